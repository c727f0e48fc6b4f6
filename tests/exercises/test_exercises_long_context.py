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
            if end <= start and not stop:
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
    "an empty tile": loop(starts=lambda n, t: range(0, n + 1, t), stop=lambda s, t, n: s + t),
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


# --------------------------------------------------------------------------------------------------------------------
# The second exercise: the offload hooks
# --------------------------------------------------------------------------------------------------------------------

import diagnoses  # noqa: E402

from kernels.exercises.long_context import OFFLOAD_HINTS, check_offload_hooks  # noqa: E402


def hooks(wait=True, side_out=True, blocking_out=False, mark_out=True, kept=False, sync=None, copy_back=True,
          side_back=True, blocking_back=False, event="after", alloc_on_side=False, mark_back=True, corrupt=False,
          wait_back=True, pinned=None):
    """The solution's pair with one planted mistake."""

    def pack(tensor, side):
        if kept:
            return tensor.device, tensor
        pin = torch.cuda.is_available() if pinned is None else pinned
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
        if wait:
            side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side if side_out else None):
            host.copy_(tensor, non_blocking=not blocking_out)
        if sync == "pack":
            torch.cuda.synchronize()
        if mark_out:
            tensor.record_stream(side)
        return tensor.device, host

    def unpack(packed, side):
        device, host = packed
        if not copy_back:
            return host if not corrupt else host * 2
        early = side.record_event()
        tensor = None if alloc_on_side else torch.empty(host.shape, dtype=host.dtype, device=device)
        if wait_back:
            side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side if side_back else None):
            if alloc_on_side:
                tensor = host.to(device, copy=True, non_blocking=not blocking_back)
            else:
                tensor.copy_(host, non_blocking=not blocking_back)
            copied = side.record_event()
        if sync == "unpack":
            copied.synchronize()
        if event == "after":
            torch.cuda.current_stream().wait_event(copied)
        elif event == "before":
            torch.cuda.current_stream().wait_event(early)
        if alloc_on_side and mark_back:
            tensor.record_stream(torch.cuda.current_stream())
        return tensor * 2 if corrupt else tensor

    return pack, unpack


def offload_stub(tensor, side):
    raise NotImplementedError("your turn")


OFFLOAD_MISTAKES = {
    "stub": (offload_stub, offload_stub),
    "kept_tensor": hooks(kept=True),
    "no_copy_out": (lambda tensor, side: (tensor.device, tensor.clone()), offload_stub),  # a clone stays on device
    "copy_out_on_compute": hooks(side_out=False),
    "no_wait_before_copy_out": hooks(wait=False),
    "blocking_copy_out": hooks(blocking_out=True),
    "no_record_stream_out": hooks(mark_out=False),
    "synchronized": hooks(sync="pack"),
    "no_copy_back": hooks(copy_back=False),
    "copy_back_on_compute": hooks(side_back=False),
    "blocking_copy_back": hooks(blocking_back=True),
    "no_wait_after_copy_back": hooks(event=None),
    "wait_before_copy_back": hooks(event="before"),
    "no_record_stream_back": hooks(alloc_on_side=True, mark_back=False),
    "wrong_tensor": hooks(corrupt=True),
    "no_wait_before_copy_back": hooks(wait_back=False),
    "raised": (lambda tensor, side: tensor.no_such_method(), offload_stub),
}
# Seen on a GPU only (the races provoked on real streams), or by the gradient run: see the gpu test below.
GPU_OR_MODEL_ONLY = {"not_pinned", "pack_waited", "race_out", "race_back", "gradients", "no_checkpoint"}


def test_the_offload_solution_passes_and_says_what_was_not_checked():
    report = check_offload_hooks(*load("offload_hooks")(), seed=0, verbose=False)
    assert report.passed, report.message
    if not torch.cuda.is_available():
        assert "NOT checked, since there is no GPU here" in report.message and "no race was provoked" in report.message


def test_every_offload_diagnosis_is_planted_here():
    assert set(OFFLOAD_MISTAKES) | GPU_OR_MODEL_ONLY == set(OFFLOAD_HINTS)


@pytest.mark.parametrize("key", sorted(OFFLOAD_MISTAKES))
def test_each_offload_mistake_is_named(key):
    if torch.cuda.is_available() and key not in {"stub", "raised", "kept_tensor", "wrong_tensor"}:
        pytest.skip("the order of the calls is recorded where there is no GPU; on a GPU the races are provoked")
    report = check_offload_hooks(*OFFLOAD_MISTAKES[key], seed=3, verbose=False)
    assert not report.passed, f"a wrong pair passed: {key}"
    assert diagnoses.says(OFFLOAD_HINTS[key], report.message), report.message


def test_a_tensor_allocated_on_the_side_stream_needs_no_wait_before_its_copy():
    # Its memory was last used on the side stream: marked for the compute stream, that pattern is right too.
    report = check_offload_hooks(*hooks(alloc_on_side=True, wait_back=False), seed=0, verbose=False)
    assert report.passed, report.message


def test_pageable_memory_passes_without_a_gpu_and_the_verdict_says_it_was_not_checked():
    if torch.cuda.is_available():
        pytest.skip("on a GPU pageable memory is refused: see the gpu test below")
    report = check_offload_hooks(*hooks(pinned=False), seed=0, verbose=False)
    assert report.passed and "NOT checked" in report.message and "pinned" in report.message, report.message
    assert "really wait" in report.message and "no race was provoked" in report.message


def test_the_package_offload_called_from_the_hooks_is_refused():
    from kernels.hf.offload import CheckpointOffload

    def pack(tensor, side):
        return CheckpointOffload.pack(None, tensor)

    report = check_offload_hooks(pack, load("offload_hooks")()[1], seed=0, verbose=False)
    assert not report.passed and "CheckpointOffload.pack" in report.message, report.message
    assert 'solution("offload_hooks")' in report.message


def test_the_package_tile_bounds_are_refused():
    from kernels.hf.tiled_mlp import tile_bounds

    def package_loop(x, mlp_tile, tile_rows):
        rows = x.reshape(-1, x.shape[-1])
        out = torch.empty_like(rows)
        for start, stop in tile_bounds(rows.shape[0], tile_rows):
            out[start:stop] = mlp_tile(rows[start:stop])
        return out.view(x.shape)

    report = check_tiled_forward(package_loop, seed=0, verbose=False)
    assert not report.passed and "tile_bounds" in report.message and "finished" in report.message, report.message


def test_a_pair_that_changes_the_saved_tensor_in_the_model_is_named(monkeypatch):
    # Right on the lone tensor, wrong inside the model: the gradient comparison catches it.
    pack, unpack = load("offload_hooks")()
    calls = {"n": 0}
    lone = 2 if torch.cuda.is_available() else 1  # the check's unpacks of a lone tensor come first: right there

    def late_unpack(packed, side):
        calls["n"] += 1
        out = unpack(packed, side)
        return out if calls["n"] <= lone else out + 1e-3

    report = check_offload_hooks(pack, late_unpack, seed=0, verbose=False)
    assert not report.passed
    assert diagnoses.says(OFFLOAD_HINTS["gradients"], report.message), report.message


def test_the_stand_ins_are_gone_after_a_check():
    before = (torch.cuda.current_stream, torch.cuda.stream, torch.cuda.Event, torch.cuda.synchronize,
              torch.Tensor.record_stream)
    check_offload_hooks(*OFFLOAD_MISTAKES["synchronized"], seed=0, verbose=False)
    after = (torch.cuda.current_stream, torch.cuda.stream, torch.cuda.Event, torch.cuda.synchronize,
             torch.Tensor.record_stream)
    assert all(a is b for a, b in zip(before, after))


# On a GPU each race is provoked on real streams (busy streams from torch.cuda._sleep, memory handed out again),
# and the hooks' mistakes show as wrong data or a slow pack: (planted mistake, the diagnosis it must get).
GPU_RACES = {
    "no_wait_before_copy_out": "race_out",
    "no_record_stream_out": "no_record_stream_out",
    "no_wait_before_copy_back": "no_wait_before_copy_back",
    "no_wait_after_copy_back": "race_back",
    "wait_before_copy_back": "race_back",
    "synchronized": "pack_waited",
    "blocking_copy_out": "pack_waited",
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("key", sorted(GPU_RACES))
def test_on_a_gpu_the_races_are_provoked(key):
    report = check_offload_hooks(*OFFLOAD_MISTAKES[key], seed=0, verbose=False)
    assert not report.passed, f"a wrong pair passed on a GPU: {key}"
    assert diagnoses.says(OFFLOAD_HINTS[GPU_RACES[key]], report.message), report.message


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_the_solution_passes_with_every_race_provoked():
    report = check_offload_hooks(*load("offload_hooks")(), seed=0, verbose=False)
    assert report.passed and "each race provoked" in report.message, report.message


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_pageable_memory_is_named():
    report = check_offload_hooks(*hooks(pinned=False), seed=0, verbose=False)
    assert not report.passed
    assert diagnoses.says(OFFLOAD_HINTS["not_pinned"], report.message), report.message
