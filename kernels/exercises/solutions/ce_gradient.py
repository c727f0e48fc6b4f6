"""Chapter 06, exercise 1: the gradient line of the cross-entropy sweep, in its kernel and launcher."""

import torch
import triton
import triton.language as tl

from kernels.cross_entropy import cross_entropy_forward
from kernels.triton_utils import cast_to

BLOCK_V = 128


@triton.jit
def _gradient_kernel(LOGITS, TARGET, LSE, GRAD, SCALE, n_cols, stride, ignore_index, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(TARGET + row)
    counted = target != ignore_index
    lse = tl.load(LSE + row)
    scale = tl.load(SCALE)  # 1 / n_valid
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        ok = cols < n_cols
        x = tl.load(LOGITS + row * stride + cols, mask=ok, other=0.0).to(tl.float32)
        # The answer: softmax − onehot, times 1 / n_valid for a counted row and 0 for an ignored one.
        g = (tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)) * tl.where(counted, scale, 0.0)
        tl.store(GRAD + row * stride + cols, cast_to(g, GRAD.dtype.element_ty), mask=ok)


def ce_gradient(logits, target, ignore_index=-100):
    logits = logits.contiguous()
    _, lse, _ = cross_entropy_forward(logits, target, ignore_index, "none", compute_grad=False)
    scale = 1.0 / (target != ignore_index).sum().to(torch.float32)
    grad = torch.empty_like(logits)
    _gradient_kernel[(logits.shape[0],)](logits, target, lse, grad, scale, logits.shape[1], logits.stride(0),
                                         ignore_index, BLOCK_V=BLOCK_V)
    return grad
