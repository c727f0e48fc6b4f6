"""Chapter 16: FlashAttention's inner loop, one query head at a time, the keys block by block."""

import math

import torch


def attention_loop(q, k, v, causal, block_n):
    heads, seq, d = q.shape
    group = heads // k.shape[0]  # query heads per KV head: consecutive query heads share one
    scale = 1.0 / math.sqrt(d)
    out = torch.empty_like(q)
    rows = torch.arange(seq)[:, None]
    for h in range(heads):
        kh = h // group
        # finite: a fully masked block leaves alpha = 1, not NaN
        m = torch.full((seq,), -1e30, dtype=q.dtype)
        l = torch.zeros(seq, dtype=q.dtype)  # noqa: E741
        acc = torch.zeros(seq, d, dtype=q.dtype)
        for n0 in range(0, seq, block_n):
            s = q[h] @ k[kh, n0:n0 + block_n].T * scale
            if causal:  # key j after query i is hidden; the diagonal (j == i) stays
                cols = torch.arange(n0, min(n0 + block_n, seq))[None, :]
                s = s.masked_fill(cols > rows, float("-inf"))
            m_new = torch.maximum(m, s.max(dim=-1).values)
            # what the old terms were measured against, moved to the new maximum
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new[:, None])
            l = l * alpha + p.sum(-1)  # noqa: E741
            acc = acc * alpha[:, None] + p @ v[kh, n0:n0 + block_n]
            m = m_new
        out[h] = acc / l[:, None]
    return out
