"""Chapter 17's exercise, one answer: the residual add fused into RMSNorm's forward, a tile of ROWS
rows × BLOCK_N columns per program."""

import triton
import triton.language as tl

from kernels.triton_utils import cast_to


@triton.jit
def add_rms_norm_kernel(X, R, W, Y, H, n_rows, n_cols, stride_x, stride_r, stride_y, stride_h, eps,
                        ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    # The tile: ROWS rows (int64, so that row * stride cannot overflow), the whole width in BLOCK_N
    # lanes; the lanes past n_cols and the rows past n_rows are switched off.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    # One read of each input, float32 before any arithmetic.
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)

    # The add, rounded to the model's dtype as Hugging Face's `residual + hidden_states` is: the
    # next layer reads this h, and this norm normalises it.
    h = cast_to(x + r, H.dtype.element_ty)
    tl.store(H + rows[:, None] * stride_h + cols[None, :], h, mask=mask)
    h = h.to(tl.float32)

    # LlamaRMSNorm of h: the mean over the real width, eps inside the root, the normalised value
    # rounded before the weight's product.
    rstd = tl.math.rsqrt(tl.sum(h * h, axis=1) / n_cols + eps)
    h_hat = cast_to(h * rstd[:, None], Y.dtype.element_ty).to(tl.float32)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], cast_to(h_hat * w[None, :], Y.dtype.element_ty),
             mask=mask)
