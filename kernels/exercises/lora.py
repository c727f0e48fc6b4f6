"""The check for chapter 15's exercise: the LoRA layer's backward, written by the reader in plain PyTorch.

``check_lora_backward(fn)`` calls ``fn(dy, x, weight, lora_a, lora_b, scale) -> (dx, d_lora_a, d_lora_b)`` for the
layer ``y = x·Wᵀ + s·(x·Aᵀ)·Bᵀ`` (W frozen) on fresh inputs of odd sizes and compares each gradient with float64.
When one is wrong it recomputes the usual mistakes in float64 and says which one the answer reproduces: a missing
scale, a missing transpose, dx without its LoRA term, dA or dB from the wrong input. It never raises because the
reader's code is wrong or unfinished: it prints its verdict and returns a ``Report``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.reference import relative_error
from kernels.tolerances import RELATIVE_ERROR_TOL

from .rmsnorm import Report, generator, last_line, verdict

HINTS = {
    "raised": "your function raised {error}",
    "not_three": "your function returned {what}; return the three gradients (dx, d_lora_a, d_lora_b)",
    "shape": "{name} has shape {shape}, expected {want} (the shape of {of})",
    "transposed": ("{name} has shape {shape}, the transpose of {of}'s {want}: a transpose is missing. {fix}"),
    "not_finite": "{name} holds NaN or infinity",
    "no_scale": ("{name} is missing the scale s: the adapter's output is s·(x·Aᵀ)·Bᵀ, so every gradient through the "
                 "adapter carries s once (dxa = s·dy·B; dB = s·dyᵀ·xa)"),
    "double_scale": "{name} carries the scale s twice: dxa = s·dy·B already holds it, dA = dxaᵀ·x adds no second s",
    "dx_no_lora": ("dx is dy·W only: the adapter's term is missing. x also reaches the output through A, so "
                   "dx = dy·W + dxa·A with dxa = s·dy·B"),
    "da_wrong_input": ("dA is a product with {used} instead of x: A multiplies x in the forward (xa = x·Aᵀ), so "
                       "dA = dxaᵀ·x, the gradient of xa against the layer's input"),
    "db_wrong_input": ("dB is a product with {used} instead of xa = x·Aᵀ: B multiplies xa in the forward, so "
                       "dB = s·dyᵀ·xa"),
    "unrecognised": ("{name} differs from float64 (relative error {error:.2e}, bound {tol:g}); none of the usual "
                     "mistakes reproduces it: print it beside the reference"),
    "passed": "all three gradients match float64 on {cases}",
}

FIX = {
    "d_lora_a": "dA = dxaᵀ·x is [r, in], like A",
    "d_lora_b": "dB = s·dyᵀ·xa is [out, r], like B",
    "dx": "dx is [tokens, in], like x",
}


@dataclass(frozen=True)
class Case:
    tokens: int
    n_in: int
    n_out: int
    rank: int
    scale: float

    def __str__(self) -> str:
        return f"{self.tokens} tokens, {self.n_in} → {self.n_out}, r={self.rank}, s={self.scale:g}"


CASES = (Case(37, 24, 20, 3, 0.75), Case(5, 9, 13, 1, 2.5))


def _inputs(case: Case, gen: torch.Generator):
    t = [torch.randn(shape, generator=gen, dtype=torch.float64) for shape in (
        (case.tokens, case.n_out), (case.tokens, case.n_in), (case.n_out, case.n_in), (case.rank, case.n_in),
        (case.n_out, case.rank))]
    return t  # dy, x, W, A, B


def _mistakes(dy, x, w, a, b, s) -> dict[str, dict[str, torch.Tensor]]:
    """Each gradient as written right and as the usual mistakes write it, in float64."""
    xa = x @ a.t()
    dxa = s * (dy @ b)
    right = {"dx": dy @ w + dxa @ a, "d_lora_a": dxa.t() @ x, "d_lora_b": s * (dy.t() @ xa)}
    wrong = {
        "dx": {"no_scale": dy @ w + (dy @ b) @ a, "dx_no_lora": dy @ w, "double_scale": dy @ w + s * dxa @ a},
        "d_lora_a": {"no_scale": (dy @ b).t() @ x, "double_scale": s * dxa.t() @ x,
                     "da_wrong_input:dx (the input's gradient)": dxa.t() @ right["dx"],
                     "da_wrong_input:dy·W (the base layer's input gradient)": dxa.t() @ (dy @ w)},
        "d_lora_b": {"no_scale": dy.t() @ xa, "double_scale": s * s * (dy.t() @ xa),
                     "db_wrong_input:dxa (a gradient, not the activation)": dy.t() @ dxa},
    }
    return {"right": right, **{name: wrong[name] for name in wrong}}


def _diagnose(name: str, got: torch.Tensor, want: torch.Tensor, candidates: dict, tol: float) -> str:
    if got.shape != want.shape:
        if got.shape == want.t().shape and want.dim() == 2:
            return HINTS["transposed"].format(name=name, shape=tuple(got.shape), of=name.removeprefix("d_"),
                                              want=tuple(want.shape), fix=FIX[name])
        return HINTS["shape"].format(name=name, shape=tuple(got.shape), want=tuple(want.shape),
                                     of=name.removeprefix("d_"))
    if not torch.isfinite(got).all():
        return HINTS["not_finite"].format(name=name)
    for key, value in candidates.items():
        if relative_error(got, value) < tol:
            hint, _, used = key.partition(":")
            return HINTS[hint].format(name=name, used=used)
    return HINTS["unrecognised"].format(name=name, error=relative_error(got, want), tol=tol)


def check_lora_backward(fn: Callable, seed: int | None = None, verbose: bool = True) -> Report:
    """Run ``fn(dy, x, weight, lora_a, lora_b, scale) -> (dx, d_lora_a, d_lora_b)`` on float32 inputs of odd
    sizes, compare each gradient with float64, and name the mistake when one is wrong."""
    gen = generator(seed)
    tol = RELATIVE_ERROR_TOL[torch.float32]
    for case in CASES:
        dy, x, w, a, b = _inputs(case, gen)
        try:
            result = fn(dy.float(), x.float(), w.float(), a.float(), b.float(), case.scale)
        except Exception as error:  # the reader's code: any error is a verdict, not a crash
            return verdict(False, HINTS["raised"].format(error=last_line(error)) + f" (on {case})", verbose)
        if not isinstance(result, (tuple, list)) or len(result) != 3 or not all(
                isinstance(t, torch.Tensor) for t in result):
            return verdict(False, HINTS["not_three"].format(what=type(result).__name__), verbose)
        expected = _mistakes(dy, x, w, a, b, case.scale)
        for name, got in zip(("dx", "d_lora_a", "d_lora_b"), result):
            want = expected["right"][name]
            if got.shape == want.shape and relative_error(got, want) < tol:
                continue
            message = _diagnose(name, got.detach().double(), want, expected[name], tol)
            return verdict(False, f"{message} (on {case})", verbose)
    return verdict(True, HINTS["passed"].format(cases="; ".join(map(str, CASES))), verbose)
