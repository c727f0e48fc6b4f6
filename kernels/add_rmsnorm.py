"""The residual add fused into RMSNorm: forward and backward kernels, operators, autograd, function.

    h = round_to_input_dtype(x + residual),    y = w ⊙ round_to_input_dtype(h · rstd(h))

A Llama decoder layer adds the attention's output to the residual stream and normalises the sum
(``post_attention_layernorm``). Unfused that is two passes over [tokens, hidden]: the add reads x
and residual and writes h, the norm reads h again. The forward kernel here reads x and residual
once, writes h (the residual stream goes on with it) and y, and keeps one float32 rstd per row.

h feeds both the norm and the rest of the residual stream, so its gradient is the sum of the norm's
backward and the gradient dh that comes back along the stream. The backward kernel reads h, dy, dh
and rstd and writes that sum once, as the gradient of both x and residual (the add passes its
gradient to both inputs unchanged). dW is reduced as ``kernels.rmsnorm`` reduces it: float32
partials per program of a persistent grid, summed in a fixed order by ``rms_norm_dw_kernel``.

The bytes this saves per layer, and the design: assets/notes/add_rmsnorm.md; chapter 17 teaches it.
All arithmetic is float32 whatever the storage dtype; values are cast only when stored.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from . import ops, rmsnorm, runtime
from .rmsnorm import (
    BackwardConfig,
    ForwardConfig,
    as_rows,
    cached_forward_config,
    check_tensors,
    out_dtype,
    rms_norm_dw_kernel,
)
from .triton_utils import cast_to, row_tile

# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def add_rms_norm_fwd_kernel(
    X, R, W, Y, H, RSTD,
    n_rows, n_cols, stride_x, stride_r, eps,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The forward pass: h = x + residual, y and one float32 rstd per row, ROWS rows per program
    (``add_rms_norm_forward`` launches it).

    Args:
        X, R, W: pointers to x and residual ([n_rows, n_cols], unit column stride) and the weight.
        Y, H, RSTD: pointers to the outputs y and h (contiguous rows) and rstd [n_rows].
        n_rows, n_cols: the sizes; stride_x, stride_r: the inputs' row strides; eps: the norm's.
        ROWS: rows per program; BLOCK_N: columns of a tile (a power of two ≥ n_cols).
    """
    # int64 row indices: row * stride overflows int32 once rows × hidden passes 2**31.
    rows, cols, row_ok, col_ok, ok = row_tile(n_rows, n_cols, ROWS, BLOCK_N)

    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)

    # Hugging Face adds in the input dtype, so the stream carries the rounded sum and the norm
    # reads that rounded value: round first, then normalise what was stored.
    h = cast_to(x + r, H.dtype.element_ty)
    tl.store(H + rows[:, None] * n_cols + cols[None, :], h, mask=ok)
    h = h.to(tl.float32)

    # Masked lanes loaded 0, so they add nothing to the sum; divide by the true width.
    rstd = tl.math.rsqrt(tl.sum(h * h, axis=1) / n_cols + eps)
    # LlamaRMSNorm casts the normalised value to the input dtype before the weight product.
    h_hat = cast_to(h * rstd[:, None], H.dtype.element_ty).to(tl.float32)
    y = h_hat * w[None, :]
    tl.store(Y + rows[:, None] * n_cols + cols[None, :], cast_to(y, Y.dtype.element_ty), mask=ok)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def add_rms_norm_bwd_kernel(
    H, W, DY, DH, RSTD, DX, DW_PARTIAL,
    n_rows, n_cols, stride_h, stride_dy, stride_dh,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, HAS_DH: tl.constexpr, COMPUTE_DW: tl.constexpr,
    STAGES: tl.constexpr,
):
    """The backward pass: dx = the norm's backward of dy, plus dh; with COMPUTE_DW one row of
    float32 dW partials per program (``add_rms_norm_backward`` launches it).

    Args:
        H, W, DY, DH, RSTD: pointers to the saved h, the weight, the two incoming gradients (dy of
            y, dh of h) and the saved rstd.
        DX, DW_PARTIAL: pointers to dx (contiguous rows) and the float32 partials [programs, n_cols].
        n_rows, n_cols: the sizes; stride_h, stride_dy, stride_dh: the row strides.
        ROWS, BLOCK_N: rows per block and columns of a tile.
        HAS_DH: whether dh is added; COMPUTE_DW: whether the partials are written.
        STAGES: software-pipeline stages of the loop over row blocks.
    """
    # A persistent grid, as in rms_norm_bwd_kernel: program p takes row blocks p, p + P, ... and
    # keeps its part of dW in registers until one [P, hidden] float32 write at the end.
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)

    n_blocks = tl.cdiv(n_rows, ROWS)
    for block in tl.range(pid, n_blocks, n_programs, num_stages=STAGES):
        rows = (block * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        row_ok = rows < n_rows
        ok = row_ok[:, None] & col_ok[None, :]

        h = tl.load(H + rows[:, None] * stride_h + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)

        h_hat = h * rstd[:, None]
        g = dy * w[None, :]  # gradient with respect to h_hat
        # dh_norm = rstd · (g − h_hat · mean(g ⊙ h_hat)), derived in notebook 03.
        c = tl.sum(g * h_hat, axis=1) / n_cols
        dx = rstd[:, None] * (g - h_hat * c[:, None])
        if HAS_DH:
            # Both gradients of h summed in float32 and rounded once (autograd, unfused, rounds each
            # to the input dtype and then adds them there).
            dx += tl.load(DH + rows[:, None] * stride_dh + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        tl.store(DX + rows[:, None] * n_cols + cols[None, :], cast_to(dx, DX.dtype.element_ty), mask=ok)

        if COMPUTE_DW:
            # The forward multiplied the weight by h_hat rounded to the input dtype: use that value.
            h_hat_stored = cast_to(h_hat, H.dtype.element_ty).to(tl.float32)
            dw_acc += tl.sum(dy * h_hat_stored, axis=0)

    if COMPUTE_DW:
        tl.store(DW_PARTIAL + pid.to(tl.int64) * n_cols + cols, dw_acc, mask=col_ok)


# --------------------------------------------------------------------------------------------------
# Launch configuration: RMSNorm's, with room for the extra tile
# --------------------------------------------------------------------------------------------------


def forward_config(n_rows: int, n_cols: int, props: runtime.DeviceProps | None = None) -> ForwardConfig:
    """Launch configuration of the forward kernel on ``props`` (default: this machine's device).

    RMSNorm's forward configuration: its tiles leave registers for two live tiles, and this
    forward holds two (x and residual; h replaces them).

    Args:
        n_rows: rows (tokens) of x.
        n_cols: the hidden size.
        props: the device's properties.

    Returns:
        The ``kernels.rmsnorm.ForwardConfig`` to launch ``add_rms_norm_fwd_kernel`` with.
    """
    return cached_forward_config(n_rows, n_cols, props or runtime.device_props())


def backward_config(n_rows: int, n_cols: int, itemsize: int = 2,
                    props: runtime.DeviceProps | None = None) -> BackwardConfig:
    """Launch configuration of the backward kernels on ``props`` (default: this machine's device).

    Args:
        n_rows: rows (tokens) of h.
        n_cols: the hidden size.
        itemsize: bytes per element of h, dy and dh.
        props: the device's properties.

    Returns:
        The ``kernels.rmsnorm.BackwardConfig`` to launch ``add_rms_norm_bwd_kernel`` and the dW sum
        with.
    """
    return cached_backward_config(n_rows, n_cols, itemsize, props or runtime.device_props())


@functools.lru_cache(maxsize=512)
def cached_backward_config(n_rows: int, n_cols: int, itemsize: int,
                           props: runtime.DeviceProps) -> BackwardConfig:
    """``backward_config`` for given ``props``, cached: what the launches ask for on every call.

    Args:
        n_rows, n_cols: h's rows and hidden size.
        itemsize: bytes per element of h, dy and dh.
        props: the device's properties (hashable: the cache's key).

    Returns:
        RMSNorm's ``BackwardConfig``, with fewer pipeline stages where dh's tile leaves no room.
    """
    base = rmsnorm.cached_backward_config(n_rows, n_cols, itemsize, props)
    if props.interpreter or base.stages == 1:
        return base
    # RMSNorm's pipeline stage holds a tile of x and one of dy; here a stage also holds dh, so fewer
    # stages may fit in one program's shared memory.
    stage_bytes = 3 * base.rows * base.block_n * itemsize
    return dataclasses.replace(base, stages=max(1, min(base.stages, props.shared_mem_per_block // stage_bytes)))


# --------------------------------------------------------------------------------------------------
# Host side: checks and launches
# --------------------------------------------------------------------------------------------------


def check_inputs(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> None:
    """Types, dtypes, shapes and devices of ``add_rms_norm``'s inputs: a TypeError or ValueError
    naming the argument.

    Args:
        x: what is added to the residual stream, [..., hidden].
        residual: the residual stream, x's shape and dtype, on x's device.
        weight: the norm's scale, ``(hidden,)``.

    Raises:
        TypeError: a non-tensor, an unsupported dtype, or a residual of another dtype than x's.
        ValueError: mismatched shapes or devices, or a non-CUDA tensor in gpu mode.
    """
    check_tensors(x, weight)
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"residual must be a tensor, got {type(residual).__name__}")
    if residual.dtype != x.dtype:
        raise TypeError(f"residual must have x's dtype {x.dtype}, got {residual.dtype}: Hugging Face's sum of the "
                        "two would be promoted; cast one of them first")
    if residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    if residual.device != x.device:
        raise ValueError(f"x and residual must be on the same device, got {x.device} and {residual.device}")
    # meta: shapes only, by the fake operators
    if not runtime.INTERPRET and x.device.type not in ("cuda", "meta"):
        raise ValueError(f"in gpu mode the inputs must be CUDA tensors, got a tensor on {x.device}")


def add_rms_norm_forward(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                         config: ForwardConfig | None = None):
    """Launch the forward kernel. Returns ``(y, h, rstd)``: the normalised sum, the sum (both of
    x's shape, h contiguous) and a float32 rstd per row.

    Rows of x and residual may have any row stride (``as_rows``); the weight is read with unit
    stride (a strided one is copied first, ``hidden`` values). The inputs are not checked here
    (``check_inputs`` does it).

    Args:
        x, residual: [..., hidden], of one shape and dtype.
        weight: the norm's scale, ``(hidden,)``.
        eps: added to the mean of squares.
        config: a launch configuration; None picks ``forward_config``'s.
    """
    weight = weight.contiguous()
    x_rows, r_rows = as_rows(x), as_rows(residual)
    n_rows, n_cols = x_rows.shape
    y = torch.empty(x.shape, dtype=out_dtype(x.dtype, weight.dtype), device=x.device)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    # No columns: rows of nothing have no rstd, as in RMSNorm's operators.
    rstd = torch.empty(n_rows if n_cols else 0, dtype=torch.float32, device=x.device)
    if n_rows and n_cols:
        cfg = config or cached_forward_config(n_rows, n_cols, runtime.device_props(x.device))
        add_rms_norm_fwd_kernel[cfg.grid](
            x_rows, r_rows, weight, y, h, rstd, n_rows, n_cols, x_rows.stride(0), r_rows.stride(0), eps,
            ROWS=cfg.rows, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
        )
    return y, h, rstd


def add_rms_norm_backward(dy: torch.Tensor, dh: torch.Tensor | None, h: torch.Tensor, weight: torch.Tensor,
                          rstd: torch.Tensor, compute_dw: bool = True, config: BackwardConfig | None = None):
    """Launch the backward kernels. Returns ``(dx, dw)``: dx (the gradient of both x and residual)
    contiguous in h's shape and dtype; dw in weight's shape and dtype (empty, shape [0], when
    ``compute_dw`` is false). ``dh`` None: no gradient came back along the residual stream.

    Args:
        dy: the gradient of y; dh: the gradient of h, or None.
        h, weight, rstd: what the forward saved (h, the weight, the float32 rstd per row).
        compute_dw: whether to compute the weight's gradient.
        config: a launch configuration; None picks ``backward_config``'s.
    """
    weight = weight.contiguous()
    h_rows, dy_rows = as_rows(h), as_rows(dy)
    dh_rows = as_rows(dh) if dh is not None else dy_rows  # dy_rows: a placeholder the kernel never reads
    n_rows, n_cols = h_rows.shape
    dx = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    if n_rows == 0 or n_cols == 0:  # no rows: dW sums nothing; no columns: nothing to compute
        if dh is not None:
            dx.copy_(dh)
        return dx, (torch.zeros_like(weight) if compute_dw else weight.new_empty(0))
    dw = torch.empty_like(weight) if compute_dw else weight.new_empty(0)
    cfg = config or cached_backward_config(n_rows, n_cols, h.element_size(), runtime.device_props(h.device))
    partial = torch.empty((cfg.grid[0], n_cols), dtype=torch.float32, device=h.device) if compute_dw else dx
    add_rms_norm_bwd_kernel[cfg.grid](
        h_rows, weight, dy_rows, dh_rows, rstd, dx, partial,
        n_rows, n_cols, h_rows.stride(0), dy_rows.stride(0), dh_rows.stride(0),
        ROWS=cfg.rows, BLOCK_N=cfg.block_n, HAS_DH=dh is not None, COMPUTE_DW=compute_dw,
        STAGES=cfg.stages, num_warps=cfg.num_warps,
    )
    if compute_dw:
        rms_norm_dw_kernel[cfg.dw_grid](
            partial, dw, cfg.grid[0], n_cols, BLOCK_P=cfg.dw_block_p, BLOCK_C=cfg.dw_block_c, num_warps=4,
        )
    return dx, dw


# --------------------------------------------------------------------------------------------------
# PyTorch operators: torch.ops.kernels.add_rms_norm_fwd and add_rms_norm_bwd (see kernels/ops.py)
# --------------------------------------------------------------------------------------------------


def add_rms_norm_fwd_fake(x, residual, weight, eps):
    """The fake implementation of ``add_rms_norm_fwd``: ``(y, h, rstd)`` as empty tensors of the
    right shapes and dtypes.

    Args:
        x, residual, weight, eps: the operator's arguments, as ``add_rms_norm_forward``'s.
    """
    n_rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    y = torch.empty(x.shape, dtype=out_dtype(x.dtype, weight.dtype), device=x.device)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return y, h, torch.empty(n_rows, dtype=torch.float32, device=x.device)


def add_rms_norm_bwd_fake(dy, dh, h, weight, rstd, compute_dw):
    """The fake implementation of ``add_rms_norm_bwd``: ``(dx, dw)`` as empty tensors (dw empty,
    shape [0], without ``compute_dw``).

    Args:
        dy, dh, h, weight, rstd, compute_dw: the operator's arguments, as
            ``add_rms_norm_backward``'s.
    """
    dx = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    return dx, (torch.empty(weight.shape, dtype=weight.dtype, device=weight.device) if compute_dw
                else weight.new_empty(0))


add_rms_norm_fwd_op = ops.define(
    "add_rms_norm_fwd(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor, Tensor)",
    add_rms_norm_forward, add_rms_norm_fwd_fake,
)
add_rms_norm_bwd_op = ops.define(
    "add_rms_norm_bwd(Tensor dy, Tensor? dh, Tensor h, Tensor weight, Tensor rstd, bool compute_dw) "
    "-> (Tensor, Tensor)",
    add_rms_norm_backward, add_rms_norm_bwd_fake,
)


# --------------------------------------------------------------------------------------------------
# autograd, function
# --------------------------------------------------------------------------------------------------


class AddRMSNormFunction(torch.autograd.Function):
    """autograd glue around the two operators: the forward saves h (its own output, no copy), the
    weight and one float32 rstd per row. Either output's gradient may be None (grads are not
    materialised): without dy the gradient of x and residual is dh itself and no kernel runs;
    without dh the backward kernel skips its load."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        """Run the forward operator and save h, the weight and rstd.

        Args:
            ctx: autograd's context.
            x, residual, weight, eps: as ``add_rms_norm``'s.
        """
        y, h, rstd = ops.call(add_rms_norm_fwd_op, x, residual, weight, eps)
        ctx.save_for_backward(h, weight, rstd)
        ctx.set_materialize_grads(False)
        return y, h

    @staticmethod
    def backward(ctx, dy, dh):
        """The gradients of x, residual (one tensor, twice) and the weight.

        Args:
            ctx: autograd's context.
            dy, dh: the gradients of y and h, each possibly None.
        """
        h, weight, rstd = ctx.saved_tensors
        if dy is None:
            dx, dw = dh, None  # y unused: the add's gradient alone, passed on as autograd's add does
        else:
            compute_dw = ctx.needs_input_grad[2]
            dx, dw = ops.call(add_rms_norm_bwd_op, dy, dh, h, weight, rstd, compute_dw)
            dw = dw if compute_dw else None
        # The add passes one gradient to both inputs: the same tensor, as PyTorch's own add does.
        return (dx if ctx.needs_input_grad[0] else None), (dx if ctx.needs_input_grad[1] else None), dw, None


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and Llama's RMSNorm of the sum, in one kernel forward and one backward.

    Computes ``h = x + residual`` in the input dtype and ``y = LlamaRMSNorm(h)``, bit for bit the
    casts of Hugging Face's ``hidden_states = residual + hidden_states`` followed by its norm.
    Both outputs are differentiable; the gradient of x and of residual is the norm's backward plus
    the gradient of h. Works under ``torch.compile``: the kernels are the operators
    ``torch.ops.kernels.add_rms_norm_fwd``/``_bwd``. Chapter 17 (notebooks/17_whole_step.ipynb)
    derives it.

    Args:
        x: the sublayer's output, [..., hidden], any leading dimensions, possibly a strided view.
        residual: the residual stream, of x's shape, dtype and device.
        weight: the norm's scale, ``(hidden,)``.
        eps: added to the mean of squares before the square root.

    Returns:
        ``(y, h)``: ``weight * h / sqrt(mean(h²) + eps)`` (dtype of ``weight * h``) and ``h = x +
        residual`` (x's dtype), both of x's shape.

    Raises:
        TypeError, ValueError: from ``check_inputs``, naming the argument.
    """
    check_inputs(x, residual, weight)
    eps = float(eps)
    if torch.is_grad_enabled() and (x.requires_grad or residual.requires_grad or weight.requires_grad):
        return AddRMSNormFunction.apply(x, residual, weight, eps)
    y, h, _ = ops.call(add_rms_norm_fwd_op, x, residual, weight, eps)
    return y, h
