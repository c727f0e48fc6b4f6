"""Check for the exercise of chapter 14: the tile loop of a tiled MLP's forward.

The reader writes ``fn(x, mlp_tile, tile_rows) -> out``: x is [batch, seq, hidden]; ``mlp_tile(rows)`` runs the MLP
on a [n, hidden] block of rows and returns [n, hidden]. The function must flatten x to [tokens, hidden], cut the
tokens into consecutive tiles of at most ``tile_rows`` rows (the last one partial when ``tile_rows`` does not divide
the tokens), run ``mlp_tile`` on each, write each result into the same rows of an output like x, and return it.

The check hands the reader's function an ``mlp_tile`` that records which rows of x each call received (found by
their values, so copies and views alike are traced), runs it on a few fresh inputs (a ragged last tile, fewer rows
than one tile, bfloat16, an exact multiple), and when something is wrong says which mistake it was: the last partial
tile dropped, tiles overlapping, rows skipped between tiles, the hidden axis tiled instead of the tokens, a tile
larger than ``tile_rows``, results written to the wrong rows, or the output's shape or dtype. It never raises
because the reader's function is wrong: it prints its verdict and returns a ``Report``.

``solution("tiled_forward")`` prints a solution, only when called.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import runtime
from kernels.tolerances import ELEMENT_TOL

from .rmsnorm import Report


@dataclass(frozen=True)
class TileCase:
    dtype: torch.dtype
    batch: int
    seq: int
    hidden: int
    tile_rows: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def __str__(self) -> str:
        q, r = divmod(self.tokens, self.tile_rows)
        split = f"{q} tiles + {r} rows" if q and r else (f"{q} whole tiles" if q else f"one partial tile of {r}")
        return (f"{str(self.dtype).removeprefix('torch.')} x of [{self.batch}, {self.seq}, {self.hidden}] with "
                f"tile_rows={self.tile_rows} ({self.tokens} tokens: {split})")


CASES = (
    TileCase(torch.float32, 2, 45, 24, 16),  # 90 tokens: 5 tiles + 10 rows; 24 columns, no multiple of 16
    TileCase(torch.float32, 1, 11, 24, 16),  # fewer tokens than one tile
    TileCase(torch.bfloat16, 3, 13, 32, 8),  # 39 tokens: 4 tiles + 7 rows, bfloat16
    TileCase(torch.float32, 1, 64, 16, 16),  # an exact multiple
)

# --------------------------------------------------------------------------------------------------------------------
# The instrumented MLP tile
# --------------------------------------------------------------------------------------------------------------------


class TracedMLP:
    """``mlp_tile`` for the reader's function: Llama's MLP (float32 arithmetic, rounded to x's dtype once) on a
    block of rows, recording for each call the rows of x it received (by value: x's rows are all different), its
    width and its row count. A block whose last dimension is not the hidden size is recorded and refused."""

    def __init__(self, x: torch.Tensor, gen: torch.Generator):
        self.hidden = x.shape[-1]
        self.rows = x.reshape(-1, self.hidden)
        inter = 2 * self.hidden + 8
        self.w_gate, self.w_up = (torch.randn(inter, self.hidden, generator=gen) / self.hidden**0.5 for _ in range(2))
        self.w_down = torch.randn(self.hidden, inter, generator=gen) / inter**0.5
        self.where = {tuple(row.tolist()): i for i, row in enumerate(self.rows.float().cpu())}
        self.calls: list[dict] = []

    def mlp(self, block: torch.Tensor) -> torch.Tensor:
        h = block.float().cpu()
        y = torch.nn.functional.silu(h @ self.w_gate.t()) * (h @ self.w_up.t())
        return (y @ self.w_down.t()).to(block.dtype).to(block.device)

    def __call__(self, block: torch.Tensor) -> torch.Tensor:
        if not isinstance(block, torch.Tensor):
            raise TypeError(f"mlp_tile takes a tensor of rows, got {type(block).__name__}")
        if block.shape[-1] != self.hidden:
            self.calls.append({"width": block.shape[-1], "rows": [], "n": block.numel() // max(block.shape[-1], 1)})
            raise ValueError(f"mlp_tile expects rows of the hidden size {self.hidden}, got a block of shape "
                             f"{tuple(block.shape)}")
        flat = block.reshape(-1, self.hidden)
        rows = [self.where.get(tuple(r.tolist()), -1) for r in flat.float().cpu()]
        self.calls.append({"width": self.hidden, "rows": rows, "n": flat.shape[0]})
        return self.mlp(block)

    def reference(self) -> torch.Tensor:
        return self.mlp(self.rows)


# --------------------------------------------------------------------------------------------------------------------
# The diagnosis
# --------------------------------------------------------------------------------------------------------------------


def _span(rows: list[int]) -> str:
    """``row 7``, ``rows 80–89`` when consecutive, else ``18 rows between 13 and 80``."""
    lo, hi = min(rows), max(rows)
    if len(rows) == 1:
        return f"row {lo}"
    return f"rows {lo}–{hi}" if hi - lo + 1 == len(rows) else f"{len(rows)} rows between {lo} and {hi}"


def _axis_problem(traced: TracedMLP, case: TileCase) -> str | None:
    wrong = next((call for call in traced.calls if call["width"] != case.hidden), None)
    if wrong is None:
        return None
    return (f"wrong axis tiled: a tile had {wrong['width']} columns where every row has {case.hidden}. Cut the "
            "tokens (rows of x.reshape(-1, hidden)), never the hidden axis: the MLP needs whole rows")


def _coverage_problem(traced: TracedMLP, case: TileCase) -> str | None:
    """What is wrong with the tiles the reader cut, or None when every row went through the MLP once, in tiles of
    at most ``tile_rows``."""
    n, t = case.tokens, case.tile_rows
    if not traced.calls and n >= t:
        return "mlp_tile was never called: loop over the tiles and run each through it"
    biggest = max((call["n"] for call in traced.calls), default=0)
    if biggest > t:
        whole = " (all the tokens at once: no tiling at all)" if biggest >= n and n > t else ""
        return (f"a tile of {biggest} rows is larger than tile_rows={t}{whole}: each tile is at most tile_rows rows, "
                "so its [tile, intermediate] tensors stay small")
    if any(r < 0 for call in traced.calls for r in call["rows"]):
        return "a tile held rows that are not rows of x: slice x's rows, do not build new ones"
    seen: dict[int, int] = {}
    for call in traced.calls:
        for r in call["rows"]:
            seen[r] = seen.get(r, 0) + 1
    twice = sorted(r for r, count in seen.items() if count > 1)
    if twice:
        return (f"tiles overlap: {_span(twice)} went through the MLP more than once. Each tile "
                "starts where the last one stopped: range(0, n_rows, tile_rows), stop = start + tile_rows")
    missing = sorted(set(range(n)) - set(seen))
    if missing:
        tail = list(range(n - n % t, n)) if n % t else []
        if missing == tail or (missing == list(range(missing[0], n)) and missing[0] >= n - t):
            return (f"the last partial tile was dropped: {_span(missing)} never went through the MLP ({n} tokens = "
                    f"{n // t} × {t} + {n % t}). Loop while start < n_rows and stop at min(start + tile_rows, "
                    "n_rows)")
        return (f"rows skipped between tiles: {_span(missing)} never went through the MLP. "
                "Each tile starts where the last one stopped")
    return None


def _output_problem(out, x: torch.Tensor, traced: TracedMLP, case: TileCase) -> str | None:
    if not isinstance(out, torch.Tensor):
        return f"the function returned {type(out).__name__}, expected a tensor shaped like x"
    if out.shape != x.shape:
        return (f"the output has shape {tuple(out.shape)}, expected x's {tuple(x.shape)}: view the [tokens, hidden] "
                "result back as [batch, seq, hidden]")
    if out.dtype != x.dtype:
        return (f"the output has dtype {out.dtype}, expected x's {x.dtype}: allocate it like x "
                "(torch.empty_like of x's rows), not with torch's default dtype")
    ref = traced.reference().reshape(x.shape)
    rtol, atol = ELEMENT_TOL[case.dtype]
    got, want = out.detach().double().cpu().reshape(-1, case.hidden), ref.double().cpu().reshape(-1, case.hidden)
    bad = ((got - want).abs() > rtol * want.abs() + atol * want.abs().max()).any(-1) | ~torch.isfinite(got).all(-1)
    if bad.any():
        rows = bad.nonzero().flatten().tolist()
        return (f"{_span(rows)} of the output do not hold the MLP of the same rows of x: write "
                "each tile's result to out[start:stop], the rows it came from")
    return None


def _call(fn, x, traced, case):
    try:
        return fn(x, traced, case.tile_rows), None
    except Exception as error:  # noqa: BLE001  (any failure of the reader's code is reported, not raised)
        lines = [line for line in str(error).strip().splitlines() if line.strip()]
        return None, f"your function raised {type(error).__name__}: {lines[-1] if lines else repr(error)}"


def _verdict(passed: bool, message: str, verbose: bool) -> Report:
    report = Report(passed, ("✓ " if passed else "✗ ") + message)
    if verbose:
        print(report.message)
    return report


def check_tiled_forward(fn: Callable, seed: int | None = None, verbose: bool = True) -> Report:
    """Check ``fn(x, mlp_tile, tile_rows) -> out``, the tile loop of a tiled MLP forward (see the module docstring).
    Prints the verdict (unless ``verbose=False``) and returns it."""
    gen = torch.Generator()
    if seed is None:
        gen.seed()  # fresh inputs every call: a loop must be right for any length, not one
    else:
        gen.manual_seed(seed)
    for case in CASES:
        x = torch.randn(case.batch, case.seq, case.hidden, generator=gen).to(case.dtype).to(runtime.device())
        traced = TracedMLP(x, gen)
        out, raised = _call(fn, x, traced, case)
        problem = (_axis_problem(traced, case) or raised or _coverage_problem(traced, case)
                   or _output_problem(out, x, traced, case))
        if problem is not None:
            return _verdict(False, f"on a {case}: {problem}.", verbose)
    return _verdict(True, f"the tile loop is right on {len(CASES)} inputs (a ragged last tile, fewer tokens than "
                          "one tile, bfloat16, an exact multiple): every token through the MLP once, in tiles of at "
                          "most tile_rows, each result in its own rows.", verbose)


__all__ = ["TileCase", "CASES", "TracedMLP", "check_tiled_forward"]
