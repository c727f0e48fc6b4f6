"""LoRA over a frozen base stored in FP8: the base GEMMs in FP8, the adapters in bf16, one node.

The fused LoRA layer of ``kernels.lora`` with its frozen weight ``W`` replaced by an ``Fp8Weight``
(``kernels.fp8_linear``: codes ``q`` [out, in] in e4m3 and one float32 scale per output channel,
``W ≈ q · ws[:, None]``). Per layer, or per group of layers on one input (q/k/v, gate/up):

* **forward**: ``xa = x · Aᵀ`` in x's dtype (for all layers of a group in one GEMM); x's rows
  quantised once (``fp8.quantize_rows``) for every layer of the group; each base output ``y_i =
  fp8_matmul(xq, xs, q_i, ws_i)`` (both scales in the GEMM's epilogue), then ``y_i += s_i · xa_i ·
  B_iᵀ`` (cuBLAS's β = 1 accumulate).
* **saved**: x (bf16, for dA, as the bf16 layer saves it; or ``SAVED_INPUTS``' ``"fp8"``: the
  codes and row scales the forward already made, half the bytes, dA then over FP8-rounded x), xa,
  the weights' codes and scales (the module's buffers: no new memory), the adapters.
* **backward**: ``dxa_i = s_i · dy_i · B_i``, ``dB_i = s_i · dy_iᵀ · xa_i``, all ``dA_i`` in one GEMM
  ``dxaᵀ · x``, and ``dx = dxa · [A_1; A_2; …] + Σ dy_i · Ŵ_i``. Each ``dy_i · Ŵ_i`` reduces over
  the output channels, the dimension the weight's scale runs along; so the scale moves onto dy's
  columns, ``dy · Ŵ = (dy · diag(ws)) · q``, and ``quantize_rows(dy, col_scale=ws)`` multiplies
  them in as it reads dy, one scale per token row: then ``dx_i = fp8_matmul(dyq, dys, qᵀ, 1)``, an
  FP8 GEMM like the forward's over a transposed copy of the codes (one byte an element, made for the
  call and freed after it). ``GRAD_INPUTS``: ``"fp8"`` (that), or ``"bf16"``: the weight dequantised
  tile by tile in a bf16 GEMM (``fp8_linear.fp8_weight_grad_input``), the choice to make where FP8
  gradients lose accuracy; chapter 18 measures both.

``Fp8LoRAFunction`` is the node for one layer or a group; ``Fp8SwiGLULoRADownFunction`` is
``down_proj`` over the SwiGLU keeping gate and up, not their product (``kernels.lora``'s
``SwiGLULoRADownFunction`` says why). ``fp8_lora_linear`` is the functional form. ``kernels.hf.lora``
runs PEFT's LoRA layers through them once ``patch_llama(fp8_base=True)`` has converted the base.
"""

from __future__ import annotations

import torch

from . import ops
from .fp8 import fp8_matmul, quantize_rows, transpose_codes
from .fp8_linear import Fp8Weight, fp8_weight_grad_input_op, require_fp8
from .lora import adapter_columns, adapter_grads
from .swiglu import inplace_backward_allowed, swiglu_backward, swiglu_backward_, swiglu_forward

GRAD_INPUTS = ("fp8", "bf16")
# What the node keeps of x for dA: x itself ("bf16"), or the codes and row scales the forward's FP8
# GEMM read ("fp8": half the bytes; dA then sums FP8-rounded x, as an FP8 weight-gradient GEMM would).
SAVED_INPUTS = ("bf16", "fp8")
PER_LAYER = 5  # tensors per layer in ``Fp8LoRAFunction.apply``: codes, scales, bias, A, B


def base_grad_input(dy2: torch.Tensor, q: torch.Tensor, ws: torch.Tensor, grad_input: str = "fp8") -> torch.Tensor:
    """``dy · Ŵ`` for the frozen FP8 weight ``Ŵ = q · ws[:, None]`` (the module docstring).

    Args:
        dy2: [tokens, out] in bf16, fp16 or fp32.
        q, ws: the weight's codes [out, in] and float32 scales [out].
        grad_input: ``"fp8"`` (dy quantised per row with ws folded in, an FP8 GEMM) or ``"bf16"``
            (the dequantising bf16 GEMM).

    Returns:
        dx [tokens, in] in dy2's dtype.
    """
    if grad_input == "bf16":
        return ops.call(fp8_weight_grad_input_op, dy2, q, ws)
    dyq, dys = quantize_rows(dy2, q.dtype, col_scale=ws)
    # _scaled_mm wants the operand it reduces over K-major: the codes transposed, one byte each.
    qt = transpose_codes(q)
    ones = torch.ones(qt.shape[0], dtype=torch.float32, device=qt.device)
    return fp8_matmul(dyq, dys, qt, ones, out_dtype=dy2.dtype)


def group_forward(x2, qs, wss, biases, lora_as, lora_bs, scales):
    """(outputs, xa, xq, xs) of layers on one 2-D input ``x2`` [tokens, in]: x quantised once (xq,
    xs), one FP8 GEMM and one low-rank accumulate per layer.

    Args:
        x2: [tokens, in] in bf16, fp16 or fp32.
        qs, wss, biases: per layer, the codes [out_i, in], scales [out_i] and bias (or None).
        lora_as, lora_bs: per layer, A_i [r_i, in] and B_i [out_i, r_i] (cast to x2's dtype here).
        scales: per layer, s_i.

    Returns:
        ``([y_i [tokens, out_i]], xa [tokens, Σ r_i], xq, xs)``: the outputs, the adapters' first
        product, and x's codes and row scales.
    """
    xa = x2 @ torch.cat([a.to(x2.dtype) for a in lora_as]).t()
    xq, xs = quantize_rows(x2, qs[0].dtype)
    outputs = []
    for (lo, hi), q, ws, bias, b, s in zip(adapter_columns(lora_as), qs, wss, biases, lora_bs, scales):
        y = fp8_matmul(xq, xs, q, ws, out_dtype=x2.dtype)
        if bias is not None:
            y += bias.to(y.dtype)
        outputs.append(y.addmm_(xa[:, lo:hi], b.to(x2.dtype).t(), alpha=s))
    return outputs, xa, xq, xs


def group_backward(dys, x2, qs, wss, lora_as, lora_bs, xa, scales, need_dx: bool, grad_input: str):
    """(dx or None, [dA_i], [dB_i]) of the layers ``group_forward`` ran.

    Args:
        dys: per layer, the output's gradient [tokens, out_i].
        x2, qs, wss, lora_as, lora_bs, xa, scales: the forward's input, layers and ``xa``.
        need_dx: whether to compute dx.
        grad_input: one of ``GRAD_INPUTS``.

    Returns:
        dx [tokens, in] (None without ``need_dx``), and each adapter's gradients in its own dtype.
    """
    dxa, d_as, d_bs = adapter_grads(dys, x2, lora_as, lora_bs, xa, scales)
    if not need_dx:
        return None, d_as, d_bs
    dx = None
    for dy, q, ws in zip(dys, qs, wss):
        base = base_grad_input(dy, q, ws, grad_input)
        dx = base if dx is None else dx.add_(base)
    # The low-rank term joins the first FP8 GEMM's output in cuBLAS's β = 1 epilogue: no pass of
    # its own (the FP8 GEMM cannot accumulate into a tensor, so each further layer of a group costs
    # an add).
    return dx.addmm_(dxa, torch.cat([a.to(x2.dtype) for a in lora_as])), d_as, d_bs


def _layers(params) -> tuple[list, ...]:
    # (codes, scales, biases, As, Bs) from the flat per-layer arguments of apply().
    return tuple(list(params[i::PER_LAYER]) for i in range(PER_LAYER))


class Fp8LoRAFunction(torch.autograd.Function):
    """LoRA layers over FP8 bases on one input as one node. ``apply(x, grad_input, saved_input,
    scales, q_1, ws_1, bias_1, A_1, B_1, q_2, …)``: five per layer (a bias may be None); returns one
    2-D output [tokens, out_i] per layer. Gradients flow to x, the As and the Bs; the base is
    frozen."""

    @staticmethod
    def forward(ctx, x, grad_input, saved_input, scales, *params):
        """Every layer's output on x's rows; save x (or its codes and scales), xa, the codes,
        scales and adapters.

        Args:
            ctx: autograd's context.
            x: [..., in]; grad_input: one of ``GRAD_INPUTS``; saved_input: one of
            ``SAVED_INPUTS``; scales: one s_i per layer.
            params: five per layer: codes, scales, bias (or None), A, B.
        """
        qs, wss, biases, lora_as, lora_bs = _layers(params)
        x2 = x.reshape(-1, x.shape[-1])
        outputs, xa, xq, xs = group_forward(x2, qs, wss, biases, lora_as, lora_bs, scales)
        kept = (xq, xs) if saved_input == "fp8" else (x2,)
        ctx.save_for_backward(xa, *qs, *wss, *lora_as, *lora_bs, *kept)
        ctx.n, ctx.scales, ctx.grad_input, ctx.x_shape = len(qs), scales, grad_input, x.shape
        ctx.x_dtype = x.dtype
        return tuple(outputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *dys):
        """The gradients of x and of each A and B.

        Args:
            ctx: autograd's context.
            dys: one output gradient per layer.
        """
        xa, *rest = ctx.saved_tensors
        n = ctx.n
        qs, wss, lora_as, lora_bs = (rest[i * n:(i + 1) * n] for i in range(4))
        kept = rest[4 * n:]
        # x for dA: as saved, or dequantised from the forward's codes
        x2 = kept[0] if len(kept) == 1 else (kept[0].float() * kept[1][:, None]).to(ctx.x_dtype)
        dys = [dy.reshape(-1, dy.shape[-1]) for dy in dys]
        dx, d_as, d_bs = group_backward(dys, x2, qs, wss, lora_as, lora_bs, xa, ctx.scales,
                                        ctx.needs_input_grad[0], ctx.grad_input)
        needs = ctx.needs_input_grad[4:]
        grads = []
        for i in range(n):
            need_a, need_b = needs[PER_LAYER * i + 3], needs[PER_LAYER * i + 4]
            grads += [None, None, None, d_as[i] if need_a else None, d_bs[i] if need_b else None]
        return (None if dx is None else dx.reshape(ctx.x_shape), None, None, None, *grads)


class Fp8SwiGLULoRADownFunction(torch.autograd.Function):
    """``down_proj`` over ``swiglu(gate, up)`` with an FP8 base, keeping gate and up, not the product
    (recomputed in the backward for dA). ``apply(gate, up, grad_input, scale, q, ws, bias, A, B)``;
    returns [..., out]."""

    @staticmethod
    def forward(ctx, gate, up, grad_input, scale, q, ws, bias, lora_a, lora_b):
        """The product, then the layer over it; save gate, up, the codes, scales, adapters and xa.

        Args:
            ctx: autograd's context.
            gate, up: [..., intermediate]; grad_input: one of ``GRAD_INPUTS``; scale: s.
            q, ws, bias, lora_a, lora_b: the layer.
        """
        h2 = swiglu_forward(gate, up).reshape(-1, gate.shape[-1])
        (y,), xa, _, _ = group_forward(h2, [q], [ws], [bias], [lora_a], [lora_b], [scale])
        del h2
        ctx.save_for_backward(gate, up, q, ws, lora_a, lora_b, xa)
        ctx.scale, ctx.grad_input = scale, grad_input
        ctx.overwrite = inplace_backward_allowed(gate, up)
        return y.reshape(*gate.shape[:-1], q.shape[0])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        """The gradients of gate and up (over them where allowed), A and B.

        Args:
            ctx: autograd's context.
            dy: the output's gradient.
        """
        gate, up, q, ws, lora_a, lora_b, xa = ctx.saved_tensors
        h2 = swiglu_forward(gate, up).reshape(-1, gate.shape[-1])
        dh, (d_a,), (d_b,) = group_backward([dy.reshape(-1, dy.shape[-1])], h2, [q], [ws], [lora_a], [lora_b],
                                            xa, [ctx.scale], True, ctx.grad_input)
        del h2
        if ctx.overwrite:
            swiglu_backward_(dh.reshape(gate.shape), gate, up)  # d(gate), d(up) over gate and up
            d_gate, d_up = gate.detach(), up.detach()
        else:
            d_gate, d_up = swiglu_backward(dh.reshape(gate.shape), gate, up)
        return (d_gate, d_up, None, None, None, None, None, d_a if ctx.needs_input_grad[7] else None,
                d_b if ctx.needs_input_grad[8] else None)


def fp8_lora_linear(x: torch.Tensor, weight: Fp8Weight, lora_a: torch.Tensor, lora_b: torch.Tensor,
                    scale: float, grad_input: str = "fp8", saved_input: str = "bf16") -> torch.Tensor:
    """``x · Ŵᵀ + bias + s · (x · Aᵀ) · Bᵀ`` with the frozen weight in FP8, as one node (chapter 18).

    Args:
        x: [..., in] bfloat16, float16 or float32 on a device the FP8 kernels run on.
        weight: the frozen base (``Fp8Weight.from_linear``), [out, in], on x's device.
        lora_a, lora_b: A [r, in] and B [out, r], of one dtype (float32 or x's); gradients flow to
            them and to x.
        scale: s (PEFT's ``scaling``).
        grad_input: one of ``GRAD_INPUTS``.
        saved_input: one of ``SAVED_INPUTS``.

    Returns:
        [..., out] in x's dtype.

    Raises:
        TypeError: a non-tensor, dtypes that do not fit, ``weight`` not an ``Fp8Weight``.
        ValueError: shapes or devices that do not fit, an unknown ``grad_input``.
        RuntimeError: a device without the FP8 kernels (``fp8_linear.require_fp8``).
    """
    check_fp8_lora(x, weight, lora_a, lora_b, grad_input, saved_input)
    (y,) = Fp8LoRAFunction.apply(x, grad_input, saved_input, (float(scale),), weight.q, weight.scale, weight.bias,
                                 lora_a, lora_b)
    return y.reshape(*x.shape[:-1], weight.q.shape[0])


def check_fp8_lora(x, weight, lora_a, lora_b, grad_input: str, saved_input: str = "bf16") -> None:
    """A clear error unless ``fp8_lora_linear`` can compute these arguments.

    Args:
        x, weight, lora_a, lora_b, grad_input, saved_input: ``fp8_lora_linear``'s.

    Raises:
        TypeError, ValueError, RuntimeError: as ``fp8_lora_linear``.
    """
    if not isinstance(weight, Fp8Weight):
        raise TypeError(f"weight must be an Fp8Weight (Fp8Weight.from_linear), got {type(weight).__name__}")
    for name, t in (("x", x), ("lora_a", lora_a), ("lora_b", lora_b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        ops.check_kernel_dtype(name, t, "cast it first")
        if t.device != weight.q.device:
            raise ValueError(f"{name} must be on the weight's device {weight.q.device}, got {t.device}")
    if grad_input not in GRAD_INPUTS:
        raise ValueError(f"grad_input must be one of {GRAD_INPUTS}, got {grad_input!r}")
    if saved_input not in SAVED_INPUTS:
        raise ValueError(f"saved_input must be one of {SAVED_INPUTS}, got {saved_input!r}")
    out, k = weight.q.shape
    if x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"x must be [..., {k}] (the weight is [{out}, {k}]), got shape {tuple(x.shape)}")
    if lora_a.dim() != 2 or lora_a.shape[1] != k or lora_b.dim() != 2 or lora_b.shape != (out, lora_a.shape[0]):
        raise ValueError(f"lora_a must be [r, {k}] and lora_b [{out}, r], got {tuple(lora_a.shape)} and "
                         f"{tuple(lora_b.shape)}")
    if lora_a.dtype != lora_b.dtype:
        raise TypeError(f"lora_a and lora_b must share a dtype, got {lora_a.dtype} and {lora_b.dtype}")
    require_fp8(x.device)
