"""The host-overhead benchmark runs end to end (in the interpreter its microseconds are NumPy's, not a GPU's)."""

import math

import pytest

from kernels.bench import overhead


@pytest.mark.parametrize("kernel, n_launches", [("rmsnorm", 3), ("cross_entropy", 4), ("swiglu", 2), ("rope", 2)])
def test_breakdown_layers_add_up(kernel, n_launches):
    result = overhead.breakdown(kernel, calls=2)
    assert set(result["parts_us"]) == set(overhead.LAYERS)
    assert math.isclose(sum(result["parts_us"].values()), result["levels_us"]["total"], rel_tol=1e-9)
    assert result["n_launches"] == n_launches and result["levels_us"]["launches"] > 0
    assert "dispatch_skipped_us" in result  # the operators timed too, though an eager call skips them


def test_peers_are_checked_then_timed_or_skipped_with_a_reason():
    rows = overhead.measure_peers("cross_entropy", "fwd+bwd", calls=2)
    ours = [r for r in rows if r["impl"] == "ours"]
    assert len(ours) == 1 and ours[0]["host_us"] > 0
    for row in rows:
        assert row["host_us"] is not None or row["note"], row


def test_run_table_and_plot(tmp_path):
    results = overhead.run(calls=2)
    table = overhead.format_table(results)
    assert all(f"ours through Python, {kernel} fwd+bwd" in table for kernel in overhead.PASSES)
    assert all(name in table for name in overhead.FLOOR)
    json_path, png_path = overhead.save(results, tmp_path)
    assert json_path.exists() and png_path.exists()


def test_interleaved_timing_takes_every_function_in_turn():
    log = []
    fns = {name: ((lambda name=name: log.append(name)), []) for name in ("a", "b")}
    result = overhead.interleaved_host_us(fns, calls=4, rounds=2)
    turns = [name for i, name in enumerate(log) if i == 0 or log[i - 1] != name]
    assert turns == ["a", "b", "a"] and set(result) == {"a", "b"}  # a b | b a: the order rotates between rounds
    assert all(us > 0 for us in result.values())


def test_floor_times_the_empty_function_beside_hugging_face_and_ours():
    result = overhead.floor(calls=2)
    assert list(result) == list(overhead.FLOOR) and all(us > 0 for us in result.values())
    table = overhead.format_table({"device": "cpu", "peers": [], "breakdown": {}, "floor_us": result})
    assert all(name in table for name in overhead.FLOOR)


@pytest.mark.parametrize("launches", [0, 1])
def test_empty_function_has_the_shapes_and_graph_of_a_swiglu(launches):
    case = overhead._case("swiglu")
    y = overhead._EmptyFunction.apply(case.gate, case.up, launches)
    assert y.shape == case.gate.shape and y.dtype == case.gate.dtype and y.requires_grad
    y.backward(case.dy)
    assert case.gate.grad.shape == case.gate.shape and case.up.grad.shape == case.up.shape
