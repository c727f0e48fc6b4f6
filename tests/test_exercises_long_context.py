"""The chapter 14 exercise check: the solution passes, and each typical mistake in the tile loop is named."""

import pytest
import torch

from kernels.exercises.long_context import CASES, check_tiled_forward
from kernels.exercises.solutions import load, solution


def solved():
    return load("tiled_forward")


def loop(step=None, stop=None, starts=None, write=None, out_like=None, view=True):
    """A tile loop with one planted mistake, built from the pieces the reader writes."""

    def fn(x, mlp_tile, tile_rows):
        rows = x.reshape(-1, x.shape[-1])
        out = out_like(rows) if out_like else torch.empty_like(rows)
        n = rows.shape[0]
        for start in (starts(n, tile_rows) if starts else range(0, n, step(tile_rows) if step else tile_rows)):
            end = stop(start, tile_rows, n) if stop else min(start + tile_rows, n)
            if end <= start:
                continue
            result = mlp_tile(rows[start:end])
            if write:
                write(out, start, end, result)
            else:
                out[start:end] = result
        return out.view(x.shape) if view else out

    return fn


def by_columns(x, mlp_tile, tile_rows):
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty_like(rows)
    for start in range(0, rows.shape[1], tile_rows):
        out[:, start:start + tile_rows] = mlp_tile(rows[:, start:start + tile_rows])
    return out.view(x.shape)


def by_sequence_of_3d(x, mlp_tile, tile_rows):
    out = torch.empty_like(x)
    for start in range(0, x.shape[1], tile_rows):
        out[:, start:start + tile_rows] = mlp_tile(x[:, start:start + tile_rows])
    return out


def stub(x, mlp_tile, tile_rows):
    raise NotImplementedError("write the tile loop")


def whole(x, mlp_tile, tile_rows):
    return mlp_tile(x)


def write_first_rows(out, start, end, result):
    out[: end - start] = result


WRONG = {
    "last partial tile was dropped": loop(starts=lambda n, t: range(0, n - t + 1, t)),
    "tiles overlap": loop(step=lambda t: t - 3, stop=lambda s, t, n: min(s + t, n)),
    "rows skipped between tiles": loop(step=lambda t: t + 2, stop=lambda s, t, n: min(s + t, n)),
    "wrong axis tiled": by_columns,
    "larger than tile_rows": whole,
    "no tiling at all": whole,
    "write each tile's result to out[start:stop]": loop(write=write_first_rows),
    "dtype": loop(out_like=lambda rows: torch.empty(rows.shape, device=rows.device)),
    "view the [tokens, hidden] result back": loop(view=False),
    "your function raised NotImplementedError: write the tile loop": stub,
}


def test_the_solution_passes_and_is_shown_only_when_asked(capsys):
    report = check_tiled_forward(solved(), seed=0)
    assert report.passed and report.message.startswith("✓")
    out = capsys.readouterr().out
    assert "min(start + tile_rows, n)" not in out
    solution("tiled_forward")
    assert "min(start + tile_rows, n)" in capsys.readouterr().out
    with pytest.raises(ValueError, match="no solution named"):
        solution("backward")


@pytest.mark.parametrize("mistake", list(WRONG))
def test_each_mistake_is_named(mistake):
    report = check_tiled_forward(WRONG[mistake], seed=1, verbose=False)
    assert not report.passed
    assert mistake in report.message, report.message


def test_tiling_the_sequence_of_a_batch_makes_tiles_too_large():
    report = check_tiled_forward(by_sequence_of_3d, seed=2, verbose=False)
    assert not report.passed and "larger than tile_rows" in report.message


def test_a_dropped_partial_tile_is_named_when_it_is_the_only_tile():
    # CASES[1] has fewer tokens than one tile: dropping the partial tile drops everything.
    assert CASES[1].tokens < CASES[1].tile_rows
    only_when_short = loop(starts=lambda n, t: range(0, n - t + 1, t) if n < t else range(0, n, t))
    report = check_tiled_forward(only_when_short, seed=4, verbose=False)
    assert not report.passed and str(CASES[1]) in report.message
    assert "last partial tile was dropped" in report.message


def test_every_case_is_named_in_words():
    assert all("tile_rows=" in str(case) for case in CASES)
    assert "5 tiles + 10 rows" in str(CASES[0]) and "one partial tile of 11" in str(CASES[1])
