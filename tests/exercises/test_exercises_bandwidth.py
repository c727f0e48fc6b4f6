"""The exercise of chapters 04 and 07: its check passes the solutions, and names every planted mistake, in the byte
count and in the floor's units, with the sentence of its diagnosis, without raising."""

import math

import diagnoses
import pytest
import torch

from kernels.bench.sweep import cross_entropy_bytes, rmsnorm_bytes
from kernels.bench.timing import floor_ms
from kernels.exercises import solutions
from kernels.exercises.bandwidth import (
    BYTES_MISTAKES,
    EXTRA_TRANSFERS,
    FLOOR_MISTAKES,
    HINTS,
    KERNELS,
    SIZE_MISTAKES,
    TRANSFERS,
    Measurement,
    check_floor,
    compare_floor,
    measurements,
    transfer_bytes,
)
from kernels.exercises.solutions import load

RMSNORM = load("rmsnorm_minimal_bytes")
CROSS_ENTROPY = load("cross_entropy_minimal_bytes")
FLOOR = load("floor_us")
RIGHT_BYTES = {"rmsnorm": RMSNORM, "cross_entropy": CROSS_ENTROPY}


def says(key: str, message: str) -> bool:
    """Whether ``message`` holds the diagnosis ``HINTS[key]``."""
    return diagnoses.says(HINTS[key], message)


def bytes_message(fn, kernel: str) -> str:
    report = check_floor(fn, FLOOR, kernel, verbose=False)
    assert not report.passed
    line = next(line for line in report.message.splitlines() if "minimal_bytes" in line)
    assert line.startswith("✗ minimal_bytes: "), report.message
    return line


def floor_message(fn) -> str:
    report = check_floor(RMSNORM, fn, "rmsnorm", verbose=False)
    assert not report.passed
    line = report.message.splitlines()[-1]
    assert line.startswith("✗ floor_us: "), report.message
    return line


# ---------------------------------------------------------------------------------------------------------------------
# The solutions
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_solutions_pass(kernel, capsys):
    assert {"rmsnorm_minimal_bytes", "cross_entropy_minimal_bytes", "floor_us"} <= set(solutions.names())
    report = check_floor(RIGHT_BYTES[kernel], FLOOR, kernel)
    assert report.passed, report.message
    printed = capsys.readouterr().out
    assert printed.count("✓") == 2 and "✗" not in printed


def test_the_counts_are_the_sweeps_plus_the_weight():
    for m, n in ((16384, 4096), (7, 333)):
        assert RMSNORM(m, n, torch.bfloat16) == rmsnorm_bytes(m, n, 2) + 3 * n * 2 == transfer_bytes("rmsnorm", m, n)
        assert CROSS_ENTROPY(m, n, torch.bfloat16) == cross_entropy_bytes(m, n, 2, "two_read")
        assert CROSS_ENTROPY(m, n, torch.float32) == transfer_bytes("cross_entropy", m, n, torch.float32)
    assert FLOOR(4e9, 4000) == pytest.approx(floor_ms(4e9, 4000) * 1e3) == pytest.approx(1000.0)


def test_per_row_scalars_may_be_counted():
    # RMSNorm's float32 rstd written and read; the cross-entropy's int64 target and float32 logsumexp; a scalar loss.
    with_rstd = lambda m, n, d: RMSNORM(m, n, d) + 8 * m  # noqa: E731
    with_targets = lambda m, n, d: CROSS_ENTROPY(m, n, d) + 8 * m + 4 * m + 4  # noqa: E731
    assert check_floor(with_rstd, FLOOR, "rmsnorm", verbose=False).passed
    assert check_floor(with_targets, FLOOR, "cross_entropy", verbose=False).passed


# ---------------------------------------------------------------------------------------------------------------------
# Unfinished and broken answers
# ---------------------------------------------------------------------------------------------------------------------


def stub_bytes(M, N, dtype):
    return None


def stub_floor(n_bytes, gbps):
    return None


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_stubs_say_not_done_and_do_not_raise(kernel, capsys):
    report = check_floor(stub_bytes, stub_floor, kernel)
    assert not report.passed
    printed = capsys.readouterr().out
    assert says("not_done_bytes", printed) and says("not_done_floor", printed)
    for transfer in TRANSFERS[kernel]:
        assert str(transfer) in printed


def test_exceptions_and_non_numbers_are_reported():
    def boom(M, N, dtype):
        raise ZeroDivisionError("division by zero")

    assert says("raised", bytes_message(boom, "rmsnorm"))
    assert "ZeroDivisionError" in bytes_message(boom, "rmsnorm")
    assert says("not_a_number", bytes_message(lambda M, N, d: "many", "rmsnorm"))
    assert says("not_a_number", floor_message(lambda n, g: [n / g]))
    assert says("not_a_number", floor_message(lambda n, g: math.nan))


# ---------------------------------------------------------------------------------------------------------------------
# minimal_bytes: each mistake named
# ---------------------------------------------------------------------------------------------------------------------


def rms(activations: int, weight: int, size=lambda d: d.itemsize, per_row: int = 0):
    """An RMSNorm count of ``activations`` [M, N] transfers and ``weight`` [N] transfers."""
    return lambda M, N, d: activations * M * N * size(d) + weight * N * size(d) + per_row * M


def ce(transfers: int, size=lambda d: d.itemsize):
    return lambda M, N, d: transfers * M * N * size(d)


BITS = lambda d: torch.finfo(d).bits  # noqa: E731
FP32 = lambda d: 4  # noqa: E731
FIXED_2 = lambda d: 2  # noqa: E731

PLANTED_BYTES = [
    # (kernel, attempt, the diagnoses it must name)
    ("rmsnorm", rms(5, 3, BITS), ["element_in_bits"]),
    ("rmsnorm", rms(5, 3, FP32), ["float32_size"]),
    ("rmsnorm", rms(5, 3, FIXED_2), ["fixed_2_bytes"]),
    ("rmsnorm", rms(4, 3), ["x_once"]),
    ("rmsnorm", rms(5, 2), ["no_dw"]),
    ("rmsnorm", rms(5, 0), ["no_weight"]),
    ("rmsnorm", rms(3, 2), ["reads_only", "backward_only"]),  # the same bytes: both are named
    ("rmsnorm", rms(2, 1), ["writes_only", "forward_only"]),
    ("rmsnorm", rms(4, 2), ["two_mistakes", "x_once", "no_dw"]),
    ("rmsnorm", rms(5, 0, FP32), ["two_mistakes", "no_weight", "float32_size"]),
    ("rmsnorm", rms(5, 3, per_row=100), ["per_row"]),
    ("rmsnorm", lambda M, N, d: RMSNORM(M, N, d) + 1000, ["constant"]),
    ("rmsnorm", rms(6, 3), ["y_read"]),  # the backward reading y as well
    ("rmsnorm", rms(7, 0), ["unrecognised"]),
    ("rmsnorm", lambda M, N, d: RMSNORM(M, N, d) / 1e6, ["not_bytes"]),
    ("rmsnorm", lambda M, N, d: M * M * N * d.itemsize, ["not_linear"]),
    ("cross_entropy", ce(2), ["logits_once", "reads_only"]),  # one read + the write, or the two reads alone
    ("cross_entropy", ce(1), ["writes_only"]),
    ("cross_entropy", ce(3, BITS), ["element_in_bits"]),
    ("cross_entropy", ce(3, FP32), ["float32_size"]),
    ("cross_entropy", ce(3, FIXED_2), ["fixed_2_bytes"]),
    ("cross_entropy", lambda M, N, d: CROSS_ENTROPY(M, N, d) / 2**30, ["not_bytes"]),
    ("cross_entropy", ce(4), ["four_transfers"]),  # the gradient written twice, or a third read
    ("cross_entropy", ce(5), ["unrecognised"]),
]


@pytest.mark.parametrize("kernel, attempt, keys", PLANTED_BYTES,
                         ids=[f"{k}-{'+'.join(keys)}" for k, _, keys in PLANTED_BYTES])
def test_each_byte_count_mistake_is_named(kernel, attempt, keys):
    message = bytes_message(attempt, kernel)
    for key in keys:
        assert says(key, message), (key, message)
    if len(keys) > 1 and keys[0] != "two_mistakes":
        assert says("ambiguous", message), message


def test_every_byte_mistake_has_its_wording_and_a_planted_answer():
    planted = {key for _, _, keys in PLANTED_BYTES for key in keys}
    named = {key for filters in BYTES_MISTAKES.values() for key in filters} | set(SIZE_MISTAKES)
    named |= {key for extras in EXTRA_TRANSFERS.values() for key in extras}
    assert named <= set(HINTS)
    assert named <= planted, named - planted


def test_the_unrecognised_count_shows_the_terms():
    message = bytes_message(rms(7, 0), "rmsnorm")
    assert "you count 14 bytes, the transfers 10" in message and "you count 0, the transfers 6" in message
    assert "per element of [N]" not in bytes_message(ce(5), "cross_entropy")


# ---------------------------------------------------------------------------------------------------------------------
# The package's own count and floor: refused by name, wherever the learner's code reaches them
# ---------------------------------------------------------------------------------------------------------------------


def sweep_plus_weight(M, N, dtype):
    # The sweep's count, with the weight the table rounds away added back.
    return rmsnorm_bytes(M, N, dtype.itemsize) + 3 * N * dtype.itemsize


def sweep_two_read(N, V, dtype):
    return cross_entropy_bytes(N, V, dtype.itemsize, "two_read")


def package_count(M, N, dtype):
    from kernels.exercises import bandwidth

    return bandwidth.transfer_bytes("rmsnorm", M, N, dtype)


def floor_from_ms(n_bytes, gbps):
    return floor_ms(n_bytes, gbps) * 1e3


def floor_from_module(n_bytes, gbps):
    from kernels.bench import timing

    return timing.floor_ms(n_bytes, gbps) * 1e3


@pytest.mark.parametrize("kernel, attempt, name", [
    ("rmsnorm", sweep_plus_weight, "rmsnorm_bytes"),
    ("rmsnorm", package_count, "transfer_bytes"),
    ("rmsnorm", lambda M, N, d: transfer_bytes("rmsnorm", M, N, d), "transfer_bytes"),
    ("cross_entropy", sweep_two_read, "cross_entropy_bytes"),
])
def test_the_package_count_is_refused(kernel, attempt, name):
    message = bytes_message(attempt, kernel)
    assert name in message and "finished answer" in message, message


@pytest.mark.parametrize("attempt, name", [(floor_from_ms, "floor_ms"), (floor_from_module, "floor_ms")])
def test_the_package_floor_is_refused(attempt, name):
    message = floor_message(attempt)
    assert name in message and "finished answer" in message, message
    assert floor_ms(4e9, 4000) == pytest.approx(1.0)  # put back afterwards


def test_a_refused_answer_leaves_the_comparison_empty(capsys):
    rows = compare_floor("rmsnorm", measurements(fake_results()), sweep_plus_weight, floor_from_ms)
    assert rows[0]["yours_us"] is None and "✓" not in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------------------------
# floor_us: each unit mistake named
# ---------------------------------------------------------------------------------------------------------------------

PLANTED_FLOORS = {
    "milliseconds": lambda n, g: n / (g * 1e9) * 1e3,
    "seconds": lambda n, g: n / (g * 1e9),
    "nanoseconds": lambda n, g: n / (g * 1e9) * 1e9,
    "gib": lambda n, g: n / (g * 2**30) * 1e6,
    "gib_bytes": lambda n, g: n / (g * 1e9 / 2**30 * 1e9) * 1e6,  # GB/s "converted" from GiB/s the wrong way
    "bytes_as_bits": lambda n, g: 8 * n / (g * 1e9) * 1e6,
    "gigabits": lambda n, g: n / (8 * g * 1e9) * 1e6,
    "halved_bandwidth": lambda n, g: n / (g / 2 * 1e9) * 1e6,
    "doubled_bandwidth": lambda n, g: n / (2 * g * 1e9) * 1e6,
    "multiplied": lambda n, g: n * g / 1e3,
    "inverted": lambda n, g: g / n * 1e3,
    "unrecognised_floor": lambda n, g: n / (g * 1e9) * 1e6 + 1.0,
}


@pytest.mark.parametrize("key", list(PLANTED_FLOORS))
def test_each_floor_mistake_is_named(key):
    assert says(key, floor_message(PLANTED_FLOORS[key]))


def test_every_floor_mistake_has_a_planted_answer():
    assert set(FLOOR_MISTAKES) <= set(PLANTED_FLOORS) and set(FLOOR_MISTAKES) <= set(HINTS)


def test_two_unit_mistakes_at_once():
    message = floor_message(lambda n, g: n / (g * 2**30) * 1e3)  # GiB/s and milliseconds
    assert says("two_mistakes", message) and says("milliseconds", message) and says("gib", message)


# ---------------------------------------------------------------------------------------------------------------------
# The floor against the clock
# ---------------------------------------------------------------------------------------------------------------------


def fake_results(mode="gpu"):
    row = dict(impl="ours", status="ok", dtype="bfloat16")
    rows = [{**row, "pass": "fwd+bwd", "tokens": 16384, "width": 4096, "device_ms": 0.1743},
            {**row, "pass": "fwd", "tokens": 16384, "width": 4096, "device_ms": 0.07},
            {**row, "pass": "fwd+bwd", "impl": "hf", "tokens": 16384, "width": 4096, "device_ms": 1.0}]
    return {"mode": mode, "device": "NVIDIA H200", "date": "2026-11-24T12:00", "ceilings": {"copy_gbps": 4274.0},
            "rows": rows}


def test_measurements_take_ours_forward_and_backward_from_a_gpu_run():
    found = measurements(fake_results())
    assert found == [Measurement(16384, 4096, 0.1743, 4274.0, torch.bfloat16, "NVIDIA H200, 2026-11-24")]
    assert measurements(fake_results(), "committed run")[0].source == "committed run, NVIDIA H200, 2026-11-24"
    assert measurements(fake_results("interpreter")) == [] and measurements(None) == []


def test_compare_floor_sets_the_floor_beside_the_time(capsys):
    rows = compare_floor("rmsnorm", measurements(fake_results()), RMSNORM, FLOOR)
    out = capsys.readouterr().out
    (row,) = rows
    assert row["floor_us"] == pytest.approx(transfer_bytes("rmsnorm", 16384, 4096) / 4274e9 * 1e6)
    assert row["yours_us"] == pytest.approx(row["floor_us"])
    assert row["floor_over_device"] == pytest.approx(row["floor_us"] / 174.3)
    assert "✓ your floor is the package's at every shape" in out and "4,274 GB/s" in out


def test_compare_floor_flags_a_floor_the_kernel_beats(capsys):
    compare_floor("rmsnorm", measurements(fake_results()), rms(5, 3, FP32), FLOOR)
    assert "no kernel beats its floor" in capsys.readouterr().out
    rows = compare_floor("rmsnorm", measurements(fake_results()), stub_bytes, stub_floor)
    assert rows[0]["yours_us"] is None and "stays empty" in capsys.readouterr().out


def test_compare_floor_on_the_committed_runs(capsys):
    from kernels.bench.results import load_results

    for kernel in KERNELS:
        results = load_results(kernel)
        if results is None:
            pytest.skip("no committed GPU results")
        rows = compare_floor(kernel, measurements(results), RIGHT_BYTES[kernel], FLOOR, verbose=False)
        assert rows and all(0 < r["floor_over_device"] <= 1.0 for r in rows)  # no kernel beats its floor
