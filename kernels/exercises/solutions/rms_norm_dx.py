"""Chapter 03's first exercise, one answer: dx of RMSNorm, one row per program.

Carrying out chapter 03's sum, with g = dy ⊙ w (the gradient that reaches x̂) and x̂ = x · rstd:

    dx_k = rstd · g_k − (rstd³ · x_k / N) · Σ_j g_j x_j = rstd · (g_k − x̂_k · mean(g ⊙ x̂))

    dx = rstd · (g − x̂ · mean(g ⊙ x̂))

The first term is the gradient as if rstd were a constant; the second removes the component along x̂, because
scaling a row up is undone by the normalisation.
"""

import torch
import triton
import triton.language as tl

from kernels.triton_utils import cast_to


@triton.jit
def _rms_norm_dx_kernel(X, W, DY, RSTD, DX, n_cols, stride_x, stride_dy, stride_dx, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD + row)
    x_hat = x * rstd
    g = dy * w

    # The masked lanes hold zeros, so they add nothing to the sum; the mean divides by the real width.
    mean_g_x_hat = tl.sum(g * x_hat, axis=0) / n_cols
    dx = rstd * (g - x_hat * mean_g_x_hat)

    tl.store(DX + row * stride_dx + cols, cast_to(dx, DX.dtype.element_ty), mask=mask)


def rms_norm_dx(dy, x, weight, rstd):
    """dx for a 2-D x, one program per row; rstd is the float32 1/sqrt(mean(x²) + eps) of each row."""
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_rows, n_cols = x.shape
    _rms_norm_dx_kernel[(n_rows,)](
        x, weight, dy, rstd, dx, n_cols, x.stride(0), dy.stride(0), dx.stride(0),
        BLOCK_N=triton.next_power_of_2(n_cols),
    )
    return dx
