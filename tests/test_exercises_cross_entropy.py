"""The exercise checks of chapters 05 and 06: each passes its solution, and names every planted mistake with the
sentence of its diagnosis dict, without raising.

The online update and the gradient line are planted in plain PyTorch (exactly the arithmetic a wrong answer does);
the in-place sweep is planted as Triton kernels, one per mistake, since what it checks (masks, offsets, strides,
dtypes) only exists in a kernel.
"""

import json
import math
from pathlib import Path

import diagnoses
import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.exercises.cross_entropy import (
    GRADIENT_DIAGNOSES,
    SWEEP_DIAGNOSES,
    UPDATE_DIAGNOSES,
    check_ce_gradient,
    check_inplace_gradient,
    check_online_update,
)
from kernels.exercises.solutions import load
from kernels.triton_utils import cast_to

# ---------------------------------------------------------------------------------------------------------------------
# Chapter 05: the online update
# ---------------------------------------------------------------------------------------------------------------------


def update_attempt(mistake):
    """The online update with one of the usual mistakes (or none)."""
    def attempt(m, s, c):
        m_new = torch.maximum(m, c.max())
        right_s = s * torch.exp(m - m_new) + torch.exp(c - m_new).sum()
        if mistake == "stub":
            raise NotImplementedError
        if mistake == "raised":
            return m_new, s * torch.exp(m - m_new) + torch.exp(c[None, :] - m_new[None]).sum(dim=2)
        if mistake == "first-chunk":  # right except where m = -inf
            return m_new, right_s if torch.isfinite(m) else torch.tensor(math.nan)
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


def test_the_update_solution_passes(capsys):
    assert check_online_update(update_attempt("right"))
    assert check_online_update(load("online_update"))
    assert capsys.readouterr().out.startswith("✓")


def test_a_quiet_check_prints_nothing(capsys):
    assert check_online_update(load("online_update"), verbose=False)
    assert not check_online_update(update_attempt("no-rescale"), verbose=False)
    assert capsys.readouterr().out == ""


# ---------------------------------------------------------------------------------------------------------------------
# Chapter 06, exercise 1: the gradient line
# ---------------------------------------------------------------------------------------------------------------------


def gradient_attempt(mistake):
    def attempt(logits, target, ignore_index):
        if mistake == "stub":
            raise NotImplementedError
        if mistake == "raised":
            raise RuntimeError("a kernel that does not compile")
        counted = target != ignore_index
        x = logits.double()
        p = torch.softmax(x, -1)
        onehot = F.one_hot(target.clamp(min=0), logits.shape[-1]).double() * counted[:, None]
        keep = counted[:, None].double()
        n = counted.sum()

        def column(i):
            return torch.tensor(i, device=logits.device)

        return {
            "right": (p - onehot) / n * keep,
            "shape": p[:, :-1],
            "zeros": torch.zeros_like(p),
            "nan": p * float("nan"),
            "no-onehot": p / n * keep,
            "sign": (onehot - p) / n * keep,
            "no-scale": (p - onehot) * keep,
            "all-rows": (p - onehot) / logits.shape[0] * keep,
            "ignored-count": (p - onehot) / n,
            "unnormalised": (torch.exp(x - x.max(-1, keepdim=True).values) - onehot) / n * keep,
            "onehot-off-by-one": (p - shifted(onehot, 1)) / n * keep,  # cols == target + 1: none for the last column
            "onehot-unscaled": (p / n - onehot) * keep,
            "scale-inverted": (p - onehot) * n * keep,
            "divided-by-columns": (p - onehot) / logits.shape[-1] * keep,
            "log-softmax": (x - torch.logsumexp(x, -1, keepdim=True) - onehot) / n * keep,
            "scaled": 0.5 * (p - onehot) / n * keep,
            # A mistake nobody makes, with rows that still sum to 0: the check can only point at the largest error.
            "wrong": (p - onehot) / n * keep + 0.01 * keep * (F.one_hot(column(7), logits.shape[-1])
                                                              - F.one_hot(column(8), logits.shape[-1])),
        }[mistake].float()
    return attempt


def shifted(onehot, by):
    """The one-hot moved ``by`` columns, what cols == target + by finds: nothing where that column does not exist."""
    out = torch.zeros_like(onehot)
    if by > 0:
        out[:, by:] = onehot[:, :-by]
    else:
        out[:, :by] = onehot[:, -by:]
    return out


@pytest.mark.parametrize("mistake", [key for key in GRADIENT_DIAGNOSES])
def test_every_gradient_diagnosis_is_named(mistake, device, capsys):
    assert not check_ce_gradient(gradient_attempt(mistake), device=device)
    out = capsys.readouterr().out
    assert out.startswith("✗") and diagnoses.says(GRADIENT_DIAGNOSES[mistake], out), out


@pytest.mark.parametrize("by, side", [(1, "right of"), (-1, "left of")])
def test_a_onehot_one_column_off_is_named_as_such_not_as_an_unnormalised_softmax(by, side, device, capsys):
    # The target in the last column (299) has no column to its right: that row's −1 is lost, its sum is not 0, and
    # a check that looked at row sums first called this "the softmax is not normalised".
    def attempt(logits, target, ignore_index):
        counted = target != ignore_index
        p = torch.softmax(logits.double(), -1)
        onehot = F.one_hot(target.clamp(min=0), logits.shape[-1]).double() * counted[:, None]
        return ((p - shifted(onehot, by)) / counted.sum() * counted[:, None]).float()

    assert not check_ce_gradient(attempt, device=device)
    out = capsys.readouterr().out
    assert "the one-hot is at the wrong column" in out and side in out, out
    assert GRADIENT_DIAGNOSES["unnormalised"] not in out, out


def test_the_gradient_check_accepts_the_package_kernel(device):
    from kernels.cross_entropy import cross_entropy_forward

    def kernel_gradient(logits, target, ignore_index):
        return cross_entropy_forward(logits, target, ignore_index, "mean")[2]

    assert check_ce_gradient(kernel_gradient, device=device, verbose=False)


def test_the_gradient_solution_passes(device, capsys):
    assert check_ce_gradient(gradient_attempt("right"), device=device)
    assert check_ce_gradient(load("ce_gradient"), device=device)
    assert capsys.readouterr().out.startswith("✓")


# ---------------------------------------------------------------------------------------------------------------------
# Chapter 06, exercise 2: the in-place sweep, as kernels with one planted mistake each
# ---------------------------------------------------------------------------------------------------------------------

# Mistakes of the kernel below, by number (a constexpr, so each compiles to its own kernel).
KERNEL_MISTAKES = {"right": 0, "mask": 1, "stride": 2, "one-row": 3, "first-chunk": 4, "ignored-unwritten": 5,
                   "upcast": 6, "precision": 7, "sign": 8, "no-onehot": 9, "no-scale": 10, "ignored-count": 11,
                   "unnormalised": 12, "nan": 13, "zeros": 14, "onehot-off-by-one": 15, "stub": 16, "lse-row0": 17,
                   "target-row0": 18, "log-softmax": 19, "wrong": 20}


@triton.jit
def planted_kernel(LOGITS, TARGET, LSE, SCALE, n_cols, stride, ignore_index, BLOCK_V: tl.constexpr,
                   MISTAKE: tl.constexpr):
    if MISTAKE != 16:  # 16: the stub, which stores nothing
        row = tl.program_id(0).to(tl.int64)
        if MISTAKE == 3:
            row = row * 0  # every program on row 0
        row_step = stride
        if MISTAKE == 2:
            row_step = n_cols  # rows taken as n_cols apart
        target = tl.load(TARGET + row)
        if MISTAKE == 18:
            target = tl.load(TARGET)  # row 0's target for every row
        counted = target != ignore_index
        lse = tl.load(LSE + row)
        if MISTAKE == 17:
            lse = tl.load(LSE)  # row 0's logsumexp for every row
        if MISTAKE == 7:
            lse = lse.to(LOGITS.dtype.element_ty).to(tl.float32)  # rounded to the logits' dtype
        scale = tl.load(SCALE)
        row_scale = tl.where(counted, scale, 0.0)
        if MISTAKE == 10:
            row_scale = tl.where(counted, 1.0, 0.0)
        if MISTAKE == 11:
            row_scale = scale + 0.0 * lse
        n_chunks = n_cols
        if MISTAKE == 4:
            n_chunks = 1  # only the first chunk
        for start in range(0, n_chunks, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            ok = cols < n_cols
            if MISTAKE == 1:
                ok = cols < n_cols + BLOCK_V  # no mask on the last chunk
            if MISTAKE == 5:
                ok = cols < tl.where(counted, n_cols, 0)  # ignored rows keep their logits
            if MISTAKE == 6:
                x = tl.load(LOGITS + row * row_step + cols, mask=ok, other=0.0)  # not converted to float32
                p = tl.exp(x) * tl.exp(-lse)
            else:
                x = tl.load(LOGITS + row * row_step + cols, mask=ok, other=0.0).to(tl.float32)
                p = tl.exp(x - lse)
                if MISTAKE == 12:
                    p = tl.exp(x)
                if MISTAKE == 19:
                    p = x - lse  # the log of the softmax
            onehot = tl.where(cols == target, 1.0, 0.0)
            if MISTAKE == 15:
                onehot = tl.where(cols == target + 1, 1.0, 0.0)  # the −1 one column too far right
            if MISTAKE == 9:
                onehot = 0.0 * onehot
            g = (p - onehot) * row_scale
            if MISTAKE == 8:
                g = -g
            if MISTAKE == 13:
                g = g / tl.where(counted, 1.0, 0.0)
            if MISTAKE == 14:
                g = g * 0.0
            if MISTAKE == 20:
                # No mistake anyone makes, rows still summing to 0: the check cannot name it.
                g = g + (tl.where(cols == 7, 0.01, 0.0) - tl.where(cols == 8, 0.01, 0.0)) * row_scale
            tl.store(LOGITS + row * row_step + cols, cast_to(g, LOGITS.dtype.element_ty), mask=ok)


def planted(mistake, block=128, divisor="valid"):
    def launch(logits, target, lse, ignore_index=-100):
        n = (target != ignore_index).sum() if divisor == "valid" else torch.tensor(target.shape[0])
        scale = 1.0 / n.to(torch.float32).to(logits.device)
        planted_kernel[(logits.shape[0],)](logits, target, lse, scale, logits.shape[1], logits.stride(0),
                                           ignore_index, BLOCK_V=block, MISTAKE=KERNEL_MISTAKES[mistake])
        return logits
    return launch


def sweep_attempt(mistake):
    if mistake == "all-rows":
        return planted("right", divisor="all")
    if mistake == "raised":
        def raises(logits, target, lse, ignore_index=-100):
            raise RuntimeError("out of resources")
        return raises
    if mistake == "launcher-stub":
        def stub(logits, target, lse, ignore_index=-100):
            raise NotImplementedError
        return stub
    return planted(mistake)


@triton.jit
def int32_kernel(LOGITS, TARGET, LSE, SCALE, n_cols, stride, ignore_index, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)  # int64? No: int32, and row * stride wraps past 2**31
    target = tl.load(TARGET + row)
    lse = tl.load(LSE + row)
    row_scale = tl.where(target != ignore_index, tl.load(SCALE), 0.0)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        ok = cols < n_cols
        x = tl.load(LOGITS + row * stride + cols, mask=ok, other=0.0).to(tl.float32)
        g = (tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)) * row_scale
        tl.store(LOGITS + row * stride + cols, cast_to(g, LOGITS.dtype.element_ty), mask=ok)


def int32_launch(logits, target, lse, ignore_index=-100):
    scale = 1.0 / (target != ignore_index).sum().to(torch.float32)
    int32_kernel[(logits.shape[0],)](logits, target, lse, scale, logits.shape[1], logits.stride(0), ignore_index,
                                     BLOCK_V=128)
    return logits


SWEEP_CASES = [
    # (how the attempt is made, the diagnosis it must get, from which dict)
    ("stub", SWEEP_DIAGNOSES["stub"]),
    ("launcher-stub", SWEEP_DIAGNOSES["stub"]),
    ("raised", SWEEP_DIAGNOSES["raised"]),
    ("upcast", SWEEP_DIAGNOSES["upcast"]),
    ("precision", SWEEP_DIAGNOSES["precision"]),
    ("mask", SWEEP_DIAGNOSES["mask"]),
    ("stride", SWEEP_DIAGNOSES["stride"]),
    ("one-row", SWEEP_DIAGNOSES["one-row"]),
    ("first-chunk", SWEEP_DIAGNOSES["first-chunk"]),
    ("ignored-unwritten", SWEEP_DIAGNOSES["ignored-unwritten"]),
    ("sign", GRADIENT_DIAGNOSES["sign"]),
    ("no-onehot", GRADIENT_DIAGNOSES["no-onehot"]),
    ("no-scale", GRADIENT_DIAGNOSES["no-scale"]),
    ("all-rows", GRADIENT_DIAGNOSES["all-rows"]),
    ("ignored-count", GRADIENT_DIAGNOSES["ignored-count"]),
    ("unnormalised", GRADIENT_DIAGNOSES["unnormalised"]),
    ("nan", GRADIENT_DIAGNOSES["nan"]),
    ("zeros", GRADIENT_DIAGNOSES["zeros"]),
    ("onehot-off-by-one", "the one-hot is at the wrong column"),
    ("log-softmax", GRADIENT_DIAGNOSES["log-softmax"]),
    ("lse-row0", SWEEP_DIAGNOSES["lse-row0"]),
    ("target-row0", SWEEP_DIAGNOSES["target-row0"]),
    ("wrong", GRADIENT_DIAGNOSES["wrong"]),
]


def test_every_sweep_diagnosis_has_a_case():
    named = {sentence for _, sentence in SWEEP_CASES}
    assert set(SWEEP_DIAGNOSES.values()) - named == {SWEEP_DIAGNOSES["int32"]}  # tested below, on its own
    assert {GRADIENT_DIAGNOSES[k] for k in ("sign", "no-onehot", "no-scale", "all-rows", "ignored-count")} <= named


@pytest.mark.parametrize("mistake, sentence", SWEEP_CASES, ids=[case for case, _ in SWEEP_CASES])
def test_every_sweep_mistake_is_named(mistake, sentence, device, capsys):
    assert not check_inplace_gradient(sweep_attempt(mistake), device=device, high_rows=False)
    out = capsys.readouterr().out
    assert out.startswith("✗") and sentence in out, out


def test_int32_row_offsets_are_named_by_running_the_kernel(device, capsys):
    # The kernel's source says "int64" (in a comment): only running it shows its offsets wrap. In the interpreter the
    # view lives in a mapped address range, so the run needs a few pages of memory, not 8 GiB.
    assert not check_inplace_gradient(int32_launch, device=device)
    out = capsys.readouterr().out
    assert SWEEP_DIAGNOSES["int32"] in out and "rows 0 and 1 are right, row 2 is not" in out, out


def test_the_high_row_case_reads_the_right_elements_with_int64_offsets(device, capsys):
    assert check_inplace_gradient(load("inplace_gradient"), device=device)
    out = capsys.readouterr().out
    assert out.startswith("✓") and "row 2 of a view at element 2**31 + 128 (int64 row offsets)" in out, out


def test_a_skipped_high_row_case_says_so(device, capsys):
    assert check_inplace_gradient(load("inplace_gradient"), device=device, high_rows=False)
    assert "int64 row offsets NOT checked" in capsys.readouterr().out


def test_the_sweep_solution_passes(device, capsys):
    assert check_inplace_gradient(planted("right"), device=device, high_rows=False)
    assert check_inplace_gradient(load("inplace_gradient"), device=device, high_rows=False)
    out = capsys.readouterr().out
    assert out.startswith("✓") and "✗" not in out


def test_a_larger_block_is_fine(device):
    assert check_inplace_gradient(planted("right", block=512), device=device, high_rows=False, verbose=False)
    assert not check_inplace_gradient(planted("mask", block=512), device=device, high_rows=False, verbose=False)


@pytest.mark.gpu
def test_int32_row_offsets_wrap_on_the_gpu(capsys):
    # The same case in real GPU memory: 8 GiB of bf16.
    # The third row starts past element 2**31, and an int32 offset lands in the headroom below.
    assert not check_inplace_gradient(int32_launch, device="cuda", high_rows=True)
    out = capsys.readouterr().out
    assert SWEEP_DIAGNOSES["int32"] in out and "rows 0 and 1 are right" in out, out
    assert check_inplace_gradient(load("inplace_gradient"), device="cuda", high_rows=True)


# ---------------------------------------------------------------------------------------------------------------------
# The answers stay out of sight until the reader has tried: nothing before a check cell gives its answer away
# ---------------------------------------------------------------------------------------------------------------------

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


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
    for marker in ("check_ce_gradient(my_gradient", "check_inplace_gradient(inplace_gradient"):
        before = cells_before("06_cross_entropy_kernel.ipynb", marker)
        assert "tl.exp(x - lse) - tl.where(cols == target" not in before, marker
        assert "tl.where(cols == target" not in before, marker


def test_a_machine_that_will_not_map_the_range_is_told_so(device, monkeypatch, capsys):
    import kernels.exercises.cross_entropy as module

    monkeypatch.setattr(module, "mapped_buffer", lambda *args: None)
    assert check_inplace_gradient(load("inplace_gradient"), device=device, high_rows=True)
    assert "int64 row offsets NOT checked (this machine would not map" in capsys.readouterr().out
