"""Chapter 18's exercise, one answer: one row quantised to FP8 with its own float32 scale, the whole
row in one block."""

import triton
import triton.language as tl

from kernels.fp8 import fp8_bits


@triton.jit
def quantize_row_kernel(X, Q, S, cols, stride_x, FP8_MAX_VALUE: tl.constexpr, FLOOR: tl.constexpr,
                        FP8: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    x = tl.load(X + row * stride_x + c, mask=c < cols, other=0.0).to(tl.float32)

    # The largest magnitude lands on the format's largest value. div_rn is IEEE division, the bits
    # PyTorch's `/` gives (a GPU's `/` on float32 is approximate). The masked lanes hold 0, which
    # leaves the amax alone.
    amax = tl.max(tl.abs(x), axis=0)
    scale = tl.maximum(tl.math.div_rn(amax, FP8_MAX_VALUE), FLOOR)
    scale = tl.where(amax == 0.0, 1.0, scale)  # a row of zeros: q = 0 at any scale, and never 0 / 0

    # x / scale can pass FP8_MAX_VALUE by a rounding step: clamp before the conversion.
    y = tl.math.div_rn(x, scale)
    y = tl.minimum(tl.maximum(y, -FP8_MAX_VALUE), FP8_MAX_VALUE)

    # Q is the contiguous [rows, cols] codes: its rows are cols apart, whatever x's stride.
    tl.store(Q + row * cols + c, fp8_bits(y, FP8, MBITS, EMIN), mask=c < cols)
    tl.store(S + row, scale)
