"""Small pieces of Triton shared by the kernel families.

``cast_to`` is how every kernel stores a float32 value into a lower-precision tensor. On a GPU it is
a plain ``.to(dtype)``, which rounds to nearest-even. Triton's CPU interpreter truncates instead
when it converts float32 to bfloat16, which doubles the rounding error and makes outputs disagree
with PyTorch in the last bit; there we round to nearest-even by hand on the bit pattern, so the
interpreter and the GPU store the same bits.
"""

import triton
import triton.language as tl

from .runtime import INTERPRET

if INTERPRET:

    @triton.jit
    def cast_to(x, dtype: tl.constexpr):
        """``x`` converted to ``dtype``, bfloat16 rounded to nearest-even on the bit pattern.

        Chapter 02 stores the RMSNorm output with it.

        Args:
            x: a tensor of values (float32, or any float dtype).
            dtype: the dtype to store in, e.g. ``Y.dtype.element_ty``.

        Returns:
            ``x`` in ``dtype``, the bits a GPU's ``.to(dtype)`` gives.
        """
        if dtype == tl.bfloat16:
            bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
            # Add half an ulp of bfloat16 (minus one when the kept part is even: ties go to even),
            # then drop the low 16 bits. Infinities stay infinite, NaNs stay NaN, values past the
            # largest bfloat16 round to infinity.
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True).to(dtype)
        else:
            return x.to(dtype)

else:

    @triton.jit
    def cast_to(x, dtype: tl.constexpr):
        """``x`` converted to ``dtype``, rounded to nearest-even (a plain ``.to``).

        Chapter 02 stores the RMSNorm output with it.

        Args:
            x: a tensor of values (float32, or any float dtype).
            dtype: the dtype to store in, e.g. ``Y.dtype.element_ty``.

        Returns:
            ``x`` in ``dtype``.
        """
        return x.to(dtype)


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """The output tile a GEMM's program ``pid`` computes, in grouped order: ``GROUP_M`` row-tiles
    walk the column-tiles together, so that the tiles of B they share are still in the L2 cache
    when the next row-tile of the group reads them (chapter 15's GEMM).

    Args:
        pid: the program's index.
        M, N: the output's rows and columns.
        BLOCK_M, BLOCK_N: the tile's rows and columns.
        GROUP_M: row-tiles per group.

    Returns:
        ``(pid_m, pid_n)``: the tile's row-tile and column-tile.
    """
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_m = min(tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_m, (pid % per_group) // group_m


@triton.jit
def row_tile(n_rows, n_cols, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The [ROWS, BLOCK_N] tile of whole rows that program ``program_id(0)`` of a row-wise kernel
    (RMSNorm and its fused forms, chapter 02) takes, and which of its lanes are real.

    Args:
        n_rows, n_cols: the rows and their width.
        ROWS, BLOCK_N: rows per program, and the width rounded up to a power of two.

    Returns:
        ``(rows, cols, row_ok, col_ok, ok)``: the row indices (int64, so that row × stride cannot
        overflow int32 past 2**31 elements), the column indices, the rows and columns inside the
        tensor, and their [ROWS, BLOCK_N] combination.
    """
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    col_ok = cols < n_cols
    return rows, cols, row_ok, col_ok, row_ok[:, None] & col_ok[None, :]
