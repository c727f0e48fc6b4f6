"""Check for the exercise of chapter 10: the gradient of one vocabulary slice, recomputed in the backward pass.

The reader writes ``slice_gradient(logits, lse, target, col_start, scale, ignore_index)``: for a [tokens, width]
slice of logits holding columns ``col_start ... col_start + width`` of the vocabulary, the logsumexp of every token
over the whole vocabulary and the target classes, return d(loss)/d(logits) for that slice,
(softmax − onehot) · scale, with a zero row for an ignored target. The check runs it on slices chosen so that each
usual mistake gives a different wrong answer (a target outside the slice, a slice that does not start at column 0,
an ignored row, a scale that is not 1) and says which mistake it sees. It prints its verdict, returns True when
everything is right, and never raises.
"""

from __future__ import annotations

import torch

_OK = "✓ "
_WRONG = "✗ "


def reference_slice_gradient(logits, lse, target, col_start, scale, ignore_index=-100):
    """The right answer, in float64."""
    x = logits.to(torch.float64)
    p = torch.exp(x - lse.to(torch.float64)[:, None])
    cols = torch.arange(col_start, col_start + x.shape[1])
    onehot = (cols[None, :] == target[:, None]).to(torch.float64)
    counted = (target != ignore_index).to(torch.float64)[:, None]
    return (p - onehot) * scale * counted


def _mistakes(logits, lse, target, col_start, scale, ignore_index):
    """What the usual mistakes return, each with the sentence that explains it."""
    x = logits.to(torch.float64)
    p = torch.exp(x - lse.to(torch.float64)[:, None])
    counted = (target != ignore_index).to(torch.float64)[:, None]
    width = x.shape[1]
    local = (torch.arange(width)[None, :] == target[:, None]).to(torch.float64)  # forgot col_start
    right = (torch.arange(col_start, col_start + width)[None, :] == target[:, None]).to(torch.float64)
    slice_softmax = torch.softmax(x, dim=1)
    return [
        ((p - local) * scale * counted, "the one-hot compares the target with the slice's own column numbers 0 … "
                                        "width−1: the slice holds vocabulary columns col_start … col_start+width−1, "
                                        "so compare the target with col_start + column"),
        ((slice_softmax - right) * scale * counted, "the softmax is normalised over this slice alone: divide by the "
                                                    "whole vocabulary's sum, i.e. use exp(logits − lse) with the lse "
                                                    "you are given"),
        ((p - right) * counted, "the gradient is not multiplied by scale (1 / the number of counted targets for a "
                                "mean, times the incoming gradient)"),
        ((p - right) * scale, "rows whose target is ignore_index must be zero: they do not count in the loss"),
    ]


def _cases():
    g = torch.Generator().manual_seed(10)
    vocab, width, tokens = 40, 12, 6
    full = torch.randn(tokens, vocab, generator=g) * 2
    lse = torch.logsumexp(full, dim=1)
    target = torch.tensor([3, 17, 20, -100, 39, 14])  # targets inside the slice 12 … 23, before it, after it
    return [
        ("the first slice (columns 0 … 11), scale 1", full[:, :width], lse, target, 0, 1.0),
        ("a middle slice (columns 12 … 23), scale 0.2", full[:, 12:24].contiguous(), lse, target, 12, 0.2),
        ("the last, narrower slice (columns 36 … 39), scale 0.5", full[:, 36:].contiguous(), lse, target, 36, 0.5),
    ]


def _diagnose(fn, label, logits, lse, target, col_start, scale) -> str | None:
    where = f"on {label}"
    try:
        got = fn(logits.clone(), lse.clone(), target.clone(), col_start, scale, -100)
    except NotImplementedError:
        return "slice_gradient is still the stub (it raises NotImplementedError)"
    except Exception as exc:  # the reader's code may fail in any way: say how
        return f"slice_gradient raised {type(exc).__name__}: {exc} {where}"
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(logits.shape):
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        return f"slice_gradient must return a tensor shaped like the slice {tuple(logits.shape)}, got {shape} {where}"
    got = got.detach().to(torch.float64)
    expected = reference_slice_gradient(logits, lse, target, col_start, scale)
    if torch.allclose(got, expected, rtol=1e-5, atol=1e-7):
        return None
    for wrong, why in _mistakes(logits, lse, target, col_start, scale, -100):
        if not torch.allclose(wrong, expected, rtol=1e-5, atol=1e-7) and torch.allclose(got, wrong, rtol=1e-5,
                                                                                        atol=1e-7):
            return f"{why} (seen {where})"
    worst = (got - expected).abs().max().item()
    return f"the gradient differs from (softmax − onehot) · scale by up to {worst:.3g} {where}"


def check_slice_gradient(fn) -> bool:
    """Run ``fn(logits, lse, target, col_start, scale, ignore_index)`` on three slices; print what is wrong."""
    for case in _cases():
        problem = _diagnose(fn, *case)
        if problem:
            print(_WRONG + problem)
            return False
    print(_OK + "slice_gradient is right on the first, a middle and the last slice, with an ignored row and a scale")
    return True
