"""Chapter 02's forward function, one answer: RMSNorm with one row per program, in Hugging Face's
cast order."""

import torch
import triton
import triton.language as tl

from kernels.triton_utils import cast_to


@triton.jit
def _rms_norm_row_kernel(X, W, Y, n_cols, stride_x, stride_y, eps, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride must not overflow
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    # The masked lanes hold zeros: they add nothing to the sum, and the mean divides by the real width.
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    # rounded to x's dtype first, as Hugging Face does
    x_hat = cast_to(x * rstd, X.dtype.element_ty).to(tl.float32)
    tl.store(Y + row * stride_y + cols, cast_to(x_hat * w, Y.dtype.element_ty), mask=mask)


def rms_norm_forward_rows(x, weight, eps=1e-6):
    """RMSNorm of a 2-D x (rows may be strided), one program per row; the output has x's dtype."""
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_rows, n_cols = x.shape
    _rms_norm_row_kernel[(n_rows,)](
        x, weight, y, n_cols, x.stride(0), y.stride(0), eps, BLOCK_N=triton.next_power_of_2(n_cols)
    )
    return y
