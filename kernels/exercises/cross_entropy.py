"""Checks for the exercises of chapters 05 (the online-softmax update) and 06 (the cross-entropy gradient).

Each check runs the reader's function on small inputs chosen to expose one mistake each, compares with the right
answer and with the answers that the usual mistakes give, and prints what is wrong in words. It returns True when
everything is right and never raises: a notebook with the exercise left undone still runs to the end.
"""

from __future__ import annotations

import math

import torch

from .. import runtime

_OK = "✓ "
_WRONG = "✗ "


def _report(problem: str | None, success: str) -> bool:
    print(_WRONG + problem if problem else _OK + success)
    return problem is None


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-5, atol: float = 1e-6) -> bool:
    return bool(torch.allclose(a.to(torch.float64), b.to(torch.float64), rtol=rtol, atol=atol, equal_nan=True))


# --------------------------------------------------------------------------------------------------------------------
# Chapter 05: online_update(m, s, chunk) -> (m_new, s_new)
# --------------------------------------------------------------------------------------------------------------------

# (what the case is, m, s, chunk): a chunk that raises the max, one that does not, the first chunk, large logits.
# The general cases come first: they tell the usual mistakes apart, where the first chunk only gives inf or NaN.
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
    """What the common mistakes return for s_new, each with the sentence that explains it."""
    m_new = torch.maximum(m, x.max())
    chunk_sum = torch.exp(x - m_new).sum()
    return [
        (s + chunk_sum, "the old sum s is not rescaled: when the max grows from m to m_new, every term already in s "
                        "was exp(x − m) and must become exp(x − m_new), so multiply s by exp(m − m_new)"),
        (s * torch.exp(m_new - m) + chunk_sum, "the rescale factor is upside down: use exp(m − m_new) (≤ 1), "
                                               "not exp(m_new − m)"),
        (s * torch.exp(m - m_new) + torch.exp(x - m).sum(),
         "the new chunk's terms are taken relative to the old max m; take them relative to m_new: "
         "Σ exp(chunk − m_new)"),
        (s + torch.exp(x).sum(), "no max is subtracted: exp(x) overflows float32 once x > 88.7; keep every term "
                                 "as exp(x − m_new)"),
        (s * torch.exp(m - m_new) + torch.exp(x).sum(), "the chunk's terms are exp(chunk) without subtracting "
                                                        "m_new: use Σ exp(chunk − m_new)"),
    ]


def _diagnose_update(fn, label, m_val, s_val, values) -> str | None:
    m = torch.tensor(m_val, dtype=torch.float32)
    s = torch.tensor(s_val, dtype=torch.float32)
    x = torch.tensor(values, dtype=torch.float32)
    where = f"on {label} (m = {m_val}, s = {s_val}, chunk = {values})"
    try:
        result = fn(m.clone(), s.clone(), x.clone())
    except NotImplementedError:
        return "online_update is still the stub (it raises NotImplementedError): write the two update lines"
    except Exception as exc:  # the reader's code may fail in any way: say how
        return f"online_update raised {type(exc).__name__}: {exc} {where}"
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        return f"online_update must return two values (m_new, s_new), got {type(result).__name__} {where}"
    got_m, got_s = (torch.as_tensor(v, dtype=torch.float32).reshape(()) for v in result)
    want_m, want_s = _expected_update(m, s, x)
    if not _close(got_m, want_m):
        if _close(got_m, x.max()):
            return (f"m_new = {got_m.item():g} is the chunk's max alone {where}; the running max must never go "
                    f"down: m_new = max(m, max(chunk)) = {want_m.item():g}")
        return f"m_new = {got_m.item():g}, expected max(m, max(chunk)) = {want_m.item():g} {where}"
    if not torch.isfinite(got_s):
        if math.isinf(m_val):
            why = "on the first chunk the rescale factor must be exp(m − m_new) = exp(−inf) = 0, not exp(m_new − m)"
        else:
            why = "exp overflowed float32 (its limit is exp(88.7)): every term must be exp(x − m_new) ≤ 1"
        return f"s_new is {got_s.item()} {where}: {why}"
    if _close(got_s, want_s):
        return None
    for wrong, sentence in _update_mistakes(m, s, x):
        if torch.isfinite(wrong) and _close(got_s, wrong):
            return f"{sentence} (s_new = {got_s.item():.6g} instead of {want_s.item():.6g} {where})"
    return f"s_new = {got_s.item():.6g}, expected s·exp(m − m_new) + Σ exp(chunk − m_new) = {want_s.item():.6g} {where}"


def check_online_update(fn) -> bool:
    """Check the reader's ``online_update(m, s, chunk) -> (m_new, s_new)`` (0-d float32 tensors and a 1-D chunk)."""
    for case in _UPDATE_CASES:
        problem = _diagnose_update(fn, *case)
        if problem:
            return _report(problem, "")
    return _report(None, "online_update is right: first chunk, growing max, steady max and large logits all check out")


# --------------------------------------------------------------------------------------------------------------------
# Chapter 06: the gradient sweep, fn(logits [N, V] float32, target [N] int64, ignore_index) -> grad [N, V]
# --------------------------------------------------------------------------------------------------------------------


def _gradient_case(device):
    # 6 rows of 300 logits (more than one chunk of 128 or 256), spread enough that the softmax is not flat;
    # targets at both ends of the row, and two ignored rows, so n_valid (4) differs from the row count (6).
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 300, generator=gen) * 3
    target = torch.tensor([0, 299, -100, 137, -100, 256])
    return logits.to(device), target.to(device), -100


def _gradient_mistakes(p, onehot, counted, n_valid, n_rows):
    keep = counted[:, None].to(p.dtype)
    return [
        (p / n_valid * keep, "the target column lacks its −1: the gradient is softmax − onehot(target), not softmax"),
        (-(p - onehot) / n_valid * keep, "the sign is flipped: d loss / d x = softmax − onehot, not onehot − softmax"),
        ((p - onehot) * keep, f"the gradient is not divided by the number of counted targets: the loss is a mean "
                              f"over the n_valid = {n_valid} rows that are not ignored, so scale by 1 / n_valid"),
        ((p - onehot) / n_rows * keep, f"the gradient is divided by all {n_rows} rows; the mean runs over the "
                                       f"{n_valid} rows whose target is not ignore_index: scale by 1 / n_valid"),
        ((p - onehot) / n_valid, "ignored rows (target == ignore_index) must get a zero gradient: they are not part "
                                 "of the loss; multiply by a row scale that is 0 for them"),
    ]


def check_ce_gradient(fn, device=None) -> bool:
    """Check ``fn(logits, target, ignore_index) -> grad``: the gradient of the *mean* cross-entropy.

    The inputs live on ``device`` (default: where the kernels run, ``runtime.device()``).
    """
    device = device or runtime.device()
    logits, target, ignore_index = _gradient_case(device)
    try:
        got = fn(logits.clone(), target.clone(), ignore_index)
    except NotImplementedError:
        return _report("the gradient function is still the stub (it raises NotImplementedError)", "")
    except Exception as exc:  # the reader's kernel may fail in any way: say how
        return _report(f"your function raised {type(exc).__name__}: {exc}", "")
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(logits.shape):
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        return _report(f"expected a gradient of shape {tuple(logits.shape)}, got {shape}", "")
    got = got.detach().to("cpu", torch.float64)
    x, t = logits.cpu().to(torch.float64), target.cpu()
    counted = t != ignore_index
    n_valid, n_rows = int(counted.sum()), x.shape[0]
    p = torch.softmax(x, dim=-1)
    onehot = torch.zeros_like(p)
    onehot[counted.nonzero()[:, 0], t[counted]] = 1.0
    want = (p - onehot) / n_valid * counted[:, None]
    if not torch.isfinite(got).all():
        return _report("the gradient holds NaN or infinity: compute the softmax as exp(x − lse) in float32, and give "
                       "ignored rows a scale of 0 before multiplying", "")
    if not got.any():
        return _report("every element of the gradient is zero: the gradient line is still the stub (or nothing is "
                       "stored)", "")
    if _close(got, want, rtol=1e-4, atol=1e-7):
        return _report(None, "the gradient is right: softmax − onehot, scaled by 1 / n_valid, zero on ignored rows")
    for wrong, sentence in _gradient_mistakes(p, onehot, counted, n_valid, n_rows):
        if _close(got, wrong, rtol=1e-4, atol=1e-7):
            return _report(sentence, "")
    row_sums = got[counted].sum(dim=-1)
    if not _close(row_sums, torch.zeros_like(row_sums), atol=1e-5):
        return _report("each counted row of the gradient must sum to 0 (the softmax sums to 1, and so does the "
                       "one-hot): the softmax is not normalised, use exp(x − lse) with the row's logsumexp", "")
    err = (got - want).abs()
    r, c = divmod(int(err.argmax()), x.shape[1])
    return _report(
        f"largest error at row {r}, column {c} (that row's target is {int(t[r])}): got {got[r, c].item():.6g}, "
        f"expected {want[r, c].item():.6g}", "",
    )
