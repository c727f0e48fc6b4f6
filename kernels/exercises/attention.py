"""Check for the exercise of chapter 16: the inner loop of FlashAttention's forward, written in PyTorch.

The reader completes ``fn(q, k, v, causal, block_n) -> out`` for one sequence: q is [heads, seq, head_dim], k and v
[kv_heads, seq, head_dim] (grouped-query attention), and the loop walks the keys ``block_n`` at a time with the
running maximum m, the running sum l and the accumulator acc of chapter 05's online softmax. ``check_attention_loop``
runs it on a few fresh inputs (GQA 4/2 and 6/3, a length that is not a multiple of the block, causal and not, scores
large enough that a missing rescale shows) and compares with float64.

When the output is wrong, the check recomputes the usual mistakes with the same loop and says which one the output
reproduces: acc or l not rescaled when the maximum grows, the causal mask missing or off by one on the diagonal
block, the scale 1/√d missing or 1/d, the wrong KV head for a query head, the output not divided by l. Every
diagnosis is worded once, in ``HINTS``. The check never raises because the reader's code is wrong or unfinished: it
prints its verdict and returns a ``Report``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kernels.attention import attention_reference
from kernels.reference import relative_error

from .rmsnorm import Report, last_line, verdict

HINTS = {
    "raised": "your function raised {error}",
    "shape": "your function returned {got}, expected a tensor of shape {want} (q's)",
    "not_finite": ("the output holds NaN or infinity: a fully masked block gives exp(−inf − (−inf)); start m at a "
                   "large finite negative number, or mask with −inf only what the block's maximum still covers"),
    "no_rescale_acc": ("acc is not rescaled when the maximum grows: before adding the block's p @ v, multiply acc by "
                       "alpha = exp(m_old − m_new) (one number per query row)"),
    "no_rescale_l": ("l is not rescaled when the maximum grows: l = l · exp(m_old − m_new) + p.sum(-1), the same alpha "
                     "as acc's"),
    "no_rescale": ("neither acc nor l is rescaled when the maximum grows: both were summed relative to the old "
                   "maximum; multiply each by alpha = exp(m_old − m_new) before adding the block's terms"),
    "no_causal_mask": ("the output attends to later keys: with causal=True, key j must be masked (−inf) for query i "
                       "when j > i, on the diagonal block (blocks wholly after the query are skipped or masked too)"),
    "causal_strict": ("each query is masked from its own key: the causal mask keeps j ≤ i (the diagonal belongs to "
                      "the query), not j < i"),
    "no_scale": "the scores are not scaled: multiply q @ kᵀ by 1/√d (d = head_dim) before the softmax",
    "scale_d": "the scores are scaled by 1/d: the scale is 1/√d (d = head_dim), math.sqrt(d)",
    "gqa_modulo": ("query head h reads KV head h % kv_heads: in grouped-query attention consecutive query heads share "
                   "a KV head, h // (heads // kv_heads)"),
    "not_normalised": "the output is acc itself: divide by l at the end, out = acc / l[:, None]",
    "unrecognised": ("the output differs from float64 (relative error {error:.2e}) on {case}, and none of the usual "
                     "mistakes reproduces it: print it beside attention_reference(...) to see the pattern"),
    "passed": ("your inner loop matches float64 on {n} inputs (GQA 4/2 and 6/3, causal and not, a length that is not "
               "a multiple of the block; worst relative error {error:.1e})"),
}

MISTAKES = ("no_rescale", "no_rescale_acc", "no_rescale_l", "no_causal_mask", "causal_strict", "no_scale", "scale_d",
            "gqa_modulo", "not_normalised")


def blockwise_attention(q, k, v, causal: bool, block_n: int, mistake: str | None = None) -> torch.Tensor:
    """The exercise's loop in plain PyTorch (float64 in the check), with one of ``MISTAKES`` made on purpose."""
    heads, seq, d = q.shape
    group = heads // k.shape[0]
    scale = {"no_scale": 1.0, "scale_d": 1.0 / d}.get(mistake, 1.0 / math.sqrt(d))
    out = torch.empty_like(q)
    rows = torch.arange(seq)[:, None]
    for h in range(heads):
        kh = h % k.shape[0] if mistake == "gqa_modulo" else h // group
        m = torch.full((seq,), -1e30, dtype=q.dtype)
        l = torch.zeros(seq, dtype=q.dtype)  # noqa: E741  (the l of the online softmax)
        acc = torch.zeros(seq, d, dtype=q.dtype)
        for n0 in range(0, seq, block_n):
            cols = torch.arange(n0, min(n0 + block_n, seq))[None, :]
            s = q[h] @ k[kh, n0:n0 + block_n].T * scale
            if causal and mistake != "no_causal_mask":
                hidden = cols >= rows if mistake == "causal_strict" else cols > rows
                s = s.masked_fill(hidden, float("-inf"))
            m_new = torch.maximum(m, s.max(dim=-1).values)
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new[:, None])
            keep_l = mistake in ("no_rescale", "no_rescale_l")
            keep_acc = mistake in ("no_rescale", "no_rescale_acc")
            l = (l if keep_l else l * alpha) + p.sum(-1)  # noqa: E741
            acc = (acc if keep_acc else acc * alpha[:, None]) + p @ v[kh, n0:n0 + block_n]
            m = m_new
        out[h] = acc if mistake == "not_normalised" else acc / l[:, None]
    return out


def _cases(gen: torch.Generator):
    # (heads, kv_heads, seq, d, causal, block_n, spread): the scores' spread makes a missing rescale visible.
    for heads, kv_heads, seq, d, causal, block_n in ((4, 2, 37, 16, True, 8), (6, 3, 29, 32, False, 16),
                                                     (4, 2, 40, 16, True, 16)):
        q = torch.randn(heads, seq, d, generator=gen, dtype=torch.float64) * 3
        k = torch.randn(kv_heads, seq, d, generator=gen, dtype=torch.float64)
        v = torch.randn(kv_heads, seq, d, generator=gen, dtype=torch.float64)
        yield (heads, kv_heads, seq, d, causal, block_n), q, k, v


def _describe(case) -> str:
    heads, kv_heads, seq, d, causal, block_n = case
    return f"{heads}/{kv_heads} heads, seq {seq}, d={d}, {'causal' if causal else 'not causal'}, block_n={block_n}"


def diagnose(out, q, k, v, causal, block_n) -> str | None:
    """The mistake whose float64 recomputation ``out`` reproduces, or None."""
    for mistake in MISTAKES:
        if mistake in ("no_causal_mask", "causal_strict") and not causal:
            continue
        wrong = blockwise_attention(q, k, v, causal, block_n, mistake)
        finite = torch.isfinite(wrong)
        # A strict causal mask leaves the first query no key (NaN there): compare where both are finite.
        if torch.equal(finite, torch.isfinite(out)) and relative_error(out[finite], wrong[finite]) < 1e-6:
            return mistake
    return None


def check_attention_loop(fn: Callable, verbose: bool = True, seed: int = 0) -> Report:
    """Run ``fn(q, k, v, causal, block_n)`` on fresh float64 inputs; name the mistake when the output is wrong."""
    gen = torch.Generator().manual_seed(seed)
    worst, n = 0.0, 0
    for case, q, k, v in _cases(gen):
        heads, kv_heads, seq, d, causal, block_n = case
        try:
            out = fn(q.clone(), k.clone(), v.clone(), causal, block_n)
        except Exception as exc:  # noqa: BLE001  (the reader's code: report, never raise)
            return verdict(False, HINTS["raised"].format(error=last_line(exc)), verbose)
        if not isinstance(out, torch.Tensor) or out.shape != q.shape:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            return verdict(False, HINTS["shape"].format(got=got, want=tuple(q.shape)), verbose)
        out = out.detach().to(torch.float64)
        if not torch.isfinite(out).all():
            mistake = diagnose(out, q, k, v, causal, block_n)
            return verdict(False, HINTS[mistake] if mistake else HINTS["not_finite"], verbose)
        ref = attention_reference(q[None], k[None], v[None], causal=causal)[0]
        error = relative_error(out, ref)
        if error > 1e-9:
            mistake = diagnose(out, q, k, v, causal, block_n)
            message = HINTS[mistake] if mistake else HINTS["unrecognised"].format(error=error, case=_describe(case))
            return verdict(False, message, verbose)
        worst, n = max(worst, error), n + 1
    return verdict(True, HINTS["passed"].format(n=n, error=worst), verbose)
