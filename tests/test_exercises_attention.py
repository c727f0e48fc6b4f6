"""Chapter 16's check: the solution passes, and each usual mistake in the inner loop is named."""

import functools

import pytest

from kernels.exercises import solutions
from kernels.exercises.attention import HINTS, MISTAKES, blockwise_attention, check_attention_loop


def test_solution_passes():
    report = check_attention_loop(solutions.load("attention_loop"), verbose=False)
    assert report.passed, report.message


def test_reference_loop_passes():
    assert check_attention_loop(blockwise_attention, verbose=False)


@pytest.mark.parametrize("mistake", MISTAKES)
def test_each_mistake_is_named(mistake):
    report = check_attention_loop(functools.partial(blockwise_attention, mistake=mistake), verbose=False)
    assert not report.passed and report.message == "✗ " + HINTS[mistake]


def test_stub_and_errors_are_reported():
    assert "raised" in check_attention_loop(lambda *a: 1 / 0, verbose=False).message
    assert "expected a tensor of shape" in check_attention_loop(lambda q, *a: q[0], verbose=False).message
    assert "NaN" in check_attention_loop(lambda q, *a: q * float("nan"), verbose=False).message
    assert "none of the usual" in check_attention_loop(lambda q, *a: q, verbose=False).message
