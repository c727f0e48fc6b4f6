"""Check for chapter 16's exercise on Hopper's copy engine: the tensor descriptor of one head's tile.

The reader completes ``fn(t, rows) -> TensorDescriptor``: a descriptor over ``t``, a [batch,
heads, seq, head_dim] tensor (contiguous, or a transposed view of [batch, seq, heads, head_dim]
memory as Llama's projections give it), whose box is one head's [rows, head_dim] tile, so that a
kernel's ``desc.load([b, h, start, 0])`` copies rows start … start + rows − 1 of head h in batch b
into shared memory, zeros past the end of the sequence.

``check_tile_descriptor`` builds the reader's descriptor for three tensors (contiguous; a transposed
view; a sequence that is not a whole number of tiles), reads its fields and says which of the usual
mistakes it holds (a box without the leading 1s, the box's two sizes swapped, the strides of a
contiguous tensor for a view, the shape in memory order, a copy of ``t`` rather than ``t``), then
loads every tile through it with a small Triton kernel and compares with slicing ``t``. The
package's own descriptor function is out of reach while the reader's runs
(``reach.FORBIDDEN["tile_descriptor"]``). The check never raises because the reader's code is wrong:
it prints its verdict and returns a ``Report``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels import runtime

from .reach import FinishedCodeCalled, call_learner
from .rmsnorm import Report, last_line, verdict
from .sentences import sentence_lookup

EXERCISE = "tile_descriptor"

HINTS = {
    "raised": "tile_descriptor raised {error}",
    "stub": ("tile_descriptor is still the stub: return TensorDescriptor(t, shape, strides, block_shape) "
             "with t's shape and strides and a box of one head's [rows, head_dim] tile"),
    "type": ("tile_descriptor returned {got}, not a TensorDescriptor: build one with "
             "TensorDescriptor(t, shape, strides, block_shape)"),
    "rank": ("the box {box} has {n} sizes and the tensor has 4 dimensions: a descriptor's box names a "
             "size for every dimension, here [1, 1, rows, head_dim] (one batch, one head, rows rows, the "
             "whole head_dim)"),
    "swapped": ("the box {box} holds head_dim rows of `rows` columns: the tile is rows × head_dim, "
                "[1, 1, rows, head_dim]"),
    "box": "the box is {box}; one head's tile of {rows} rows is [1, 1, {rows}, {d}]",
    "copy": ("the descriptor reads another tensor than t ({what}): a copy's loads read the copy, not "
             "t. Pass t itself; the descriptor follows its strides, so no copy is needed"),
    "contiguous_strides": ("the strides {got} are those of a contiguous tensor of this shape; t is a "
                           "view whose strides are {want} (t.stride()): with these the copy engine "
                           "reads other elements than t's"),
    "strides": "the strides are {got}; t's are {want} (t.stride())",
    "memory_order": ("the shape {got} swaps t's heads and seq ([batch, seq, heads, head_dim] is the order "
                     "of Llama's projections in memory); the kernel asks for [b, h, start, 0] in t's own "
                     "order, [batch, heads, seq, head_dim] = {want}"),
    "refused": ("TensorDescriptor refused the fields ({error}): the shape, the strides and the box each "
                "need one entry per dimension of t (4 here), and the last stride must be 1"),
    "shape": "the shape is {got}; t's is {want} (t.shape)",
    "values": ("the tile of batch {b}, head {h}, rows {start}…{end} differs from t[{b}, {h}, "
               "{start}:{end}] (first at row {row}): print both to see the pattern"),
    "no_tma": ("the fields are right; this GPU has no TMA (compute capability below 9.0), so the "
               "tiles were not loaded through the descriptor"),
    "passed": ("your descriptor loads every tile of {n} tensors (contiguous, a transposed view, a "
               "ragged last tile) as slicing t does, zeros past the end"),
}
hint = sentence_lookup(HINTS)


@triton.jit
def _load_tiles(desc, OUT, n_heads, n_tiles, ROWS: tl.constexpr, D: tl.constexpr):
    # One program per (batch, head, tile): the tile through the descriptor, stored into OUT
    # [batch, heads, n_tiles * ROWS, D] contiguous.
    pid = tl.program_id(0)
    bh = pid // n_tiles
    tile = pid % n_tiles
    b = bh // n_heads
    h = bh % n_heads
    x = desc.load([b, h, tile * ROWS, 0]).reshape([ROWS, D])
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, D)
    tl.store(OUT + (bh * n_tiles * ROWS + tile * ROWS + rows[:, None]) * D + cols[None, :], x)


def cases(device) -> list[tuple[str, torch.Tensor, int]]:
    """The tensors the reader's descriptor is built for: (what, t, rows).

    Args:
        device: where the tensors live.

    Returns:
        a contiguous tensor, a transposed view of Llama's [batch, seq, heads, head_dim] memory, and
        a sequence that is not a whole number of tiles.
    """
    gen = torch.Generator().manual_seed(0)

    def draw(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    return [("a contiguous [2, 3, 32, 16] tensor", draw(2, 3, 32, 16), 16),
            ("a transposed view of [2, 24, 3, 16] memory", draw(2, 24, 3, 16).transpose(1, 2), 8),
            ("a view of 37 tokens (the last tile ragged)", draw(1, 37, 2, 16).transpose(1, 2), 16)]


def _short(text: str, width: int = 120) -> str:
    # TensorDescriptor's asserts print the whole tensor: keep the end, where the fields are.
    return text if len(text) <= width else "…" + text[-width:]


def _contiguous_strides(shape) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


def diagnose_fields(desc, t: torch.Tensor, rows: int) -> str | None:
    """The first of the usual mistakes the descriptor's fields hold, in words, or None.

    Args:
        desc: what the reader's function returned.
        t: the tensor it was built for.
        rows: the tile's rows.

    Returns:
        the hint, or None when the fields are right.
    """
    if desc is None:
        return hint("stub")
    if not isinstance(desc, TensorDescriptor):
        return hint("type", got=type(desc).__name__)
    box, d = list(desc.block_shape), t.shape[-1]
    if len(box) != 4:
        return hint("rank", box=box, n=len(box))
    if box == [1, 1, d, rows] and d != rows:
        return hint("swapped", box=box)
    if box != [1, 1, rows, d]:
        return hint("box", box=box, rows=rows, d=d)
    base = desc.base
    if not isinstance(base, torch.Tensor) or base.data_ptr() != t.data_ptr():
        what = "a copy of t" if isinstance(base, torch.Tensor) else type(base).__name__
        return hint("copy", what=what)
    shape, strides = [int(s) for s in desc.shape], [int(s) for s in desc.strides]
    memory = [t.shape[0], t.shape[2], t.shape[1], t.shape[3]]
    if shape == memory and shape != list(t.shape):
        return hint("memory_order", got=shape, want=list(t.shape))
    if shape != list(t.shape):
        return hint("shape", got=shape, want=list(t.shape))
    if strides != list(t.stride()):
        if strides == _contiguous_strides(t.shape):
            return hint("contiguous_strides", got=strides, want=list(t.stride()))
        return hint("strides", got=strides, want=list(t.stride()))
    return None


def _tiles_differ(desc, t: torch.Tensor, rows: int) -> str | None:
    batch, heads, seq, d = t.shape
    n_tiles = triton.cdiv(seq, rows)
    out = torch.full((batch, heads, n_tiles * rows, d), float("nan"), device=t.device, dtype=t.dtype)
    _load_tiles[(batch * heads * n_tiles,)](desc, out, heads, n_tiles, ROWS=rows, D=d)
    want = torch.zeros_like(out)
    want[:, :, :seq] = t
    for b in range(batch):
        for h in range(heads):
            for start in range(0, seq, rows):
                got, ref = out[b, h, start:start + rows], want[b, h, start:start + rows]
                if not torch.equal(got, ref):
                    row = int((got != ref).any(-1).nonzero()[0]) + start
                    return hint("values", b=b, h=h, start=start, end=start + rows, row=row)
    return None


def _can_load() -> bool:
    return runtime.INTERPRET or torch.cuda.get_device_capability()[0] >= 9


def check_tile_descriptor(fn: Callable, verbose: bool = True) -> Report:
    """Check the reader's ``fn(t, rows)``: a tensor descriptor of one head's [rows, head_dim] tile.

    Args:
        fn: the reader's function.
        verbose: print the verdict.

    Returns:
        the ``Report``: passed, and what is right or wrong, in words.
    """
    all_cases = cases(runtime.device())
    for what, t, rows in all_cases:
        try:
            desc = call_learner(EXERCISE, fn, t, rows)
        except FinishedCodeCalled as called:
            return verdict(False, str(called), verbose)
        except NotImplementedError:
            return verdict(False, hint("stub"), verbose)
        except AssertionError as error:  # TensorDescriptor checks its fields with asserts
            return verdict(False, hint("refused", error=_short(last_line(error))), verbose)
        except Exception as error:  # noqa: BLE001  (the reader's error is the verdict)
            return verdict(False, hint("raised", error=f"{type(error).__name__}: {last_line(error)}"), verbose)
        problem = diagnose_fields(desc, t, rows)
        if problem is None and _can_load():
            problem = _tiles_differ(desc, t, rows)
        if problem is not None:
            return verdict(False, f"on {what}: {problem}", verbose)
    if not _can_load():
        return verdict(False, hint("no_tma"), verbose)
    return verdict(True, hint("passed", n=len(all_cases)), verbose)
