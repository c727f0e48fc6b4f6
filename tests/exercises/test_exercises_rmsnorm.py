"""The RMSNorm exercise checks: they pass right answers and name each planted mistake precisely, without raising.

For the checks of a function, the planted mistakes are written in plain PyTorch (fast, and exactly the arithmetic a
wrong kernel would do), with two Triton kernels to show the checks also report on a kernel as the reader finds it
in the notebook. The checks of a tile kernel launch the kernel themselves, so their planted mistakes are Triton
kernels: one kernel each, with the mistake chosen by a compile-time switch.
"""

import json
from pathlib import Path

import diagnoses
import pytest
import torch
import triton
import triton.language as tl

from kernels.exercises import solutions
from kernels.exercises.rmsnorm import (
    DW_TIGHT,
    HINTS,
    check_rms_norm_backward,
    check_rms_norm_backward_tile,
    check_rms_norm_forward,
    check_rms_norm_tile,
)
from kernels.exercises.solutions import load
from kernels.rmsnorm import rms_norm_backward
from kernels.triton_utils import cast_to


def truncate_bf16(t):
    return (t.float().contiguous().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


# ---------------------------------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------------------------------


def forward(x, w, eps, *, divisor=None, eps_used=None, power=-0.5, weight=True, weight_first=False, truncate=False,
            columns=None, contiguous_rows=False):
    """RMSNorm as Hugging Face computes it, or with one planted mistake chosen by a keyword."""
    if contiguous_rows:  # step between rows by the width, ignoring the view's row stride
        x = torch.as_strided(x, x.shape, (x.shape[-1], 1))
    x32 = x.float()
    used = x32[:, :columns]
    mean_square = used.pow(2).sum(-1, keepdim=True) / (divisor(x.shape[-1]) if divisor else used.shape[-1])
    x_hat = x32 * (mean_square + (eps if eps_used is None else eps_used)) ** power
    if not weight:
        return x_hat.to(x.dtype)
    if weight_first:
        return (x_hat * w.float()).to(x.dtype)
    if truncate:
        return truncate_bf16(truncate_bf16(x_hat).float() * w.float()) if x.dtype == torch.bfloat16 else x_hat * w
    return w * x_hat.to(x.dtype)


def forward_leaving(x, w, eps, *, columns=None, rows=None):
    """A right forward that leaves columns (or rows) from an index on unwritten (zero)."""
    y = forward(x, w, eps)
    if columns is not None:
        y[:, columns:] = 0
    if rows is not None:
        y[rows:] = 0
    return y


def short_block(n):
    """The power of two at or below n: what BLOCK_N is when it is rounded the wrong way."""
    return n if triton.next_power_of_2(n) == n else triton.next_power_of_2(n) // 2


def forward_short_block(x, w, eps):
    """BLOCK_N rounded down: only the first BLOCK_N columns are summed, and only they are written."""
    block = short_block(x.shape[-1])
    y = forward(x, w, eps, columns=block)
    y[:, block:] = 0
    return y


def forward_with_nan(x, w, eps):
    y = forward(x, w, eps)
    y[2, 3] = float("nan")
    return y


def raise_error(*args):
    raise ValueError("boom: the reader's kernel failed")


def returns_float32(x, w, eps):
    return forward(x, w, eps).float()


def forward_statistic(x, w, eps, statistic):
    """RMSNorm with the wrong statistic of the row (Hugging Face's cast order otherwise)."""
    x32 = x.float()
    mean = x32.mean(-1, keepdim=True)
    variance = (x32 - mean).pow(2).mean(-1, keepdim=True)
    x_hat = {
        "square-of-mean": lambda: x32 * torch.rsqrt(mean.pow(2) + eps),
        "no-square": lambda: x32 * torch.rsqrt(mean + eps),
        "centred": lambda: x32 * torch.rsqrt(variance + eps),
        "centred-x": lambda: (x32 - mean) * torch.rsqrt(variance + eps),
        "divide-by-rows": lambda: x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) / x.shape[0] + eps),
        "eps-outside-sqrt": lambda: x32 / (x32.pow(2).mean(-1, keepdim=True).sqrt() + eps),
    }[statistic]()
    return w * x_hat.to(x.dtype)


PLANTED_FORWARD_STATISTIC = {
    "square-of-mean": "square_of_mean",
    "no-square": "no_square",
    "centred": "centred",
    "centred-x": "centred_x",
    "divide-by-rows": "divide_by_rows",
    "eps-outside-sqrt": "eps_outside_sqrt",
}


@pytest.mark.parametrize("statistic", list(PLANTED_FORWARD_STATISTIC))
def test_forward_check_names_a_wrong_statistic(statistic):
    report = check_rms_norm_forward(lambda x, w, eps: forward_statistic(x, w, eps, statistic), verbose=False)
    assert not report.passed
    assert says(PLANTED_FORWARD_STATISTIC[statistic], report.message), report.message


PLANTED_FORWARD = {
    "stub-zeros": (lambda x, w, eps: torch.zeros_like(x),
                   "every value of y is 0: is the exercise line still the placeholder"),
    "divide-by-BLOCK_N": (
        lambda x, w, eps: forward(x, w, eps, divisor=triton.next_power_of_2),
        "on a float32 input of 5 × 100, row 0 of y differs (column",
    ),
    "sum-not-mean": (lambda x, w, eps: forward(x, w, eps, divisor=lambda n: 1), "did not divide by n_cols"),
    "sqrt-not-rsqrt": (lambda x, w, eps: forward(x, w, eps, power=0.5), "instead of dividing by it"),
    "no-weight": (lambda x, w, eps: forward(x, w, eps, weight=False), "the weight is never applied"),
    "no-eps": (lambda x, w, eps: forward(x, w, eps, eps_used=0.0), "eps is missing"),
    "default-eps": (lambda x, w, eps: forward(x, w, eps, eps_used=1e-6), "not the eps passed in (1e-05)"),
    "weight-before-cast": (
        lambda x, w, eps: forward(x, w, eps, weight_first=True),
        "output not cast like Hugging Face: you multiplied by the weight before casting",
    ),
    "truncated-bf16": (lambda x, w, eps: forward(x, w, eps, truncate=True), "truncated to bfloat16 instead of rounded"),
    "BLOCK_N-too-small": (
        forward_short_block,
        "only the first 64 columns were used: BLOCK_N must be a power of two at least n_cols "
        "(triton.next_power_of_2(100) = 128)",
    ),
    "tail-not-written": (
        lambda x, w, eps: forward_leaving(x, w, eps, columns=64),
        "columns 64–99 of y are wrong while columns 0–63 are right: tail columns not written: check your mask",
    ),
    "rows-not-written": (
        lambda x, w, eps: forward_leaving(x, w, eps, rows=4),
        "rows 4–6 of y are wrong while rows 0–3 are right",
    ),
    "ignores-row-stride": (
        lambda x, w, eps: forward(x, w, eps, contiguous_rows=True),
        "in this view they are 128 apart: offset each row by the tensor's row stride (x.stride(0))",
    ),
    "nan": (forward_with_nan, "y holds NaN or infinity. Masked-off lanes must load other=0.0"),
    "raises": (raise_error, "your function raised ValueError: boom: the reader's kernel failed"),
    "returns-none": (lambda x, w, eps: None, "your function returned NoneType, expected a tensor shaped like x"),
    "wrong-shape": (lambda x, w, eps: forward(x, w, eps)[:, :-1], "the output has shape (7, 63), expected (7, 64)"),
    "wrong-dtype": (returns_float32,
                    "bfloat16 input of 6 × 300, the output has dtype torch.float32, expected torch.bfloat16"),
    "unrecognised": (lambda x, w, eps: forward(x, w, eps) * 1.01, "None of the usual mistakes reproduces this output"),
}


@pytest.mark.parametrize(
    "fn",
    [load("rms_norm_forward_rows"), forward],
    ids=["hidden-solution", "plain-pytorch"],
)
def test_forward_check_passes_right_answers(fn):
    report = check_rms_norm_forward(fn, verbose=False)
    assert report.passed and report, report.message
    assert report.message.startswith("✓ forward correct on 5 inputs")


@pytest.mark.parametrize("name", list(PLANTED_FORWARD))
def test_forward_check_names_each_planted_mistake(name, capsys):
    fn, expected = PLANTED_FORWARD[name]
    report = check_rms_norm_forward(fn)
    assert not report.passed and not report
    assert report.message.startswith("✗ ")
    assert expected in report.message, report.message
    assert capsys.readouterr().out.strip() == report.message  # the verdict is printed, not raised


# ---------------------------------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------------------------------


def dx(dy, x, w, rstd, variant="right", divisor=None, short=False, contiguous_rows=False, dy_at_x_stride=False):
    """dx = rstd · (g − x̂ · mean(g ⊙ x̂)) with g = dy ⊙ w in float32, or one planted mistake (``variant``)."""
    if contiguous_rows:
        x = torch.as_strided(x, x.shape, (x.shape[-1], 1))
        dy = torch.as_strided(dy, dy.shape, (dy.shape[-1], 1))
    if dy_at_x_stride:  # DY + row * stride_x: dy's rows read as if they were x's stride apart
        dy = torch.as_strided(dy, dy.shape, (x.stride(0), 1))
    columns = short_block(x.shape[-1]) if short else None
    x32, dy32, w32 = x.float()[:, :columns], dy.float()[:, :columns], w.float()[:columns]
    r = rstd[:, None]
    x_hat, g = x32 * r, dy32 * w32
    n = divisor or x32.shape[-1]
    mean = lambda t: t.sum(-1, keepdim=True) / n  # noqa: E731
    result = {
        "right": lambda: r * (g - x_hat * mean(g * x_hat)),
        "no-rstd": lambda: g - x_hat * mean(g * x_hat),
        "sum": lambda: r * (g - x_hat * (g * x_hat).sum(-1, keepdim=True)),
        "sign": lambda: r * (g + x_hat * mean(g * x_hat)),
        "no-correction": lambda: r * g,
        "correction-no-rstd": lambda: r * g - x_hat * mean(g * x_hat),  # the same numbers as x-for-x_hat
        "no-weight": lambda: r * (dy32 - x_hat * mean(dy32 * x_hat)),
        "dy-in-mean": lambda: r * (g - x_hat * mean(dy32 * x_hat)),
        "mean-of-g": lambda: r * (g - x_hat * mean(g)),
        "x-for-x_hat": lambda: r * (g - x32 * mean(g * x_hat)),
        "x-in-mean": lambda: r * (g - x_hat * mean(g * x32)),  # the same numbers as x-for-x_hat
    }[variant]()
    if columns is not None:
        result = torch.cat([result, torch.zeros(x.shape[0], x.shape[1] - columns, device=x.device)], dim=1)
    return result.to(x.dtype)


PLANTED_BACKWARD = {
    "stub-zeros": (lambda dy, x, w, r: torch.zeros_like(x), "every value of dx is 0: is the exercise line still"),
    "no-rstd": (lambda *a: dx(*a, "no-rstd"), "the leading rstd factor is missing"),
    "sum-not-mean": (lambda *a: dx(*a, "sum"), "you summed g ⊙ x̂ over the row instead of taking its mean"),
    "sign": (lambda *a: dx(*a, "sign"), "the sign of the correction is wrong"),
    "no-correction": (lambda *a: dx(*a, "no-correction"), "the correction term − x̂ · mean(g ⊙ x̂) is missing"),
    "correction-no-rstd": (lambda *a: dx(*a, "correction-no-rstd"), "rstd multiplies the whole bracket"),
    "no-weight": (lambda *a: dx(*a, "no-weight"), "the weight is missing: g = dy ⊙ w"),
    "dy-in-mean": (lambda *a: dx(*a, "dy-in-mean"), "inside the mean use g = dy ⊙ w, not dy"),
    "mean-of-g": (lambda *a: dx(*a, "mean-of-g"), "wrong mean: it is mean(g ⊙ x̂), not mean(g)"),
    "x-for-x_hat": (lambda *a: dx(*a, "x-for-x_hat"), "you used x where x̂ belongs"),
    "x-in-mean": (lambda *a: dx(*a, "x-in-mean"), "x inside the mean"),
    "divide-by-BLOCK_N": (
        lambda *a: dx(*a, divisor=triton.next_power_of_2(a[1].shape[-1])),
        "on a float32 input of 5 × 100, row",  # which row shows it first depends on the draw
    ),
    "BLOCK_N-too-small": (lambda *a: dx(*a, short=True), "only the first 64 columns were used"),
    "ignores-row-stride": (lambda *a: dx(*a, contiguous_rows=True),
                           "the rows of x and dy were read n_cols (80) elements apart, the width, but they are 128 and "
                           "160 elements apart: offset each tensor's rows by its own row stride (stride_x, stride_dy)"),
    "dy-at-x-stride": (lambda *a: dx(*a, dy_at_x_stride=True),
                       "rows of dy were read 128 elements apart (stride_x, x's row stride), but they are 160 apart: "
                       "offset dy's rows by stride_dy, not by stride_x"),
    "raises": (raise_error, "your function raised ValueError"),
}


@pytest.mark.parametrize("fn", [load("rms_norm_dx"), dx], ids=["hidden-solution", "plain-pytorch"])
def test_backward_check_passes_right_answers(fn):
    report = check_rms_norm_backward(fn, verbose=False)
    assert report.passed, report.message
    assert report.message.startswith("✓ backward (dx) correct on 4 inputs")


@pytest.mark.parametrize("name", list(PLANTED_BACKWARD))
def test_backward_check_names_each_planted_mistake(name):
    fn, expected = PLANTED_BACKWARD[name]
    report = check_rms_norm_backward(fn, verbose=False)
    assert not report.passed
    assert expected in report.message, report.message


def test_divide_by_block_n_message_names_both_widths():
    report = check_rms_norm_backward(lambda *a: dx(*a, divisor=triton.next_power_of_2(a[1].shape[-1])), verbose=False)
    assert "did you divide by BLOCK_N (128) instead of n_cols (100)?" in report.message, report.message
    report = check_rms_norm_forward(lambda x, w, eps: forward(x, w, eps, divisor=triton.next_power_of_2), verbose=False)
    assert "did you divide by BLOCK_N (128) instead of n_cols (100)?" in report.message, report.message


# ---------------------------------------------------------------------------------------------------------------------
# A Triton kernel as the reader finds it in chapter 02, and with one mistake
# ---------------------------------------------------------------------------------------------------------------------


@triton.jit
def _rows_kernel(X, W, Y, n_cols, stride_x, stride_y, eps, BLOCK_N: tl.constexpr, MISTAKE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if MISTAKE == "other-1":  # the masked-off lanes load 1.0
        x = tl.load(X + row * stride_x + cols, mask=mask, other=1.0).to(tl.float32)
    if MISTAKE == "stub":
        rstd = 0.0
    elif MISTAKE == "block":
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / BLOCK_N + eps)
    else:
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    x_hat = cast_to(x * rstd, X.dtype.element_ty).to(tl.float32)
    if MISTAKE == "unrounded":  # x̂ multiplied by the weight in float32, never rounded to x's dtype
        x_hat = x * rstd
    y = cast_to(x_hat * w, Y.dtype.element_ty)
    if MISTAKE == "to-bf16":  # a plain conversion: the interpreter truncates it
        y = (x_hat * w).to(Y.dtype.element_ty)
    tl.store(Y + row * stride_y + cols, y, mask=mask)


def triton_forward(mistake):
    def run(x, w, eps):
        y = torch.empty_like(x)
        _rows_kernel[(x.shape[0],)](
            x, w, y, x.shape[1], x.stride(0), y.stride(0), eps, BLOCK_N=triton.next_power_of_2(x.shape[1]),
            MISTAKE=mistake,
        )
        return y

    return run


@pytest.mark.parametrize(
    "mistake, expected",
    [
        ("stub", "every value of y is 0"),
        ("block", "did you divide by BLOCK_N (128) instead of n_cols (100)?"),
        ("other-1", "the masked-off lanes of x loaded 1.0, not 0.0: the 28 lanes between n_cols (100) and BLOCK_N"),
        ("unrounded", "output not cast like Hugging Face"),
        ("to-bf16", "values are truncated to bfloat16 instead of rounded"),
        ("none", "✓ forward correct"),
    ],
)
def test_forward_check_on_triton_kernels(mistake, expected):
    report = check_rms_norm_forward(triton_forward(mistake), verbose=False)
    assert report.passed == (mistake == "none")
    assert expected in report.message, report.message


def test_x_for_x_hat_twice_is_named():
    report = check_rms_norm_backward(lambda *a: dx_x_twice(*a), verbose=False)
    assert HINTS["x_for_x_hat_twice"] in report.message, report.message


def dx_x_twice(dy, x, w, rstd):
    x32, dy32, w32, r = x.float(), dy.float(), w.float(), rstd[:, None]
    g = dy32 * w32
    return (r * (g - x32 * (g * x32).mean(-1, keepdim=True))).to(x.dtype)


# ---------------------------------------------------------------------------------------------------------------------
# The hidden solutions pass their checks
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, check", [
    ("rms_norm_tile_kernel", check_rms_norm_tile),
    ("rms_norm_dx", check_rms_norm_backward),
    ("rms_norm_bwd_tile_kernel", check_rms_norm_backward_tile),
])
def test_solutions_pass_their_checks(name, check):
    report = check(load(name), verbose=False)
    assert report.passed, report.message
    assert name in solutions.names()


def says(key: str, message: str) -> bool:
    """Whether ``message`` holds the diagnosis ``HINTS[key]``."""
    return diagnoses.says(HINTS[key], message)


# ---------------------------------------------------------------------------------------------------------------------
# Chapter 02's tile kernel: the reader's mechanics (rows, mask, offsets, upcast) and rstd, one mistake at a time
# ---------------------------------------------------------------------------------------------------------------------


@triton.jit
def _tile_kernel(X, W, Y, n_rows, n_cols, stride_x, stride_y, eps, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                 MISTAKE: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    if MISTAKE == "int32-rows":
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # int32: rows * stride wraps past 2**31
    if MISTAKE == "row+1":
        rows = rows + 1
    if MISTAKE == "row-1":
        rows = rows - 1
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    if MISTAKE == "stub":
        mask = tl.zeros((ROWS, BLOCK_N), dtype=tl.int1)
    if MISTAKE == "mask-columns-only":  # a 1-D mask: every row of the tile, the last one's padding rows too
        mask = cols < n_cols
    if MISTAKE == "mask-rows-only":
        mask = rows[:, None] < n_rows
    if MISTAKE == "mask-1d-rows":  # [ROWS] against a [ROWS, BLOCK_N] block: does not broadcast
        mask = rows < n_rows
    if MISTAKE == "rows<=n_rows":
        mask = (rows[:, None] <= n_rows) & (cols[None, :] < n_cols)
    x_stride = stride_x
    y_stride = stride_y
    if MISTAKE == "width-for-x" or MISTAKE == "width-everywhere":
        x_stride = n_cols
    if MISTAKE == "width-for-y" or MISTAKE == "width-everywhere":
        y_stride = n_cols
    if MISTAKE == "stride_x-for-y":
        y_stride = stride_x
    x = tl.load(X + rows[:, None] * x_stride + cols[None, :], mask=mask, other=1.0 if MISTAKE == "other-1" else 0.0)
    if MISTAKE != "no-upcast":
        x = x.to(tl.float32)
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    if MISTAKE == "rstd-stub":
        rstd = tl.zeros((ROWS,), dtype=tl.float32)
    elif MISTAKE == "axis-0":
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    elif MISTAKE == "divide-by-BLOCK_N":
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / BLOCK_N + eps)
    elif MISTAKE == "eps-outside-sqrt":
        rstd = 1.0 / (tl.sqrt(tl.sum(x * x, axis=1) / n_cols) + eps)
    elif MISTAKE == "eps-after-rsqrt":
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / n_cols) + eps
    elif MISTAKE == "sum-not-mean":
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) + eps)
    elif MISTAKE == "no-rsqrt":
        rstd = tl.sum(x * x, axis=1) / n_cols + eps
    elif MISTAKE == "divide-by-ROWS":
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / ROWS + eps)
    elif MISTAKE == "square-of-mean":
        mean = tl.sum(x, axis=1) / n_cols
        rstd = tl.math.rsqrt(mean * mean + eps)
    elif MISTAKE == "centred":
        centred = tl.where(mask, x - (tl.sum(x, axis=1) / n_cols)[:, None], 0.0)
        rstd = tl.math.rsqrt(tl.sum(centred * centred, axis=1) / n_cols + eps)
    else:
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    x_hat = cast_to(x * rstd[:, None], X.dtype.element_ty).to(tl.float32)
    if MISTAKE == "x_hat-unrounded":
        x_hat = x * rstd[:, None]
    y = cast_to(x_hat * w[None, :], Y.dtype.element_ty)
    if MISTAKE == "to-bf16":
        y = (x_hat * w[None, :]).to(Y.dtype.element_ty)
    tl.store(Y + rows[:, None] * y_stride + cols[None, :], y, mask=mask)


class _Planted:
    """A planted kernel with its MISTAKE fixed, launched like the reader's: ``kernel[grid](*args, ROWS=, BLOCK_N=)``."""

    def __init__(self, kernel, mistake):
        self.kernel, self.mistake = kernel, mistake

    def __getitem__(self, grid):
        return lambda *args, **meta: self.kernel[grid](*args, **meta, MISTAKE=self.mistake)


PLANTED_TILE = {
    "stub": ["nothing_written"],
    "rstd-stub": ["placeholder_zeros"],
    "mask-columns-only": ["rows_past_end"],
    "mask-rows-only": ["columns_past_end"],
    "mask-1d-rows": ["tile_shapes_forward"],
    "rows<=n_rows": ["row_at_end"],
    "row+1": ["first_rows_skipped"],
    "row-1": ["rows_before_start"],
    "width-for-x": ["input_stride"],
    "width-for-y": ["output_stride"],
    "stride_x-for-y": ["output_stride"],
    "width-everywhere": ["output_stride", "input_stride"],
    "axis-0": ["tile_shapes_forward"],
    "no-upcast": ["no_upcast"],
    "divide-by-BLOCK_N": ["divide_by_block"],
    "eps-outside-sqrt": ["eps_outside_sqrt"],
    "eps-after-rsqrt": ["no_eps"],
    "sum-not-mean": ["sum_not_mean"],
    "divide-by-ROWS": ["divide_by_rows"],
    "no-rsqrt": ["no_rsqrt"],
    "int32-rows": ["int32_rows"],
    "square-of-mean": ["square_of_mean"],
    "centred": ["centred"],
    "other-1": ["masked_other"],
    "x_hat-unrounded": ["cast_order"],
    "to-bf16": ["truncation"],
}


@pytest.mark.parametrize("mistake", list(PLANTED_TILE))
def test_tile_check_names_each_planted_mistake(mistake, capsys):
    report = check_rms_norm_tile(_Planted(_tile_kernel, mistake))
    assert not report.passed and report.message.startswith("✗ ")
    for key in PLANTED_TILE[mistake]:
        assert says(key, report.message), (key, report.message)
    assert capsys.readouterr().out.strip() == report.message  # printed, not raised


def test_tile_check_names_the_wrong_stride():
    report = check_rms_norm_tile(_Planted(_tile_kernel, "stride_x-for-y"), verbose=False)
    assert "y's rows were written 80 elements apart (stride_x, x's row stride), but they are 72 apart" in report.message
    report = check_rms_norm_tile(_Planted(_tile_kernel, "width-for-x"), verbose=False)
    assert "rows of x were read 64 elements apart (n_cols, the width), but they are 80 apart" in report.message


def test_tile_check_passes_the_right_kernel():
    report = check_rms_norm_tile(_Planted(_tile_kernel, "none"), verbose=False)
    assert report.passed, report.message
    assert report.message.startswith("✓ tile kernel correct on 4 inputs")
    assert "rows past element 2**31 read and written where they are (int64 row offsets)" in report.message


def test_tile_check_runs_int32_rows_past_two_to_the_31():
    # Only a row offset past 2**31 shows int32 rows; the check launches the kernel on one, in an address range mapped
    # without memory behind it on the CPU, and reads the rows back.
    report = check_rms_norm_tile(_Planted(_tile_kernel, "int32-rows"), verbose=False)
    assert "row 2 of y was never written while the rows before are right: row 2 starts at element 2,147,483,776" \
        in report.message, report.message


# ---------------------------------------------------------------------------------------------------------------------
# Chapter 03's backward tile kernel: masks, dx and the dW partial sums, one mistake at a time
# ---------------------------------------------------------------------------------------------------------------------


@triton.jit
def _bwd_tile_kernel(
    X, W, DY, RSTD, DX, DW_PARTIALS, n_rows, n_cols, stride_x, stride_dy, stride_dx,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, MISTAKE: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    if MISTAKE == "dw-bfloat16":
        dw_acc = tl.zeros((BLOCK_N,), dtype=X.dtype.element_ty)
    else:
        dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    x_stride = stride_x
    dy_stride = stride_dy
    if MISTAKE == "width-for-dy" or MISTAKE == "width-everywhere":
        dy_stride = n_cols
    if MISTAKE == "width-everywhere":
        x_stride = n_cols
    for block in range(pid, tl.cdiv(n_rows, ROWS), tl.num_programs(0)):
        rows = (block * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        if MISTAKE == "int32-rows":  # rows * stride wraps past 2**31
            rows = block * ROWS + tl.arange(0, ROWS)
        row_ok = rows < n_rows
        if MISTAKE == "rows<=n_rows":
            row_ok = rows <= n_rows
        ok = row_ok[:, None] & col_ok[None, :]
        if MISTAKE == "stub":
            row_ok = tl.zeros((ROWS,), dtype=tl.int1)
            ok = tl.zeros((ROWS, BLOCK_N), dtype=tl.int1)
        if MISTAKE == "no-row-mask":
            ok = col_ok[None, :] & (rows >= 0)[:, None]
        x = tl.load(X + rows[:, None] * x_stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * dy_stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        x_hat = x * rstd[:, None]
        g = dy * w[None, :]
        x_hat_rounded = cast_to(x_hat, X.dtype.element_ty).to(tl.float32)
        divisor = n_cols
        if MISTAKE == "divide-by-BLOCK_N":
            divisor = BLOCK_N
        mean = (tl.sum(g * x_hat, axis=1) / divisor)[:, None]
        if MISTAKE == "stub" or MISTAKE == "dx-stub":
            dx = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        elif MISTAKE == "sign":
            dx = rstd[:, None] * (g + x_hat * mean)
        elif MISTAKE == "no-mean-term":
            dx = rstd[:, None] * g
        elif MISTAKE == "dx-axis-0":  # one mean per column, over the tile's rows, broadcast without [:, None]
            dx = rstd[:, None] * (g - x_hat * (tl.sum(g * x_hat, axis=0) / n_cols))
        else:
            dx = rstd[:, None] * (g - x_hat * mean)
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], cast_to(dx, DX.dtype.element_ty), mask=ok)
        if MISTAKE == "stub" or MISTAKE == "dx-stub" or MISTAKE == "dw-stub":
            dw_acc += tl.zeros((BLOCK_N,), dtype=tl.float32)
        elif MISTAKE == "dw-axis-1":
            dw_acc += tl.sum(dy * x_hat_rounded, axis=1)
        elif MISTAKE == "dw-bfloat16":
            dw_acc += tl.sum(dy * x_hat_rounded, axis=0).to(X.dtype.element_ty)
        elif MISTAKE == "dw-assigned":
            dw_acc = tl.sum(dy * x_hat_rounded, axis=0)
        elif MISTAKE == "dw-uses-g":
            dw_acc += tl.sum(g * x_hat_rounded, axis=0)
        elif MISTAKE == "dw-uses-x":
            dw_acc += tl.sum(dy * x, axis=0)
        elif MISTAKE == "dw-unrounded":
            dw_acc += tl.sum(dy * x_hat, axis=0)
        elif MISTAKE == "dw-sign":
            dw_acc -= tl.sum(dy * x_hat_rounded, axis=0)
        elif MISTAKE == "dw-not-summed":
            dw_acc += dy * x_hat_rounded
        elif MISTAKE == "dw-rstd-twice":
            dw_acc += tl.sum(dy * x_hat_rounded * rstd[:, None], axis=0)
        else:
            dw_acc += tl.sum(dy * x_hat_rounded, axis=0)
    tl.store(DW_PARTIALS + pid * n_cols + cols, dw_acc, mask=col_ok)


PLANTED_BACKWARD_TILE = {
    "stub": ["nothing_written"],
    "dx-stub": ["placeholder_zeros"],
    "dw-stub": ["dw_zero"],
    "no-row-mask": ["rows_past_end"],
    "rows<=n_rows": ["row_at_end"],
    "sign": ["dx_sign"],
    "no-mean-term": ["no_correction"],
    "divide-by-BLOCK_N": ["dx_divide_by_block"],
    "width-for-dy": ["input_stride"],
    "width-everywhere": ["inputs_width"],
    "dw-axis-1": ["tile_shapes_backward"],
    "dw-bfloat16": ["dw_not_float32"],
    "dw-assigned": ["dw_last_tile"],
    "dw-uses-g": ["dw_used_g"],
    "dw-uses-x": ["dw_used_x"],
    "dw-unrounded": ["dw_unrounded"],
    "dw-sign": ["dw_sign"],
    "dx-axis-0": ["dx_axis_0"],
    "dw-not-summed": ["dw_not_summed"],
    "dw-rstd-twice": ["dw_rstd_twice"],
    "int32-rows": ["int32_rows"],
}


@pytest.mark.parametrize("mistake", list(PLANTED_BACKWARD_TILE))
def test_backward_tile_check_names_each_planted_mistake(mistake, capsys):
    report = check_rms_norm_backward_tile(_Planted(_bwd_tile_kernel, mistake))
    assert not report.passed and report.message.startswith("✗ ")
    for key in PLANTED_BACKWARD_TILE[mistake]:
        assert says(key, report.message), (key, report.message)
    assert capsys.readouterr().out.strip() == report.message


def test_backward_tile_check_passes_the_right_kernel():
    report = check_rms_norm_backward_tile(_Planted(_bwd_tile_kernel, "none"), verbose=False)
    assert report.passed, report.message
    assert report.message.startswith("✓ backward tile kernel correct on 3 inputs")


def test_a_bfloat16_accumulator_is_far_from_float32_sums():
    # The threshold between the two is what the diagnosis rests on: a float32 accumulator stays well under DW_TIGHT.
    report = check_rms_norm_backward_tile(_Planted(_bwd_tile_kernel, "none"), verbose=False)
    error = float(report.message.rsplit("sums) ", 1)[1].rstrip("."))
    assert error < DW_TIGHT / 10


def test_a_shape_clash_on_the_gpu_is_recognised_too():
    # A compiled kernel reports the clash inside a CompilationError whose last line is not the clash itself.
    class Compiled:
        def __getitem__(self, grid):
            def launch(*args, **meta):
                raise RuntimeError("at 12:8:\n    rstd = ...\n        ^\nValueError('Cannot make_shape_compatible: "
                                   "incompatible dimensions at index 0: 64 and 4')\nThe above exception was raised")
            return launch

    assert says("tile_shapes_forward", check_rms_norm_tile(Compiled(), verbose=False).message)


# ---------------------------------------------------------------------------------------------------------------------
# The package's tile kernels, the answers of chapters 02 and 03, are printed only once the reader's kernel passes
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("notebook, kernel, report", [
    ("02_rmsnorm_forward.ipynb", "rms_norm_fwd_kernel", "report"),
    ("03_rmsnorm_backward.ipynb", "rms_norm_bwd_kernel", "tile_report"),
])
def test_the_package_kernel_is_printed_only_once_the_exercise_passes(notebook, kernel, report):
    cells = json.loads((Path(__file__).resolve().parents[2] / "notebooks" / notebook).read_text())["cells"]
    printing = [cell for cell in cells if f"kernels.rmsnorm.{kernel}.fn" in "".join(cell["source"])]
    assert len(printing) == 1
    source = "".join(printing[0]["source"])
    assert f"if {report} or show_package_kernel:" in source and "show_package_kernel = False" in source
    shown = "\n".join(str(cell.get("outputs", "")) for cell in cells)
    assert "def rms_norm_fwd_kernel(" not in shown and "def rms_norm_bwd_kernel(X, W, DY" not in shown


def test_the_tile_check_says_when_it_cannot_map_the_range(monkeypatch):
    import kernels.exercises.rmsnorm as module

    monkeypatch.setattr(module, "mapped_buffer", lambda *args: None)
    report = check_rms_norm_tile(load("rms_norm_tile_kernel"), verbose=False)
    assert report.passed and "int64 row offsets NOT checked" in report.message, report.message


# ---------------------------------------------------------------------------------------------------------------------
# Chapter 03's dx kernel: the exercise line, written wrong the ways a reader writes it
# ---------------------------------------------------------------------------------------------------------------------


@triton.jit
def _dx_kernel(X, W, DY, RSTD, DX, n_cols, stride_x, stride_dy, stride_dx, BLOCK_N: tl.constexpr,
               MISTAKE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD + row)
    x_hat = x * rstd
    g = dy * w
    mean = tl.sum(g * x_hat, axis=0) / n_cols
    if MISTAKE == "stub":
        dx = tl.zeros_like(x)
    elif MISTAKE == "divide-by-BLOCK_N":
        dx = rstd * (g - x_hat * (tl.sum(g * x_hat, axis=0) / BLOCK_N))
    elif MISTAKE == "sum-not-mean":
        dx = rstd * (g - x_hat * tl.sum(g * x_hat, axis=0))
    elif MISTAKE == "plus":
        dx = rstd * (g + x_hat * mean)
    elif MISTAKE == "no-rstd":
        dx = g - x_hat * mean
    elif MISTAKE == "rstd-on-g-only":
        dx = rstd * g - x_hat * mean
    elif MISTAKE == "dy-for-g":
        dx = rstd * (dy - x_hat * (tl.sum(dy * x_hat, axis=0) / n_cols))
    elif MISTAKE == "mean-of-g":
        dx = rstd * (g - x_hat * (tl.sum(g, axis=0) / n_cols))
    elif MISTAKE == "dy-in-mean":
        dx = rstd * (g - x_hat * (tl.sum(dy * x_hat, axis=0) / n_cols))
    elif MISTAKE == "x-twice":
        dx = rstd * (g - x * (tl.sum(g * x, axis=0) / n_cols))
    elif MISTAKE == "no-correction":
        dx = rstd * g
    else:
        dx = rstd * (g - x_hat * mean)
    tl.store(DX + row * stride_dx + cols, cast_to(dx, DX.dtype.element_ty), mask=mask)


def triton_dx(mistake):
    """The notebook's rms_norm_dx, launching the kernel above with one wrong exercise line."""
    def rms_norm_dx(dy, x, weight, rstd):
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        _dx_kernel[(x.shape[0],)](x, weight, dy, rstd, out, x.shape[1], x.stride(0), dy.stride(0), out.stride(0),
                                  BLOCK_N=triton.next_power_of_2(x.shape[1]), MISTAKE=mistake)
        return out

    return rms_norm_dx


PLANTED_DX_KERNEL = {
    "stub": "placeholder_zeros",
    "divide-by-BLOCK_N": "dx_divide_by_block",
    "sum-not-mean": "dx_sum_not_mean",
    "plus": "dx_sign",
    "no-rstd": "no_rstd",
    "rstd-on-g-only": "x_for_x_hat",
    "dy-for-g": "dx_no_weight",
    "mean-of-g": "mean_of_g",
    "dy-in-mean": "dy_in_mean",
    "x-twice": "x_for_x_hat_twice",
    "no-correction": "no_correction",
}


@pytest.mark.parametrize("mistake", list(PLANTED_DX_KERNEL))
def test_dx_check_names_each_wrong_line_of_the_kernel(mistake):
    report = check_rms_norm_backward(triton_dx(mistake), verbose=False)
    assert not report.passed
    assert says(PLANTED_DX_KERNEL[mistake], report.message), report.message


def test_dx_check_passes_the_right_kernel():
    assert check_rms_norm_backward(triton_dx("none"), verbose=False)


# ---------------------------------------------------------------------------------------------------------------------
# Finished answers are refused, however the reader reaches them; the stubs as the chapters ship them fail
# ---------------------------------------------------------------------------------------------------------------------


TRIPPED = "that is a finished answer to this exercise"


def notebook_function(source: str, name: str):
    """A function defined the way a notebook cell defines it: imports and all, in a namespace of its own."""
    namespace = {"__name__": "__notebook__"}
    exec(source, namespace)  # noqa: S102  (the test's own source)
    return namespace[name]


FINISHED_BACKWARD = {
    # Chapter 03 checked its package's dx this way: the finished backward, called through the exercise's check.
    "package-backward": ("from kernels.rmsnorm import rms_norm_backward\n"
                         "f = lambda dy, x, w, rstd: rms_norm_backward(dy, x, w, rstd, compute_dw=False)[0]",
                         "kernels.rmsnorm.rms_norm_backward"),
    "package-module-attribute": ("import kernels.rmsnorm\n"
                                 "f = lambda dy, x, w, rstd: kernels.rmsnorm.rms_norm_backward(dy, x, w, rstd)[0]",
                                 "kernels.rmsnorm.rms_norm_backward"),
    "operator": ("import torch, kernels\n"
                 "f = lambda dy, x, w, rstd: torch.ops.kernels.rms_norm_bwd(dy, x, w, rstd, False)[0]",
                 "kernels.rmsnorm.rms_norm_bwd_kernel.run"),
    "autograd-through-the-package": (
        "import torch, kernels\n"
        "def f(dy, x, w, rstd):\n"
        "    x = x.detach().requires_grad_()\n"
        "    kernels.rms_norm(x, w).backward(dy)\n"
        "    return x.grad\n",
        "kernels.rmsnorm.rms_norm"),
    "autograd-through-plain-pytorch": (
        "import torch\n"
        "def f(dy, x, w, rstd):\n"
        "    x = x.detach().float().requires_grad_()\n"
        "    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()\n"
        "    return torch.autograd.grad(y, x, dy.float())[0].to(dy.dtype)\n",
        "torch.autograd.grad"),
    "a-jacobian-transform": ("import torch\n"
                             "def f(dy, x, w, rstd):\n"
                             "    jacobian = torch.func.jacrev(lambda t: t * w)\n"
                             "    return dy\n",
                             "torch.func.jacrev"),
    "the-hidden-solution": ("from kernels.exercises.solutions import load\n"
                            "f = lambda dy, x, w, rstd: load('rms_norm_dx')(dy, x, w, rstd)",
                            "kernels.exercises.solutions.load"),
}


@pytest.mark.parametrize("name", list(FINISHED_BACKWARD))
def test_dx_check_refuses_finished_answers(name):
    source, called = FINISHED_BACKWARD[name]
    report = check_rms_norm_backward(notebook_function(source, "f"), verbose=False)
    assert not report.passed
    assert f"your code called {called}" in report.message and TRIPPED in report.message, report.message


def test_dx_check_refuses_the_finished_backward_handed_over_itself():
    report = check_rms_norm_backward(rms_norm_backward, verbose=False)
    assert not report.passed and "kernels.rmsnorm.rms_norm_backward" in report.message, report.message


FINISHED_FORWARD = {
    "package": ("import kernels\nf = lambda x, w, eps: kernels.rms_norm(x, w, eps)", "kernels.rmsnorm.rms_norm"),
    "package-forward": ("from kernels.rmsnorm import rms_norm_forward\n"
                        "f = lambda x, w, eps: rms_norm_forward(x, w, eps)[0]", "kernels.rmsnorm.rms_norm_forward"),
    "operator": ("import torch, kernels\nf = lambda x, w, eps: torch.ops.kernels.rms_norm_fwd(x, w, eps)[0]",
                 "kernels.rmsnorm.rms_norm_fwd_kernel.run"),
    "reference": ("from kernels.reference import rms_norm_reference\nf = rms_norm_reference",
                  "kernels.reference.rms_norm_reference"),
    "functional": ("import torch.nn.functional as F\n"
                   "f = lambda x, w, eps: F.rms_norm(x.float(), (x.shape[-1],), w.float(), eps).to(x.dtype)",
                   "torch.nn.functional.rms_norm"),
    "torch-op": ("import torch\nf = lambda x, w, eps: torch.rms_norm(x, (x.shape[-1],), w, eps)", "torch.rms_norm"),
    "hugging-face": ("import torch\nfrom transformers.models.llama.modeling_llama import LlamaRMSNorm\n"
                     "def f(x, w, eps):\n"
                     "    norm = LlamaRMSNorm(x.shape[-1], eps).to(x.dtype)\n"
                     "    norm.weight.data = w\n"
                     "    return norm(x)\n",
                     "LlamaRMSNorm.forward"),
}


@pytest.mark.parametrize("name", list(FINISHED_FORWARD))
def test_forward_check_refuses_finished_answers(name):
    source, called = FINISHED_FORWARD[name]
    report = check_rms_norm_forward(notebook_function(source, "f"), verbose=False)
    assert not report.passed
    assert f"your code called {called}" in report.message or called in report.message, report.message
    assert TRIPPED in report.message, report.message


def test_tile_checks_refuse_the_package_kernels():
    import kernels.rmsnorm

    report = check_rms_norm_tile(kernels.rmsnorm.rms_norm_fwd_kernel, verbose=False)
    assert not report.passed and "kernels.rmsnorm.rms_norm_fwd_kernel.run" in report.message, report.message
    report = check_rms_norm_backward_tile(kernels.rmsnorm.rms_norm_bwd_kernel, verbose=False)
    assert not report.passed and "kernels.rmsnorm.rms_norm_bwd_kernel.run" in report.message, report.message


def test_a_tile_kernel_wrapper_that_launches_the_package_kernel_is_refused():
    import kernels.rmsnorm

    class Wrapper:  # launched like a kernel, but hands the work to the package
        def __getitem__(self, grid):
            def launch(X, W, Y, n_rows, n_cols, stride_x, stride_y, eps, ROWS, BLOCK_N):
                rstd = torch.empty(n_rows, device=X.device)
                kernels.rmsnorm.rms_norm_fwd_kernel[grid](X, W, Y, rstd, n_rows, n_cols, stride_x, stride_y, eps,
                                                          ROWS=ROWS, BLOCK_N=BLOCK_N)
            return launch

    report = check_rms_norm_tile(Wrapper(), verbose=False)
    assert not report.passed and TRIPPED in report.message, report.message


def notebook_cell(notebook: str, cell_id: str) -> str:
    cells = json.loads((Path(__file__).resolve().parents[2] / "notebooks" / notebook).read_text())["cells"]
    return "".join(next(cell for cell in cells if cell.get("id") == cell_id)["source"])


NOTEBOOK_IMPORTS = ("import torch\nimport triton\nimport triton.language as tl\n"
                    "from kernels.triton_utils import cast_to\n")


@pytest.mark.parametrize("notebook, cell_id, name, check, key", [
    ("02_rmsnorm_forward.ipynb", "02-31", "rms_norm_tile_kernel", check_rms_norm_tile, "nothing_written"),
    ("03_rmsnorm_backward.ipynb", "03-06", "rms_norm_dx", check_rms_norm_backward, "placeholder_zeros"),
    ("03_rmsnorm_backward.ipynb", "03-ex2-stub", "rms_norm_bwd_tile_kernel", check_rms_norm_backward_tile,
     "nothing_written"),
])
def test_the_stubs_as_shipped_fail_with_their_message(notebook, cell_id, name, check, key):
    fn = notebook_function(NOTEBOOK_IMPORTS + notebook_cell(notebook, cell_id), name)
    report = check(fn, verbose=False)
    assert not report.passed and says(key, report.message), report.message


def test_the_dx_formula_is_shown_only_once_the_exercise_passes():
    cells = json.loads((Path(__file__).resolve().parents[2] / "notebooks" / "03_rmsnorm_backward.ipynb").read_text())
    cells = cells["cells"]
    gate = next(i for i, cell in enumerate(cells) if cell.get("id") == "03-dx-formula")
    assert "if report or show_formula:" in "".join(cells[gate]["source"])
    assert 'solution("rms_norm_dx")' in "".join(cells[gate]["source"])
    # Above the gate: the derivation says what dx depends on, never the finished expression, in words or in code.
    answers = ("mean}(g \\odot \\hat x)", "mean(g ⊙ x̂)", "g_k - \\hat x_k", "(g * x_hat)", "g - x_hat *")
    for cell in cells[:gate]:
        text = "".join(cell["source"]) + str(cell.get("outputs", ""))
        assert not any(answer in text for answer in answers), (cell.get("id"), text[:200])
