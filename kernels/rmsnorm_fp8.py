"""RMSNorm whose output leaves the kernel in FP8, with one float32 scale per row.

    y = round_to_out_dtype(w ⊙ round_to_input_dtype(x · rstd)),    (q, scale) = quantize_rows(y)

A frozen base projection run in FP8 (``kernels.fp8.fp8_matmul``) needs its input quantised by rows.
That input is the output of the RMSNorm before it (q/k/v after the attention norm, gate/up after the
MLP norm). Quantising it in a second kernel reads the whole activation again and writes it again;
here the kernel that computes it quantises it before its only store. One program holds a block of
whole rows in registers and makes two passes over them, not over memory: the first sums the
squares (the norm's rstd), the second takes each row's amax of the rounded output (the scale), and
the codes follow from the same registers. The kernel reads x and the weight once and writes one
byte per value plus four per row: half what the bf16 output alone would cost.

Code for code, ``rms_norm_fp8(x, w, eps)`` is ``quantize_rows(rms_norm(x, w, eps))``: the norm is
``kernels.rmsnorm``'s forward (the same tile, so the same float32 sum of squares; the normalised
value rounded to x's dtype before the weight's product, as Hugging Face's ``LlamaRMSNorm`` does;
the product rounded to the output dtype), and the quantisation is ``kernels.fp8``'s (the same
``div_rn`` scale and division, the same clamp, ``fp8_bits``' rounding). In Triton's interpreter
that holds bit for bit. On a GPU the compiler schedules each kernel's float32 arithmetic on its own
(how it contracts multiplies and adds), so a value that sits on a rounding boundary can land one
FP8 step apart in the two: ``code_disagreements`` counts them, and the tests and the benchmark allow
at most one code in a million, each one step off (assets/notes/fp8.md has the count measured).

It has no autograd: the FP8 path serves a frozen base's forward. The backward of a LoRA step needs
the norm's bf16 output, which this function does not return. Chapter 18 builds it; what it saves is
in assets/notes/fp8.md, "Fused into RMSNorm".
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import ops, runtime
from .fp8 import FP8_DTYPES, SCALE_FLOOR, fp8_bits, fp8_format, quantize_rows_reference, triton_problem
from .rmsnorm import ForwardConfig, as_rows, cached_forward_config, check_tensors, out_dtype, rms_norm
from .triton_utils import cast_to, row_tile

# The widest row one program keeps in registers: Llama's largest hidden sizes (8,192 for 70B,
# 16,384 for 405B) fit. Beyond it the row would spill out of the registers.
MAX_HIDDEN = 16384

TRITON_OUT = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


# --------------------------------------------------------------------------------------------------
# The kernel
# --------------------------------------------------------------------------------------------------


@triton.jit
def rms_norm_fp8_kernel(
    X, W, Q, S,
    n_rows, n_cols, stride_x, eps,
    OUT: tl.constexpr, FP8_MAX_VALUE: tl.constexpr, FLOOR: tl.constexpr, FP8: tl.constexpr,
    MBITS: tl.constexpr, EMIN: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """RMSNorm of ROWS rows, quantised to FP8 by rows before the only store (chapter 18).

    Args:
        X, W: pointers to x [n_rows, n_cols] (any row stride, unit stride along a row) and the
            weight [n_cols].
        Q, S: pointers to the codes [n_rows, n_cols] (uint8, the FP8 tensor's bytes, contiguous)
            and the float32 scales [n_rows].
        n_rows, n_cols: the rows and their width; stride_x: x's row stride; eps: as RMSNorm's.
        OUT: the norm's output dtype, which the quantiser reads its input in.
        FP8_MAX_VALUE, FLOOR, FP8, MBITS, EMIN: the format and the smallest scale (``fp8_bits``).
        ROWS, BLOCK_N: the tile, rows by ``n_cols`` rounded up to a power of two.
    """
    rows, cols, row_ok, col_ok, ok = row_tile(n_rows, n_cols, ROWS, BLOCK_N)

    # The norm, operation for operation as kernels.rmsnorm's forward computes it, so that the
    # rounded output is the same bits. (That kernel keeps its lines in place rather than in a shared
    # helper: chapter 02 prints it as the exercise's answer.)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    x_hat = cast_to(x * rstd[:, None], X.dtype.element_ty).to(tl.float32)
    y = cast_to(x_hat * w[None, :], OUT).to(tl.float32)

    # The quantiser, as kernels.fp8's: masked lanes hold 0 and leave amax alone; a NaN counts as
    # infinity, so that a row holding one gets a NaN scale.
    amax = tl.max(tl.where(y == y, tl.abs(y), float("inf")), axis=1)
    scale = tl.maximum(tl.math.div_rn(amax, FP8_MAX_VALUE), FLOOR)
    scale = tl.where(amax == 0.0, 1.0, scale)
    scale = tl.where(amax == float("inf"), float("nan"), scale)
    q = tl.math.div_rn(y, scale[:, None])
    # Comparisons rather than min/max, which on a GPU would return the other operand of a NaN.
    q = tl.where(q > FP8_MAX_VALUE, FP8_MAX_VALUE, q)
    q = tl.where(q < -FP8_MAX_VALUE, -FP8_MAX_VALUE, q)
    tl.store(Q + rows[:, None] * n_cols + cols[None, :], fp8_bits(q, FP8, MBITS, EMIN), mask=ok)
    tl.store(S + rows, scale, mask=row_ok)


def code_disagreements(q: torch.Tensor, q_ref: torch.Tensor) -> tuple[int, int]:
    """How many FP8 codes of ``q`` differ from ``q_ref``'s, and by how many steps at most.

    Args:
        q, q_ref: FP8 tensors of one shape and dtype.

    Returns:
        ``(count, steps)``: the codes that differ, and the largest distance between two of them in
        steps of the format (codes of opposite signs count as far apart: 256).
    """
    a, b = q.view(torch.uint8).to(torch.int32), q_ref.view(torch.uint8).to(torch.int32)
    differ = a != b
    if not bool(differ.any()):
        return 0, 0
    same_sign = (a >> 7) == (b >> 7)
    steps = torch.where(same_sign, ((a & 0x7F) - (b & 0x7F)).abs(), torch.full_like(a, 256))
    return int(differ.sum()), int(steps[differ].max())


def scales_agree(scale: torch.Tensor, scale_ref: torch.Tensor, interpreter: bool) -> bool:
    """Whether the fused kernel's row scales are the two kernels': equal (NaN where NaN) in the
    interpreter; on a GPU within 2⁻²² of each other (a few float32 rounding steps: the two kernels'
    sums of squares may round apart, the module docstring says why).

    Args:
        scale, scale_ref: float32 [rows].
        interpreter: whether the kernels ran in Triton's interpreter.

    Returns:
        True where they agree.
    """
    if not torch.equal(scale.isnan(), scale_ref.isnan()):
        return False
    a, b = scale[~scale.isnan()], scale_ref[~scale_ref.isnan()]
    if interpreter:
        return torch.equal(a, b)
    return bool(((a - b).abs() <= 2.0**-22 * b.abs()).all())


def disagreement_allowed(count: int, steps: int, numel: int, interpreter: bool) -> bool:
    """Whether a fused result's codes are close enough to the two kernels' (the module docstring):
    equal in the interpreter; on a GPU at most one code in a million (one for a smaller tensor),
    each one step off.

    Args:
        count, steps: ``code_disagreements``' answer.
        numel: the codes compared.
        interpreter: whether the kernels ran in Triton's interpreter.

    Returns:
        True where the difference is allowed.
    """
    if interpreter:
        return count == 0
    return count <= max(1, numel // 1_000_000) and steps <= 1


# --------------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------------


def rms_norm_fp8_config(n_rows: int, n_cols: int, props: runtime.DeviceProps | None = None) -> ForwardConfig:
    """Launch configuration of the fused kernel: ``kernels.rmsnorm``'s forward tile, unchanged.

    The tile fixes the order in which a row's squares are summed (each thread's share, then across
    threads and warps). The same tile, rows and warps as ``rms_norm``'s forward give the same
    float32 sum, so the same rstd and the same rounded output: what makes the fused result equal
    to the two kernels' bit for bit. The tile holds whole rows (chapter 02 sizes it).

    Args:
        n_rows, n_cols: the rows of x and their width.
        props: the device's properties; None reads the current device's.

    Returns:
        The ``ForwardConfig``: grid, rows per program, tile width and warps.
    """
    return cached_forward_config(n_rows, n_cols, props or runtime.device_props())


# --------------------------------------------------------------------------------------------------
# Host side: checks, launch, operator
# --------------------------------------------------------------------------------------------------


def check_inputs(x, weight, eps, fp8_dtype) -> None:
    """The checks of ``rms_norm_fp8``, before anything runs.

    Args:
        x, weight, eps, fp8_dtype: as ``rms_norm_fp8`` takes them.

    Raises:
        TypeError, ValueError: as ``rms_norm_fp8`` documents them.
    """
    check_tensors(x, weight)
    if fp8_dtype not in FP8_DTYPES:
        raise TypeError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a number, got {type(eps).__name__}")
    if x.shape[-1] > MAX_HIDDEN:
        raise ValueError(f"the hidden size {x.shape[-1]} is above {MAX_HIDDEN}, the widest row the fused kernel "
                         "keeps in registers: use kernels.fp8.quantize_rows(rms_norm(x, weight, eps)) instead")
    if not runtime.INTERPRET and x.device.type not in ("cuda", "meta"):
        raise ValueError(f"in gpu mode the inputs must be CUDA tensors, got a tensor on {x.device}")


def rms_norm_fp8_forward(x: torch.Tensor, weight: torch.Tensor, eps: float,
                         fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the fused kernel: the implementation of ``torch.ops.kernels.rms_norm_fp8``.

    On a GPU without FP8 conversions (below sm_89) it runs ``rms_norm`` and then
    ``quantize_rows_reference``, which store the same bits. Inputs are not checked here
    (``rms_norm_fp8`` does).

    Args:
        x, weight, eps, fp8_dtype: as ``rms_norm_fp8`` takes them.

    Returns:
        ``(q, scale)`` as ``rms_norm_fp8`` returns them.
    """
    weight = weight.contiguous()  # read with unit stride, as kernels.rmsnorm reads it
    x_rows = as_rows(x)
    n_rows, n_cols = x_rows.shape
    q = torch.empty((n_rows, n_cols), dtype=fp8_dtype, device=x.device)
    scale = torch.ones(n_rows, dtype=torch.float32, device=x.device)  # rows of no columns: scale 1
    if n_rows == 0 or n_cols == 0:
        return q, scale
    if triton_problem(x.device) is not None:
        return quantize_rows_reference(as_rows(rms_norm(x_rows, weight, eps)), fp8_dtype)
    cfg = rms_norm_fp8_config(n_rows, n_cols, runtime.device_props(x.device))
    rms_norm_fp8_kernel[cfg.grid](
        x_rows, weight, q.view(torch.uint8), scale, n_rows, n_cols, x_rows.stride(0), eps,
        OUT=TRITON_OUT[out_dtype(x.dtype, weight.dtype)], FLOOR=SCALE_FLOOR, **fp8_format(fp8_dtype),
        ROWS=cfg.rows, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
    )
    return q, scale


def rms_norm_fp8_fake(x, weight, eps, fp8_dtype):
    """The fake implementation of ``rms_norm_fp8``: the shapes and dtypes, for ``torch.compile``.

    Args:
        x, weight, eps, fp8_dtype: as ``rms_norm_fp8`` takes them.

    Returns:
        ``(q, scale)`` as empty tensors.
    """
    n_rows = math.prod(x.shape[:-1])  # explicit: with no columns, numel() // 0 would not say
    return x.new_empty((n_rows, x.shape[-1]), dtype=fp8_dtype), x.new_empty((n_rows,), dtype=torch.float32)


rms_norm_fp8_op = ops.define(
    "rms_norm_fp8(Tensor x, Tensor weight, float eps, ScalarType fp8_dtype) -> (Tensor, Tensor)",
    rms_norm_fp8_forward, rms_norm_fp8_fake,
)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                 fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's RMSNorm of ``x``, quantised to FP8 by rows in the same kernel (chapter 18).

    The result is ``kernels.fp8.quantize_rows(rms_norm(x, weight, eps).reshape(-1, hidden))`` bit
    for bit, codes and scales, without the norm's output ever being written: the input of
    ``fp8_matmul`` for a frozen projection that follows the norm. No autograd: the FP8 path is a
    frozen base's forward, and the backward of a LoRA step needs the norm's bf16 output, which is
    not returned here. Rows holding an infinity or NaN get scale NaN and NaN codes, as
    ``quantize_rows`` gives them.

    Args:
        x: the input, ``[..., hidden]``, float32, bfloat16 or float16, any leading dimensions (they
            are flattened), rows of any stride; ``hidden`` at most ``MAX_HIDDEN``.
        weight: the norm's weight, ``(hidden,)``, float32, bfloat16 or float16; the norm's output
            dtype (what is quantised) is that of ``weight * x`` in PyTorch.
        eps: added to the mean of squares.
        fp8_dtype: ``torch.float8_e4m3fn`` (default) or ``torch.float8_e5m2``.

    Returns:
        ``(q, scale)``: q a new contiguous ``[rows, hidden]`` tensor of ``fp8_dtype`` (rows the
        product of x's leading dimensions), scale float32 ``[rows]``, so that the norm's output is
        about ``q · scale[:, None]``. No rows give empty tensors; rows of no columns scale 1.

    Raises:
        TypeError: x or weight not a tensor or not of a dtype above; ``fp8_dtype`` not an FP8
            format; eps not a number.
        ValueError: x a scalar, weight not ``(hidden,)``, the two on different devices, ``hidden``
            above ``MAX_HIDDEN``, or CPU tensors outside Triton's interpreter.
    """
    check_inputs(x, weight, eps, fp8_dtype)
    return ops.call(rms_norm_fp8_op, x, weight, float(eps), fp8_dtype)
