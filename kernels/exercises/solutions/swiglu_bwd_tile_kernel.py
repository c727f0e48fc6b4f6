"""Chapter 11's SwiGLU exercise, one answer: the backward pass on a tile of ROWS rows × BLOCK_N
columns per program."""

import triton
import triton.language as tl

from kernels.triton_utils import cast_to


@triton.jit
def swiglu_bwd_tile_kernel(DY, GATE, UP, DGATE, DUP, n_rows, n_cols, stride_dy, stride_gate,
                           stride_up, stride_out, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    # The tile: a 2-D grid, rows along its first axis (int64, so that row * stride cannot overflow),
    # columns along its second.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    # Only real elements: the last row block may hang past n_rows, the last column block past n_cols.
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    # Each tensor's rows are its own stride apart; float32 before any arithmetic.
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(GATE + rows[:, None] * stride_gate + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + rows[:, None] * stride_up + cols[None, :], mask=mask, other=0.0).to(tl.float32)

    # σ(g) recomputed, nothing saved: silu(g) = g·σ(g), silu'(g) = σ(g)·(1 + g·(1 − σ(g))).
    s = tl.sigmoid(g)
    d_gate = dy * u * s * (1.0 + g * (1.0 - s))
    d_up = dy * g * s

    # Each gradient into its own buffer, rounded once.
    out = rows[:, None] * stride_out + cols[None, :]
    tl.store(DGATE + out, cast_to(d_gate, DGATE.dtype.element_ty), mask=mask)
    tl.store(DUP + out, cast_to(d_up, DUP.dtype.element_ty), mask=mask)
