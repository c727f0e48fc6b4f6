"""Chapter 18's exercise check (kernels/exercises/fp8.py): the solution passes, each planted mistake
is named with its own hint, the finished quantiser is out of reach, and nothing raises."""


import pytest
import torch
import triton
import triton.language as tl
from diagnoses import key_words

from kernels import fp8, runtime
from kernels.exercises import fp8 as check_module
from kernels.exercises import solutions
from kernels.exercises.fp8 import CASES, HINTS, check_quantize_row_kernel
from kernels.fp8 import fp8_bits

# The planted mistakes, one constexpr value each (0 is the right kernel).
MISTAKES = {
    "right": 0, "no_divide": 1, "inverted": 2, "multiplied": 3, "signed_max": 4, "zero_nan": 5,
    "zero_floor": 6, "no_floor": 7, "per_tensor": 8, "scale_slot": 9, "load_mask": 10, "store_mask": 11,
    "stride": 12, "q_stride": 13, "hard448": 14, "clamp448": 15, "scale_rounding": 16, "rounding": 17,
    "q_never_stored": 18, "s_never_stored": 19, "stub": 20, "raised": 21, "s_outside": 22, "codes": 23,
    "scale": 24,
}


@triton.jit
def _planted(X, Q, S, cols, stride_x, FP8_MAX_VALUE: tl.constexpr, FLOOR: tl.constexpr,
             FP8: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, BLOCK: tl.constexpr,
             MISTAKE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    load_mask = c < cols
    if MISTAKE == 10:  # the load's mask dropped
        load_mask = c >= 0
    x_row = row * stride_x
    if MISTAKE == 12:  # x's rows taken as cols apart
        x_row = row * cols
    x = tl.load(X + x_row + c, mask=load_mask, other=0.0).to(tl.float32)
    if MISTAKE == 21:  # a 2-D reduction on a 1-D block
        x = tl.max(x, axis=1)

    amax = tl.max(tl.abs(x), axis=0)
    if MISTAKE == 4:  # the largest value, not the largest magnitude
        amax = tl.max(x, axis=0)
    if MISTAKE == 8:  # the whole tensor's amax
        for r in range(0, tl.num_programs(0)):
            xr = tl.load(X + r * stride_x + c, mask=c < cols, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(xr), axis=0))
    divisor = FP8_MAX_VALUE
    if MISTAKE == 14:  # e4m3's largest value, whatever the format
        divisor = 448.0
    scale = tl.math.div_rn(amax, divisor)
    if MISTAKE == 1:  # amax itself
        scale = amax
    if MISTAKE == 2:  # upside down
        scale = tl.math.div_rn(FP8_MAX_VALUE + 0.0 * amax, amax)
    if MISTAKE == 16:  # a product with the reciprocal
        scale = amax * (1.0 / FP8_MAX_VALUE)
    if MISTAKE != 5 and MISTAKE != 7:  # 5, 7: no floor
        scale = tl.maximum(scale, FLOOR)
    if MISTAKE != 5 and MISTAKE != 6:  # 5, 6: no guard for a row of zeros
        scale = tl.where(amax == 0.0, 1.0, scale)
    if MISTAKE == 24:  # half the format's range
        scale = tl.math.div_rn(amax, FP8_MAX_VALUE * 0.5)

    divide_by = scale
    if MISTAKE == 23:  # codes of another scale than the one stored
        divide_by = scale * 1.5
    y = tl.math.div_rn(x, divide_by)
    if MISTAKE == 3:  # multiplied
        y = x * scale
    limit = FP8_MAX_VALUE
    if MISTAKE == 15:  # e4m3's clamp, whatever the format
        limit = 448.0
    y = tl.minimum(tl.maximum(y, -limit), limit)
    codes = fp8_bits(y, FP8, MBITS, EMIN)
    if MISTAKE == 17:  # the interpreter's own conversion, which truncates
        codes = y.to(FP8).to(tl.uint8, bitcast=True)

    q_row = row * cols
    if MISTAKE == 13:  # Q's rows taken as x's
        q_row = row * stride_x
    store_mask = c < cols
    if MISTAKE == 11:  # the store's mask dropped
        store_mask = c >= 0
    if MISTAKE != 18 and MISTAKE != 20:
        tl.store(Q + q_row + c, codes, mask=store_mask)
    s_at = S + row
    if MISTAKE == 9:  # one slot for all
        s_at = S
    if MISTAKE == 22:  # one row further
        s_at = S + row + 1
    if MISTAKE != 19 and MISTAKE != 20:
        tl.store(s_at, scale)


# The exercise cell's stub, as chapter 18 gives it (the cell in notebooks/18_fp8_lora.ipynb).
@triton.jit
def _stub(X, Q, S, cols, stride_x, FP8_MAX_VALUE: tl.constexpr, FLOOR: tl.constexpr,
          FP8: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # this program's row (int64: row * stride cannot overflow)
    c = tl.arange(0, BLOCK)  # the row's columns, padded to BLOCK lanes
    x = tl.load(X + row * stride_x + c, mask=c < cols, other=0.0).to(tl.float32)
    # YOUR CODE: amax, the largest |x| of the row; scale = amax / FP8_MAX_VALUE (tl.math.div_rn),
    # at least FLOOR, and 1 for a row of zeros
    scale = 1.0  # noqa: F841  (the cell's placeholders, unused until the reader's lines)
    # YOUR CODE: y = x / scale (tl.math.div_rn), clamped to ±FP8_MAX_VALUE
    y = x  # noqa: F841
    # YOUR CODE: store fp8_bits(y, FP8, MBITS, EMIN) at Q + row * cols + c (Q is contiguous),
    # masked, and the scale at S + row


class _Planted:
    """``_planted`` with one mistake bound, launched like the reader's kernel (``kernel[grid](...)``)."""

    def __init__(self, mistake: str):
        self.mistake = MISTAKES[mistake]

    def __getitem__(self, grid):
        return lambda *args, **kwargs: _planted[grid](*args, **kwargs, MISTAKE=self.mistake)


class _Cheat:
    """A stand-in kernel whose launch fills Q and S with ``finished(x, fp8_dtype)``'s answer."""

    def __init__(self, finished):
        self.finished = finished

    def __getitem__(self, grid):
        def launch(x, q, s, cols, stride_x, FP8_MAX_VALUE, **kwargs):
            fmt = torch.float8_e4m3fn if FP8_MAX_VALUE == 448.0 else torch.float8_e5m2
            codes, scales = self.finished(x, fmt)
            q.copy_(codes.view(torch.uint8))
            s.copy_(scales)
        return launch


def _words(key: str) -> str:
    return key_words(HINTS[key])


def test_the_solution_passes(capsys):
    assert "quantize_row_kernel" in solutions.names()
    report = check_quantize_row_kernel(solutions.load("quantize_row_kernel"))
    assert report.passed and report.message.startswith("✓") and "bit for bit" in capsys.readouterr().out


def test_the_stub_as_given_fails_as_the_stub():
    report = check_quantize_row_kernel(_stub, verbose=False)
    assert not report.passed and _words("stub") in report.message, report.message


def test_the_planted_kernel_without_a_mistake_passes():
    assert check_quantize_row_kernel(_Planted("right"), verbose=False, seed=0).passed


@pytest.mark.parametrize("mistake", [m for m in MISTAKES if m != "right"])
def test_each_planted_mistake_is_named(mistake):
    if mistake == "rounding" and not runtime.INTERPRET:
        pytest.skip("a GPU's y.to(FP8) rounds to nearest-even: only the interpreter's truncates")
    report = check_quantize_row_kernel(_Planted(mistake), verbose=False, seed=0)
    assert not report.passed and report.message.startswith("✗")
    assert _words(mistake) in report.message, report.message


def test_every_hint_but_the_environment_s_is_planted():
    environment = {"passed", "no_fp8", "not_kernel"}
    assert set(HINTS) - environment == set(MISTAKES) - {"right"}


def test_the_mistakes_are_named_on_fresh_inputs_too():
    for mistake in ("signed_max", "per_tensor", "load_mask", "no_floor", "hard448"):
        report = check_quantize_row_kernel(_Planted(mistake), verbose=False)
        assert _words(mistake) in report.message, report.message


def test_a_plain_function_is_not_a_kernel():
    def quantize_row_kernel(X, Q, S, cols, stride_x):
        return None

    report = check_quantize_row_kernel(quantize_row_kernel, verbose=False)
    assert not report.passed and "not a Triton kernel" in report.message


def test_a_gpu_without_fp8_is_said(monkeypatch):
    monkeypatch.setattr(check_module, "triton_problem", lambda device: "compute capability (8, 0)")
    report = check_quantize_row_kernel(solutions.load("quantize_row_kernel"), verbose=False)
    assert not report.passed and "compute capability (8, 0)" in report.message


@pytest.mark.parametrize("finished, name", [
    (lambda x, fmt: fp8.quantize_rows(x, fmt), "kernels.fp8.quantize_rows "),
    (lambda x, fmt: fp8.quantize_rows_reference(x, fmt), "quantize_rows_reference"),
    (lambda x, fmt: torch.ops.kernels.quantize_rows(x, fmt), "ops.kernels.quantize_rows"),
    (lambda x, fmt: (fp8.quantize_rows_reference(x, fmt, scale=fp8.row_scales_reference(x, fmt))),
     "row_scales_reference"),
])
def test_the_finished_quantiser_is_out_of_reach(finished, name):
    report = check_quantize_row_kernel(_Cheat(finished), verbose=False)
    assert not report.passed and name in report.message and "finished answer" in report.message


def test_the_package_kernel_itself_is_refused():
    report = check_quantize_row_kernel(fp8.quantize_rows_kernel, verbose=False)
    assert not report.passed and "quantize_rows_kernel" in report.message and "finished" in report.message


def test_the_solution_itself_is_refused():
    from kernels.exercises.solutions.quantize_row_kernel import quantize_row_kernel

    report = check_quantize_row_kernel(quantize_row_kernel, verbose=False)
    assert not report.passed and "hidden solution" in report.message


def test_the_inputs_hold_what_the_diagnoses_need():
    # The first case has a row of zeros and a negative outlier, the second a view of an odd width
    # and a row of tiny values, the third is e5m2: each diagnosis has an input that shows it.
    first, second, third = CASES
    assert 0.0 in first.magnitudes and first.outlier_row is not None
    assert None in second.magnitudes and second.stride != second.cols and second.block > second.cols
    assert third.fp8 == torch.float8_e5m2 and third.block > third.cols


@pytest.mark.gpu
def test_on_a_gpu_the_solution_passes_and_its_conversion_needs_no_help():
    # The hardware converts float32 to FP8 rounding to nearest-even, as PyTorch does: the solution
    # passes on fresh inputs, and so does the plain conversion the interpreter gets wrong.
    for _ in range(10):
        assert check_quantize_row_kernel(solutions.load("quantize_row_kernel"), verbose=False).passed
    assert check_quantize_row_kernel(_Planted("rounding"), verbose=False).passed
