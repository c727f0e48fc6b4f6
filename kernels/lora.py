"""The LoRA linear layer fused: ``y = x · Wᵀ + b + s · (x · Aᵀ) · Bᵀ`` as one autograd node.

A LoRA adapter (``A`` [r, in], ``B`` [out, r], rank r, scale s = α/r, or α/√r for rsLoRA) beside a
frozen linear layer costs little arithmetic, about 2·r/in of the layer's FLOPs, but PEFT computes it
as four more modules and ops after the base layer: ``lora_A``, ``lora_B``, the scaling and the add,
each reading and writing its own tensor, and (with the adapters in float32 over a bfloat16 model,
PEFT's default) a float32 copy of ``x`` that autograd keeps for ``lora_A``'s backward. Here the
whole layer is one ``autograd.Function``:

* **forward**: ``xa = x · Aᵀ`` ([tokens, r], tiny), then the base GEMM with the low-rank product ``s
  · xa · Bᵀ`` added in its *epilogue* (before the output is stored): either cuBLAS's β-epilogue (``y
  = x·Wᵀ + b``, then ``y.addmm_(xa, Bᵀ, alpha=s)``: one extra read and write of y) or a Triton GEMM
  whose tile adds the low-rank term in registers (``kernels.gemm.gemm_epilogue``: y written once).
  ``epilogue="cublas"`` or ``"triton"``; or ``"cublas_lowrank_first"``: the low-rank product written
  first, then the base GEMM accumulating onto it (β = 1), so that cuBLAS reads it in the big GEMM's
  own epilogue rather than in a pass of its own; or ``"merged"``: the adapter merged into a
  temporary weight, ``W + s·B·A``, and one GEMM with it (2·out·in values read and written instead of
  the epilogue's 2·tokens·out); or ``"auto"``: merged wherever that moves fewer bytes (in_features
  below the tokens forward, out_features below them for dx), else ``"cublas"``.
* **saved for the backward**: ``x`` (the base layer's input, which a frozen linear layer saves
  anyway), ``W``, ``A``, ``B`` and ``xa``: no float32 copy of anything, nothing of the output's
  size.
* **backward**: ``dxa = s · dy · B``; ``dx = dy · W + dxa · A`` (the same epilogue trick); ``dB = s
  · dyᵀ · xa`` and ``dA = dxaᵀ · x``, two skinny GEMMs whose reduction runs over all tokens: cuBLAS
  (``skinny="cublas"``) or a split-K Triton kernel (``skinny="splitk"``,
  ``kernels.gemm.splitk_mm``), each accumulating in float32 and returned in the adapter's own dtype.
  ``W`` and the bias get gradients only if they require them (a frozen base: never).

The GEMMs run in ``x``'s dtype: a float32 adapter over a bfloat16 layer is cast to bfloat16 for them
(r·(in + out) values, nothing of the tokens' size), and its gradients are accumulated in float32 and
returned in float32. **Layers that share one input** (``lora_group``, ``LoRAGroupFunction``): q, k
and v of an attention block, or gate and up of a Llama MLP, fused one by one still read ``x`` once
per layer for ``x · A_iᵀ`` and again for dA_i, and autograd adds their input gradients with
elementwise passes over a [tokens, in] tensor. As one node: ``xa = x · [A_1; A_2; A_3]ᵀ`` in one
GEMM; each output with its low-rank product joined to its base GEMM as above (the two cuBLAS
epilogues; each output its own tensor, which a later backward may write over, as SwiGLU's does over
gate and up); saved: x once, the weights, the adapters and the [tokens, Σr] xa; backward: ``dxa_i =
s_i · dy_i · B_i`` and ``dB_i`` per layer, every ``dA_i`` in one GEMM ``dxaᵀ · x``, and ``dx = dxa ·
[A_1; A_2; A_3] + Σ dy_i · W_i`` accumulated by β = 1 GEMMs. By bytes at the Llama-3.1-8B shape
(8,192 tokens, bf16) that is about 960 MiB a decoder layer less than the layers fused one by one: x
read four times fewer for q/k/v and twice for gate/up, and autograd's three additions of input
gradients (each reads two [tokens, 4,096] tensors and writes one) gone.

It works under gradient checkpointing (the forward is recomputed like any other node) and
``torch.compile`` (the two halves are the operators ``torch.ops.kernels.lora_linear_fwd`` /
``_bwd``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import ops
from .gemm import KERNEL_DTYPES, gemm_epilogue, splitk_mm
from .swiglu import inplace_backward_allowed, swiglu_backward, swiglu_backward_, swiglu_forward

EPILOGUES = ("cublas", "cublas_lowrank_first", "triton", "merged", "auto")
SKINNY = ("cublas", "splitk")


def lora_scale(alpha: float, rank: int, use_rslora: bool = False) -> float:
    """PEFT's scaling: ``alpha / rank``, or ``alpha / sqrt(rank)`` for rsLoRA (rank-stabilised LoRA).

    Args:
        alpha: PEFT's ``lora_alpha``.
        rank: the adapter's rank r, a positive int.
        use_rslora: divide by √r instead of r.

    Returns:
        the scale s of ``s · B·A``.

    Raises:
        ValueError: ``rank`` not a positive int.
    """
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be a positive int, got {rank!r}")
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


# --------------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------------


def check_lora_inputs(x, weight, bias, lora_a, lora_b, scale, epilogue, skinny) -> None:
    """A clear error (TypeError or ValueError) unless ``lora_linear`` computes this call.

    Args:
        x, weight, bias, lora_a, lora_b, scale, epilogue, skinny: ``lora_linear``'s arguments.

    Raises:
        TypeError: a non-tensor, an unsupported dtype, a weight or bias not in x's dtype, or a
            scale that is not a finite number.
        ValueError: shapes that do not fit, tensors on several devices, or an unknown
            ``epilogue`` or ``skinny``.
    """
    for name, t in (("x", x), ("weight", weight), ("lora_a", lora_a), ("lora_b", lora_b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dtype not in KERNEL_DTYPES:
            raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}: cast it to float32, or "
                            "use PEFT's own LoRA layer")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be a tensor or None, got {type(bias).__name__}")
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension (its last is in_features), got a scalar")
    if weight.dim() != 2 or lora_a.dim() != 2 or lora_b.dim() != 2:
        raise ValueError(f"weight, lora_a and lora_b must be 2-D, got shapes {tuple(weight.shape)}, "
                         f"{tuple(lora_a.shape)}, {tuple(lora_b.shape)}")
    out_features, in_features = weight.shape
    rank = lora_a.shape[0]
    if x.shape[-1] != in_features:
        raise ValueError(f"x's last dimension must be in_features={in_features} (weight is "
                         f"{tuple(weight.shape)}), got shape {tuple(x.shape)}")
    if rank < 1 or lora_a.shape[1] != in_features:
        raise ValueError(f"lora_a must be [rank ≥ 1, in_features={in_features}], got {tuple(lora_a.shape)}")
    if tuple(lora_b.shape) != (out_features, rank):
        raise ValueError(f"lora_b must be [out_features={out_features}, rank={rank}], got {tuple(lora_b.shape)}")
    if bias is not None and tuple(bias.shape) != (out_features,):
        raise ValueError(f"bias must have shape ({out_features},), got {tuple(bias.shape)}")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise TypeError(f"weight (and bias) must have x's dtype {x.dtype}, got {weight.dtype}"
                        f"{'' if bias is None else f' and {bias.dtype}'}")
    for name, t in (("weight", weight), ("bias", bias), ("lora_a", lora_a), ("lora_b", lora_b)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}: put them on one device")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite float, got {scale!r}")
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue must be one of {EPILOGUES}, got {epilogue!r}")
    if skinny not in SKINNY:
        raise ValueError(f"skinny must be one of {SKINNY}, got {skinny!r}")


# --------------------------------------------------------------------------------------------------
# The two halves on 2-D tensors
# --------------------------------------------------------------------------------------------------


def _merges(epilogue: str, tokens: int, reduced: int) -> bool:
    # Merging writes and reads a temporary [out, in] weight; the epilogue writes and reads a
    # [tokens, out] output (forward) or [tokens, in] gradient (dx). Per GEMM: merged costs less
    # where the dimension it reduces over is smaller than the tokens.
    return epilogue == "merged" or (epilogue == "auto" and reduced < tokens)


def _merged(weight, a, b, scale: float) -> torch.Tensor:
    """``W + s·B·A`` in W's dtype: a temporary weight with the adapter in it (what PEFT's merge
    computes, not kept)."""
    return torch.addmm(weight, b, a, alpha=scale)


def lora_forward(x2, weight, bias, lora_a, lora_b, scale: float, epilogue: str = "cublas"):
    """(y, xa) for 2-D ``x2`` [tokens, in]: ``y = x2·Wᵀ + b + s·xa·Bᵀ`` and ``xa = x2·Aᵀ``.

    ``xa`` is kept for the backward. The inputs are not checked here (``lora_linear`` does it).

    Args:
        x2: [tokens, in].
        weight, bias: the base layer, [out, in] and [out] or None, in x2's dtype.
        lora_a, lora_b: [r, in] and [out, r], cast to x2's dtype for the GEMMs.
        scale: the adapter's scale s.
        epilogue: how the low-rank product joins the base GEMM (one of ``EPILOGUES``).
    """
    a = lora_a.to(x2.dtype)
    b = lora_b.to(x2.dtype)
    xa = x2 @ a.t()
    if _merges(epilogue, x2.shape[0], weight.shape[1]):
        y = F.linear(x2, _merged(weight, a, b, scale), bias)
    elif epilogue == "triton":
        y = gemm_epilogue(x2, weight.t(), xa, b.t(), scale, bias)
    else:
        y = _cublas_output(x2, weight, bias, xa, b, scale, epilogue)
    return y, xa


def _cublas_output(x2, weight, bias, xa, b, scale: float, epilogue: str) -> torch.Tensor:
    """``x2·Wᵀ + bias + s·xa·Bᵀ`` with the low-rank product joined by cuBLAS's β = 1 epilogue (``b``
    in x2's dtype; ``xa`` may be a column slice of a wider tensor)."""
    if epilogue == "cublas_lowrank_first":
        # s·xa·Bᵀ (+ b) first, a GEMM over K = r; then the base GEMM adds onto it in its own
        # epilogue (β = 1), where the compute-bound main loops of other tiles may hide the read.
        y = (xa * scale) @ b.t() if bias is None else torch.addmm(bias, xa * scale, b.t())
        y.addmm_(x2, weight.t())
    else:
        # cuBLAS: the base GEMM (with its bias), then the low-rank GEMM accumulated into it (β = 1):
        # y read once more.
        y = F.linear(x2, weight, bias)
        y.addmm_(xa, b.t(), alpha=scale)
    return y


def _cublas_input_grad(dys, weights, dxa, a, epilogue: str) -> torch.Tensor:
    """``dxa·A + Σ dy_i·W_i`` as one tensor accumulated by cuBLAS's β = 1 epilogue: the low-rank
    term first (``"cublas_lowrank_first"``) or last (``"cublas"``). One layer, or the layers of a
    group (A stacked)."""
    if epilogue == "cublas_lowrank_first":
        dx = dxa @ a
        for dy, w in zip(dys, weights):
            dx.addmm_(dy, w)
        return dx
    dx = dys[0] @ weights[0]
    for dy, w in zip(dys[1:], weights[1:]):
        dx.addmm_(dy, w)
    return dx.addmm_(dxa, a)


# whether this PyTorch's torch.mm takes out_dtype (found on the first call that tries)
_MM_OUT_DTYPE = [True]


def skinny_mm(a: torch.Tensor, b: torch.Tensor, scale: float, out_dtype: torch.dtype,
              skinny: str = "cublas"):
    """``scale · aᵀ · b`` reduced over the tokens (the rows of both), accumulated in float32, in
    ``out_dtype``.

    Args:
        a, b: [tokens, M] and [tokens, N].
        scale: the product's factor.
        out_dtype: the result's dtype.
        skinny: ``"cublas"`` (torch.mm) or ``"splitk"`` (``kernels.gemm.splitk_mm``).
    """
    if skinny == "splitk":
        return splitk_mm(a, b, scale, out_dtype)
    if a.dtype == out_dtype and b.dtype == out_dtype:
        out = a.t() @ b
    elif a.is_cuda and a.dtype == b.dtype and out_dtype == torch.float32 and _MM_OUT_DTYPE[0]:
        try:
            out = torch.mm(a.t(), b, out_dtype=torch.float32)  # bf16 inputs, fp32 accumulator and output
        except (TypeError, RuntimeError):  # a PyTorch without mm's out_dtype: upcast instead, from now on
            _MM_OUT_DTYPE[0] = False
            out = a.t().float() @ b.float()
    else:
        out = a.t().float() @ b.float()
    return (out.mul_(scale) if scale != 1.0 else out).to(out_dtype)


def lora_backward(dy2, x2, weight, lora_a, lora_b, xa, scale: float, need_dx: bool = True,
                  epilogue: str = "cublas", skinny: str = "cublas"):
    """(dx, dA, dB) for 2-D ``dy2`` [tokens, out]; ``dx`` is an empty tensor when ``need_dx`` is False.

    Args:
        dy2: the output's gradient, [tokens, out].
        x2, weight, lora_a, lora_b, xa: the forward's input, base weight, adapters and ``xa``.
        scale: the adapter's scale s.
        need_dx: whether to compute dx.
        epilogue: how dx's low-rank term joins the base GEMM; skinny: how dA and dB are reduced.
    """
    a = lora_a.to(x2.dtype)
    b = lora_b.to(x2.dtype)
    dxa = dy2 @ b
    dxa.mul_(scale)  # [tokens, r]: s·dy·B, the gradient of xa
    d_b = skinny_mm(dy2, xa, scale, lora_b.dtype, skinny)  # s·dyᵀ·xa  [out, r]
    d_a = skinny_mm(dxa, x2, 1.0, lora_a.dtype, skinny)  # dxaᵀ·x   [r, in]
    if not need_dx:
        return x2.new_empty(0), d_a, d_b
    if _merges(epilogue, dy2.shape[0], weight.shape[0]):
        dx = dy2 @ _merged(weight, a, b, scale)
    elif epilogue == "triton":
        dx = gemm_epilogue(dy2, weight, dxa, a, 1.0)
    else:
        dx = _cublas_input_grad([dy2], [weight], dxa, a, epilogue)
    return dx, d_a, d_b


# --------------------------------------------------------------------------------------------------
# Operators
# --------------------------------------------------------------------------------------------------


def _fwd_fake(x2, weight, bias, lora_a, lora_b, scale, epilogue):
    return x2.new_empty((x2.shape[0], weight.shape[0])), x2.new_empty((x2.shape[0], lora_a.shape[0]))


def _bwd_fake(dy2, x2, weight, lora_a, lora_b, xa, scale, need_dx, epilogue, skinny):
    dx = x2.new_empty(x2.shape) if need_dx else x2.new_empty(0)
    return dx, lora_a.new_empty(lora_a.shape), lora_b.new_empty(lora_b.shape)


lora_fwd_op = ops.define(
    "lora_linear_fwd(Tensor x, Tensor weight, Tensor? bias, Tensor lora_a, Tensor lora_b, float scale, "
    "str epilogue) -> (Tensor, Tensor)", lora_forward, _fwd_fake)
lora_bwd_op = ops.define(
    "lora_linear_bwd(Tensor dy, Tensor x, Tensor weight, Tensor lora_a, Tensor lora_b, Tensor xa, float scale, "
    "bool need_dx, str epilogue, str skinny) -> (Tensor, Tensor, Tensor)", lora_backward, _bwd_fake)


# --------------------------------------------------------------------------------------------------
# autograd and the functional form
# --------------------------------------------------------------------------------------------------


class LoRALinearFunction(torch.autograd.Function):
    """The fused LoRA layer as one autograd node: saves x, W, A, B and the [tokens, r] xa, nothing
    else. Returns y as [tokens, out] (``lora_linear`` gives it x's leading dimensions)."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scale, epilogue, skinny):
        """Run the forward operator on x's rows; save x, W, A, B and xa.

        Args:
            ctx: autograd's context.
            x, weight, bias, lora_a, lora_b, scale, epilogue, skinny: as ``lora_linear``'s.
        """
        x2 = x.reshape(-1, x.shape[-1])
        y, xa = ops.call(lora_fwd_op, x2, weight, bias, lora_a, lora_b, scale, epilogue)
        ctx.save_for_backward(x2, weight, lora_a, lora_b, xa)
        ctx.scale, ctx.epilogue, ctx.skinny = scale, epilogue, skinny
        ctx.x_shape, ctx.has_bias = x.shape, bias is not None
        # y stays 2-D here; callers reshape it. A reshape inside would be a view of a tensor made
        # without autograd, and a later backward may not write over such an output
        # (swiglu.may_overwrite): gate and up of the MLP.
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        """The gradients of x, A and B (and of W and the bias where they require them).

        Args:
            ctx: autograd's context.
            dy: the output's gradient.
        """
        x2, weight, lora_a, lora_b, xa = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        need_dx, need_w, need_bias = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        dx, d_a, d_b = ops.call(lora_bwd_op, dy2, x2, weight, lora_a, lora_b, xa, ctx.scale, need_dx,
                                ctx.epilogue, ctx.skinny)
        dw = dy2.t() @ x2 if need_w else None  # a trained base layer (not LoRA's usual case)
        d_bias = dy2.sum(0) if need_bias and ctx.has_bias else None
        return (dx.reshape(ctx.x_shape) if need_dx else None, dw, d_bias,
                d_a if ctx.needs_input_grad[3] else None, d_b if ctx.needs_input_grad[4] else None,
                None, None, None)


class SwiGLULoRADownFunction(torch.autograd.Function):
    """``lora_linear(swiglu(gate, up), ...)``, Llama's LoRA ``down_proj`` over its SwiGLU, keeping
    gate and up only.

    The fused LoRA layer keeps its input x for dA. For ``down_proj`` that input is h = silu(gate) ·
    up, a [tokens, intermediate] tensor (235 MB per layer at 8,192 tokens of Llama-3.1-8B) that
    nothing else keeps: the SwiGLU backward needs gate and up, not h. So the forward frees h at
    once, and the backward recomputes it from gate and up (one elementwise kernel, the same bits)
    for dA and, for a trained base, dW. d(gate) and d(up) are written over gate and up, as
    ``swiglu(..., inplace_backward=True)`` does, where that is allowed
    (``swiglu.inplace_backward_allowed``: intermediate results of autograd, dense, in memory of
    their own); a caller's leaf, a view of one, or a strided view gets new gradient tensors
    instead."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias, lora_a, lora_b, scale, epilogue, skinny):
        """The product, then the LoRA layer; save gate, up, W, A, B and xa (not the product).

        Args:
            ctx: autograd's context.
            gate, up, weight, bias, lora_a, lora_b, scale, epilogue, skinny: as
                ``swiglu_lora_down``'s.
        """
        h = swiglu_forward(gate, up)
        y, xa = ops.call(lora_fwd_op, h.reshape(-1, h.shape[-1]), weight, bias, lora_a, lora_b,
                         scale, epilogue)
        del h
        ctx.save_for_backward(gate, up, weight, lora_a, lora_b, xa)
        ctx.scale, ctx.epilogue, ctx.skinny, ctx.has_bias = scale, epilogue, skinny, bias is not None
        ctx.overwrite = inplace_backward_allowed(gate, up)
        return y.reshape(*gate.shape[:-1], weight.shape[0])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        """The gradients of gate and up (over them where allowed), A, B, and W and the bias where
        they require them; the product is recomputed.

        Args:
            ctx: autograd's context.
            dy: the output's gradient.
        """
        gate, up, weight, lora_a, lora_b, xa = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        h2 = swiglu_forward(gate, up).reshape(-1, gate.shape[-1])
        dh, d_a, d_b = ops.call(lora_bwd_op, dy2, h2, weight, lora_a, lora_b, xa, ctx.scale, True,
                                ctx.epilogue,
                                ctx.skinny)
        dw = dy2.t() @ h2 if ctx.needs_input_grad[2] else None
        del h2
        d_bias = dy2.sum(0) if ctx.needs_input_grad[3] and ctx.has_bias else None
        if ctx.overwrite:
            swiglu_backward_(dh.reshape(gate.shape), gate, up)  # d(gate), d(up) over gate and up
            d_gate, d_up = gate.detach(), up.detach()
        else:
            d_gate, d_up = swiglu_backward(dh.reshape(gate.shape), gate, up)
        return (d_gate, d_up, dw, d_bias, d_a if ctx.needs_input_grad[4] else None,
                d_b if ctx.needs_input_grad[5] else None, None, None, None)


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
                lora_b: torch.Tensor, scale: float, *, epilogue: str = "cublas", skinny: str = "cublas"
                ) -> torch.Tensor:
    """``F.linear(x, weight, bias) + scale * F.linear(F.linear(x, lora_a), lora_b)`` as one fused
    autograd node.

    ``x`` [..., in] (any leading dimensions), ``weight`` [out, in] and ``bias`` [out] (or None) in
    ``x``'s dtype, ``lora_a`` [r, in] and ``lora_b`` [out, r] in float32, bfloat16 or float16 (PEFT
    keeps them in float32 over a bfloat16 model). Returns [..., out] in ``x``'s dtype. ``epilogue``
    picks how the low-rank product joins the base GEMM (``"cublas"``: addmm's β-epilogue;
    ``"cublas_lowrank_first"``: the low-rank product first, read by the base GEMM's β-epilogue;
    ``"triton"``: inside a Triton GEMM's tile; ``"merged"``: into a temporary weight W + s·B·A;
    ``"auto"``: merged where that moves fewer bytes), ``skinny`` how dA and dB are reduced over the
    tokens (``"cublas"`` or ``"splitk"``). Gradients: x, A and B always when they require them; W
    and the bias only if they do (a frozen base layer costs no dW GEMM). Chapter 15 (notebooks/15_lora.ipynb)
    derives it.

    Args:
        x: [..., in].
        weight, bias: the base layer, [out, in] and [out] (or None), in x's dtype.
        lora_a, lora_b: the adapter, [r, in] and [out, r].
        scale: the adapter's scale (``lora_scale``).
        epilogue: one of ``EPILOGUES``.
        skinny: one of ``SKINNY``.

    Returns:
        [..., out] in x's dtype.

    Raises:
        TypeError, ValueError: from ``check_lora_inputs``, naming the argument.
    """
    check_lora_inputs(x, weight, bias, lora_a, lora_b, scale, epilogue, skinny)
    y = LoRALinearFunction.apply(x, weight, bias, lora_a, lora_b, float(scale), epilogue, skinny)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def swiglu_lora_down(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float, *, epilogue: str = "cublas",
                     skinny: str = "cublas") -> torch.Tensor:
    """``lora_linear(silu(gate) * up, weight, bias, lora_a, lora_b, scale)`` as one node that keeps
    gate and up, not their product (``SwiGLULoRADownFunction``): gate and up [..., intermediate] of
    one shape and dtype, the layer as ``lora_linear`` takes it. Returns [..., out].

    Args:
        gate, up: [..., intermediate], of one shape, dtype and device.
        weight, bias, lora_a, lora_b, scale, epilogue, skinny: the down projection, as
            ``lora_linear`` takes them.

    Returns:
        [..., out].

    Raises:
        TypeError: a non-tensor gate or up, or as ``check_lora_inputs``.
        ValueError: gate and up of different shapes, dtypes or devices, or as
            ``check_lora_inputs``.
    """
    for name, t in (("gate", gate), ("up", up)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(f"gate and up must have one shape, dtype and device, got {tuple(gate.shape)} {gate.dtype} "
                         f"on {gate.device} and {tuple(up.shape)} {up.dtype} on {up.device}")
    check_lora_inputs(gate, weight, bias, lora_a, lora_b, scale, epilogue, skinny)
    return SwiGLULoRADownFunction.apply(gate, up, weight, bias, lora_a, lora_b, float(scale),
                                        epilogue, skinny)


def lora_linear_reference(x, weight, bias, lora_a, lora_b, scale):
    """PEFT's computation in plain PyTorch: the base layer, then the adapter's two linears, scaled
    and added.

    Args:
        x, weight, bias, lora_a, lora_b, scale: as ``lora_linear``'s.
    """
    return F.linear(x, weight, bias) + F.linear(F.linear(x, lora_a), lora_b) * scale


# --------------------------------------------------------------------------------------------------
# Layers that share one input: q, k and v; gate and up
# --------------------------------------------------------------------------------------------------

GROUP_EPILOGUES = ("cublas", "cublas_lowrank_first")


def adapter_columns(lora_as) -> list[tuple[int, int]]:
    """Each adapter's columns of a group's concatenated xa (and rows of the concatenated A).

    Args:
        lora_as: the group's A matrices, [r_i, in] each.

    Returns:
        ``[(start, end), ...]``, one per adapter.
    """
    bounds, lo = [], 0
    for a in lora_as:
        bounds.append((lo, lo + a.shape[0]))
        lo += a.shape[0]
    return bounds


def _stacked(lora_as, dtype: torch.dtype) -> torch.Tensor:
    """[A_1; A_2; ...] in the GEMMs' dtype: r_1 + r_2 + ... rows of in_features (nothing of the
    tokens' size)."""
    return torch.cat([a.to(dtype) for a in lora_as])


def group_forward(x2, weights, biases, lora_as, lora_bs, scales, epilogue):
    """(outputs, xa) for 2-D ``x2`` [tokens, in]: one ``y_i`` [tokens, out_i] per layer and ``xa``
    [tokens, Σr].

    Args:
        x2: [tokens, in].
        weights, biases, lora_as, lora_bs, scales: one of each per layer.
        epilogue: one of ``GROUP_EPILOGUES``.
    """
    xa = x2 @ _stacked(lora_as, x2.dtype).t()
    outputs = []
    for (lo, hi), w, bias, b, s in zip(adapter_columns(lora_as), weights, biases, lora_bs, scales):
        outputs.append(_cublas_output(x2, w, bias, xa[:, lo:hi], b.to(x2.dtype), s, epilogue))
    return outputs, xa


def adapter_grads(dys, x2, lora_as, lora_bs, xa, scales, skinny: str = "cublas"):
    """The adapters' side of a group's backward: ``dxa`` [tokens, Σr] (each layer's ``s_i·dy_i·B_i``),
    every ``dA_i`` from one GEMM ``dxaᵀ · x`` and each ``dB_i = s_i·dy_iᵀ·xa_i``, in the adapters'
    dtype. Shared by the bf16 group and the FP8-base group (``kernels.lora_fp8``).

    Args:
        dys: one [tokens, out_i] gradient per layer.
        x2, lora_as, lora_bs, xa, scales: the forward's input, adapters, ``xa`` and scales.
        skinny: how dA and dB are reduced (one of ``SKINNY``).

    Returns:
        ``(dxa, [dA_i], [dB_i])``.
    """
    bounds = adapter_columns(lora_as)
    dxas, d_bs = [], []
    for (lo, hi), dy, b, s in zip(bounds, dys, lora_bs, scales):
        dxa = dy @ b.to(dy.dtype)
        dxas.append(dxa.mul_(s))  # s·dy·B: the gradient of this layer's columns of xa
        d_bs.append(skinny_mm(dy, xa[:, lo:hi], s, b.dtype, skinny))  # s·dyᵀ·xa_i
    dxa = torch.cat(dxas, dim=1)
    d_a = skinny_mm(dxa, x2, 1.0, lora_as[0].dtype, skinny)  # every dA_i in one GEMM: x read once
    return dxa, [d_a[lo:hi] for lo, hi in bounds], d_bs


def group_backward(dys, x2, weights, lora_as, lora_bs, xa, scales, need_dx, epilogue, skinny):
    """(dx, [dA_i], [dB_i]) for the 2-D output gradients ``dys``; ``dx`` is None when ``need_dx`` is
    False.

    Args:
        dys: one [tokens, out_i] gradient per layer.
        x2, weights, lora_as, lora_bs, xa, scales: the forward's input, layers and ``xa``.
        need_dx: whether to compute dx.
        epilogue: one of ``GROUP_EPILOGUES``; skinny: how dA and dB are reduced.
    """
    dxa, d_as, d_bs = adapter_grads(dys, x2, lora_as, lora_bs, xa, scales, skinny)
    if not need_dx:
        return None, d_as, d_bs
    return _cublas_input_grad(dys, weights, dxa, _stacked(lora_as, x2.dtype), epilogue), d_as, d_bs


def check_group(x, weights, biases, lora_as, lora_bs, scales, epilogue, skinny) -> None:
    """A clear error unless the layers can be one group node on ``x``: each layer one ``lora_linear`` could
    compute on ``x``, adapters of one dtype, a grouped epilogue.

    Args:
        x, weights, biases, lora_as, lora_bs, scales, epilogue, skinny: ``lora_group``'s.

    Raises:
        TypeError: adapters of several dtypes, or as ``check_lora_inputs``.
        ValueError: no layer, lists of different lengths, an epilogue not in ``GROUP_EPILOGUES``,
            or as ``check_lora_inputs``.
    """
    n = len(weights)
    if n < 1 or not (len(biases) == len(lora_as) == len(lora_bs) == len(scales) == n):
        raise ValueError(f"one weight, bias (or None), lora_a, lora_b and scale per layer, got {n}, {len(biases)}, "
                         f"{len(lora_as)}, {len(lora_bs)}, {len(scales)}")
    if epilogue not in GROUP_EPILOGUES:
        raise ValueError(f"epilogue must be one of {GROUP_EPILOGUES}, got {epilogue!r}")
    for layer in zip(weights, biases, lora_as, lora_bs, scales):
        check_lora_inputs(x, *layer, epilogue, skinny)
    if not adapters_share_dtype(lora_as, lora_bs):
        raise TypeError("the adapters must share one dtype, got "
                        f"{sorted({str(t.dtype) for t in (*lora_as, *lora_bs)})}")


def adapters_share_dtype(lora_as, lora_bs) -> bool:
    """Whether every A and B of a group has one dtype, as the stacked [A_1; A_2; ...] and its
    gradient need.

    Args:
        lora_as, lora_bs: the group's adapters.

    Returns:
        True when all of them have one dtype.
    """
    return len({t.dtype for t in (*lora_as, *lora_bs)}) == 1


class LoRAGroupFunction(torch.autograd.Function):
    """Several LoRA layers on one input as one autograd node (the module docstring). ``apply(x,
    epilogue, skinny, scales, w_1, b_1, A_1, B_1, w_2, ...)``: four tensors per layer (a bias may be
    None); returns one 2-D output [tokens, out_i] per layer."""

    @staticmethod
    def forward(ctx, x, epilogue, skinny, scales, *params):
        """Every layer's output on x's rows; save x, xa, the weights and the adapters.

        Args:
            ctx: autograd's context.
            x, epilogue, skinny, scales: as ``lora_group``'s.
            params: four per layer: weight, bias (or None), A, B.
        """
        weights, biases, lora_as, lora_bs = (list(params[i::4]) for i in range(4))
        x2 = x.reshape(-1, x.shape[-1])
        outputs, xa = group_forward(x2, weights, biases, lora_as, lora_bs, scales, epilogue)
        ctx.save_for_backward(x2, xa, *weights, *lora_as, *lora_bs)
        ctx.n, ctx.scales, ctx.epilogue, ctx.skinny = len(weights), scales, epilogue, skinny
        ctx.x_shape, ctx.has_bias = x.shape, [bias is not None for bias in biases]
        return tuple(outputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *dys):
        """The gradients of x, each A and B, and weights and biases where they require them.

        Args:
            ctx: autograd's context.
            dys: one output gradient per layer.
        """
        x2, xa, *rest = ctx.saved_tensors
        n = ctx.n
        weights, lora_as, lora_bs = rest[:n], rest[n:2 * n], rest[2 * n:]
        needs = ctx.needs_input_grad[4:]
        dys = [dy.reshape(-1, dy.shape[-1]) for dy in dys]
        dx, d_as, d_bs = group_backward(dys, x2, weights, lora_as, lora_bs, xa, ctx.scales,
                                        ctx.needs_input_grad[0], ctx.epilogue, ctx.skinny)
        grads = []
        for i, dy in enumerate(dys):
            need_w, need_bias, need_a, need_b = needs[4 * i:4 * i + 4]
            grads += [dy.t() @ x2 if need_w else None,  # a trained base layer (not LoRA's usual case)
                      dy.sum(0) if need_bias and ctx.has_bias[i] else None,
                      d_as[i] if need_a else None, d_bs[i] if need_b else None]
        return (None if dx is None else dx.reshape(ctx.x_shape), None, None, None, *grads)


def lora_group(x: torch.Tensor, weights, biases, lora_as, lora_bs, scales, *, epilogue: str = "cublas",
               skinny: str = "cublas") -> list[torch.Tensor]:
    """``[lora_linear(x, w_i, b_i, A_i, B_i, s_i) for each layer]`` as one fused node: x [..., in],
    one weight [out_i, in] and bias (or None) in x's dtype per layer, adapters A_i [r_i, in] and B_i
    [out_i, r_i] of one dtype, scales s_i. Returns one [..., out_i] tensor per layer; gradients as
    ``kernels.lora.lora_linear`` gives them. Chapter 15 (notebooks/15_lora.ipynb) uses it.

    Args:
        x: [..., in].
        weights, biases: one base layer per entry, in x's dtype (a bias may be None).
        lora_as, lora_bs: one adapter per layer, all of one dtype.
        scales: one scale per layer.
        epilogue: one of ``GROUP_EPILOGUES``.
        skinny: one of ``SKINNY``.

    Returns:
        one [..., out_i] tensor per layer.

    Raises:
        TypeError, ValueError: from ``check_group``, naming the problem.
    """
    scales = tuple(float(s) for s in scales)
    check_group(x, weights, biases, lora_as, lora_bs, scales, epilogue, skinny)
    params = [t for layer in zip(weights, biases, lora_as, lora_bs) for t in layer]
    outputs = LoRAGroupFunction.apply(x, epilogue, skinny, scales, *params)
    return [y.reshape(*x.shape[:-1], y.shape[-1]) for y in outputs]
