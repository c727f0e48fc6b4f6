"""The RoPE backward exercise check: it passes right answers and names each planted mistake, without raising."""

import pytest
import torch

from kernels.exercises.swiglu_rope import check_rope_backward
from kernels.rope import rope_backward


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
