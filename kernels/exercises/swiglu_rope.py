"""Check for the RoPE exercise of chapter 11: the backward pass, the rotation by −θ.

The reader writes ``fn(dy, cos, sin) -> dx`` for one tensor x of shape [batch, heads, seq, head_dim] rotated as
Hugging Face does (``x·cos + rotate_half(x)·sin``, cos and sin [batch, seq, head_dim]). The check runs it on a few
fresh inputs (Llama's strided layout, a head_dim whose half is not a power of two, cos and sin whose two halves
differ, bfloat16), compares with float64, and when it is wrong recomputes the usual mistakes in float64 to say which
one the output reproduces. It never raises because the reader's function is wrong: it prints a verdict and returns
a :class:`Report`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import runtime
from kernels.reference import relative_error, rotary_cos_sin
from kernels.tolerances import RELATIVE_ERROR_TOL

from .rmsnorm import Report, generator, last_line, verdict


@dataclass(frozen=True)
class RopeCase:
    dtype: torch.dtype
    batch: int
    heads: int
    seq: int
    head_dim: int
    llama_layout: bool = True  # dy as the transposed view Llama's attention makes, else contiguous
    general_halves: bool = False  # cos and sin with two different halves (not Llama's cat((f, f)))

    def __str__(self) -> str:
        text = (f"{str(self.dtype).removeprefix('torch.')} dy of shape [{self.batch}, {self.heads}, {self.seq}, "
                f"{self.head_dim}]")
        text += " (Llama's transposed view)" if self.llama_layout else " (contiguous)"
        if self.general_halves:
            text += " with cos and sin whose two halves differ"
        return text


ROPE_CASES = (
    RopeCase(torch.float32, 1, 2, 3, 8, llama_layout=False),
    RopeCase(torch.float32, 2, 4, 5, 16),
    RopeCase(torch.float32, 2, 3, 4, 12, general_halves=True),  # half = 6: masks matter
    RopeCase(torch.bfloat16, 1, 4, 7, 32),
)


def _halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = t.shape[-1] // 2
    return t[..., :half], t[..., half:]


def _backward64(dy, cos, sin, mistake: str | None = None) -> torch.Tensor:
    """dx in float64: dx1 = dy1·c1 + dy2·s2, dx2 = dy2·c2 − dy1·s1, or the same with one planted mistake."""
    dy1, dy2 = _halves(dy.double())
    c1, c2 = _halves(cos.double()[:, None])
    s1, s2 = _halves(sin.double()[:, None])
    if mistake == "forward":  # the forward rotation, by +θ
        return torch.cat((dy1 * c1 - dy2 * s1, dy2 * c2 + dy1 * s2), dim=-1)
    if mistake == "no sin":
        return torch.cat((dy1 * c1, dy2 * c2), dim=-1)
    if mistake == "same signs":
        return torch.cat((dy1 * c1 + dy2 * s2, dy2 * c2 + dy1 * s1), dim=-1)
    if mistake == "own half's sin":  # the partner's value times this half's sin, instead of the partner's sin
        return torch.cat((dy1 * c1 + dy2 * s1, dy2 * c2 - dy1 * s2), dim=-1)
    return torch.cat((dy1 * c1 + dy2 * s2, dy2 * c2 - dy1 * s1), dim=-1)


SUSPECTS = {
    "forward": "your dx is the forward rotation of dy (by +θ). The backward is its transpose, the rotation by −θ: "
               "dx1 = dy1·cos1 + dy2·sin2 and dx2 = dy2·cos2 − dy1·sin1",
    "no sin": "your dx is dy·cos alone: the rotate_half term (the partner column times sin) is missing",
    "same signs": "both halves add their partner's term: dx2 must subtract it, dx2 = dy2·cos2 − dy1·sin1",
    "own half's sin": "each half multiplies its partner's dy by its own half of sin. The transpose moves sin with "
                      "the partner: dx1 = dy1·cos1 + dy2·sin2, dx2 = dy2·cos2 − dy1·sin1 (Llama's equal halves "
                      "hide this; general cos and sin do not)",
}


def _inputs(case: RopeCase, gen: torch.Generator):
    device = runtime.device()
    shape = (case.batch, case.seq, case.heads, case.head_dim) if case.llama_layout else (
        case.batch, case.heads, case.seq, case.head_dim)
    dy = torch.randn(shape, generator=gen).to(device, case.dtype)
    if case.llama_layout:
        dy = dy.transpose(1, 2)
    if case.general_halves:
        cos, sin = (torch.randn(case.batch, case.seq, case.head_dim, generator=gen).to(device) for _ in range(2))
    else:
        positions = torch.randint(0, 4096, (case.batch, case.seq), generator=gen).to(device)
        cos, sin = rotary_cos_sin(case.batch, case.seq, case.head_dim, theta=10_000.0, dtype=case.dtype,
                                  device=device, positions=positions)
    return dy, cos.to(case.dtype), sin.to(case.dtype)


def _call(fn, dy, cos, sin, case):
    try:
        out = fn(dy, cos, sin)
    except Exception as error:  # noqa: BLE001  (any failure of the reader's code is reported, not raised)
        return None, f"on a {case}, your function raised {type(error).__name__}: {last_line(error)}"
    if not isinstance(out, torch.Tensor):
        return None, f"on a {case}, your function returned {type(out).__name__}, expected a tensor shaped like dy"
    if out.shape != dy.shape or out.dtype != dy.dtype:
        return None, (f"on a {case}, dx has shape {tuple(out.shape)} and dtype {out.dtype}, expected "
                      f"{tuple(dy.shape)} and {dy.dtype} (those of dy)")
    return out.detach(), None


def _diagnose(out, dy, cos, sin, case) -> str:
    tol = RELATIVE_ERROR_TOL[case.dtype]
    if not torch.isfinite(out.float()).all():
        return f"on a {case}, dx holds NaN or infinity: an element was read out of bounds or never written"
    for mistake, message in SUSPECTS.items():
        if relative_error(out, _backward64(dy, cos, sin, mistake)) < tol:
            return f"on a {case}: {message}."
    ref = _backward64(dy, cos, sin)
    wrong = ((out.double().cpu() - ref.cpu()).abs() > 1e-2 * ref.abs().max().item() + 1e-3).nonzero()
    b, h, t, d = (int(i) for i in wrong[0])
    half = case.head_dim // 2
    where = "first half" if d < half else "second half"
    hint = ("dy was read as if contiguous: use the strides of the view" if case.llama_layout and
            relative_error(out, _backward64(dy.contiguous(), cos, sin)) >= tol else
            "compare your two lines with dx1 = dy1·cos1 + dy2·sin2, dx2 = dy2·cos2 − dy1·sin1")
    return (f"on a {case}, dx differs from float64 (relative error {relative_error(out, ref):.2e}), first at "
            f"batch {b}, head {h}, position {t}, column {d} ({where}); {len(wrong)} elements are off. Hint: {hint}.")


def check_rope_backward(fn: Callable, seed: int | None = None, verbose: bool = True) -> Report:
    """Check ``fn(dy, cos, sin) -> dx``, the gradient of ``x·cos + rotate_half(x)·sin`` with respect to x.

    ``dy`` is [batch, heads, seq, head_dim] (possibly Llama's transposed view), ``cos`` and ``sin`` are [batch, seq,
    head_dim]; dx must have dy's shape and dtype. Prints the verdict (unless ``verbose=False``) and returns it.
    """
    gen = generator(seed)
    worst: dict[torch.dtype, float] = {}
    for case in ROPE_CASES:
        dy, cos, sin = _inputs(case, gen)
        out, problem = _call(fn, dy, cos, sin, case)
        if problem is None:
            error = relative_error(out, _backward64(dy, cos, sin))
            if not error < RELATIVE_ERROR_TOL[case.dtype]:
                problem = _diagnose(out, dy, cos, sin, case)
            worst[case.dtype] = max(worst.get(case.dtype, 0.0), error)
        if problem is not None:
            return verdict(False, problem, verbose)
    errors = ", ".join(f"{str(d).removeprefix('torch.')} {e:.1e}" for d, e in worst.items())
    return verdict(True, f"RoPE backward correct on {len(ROPE_CASES)} inputs (Llama's strided layout, head_dim "
                         f"8/16/12/32, cos and sin with unequal halves, bfloat16). Largest relative errors: {errors}.",
                   verbose)
