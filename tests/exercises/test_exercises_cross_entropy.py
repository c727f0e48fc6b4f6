"""The exercise checks of chapters 05 and 06: each passes its solution, and names every wrong answer of its catalogue
with the sentence of its diagnosis dict, without raising.

The online update's wrong answers are written in plain PyTorch, as a reader of chapter 05 writes the update. Chapter
06's are written as a reader writes them: the notebook's own exercise cell, read from the notebook, with the one line
(or the launcher's line) a reader gets wrong replaced, saved as a module and imported, so that Triton compiles each
like the notebook's kernel.
"""

import importlib.util
import itertools
import json
import math
from pathlib import Path

import diagnoses
import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels.exercises.cross_entropy import (
    GRADIENT_DIAGNOSES,
    SWEEP_DIAGNOSES,
    UPDATE_DIAGNOSES,
    check_ce_gradient,
    check_inplace_gradient,
    check_online_update,
)
from kernels.exercises.solutions import load
from kernels.reference import online_logsumexp

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
TRIPPED = "that is a finished answer to this exercise"


def notebook_cell(notebook: str, marker: str) -> str:
    """The source of the first code cell of ``notebook`` whose source holds ``marker``."""
    cells = json.loads((NOTEBOOKS / notebook).read_text())["cells"]
    for cell in cells:
        source = "".join(cell["source"])
        if cell["cell_type"] == "code" and marker in source:
            return source
    raise AssertionError(f"no code cell of {notebook} holds {marker!r}")


# ---------------------------------------------------------------------------------------------------------------------
# Chapter 05: the online update
# ---------------------------------------------------------------------------------------------------------------------


def update_attempt(mistake):
    """The online update with one of the usual mistakes (or none)."""
    seen = []  # what "stateful" keeps between calls

    def attempt(m, s, c):
        m_new = torch.maximum(m, c.max())
        right_s = s * torch.exp(m - m_new) + torch.exp(c - m_new).sum()
        if mistake == "stub":
            raise NotImplementedError
        if mistake == "raised":
            return m_new, s * torch.exp(m - m_new) + torch.exp(c[None, :] - m_new[None]).sum(dim=2)
        if mistake == "first-chunk":  # right except where m = -inf
            return m_new, right_s if torch.isfinite(m) else torch.tensor(math.nan)
        if mistake == "stateful":  # recomputes over every chunk it has seen
            seen.append(c)
            everything = torch.cat(seen)
            return everything.max(), torch.exp(everything - everything.max()).sum()
        return {
            "right": (m_new, right_s),
            "one-value": m_new,
            "max-not-tracked": (m, s + torch.exp(c - m).sum()),
            "max-goes-down": (c.max(), s * torch.exp(m - c.max()) + torch.exp(c - c.max()).sum()),
            "max-wrong": (m_new + 1, right_s),
            "no-rescale": (m_new, s + torch.exp(c - m_new).sum()),
            "rescale-upside-down": (m_new, s * torch.exp(m_new - m) + torch.exp(c - m_new).sum()),
            "old-max": (m_new, s * torch.exp(m - m_new) + torch.exp(c - m).sum()),
            "no-max": (m_new, s + torch.exp(c).sum()),
            "chunk-no-max": (m_new, s * torch.exp(m - m_new) + torch.exp(c).sum()),
            # exp(m) / exp(m_new) is the right factor on paper and inf / inf in float32 at m = 500
            "overflow": (m_new, s * torch.exp(m) / torch.exp(m_new) + torch.exp(c - m_new).sum()),
            "sum-wrong": (m_new, 2 * right_s),
            "swapped": (right_s, m_new),
            "m-not-one-number": (torch.maximum(m, c), right_s),  # elementwise: one value per element of the chunk
            "s-not-one-number": (m_new, s * torch.exp(m - m_new) + torch.exp(c - m_new)),  # the .sum() forgotten
            "chunk-own-max": (m_new, s * torch.exp(m - m_new) + torch.exp(c - c.max()).sum()),
            "old-sum-dropped": (m_new, torch.exp(c - m_new).sum()),
            "mean-not-sum": (m_new, s * torch.exp(m - m_new) + torch.exp(c - m_new).mean()),
            "no-exp": (m_new, s * torch.exp(m - m_new) + (c - m_new).sum()),
            "log-sum": (m_new, torch.log(right_s)),
            "exp-of-sum": (m_new, s * torch.exp(m - m_new) + torch.exp(c.sum() - m_new)),
            "max-term-only": (m_new, s * torch.exp(m - m_new) + torch.exp(c.max() - m_new)),
            "rescale-everything": (m_new, (s + torch.exp(c - m_new).sum()) * torch.exp(m - m_new)),
        }[mistake]
    return attempt


@pytest.mark.parametrize("mistake", [key for key in UPDATE_DIAGNOSES])
def test_every_update_diagnosis_is_named(mistake, capsys):
    assert not check_online_update(update_attempt(mistake))
    out = capsys.readouterr().out
    assert out.startswith("✗") and UPDATE_DIAGNOSES[mistake] in out, out
    others = [key for key in UPDATE_DIAGNOSES
              if key != mistake and UPDATE_DIAGNOSES[key] not in UPDATE_DIAGNOSES[mistake]]
    assert not any(UPDATE_DIAGNOSES[key] in out for key in others), out  # one diagnosis, the right one


def test_a_chunk_below_the_running_max_shows_a_chunk_measured_against_its_own_max(capsys):
    # On a chunk that raises the max, its own max is m_new and the mistake is invisible: the second case shows it.
    check_online_update(update_attempt("chunk-own-max"))
    assert "chunk whose values are all below the running max" in capsys.readouterr().out


def test_an_update_that_only_handles_chunks_of_several_values_is_caught_by_the_whole_pass(capsys):
    # Right on the four single steps (chunks of 3 and 4 values), wrong once a chunk holds one value: the whole pass in
    # chunks of 1 shows it.
    def attempt(m, s, c):
        m_new = torch.maximum(m, c.max())
        terms = torch.exp(c - m_new)
        return m_new, s * torch.exp(m - m_new) + (terms.sum() if c.numel() > 1 else 0.0 * terms.sum())

    assert not check_online_update(attempt)
    out = capsys.readouterr().out
    assert "in chunks of 1" in out and UPDATE_DIAGNOSES["old-sum-dropped"] not in out, out


def test_the_update_stub_as_shipped_is_named(capsys):
    namespace = {}
    exec(notebook_cell("05_online_softmax.ipynb", "def online_update("), namespace)
    assert not check_online_update(namespace["online_update"])
    assert capsys.readouterr().out.startswith("✗ " + UPDATE_DIAGNOSES["stub"])


@pytest.mark.parametrize("finished", ["online_logsumexp", "online_softmax_steps"])
def test_the_packages_online_softmax_is_out_of_reach(finished, capsys):
    from kernels.reference import online_softmax_steps

    def attempt(m, s, c):
        if finished == "online_logsumexp":
            lse = online_logsumexp(c, c.numel())
        else:
            lse = torch.tensor(online_softmax_steps(c, c.numel())[-1].logsumexp)
        m_new = torch.maximum(m, c.max())
        return m_new, s * torch.exp(m - m_new) + torch.exp(lse - m_new)

    assert not check_online_update(attempt)
    out = capsys.readouterr().out
    assert TRIPPED in out and f"kernels.reference.{finished}" in out, out


def test_the_update_solution_passes(capsys):
    assert check_online_update(update_attempt("right"))
    assert check_online_update(load("online_update"))
    out = capsys.readouterr().out
    assert out.startswith("✓") and "✗" not in out


def test_an_update_in_log_space_is_right_too(capsys):
    # Another correct derivation: combine the old state and the chunk as logsumexps, then return to (m, s).
    def attempt(m, s, c):
        m_new = torch.maximum(m, c.max())
        total = torch.logaddexp(m + torch.log(s), torch.logsumexp(c, 0))
        return m_new, torch.exp(total - m_new)

    assert check_online_update(attempt)


def test_a_quiet_check_prints_nothing(capsys):
    assert check_online_update(load("online_update"), verbose=False)
    assert not check_online_update(update_attempt("no-rescale"), verbose=False)
    assert capsys.readouterr().out == ""


# ---------------------------------------------------------------------------------------------------------------------
# Chapter 06: the notebook's exercise cells, with a reader's lines
# ---------------------------------------------------------------------------------------------------------------------

# The setup cell's names the exercise cells use.
CELL_HEADER = """import torch
import triton
import triton.language as tl

from kernels.cross_entropy import cross_entropy_forward
from kernels.triton_utils import cast_to

"""
_modules = itertools.count()


def from_cell(tmp_path, cell: str, replacements=(), name: str = "my_gradient"):
    """The function ``name`` of the notebook's exercise ``cell`` with each ``(old, new)`` of ``replacements`` made,
    saved as a module (Triton reads a kernel's source from its file) and imported."""
    for old, new in replacements:
        assert old in cell, old
        cell = cell.replace(old, new)
    path = tmp_path / f"reader_cell_{next(_modules)}.py"
    path.write_text(CELL_HEADER + cell)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


# ---------------------------------------------------------------------------------------------------------------------
# Chapter 06, exercise 1: the gradient line
# ---------------------------------------------------------------------------------------------------------------------

GRADIENT_CELL = notebook_cell("06_cross_entropy_kernel.ipynb", "def grad_exercise_kernel(")
STUB_LINE = "g = tl.zeros((BLOCK_V,), dtype=tl.float32)  # replace this line"
ONEHOT = "tl.where(cols == target, 1.0, 0.0)"
ROW_SCALE = "tl.where(counted, scale, 0.0)"
RIGHT_LINE = f"g = (tl.exp(x - lse) - {ONEHOT}) * {ROW_SCALE}"
LAUNCHER_SCALE = "scale = 1.0 / (target != ignore_index).sum().to(torch.float32)"

# The reader's gradient line, by the diagnosis it must get.
GRADIENT_LINES = {
    "no-onehot": f"g = tl.exp(x - lse) * {ROW_SCALE}",
    "sign": f"g = ({ONEHOT} - tl.exp(x - lse)) * {ROW_SCALE}",
    "no-scale": f"g = (tl.exp(x - lse) - {ONEHOT}) * tl.where(counted, 1.0, 0.0)",
    "ignored-count": f"g = (tl.exp(x - lse) - {ONEHOT}) * scale",
    "onehot-off-by-one": f"g = (tl.exp(x - lse) - tl.where(cols == target + 1, 1.0, 0.0)) * {ROW_SCALE}",
    "onehot-no-start": f"g = (tl.exp(x - lse) - tl.where(tl.arange(0, BLOCK_V) == target, 1.0, 0.0)) * {ROW_SCALE}",
    "minus-one-everywhere": f"g = (tl.exp(x - lse) - 1.0) * {ROW_SCALE}",
    "onehot-unscaled": f"g = tl.exp(x - lse) * {ROW_SCALE} - {ONEHOT}",
    "scale-inverted": f"g = (tl.exp(x - lse) - {ONEHOT}) * tl.where(counted, 1.0 / scale, 0.0)",
    "divided-by-columns": f"g = (tl.exp(x - lse) - {ONEHOT}) * tl.where(counted, 1.0 / n_cols, 0.0)",
    "log-softmax": f"g = (x - lse - {ONEHOT}) * {ROW_SCALE}",
    "unnormalised": f"g = (tl.exp(x) - {ONEHOT}) * {ROW_SCALE}",
    "nan": f"g = (tl.exp(x - lse) - {ONEHOT}) * scale / tl.where(counted, 1.0, 0.0)",
    "scaled": f"g = 0.5 * (tl.exp(x - lse) - {ONEHOT}) * {ROW_SCALE}",
    "raised": f"g = (tl.exp(x - lse) - tl.where(cols == target, 1.0)) * {ROW_SCALE}",
    # No mistake anyone makes, with rows that still sum to 0: the check can only point at the largest error.
    "wrong": f"g = (tl.exp(x - lse) - {ONEHOT} + tl.where(cols == 7, 0.01, 0.0) - tl.where(cols == 8, 0.01, 0.0))"
             f" * {ROW_SCALE}",
}
# The reader's launcher, by the diagnosis it must get: (what the notebook's launcher says, what the reader wrote).
GRADIENT_LAUNCHERS = {
    "all-rows": (LAUNCHER_SCALE, "scale = torch.tensor(1.0 / target.shape[0], device=logits.device)"),
    "shape": ("    return grad", "    return grad[:, 1:]"),
    "stub": ("    logits = logits.contiguous()", "    raise NotImplementedError"),
}


def gradient_attempt(tmp_path, mistake):
    if mistake == "zeros":  # the notebook's stub line, as shipped
        return from_cell(tmp_path, GRADIENT_CELL)
    if mistake in GRADIENT_LAUNCHERS:
        return from_cell(tmp_path, GRADIENT_CELL, [(STUB_LINE, RIGHT_LINE), GRADIENT_LAUNCHERS[mistake]])
    return from_cell(tmp_path, GRADIENT_CELL, [(STUB_LINE, GRADIENT_LINES.get(mistake, RIGHT_LINE))])


def pure_pytorch_gradient(logits, target, ignore_index=-100):
    # softmax − onehot without a kernel, and without torch.softmax or torch.exp
    counted = target != ignore_index
    lse = torch.logsumexp(logits, -1, keepdim=True)
    grad = math.e ** (logits - lse)
    grad[counted, target[counted]] -= 1.0
    return grad / counted.sum() * counted[:, None]


GRADIENT_CASES = [*GRADIENT_LINES, *GRADIENT_LAUNCHERS, "zeros"]


def test_every_gradient_diagnosis_has_a_case():
    covered = set(GRADIENT_CASES) | {"no-kernel"}
    assert set(GRADIENT_DIAGNOSES) - covered == set(), set(GRADIENT_DIAGNOSES) - covered


@pytest.mark.parametrize("mistake", GRADIENT_CASES)
def test_every_gradient_mistake_is_named(mistake, tmp_path, device, capsys):
    assert not check_ce_gradient(gradient_attempt(tmp_path, mistake), device=device)
    out = capsys.readouterr().out
    assert out.startswith("✗") and diagnoses.says(GRADIENT_DIAGNOSES[mistake], out), out


@pytest.mark.parametrize("by, side", [(1, "right of"), (-1, "left of")])
def test_a_onehot_one_column_off_is_named_as_such_not_as_an_unnormalised_softmax(by, side, tmp_path, device, capsys):
    # The target in the last column (299) has no column to its right: that row's −1 is lost, its sum is not 0, and
    # a check that looked at row sums first called this "the softmax is not normalised".
    line = f"g = (tl.exp(x - lse) - tl.where(cols == target {'+' if by > 0 else '-'} 1, 1.0, 0.0)) * {ROW_SCALE}"
    assert not check_ce_gradient(from_cell(tmp_path, GRADIENT_CELL, [(STUB_LINE, line)]), device=device)
    out = capsys.readouterr().out
    assert "the one-hot is at the wrong column" in out and side in out, out
    assert GRADIENT_DIAGNOSES["unnormalised"] not in out, out


@pytest.mark.parametrize("block", [64, 256])
def test_lane_numbers_for_columns_are_named_whatever_the_chunk(block, tmp_path, device, capsys):
    attempt = from_cell(tmp_path, GRADIENT_CELL, [(STUB_LINE, GRADIENT_LINES["onehot-no-start"]),
                                                  ("EXERCISE_BLOCK_V = 128", f"EXERCISE_BLOCK_V = {block}")])
    assert not check_ce_gradient(attempt, device=device)
    out = capsys.readouterr().out
    assert diagnoses.says(GRADIENT_DIAGNOSES["onehot-no-start"], out) and f"chunks of {block}" in out, out


def test_a_gradient_computed_in_pytorch_is_refused(device, capsys):
    assert not check_ce_gradient(pure_pytorch_gradient, device=device)
    out = capsys.readouterr().out
    assert diagnoses.says(GRADIENT_DIAGNOSES["no-kernel"], out), out


def package_gradient(logits, target, ignore_index=-100):
    from kernels.cross_entropy import cross_entropy_forward

    return cross_entropy_forward(logits, target, ignore_index, "mean", None, True)[2]  # compute_grad by position


def autograd_through_the_package(logits, target, ignore_index=-100):
    x = logits.clone().requires_grad_()
    kernels.cross_entropy(x, target, ignore_index).backward()
    return x.grad


def autograd_through_pytorch(logits, target, ignore_index=-100):
    x = logits.clone().requires_grad_()
    F.cross_entropy(x, target, ignore_index=ignore_index).backward()
    return x.grad


def the_packages_operator(logits, target, ignore_index=-100):
    return torch.ops.kernels.cross_entropy_fwd(logits, target, ignore_index, "mean", None, None, True)[2]


def torch_softmax_beside_the_stub_kernel(logits, target, ignore_index=-100):
    counted = target != ignore_index
    grad = torch.softmax(logits, -1)
    grad[counted, target[counted]] -= 1.0
    return grad / counted.sum() * counted[:, None]


@pytest.mark.parametrize("attempt, called", [
    (package_gradient, "kernels.cross_entropy.cross_entropy_forward"),
    (autograd_through_the_package, "kernels.cross_entropy.cross_entropy"),
    (autograd_through_pytorch, "torch.nn.functional.cross_entropy"),
    (the_packages_operator, "kernels.cross_entropy.cross_entropy_forward"),
    (torch_softmax_beside_the_stub_kernel, "torch.softmax"),
    (kernels.cross_entropy, "kernels.cross_entropy.cross_entropy"),
])
def test_finished_gradients_are_out_of_reach(attempt, called, device, capsys):
    assert not check_ce_gradient(attempt, device=device)
    out = capsys.readouterr().out
    assert TRIPPED in out and called in out, out


def test_the_logsumexp_of_the_package_is_allowed(tmp_path, device, capsys):
    # The notebook's launcher takes the logsumexp from the package's kernel with compute_grad=False: that stays.
    assert "compute_grad=False" in GRADIENT_CELL
    assert check_ce_gradient(from_cell(tmp_path, GRADIENT_CELL, [(STUB_LINE, RIGHT_LINE)]), device=device)
    assert capsys.readouterr().out.startswith("✓")


def test_the_gradient_solution_passes(device, capsys):
    assert check_ce_gradient(load("ce_gradient"), device=device)
    assert capsys.readouterr().out.startswith("✓")


# ---------------------------------------------------------------------------------------------------------------------
# Chapter 06, exercise 2: the in-place sweep
# ---------------------------------------------------------------------------------------------------------------------

SWEEP_CELL = notebook_cell("06_cross_entropy_kernel.ipynb", "def inplace_gradient_kernel(")
SWEEP_STUB = ("    pass  # your turn: the row offset, the loop over chunks, the masked load, the gradient, the masked "
              "store")
# A reader's right body for the notebook's stub kernel.
SWEEP_BODY = """    row = tl.program_id(0).to(tl.int64)
    row_ptr = LOGITS + row * stride
    target = tl.load(TARGET + row)
    lse = tl.load(LSE + row)
    row_scale = tl.where(target != ignore_index, tl.load(SCALE), 0.0)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        ok = cols < n_cols
        x = tl.load(row_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        g = (tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)) * row_scale
        tl.store(row_ptr + cols, cast_to(g, LOGITS.dtype.element_ty), mask=ok)"""
GRADIENT = "g = (tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)) * row_scale"
LAUNCH = "inplace_gradient_kernel[(logits.shape[0],)](logits, target"

# What the reader wrote instead of the right body's (or the launcher's) line, by the diagnosis it must get.
SWEEP_MISTAKES = {
    "mask": [("mask=ok, other=0.0", ""), (", mask=ok)", ")")],
    "stride": [("row_ptr = LOGITS + row * stride", "row_ptr = LOGITS + row * n_cols")],
    "one-row": [(LAUNCH, LAUNCH.replace("(logits.shape[0],)", "(1,)"))],
    "first-chunk": [("range(0, n_cols, BLOCK_V)", "range(0, BLOCK_V, BLOCK_V)")],
    "ignored-unwritten": [("range(0, n_cols, BLOCK_V)",
                           "range(0, tl.where(target != ignore_index, n_cols, 0), BLOCK_V)")],
    "upcast": [(".to(tl.float32)", ""), ("tl.exp(x - lse)", "tl.exp(x) / tl.exp(lse)")],
    "precision": [("lse = tl.load(LSE + row)", "lse = tl.load(LSE + row).to(LOGITS.dtype.element_ty)")],
    "lse-row0": [("lse = tl.load(LSE + row)", "lse = tl.load(LSE)")],
    "target-row0": [("target = tl.load(TARGET + row)", "target = tl.load(TARGET)")],
    # The kernel gets a copy, with the copy's own strides (the view's would run past the copy's end).
    "copy": [("    scale = 1.0", "    copy = logits.clone()\n    scale = 1.0"),
             ("](logits, target, lse, scale, logits.shape[1], logits.stride(0),",
              "](copy, target, lse, scale, copy.shape[1], copy.stride(0),")],
    "copy-returned": [("    scale = 1.0", "    logits = logits.clone()\n    scale = 1.0")],
    "sign": [(GRADIENT, "g = (tl.where(cols == target, 1.0, 0.0) - tl.exp(x - lse)) * row_scale")],
    "no-onehot": [(GRADIENT, "g = tl.exp(x - lse) * row_scale")],
    "no-scale": [("tl.load(SCALE), 0.0)", "1.0, 0.0)")],
    "ignored-count": [("tl.where(target != ignore_index, tl.load(SCALE), 0.0)", "tl.load(SCALE)")],
    "all-rows": [("scale = 1.0 / (target != ignore_index).sum().to(torch.float32)",
                  "scale = torch.tensor(1.0 / target.shape[0], device=logits.device)")],
    "unnormalised": [("tl.exp(x - lse)", "tl.exp(x)")],
    "log-softmax": [("tl.exp(x - lse)", "(x - lse)")],
    "onehot-off-by-one": [("cols == target", "cols == target + 1")],
    "onehot-no-start": [("tl.where(cols == target", "tl.where(tl.arange(0, BLOCK_V) == target")],
    "minus-one-everywhere": [("tl.where(cols == target, 1.0, 0.0)", "1.0")],
    "nan": [("* row_scale", "* row_scale / tl.where(target != ignore_index, 1.0, 0.0)")],
    "zeros": [(GRADIENT, "g = tl.zeros((BLOCK_V,), dtype=tl.float32)")],
    "raised": [("tl.exp(x - lse)", "tl.exp(x - lse, 2)")],
    "launcher-stub": [("    scale = 1.0", "    raise NotImplementedError\n    scale = 1.0")],
    # No mistake anyone makes, rows still summing to 0: the check cannot name it.
    "wrong": [(GRADIENT, GRADIENT + " + (tl.where(cols == 7, 0.01, 0.0) - tl.where(cols == 8, 0.01, 0.0))"
                                    " * row_scale")],
}
SWEEP_VERDICTS = {
    **{key: SWEEP_DIAGNOSES[key] for key in ("mask", "stride", "one-row", "first-chunk", "ignored-unwritten",
                                             "upcast", "precision", "lse-row0", "target-row0", "copy", "raised")},
    "copy-returned": SWEEP_DIAGNOSES["copy"], "launcher-stub": SWEEP_DIAGNOSES["stub"],
    **{key: GRADIENT_DIAGNOSES[key] for key in ("sign", "no-onehot", "no-scale", "ignored-count", "all-rows",
                                                "unnormalised", "log-softmax", "onehot-no-start",
                                                "minus-one-everywhere", "nan", "zeros", "wrong")},
    "onehot-off-by-one": "the one-hot is at the wrong column",
}


def sweep_attempt(tmp_path, mistake=None, block=128):
    """The notebook's exercise 2 cell with the reader's body, with one mistake (or none)."""
    replacements = [(SWEEP_STUB, SWEEP_BODY), ("INPLACE_BLOCK_V = 128", f"INPLACE_BLOCK_V = {block}")]
    return from_cell(tmp_path, SWEEP_CELL, replacements + SWEEP_MISTAKES.get(mistake, []), name="inplace_gradient")


def test_every_sweep_diagnosis_has_a_case():
    named = set(SWEEP_VERDICTS.values())
    assert set(SWEEP_DIAGNOSES.values()) - named == {SWEEP_DIAGNOSES["int32"]}  # tested below, on its own
    assert set(SWEEP_MISTAKES) == set(SWEEP_VERDICTS)


@pytest.mark.parametrize("mistake", list(SWEEP_MISTAKES))
def test_every_sweep_mistake_is_named(mistake, tmp_path, device, capsys):
    assert not check_inplace_gradient(sweep_attempt(tmp_path, mistake), device=device, high_rows=False)
    out = capsys.readouterr().out
    verdict = SWEEP_VERDICTS[mistake]
    assert out.startswith("✗") and diagnoses.says(verdict, out), out


def test_the_sweep_stub_as_shipped_is_named(tmp_path, device, capsys):
    attempt = from_cell(tmp_path, SWEEP_CELL, name="inplace_gradient")
    assert not check_inplace_gradient(attempt, device=device, high_rows=False)
    assert capsys.readouterr().out.startswith("✗ " + SWEEP_DIAGNOSES["stub"])


def test_no_upcast_before_a_float32_operand_is_float32_arithmetic(tmp_path, device, capsys):
    # Without .to(tl.float32), x - lse still runs in float32: Triton promotes the bf16 x to the float32 lse's type
    # before subtracting, exactly as the explicit conversion would. The result is the same to the bit, so no input
    # can tell it apart, and the check passes it.
    attempt = sweep_attempt(tmp_path)
    plain = from_cell(tmp_path, SWEEP_CELL, [(SWEEP_STUB, SWEEP_BODY.replace(".to(tl.float32)", ""))],
                      name="inplace_gradient")
    assert check_inplace_gradient(plain, device=device, high_rows=False)
    logits = (torch.randn(3, 300, device=device) * 3 + 40).to(torch.bfloat16)
    target = torch.tensor([4, -100, 299], device=device)
    lse = torch.logsumexp(logits.double(), -1).float()
    assert torch.equal(attempt(logits.clone(), target, lse), plain(logits.clone(), target, lse))


def test_a_sweep_in_pytorch_is_refused(device, capsys):
    def in_pytorch(logits, target, lse, ignore_index=-100):
        logits.copy_(pure_pytorch_gradient(logits.float(), target, ignore_index))
        return logits

    assert not check_inplace_gradient(in_pytorch, device=device, high_rows=False)
    assert diagnoses.says(GRADIENT_DIAGNOSES["no-kernel"], capsys.readouterr().out)


def test_finished_sweeps_are_out_of_reach(device, capsys):
    def through_the_package(logits, target, lse, ignore_index=-100):
        kernels.cross_entropy(logits, target, ignore_index, inplace_backward=True)
        return logits

    def with_exp(logits, target, lse, ignore_index=-100):
        p = (logits.float() - lse[:, None]).exp()
        counted = target != ignore_index
        p[counted, target[counted]] -= 1.0
        logits.copy_(p / counted.sum() * counted[:, None])
        return logits

    for attempt, called in ((through_the_package, "kernels.cross_entropy.cross_entropy"),
                            (with_exp, "torch.Tensor.exp")):
        assert not check_inplace_gradient(attempt, device=device, high_rows=False)
        out = capsys.readouterr().out
        assert TRIPPED in out and called in out, out


def test_int32_row_offsets_are_named_by_running_the_kernel(tmp_path, device, capsys):
    # The kernel's comment says nothing of it: only running it shows its offsets wrap. In the interpreter the view
    # lives in a mapped address range, so the run needs a few pages of memory, not 8 GiB.
    attempt = from_cell(tmp_path, SWEEP_CELL, [(SWEEP_STUB, SWEEP_BODY.replace(".to(tl.int64)", ""))],
                        name="inplace_gradient")
    assert not check_inplace_gradient(attempt, device=device)
    out = capsys.readouterr().out
    assert SWEEP_DIAGNOSES["int32"] in out and "rows 0 and 1 are right, row 2 is not" in out, out


def test_the_high_row_case_reads_the_right_elements_with_int64_offsets(device, capsys):
    assert check_inplace_gradient(load("inplace_gradient"), device=device)
    out = capsys.readouterr().out
    assert out.startswith("✓") and "row 2 of a view at element 2**31 + 128 (int64 row offsets)" in out, out


def test_a_skipped_high_row_case_says_so(device, capsys):
    assert check_inplace_gradient(load("inplace_gradient"), device=device, high_rows=False)
    assert "int64 row offsets NOT checked" in capsys.readouterr().out


def test_the_sweep_solution_passes(tmp_path, device, capsys):
    assert check_inplace_gradient(sweep_attempt(tmp_path), device=device, high_rows=False)
    assert check_inplace_gradient(load("inplace_gradient"), device=device, high_rows=False)
    out = capsys.readouterr().out
    assert out.startswith("✓") and "✗" not in out


def test_a_larger_block_is_fine(tmp_path, device):
    assert check_inplace_gradient(sweep_attempt(tmp_path, block=512), device=device, high_rows=False, verbose=False)
    assert not check_inplace_gradient(sweep_attempt(tmp_path, "mask", block=512), device=device, high_rows=False,
                                      verbose=False)


@pytest.mark.gpu
def test_int32_row_offsets_wrap_on_the_gpu(tmp_path, capsys):
    # The same case in real GPU memory: 8 GiB of bf16.
    # The third row starts past element 2**31, and an int32 offset lands in the headroom below.
    attempt = from_cell(tmp_path, SWEEP_CELL, [(SWEEP_STUB, SWEEP_BODY.replace(".to(tl.int64)", ""))],
                        name="inplace_gradient")
    assert not check_inplace_gradient(attempt, device="cuda", high_rows=True)
    out = capsys.readouterr().out
    assert SWEEP_DIAGNOSES["int32"] in out and "rows 0 and 1 are right" in out, out
    assert check_inplace_gradient(load("inplace_gradient"), device="cuda", high_rows=True)


# ---------------------------------------------------------------------------------------------------------------------
# The answers stay out of sight until the reader has tried: nothing before a check cell gives its answer away
# ---------------------------------------------------------------------------------------------------------------------


def cells_before(notebook: str, marker: str) -> str:
    """The text of every cell (source and committed outputs) before the first cell whose source holds ``marker``."""
    cells = json.loads((NOTEBOOKS / notebook).read_text())["cells"]
    text = []
    for cell in cells:
        source = "".join(cell["source"])
        if marker in source:
            return "\n".join(text)
        outputs = [str(output) for output in cell.get("outputs", [])]
        text += [source, *outputs]
    raise AssertionError(f"no cell of {notebook} holds {marker!r}")


def test_chapter_05_gives_the_invariant_not_the_update_before_its_check():
    before = cells_before("05_online_softmax.ipynb", "check_online_update(online_update)")
    assert "s_{k-1}\\, e^{\\,m_{k-1} - m_k}" not in before  # the boxed update
    assert "e^{m_{k-1} - m_k}" not in before and "m_{\\text{new}} - m" not in before  # the rescale factor
    assert "online_softmax_steps(row" not in before  # the step-through table prints the factor
    assert "s_k = \\sum" in before  # the invariant is there


def test_chapter_06_shows_no_gradient_line_before_its_exercises():
    # Exercise 2's stub sits right under exercise 1's check: it describes its task without exercise 1's line.
    for marker in ("check_ce_gradient(my_gradient", "check_inplace_gradient(inplace_gradient"):
        before = cells_before("06_cross_entropy_kernel.ipynb", marker)
        assert "tl.where(cols == target" not in before, marker
        assert "exp(x - lse) -" not in before and "exp(x − lse) −" not in before, marker
        assert "onehot(target)) * scale" not in before, marker


@pytest.mark.parametrize("notebook", ["05_online_softmax.ipynb", "06_cross_entropy_kernel.ipynb"])
def test_no_committed_output_is_a_bare_widget_or_a_frozen_progress_bar(notebook):
    # A widget's committed output is read without a kernel: its text must say something, not repr the widget.
    for cell in json.loads((NOTEBOOKS / notebook).read_text())["cells"]:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            text = "".join(data.get("text/plain", "")) + "".join(output.get("text", ""))
            assert not text.startswith(("interactive(", "IntSlider(", "IntProgress(")), text
            assert " 0%|" not in text and "IntProgress" not in text, text


def test_a_machine_that_will_not_map_the_range_is_told_so(device, monkeypatch, capsys):
    import kernels.exercises.cross_entropy as module

    monkeypatch.setattr(module, "mapped_buffer", lambda *args: None)
    assert check_inplace_gradient(load("inplace_gradient"), device=device, high_rows=True)
    assert "int64 row offsets NOT checked (this machine would not map" in capsys.readouterr().out
