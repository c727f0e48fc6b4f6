"""FlashAttention (kernels/attention.py) against a float64 reference: the output, dQ, dK and dV; causal and not; GQA;
odd lengths; packed documents (cu_seqlens) including documents of one token; layouts; bad inputs; the operators.

Sizes stay tiny: in Triton's interpreter each program costs milliseconds.
"""

import math

import pytest
import strategies
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from kernels import attention as attention_module
from kernels import runtime
from kernels.attention import (
    BlockConfig,
    Config,
    attention_backward,
    attention_config,
    attention_forward,
    attention_reference,
    document_mask,
    flash_attention,
    flash_attention_bwd,
    flash_attention_fwd,
    running_max,
    segment_bounds,
    segment_bounds_from_positions,
    shrinking,
)
from kernels.reference import relative_error
from kernels.tolerances import RELATIVE_ERROR_TOL


def _inputs(gen, device, batch, heads, kv_heads, seq, head_dim, dtype):
    def draw(h):
        return torch.randn(batch, h, seq, head_dim, generator=gen).to(device, dtype).requires_grad_(True)
    return draw(heads), draw(kv_heads), draw(kv_heads)


def _check_against_float64(q, k, v, causal, scale=None, cu_seqlens=None, gen=None, leaves=None):
    """Run ours and the float64 reference forward and backward; every relative error within the dtype's bound."""
    out = flash_attention(q, k, v, causal=causal, scale=scale, cu_seqlens=cu_seqlens)
    grad = torch.randn(out.shape, generator=gen).to(out.device, out.dtype)
    leaves = leaves or (q, k, v)
    grads = torch.autograd.grad(out, leaves, grad) if out.numel() else [torch.zeros_like(x) for x in leaves]
    leaves64 = [x.detach().double().requires_grad_(True) for x in leaves]
    views64 = [x64.as_strided(v.shape, v.stride(), v.storage_offset()) if x is not v else x64
               for x, x64, v in zip(leaves, leaves64, (q, k, v))]
    ref = attention_reference(*views64, causal=causal, scale=scale, cu_seqlens=cu_seqlens)
    ref_grads = (torch.autograd.grad(ref, leaves64, grad.double(), allow_unused=True) if ref.numel()
                 else [torch.zeros_like(x) for x in leaves64])
    tol = RELATIVE_ERROR_TOL[q.dtype]
    assert out.shape == ref.shape and out.dtype == q.dtype
    torch_own = _torch_in_dtype(leaves, (q, k, v), causal, scale, cu_seqlens, grad)
    delta_share = _stored_output_delta_error(views64, ref, out, grad.double(), causal, scale, cu_seqlens,
                                             ref_grads) if ref.numel() else {}
    for i, (name, a, b) in enumerate((("out", out, ref), ("dq", grads[0], ref_grads[0]),
                                      ("dk", grads[1], ref_grads[1]), ("dv", grads[2], ref_grads[2]))):
        if b.numel() == 0 or b.abs().max() == 0:
            # dQ of a row that sees one key is exactly 0 (dP = delta); ours may keep a rounding residue of that
            # difference, bounded by the sizes it came from.
            bound = grad.double().norm() * v.double().norm() * k.double().norm()
            assert a.numel() == 0 or a.double().abs().max() <= tol * bound, name
            continue
        # dQ = Σ p·(dP − delta)·K and dK = Σ p·(dP − delta)·Q sum terms whose weights add up to 0: where they
        # nearly cancel, rounding is a large share of the result. Two such errors are allowed for, never below the
        # table's bound: a few times PyTorch's own error in the inputs' dtype, and the error every FlashAttention
        # backward shares, delta = rowsum(dO ∘ O) taken from the output as stored (rounded to that dtype; the
        # output itself is held to the table's bound above).
        err = relative_error(a, b)
        bound = max(tol, 4 * relative_error(torch_own[i], b), tol + delta_share.get(name, 0.0))
        assert err < bound, f"{name}: relative error {err:.2e} over {bound:.1e}"


def _stored_output_delta_error(qkv64, out64, out, grad64, causal, scale, cu_seqlens, grads64) -> dict:
    """How far dQ and dK move (relative to float64's) when delta = rowsum(dO ∘ O) is taken from the output ``out``
    as stored, in the inputs' dtype, as every FlashAttention backward reads it: with Δ the change of delta, d(dQ) =
    −s·Δ·(P·K) and d(dK) = −s·Pᵀ·(Δ·Q), P the float64 probabilities."""
    q, k, v = (x.detach() for x in qkv64)
    group = q.shape[1] // k.shape[1]
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    k_rep = k.repeat_interleave(group, dim=1)
    allowed = document_mask(cu_seqlens, q.shape[2], causal).to(q.device)
    p = torch.softmax((q @ k_rep.transpose(-1, -2) * s).masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
    shift = (grad64 * (out.detach().double() - out64.detach())).sum(-1, keepdim=True)
    d_dq = -s * shift * (p @ k_rep)
    d_dk = (-s * p.transpose(-1, -2) @ (shift * q)).unflatten(1, (k.shape[1], group)).sum(2)
    return {name: (d.norm() / g.norm()).item() if g.norm() > 0 else 0.0
            for name, d, g in (("dq", d_dq, grads64[0]), ("dk", d_dk, grads64[1]))}


def _torch_in_dtype(leaves, views, causal, scale, cu_seqlens, grad):
    """PyTorch's attention (``attention_reference``) in the inputs' own dtype: its output and gradients."""
    own = [x.detach().clone().requires_grad_(True) for x in leaves]
    own_views = [o.as_strided(v.shape, v.stride(), v.storage_offset()) if x is not v else o
                 for x, o, v in zip(leaves, own, views)]
    out = attention_reference(*own_views, causal=causal, scale=scale, cu_seqlens=cu_seqlens)
    if out.numel() == 0:
        return [out, *own]
    return [out, *torch.autograd.grad(out, own, grad.to(out.dtype), allow_unused=True)]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seq", [1, 77, 130])
@pytest.mark.parametrize("heads,kv_heads", [(4, 1), (8, 2)])
def test_matches_float64(device, gen, heads, kv_heads, seq, causal):
    q, k, v = _inputs(gen, device, 1, heads, kv_heads, seq, 16, torch.float32)
    _check_against_float64(q, k, v, causal, gen=gen)


@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 64), (torch.float16, 32), (torch.float32, 128)])
def test_dtypes_and_head_dims(device, gen, dtype, head_dim):
    q, k, v = _inputs(gen, device, 2, 4, 2, 37, head_dim, dtype)
    _check_against_float64(q, k, v, True, gen=gen)


def test_scale_and_large_scores(device, gen):
    # A scale far from 1/sqrt(d) and scores in the hundreds (exp would overflow float32 past 88): the running maximum
    # must keep every exp in range. Rounding a score of ~300 to float32 already moves p by ~3e-5, so the gradients
    # are held to a few times PyTorch's own float32 error on the same inputs (the output keeps the float32 bound).
    q, k, v = _inputs(gen, device, 1, 2, 2, 50, 16, torch.float32)
    with torch.no_grad():
        q.mul_(8)
    out = flash_attention(q, k, v, causal=False, scale=2.5)
    grad = torch.randn(out.shape, generator=gen).to(device)
    ours = (out, *torch.autograd.grad(out, (q, k, v), grad))
    torch32 = attention_reference(q, k, v, causal=False, scale=2.5)
    torch32 = (torch32, *torch.autograd.grad(torch32, (q, k, v), grad))
    leaves64 = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
    ref = attention_reference(*leaves64, causal=False, scale=2.5)
    ref = (ref, *torch.autograd.grad(ref, leaves64, grad.double()))
    assert ours[0].abs().max() > 0 and relative_error(ours[0], ref[0]) < 1e-5
    for a, t, r in zip(ours, torch32, ref):
        assert relative_error(a, r) <= max(1e-5, 4 * relative_error(t, r))


@pytest.mark.parametrize("causal", [True, False])
def test_packed_documents(device, gen, causal):
    # Documents of 1, 39, 1, 49 and 40 tokens, blocks of the interpreter's 128 span several of them.
    cu = torch.tensor([0, 1, 40, 41, 90, 130], dtype=torch.int32, device=device)
    q, k, v = _inputs(gen, device, 1, 8, 2, 130, 16, torch.float32)
    _check_against_float64(q, k, v, causal, cu_seqlens=cu, gen=gen)


def test_packed_equals_documents_one_by_one(device, gen):
    # Each document's rows of the packed output and gradients are those of the document attended alone.
    lengths = [5, 1, 30, 1, 12]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q, k, v = _inputs(gen, device, 1, 4, 2, sum(lengths), 32, torch.float32)
    out = flash_attention(q, k, v, cu_seqlens=cu)
    grad = torch.randn(out.shape, generator=gen).to(device)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        part = [x.detach()[:, :, a:b].clone().requires_grad_(True) for x in (q, k, v)]
        alone = flash_attention(*part)
        grads = torch.autograd.grad(alone, part, grad[:, :, a:b])
        assert relative_error(out[:, :, a:b], alone) < 1e-6
        for name, whole, piece in zip(("dq", "dk", "dv"), (dq, dk, dv), grads):
            if b - a == 1 and name in ("dq", "dk"):
                # A softmax over one key is constant: dQ and dK are 0 up to the rounding of dP − delta, in both runs.
                assert whole[:, :, a:b].abs().max() < 1e-5 and piece.abs().max() < 1e-5
            else:
                assert relative_error(whole[:, :, a:b], piece) < 1e-6, name


def test_document_mask(device):
    cu = torch.tensor([0, 2, 3], dtype=torch.int32)
    expected = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)
    assert torch.equal(document_mask(cu, 3, causal=True), expected)
    start, end = segment_bounds(cu, 3)
    assert start.tolist() == [[0, 0, 2]] and end.tolist() == [[2, 2, 3]]
    positions = torch.tensor([[0, 1, 0, 0, 1, 2], [5, 6, 7, 8, 9, 10]])
    start, end = segment_bounds_from_positions(positions)
    assert start.tolist() == [[0, 0, 2, 3, 3, 3], [0] * 6] and end.tolist() == [[2, 2, 3, 6, 6, 6], [6] * 6]


@pytest.mark.parametrize("seq", [1, 255, 256, 257, 1000])
def test_running_max_is_cummax_across_chunks(gen, seq):
    # The two-level scan behind segment_bounds_from_positions: rows of one, of a chunk, and across several chunks
    # (with a partial last one), on values that rise and fall, and negative ones (the end's running minimum).
    x = torch.randint(-10**6, 10**6, (3, seq), generator=gen)
    assert torch.equal(running_max(x), x.cummax(dim=1).values)
    y = torch.randn(2, seq, generator=gen)  # any dtype cummax takes
    assert torch.equal(running_max(y), y.cummax(dim=1).values)
    for empty in (torch.zeros(0, seq, dtype=torch.long), torch.zeros(3, 0, dtype=torch.long)):
        assert running_max(empty).shape == empty.shape
    with pytest.raises(ValueError, match="batch, seq"):
        running_max(x[0])
    positions = torch.cat([torch.arange(300), torch.arange(1), torch.arange(seq)])[None]
    start, end = segment_bounds_from_positions(positions)
    first = torch.tensor([0] * 300 + [300] + [301] * seq)
    assert start.tolist() == [first.tolist()]
    assert end.tolist() == [[300] * 300 + [301] + [301 + seq] * seq]


@given(batch=st.integers(0, 3), seq=st.integers(0, 600),
       dtype=st.sampled_from([torch.int64, torch.int32, torch.float32]), transposed=st.booleans())
def test_running_max_any_shape_dtype_layout(batch, seq, dtype, transposed):
    # Any row count and length (empty ones, one chunk, several and a partial one), integer and float values, and a
    # transposed view as well as a dense tensor: always cummax's answer.
    values = torch.randn(seq, batch) * 1000
    x = values.to(dtype).t() if transposed else values.t().contiguous().to(dtype)
    assert torch.equal(running_max(x), x.cummax(dim=1).values)


def test_position_ids_with_no_rows(device):
    # batch 0 with position ids: an empty output and empty gradients, as with dense rows
    q = torch.randn(0, 2, 10, 16, device=device, requires_grad=True)
    k = torch.randn(0, 1, 10, 16, device=device)
    out = flash_attention(q, k, k, position_ids=torch.arange(10, device=device)[None])
    out.sum().backward()
    assert out.shape == q.shape and q.grad.shape == q.shape


def test_position_ids_pack_each_row(device, gen):
    # Two rows, each packed differently by restarting positions; the same as cu_seqlens row by row.
    q, k, v = _inputs(gen, device, 2, 4, 2, 30, 16, torch.float32)
    positions = torch.cat([torch.arange(10), torch.arange(1), torch.arange(19)]).expand(2, 30).clone()
    positions[1] = torch.cat([torch.arange(25), torch.arange(5)])
    out = flash_attention(q, k, v, position_ids=positions.to(device))
    for row, cu in ((0, [0, 10, 11, 30]), (1, [0, 25, 30])):
        cu = torch.tensor(cu, dtype=torch.int32, device=device)
        ref = attention_reference(*(x.detach()[row:row + 1].double() for x in (q, k, v)), cu_seqlens=cu)
        assert relative_error(out[row:row + 1], ref) < 1e-5


def test_matches_sdpa(device, gen):
    q, k, v = _inputs(gen, device, 2, 6, 3, 45, 32, torch.float32)
    ours = flash_attention(q, k, v, causal=True)
    theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert relative_error(ours, theirs) < 1e-5


def test_llama_layout_is_read_in_place(device, gen):
    # Llama's q, k and v are [batch, heads, seq, d] views of [batch, seq, heads, d] projections.
    b, s, h, hk, d = 2, 33, 4, 2, 16
    q = torch.randn(b, s, h, d, generator=gen).to(device).transpose(1, 2).requires_grad_(True)
    k = torch.randn(b, s, hk, d, generator=gen).to(device).transpose(1, 2).requires_grad_(True)
    v = torch.randn(b, s, hk, d, generator=gen).to(device).transpose(1, 2).requires_grad_(True)
    _check_against_float64(q, k, v, True, gen=gen)
    out = flash_attention(q, k, v)
    assert out.transpose(1, 2).is_contiguous()  # Hugging Face transposes it back: no copy


@given(data=st.data())
def test_any_shape_dtype_layout(data):
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    dtype = data.draw(strategies.kernel_dtypes())
    kv_heads = data.draw(st.integers(1, 2))
    heads = kv_heads * data.draw(st.sampled_from([1, 2, 3]))
    batch = data.draw(st.integers(0, 2))
    seq = data.draw(strategies.sizes(40))
    head_dim = data.draw(st.sampled_from([16, 32]))
    causal = data.draw(st.booleans())
    # A scale below float32's range (1e-64) gives gradients float32 cannot hold: 0 is then the right answer, and a
    # relative error against float64 means nothing. Zero and negative scales are fair inputs.
    scale = data.draw(st.one_of(st.none(), st.just(0.0), st.floats(-1.0, -0.01), st.floats(0.01, 1.0)))
    cu_seqlens = None
    if batch == 1 and data.draw(st.booleans()):  # documents packed along the row, some of them empty or of one token
        cuts = sorted(data.draw(st.lists(st.integers(0, seq), max_size=4)))
        cu_seqlens = torch.tensor([0, *cuts, seq], dtype=torch.int32, device=runtime.device())
    leaves, views = [], []
    for h in (heads, kv_heads, kv_heads):
        values = torch.randn(batch, h, seq, head_dim, generator=gen).to(runtime.device(), dtype)
        leaf, view = strategies.shaped_leaf(values, data.draw(strategies.layouts()))
        leaves.append(leaf)
        views.append(view)
    _check_against_float64(*views, causal, scale=scale, cu_seqlens=cu_seqlens, gen=gen, leaves=leaves)


def _good(device, **kw):
    shape = dict(batch=1, heads=4, kv_heads=2, seq=8, head_dim=16)
    shape.update(kw)
    q = torch.randn(shape["batch"], shape["heads"], shape["seq"], shape["head_dim"], device=device)
    k = torch.randn(shape["batch"], shape["kv_heads"], shape["seq"], shape["head_dim"], device=device)
    return q, k, k.clone()


def test_errors(device):
    q, k, v = _good(device)
    with pytest.raises(TypeError, match="q has dtype torch.float64.*cast it to float32"):
        flash_attention(q.double(), k, v)
    with pytest.raises(TypeError, match="k has dtype torch.int64"):
        flash_attention(q, k.long(), v)
    with pytest.raises(TypeError, match="one dtype"):
        flash_attention(q, k.half(), v)
    with pytest.raises(ValueError, match="4-D"):
        flash_attention(q[0], k, v)
    with pytest.raises(ValueError, match="multiple of k's and v's heads"):
        flash_attention(*_good(device, heads=3))
    with pytest.raises(ValueError, match="head_dim must be one of"):
        flash_attention(*_good(device, head_dim=48))
    with pytest.raises(ValueError, match="one sequence length"):
        flash_attention(q, k[:, :, :5], v[:, :, :5])
    with pytest.raises(ValueError, match="scale must be finite"):
        flash_attention(q, k, v, scale=math.nan)
    with pytest.raises(TypeError, match="scale must be a real number"):
        flash_attention(q, k, v, scale="0.5")
    with pytest.raises(TypeError, match="causal must be a bool"):
        flash_attention(q, k, v, causal=None)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="batch must be 1, got 2"):
        flash_attention(*_good(device, batch=2), cu_seqlens=cu)
    with pytest.raises(TypeError, match="int32"):
        flash_attention(q, k, v, cu_seqlens=cu.long())
    with pytest.raises(ValueError, match="rise from 0 to seq=8"):
        flash_attention(q, k, v, cu_seqlens=torch.tensor([0, 3, 7], dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="rise from 0 to seq=8"):
        flash_attention(q, k, v, cu_seqlens=torch.tensor([0, 5, 3, 8], dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="not both"):
        flash_attention(q, k, v, cu_seqlens=cu, position_ids=torch.arange(8, device=device)[None])
    with pytest.raises(TypeError, match="position_ids must be an integer tensor"):
        flash_attention(q, k, v, position_ids=torch.zeros(1, 8, device=device))
    with pytest.raises(TypeError, match=r"position_ids must be an integer tensor \[batch, seq\], got torch.bool"):
        flash_attention(q, k, v, position_ids=torch.ones(1, 8, dtype=torch.bool, device=device))
    with pytest.raises(ValueError, match="position_ids must be"):
        flash_attention(q, k, v, position_ids=torch.arange(7, device=device)[None])


def test_config_from_one_function():
    gpu = runtime.DeviceProps("H200", False, 132, 232448, 65536)
    cfg = attention_config(16384, 128, gpu)
    assert (cfg.forward.block_m, cfg.forward.block_n, cfg.forward.num_warps, cfg.forward.num_stages) == (128, 128, 8, 3)
    assert cfg.dkdv.block_m * cfg.dkdv.block_n <= cfg.forward.block_m * cfg.forward.block_n
    tiny = attention_config(77, 16, runtime.INTERPRETER)
    assert tiny.forward.block_m == 128  # one program per (batch, head) at the chapter's sizes


@pytest.mark.parametrize("dkdv_blocks", [(16, 32), (32, 16)], ids=lambda b: f"dkdv{b[0]}x{b[1]}")
@pytest.mark.parametrize("causal,packed", [(True, False), (False, False), (True, True)])
def test_small_blocks_walk_masked_and_unmasked_blocks(device, gen, causal, packed, dkdv_blocks):
    # GPU-sized walks in the interpreter: blocks of 32 queries and 16 keys over 77 tokens, so that the key blocks
    # before a query block's diagonal (or all full blocks, not causal) run without the mask, and the rest with it.
    # The dK/dV walk likewise, over query blocks past a key block's diagonal, with fewer or more rows than keys.
    blocks = BlockConfig(32, 16, 4, 1)
    cfg = Config(blocks, BlockConfig(*dkdv_blocks, 4, 1), blocks, 32)
    _launches_against_float64(gen, device, cfg, causal, 77, [0, 1, 30, 77] if packed else None)


def _launches_against_float64(gen, device, cfg, causal, seq, bounds):
    """The kernels launched with ``cfg`` (document ``bounds`` packed along one row, or two rows without), forward and
    backward, against float64."""
    q, k, v = (x.detach() for x in _inputs(gen, device, 1 if bounds else 2, 4, 2, seq, 16, torch.float32))
    cu = torch.tensor(bounds, dtype=torch.int32) if bounds else None
    seg = segment_bounds(cu.to(device), seq) if bounds else (None, None)
    out, lse = attention_forward(q, k, v, causal, 0.25, *seg, config=cfg)
    grad = torch.randn(out.shape, generator=gen).to(device)
    dq, dk, dv = attention_backward(grad, q, k, v, out, lse, causal, 0.25, *seg, config=cfg)
    leaves = [x.double().requires_grad_(True) for x in (q, k, v)]
    ref = attention_reference(*leaves, causal=causal, scale=0.25, cu_seqlens=cu)
    ref_grads = torch.autograd.grad(ref, leaves, grad.double())
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), (ref, *ref_grads)):
        assert relative_error(a, b) < 1e-5, name


def test_opcheck(device, gen):
    q, k, v = (x.detach() for x in _inputs(gen, device, 1, 4, 2, 20, 16, torch.float32))
    cu = torch.tensor([0, 1, 12, 20], dtype=torch.int32, device=device)
    seg_start, seg_end = segment_bounds(cu, 20)
    for seg in ((None, None), (seg_start, seg_end)):
        torch.library.opcheck(flash_attention_fwd, (q, k, v, True, 0.25, *seg))
        out, lse = flash_attention_fwd(q, k, v, True, 0.25, *seg)
        grad = torch.randn(out.shape, generator=gen).to(device)
        torch.library.opcheck(flash_attention_bwd, (grad, q, k, v, out, lse, True, 0.25, *seg))


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiles_without_graph_break(device, gen):
    q, k, v = _inputs(gen, device, 1, 4, 2, 24, 16, torch.float32)
    cu = torch.tensor([0, 10, 24], dtype=torch.int32, device=device)

    def step(q, k, v):
        return (flash_attention(q, k, v, cu_seqlens=cu) ** 2).sum()

    compiled = torch.compile(step, backend=runtime.COMPILE_BACKEND, fullgraph=True)
    loss = compiled(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    eager = step(q, k, v)
    eager_grads = torch.autograd.grad(eager, (q, k, v))
    assert relative_error(loss, eager) < 1e-6
    for a, b in zip(grads, eager_grads):
        assert relative_error(a, b) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("seq", [1, 200, 1000, 2049])
def test_gpu_llama_shapes(gen, seq):
    # The 8B shape on a GPU: 32 q heads, 8 KV heads, head_dim 128, bf16; poisoned outputs are fully written.
    q, k, v = _inputs(gen, "cuda", 1, 32, 8, seq, 128, torch.bfloat16)
    _check_against_float64(q, k, v, True, gen=gen)
    cu = torch.tensor(sorted({0, 1, seq // 3, seq}), dtype=torch.int32, device="cuda")  # a one-token document first
    _check_against_float64(q, k, v, True, cu_seqlens=cu, gen=gen)


@pytest.mark.gpu
@pytest.mark.parametrize("interior", [False, True])
def test_gpu_tiles_too_big_for_shared_memory_shrink_and_the_interior_walk(gen, monkeypatch, interior):
    # On the GPU: tiles no Hopper block can hold (128 × 128 with 4 pipeline stages: four copies of the loaded
    # tiles, over 250 KB in each kernel) are refused at launch and the launch takes smaller ones, with the same
    # answer: dense rows, and packed rows with the interior walk on. bf16: each refused tile compiles before the
    # refusal; float32 tiles of this size, and bf16 ones with 8 stages, took minutes to compile on an H200.
    too_big = BlockConfig(128, 128, 8, 4)
    config = Config(too_big, too_big, too_big, 64, interior)
    monkeypatch.setattr(attention_module, "attention_config", lambda *args, **kwargs: config)
    q, k, v = _inputs(gen, "cuda", 1, 4, 2, 300, 128, torch.bfloat16)
    cu = torch.tensor([0, 1, 140, 300], dtype=torch.int32, device="cuda") if interior else None
    _check_against_float64(q, k, v, True, cu_seqlens=cu, gen=gen)
    fitted = [tile for key, tile in attention_module._FITTED.items() if key[1] == too_big]
    assert fitted and all(tile != too_big for tile in fitted)


@pytest.mark.gpu
def test_gpu_packed_interior_walk_at_the_8b_shape(gen, monkeypatch):
    # The interior walk with the configured tiles at the 8B attention shape, bf16, documents of 1,024 tokens and a
    # ragged tail: the same answer as float64 within the table's bound.
    monkeypatch.setattr(attention_module, "PACKED_INTERIOR", True)
    q, k, v = _inputs(gen, "cuda", 1, 32, 8, 3000, 128, torch.bfloat16)
    cu = torch.tensor([0, 1024, 2048, 2049, 3000], dtype=torch.int32, device="cuda")
    _check_against_float64(q, k, v, True, cu_seqlens=cu, gen=gen)


def test_shrinking_tiles_get_smaller_and_keep_the_query_walk_whole():
    first = BlockConfig(128, 128, 8, 3)
    tiles = list(shrinking(first, divisible=True))
    assert tiles[0] == first and tiles[-1] == BlockConfig(16, 16, 4, 1)
    sizes = [t.block_m * t.block_n * t.num_stages for t in tiles]
    assert all(a > b for a, b in zip(sizes, sizes[1:]))
    assert all(t.block_m % t.block_n == 0 for t in tiles)
    assert any(t.block_m % t.block_n for t in shrinking(BlockConfig(32, 128, 4, 3), divisible=False))


class _TooBigOver:
    """A stand-in for a Triton kernel that refuses tiles over ``limit`` elements, as a GPU refuses a launch whose
    tile needs more shared memory than a block may have."""

    def __init__(self, limit):
        self.limit, self.launched = limit, []
        self.fn = self._too_big_over

    def _too_big_over(self):
        pass

    def __getitem__(self, grid):
        def call(*args, BLOCK_M, BLOCK_N, num_warps, num_stages, **meta):
            need = BLOCK_M * BLOCK_N * num_stages
            if need > self.limit:
                raise attention_module.OutOfResources(need, self.limit, "shared memory")
            self.launched.append((grid, BLOCK_M, BLOCK_N, num_stages))
        return call


def test_a_tile_too_big_for_the_gpu_falls_back_and_an_explicit_one_raises():
    kernel = _TooBigOver(limit=128 * 64 * 2)
    key = ("test", object())  # a key of its own: nothing remembered from another launch
    attention_module._launch(kernel, lambda c: (c.block_m,), BlockConfig(128, 128, 8, 3), True, True, key)
    assert kernel.launched == [((128,), 128, 64, 2)]
    attention_module._launch(kernel, lambda c: (c.block_m,), BlockConfig(128, 128, 8, 3), True, True, key)
    assert kernel.launched[-1] == ((128,), 128, 64, 2) and len(kernel.launched) == 2  # remembered: no retries
    with pytest.raises(attention_module.OutOfResources):
        attention_module._launch(kernel, lambda c: (c.block_m,), BlockConfig(128, 128, 8, 3), False, True, key)
    with pytest.raises(RuntimeError, match="no tile down to 16"):
        attention_module._launch(_TooBigOver(limit=1), lambda c: (1,), BlockConfig(64, 64, 4, 2), True, True, key)


def test_float32_inputs_get_smaller_tiles_than_bf16():
    gpu = runtime.DeviceProps("a Hopper-like GPU", False, 132, 227 << 10, 64 << 10)
    wide, narrow = attention_config(4096, 128, gpu, 2), attention_config(4096, 128, gpu, 4)
    for a, b in ((wide.forward, narrow.forward), (wide.dkdv, narrow.dkdv), (wide.dq, narrow.dq)):
        assert b.block_m * b.block_n <= a.block_m * a.block_n
    assert narrow.forward.block_m * narrow.forward.block_n < wide.forward.block_m * wide.forward.block_n


@pytest.mark.parametrize("dkdv_blocks", [(16, 32), (32, 16)], ids=lambda b: f"dkdv{b[0]}x{b[1]}")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("bounds", [[0, 1, 40, 41, 90, 130], [0, 32, 96, 130], [0, 130]],
                         ids=["short-and-odd", "block-aligned", "one-document"])
def test_packed_interior_blocks_walk_without_the_mask(device, gen, causal, dkdv_blocks, bounds):
    # Packed rows with the interior walk on (Config.interior): the key blocks wholly inside a query block's document,
    # and the query blocks wholly inside a key block's, run unmasked; documents of 1 token, documents that start and
    # end inside a block and on a block's edge, and one document across the whole row. Same answer as float64.
    blocks = BlockConfig(32, 16, 4, 1)
    cfg = Config(blocks, BlockConfig(*dkdv_blocks, 4, 1), blocks, 32, interior=True)
    _launches_against_float64(gen, device, cfg, causal, 130, bounds)


def test_packed_rows_take_their_own_forward_tiles():
    # Measured on an H200 with 1,024-token documents: the forward of packed rows at 64 × 64, 4 warps, 2 stages; the
    # dense rows' tiles and both backward kernels' unchanged.
    gpu = runtime.DeviceProps("a Hopper-like GPU", False, 132, 227 << 10, 64 << 10)
    dense, packed = attention_config(8192, 128, gpu), attention_config(8192, 128, gpu, packed=True)
    assert dense.forward == BlockConfig(128, 128, 8, 3) and packed.forward == BlockConfig(64, 64, 4, 2)
    assert (dense.dkdv, dense.dq) == (packed.dkdv, packed.dq)
    assert attention_config(8192, 128, gpu, 4, packed=True) == attention_config(8192, 128, gpu, 4)


def test_the_interior_walk_is_on_by_default_and_follows_the_switch(monkeypatch):
    gpu = runtime.DeviceProps("a Hopper-like GPU", False, 132, 227 << 10, 64 << 10)
    assert attention_config(4096, 128, gpu).interior and attention_config(77, 16, runtime.INTERPRETER).interior
    monkeypatch.setattr(attention_module, "PACKED_INTERIOR", False)
    assert not attention_config(4096, 128, gpu).interior and not attention_config(77, 16, runtime.INTERPRETER).interior
