"""Chapter 02's exercise, one answer: RMSNorm's forward on a tile of ROWS rows × BLOCK_N columns per
program."""

import triton
import triton.language as tl

from kernels.triton_utils import cast_to


@triton.jit
def rms_norm_tile_kernel(X, W, Y, n_rows, n_cols, stride_x, stride_y, eps, ROWS: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    # The tile: this program's ROWS row indices (int64, so that row * stride cannot overflow) and
    # BLOCK_N columns.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    # Only real elements: the last program's tile may hang past n_rows, and BLOCK_N past n_cols.
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    # Rows are a stride apart, not a width: each tensor has its own row stride.
    x_offsets = rows[:, None] * stride_x + cols[None, :]
    y_offsets = rows[:, None] * stride_y + cols[None, :]
    x = tl.load(X + x_offsets, mask=mask, other=0.0).to(tl.float32)  # float32 before any arithmetic
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)

    # One value per row: sum along the columns (axis=1), divide by the real width, eps inside the
    # square root.
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)

    x_hat = cast_to(x * rstd[:, None], X.dtype.element_ty).to(tl.float32)
    y = x_hat * w[None, :]
    tl.store(Y + y_offsets, cast_to(y, Y.dtype.element_ty), mask=mask)
