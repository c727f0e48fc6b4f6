"""Checks for the RMSNorm exercises of chapter 02 (forward) and chapter 03 (backward).

Each check runs the reader's function on a handful of fresh random inputs, each chosen to expose particular
mistakes (a width that is a power of two, one that is not, a row of tiny values, bfloat16, a strided view), and
compares the result with a float64 reference. When it is wrong, the check recomputes the usual mistakes in float64
and says which one the output reproduces, on which input and in which row. A check never raises because the
reader's function is wrong or unfinished: it prints its verdict and returns a :class:`Report`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton

from kernels import runtime
from kernels.reference import relative_error, rms_norm_reference
from kernels.tolerances import ELEMENT_TOL, RELATIVE_ERROR_TOL

# A bfloat16 forward output must equal Hugging Face's bit for bit except in at most this fraction of values. The
# right cast order gives (almost) no differences; multiplying by the weight before rounding changes about a fifth.
BF16_MAX_DIFFERENT = 0.02


@dataclass(frozen=True)
class Report:
    """The verdict of a check: ``passed`` and a message that says what is right or what is wrong."""

    passed: bool
    message: str

    def __bool__(self) -> bool:
        return self.passed


@dataclass(frozen=True)
class Case:
    """One input the reader's function is run on."""

    dtype: torch.dtype
    rows: int
    cols: int
    eps: float = 1e-6
    row_stride: int | None = None  # when set, x is a [rows, cols] view into a wider buffer
    tiny_row: int | None = None  # when set, that row of x is scaled so that mean(x²) is below eps

    def __str__(self) -> str:
        text = f"{str(self.dtype).removeprefix('torch.')} input of {self.rows} × {self.cols}"
        if self.row_stride:
            text += f" (a view whose rows are {self.row_stride} elements apart)"
        if self.tiny_row is not None:
            text += f" (row {self.tiny_row} holds tiny values; eps={self.eps:g})"
        return text


FORWARD_CASES = (
    Case(torch.float32, 7, 64),  # a power-of-two width: BLOCK_N == n_cols
    Case(torch.float32, 5, 100),  # BLOCK_N = 128 > n_cols: masks and the divisor matter
    Case(torch.float32, 3, 37, eps=1e-5, tiny_row=1),  # eps matters, and it is not the default one
    Case(torch.bfloat16, 6, 300),  # the cast order of Hugging Face
    Case(torch.float32, 4, 80, row_stride=128),  # row stride != width
)
BACKWARD_CASES = (
    Case(torch.float32, 7, 64),
    Case(torch.float32, 5, 100),
    Case(torch.bfloat16, 6, 300),
    Case(torch.float32, 4, 80, row_stride=128),
)


# ----------------------------------------------------------------------------------------------------------------------
# The two checks
# ----------------------------------------------------------------------------------------------------------------------


def check_rms_norm_forward(fn: Callable, seed: int | None = None, verbose: bool = True) -> Report:
    """Check ``fn(x, weight, eps) -> y``, an RMSNorm forward over the last dimension of a 2-D ``x``.

    ``y`` must have ``x``'s shape and dtype and match Hugging Face's ``LlamaRMSNorm``: within float32 precision of
    the float64 result, and for bfloat16 the same bits (normalise in float32, round to bfloat16, then multiply by
    the weight). Prints the verdict (unless ``verbose=False``) and returns it.
    """
    gen = generator(seed)
    worst = {}
    same_bits = []
    for case in FORWARD_CASES:
        x, w = _matrix(case, gen, tiny=True), _weight(case, gen)
        ref = _forward64(x, w, case.eps)
        out, problem = _call(fn, (x, w, case.eps), case, expect_like=x)
        if problem is None:
            problem = _compare(out, ref, case, "y", _forward_suspects(x, w, case))
        if problem is None and case.dtype == torch.bfloat16:
            problem, fraction = _bf16_cast_order(out, x, w, case)
            same_bits.append(1 - fraction)
        if problem is not None:
            return verdict(False, problem, verbose)
        worst[case.dtype] = max(worst.get(case.dtype, 0.0), relative_error(out, ref))
    summary = (
        f"forward correct on {len(FORWARD_CASES)} inputs (widths {_widths(FORWARD_CASES)}, float32 and bfloat16, "
        f"tiny values, a strided view). Largest relative errors: {_format_errors(worst)}; bfloat16 outputs "
        f"identical to Hugging Face's in {100 * min(same_bits):.2f}% of values."
    )
    return verdict(True, summary, verbose)


def check_rms_norm_backward(fn: Callable, seed: int | None = None, verbose: bool = True) -> Report:
    """Check ``fn(dy, x, weight, rstd) -> dx``, the input gradient of RMSNorm for a 2-D ``x``.

    ``rstd`` is the float32 ``1 / sqrt(mean(x²) + eps)`` per row that the forward pass saved; ``dx`` must have ``x``'s
    shape and dtype. Prints the verdict (unless ``verbose=False``) and returns it.
    """
    gen = generator(seed)
    worst = {}
    for case in BACKWARD_CASES:
        x, w, dy = _matrix(case, gen), _weight(case, gen), _matrix(case, gen)
        rstd = torch.rsqrt(x.float().pow(2).mean(-1) + case.eps)
        ref, suspects = _backward_suspects(x, w, dy, rstd, case)
        out, problem = _call(fn, (dy, x, w, rstd), case, expect_like=x)
        if problem is None:
            problem = _compare(out, ref, case, "dx", suspects)
        if problem is not None:
            return verdict(False, problem, verbose)
        worst[case.dtype] = max(worst.get(case.dtype, 0.0), relative_error(out, ref))
    summary = (
        f"backward (dx) correct on {len(BACKWARD_CASES)} inputs (widths {_widths(BACKWARD_CASES)}, float32 and "
        f"bfloat16, a strided view). Largest relative errors: {_format_errors(worst)}."
    )
    return verdict(True, summary, verbose)


# ----------------------------------------------------------------------------------------------------------------------
# Inputs and calls
# ----------------------------------------------------------------------------------------------------------------------


def generator(seed: int | None) -> torch.Generator:
    """The CPU generator a check draws its inputs from: seeded with ``seed``, or fresh on every call when None."""
    gen = torch.Generator()
    if seed is None:
        gen.seed()  # fresh inputs on every call: a function must be right for any input, not for one
    else:
        gen.manual_seed(seed)
    return gen


def _matrix(case: Case, gen: torch.Generator, tiny: bool = False) -> torch.Tensor:
    buffer = torch.randn(case.rows, case.row_stride or case.cols, generator=gen, dtype=torch.float64)
    if tiny and case.tiny_row is not None:
        buffer[case.tiny_row] *= 1e-3  # mean(x²) ≈ 1e-6, well below eps = 1e-5: the result depends on eps
    return buffer.to(case.dtype).to(runtime.device())[:, : case.cols]


def _weight(case: Case, gen: torch.Generator) -> torch.Tensor:
    # Spread around 1 and never all ones: an all-ones weight hides a missing or misplaced multiplication.
    return (0.5 + torch.rand(case.cols, generator=gen, dtype=torch.float64)).to(case.dtype).to(runtime.device())


def _call(fn, args, case: Case, expect_like: torch.Tensor):
    """Run the reader's function; return ``(output, None)`` or ``(None, what is wrong with the call or its result)``."""
    try:
        out = fn(*args)
    except Exception as error:  # noqa: BLE001  (any failure of the reader's code is reported, not raised)
        return None, f"on a {case}, your function raised {type(error).__name__}: {last_line(error)}"
    if not isinstance(out, torch.Tensor):
        return None, f"on a {case}, your function returned {type(out).__name__}, expected a tensor shaped like x"
    if out.shape != expect_like.shape:
        return None, f"on a {case}, the output has shape {tuple(out.shape)}, expected {tuple(expect_like.shape)}"
    if out.dtype != expect_like.dtype:
        return None, (
            f"on a {case}, the output has dtype {out.dtype}, expected {expect_like.dtype}: allocate the output "
            "like x and store with cast_to(value, OUT.dtype.element_ty)"
        )
    if out.device != expect_like.device:
        return None, f"on a {case}, the output is on {out.device}, expected {expect_like.device} (where x is)"
    return out.detach(), None


def last_line(error: Exception) -> str:
    """The last non-empty line of ``error``'s message (at most 300 characters): what a check tells the reader of an
    exception their function raised."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    text = lines[-1] if lines else repr(error)
    return text if len(text) <= 300 else text[:297] + "..."


def verdict(passed: bool, message: str, verbose: bool) -> Report:
    """A check's ``Report``: ``message`` marked ✓ or ✗, printed when ``verbose``."""
    report = Report(passed, ("✓ " if passed else "✗ ") + message)
    if verbose:
        print(report.message)
    return report


def _widths(cases) -> str:
    return "/".join(str(case.cols) for case in cases)


def _format_errors(worst: dict) -> str:
    return ", ".join(f"{str(dtype).removeprefix('torch.')} {error:.1e}" for dtype, error in worst.items())


# ----------------------------------------------------------------------------------------------------------------------
# References and the usual mistakes, all in float64
# ----------------------------------------------------------------------------------------------------------------------


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(device="cpu", dtype=torch.float64)


def _forward64(x, w, eps, divisor=None, columns=None, rstd_power=-0.5, weight=True):
    """RMSNorm in float64, or one of its usual misreadings (another divisor, fewer columns, sqrt for rsqrt...)."""
    x, w = _f64(x), _f64(w)
    used = x if columns is None else x[:, :columns]
    mean_square = used.pow(2).sum(-1, keepdim=True) / (divisor or used.shape[-1])
    y = x * (mean_square + eps) ** rstd_power
    return w * y if weight else y


def _forward_suspects(x, w, case: Case) -> list[tuple[str, torch.Tensor]]:
    n = case.cols
    block_n = triton.next_power_of_2(n)
    suspects = []
    if block_n != n:
        suspects.append((
            f"did you divide by BLOCK_N ({block_n}) instead of n_cols ({n})? The masked lanes load zeros, so the sum "
            "of squares is right, but the mean is over the row's real width",
            _forward64(x, w, case.eps, divisor=block_n),
        ))
        # BLOCK_N too small (the power of two below n_cols): only the first columns enter the sum, and the rest of
        # the row is never written, so only those first columns can be compared.
        short = block_n // 2
        suspects.append((_short_block_hint(short, n), _first_columns(_forward64(x, w, case.eps, columns=short), short)))
    suspects += [
        ("you summed the squares but did not divide by n_cols: rstd needs the mean of x², not the sum",
         _forward64(x, w, case.eps, divisor=1)),
        ("you multiplied by sqrt(mean(x²) + eps) instead of dividing by it: rstd = 1 / sqrt(mean(x²) + eps), "
         "tl.math.rsqrt(...)", _forward64(x, w, case.eps, rstd_power=0.5)),
        ("the weight is never applied: y = w ⊙ x̂", _forward64(x, w, case.eps, weight=False)),
        (f"eps is missing: add it inside the square root (the eps passed in, here {case.eps:g})",
         _forward64(x, w, 0.0)),
    ]
    if case.eps != 1e-6:
        suspects.append((
            f"you used eps = 1e-6, not the eps passed in ({case.eps:g}): take it from the argument",
            _forward64(x, w, 1e-6),
        ))
    if case.row_stride:
        suspects.append(_stride_suspect(case, _forward64(_as_if_contiguous(x), w, case.eps)))
    if case.dtype == torch.bfloat16:
        suspects += [(hint, _f64(wrong)) for hint, wrong in _bf16_near_misses(x, w, case)]
    return suspects


def _backward_suspects(x, w, dy, rstd, case: Case) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]:
    """The right dx, and the usual mistakes in writing dx = rstd · (g − x̂ · mean(g ⊙ x̂)) with g = dy ⊙ w."""

    def dx64(x, dy, divisor=None, columns=None):
        x, w64, dy, r = _f64(x), _f64(w), _f64(dy), _f64(rstd)[:, None]
        x, w64, dy = x[:, :columns], w64[:columns], dy[:, :columns]
        x_hat, g = x * r, dy * w64
        mean = lambda t, d=divisor or x.shape[-1]: t.sum(-1, keepdim=True) / d  # noqa: E731
        return {
            "right": r * (g - x_hat * mean(g * x_hat)),
            "no rstd": g - x_hat * mean(g * x_hat),
            "sum": r * (g - x_hat * (g * x_hat).sum(-1, keepdim=True)),
            "sign": r * (g + x_hat * mean(g * x_hat)),
            "no correction": r * g,
            "no weight": r * (dy - x_hat * mean(dy * x_hat)),
            "dy in mean": r * (g - x_hat * mean(dy * x_hat)),
            "mean of g": r * (g - x_hat * mean(g)),
            "x for x_hat": r * (g - x * mean(g * x_hat)),
            "x for x_hat twice": r * (g - x * mean(g * x)),
        }

    n = case.cols
    block_n = triton.next_power_of_2(n)
    v = dx64(x, dy)
    x_hat_is = "x̂ = x · rstd"
    suspects = [
        ("the leading rstd factor is missing: dx = rstd · (g − x̂ · mean(g ⊙ x̂))", v["no rstd"]),
        (f"you summed g ⊙ x̂ over the row instead of taking its mean: divide the sum by n_cols ({n})", v["sum"]),
        ("the sign of the correction is wrong: dx = rstd · (g − x̂ · mean(g ⊙ x̂)), a minus", v["sign"]),
        ("the correction term − x̂ · mean(g ⊙ x̂) is missing: it carries how each output depends on every input "
         "through rstd", v["no correction"]),
        ("the weight is missing: g = dy ⊙ w is the gradient that reaches x̂, in both places", v["no weight"]),
        ("inside the mean use g = dy ⊙ w, not dy: mean(g ⊙ x̂)", v["dy in mean"]),
        ("wrong mean: it is mean(g ⊙ x̂), not mean(g)", v["mean of g"]),
        (f"you used x where x̂ belongs: the correction is x̂ · mean(g ⊙ x̂) with {x_hat_is}", v["x for x_hat"]),
        (f"you used x where x̂ belongs (in the product and in the mean): {x_hat_is}", v["x for x_hat twice"]),
    ]
    if block_n != n:
        suspects.append((
            f"wrong mean: did you divide by BLOCK_N ({block_n}) instead of n_cols ({n})? The masked lanes add zeros "
            "to the sum; the mean is over the row's real width",
            dx64(x, dy, divisor=block_n)["right"],
        ))
        # BLOCK_N too small: only the first columns are computed (with either divisor); only they can be compared.
        short = block_n // 2
        for divisor in (short, n):
            dx_short = torch.full(v["right"].shape, float("nan"), dtype=torch.float64)
            dx_short[:, :short] = dx64(x, dy, divisor=divisor, columns=short)["right"]
            suspects.append((_short_block_hint(short, n), dx_short))
    if case.row_stride:
        suspects.append(_stride_suspect(case, dx64(_as_if_contiguous(x), _as_if_contiguous(dy))["right"]))
    return v["right"], suspects


def _as_if_contiguous(t: torch.Tensor) -> torch.Tensor:
    """What a kernel reads from a strided view when it steps between rows by the width instead of the row stride."""
    return torch.as_strided(t, t.shape, (t.shape[-1], 1))


def _short_block_hint(short: int, n: int) -> str:
    return (
        f"only the first {short} columns were used: BLOCK_N must be a power of two at least n_cols "
        f"(triton.next_power_of_2({n}) = {triton.next_power_of_2(n)}), with the mask cols < n_cols switching off the "
        "extra lanes"
    )


def _first_columns(t: torch.Tensor, columns: int) -> torch.Tensor:
    """``t`` with every column from ``columns`` on set to NaN, i.e. left out of the comparison."""
    t = t.clone()
    t[:, columns:] = float("nan")
    return t


def _stride_suspect(case: Case, wrong: torch.Tensor) -> tuple[str, torch.Tensor]:
    return (
        f"rows were read n_cols ({case.cols}) elements apart, but in this view they are {case.row_stride} apart: "
        "offset each row by the tensor's row stride (x.stride(0)), not by its width",
        wrong,
    )


# ----------------------------------------------------------------------------------------------------------------------
# Comparing and explaining
# ----------------------------------------------------------------------------------------------------------------------


def _bad_elements(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Elements of ``out`` that are not close to ``ref``; where ``ref`` is NaN nothing is compared."""
    rtol, atol = ELEMENT_TOL[dtype]
    out = _f64(out)
    compared = torch.isfinite(ref)
    scale = float(ref[compared].abs().max()) if compared.any() else 1.0
    far = ~torch.isfinite(out) | ((out - ref).abs() > rtol * ref.abs() + atol * (scale or 1.0))
    return far & compared


def _compare(out, ref, case: Case, name: str, suspects) -> str | None:
    """None when ``out`` is right; otherwise the most precise explanation of what is wrong."""
    bad = _bad_elements(out, ref, case.dtype)
    if not bad.any() and relative_error(out, ref) < RELATIVE_ERROR_TOL[case.dtype]:
        return None
    where = f"on a {case}"
    out64 = _f64(out)
    first = _first_difference(out64, ref, bad, name)
    if torch.count_nonzero(out64) == 0:
        return (
            f"{where}, every value of {name} is 0: is the exercise line still the placeholder? "
            "(the stub as given computes zeros)"
        )
    for hint, wrong in suspects:
        if not _bad_elements(out, wrong, case.dtype).any():
            return f"{where}, {first}: {hint}."
    tail = _suffix(bad.any(0))
    if tail is not None:
        return (
            f"{where}, columns {tail}–{case.cols - 1} of {name} are wrong while columns 0–{tail - 1} are right: "
            "tail columns not written: check your mask (cols < n_cols) on the loads and the store, and that "
            "BLOCK_N ≥ n_cols."
        )
    tail = _suffix(bad.any(1))
    if tail is not None:
        return (
            f"{where}, rows {tail}–{case.rows - 1} of {name} are wrong while rows 0–{tail - 1} are right: some rows "
            "were never computed: does the grid launch a program for every row (or block of rows), and does the "
            "row mask keep exactly rows < n_rows?"
        )
    if not torch.isfinite(out64).all():
        return (
            f"{where}, {first}: {name} holds NaN or infinity. Masked-off lanes must load other=0.0, and eps belongs "
            "inside the square root."
        )
    return (
        f"{where}, {first}; relative error of {name} {relative_error(out, ref):.2e} (must stay below "
        f"{RELATIVE_ERROR_TOL[case.dtype]:g}). None of the usual mistakes reproduces this output: print it beside the "
        "reference "
        "for this input to see the pattern."
    )


def _first_difference(out64, ref, bad, name) -> str:
    if bad.any():
        row, col = (int(i) for i in bad.nonzero()[0])
    else:  # every element within tolerance, yet the whole is not: point at the largest difference
        row, col = divmod(int((out64 - ref).abs().argmax()), ref.shape[1])
    got, expected = out64[row, col].item(), ref[row, col].item()
    return f"row {row} of {name} differs (column {col}: got {got:.5g}, expected {expected:.5g})"


def _suffix(bad_along: torch.Tensor) -> int | None:
    """k > 0 when exactly the positions k, k+1, ... are bad; otherwise None."""
    bad_along = bad_along.tolist()
    if all(bad_along) or not any(bad_along):
        return None
    k = bad_along.index(True)
    return k if all(bad_along[k:]) else None


CAST_ORDER_HINT = (
    "output not cast like Hugging Face: you multiplied by the weight before casting. Hugging Face rounds x̂ to the "
    "input dtype first, then multiplies by the weight: y = cast_to(x_hat, X.dtype.element_ty).to(tl.float32) * w"
)
TRUNCATION_HINT = (
    "values are truncated to bfloat16 instead of rounded: Triton's interpreter truncates .to(tl.bfloat16), so store "
    "through cast_to(value, Y.dtype.element_ty) (and round x̂ the same way)"
)


def _bf16_near_misses(x, w, case: Case) -> list[tuple[str, torch.Tensor]]:
    """Outputs that are right to bfloat16 precision but rounded differently from Hugging Face's, as bf16 on the CPU."""
    x32, w32 = x.detach().cpu().float(), w.detach().cpu().float()
    x_hat = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + case.eps)
    return [
        (CAST_ORDER_HINT, (x_hat * w32).bfloat16()),
        (TRUNCATION_HINT, _truncate_bf16(_truncate_bf16(x_hat).float() * w32)),
    ]


def _bf16_cast_order(out, x, w, case: Case) -> tuple[str | None, float]:
    """Compare a bfloat16 output bit for bit with Hugging Face's; return (what is wrong or None, fraction differing)."""
    out = out.cpu()
    differs = (out != rms_norm_reference(x.cpu(), w.cpu(), case.eps)).float().mean().item()
    if differs <= BF16_MAX_DIFFERENT:
        return None, differs
    where = f"on a {case}, {100 * differs:.0f}% of the values differ from Hugging Face's in the last bits"
    for hint, candidate in _bf16_near_misses(x, w, case):
        if (out != candidate).float().mean().item() < differs / 4:
            return f"{where}: {hint}.", differs
    return (
        f"{where} (close, but not the same rounding): normalise in float32, round x̂ to bfloat16, then multiply by "
        "the weight.",
        differs,
    )


def _truncate_bf16(t: torch.Tensor) -> torch.Tensor:
    """float32 → bfloat16 by dropping the low 16 bits (what a truncating conversion does)."""
    bits = t.float().contiguous().view(torch.int32) & -65536  # 0xFFFF0000 as a signed 32-bit integer
    return bits.view(torch.float32).bfloat16()
