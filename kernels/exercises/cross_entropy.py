"""Checks for the exercises of chapters 05 (the online-softmax update) and 06 (the cross-entropy gradient).

Each check runs the reader's function on small inputs chosen to expose one mistake each, compares
with the right answer and with the answers that the usual mistakes give, and prints what is wrong in
words. It returns True when everything is right and never raises: a notebook with the exercise left
undone still runs to the end.

The sentence that names each mistake lives in one dict per exercise (``UPDATE_DIAGNOSES``,
``GRADIENT_DIAGNOSES``, ``SWEEP_DIAGNOSES``); a check prints that sentence, followed by what it saw
on which input. The tests feed every named mistake to its check and look for its sentence.

A check runs the reader's code through ``kernels.exercises.reach``, with the exercise's finished
answers out of reach (``FORBIDDEN``: the package's online softmax; the package's cross-entropy with
its gradient, PyTorch's, autograd and PyTorch's softmax and exp). The two chapter 06 checks also
watch which Triton kernels the reader's function launches: the exercise is a kernel, so a gradient
that no kernel of the reader's wrote does not count.
"""

from __future__ import annotations

import functools
import importlib
import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kernels import runtime
from kernels.exercises.reach import FinishedCodeCalled, call_learner
from kernels.exercises.rmsnorm import mapped_buffer
from kernels.reference import relative_error

_OK = "✓ "
_WRONG = "✗ "


def _report(problem: str | None, success: str, verbose: bool = True) -> bool:
    if verbose:
        print(_WRONG + problem if problem else _OK + success)
    return problem is None


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-5, atol: float = 1e-6) -> bool:
    return bool(torch.allclose(a.to(torch.float64), b.to(torch.float64), rtol=rtol, atol=atol,
                               equal_nan=True))


# --------------------------------------------------------------------------------------------------
# Chapter 05: online_update(m, s, chunk) -> (m_new, s_new)
# --------------------------------------------------------------------------------------------------

UPDATE_DIAGNOSES = {
    "stub": "online_update is still the stub (it raises NotImplementedError): write the two update lines",
    "raised": "online_update raised an exception",
    "stateful": ("online_update gave two different answers to the same (m, s, chunk): it keeps "
                 "something between calls (the chunks seen so far, say). The online update has "
                 "only the two numbers m and s and the new chunk, the earlier chunks are gone: "
                 "compute (m_new, s_new) from those three alone"),
    "one-value": "online_update must return two values, (m_new, s_new)",
    "swapped": "the two values are swapped: return (m_new, s_new), the running max first",
    "m-not-one-number": "m_new must be one number, but it has one value per element of the chunk: "
                        "torch.maximum(m, chunk) compares element by element; take the chunk's max first, "
                        "torch.maximum(m, chunk.max())",
    "s-not-one-number": ("s_new must be one number, but it has one value per element of the chunk: "
                         "the chunk's terms exp(chunk − m_new) must be summed, .sum()"),
    "max-not-tracked": ("the running max is not updated: m_new is still the old m, so the chunk's "
                        "larger values are never subtracted; m_new = max(m, max(chunk))"),
    "max-goes-down": "m_new is the chunk's max alone: the running max must never go down, "
                     "m_new = max(m, max(chunk))",
    "max-wrong": "m_new is not the running max max(m, max(chunk))",
    "no-rescale": ("the old sum s is not rescaled: when the max grows from m to m_new, every term "
                   "already in s was exp(x − m) and must become exp(x − m_new), so multiply s by "
                   "exp(m − m_new)"),
    "rescale-upside-down": "the rescale factor is upside down (the exponent has the wrong sign): use "
                           "exp(m − m_new) (≤ 1), not exp(m_new − m)",
    "old-max": "the new chunk's terms are taken relative to the old max m; take them relative to m_new: "
               "Σ exp(chunk − m_new)",
    "no-max": ("no max is subtracted: exp(x) overflows float32 once x > 88.7; keep every term as "
               "exp(x − m_new)"),
    "chunk-no-max": "the chunk's terms are exp(chunk) without subtracting m_new: use Σ exp(chunk − m_new)",
    "chunk-own-max": ("the chunk's terms are taken relative to the chunk's own max; when the "
                      "running max m is larger, they must be relative to m_new = max(m, "
                      "max(chunk)), like every term of s: Σ exp(chunk − m_new)"),
    "old-sum-dropped": ("the old sum s is dropped: s_new holds only the chunk's terms, but it must "
                        "hold every term read so far, the old ones rescaled: s · exp(m − m_new) + "
                        "Σ exp(chunk − m_new)"),
    "mean-not-sum": ("the chunk's terms are averaged (.mean()), not summed: s counts every term, Σ "
                     "exp(chunk − m_new)"),
    "no-exp": "the chunk's terms are not exponentiated: s is a sum of exp(x − m_new), not of x − m_new",
    "exp-of-sum": "the chunk adds exp(Σ chunk − m_new), the exp of its sum: s adds one term per element, "
                  "Σ exp(chunk − m_new), the sum of the exps",
    "max-term-only": ("the chunk adds only its largest term, exp(max(chunk) − m_new): every "
                      "element of the chunk adds its own term, Σ exp(chunk − m_new)"),
    "rescale-everything": ("the rescale factor multiplies the chunk's new terms too: (s + Σ "
                           "exp(chunk − m_new)) · exp(m − m_new). The new terms are already "
                           "relative to m_new; only the old sum s, measured against m, needs exp(m "
                           "− m_new)"),
    "log-sum": ("s_new is the log of the running sum: the state keeps the sum itself, s = Σ exp(x "
                "− m), and the log is taken once, at the end (L = m + log s)"),
    "first-chunk": "s_new is not finite on the first chunk: there the rescale factor must be "
                   "exp(m − m_new) = exp(−inf) = 0, which empties nothing",
    "overflow": ("s_new overflowed: exp overflows float32 past exp(88.7), so every factor must be "
                 "an exp of a difference that is ≤ 0, exp(m − m_new) and exp(chunk − m_new), never "
                 "exp(m) or exp(chunk) alone"),
    "sum-wrong": "s_new is not s·exp(m − m_new) + Σ exp(chunk − m_new)",
}

# (what the case is, m, s, chunk): a chunk that raises the max, one that does not, the first chunk,
# large logits. The general cases come first: they tell the usual mistakes apart, where the first
# chunk only gives inf or NaN.
_UPDATE_CASES = [
    ("a chunk whose max is above the running max", 2.0, 1.5, [0.5, 5.0, 1.0, 4.0]),
    ("a chunk whose values are all below the running max", 4.0, 2.0, [1.0, 3.5, -2.0]),
    ("the first chunk (m = -inf, s = 0)", -math.inf, 0.0, [1.0, 3.0, 2.0, -1.0]),
    ("large logits (m = 500)", 500.0, 1.25, [480.0, 510.0, 505.0]),
]


def _expected_update(m, s, x):
    m_new = torch.maximum(m, x.max())
    return m_new, s * torch.exp(m - m_new) + torch.exp(x - m_new).sum()


def _update_mistakes(m, s, x):
    """What the common mistakes return for s_new (with the right m_new), each with the key of its
    diagnosis."""
    m_new = torch.maximum(m, x.max())
    chunk_sum = torch.exp(x - m_new).sum()
    return [
        (s + chunk_sum, "no-rescale"),
        (s * torch.exp(m_new - m) + chunk_sum, "rescale-upside-down"),
        (s * torch.exp(m - m_new) + torch.exp(x - m).sum(), "old-max"),
        (s + torch.exp(x).sum(), "no-max"),
        (s * torch.exp(m - m_new) + torch.exp(x).sum(), "chunk-no-max"),
        (s * torch.exp(m - m_new) + torch.exp(x - x.max()).sum(), "chunk-own-max"),
        (chunk_sum, "old-sum-dropped"),
        (s * torch.exp(m - m_new) + torch.exp(x - m_new).mean(), "mean-not-sum"),
        (s * torch.exp(m - m_new) + (x - m_new).sum(), "no-exp"),
        (torch.log(s * torch.exp(m - m_new) + chunk_sum), "log-sum"),
        (s * torch.exp(m - m_new) + torch.exp(x.sum() - m_new), "exp-of-sum"),
        (s * torch.exp(m - m_new) + torch.exp(x.max() - m_new), "max-term-only"),
        ((s + chunk_sum) * torch.exp(m - m_new), "rescale-everything"),
    ]


def _diagnose_update(fn, label, m_val, s_val, values) -> str | None:
    m = torch.tensor(m_val, dtype=torch.float32)
    s = torch.tensor(s_val, dtype=torch.float32)
    x = torch.tensor(values, dtype=torch.float32)
    where = f"on {label} (m = {m_val}, s = {s_val}, chunk = {values})"
    try:
        result = call_learner("online_update", fn, m.clone(), s.clone(), x.clone())
    except FinishedCodeCalled as called:
        return str(called)
    except NotImplementedError:
        return UPDATE_DIAGNOSES["stub"]
    except Exception as exc:  # the reader's code may fail in any way: say how
        return f"{UPDATE_DIAGNOSES['raised']}: {type(exc).__name__}: {exc} {where}"
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        return f"{UPDATE_DIAGNOSES['one-value']}; got {type(result).__name__} {where}"
    try:
        got_m, got_s = (torch.as_tensor(v).detach().to("cpu", torch.float32) for v in result)
    except Exception as exc:  # noqa: BLE001  (not numbers at all: say what came back)
        return (f"{UPDATE_DIAGNOSES['raised']}: its result is not two numbers "
                f"({type(exc).__name__}: {exc}) {where}")
    for got, key in ((got_m, "m-not-one-number"), (got_s, "s-not-one-number")):
        if got.numel() != 1:
            return f"{UPDATE_DIAGNOSES[key]} (it has shape {tuple(got.shape)} {where})"
    got_m, got_s = got_m.reshape(()), got_s.reshape(())
    want_m, want_s = _expected_update(m, s, x)
    if not _close(got_m, want_m) and _close(got_m, want_s) and _close(got_s, want_m):
        return f"{UPDATE_DIAGNOSES['swapped']} (got ({got_m.item():g}, {got_s.item():g}) {where})"
    if not _close(got_m, want_m):
        seen = f"(m_new = {got_m.item():g}, expected {want_m.item():g} {where})"
        if _close(got_m, m):
            return f"{UPDATE_DIAGNOSES['max-not-tracked']} {seen}"
        if _close(got_m, x.max()):
            return f"{UPDATE_DIAGNOSES['max-goes-down']} {seen}"
        return f"{UPDATE_DIAGNOSES['max-wrong']} {seen}"
    if not torch.isfinite(got_s):
        key = "first-chunk" if math.isinf(m_val) else "overflow"
        return f"{UPDATE_DIAGNOSES[key]} (s_new = {got_s.item()} {where})"
    if _close(got_s, want_s):
        return None
    seen = f"(s_new = {got_s.item():.6g} instead of {want_s.item():.6g} {where})"
    for wrong, key in _update_mistakes(m, s, x):
        if torch.isfinite(wrong) and _close(got_s, wrong):
            return f"{UPDATE_DIAGNOSES[key]} {seen}"
    return f"{UPDATE_DIAGNOSES['sum-wrong']} {seen}"


# A whole pass: a row of 23 values read in chunks of 5 (the last one of 3), then in chunks of 1,
# from m = -inf, s = 0.
_PASS_ROW = [0.3, -1.2, 2.5, 0.0, 1.1, 4.2, -0.7, 3.9, 0.5, -2.0, 1.4, 6.1, 2.2, -0.4, 5.8, 0.9,
             3.3, -1.5, 7.0, 2.6, -3.1, 1.8, 0.2]
_PASS_CHUNKS = (5, 1)


def _same_answer_twice(fn) -> str | None:
    """The update is a function of (m, s, chunk) alone: the same inputs twice give the same answer."""
    label, m_val, s_val, values = _UPDATE_CASES[0]
    answers = []
    for _ in range(2):
        try:
            result = call_learner("online_update", fn, torch.tensor(m_val), torch.tensor(s_val),
                                  torch.tensor(values))
            answers.append([float(torch.as_tensor(v).detach().reshape(-1)[0]) for v in result])
        # noqa: BLE001  (the cases below name what goes wrong; here only the answers matter)
        except Exception:
            return None
    if not all(math.isclose(a, b, rel_tol=1e-6) or (math.isnan(a) and math.isnan(b))
               for a, b in zip(*answers)):
        return (f"{UPDATE_DIAGNOSES['stateful']} (on {label}, m = {m_val}, s = {s_val}, chunk = "
                f"{values}: first {answers[0]}, then {answers[1]})")
    return None


def _diagnose_pass(fn) -> str | None:
    """Each step of a whole pass over ``_PASS_ROW``, from the state the steps before it reached."""
    row = torch.tensor(_PASS_ROW)
    for chunk in _PASS_CHUNKS:
        m, s = torch.tensor(-math.inf), torch.tensor(0.0)
        for k, start in enumerate(range(0, row.numel(), chunk)):
            x = row[start:start + chunk]
            label = (f"chunk {k} of a pass over a row of {row.numel()} values in chunks of {chunk} "
                     "(from m = -inf, s = 0)")
            problem = _diagnose_update(fn, label, m.item(), s.item(), x.tolist())
            if problem:
                return problem
            m, s = _expected_update(m, s, x)
    return None


def check_online_update(fn: Callable, verbose: bool = True) -> bool:
    """Check the reader's ``online_update(m, s, chunk) -> (m_new, s_new)`` (0-d float32 tensors and
    a 1-D chunk).

    Runs it on four single steps (a chunk that raises the max, one below it, the first chunk, large
    logits), then step by step through whole passes over a row, in chunks of 5 and of 1, with the
    package's online softmax out of reach. Prints the verdict (unless ``verbose=False``) and returns
    True when the update is right (chapter 05, notebooks/05_online_softmax.ipynb).

    Args:
        fn: the reader's ``online_update(m, s, chunk) -> (m_new, s_new)``: the running maximum m
            and the running sum s of e^(x − m) brought up to date with one more chunk.
        verbose: print the verdict: ✓ and what was checked, or ✗ and the first case that is wrong
            with what was expected.

    Returns:
        True when every case is right, False otherwise.
    """
    # An update that keeps state between calls gets every later case wrong in some way: name that first.
    problem = _same_answer_twice(fn)
    for case in _UPDATE_CASES:
        problem = problem or _diagnose_update(fn, *case)
    problem = problem or _diagnose_pass(fn)
    if problem:
        return _report(problem, "", verbose)
    return _report(None, ("online_update is right: first chunk, growing max, steady max, large "
                          "logits and whole passes in chunks of 5 and of 1 all check out"), verbose)


# --------------------------------------------------------------------------------------------------
# Chapter 06: which Triton kernels the reader's function launched
# --------------------------------------------------------------------------------------------------

# Where Triton keeps the method a launch ``kernel[grid](...)`` calls: compiled kernels and interpreted ones.
_LAUNCHERS = (("triton.runtime.jit", "JITFunction"), ("triton.runtime.interpreter", "InterpretedFunction"))


@dataclass(frozen=True)
class Launch:
    """One kernel launch: the kernel's name and module, and the tensors it was given."""

    kernel: str
    module: str
    tensors: tuple[torch.Tensor, ...]

    @property
    def readers(self) -> bool:
        """Whether the reader wrote this kernel: anything but the package's own (its hidden
        solutions count as the reader's, so that they pass the check they stand for)."""
        package = self.module == "kernels" or self.module.startswith("kernels.")
        return not package or self.module.startswith("kernels.exercises.solutions.")

    def writes_to(self, tensor: torch.Tensor) -> bool:
        """Whether one of the tensors it was given lives in ``tensor``'s memory.

        Args:
            tensor: the tensor that should have been written.

        Returns:
            True when a tensor of the launch shares ``tensor``'s storage.
        """
        storage = tensor.untyped_storage().data_ptr()
        return any(t.untyped_storage().data_ptr() == storage for t in self.tensors)


@contextmanager
def launches() -> Iterator[list[Launch] | None]:
    """Within the block, every Triton kernel launch is recorded into the list it yields (None where
    this Triton keeps its launch method elsewhere: then nothing can be recorded, and the checks do
    without).

    Yields:
        the list the block's launches are appended to, as ``Launch`` records, or None.
    """
    classes = []
    for module_name, class_name in _LAUNCHERS:
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue
        if callable(vars(cls).get("run")):
            classes.append((cls, vars(cls)["run"]))
    seen: list[Launch] = []

    def recording(original):
        @functools.wraps(original)
        def run(self, *args, **kwargs):
            if not kwargs.get("warmup", False):
                fn = getattr(self, "fn", None)
                tensors = tuple(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
                seen.append(Launch(getattr(fn, "__name__", "?"),
                                   getattr(fn, "__module__", None) or "", tensors))
            return original(self, *args, **kwargs)

        return run

    try:
        for cls, original in classes:
            cls.run = recording(original)
        yield seen if classes else None
    finally:
        for cls, original in classes:
            cls.run = original


def _no_kernel(launched: list[Launch] | None, what: str) -> str | None:
    """The "no kernel" verdict when the record shows no launch of a kernel of the reader's, else None."""
    if launched is None or any(launch.readers for launch in launched):
        return None
    return GRADIENT_DIAGNOSES["no-kernel"].format(what=what)


# --------------------------------------------------------------------------------------------------
# Chapter 06, exercise 1: the gradient line, fn(logits [N, V] float32, target [N] int64,
# ignore_index) -> grad [N, V]
# --------------------------------------------------------------------------------------------------

GRADIENT_DIAGNOSES = {
    "stub": "the gradient function is still the stub (it raises NotImplementedError)",
    "raised": "your function raised an exception",
    "no-kernel": ("no kernel of yours ran: your function launched no Triton kernel of its own, and "
                  "the exercise is the kernel (a gradient computed in PyTorch does not count); "
                  "launch yours, kernel[(n_rows,)](...), and let it write {what}"),
    "shape": "the gradient must have the logits' shape",
    "zeros": ("every element of the gradient is zero: the gradient line is still the stub (or "
              "nothing is stored)"),
    "nan": ("the gradient holds NaN or infinity: compute the softmax as exp(x − lse) in float32, "
            "and give ignored rows a scale of 0 before multiplying"),
    "no-onehot": "the target column lacks its −1: the gradient is softmax − onehot(target), not softmax",
    "sign": "the sign is flipped: d loss / d x = softmax − onehot, not onehot − softmax",
    "no-scale": ("the gradient is not divided by the number of counted targets: the loss is a mean "
                 "over the rows that are not ignored, so scale by 1 / n_valid"),
    "all-rows": "the gradient is divided by all rows; the mean runs over the rows whose target is not "
                "ignore_index: scale by 1 / n_valid, not 1 / n_rows",
    "ignored-count": ("ignored rows (target == ignore_index) count: they must get a zero gradient, "
                      "since they are not part of the loss; multiply by a row scale that is 0 for "
                      "them"),
    "onehot-off-by-one": ("the one-hot is at the wrong column: its −1 sits one column {side} the "
                          "target (the target index is off by one); the −1 belongs at column "
                          "target itself, tl.where(cols == target, 1.0, 0.0)"),
    "onehot-no-start": ("the one-hot compares the chunk's own lane numbers, tl.arange(0, BLOCK_V), "
                        "with the target: they restart at 0 in every chunk, so the −1 lands at the "
                        "target's column in every chunk (and nowhere when target ≥ BLOCK_V); "
                        "compare the row's column numbers, cols = start + tl.arange(0, BLOCK_V), "
                        "with the target"),
    "minus-one-everywhere": ("1 is subtracted from every column: the −1 of the one-hot belongs at "
                             "the target's column only, tl.where(cols == target, 1.0, 0.0), not "
                             "everywhere"),
    "onehot-unscaled": ("the one-hot is not scaled: only the softmax was multiplied by the scale, "
                        "but the whole difference is: (softmax − onehot) · scale"),
    "scale-inverted": "the gradient is multiplied by n_valid instead of divided by it: SCALE already holds "
                      "1 / n_valid, so multiply by it (do not divide by it)",
    "divided-by-columns": ("the gradient is divided by the number of columns (n_cols): the mean "
                           "runs over the counted rows, not over the vocabulary: scale by 1 / "
                           "n_valid"),
    "log-softmax": ("the softmax is missing its exp: x − lse is the log of the softmax; the "
                    "softmax is exp(x − lse)"),
    "scaled": ("the gradient is right up to a constant factor ({factor:.4g}): the shape is right, "
               "the scale is not; a counted row's gradient is (softmax − onehot) / n_valid"),
    "unnormalised": "each counted row of the gradient must sum to 0 (the softmax sums to 1, and so does the "
                    "one-hot): the softmax is not normalised, use exp(x − lse) with the row's logsumexp",
    "wrong": "the gradient is wrong",
}


# The chunk sizes a reader may have chosen: a one-hot by lane numbers puts its −1s where the chunk size says.
_BLOCKS = (16, 32, 64, 128, 256)


def _gradient_case(device):
    # 6 rows of 300 logits (more than one chunk of 128 or 256), spread enough that the softmax is not flat;
    # targets at both ends of the row, and two ignored rows, so n_valid (4) differs from the row count (6).
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 300, generator=gen) * 3
    target = torch.tensor([0, 299, -100, 137, -100, 256])
    return logits.to(device), target.to(device), -100


def _gradient_parts(logits, target, ignore_index):
    """float64 softmax, one-hot, which rows count, n_valid and the right gradient of the mean loss."""
    x, t = logits.detach().cpu().to(torch.float64), target.cpu()
    counted = t != ignore_index
    p = torch.softmax(x, dim=-1)
    onehot = torch.zeros_like(p)
    onehot[counted.nonzero()[:, 0], t[counted]] = 1.0
    n_valid = int(counted.sum())
    want = (p - onehot) / n_valid * counted[:, None]
    return p, onehot, counted, n_valid, want


def _shifted_onehot(onehot: torch.Tensor, by: int) -> torch.Tensor:
    """The one-hot with its 1 ``by`` columns further right; a 1 pushed past either end of the row is
    lost (a kernel that compares cols == target + 1 finds no column for the last target)."""
    shifted = torch.zeros_like(onehot)
    if by > 0:
        shifted[:, by:] = onehot[:, :-by]
    else:
        shifted[:, :by] = onehot[:, -by:]
    return shifted


def _gradient_mistakes(p, onehot, counted, n_valid, n_rows, x=None, lse=None):
    """The gradients the usual mistakes give, each with the key of its diagnosis and what to add to
    the sentence."""
    keep = counted[:, None].to(p.dtype)
    n_cols = p.shape[1]
    mistakes = [
        (p / n_valid * keep, "no-onehot", ""),
        (-(p - onehot) / n_valid * keep, "sign", ""),
        ((p - onehot) * keep, "no-scale", f" (n_valid = {n_valid} here)"),
        ((p - onehot) / n_rows * keep, "all-rows", (f" (here it was divided by all {n_rows} rows; "
                                                    f"{n_valid} count)")),
        ((p - onehot) / n_valid, "ignored-count", ""),
        ((p / n_valid - onehot) * keep, "onehot-unscaled", ""),
        ((p - onehot) * n_valid * keep, "scale-inverted", f" (n_valid = {n_valid} here)"),
        ((p - onehot) / n_cols * keep, "divided-by-columns", (f" (here {n_cols} columns; {n_valid} "
                                                              "rows count)")),
    ]
    for by, side in ((1, "right of"), (-1, "left of")):
        mistakes.append(((p - _shifted_onehot(onehot, by)) / n_valid * keep, "onehot-off-by-one", side))
    mistakes.append(((p - 1.0) / n_valid * keep, "minus-one-everywhere", ""))
    targets = onehot.argmax(dim=-1)
    lanes = torch.arange(n_cols)
    for block in _BLOCKS:
        if block < n_cols:  # a row of one chunk has its lane numbers right
            lane_hot = ((lanes[None, :] % block) == targets[:, None]).to(p.dtype) * keep
            mistakes.append(((p - lane_hot) / n_valid * keep, "onehot-no-start",
                             f" (chunks of {block} here)"))
    if x is not None and lse is not None:
        mistakes.append(((x - lse[:, None] - onehot) / n_valid * keep, "log-softmax", ""))
    return mistakes


def _diagnose_values(got, x, t, p, onehot, counted, n_valid, want, rtol, atol) -> str | None:
    """The diagnosis of a gradient of the right shape, or None when it is right (shared by both
    chapter 06 checks)."""
    if not torch.isfinite(got).all():
        return GRADIENT_DIAGNOSES["nan"]
    if not got.any():
        return GRADIENT_DIAGNOSES["zeros"]
    if _close(got, want, rtol=rtol, atol=atol):
        return None
    x64 = x.detach().to("cpu", torch.float64)
    lse = torch.logsumexp(x64, dim=-1)
    for wrong, key, extra in _gradient_mistakes(p, onehot, counted, n_valid, x.shape[0], x64, lse):
        if _close(got, wrong, rtol=rtol, atol=atol):
            if key == "onehot-off-by-one":
                return GRADIENT_DIAGNOSES[key].format(side=extra)
            return GRADIENT_DIAGNOSES[key] + extra
    factor = float((got * want).sum() / (want * want).sum())
    if abs(factor - 1) > 1e-3 and _close(got, factor * want, rtol=rtol, atol=atol):
        return GRADIENT_DIAGNOSES["scaled"].format(factor=factor)
    row_sums = got[counted].sum(dim=-1) * n_valid
    if not _close(row_sums, torch.zeros_like(row_sums), atol=max(1e-4, 50 * atol * x.shape[1])):
        return GRADIENT_DIAGNOSES["unnormalised"]
    err = (got - want).abs()
    r, c = divmod(int(err.argmax()), x.shape[1])
    return (f"{GRADIENT_DIAGNOSES['wrong']}: the largest error is at row {r}, column {c} (that "
            f"row's target is {int(t[r])}): got {got[r, c].item():.6g}, expected "
            f"{want[r, c].item():.6g}")


def check_ce_gradient(fn: Callable, device=None, verbose: bool = True) -> bool:
    """Check ``fn(logits, target, ignore_index) -> grad``: the gradient of the *mean* cross-entropy,
    written by a Triton kernel that ``fn`` launches.

    ``fn`` runs with the exercise's finished answers out of reach (``FORBIDDEN["ce_gradient"]``: the
    package's kernel may give it the logsumexp, ``compute_grad=False``, but not the gradient), and a
    gradient that no kernel of the reader's wrote is refused. The inputs live on ``device``
    (default: where the kernels run, ``runtime.device()``). Prints the verdict (unless
    ``verbose=False``) and returns True when the gradient is right (chapter 06,
    notebooks/06_cross_entropy_kernel.ipynb).

    Never raises for the reader's code: an error it raises, the stub's NotImplementedError or a
    call of a finished answer is reported in the verdict.

    Args:
        fn: the reader's ``fn(logits, target, ignore_index) -> grad``, logits [N, V], target [N]
            int64 with some rows equal to ``ignore_index``, grad the logits' shape.
        device: where the inputs are made; None for ``runtime.device()``.
        verbose: print the verdict: ✓, or ✗ and the mistake the gradient shows.

    Returns:
        True when the gradient is right and a kernel of the reader's wrote it, False otherwise.
    """
    device = device or runtime.device()
    logits, target, ignore_index = _gradient_case(device)
    try:
        with warnings.catch_warnings(), launches() as launched:
            warnings.simplefilter("ignore", RuntimeWarning)  # NumPy's overflow notices from the interpreter
            got = call_learner("ce_gradient", fn, logits.clone(), target.clone(), ignore_index)
    except FinishedCodeCalled as called:
        return _report(str(called), "", verbose)
    except NotImplementedError:
        return _report(GRADIENT_DIAGNOSES["stub"], "", verbose)
    except Exception as exc:  # the reader's kernel may fail in any way: say how
        return _report(f"{GRADIENT_DIAGNOSES['raised']}: {type(exc).__name__}: {exc}", "", verbose)
    problem = _no_kernel(launched, "the gradient")
    if problem:
        return _report(problem, "", verbose)
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(logits.shape):
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        return _report(f"{GRADIENT_DIAGNOSES['shape']}: expected a gradient of shape "
                       f"{tuple(logits.shape)}, got {shape}", "", verbose)
    got = got.detach().to("cpu", torch.float64)
    p, onehot, counted, n_valid, want = _gradient_parts(logits, target, ignore_index)
    problem = _diagnose_values(got, logits.cpu(), target.cpu(), p, onehot, counted, n_valid, want,
                               1e-4, 1e-7)
    return _report(problem, ("the gradient is right: softmax − onehot, scaled by 1 / n_valid, zero "
                             "on ignored rows"),
                   verbose)


# --------------------------------------------------------------------------------------------------
# Chapter 06, exercise 2: the gradient sweep in place, fn(logits [N, V], target [N], lse [N]
# float32, ignore_index) overwrites each row of logits with its gradient of the mean loss
# --------------------------------------------------------------------------------------------------

SWEEP_DIAGNOSES = {
    "stub": ("nothing was written: the logits are unchanged, so the kernel is still the stub (or "
             "it stores nothing)"),
    "raised": "your function raised an exception",
    "copy": ("the sweep writes a copy, not over the logits: your kernel was not given the logits' "
             "memory (a logits.clone(), a new buffer), so the logits keep their values. In place, "
             "the kernel stores into LOGITS itself, the tensor your launcher was given, and the "
             "launcher returns it"),
    "upcast": ("no float32 upcast: the bf16 logits reached tl.exp unconverted; load them and "
               "convert right away, x = tl.load(...).to(tl.float32), and compute in float32"),
    "precision": ("the bf16 result is less accurate than one rounding of the float32 gradient: "
                  "some arithmetic ran in bf16 (a value converted down before the end); convert "
                  "the logits to float32 when loading and round once, on the store"),
    "mask": ("a missing mask on the last chunk: the last chunk runs past the end of the row, and "
             "elements past column n_cols − 1 were written; load and store with mask=cols < "
             "n_cols"),
    "stride": ("the rows are addressed as if they were n_cols apart: a view's rows are `stride` "
               "elements apart (logits.stride(0)), so offset each row by row * stride"),
    "one-row": ("only row 0 was written: every program must work on its own row, row = "
                "tl.program_id(0), with its pointers offset by row * stride"),
    "first-chunk": "only the first chunk of each row was written: loop over the whole row, "
                   "for start in range(0, n_cols, BLOCK_V), with cols = start + tl.arange(0, BLOCK_V)",
    "ignored-unwritten": ("the rows whose target is ignore_index still hold their logits: in "
                          "place, those rows must be written too, as zeros (a row scale of 0)"),
    "lse-row0": ("every row used row 0's logsumexp: each program loads its own row's, lse = "
                 "tl.load(LSE + row)"),
    "target-row0": ("every row used row 0's target: each program loads its own row's, target = "
                    "tl.load(TARGET + row)"),
    "int32": ("int32 row offsets: tl.program_id(0) is int32, so row * stride is computed in int32 "
              "and wraps around once it passes 2**31 − 1 (row 16,744 at 128,256 columns), reading "
              "and writing the wrong memory; convert first, row = tl.program_id(0).to(tl.int64)"),
}

# Elements between the rows of the checker's views (their rows are n_cols + _GUARD apart), filled
# with _SENTINEL: a store without the mask writes there, and is seen. Enough for any BLOCK_V up to
# 2,048.
_GUARD = 2048
_SENTINEL = 7777.0


def _sweep_inputs(dtype, device, contiguous=False):
    """The gradient case's logits as a view into a buffer that holds _SENTINEL around it: rows
    n_cols + _GUARD elements apart with the gaps filled, or (``contiguous``) rows n_cols apart with
    _GUARD elements after the last."""
    logits, target, ignore_index = _gradient_case("cpu")
    if dtype != torch.float32:
        # Around 40, as a model's logits may be, a bf16 step is 1/4: a value of the row rounded to
        # bf16 on the way (its logsumexp, say) moves the softmax by several percent, where a correct
        # kernel only rounds the result.
        logits = logits + 40.0
    n_rows, n_cols = logits.shape
    if contiguous:
        buffer = torch.full((n_rows * n_cols + _GUARD,), _SENTINEL, dtype=dtype)
        buffer[: n_rows * n_cols] = logits.to(dtype).reshape(-1)
        buffer = buffer.to(device)
        view, gaps = buffer[: n_rows * n_cols].view(n_rows, n_cols), buffer[n_rows * n_cols:]
    else:
        buffer = torch.full((n_rows, n_cols + _GUARD), _SENTINEL, dtype=dtype)
        buffer[:, :n_cols] = logits.to(dtype)
        buffer = buffer.to(device)
        view, gaps = buffer[:, :n_cols], buffer[:, n_cols:]
    lse = torch.logsumexp(view.double(), dim=-1).float()
    return view, gaps, target.to(device), lse.to(device), ignore_index


def _call_sweep(fn, view, target, lse, ignore_index) -> tuple[str | None, object]:
    """Run ``fn`` on ``view`` with the exercise's finished answers out of reach; returns (what is
    wrong or None, what ``fn`` returned). Wrong here: it raised, called a finished answer, launched
    no kernel of the reader's, or launched the reader's kernels on memory other than the logits'."""
    try:
        with warnings.catch_warnings(), launches() as launched:
            warnings.simplefilter("ignore", RuntimeWarning)  # NumPy's overflow notices from the interpreter
            returned = call_learner("inplace_gradient", fn, view, target, lse, ignore_index)
    except FinishedCodeCalled as called:
        return str(called), None
    except NotImplementedError:
        return SWEEP_DIAGNOSES["stub"], None
    except Exception as exc:  # the reader's kernel may fail in any way: say how
        text = str(exc)
        if "bf16" in text and "Expected dtype" in text:
            return SWEEP_DIAGNOSES["upcast"] + f" (Triton said: {text.strip().splitlines()[-1][:200]})", None
        return f"{SWEEP_DIAGNOSES['raised']}: {type(exc).__name__}: {text.strip()[:500]}", None
    if view.device.type == "cuda":
        torch.cuda.synchronize(view.device)
    problem = _no_kernel(launched, "the gradient over the logits")
    if problem:
        return problem, returned
    if launched is not None and not any(launch.writes_to(view) for launch in launched if launch.readers):
        return SWEEP_DIAGNOSES["copy"], returned
    return None, returned


def _elsewhere(returned, view) -> torch.Tensor | None:
    """What ``fn`` returned, when it is a tensor of the view's shape outside the view's memory."""
    if not isinstance(returned, torch.Tensor) or tuple(returned.shape) != tuple(view.shape):
        return None
    if returned.untyped_storage().data_ptr() == view.untyped_storage().data_ptr():
        return None
    return returned


def _sweep_mistakes(logits, target, ignore_index, n_valid):
    """The gradients of a sweep whose programs all load row 0's logsumexp, or row 0's target (row 0
    counts)."""
    x = logits.detach().to("cpu", torch.float64)
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    counted = (target != ignore_index)[:, None].to(x.dtype)
    onehot = torch.zeros_like(x)
    rows = (target != ignore_index).nonzero()[:, 0]
    onehot[rows, target[rows]] = 1.0
    row0_onehot = torch.zeros_like(x)
    row0_onehot[:, int(target[0])] = 1.0
    return [
        ((torch.exp(x - lse[:1]) - onehot) / n_valid * counted, "lse-row0"),
        ((torch.exp(x - lse) - row0_onehot) / n_valid, "target-row0"),
    ]


def _diagnose_sweep(fn, dtype, device) -> str | None:
    """Run fn on a strided view of one dtype and name what is wrong, or None."""
    view, gaps, target, lse, ignore_index = _sweep_inputs(dtype, device)
    before = view.detach().cpu().clone()
    problem, returned = _call_sweep(fn, view, target, lse, ignore_index)
    if problem:
        return problem
    name = str(dtype).removeprefix("torch.")
    on = f"on {name} logits of 6 × 300 in a view whose rows are {view.stride(0)} elements apart"
    where = f" ({on})"
    got = view.detach().cpu().to(torch.float64)
    changed = view.detach().cpu() != before
    gaps_written = bool((gaps.cpu() != _SENTINEL).any())
    p, onehot, counted, n_valid, want = _gradient_parts(before, target, ignore_index)
    rtol, atol = (1e-4, 1e-7) if dtype == torch.float32 else (2**-6, 2**-8 * float(want.abs().max()))
    if not changed.any() and not gaps_written:
        copy = _elsewhere(returned, view)
        if copy is not None and _close(copy.detach().cpu().double(), want, rtol=rtol, atol=atol):
            return SWEEP_DIAGNOSES["copy"] + (" (your launcher returned the gradient in another "
                                              f"tensor; {on})")
        return SWEEP_DIAGNOSES["stub"]
    if gaps_written or not changed[1:].any():
        # Either the kernel writes outside its rows, or every program writes the same place. Which
        # one? The same function on contiguous logits (rows n_cols apart) tells a missing stride
        # from a missing mask.
        c_view, c_gaps, c_target, c_lse, _ = _sweep_inputs(dtype, device, contiguous=True)
        c_before = c_view.detach().cpu().clone()
        c_right = (_call_sweep(fn, c_view, c_target, c_lse, ignore_index)[0] is None
                   and bool((c_gaps.cpu() == _SENTINEL).all())
                   and _close(c_view.detach().cpu().double(),
                              _gradient_parts(c_before, target, ignore_index)[4],
                              rtol=rtol, atol=atol))
        if c_right:
            return SWEEP_DIAGNOSES["stride"] + where
        if not changed[1:].any():
            return SWEEP_DIAGNOSES["one-row"] + where
        return SWEEP_DIAGNOSES["mask"] + where
    values_right = _close(got, want, rtol=rtol, atol=atol)
    if values_right:
        return None
    if not changed[~counted].any() and _close(got[counted], want[counted], rtol=rtol, atol=atol):
        return SWEEP_DIAGNOSES["ignored-unwritten"] + where
    first_block = int(changed.any(dim=0).nonzero().max()) + 1
    if first_block < view.shape[1] and not changed[:, first_block:].any():
        return SWEEP_DIAGNOSES["first-chunk"] + (f" (columns {first_block} to {view.shape[1] - 1} "
                                                 f"are unchanged, {on})")
    for wrong, key in _sweep_mistakes(before, target.cpu(), ignore_index, n_valid):
        if _close(got, wrong, rtol=rtol, atol=atol):
            return SWEEP_DIAGNOSES[key] + where
    problem = _diagnose_values(got, before, target.cpu(), p, onehot, counted, n_valid, want, rtol, atol)
    if dtype != torch.float32 and problem and problem.startswith(GRADIENT_DIAGNOSES["wrong"]):
        error = relative_error(got, want)
        if error < 0.2:  # right in its structure, too far for bf16 rounding
            return SWEEP_DIAGNOSES["precision"] + f" (relative error {error:.1e}, {on})"
    return problem + where if problem else None


# The high-row case: 3 rows of 300 logits whose rows are 2**30 + 64 elements apart, so row 2 starts
# at element 2**31 + 128, past int32. The view starts 2**31 elements into its buffer: an offset that
# wraps around to -2**31 + 128 then still lands inside the buffer, where it is harmless and seen.
# 2**32 bf16 elements: 8 GiB of addresses, of which a kernel touches a few pages. On a GPU that is
# real memory (checked free first); on the CPU, where Triton's interpreter runs the kernel, it is an
# address range mapped without memory behind it: a page becomes memory only once something writes to
# it, so the check costs kilobytes there.
_HIGH_STRIDE = 2**30 + 64
_HIGH_HEADROOM = 2**31
_HIGH_COLS = 300
_HIGH_ELEMENTS = _HIGH_HEADROOM + 2 * _HIGH_STRIDE + _HIGH_COLS + 64


def _high_rows_fit(device) -> bool:
    if device.type == "cpu":
        return True  # address space, not memory: see mapped_buffer
    if device.type != "cuda":
        return False
    free, _ = torch.cuda.mem_get_info(device)
    return free > 2 * _HIGH_ELEMENTS + 2**30  # bf16, and 1 GiB to spare (as mapped_buffer asks)


def _high_rows_buffer(device) -> torch.Tensor | None:
    """The high-row case's bf16 buffer of ``_HIGH_ELEMENTS`` elements, or None where it cannot be had."""
    return mapped_buffer(_HIGH_ELEMENTS, torch.bfloat16, device)


def _diagnose_high_rows(fn, device) -> tuple[str | None, bool]:
    """Does row 2 of a view, at an element offset past 2**31, get its gradient (int64 row offsets)?
    Runs ``fn`` on that view: on a GPU in real memory, on the CPU in a mapped address range (see
    ``_high_rows_buffer``). Returns (what is wrong or None, whether the case could run at all)."""
    buffer = _high_rows_buffer(device)
    if buffer is None:
        return None, False
    view = buffer.as_strided((3, _HIGH_COLS), (_HIGH_STRIDE, 1), storage_offset=_HIGH_HEADROOM)
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(3, _HIGH_COLS, generator=gen) * 3).to(torch.bfloat16)
    view.copy_(logits.to(device))
    target = torch.tensor([5, -100, 299], device=device)
    lse = torch.logsumexp(logits.double(), dim=-1).float().to(device)
    problem = _call_sweep(fn, view, target, lse, -100)[0]
    got = view.detach().cpu().double()
    del view, buffer  # 8 GiB of addresses: give them back before anything else runs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    where = f" (on a view whose rows are {_HIGH_STRIDE:,} elements apart)"
    if problem:
        return problem + where, True
    want = _gradient_parts(logits, target.cpu(), -100)[4]
    rtol, atol = 2**-6, 2**-8 * float(want.abs().max())
    if _close(got, want, rtol=rtol, atol=atol):
        return None, True
    if _close(got[:2], want[:2], rtol=rtol, atol=atol):
        return (SWEEP_DIAGNOSES["int32"] + (f" (row 2 of a view whose rows are {_HIGH_STRIDE:,} "
                                            "elements apart starts at element "
                                            f"{2 * _HIGH_STRIDE:,}, past 2**31 − 1 = "
                                            f"{2**31 - 1:,}: rows 0 and 1 are right, row 2 "
                                            "is not)")), True
    return SWEEP_DIAGNOSES["stride"] + where, True


def check_inplace_gradient(fn: Callable, device=None, verbose: bool = True,
                           high_rows: bool | None = None) -> bool:
    """Check ``fn(logits, target, lse, ignore_index)``: it must overwrite each row of ``logits``
    (2-D, rows possibly strided) with the gradient of the mean cross-entropy, ``(softmax − onehot) /
    n_valid``, zeros on ignored rows.

    ``fn`` runs with the exercise's finished answers out of reach
    (``FORBIDDEN["inplace_gradient"]``), and must launch a kernel of the reader's on the logits' own
    memory. It runs ``fn`` on float32 and bfloat16 logits in views whose rows are further apart than
    their width (the gaps show a store without a mask), then on a bfloat16 view whose third row
    starts past element 2**31, where int32 row offsets wrap around: in Triton's interpreter (on the
    CPU) that view lives in a mapped address range with almost no memory behind it; on a GPU it
    needs 9 GiB free. ``high_rows`` forces that case (True) or skips it (False); by default it runs
    wherever it fits. Prints the verdict (unless ``verbose=False``) and returns True when right
    (chapter 06, notebooks/06_cross_entropy_kernel.ipynb).

    Args:
        fn: the reader's ``fn(logits, target, lse, ignore_index)``, which writes the gradient into
            ``logits`` (2-D, rows possibly strided) given the targets [N] and each row's
            logsumexp ``lse`` [N]; what it returns only serves to name a gradient written into a
            copy instead of ``logits``.
        device: where the inputs are made; None for ``runtime.device()``.
        verbose: print the verdict: ✓ and what was checked (and whether the int64 row offsets
            were), or ✗ and the mistake the gradient shows.
        high_rows: run the case past element 2**31 (True), skip it (False), or run it where it fits
            (None).

    Returns:
        True when every case is right, False otherwise.
    """
    device = torch.device(device or runtime.device())
    for dtype in (torch.float32, torch.bfloat16):
        problem = _diagnose_sweep(fn, dtype, device)
        if problem:
            return _report(problem, "", verbose)
    if high_rows is None:
        high_rows = _high_rows_fit(device)
    ran = False
    if high_rows:
        problem, ran = _diagnose_high_rows(fn, device)
        if problem:
            return _report(problem, "", verbose)
    if ran:
        offsets = "and row 2 of a view at element 2**31 + 128 (int64 row offsets)"
    else:
        why = "skipped" if not high_rows else "this machine would not map the 8 GiB of addresses it needs"
        offsets = (f"int64 row offsets NOT checked ({why}: a view whose row 2 starts past element "
                   "2**31 shows them)")
    return _report(None, ("the in-place gradient is right: float32 and bfloat16, strided rows, the "
                          "partial last chunk masked, ignored rows written as zeros; "
                          f"{offsets}"), verbose)
