"""The chapter 13 exercise check: the solution passes; the stub and every usual mistake of the C++ row loop are named
with the sentence of ``DIAGNOSES``, never raised.

Each distinct source is one small build (no PyTorch headers: about a second, then cached by its hash)."""

import pytest

from kernels import cuda_rmsnorm
from kernels.exercises import solutions
from kernels.exercises.cuda_cpp import DIAGNOSES, STUB, check_rms_norm_rows, diagnosis
from kernels.exercises.solutions import load

pytestmark = pytest.mark.skipif(cuda_rmsnorm.cpu_build_unavailable() is not None,
                                reason=f"no C++ build here: {cuda_rmsnorm.cpu_build_unavailable()}")

RIGHT = load("rms_norm_rows")()

# Each wrong answer: (diagnosis key, the edit of the right source that makes the mistake).
SUM = "sum_sq += x_row[c] * x_row[c];"
R = "const float r = 1.0f / std::sqrt(sum_sq / static_cast<float>(cols) + eps);"
WRITE = "y[row * cols + c] = w[c] * (x_row[c] * r);"
MISTAKES = {
    "not_written": (WRITE, "(void)w;"),
    "partly_written": ("for (int64_t c = 0; c < cols; ++c) y[", "for (int64_t c = 1; c < cols; ++c) y["),
    "past_y": ("for (int64_t c = 0; c < cols; ++c) y[", "for (int64_t c = 0; c <= cols; ++c) y["),
    "y_stride": (WRITE, "y[row * x_row_stride + c] = w[c] * (x_row[c] * r);"),
    "no_eps": (R, "const float r = 1.0f / std::sqrt(sum_sq / static_cast<float>(cols));"),
    "fixed_eps": (R, "const float r = 1.0f / std::sqrt(sum_sq / static_cast<float>(cols) + 1e-6f);"),
    "eps_outside": (R, "const float r = 1.0f / (std::sqrt(sum_sq / static_cast<float>(cols)) + eps);"),
    "no_weight": (WRITE, "y[row * cols + c] = x_row[c] * r;"),
    "sum_not_mean": (R, "const float r = 1.0f / std::sqrt(sum_sq + eps);"),
    "times_sqrt": (R, "const float r = std::sqrt(sum_sq / static_cast<float>(cols) + eps);"),
    "x_stride": ("x + row * x_row_stride", "x + row * cols"),
    "nan_y": (SUM, "sum_sq -= x_row[c] * x_row[c];"),
    "wrong_y": (SUM, "sum_sq += std::abs(x_row[c]);"),
    "no_rstd": ("rstd[row] = r;", ""),
    "rstd_is_std": ("rstd[row] = r;", "rstd[row] = 1.0f / r;"),
    "wrong_rstd": ("rstd[row] = r;", "rstd[row] = r * r;"),
    "no_function": ('extern "C" void', "void"),
}


def test_the_solution_passes(seed):
    assert "rms_norm_rows" in solutions.names()
    report = check_rms_norm_rows(RIGHT, seed=seed, verbose=False)
    assert report, report.message
    assert report.message.startswith("✓ " + DIAGNOSES["passed"].split("{")[0])


@pytest.mark.parametrize("key", sorted(MISTAKES))
def test_each_mistake_is_named(key, seed):
    old, new = MISTAKES[key]
    assert old in RIGHT, f"the edit for {key} no longer applies to the solution"
    report = check_rms_norm_rows(RIGHT.replace(old, new), seed=seed, verbose=False)
    expected = DIAGNOSES[key].split("{")[0]  # the sentence up to its first field
    assert not report and expected in report.message, report.message


def test_the_stub_is_reported_as_not_written(seed):
    report = check_rms_norm_rows(STUB, seed=seed, verbose=False)
    assert not report and DIAGNOSES["not_written"] in report.message


def test_the_case_is_named():
    report = check_rms_norm_rows(RIGHT.replace(*MISTAKES["x_stride"]), verbose=False)
    assert "128 floats apart" in report.message
    report = check_rms_norm_rows(RIGHT.replace(*MISTAKES["fixed_eps"]), verbose=False)
    assert "eps=1e-05" in report.message


def test_a_compile_error_is_reported_not_raised(seed):
    report = check_rms_norm_rows(RIGHT.replace("float sum_sq", "flaot sum_sq"), seed=seed, verbose=False)
    assert not report and DIAGNOSES["compile"].split("{")[0] in report.message and "flaot" in report.message
    assert "/" not in report.message.split("main.cpp:", 1)[0], "the build folder's path leaked into the message"


def test_no_compiler_is_reported_not_raised(monkeypatch):
    monkeypatch.setattr(cuda_rmsnorm, "cpu_build_unavailable", lambda: "no C++ compiler found")
    report = check_rms_norm_rows(RIGHT, verbose=False)
    assert not report and report.message == "✗ " + diagnosis("unavailable", reason="no C++ compiler found")


def test_every_diagnosis_has_a_test():
    tested = set(MISTAKES) | {"compile", "unavailable", "passed"}
    assert tested == set(DIAGNOSES)


def test_the_verdict_is_printed(capsys):
    check_rms_norm_rows(STUB)
    assert capsys.readouterr().out.startswith("✗ on an input of 7 × 64, y was never written")
