"""Chapter 05: the online-softmax update, one chunk at a time."""

import torch


def online_update(m, s, chunk):
    # The running max can only grow; the old sum was measured relative to the old max, so it is
    # rescaled by exp(m − m_new) ≤ 1 (0 on the first chunk, where m = −inf), and the chunk's terms
    # are taken relative to m_new.
    m_new = torch.maximum(m, chunk.max())
    s_new = s * torch.exp(m - m_new) + torch.exp(chunk - m_new).sum()
    return m_new, s_new
