"""Check for the exercise of chapter 10: the gradient of one vocabulary slice, recomputed in the
backward pass.

The reader writes ``slice_gradient(logits, lse, target, col_start, scale, ignore_index)``: for a
[tokens, width] slice of logits holding columns ``col_start ... col_start + width − 1`` of the
vocabulary, the logsumexp of every token over the whole vocabulary and the target classes, return
d(loss)/d(logits) for that slice, (softmax − onehot) · scale, with a zero row for an ignored target.
The check runs it on slices chosen so that each usual mistake gives a different wrong answer
(targets inside the slice, before it and after it; a slice that does not start at column 0; ignored
rows, with ``ignore_index`` −100 and −1; a scale that is not 1; bfloat16 logits) and says which
mistake it sees, on which slice.

The sentence that names each mistake is in ``DIAGNOSES``; the tests feed every mistake to the check
and look for its sentence. The check prints its verdict, returns True when everything is right, and
never raises.

The reader's code runs with the exercise's finished answers out of reach
(``reach.FORBIDDEN["slice_gradient"]`` and ``["slice_gradient_kernel"]``: the package's
slice-gradient kernel and gradient pass, the float64 reference of this module, PyTorch's
cross-entropy and autograd): calling one, or handing one to the check, is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton

from kernels import runtime

from .reach import FinishedCodeCalled, call_learner, finished_answer
from .sentences import sentence_lookup

_OK = "✓ "
_WRONG = "✗ "

DIAGNOSES = {
    "stub": ("slice_gradient is still the stub (it raises NotImplementedError): write the gradient "
             "of one slice"),
    "raised": "slice_gradient raised {error}",
    "outside_raised": ("slice_gradient raised {error}: some targets have no column in this slice "
                       "(the targets of other slices, and ignore_index). Build the one-hot by "
                       "comparing, col_start + column == target, rather than by indexing with the "
                       "target: a row whose target lies outside col_start … col_start+width−1 gets "
                       "no −1 here"),
    "shape": "slice_gradient must return a tensor shaped like the slice, {expected}; it returned {got}",
    "no_offset": ("the one-hot compares the target with the slice's own column numbers 0 … "
                  "width−1: the slice holds vocabulary columns col_start … col_start+width−1, so "
                  "compare the target with col_start + column"),
    "offset_off_by_one": ("the one-hot is one column off: column j of the slice is class col_start "
                          "+ j exactly, so the −1 of target t sits at column t − col_start"),
    "outside_clamped": ("a target outside this slice put its −1 in the slice's first or last "
                        "column (the target's column was clamped into the slice): a target of "
                        "another slice has no column here, and its row is the softmax alone"),
    "outside_wrapped": ("a target outside this slice put its −1 in a column of this slice (the "
                        "target's column was taken modulo width): a target of another slice has no "
                        "column here, and its row is the softmax alone"),
    "slice_softmax": ("the softmax is normalised over this slice alone: divide by the whole "
                      "vocabulary's sum, i.e. use exp(logits − lse) with the lse you are given"),
    "sign": ("the sign is flipped: the gradient is (softmax − onehot) · scale, not (onehot − "
             "softmax) · scale"),
    "no_scale": ("the gradient is not multiplied by scale (1 / the number of counted targets for a "
                 "mean, times the incoming gradient)"),
    "divided_by_scale": ("the gradient is divided by scale: multiply by it (scale is already 1 / "
                         "the number of counted targets)"),
    "scale_twice": "the gradient is multiplied by scale twice: once is enough",
    "mean_over_rows": ("the gradient is divided by the number of rows of the slice instead of "
                       "multiplied by scale: scale is 1 / the number of counted targets of the "
                       "whole batch (ignored rows do not count), which this slice's rows cannot "
                       "tell you"),
    "ignored_rows_count": ("rows whose target is ignore_index must be zero: they do not count in "
                           "the loss, so they get no gradient"),
    "ignore_index_hardcoded": ("with ignore_index = {ignore_index}, the rows whose target is "
                               "{ignore_index} are not zero (the rows of −100 were): use the "
                               "ignore_index argument, not the constant −100"),
    "no_float32": ("the float32 slices are right but this bfloat16 one is not: elements are off by "
                   "up to {worst:.1%}, where rounding a float32 answer to bfloat16 once moves them "
                   "by at most 0.4%. The arithmetic ran in bfloat16 (or lse was rounded to it): "
                   "upcast first, x = logits.float(), keep lse in float32, compute exp(x − lse) "
                   "and the rest in float32, and round at most once, at the end"),
    "unrecognised": ("the gradient differs from (softmax − onehot) · scale by up to {worst:.3g}, "
                     "and none of the usual mistakes gives this answer: print yours beside the "
                     "reference for this slice"),
}

# Elementwise tolerances: float32 arithmetic on float32 logits; for bfloat16 logits, up to two roundings to
# bfloat16 (2⁻⁸ each) of an answer computed in float32.
_TOL = {torch.float32: (1e-5, 1e-7), torch.bfloat16: (2.0**-7, 1e-6)}


diagnosis = sentence_lookup(DIAGNOSES)


def reference_slice_gradient(logits, lse, target, col_start, scale, ignore_index=-100):
    """The right answer, in float64: ``(softmax − onehot) · scale`` over the slice's columns, zero on
    ignored rows.

    Args:
        logits: the slice, [tokens, width]: columns ``col_start`` … ``col_start + width − 1`` of the
            vocabulary.
        lse: each row's logsumexp over the whole vocabulary, [tokens].
        target: each row's target word (anywhere in the vocabulary), [tokens].
        col_start: the vocabulary column of the slice's first column.
        scale: the factor of the gradient (1 / the count of labels for a mean loss).
        ignore_index: the target of rows that do not count.

    Returns:
        the slice's gradient, float64 [tokens, width].
    """
    x = logits.to(torch.float64)
    p = torch.exp(x - lse.to(torch.float64)[:, None])
    cols = torch.arange(col_start, col_start + x.shape[1], device=x.device)
    onehot = (cols[None, :] == target[:, None]).to(torch.float64)
    counted = (target != ignore_index).to(torch.float64)[:, None]
    return (p - onehot) * scale * counted


@dataclass(frozen=True)
class Case:
    """One slice the reader's function is run on."""

    label: str
    logits: torch.Tensor  # [tokens, width], columns col_start … col_start + width − 1 of the vocabulary
    lse: torch.Tensor  # float32, over the whole vocabulary
    target: torch.Tensor
    col_start: int
    scale: float
    ignore_index: int = -100

    def __str__(self) -> str:
        return self.label


def _cases() -> list[Case]:
    g = torch.Generator().manual_seed(10)
    vocab, width, tokens = 40, 12, 6
    full = torch.randn(tokens, vocab, generator=g) * 2
    lse = torch.logsumexp(full, dim=1)
    target = torch.tensor([3, 17, 20, -100, 39, 14])  # inside the middle slice 12 … 23, before it, after it
    # ignore_index = −1: hard-coding −100 counts these rows
    minus_one = torch.tensor([13, -1, 22, 5, -1, 30])
    # bfloat16 logits of a larger spread (an lse near 20): lse rounded to bfloat16 is off by up to 0.06.
    big = (torch.randn(tokens, vocab, generator=g) * 6 + 10).to(torch.bfloat16)
    big_lse = torch.logsumexp(big.float(), dim=1)
    return [
        Case("the first slice (columns 0 … 11), scale 1", full[:, :width], lse, target, 0, 1.0),
        Case("a middle slice (columns 12 … 23), scale 0.2", full[:, 12:24].contiguous(), lse,
             target, 12, 0.2),
        Case("the last, narrower slice (columns 36 … 39), scale 0.5", full[:, 36:].contiguous(),
             lse, target, 36, 0.5),
        Case("a middle slice (columns 12 … 23) with ignore_index = −1, scale 0.25",
             full[:, 12:24].contiguous(), lse, minus_one, 12, 0.25, ignore_index=-1),
        Case("a middle slice (columns 12 … 23) of bfloat16 logits, scale 0.25",
             big[:, 12:24].contiguous(), big_lse, target, 12, 0.25),
    ]


def _onehot(local: torch.Tensor, width: int) -> torch.Tensor:
    """Rows of zeros with a 1 at column ``local`` where 0 ≤ local < width (no 1 elsewhere)."""
    return (torch.arange(width)[None, :] == local[:, None]).to(torch.float64)


def _mistakes(case: Case) -> list[tuple[str, torch.Tensor]]:
    """What each usual mistake returns on this slice, in float64, with the key of its diagnosis."""
    x = case.logits.to(torch.float64)
    width = x.shape[1]
    p = torch.exp(x - case.lse.to(torch.float64)[:, None])
    local = case.target - case.col_start
    counted = (case.target != case.ignore_index).to(torch.float64)[:, None]
    right = _onehot(local, width)
    grad = (p - right) * case.scale * counted
    found = [
        ("no_offset", (p - _onehot(case.target, width)) * case.scale * counted),
        ("offset_off_by_one", (p - _onehot(local - 1, width)) * case.scale * counted),
        ("offset_off_by_one", (p - _onehot(local + 1, width)) * case.scale * counted),
        ("outside_clamped", (p - _onehot(local.clamp(0, width - 1), width)) * case.scale * counted),
        ("outside_wrapped", (p - _onehot(local % width, width)) * case.scale * counted),
        ("slice_softmax", (torch.softmax(x, dim=1) - right) * case.scale * counted),
        ("sign", -grad),
        ("no_scale", grad / case.scale),
        ("divided_by_scale", grad / case.scale**2),
        ("scale_twice", grad * case.scale),
        ("mean_over_rows", grad / case.scale / x.shape[0]),
    ]
    # before the next: where no target is −100, hard-coding it counts every row
    if case.ignore_index != -100:
        counts_minus_100 = (case.target != -100).to(torch.float64)[:, None]
        found.append(("ignore_index_hardcoded", (p - right) * case.scale * counts_minus_100))
    found.append(("ignored_rows_count", (p - right) * case.scale))
    return found


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    rtol, atol = _TOL[dtype]
    return bool(torch.allclose(a, b, rtol=rtol, atol=atol))


def _has_no_column(case: Case) -> bool:
    """Whether some target of this slice (an ignored one included) has no column in it."""
    local = case.target - case.col_start
    return bool(((local < 0) | (local >= case.logits.shape[1])).any())


def _diagnose(fn: Callable, case: Case, exercise: str = "slice_gradient", code=None) -> str | None:
    where = f" (seen on {case})"
    try:
        got = call_learner(exercise, fn, case.logits.clone(), case.lse.clone(), case.target.clone(),
                           case.col_start, case.scale, case.ignore_index, watch=code)
    except FinishedCodeCalled as called:
        return str(called)
    except NotImplementedError:
        return diagnosis("stub")
    except Exception as exc:  # noqa: BLE001  (the reader's code may fail in any way: say how)
        text = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
        error = f"{type(exc).__name__}: {text}"
        indexing = isinstance(exc, IndexError) or any(
            word in text.lower() for word in ("index", "one_hot", "class values", "out of bounds"))
        key = "outside_raised" if indexing and _has_no_column(case) else "raised"
        return diagnosis(key, error=error) + where
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(case.logits.shape):
        shape = f"a tensor of shape {tuple(got.shape)}" if isinstance(got,
                                                                      torch.Tensor) else type(got).__name__
        return diagnosis("shape", expected=tuple(case.logits.shape), got=shape) + where
    got = got.detach().cpu().to(torch.float64)
    expected = reference_slice_gradient(case.logits, case.lse, case.target, case.col_start, case.scale,
                                        case.ignore_index)
    dtype = case.logits.dtype
    if _close(got, expected, dtype):
        return None
    for key, wrong in _mistakes(case):
        if not _close(wrong, expected, dtype) and _close(got, wrong, dtype):
            return diagnosis(key, ignore_index=case.ignore_index) + where
    error = ((got - expected).norm() / expected.norm()).item()
    # close, but not as close as one rounding: bfloat16 arithmetic
    if dtype == torch.bfloat16 and error < 0.25:
        worst = ((got - expected).abs() / (expected.abs() + _TOL[dtype][1])).max().item()
        return diagnosis("no_float32", worst=worst) + where
    return diagnosis("unrecognised", worst=(got - expected).abs().max().item()) + where


def check_slice_gradient(fn: Callable, verbose: bool = True) -> bool:
    """Run ``fn(logits, lse, target, col_start, scale, ignore_index)`` on every slice of the check;
    print what is wrong (or that all is right, unless ``verbose=False``) and return whether it
    passed (chapter 10, notebooks/10_linear_cross_entropy.ipynb).

    Never raises for the reader's code: an error it raises, or a call of a finished answer, is
    reported in the verdict.

    Args:
        fn: the reader's ``slice_gradient(logits, lse, target, col_start, scale, ignore_index) ->
            grad``, arguments as ``reference_slice_gradient`` takes them (logits float32 or
            bfloat16), grad the slice's shape.
        verbose: print the verdict: ✓ and what was checked, or ✗ with the mistake recognised and
            the slice it showed on.

    Returns:
        True when every slice is right, False otherwise.
    """
    for case in _cases():
        problem = _diagnose(fn, case)
        if problem:
            if verbose:
                print(_WRONG + problem)
            return False
    if verbose:
        print(_OK + ("slice_gradient is right on the first, a middle and the last slice, with "
                     "targets inside and outside each, ignored rows (ignore_index −100 and −1), a "
                     "scale, and bfloat16 logits"))
    return True


# ==================================================================================================
# The exercise as a Triton kernel: one tile of the slice's gradient
# ==================================================================================================
#
# The reader writes ``slice_gradient_kernel``: each program owns ROWS rows × BLOCK_N columns of the
# slice, loads its logits (rows ``stride_logits`` apart: the slice is a view of the [tokens, vocab]
# logits), each row's lse and target, and stores (softmax − onehot) · scale, zero on ignored rows,
# into GRAD (rows ``stride_grad`` apart). The check first launches it once on a slice inside the
# full logits, writing into a larger buffer filled with a sentinel, and says where it wrote, where
# it did not and which stride it read; then it hands the launch to ``check_slice_gradient``, whose
# slices name the arithmetic's mistakes.

EXERCISE_KERNEL = "slice_gradient_kernel"
KERNEL_ROWS = 4
KERNEL_BLOCK_N = 16
SENTINEL = -4096.0  # what GRAD's surroundings and unwritten elements hold before a launch

KERNEL_DIAGNOSES = {
    "not_kernel": "check_slice_gradient_kernel takes a Triton kernel (an @triton.jit function), got {got}",
    "raised": "your kernel raised {error}",
    "nothing": ("the kernel stored nothing: is the mask still the placeholder? (the elements that exist are "
                "rows < n_rows and columns < width)"),
    "outside": ("the kernel wrote {count} value(s) outside the slice's [{rows}, {width}] gradient: "
                "mask the rows past n_rows and the columns past width (the last tiles hang over "
                "both)"),
    "unwritten": ("{count} element(s) of the gradient were never written, the first at row {row}, "
                  "column {col}: program_id(0) numbers tiles of ROWS rows and program_id(1) blocks "
                  "of BLOCK_N columns, and together they must cover the slice"),
    "stride": ("the logits were read {what}: the slice is a view of the [tokens, vocab] logits, so "
               "its rows are stride_logits elements apart (and GRAD's stride_grad), not width"),
    "passed": ("your kernel is right: it writes exactly the slice's gradient, reads the slice "
               "through its stride, and the arithmetic holds on every slice of the check."),
}


def kernel_diagnosis(key: str, **fields) -> str:
    """The sentence ``KERNEL_DIAGNOSES[key]`` with its fields filled in.

    Args:
        key: a key of ``KERNEL_DIAGNOSES``.
        **fields: the sentence's fields.

    Returns:
        the sentence.

    Raises:
        KeyError: when ``key`` is unknown or a field the sentence names is missing.
    """
    return KERNEL_DIAGNOSES[key].format(**fields)


def launch_slice_gradient(kernel, logits, lse, target, col_start, scale, ignore_index=-100, grad=None):
    """Launch ``kernel`` over the slice ``logits`` ([tokens, width], any row stride, unit column
    stride) into ``grad`` (float32, default a new [tokens, width] tensor); returns ``grad``.

    The grid has one program per ``KERNEL_ROWS`` rows × ``KERNEL_BLOCK_N`` columns; the kernel is
    given ``(logits, lse, target, grad, tokens, width, col_start, scale, ignore_index,
    stride_logits, stride_grad, ROWS=, BLOCK_N=)``.

    Args:
        kernel: the reader's ``@triton.jit`` kernel.
        logits, lse, target, col_start, scale, ignore_index: the slice and what its gradient needs,
            as ``reference_slice_gradient`` takes them.
        grad: where the gradient is written (rows may be further apart than width); None allocates
            it.

    Returns:
        ``grad``.
    """
    tokens, width = logits.shape
    if grad is None:
        grad = torch.empty(tokens, width, dtype=torch.float32, device=logits.device)
    grid = (triton.cdiv(tokens, KERNEL_ROWS), triton.cdiv(width, KERNEL_BLOCK_N))
    kernel[grid](logits, lse.float().contiguous(), target.contiguous(), grad, tokens, width,
                 col_start, float(scale),
                 ignore_index, logits.stride(0), grad.stride(0), ROWS=KERNEL_ROWS, BLOCK_N=KERNEL_BLOCK_N)
    return grad


def _kernel_function(kernel) -> Callable:
    """``kernel`` as ``slice_gradient(logits, lse, target, col_start, scale, ignore_index)``, on
    this machine's device; a failed launch is raised as it came."""

    def fn(logits, lse, target, col_start, scale, ignore_index=-100):
        device = runtime.device()
        grad = launch_slice_gradient(kernel, logits.to(device), lse.to(device), target.to(device),
                                     col_start, scale, ignore_index)
        return grad.cpu()

    return fn


def _placement(kernel, device) -> str | None:
    """Launch once on a slice of 7 rows × 21 columns inside [7, 50] logits, into a [7 + 2, 27]
    buffer of sentinels: what was written outside, what was not written, and whether the logits were
    read through their stride."""
    g = torch.Generator().manual_seed(11)
    tokens, vocab, col_start, width, stride_grad = 7, 50, 20, 21, 27
    full = (torch.randn(tokens, vocab, generator=g) * 2).to(device)
    lse = torch.logsumexp(full, dim=1)
    target = torch.tensor([25, 3, 40, -100, 20, 30, 49], device=device)
    logits = full[:, col_start:col_start + width]  # a view: rows `vocab` apart
    buffer = torch.full((tokens + 2, stride_grad), SENTINEL, dtype=torch.float32, device=device)
    grad = buffer[:tokens, :width]
    try:
        call_learner(EXERCISE_KERNEL, launch_slice_gradient, kernel, logits, lse, target, col_start,
                     0.5, -100, grad, watch=getattr(kernel, "fn", kernel))
    except FinishedCodeCalled as called:
        return str(called)
    except Exception as exc:  # noqa: BLE001  (the reader's kernel may fail in any way: say how)
        text = [line for line in str(exc).strip().splitlines() if line.strip()]
        return kernel_diagnosis("raised", error=f"{type(exc).__name__}: {text[-1][:200] if text else ''}")
    written = (buffer != SENTINEL).cpu()
    inside = torch.zeros_like(written)
    inside[:tokens, :width] = True
    if not written.any():
        return kernel_diagnosis("nothing")
    outside = int((written & ~inside).sum())
    if outside:
        return kernel_diagnosis("outside", count=outside, rows=tokens, width=width)
    missing = (~written & inside).nonzero()
    if len(missing):
        row, col = (int(i) for i in missing[0])
        return kernel_diagnosis("unwritten", count=len(missing), row=row, col=col)
    got = grad.double().cpu()
    expected = reference_slice_gradient(logits.cpu(), lse.cpu(), target.cpu(), col_start, 0.5)
    if torch.allclose(got, expected, rtol=1e-5, atol=1e-7):
        return None
    packed = torch.as_strided(full, (tokens, width), (width, 1), full.storage_offset() + col_start)
    if torch.allclose(got, reference_slice_gradient(packed.cpu(), lse.cpu(), target.cpu(), col_start, 0.5),
                      rtol=1e-5, atol=1e-7):
        return kernel_diagnosis("stride", what="width apart (as if the slice were contiguous)")
    return None  # wrong arithmetic: the slices of check_slice_gradient name it


def check_slice_gradient_kernel(kernel, verbose: bool = True) -> bool:
    """Check the reader's ``slice_gradient_kernel`` (see the notes above ``KERNEL_DIAGNOSES``):
    where it writes, the stride it reads, then the arithmetic on every slice of
    ``check_slice_gradient``. Prints the verdict (unless ``verbose=False``) and returns whether it
    passed; never raises because the kernel is wrong (chapter 10,
    notebooks/10_linear_cross_entropy.ipynb).

    Args:
        kernel: the reader's ``@triton.jit`` ``slice_gradient_kernel``, launched as
            ``launch_slice_gradient`` launches it.
        verbose: print the verdict: ✓, or ✗ with where it wrote or did not, the stride it read, or
            the arithmetic's mistake.

    Returns:
        True when the kernel is right, False otherwise.
    """
    message = finished_answer(EXERCISE_KERNEL, kernel)
    if message is None and not isinstance(kernel, triton.runtime.jit.KernelInterface):
        message = kernel_diagnosis("not_kernel", got=type(kernel).__name__)
    if message is None:
        message = _placement(kernel, runtime.device())
    if message is None:
        fn = _kernel_function(kernel)
        for case in _cases():
            message = _diagnose(fn, case, EXERCISE_KERNEL, getattr(kernel, "fn", kernel))
            if message:
                message = message.replace("slice_gradient raised", "your kernel raised")
                break
    if verbose:
        print((_WRONG + message) if message else (_OK + kernel_diagnosis("passed")))
    return message is None
