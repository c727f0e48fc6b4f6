"""flash_attention at its edges: scales across float32's range, position ids in every integer dtype (wrapping ones
included), numpy bools, second derivatives, and tiles the kernels cannot compute.

Outputs are compared with ``attention_reference`` in float64 (SDPA's math backend takes the square root of the scale,
which is NaN for a negative one).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.attention import (
    LOG2E,
    BlockConfig,
    Config,
    attention_backward,
    attention_forward,
    attention_reference,
    document_mask,
    flash_attention,
    segment_bounds_from_positions,
)
from kernels.reference import relative_error
from kernels.tolerances import RELATIVE_ERROR_TOL

FLOAT32_MAX = float(torch.finfo(torch.float32).max)
MAX_EXPONENT = math.log10(FLOAT32_MAX / LOG2E)  # of the largest scale the kernels take


def _qkv(gen, device, batch=1, heads=2, seq=20, head_dim=16, requires_grad=False):
    return [torch.randn(batch, heads, seq, head_dim, generator=gen).to(device).requires_grad_(requires_grad)
            for _ in range(3)]


# --------------------------------------------------------------------------------------------------------------------
# Scale
# --------------------------------------------------------------------------------------------------------------------


@settings(max_examples=min(settings().max_examples, 60))
@given(exponent=st.one_of(st.floats(-320.0, MAX_EXPONENT), st.floats(29.0, MAX_EXPONENT)), negative=st.booleans(),
       causal=st.booleans(), seq=st.integers(1, 40), packed=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_any_scale_in_float32s_range_matches_float64(exponent, negative, causal, seq, packed, seed, device):
    # A running maximum that started at a finite stand-in (-1e30) zeroed every row whose scaled scores all lay below
    # it; scale 1e30 did that to about half the rows. Each row is held to the float32 rounding of its scores.
    scale = min((-1.0 if negative else 1.0) * 10.0 ** exponent, FLOAT32_MAX / LOG2E)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = _qkv(gen, device, seq=seq)
    cu = None
    if packed:
        cuts = sorted(torch.randint(0, seq + 1, (3,), generator=gen).tolist())
        cu = torch.tensor([0, *cuts, seq], dtype=torch.int32, device=device)
    out = flash_attention(q, k, v, causal, scale=scale, cu_seqlens=cu)
    q64, k64, v64 = (t.double() for t in (q, k, v))
    ref = attention_reference(q64, k64, v64, causal, scale, cu)
    top = ((q64 @ k64.transpose(-1, -2)).abs().max() * abs(scale) * LOG2E).item()  # the largest base-2 score
    if top > FLOAT32_MAX / 2:  # the float32 scores overflow (or nearly): NaN, as SDPA in float32, never a number
        if top > 2 * FLOAT32_MAX:
            assert out.isnan().any()
        return
    error = (out.double() - ref).abs().amax(-1)
    assert (error <= _float32_score_bound(q64, k64, v64, causal, scale, cu)).all(), (scale, error.max())


def _float32_score_bound(q, k, v, causal, scale, cu):
    # How far a row's output may lie from float64's when each score is computed in float32: a score off by δ (a few
    # ulps of the sum of |q_i k_i| · |scale|) changes each key's weight, relative to the row's largest, by a factor
    # within exp(±2δ); the output moves by at most 2 max|v| · Σ over the other keys of p · expm1(2δ) (each capped at
    # 1). Small scores: a few ulps. Huge ones: the softmax is one-hot and the other keys' p is 0, whatever δ is.
    s = q @ k.transpose(-1, -2) * scale
    delta = 2.0**-20 * ((q.abs() @ k.abs().transpose(-1, -2)) * abs(scale)).amax(-1, keepdim=True)
    allowed = document_mask(cu, q.shape[2], causal).to(q.device)
    logp = torch.log_softmax(s.masked_fill(~allowed, -math.inf), -1)
    logp = logp.masked_fill(logp == logp.amax(-1, keepdim=True), -math.inf)  # the largest: its own reference
    log_factor = torch.where(delta > 15, 2 * delta, torch.log(torch.expm1(2 * delta.clamp(max=15))))  # finite
    spread = torch.clamp((logp + log_factor).exp(), max=1.0).sum(-1)
    return 1e-5 * v.abs().amax() + 2 * v.abs().amax() * spread


def test_scale_1e30_keeps_every_row(device, gen):
    q, k, v = _qkv(gen, device)
    for causal in (True, False):
        out = flash_attention(q, k, v, causal, scale=1e30)
        ref = attention_reference(q.double(), k.double(), v.double(), causal, 1e30)
        assert relative_error(out, ref) < 1e-6


@pytest.mark.parametrize("scale", [10**400, -(10**400), math.nan, math.inf, 1e300, -1e39],
                         ids=["10**400", "-10**400", "nan", "inf", "1e300", "-1e39"])
def test_scales_past_float32_are_a_value_error(scale, device, gen):
    q, k, v = _qkv(gen, device, seq=8)
    with pytest.raises(ValueError, match="scale must be finite"):
        flash_attention(q, k, v, scale=scale)


def test_numpy_scales_and_bools_are_taken(device, gen):
    q, k, v = _qkv(gen, device, seq=8)
    ref = flash_attention(q, k, v, True, scale=0.5)
    assert torch.equal(flash_attention(q, k, v, np.bool_(True), scale=np.float32(0.5)), ref)
    assert torch.equal(flash_attention(q, k, v, np.bool_(False)), flash_attention(q, k, v, False))
    with pytest.raises(TypeError, match="causal must be a bool, got builtins.int"):
        flash_attention(q, k, v, 1)


# --------------------------------------------------------------------------------------------------------------------
# Position ids
# --------------------------------------------------------------------------------------------------------------------

INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
                  torch.uint64)
_NO_ADD = (torch.uint16, torch.uint32, torch.uint64)


@pytest.mark.parametrize("dtype", INTEGER_DTYPES)
def test_position_ids_that_wrap_start_a_new_document(dtype, device, gen):
    # Two documents whose boundary is the dtype's maximum followed by its minimum: max + 1 wraps to min, which read
    # as one run of consecutive positions merged them.
    info = torch.iinfo(dtype)
    seq = 8
    positions = [info.max - 3, info.max - 2, info.max - 1, info.max, info.min, info.min + 1, info.min + 2,
                 info.min + 3]
    pos = torch.tensor([positions], dtype=dtype, device=device) if dtype not in _NO_ADD else None
    q, k, v = _qkv(gen, device, seq=seq)
    if dtype in _NO_ADD:  # PyTorch has no + for them: refused by name, not an internal error
        pos = torch.zeros(1, seq, dtype=dtype, device=device)
        with pytest.raises(TypeError, match=f"position_ids of dtype {dtype}"):
            flash_attention(q, k, v, position_ids=pos)
        return
    start, end = segment_bounds_from_positions(pos)
    assert start.tolist() == [[0, 0, 0, 0, 4, 4, 4, 4]] and end.tolist() == [[4, 4, 4, 4, 8, 8, 8, 8]]
    out = flash_attention(q, k, v, position_ids=pos)
    cu = torch.tensor([0, 4, 8], dtype=torch.int32, device=device)
    ref = attention_reference(q.double(), k.double(), v.double(), True, None, cu)
    assert relative_error(out, ref) < RELATIVE_ERROR_TOL[torch.float32]


@settings(max_examples=min(settings().max_examples, 40))
@given(dtype=st.sampled_from([d for d in INTEGER_DTYPES if d not in _NO_ADD]), data=st.data())
def test_position_ids_of_any_integer_dtype_find_the_documents(dtype, data):
    # Runs of positions from any start the dtype holds, ending anywhere up to its maximum: a document starts wherever
    # a position is not the previous one plus 1 in whole numbers (never by wrapping past the maximum).
    info = torch.iinfo(dtype)
    positions = []
    for n in data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=5)):
        first = data.draw(st.one_of(st.integers(info.min, info.max - n + 1), st.just(info.max - n + 1),
                                    st.just(info.min)))
        positions += range(first, first + n)
    seq = len(positions)
    starts = [0] * seq
    for i in range(1, seq):
        starts[i] = starts[i - 1] if positions[i] == positions[i - 1] + 1 else i
    ends = [next((j for j in range(i + 1, seq) if starts[j] == j), seq) for i in range(seq)]
    start, end = segment_bounds_from_positions(torch.tensor([positions], dtype=dtype))
    assert start.tolist() == [starts] and end.tolist() == [ends]


# --------------------------------------------------------------------------------------------------------------------
# Second derivatives
# --------------------------------------------------------------------------------------------------------------------


def test_gradcheck_and_no_silent_double_backward(device, gen):
    q, k, v = _qkv(gen, device, heads=1, seq=3, requires_grad=True)
    # float32 (the kernels take no float64): central differences at eps 1e-2 carry ~1e-3 of truncation. Fast mode
    # (random directions) keeps the interpreter's launches few.
    check = dict(eps=1e-2, atol=5e-3, rtol=5e-3, fast_mode=True)
    with pytest.warns(UserWarning, match="double precision"):
        assert torch.autograd.gradcheck(lambda *a: flash_attention(*a), (q, k, v), **check)
    # A gradient penalty: create_graph=True used to return a gradient with no derivative (requires_grad False),
    # so the penalty's own gradient silently left attention out. SDPA's fused kernels raise; so does this.
    with pytest.warns(UserWarning, match="double precision"), pytest.raises(RuntimeError, match="no double backward"):
        torch.autograd.gradgradcheck(lambda *a: flash_attention(*a), (q, k, v), **check)
    for loss in (lambda o: o.sum(), lambda o: o.pow(2).sum()):  # grad_out constant, and grad_out with a graph
        (dq,) = torch.autograd.grad(loss(flash_attention(q, k, v)), q, create_graph=True)
        assert dq.requires_grad
        with pytest.raises(RuntimeError, match="no double backward"):
            dq.pow(2).sum().backward()
    # A first-order backward is unchanged.
    q.grad = None
    flash_attention(q, k, v).sum().backward()
    assert q.grad is not None and not q.grad.requires_grad


# --------------------------------------------------------------------------------------------------------------------
# Tiles
# --------------------------------------------------------------------------------------------------------------------


def test_tiles_with_block_m_not_a_multiple_of_block_n_are_refused(device, gen):
    q, k, v = _qkv(gen, device, seq=40)
    good, bad = BlockConfig(32, 16, 4, 1), BlockConfig(16, 32, 4, 1)
    with pytest.raises(ValueError, match="config.forward has block_m=16 and block_n=32"):
        attention_forward(q, k, v, True, 0.25, config=Config(bad, good, good, 16))
    out, lse = attention_forward(q, k, v, True, 0.25, config=Config(good, bad, good, 16))  # dK/dV: any shape
    with pytest.raises(ValueError, match="config.dq has block_m=16 and block_n=32"):
        attention_backward(torch.randn_like(out), q, k, v, out, lse, True, 0.25, config=Config(good, good, bad, 16))
