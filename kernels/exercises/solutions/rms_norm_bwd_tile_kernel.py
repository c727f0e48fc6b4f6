"""Chapter 03's second exercise, one answer: RMSNorm's backward on tiles of rows in a persistent
grid, with dW as float32 partial sums, one row of DW_PARTIALS per program."""

import triton
import triton.language as tl

from kernels.triton_utils import cast_to


@triton.jit
def rms_norm_bwd_tile_kernel(
    X, W, DY, RSTD, DX, DW_PARTIALS, n_rows, n_cols, stride_x, stride_dy, stride_dx,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    # this program's share of dW: float32, for every tile it adds
    dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)

    for block in range(pid, tl.cdiv(n_rows, ROWS), tl.num_programs(0)):  # tiles pid, pid + P, pid + 2P, ...
        rows = (block * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        # The last tile may hang past n_rows: those rows are neither loaded nor stored.
        row_ok = rows < n_rows
        ok = row_ok[:, None] & col_ok[None, :]

        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        x_hat = x * rstd[:, None]
        g = dy * w[None, :]
        x_hat_rounded = cast_to(x_hat, X.dtype.element_ty).to(tl.float32)  # what the forward multiplied w by

        # dx: one mean per row (axis=1) over the real width, broadcast back over the columns.
        dx = rstd[:, None] * (g - x_hat * (tl.sum(g * x_hat, axis=1) / n_cols)[:, None])
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], cast_to(dx, DX.dtype.element_ty), mask=ok)
        # dW: this tile's rows summed (axis=0), one value per column, added to the float32 accumulator.
        dw_acc += tl.sum(dy * x_hat_rounded, axis=0)

    tl.store(DW_PARTIALS + pid * n_cols + cols, dw_acc, mask=col_ok)
