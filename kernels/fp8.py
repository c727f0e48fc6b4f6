"""FP8 building blocks: a per-row quantiser and a scaled FP8 GEMM with a dequantising epilogue.

**Why scaling.** An 8-bit float keeps very few values: ``float8_e4m3fn`` (4 exponent bits, 3
mantissa bits) spans ±448 with a relative step of 2⁻³ near each power of two, and nothing below
2⁻⁹. A bf16 activation or weight stored in it as is would lose every value under about 0.001 and
saturate everything above 448. So each group of values is stored divided by a float32 *scale*:
``x ≈ q · scale`` with ``scale = amax(|group|) / 448``, so that the largest value of the group lands
on the largest FP8 value and the group uses the format's whole range.

**Why per row.** One scale per tensor lets a single outlier row (a token with a huge activation, a
weight row of large norm) push every other row down into the format's coarse, subnormal bottom. One
scale per row of the activation (per token) and per row of the weight (per output channel, the row
of ``nn.Linear``'s [out, in] weight) costs M + N float32 values and fits the GEMM exactly: both
scales are constant along the reduced dimension K, so they factor out of the sum:

    out[m, n] = Σ_k (qa[m,k] · sa[m]) · (qb[n,k] · sb[n]) = sa[m] · sb[n] · Σ_k qa[m,k] · qb[n,k].

**The dequantising epilogue.** The sum on the right is what FP8 tensor cores compute (FP8 inputs, a
float32 accumulator); the two scales multiply the finished float32 tile once, in the GEMM's epilogue,
before its one store in bf16 (or fp16, fp32). Dequantising costs M·N multiplications, not M·N·K.

**e4m3 or e5m2.** ``float8_e4m3fn`` (max 448, 3 mantissa bits, no infinities) has the precision,
and is what forward passes store; ``float8_e5m2`` (max 57,344, 2 mantissa bits, with infinities)
has the range, and is what gradients often use. Both work here: the scale uses the chosen format's
largest value.

**Rounding.** ``q = round_to_nearest_even(x / scale)``, clamped to ±FP8_MAX first (``x / scale`` can
exceed FP8_MAX by a rounding step, and e4m3fn has no infinity: a value above 464 would become NaN).
The division is IEEE-exact in the kernel (``div_rn``), so the kernel and ``quantize_rows_reference``
store the same bits. On a GPU the kernel converts with the hardware's instruction (sm_89 and up); Triton's
interpreter converts float32 to FP8 wrongly (it drops the carry of a rounding), so there the value is
rounded onto the FP8 grid by hand first, which the conversion then keeps exactly.

**Edge values.** A row of zeros gets scale 1 (and q zeros), never a division by zero. A row whose
largest magnitude is so small that amax / FP8_MAX underflows gets the smallest normal float32 as its
scale. A row holding an infinity or a NaN comes out as NaN: its scale is NaN and every q of it is
NaN, so a GEMM over it gives NaN in that row, as a matmul of the unquantised row would give NaN or
infinity, never a silently finite number. Checking for it on the host would cost a synchronisation.

**Backends of the GEMM.** ``fp8_matmul`` runs the Triton kernel of this file, or cuBLAS through
``torch._scaled_mm`` (row-wise scaling: cuBLAS on Hopper with CUDA 12.9 and up, a CUTLASS kernel
with bf16 output on sm_89, older CUDA and Blackwell), or the dequantised float32 reference where
neither can run (a GPU older than sm_89, which has no FP8 tensor cores; CPU tensors outside the
interpreter). Triton's interpreter runs ``tl.dot`` on FP8 tiles, exactly (each product of two FP8
values is exact in float32). ``choose_backend`` makes the "auto" choice; ``kernels.bench.fp8_gemm``
measures it (assets/notes/fp8.md). Chapter 18 builds both kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import ops, runtime
from .triton_utils import cast_to, grouped_tile

# The largest finite value of each format, its stored mantissa bits, its smallest normal exponent
# and its Triton type.
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}
_MIN_EXPONENT = {torch.float8_e4m3fn: -6, torch.float8_e5m2: -14}
_TRITON_FP8 = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}


def fp8_format(fp8_dtype: torch.dtype) -> dict:
    """What a kernel that writes FP8 codes through ``fp8_bits`` needs to know of the format.

    Args:
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.

    Returns:
        the kernel's keyword arguments ``FP8_MAX_VALUE`` (448 or 57,344), ``FP8`` (the Triton
        type), ``MBITS`` (stored mantissa bits, 3 or 2) and ``EMIN`` (smallest normal exponent, -6
        or -14).
    """
    return dict(FP8_MAX_VALUE=FP8_MAX[fp8_dtype], FP8=_TRITON_FP8[fp8_dtype], MBITS=_MANTISSA_BITS[fp8_dtype],
                EMIN=_MIN_EXPONENT[fp8_dtype])
FP8_DTYPES = tuple(FP8_MAX)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BACKENDS = ("auto", "triton", "cublas", "reference")
# A scale never smaller than this: amax / FP8_MAX of a row of float32 subnormals would underflow to 0.
SCALE_FLOOR = torch.finfo(torch.float32).tiny
# The compute capability from which GPUs have FP8 tensor cores (Ada sm_89, Hopper sm_90, Blackwell).
FP8_CAPABILITY = (8, 9)


# --------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------

if runtime.INTERPRET:

    @triton.jit
    def fp8_bits(y, FP8: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr):
        """The FP8 bit patterns (uint8) of float32 ``y``, rounded to nearest-even; |y| ≤ FP8_MAX or NaN.

        Args:
            y: float32 values, clamped to ±FP8_MAX (NaN allowed).
            FP8: the Triton FP8 type; MBITS: its mantissa bits; EMIN: its smallest normal exponent.

        Returns:
            uint8 codes, the bits a GPU's conversion stores.
        """
        # The interpreter's float32 → FP8 conversion truncates and drops the carry into the
        # exponent; it converts a value already on the FP8 grid exactly. So round onto the grid
        # here: adding c = 2^(e + 23 − MBITS) leaves float32 exactly the FP8 step at exponent e,
        # and float32 addition rounds to nearest-even.
        bits = y.to(tl.uint32, bitcast=True)
        e = tl.maximum(((bits >> 23) & 0xFF).to(tl.int32) - 127, EMIN)
        c = ((e + (127 + 23 - MBITS)).to(tl.uint32) << 23).to(tl.float32, bitcast=True)
        r = (tl.abs(y) + c) - c
        r = tl.where((bits >> 31) != 0, -r, r)  # the sign bit, so that −0 stays −0
        q = r.to(FP8).to(tl.uint8, bitcast=True)
        return tl.where(y != y, 0x7F, q)  # NaN, which the interpreter's conversion loses

else:

    @triton.jit
    def fp8_bits(y, FP8: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr):
        """The FP8 bit patterns (uint8) of float32 ``y``, rounded to nearest-even by the hardware.

        Args:
            y: float32 values, clamped to ±FP8_MAX (NaN allowed).
            FP8: the Triton FP8 type; MBITS, EMIN: unused here (the interpreter's version needs them).

        Returns:
            uint8 codes.
        """
        return y.to(FP8).to(tl.uint8, bitcast=True)


@triton.jit
def _column_scaled(x, CS, cols_here, cols, HAS_CS: tl.constexpr):
    # x · cs[col] in float32: the scale of a weight's output channel moved onto the gradient that
    # reduces over those channels (kernels.lora_fp8).
    if HAS_CS:
        x = x * tl.load(CS + cols_here, mask=cols_here < cols, other=0.0)[None, :]
    return x


@triton.jit
def quantize_rows_kernel(
    X, CS, Q, S, rows, cols, stride_xr, stride_xc, stride_qr,
    FP8_MAX_VALUE: tl.constexpr, FLOOR: tl.constexpr, FP8: tl.constexpr, MBITS: tl.constexpr,
    EMIN: tl.constexpr, HAS_CS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Quantise BLOCK_R rows of ``X`` (times ``CS`` column by column where ``HAS_CS``): their amax,
    their scales, then their FP8 codes.

    Args:
        X: pointer to ``x`` [rows, cols] (any strides, loaded and upcast to float32).
        CS: pointer to float32 column scales [cols] (contiguous), read only where ``HAS_CS``.
        Q: pointer to the codes [rows, cols], uint8 (the FP8 tensor's bytes), row stride ``stride_qr``.
        S: pointer to the float32 scales [rows].
        rows, cols: the sizes; stride_*: strides in elements.
        FP8_MAX_VALUE: the format's largest value; FLOOR: the smallest scale.
        FP8, MBITS, EMIN: the format (see ``fp8_bits``).
        BLOCK_R, BLOCK_C: rows per program, columns per step of the two loops.
    """
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_rows = r < rows
    c = tl.arange(0, BLOCK_C)
    # Pass 1: the largest magnitude of each row. A NaN counts as infinity: max() would drop it, and
    # a row holding one must not get a finite scale.
    amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for c0 in range(0, cols, BLOCK_C):
        mask = in_rows[:, None] & ((c0 + c) < cols)[None, :]
        x = tl.load(X + r[:, None] * stride_xr + (c0 + c)[None, :] * stride_xc, mask=mask, other=0.0)
        x = _column_scaled(x.to(tl.float32), CS, c0 + c, cols, HAS_CS)
        amax = tl.maximum(amax, tl.max(tl.where(x == x, tl.abs(x), float("inf")), axis=1))
    scale = tl.maximum(tl.math.div_rn(amax, FP8_MAX_VALUE), FLOOR)
    scale = tl.where(amax == 0.0, 1.0, scale)
    scale = tl.where(amax == float("inf"), float("nan"), scale)
    tl.store(S + r, scale, mask=in_rows)
    # Pass 2: the codes. The row is read a second time (from the L2 cache when it fits there).
    for c0 in range(0, cols, BLOCK_C):
        mask = in_rows[:, None] & ((c0 + c) < cols)[None, :]
        x = tl.load(X + r[:, None] * stride_xr + (c0 + c)[None, :] * stride_xc, mask=mask, other=0.0)
        x = _column_scaled(x.to(tl.float32), CS, c0 + c, cols, HAS_CS)
        y = tl.math.div_rn(x, scale[:, None])
        # Clamp with comparisons, which keep a NaN (min/max on a GPU return the other operand).
        y = tl.where(y > FP8_MAX_VALUE, FP8_MAX_VALUE, y)
        y = tl.where(y < -FP8_MAX_VALUE, -FP8_MAX_VALUE, y)
        tl.store(Q + r[:, None] * stride_qr + (c0 + c)[None, :], fp8_bits(y, FP8, MBITS, EMIN), mask=mask)


@triton.jit
def fp8_matmul_kernel(
    A, B, SA, SB, C, M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_sa, stride_sb, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    FAST_ACCUM: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of ``C = SA[:, None] · SB[None, :] · (A @ Bᵀ)``.

    Args:
        A, B: pointers to the FP8 ``a`` [M, K] and ``b`` [N, K] (nn.Linear's weight layout).
        SA, SB: pointers to the float32 scales, [M] and [N].
        C: pointer to the output [M, N].
        M, N, K: the sizes; stride_*: strides in elements.
        BLOCK_M, BLOCK_N, BLOCK_K: tile sizes; GROUP_M: row-tiles per group of the tile order.
        FAST_ACCUM: let the tensor cores carry the sum across K-tiles (see ``Fp8GemmConfig``).
    """
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ka = k0 + rk
        a = tl.load(A + rm[:, None] * stride_am + ka[None, :] * stride_ak,
                    mask=(rm[:, None] < M) & (ka[None, :] < K), other=0.0)
        # b's tile read as [BLOCK_K, BLOCK_N]: K runs along b's rows, the layout FP8 tensor cores
        # want for their second operand.
        b = tl.load(B + rn[None, :] * stride_bn + ka[:, None] * stride_bk,
                    mask=(ka[:, None] < K) & (rn[None, :] < N), other=0.0)
        # FP8 × FP8 on the tensor cores. Hopper's accumulate FP8 products with fewer bits than
        # float32: unless FAST_ACCUM, each K-tile's dot starts from zero there and is added to acc
        # in float32 (what cuBLAS does unless asked for fast accumulation).
        if FAST_ACCUM:
            acc = tl.dot(a, b, acc)
        else:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
    # The epilogue: the two scales applied once to the finished float32 tile.
    sa = tl.load(SA + rm * stride_sa, mask=rm < M, other=0.0)
    sb = tl.load(SB + rn * stride_sb, mask=rn < N, other=0.0)
    acc = acc * sa[:, None] * sb[None, :]
    tl.store(C + rm[:, None] * stride_cm + rn[None, :] * stride_cn, cast_to(acc, C.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


# --------------------------------------------------------------------------------------------------
# Launch configurations
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantizeConfig:
    """A launch configuration of ``quantize_rows_kernel``: rows per program, columns per step, warps."""

    block_r: int
    block_c: int
    num_warps: int


@dataclass(frozen=True)
class Fp8GemmConfig:
    """A launch configuration of ``fp8_matmul_kernel``: tile sizes, ``GROUP_M``, warps, stages, and
    ``fast_accum``: sum across K-tiles in the tensor cores' narrower accumulator (faster on Hopper,
    less precise; like ``torch._scaled_mm(use_fast_accum=True)``) instead of in float32."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    fast_accum: bool = False


def quantize_config(rows: int, cols: int, props: runtime.DeviceProps | None = None) -> QuantizeConfig:
    """Tiles of the quantiser. In the interpreter, many rows per program (each program costs
    milliseconds there). On a GPU, a few rows per program and 1,024 columns per step: enough bytes
    in flight per program for a memory-bound pass, and enough programs to fill the SMs at 8,192
    tokens.

    Args:
        rows, cols: the input's sizes.
        props: the device's properties; None reads the current device's.

    Returns:
        the ``QuantizeConfig``.
    """
    props = props or runtime.device_props()
    block_c = min(1024, triton.next_power_of_2(max(cols, 16)))
    if props.interpreter:
        return QuantizeConfig(max(1, min(64, triton.next_power_of_2(max(rows, 1)))), block_c, 4)
    # Rows per program: about four programs per SM at least, and at most 8 rows.
    block_r = max(1, min(8, triton.next_power_of_2(max(1, rows // (4 * props.sm_count)))))
    return QuantizeConfig(block_r, block_c, 4 if block_r * block_c <= 4096 else 8)


def fp8_gemm_config(m: int, n: int, k: int, props: runtime.DeviceProps | None = None) -> Fp8GemmConfig:
    """Tiles of the FP8 GEMM. In the interpreter, 64 × 64 × 64. On a GPU, 128 × 256 × 128 with 8 warps
    and 3 stages where the shared memory holds them (Hopper, Blackwell), a smaller tile elsewhere:
    an FP8 element is one byte, so a K-step twice as deep as bf16's costs the same shared memory.
    ``kernels.bench.fp8_gemm`` measures the result against cuBLAS (assets/notes/fp8.md).

    Args:
        m, n, k: the GEMM's sizes (unused: one tile fits Llama's shapes).
        props: the device's properties; None reads the current device's.

    Returns:
        the ``Fp8GemmConfig``.
    """
    props = props or runtime.device_props()
    if props.interpreter:
        return Fp8GemmConfig(64, 64, 64, 8, 4, 1)
    if props.shared_mem_per_block >= 3 * (128 + 256) * 128:  # three stages of A's and B's tiles
        return Fp8GemmConfig(128, 256, 128, 8, 8, 3)
    return Fp8GemmConfig(64, 128, 64, 8, 4, 3)


# --------------------------------------------------------------------------------------------------
# Quantisation: checks, reference, launch
# --------------------------------------------------------------------------------------------------


def _check_fp8_dtype(name: str, dtype) -> None:
    if dtype not in FP8_DTYPES:
        raise TypeError(f"{name} must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")


def _check_quantize_input(x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a tensor, got {type(x).__name__}")
    if x.dtype not in ops.KERNEL_DTYPES:
        raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [rows, cols], got shape {tuple(x.shape)} (flatten the leading "
                         "dimensions first: x.reshape(-1, x.shape[-1]))")


def row_scales_reference(x: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """The per-row float32 scales of ``quantize_rows``, in PyTorch.

    Args:
        x: [rows, cols], float32, bfloat16 or float16.
        fp8_dtype: the target format.

    Returns:
        float32 [rows]: amax(|row|) / FP8_MAX, at least ``SCALE_FLOOR``; 1 for a row of zeros (or
        no columns); NaN for a row holding an infinity or NaN.
    """
    xf = x.float()
    if x.shape[1] == 0:
        return torch.ones(x.shape[0], dtype=torch.float32, device=x.device)
    amax = torch.where(xf.isnan(), torch.inf, xf.abs()).amax(dim=1)
    # A tensor divisor, not a Python number: PyTorch on a GPU divides by a number as a product with
    # its reciprocal, which can differ from the division (the kernel's div_rn) in the last bit.
    scale = (amax / torch.full_like(amax, FP8_MAX[fp8_dtype])).clamp_min(SCALE_FLOOR)
    scale = torch.where(amax == 0, 1.0, scale)
    return torch.where(amax == torch.inf, torch.nan, scale)


def quantize_rows_reference(x: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                            scale: torch.Tensor | None = None, col_scale: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows`` in PyTorch: the same scales and the same FP8 bits.

    Args:
        x: [rows, cols], float32, bfloat16 or float16, any strides.
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        scale: float32 [rows] to use instead of ``row_scales_reference``'s.
        col_scale: float32 [cols] multiplying x's columns (in float32) before anything else, or None.

    Returns:
        ``(q, scale)``: q contiguous [rows, cols] in ``fp8_dtype``, scale float32 [rows].

    Raises:
        TypeError, ValueError: as ``quantize_rows``.
    """
    _check_quantize_input(x)
    _check_fp8_dtype("fp8_dtype", fp8_dtype)
    _check_col_scale(x, col_scale)
    if col_scale is not None:
        x = x.float() * col_scale[None, :]
    if scale is None:
        scale = row_scales_reference(x, fp8_dtype)
    limit = FP8_MAX[fp8_dtype]
    y = x.float() / scale[:, None]
    # where() rather than clamp(): the same NaN-keeping comparisons as the kernel
    y = torch.where(y > limit, limit, torch.where(y < -limit, -limit, y))
    return y.to(fp8_dtype).contiguous(), scale


def _check_col_scale(x: torch.Tensor, col_scale) -> None:
    if col_scale is None:
        return
    if not isinstance(col_scale, torch.Tensor) or col_scale.dtype != torch.float32:
        raise TypeError(f"col_scale must be a float32 tensor, got {getattr(col_scale, 'dtype', type(col_scale))}")
    if col_scale.shape != (x.shape[1],):
        raise ValueError(f"col_scale must have shape ({x.shape[1]},), one per column of x, got "
                         f"{tuple(col_scale.shape)}")
    if col_scale.device != x.device:
        raise ValueError(f"col_scale must be on x's device {x.device}, got {col_scale.device}")


def _quantize_launch(x: torch.Tensor, fp8_dtype: torch.dtype, col_scale: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=fp8_dtype, device=x.device)
    scale = torch.ones(rows, dtype=torch.float32, device=x.device)
    if rows == 0 or cols == 0:
        return q, scale
    if not _triton_can_run(x.device):
        # no FP8 conversion in Triton below sm_89 (and no Triton on CPU tensors outside the
        # interpreter): PyTorch's, with the same bits
        return quantize_rows_reference(x, fp8_dtype, col_scale=col_scale)
    cfg = quantize_config(rows, cols, runtime.device_props(x.device))
    grid = (triton.cdiv(rows, cfg.block_r),)
    cs = scale if col_scale is None else col_scale.contiguous()  # any float32 pointer when unused
    quantize_rows_kernel[grid](
        x, cs, q.view(torch.uint8), scale, rows, cols, x.stride(0), x.stride(1), q.stride(0),
        FLOOR=SCALE_FLOOR, **fp8_format(fp8_dtype), HAS_CS=col_scale is not None,
        BLOCK_R=cfg.block_r, BLOCK_C=cfg.block_c, num_warps=cfg.num_warps,
    )
    return q, scale



def quantize_rows(x: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                  col_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise each row of ``x`` to FP8 with its own float32 scale (chapter 18).

    ``scale[r] = amax(|x[r]|) / FP8_MAX`` (448 for e4m3fn, 57,344 for e5m2) and ``q[r] =
    round_to_nearest_even(x[r] / scale[r])`` clamped to ±FP8_MAX, so ``x ≈ q · scale[:, None]``. A
    row of zeros gets scale 1; a row holding an infinity or NaN gets scale NaN and NaN codes (the
    module's docstring says why). The Triton kernel stores the bits of ``quantize_rows_reference``;
    on a GPU below sm_89, and on CPU tensors outside the interpreter, that reference runs instead.
    With ``col_scale``, the rows of ``x · col_scale[None, :]`` (computed in float32 as they are
    read) are quantised: how a weight's per-output-channel scale joins the gradient that reduces
    over those channels (``kernels.lora_fp8``).

    Args:
        x: [rows, cols], float32, bfloat16 or float16, any strides (a view is read in place).
        fp8_dtype: ``torch.float8_e4m3fn`` (default) or ``torch.float8_e5m2``.
        col_scale: float32 [cols] on x's device, or None.

    Returns:
        ``(q, scale)``: q a new contiguous [rows, cols] tensor of ``fp8_dtype``, scale float32 [rows].

    Raises:
        TypeError: ``x`` not a tensor or of another dtype; ``fp8_dtype`` not an FP8 format.
        ValueError: ``x`` not 2-D, ``col_scale`` of another shape or device (TypeError: not float32).
    """
    _check_quantize_input(x)
    _check_fp8_dtype("fp8_dtype", fp8_dtype)
    _check_col_scale(x, col_scale)
    return ops.call(quantize_rows_op, x, fp8_dtype, col_scale)


# --------------------------------------------------------------------------------------------------
# The GEMM: checks, reference, backends
# --------------------------------------------------------------------------------------------------


def triton_problem(device: torch.device) -> str | None:
    """Why this file's Triton kernels cannot run on ``device``, or None where they can.

    Triton runs CPU tensors only in its interpreter, and FP8 conversions and dots only on GPUs of
    sm_89 and up.

    Args:
        device: the tensors' device.

    Returns:
        a sentence, or None.
    """
    if device.type != "cuda":
        return None if runtime.INTERPRET else f"Triton runs {device} tensors only in its interpreter"
    if runtime.INTERPRET:
        return "Triton's interpreter runs CPU tensors, not CUDA ones"
    capability = runtime.device_props(device).capability
    if capability < FP8_CAPABILITY:
        return f"compute capability {capability} has no FP8 tensor cores (sm_89 and up have)"
    return None


def _triton_can_run(device: torch.device) -> bool:
    return triton_problem(device) is None


def _check_matmul_inputs(a, a_scale, b, b_scale, out_dtype, backend) -> None:
    for name, t in (("a", a), ("a_scale", a_scale), ("b", b), ("b_scale", b_scale)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    for name, t in (("a", a), ("b", b)):
        _check_fp8_dtype(f"{name}'s dtype", t.dtype)
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must have one FP8 dtype, got {a.dtype} and {b.dtype}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"a is [M, K] and b [N, K] (nn.Linear's weight layout): their K differ, "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    for name, t, n, of in (("a_scale", a_scale, a.shape[0], "a's rows"), ("b_scale", b_scale, b.shape[0],
                                                                             "b's rows")):
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {t.dtype}")
        if t.shape != (n,):
            raise ValueError(f"{name} must have shape ({n},) (one scale per row of {of}), got {tuple(t.shape)}")
    for name, t in (("a_scale", a_scale), ("b", b), ("b_scale", b_scale)):
        if t.device != a.device:
            raise ValueError(f"{name} must be on a's device {a.device}, got {t.device}")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.bfloat16, torch.float16 or torch.float32, got {out_dtype}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def fp8_matmul_reference(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                         out_dtype: torch.dtype = torch.bfloat16,
                         compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(a · a_scale[:, None]) @ (b · b_scale[:, None])ᵀ``: both operands dequantised, then one
    torch matmul in ``compute_dtype`` (the fallback backend in float32; the tests' reference in
    float64, where it is exact up to the sum's rounding).

    Args:
        a: FP8 [M, K]; a_scale: float32 [M].
        b: FP8 [N, K]; b_scale: float32 [N].
        out_dtype: the result's dtype.
        compute_dtype: the dtype the operands are dequantised to and multiplied in.

    Returns:
        [M, N] in ``out_dtype``.
    """
    a_deq = a.to(compute_dtype) * a_scale.to(compute_dtype)[:, None]
    b_deq = b.to(compute_dtype) * b_scale.to(compute_dtype)[:, None]
    return (a_deq @ b_deq.t()).to(out_dtype)


def cublas_problem(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> str | None:
    """Why ``torch._scaled_mm`` with row-wise scales cannot run this product, or None where it can.

    Its contract (PyTorch's ``_scaled_mm`` checks): CUDA tensors of a GPU with FP8 tensor cores
    (sm_89 and up); K and N multiples of 16; a row-major and b column-major (``b.t()`` of a
    row-major [N, K] weight is); float32 scales [M, 1] and [1, N]. cuBLAS does row-wise scaling
    only on sm_90 with CUDA 12.9 and up; elsewhere a CUTLASS kernel does, with bf16 output only.
    Pairs of e5m2 are left to Triton too (cuBLAS has no e5m2 × e5m2 GEMM).

    Args:
        a: FP8 [M, K]; b: FP8 [N, K].
        out_dtype: the output's dtype.

    Returns:
        a sentence, or None.
    """
    if a.device.type != "cuda":
        return f"the tensors are on {a.device}, not a CUDA GPU"
    capability = runtime.device_props(a.device).capability
    if capability < FP8_CAPABILITY:
        return f"compute capability {capability} has no FP8 tensor cores (sm_89 and up have)"
    if a.shape[1] % 16 or b.shape[0] % 16:
        return f"K = {a.shape[1]} and N = {b.shape[0]} must be multiples of 16"
    if a.dtype == b.dtype == torch.float8_e5m2:
        return "cuBLAS has no e5m2 × e5m2 GEMM"
    cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    if out_dtype != torch.bfloat16 and not (capability[0] == 9 and cuda >= (12, 9)):
        return f"row-wise scaling with {out_dtype} output needs cuBLAS on sm_90 with CUDA 12.9+"
    return None


def choose_backend(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> str:
    """The backend ``backend="auto"`` runs: cuBLAS where it can run the product, else Triton where
    it can, else the float32 reference. cuBLAS first because it measured faster than ours at every
    8B shape on Hopper (``kernels.bench.fp8_gemm``; assets/notes/fp8.md, "Measured"): this is the
    one place to change when a measurement says otherwise.

    Args:
        a: FP8 [M, K]; b: FP8 [N, K].
        out_dtype: the output's dtype.

    Returns:
        ``"cublas"``, ``"triton"`` or ``"reference"``.
    """
    if cublas_problem(a, b, out_dtype) is None:
        return "cublas"
    return "triton" if _triton_can_run(a.device) else "reference"


def _cublas(a, a_scale, b, b_scale, out_dtype):
    problem = cublas_problem(a, b, out_dtype) if a.device.type == "cuda" else None
    if problem is not None:
        raise ValueError(f"backend='cublas' cannot run here: {problem}")
    # _scaled_mm wants a row-major and b column-major: b.t() of a row-major [N, K] is. Anything
    # else is copied first.
    return torch._scaled_mm(a.contiguous(), b.contiguous().t(), scale_a=a_scale.contiguous()[:, None],
                            scale_b=b_scale.contiguous()[None, :], out_dtype=out_dtype)


def _triton(a, a_scale, b, b_scale, out_dtype):
    problem = triton_problem(a.device)
    if problem is not None:
        raise ValueError(f"backend='triton' cannot run here: {problem}")
    m, k = a.shape
    n = b.shape[0]
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    cfg = fp8_gemm_config(m, n, k, runtime.device_props(a.device))
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    fp8_matmul_kernel[grid](
        a, b, a_scale, b_scale, c, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        a_scale.stride(0), b_scale.stride(0), c.stride(0), c.stride(1),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        FAST_ACCUM=cfg.fast_accum, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return c


_RUN = {"cublas": _cublas, "triton": _triton, "reference": fp8_matmul_reference}


def _matmul_launch(a, a_scale, b, b_scale, out_dtype, backend):
    m, k = a.shape
    n = b.shape[0]
    if m == 0 or n == 0 or k == 0:  # torch's answer: an empty product, or zeros for an empty sum
        return torch.zeros((m, n), dtype=out_dtype, device=a.device)
    if backend == "auto":
        backend = choose_backend(a, b, out_dtype)
    return _RUN[backend](a, a_scale, b, b_scale, out_dtype)


def fp8_matmul(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
               out_dtype: torch.dtype = torch.bfloat16, backend: str = "auto") -> torch.Tensor:
    """``out[m, n] = a_scale[m] · b_scale[n] · Σ_k a[m, k] · b[n, k]``, summed in float32 (chapter 18).

    ``a`` is the quantised activation with one scale per row, ``b`` the quantised weight in
    ``nn.Linear``'s [out, in] layout with one scale per output channel (``quantize_rows`` gives
    both). Backends: ``"triton"`` (this file's kernel, scales in its epilogue), ``"cublas"``
    (``torch._scaled_mm``, row-wise scaling; on CPU tensors PyTorch's own CPU implementation of
    it), ``"reference"`` (dequantised float32 operands, one
    torch matmul) and ``"auto"`` (``choose_backend``: chosen by the benchmark's measurements).

    Args:
        a: [M, K], float8_e4m3fn or float8_e5m2, any strides.
        a_scale: float32 [M].
        b: [N, K], the same FP8 dtype as ``a``, any strides.
        b_scale: float32 [N].
        out_dtype: bfloat16 (default), float16 or float32.
        backend: ``"auto"``, ``"triton"``, ``"cublas"`` or ``"reference"``.

    Returns:
        a new [M, N] tensor of ``out_dtype`` (zeros when K is 0).

    Raises:
        TypeError: a non-tensor, a non-FP8 operand, operands of two FP8 dtypes, scales not float32,
            or another ``out_dtype``.
        ValueError: operands not 2-D, different K, scales of the wrong shape, tensors on two
            devices, an unknown backend, or a backend that cannot run here (``cublas_problem``).
    """
    _check_matmul_inputs(a, a_scale, b, b_scale, out_dtype, backend)
    return ops.call(fp8_matmul_op, a, a_scale, b, b_scale, out_dtype, backend)


# --------------------------------------------------------------------------------------------------
# The transposed codes
# --------------------------------------------------------------------------------------------------


@triton.jit
def transpose_codes_kernel(X, Y, rows, cols, BLOCK: tl.constexpr):
    """One [BLOCK, BLOCK] tile of ``Y = Xᵀ`` for one-byte codes: loaded along X's rows, stored
    along Y's (``tl.trans`` moves it through shared memory), so both sides are coalesced.

    Args:
        X: pointer to x [rows, cols] (uint8, contiguous); Y: pointer to y [cols, rows].
        rows, cols: x's sizes; BLOCK: the tile's side.
    """
    r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    c = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tile = tl.load(X + r[:, None] * cols + c[None, :], mask=(r[:, None] < rows) & (c[None, :] < cols))
    tl.store(Y + c[:, None] * rows + r[None, :], tl.trans(tile), mask=(c[:, None] < cols) & (r[None, :] < rows))


def transpose_codes(q: torch.Tensor) -> torch.Tensor:
    """``q.t().contiguous()`` for a 2-D FP8 tensor, by a Triton kernel on devices it runs on.

    cuBLAS's FP8 GEMM reads both operands along the reduced dimension, so a GEMM that reduces over
    a weight's other dimension (the input gradient) needs the codes transposed. PyTorch's copy moves
    one byte at a time through strided addresses; the kernel moves tiles.

    Args:
        q: [rows, cols] in an FP8 dtype, contiguous.

    Returns:
        a new contiguous [cols, rows] tensor of q's dtype.

    Raises:
        TypeError: q not an FP8 tensor; ValueError: not 2-D or not contiguous.
    """
    if not isinstance(q, torch.Tensor) or q.dtype not in FP8_DTYPES:
        raise TypeError(f"q must be an FP8 tensor, got {getattr(q, 'dtype', type(q).__name__)}")
    if q.dim() != 2 or not q.is_contiguous():
        raise ValueError(f"q must be 2-D and contiguous, got shape {tuple(q.shape)}, strides {q.stride()}")
    rows, cols = q.shape
    if q.numel() == 0 or not _triton_can_run(q.device):
        return q.t().contiguous()
    out = torch.empty((cols, rows), dtype=q.dtype, device=q.device)
    block = 64
    transpose_codes_kernel[(triton.cdiv(rows, block), triton.cdiv(cols, block))](
        q.view(torch.uint8), out.view(torch.uint8), rows, cols, BLOCK=block, num_warps=4)
    return out


# --------------------------------------------------------------------------------------------------
# Operators
# --------------------------------------------------------------------------------------------------


def _quantize_fake(x, fp8_dtype, col_scale=None):
    return (x.new_empty(x.shape, dtype=fp8_dtype), x.new_empty((x.shape[0],), dtype=torch.float32))


def _matmul_fake(a, a_scale, b, b_scale, out_dtype, backend):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


quantize_rows_op = ops.define(
    "quantize_rows(Tensor x, ScalarType fp8_dtype, Tensor? col_scale=None) -> (Tensor, Tensor)",
    _quantize_launch, _quantize_fake)
fp8_matmul_op = ops.define(
    "fp8_matmul(Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, ScalarType out_dtype, str backend) -> Tensor",
    _matmul_launch, _matmul_fake)
