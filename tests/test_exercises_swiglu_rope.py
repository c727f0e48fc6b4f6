"""The RoPE backward exercise check: it passes right answers and names each planted mistake, without raising."""

import pytest
import torch
import triton
import triton.language as tl

from kernels.exercises.swiglu_rope import check_rope_backward
from kernels.rope import rope_backward
from kernels.triton_utils import cast_to


def ours(dy, cos, sin):
    return rope_backward(dy, dy[:, :1], cos, sin, dy.dtype)[0]


def planted(mistake):
    def fn(dy, cos, sin):
        half = dy.shape[-1] // 2
        d1, d2 = dy.float()[..., :half], dy.float()[..., half:]
        c1, c2 = cos.float()[:, None, :, :half], cos.float()[:, None, :, half:]
        s1, s2 = sin.float()[:, None, :, :half], sin.float()[:, None, :, half:]
        if mistake == "forward":
            parts = d1 * c1 - d2 * s1, d2 * c2 + d1 * s2
        elif mistake == "no sin":
            parts = d1 * c1, d2 * c2
        elif mistake == "same signs":
            parts = d1 * c1 + d2 * s2, d2 * c2 + d1 * s1
        elif mistake == "own half":
            parts = d1 * c1 + d2 * s1, d2 * c2 - d1 * s2
        else:
            raise AssertionError(mistake)
        return torch.cat(parts, dim=-1).to(dy.dtype)

    return fn


def contiguous_reader(dy, cos, sin):
    # Reads dy's memory as if it were contiguous [b, h, s, D]: wrong for Llama's transposed view.
    flat = torch.as_strided(dy, dy.shape, dy.contiguous().stride())
    return ours(flat.contiguous(), cos, sin)


def test_right_answer_passes(capsys):
    report = check_rope_backward(ours, seed=3)
    assert report.passed and "correct on 4 inputs" in capsys.readouterr().out


@pytest.mark.parametrize("mistake, words", [
    ("forward", "forward rotation of dy"),
    ("no sin", "rotate_half term"),
    ("same signs", "dx2 must subtract"),
    ("own half", "its own half of sin"),
])
def test_each_mistake_is_named(mistake, words, capsys):
    report = check_rope_backward(planted(mistake), seed=5)
    assert not report.passed and words in report.message and "✗" in capsys.readouterr().out


def test_bad_calls_are_reported_not_raised():
    def raises(dy, cos, sin):
        raise RuntimeError("kernel exploded")

    assert "raised RuntimeError: kernel exploded" in check_rope_backward(raises, verbose=False).message
    assert "dtype" in check_rope_backward(lambda dy, c, s: ours(dy, c, s).double(), verbose=False).message
    message = check_rope_backward(contiguous_reader, seed=1, verbose=False).message
    assert "strides of the view" in message and "first at batch" in message


# The chapter's exercise as the reader finds it (a Triton kernel with the two dx lines to complete) and completed.
@triton.jit
def _rope_bwd_kernel(DY, COS, SIN, DX, n_heads, seq, half, sx_b, sx_h, sx_t, so_b, so_h, so_t, sc_b, sc_t,
                     BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, COMPLETED: tl.constexpr):
    pid = tl.program_id(0)
    b, h = (pid // n_heads).to(tl.int64), (pid % n_heads).to(tl.int64)
    t = tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_H)
    ok = (t < seq)[:, None] & (d < half)[None, :]
    dy_at = DY + b * sx_b + h * sx_h + t[:, None] * sx_t + d[None, :]
    c_at = COS + b * sc_b + t[:, None] * sc_t + d[None, :]
    s_at = SIN + b * sc_b + t[:, None] * sc_t + d[None, :]
    dy1 = tl.load(dy_at, mask=ok, other=0.0).to(tl.float32)
    dy2 = tl.load(dy_at + half, mask=ok, other=0.0).to(tl.float32)
    c1 = tl.load(c_at, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(c_at + half, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(s_at, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(s_at + half, mask=ok, other=0.0).to(tl.float32)
    if COMPLETED:
        dx1 = dy1 * c1 + dy2 * s2
        dx2 = dy2 * c2 - dy1 * s1
    else:
        dx1 = dy1 * c1
        dx2 = dy2 * c2
    o_at = DX + b * so_b + h * so_h + t[:, None] * so_t + d[None, :]
    tl.store(o_at, cast_to(dx1, DX.dtype.element_ty), mask=ok)
    tl.store(o_at + half, cast_to(dx2, DX.dtype.element_ty), mask=ok)


def _notebook_kernel(completed):
    def fn(dy, cos, sin):
        batch, heads, seq, dim = dy.shape
        cos, sin = cos.contiguous(), sin.contiguous()
        out = torch.empty_like(dy)
        _rope_bwd_kernel[(batch * heads,)](dy, cos, sin, out, heads, seq, dim // 2, *dy.stride()[:3],
                                           *out.stride()[:3], cos.stride(0), cos.stride(1),
                                           BLOCK_T=triton.next_power_of_2(seq),
                                           BLOCK_H=triton.next_power_of_2(dim // 2), COMPLETED=completed)
        return out

    return fn


def test_the_chapters_stub_and_its_completion():
    assert "rotate_half term" in check_rope_backward(_notebook_kernel(False), verbose=False).message
    assert check_rope_backward(_notebook_kernel(True), verbose=False).passed
