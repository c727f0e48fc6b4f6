"""Chapter 15's exercise check: the answer passes; the stub, the usual wrong answers (written as a learner writes
them) and every finished answer within reach are refused, each with its own message."""

import pytest
import torch
import torch.nn.functional as F

import kernels.lora
from kernels.exercises.lora import _terms, check_lora_backward
from kernels.exercises.solutions import load
from kernels.lora import lora_linear, lora_linear_reference

solution = load("lora_backward")


def test_the_solution_passes():
    report = check_lora_backward(solution, verbose=False)
    assert report, report.message
    assert "dx = dy·W + dxa·A" in report.message  # the formulas are shown once the answer passes


def answer(dy, x, weight, lora_a, lora_b, scale):
    """A learner's right answer, written differently from the solution: one merged weight for dx."""
    xa = F.linear(x, lora_a)
    dx = dy @ (weight + scale * lora_b @ lora_a)
    return dx, scale * (dy @ lora_b).t() @ x, scale * dy.t() @ xa


def test_a_right_answer_written_differently_passes():
    assert check_lora_backward(answer, verbose=False)


# ---- the stub, as chapter 15 ships it ----

def stub(dy, x, weight, lora_a, lora_b, scale):
    # ---- EXERCISE: dx needs the adapter's term too; dA and dB are sums over the tokens.
    dx = dy @ weight
    d_lora_a = torch.zeros_like(lora_a)
    d_lora_b = torch.zeros_like(lora_b)
    return dx, d_lora_a, d_lora_b


def test_the_stub_is_named_and_gives_nothing_away():
    report = check_lora_backward(stub, verbose=False)
    assert not report and "this is the stub as the chapter ships it" in report.message, report.message
    for formula in ("dxa·A", "dxaᵀ·x", "dyᵀ·xa", "s·dy·B"):
        assert formula not in report.message


# ---- wrong answers a learner plausibly writes ----

def no_scale_in_db(dy, x, weight, lora_a, lora_b, scale):
    dxa = scale * (dy @ lora_b)
    return dy @ weight + dxa @ lora_a, dxa.t() @ x, dy.t() @ (x @ lora_a.t())


def no_scale_anywhere(dy, x, weight, lora_a, lora_b, scale):
    dxa = dy @ lora_b
    return dy @ weight + dxa @ lora_a, dxa.t() @ x, dy.t() @ (x @ lora_a.t())


def scale_twice_in_da(dy, x, weight, lora_a, lora_b, scale):
    dxa = scale * (dy @ lora_b)
    return dy @ weight + dxa @ lora_a, scale * dxa.t() @ x, scale * dy.t() @ (x @ lora_a.t())


def scale_on_the_whole_dx(dy, x, weight, lora_a, lora_b, scale):
    dxa = dy @ lora_b
    return scale * (dy @ weight + dxa @ lora_a), scale * dxa.t() @ x, scale * dy.t() @ (x @ lora_a.t())


def da_transposed(dy, x, weight, lora_a, lora_b, scale):
    dxa = scale * (dy @ lora_b)
    return dy @ weight + dxa @ lora_a, x.t() @ dxa, scale * dy.t() @ (x @ lora_a.t())


def db_transposed(dy, x, weight, lora_a, lora_b, scale):
    dxa = scale * (dy @ lora_b)
    return dy @ weight + dxa @ lora_a, dxa.t() @ x, scale * (x @ lora_a.t()).t() @ dy


def dx_without_the_adapter(dy, x, weight, lora_a, lora_b, scale):
    dxa = scale * (dy @ lora_b)
    return dy @ weight, dxa.t() @ x, scale * dy.t() @ (x @ lora_a.t())


def dx_without_the_base(dy, x, weight, lora_a, lora_b, scale):
    dxa = scale * (dy @ lora_b)
    return dxa @ lora_a, dxa.t() @ x, scale * dy.t() @ (x @ lora_a.t())


def da_from_the_base_gradient(dy, x, weight, lora_a, lora_b, scale):
    dxa = scale * (dy @ lora_b)
    dx_base = dy @ weight
    return dx_base + dxa @ lora_a, dxa.t() @ dx_base, scale * dy.t() @ (x @ lora_a.t())


def da_from_dx(dy, x, weight, lora_a, lora_b, scale):
    dxa = scale * (dy @ lora_b)
    dx = dy @ weight + dxa @ lora_a
    return dx, dxa.t() @ dx, scale * dy.t() @ (x @ lora_a.t())


def da_from_the_activation(dy, x, weight, lora_a, lora_b, scale):
    xa = x @ lora_a.t()
    dxa = scale * (dy @ lora_b)
    return dy @ weight + dxa @ lora_a, xa.t() @ x, scale * dy.t() @ xa


def db_from_dxa_scaled(dy, x, weight, lora_a, lora_b, scale):
    dxa = scale * (dy @ lora_b)
    return dy @ weight + dxa @ lora_a, dxa.t() @ x, scale * (dy.t() @ dxa)


def db_from_dxa(dy, x, weight, lora_a, lora_b, scale):
    dxa = scale * (dy @ lora_b)
    return dy @ weight + dxa @ lora_a, dxa.t() @ x, dy.t() @ dxa


def minus_in_dx(dy, x, weight, lora_a, lora_b, scale):
    dxa = scale * (dy @ lora_b)
    return dy @ weight - dxa @ lora_a, dxa.t() @ x, scale * dy.t() @ (x @ lora_a.t())


def minus_on_all_of_dx(dy, x, weight, lora_a, lora_b, scale):
    dxa = scale * (dy @ lora_b)
    return -(dy @ weight + dxa @ lora_a), dxa.t() @ x, scale * dy.t() @ (x @ lora_a.t())


def minus_in_da(dy, x, weight, lora_a, lora_b, scale):
    dxa = scale * (dy @ lora_b)
    return dy @ weight + dxa @ lora_a, -dxa.t() @ x, scale * dy.t() @ (x @ lora_a.t())


def minus_in_db(dy, x, weight, lora_a, lora_b, scale):
    dxa = scale * (dy @ lora_b)
    return dy @ weight + dxa @ lora_a, dxa.t() @ x, -scale * dy.t() @ (x @ lora_a.t())


def divided_by_scale(dy, x, weight, lora_a, lora_b, scale):
    dxa = dy @ lora_b / scale
    return dy @ weight + dxa @ lora_a, scale * (dy @ lora_b).t() @ x, scale * dy.t() @ (x @ lora_a.t())


def in_bfloat16(dy, x, weight, lora_a, lora_b, scale):
    dy, x, weight, lora_a, lora_b = (t.to(torch.bfloat16) for t in (dy, x, weight, lora_a, lora_b))
    dxa = scale * (dy @ lora_b)
    grads = dy @ weight + dxa @ lora_a, dxa.t() @ x, scale * dy.t() @ (x @ lora_a.t())
    return tuple(g.float() for g in grads)


def returns_bfloat16(dy, x, weight, lora_a, lora_b, scale):
    dy, x, weight, lora_a, lora_b = (t.bfloat16() for t in (dy, x, weight, lora_a, lora_b))
    dxa = scale * (dy @ lora_b)
    return dy @ weight + dxa @ lora_a, dxa.t() @ x, scale * dy.t() @ (x @ lora_a.t())


def in_bfloat16_and_no_scale_in_db(dy, x, weight, lora_a, lora_b, scale):
    dy, x, weight, lora_a, lora_b = (t.bfloat16() for t in (dy, x, weight, lora_a, lora_b))
    dxa = scale * (dy @ lora_b)
    grads = dy @ weight + dxa @ lora_a, dxa.t() @ x, dy.t() @ (x @ lora_a.t())
    return tuple(g.float() for g in grads)


def only_dx_written(dy, x, weight, lora_a, lora_b, scale):
    dxa = scale * (dy @ lora_b)
    return dy @ weight + dxa @ lora_a, torch.zeros_like(lora_a), torch.zeros_like(lora_b)


def da_summed_over_the_wrong_axis(dy, x, weight, lora_a, lora_b, scale):
    dxa = scale * (dy @ lora_b)
    return dy @ weight + dxa @ lora_a, dxa.sum(0)[:, None] * x.sum(0)[None, :] / x.shape[0], \
        scale * dy.t() @ (x @ lora_a.t())


def returns_nan(dy, x, weight, lora_a, lora_b, scale):
    dxa = scale * (dy @ lora_b)
    return dy @ weight + dxa @ lora_a / 0 * 0, dxa.t() @ x, scale * dy.t() @ (x @ lora_a.t())


def weight_not_transposed_right(dy, x, weight, lora_a, lora_b, scale):
    dxa = scale * (dy @ lora_b)
    return dy @ weight.t() + dxa @ lora_a, dxa.t() @ x, scale * dy.t() @ (x @ lora_a.t())


def returns_a_dict(dy, x, weight, lora_a, lora_b, scale):
    dxa = scale * (dy @ lora_b)
    return {"dx": dy @ weight + dxa @ lora_a, "dA": dxa.t() @ x, "dB": scale * dy.t() @ (x @ lora_a.t())}


def returns_two(dy, x, weight, lora_a, lora_b, scale):
    dxa = scale * (dy @ lora_b)
    return dxa.t() @ x, scale * dy.t() @ (x @ lora_a.t())


@pytest.mark.parametrize("fn,words", [
    (no_scale_in_db, "dB is missing the scale s"),
    (no_scale_anywhere, "dx's adapter term is missing the scale s"),
    (scale_twice_in_da, "dA carries the scale s twice"),
    (scale_on_the_whole_dx, "dx's base-layer term carries the scale s"),
    (da_transposed, "dA has shape (24, 3), the transpose of lora_a's (3, 24)"),
    (db_transposed, "dB has shape (3, 20), the transpose of lora_b's (20, 3)"),
    (dx_without_the_adapter, "dx holds the base layer's term only"),
    (dx_without_the_base, "dx holds the adapter's term only"),
    (da_from_the_base_gradient, "dA is a product with dy·W"),
    (da_from_dx, "dA is a product with dx (the layer's input gradient)"),
    (da_from_the_activation, "dA is a product of x with xa = x·Aᵀ, the forward's activation"),
    (db_from_dxa_scaled, "dB is a product with the gradient that reaches xa"),
    (db_from_dxa, "dB is a product with the gradient that reaches xa"),
    (minus_in_dx, "dx's adapter term has the wrong sign"),
    (minus_on_all_of_dx, "dx has the wrong sign: both of its terms"),
    (minus_in_da, "dA has the wrong sign"),
    (minus_in_db, "dB has the wrong sign"),
    (divided_by_scale, "dx's adapter term is divided by s"),
    (in_bfloat16, "that is bfloat16's precision"),
    (returns_bfloat16, "dx is bfloat16, but the inputs are float32"),
    (in_bfloat16_and_no_scale_in_db, "dB is missing the scale s"),
    (only_dx_written, "dA is all zeros"),
    (da_summed_over_the_wrong_axis, "none of the usual mistakes"),
    (returns_nan, "dx holds NaN"),
    (weight_not_transposed_right, "your function raised"),
    (returns_a_dict, "return the three gradients"),
    (returns_two, "return the three gradients"),
])
def test_each_wrong_answer_is_named(fn, words):
    report = check_lora_backward(fn, seed=15, verbose=False)
    assert not report and words in report.message, report.message


# ---- finished answers within reach: refused by name ----

def autograd_through_my_forward(dy, x, weight, lora_a, lora_b, scale):
    x, lora_a, lora_b = (t.detach().requires_grad_() for t in (x, lora_a, lora_b))
    y = x @ weight.t() + scale * (x @ lora_a.t()) @ lora_b.t()
    y.backward(dy)
    return x.grad, lora_a.grad, lora_b.grad


def autograd_grad_through_my_forward(dy, x, weight, lora_a, lora_b, scale):
    x, lora_a, lora_b = (t.detach().requires_grad_() for t in (x, lora_a, lora_b))
    y = F.linear(x, weight) + F.linear(F.linear(x, lora_a), lora_b) * scale
    return torch.autograd.grad(y, (x, lora_a, lora_b), dy)


def vjp_of_my_forward(dy, x, weight, lora_a, lora_b, scale):
    _, pullback = torch.func.vjp(lambda x, a, b: x @ weight.t() + scale * (x @ a.t()) @ b.t(), x, lora_a, lora_b)
    return pullback(dy)


def autograd_through_lora_linear(dy, x, weight, lora_a, lora_b, scale):
    x, lora_a, lora_b = (t.detach().requires_grad_() for t in (x, lora_a, lora_b))
    lora_linear(x, weight, None, lora_a, lora_b, scale).backward(dy)
    return x.grad, lora_a.grad, lora_b.grad


def autograd_through_the_reference(dy, x, weight, lora_a, lora_b, scale):
    x, lora_a, lora_b = (t.detach().requires_grad_() for t in (x, lora_a, lora_b))
    lora_linear_reference(x, weight, None, lora_a, lora_b, scale).backward(dy)
    return x.grad, lora_a.grad, lora_b.grad


def reference_forward_caught(dy, x, weight, lora_a, lora_b, scale):
    try:
        lora_linear_reference(x, weight, None, lora_a, lora_b, scale)
    except Exception:
        pass
    return solution(dy, x, weight, lora_a, lora_b, scale)


def the_package_backward(dy, x, weight, lora_a, lora_b, scale):
    return kernels.lora.lora_backward(dy, x, weight, lora_a, lora_b, x @ lora_a.t(), scale)


def the_registered_operator(dy, x, weight, lora_a, lora_b, scale):
    return torch.ops.kernels.lora_linear_bwd(dy, x, weight, lora_a, lora_b, x @ lora_a.t(), scale, True,
                                             "cublas", "cublas")


def the_checks_own_gradients(dy, x, weight, lora_a, lora_b, scale):
    right = _terms(dy, x, weight, lora_a, lora_b, scale).right
    return right["dx"], right["dA"], right["dB"]


def the_hidden_solution(dy, x, weight, lora_a, lora_b, scale):
    return load("lora_backward")(dy, x, weight, lora_a, lora_b, scale)


@pytest.mark.parametrize("fn,words", [
    (autograd_through_my_forward, "torch.Tensor.backward (autograd"),
    (autograd_grad_through_my_forward, "torch.autograd.grad (autograd"),
    (vjp_of_my_forward, "torch.func.vjp (autograd"),
    (autograd_through_lora_linear, "kernels.lora.lora_linear (the package's finished LoRA layer)"),
    (autograd_through_the_reference, "kernels.lora.lora_linear_reference (the reference LoRA layer)"),
    (reference_forward_caught, "kernels.lora.lora_linear_reference (the reference LoRA layer)"),
    (the_package_backward, "kernels.lora.lora_backward (the package's finished LoRA backward)"),
    (the_registered_operator, "lora_linear_bwd (the package's finished LoRA backward operator)"),
    (the_checks_own_gradients, "kernels.exercises.lora._terms (the check's own float64 gradients)"),
    (the_hidden_solution, "the hidden solution"),
    (kernels.lora.lora_backward, "kernels.lora.lora_backward (the package's finished LoRA backward)"),
])
def test_finished_answers_are_refused(fn, words):
    report = check_lora_backward(fn, seed=15, verbose=False)
    assert not report and words in report.message and "a ✓ would not be yours" in report.message, report.message


def test_the_finished_answers_work_again_after_a_check():
    check_lora_backward(autograd_through_lora_linear, seed=15, verbose=False)
    x, a, b = (torch.randn(shape, requires_grad=True) for shape in ((5, 8), (2, 8), (6, 2)))
    lora_linear(x, torch.randn(6, 8), None, a, b, 0.5).sum().backward()
    assert x.grad is not None and a.grad is not None and b.grad is not None
