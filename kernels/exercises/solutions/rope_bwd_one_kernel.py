"""Chapter 11's RoPE exercise, one answer: the backward of one rotated tensor, the rotation by −θ."""

import triton
import triton.language as tl

from kernels.triton_utils import cast_to


@triton.jit
def rope_bwd_one_kernel(DY, COS, SIN, DX, n_heads, seq, half, sx_b, sx_h, sx_t, so_b, so_h, so_t, sc_b, sc_t,
                        BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    pid = tl.program_id(0)
    b, h = (pid // n_heads).to(tl.int64), (pid % n_heads).to(tl.int64)
    t = tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_H)
    ok = (t < seq)[:, None] & (d < half)[None, :]
    dy_at = DY + b * sx_b + h * sx_h + t[:, None] * sx_t + d[None, :]
    c_at = COS + b * sc_b + t[:, None] * sc_t + d[None, :]
    s_at = SIN + b * sc_b + t[:, None] * sc_t + d[None, :]
    dy1 = tl.load(dy_at, mask=ok, other=0.0).to(tl.float32)
    c1 = tl.load(c_at, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(s_at, mask=ok, other=0.0).to(tl.float32)
    # The partner of column d < D/2 is column d + D/2: the second half, as one tile.
    dy2 = tl.load(dy_at + half, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(c_at + half, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(s_at + half, mask=ok, other=0.0).to(tl.float32)
    # The transpose of x·cos + rotate_half(x)·sin: the sine terms change sign and take the partner's
    # half of sin.
    dx1 = dy1 * c1 + dy2 * s2
    dx2 = dy2 * c2 - dy1 * s1
    o_at = DX + b * so_b + h * so_h + t[:, None] * so_t + d[None, :]
    tl.store(o_at, cast_to(dx1, DX.dtype.element_ty), mask=ok)
    tl.store(o_at + half, cast_to(dx2, DX.dtype.element_ty), mask=ok)
