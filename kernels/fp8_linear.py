"""A frozen ``nn.Linear`` stored in FP8, for LoRA over a frozen base: forward and input gradient.

**What is stored.** ``Fp8Weight`` holds the weight as FP8 codes ``q`` [N, K] (nn.Linear's [out, in]
layout, one byte per element) with one float32 scale per output channel (``fp8.quantize_rows`` of the
weight's rows), the bias as it was, and the weight's original dtype. The bf16 weight is dropped: the
frozen base takes half the memory.

**Forward: FP8 × FP8.** Each row of the input is quantised (``quantize_rows``), and ``fp8_matmul``
computes ``y = xs[:, None] · ws[None, :] · (xq @ qᵀ)`` with both scales in its epilogue: both are
constant along the reduced dimension K.

**Input gradient: a bf16 GEMM over the FP8 weight.** ``dx = dy @ Ŵ`` with ``Ŵ = q · scale[:, None]``
reduces over N, the dimension the per-output-channel scale runs along, so the scale cannot leave the
sum for an epilogue. The kernel here reads each [BLOCK_N, BLOCK_K] tile of ``q`` as FP8 (one byte an
element: the memory the format saves is also bandwidth saved), converts it to float32 in registers,
multiplies it by its rows' scales, rounds it to ``dy``'s dtype (what a bf16 copy of the dequantised
weight would hold) and feeds ``tl.dot`` with float32 accumulation. An FP8 dx GEMM would need a
transposed FP8 copy of the weight with per-column scales, or ``dy`` scaled per column: see
assets/notes/fp8.md, "The frozen base in FP8".

No weight gradient: the base is frozen, so the backward saves only the ``Fp8Weight``, never ``x``.
``convert_frozen_linears`` puts ``Fp8Linear`` in place of each frozen ``nn.Linear`` of a model (the
``base_layer`` of PEFT's LoRA layers). Chapter 18 runs LoRA over it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import nn

from . import ops, runtime
from .fp8 import FP8_DTYPES, fp8_matmul, quantize_rows, triton_problem
from .triton_utils import cast_to, grouped_tile

KERNEL_DTYPES = ops.KERNEL_DTYPES


# --------------------------------------------------------------------------------------------------
# The stored weight
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fp8Weight:
    """A frozen linear layer's weight in FP8: codes, per-output-channel scales, bias, original dtype.

    ``q`` [N, K] contiguous FP8 codes, ``scale`` float32 [N] with ``weight ≈ q · scale[:, None]``,
    ``bias`` [N] or None, ``dtype`` the weight's dtype before quantisation.
    """

    q: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None
    dtype: torch.dtype

    @classmethod
    def from_linear(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> Fp8Weight:
        """Quantise a linear layer's weight once, one scale per output channel (row).

        Args:
            weight: [N, K] float32, bfloat16 or float16 (read, not kept).
            bias: [N] or None, kept as it is (detached).
            fp8_dtype: ``torch.float8_e4m3fn`` (default) or ``torch.float8_e5m2``.

        Returns:
            the ``Fp8Weight``.

        Raises:
            TypeError: ``weight`` not a tensor, of another dtype, or ``fp8_dtype`` not FP8.
            ValueError: ``weight`` not 2-D, ``bias`` of the wrong shape or on another device.
        """
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"weight must be a tensor, got {type(weight).__name__}")
        if weight.dim() != 2:
            raise ValueError(f"weight must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
        ops.check_kernel_dtype("weight", weight, "cast the layer first")
        if fp8_dtype not in FP8_DTYPES:
            raise TypeError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}")
        if bias is not None:
            if bias.shape != (weight.shape[0],):
                raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
            if bias.device != weight.device:
                raise ValueError(f"bias must be on the weight's device {weight.device}, got {bias.device}")
            bias = bias.detach()
        q, scale = quantize_rows(weight.detach(), fp8_dtype)
        return cls(q, scale, bias, weight.dtype)

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``q · scale[:, None]`` computed in float32, returned in ``dtype`` (default: the original dtype).

        Args:
            dtype: the result's dtype; None for ``self.dtype``.

        Returns:
            the [N, K] dequantised weight.
        """
        return (self.q.float() * self.scale[:, None]).to(dtype or self.dtype)


# --------------------------------------------------------------------------------------------------
# The input-gradient kernel
# --------------------------------------------------------------------------------------------------


@triton.jit
def fp8_weight_grad_input_kernel(
    DY, Q, S, DX, M, N, K, stride_dym, stride_dyn, stride_qn, stride_qk, stride_dxm, stride_dxk,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_K] tile of ``DX = DY @ (Q · S[:, None])``, the weight dequantised in registers.

    Args:
        DY: pointer to ``dy`` [M, N] (bf16, fp16 or fp32, any strides).
        Q: pointer to the FP8 codes [N, K]; S: pointer to their float32 scales [N] (contiguous).
        DX: pointer to the output [M, K], ``dy``'s dtype.
        M, N, K: the sizes (N is reduced); stride_*: strides in elements.
        UPCAST: feed ``tl.dot`` float32 tiles (the interpreter's bf16 dot is wrong), after the
            weight tile has been rounded to ``dy``'s dtype.
        PRECISION: ``tl.dot``'s ``input_precision``.
        BLOCK_M, BLOCK_N, BLOCK_K: tile sizes; GROUP_M: row-tiles per group of the tile order.
    """
    pid_m, pid_k = grouped_tile(tl.program_id(0), M, K, BLOCK_M, BLOCK_K, GROUP_M)
    rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = pid_k.to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    rn = tl.arange(0, BLOCK_N).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        n = n0 + rn
        dy = tl.load(DY + rm[:, None] * stride_dym + n[None, :] * stride_dyn,
                     mask=(rm[:, None] < M) & (n[None, :] < N), other=0.0)
        # One byte per element from memory; the conversion to float32 is exact. A NaN code (which
        # the interpreter converts to a finite value) only occurs in a row whose scale is NaN.
        q = tl.load(Q + n[:, None] * stride_qn + rk[None, :] * stride_qk,
                    mask=(n[:, None] < N) & (rk[None, :] < K), other=0.0)
        s = tl.load(S + n, mask=n < N, other=0.0)
        # The scale sits on the reduced dimension: it multiplies the tile here, not the output.
        # Rounded once to dy's dtype, as a copy of the dequantised weight in that dtype would be.
        w = cast_to(q.to(tl.float32) * s[:, None], DY.dtype.element_ty)
        if UPCAST:
            acc = tl.dot(dy.to(tl.float32), w.to(tl.float32), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(dy, w, acc, input_precision=PRECISION)
    tl.store(DX + rm[:, None] * stride_dxm + rk[None, :] * stride_dxk, cast_to(acc, DX.dtype.element_ty),
             mask=(rm[:, None] < M) & (rk[None, :] < K))


@dataclass(frozen=True)
class GradInputConfig:
    """A launch configuration of ``fp8_weight_grad_input_kernel``: the output tile (``block_m`` ×
    ``block_k``), the reduced step ``block_n``, ``GROUP_M``, warps and stages."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def grad_input_config(m: int, n: int, k: int, props: runtime.DeviceProps | None = None) -> GradInputConfig:
    """Tiles of the input-gradient GEMM. In the interpreter, 64 × 64 × 64. On a GPU, a 128 × 128
    output tile with a reduced step of 64 and 8 warps where the shared memory holds four stages
    (``dy``'s tile in two bytes an element, the weight's in one), a smaller tile elsewhere: the
    bf16 GEMM's choice (``kernels.gemm.gemm_config``), the weight's stage half as large.

    Args:
        m, n, k: the GEMM's sizes (``dy`` [m, n], ``dx`` [m, k]; unused: one tile fits Llama's shapes).
        props: the device's properties; None reads the current device's.

    Returns:
        the ``GradInputConfig``.
    """
    props = props or runtime.device_props()
    if props.interpreter:
        return GradInputConfig(64, 64, 64, 8, 4, 1)
    per_stage = 128 * 64 * 2 + 64 * 128 * 1  # bytes of one stage: dy's bf16 tile, the FP8 weight tile
    if props.shared_mem_per_block >= 4 * per_stage:
        return GradInputConfig(128, 64, 128, 8, 8, 4)
    return GradInputConfig(64, 32, 64, 8, 4, 3)


# --------------------------------------------------------------------------------------------------
# Checks, reference, launch
# --------------------------------------------------------------------------------------------------


def _check_weight(w: Fp8Weight) -> None:
    if not isinstance(w, Fp8Weight):
        raise TypeError(f"w must be an Fp8Weight (Fp8Weight.from_linear), got {type(w).__name__}")


def _check_grad_input(dy: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    if not isinstance(dy, torch.Tensor):
        raise TypeError(f"dy must be a tensor, got {type(dy).__name__}")
    if dy.dim() != 2:
        raise ValueError(f"dy must be 2-D [M, N], got shape {tuple(dy.shape)}")
    ops.check_kernel_dtype("dy", dy, "cast it to float32")
    if q.dtype not in FP8_DTYPES or q.dim() != 2:
        raise TypeError(f"the weight's codes must be a 2-D FP8 tensor, got {q.dtype} of shape {tuple(q.shape)}")
    if scale.dtype != torch.float32 or scale.shape != (q.shape[0],):
        raise ValueError(f"the weight's scales must be float32 of shape ({q.shape[0]},), got {scale.dtype} "
                         f"{tuple(scale.shape)}")
    if dy.shape[1] != q.shape[0]:
        raise ValueError(f"dy is [M, N] and the weight [N, K]: dy has {dy.shape[1]} columns, the weight "
                         f"{q.shape[0]} rows")
    for name, t in (("the weight's codes", q), ("the weight's scales", scale)):
        if t.device != dy.device:
            raise ValueError(f"{name} must be on dy's device {dy.device}, got {t.device}")


def require_fp8(device: torch.device) -> None:
    """Raise where the FP8 kernels cannot run on ``device`` (a GPU below sm_89; CPU tensors outside
    Triton's interpreter), saying why.

    Args:
        device: the tensors' device.

    Raises:
        RuntimeError: ``fp8.triton_problem`` finds a reason.
    """
    problem = triton_problem(device)
    if problem is not None:
        raise RuntimeError(f"the FP8 linear layer cannot run here: {problem}. Keep the base in bf16 on this "
                           "device")


def fp8_weight_grad_input_reference(dy: torch.Tensor, w: Fp8Weight,
                                    compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``dy @ Ŵ`` in PyTorch: Ŵ = q · scale dequantised in float32 and rounded to ``dy``'s dtype,
    the product in ``compute_dtype``, the result rounded to ``dy``'s dtype.

    Args:
        dy: [M, N] float32, bfloat16 or float16.
        w: the ``Fp8Weight`` ([N, K]).
        compute_dtype: the matmul's dtype (float64 for the tests' exact reference).

    Returns:
        dx [M, K] in ``dy``'s dtype.
    """
    _check_weight(w)
    _check_grad_input(dy, w.q, w.scale)
    w_hat = (w.q.float() * w.scale[:, None]).to(dy.dtype)
    return (dy.to(compute_dtype) @ w_hat.to(compute_dtype)).to(dy.dtype)


def _grad_input_launch(dy: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    m, n = dy.shape
    k = q.shape[1]
    if m == 0 or k == 0 or n == 0:  # torch's answer: empty, or zeros for an empty sum
        return torch.zeros((m, k), dtype=dy.dtype, device=dy.device)
    require_fp8(dy.device)
    dx = torch.empty((m, k), dtype=dy.dtype, device=dy.device)
    cfg = grad_input_config(m, n, k, runtime.device_props(dy.device))
    upcast = runtime.INTERPRET
    precision = "ieee" if (upcast or dy.dtype == torch.float32) else "tf32"
    scale = scale.contiguous()
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(k, cfg.block_k),)
    fp8_weight_grad_input_kernel[grid](
        dy, q, scale, dx, m, n, k, dy.stride(0), dy.stride(1), q.stride(0), q.stride(1),
        dx.stride(0), dx.stride(1), UPCAST=upcast, PRECISION=precision,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return dx


def _grad_input_fake(dy, q, scale):
    return dy.new_empty((dy.shape[0], q.shape[1]))


fp8_weight_grad_input_op = ops.define(
    "fp8_weight_grad_input(Tensor dy, Tensor q, Tensor scale) -> Tensor", _grad_input_launch, _grad_input_fake)


def fp8_weight_grad_input(dy: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """``dx = dy @ Ŵ`` over the FP8-stored weight, ``Ŵ = q · scale[:, None]`` (chapter 18).

    The weight is read as FP8 and dequantised tile by tile in registers, rounded to ``dy``'s dtype,
    and multiplied with float32 accumulation (the module's docstring says why not in FP8).

    Args:
        dy: [M, N] float32, bfloat16 or float16, any strides.
        w: the ``Fp8Weight`` ([N, K]) on ``dy``'s device.

    Returns:
        a new dx [M, K] in ``dy``'s dtype (zeros when N is 0).

    Raises:
        TypeError: ``w`` not an ``Fp8Weight``, ``dy`` not a tensor or of another dtype.
        ValueError: ``dy`` not 2-D, N differs from the weight's, tensors on two devices.
        RuntimeError: a GPU without FP8 (below sm_89), or CPU tensors outside the interpreter.
    """
    _check_weight(w)
    _check_grad_input(dy, w.q, w.scale)
    return ops.call(fp8_weight_grad_input_op, dy, w.q, w.scale)


# --------------------------------------------------------------------------------------------------
# Autograd and the module
# --------------------------------------------------------------------------------------------------


class Fp8LinearFunction(torch.autograd.Function):
    """``y = x @ Ŵᵀ + bias`` in FP8 over a frozen ``Fp8Weight``; the backward gives ``x`` its gradient only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        """Quantise x's rows and run the scaled FP8 GEMM (bias added after).

        Args:
            x: [..., K] float32, bfloat16 or float16.
            q, scale: the ``Fp8Weight``'s codes [N, K] and scales [N]; bias: [N] or None.

        Returns:
            y [..., N] in x's dtype.
        """
        x2 = x.reshape(-1, x.shape[-1])
        xq, xs = quantize_rows(x2, q.dtype)  # one FP8 dtype per GEMM: the weight's
        y = fp8_matmul(xq, xs, q, scale, out_dtype=x.dtype)
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.save_for_backward(q, scale)  # the frozen weight only: x is not needed without dW
        ctx.x_shape = x.shape
        return y.reshape(*x.shape[:-1], q.shape[0])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        """dx = dy @ Ŵ, through ``fp8_weight_grad_input``; None for the frozen weight and bias.

        Args:
            dy: [..., N], the output's gradient.

        Returns:
            ``(dx, None, None, None)``; dx is None when x needs no gradient.
        """
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        q, scale = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = ops.call(fp8_weight_grad_input_op, dy2, q, scale)
        return dx.reshape(ctx.x_shape), None, None, None


@dataclass(frozen=True)
class Fp8WeightInfo:
    """What ``Fp8Linear.weight`` gives: the shape, dtype and device of the weight it replaced.

    PEFT reads ``base_layer.weight.dtype`` and ``.device`` to place new adapters; that works. The
    weight's values are not kept: reading anything else raises and says so.
    """

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device

    def __getattr__(self, name):
        raise AttributeError(
            f"Fp8Linear stores its frozen weight in FP8: the weight's {name!r} is not available (only shape, dtype "
            "and device). Use Fp8Linear.dequantized() for the values; merging adapters into the base needs the "
            "model reloaded in bf16")


def _check_frozen(linear: nn.Linear) -> None:
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"expected an nn.Linear, got {type(linear).__name__}")
    for name, p in (("weight", linear.weight), ("bias", linear.bias)):
        if p is not None and p.requires_grad:
            raise ValueError(f"the FP8 base is frozen: this layer's {name} requires grad: freeze it first "
                             f"or train it in bf16 ({name}.requires_grad_(False) freezes it)")


class Fp8Linear(nn.Module):
    """A frozen ``nn.Linear`` whose weight is stored in FP8 (``Fp8Weight``); chapter 18.

    The forward runs ``Fp8LinearFunction``: the input's gradient flows, nothing else has one. The
    codes and scales are buffers stored as raw integer bits: ``model.to(torch.bfloat16)`` casts
    floating buffers, which would turn the codes back into bf16 and round the scales, while integer
    buffers only follow the device.
    """

    def __init__(self, w: Fp8Weight):
        """Args:
            w: the ``Fp8Weight`` to hold.
        """
        super().__init__()
        _check_weight(w)
        self.out_features, self.in_features = w.q.shape
        self.fp8_dtype = w.q.dtype
        self.weight_dtype = w.dtype
        self.register_buffer("q_bits", w.q.contiguous().view(torch.uint8))
        self.register_buffer("scale_bits", w.scale.contiguous().view(torch.int32))
        self.register_buffer("bias", w.bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> Fp8Linear:
        """An ``Fp8Linear`` holding ``linear``'s weight quantised per output channel.

        Args:
            linear: an ``nn.Linear`` whose weight (and bias) do not require grad.
            fp8_dtype: ``torch.float8_e4m3fn`` (default) or ``torch.float8_e5m2``.

        Returns:
            the new module (``linear`` is left unchanged).

        Raises:
            TypeError: not an ``nn.Linear``, or a dtype ``Fp8Weight.from_linear`` refuses.
            ValueError: a weight or bias that requires grad.
        """
        _check_frozen(linear)
        return cls(Fp8Weight.from_linear(linear.weight, linear.bias, fp8_dtype))

    @property
    def fp8_weight(self) -> Fp8Weight:
        """The ``Fp8Weight`` over this module's buffers (views, no copy)."""
        return Fp8Weight(self.q_bits.view(self.fp8_dtype), self.scale_bits.view(torch.float32), self.bias,
                         self.weight_dtype)

    @property
    def weight(self) -> Fp8WeightInfo:
        """The replaced weight's shape, dtype and device (``Fp8WeightInfo``), for PEFT's lookups."""
        return Fp8WeightInfo(torch.Size((self.out_features, self.in_features)), self.weight_dtype,
                             self.q_bits.device)

    def dequantized(self) -> torch.Tensor:
        """The weight ``q · scale[:, None]`` in its original dtype, for checks.

        Returns:
            [out_features, in_features].
        """
        return self.fp8_weight.dequantized()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ Ŵᵀ + bias`` with FP8 operands.

        Args:
            x: [..., in_features] float32, bfloat16 or float16 on the module's device.

        Returns:
            [..., out_features] in x's dtype.

        Raises:
            TypeError, ValueError, RuntimeError: a dtype, a last dimension or a device that does not
                fit, or a device without FP8 (``require_fp8``).
        """
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a tensor, got {type(x).__name__}")
        ops.check_kernel_dtype("x", x, "cast it first")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"x must be [..., {self.in_features}], got shape {tuple(x.shape)}")
        if x.device != self.q_bits.device:
            raise ValueError(f"x must be on the layer's device {self.q_bits.device}, got {x.device}")
        require_fp8(x.device)
        w = self.fp8_weight
        return Fp8LinearFunction.apply(x, w.q, w.scale, w.bias)

    def extra_repr(self) -> str:
        """What ``repr`` shows inside the parentheses.

        Returns:
            the sizes, whether there is a bias, the FP8 format and the original dtype.
        """
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"fp8={self.fp8_dtype}, weight_dtype={self.weight_dtype}")


def _matches(name: str, skip: tuple[str, ...]) -> bool:
    return any(s in name.split(".") or s == name for s in skip)


def convert_frozen_linears(model: nn.Module, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                           skip: tuple[str, ...] = ("lm_head",)) -> int:
    """Replace each frozen ``nn.Linear`` of ``model`` by an ``Fp8Linear``, in place (chapter 18).

    Works on a plain model and on a PEFT LoRA model: there the frozen linear is each LoRA layer's
    ``base_layer`` (a child of the LoRA layer, so it is found like any other), while the adapters'
    ``lora_A``/``lora_B`` require grad and are left alone. Linears whose weight requires grad are
    left as they are. One-way: the bf16 weights are freed; reload the model to undo. PEFT's
    ``save_pretrained`` saves the adapters unchanged (their keys and values do not involve the base).

    Args:
        model: the model to convert.
        fp8_dtype: ``torch.float8_e4m3fn`` (default) or ``torch.float8_e5m2``.
        skip: module names left in their dtype: a name is skipped when one of its dotted parts, or
            the whole name, is in ``skip`` (``"lm_head"`` by default).

    Returns:
        how many linears were converted.

    Raises:
        RuntimeError: a linear to convert sits on a device where the FP8 kernels cannot run
            (``require_fp8``); nothing is converted then.
    """
    if isinstance(skip, str):
        skip = (skip,)
    targets = []
    for parent_name, parent in model.named_modules():
        for child_name, child in parent.named_children():
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if type(child) is nn.Linear and not child.weight.requires_grad and not _matches(name, skip):
                if child.bias is None or not child.bias.requires_grad:
                    targets.append((parent, child_name, child))
    for device in {child.weight.device for _, _, child in targets}:
        require_fp8(device)  # before anything is converted: the conversion cannot be undone
    for parent, child_name, child in targets:
        setattr(parent, child_name, Fp8Linear.from_linear(child, fp8_dtype))
    return len(targets)
