"""The tripwire the exercise checks share: every finished answer in its table trips, wherever a learner binds it, and
everything is put back afterwards."""

import functools

import pytest
import torch
import torch.nn.functional as F

import kernels
import kernels.attention
from kernels.attention import attention_reference
from kernels.exercises import reach
from kernels.exercises.reach import FORBIDDEN, FinishedCodeCalled, call_learner, out_of_reach, resolve, targets

ROWS = sorted(FORBIDDEN)


def _qkv():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=gen, dtype=torch.float64) for shape in ((2, 5, 4), (1, 5, 4), (1, 5, 4))]


@pytest.mark.parametrize("exercise", ROWS)
def test_every_target_resolves_and_trips_through_its_module(exercise):
    for forbid in targets(exercise):
        owner, attribute, original = resolve(forbid.target)
        with out_of_reach(exercise):
            wire = getattr(owner, attribute)
            assert wire is not original, forbid.target
            if forbid.when is None:
                with pytest.raises(FinishedCodeCalled, match=attribute):
                    wire()
        assert resolve(forbid.target)[2] is original, f"{forbid.target} was not put back"


def test_unknown_exercise_names_the_rows():
    with pytest.raises(ValueError, match="attention_loop"):
        targets("no_such_exercise")


def test_a_name_the_learner_imported_trips_and_is_put_back():
    def learner(q, k, v):
        return attention_reference(q[None], k[None], v[None])[0]

    with pytest.raises(FinishedCodeCalled, match="attention_reference") as called:
        call_learner("attention_loop", learner, *_qkv())
    assert "float64 reference" in str(called.value) and 'solution("attention_loop")' in str(called.value)
    assert globals()["attention_reference"] is kernels.attention.attention_reference
    assert learner(*_qkv()).shape == (2, 5, 4)  # outside the check, the learner's code runs as before


def test_package_reexports_and_pytorch_ops_trip():
    def through_package(q, k, v):
        return kernels.flash_attention(q[None], k[None], v[None])[0]

    def through_pytorch(q, k, v):
        return F.scaled_dot_product_attention(q, k.expand_as(q), v.expand_as(q))

    for learner, name in ((through_package, "flash_attention"), (through_pytorch, "scaled_dot_product_attention")):
        with pytest.raises(FinishedCodeCalled, match=name):
            call_learner("attention_loop", learner, *_qkv())
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention


def test_a_closure_and_a_partial_of_the_finished_function_trip():
    def make(reference):
        return lambda q, k, v: reference(q[None], k[None], v[None])[0]

    with pytest.raises(FinishedCodeCalled):
        call_learner("attention_loop", make(kernels.attention.attention_reference), *_qkv())
    with pytest.raises(FinishedCodeCalled):
        call_learner("attention_loop", functools.partial(kernels.attention.attention_reference, causal=False),
                     *[t[None] for t in _qkv()])


def test_a_caught_tripwire_still_fails():
    def swallows(q, k, v):
        try:
            return attention_reference(q[None], k[None], v[None])[0]
        except Exception:  # noqa: BLE001  (what a learner might write)
            return q

    def converts(q, k, v):
        try:
            return attention_reference(q[None], k[None], v[None])[0]
        except Exception as error:
            raise RuntimeError("my own error") from error

    for learner in (swallows, converts):
        with pytest.raises(FinishedCodeCalled, match="attention_reference"):
            call_learner("attention_loop", learner, *_qkv())


def test_autograd_trips_where_the_gradient_is_the_lesson_and_is_put_back():
    def through_autograd(x, w):
        x = x.clone().requires_grad_()
        (x @ w.t()).sum().backward()
        return x.grad

    x, w = torch.randn(3, 4), torch.randn(5, 4)
    with pytest.raises(FinishedCodeCalled, match="autograd"):
        call_learner("lora_backward", through_autograd, x, w)
    torch.testing.assert_close(through_autograd(x, w), w.sum(0).expand(3, 4))


def test_own_code_passes_and_errors_propagate():
    q, k, v = _qkv()
    assert call_learner("attention_loop", lambda q, k, v: q * 2, q, k, v).equal(q * 2)
    with pytest.raises(ZeroDivisionError):
        call_learner("attention_loop", lambda *args: 1 / 0, q, k, v)


def test_a_conditional_target_trips_only_where_its_condition_holds():
    conditional = [f for row in FORBIDDEN.values() for f in row if f.when is not None]
    assert conditional, "the table has a conditional target (the cross-entropy forward with its gradient)"
    forbid = conditional[0]
    exercise = next(name for name, row in FORBIDDEN.items() if forbid in row)
    calls = []
    wire = reach.Tripwire(exercise).wire(forbid, lambda *args, **kwargs: calls.append(kwargs) or "ran")
    assert wire(compute_grad=False) == "ran"
    with pytest.raises(FinishedCodeCalled):
        wire(compute_grad=True)
    assert calls == [{"compute_grad": False}]
