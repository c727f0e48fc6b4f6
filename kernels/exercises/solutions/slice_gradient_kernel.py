"""Chapter 10's exercise, one answer: the gradient of one vocabulary slice, a tile of ROWS × BLOCK_N
per program."""

import triton
import triton.language as tl


@triton.jit
def slice_gradient_kernel(LOGITS, LSE, TARGET, GRAD, n_rows, width, col_start, scale, ignore_index,
                          stride_logits, stride_grad, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    # The tile: ROWS rows (int64: row * stride passes 2^31 at long sequences and large
    # vocabularies), BLOCK_N columns.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols < width)[None, :]
    # The slice is a view of the whole logits: its rows are stride_logits apart. Float32 before any
    # arithmetic.
    x = tl.load(LOGITS + rows[:, None] * stride_logits + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    lse = tl.load(LSE + rows, mask=row_ok, other=0.0)
    target = tl.load(TARGET + rows, mask=row_ok, other=ignore_index)
    # The softmax over the whole vocabulary, element by element; column j of the slice is class
    # col_start + j.
    p = tl.exp(x - lse[:, None])
    is_target = (col_start + cols)[None, :] == target[:, None]
    g = tl.where(is_target, p - 1.0, p) * scale
    g = tl.where((target != ignore_index)[:, None], g, 0.0)  # an ignored row gets no gradient
    tl.store(GRAD + rows[:, None] * stride_grad + cols[None, :], g, mask=mask)
