"""The check for chapter 15's exercise: the LoRA layer's backward, written by the reader in plain PyTorch.

``check_lora_backward(fn)`` calls ``fn(dy, x, weight, lora_a, lora_b, scale) -> (dx, d_lora_a,
d_lora_b)`` for the layer ``y = x·Wᵀ + s·(x·Aᵀ)·Bᵀ`` (W frozen) on fresh float32 inputs of odd
sizes, with the finished answers out of reach (``kernels.exercises.reach``: the package's LoRA layer
and backward, the reference layer, autograd), and compares each gradient with float64.

When a gradient is wrong the check says what is wrong with it, not what the answer is. Each gradient
is a sum of known products (dx of two, dA and dB of one each), so the check fits the reader's tensor
as a combination of those products and of the products a wrong input gives, and reads the mistake
off the fitted factors: a term missing, the scale s missing or applied twice, a sign, a wrong input,
bfloat16 arithmetic. The formulas themselves are shown only once every gradient passes. It never
raises because the reader's code is wrong or unfinished: it prints its verdict and returns a
``Report``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.reference import relative_error
from kernels.tolerances import RELATIVE_ERROR_TOL

from .reach import FinishedCodeCalled, call_learner
from .rmsnorm import Report, generator, last_line, verdict

EXERCISE = "lora_backward"
NAMES = ("dx", "dA", "dB")  # in the order the function returns them
SHAPE_OF = {"dx": "x", "dA": "lora_a", "dB": "lora_b"}

# A fit whose residual is below FIT_TOL explains the tensor (loose enough for bfloat16 arithmetic on top of a
# mistake); a fitted factor within FACTOR_TOL of a value is that value.
FIT_TOL = 3e-2
FACTOR_TOL = 2e-2
# relative errors above this are bfloat16's (8 bits of mantissa); below, float16's or TF32's
BF16_LIKE = 1e-3

# Every verdict, in one place; no hint before the pass states a gradient's formula.
HINTS = {
    "raised": "your function raised {error}",
    "not_three": "your function returned {what}; return the three gradients (dx, d_lora_a, d_lora_b)",
    "stub": ("not done yet: this is the stub as the chapter ships it (dx is the base layer's term "
             "alone, dA and dB are zeros). Write the adapter's share of dx, then dA and dB"),
    "zeros": "{name} is all zeros: it is still the stub's placeholder. Write its product",
    "shape": "{name} has shape {shape}, expected {want} (the shape of {of})",
    "transposed": ("{name} has shape {shape}, the transpose of {of}'s {want}: a transpose is "
                   "missing (or one too many). A gradient has the shape of the tensor it is the "
                   "gradient of"),
    "not_finite": "{name} holds NaN or infinity",
    "low_dtype": ("{name} is {dtype}, but the inputs are float32: the arithmetic ran in a lower "
                  "precision. Work on the float32 tensors as they come (no .bfloat16() or .half() "
                  "inside) and return float32"),
    "dtype": "{name} is {dtype}, expected float32 (the dtype of the inputs, which a gradient keeps)",
    "precision": ("{name} has the right terms but agrees with float64 only to {error:.1e} (bound "
                  "{tol:g}): that is {which}'s precision, not float32's. Some of the arithmetic "
                  "ran in {which} (a .bfloat16() or .half() cast, or autocast): work on the "
                  "float32 tensors as they come"),
    # dx: the base layer's term and the adapter's term.
    "dx_no_lora": ("dx holds the base layer's term only: x also reaches the output through the "
                   "adapter (x·Aᵀ, then ·Bᵀ), and that path adds a second term to dx"),
    "dx_no_base": ("dx holds the adapter's term only: the base layer's term is missing (W is "
                   "frozen and gets no gradient, but x still reaches the output through it)"),
    "dx_sign": ("dx has the wrong sign: both of its terms are negated, and nothing in this "
                "backward subtracts"),
    "base_scaled": ("dx's base-layer term carries the scale s: s multiplies the adapter's output "
                    "only, not x·Wᵀ, so the term through W has no s"),
    "base_factor": ("dx's base-layer term is multiplied by {factor:.4g}: the term through W has no "
                    "factor at all"),
    "base_sign": "dx's base-layer term has the wrong sign: the two terms of dx add, nothing subtracts",
    # A term that goes through the adapter: s once.
    "no_scale": ("{term} is missing the scale s: the adapter's output is multiplied by s, so every "
                 "gradient that goes through the adapter carries s once"),
    "double_scale": ("{term} carries the scale s twice (s²): s enters once, where the gradient "
                     "passes through the adapter's output; do not apply it again to a product that "
                     "already holds it"),
    "divided_scale": "{term} is divided by s: the adapter's output is multiplied by s, not divided",
    "sign": ("{term} has the wrong sign (it is the negative of the right value): nothing in this "
             "backward subtracts"),
    "factor": ("{term} is the right product times {factor:.4g}: an extra or missing constant "
               "factor (the only constant in this layer is the scale s = {s:g}, and it enters "
               "once)"),
    # Wrong inputs.
    "da_wrong_input": ("dA is a product with {used} where the layer's input x belongs: A "
                       "multiplies x in the forward (xa = x·Aᵀ), so dA pairs the gradient that "
                       "reaches xa with x itself"),
    "da_activation": ("dA is a product of x with xa = x·Aᵀ, the forward's activation, where the "
                      "gradient that reaches xa belongs"),
    "db_wrong_input": ("dB is a product with {used} where the forward's activation xa = x·Aᵀ "
                       "belongs: B multiplies xa in the forward, so dB pairs dy with xa"),
    "unrecognised": ("{name} differs from float64 (relative error {error:.2e}, bound {tol:g}); "
                     "none of the usual mistakes reproduces it: print it beside the formula you "
                     "meant to write"),
    "passed": ("all three gradients match float64 on {cases}. What you derived, with dxa = s·dy·B "
               "(the gradient reaching xa = x·Aᵀ, [tokens, r]): dx = dy·W + dxa·A, dA = dxaᵀ·x, dB "
               "= s·dyᵀ·xa"),
}

TERM = {"dx": "dx's adapter term", "dA": "dA", "dB": "dB"}


@dataclass(frozen=True)
class Case:
    """One set of sizes the backward is tried on: tokens, n_in → n_out, rank r and scale s."""

    tokens: int
    n_in: int
    n_out: int
    rank: int
    scale: float

    def __str__(self) -> str:
        return f"{self.tokens} tokens, {self.n_in} → {self.n_out}, r={self.rank}, s={self.scale:g}"


# Odd sizes; scales other than ±1 with s, s² and 1/s all apart, so that a fitted factor names one mistake.
CASES = (Case(37, 24, 20, 3, 0.75), Case(5, 9, 13, 1, 2.5))


def _inputs(case: Case, gen: torch.Generator) -> list[torch.Tensor]:
    """dy, x, W, A, B in float64."""
    return [torch.randn(shape, generator=gen, dtype=torch.float64) for shape in (
        (case.tokens, case.n_out), (case.tokens, case.n_in), (case.n_out, case.n_in), (case.rank, case.n_in),
        (case.n_out, case.rank))]


@dataclass(frozen=True)
class Terms:
    """What each gradient is fitted with, in float64: ``right`` the gradients, ``bases`` the
    products they are made of (dx = base + s·adapter, dA and dB s times their one product),
    ``wrong`` the products a wrong input gives, by the hint that names it."""

    right: dict[str, torch.Tensor]
    bases: dict[str, list[torch.Tensor]]
    wrong: dict[str, dict[str, torch.Tensor]]


def _terms(dy, x, w, a, b, s) -> Terms:
    """The right gradients and the usual mistakes' products (kept out of the reader's reach while a
    check runs)."""
    xa = x @ a.t()
    g = dy @ b  # the gradient reaching xa, before the scale
    base, adapter = dy @ w, g @ a
    right = {"dx": base + s * adapter, "dA": s * (g.t() @ x), "dB": s * (dy.t() @ xa)}
    return Terms(
        right=right,
        bases={"dx": [base, adapter], "dA": [g.t() @ x], "dB": [dy.t() @ xa]},
        wrong={
            "dx": {},
            "dA": {"da_wrong_input:dy·W (the base layer's share of the input gradient)": g.t() @ base,
                   "da_wrong_input:dx (the layer's input gradient)": g.t() @ right["dx"],
                   "da_activation:": xa.t() @ x},
            "dB": {("db_wrong_input:the gradient that reaches xa (dy·B, a gradient, not an "
                    "activation)"): dy.t() @ g},
        },
    )


def _fit(got: torch.Tensor, bases: list[torch.Tensor]) -> tuple[list[float], float]:
    """The factors c that make Σ cᵢ·baseᵢ closest to ``got`` (least squares), and the fit's relative
    residual."""
    columns = torch.stack([t.reshape(-1) for t in bases], dim=1)
    factors = torch.linalg.lstsq(columns, got.reshape(-1, 1)).solution.reshape(-1)
    residual = relative_error(columns @ factors, got.reshape(-1)) if got.norm() > 0 else float("inf")
    return factors.tolist(), residual


def _near(value: float, target: float) -> bool:
    return abs(value - target) <= FACTOR_TOL * max(abs(target), 1e-12)


def _scale_mistake(term: str, factor: float, s: float) -> str:
    """The verdict for a term that should carry s once and carries ``factor``."""
    for key, value in (("no_scale", 1.0), ("double_scale", s * s), ("divided_scale", 1.0 / s), ("sign", -s)):
        if _near(factor, value):
            return HINTS[key].format(term=term)
    return HINTS["factor"].format(term=term, factor=factor / s, s=s)


def _dx_mistake(factors: list[float], s: float) -> str | None:
    base, adapter = factors
    if _near(base, 1.0) and _near(adapter, s):
        return None
    if _near(base, -1.0) and _near(adapter, -s):
        return HINTS["dx_sign"]
    if abs(adapter) <= FACTOR_TOL * s:
        return HINTS["dx_no_lora"]
    if abs(base) <= FACTOR_TOL:
        return HINTS["dx_no_base"]
    if not _near(base, 1.0):
        if _near(base, s):
            return HINTS["base_scaled"]
        return HINTS["base_sign"] if _near(base, -1.0) else HINTS["base_factor"].format(factor=base)
    return _scale_mistake(TERM["dx"], adapter, s)


class LowPrecision(str):
    """A verdict that a gradient's terms are right and only its precision is not."""


def _diagnose(name: str, got: torch.Tensor, terms: Terms, s: float, tol: float) -> str:
    want = terms.right[name]
    of = SHAPE_OF[name]
    if got.shape != want.shape:
        if got.dim() == 2 and got.shape == want.t().shape:
            return HINTS["transposed"].format(name=name, shape=tuple(got.shape), of=of,
                                              want=tuple(want.shape))
        return HINTS["shape"].format(name=name, shape=tuple(got.shape), want=tuple(want.shape), of=of)
    if got.dtype != torch.float32:
        hint = "low_dtype" if got.dtype in (torch.bfloat16, torch.float16) else "dtype"
        return HINTS[hint].format(name=name, dtype=str(got.dtype).removeprefix("torch."))
    got = got.detach().to("cpu", torch.float64)
    if not torch.isfinite(got).all():
        return HINTS["not_finite"].format(name=name)
    if not got.any():
        return HINTS["zeros"].format(name=name)
    factors, residual = _fit(got, terms.bases[name])
    if residual < FIT_TOL:
        if name == "dx":
            mistake = _dx_mistake(factors, s)
        else:
            mistake = None if _near(factors[0], s) else _scale_mistake(TERM[name], factors[0], s)
        if mistake is not None:
            return mistake
        error = relative_error(got, want)
        which = "bfloat16" if error > BF16_LIKE else "float16 (or TF32)"
        return LowPrecision(HINTS["precision"].format(name=name, error=error, tol=tol, which=which))
    for key, product in terms.wrong[name].items():
        if _fit(got, [product])[1] < FIT_TOL:
            hint, _, used = key.partition(":")
            return HINTS[hint].format(name=name, used=used)
    return HINTS["unrecognised"].format(name=name, error=relative_error(got, want), tol=tol)


def _is_stub(result, dy, w) -> bool:
    dx, d_a, d_b = (t.detach().to("cpu", torch.float64) for t in result)
    base = dy @ w
    return (not d_a.any() and not d_b.any() and dx.shape == base.shape
            and relative_error(dx, base) < RELATIVE_ERROR_TOL[torch.float32])


def check_lora_backward(fn: Callable, seed: int | None = None, verbose: bool = True) -> Report:
    """Check the reader's LoRA backward against float64 and name the mistake when one is wrong.

    Runs ``fn`` on float32 inputs of the odd sizes of ``CASES``, with the finished answers out of
    reach (``reach.FORBIDDEN["lora_backward"]``), and stops at the first case where a gradient is
    wrong. Chapter: ``notebooks/15_lora.ipynb``.

    Args:
        fn: the reader's ``fn(dy, x, weight, lora_a, lora_b, scale) -> (dx, d_lora_a, d_lora_b)``,
            with ``dy`` [tokens, n_out], ``x`` [tokens, n_in], ``weight`` [n_out, n_in], ``lora_a``
            [r, n_in], ``lora_b`` [n_out, r] (float32 tensors) and ``scale`` a float.
        seed: seed of the random inputs; None draws a fresh one.
        verbose: print the verdict (False: only return it).

    Returns:
        The ``Report``: ``passed``, and a message that names the first mistake found (a term
        missing, the scale, a sign, a wrong input, a shape, a dtype, low precision) on which case,
        or, on a pass, the three formulas derived. It never raises because ``fn`` is wrong.
    """
    gen = generator(seed)
    tol = RELATIVE_ERROR_TOL[torch.float32]
    for case in CASES:
        dy, x, w, a, b = _inputs(case, gen)
        try:
            result = call_learner(EXERCISE, fn, dy.float(), x.float(), w.float(), a.float(),
                                  b.float(), case.scale)
        except FinishedCodeCalled as called:
            return verdict(False, str(called), verbose)
        except Exception as error:  # the reader's code: any error is a verdict, not a crash
            return verdict(False, HINTS["raised"].format(error=last_line(error)) + f" (on {case})", verbose)
        if not isinstance(result, (tuple, list)) or len(result) != 3 or not all(
                isinstance(t, torch.Tensor) for t in result):
            return verdict(False, HINTS["not_three"].format(what=type(result).__name__), verbose)
        if _is_stub(result, dy, w):
            return verdict(False, HINTS["stub"], verbose)
        terms = _terms(dy, x, w, a, b, case.scale)
        found = [_diagnose(name, got, terms, case.scale, tol) for name, got in zip(NAMES, result)
                 if not (got.shape == terms.right[name].shape and got.dtype == torch.float32
                         and relative_error(got, terms.right[name]) < tol)]
        if found:
            # A wrong term first: the low precision of a gradient that is otherwise right is the lesser news.
            message = next((m for m in found if not isinstance(m, LowPrecision)), found[0])
            return verdict(False, f"{message} (on {case})", verbose)
    return verdict(True, HINTS["passed"].format(cases="; ".join(map(str, CASES))), verbose)
