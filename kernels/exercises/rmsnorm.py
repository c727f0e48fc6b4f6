"""Checks for the RMSNorm exercises of chapter 02 (forward) and chapter 03 (backward).

Two kinds of check. ``check_rms_norm_forward`` and ``check_rms_norm_backward`` call the reader's
*function* (a wrapper that launches a kernel) on a handful of fresh random inputs, each chosen to
expose particular mistakes (a width that is a power of two, one that is not, a row of tiny values,
bfloat16, a strided view), and compare the result with a float64 reference. ``check_rms_norm_tile``
and ``check_rms_norm_backward_tile`` launch the reader's *kernel* themselves, with tiles of
``TILE_ROWS`` rows, on tensors that sit inside larger buffers: foreign values around every input, a
sentinel around every output. A kernel that reads or writes past the tensor's last row, before its
first, or past its last column therefore touches memory the check owns, and the check can say
exactly where.

Both tile checks end with a launch on rows that lie past element 2**31 of their buffer
(``mapped_buffer``: on the CPU an address range with almost no memory behind it), where row offsets
computed in int32 wrap around.

Every check runs the reader's code with the finished answers of its exercise out of reach
(``kernels.exercises.reach``: the package's RMSNorm and its kernels, the references, PyTorch's own
RMSNorm, and autograd for the backward): a reader's function that calls one of them gets a verdict
that says so, not a ✓.

When the result is wrong, a check recomputes the usual mistakes in float64 and says which one the
output reproduces, on which input and in which row; the wording of every diagnosis is in ``HINTS``.
A check never raises because the reader's code is wrong or unfinished: it prints its verdict and
returns a :class:`Report`.
"""

from __future__ import annotations

import mmap
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton

from kernels import runtime
from kernels.exercises.reach import FinishedCodeCalled, call_learner, out_of_reach
from kernels.reference import relative_error, rms_norm_reference
from kernels.tolerances import ELEMENT_TOL, RELATIVE_ERROR_TOL

from .sentences import sentence_lookup

# A bfloat16 forward output must equal Hugging Face's bit for bit except in at most this fraction of
# values. The right cast order gives (almost) no differences; multiplying by the weight before
# rounding changes about a fifth.
BF16_MAX_DIFFERENT = 0.02

# Rows per program in the tile checks, and rows of guard before and after each tensor: enough for
# the last tile to hang past the end, and for a row index that is off by one, to stay inside memory
# the check owns.
TILE_ROWS = 4
GUARD_ROWS = TILE_ROWS + 1
# what an output's surroundings hold (exact in bfloat16): a kernel that changes it wrote there
SENTINEL = -4096.0

# Every diagnosis, in one place. Fields in braces are filled in for the input at hand.
HINTS = {
    # What the reader's code did rather than what it computed.
    "raised": "your function raised {error}",
    "kernel_raised": "your kernel raised {error}",
    "not_a_tensor": "your function returned {type}, expected a tensor shaped like x",
    "shape": "the output has shape {got}, expected {expected}",
    "dtype": ("the output has dtype {got}, expected {expected}: allocate the output like x and store with "
              "cast_to(value, OUT.dtype.element_ty)"),
    "device": "the output is on {got}, expected {expected} (where x is)",
    # Patterns in the output.
    "placeholder_zeros": ("every value of {name} is 0: is the exercise line still the placeholder? "
                          "(the stub as given computes zeros)"),
    "nothing_written": ("nothing was written to {name}: is the mask (or are the offsets) still a "
                        "placeholder? (the stub as given stores nothing)"),
    "tail_columns": ("columns {first}–{last} of {name} are wrong while columns 0–{right} are "
                     "right: tail columns not written: check your mask (cols < n_cols) on the "
                     "loads and the store, and that BLOCK_N ≥ n_cols."),
    "tail_rows": ("rows {first}–{last} of {name} are wrong while rows 0–{right} are right: some "
                  "rows were never computed: does the grid launch a program for every row (or "
                  "block of rows), does each program start at its own first row (pid * ROWS for a "
                  "tile), and does the row mask keep exactly rows < n_rows?"),
    "first_rows_skipped": ("{rows} of {name} {were} never written while the other rows are right: "
                           "the first program's first row is 0, so this program's rows are pid * "
                           "ROWS + tl.arange(0, ROWS): is the row index shifted (an off-by-one)?"),
    "not_finite": ("{name} holds NaN or infinity. Masked-off lanes must load other=0.0, and eps "
                   "belongs inside the square root."),
    "unrecognised": ("relative error of {name} {error:.2e} (must stay below {tol:g}). None of the "
                     "usual mistakes reproduces this output: print it beside the reference for "
                     "this input to see the pattern."),
    # Where a tile kernel wrote: outside the tensor.
    "rows_past_end": ("{name} was written in {written}, past its last row ({rows} rows): the last program's "
                      "tile hangs past n_rows, and the mask must switch those rows off: "
                      "(rows[:, None] < n_rows) & (cols[None, :] < n_cols)"),
    "row_at_end": ("{name} was written in row {rows}, one past its last: the row mask lets rows == "
                   "n_rows through: rows < n_rows, not <="),
    "rows_before_start": ("{name} was written before its first row: the row index is off by one: "
                          "this program's rows are pid * ROWS + tl.arange(0, ROWS), and the first "
                          "program's first row is 0"),
    "columns_past_end": ("{name} was written in columns {first}–{last}, past its last column "
                         "({cols} columns), in the memory around the tensor: the mask must switch "
                         "off the lanes with cols ≥ n_cols, on the loads and the store (a 2-D "
                         "mask: rows and columns)"),
    "output_stride": ("{name}'s rows were written {used} elements apart ({what}), but they are "
                      "{right} apart: offset {name}'s rows by {arg}"),
    # RMSNorm's forward.
    "divide_by_block": ("did you divide by BLOCK_N ({block_n}) instead of n_cols ({n})? The masked "
                        "lanes load zeros, so the sum of squares is right, but the mean is over "
                        "the row's real width"),
    "short_block": ("only the first {short} columns were used: BLOCK_N must be a power of two at "
                    "least n_cols (triton.next_power_of_2({n}) = {block_n}), with the mask cols < "
                    "n_cols switching off the extra lanes"),
    "masked_other": ("the masked-off lanes of x loaded 1.0, not 0.0: the {pad} lanes between "
                     "n_cols ({n}) and BLOCK_N ({block_n}) each add 1.0² to the sum of squares. "
                     "Load with other=0.0, so that they add nothing"),
    "sum_not_mean": ("you summed the squares but did not divide by n_cols: rstd needs the mean of "
                     "x², not the sum"),
    "no_rsqrt": ("you multiplied by mean(x²) + eps itself: rstd is its reciprocal square root, "
                 "tl.math.rsqrt(mean + eps)"),
    "sqrt_not_rsqrt": ("you multiplied by sqrt(mean(x²) + eps) instead of dividing by it: rstd = 1 "
                       "/ sqrt(mean(x²) + eps), tl.math.rsqrt(...)"),
    "no_weight": "the weight is never applied: y = w ⊙ x̂",
    "no_eps": "eps is missing: add it inside the square root (the eps passed in, here {eps:g})",
    "eps_outside_sqrt": ("eps was added outside the square root: 1 / (sqrt(mean(x²)) + eps) is not "
                         "1 / sqrt(mean(x²) + eps); it belongs inside: tl.math.rsqrt(mean + eps)"),
    "default_eps": "you used eps = 1e-6, not the eps passed in ({eps:g}): take it from the argument",
    "square_of_mean": ("you squared the mean (mean(x)²) instead of taking the mean of the squares "
                       "(mean(x²)): square first, tl.sum(x * x, ...) / n_cols"),
    "no_square": ("the values were not squared: rstd = 1 / sqrt(mean(x²) + eps), and without the "
                  "square a row whose mean is negative gives the root of a negative number (NaN)"),
    "centred": ("you subtracted the row's mean (that is LayerNorm's variance): RMSNorm does not "
                "centre, rstd = 1 / sqrt(mean(x²) + eps) of x itself"),
    "centred_x": ("you centred x (x − mean(x)), as LayerNorm does: RMSNorm does not subtract the "
                  "mean, neither in rstd nor in x̂ = x · rstd"),
    "divide_by_rows": ("the mean divides by the number of rows ({divisor}) instead of n_cols "
                       "({n}): the mean runs along the row, over its columns"),
    "row_stride": ("rows were read n_cols ({cols}) elements apart, but in this view they are "
                   "{stride} apart: offset each row by the tensor's row stride (x.stride(0)), not "
                   "by its width"),
    "inputs_width": ("the rows of {tensors} were read n_cols ({cols}) elements apart, the width, "
                     "but they are {strides} elements apart: offset each tensor's rows by its own "
                     "row stride ({args})"),
    "input_stride": ("rows of {tensor} were read {used} elements apart ({what}), but they are "
                     "{right} apart: offset {tensor}'s rows by {arg}, not by {wrong}"),
    "cast_order": ("output not cast like Hugging Face: you multiplied by the weight before "
                   "casting. Hugging Face rounds x̂ to the input dtype first, then multiplies by "
                   "the weight: y = cast_to(x_hat, X.dtype.element_ty).to(tl.float32) * w"),
    "truncation": ("values are truncated to bfloat16 instead of rounded: Triton's interpreter "
                   "truncates .to(tl.bfloat16), so store through cast_to(value, "
                   "Y.dtype.element_ty) (and round x̂ the same way)"),
    "bf16_bits": ("{share:.0f}% of the values differ from Hugging Face's in the last bits (close, "
                  "but not the same rounding): normalise in float32, round x̂ to bfloat16, then "
                  "multiply by the weight."),
    "no_upcast": ("float32 inputs are right but this bfloat16 one is not: the loaded values were "
                  "not converted to float32 before the arithmetic. Load, then .to(tl.float32): the "
                  "squares and their sum must be float32 (a bfloat16 sum stops growing once it is "
                  "large, and Triton's interpreter computes bfloat16 arithmetic wrongly)"),
    "int32_rows": ("{rows} of {name} {were} never written while the rows before are right: row "
                   "{first} starts at element {start:,}, past 2**31 − 1, and its offset wrapped "
                   "around: the row indices are int32. Make them int64 before multiplying by the "
                   "stride: (pid * ROWS + tl.arange(0, ROWS)).to(tl.int64)"),
    "tile_shapes_forward": ("Triton could not combine two blocks of different shapes ({error}). In "
                            "this kernel that comes from one of three things: a reduction along "
                            "the wrong axis (rstd is one value per row: tl.sum(..., axis=1), shape "
                            "[ROWS]); a row index without [:, None] (the offsets are rows[:, None] "
                            "* stride + cols[None, :]); or a mask built from 1-D pieces that do "
                            "not broadcast: (rows[:, None] < n_rows) & (cols[None, :] < n_cols)"),
    # RMSNorm's backward: dx.
    "no_rstd": "the leading rstd factor is missing: dx = rstd · (g − x̂ · mean(g ⊙ x̂))",
    "dx_sum_not_mean": ("you summed g ⊙ x̂ over the row instead of taking its mean: divide the sum "
                        "by n_cols ({n})"),
    "dx_sign": "the sign of the correction is wrong: dx = rstd · (g − x̂ · mean(g ⊙ x̂)), a minus",
    "dx_axis_0": ("the mean ran down the tile's columns (axis=0: one value per column, over the "
                  "tile's rows): dx's mean is one value per row, tl.sum(g * x_hat, axis=1) / "
                  "n_cols, used as [:, None]"),
    "no_correction": ("the correction term − x̂ · mean(g ⊙ x̂) is missing: it carries how each "
                      "output depends on every input through rstd"),
    "dx_no_weight": "the weight is missing: g = dy ⊙ w is the gradient that reaches x̂, in both places",
    "dy_in_mean": "inside the mean use g = dy ⊙ w, not dy: mean(g ⊙ x̂)",
    "mean_of_g": "wrong mean: it is mean(g ⊙ x̂), not mean(g)",
    "x_for_x_hat": ("you used x where x̂ belongs, once: the correction is x̂ · mean(g ⊙ x̂) with "
                    "x̂ = x · rstd (x in the product, x inside the mean, or rstd · g − x̂ · mean(g "
                    "⊙ x̂) all give these numbers: rstd multiplies the whole bracket, the "
                    "correction too)"),
    "x_for_x_hat_twice": "you used x where x̂ belongs (in the product and in the mean): x̂ = x · rstd",
    "dx_divide_by_block": ("wrong mean: did you divide by BLOCK_N ({block_n}) instead of n_cols "
                           "({n})? The masked lanes add zeros to the sum; the mean is over the "
                           "row's real width"),
    "tile_shapes_backward": ("Triton could not combine two blocks of different shapes ({error}). "
                             "In this kernel that comes from one of three things: a sum along the "
                             "wrong axis (dx's mean is one value per row, tl.sum(..., axis=1), "
                             "used as [:, None]; dW's contribution is one value per column, "
                             "tl.sum(..., axis=0), the sum over the tile's rows); a row index "
                             "without [:, None]; or a mask built from 1-D pieces that do not "
                             "broadcast: row_ok[:, None] & col_ok[None, :]"),
    # RMSNorm's backward: dW, from a tile kernel's per-program partial sums.
    "dw_zero": ("every value of dW is 0: nothing is ever added to dw_acc: is the dW line still the "
                "placeholder?"),
    "dw_sign": "dW has the wrong sign: dW = + Σ over rows of dy ⊙ x̂",
    "dw_used_g": ("dW used g = dy ⊙ w where dy belongs: dW = Σ over rows of dy ⊙ x̂ (the weight "
                  "does not multiply its own gradient)"),
    "dw_used_x": "dW used x where x̂ belongs: dW = Σ over rows of dy ⊙ x̂, with x̂ = x · rstd",
    "dw_not_summed": ("dw_acc is one value per column ([BLOCK_N]), but a [ROWS, BLOCK_N] block was "
                      "added to it ({error}): sum the tile's dy ⊙ x̂ over its rows first, "
                      "tl.sum(..., axis=0)"),
    "dw_rstd_twice": ("dW multiplied by rstd once more: x_hat already holds x · rstd, so dW = Σ "
                      "over rows of dy ⊙ x̂"),
    "dw_mean": "dW is a mean over the rows, but it is a sum: dW = Σ over rows of dy ⊙ x̂, with no division",
    "dw_last_tile": ("dW holds only the last tile of each program: add each tile's contribution to "
                     "the accumulator (dw_acc += ...), do not assign it (dw_acc = ...)"),
    "dw_unrounded": ("dW used x̂ before rounding: the forward multiplied the weight by x̂ rounded "
                     "to x's dtype, so dW = Σ dy ⊙ x_hat_rounded"),
    "dw_not_float32": ("dW is right for float32 inputs but not for this bfloat16 one (relative "
                       "error {error:.1e}, where float32 sums stay under {tight:g}): dW was not "
                       "accumulated in float32. Keep dw_acc a float32 block, tl.zeros((BLOCK_N,), "
                       "dtype=tl.float32), add float32 sums into it, and round to the weight's "
                       "dtype only once, after the partials are summed"),
    "dw_loop_dtype": ("dw_acc changed its dtype inside the loop ({error}): a loop's accumulator "
                      "keeps one dtype, and for dW that is float32: tl.zeros((BLOCK_N,), "
                      "dtype=tl.float32), with float32 sums added to it"),
    "dw_partials_missing": ("some of dW's partial sums were never written (they are still NaN): "
                            "every program stores its sums once, after its loop: DW_PARTIALS + pid "
                            "* n_cols + cols"),
    "dw_partials_outside": ("DW_PARTIALS was written outside this program's row: program pid "
                            "stores its BLOCK_N sums at DW_PARTIALS + pid * n_cols + cols, with "
                            "the mask cols < n_cols"),
}


hint = sentence_lookup(HINTS)


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
    # backward: when set, dy is a view whose rows are this far apart (not x's stride)
    dy_stride: int | None = None
    tiny_row: int | None = None  # when set, that row of x is scaled so that mean(x²) is below eps

    def __str__(self) -> str:
        text = f"{str(self.dtype).removeprefix('torch.')} input of {self.rows} × {self.cols}"
        if self.row_stride and self.dy_stride:
            text += f" (views: x's rows are {self.row_stride} elements apart, dy's {self.dy_stride})"
        elif self.row_stride:
            text += f" (a view whose rows are {self.row_stride} elements apart)"
        if self.tiny_row is not None:
            text += f" (row {self.tiny_row} holds tiny values; eps={self.eps:g})"
        return text

    @property
    def strides(self) -> tuple[int, int]:
        """The row strides of x and dy."""
        x_stride = self.row_stride or self.cols
        return x_stride, self.dy_stride or x_stride


@dataclass(frozen=True)
class TileCase:
    """One launch of the reader's tile kernel: the shape, and the row stride of each 2-D tensor it
    receives, in the order of the kernel's pointer arguments (forward: x, y; backward: x, dy, dx).
    Every stride exceeds BLOCK_N, so a lane past the last column lands in the memory around the
    tensor, never in the next row."""

    dtype: torch.dtype
    rows: int
    cols: int
    strides: tuple[int, ...]
    eps: float = 1e-6
    tiny_row: int | None = None
    programs: int | None = None  # backward: the size of the persistent grid

    @property
    def row_stride(self) -> int:
        """x's row stride, the first of ``strides``."""
        return self.strides[0]

    @property
    def padding_rows(self) -> int:
        """Rows of the last tile that lie past the end of the tensor."""
        return -self.rows % TILE_ROWS

    def __str__(self) -> str:
        text = f"{str(self.dtype).removeprefix('torch.')} input of {self.rows} × {self.cols}"
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
    # x and dy strided, each its own way: dy read at x's stride (or x at dy's, or either at the width) shows.
    Case(torch.float32, 4, 80, row_stride=128, dy_stride=160),
)
# The tile kernels: float32 first, so that a mistake that only bfloat16 shows (a missing upcast, a
# bfloat16 accumulator) is named as such. Row counts leave the last tile short (by 2, 3, 1 and 3
# rows) and strides differ between tensors, so that using one tensor's stride for another shows.
TILE_CASES = (
    # BLOCK_N == n_cols; two rows of the last tile are padding
    TileCase(torch.float32, 6, 64, strides=(80, 72)),
    # BLOCK_N = 128 > n_cols: the column mask and the divisor
    TileCase(torch.float32, 9, 100, strides=(136, 144)),
    # eps inside the square root or not
    TileCase(torch.float32, 7, 37, strides=(72, 64), eps=1e-5, tiny_row=1),
    TileCase(torch.bfloat16, 5, 300, strides=(520, 512)),  # the float32 upcast
)
BACKWARD_TILE_CASES = (
    TileCase(torch.float32, 13, 64, strides=(80, 72, 88), programs=2),
    TileCase(torch.float32, 10, 100, strides=(136, 144, 160), programs=2),
    # Many tiles per program: a bfloat16 accumulator for dW rounds after every tile and drifts far
    # from float32.
    TileCase(torch.bfloat16, 203, 48, strides=(64, 72, 80), programs=2),
)
# The tile checks' last launch: HIGH_ROWS rows HIGH_STRIDE elements apart, so that row 2 starts at
# element 2**31 + 128, past int32; the tensors start HIGH_HEADROOM elements into their buffer, so
# that an offset that wraps around to -2**31 + 128 still lands inside it (where it is harmless and
# seen). The tensors share the buffer: x in the first HIGH_COLS columns of each row, then y
# (forward: HIGH_COLS columns further on), or dy and dx (backward, one after the other). 2**32
# bfloat16 elements: 8 GiB of addresses.
HIGH_STRIDE = 2**30 + 64
HIGH_HEADROOM = 2**31
HIGH_ROWS, HIGH_COLS = 3, 64
# dW from float32 partial sums of exact products stays this close to its float64 value; a bfloat16
# accumulator over the 26 tiles of a program in BACKWARD_TILE_CASES is off by about a percent.
DW_TIGHT = 1e-4


# --------------------------------------------------------------------------------------------------
# The checks of a function
# --------------------------------------------------------------------------------------------------


def check_rms_norm_forward(fn: Callable, seed: int | None = None, verbose: bool = True) -> Report:
    """Check ``fn(x, weight, eps) -> y``, an RMSNorm forward over the last dimension of a 2-D ``x``.

    ``y`` must have ``x``'s shape and dtype and match Hugging Face's ``LlamaRMSNorm``: within
    float32 precision of the float64 result, and for bfloat16 the same bits (normalise in float32,
    round to bfloat16, then multiply by the weight). Chapter:
    ``notebooks/02_rmsnorm_forward.ipynb``.

    Args:
        fn: the reader's ``fn(x, weight, eps) -> y``, called on float32 and bfloat16 inputs of
            several widths, a row of tiny values and a strided view.
        seed: seed of the random inputs; None draws fresh ones on every call.
        verbose: print the verdict (False: only return it).

    Returns:
        The ``Report``: ``passed``, and a message that names the first mistake, on which input and
        in which row, or, on a pass, the largest relative errors. It never raises because ``fn`` is
        wrong or unfinished.
    """
    gen = generator(seed)
    worst = {}
    same_bits = []
    for case in FORWARD_CASES:
        x, w = _matrix(case, gen, tiny=True), _weight(case, gen)
        ref = _forward64(x, w, case.eps)
        out, problem = _call(fn, (x, w, case.eps), case, expect_like=x, exercise="rms_norm_forward_rows")
        if problem is None:
            problem = _compare(out, ref, case, "y", _forward_suspects(x, w, case))
        if problem is None and case.dtype == torch.bfloat16:
            problem, fraction = _bf16_cast_order(out, x, w, case)
            same_bits.append(1 - fraction)
        if problem is not None:
            return verdict(False, problem, verbose)
        worst[case.dtype] = max(worst.get(case.dtype, 0.0), relative_error(out, ref))
    summary = (
        f"forward correct on {len(FORWARD_CASES)} inputs (widths {_widths(FORWARD_CASES)}, float32 "
        "and bfloat16, tiny values, a strided view). Largest relative errors: "
        f"{_format_errors(worst)}; bfloat16 outputs identical to Hugging Face's in "
        f"{100 * min(same_bits):.2f}% of values."
    )
    return verdict(True, summary, verbose)


def check_rms_norm_backward(fn: Callable, seed: int | None = None, verbose: bool = True) -> Report:
    """Check ``fn(dy, x, weight, rstd) -> dx``, the input gradient of RMSNorm for a 2-D ``x``.

    ``rstd`` is the float32 ``1 / sqrt(mean(x²) + eps)`` per row that the forward pass saved; ``dx``
    must have ``x``'s shape and dtype. Chapter: ``notebooks/03_rmsnorm_backward.ipynb``.

    Args:
        fn: the reader's ``fn(dy, x, weight, rstd) -> dx``, called on float32 and bfloat16 inputs
            of several widths, and on views of wider buffers (x's and dy's row strides differ).
        seed: seed of the random inputs; None draws fresh ones on every call.
        verbose: print the verdict (False: only return it).

    Returns:
        The ``Report``: ``passed``, and a message that names the first mistake, on which input and
        in which row, or, on a pass, the largest relative errors. It never raises because ``fn`` is
        wrong or unfinished.
    """
    gen = generator(seed)
    worst = {}
    for case in BACKWARD_CASES:
        x, w = _matrix(case, gen, spare_rows=1), _weight(case, gen)
        dy = _matrix(case, gen, stride=case.dy_stride, spare_rows=1)
        rstd = torch.rsqrt(x.float().pow(2).mean(-1) + case.eps)
        ref, suspects = _backward_suspects(x, w, dy, rstd, case)
        out, problem = _call(fn, (dy, x, w, rstd), case, expect_like=x, exercise="rms_norm_dx")
        if problem is None:
            problem = _compare(out, ref, case, "dx", suspects)
        if problem is not None:
            return verdict(False, problem, verbose)
        worst[case.dtype] = max(worst.get(case.dtype, 0.0), relative_error(out, ref))
    summary = (
        f"backward (dx) correct on {len(BACKWARD_CASES)} inputs (widths {_widths(BACKWARD_CASES)}, "
        f"float32 and bfloat16, a strided view). Largest relative errors: {_format_errors(worst)}."
    )
    return verdict(True, summary, verbose)


# --------------------------------------------------------------------------------------------------
# The checks of a tile kernel, launched by the check on guarded buffers
# --------------------------------------------------------------------------------------------------


def check_rms_norm_tile(kernel, seed: int | None = None, verbose: bool = True) -> Report:
    """Check a Triton kernel that normalises a tile of ``ROWS`` rows × ``BLOCK_N`` columns per program.

    The check launches it itself, ``cdiv(n_rows, ROWS)`` programs, as ``kernel[grid](X, W, Y,
    n_rows, n_cols, stride_x, stride_y, eps, ROWS=TILE_ROWS, BLOCK_N=next_power_of_2(n_cols))`` on
    tensors inside larger buffers, so it sees every element the kernel writes, inside the tensor or
    not. ``Y`` must match Hugging Face's ``LlamaRMSNorm`` as in ``check_rms_norm_forward``. Ends
    with a launch on rows past element 2**31 of their buffer (int64 row offsets), where this machine
    can map one. Chapter: ``notebooks/02_rmsnorm_forward.ipynb``.

    Args:
        kernel: the reader's ``@triton.jit`` kernel, with the parameters above.
        seed: seed of the random inputs; None draws fresh ones on every call.
        verbose: print the verdict (False: only return it).

    Returns:
        The ``Report``: ``passed``, and a message that names the first mistake (a wrong value, a
        write outside the tensor, an offset that wraps), on which input and where, or, on a pass,
        the largest relative errors. It never raises because ``kernel`` is wrong or unfinished.
    """
    gen = generator(seed)
    worst, same_bits = {}, []
    for case in TILE_CASES:
        x_buf, x = _guarded_input(_matrix64(case, gen, tiny=True), case.strides[0], case.dtype, gen)
        w = _weight(case, gen)
        y_buf, y, y_before = _guarded_output(case.rows, case.cols, case.strides[1], case.dtype)
        ref = _forward64(x, w, case.eps)
        problem = _launch(kernel, "rms_norm_tile_kernel", "forward",
                          (triton.cdiv(case.rows, TILE_ROWS),), case,
                          x, w, y, case.rows, case.cols, x.stride(0), y.stride(0), case.eps)
        suspects = _forward_suspects(x, w, case, strides=False) + _tile_forward_suspects(x, w, case)
        if problem is None:
            problem = _written_outside(y_buf, y_before, y, ref, case, "y", {
                case.cols: "n_cols, the width", case.strides[0]: "stride_x, x's row stride"},
                                       "stride_y", suspects)
        if problem is None:
            problem = _compare(y, ref, case, "y", suspects)
        fraction = None
        if problem is None and case.dtype == torch.bfloat16:
            problem, fraction = _bf16_cast_order(y, x, w, case)
            same_bits.append(1 - fraction)
        if problem is not None and case.dtype == torch.bfloat16 and worst and not _named(problem):
            # float32 passed and bfloat16 did not, in a way no other diagnosis names: the upcast is missing
            bad = bad_elements(y, ref, case.dtype)
            detail = (_first_difference(_f64(y), ref, bad, "y") if fraction is None
                      else (f"{100 * fraction:.0f}% of the values differ from Hugging Face's in "
                            "the last bits"))
            problem = f"on a {case}, {detail}: {hint('no_upcast')}."
        if problem is not None:
            return verdict(False, problem, verbose)
        worst[case.dtype] = max(worst.get(case.dtype, 0.0), relative_error(y, ref))
    problem, ran = _high_rows_tile(kernel, gen)
    if problem is not None:
        return verdict(False, problem, verbose)
    offsets = _offsets_checked(ran)
    summary = (
        f"tile kernel correct on {len(TILE_CASES)} inputs (widths {_widths(TILE_CASES)}, float32 "
        "and bfloat16, tiny values, strided rows, a last tile that hangs past the last row), and "
        f"nothing written outside the tensor; {offsets}. Largest relative errors: "
        f"{_format_errors(worst)}; bfloat16 outputs identical to Hugging Face's in "
        f"{100 * min(same_bits):.2f}% of values."
    )
    return verdict(True, summary, verbose)


def _high_rows_tile(kernel, gen: torch.Generator) -> tuple[str | None, bool]:
    """Launch the tile kernel on bfloat16 rows past element 2**31 of their buffer; (what is wrong or
    None, whether the launch could run at all)."""
    device = runtime.device()
    elements = HIGH_HEADROOM + (HIGH_ROWS - 1) * HIGH_STRIDE + 3 * HIGH_COLS
    buffer = mapped_buffer(elements, torch.bfloat16, device)
    if buffer is None:
        return None, False
    case = TileCase(torch.bfloat16, HIGH_ROWS, HIGH_COLS, strides=(HIGH_STRIDE, HIGH_STRIDE))
    x = buffer.as_strided((HIGH_ROWS, HIGH_COLS), (HIGH_STRIDE, 1), storage_offset=HIGH_HEADROOM)
    y = buffer.as_strided((HIGH_ROWS, HIGH_COLS), (HIGH_STRIDE, 1),
                          storage_offset=HIGH_HEADROOM + 2 * HIGH_COLS)
    x.copy_(_matrix64(case, gen).to(torch.bfloat16))
    y.fill_(float("nan"))
    w = _weight(case, gen)
    problem = _launch(kernel, "rms_norm_tile_kernel", "forward", (triton.cdiv(HIGH_ROWS, TILE_ROWS),), case,
                      x, w, y, HIGH_ROWS, HIGH_COLS, HIGH_STRIDE, HIGH_STRIDE, case.eps)
    x_now, y_now = x.cpu(), y.cpu()
    del x, y, buffer  # 8 GiB of addresses: give them back
    if problem is not None:
        return problem, True
    return _high_rows_problem(y_now, _forward64(x_now, w, case.eps), case, "y"), True


def _high_rows_backward_tile(kernel, gen: torch.Generator) -> tuple[str | None, bool]:
    """Launch the backward tile kernel, one program, on bfloat16 rows past element 2**31 of their
    buffer (x, dy and dx side by side in each row); (what is wrong or None, whether the launch could
    run at all)."""
    device = runtime.device()
    elements = HIGH_HEADROOM + (HIGH_ROWS - 1) * HIGH_STRIDE + 3 * HIGH_COLS
    buffer = mapped_buffer(elements, torch.bfloat16, device)
    if buffer is None:
        return None, False
    case = TileCase(torch.bfloat16, HIGH_ROWS, HIGH_COLS, strides=(HIGH_STRIDE,) * 3, programs=1)
    x, dy, dx = (buffer.as_strided((HIGH_ROWS, HIGH_COLS), (HIGH_STRIDE, 1),
                                   storage_offset=HIGH_HEADROOM + k * HIGH_COLS) for k in range(3))
    x.copy_(_matrix64(case, gen).to(torch.bfloat16))
    dy.copy_(_matrix64(case, gen).to(torch.bfloat16))
    dx.fill_(float("nan"))
    w = _weight(case, gen)
    rstd = torch.rsqrt(x.float().pow(2).mean(-1) + case.eps)
    partials = torch.full((1, HIGH_COLS), float("nan"), dtype=torch.float32, device=device)
    problem = _launch(kernel, "rms_norm_bwd_tile_kernel", "backward", (1,), case, x, w, dy, rstd,
                      dx, partials, HIGH_ROWS, HIGH_COLS, HIGH_STRIDE, HIGH_STRIDE, HIGH_STRIDE)
    x_now, dy_now, dx_now = x.cpu(), dy.cpu(), dx.cpu()
    del x, dy, dx, buffer  # 8 GiB of addresses: give them back
    if problem is not None:
        return problem, True
    problem = _high_rows_problem(dx_now, _backward_suspects(x_now, w, dy_now, rstd, case)[0], case, "dx")
    if problem is None:
        problem = _check_dw(partials, x_now, w, dy_now, rstd, case, fp32_passed=True)[0]
    return problem, True


def _high_rows_problem(out: torch.Tensor, ref: torch.Tensor, case: TileCase, name: str) -> str | None:
    """None when ``out``, the rows past element 2**31, matches ``ref``; otherwise what is wrong:
    int32 row offsets when exactly the rows that start past 2**31 − 1 are wrong."""
    bad = bad_elements(out, ref, case.dtype)
    bad_rows = bad.any(1).tolist()
    if not any(bad_rows):
        return None
    first = bad_rows.index(True)
    where = f"on a {case} (rows {HIGH_STRIDE:,} elements apart), "
    if first > 0 and all(bad_rows[first:]) and first * HIGH_STRIDE >= 2**31:
        rows = _span("row", first, case.rows - 1)
        return where + hint("int32_rows", rows=rows, name=name,
                            were="was" if first == case.rows - 1 else "were",
                            first=first, start=first * HIGH_STRIDE) + "."
    error = relative_error(out, ref)
    return (where + _first_difference(_f64(out), ref, bad, name) + "; "
            + hint("unrecognised", name=name, error=error, tol=RELATIVE_ERROR_TOL[case.dtype]))


def mapped_buffer(elements: int, dtype: torch.dtype, device) -> torch.Tensor | None:
    """A 1-D buffer for checks that need offsets past 2**31 but touch only a few of its elements.

    On a GPU it is real memory (None unless that and 2**30 bytes more are free). On the CPU, where
    Triton's interpreter runs kernels, it is an anonymous private mapping, reserved without memory
    behind it where the system allows: a page becomes memory once something writes to it, and
    reads as zeros until then.

    Args:
        elements: its length, in elements.
        dtype: its dtype.
        device: where it lives (a ``torch.device`` or its name).

    Returns:
        The buffer, or None where it cannot be had (too little free GPU memory, no such mapping on
        this system, a device other than CUDA or the CPU).
    """
    device = torch.device(device)
    nbytes = elements * torch.empty((), dtype=dtype).element_size()
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return torch.empty(elements, dtype=dtype, device=device) if free > nbytes + 2**30 else None
    if device.type != "cpu":
        return None
    try:  # POSIX flags (Windows has none of them, and no such mapping: None there)
        flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", getattr(mmap, "MAP_ANON", 0))
        flags |= getattr(mmap, "MAP_NORESERVE", 0)  # Linux: the range is not counted against memory up front
        mapping = mmap.mmap(-1, nbytes, flags=flags)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(mapping, dtype=dtype)  # keeps the mapping alive while the tensor lives
    except (AttributeError, TypeError, OSError, ValueError, OverflowError, RuntimeError):
        return None


def check_rms_norm_backward_tile(kernel, seed: int | None = None, verbose: bool = True) -> Report:
    """Check a Triton kernel for RMSNorm's backward in a persistent grid of tiles: dx, and dW as
    partial sums.

    The check launches it itself on ``case.programs`` programs, as ``kernel[(P,)](X, W, DY, RSTD,
    DX, DW_PARTIALS, n_rows, n_cols, stride_x, stride_dy, stride_dx, ROWS=TILE_ROWS,
    BLOCK_N=next_power_of_2(n_cols))``; program ``pid`` handles the tiles ``pid, pid + P, ...`` and
    writes its float32 sums of ``dy ⊙ x̂`` (x̂ rounded to x's dtype, as the forward used it) as row
    ``pid`` of the ``[P, n_cols]`` float32 ``DW_PARTIALS``; the check adds the rows up. Inputs and
    outputs sit inside larger buffers, so the check sees every element the kernel writes. Ends with
    a launch on rows past element 2**31 of their buffer, where this machine can map one. Chapter:
    ``notebooks/03_rmsnorm_backward.ipynb``.

    Args:
        kernel: the reader's ``@triton.jit`` kernel, with the parameters above.
        seed: seed of the random inputs; None draws fresh ones on every call.
        verbose: print the verdict (False: only return it).

    Returns:
        The ``Report``: ``passed``, and a message that names the first mistake (in dx, in dW's
        partial sums, a write outside the tensors, an offset that wraps), on which input and where,
        or, on a pass, the largest relative errors of dx and dW. It never raises because ``kernel``
        is wrong or unfinished.
    """
    gen = generator(seed)
    worst = {"dx": {}, "dW": 0.0}
    for case in BACKWARD_TILE_CASES:
        x_buf, x = _guarded_input(_matrix64(case, gen), case.strides[0], case.dtype, gen)
        dy_buf, dy = _guarded_input(_matrix64(case, gen), case.strides[1], case.dtype, gen)
        w = _weight(case, gen)
        rstd_buf, rstd = _guarded_rstd(x, case, gen)
        dx_buf, dx, dx_before = _guarded_output(case.rows, case.cols, case.strides[2], case.dtype)
        p_buf, partials, p_before = _guarded_output(case.programs, case.cols, case.cols, torch.float32)
        ref, suspects = _backward_suspects(x, w, dy, rstd, case)
        suspects += _input_stride_suspects(
            case, {"x": x, "dy": dy}, lambda t, w=w, r=rstd,
                                           c=case: _backward_suspects(t["x"], w, t["dy"], r, c)[0])
        suspects.append((hint("dx_axis_0"), _dx_tile_axis_0(x, w, dy, rstd)))
        problem = _launch(kernel, "rms_norm_bwd_tile_kernel", "backward", (case.programs,), case,
                          x, w, dy, rstd, dx, partials, case.rows, case.cols, x.stride(0),
                          dy.stride(0), dx.stride(0))
        if problem is None:
            problem = _written_outside(dx_buf, dx_before, dx, ref, case, "dx", {
                case.cols: "n_cols, the width", case.strides[0]: "stride_x, x's row stride",
                case.strides[1]: "stride_dy, dy's row stride"}, "stride_dx", suspects)
        if problem is None:
            problem = _compare(dx, ref, case, "dx", suspects)
        if problem is None:
            outside = _changed(p_buf, p_before)
            outside[GUARD_ROWS:GUARD_ROWS + case.programs] = False
            if outside.any():
                problem = f"on a {case}, {hint('dw_partials_outside')}."
        if problem is None:
            problem, dw_error = _check_dw(partials, x, w, dy, rstd, case, fp32_passed=bool(worst["dx"]))
        if problem is not None:
            return verdict(False, problem, verbose)
        worst["dx"][case.dtype] = max(worst["dx"].get(case.dtype, 0.0), relative_error(dx, ref))
        worst["dW"] = max(worst["dW"], dw_error)
    problem, ran = _high_rows_backward_tile(kernel, gen)
    if problem is not None:
        return verdict(False, problem, verbose)
    offsets = _offsets_checked(ran)
    summary = (
        f"backward tile kernel correct on {len(BACKWARD_TILE_CASES)} inputs (widths "
        f"{_widths(BACKWARD_TILE_CASES)}, float32 and bfloat16, strided rows, last tiles that hang "
        "past the last row, programs that loop over several tiles), and nothing written outside "
        f"the tensors; {offsets}. Largest relative errors: dx {_format_errors(worst['dx'])}; dW "
        f"(from your float32 partial sums) {worst['dW']:.1e}."
    )
    return verdict(True, summary, verbose)


# --------------------------------------------------------------------------------------------------
# Inputs and calls
# --------------------------------------------------------------------------------------------------


def generator(seed: int | None) -> torch.Generator:
    """The CPU generator a check draws its inputs from.

    Args:
        seed: the seed; None seeds it afresh on every call.

    Returns:
        A ``torch.Generator`` on the CPU.
    """
    gen = torch.Generator()
    if seed is None:
        gen.seed()  # fresh inputs on every call: a function must be right for any input, not for one
    else:
        gen.manual_seed(seed)
    return gen


def _matrix64(case, gen: torch.Generator, tiny: bool = False) -> torch.Tensor:
    data = torch.randn(case.rows, case.cols, generator=gen, dtype=torch.float64)
    if tiny and case.tiny_row is not None:
        data[case.tiny_row] *= 1e-3  # mean(x²) ≈ 1e-6, well below eps = 1e-5: the result depends on eps
    return data


def _matrix(case: Case, gen: torch.Generator, tiny: bool = False, stride: int | None = None,
            spare_rows: int = 0) -> torch.Tensor:
    """A [rows, cols] input: a view of a buffer whose rows are ``stride`` (default: the case's row
    stride) apart, with ``spare_rows`` more rows after it, so that rows read at another tensor's
    larger stride stay inside."""
    stride = stride or case.row_stride or case.cols
    buffer = torch.randn(case.rows + (spare_rows if stride != case.cols else 0), stride, generator=gen,
                         dtype=torch.float64)
    if tiny and case.tiny_row is not None:
        buffer[case.tiny_row] *= 1e-3  # mean(x²) ≈ 1e-6, well below eps = 1e-5: the result depends on eps
    return buffer.to(case.dtype).to(runtime.device())[: case.rows, : case.cols]


def _weight(case, gen: torch.Generator) -> torch.Tensor:
    # Spread around 1 and never all ones: an all-ones weight hides a missing or misplaced multiplication.
    return (0.5 + torch.rand(case.cols, generator=gen,
                             dtype=torch.float64)).to(case.dtype).to(runtime.device())


def _guarded_input(data: torch.Tensor, stride: int, dtype: torch.dtype, gen: torch.Generator):
    """``data`` as a view into a buffer of rows ``stride`` elements apart, surrounded by
    ``GUARD_ROWS`` rows before and after and by padding columns, all holding foreign values (around
    8, never the tensor's): a kernel that reads them computes something visibly different. Returns
    (buffer, view)."""
    rows, cols = data.shape
    buffer = 8 + 4 * torch.randn(rows + 2 * GUARD_ROWS, stride, generator=gen, dtype=torch.float64)
    buffer[GUARD_ROWS:GUARD_ROWS + rows, :cols] = data
    buffer = buffer.to(dtype).to(runtime.device())
    return buffer, buffer[GUARD_ROWS:GUARD_ROWS + rows, :cols]


def _guarded_output(rows: int, cols: int, stride: int, dtype: torch.dtype):
    """An output view of ``rows × cols`` inside a buffer like ``_guarded_input``'s: the view holds
    NaN (an element the kernel never writes stays NaN), the rest ``SENTINEL``. Returns (buffer,
    view, a copy of the buffer)."""
    buffer = torch.full((rows + 2 * GUARD_ROWS, stride), SENTINEL, dtype=dtype, device=runtime.device())
    view = buffer[GUARD_ROWS:GUARD_ROWS + rows, :cols]
    view.fill_(float("nan"))
    return buffer, view, buffer.clone()


def _guarded_rstd(x: torch.Tensor, case: TileCase, gen: torch.Generator):
    """The float32 rstd of each row of ``x``, inside a buffer whose elements past the end hold
    foreign values."""
    buffer = 0.5 + torch.rand(case.rows + 2 * GUARD_ROWS, generator=gen, dtype=torch.float64)
    buffer = buffer.float().to(runtime.device())
    view = buffer[GUARD_ROWS:GUARD_ROWS + case.rows]
    view.copy_(torch.rsqrt(x.float().pow(2).mean(-1) + case.eps))
    return buffer, view


def _changed(buffer: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """Where ``buffer`` differs from ``before`` bit for bit (NaN included): [rows, stride] booleans."""
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[buffer.element_size()]
    return (buffer.view(bits) != before.view(bits)).cpu()


def _call(fn, args, case: Case, expect_like: torch.Tensor, exercise: str):
    """Run the reader's function with ``exercise``'s finished answers out of reach; return
    ``(output, None)`` or ``(None, what is wrong with the call or its result)``."""
    where = f"on a {case}, "
    try:
        out = call_learner(exercise, fn, *args)
    except FinishedCodeCalled as called:
        return None, str(called)
    except Exception as error:  # noqa: BLE001  (any failure of the reader's code is reported, not raised)
        return None, where + hint("raised", error=f"{type(error).__name__}: {last_line(error)}")
    if not isinstance(out, torch.Tensor):
        return None, where + hint("not_a_tensor", type=type(out).__name__)
    if out.shape != expect_like.shape:
        return None, where + hint("shape", got=tuple(out.shape), expected=tuple(expect_like.shape))
    if out.dtype != expect_like.dtype:
        return None, where + hint("dtype", got=out.dtype, expected=expect_like.dtype)
    if out.device != expect_like.device:
        return None, where + hint("device", got=out.device, expected=expect_like.device)
    return out.detach(), None


def _launch(kernel, exercise: str, which: str, grid, case: TileCase, *args) -> str | None:
    """Launch the reader's tile kernel with ``exercise``'s finished answers out of reach; None, or
    what went wrong (a finished answer called, or the usual cause of a shape clash)."""
    tripwire = None
    try:
        # The kernel's Python function holds the names the reader's code can reach (``.fn`` of a
        # Triton kernel).
        with out_of_reach(exercise, getattr(kernel, "fn", kernel)) as tripwire:
            kernel[grid](*args, ROWS=TILE_ROWS, BLOCK_N=triton.next_power_of_2(case.cols))
    except Exception as error:  # noqa: BLE001  (any failure of the reader's kernel is reported, not raised)
        if tripwire is not None and tripwire.called:  # a finished answer, however the error came out
            return tripwire.message
        text = str(error)
        detail = last_line(error)
        if "incompatible dimensions" in text or "Cannot broadcast" in text:
            clash = next((line.strip() for line in text.splitlines() if "incompatible dimensions" in line),
                         detail)
            return f"on a {case}, " + hint(f"tile_shapes_{which}", error=_shorten(clash))
        if which == "backward" and "Expected pointer argument to have shape" in text:
            return f"on a {case}, " + hint("dw_not_summed", error=_shorten(detail))
        if "oop-carried variable" in text or "loop-carried" in text.lower():
            # The compiler (on a GPU) names the accumulator's type before and after: a new shape
            # with the same dtype is a block added to a per-column sum without summing it over the
            # rows first.
            types = re.search(r"initial type <\[(.*?)\], (\w+)> but is re-assigned to <\[(.*?)\], "
                              r"(\w+)>", text)
            if (which == "backward" and types and types.group(1) != types.group(3)
                    and types.group(2) == types.group(4)):
                return f"on a {case}, " + hint("dw_not_summed", error=_shorten(detail))
            return f"on a {case}, " + hint("dw_loop_dtype", error=_shorten(detail))
        return f"on a {case}, " + hint("kernel_raised", error=f"{type(error).__name__}: {detail}")
    return tripwire.message  # None unless the reader's code caught the tripwire's error and went on


def _shorten(text: str, width: int = 160) -> str:
    text = text.strip().strip("'\"")
    return text if len(text) <= width else text[: width - 3] + "..."


def last_line(error: Exception) -> str:
    """The last non-empty line of ``error``'s message: what a check tells of an exception raised.

    Args:
        error: the exception the reader's code raised.

    Returns:
        That line, cut to 300 characters (``repr(error)`` when the message is empty).
    """
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    text = lines[-1] if lines else repr(error)
    return text if len(text) <= 300 else text[:297] + "..."


def verdict(passed: bool, message: str, verbose: bool) -> Report:
    """A check's ``Report``: ``message`` marked ✓ or ✗, printed when ``verbose``.

    Args:
        passed: whether the check passed.
        message: the verdict in words, without the mark.
        verbose: print the marked message.

    Returns:
        The ``Report``, its message marked.
    """
    report = Report(passed, ("✓ " if passed else "✗ ") + message)
    if verbose:
        print(report.message)
    return report


def _offsets_checked(ran: bool) -> str:
    """What a tile check's launch on rows past element 2**31 showed, for its ✓ message."""
    return ("rows past element 2**31 read and written where they are (int64 row offsets)" if ran
            else ("int64 row offsets NOT checked (this machine would not map the 8 GiB of "
                  "addresses it needs)"))


def _widths(cases) -> str:
    return "/".join(str(case.cols) for case in cases)


def _format_errors(worst: dict) -> str:
    return ", ".join(f"{str(dtype).removeprefix('torch.')} {error:.1e}" for dtype, error in worst.items())


# --------------------------------------------------------------------------------------------------
# References and the usual mistakes, all in float64
# --------------------------------------------------------------------------------------------------


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(device="cpu", dtype=torch.float64)


def _forward64(x, w, eps, divisor=None, columns=None, rstd_power=-0.5, weight=True,
               eps_outside=False, padding=0):
    """RMSNorm in float64, or one of its usual misreadings (another divisor, fewer columns, sqrt for
    rsqrt, ``padding`` lanes of 1.0 in the sum of squares...)."""
    x, w = _f64(x), _f64(w)
    used = x if columns is None else x[:, :columns]
    mean_square = (used.pow(2).sum(-1, keepdim=True) + padding) / (divisor or used.shape[-1])
    if eps_outside:
        y = x / (mean_square.sqrt() + eps)
    else:
        y = x * (mean_square + eps) ** rstd_power
    return w * y if weight else y


def _statistic_suspects(x, w, case) -> list[tuple[str, torch.Tensor]]:
    """The forward with the wrong statistic: mean(x)², mean(x) (no square: NaN where negative),
    LayerNorm's variance, LayerNorm's centred x̂; all in float64."""
    x64, w64 = _f64(x), _f64(w)
    mean = x64.mean(-1, keepdim=True)
    variance = (x64 - mean).pow(2).mean(-1, keepdim=True)
    return [
        (hint("square_of_mean"), w64 * x64 * (mean.pow(2) + case.eps).rsqrt()),
        (hint("no_square"), w64 * x64 * (mean + case.eps).rsqrt()),
        (hint("centred"), w64 * x64 * (variance + case.eps).rsqrt()),
        (hint("centred_x"), w64 * (x64 - mean) * (variance + case.eps).rsqrt()),
    ]


def _forward_suspects(x, w, case, strides: bool = True) -> list[tuple[str, torch.Tensor]]:
    n = case.cols
    block_n = triton.next_power_of_2(n)
    suspects = []
    for divisor in sorted({case.rows, TILE_ROWS} - {n, block_n, 1}):  # the rows of the input, or of a tile
        suspects.append((hint("divide_by_rows", divisor=divisor, n=n),
                         _forward64(x, w, case.eps, divisor=divisor)))
    if block_n != n:
        suspects.append((hint("divide_by_block", block_n=block_n, n=n),
                         _forward64(x, w, case.eps, divisor=block_n)))
        suspects.append((hint("masked_other", pad=block_n - n, n=n, block_n=block_n),
                         _forward64(x, w, case.eps, padding=block_n - n)))
        # BLOCK_N too small (the power of two below n_cols): only the first columns enter the sum,
        # and the rest of the row is never written, so only those first columns can be compared.
        short = block_n // 2
        suspects.append((hint("short_block", short=short, n=n, block_n=block_n),
                         _first_columns(_forward64(x, w, case.eps, columns=short), short)))
    suspects += [
        (hint("sum_not_mean"), _forward64(x, w, case.eps, divisor=1)),
        (hint("sqrt_not_rsqrt"), _forward64(x, w, case.eps, rstd_power=0.5)),
        (hint("no_rsqrt"), _forward64(x, w, case.eps, rstd_power=1.0)),
        (hint("no_weight"), _forward64(x, w, case.eps, weight=False)),
        (hint("no_eps", eps=case.eps), _forward64(x, w, 0.0)),
        (hint("eps_outside_sqrt"), _forward64(x, w, case.eps, eps_outside=True)),
    ] + _statistic_suspects(x, w, case)
    if case.eps != 1e-6:
        suspects.append((hint("default_eps", eps=case.eps), _forward64(x, w, 1e-6)))
    if strides and case.row_stride:
        suspects.append((hint("row_stride", cols=case.cols, stride=case.row_stride),
                         _forward64(_as_if_strided(x, case.cols), w, case.eps)))
    if case.dtype == torch.bfloat16:
        suspects += [(hint, _f64(wrong)) for hint, wrong in _bf16_near_misses(x, w, case)]
    return suspects


def _tile_forward_suspects(x, w, case: TileCase) -> list[tuple[str, torch.Tensor]]:
    """The forward mistakes that only a tile kernel can make: another tensor's row stride."""
    return _input_stride_suspects(case, {"x": x}, lambda t: _forward64(t["x"], w, case.eps),
                                             others={"y": case.strides[1]})


def _input_stride_suspects(case: TileCase | Case, inputs: dict, compute, others: dict | None = None):
    """What a kernel computes when it steps between the rows of one input by a wrong stride: the
    width, or the row stride of another tensor. ``compute`` maps the inputs (some read wrongly) to
    the result."""
    strides = dict(zip(inputs, case.strides))
    strides.update(others or {})
    suspects = []
    for name, t in inputs.items():
        wrong = {case.cols: "n_cols, the width"}
        wrong.update({s: f"stride_{other}, {other}'s row stride" for other,
                      s in strides.items() if other != name})
        for used, what in wrong.items():
            if used == strides[name] or not _fits(t, used):
                continue
            misread = dict(inputs, **{name: _as_if_strided(t, used)})
            suspects.append((hint("input_stride", tensor=name, used=used, what=what, right=strides[name],
                                  arg=f"stride_{name}", wrong=what.split(",")[0]), compute(misread)))
    # every input read at the width
    if len(inputs) > 1 and all(_fits(t, case.cols) for t in inputs.values()):
        names = list(inputs)
        suspects.append((hint("inputs_width", tensors=" and ".join(names), cols=case.cols,
                              strides=" and ".join(str(strides[n]) for n in names),
                              args=", ".join(f"stride_{n}" for n in names)),
                         compute({n: _as_if_strided(t, case.cols) for n, t in inputs.items()})))
    return suspects


def _backward_suspects(x, w, dy, rstd, case) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]:
    """The right dx, and the usual mistakes in writing dx = rstd · (g − x̂ · mean(g ⊙ x̂)) with g =
    dy ⊙ w."""

    def dx64(x, dy, divisor=None, columns=None):
        x, w64, dy, r = _f64(x), _f64(w), _f64(dy), _f64(rstd)[:, None]
        x, w64, dy = x[:, :columns], w64[:columns], dy[:, :columns]
        x_hat, g = x * r, dy * w64
        mean = lambda t, d=divisor or x.shape[-1]: t.sum(-1, keepdim=True) / d  # noqa: E731
        return {
            "right": r * (g - x_hat * mean(g * x_hat)),
            "no_rstd": g - x_hat * mean(g * x_hat),
            "dx_sum_not_mean": r * (g - x_hat * (g * x_hat).sum(-1, keepdim=True)),
            "dx_sign": r * (g + x_hat * mean(g * x_hat)),
            "no_correction": r * g,
            "dx_no_weight": r * (dy - x_hat * mean(dy * x_hat)),
            "dy_in_mean": r * (g - x_hat * mean(dy * x_hat)),
            "mean_of_g": r * (g - x_hat * mean(g)),
            "x_for_x_hat": r * (g - x * mean(g * x_hat)),
            "x_for_x_hat_twice": r * (g - x * mean(g * x)),
        }

    n = case.cols
    block_n = triton.next_power_of_2(n)
    v = dx64(x, dy)
    suspects = [(hint(key, n=n), v[key]) for key in v if key != "right"]
    if block_n != n:
        suspects.append((hint("dx_divide_by_block", block_n=block_n, n=n),
                         dx64(x, dy, divisor=block_n)["right"]))
        # BLOCK_N too small: only the first columns are computed (with either divisor); only they
        # can be compared.
        short = block_n // 2
        for divisor in (short, n):
            dx_short = torch.full(v["right"].shape, float("nan"), dtype=torch.float64)
            dx_short[:, :short] = dx64(x, dy, divisor=divisor, columns=short)["right"]
            suspects.append((hint("short_block", short=short, n=n, block_n=block_n), dx_short))
    if isinstance(case, Case) and case.row_stride:  # another stride for x or dy: the width, or the other's
        suspects += _input_stride_suspects(case, {"x": x, "dy": dy},
                                           lambda t: dx64(t["x"], t["dy"])["right"])
    return v["right"], suspects


def _dx_tile_axis_0(x, w, dy, rstd) -> torch.Tensor:
    """dx of a tile kernel whose mean runs along axis 0: per tile of TILE_ROWS rows, one mean per
    column over the tile's rows (rows past the end load zeros), divided by n_cols, broadcast over
    the rows."""
    x, w64, dy, r = _f64(x), _f64(w), _f64(dy), _f64(rstd)[:, None]
    x_hat, g = x * r, dy * w64
    dx = torch.empty_like(x)
    for start in range(0, x.shape[0], TILE_ROWS):
        tile = slice(start, start + TILE_ROWS)
        mean = (g[tile] * x_hat[tile]).sum(0) / x.shape[1]
        dx[tile] = r[tile] * (g[tile] - x_hat[tile] * mean)
    return dx


def _as_if_strided(t: torch.Tensor, stride: int) -> torch.Tensor:
    """What a kernel reads from the memory of view ``t`` when it steps between rows by ``stride``
    elements."""
    return torch.as_strided(t, t.shape, (stride, 1))


def _fits(t: torch.Tensor, stride: int) -> bool:
    """Whether rows ``stride`` apart, from ``t``'s first element, stay inside ``t``'s storage."""
    last = t.storage_offset() + (t.shape[0] - 1) * stride + t.shape[1]
    return last * t.element_size() <= t.untyped_storage().nbytes()


def _first_columns(t: torch.Tensor, columns: int) -> torch.Tensor:
    """``t`` with every column from ``columns`` on set to NaN, i.e. left out of the comparison."""
    t = t.clone()
    t[:, columns:] = float("nan")
    return t


def _check_dw(partials, x, w, dy, rstd, case: TileCase, fp32_passed: bool) -> tuple[str | None, float]:
    """Sum the kernel's float32 partials in float64 and compare with dW = Σ dy ⊙ round(x̂);
    (problem, error)."""
    where = f"on a {case}, "
    got = _f64(partials).sum(0)
    x32, dy64, r = x.detach().cpu().float(), _f64(dy), rstd.detach().cpu().float()[:, None]
    x_hat = x32 * r  # as the kernel computes it, in float32
    x_hat_rounded = _f64(x_hat.to(case.dtype))
    ref = (dy64 * x_hat_rounded).sum(0)
    tiles = [slice(start, min(start + TILE_ROWS, case.rows)) for start in range(0, case.rows, TILE_ROWS)]
    last_tiles = [tiles[p + ((len(tiles) - 1 - p) // case.programs) * case.programs]
                  for p in range(min(case.programs, len(tiles)))]
    suspects = [
        ("dw_sign", -ref),
        ("dw_used_g", (dy64 * _f64(w) * x_hat_rounded).sum(0)),
        ("dw_used_x", (dy64 * _f64(x)).sum(0)),
        ("dw_mean", ref / case.rows),
        ("dw_last_tile", sum((dy64[t] * x_hat_rounded[t]).sum(0) for t in last_tiles)),
        ("dw_rstd_twice", (dy64 * x_hat_rounded * _f64(r)).sum(0)),
    ]
    if case.dtype != torch.float32:
        suspects.append(("dw_unrounded", (dy64 * _f64(x_hat)).sum(0)))
    if not torch.isfinite(got).all():
        return where + hint("dw_partials_missing") + ".", float("inf")
    error = relative_error(got, ref)
    if error < DW_TIGHT and not bad_elements(got, ref, torch.float32).any():
        return None, error
    first = _first_difference(got[None], ref[None], bad_elements(got[None], ref[None], torch.float32), "dW")
    first = first.replace("row 0 of dW differs (column", "dW differs (column")
    if torch.count_nonzero(got) == 0:
        return where + hint("dw_zero"), error
    for key, wrong in suspects:
        if relative_error(got, wrong) < DW_TIGHT:
            return f"{where}{first}: {hint(key)}.", error
    if case.dtype != torch.float32 and fp32_passed:
        return f"{where}{first}: {hint('dw_not_float32', error=error, tight=DW_TIGHT)}.", error
    return where + first + "; " + hint("unrecognised", name="dW", error=error, tol=DW_TIGHT), error


# --------------------------------------------------------------------------------------------------
# Comparing and explaining
# --------------------------------------------------------------------------------------------------


def bad_elements(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The elements of ``out`` that are not close to ``ref`` within ``dtype``'s element tolerances.

    The absolute part of the tolerance scales with the largest finite ``|ref|``; where ``ref`` is
    not finite nothing is compared. Shared by the exercises' checks.

    Args:
        out: the output to judge (any dtype and device).
        ref: the reference, float64 on the CPU, of ``out``'s shape.
        dtype: the dtype whose tolerances apply (a key of ``ELEMENT_TOL``).

    Returns:
        A boolean tensor of ``out``'s shape: True where the element is not finite or too far.
    """
    rtol, atol = ELEMENT_TOL[dtype]
    out = _f64(out)
    compared = torch.isfinite(ref)
    scale = float(ref[compared].abs().max()) if compared.any() else 1.0
    far = ~torch.isfinite(out) | ((out - ref).abs() > rtol * ref.abs() + atol * (scale or 1.0))
    return far & compared


def _reproduces(out, wrong, text: str, dtype: torch.dtype) -> bool:
    """Whether ``out`` is what the mistake ``text`` computes, ``wrong``. Where ``wrong`` is NaN
    nothing is compared (columns a mistake never writes), except for a missing square, whose NaN
    rows (the root of a negative mean) are part of its pattern: the output must be NaN in exactly
    those rows."""
    if text == HINTS["no_square"] and not torch.equal(torch.isnan(_f64(out)), torch.isnan(wrong)):
        return False
    return not bad_elements(out, wrong, dtype).any()


def _compare(out, ref, case, name: str, suspects) -> str | None:
    """None when ``out`` is right; otherwise the most precise explanation of what is wrong."""
    bad = bad_elements(out, ref, case.dtype)
    if not bad.any() and relative_error(out, ref) < RELATIVE_ERROR_TOL[case.dtype]:
        return None
    where = f"on a {case}"
    out64 = _f64(out)
    first = _first_difference(out64, ref, bad, name)
    if torch.count_nonzero(out64) == 0:
        return f"{where}, " + hint("placeholder_zeros", name=name)
    for text, wrong in suspects:
        if _reproduces(out, wrong, text, case.dtype):
            return f"{where}, {first}: {text}."
    tail = _suffix(bad.any(0))
    if tail is not None:
        return f"{where}, " + hint("tail_columns", first=tail, last=case.cols - 1, name=name, right=tail - 1)
    tail = _suffix(bad.any(1))
    if tail is not None:
        return f"{where}, " + hint("tail_rows", first=tail, last=case.rows - 1, name=name, right=tail - 1)
    head = _prefix(bad.any(1))
    if head is not None and torch.isnan(out64[:head]).all():
        return f"{where}, " + hint("first_rows_skipped", rows=_span("row", 0, head - 1), name=name,
                                       were="was" if head == 1 else "were")
    if not torch.isfinite(out64).all():
        return f"{where}, {first}: " + hint("not_finite", name=name)
    return (f"{where}, {first}; "
            + hint("unrecognised", name=name, error=relative_error(out, ref),
                   tol=RELATIVE_ERROR_TOL[case.dtype]))


def _written_outside(buffer, before, view, ref, case: TileCase, name: str, other_strides: dict, arg: str,
                     suspects=()):
    """None when the kernel wrote inside the view only; otherwise where else it wrote, and why (a
    wrong stride, a missing row or column mask, a row index off by one). Rows written at another
    stride are compared with ``ref`` and with the ``suspects``, the usual mistakes in what was
    computed, so that both mistakes are named."""
    changed = _changed(buffer, before)
    inside = torch.zeros_like(changed)
    inside[GUARD_ROWS:GUARD_ROWS + case.rows, : case.cols] = True
    where = f"on a {case}, "
    if not changed.any():
        return where + hint("nothing_written", name=name) + "."
    outside = changed & ~inside
    if not outside.any():
        return None
    right = view.stride(0)
    for used, what in other_strides.items():  # the rows written at another stride: are they right there?
        if used == right or not _fits(view, used):
            continue
        written = _as_if_strided(view, used)
        stride_hint = where + hint("output_stride", name=name, used=used, what=what, right=right, arg=arg)
        if not bad_elements(written, ref, case.dtype).any():
            return stride_hint + "."
        for text, wrong in suspects:
            if _reproduces(written, wrong, text, case.dtype):
                return f"{stride_hint}; and {text}."
    problems = []
    before_rows = outside[:GUARD_ROWS].any(1)
    if before_rows.any():
        problems.append(hint("rows_before_start", name=name))
    after = [int(i) + case.rows for i in outside[GUARD_ROWS + case.rows:].any(1).nonzero().flatten()]
    if after == [case.rows] and case.padding_rows > 1:
        problems.append(hint("row_at_end", name=name, rows=case.rows))
    elif after:
        problems.append(hint("rows_past_end", name=name, written=_span("row", after[0], after[-1]),
                             rows=case.rows))
    columns = outside[GUARD_ROWS:GUARD_ROWS + case.rows].any(0).nonzero().flatten()
    if len(columns):
        problems.append(hint("columns_past_end", name=name, first=int(columns[0]), last=int(columns[-1]),
                             cols=case.cols))
    return where + "; and ".join(problems) + "."


def _named(problem: str) -> bool:
    """Whether ``problem`` names a mistake (rather than saying that none of the usual ones
    reproduces the output, or only that it holds NaN)."""
    return not any(_says(HINTS[key], problem) for key in ("unrecognised", "bf16_bits", "not_finite"))


def _says(wording: str, message: str) -> bool:
    """Whether ``message`` holds the diagnosis worded ``wording`` (its fixed words, in order; fields
    left out)."""
    at = 0
    for piece in (p for p in re.split(r"\{[^}]*\}", wording) if p.strip()):
        at = message.find(piece, at)
        if at < 0:
            return False
        at += len(piece)
    return True


def _span(noun: str, first: int, last: int) -> str:
    """'row 3' or 'rows 3–5'."""
    return f"{noun} {first}" if first == last else f"{noun}s {first}–{last}"


def _first_difference(out64, ref, bad, name) -> str:
    if bad.any():
        row, col = (int(i) for i in bad.nonzero()[0])
    else:  # every element within tolerance, yet the whole is not: point at the largest difference
        row, col = divmod(int((out64 - ref).abs().nan_to_num(0.0).argmax()), ref.shape[1])
    got, expected = out64[row, col].item(), ref[row, col].item()
    return f"row {row} of {name} differs (column {col}: got {got:.5g}, expected {expected:.5g})"


def _suffix(bad_along: torch.Tensor) -> int | None:
    """k > 0 when exactly the positions k, k+1, ... are bad; otherwise None."""
    bad_along = bad_along.tolist()
    if all(bad_along) or not any(bad_along):
        return None
    k = bad_along.index(True)
    return k if all(bad_along[k:]) else None


def _prefix(bad_along: torch.Tensor) -> int | None:
    """k > 0 when exactly the positions 0, ..., k − 1 are bad; otherwise None."""
    k = _suffix(~bad_along)
    return k


CAST_ORDER_HINT = HINTS["cast_order"]
TRUNCATION_HINT = HINTS["truncation"]


def _bf16_near_misses(x, w, case) -> list[tuple[str, torch.Tensor]]:
    """Outputs that are right to bfloat16 precision but rounded differently from Hugging Face's, as
    bf16 on the CPU."""
    x32, w32 = x.detach().cpu().float(), w.detach().cpu().float()
    x_hat = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + case.eps)
    rounded = x_hat.bfloat16().float()
    return [
        (CAST_ORDER_HINT, (x_hat * w32).bfloat16()),
        # Truncated where it should round: x̂ and the output, the output only, or x̂ only.
        (TRUNCATION_HINT, _truncate_bf16(_truncate_bf16(x_hat).float() * w32)),
        (TRUNCATION_HINT, _truncate_bf16(rounded * w32)),
        (TRUNCATION_HINT, (_truncate_bf16(x_hat).float() * w32).bfloat16()),
    ]


def _bf16_cast_order(out, x, w, case) -> tuple[str | None, float]:
    """Compare a bfloat16 output bit for bit with Hugging Face's; return (what is wrong or None,
    fraction differing)."""
    out = out.cpu()
    differs = (out != rms_norm_reference(x.cpu(), w.cpu(), case.eps)).float().mean().item()
    if differs <= BF16_MAX_DIFFERENT:
        return None, differs
    where = f"on a {case}, {100 * differs:.0f}% of the values differ from Hugging Face's in the last bits"
    for text, candidate in _bf16_near_misses(x, w, case):
        if (out != candidate).float().mean().item() < differs / 4:
            return f"{where}: {text}.", differs
    return f"on a {case}, " + hint("bf16_bits", share=100 * differs), differs


def _truncate_bf16(t: torch.Tensor) -> torch.Tensor:
    """float32 → bfloat16 by dropping the low 16 bits (what a truncating conversion does)."""
    bits = t.float().contiguous().view(torch.int32) & -65536  # 0xFFFF0000 as a signed 32-bit integer
    return bits.view(torch.float32).bfloat16()
