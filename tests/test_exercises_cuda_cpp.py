"""The chapter 13 exercise check: a right row loop passes; the stub and the usual mistakes are named, never raised.

Each distinct source is one small build (no PyTorch headers: about a second)."""

import pytest

from kernels import cuda_rmsnorm
from kernels.exercises.cuda_cpp import STUB, check_rms_norm_rows

pytestmark = pytest.mark.skipif(cuda_rmsnorm.cpu_build_unavailable() is not None,
                                reason=f"no C++ build here: {cuda_rmsnorm.cpu_build_unavailable()}")

RIGHT = r"""
extern "C" void rms_norm_rows(const float* x, int64_t x_row_stride, const float* w, float* y, float* rstd,
                              int64_t rows, int64_t cols, float eps) {
  for (int64_t row = 0; row < rows; ++row) {
    const float* x_row = x + row * x_row_stride;
    float sum_sq = 0.0f;
    for (int64_t c = 0; c < cols; ++c) sum_sq += x_row[c] * x_row[c];
    const float r = 1.0f / std::sqrt(sum_sq / cols + eps);
    for (int64_t c = 0; c < cols; ++c) y[row * cols + c] = w[c] * (x_row[c] * r);
    rstd[row] = r;
  }
}
"""


def test_a_right_answer_passes(seed):
    report = check_rms_norm_rows(RIGHT, seed=seed, verbose=False)
    assert report, report.message


def test_the_stub_is_reported_as_not_written(seed):
    report = check_rms_norm_rows(STUB, seed=seed, verbose=False)
    assert not report and "never written" in report.message


def test_ignoring_the_row_stride_is_named(seed):
    report = check_rms_norm_rows(RIGHT.replace("row * x_row_stride", "row * cols"), seed=seed, verbose=False)
    assert not report and "x_row_stride" in report.message and "128 floats apart" in report.message


def test_a_compile_error_is_reported_not_raised(seed):
    report = check_rms_norm_rows(RIGHT.replace("float sum_sq", "flaot sum_sq"), seed=seed, verbose=False)
    assert not report and "does not compile" in report.message and "flaot" in report.message
