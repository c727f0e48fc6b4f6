"""Check for the exercise of chapter 13: the row loop of an RMSNorm forward, written in C++.

The reader completes the body of ``rms_norm_rows``, a plain C++ function over raw float32 pointers:
the loop that the CUDA kernel spreads over the threads of a block, here run by one CPU thread. The
check compiles it with ``torch.utils.cpp_extension.load_inline`` (the same compiler, flags and ninja
as the package's extensions, but without PyTorch's headers, so a build takes a second or two instead
of twenty), calls it through ``ctypes`` on inputs chosen to expose the usual mistakes (widths that
are not powers of two, a row of tiny values where eps matters, rows further apart in memory than
they are wide), and compares ``y`` and ``rstd`` with float64. It ends with rows 2**32 + 192 floats
apart (``mapped_buffer``: an address range with almost no memory behind it), where a row offset cut
to 32 bits (``int offset = row * x_row_stride``) reads row 1 from element 192. Every diagnosis is
worded once, in ``DIAGNOSES``. It never raises because the reader's code is wrong or does not
compile: it prints its verdict and returns a ``Report``.
"""

from __future__ import annotations

import ctypes
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.reference import relative_error, rms_norm_reference
from kernels.tolerances import RELATIVE_ERROR_TOL

from .rmsnorm import Report, mapped_buffer, verdict
from .sentences import sentence_lookup

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

# What the reader's source is compiled with: the C and C++ standard headers it may need, nothing of
# PyTorch's.
PRELUDE = "#include <cmath>\n#include <cstdint>\n"

TOL = RELATIVE_ERROR_TOL[torch.float32]

# The eps a reader may have typed as a constant instead of using the argument (LlamaRMSNorm's usual value).
COMMON_EPS = 1e-6

# Every verdict, worded once. A case-specific one is prefixed with the input it was found on ("on an
# input of …, ").
DIAGNOSES = {
    "unavailable": "cannot compile here: {reason}",
    "compile": "it does not compile: {error}",
    "no_function": ('the library has no function named rms_norm_rows: keep the `extern "C"` line '
                    'and the name of the stub (without extern "C", C++ renames the function)'),
    "not_written": "y was never written: the loop body is missing or stores nowhere",
    "partly_written": ("y[{row}, {col}] was never written ({count} of {total} values): the column "
                       "loop must cover 0 … cols − 1 of every row"),
    "y_stride": ("y's rows were written x_row_stride apart, {count} values of them past the end of y: y is "
                 "packed, its row r starts at y + r * cols; x_row_stride is the spacing of x's rows only"),
    "past_y": ("{count} value(s) were written past the end of y: a loop runs too far (c <= cols or "
               "row <= rows); the last column is cols − 1 and the last row rows − 1"),
    "no_eps": "y is wrong: eps is missing, r = 1 / sqrt(mean) instead of 1 / sqrt(mean + eps)",
    "fixed_eps": (f"y is wrong: eps is the constant {COMMON_EPS:g}, not the eps argument (a model "
                  "chooses its own: config.rms_norm_eps)"),
    "eps_outside": ("y is wrong: eps is outside the square root, r = 1 / (sqrt(mean) + eps); it "
                    "belongs inside, r = 1 / sqrt(mean + eps)"),
    "no_weight": "y is wrong: the weight is not applied, y must be w[c] · x[c] · r",
    "sum_not_mean": "y is wrong: the sum of squares is not divided by the width (a sum, not a mean)",
    "times_sqrt": "y is wrong: x is multiplied by sqrt(mean + eps) instead of divided by it",
    "x_stride": "y is wrong: rows of x are read `cols` apart instead of `x_row_stride` apart",
    "nan_y": ("y holds NaN in row {row}, computed by the function: the square root of a negative "
              "number, or 0 / 0 (is every term of the sum of squares x · x?)"),
    "wrong_y": ("y is wrong (relative error {error:.2g} > {tol:g}); row {row} differs most. Expected "
                "y = w · x · r with r = 1 / sqrt(mean(x²) + eps)"),
    "no_rstd": "y is right but rstd was not written: store r in rstd[row] (the backward needs it)",
    "rstd_is_std": ("y is right but rstd holds sqrt(mean + eps), the root mean square itself: "
                    "store its reciprocal r = 1 / sqrt(mean + eps), which the backward multiplies "
                    "by"),
    "wrong_rstd": "y is right but rstd is wrong (relative error {error:.2g}): rstd[row] must be r",
    "int32_offset": ("row {row} of y is the RMSNorm of the floats at element {wrapped:,} of x, not "
                     "at element {start:,} where the row starts: row * x_row_stride was cut to 32 "
                     "bits (an int offset, or a static_cast<int>), and it passes 2³¹. Keep every "
                     "offset int64_t, as the signature's types are: rows × stride passes 2³¹ in "
                     "real models (16,744 rows at a width of 128,256)"),
    "source_type": "the check takes the C++ source as a string (r\"\"\"...\"\"\"), got {got}",
    "passed": ("rms_norm_rows is right on {cases} inputs (widths {widths}, tiny values, a strided "
               "view); largest relative error of y {worst:.1e}; {offsets}."),
}

# The last input: rows HIGH_STRIDE floats apart, so row 1 starts past element 2**32. An offset cut
# to 32 bits keeps HIGH_STRIDE mod 2**32 = HIGH_WRAP, still inside the buffer (a negative one would
# read before it and crash).
HIGH_COLS = 64
HIGH_WRAP = 3 * HIGH_COLS
HIGH_STRIDE = 2**32 + HIGH_WRAP
HIGH_CASE_TEXT = f"input of 2 × {HIGH_COLS} whose rows are {HIGH_STRIDE:,} floats apart in memory"
OFFSETS_CHECKED = (f"row offsets past 2³¹ read where they are (rows {HIGH_STRIDE:,} floats apart: "
                   "int64 offsets)")
OFFSETS_NOT_CHECKED = ("int64 row offsets NOT checked (this machine would not map the 16 GiB of "
                       "addresses a row past element 2³² needs)")


diagnosis = sentence_lookup(DIAGNOSES)


@dataclass(frozen=True)
class Case:
    """One input ``check_rms_norm_rows`` runs the reader's row loop on: x [rows, cols] and eps."""

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


# --------------------------------------------------------------------------------------------------
# Compiling the reader's source
# --------------------------------------------------------------------------------------------------


def compile_rows_function(source: str):
    """Compile ``source`` (C++ defining ``extern "C" void rms_norm_rows(...)``) and return
    ``(function, None)``, or ``(None, what went wrong)``. Each distinct source is built once, under
    a name derived from its hash.

    Args:
        source: the reader's C++ source; ``PRELUDE`` (``<cmath>``, ``<cstdint>``) is put before it.

    Returns:
        ``(function, None)``, the ``ctypes`` function with its argument types set, or ``(None,
        text)``: the first compiler error, a missing ``rms_norm_rows``, or why no C++ build is
        possible here.
    """
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


# --------------------------------------------------------------------------------------------------
# Running it, and what its results say
# --------------------------------------------------------------------------------------------------


def _inputs(case: Case, gen: torch.Generator):
    buffer = torch.randn(case.rows, case.row_stride or case.cols, generator=gen, dtype=torch.float64)
    if case.tiny_row is not None:
        buffer[case.tiny_row] *= 1e-3  # mean(x²) ≈ 1e-6, below eps = 1e-5
    x = buffer.float()[:, : case.cols]
    w = (0.5 + torch.rand(case.cols, generator=gen, dtype=torch.float64)).float()  # never all ones
    return x, w


# What the output buffers are filled with before the call: a NaN with a payload of its own (float32
# bits 0x7FC0DEAD), so that a value the function never wrote is told apart from a NaN it computed
# (sqrt of a negative number, 0 / 0), which comes out as the processor's default NaN.
POISON_BITS = 0x7FC0DEAD


def _poisoned(n: int) -> torch.Tensor:
    return torch.full((n,), POISON_BITS, dtype=torch.int32).view(torch.float32)


def untouched(values: torch.Tensor) -> torch.Tensor:
    """Where ``values`` (float32) still hold the poison they were filled with: never written.

    Args:
        values: an output buffer filled with the poison NaN (``POISON_BITS``) before the call.

    Returns:
        a bool tensor of ``values``' shape, True where the poison is still there.
    """
    return values.contiguous().view(torch.int32) == POISON_BITS


def run_rows_function(fn, x: torch.Tensor, w: torch.Tensor, eps: float):
    """Call the compiled ``rms_norm_rows`` on a float32 [rows, cols] view ``x`` (unit stride along a row).

    Returns ``(y, rstd, buffer)``. All start poisoned (``untouched`` finds what the function did not
    write). ``y`` is the front of ``buffer``, a larger block: what the function writes past y's end
    lands there instead of on memory it does not own, and the check can see it.

    Args:
        fn: the compiled function, as ``compile_rows_function`` returns it.
        x: the input, float32 [rows, cols], rows possibly further apart than cols.
        w: the weight, float32 [cols].
        eps: the epsilon added to mean(x²).
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
    # The rows a function reads when it steps `cols` floats from row to row in x's memory, ignoring
    # the stride.
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
    """What is wrong with ``(y, rstd)`` on ``case`` (``buffer``: y and what lies past its end), or
    None when both are right. The answer names the case it was found on."""
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

    Prints the verdict (unless ``verbose=False``) and returns it as a ``Report``; never raises
    because the source is wrong or does not compile (chapter 13, notebooks/13_cuda_cpp.ipynb).

    Args:
        source: the reader's C++ source, as a string, defining ``extern "C" void
            rms_norm_rows(x, x_row_stride, w, y, rstd, rows, cols, eps)`` over float32 pointers.
        seed: seed of the random inputs; None draws fresh ones.
        verbose: print the verdict: ✓ with the worst relative error and whether int64 row offsets
            were checked, or ✗ and the first mistake found.

    Returns:
        a ``Report``: ``passed``, and the verdict's message.
    """
    if not isinstance(source, str):
        return verdict(False, diagnosis("source_type", got=type(source).__name__), verbose)
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
    problem, ran = _high_offsets(fn, gen)
    if problem is not None:
        return verdict(False, problem, verbose)
    widths = "/".join(str(c.cols) for c in CASES)
    offsets = OFFSETS_CHECKED if ran else OFFSETS_NOT_CHECKED
    return verdict(True,
                   diagnosis("passed", cases=len(CASES), widths=widths, worst=worst,
                             offsets=offsets), verbose)


def _high_offsets(fn, gen: torch.Generator) -> tuple[str | None, bool]:
    """Run ``fn`` on two rows ``HIGH_STRIDE`` floats apart; (what is wrong or None, whether it could
    run at all). Only called once every case has passed, so y is written where it belongs: packed, a
    few hundred floats."""
    buffer = mapped_buffer(HIGH_STRIDE + HIGH_COLS, torch.float32, "cpu")
    if buffer is None:
        return None, False
    x = buffer.as_strided((2, HIGH_COLS), (HIGH_STRIDE, 1))
    values = torch.randn(3, HIGH_COLS, generator=gen, dtype=torch.float64).float()
    x.copy_(values[:2])
    buffer[HIGH_WRAP: HIGH_WRAP + HIGH_COLS] = values[2]  # what row 1 reads at an offset cut to 32 bits
    w = (0.5 + torch.rand(HIGH_COLS, generator=gen, dtype=torch.float64)).float()
    y = _poisoned(2 * HIGH_COLS).view(2, HIGH_COLS)
    rstd = _poisoned(2)
    eps = 1e-6
    fn(x.data_ptr(), HIGH_STRIDE, w.data_ptr(), y.data_ptr(), rstd.data_ptr(), 2, HIGH_COLS, eps)
    del x, buffer  # 16 GiB of addresses: give them back
    ref = rms_norm_reference(values.double(), w.double(), eps)
    if relative_error(y[1], ref[2]) <= TOL and relative_error(y[0], ref[0]) <= TOL:
        return f"on an {HIGH_CASE_TEXT}, " + diagnosis("int32_offset", row=1, wrapped=HIGH_WRAP,
                                                         start=HIGH_STRIDE), True
    where = f"on an {HIGH_CASE_TEXT}, "
    error = relative_error(y, ref[:2])
    if untouched(y).any() or not error <= TOL:
        bad_row = int(((y.double() - ref[:2]).abs().nan_to_num(float("inf")).amax(-1)).argmax())
        return where + diagnosis("wrong_y", error=error, tol=TOL, row=bad_row), True
    error = relative_error(rstd, (values[:2].double().pow(2).mean(-1) + eps).rsqrt())
    if untouched(rstd).any() or not error <= TOL:
        return where + diagnosis("wrong_rstd", error=error), True
    return None, True


# ==================================================================================================
# The CUDA exercise: a warp per row, 16-byte loads and a warp-shuffle reduction
# ==================================================================================================
#
# The reader writes a CUDA kernel, as a string: ``rstd_warp_per_row`` computes each row's rstd = 1 /
# sqrt(mean(x²) + eps) of a float32 [rows, cols] tensor, one warp per row (blockDim.x / 32 rows per
# block), each lane reading its share of the row in float4 packs (16 bytes; cols is a multiple of 4,
# so every row starts on a 16-byte boundary) and the lanes' partial sums added with warp shuffles.
# The package's kernel gives a whole block to a row; a warp per row is the layout for rows too
# narrow to feed a block, and its reduction needs no shared memory at all.
#
# Where a GPU is present the check builds the kernel with ``torch.utils.cpp_extension.load_inline``
# in a separate process (a kernel that reads out of bounds ends its CUDA context, and must not end
# the reader's), runs it on poisoned outputs with room past their end, and compares with float64.
# Without a GPU it compiles the kernel to PTX with ``nvcc`` when nvcc is on PATH (about two
# seconds), reads the source for the usual mistakes, and says plainly that the kernel was compiled
# and not run; without nvcc, that it was neither.

WARP_KERNEL = "rstd_warp_per_row"

WARP_STUB = r"""
extern "C" __global__ void rstd_warp_per_row(const float* x, float* rstd, int64_t rows, int64_t cols, float eps) {
  // TODO: this warp's row and this thread's lane; the lane's share of the row in float4 packs; the lanes' partial
  //       sums added with warp shuffles; one lane writes rstd[row] = 1 / sqrt(mean + eps).
}
"""

WARP_DIAGNOSES = {
    "stub": "rstd_warp_per_row is still the stub: its body is empty",
    "compile": "it does not compile: {error}",
    "no_kernel": ('the PTX has no kernel named rstd_warp_per_row: keep `extern "C" __global__` and '
                  'the stub\'s name (without extern "C", C++ renames the function)'),
    "no_shuffle": ("the lanes' partial sums are not combined with a warp shuffle (__shfl_xor_sync or "
                   "__shfl_down_sync): that is what this exercise is about"),
    "old_shuffle": ("{call} without _sync no longer exists on sm_70 and later: use the _sync "
                    "variant with the mask of the lanes taking part, 0xffffffff for a whole warp"),
    "partial_mask": ("a shuffle's mask is {mask}, not the whole warp (0xffffffff): lanes outside "
                     "the mask do not take part, and reading from them is undefined"),
    "atomic": ("atomicAdd combines the partial sums: correct, but it serialises the lanes; the "
               "shuffles add them in registers, in five steps"),
    "no_vector_load": ("no 16-byte load: read the row as float4 packs (reinterpret_cast<const "
                       "float4*>(row)[i]), one instruction per four floats"),
    "int32_offset": ("`{code}` keeps a row offset in 32 bits: row * cols passes 2³¹ once rows × "
                     "cols does (16,744 rows at a width of 128,256), and the offset wraps. Keep it "
                     "int64_t (row is int64_t; so is cols)"),
    "unavailable_gpu": "cannot build CUDA here: {reason}",
    "crashed": ("the kernel failed on the GPU ({error}): an out-of-bounds or misaligned access. "
                "Does every lane stay within its row's cols / 4 packs, and every warp whose row is "
                "≥ rows do nothing?"),
    "not_written": "rstd was never written: the lane that holds the total must store it",
    "partly_written": ("rstd[{row}] was never written ({count} of {rows} rows): warp w of block b "
                       "takes row b * (blockDim.x / 32) + w, and every row needs a warp (the grid "
                       "is ceil(rows / warps per block) blocks)"),
    "past_rows": ("{count} value(s) were written past the last row of rstd: a warp whose row is ≥ "
                  "rows must do nothing (the last block has more warps than rows left)"),
    "no_reduction": ("rstd holds lane 0's share only: the lanes' partial sums were not added (a "
                     "shuffle over offsets 16, 8, 4, 2, 1 before the store)"),
    "one_pack": ("each lane read only its first pack: the row has cols / 4 packs, more than 32 "
                 "when cols > 128; loop over them with a stride of 32"),
    "mean_over_packs": "the sum of squares is divided by the number of packs (cols / 4) instead of cols",
    "no_eps": "rstd is wrong: eps is missing, 1 / sqrt(mean) instead of 1 / sqrt(mean + eps)",
    "std": "rstd holds sqrt(mean + eps), the root itself: store its reciprocal (rsqrtf)",
    "wrong": ("rstd is wrong (relative error {error:.2g} > {tol:g}); row {row} differs most. Expected "
              "1 / sqrt(mean(x²) + eps) of every row"),
    "passed_gpu": ("rstd_warp_per_row is right on {cases} inputs ({shapes}), run on {device}; "
                   "largest relative error {worst:.1e}."),
    "compiled_not_run": ("compiled, not run: no GPU. nvcc built the kernel to PTX for {arch}, and "
                         "the source reads right (float4 loads, warp shuffles over the whole "
                         "warp). Whether it computes rstd was not checked: run this check where "
                         "there is a GPU."),
    "not_compiled": ("not compiled and not run: no GPU and no nvcc here. The source reads right "
                     "(float4 loads, warp shuffles over the whole warp), which is all that could "
                     "be checked."),
}

OUTCOMES = ("passed", "failed", "compiled, not run", "not compiled, not run")


@dataclass(frozen=True)
class CudaReport:
    """The verdict of the CUDA check: ``outcome`` is one of ``OUTCOMES``; true only when the kernel
    ran and was right. "compiled, not run" is its own outcome, never a pass."""

    outcome: str
    message: str

    @property
    def passed(self) -> bool:
        """Whether the kernel ran on a GPU and was right."""
        return self.outcome == "passed"

    def __bool__(self) -> bool:
        return self.passed


def warp_diagnosis(key: str, **fields) -> str:
    """The sentence ``WARP_DIAGNOSES[key]`` with its fields filled in.

    Args:
        key: a key of ``WARP_DIAGNOSES``.
        **fields: the sentence's fields.

    Returns:
        the sentence.

    Raises:
        KeyError: when ``key`` is unknown or a field the sentence names is missing.
    """
    return WARP_DIAGNOSES[key].format(**fields)


def _cuda_verdict(outcome: str, message: str, verbose: bool) -> CudaReport:
    mark = {"passed": "✓ ", "failed": "✗ "}.get(outcome, "○ ")
    report = CudaReport(outcome, mark + message)
    if verbose:
        print(report.message)
    return report


@dataclass(frozen=True)
class WarpCase:
    """One input ``check_rstd_warp_per_row`` runs the reader's kernel on: x [rows, cols], the
    threads of a block, and eps."""

    rows: int
    cols: int
    threads: int
    eps: float = 1e-6
    tiny_row: int | None = None

    def __str__(self) -> str:
        text = f"input of {self.rows} × {self.cols} with {self.threads} threads per block"
        if self.tiny_row is not None:
            text += f" (row {self.tiny_row} holds tiny values; eps={self.eps:g})"
        return text


WARP_CASES = (
    # 256 packs a row: 8 per lane; 37 rows, so the last block has warps without a row
    WarpCase(37, 1024, 128),
    # 250 packs: not a multiple of 32 lanes; eps decides one row
    WarpCase(5, 1000, 256, eps=1e-5, tiny_row=2),
    WarpCase(64, 128, 64),  # exactly one pack per lane
    WarpCase(3, 4, 32),  # one pack a row: 31 lanes hold nothing
)
ROWS_GUARD = 64  # poisoned values past rstd's end, where a warp beyond the last row would write


# -- reading the source
# --------------------------------------------------------------------------------------------

_SHUFFLE = re.compile(r"__shfl_(xor|down|up)?_?sync\s*\(\s*([^,]+),")
_OLD_SHUFFLE = re.compile(r"__shfl(_xor|_down|_up)?\s*\(")
# A 32-bit variable initialised with a product that involves cols, or a product cast to 32 bits.
_INT32_OFFSET = re.compile(r"\b(?:unsigned\s+int|unsigned|int|int32_t|uint32_t)\s+\w+\s*=\s*[^;]*\*[^;]*;"
                           r"|(?:\bstatic_cast<\s*(?:int|unsigned|int32_t|uint32_t)\s*>"
                           r"|\(\s*(?:int|unsigned|int32_t|uint32_t)\s*\))\s*\([^;]*?\*[^;]*?\)")
_FULL_MASKS = {"0xffffffff", "0xffffffffu", "0xFFFFFFFF", "0xFFFFFFFFu", "0xffffffffU",
               "0xFFFFFFFFU", "~0u", "~0U", "~0", "-1", "0xffffffffull"}


def _without_comments(source: str) -> str:
    source = re.sub(r"/\*.*?\*/", " ", source, flags=re.S)
    return re.sub(r"//[^\n]*", " ", source)


def read_warp_source(source: str) -> str | None:
    """The first usual mistake the source shows by reading alone, worded; None when it reads right.

    Args:
        source: the reader's CUDA source of ``rstd_warp_per_row``.

    Returns:
        the sentence of ``WARP_DIAGNOSES`` for the first mistake read (an empty body, a 32-bit
        offset from a product with cols, the old shuffles, no shuffle, a partial mask, an
        atomicAdd, no vector load), or None.
    """
    code = _without_comments(source)
    body = code[code.find("{") + 1: code.rfind("}")] if "{" in code else ""
    if not body.strip():
        return warp_diagnosis("stub")
    for found in _INT32_OFFSET.finditer(code):
        if re.search(r"\bcols\b", found.group(0)):
            return warp_diagnosis("int32_offset", code=" ".join(found.group(0).split()))
    old = _OLD_SHUFFLE.search(code)
    if old:
        return warp_diagnosis("old_shuffle", call=old.group(0).rstrip("( "))
    shuffles = _SHUFFLE.findall(code)
    if not shuffles:
        return warp_diagnosis("atomic") if "atomicAdd" in code else warp_diagnosis("no_shuffle")
    for _, mask in shuffles:
        mask = mask.strip()
        if re.fullmatch(r"(0x[0-9a-fA-F]+|\d+)[uUlL]*", mask) and mask not in _FULL_MASKS:
            return warp_diagnosis("partial_mask", mask=mask)
    if "atomicAdd" in code:
        return warp_diagnosis("atomic")
    if not re.search(r"\b(float4|uint4|int4)\b", code):
        return warp_diagnosis("no_vector_load")
    return None


# -- compiling without a GPU: nvcc to PTX
# ----------------------------------------------------------------------------

PTX_ARCH = "sm_90"
_PTX_PRELUDE = "#include <cstdint>\n"


def nvcc_path() -> str | None:
    """nvcc on PATH (or under CUDA_HOME or CUDA_PATH), else None.

    Returns:
        the path of nvcc, or None when none is found.
    """
    import os
    import shutil

    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidate = Path(home, "bin", "nvcc") if home else None
    return str(candidate) if candidate is not None and candidate.is_file() else None


def compile_to_ptx(source: str, arch: str = PTX_ARCH) -> tuple[str | None, str | None]:
    """``(ptx, None)`` from ``nvcc --ptx``, or ``(None, what went wrong)``; each distinct source is
    compiled once (the PTX is kept under the system's temporary folder, named by the source's hash).

    Args:
        source: the reader's CUDA source.
        arch: the GPU architecture nvcc compiles for.

    Returns:
        ``(ptx, None)``, or ``(None, text)``: ``"no nvcc"`` when there is none, else the first
        compile error worded as ``WARP_DIAGNOSES["compile"]``.
    """
    import subprocess
    import tempfile

    nvcc = nvcc_path()
    if nvcc is None:
        return None, "no nvcc"
    key = hashlib.sha1((arch + source).encode()).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / "kernels_exercise_ptx"
    folder.mkdir(exist_ok=True)
    ptx = folder / f"{key}.ptx"
    if ptx.is_file():
        return ptx.read_text(), None
    cu = folder / f"{key}.cu"
    cu.write_text(_PTX_PRELUDE + source)
    try:
        done = subprocess.run([nvcc, "--ptx", f"-arch={arch}", "-o", str(ptx), str(cu)], capture_output=True,
                              text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, warp_diagnosis("compile", error=f"nvcc did not finish: {exc}")
    if done.returncode != 0:
        errors = [line.split(f"{key}.cu", 1)[-1] for line in done.stderr.splitlines() if "error" in line]
        first = errors[0] if errors else (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return None, warp_diagnosis("compile", error=f"kernel.cu{first}" if errors else first)
    return ptx.read_text(), None


# -- running on a GPU, in a process of its own
# -----------------------------------------------------------------------

# Raw pointers and the CUDA runtime only: without PyTorch's headers the build takes seconds, not a minute.
_LAUNCHER = r"""
#include <cuda_runtime.h>

extern "C" const char* launch_rstd(const float* x, float* rstd, int64_t rows, int64_t cols, float eps,
                                   int64_t threads) {
  const int64_t warps = threads / 32;
  const int64_t blocks = (rows + warps - 1) / warps;
  rstd_warp_per_row<<<blocks, threads>>>(x, rstd, rows, cols, eps);
  cudaError_t launched = cudaGetLastError();
  cudaError_t finished = cudaDeviceSynchronize();
  cudaError_t error = launched != cudaSuccess ? launched : finished;
  return error == cudaSuccess ? nullptr : cudaGetErrorString(error);
}
"""


def _warp_inputs(case: WarpCase, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(case.rows, case.cols, generator=gen, dtype=torch.float64)
    if case.tiny_row is not None:
        x[case.tiny_row] *= 1e-3
    return x.float()


def run_on_gpu_process(source: str, inputs: list[torch.Tensor]) -> dict:
    """Build and run the reader's kernel on every case in a fresh Python process; returns
    ``{"error": text}`` for a build that failed, or ``{"results": [(rstd_with_guard, error_text),
    …], "device": name}``.

    A process of its own, so that a kernel that crashes takes its CUDA context with it, not this
    one's. Needs a CUDA GPU and a CUDA build.

    Args:
        source: the reader's CUDA source of ``rstd_warp_per_row``.
        inputs: one float32 x per case of ``WARP_CASES``, in order.

    Returns:
        the answer dict above; the results stop at the first case whose launch failed (its rstd
        None, its error text set), and rstd is followed by ``ROWS_GUARD`` poisoned values.
    """
    import os
    import subprocess
    import sys
    import tempfile

    # The child imports this package from where this process found it, installed or not.
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.pt"
        torch.save({"source": source, "inputs": inputs, "cases": [vars(c) for c in WARP_CASES]}, job)
        done = subprocess.run([sys.executable, "-m", "kernels.exercises.cuda_cpp", str(job)],
                              capture_output=True, text=True, timeout=600, env=env)
        answer = Path(tmp) / "answer.pt"
        if answer.is_file():
            return torch.load(answer)
        tail = (done.stderr or done.stdout).strip().splitlines()
        return {"error": tail[-1] if tail else f"the build process exited with {done.returncode}"}


def _gpu_job(job_path: str) -> None:
    """Inside the separate process: build, run every case, save the answers beside the job."""
    from torch.utils.cpp_extension import load_inline

    job = torch.load(job_path)
    source = job["source"]
    name = "exercise_rstd_warp_" + hashlib.sha1(source.encode()).hexdigest()[:12]
    answer = Path(job_path).with_name("answer.pt")
    try:
        library = load_inline(name=name, cpp_sources=[""], cuda_sources=[_PTX_PRELUDE + source + _LAUNCHER],
                              extra_cuda_cflags=["-O3"], is_python_module=False, no_implicit_headers=True)
    except Exception as exc:  # noqa: BLE001  (a compile error is the reader's to read)
        lines = [line for line in str(exc).splitlines() if "error" in line and ".cu" in line]
        first = lines[0].split(".cu", 1)[-1] if lines else str(exc).strip().splitlines()[-1]
        torch.save({"error": warp_diagnosis("compile",
                                            error=f"kernel.cu{first}" if lines else first)}, answer)
        return
    launch = ctypes.CDLL(library).launch_rstd
    launch.restype = ctypes.c_char_p
    launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_float,
                       ctypes.c_int64]
    results = []
    for x, case in zip(job["inputs"], job["cases"]):
        padded = torch.full((case["rows"] + 1, case["cols"]), 1e4, dtype=torch.float32, device="cuda")
        padded[: case["rows"]] = x.cuda()  # a row of large values past the end: reads beyond x show
        rstd = torch.full((case["rows"] + ROWS_GUARD,), POISON_BITS, dtype=torch.int32, device="cuda")
        rstd = rstd.view(torch.float32)
        torch.cuda.synchronize()  # the inputs are in place, whichever stream the launcher's kernel runs on
        failed = launch(padded.data_ptr(), rstd.data_ptr(), case["rows"], case["cols"], case["eps"],
                        case["threads"])
        error = failed.decode() if failed else ""
        results.append((rstd.cpu() if not error else None, error))
        if error:
            break  # the CUDA context is gone after a failed kernel
    torch.save({"results": results, "device": torch.cuda.get_device_name()}, answer)


def _warp_suspects(x: torch.Tensor, case: WarpCase) -> dict[str, torch.Tensor]:
    x64 = x.double()
    squares = x64.pow(2)
    packs = squares.view(case.rows, -1, 4).sum(-1)  # [rows, cols / 4]
    lane0 = packs[:, ::32].sum(-1)
    first = packs[:, :32].sum(-1)
    sumsq = squares.sum(-1)
    return {
        "no_reduction": (lane0 / case.cols + case.eps).rsqrt(),
        "one_pack": (first / case.cols + case.eps).rsqrt(),
        "mean_over_packs": (sumsq / (case.cols // 4) + case.eps).rsqrt(),
        "no_eps": (sumsq / case.cols).rsqrt(),
        "std": (sumsq / case.cols + case.eps).sqrt(),
    }


def _warp_problem(rstd_guarded: torch.Tensor, x: torch.Tensor, case: WarpCase) -> str | None:
    rstd, guard = rstd_guarded[: case.rows], rstd_guarded[case.rows:]
    spilled = int((~untouched(guard)).sum())
    if spilled:
        return warp_diagnosis("past_rows", count=spilled)
    unwritten = untouched(rstd)
    if unwritten.all():
        return warp_diagnosis("not_written")
    if unwritten.any():
        return warp_diagnosis("partly_written", row=int(unwritten.nonzero()[0]), count=int(unwritten.sum()),
                              rows=case.rows)
    ref = (x.double().pow(2).mean(-1) + case.eps).rsqrt()
    error = relative_error(rstd, ref)
    if error <= TOL:
        return None
    for key, value in _warp_suspects(x, case).items():
        if not torch.allclose(value, ref) and relative_error(rstd, value) <= TOL:
            return warp_diagnosis(key)
    row = int((rstd.double() - ref).abs().nan_to_num(float("inf")).argmax())
    return warp_diagnosis("wrong", error=error, tol=TOL, row=row)


def check_rstd_warp_per_row(source: str, seed: int | None = None, verbose: bool = True) -> CudaReport:
    """Check the reader's CUDA source of ``rstd_warp_per_row`` (see the notes above ``WARP_DIAGNOSES``).

    The outcome is "passed" only when the kernel ran on a GPU and was right; without a GPU it is
    "compiled, not run" (nvcc found) or "not compiled, not run", each said in words, or "failed"
    with the first mistake found by compiling or reading. Prints the verdict (unless
    ``verbose=False``); never raises because the source is wrong (chapter 13,
    notebooks/13_cuda_cpp.ipynb).

    Args:
        source: the reader's CUDA source, as a string, of ``__global__ void rstd_warp_per_row(x,
            rstd, rows, cols, eps)``, one warp per row.
        seed: seed of the random inputs on a GPU; None draws fresh ones.
        verbose: print the verdict, marked ✓ (passed), ✗ (failed) or ○ (not run).

    Returns:
        a ``CudaReport``: its ``outcome`` (one of ``OUTCOMES``) and the message; true only when
        passed.
    """
    if not isinstance(source, str):
        return _cuda_verdict("failed", f"the check takes the kernel's CUDA source as a string, got "
                                       f"{type(source).__name__}", verbose)
    read = read_warp_source(source)
    if read == warp_diagnosis("stub"):
        return _cuda_verdict("failed", read, verbose)
    if torch.cuda.is_available():
        from kernels.cuda_rmsnorm import cuda_build_unavailable

        reason = cuda_build_unavailable()
        if reason:
            return _cuda_verdict("failed", warp_diagnosis("unavailable_gpu", reason=reason), verbose)
        gen = torch.Generator()
        gen.manual_seed(seed) if seed is not None else gen.seed()
        inputs = [_warp_inputs(case, gen) for case in WARP_CASES]
        answer = run_on_gpu_process(source, inputs)
        if "error" in answer:
            return _cuda_verdict("failed", answer["error"], verbose)
        worst = 0.0
        for (rstd, error), x, case in zip(answer["results"], inputs, WARP_CASES):
            if error:
                return _cuda_verdict("failed",
                                     f"on an {case}, " + warp_diagnosis("crashed", error=error), verbose)
            problem = _warp_problem(rstd, x, case)
            if problem:
                return _cuda_verdict("failed", f"on an {case}, {problem}", verbose)
            worst = max(worst,
                        relative_error(rstd[: case.rows], (x.double().pow(2).mean(-1) + case.eps).rsqrt()))
        # right answers, and a mistake of style the run cannot show (no shuffle, no float4, an
        # atomic)
        if read:
            return _cuda_verdict("failed", "the results are right, but " + read, verbose)
        shapes = ", ".join(f"{c.rows}×{c.cols}" for c in WARP_CASES)
        return _cuda_verdict("passed", warp_diagnosis("passed_gpu", cases=len(WARP_CASES), shapes=shapes,
                                                      device=answer["device"], worst=worst), verbose)
    ptx, problem = compile_to_ptx(source)
    if problem is not None and problem != "no nvcc":
        return _cuda_verdict("failed", problem, verbose)
    if ptx is not None and not re.search(rf"\.entry\s+{WARP_KERNEL}\s*\(", ptx):
        return _cuda_verdict("failed", warp_diagnosis("no_kernel"), verbose)
    if read:
        return _cuda_verdict("failed", read, verbose)
    if ptx is None:
        return _cuda_verdict("not compiled, not run", warp_diagnosis("not_compiled"), verbose)
    return _cuda_verdict("compiled, not run", warp_diagnosis("compiled_not_run", arch=PTX_ARCH), verbose)


if __name__ == "__main__":  # the separate process of run_on_gpu_process
    import sys

    _gpu_job(sys.argv[1])
