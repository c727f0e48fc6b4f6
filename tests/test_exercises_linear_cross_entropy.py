"""The chapter 10 exercise check: it passes the right answer, names each usual mistake, survives a stub."""

import torch

from kernels.exercises.linear_cross_entropy import check_slice_gradient


def right(logits, lse, target, col_start, scale, ignore_index):
    p = torch.exp(logits - lse[:, None])
    cols = torch.arange(col_start, col_start + logits.shape[1])
    onehot = (cols[None, :] == target[:, None]).to(p.dtype)
    return (p - onehot) * scale * (target != ignore_index).to(p.dtype)[:, None]


def test_right_answer_passes(capsys):
    assert check_slice_gradient(right)
    assert "✓" in capsys.readouterr().out


def test_forgotten_column_offset_is_named(capsys):
    def wrong(logits, lse, target, col_start, scale, ignore_index):
        return right(logits, lse, target, 0, scale, ignore_index)

    assert not check_slice_gradient(wrong)
    assert "col_start + column" in capsys.readouterr().out


def test_slice_softmax_and_missing_scale_and_ignored_rows_are_named(capsys):
    def slice_softmax(logits, lse, target, col_start, scale, ignore_index):
        return right(logits, torch.logsumexp(logits, dim=1), target, col_start, scale, ignore_index)

    def unscaled(logits, lse, target, col_start, scale, ignore_index):
        return right(logits, lse, target, col_start, 1.0, ignore_index)

    def keeps_ignored(logits, lse, target, col_start, scale, ignore_index):
        return right(logits, lse, target, col_start, scale, ignore_index=-7)

    for fn, words in ((slice_softmax, "whole vocabulary"), (unscaled, "not multiplied by scale"),
                      (keeps_ignored, "must be zero")):
        assert not check_slice_gradient(fn)
        assert words in capsys.readouterr().out


def test_stub_and_crash_are_reported(capsys):
    def stub(*args):
        raise NotImplementedError

    assert not check_slice_gradient(stub)
    assert "stub" in capsys.readouterr().out
    assert not check_slice_gradient(lambda *a: 1 / 0)
    assert "ZeroDivisionError" in capsys.readouterr().out
