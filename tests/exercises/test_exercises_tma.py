"""Chapter 16's exercise on the TMA (kernels/exercises/tma.py): the solution passes, and each plausible wrong
descriptor is named, without raising."""

import pytest
import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels import attention
from kernels.exercises import solutions
from kernels.exercises.tma import HINTS, check_tile_descriptor, diagnose_fields


def _contiguous(t, rows):
    b, h, s, d = t.shape
    return TensorDescriptor(t, [b, h, s, d], [h * s * d, s * d, d, 1], [1, 1, rows, d])


def _memory_order(t, rows):
    b, h, s, d = t.shape
    return TensorDescriptor(t, [b, s, h, d], [t.stride(0), t.stride(2), t.stride(1), 1], [1, 1, rows, d])


def _stub(t, rows):
    raise NotImplementedError


def _one_short(t, rows):
    b, h, s, d = t.shape
    return TensorDescriptor(t, [b, h, s - 1, d], list(t.stride()), [1, 1, rows, d])


def _heads_for_batch(t, rows):  # strides of batch and heads exchanged
    st = list(t.stride())
    return TensorDescriptor(t, list(t.shape), [st[1], st[0], st[2], 1], [1, 1, rows, t.shape[-1]])


# (the reader's function, the key of the sentence its verdict must contain)
WRONG = {
    "stub": (_stub, "stub"),
    "returns-none": (lambda t, rows: None, "stub"),
    "returns-the-tensor": (lambda t, rows: t, "type"),
    "box-without-leading-ones": (lambda t, rows: TensorDescriptor(t, list(t.shape), list(t.stride()),
                                                                   [rows, t.shape[-1]]), "refused"),
    "box-swapped": (lambda t, rows: TensorDescriptor(t, list(t.shape), list(t.stride()),
                                                      [1, 1, t.shape[-1], rows]), "swapped"),
    "box-whole-sequence": (lambda t, rows: TensorDescriptor(t, list(t.shape), list(t.stride()),
                                                             [1, 1, t.shape[2], t.shape[-1]]), "box"),
    "contiguous-strides": (_contiguous, "contiguous_strides"),
    "a-copy": (lambda t, rows: TensorDescriptor(t.contiguous(), list(t.shape), list(t.contiguous().stride()),
                                                [1, 1, rows, t.shape[-1]]), "copy"),
    "memory-order": (_memory_order, "memory_order"),
    "one-row-short": (_one_short, "shape"),
    "strides-exchanged": (_heads_for_batch, "strides"),
    "the-package's-function": (lambda t, rows: attention._descriptor(t, rows), None),
}


def _sentence(key: str) -> str:
    # the fixed words of the sentence, before its first field
    return HINTS[key].split("{")[0][:40]


def test_the_solution_passes(capsys):
    report = check_tile_descriptor(solutions.load("tile_descriptor"))
    assert report.passed and report.message.startswith("✓") and "✓" in capsys.readouterr().out


@pytest.mark.parametrize("name", WRONG)
def test_each_wrong_descriptor_is_named(name):
    fn, key = WRONG[name]
    report = check_tile_descriptor(fn, verbose=False)
    assert not report.passed and report.message.startswith("✗")
    if key is None:  # the finished answer, caught by the tripwire
        assert "attention._descriptor" in report.message and "finished answer" in report.message
    else:
        assert _sentence(key) in report.message, report.message


def test_the_solution_itself_is_refused():
    from kernels.exercises.solutions.tile_descriptor import tile_descriptor

    report = check_tile_descriptor(tile_descriptor, verbose=False)
    assert not report.passed and "hidden solution" in report.message


def test_diagnose_fields_accepts_the_right_fields():
    t = torch.zeros(1, 5, 2, 16).transpose(1, 2)
    assert diagnose_fields(solutions.load("tile_descriptor")(t, 8), t, 8) is None
