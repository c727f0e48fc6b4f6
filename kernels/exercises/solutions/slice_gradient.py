"""Chapter 10: the gradient of one vocabulary slice, from its logits and each token's logsumexp."""

import torch


def slice_gradient(logits, lse, target, col_start, scale, ignore_index=-100):
    # Upcast first: every step below runs in float32, whatever the dtype of the logits.
    x = logits.float()
    # The softmax over the whole vocabulary, one element at a time: lse already holds each row's normaliser.
    p = torch.exp(x - lse.float()[:, None])
    # Column j of the slice is class col_start + j. Comparing (not indexing) leaves the rows whose
    # target lies in another slice, or is ignore_index, without a −1.
    cols = torch.arange(col_start, col_start + x.shape[1], device=x.device)
    onehot = (cols[None, :] == target[:, None]).float()
    # An ignored row does not count in the loss: its gradient is zero.
    counted = (target != ignore_index).float()[:, None]
    return (p - onehot) * scale * counted
