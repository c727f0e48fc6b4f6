"""Llama's MLP over the sequence in tiles of rows: its [tokens, intermediate] tensors exist for one
tile at a time.

A Llama MLP computes ``down_proj(silu(gate_proj(x)) * up_proj(x))``. Every row (token) is
independent of every other, so the rows can be cut into tiles and each tile pushed through the three
projections on its own. Untiled, a step at 500K tokens of the Llama-3.1-8B shape (intermediate
14,336) holds gate, up and their product, each 500K × 14,336 × 2 bytes = 13.4 GiB, in the one layer
being recomputed; tiled, the same three tensors take tile × 14,336 × 2 bytes each, whatever the
sequence length.

``TiledSwiGLUFunction`` is the ``autograd.Function`` that does it:

* **forward**: for each tile, gate = x_t·W_gateᵀ and up = x_t·W_upᵀ, y = silu(gate)·up
  (``kernels.swiglu``'s forward kernel), out_t = y·W_downᵀ written into the output's rows. It saves
  only x and the three weights.
* **backward**: for each tile, gate and up are recomputed from the saved x; y is recomputed for
  d(W_down) = dout_tᵀ·y and freed; dy = dout_t·W_down; the SwiGLU backward kernel writes d(gate) and
  d(up) over gate and up (they are this tile's own temporaries); d(W_gate) += d(gate)ᵀ·x_t, d(W_up)
  += d(up)ᵀ·x_t; dx_t = d(gate)·W_gate + d(up)·W_up is written into dx's rows. The weight gradients
  are sums over tiles: they accumulate in float32 by default (each tile's product rounded once to
  the weights' dtype, as one matmul over all rows would round its result once), or in the weights'
  dtype (``grad_dtype=None``: a rounding per tile, no float32 buffers).

**Under checkpointing the recompute is skipped.** A checkpointed decoder layer runs its forward
twice: once in the forward pass, and once more in the backward, to rebuild what the layer's backward
reads (PyTorch's non-reentrant checkpoint stops that recompute as soon as the last of those tensors
is saved again). The tiled MLP's backward reads only x and the weights, and recomputes gate and up
itself, tile by tile. So when its forward runs during a backward pass (``recomputing()``: autograd
is executing a graph), it saves x and the weights and computes nothing: its output is a tensor of
NaN that nothing reads (a Llama layer only adds it to the residual stream, and the recompute stops
or its result is dropped; a model that did read it would get NaN gradients, not quietly wrong ones).
Counted in matmuls, a checkpointed step then does what the untiled MLP does: gate and up three times
(forward, backward's recompute, the gradient), down twice, where computing the output in the
recompute too would add a whole MLP forward per layer. ``skip_recompute=False`` computes it anyway.

What is left of the cost is the weight gradients' accumulation over tiles (one more pass over the
float32 sums per tile) and the loop. The tile length comes from ``tile_rows`` (the sizes and the
free memory), never a fixed number.

``TiledSwiGLUMLP`` is a drop-in for a ``LlamaMLP`` holding the very same projection modules, and
``apply_tiled_mlp(model)`` swaps every decoder layer's MLP for one, returning a handle that undoes
it. Plain ``nn.Linear`` projections without bias only (LoRA-wrapped or quantised layers keep their
own forward and are refused). Eager only: under ``torch.compile`` the module's forward is left out
of the graph and runs eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels import runtime
from kernels.swiglu import TritonSwiGLUMLP, swiglu_backward_, swiglu_forward

# Tiles are a multiple of this many rows: matmul kernels work in blocks of 64 to 256 rows, so a
# ragged tile length would leave a partly filled block in every tile instead of only in the last
# one.
ALIGN = 64
# The share of free GPU memory one tile's working set may take. The rest of the step lives beside it
# (the checkpoints, the gradients the backward allocates, attention's working set), and the free
# memory is read in the forward, before the backward has allocated the weight gradients.
FREE_FRACTION = 1 / 16
# A tile's working set is capped here: beyond a few thousand rows a matmul of the 8B shape is no
# faster per row (a 4,096 × 4,096 × 14,336 product already fills an H100), so a larger tile would
# only take memory. At the 8B shape 512 MiB is about 5,700 rows.
MAX_TILE_BYTES = 512 << 20
# Without a GPU there is no free-memory reading that matters: the interpreter's tiles get this
# documented budget.
CPU_TILE_BYTES = 32 << 20


def tile_bytes_per_row(hidden: int, intermediate: int, dtype: torch.dtype) -> int:
    """Bytes one row of a tile keeps alive at the tile's peak: gate, up and a third [rows,
    intermediate] tensor (the product y in the forward, dy in the backward) and one [rows, hidden]
    output row, in ``dtype``. Chapter 14 (``notebooks/14_long_context.ipynb``) sizes its tiles with
    it.

    Args:
        hidden: the model's hidden size.
        intermediate: the MLP's intermediate size.
        dtype: the activations' dtype.

    Returns:
        ``(3 * intermediate + hidden)`` elements of ``dtype``, in bytes.
    """
    size = torch.empty((), dtype=dtype).element_size()
    return (3 * intermediate + hidden) * size


def free_device_bytes(device: torch.device | None = None) -> int:
    """GPU memory a new allocation can get without a cudaMalloc failing: what the driver reports
    free plus what PyTorch's caching allocator holds but does not use.

    Args:
        device: the CUDA device (None: the current one).

    Returns:
        The bytes free to a new allocation.
    """
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def tile_rows(n_rows: int, hidden: int, intermediate: int, dtype: torch.dtype,
              free_bytes: int | None = None) -> int:
    """Rows per tile: as many as keep one tile's working set (``tile_bytes_per_row``) within
    ``FREE_FRACTION`` of ``free_bytes`` and within ``MAX_TILE_BYTES``, rounded down to a multiple of
    ``ALIGN`` (at least ``ALIGN``), and no more than ``n_rows`` rounded up to ``ALIGN`` (one tile
    for a short input).

    ``free_bytes`` defaults to the free GPU memory (``free_device_bytes``); without a GPU the budget
    is ``CPU_TILE_BYTES`` instead of a fraction of free memory. Chapter 14
    (``notebooks/14_long_context.ipynb``) computes its tiles with it.

    Args:
        n_rows: the rows (tokens) of the input.
        hidden: the model's hidden size.
        intermediate: the MLP's intermediate size.
        dtype: the activations' dtype.
        free_bytes: the free memory to take a share of (None: read it, or ``CPU_TILE_BYTES``).

    Returns:
        Rows per tile, a positive multiple of ``ALIGN``.

    Raises:
        ValueError: a size is not a positive int, or ``free_bytes`` not a non-negative int.
    """
    for name, value in (("n_rows", n_rows), ("hidden", hidden), ("intermediate", intermediate)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if free_bytes is None:
        budget = int(free_device_bytes() * FREE_FRACTION) if runtime.MODE == "gpu" else CPU_TILE_BYTES
    else:
        if not isinstance(free_bytes, int) or isinstance(free_bytes, bool) or free_bytes < 0:
            raise ValueError(f"free_bytes must be a non-negative int, got {free_bytes!r}")
        budget = int(free_bytes * FREE_FRACTION)
    rows = min(budget, MAX_TILE_BYTES) // tile_bytes_per_row(hidden, intermediate, dtype)
    rows = max(ALIGN, rows // ALIGN * ALIGN)
    return min(rows, -(-n_rows // ALIGN) * ALIGN)


def tile_bounds(n_rows: int, rows_per_tile: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each tile over ``n_rows`` rows: consecutive, not overlapping, the last
    one partial when ``rows_per_tile`` does not divide ``n_rows``. Chapter 14
    (``notebooks/14_long_context.ipynb``) cuts its tiles with it.

    Args:
        n_rows: the rows to cover.
        rows_per_tile: rows per tile (positive).

    Returns:
        The tiles' bounds in order; empty for ``n_rows == 0``.
    """
    return [(start, min(start + rows_per_tile, n_rows)) for start in range(0, n_rows, rows_per_tile)]


# --------------------------------------------------------------------------------------------------
# The autograd function
# --------------------------------------------------------------------------------------------------


def _check_inputs(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                  rows: int) -> None:
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
        raise ValueError(f"tile_rows must be a positive int, got {rows!r}")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got dtype {x.dtype}")
    hidden = x.shape[-1]
    inter = w_gate.shape[0]
    expected = {"w_gate": (inter, hidden), "w_up": (inter, hidden), "w_down": (hidden, inter)}
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if tuple(w.shape) != expected[name]:
            raise ValueError(f"{name} must have shape {expected[name]} for x of width {hidden}, got {tuple(w.shape)}")
        if w.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {w.dtype} but x has {x.dtype}: the projections and x must match")
        if w.device != x.device:
            raise ValueError(f"{name} is on {w.device} but x is on {x.device}")


def _mlp_tile(x_t: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> tuple[torch.Tensor,
                                                                                    torch.Tensor]:
    """gate and up of one tile: two new contiguous [rows, intermediate] tensors."""
    return torch.mm(x_t, w_gate.t()), torch.mm(x_t, w_up.t())


def recomputing() -> bool:
    """True while autograd executes a backward pass. A decoder layer's forward that runs then is
    gradient checkpointing recomputing it (reentrant or not): the only caller that runs a forward
    inside a backward. Chapter 14 (``notebooks/14_long_context.ipynb``) explains the recompute it
    lets the tiled MLP skip.

    Returns:
        Whether autograd is executing a backward pass (a graph task is current).
    """
    return torch._C._current_graph_task_id() != -1


# (device type, operand dtype, sum dtype) -> whether torch.addmm(..., out_dtype=) adds a
# low-precision product into a float32 sum in one matmul on that device (CUDA in recent PyTorch
# releases), found by trying it once.
_MIXED_ADDMM: dict[tuple[str, torch.dtype, torch.dtype], bool] = {}


def _mixed_addmm_works(acc: torch.Tensor, a: torch.Tensor) -> bool:
    key = (acc.device.type, a.dtype, acc.dtype)
    if key not in _MIXED_ADDMM:
        ones = torch.ones(2, 2, dtype=a.dtype, device=a.device)
        total = torch.ones(2, 2, dtype=acc.dtype, device=acc.device)
        try:
            torch.addmm(total, ones, ones, out_dtype=acc.dtype, out=total)
            _MIXED_ADDMM[key] = bool((total == 3).all())
        except (RuntimeError, TypeError, NotImplementedError):
            _MIXED_ADDMM[key] = False
    return _MIXED_ADDMM[key]


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b``. In the operands' dtype the matmul adds into acc itself. Into a float32 acc
    from bf16 operands, one mixed-precision addmm does the same where the device has it (the product
    is summed in float32 without being rounded); elsewhere the tile's product is rounded once to the
    operands' dtype and then added."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    elif _mixed_addmm_works(acc, a):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.add_(torch.mm(a, b))


class TiledSwiGLUFunction(torch.autograd.Function):
    """``down(silu(x·W_gateᵀ) · (x·W_upᵀ))`` over tiles of ``tile_rows`` rows, saving x and the
    weights only (see the module docstring for the passes). ``grad_dtype`` is the dtype the weight
    gradients accumulate in (None: the weights' own). ``skip_output``: save what the backward needs
    and return NaN instead of computing the output (for a checkpoint's recompute, which reads only
    what is saved).

    Its ``forward`` arguments, after ``ctx``: ``x`` [..., hidden]; ``w_gate``, ``w_up``
    [intermediate, hidden] and ``w_down`` [hidden, intermediate], in x's dtype and on its device;
    ``rows`` per tile; ``grad_dtype``; ``skip_output``. Its ``backward`` returns the gradients of x
    and the three weights (None where not needed) and None for the rest.
    """

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, rows: int, grad_dtype, skip_output: bool = False):
        """The MLP's output, tile by tile; only x and the weights are saved.

        Args:
            ctx: autograd's context.
            x: [..., hidden].
            w_gate, w_up: [intermediate, hidden]; w_down: [hidden, intermediate], in x's dtype and
                on its device.
            rows: rows per tile.
            grad_dtype: the weight gradients' accumulation dtype (None: the weights' own).
            skip_output: save only, and return a tensor of NaN of x's shape.

        Returns:
            The output, of x's shape and dtype.

        Raises:
            ValueError: ``rows`` is not a positive int, or a weight's shape or device does not
                match x.
            TypeError: x is not floating point, or a weight's dtype differs from x's.
        """
        _check_inputs(x, w_gate, w_up, w_down, rows)
        ctx.save_for_backward(x, w_gate, w_up, w_down)
        ctx.rows, ctx.grad_dtype = rows, grad_dtype
        if skip_output:
            return torch.full_like(x, float("nan"))
        flat = x.reshape(-1, x.shape[-1])
        out = torch.empty(flat.shape, dtype=x.dtype, device=x.device)
        for start, stop in tile_bounds(flat.shape[0], rows):
            gate, up = _mlp_tile(flat[start:stop], w_gate, w_up)
            y = swiglu_forward(gate, up)
            del gate, up  # freed before the down projection's output exists: three tile tensors at most
            torch.mm(y, w_down.t(), out=out[start:stop])
        return out.view(x.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out):
        """Gradients tile by tile, gate and up recomputed from the saved x.

        Args:
            ctx: autograd's context, with x and the weights saved.
            d_out: the output's gradient, of x's shape.

        Returns:
            ``(dx, d_w_gate, d_w_up, d_w_down, None, None, None)``, None for an input that needs
            no gradient; the weight gradients in the weights' dtype.
        """
        x, w_gate, w_up, w_down = ctx.saved_tensors
        need_x, need_gate, need_up, need_down = ctx.needs_input_grad[:4]
        flat = x.reshape(-1, x.shape[-1])
        d_flat = d_out.reshape(-1, d_out.shape[-1])
        acc_dtype = ctx.grad_dtype or w_gate.dtype
        dx = torch.empty(flat.shape, dtype=x.dtype, device=x.device) if need_x else None
        d_gate_w = torch.zeros(w_gate.shape, dtype=acc_dtype, device=x.device) if need_gate else None
        d_up_w = torch.zeros(w_up.shape, dtype=acc_dtype, device=x.device) if need_up else None
        d_down_w = torch.zeros(w_down.shape, dtype=acc_dtype, device=x.device) if need_down else None
        for start, stop in tile_bounds(flat.shape[0], ctx.rows):
            x_t, d_t = flat[start:stop], d_flat[start:stop]
            gate, up = _mlp_tile(x_t, w_gate, w_up)
            if need_down:
                y = swiglu_forward(gate, up)
                _accumulate(d_down_w, d_t.t(), y)
                del y  # gone before dy is allocated: gate, up and one more tile tensor at most
            dy = torch.mm(d_t, w_down)
            swiglu_backward_(dy, gate, up)  # gate and up now hold d(gate) and d(up)
            del dy
            if need_gate:
                _accumulate(d_gate_w, gate.t(), x_t)
            if need_up:
                _accumulate(d_up_w, up.t(), x_t)
            if need_x:
                dx_t = dx[start:stop]
                torch.mm(gate, w_gate, out=dx_t)
                dx_t.addmm_(up, w_up)
        grads = [g.to(w.dtype) if g is not None else None
                 for g, w in ((d_gate_w, w_gate), (d_up_w, w_up), (d_down_w, w_down))]
        return (dx.view(x.shape) if need_x else None), *grads, None, None, None


def tiled_swiglu_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                     rows: int | None = None,
                     grad_dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
    """Llama's MLP without biases, ``(silu(x·W_gateᵀ) · x·W_upᵀ)·W_downᵀ``, over tiles of ``rows``
    rows (default: ``tile_rows`` of x's row count and the free memory). x is [..., hidden]; the
    weights are the projections' ``weight`` tensors, in x's dtype and on its device.
    Chapter 14 (``notebooks/14_long_context.ipynb``) teaches the tiling.

    Args:
        x: [..., hidden], floating point.
        w_gate, w_up: [intermediate, hidden]; w_down: [hidden, intermediate].
        rows: rows per tile (None: ``tile_rows``).
        grad_dtype: the weight gradients' accumulation dtype (None: the weights' own).

    Returns:
        The MLP's output, of x's shape and dtype, differentiable in x and the weights.

    Raises:
        ValueError, TypeError: as ``TiledSwiGLUFunction.forward`` raises them.
    """
    if rows is None:
        rows = tile_rows(max(1, x.numel() // x.shape[-1]), x.shape[-1], w_gate.shape[0], x.dtype)
    return TiledSwiGLUFunction.apply(x, w_gate, w_up, w_down, rows, grad_dtype)


# --------------------------------------------------------------------------------------------------
# The module and the swap
# --------------------------------------------------------------------------------------------------


def _is_plain_linear(module: torch.nn.Module) -> bool:
    return (type(module) is torch.nn.Linear and module.bias is None
            and not (module._forward_hooks or module._forward_pre_hooks))


def check_tileable(mlp: torch.nn.Module, where: str = "the MLP") -> None:
    """Raise unless ``mlp`` is a gated SiLU MLP of plain ``nn.Linear`` projections without bias:
    ``gate_proj``, ``up_proj``, ``down_proj`` and ``hidden_act`` (or ``act_fn``) SiLU, or a
    ``TritonSwiGLUMLP``.

    Args:
        mlp: the MLP module to check.
        where: its name, for the messages.

    Raises:
        TypeError: a projection is missing, has a bias, or is not a plain hook-free ``nn.Linear``.
        ValueError: the activation is not SiLU.
    """
    name = type(mlp).__name__
    missing = [p for p in ("gate_proj", "up_proj", "down_proj") if not isinstance(getattr(mlp, p, None),
                                                                                   torch.nn.Module)]
    if missing:
        raise TypeError(f"{where} ({name}) has no {', '.join(missing)}: not a gate/up/down MLP, which the tiled MLP "
                        "computes")
    if not isinstance(mlp, (TritonSwiGLUMLP, TiledSwiGLUMLP)):
        act = getattr(getattr(mlp, "config", None), "hidden_act", None)
        if act is None:
            act_fn = getattr(mlp, "act_fn", None)
            act = "silu" if type(act_fn).__name__ in ("SiLU", "SiLUActivation") else repr(act_fn)
        if act not in ("silu", "swish"):
            raise ValueError(f"{where} ({name}) uses the activation {act!r}; the tiled MLP computes "
                             "silu(gate) * up and replaces only SiLU MLPs")
    for proj in ("gate_proj", "up_proj", "down_proj"):
        module = getattr(mlp, proj)
        if not _is_plain_linear(module):
            what = "has a bias" if getattr(module, "bias",
                                           None) is not None else f"is a {type(module).__name__}"
            raise TypeError(f"{where}.{proj} {what}: the tiled MLP takes plain nn.Linear projections without bias "
                            "(a LoRA, quantised or hooked layer keeps its own forward)")


class TiledSwiGLUMLP(torch.nn.Module):
    """A Llama MLP computed over tiles of rows (``TiledSwiGLUFunction``), holding the very same
    ``gate_proj``, ``up_proj`` and ``down_proj`` modules as the MLP it replaces (``from_hf``), so
    parameter names, the optimizer and the state dict are unchanged.

    ``tile_rows``: rows per tile, or None to choose with ``tile_rows()`` on the first call at each
    row count and keep that choice for later calls at that count (the recompute of a checkpointed
    layer then cuts the same tiles as its forward did). ``grad_dtype``: the weight gradients'
    accumulation dtype (float32; None for the weights' own). ``skip_recompute``: when the forward
    runs inside a backward pass (a checkpoint recomputing the layer), save x and return NaN without
    computing the output (see the module docstring); False computes it anyway.
    Chapter 14 (``notebooks/14_long_context.ipynb``) trains long sequences with it.

    Args:
        gate_proj, up_proj, down_proj: the projections, plain ``nn.Linear`` without bias.
        tile_rows, grad_dtype, skip_recompute: as above.
    """

    def __init__(self, gate_proj: torch.nn.Module, up_proj: torch.nn.Module, down_proj: torch.nn.Module,
                 tile_rows: int | None = None, grad_dtype: torch.dtype | None = torch.float32,
                 skip_recompute: bool = True):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        self.tile_rows = tile_rows
        self.grad_dtype = grad_dtype
        self.skip_recompute = skip_recompute
        self.chosen: dict[int, int] = {}  # row count -> rows per tile, when tile_rows is None

    @classmethod
    def from_hf(cls, mlp: torch.nn.Module, tile_rows: int | None = None,
                grad_dtype: torch.dtype | None = torch.float32) -> TiledSwiGLUMLP:
        """A TiledSwiGLUMLP over ``mlp``'s own projections (no copy); refuses what
        ``check_tileable`` refuses.

        Args:
            mlp: a Llama-style MLP (or a ``TritonSwiGLUMLP``).
            tile_rows: rows per tile, or None to choose them.
            grad_dtype: the weight gradients' accumulation dtype (None: the weights' own).

        Returns:
            The new module, sharing ``mlp``'s projections.

        Raises:
            TypeError, ValueError: as ``check_tileable`` raises them.
        """
        check_tileable(mlp)
        return cls(mlp.gate_proj, mlp.up_proj, mlp.down_proj, tile_rows, grad_dtype)

    def rows_for(self, x: torch.Tensor) -> int:
        """Rows per tile for an input like ``x``: ``tile_rows``, or the choice made for its row
        count.

        Args:
            x: [..., hidden].

        Returns:
            Rows per tile.
        """
        if self.tile_rows is not None:
            return self.tile_rows
        n_rows = max(1, x.numel() // x.shape[-1])
        if n_rows not in self.chosen:
            self.chosen[n_rows] = tile_rows(n_rows, x.shape[-1], self.gate_proj.out_features, x.dtype)
        return self.chosen[n_rows]

    @torch.compiler.disable(reason="the tiled MLP is a Python loop of tiles: it runs eagerly")
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP's output over tiles; NaN during a checkpoint's recompute (``skip_recompute``).

        Args:
            x: [..., hidden], in the projections' dtype.

        Returns:
            The output, of x's shape.
        """
        skip = self.skip_recompute and torch.is_grad_enabled() and recomputing()
        return TiledSwiGLUFunction.apply(x, self.gate_proj.weight, self.up_proj.weight,
                                         self.down_proj.weight,
                                         self.rows_for(x), self.grad_dtype, skip)

    def extra_repr(self) -> str:
        """The settings, for the module's ``repr``.

        Returns:
            ``tile_rows``, ``grad_dtype`` and ``skip_recompute``, comma-separated.
        """
        return (f"tile_rows={self.tile_rows if self.tile_rows is not None else 'auto'}, grad_dtype={self.grad_dtype}, "
                f"skip_recompute={self.skip_recompute}")


@dataclass
class TiledMLPHandle:
    """What ``apply_tiled_mlp`` swapped; calling it (or ``undo()``, or leaving a ``with`` block) puts every
    original MLP back."""

    swaps: list[tuple[str, torch.nn.Module, torch.nn.Module, torch.nn.Module]] = field(default_factory=list)
    active: bool = True

    def undo(self) -> None:
        """Put every original MLP back, the last swapped first. A second call does nothing."""
        if not self.active:
            return
        for _, parent, original, _ in reversed(self.swaps):
            parent.mlp = original
        self.active = False

    __call__ = undo

    def __enter__(self) -> TiledMLPHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.undo()

    @property
    def modules(self) -> list[TiledSwiGLUMLP]:
        """The tiled MLPs swapped in, in model order."""
        return [tiled for *_, tiled in self.swaps]

    def summary(self) -> str:
        """One line: how many decoder layers have the tiled MLP.

        Returns:
            The line, ending in ``" (undone)"`` after ``undo()``.
        """
        return f"tiled MLP in {len(self.swaps)} decoder layers" + ("" if self.active else " (undone)")


def _decoder_mlps(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, torch.nn.Module]]:
    """(qualified name, decoder layer, its ``mlp``) of every module with an ``mlp`` child, checked
    before any swap."""
    found = []
    for name, module in model.named_modules():
        mlp = getattr(module, "mlp", None)
        if isinstance(mlp, torch.nn.Module) and mlp in dict(module.named_children()).values():
            where = f"{name}.mlp" if name else "mlp"
            check_tileable(mlp, where)
            found.append((where, module, mlp))
    return found


def apply_tiled_mlp(model: torch.nn.Module, tile_rows: int | None = None,
                    grad_dtype: torch.dtype | None = torch.float32) -> TiledMLPHandle:
    """Swap every decoder layer's MLP of ``model`` for a ``TiledSwiGLUMLP`` over the same
    projections; return the handle that undoes it. Every MLP is checked first: one that is not
    gate/up/down with SiLU, or whose projections are not plain bias-free ``nn.Linear`` layers, is
    refused before anything changes. A ``TritonSwiGLUMLP`` (``patch_llama(..., swiglu=True)``) is
    accepted and replaced too; undo this swap before undoing that patch. Chapter 14
    (``notebooks/14_long_context.ipynb``) applies it.

    Args:
        model: a Hugging Face model (or any module whose decoder layers have an ``mlp`` child).
        tile_rows: rows per tile, or None to choose them per row count.
        grad_dtype: the weight gradients' accumulation dtype (None: the weights' own).

    Returns:
        The ``TiledMLPHandle``: ``undo()``, ``modules``, ``summary()``.

    Raises:
        TypeError: ``model`` is not a module, or an MLP's projections are not plain ``nn.Linear``.
        ValueError: no decoder layer has an ``mlp``, or an MLP's activation is not SiLU.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    found = _decoder_mlps(model)
    if not found:
        raise ValueError(f"{type(model).__name__} has no decoder layer with an `mlp` to tile")
    handle = TiledMLPHandle()
    for where, parent, mlp in found:
        tiled = mlp if isinstance(mlp, TiledSwiGLUMLP) else TiledSwiGLUMLP.from_hf(mlp, tile_rows,
                                                                                   grad_dtype)
        parent.mlp = tiled
        handle.swaps.append((where, parent, mlp, tiled))
    return handle


__all__ = ["ALIGN", "FREE_FRACTION", "MAX_TILE_BYTES", "CPU_TILE_BYTES", "tile_bytes_per_row",
           "free_device_bytes",
           "tile_rows", "tile_bounds", "recomputing", "TiledSwiGLUFunction", "tiled_swiglu_mlp",
           "check_tileable",
           "TiledSwiGLUMLP", "TiledMLPHandle", "apply_tiled_mlp"]
