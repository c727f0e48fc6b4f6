"""Chapter 15's exercise check: the solution passes, and every planted mistake is named in words."""

import pytest
import torch

from kernels.exercises.lora import check_lora_backward
from kernels.exercises.solutions import load

solution = load("lora_backward")


def _with(**changes):
    """The solution with one gradient computed the wrong way."""
    def fn(dy, x, w, a, b, s):
        dx, da, db = solution(dy, x, w, a, b, s)
        xa, dxa = x @ a.t(), s * (dy @ b)
        found = {"dx": dx, "da": da, "db": db}
        for name, make in changes.items():
            found[name] = make(dy=dy, x=x, w=w, a=a, b=b, s=s, xa=xa, dxa=dxa)
        return found["dx"], found["da"], found["db"]
    return fn


def test_the_solution_passes():
    assert check_lora_backward(solution, verbose=False)


@pytest.mark.parametrize("fn,words", [
    (_with(db=lambda dy, xa, **_: dy.t() @ xa), "missing the scale"),
    (_with(da=lambda dy, b, x, **_: (dy @ b).t() @ x), "d_lora_a is missing the scale"),
    (_with(da=lambda x, dxa, **_: x.t() @ dxa), "a transpose is missing"),
    (_with(db=lambda xa, dy, s, **_: s * xa.t() @ dy), "d_lora_b has shape"),
    (_with(dx=lambda dy, w, **_: dy @ w), "the adapter's term is missing"),
    (_with(da=lambda dxa, dy, w, **_: dxa.t() @ (dy @ w)), "dA is a product with dy·W"),
    (_with(db=lambda dy, dxa, **_: dy.t() @ dxa), "dB is a product with dxa"),
    (_with(da=lambda dxa, x, s, **_: s * dxa.t() @ x), "twice"),
    (_with(dx=lambda dy, w, **_: torch.full_like(dy @ w, float("nan"))), "NaN"),
    (lambda *args: None, "return the three gradients"),
    (lambda *args: 1 / 0, "raised"),
])
def test_each_mistake_is_named(fn, words):
    report = check_lora_backward(fn, verbose=False)
    assert not report and words in report.message, report.message
