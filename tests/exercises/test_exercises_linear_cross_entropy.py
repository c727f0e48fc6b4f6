"""The chapter 10 exercise check: the solution passes, each usual mistake is named, a stub or a crash is reported."""


import diagnoses
import pytest
import torch
import torch.nn.functional as F

from kernels.exercises.linear_cross_entropy import DIAGNOSES, check_slice_gradient
from kernels.exercises.solutions import load


def _onehot(cols, target, dtype):
    return (cols[None, :] == target[:, None]).to(dtype)


def gradient(logits, lse, target, col_start, scale, ignore_index, *, local=None, softmax=None, sign=1.0,
             times=None, counted=None, dtype=torch.float32):
    """The right answer, or one mistake in it: every keyword replaces one piece of the right computation."""
    x = logits.to(dtype)
    p = softmax(x) if softmax else torch.exp(x - lse.to(dtype)[:, None])
    width = x.shape[1]
    local = (target - col_start) if local is None else local(target - col_start, width)
    onehot = _onehot(torch.arange(width), local, dtype)
    counted = (target != ignore_index) if counted is None else counted(target, ignore_index)
    factor = scale if times is None else times(scale, x.shape[0])
    return sign * (p - onehot) * factor * counted.to(dtype)[:, None]


def right(*args):
    return gradient(*args)


def _mistake(**changes):
    return lambda *args: gradient(*args, **changes)


def _stub(*args):
    raise NotImplementedError


def _one_hot_by_index(logits, lse, target, col_start, scale, ignore_index):
    # The one-hot built by indexing with the target: a target of another slice (or -100) cannot be indexed.
    onehot = F.one_hot(target - col_start, logits.shape[1]).float()
    return (torch.exp(logits.float() - lse[:, None]) - onehot) * scale


MISTAKES = {
    "stub": _stub,
    "raised": lambda *args: 1 / 0,
    "outside_raised": _one_hot_by_index,
    "shape": lambda logits, *rest: right(logits, *rest)[:, :-1],
    "no_offset": lambda logits, lse, target, col_start, scale, ii: right(logits, lse, target, 0, scale, ii),
    "offset_off_by_one": _mistake(local=lambda local, width: local + 1),
    "outside_clamped": _mistake(local=lambda local, width: local.clamp(0, width - 1)),
    "outside_wrapped": _mistake(local=lambda local, width: local % width),
    "slice_softmax": _mistake(softmax=lambda x: torch.softmax(x, dim=1)),
    "sign": _mistake(sign=-1.0),
    "no_scale": _mistake(times=lambda scale, rows: 1.0),
    "divided_by_scale": _mistake(times=lambda scale, rows: 1 / scale),
    "scale_twice": _mistake(times=lambda scale, rows: scale * scale),
    "mean_over_rows": _mistake(times=lambda scale, rows: 1 / rows),
    "ignored_rows_count": _mistake(counted=lambda target, ignore_index: torch.ones_like(target, dtype=torch.bool)),
    "ignore_index_hardcoded": _mistake(counted=lambda target, ignore_index: target != -100),
    "no_float32": lambda logits, *rest: gradient(logits, *rest, dtype=logits.dtype),  # bfloat16 arithmetic
    "unrecognised": lambda *args: right(*args) + 0.5,
}


def _sentence(key: str) -> str:
    """The words that tell diagnosis ``key`` apart."""
    return diagnoses.sentence(DIAGNOSES[key])


def test_the_solution_passes(capsys):
    assert check_slice_gradient(load("slice_gradient"))
    assert "✓" in capsys.readouterr().out


def test_a_bfloat16_answer_rounded_once_passes():
    solution = load("slice_gradient")
    assert check_slice_gradient(lambda logits, *rest: solution(logits, *rest).to(logits.dtype), verbose=False)


def test_every_diagnosis_has_a_mistake_here():
    assert set(MISTAKES) == set(DIAGNOSES)


@pytest.mark.parametrize("key", sorted(MISTAKES))
def test_each_mistake_is_named(key, capsys):
    assert not check_slice_gradient(MISTAKES[key])
    out = capsys.readouterr().out
    assert out.startswith("✗") and _sentence(key) in out
    others = [k for k in DIAGNOSES if k != key and _sentence(k) not in DIAGNOSES[key] and _sentence(k) in out]
    assert not others, f"{key} was also described as {others}"


def test_the_slice_is_named(capsys):
    for key, words in (("no_offset", "a middle slice"), ("ignore_index_hardcoded", "ignore_index = −1"),
                       ("no_float32", "bfloat16 logits"), ("outside_raised", "the first slice")):
        check_slice_gradient(MISTAKES[key])
        assert words in capsys.readouterr().out, key


def test_the_off_by_one_the_other_way_is_named_too(capsys):
    assert not check_slice_gradient(_mistake(local=lambda local, width: local - 1))
    assert _sentence("offset_off_by_one") in capsys.readouterr().out


def test_quiet_check_prints_nothing(capsys):
    assert not check_slice_gradient(_stub, verbose=False)
    assert check_slice_gradient(right, verbose=False)
    assert capsys.readouterr().out == ""


# --------------------------------------------------------------------------------------------------------------------
# The exercise as a Triton kernel
# --------------------------------------------------------------------------------------------------------------------

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels.exercises.linear_cross_entropy import (  # noqa: E402
    KERNEL_DIAGNOSES,
    check_slice_gradient_kernel,
)


@triton.jit
def planted_kernel(LOGITS, LSE, TARGET, GRAD, n_rows, width, col_start, scale, ignore_index, stride_logits,
                   stride_grad, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, MISTAKE: tl.constexpr):
    # The solution, with the mistake named by MISTAKE planted.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    if MISTAKE == "one_column_block":
        cols = tl.arange(0, BLOCK_N)
    else:
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols < width)[None, :]
    if MISTAKE == "placeholder":
        mask = tl.zeros((ROWS, BLOCK_N), dtype=tl.int1)
    read_stride = width if MISTAKE == "contiguous" else stride_logits
    x = tl.load(LOGITS + rows[:, None] * read_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    lse = tl.load(LSE + rows, mask=row_ok, other=0.0)
    target = tl.load(TARGET + rows, mask=row_ok, other=ignore_index)
    p = tl.exp(x - lse[:, None])
    if MISTAKE == "no_offset":
        is_target = cols[None, :] == target[:, None]
    else:
        is_target = (col_start + cols)[None, :] == target[:, None]
    g = tl.where(is_target, p - 1.0, p)
    if MISTAKE != "no_scale":
        g = g * scale
    if MISTAKE == "sign":
        g = -g
    if MISTAKE != "ignored_rows_count":
        g = tl.where((target != ignore_index)[:, None], g, 0.0)
    if MISTAKE == "no_mask":
        tl.store(GRAD + rows[:, None] * stride_grad + cols[None, :], g)
    else:
        tl.store(GRAD + rows[:, None] * stride_grad + cols[None, :], g, mask=mask)


@triton.jit
def broadcast_kernel(LOGITS, LSE, TARGET, GRAD, n_rows, width, col_start, scale, ignore_index, stride_logits,
                     stride_grad, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < width)[None, :]
    x = tl.load(LOGITS + rows[:, None] * stride_logits + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    lse = tl.load(LSE + rows, mask=rows < n_rows, other=0.0)
    p = tl.exp(x - lse)  # [ROWS, BLOCK_N] − [ROWS]: the row vector needs [:, None]
    tl.store(GRAD + rows[:, None] * stride_grad + cols[None, :], p, mask=mask)


class Planted:
    """``planted_kernel`` with MISTAKE bound, launched like the reader's kernel."""

    def __init__(self, mistake):
        self.mistake = mistake

    def __getitem__(self, grid):
        return lambda *args, **kwargs: planted_kernel[grid](*args, **kwargs, MISTAKE=self.mistake)


KERNEL_CASES = {
    "placeholder": KERNEL_DIAGNOSES["nothing"],
    "no_mask": KERNEL_DIAGNOSES["outside"],
    "one_column_block": KERNEL_DIAGNOSES["unwritten"],
    "contiguous": KERNEL_DIAGNOSES["stride"],
    "no_offset": DIAGNOSES["no_offset"],
    "sign": DIAGNOSES["sign"],
    "no_scale": DIAGNOSES["no_scale"],
    "ignored_rows_count": DIAGNOSES["ignored_rows_count"],
}


def test_the_kernel_solution_passes(capsys):
    assert check_slice_gradient_kernel(load("slice_gradient_kernel"))
    assert capsys.readouterr().out.startswith("✓ " + KERNEL_DIAGNOSES["passed"][:30])


@pytest.mark.parametrize("mistake", sorted(KERNEL_CASES))
def test_each_kernel_mistake_is_named(mistake, monkeypatch, capsys):
    # The check insists on a Triton kernel: let the stand-in that binds MISTAKE pass for one.
    monkeypatch.setattr(triton.runtime.jit, "KernelInterface", (triton.runtime.jit.KernelInterface, Planted))
    assert not check_slice_gradient_kernel(Planted(mistake))
    out = capsys.readouterr().out
    assert diagnoses.says(KERNEL_CASES[mistake], out), out


def test_a_kernel_that_raises_and_a_function_are_named(capsys):
    assert not check_slice_gradient_kernel(broadcast_kernel)
    assert diagnoses.says(KERNEL_DIAGNOSES["raised"], capsys.readouterr().out)
    assert not check_slice_gradient_kernel(load("slice_gradient"))
    assert diagnoses.says(KERNEL_DIAGNOSES["not_kernel"], capsys.readouterr().out)


def test_every_kernel_diagnosis_has_a_test():
    named = {k for k, v in KERNEL_DIAGNOSES.items() if v in KERNEL_CASES.values()}
    assert named | {"raised", "not_kernel", "passed"} == set(KERNEL_DIAGNOSES)


# --------------------------------------------------------------------------------------------------------------------
# The finished answers: refused by name, wherever the learner's code reaches them
# --------------------------------------------------------------------------------------------------------------------

from kernels.exercises.linear_cross_entropy import reference_slice_gradient  # noqa: E402
from kernels.linear_cross_entropy import _grad_slice_kernel  # noqa: E402


def _by_the_reference(logits, lse, target, col_start, scale, ignore_index):
    return reference_slice_gradient(logits, lse, target, col_start, scale, ignore_index).float()


def _by_autograd(logits, lse, target, col_start, scale, ignore_index):
    # The slice's share of the loss, differentiated by autograd: the lse term is all of the rows' softmax.
    x = logits.float().requires_grad_()
    local = (target - col_start).clamp(0, x.shape[1] - 1)
    inside = (target >= col_start) & (target < col_start + x.shape[1]) & (target != ignore_index)
    picked = x.gather(1, local[:, None])[:, 0] * inside
    counted = (target != ignore_index).float()
    loss = (torch.exp(x - lse[:, None]).detach() * x).sum(1) * counted - picked
    (grad,) = torch.autograd.grad(loss.sum() * scale, x)
    return grad


def _by_cross_entropy(logits, lse, target, col_start, scale, ignore_index):
    x = logits.float().requires_grad_()
    F.cross_entropy(x, (target - col_start).clamp(0, x.shape[1] - 1)).backward()
    return x.grad


def _by_the_reference_caught(logits, lse, target, col_start, scale, ignore_index):
    try:
        return _by_the_reference(logits, lse, target, col_start, scale, ignore_index)
    except Exception:  # noqa: BLE001  (a learner hiding the refusal: still refused)
        return right(logits, lse, target, col_start, scale, ignore_index)


@pytest.mark.parametrize("fn, name", [
    (reference_slice_gradient, "reference_slice_gradient"),  # handed to the check itself
    (_by_the_reference, "reference_slice_gradient"),
    (_by_autograd, "autograd"),
    (_by_cross_entropy, "cross_entropy"),
    (_by_the_reference_caught, "reference_slice_gradient"),
])
def test_the_finished_gradient_is_refused_by_name(fn, name, capsys):
    assert not check_slice_gradient(fn)
    out = capsys.readouterr().out
    assert out.startswith("✗") and name in out and "finished answer" in out, out


def test_the_package_kernel_is_refused_by_name(capsys):
    assert not check_slice_gradient_kernel(_grad_slice_kernel)
    out = capsys.readouterr().out
    assert "_grad_slice_kernel" in out and "finished answer" in out, out
