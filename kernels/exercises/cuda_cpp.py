"""Check for the exercise of chapter 13: the row loop of an RMSNorm forward, written in C++.

The reader completes the body of ``rms_norm_rows``, a plain C++ function over raw float32 pointers: the loop that
the CUDA kernel spreads over the threads of a block, here run by one CPU thread. The check compiles it with
``torch.utils.cpp_extension.load_inline`` (the same compiler, flags and ninja as the package's extensions, but
without PyTorch's headers, so a build takes a second or two instead of twenty), calls it through ``ctypes`` on
inputs chosen to expose the usual mistakes (widths that are not powers of two, a row of tiny values where eps
matters, rows further apart in memory than they are wide), and compares ``y`` and ``rstd`` with float64. Every
diagnosis is worded once, in ``DIAGNOSES``. It never raises because the reader's code is wrong or does not compile:
it prints its verdict and returns a ``Report``.
"""

from __future__ import annotations

import ctypes
import hashlib
from dataclasses import dataclass

import torch

from kernels.reference import relative_error, rms_norm_reference
from kernels.tolerances import RELATIVE_ERROR_TOL

from .rmsnorm import Report, verdict

FUNCTION = "rms_norm_rows"

STUB = r"""
extern "C" void rms_norm_rows(const float* x, int64_t x_row_stride, const float* w, float* y, float* rstd,
                              int64_t rows, int64_t cols, float eps) {
  for (int64_t row = 0; row < rows; ++row) {
    // TODO: the sum of squares of row `row` of x in a float accumulator (the row starts at x + row * x_row_stride),
    //       r = 1 / sqrt(mean + eps), then y[row * cols + c] = w[c] * (x[...] * r) for every column c,
    //       and rstd[row] = r.
  }
}
"""

# What the reader's source is compiled with: the C and C++ standard headers it may need, nothing of PyTorch's.
PRELUDE = "#include <cmath>\n#include <cstdint>\n"

TOL = RELATIVE_ERROR_TOL[torch.float32]

# The eps a reader may have typed as a constant instead of using the argument (LlamaRMSNorm's usual value).
COMMON_EPS = 1e-6

# Every verdict, worded once. A case-specific one is prefixed with the input it was found on ("on an input of …, ").
DIAGNOSES = {
    "unavailable": "cannot compile here: {reason}",
    "compile": "it does not compile: {error}",
    "no_function": ('the library has no function named rms_norm_rows: keep the `extern "C"` line and the name of the '
                    'stub (without extern "C", C++ renames the function)'),
    "not_written": "y was never written: the loop body is missing or stores nowhere",
    "partly_written": ("y[{row}, {col}] was never written ({count} of {total} values): the column loop must cover "
                       "0 … cols − 1 of every row"),
    "y_stride": ("y's rows were written x_row_stride apart, {count} values of them past the end of y: y is "
                 "packed, its row r starts at y + r * cols; x_row_stride is the spacing of x's rows only"),
    "past_y": ("{count} value(s) were written past the end of y: a loop runs too far (c <= cols or row <= rows); "
               "the last column is cols − 1 and the last row rows − 1"),
    "no_eps": "y is wrong: eps is missing, r = 1 / sqrt(mean) instead of 1 / sqrt(mean + eps)",
    "fixed_eps": (f"y is wrong: eps is the constant {COMMON_EPS:g}, not the eps argument (a model chooses its own: "
                  "config.rms_norm_eps)"),
    "eps_outside": ("y is wrong: eps is outside the square root, r = 1 / (sqrt(mean) + eps); it belongs inside, "
                    "r = 1 / sqrt(mean + eps)"),
    "no_weight": "y is wrong: the weight is not applied, y must be w[c] · x[c] · r",
    "sum_not_mean": "y is wrong: the sum of squares is not divided by the width (a sum, not a mean)",
    "times_sqrt": "y is wrong: x is multiplied by sqrt(mean + eps) instead of divided by it",
    "x_stride": "y is wrong: rows of x are read `cols` apart instead of `x_row_stride` apart",
    "nan_y": ("y holds NaN in row {row}, computed by the function: the square root of a negative number, or 0 / 0 "
              "(is every term of the sum of squares x · x?)"),
    "wrong_y": ("y is wrong (relative error {error:.2g} > {tol:g}); row {row} differs most. Expected "
                "y = w · x · r with r = 1 / sqrt(mean(x²) + eps)"),
    "no_rstd": "y is right but rstd was not written: store r in rstd[row] (the backward needs it)",
    "rstd_is_std": ("y is right but rstd holds sqrt(mean + eps), the root mean square itself: store its reciprocal "
                    "r = 1 / sqrt(mean + eps), which the backward multiplies by"),
    "wrong_rstd": "y is right but rstd is wrong (relative error {error:.2g}): rstd[row] must be r",
    "passed": ("rms_norm_rows is right on {cases} inputs (widths {widths}, tiny values, a strided view); largest "
               "relative error of y {worst:.1e}."),
}


def diagnosis(key: str, **fields) -> str:
    """The sentence ``DIAGNOSES[key]`` with its fields filled in."""
    return DIAGNOSES[key].format(**fields)


@dataclass(frozen=True)
class Case:
    rows: int
    cols: int
    eps: float = 1e-6
    row_stride: int | None = None  # rows of x this many floats apart (a view into a wider buffer)
    tiny_row: int | None = None  # a row of tiny values: mean(x²) below eps, so eps shapes the result

    def __str__(self) -> str:
        text = f"input of {self.rows} × {self.cols}"
        if self.row_stride:
            text += f" whose rows are {self.row_stride} floats apart in memory"
        if self.tiny_row is not None:
            text += f" (row {self.tiny_row} holds tiny values; eps={self.eps:g})"
        return text


CASES = (
    Case(7, 64),
    Case(5, 100),  # not a power of two
    Case(3, 37, eps=1e-5, tiny_row=1),  # eps matters, and it is not the default one
    Case(4, 80, row_stride=128),  # row stride != width
)


# --------------------------------------------------------------------------------------------------------------------
# Compiling the reader's source
# --------------------------------------------------------------------------------------------------------------------


def compile_rows_function(source: str):
    """Compile ``source`` (C++ defining ``extern "C" void rms_norm_rows(...)``) and return ``(function, None)``,
    or ``(None, what went wrong)``. Each distinct source is built once, under a name derived from its hash."""
    from kernels.cuda_rmsnorm import cpu_build_unavailable

    reason = cpu_build_unavailable()
    if reason:
        return None, diagnosis("unavailable", reason=reason)
    from torch.utils.cpp_extension import load_inline

    name = "exercise_rms_norm_rows_" + hashlib.sha1(source.encode()).hexdigest()[:12]
    try:
        library = load_inline(name=name, cpp_sources=[PRELUDE + source], extra_cflags=["-O1"],
                              is_python_module=False, no_implicit_headers=True)
    except Exception as exc:  # noqa: BLE001  (a compile error is the reader's to read, not a crash)
        return None, diagnosis("compile", error=_compiler_error(str(exc)))
    try:
        fn = getattr(ctypes.CDLL(library), FUNCTION)
    except AttributeError:
        return None, diagnosis("no_function")
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_int64, ctypes.c_int64, ctypes.c_float]
    return fn, None


def _compiler_error(text: str) -> str:
    errors = [line.strip() for line in text.splitlines() if "error" in line and "main.cpp" in line]
    first = errors[0] if errors else (text.strip().splitlines() or ["(no compiler output)"])[-1]
    first = first.split("main.cpp:", 1)[-1]  # drop the build folder's path; keep line:column: error: message
    return f"main.cpp:{first}" if errors else first


# --------------------------------------------------------------------------------------------------------------------
# Running it, and what its results say
# --------------------------------------------------------------------------------------------------------------------


def _inputs(case: Case, gen: torch.Generator):
    buffer = torch.randn(case.rows, case.row_stride or case.cols, generator=gen, dtype=torch.float64)
    if case.tiny_row is not None:
        buffer[case.tiny_row] *= 1e-3  # mean(x²) ≈ 1e-6, below eps = 1e-5
    x = buffer.float()[:, : case.cols]
    w = (0.5 + torch.rand(case.cols, generator=gen, dtype=torch.float64)).float()  # never all ones
    return x, w


# What the output buffers are filled with before the call: a NaN with a payload of its own (float32 bits
# 0x7FC0DEAD), so that a value the function never wrote is told apart from a NaN it computed (sqrt of a negative
# number, 0 / 0), which comes out as the processor's default NaN.
POISON_BITS = 0x7FC0DEAD


def _poisoned(n: int) -> torch.Tensor:
    return torch.full((n,), POISON_BITS, dtype=torch.int32).view(torch.float32)


def untouched(values: torch.Tensor) -> torch.Tensor:
    """Where ``values`` (float32) still hold the poison they were filled with: never written."""
    return values.contiguous().view(torch.int32) == POISON_BITS


def run_rows_function(fn, x: torch.Tensor, w: torch.Tensor, eps: float):
    """Call the compiled ``rms_norm_rows`` on a float32 [rows, cols] view ``x`` (unit stride along a row).

    Returns ``(y, rstd, buffer)``. All start poisoned (``untouched`` finds what the function did not write). ``y``
    is the front of ``buffer``, a larger block: what the function writes past y's end lands there instead of on
    memory it does not own, and the check can see it.
    """
    rows, cols = x.shape
    guard = rows * max(x.stride(0), cols) + cols  # room for a row loop that steps x's stride through y
    buffer = _poisoned(rows * cols + guard)
    y = buffer[: rows * cols].view(rows, cols)
    rstd = _poisoned(rows)
    fn(x.data_ptr(), x.stride(0), w.data_ptr(), y.data_ptr(), rstd.data_ptr(), rows, cols, eps)
    return y, rstd, buffer


def _suspects(x: torch.Tensor, w: torch.Tensor, case: Case) -> dict[str, torch.Tensor]:
    """Outputs of the usual mistakes, in float64, keyed by their diagnosis, to name the one a wrong output
    reproduces."""
    x64, w64 = x.double(), w.double()
    ms = x64.pow(2).mean(-1, keepdim=True)
    # The rows a function reads when it steps `cols` floats from row to row in x's memory, ignoring the stride.
    packed = torch.as_strided(x, (case.rows, case.cols), (case.cols, 1)).double()
    suspects = {
        "no_eps": w64 * x64 * ms.rsqrt(),
        "eps_outside": w64 * x64 / (ms.sqrt() + case.eps),
        "no_weight": x64 * (ms + case.eps).rsqrt(),
        "sum_not_mean": w64 * x64 * (x64.pow(2).sum(-1, keepdim=True) + case.eps).rsqrt(),
        "times_sqrt": w64 * x64 * (ms + case.eps).sqrt(),
        "x_stride": w64 * packed * (packed.pow(2).mean(-1, keepdim=True) + case.eps).rsqrt(),
    }
    if case.eps != COMMON_EPS:
        suspects["fixed_eps"] = w64 * x64 * (ms + COMMON_EPS).rsqrt()
    return suspects


def _diagnose(y, rstd, buffer, x: torch.Tensor, w: torch.Tensor, case: Case) -> str | None:
    """What is wrong with ``(y, rstd)`` on ``case`` (``buffer``: y and what lies past its end), or None when both
    are right. The answer names the case it was found on."""
    problem = _problem(y, rstd, buffer, x, w, case)
    return None if problem is None else f"on an {case}, {problem}"


def _problem(y, rstd, buffer, x, w, case) -> str | None:
    x64, w64 = x.double(), w.double()
    ref = rms_norm_reference(x64, w64, case.eps)
    ref_rstd = (x64.pow(2).mean(-1) + case.eps).rsqrt()
    spilled = int((~untouched(buffer[y.numel():])).sum())
    if spilled:
        rows_at_x_stride = torch.as_strided(buffer, y.shape, (x.stride(0), 1))
        if x.stride(0) != case.cols and relative_error(rows_at_x_stride, ref) <= TOL:
            return diagnosis("y_stride", count=spilled)
        return diagnosis("past_y", count=spilled)
    unwritten = untouched(y)
    if unwritten.all():
        return diagnosis("not_written")
    if unwritten.any():
        row, col = (int(i) for i in unwritten.nonzero()[0])
        return diagnosis("partly_written", row=row, col=col, count=int(unwritten.sum()), total=y.numel())
    error = relative_error(y, ref)
    if not error <= TOL:
        for key, value in _suspects(x, w, case).items():
            if relative_error(y, value) <= TOL:
                return diagnosis(key)
        if torch.isnan(y).any():
            return diagnosis("nan_y", row=int(torch.isnan(y).any(-1).nonzero()[0]))
        bad_row = int(((y.double() - ref).abs().amax(-1)).argmax())
        return diagnosis("wrong_y", error=error, tol=TOL, row=bad_row)
    if untouched(rstd).any():
        return diagnosis("no_rstd")
    error = relative_error(rstd, ref_rstd)
    if not error <= TOL:
        if relative_error(rstd, ref_rstd.reciprocal()) <= TOL:
            return diagnosis("rstd_is_std")
        return diagnosis("wrong_rstd", error=error)
    return None


def check_rms_norm_rows(source: str, seed: int | None = None, verbose: bool = True) -> Report:
    """Compile the reader's C++ ``source`` of ``rms_norm_rows`` and check it on every case against float64.

    Prints the verdict (unless ``verbose=False``) and returns it as a ``Report``; never raises because the source
    is wrong or does not compile.
    """
    fn, problem = compile_rows_function(source)
    if problem is not None:
        return verdict(False, problem, verbose)
    gen = torch.Generator()
    gen.manual_seed(seed) if seed is not None else gen.seed()  # fresh inputs unless a seed replays some
    worst = 0.0
    for case in CASES:
        x, w = _inputs(case, gen)
        y, rstd, buffer = run_rows_function(fn, x, w, case.eps)
        problem = _diagnose(y, rstd, buffer, x, w, case)
        if problem is not None:
            return verdict(False, problem, verbose)
        worst = max(worst, relative_error(y, rms_norm_reference(x.double(), w.double(), case.eps)))
    widths = "/".join(str(c.cols) for c in CASES)
    return verdict(True, diagnosis("passed", cases=len(CASES), widths=widths, worst=worst), verbose)
