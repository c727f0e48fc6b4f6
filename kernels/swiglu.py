"""SwiGLU in Triton: the gated activation of Llama's MLP, forward and backward, as operators,
function and module.

    y = silu(gate) ⊙ up = gate · σ(gate) ⊙ up

Llama's MLP computes ``down_proj(silu(gate_proj(x)) * up_proj(x))``. Between the two matmuls, eager
PyTorch runs two elementwise kernels (silu, then the product) and keeps ``silu(gate)`` alive for the
backward pass. Here the forward reads gate and up once and writes y once; the backward reads dy,
gate and up once and writes d(gate) and d(up) once, recomputing σ(gate) in registers instead of
storing anything:

    d(up)   = dy ⊙ silu(gate)
    d(gate) = dy ⊙ up ⊙ σ(gate) · (1 + gate · (1 − σ(gate)))

Recomputing costs a few arithmetic operations per element, which a memory-bound kernel gets for
free; storing silu(gate) would cost a write in the forward and a read in the backward
(assets/notes/swiglu_rope.md counts them).

All arithmetic is float32 whatever the storage dtype; y is rounded once, when stored (Hugging Face
rounds silu(gate) to the input dtype before the product, so bfloat16 outputs can differ from it by
one rounding, and are closer to float64). ``gate`` and ``up`` may be strided views, e.g. the two
halves of one fused gate-and-up projection: rows are read through their stride, without a copy.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch.nn.modules import module as nn_module

from . import host_path, ops, runtime

# Rows as the kernels read them: a view with any row stride (the halves gu[..., :I] of a fused
# projection are one, with row stride 2·I), copied only when no such view exists. The same rule as
# RMSNorm's.
from .rmsnorm import as_rows
from .triton_utils import cast_to

# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _tile(pid_row, pid_col, n_rows, n_cols, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    # The [ROWS, BLOCK_N] tile of one program: its row indices in int64 (row * stride overflows
    # int32 once tokens × intermediate passes 2**31: 150K tokens at 14,336), its columns, and the
    # mask of the ragged edges.
    rows = pid_row.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = pid_col * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    return rows, cols, ok


@triton.jit
def swiglu_fwd_kernel(
    GATE, UP, Y,
    n_rows, n_cols, stride_gate, stride_up, stride_y,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The forward pass: ``silu(gate) * up`` into Y, one [ROWS, BLOCK_N] tile per program
    (``swiglu_forward``).

    Args:
        GATE, UP, Y: pointers to gate, up and the output, rows of unit column stride.
        n_rows, n_cols: the sizes; stride_gate, stride_up, stride_y: the row strides.
        ROWS, BLOCK_N: the tile's rows and columns.
    """
    rows, cols, ok = _tile(tl.program_id(0), tl.program_id(1), n_rows, n_cols, ROWS, BLOCK_N)
    g = tl.load(GATE + rows[:, None] * stride_gate + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    u = tl.load(UP + rows[:, None] * stride_up + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], cast_to(y, Y.dtype.element_ty), mask=ok)


@triton.jit
def swiglu_bwd_kernel(
    DY, GATE, UP, DGATE, DUP,
    n_rows, n_cols, stride_dy, stride_gate, stride_up, stride_dgate, stride_dup,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The backward pass: d(gate) and d(up) from dy, gate and up, one tile per program
    (``launch_backward``). DGATE and DUP may be GATE and UP: each element is loaded before it is
    stored, by the same program.

    Args:
        DY, GATE, UP: pointers to the inputs, rows of unit column stride.
        DGATE, DUP: pointers to the gradients of gate and up.
        n_rows, n_cols: the sizes; stride_*: each tensor's row stride.
        ROWS, BLOCK_N: the tile's rows and columns.
    """
    rows, cols, ok = _tile(tl.program_id(0), tl.program_id(1), n_rows, n_cols, ROWS, BLOCK_N)
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    g = tl.load(GATE + rows[:, None] * stride_gate + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    u = tl.load(UP + rows[:, None] * stride_up + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    # Recompute σ(gate) here rather than reading a stored silu(gate): arithmetic is free, bytes are
    # not.
    s = tl.sigmoid(g)
    silu = g * s
    d_up = dy * silu
    # silu'(g) = σ(g) + g·σ(g)·(1 − σ(g)) = σ(g)·(1 + g·(1 − σ(g)))
    d_gate = dy * u * s * (1.0 + g * (1.0 - s))
    tl.store(DGATE + rows[:, None] * stride_dgate + cols[None, :],
             cast_to(d_gate, DGATE.dtype.element_ty), mask=ok)
    tl.store(DUP + rows[:, None] * stride_dup + cols[None, :], cast_to(d_up, DUP.dtype.element_ty), mask=ok)


# --------------------------------------------------------------------------------------------------
# Launch configuration: one function per kernel, from the shape and the device's properties
# --------------------------------------------------------------------------------------------------

# The interpreter pays Python per program but runs each tile with NumPy: few, large programs.
_INTERPRETER_MAX_TILE = 1 << 18


@dataclass(frozen=True)
class Config:
    """A launch configuration of the SwiGLU kernels: the grid, the tile's rows and columns, and
    warps."""

    grid: tuple[int, int]  # (row blocks, column blocks)
    rows: int  # rows per program
    block_n: int  # columns per program (a power of two)
    num_warps: int


def _elementwise_config(n_rows: int, n_cols: int, props: runtime.DeviceProps, max_block: int,
                        max_warps: int, elements_per_warp: int) -> Config:
    """Tiles of an elementwise kernel: one row per program, the row in one tile of up to
    ``max_block`` columns."""
    if props.interpreter:
        block_n = min(triton.next_power_of_2(max(n_cols, 1)), _INTERPRETER_MAX_TILE)
        rows = min(triton.next_power_of_2(max(n_rows, 1)), max(1, _INTERPRETER_MAX_TILE // block_n))
        return Config((triton.cdiv(n_rows, rows), triton.cdiv(n_cols, block_n)), rows, block_n, 4)
    # Chosen by a launch sweep (assets/notes/swiglu_rope.md): the best tiles at every row count were
    # one row tall. The forward's spans the whole row (16,384 columns, 32 warps: 16 elements per
    # thread); the backward, which keeps three inputs and σ(gate) live, takes 2,048 columns with 16
    # warps (4 elements per thread). Dense tensors are read as rows of _RECUT_COLS (below) instead:
    # one 1,024-column tile per program, 4 warps forward and 8 backward.
    block_n = min(triton.next_power_of_2(max(n_cols, 1)), max_block)
    num_warps = max(4, min(max_warps, block_n // elements_per_warp))
    return Config((n_rows, triton.cdiv(n_cols, block_n)), 1, block_n, num_warps)


def forward_config(n_rows: int, n_cols: int, props: runtime.DeviceProps | None = None) -> Config:
    """Launch configuration of the forward kernel on ``props`` (default: this machine's device).

    Args:
        n_rows, n_cols: the rows the kernel reads and their width.
        props: the device's properties.

    Returns:
        the ``Config`` (cached per arguments).
    """
    return _forward_config(n_rows, n_cols, props or runtime.device_props())


@functools.lru_cache(maxsize=512)
def _forward_config(n_rows: int, n_cols: int, props: runtime.DeviceProps) -> Config:
    return _elementwise_config(n_rows, n_cols, props, max_block=16384, max_warps=32, elements_per_warp=512)


def backward_config(n_rows: int, n_cols: int, props: runtime.DeviceProps | None = None) -> Config:
    """Launch configuration of the backward kernel on ``props`` (default: this machine's device).

    Args:
        n_rows, n_cols: the rows the kernel reads and their width.
        props: the device's properties.

    Returns:
        the ``Config`` (cached per arguments).
    """
    return _backward_config(n_rows, n_cols, props or runtime.device_props())


@functools.lru_cache(maxsize=512)
def _backward_config(n_rows: int, n_cols: int, props: runtime.DeviceProps) -> Config:
    return _elementwise_config(n_rows, n_cols, props, max_block=2048, max_warps=16, elements_per_warp=128)


# --------------------------------------------------------------------------------------------------
# Host side: checks and launches
# --------------------------------------------------------------------------------------------------


def _check_inputs(gate: torch.Tensor, up: torch.Tensor) -> None:
    for name, t in (("gate", gate), ("up", up)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
        # The kernels store these dtypes and compute in float32; float64 is refused, as by every
        # kernel of the package: a float32 answer in a float64 tensor would look more precise than it is.
        ops.check_kernel_dtype(name, t, "cast to float32, or use torch.nn.functional.silu(gate) * up")
        if t.dim() == 0:
            raise ValueError(f"{name} must have at least one dimension (the intermediate size), got a scalar")
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have the same shape, got gate {tuple(gate.shape)} and up {tuple(up.shape)}")
    if gate.dtype != up.dtype:
        raise TypeError(f"gate and up must have the same dtype, got gate {gate.dtype} and up {up.dtype}")
    if gate.device != up.device:
        raise ValueError(f"gate and up must be on the same device, got gate on {gate.device} and up on {up.device}")
    if not runtime.INTERPRET and gate.device.type not in ("cuda", "meta"):  # meta: shapes only (the fakes)
        raise ValueError(f"in gpu mode gate and up must be CUDA tensors, got tensors on {gate.device}")


# Elementwise work does not care where rows end. When gate, up (and dy) are each one dense block,
# both kernels read them as rows of _RECUT_COLS elements instead of the model's rows (14,336 at the
# 8B shape): a power of two leaves no masked-off lanes, where one 16,384-column tile per row masks
# 2,048 (timings: assets/notes/swiglu_rope.md). An explicit ``config`` describes the tensors' own
# rows, so it turns the recut off.
_RECUT_COLS = 1024


def _dense_rows(numel: int, n_cols: int, config: Config | None) -> tuple[int, int]:
    """(rows, columns) in which the kernels read dense tensors of ``numel`` elements and rows of ``n_cols``:
    rows of ``_RECUT_COLS`` when the size divides and no ``config`` fixes the tensors' own rows."""
    if config is None and numel % _RECUT_COLS == 0:
        return numel // _RECUT_COLS, _RECUT_COLS
    return (numel // n_cols if n_cols else 0), n_cols


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor, config: Config | None = None) -> torch.Tensor:
    """Launch the forward kernel: ``silu(gate) * up``, a new contiguous tensor of gate's shape and dtype.

    The inputs are not checked here (``swiglu`` does it). An explicit ``config`` describes the
    tensors' own rows (no recut into rows of ``_RECUT_COLS``).

    Args:
        gate, up: of one shape and dtype, last dimension contiguous.
        config: a launch configuration; None picks ``forward_config``'s.

    Returns:
        ``silu(gate) * up``.
    """
    if gate.is_contiguous() and up.is_contiguous():
        # The common case, passed as it is: a kernel argument is a pointer, so contiguous tensors of
        # any rank are already rows of any width that divides their size (here _RECUT_COLS), and no
        # view is made on the host.
        y = torch.empty_like(gate)
        g, u = gate, up
        n_rows, n_cols = _dense_rows(gate.numel(), gate.shape[-1], config)
        stride_g = stride_u = n_cols
    else:
        y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        g, u = as_rows(gate), as_rows(up)
        n_rows, n_cols = g.shape
        stride_g, stride_u = g.stride(0), u.stride(0)
    if n_rows and n_cols:
        cfg = config or _forward_config(n_rows, n_cols, runtime.device_props(gate.device))
        swiglu_fwd_kernel[cfg.grid](
            g, u, y, n_rows, n_cols, stride_g, stride_u, n_cols,
            ROWS=cfg.rows, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
        )
    return y


def swiglu_backward(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, config: Config | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward kernel. Returns ``(d_gate, d_up)``, contiguous, in gate's shape and dtype.

    Args:
        dy: the gradient of the output; gate, up: the forward's inputs.
        config: a launch configuration; None picks ``backward_config``'s.

    Returns:
        ``(d_gate, d_up)``.
    """
    if gate.is_contiguous() and up.is_contiguous() and dy.is_contiguous():
        d_gate, d_up = torch.empty_like(gate), torch.empty_like(up)
        n_rows, n_cols = _dense_rows(gate.numel(), gate.shape[-1], config)
        if n_rows and n_cols:
            launch_backward(dy, gate, up, d_gate, d_up, n_rows, n_cols, (n_cols,) * 5, config)
        return d_gate, d_up
    # Strided views (the halves of one fused projection): rows through their strides.
    d_gate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    d_up = torch.empty(up.shape, dtype=up.dtype, device=up.device)
    g, u, d = as_rows(gate), as_rows(up), as_rows(dy)
    n_rows, n_cols = g.shape
    if n_rows and n_cols:
        strides = (d.stride(0), g.stride(0), u.stride(0), n_cols, n_cols)
        launch_backward(d, g, u, d_gate, d_up, n_rows, n_cols, strides, config)
    return d_gate, d_up


def launch_backward(d, g, u, d_gate, d_up, n_rows: int, n_cols: int, strides: tuple[int, ...],
                    config: Config | None = None) -> None:
    """The backward kernel on ``n_rows`` rows of ``n_cols``, each tensor's rows ``strides`` apart
    (dy, gate, up, d(gate), d(up)): d(gate) into ``d_gate``, d(up) into ``d_up`` (which may be ``g``
    and ``u`` themselves).

    Args:
        d, g, u: dy, gate and up.
        d_gate, d_up: where the gradients go.
        n_rows, n_cols: the rows read and their width.
        strides: the row strides of dy, gate, up, d(gate) and d(up), in that order.
        config: a launch configuration; None picks ``backward_config``'s.
    """
    cfg = config or _backward_config(n_rows, n_cols, runtime.device_props(g.device))
    swiglu_bwd_kernel[cfg.grid](
        d, g, u, d_gate, d_up, n_rows, n_cols, *strides,
        ROWS=cfg.rows, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
    )


def _in_place_addressable(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether the backward may write d(gate) over gate and d(up) over up: each dense (its rows are
    views, never copies) and in memory of its own (the two halves of one fused projection share a
    buffer, so they do not qualify)."""
    return (gate.is_contiguous() and up.is_contiguous()
            and gate.untyped_storage().data_ptr() != up.untyped_storage().data_ptr())


def _shares_memory(t: torch.Tensor, *others: torch.Tensor) -> bool:
    # Same storage, by its address: views of one buffer, whatever their offsets and strides.
    return any(t.untyped_storage().data_ptr() == o.untyped_storage().data_ptr() for o in others)


def may_overwrite(t: torch.Tensor) -> bool:
    """Whether a backward may write over ``t``: an intermediate result of autograd, never a leaf (a
    parameter, a caller's input) nor a view of one. A view's ``grad_fn`` is a view node even when
    its memory is a leaf's, so the tensor the view was cut from (``_base``) must be an intermediate
    result too.

    Args:
        t: the tensor.

    Returns:
        True when ``t`` and its base are outputs of autograd-recorded operations.
    """
    base = t._base if t._base is not None else t
    return t.grad_fn is not None and not t.is_leaf and base.grad_fn is not None and not base.is_leaf


def inplace_backward_allowed(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether ``swiglu(gate, up, inplace_backward=True)`` really writes its gradients over gate and
    up: in eager autograd on plain tensors, with gate and up intermediate results
    (``may_overwrite``), dense, and in memory of their own.

    Args:
        gate, up: ``swiglu``'s inputs.

    Returns:
        True when the in-place backward will be used.
    """
    return (not torch.compiler.is_compiling() and _has_memory(gate,
                                                              up) and may_overwrite(gate) and may_overwrite(up)
            and _in_place_addressable(gate, up))


def _has_memory(*tensors: torch.Tensor) -> bool:
    # Plain tensors with memory of their own, whose storage addresses can be compared: not fake
    # tensors (a subclass, while tracing) nor meta tensors, which take the out-of-place backward.
    return all(type(t) in (torch.Tensor, torch.nn.Parameter) and not t.is_meta for t in tensors)


def swiglu_backward_(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> None:
    """Launch the backward kernel writing d(gate) over ``gate`` and d(up) over ``up``.

    Every element is loaded before it is stored, by the same program, so the kernel may overwrite
    its inputs. ``gate`` and ``up`` must pass ``_in_place_addressable``.

    Args:
        dy: the gradient of the output (any row stride).
        gate, up: the forward's inputs, overwritten by their gradients.

    Raises:
        ValueError: gate or up not contiguous, or the two sharing a buffer.
    """
    if not _in_place_addressable(gate, up):
        raise ValueError("swiglu_bwd_ writes over gate and up: each must be contiguous and in memory of its own")
    if dy.is_contiguous():
        n_rows, n_cols = _dense_rows(gate.numel(), gate.shape[-1], None)
        d, strides = dy, (n_cols,) * 5
    else:
        d = as_rows(dy)
        n_rows, n_cols = d.shape
        strides = (d.stride(0),) + (n_cols,) * 4
    if n_rows and n_cols:
        launch_backward(d, gate, up, gate, up, n_rows, n_cols, strides)
    # A Triton store is invisible to autograd: bump the version counters by hand, as PyTorch's
    # in-place ops do.
    torch.autograd.graph.increment_version((gate, up))


# --------------------------------------------------------------------------------------------------
# PyTorch operators: torch.ops.kernels.swiglu_fwd, swiglu_bwd and swiglu_bwd_ (see kernels/ops.py)
# --------------------------------------------------------------------------------------------------


def _forward_fake(gate, up):
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)


def _backward_fake(dy, gate, up):
    return (torch.empty(gate.shape, dtype=gate.dtype, device=gate.device),
            torch.empty(up.shape, dtype=up.dtype, device=up.device))


swiglu_fwd_op = ops.define("swiglu_fwd(Tensor gate, Tensor up) -> Tensor", swiglu_forward, _forward_fake)
swiglu_bwd_op = ops.define(
    "swiglu_bwd(Tensor dy, Tensor gate, Tensor up) -> (Tensor, Tensor)", swiglu_backward, _backward_fake
)
swiglu_bwd_inplace_op = ops.define(
    "swiglu_bwd_(Tensor dy, Tensor(a!) gate, Tensor(b!) up) -> ()", swiglu_backward_, lambda dy,
    gate, up: None
)


# --------------------------------------------------------------------------------------------------
# The C++ host path (kernels.host_path): what it launches, and the Python path it falls back to
# --------------------------------------------------------------------------------------------------

# The host path launches these kernels by handle and, on a miss, runs this Python path. It imports
# no kernel family: each hands over what the host path needs when it is imported.
host_path.register_family(host_path.SwiGLUFamily(
    cols=_RECUT_COLS, forward=swiglu_forward, backward_op=swiglu_bwd_op, forward_config=_forward_config,
    backward_config=_backward_config, forward_kernel=swiglu_fwd_kernel, backward_kernel=swiglu_bwd_kernel,
))


# --------------------------------------------------------------------------------------------------
# autograd, function, module
# --------------------------------------------------------------------------------------------------


def _forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return ops.call(swiglu_fwd_op, gate, up)


def _backward_in_place(dy: torch.Tensor, gate: torch.Tensor,
                       up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """d(gate) and d(up), written over the saved gate and up. The operator declares its writes and
    bumps their version counters, so any other autograd node that saved them fails loudly ("modified
    by an inplace operation") instead of reading gradients."""
    ops.call(swiglu_bwd_inplace_op, dy, gate, up)
    return gate.detach(), up.detach()


class SwiGLUFunction(torch.autograd.Function):
    """autograd glue around the operators (their implementations directly in a plain eager call,
    ``ops.call``): the forward saves gate and up (the tensors autograd keeps for the matmuls anyway,
    so no extra memory); nothing else is stored.

    With ``inplace_backward`` the backward writes d(gate) and d(up) over the saved gate and up, so
    no new [..., intermediate] tensors exist at that moment of the backward (``swiglu``'s docstring
    says when that is safe).
    """

    @staticmethod
    def forward(ctx, gate, up, inplace_backward):
        """Save gate and up, and run the forward operator.

        Args:
            ctx: autograd's context.
            gate, up: as ``swiglu``'s.
            inplace_backward: whether the backward may write over gate and up (already checked
                with ``inplace_backward_allowed`` by ``swiglu``).
        """
        ctx.save_for_backward(gate, up)
        # The caller decided (``swiglu``: intermediate results only); the layout is checked here
        # once more.
        ctx.inplace = inplace_backward and _in_place_addressable(gate, up)
        return _forward(gate, up)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        """d(gate) and d(up), in place over the saved tensors when allowed.

        Args:
            ctx: autograd's context.
            dy: the gradient of the output.
        """
        gate, up = ctx.saved_tensors
        # A gradient that is itself a view of gate or up (a hand-written backward upstream) would be
        # read after it is overwritten: out of place then.
        inplace = ctx.inplace and not _shares_memory(dy, gate, up)
        d_gate, d_up = _backward_in_place(dy, gate, up) if inplace else ops.call(swiglu_bwd_op, dy, gate, up)
        return (d_gate if ctx.needs_input_grad[0] else None), (d_up if ctx.needs_input_grad[1] else None), None


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, inplace_backward: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` in one Triton kernel (and its backward in one more).

    ``gate`` and ``up`` have the same shape (any leading dimensions), dtype and device; either may
    be a strided view whose last dimension is contiguous (e.g. ``gu[..., :I]`` and ``gu[..., I:]``).
    The output has their dtype and shape. Works under ``torch.compile`` and CUDA graphs: the kernels
    are ``torch.ops.kernels.swiglu_fwd``/``_bwd``. Eagerly on a GPU, dense gate and up go through a
    C++ autograd node that launches the same kernels (``kernels.host_path``).

    ``inplace_backward=True`` lets the backward write d(gate) and d(up) over gate and up when each
    is the output of another operation (never a leaf such as a parameter or a caller's input, nor a
    view of one: ``h.view(4, 6)`` of a leaf ``h`` is its memory), contiguous, and in memory of its
    own; otherwise, and under ``torch.compile``, it falls back to the out-of-place backward, with
    the same gradients: the flag is a memory hint, never an error. Writing in place saves two
    tensors of gate's size at the backward's peak, and is safe only when nothing else reads gate and
    up after this backward: true of a Llama MLP's projection outputs. Anything that saved them for
    its own backward gets PyTorch's "modified by an inplace operation" error, not wrong gradients; a
    caller who keeps gate or up to read after the backward must not pass the flag. Chapter 11
    (notebooks/11_swiglu_rope.ipynb) derives it.

    Args:
        gate: the gate projection's output, [..., I].
        up: the up projection's output, of ``gate``'s shape, dtype and device.
        inplace_backward: let the backward write its gradients over gate and up (a memory hint).

    Returns:
        ``silu(gate) * up``, of ``gate``'s shape and dtype.

    Raises:
        TypeError: a non-tensor, an unsupported dtype, or gate and up of different dtypes.
        ValueError: a 0-d tensor, different shapes or devices, or non-CUDA tensors in gpu mode.
    """
    _check_inputs(gate, up)
    with_grad = torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)
    if host_path.takes(gate, up, inplace_backward):
        # Dense tensors on a GPU, eagerly: the same kernels, with the autograd node and the launches
        # in C++.
        return host_path.swiglu(gate, up, with_grad)
    if with_grad:
        # Leaves (parameters, a caller's inputs) and views of them are never overwritten: only
        # outputs of other operations. Under torch.compile the compiler plans the backward's memory
        # itself: the out-of-place operator.
        inplace_backward = inplace_backward and inplace_backward_allowed(gate, up)
        return SwiGLUFunction.apply(gate, up, inplace_backward)
    return _forward(gate, up)


class SwiGLUDownFunction(torch.autograd.Function):
    """``linear(swiglu(gate, up), weight, bias)`` keeping only gate and up for the backward.

    A linear layer saves its input for its weight's gradient; here that input, y = silu(gate) · up,
    is a tensor of gate's size that the SwiGLU backward does not need. So the forward frees y at
    once, and the backward recomputes it from gate and up (one elementwise kernel, the same bits)
    just for d(weight), freeing it again before d(y) exists. The backward writes d(gate) and d(up)
    over gate and up, as ``swiglu(..., inplace_backward=True)`` does. The forward keeps two [..., I]
    tensors instead of three, and the backward never holds more than three.
    """

    @staticmethod
    def forward(ctx, gate, up, weight, bias):
        """The product, then the linear layer; save gate, up and the weight (not the product).

        Args:
            ctx: autograd's context.
            gate, up: the projections' outputs.
            weight, bias: down_proj's parameters (bias may be None).
        """
        out = torch.nn.functional.linear(_forward(gate, up), weight, bias)
        ctx.save_for_backward(gate, up, weight)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out):
        """The gradients of gate and up (over the saved tensors), of the weight (from the product
        recomputed) and of the bias.

        Args:
            ctx: autograd's context.
            d_out: the gradient of the layer's output.
        """
        gate, up, weight = ctx.saved_tensors
        d_rows = d_out.reshape(-1, d_out.shape[-1])
        d_weight = d_bias = d_gate = d_up = None
        if ctx.needs_input_grad[2]:
            y = _forward(gate, up)
            d_weight = d_rows.t().mm(y.reshape(-1, y.shape[-1]))
            del y  # gone before d(y) is allocated below: gate, up and one more tensor at most
        if ctx.needs_input_grad[3]:
            d_bias = d_rows.sum(0)
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            # Under autocast the weight may be float32 while d_out is bf16: multiply in d_out's
            # dtype, as the forward's autocast did.
            d_gate, d_up = _backward_in_place(d_out.matmul(weight.to(d_out.dtype)), gate, up)
        return d_gate, d_up, d_weight, d_bias


def _global_module_hooks() -> bool:
    return bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)


class TritonSwiGLUMLP(torch.nn.Module):
    """Llama's MLP, ``down_proj(silu(gate_proj(x)) * up_proj(x))``, with the activation and product fused.

    ``from_hf(mlp)`` keeps the very same ``gate_proj``, ``up_proj`` and ``down_proj`` submodules, so
    parameter names, an optimizer created before, and PEFT adapter layers inside those projections
    are all unchanged.

    Memory: the SwiGLU backward writes its gradients over gate and up, and when ``down_proj`` is a
    plain ``nn.Linear`` the product silu(gate) · up is not kept for its weight's gradient but
    recomputed in the backward (``SwiGLUDownFunction``): two [tokens, intermediate] tensors kept per
    layer, where ``down_proj(swiglu(...))`` keeps three and Hugging Face's MLP four, and at most
    three alive in its backward. A ``down_proj`` with a ``forward_after_swiglu(gate, up)`` method (a
    fused PEFT LoRA layer, ``kernels.hf.lora``) is handed gate and up likewise, and recomputes the
    product for its adapter's gradient. Under ``torch.compile`` it is ``down_proj(swiglu(gate,
    up))``.

    Chapter 11 (notebooks/11_swiglu_rope.ipynb) builds it; chapters 14 and 17 use it.

    Args:
        gate_proj, up_proj, down_proj: the three projections, kept as given (``from_hf`` takes them
            from a Hugging Face MLP).
    """

    # Set to False (on the class or one module) to keep the product for down_proj as PyTorch would:
    # no recompute in the backward, one more [tokens, intermediate] tensor per layer.
    fuse_down_proj: bool = True

    def __init__(self, gate_proj: torch.nn.Module, up_proj: torch.nn.Module, down_proj: torch.nn.Module):
        super().__init__()
        self.gate_proj = gate_proj
        self.up_proj = up_proj
        self.down_proj = down_proj

    @classmethod
    def from_hf(cls, mlp: torch.nn.Module) -> TritonSwiGLUMLP:
        """A TritonSwiGLUMLP over ``mlp``'s own projections (no copy). ``mlp`` must use the SiLU
        activation.

        Args:
            mlp: a Llama-style MLP with ``gate_proj``, ``up_proj`` and ``down_proj``.

        Returns:
            the new module, sharing ``mlp``'s projections.

        Raises:
            TypeError: a projection is missing.
            ValueError: the activation (``config.hidden_act`` or ``act_fn``) is not SiLU.
        """
        missing = [name for name in ("gate_proj", "up_proj", "down_proj") if not hasattr(mlp, name)]
        if missing:
            raise TypeError(f"{type(mlp).__name__} has no {', '.join(missing)}: not a Llama-style gated MLP")
        act = getattr(getattr(mlp, "config", None), "hidden_act", None)
        if act is None:
            act_fn = getattr(mlp, "act_fn", None)
            # transformers' ACT2FN["silu"] is its own SiLUActivation, ACT2FN["swish"] torch's
            # nn.SiLU.
            act = "silu" if type(act_fn).__name__ in ("SiLU", "SiLUActivation") else repr(act_fn)
        if act not in ("silu", "swish"):
            raise ValueError(
                f"{type(mlp).__name__} uses the activation {act!r}; TritonSwiGLUMLP computes silu(gate) * up and "
                "replaces only MLPs whose hidden_act is 'silu'"
            )
        return cls(mlp.gate_proj, mlp.up_proj, mlp.down_proj)

    def _down_fuses(self, gate: torch.Tensor, up: torch.Tensor) -> bool:
        """Whether ``SwiGLUDownFunction`` may stand in for ``down_proj(swiglu(gate, up))``: in eager
        autograd, with gate and up the backward may overwrite, and ``down_proj`` a plain
        ``nn.Linear`` whose forward nothing hooks (a PEFT LoRA layer, a quantised layer or a
        sharding hook keeps its own forward)."""
        down = self.down_proj
        return (self.fuse_down_proj and torch.is_grad_enabled() and type(down) is torch.nn.Linear
                and not (down._forward_hooks or down._forward_pre_hooks) and not _global_module_hooks()
                and inplace_backward_allowed(gate, up))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``down_proj(silu(gate_proj(x)) * up_proj(x))``.

        Args:
            x: the MLP's input, [..., hidden].

        Returns:
            the MLP's output.
        """
        gate, up = self.gate_proj(x), self.up_proj(x)
        # gate and up are this forward's own temporaries: their backward may overwrite them
        # (swiglu's docstring), and with a plain down_proj the product is not kept for its weight's
        # gradient but recomputed. Not when a projection hands x itself (or a view of it) through,
        # e.g. an nn.Identity: x belongs to the caller.
        if (not torch.compiler.is_compiling() and isinstance(x, torch.Tensor) and _has_memory(x, gate, up)
                and _shares_memory(x, gate, up)):
            return self.down_proj(swiglu(gate, up))
        if self._down_fuses(gate, up):
            return SwiGLUDownFunction.apply(gate, up, self.down_proj.weight, self.down_proj.bias)
        out = self._down_after_swiglu(gate, up)
        return out if out is not None else self.down_proj(swiglu(gate, up, inplace_backward=True))

    def _down_after_swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
        """``down_proj.forward_after_swiglu(gate, up)``: a down_proj that computes
        ``down_proj(swiglu(gate, up))`` itself without keeping the product (``kernels.hf.lora``
        gives one to PEFT's fused LoRA layers), under the conditions of ``_down_fuses`` but the
        layer's type. None where down_proj has none or it declines the call."""
        down = self.down_proj
        after = getattr(down, "forward_after_swiglu", None)
        if (after is None or not (self.fuse_down_proj and torch.is_grad_enabled()) or down._forward_hooks
                or down._forward_pre_hooks or _global_module_hooks() or not inplace_backward_allowed(gate, up)):
            return None
        return after(gate, up)
