"""Chapter 16's check: right answers pass, the stub and each usual mistake in the inner loop are named, answers that
compute the whole row at once or call a finished attention are refused.

The wrong answers are written here as a learner writes them: the right loop below with one line changed
(``CATALOGUE``: the line as it was, the line as the learner wrote it, and words the verdict must contain).
"""

import functools
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels.attention import attention_reference, flash_attention
from kernels.exercises import solutions
from kernels.exercises.attention import HINTS, MISTAKES, blockwise_attention, cases, check_attention_loop, diagnose

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "16_flash_attention.ipynb"

RIGHT = '''
def attention_loop(q, k, v, causal, block_n):
    heads, seq, d = q.shape
    group = heads // k.shape[0]
    scale = 1 / math.sqrt(d)
    out = torch.empty_like(q)
    rows = torch.arange(seq)[:, None]
    for h in range(heads):
        kh = h // group
        m = torch.full((seq,), -1e30, dtype=q.dtype)
        l = torch.zeros(seq, dtype=q.dtype)
        acc = torch.zeros(seq, d, dtype=q.dtype)
        for n0 in range(0, seq, block_n):
            s = q[h] @ k[kh, n0:n0 + block_n].T * scale
            if causal:
                cols = torch.arange(n0, min(n0 + block_n, seq))[None, :]
                s = s.masked_fill(cols > rows, float("-inf"))
            m_new = torch.maximum(m, s.max(dim=-1).values)
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new[:, None])
            l = l * alpha + p.sum(-1)
            acc = acc * alpha[:, None] + p @ v[kh, n0:n0 + block_n]
            m = m_new
        out[h] = acc / l[:, None]
    return out
'''

MASK = '''            if causal:
                cols = torch.arange(n0, min(n0 + block_n, seq))[None, :]
                s = s.masked_fill(cols > rows, float("-inf"))
'''

# name: (the right line, the learner's line, words of the verdict)
CATALOGUE = {
    "missing scale": (".T * scale", ".T", "not scaled"),
    "1/d scale": ("1 / math.sqrt(d)", "1 / d", "scaled by 1/d"),
    "no final division by l": ("out[h] = acc / l[:, None]", "out[h] = acc", "divide by l at the end"),
    "GQA modulo": ("kh = h // group", "kh = h % k.shape[0]", "h % kv_heads"),
    "GQA divided by kv_heads": ("kh = h // group", "kh = h // k.shape[0]", "the divisor is the group size"),
    "GQA head 0": ("kh = h // group", "kh = 0", "every query head reads KV head 0"),
    "rescaling only acc": ("l = l * alpha + p.sum(-1)", "l = l + p.sum(-1)", "l is not rescaled"),
    "rescaling only l": ("acc = acc * alpha[:, None] +", "acc = acc +", "acc is not rescaled"),
    "no rescale": ("l = l * alpha + p.sum(-1)\n            acc = acc * alpha[:, None] +",
                   "l = l + p.sum(-1)\n            acc = acc +", "neither acc nor l is rescaled"),
    "alpha inverted": ("alpha = torch.exp(m - m_new)", "alpha = torch.exp(m_new - m)", "exp(m_new − m_old) gives"),
    "strict causal mask": ("cols > rows", "cols >= rows", "masked from its own key"),
    "causal columns without the block offset": ("torch.arange(n0, min(n0 + block_n, seq))", "torch.arange(block_n)",
                                                "inside the block"),
    "causal columns counted in the block": ("torch.arange(n0, min(n0 + block_n, seq))",
                                            "torch.arange(min(block_n, seq - n0))", "inside the block"),
    "masking with 0": ('float("-inf")', "0.0", "still counts in the softmax"),
    "no causal mask": (MASK, "", "attends to later keys"),
    "float32 output": ("torch.empty_like(q)", "torch.empty(q.shape)", "returned float32, and the inputs are float64"),
    "float32 scores": ("s = q[h] @ k[kh, n0:n0 + block_n].T", "s = q[h].float() @ k[kh, n0:n0 + block_n].T.float()",
                       "the loop computed in float32"),
    "dense scores, then the blocks": ("    for h in range(heads):\n", "    for h in range(heads):\n"
                                      "        everything = q[h] @ k[h // group].T\n", "whole row at once"),
    "blocks twice as wide": ("    heads, seq, d = q.shape\n",
                             "    heads, seq, d = q.shape\n    block_n = 2 * block_n  # fewer blocks\n",
                             "more than block_n"),
}


def learner(source: str, **names):
    """The function ``attention_loop`` that ``source`` defines, as a notebook cell would define it."""
    namespace = {"math": math, "torch": torch, "F": F, "attention_reference": attention_reference,
                 "flash_attention": flash_attention, **names}
    exec(source, namespace)
    return namespace["attention_loop"]


def changed(old: str, new: str):
    assert RIGHT.count(old) >= 1, old
    return learner(RIGHT.replace(old, new))


def test_the_solution_passes():
    report = check_attention_loop(solutions.load("attention_loop"), verbose=False)
    assert report.passed, report.message


RIGHT_VARIANTS = {
    "written out": RIGHT,
    "the KV head first, then its blocks": RIGHT.replace("k[kh, n0:n0 + block_n]", "kk[n0:n0 + block_n]")
    .replace("v[kh, n0:n0 + block_n]", "vv[n0:n0 + block_n]")
    .replace("        m = torch.full", "        kk, vv = k[kh], v[kh]\n        m = torch.full"),
    "narrow": RIGHT.replace("k[kh, n0:n0 + block_n]", "k[kh].narrow(0, n0, min(block_n, seq - n0))"),
    "index_select and einsum": RIGHT.replace(
        "q[h] @ k[kh, n0:n0 + block_n].T",
        "torch.einsum('id,jd->ij', q[h], k[kh].index_select(0, torch.arange(n0, min(n0 + block_n, seq))))"),
    "keys scaled up front, m from −inf": RIGHT.replace("    out = torch.empty_like(q)\n",
                                                      "    out = torch.empty_like(q)\n    k = k * scale\n").replace(
        ".T * scale", ".T").replace("-1e30", "float('-inf')"),
    "split into blocks": RIGHT.replace("for n0 in range(0, seq, block_n):",
                                       "for n0, kb in zip(range(0, seq, block_n), k[kh].split(block_n)):").replace(
        "k[kh, n0:n0 + block_n].T", "kb.T"),
}


@pytest.mark.parametrize("name", RIGHT_VARIANTS)
def test_right_answers_pass(name):
    report = check_attention_loop(learner(RIGHT_VARIANTS[name]), verbose=False)
    assert report.passed, report.message


@pytest.mark.parametrize("name", CATALOGUE)
def test_each_wrong_answer_is_named(name):
    old, new, words = CATALOGUE[name]
    report = check_attention_loop(changed(old, new), verbose=False)
    assert not report.passed and words in report.message, report.message


def test_the_catalogue_covers_every_mistake_the_check_names():
    named = {key for key in HINTS for _, _, words in CATALOGUE.values() if words in HINTS[key]}
    assert set(MISTAKES) <= named, set(MISTAKES) - named


def notebook_stub() -> str:
    cells = json.loads(NOTEBOOK.read_text(encoding="utf-8"))["cells"]
    stubs = ["".join(c["source"]) for c in cells
             if c["cell_type"] == "code" and "".join(c["source"]).startswith("def attention_loop")]
    assert len(stubs) == 1, "the chapter has one exercise cell that defines attention_loop"
    return stubs[0].split("\ncheck_attention_loop")[0]


def test_the_stub_as_shipped_is_named():
    report = check_attention_loop(learner(notebook_stub()), verbose=False)
    assert not report.passed and "still the stub as shipped" in report.message, report.message


def test_a_stub_with_some_todos_done_lists_the_rest():
    stub = notebook_stub()
    assert "  # TODO: the scale" in stub
    half_done = stub.replace("  # TODO: the scale", " / math.sqrt(d)")
    report = check_attention_loop(learner(half_done), verbose=False)
    assert not report.passed and "3 of the stub's TODOs are still open" in report.message, report.message
    assert "the scale" not in report.message and "the KV head" in report.message


DENSE = '''
def attention_loop(q, k, v, causal, block_n):
    heads, seq, d = q.shape
    k = k.repeat_interleave(heads // k.shape[0], dim=0)
    v = v.repeat_interleave(heads // v.shape[0], dim=0)
    mask = torch.zeros(seq, seq, dtype=q.dtype)
    if causal:
        mask = mask.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d) + mask, dim=-1) @ v
'''


def test_a_dense_softmax_is_refused():
    report = check_attention_loop(learner(DENSE), verbose=False)
    assert not report.passed and "this computes the whole row at once" in report.message, report.message
    assert "online softmax over blocks of block_n keys" in report.message


FINISHED = {
    "SDPA with repeated heads": '''
def attention_loop(q, k, v, causal, block_n):
    group = q.shape[0] // k.shape[0]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 0), v.repeat_interleave(group, 0),
                                          is_causal=causal)
''',
    "the reference of cell 1": '''
def attention_loop(q, k, v, causal, block_n):
    return attention_reference(q[None], k[None], v[None], causal=causal)[0]
''',
    "the package's kernel": '''
def attention_loop(q, k, v, causal, block_n):
    return flash_attention(q[None], k[None], v[None], causal=causal)[0]
''',
    "the check's own loop": '''
def attention_loop(q, k, v, causal, block_n):
    return blockwise_attention(q, k, v, causal, block_n)
''',
    "the hidden solution": '''
def attention_loop(q, k, v, causal, block_n):
    return load("attention_loop")(q, k, v, causal, block_n)
''',
}
CALLED = {"SDPA with repeated heads": "scaled_dot_product_attention", "the reference of cell 1": "attention_reference",
          "the package's kernel": "flash_attention", "the check's own loop": "blockwise_attention",
          "the hidden solution": "the hidden solution"}


@pytest.mark.parametrize("name", FINISHED)
def test_finished_answers_are_refused(name):
    fn = learner(FINISHED[name], blockwise_attention=blockwise_attention, load=solutions.load)
    report = check_attention_loop(fn, verbose=False)
    assert not report.passed and CALLED[name] in report.message and "a ✓ would not be yours" in report.message, \
        report.message


@pytest.mark.parametrize("fn", [blockwise_attention, functools.partial(blockwise_attention)])
def test_the_simulator_handed_over_is_refused(fn):
    report = check_attention_loop(fn, verbose=False)
    assert not report.passed and "blockwise_attention" in report.message


def test_errors_and_shapes_are_reported():
    assert "raised" in check_attention_loop(lambda *a: 1 / 0, verbose=False).message
    assert "expected a tensor of shape" in check_attention_loop(lambda q, *a: q[0], verbose=False).message
    message = check_attention_loop(lambda q, *a: q.index_fill(1, torch.tensor([3]), float("nan")),
                                   verbose=False).message
    assert "NaN" in message and "query head 0, row 3" in message
    assert "none of the usual" in check_attention_loop(lambda q, *a: q, verbose=False).message


@pytest.mark.parametrize("mistake", MISTAKES)
def test_each_simulated_mistake_is_diagnosed_as_itself(mistake):
    inputs = list(cases(torch.Generator().manual_seed(1)))
    # The first input is causal (for the mask's mistakes), the second has 6/3 heads (for h // kv_heads).
    case, q, k, v = inputs[0] if mistake in ("no_causal_mask", "causal_strict", "causal_no_offset", "mask_zero") \
        else inputs[1]
    causal, block_n = case[4], case[5]
    assert diagnose(blockwise_attention(q, k, v, causal, block_n, mistake), q, k, v, causal, block_n) == HINTS[mistake]


def test_no_cell_runs_or_shows_the_hidden_solution():
    cells = json.loads(NOTEBOOK.read_text(encoding="utf-8"))["cells"]
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    assert not any('load("attention_loop")' in source for source in code)
    assert not any(line.startswith('solution("attention_loop")') for source in code for line in source.splitlines())
