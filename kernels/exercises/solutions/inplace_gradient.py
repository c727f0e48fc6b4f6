"""Chapter 06, exercise 2: the gradient sweep written over the logits, one program per row, chunk by
chunk."""

import torch
import triton
import triton.language as tl

from kernels.triton_utils import cast_to

BLOCK_V = 128


@triton.jit
def _inplace_gradient_kernel(LOGITS, TARGET, LSE, SCALE, n_cols, stride, ignore_index,
                             BLOCK_V: tl.constexpr):
    # int64 before multiplying: row * stride passes 2**31 on large logits
    row = tl.program_id(0).to(tl.int64)
    row_ptr = LOGITS + row * stride  # rows are `stride` elements apart, which may be more than n_cols
    target = tl.load(TARGET + row)
    lse = tl.load(LSE + row)
    row_scale = tl.where(target != ignore_index, tl.load(SCALE), 0.0)  # an ignored row becomes zeros
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        ok = cols < n_cols  # the last chunk is partial: nothing past the row's end is read or written
        x = tl.load(row_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        g = (tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)) * row_scale
        tl.store(row_ptr + cols, cast_to(g, LOGITS.dtype.element_ty), mask=ok)  # over the logits just read


def inplace_gradient(logits, target, lse, ignore_index=-100):
    scale = 1.0 / (target != ignore_index).sum().to(torch.float32)  # stays on the device: no host sync
    _inplace_gradient_kernel[(logits.shape[0],)](logits, target, lse, scale, logits.shape[1],
                                                 logits.stride(0), ignore_index, BLOCK_V=BLOCK_V)
    return logits
