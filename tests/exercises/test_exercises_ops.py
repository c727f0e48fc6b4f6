"""The chapter 09 exercise check: the solution and the package's fake pass, and each usual mistake is named."""


import diagnoses
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from triton.runtime.jit import KernelInterface

import kernels
from kernels import runtime
from kernels.exercises.ops import HINTS, check_rms_norm_fake
from kernels.exercises.solutions import load
from kernels.rmsnorm import rms_norm_forward, rms_norm_fwd_fake, rms_norm_fwd_op


def _rows(x):
    return x.numel() // x.shape[-1]


def _y(x, w):
    return torch.empty(x.shape, dtype=torch.promote_types(x.dtype, w.dtype), device=x.device)


def _rstd(x, rows=None):
    return torch.empty(_rows(x) if rows is None else rows, dtype=torch.float32, device=x.device)


def _sentence(key: str) -> str:
    """The words that tell diagnosis ``key`` apart."""
    return diagnoses.sentence(HINTS[key])


def _diagnosis(fake) -> str:
    report = check_rms_norm_fake(fake, verbose=False)
    assert not report, f"a wrong fake passed: {report.message}"
    return report.message


def test_the_solution_passes():
    assert check_rms_norm_fake(load("rms_norm_fake"), verbose=False)


def _by_the_operator(x, w, eps):
    # The chapter's section 2 calls the package's operator under FakeTensorMode: it answers from the finished fake.
    return torch.ops.kernels.rms_norm_fwd(x, w, eps)


def _by_the_overload(x, w, eps):
    return torch.ops.kernels.rms_norm_fwd.default(x, w, eps)


def _by_the_package_fake(x, w, eps):
    return rms_norm_fwd_fake(x, w, eps)


def _by_the_op_handle(x, w, eps):
    return rms_norm_fwd_op(x, w, eps)


def _by_the_package_rms_norm(x, w, eps):
    return kernels.rms_norm(x, w, eps), _rstd(x)


def _by_the_operator_caught(x, w, eps):
    try:
        return torch.ops.kernels.rms_norm_fwd(x, w, eps)
    except Exception:  # noqa: BLE001  (a learner hiding the refusal: still refused)
        return _y(x, w), _rstd(x)


@pytest.mark.parametrize("fake, name", [
    (rms_norm_fwd_fake, "rms_norm_fwd_fake"),  # the package's fake handed to the check
    (_by_the_package_fake, "rms_norm_fwd_fake"),
    (_by_the_operator, "torch.ops.kernels.rms_norm_fwd"),
    (_by_the_overload, "torch.ops.kernels.rms_norm_fwd"),
    (_by_the_op_handle, "torch.ops.kernels.rms_norm_fwd"),
    (_by_the_package_rms_norm, "kernels.rmsnorm.rms_norm"),
    (_by_the_operator_caught, "torch.ops.kernels.rms_norm_fwd"),
])
def test_the_package_fake_is_refused_by_name(fake, name):
    message = _diagnosis(fake)
    assert name in message and "finished answer" in message, message
    x = torch.randn(3, 16, device=runtime.device())
    with FakeTensorMode():  # the operator answers from its fake again afterwards
        y, _ = torch.ops.kernels.rms_norm_fwd(torch.empty(3, 16), torch.empty(16), 1e-6)
    assert y.shape == x.shape


def _stub(x, w, eps):
    raise NotImplementedError


_ROWS_BY_SHAPE: dict = {}


def _rows_by_shape(x):
    # Memoised by shape: fine with the ints of static shapes; symbolic sizes (dynamic shapes) cannot be hashed.
    return _ROWS_BY_SHAPE.setdefault(tuple(x.shape), _rows(x))


MISTAKES = {
    "stub": _stub,
    "reads_values": lambda x, w, eps: (x * float(x.sum()), _rstd(x)),
    "launched": lambda x, w, eps: rms_norm_forward(x, w, eps),
    "raised": lambda x, w, eps: (_y(x, w), torch.empty(x.rows)),
    "not_pair": lambda x, w, eps: _y(x, w),
    "not_tensor": lambda x, w, eps: (_y(x, w), _rows(x)),
    "y_flat": lambda x, w, eps: (_y(x, w).reshape(-1, x.shape[-1]), _rstd(x)),
    "y_shape": lambda x, w, eps: (torch.empty(x.shape[:-1], dtype=torch.promote_types(x.dtype, w.dtype),
                                              device=x.device), _rstd(x)),
    "y_dtype": lambda x, w, eps: (torch.empty(x.shape, dtype=x.dtype, device=x.device), _rstd(x)),
    "y_strides": lambda x, w, eps: (torch.empty_like(x, dtype=torch.promote_types(x.dtype, w.dtype)), _rstd(x)),
    "device": lambda x, w, eps: (torch.empty(x.shape, dtype=torch.promote_types(x.dtype, w.dtype)),
                                 torch.empty(_rows(x), dtype=torch.float32)),
    "rstd_not_flat": lambda x, w, eps: (_y(x, w), torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)),
    "rstd_one_dimension": lambda x, w, eps: (_y(x, w), _rstd(x, rows=x.shape[0])),
    "rstd_shape": lambda x, w, eps: (_y(x, w), _rstd(x, rows=x.shape[-1])),
    "rstd_dtype": lambda x, w, eps: (_y(x, w), x.new_empty(_rows(x))),
    "rstd_strides": lambda x, w, eps: (_y(x, w), _rstd(x, rows=2 * _rows(x))[::2]),
    "aliases": lambda x, w, eps: (x.to(torch.promote_types(x.dtype, w.dtype)), _rstd(x)),
    "opcheck": lambda x, w, eps: (_y(x, w), _rstd(x, rows=_rows_by_shape(x))),
}


def test_every_diagnosis_has_a_mistake_here():
    assert set(MISTAKES) == set(HINTS)


@pytest.mark.parametrize("key", sorted(MISTAKES))
def test_each_mistake_is_named(key):
    message = _diagnosis(MISTAKES[key])
    assert _sentence(key) in message
    others = [k for k in HINTS if k != key and _sentence(k) not in HINTS[key] and _sentence(k) in message]
    assert not others, f"{key} was also described as {others}"


def test_the_input_is_named():
    assert "float32 weight" in _diagnosis(MISTAKES["y_dtype"])
    assert "3-D" in _diagnosis(MISTAKES["rstd_one_dimension"])
    assert "transposed" in _diagnosis(MISTAKES["y_strides"])
    device = _diagnosis(MISTAKES["device"])
    assert "GPU" in device or "cuda" in device, device  # in the interpreter: "a GPU"; on one: the devices by name


def test_no_launch_is_left_refused_after_a_check():
    original = KernelInterface.__getitem__
    _diagnosis(MISTAKES["launched"])
    assert KernelInterface.__getitem__ is original
    x = torch.randn(3, 16, device=runtime.device())
    y, _ = rms_norm_forward(x, torch.randn(16, device=x.device), 1e-6)  # kernels launch again
    assert y.shape == x.shape


def test_opcheck_runs_the_registered_fake_under_dynamic_shapes():
    message = _diagnosis(MISTAKES["opcheck"])
    assert "test_aot_dispatch_dynamic" in message, message
