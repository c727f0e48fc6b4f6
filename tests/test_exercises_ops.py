"""The chapter 09 exercise check accepts the package's fake and names each usual mistake."""

import torch

from kernels.exercises.ops import check_rms_norm_fake
from kernels.rmsnorm import rms_norm_fwd_fake


def _rows(x):
    return x.numel() // x.shape[-1]


def test_the_package_fake_passes():
    assert check_rms_norm_fake(rms_norm_fwd_fake, verbose=False)


def test_output_dtype_must_follow_promotion():
    report = check_rms_norm_fake(
        lambda x, w, eps: (torch.empty_like(x), x.new_empty(_rows(x), dtype=torch.float32)), verbose=False)
    assert not report and "float32 weight" in report.message and "promote_types" in report.message


def test_rstd_needs_one_value_per_row_of_every_leading_dimension():
    report = check_rms_norm_fake(
        lambda x, w, eps: (torch.empty(x.shape, dtype=torch.promote_types(x.dtype, w.dtype), device=x.device),
                           x.new_empty(x.shape[0], dtype=torch.float32)), verbose=False)
    assert not report and "3-D" in report.message and "rstd has the wrong shape" in report.message


def test_rstd_is_float32():
    report = check_rms_norm_fake(
        lambda x, w, eps: (torch.empty(x.shape, dtype=torch.promote_types(x.dtype, w.dtype), device=x.device),
                           x.new_empty(_rows(x))), verbose=False)
    assert not report and "rstd has the wrong dtype" in report.message


def test_reading_values_is_reported_not_raised():
    report = check_rms_norm_fake(lambda x, w, eps: (x * float(x.sum()), x), verbose=False)
    assert not report and "never at values" in report.message


def test_wrong_return_type_is_reported():
    report = check_rms_norm_fake(lambda x, w, eps: None, verbose=False)
    assert not report and "two tensors" in report.message
