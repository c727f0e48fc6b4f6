"""RoPE: q_embed, k_embed, dq, dk against float64; Llama's strided q/k, GQA, odd sizes, dtypes as HF, bad input."""

import re

import pytest
import torch

from kernels import rope as rope_module
from kernels.reference import relative_error, rotary_cos_sin, rotary_reference
from kernels.rope import apply_rotary
from kernels.tolerances import RELATIVE_ERROR_TOL as TOL


def llama_qk(batch, seq, q_heads, kv_heads, head_dim, dtype, device, gen):
    """q and k as Llama's attention makes them: proj(x).view(b, s, h, D).transpose(1, 2), strided views."""
    q = torch.randn(batch, seq, q_heads * head_dim, generator=gen).to(device, dtype)
    k = torch.randn(batch, seq, kv_heads * head_dim, generator=gen).to(device, dtype)
    return (q.view(batch, seq, q_heads, head_dim).transpose(1, 2),
            k.view(batch, seq, kv_heads, head_dim).transpose(1, 2))


def random_positions(batch, seq, gen, device):
    # Positions that are not 0..seq-1 (packed sequences, offsets): large angles, both signs of cos and sin.
    return torch.randint(0, 4096, (batch, seq), generator=gen).to(device)


def errors_against_float64(q, k, cos, sin, gen):
    """Relative errors of q_embed, k_embed, dq and dk (the kernel on the given views) against float64."""
    qk, kk = q.detach().requires_grad_(), k.detach().requires_grad_()  # detach keeps the strides
    q_embed, k_embed = apply_rotary(qk, kk, cos, sin)
    dq_out = torch.randn(q_embed.shape, generator=gen).to(q_embed.device, q_embed.dtype)
    dk_out = torch.randn(k_embed.shape, generator=gen).to(k_embed.device, k_embed.dtype)
    torch.autograd.backward([q_embed, k_embed], [dq_out, dk_out])
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    ref_q, ref_k = rotary_reference(q64, k64, cos.double(), sin.double())
    torch.autograd.backward([ref_q, ref_k], [dq_out.double(), dk_out.double()])
    assert q_embed.dtype == k_embed.dtype == torch.promote_types(q.dtype, cos.dtype)
    assert qk.grad.dtype == q.dtype and kk.grad.dtype == k.dtype
    return [relative_error(a, b) for a, b in ((q_embed, ref_q), (k_embed, ref_k), (qk.grad, q64.grad),
                                               (kk.grad, k64.grad))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "batch, seq, q_heads, kv_heads, head_dim",
    [(2, 7, 8, 2, 64), (1, 1, 4, 4, 32), (3, 5, 6, 3, 20), (2, 9, 2, 1, 6)],
    ids=["gqa-8-2", "single-row", "odd-half-10", "tiny-head-6"],
)
def test_matches_float64_reference(batch, seq, q_heads, kv_heads, head_dim, dtype, device, gen):
    q, k = llama_qk(batch, seq, q_heads, kv_heads, head_dim, dtype, device, gen)
    cos, sin = rotary_cos_sin(batch, seq, head_dim, dtype=dtype, device=device,
                              positions=random_positions(batch, seq, gen, device))
    errors = errors_against_float64(q, k, cos, sin, gen)
    assert all(e < TOL[dtype] for e in errors), f"relative errors q, k, dq, dk = {errors}"


def test_general_cos_sin_halves_differ(device, gen):
    # The kernel uses both halves of cos and sin as given, not only Llama's cat((f, f)).
    q, k = llama_qk(2, 5, 4, 2, 16, torch.float32, device, gen)
    cos, sin = (torch.randn(2, 5, 16, generator=gen).to(device) for _ in range(2))
    errors = errors_against_float64(q, k, cos, sin, gen)
    assert all(e < TOL[torch.float32] for e in errors), errors


def test_contiguous_and_other_layouts(device, gen):
    cos, sin = rotary_cos_sin(2, 6, 32, device=device, positions=random_positions(2, 6, gen, device))
    q = torch.randn(2, 4, 6, 32, generator=gen).to(device)  # contiguous [b, h, s, D]
    k = torch.randn(2, 6, 32, 2, generator=gen).to(device).permute(0, 3, 1, 2)  # last dim strided: copied
    errors = errors_against_float64(q, k, cos, sin, gen)
    assert all(e < TOL[torch.float32] for e in errors), errors
    cos_b1, sin_b1 = cos[:1], sin[:1]  # one batch of positions broadcast to all
    errors = errors_against_float64(q, k.contiguous(), cos_b1, sin_b1, gen)
    assert all(e < TOL[torch.float32] for e in errors), errors


def test_output_keeps_llamas_memory_layout(device, gen):
    q, k = llama_qk(2, 5, 4, 2, 16, torch.float32, device, gen)
    cos, sin = rotary_cos_sin(2, 5, 16, device=device)
    q_embed, k_embed = apply_rotary(q, k, cos, sin)
    assert q_embed.stride() == q.stride() and k_embed.stride() == k.stride()


@pytest.mark.parametrize("q_dtype, trig_dtype", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                 (torch.float32, torch.bfloat16)])
def test_dtypes_follow_hugging_face(q_dtype, trig_dtype, device, gen):
    hf = pytest.importorskip("transformers.models.llama.modeling_llama")
    q, k = llama_qk(2, 5, 4, 2, 16, q_dtype, device, gen)
    cos, sin = rotary_cos_sin(2, 5, 16, dtype=trig_dtype, device=device,
                              positions=random_positions(2, 5, gen, device))
    ours = apply_rotary(q, k, cos, sin)
    theirs = hf.apply_rotary_pos_emb(q, k, cos, sin)
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype and a.shape == b.shape
        # HF rounds each product to bf16 before the sum; ours rounds once: equal up to bf16 rounding.
        assert relative_error(a, b) < TOL[torch.bfloat16]
    errors = errors_against_float64(q, k, cos, sin, gen)
    assert all(e < TOL[torch.bfloat16] for e in errors), errors


def test_unsqueeze_dim_2_takes_batch_seq_heads(device, gen):
    q, k = llama_qk(2, 5, 4, 2, 16, torch.float32, device, gen)
    cos, sin = rotary_cos_sin(2, 5, 16, device=device, positions=random_positions(2, 5, gen, device))
    q_bshd, k_bshd = q.transpose(1, 2), k.transpose(1, 2)
    ours = apply_rotary(q_bshd, k_bshd, cos, sin, unsqueeze_dim=2)
    ref = rotary_reference(q_bshd.double(), k_bshd.double(), cos.double(), sin.double(), unsqueeze_dim=2)
    assert all(relative_error(a, b) < TOL[torch.float32] for a, b in zip(ours, ref))


def test_cos_sin_gradients_when_asked(device, gen):
    q, k = llama_qk(2, 4, 4, 2, 8, torch.float32, device, gen)
    cos, sin = (torch.randn(1, 4, 8, generator=gen).to(device).requires_grad_() for _ in range(2))
    q_embed, k_embed = apply_rotary(q, k, cos, sin)
    (q_embed.square().sum() + 3 * k_embed.sum()).backward()
    c64, s64 = cos.detach().double().requires_grad_(), sin.detach().double().requires_grad_()
    a, b = rotary_reference(q.double(), k.double(), c64, s64)
    (a.square().sum() + 3 * b.sum()).backward()
    assert relative_error(cos.grad, c64.grad) < TOL[torch.float32]
    assert relative_error(sin.grad, s64.grad) < TOL[torch.float32]


def test_only_q_reaches_the_loss(device, gen):
    q, k = llama_qk(1, 3, 2, 1, 8, torch.float32, device, gen)
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    cos, sin = rotary_cos_sin(1, 3, 8, device=device)
    q_embed, _ = apply_rotary(q, k, cos, sin)
    q_embed.sum().backward()
    assert torch.count_nonzero(k.grad) == 0 and torch.count_nonzero(q.grad) > 0


def test_a_loop_of_several_head_steps_gives_the_same_bits(device, gen):
    # A GPU takes at most 2,048 values per half-tile in one step, so 64 heads of 128 take two steps; here 5 q heads
    # in steps of 2 (the last step half masked) and 3 kv heads in steps of 2, forward and backward, against one step.
    q, k = llama_qk(2, 7, 5, 3, 16, torch.float32, device, gen)
    cos, sin = rotary_cos_sin(2, 7, 16, device=device, positions=random_positions(2, 7, gen, device))
    steps = rope_module.Config((14,), 1, 8, 4, q_heads=2, k_heads=2)
    assert all(torch.equal(a, b) for a, b in zip(rope_module.rope_forward(q, k, cos, sin, steps),
                                                 rope_module.rope_forward(q, k, cos, sin)))
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    assert all(torch.equal(a, b) for a, b in zip(
        rope_module.rope_backward(dq, dk, cos, sin, q.dtype, True, steps),
        rope_module.rope_backward(dq, dk, cos, sin, q.dtype, True)))


def _layout(kind, batch, seq, heads, d, device, gen):
    x = torch.randn(batch, seq, heads, d, generator=gen).to(device)
    if kind == "seq-major":  # Llama's q and k
        return x.transpose(1, 2)
    if kind == "contiguous":  # attention's gradients
        return x.transpose(1, 2).contiguous()
    return torch.randn(batch, heads, seq, 2 * d, generator=gen).to(device)[..., ::2]  # strided rows: neither


@pytest.mark.parametrize("x_kind", ["seq-major", "contiguous"])
@pytest.mark.parametrize("out_kind", ["seq-major", "contiguous"])
@pytest.mark.parametrize("trig_batch", [1, 3])
@pytest.mark.parametrize("backward", [False, True])
def test_dense_kernel_gives_the_strided_kernels_bits(x_kind, out_kind, trig_batch, backward, device, gen):
    # The dense kernel derives every stride from the shape and three flags; the strided one is told them.
    batch, seq, d = 3, 5, 16
    q, k = _layout(x_kind, batch, seq, 4, d, device, gen), _layout(x_kind, batch, seq, 2, d, device, gen)
    cos, sin = rotary_cos_sin(trig_batch, seq, d, device=device, positions=random_positions(trig_batch, seq, gen,
                                                                                            device))
    outs = {}
    for strided in (False, True):
        q_out = _layout(out_kind, batch, seq, 4, d, device, gen).fill_(float("nan"))
        k_out = _layout(out_kind, batch, seq, 2, d, device, gen).fill_(float("nan"))
        rope_module.launch(q, k, cos, sin, q_out, k_out, backward, None, strided=strided)
        outs[strided] = (q_out, k_out)
    assert rope_module._dense_flags(q, k, cos, sin, *outs[False]) == (
        x_kind == "seq-major", out_kind == "seq-major", trig_batch > 1)
    assert all(torch.isfinite(t).all() for t in outs[False])
    assert all(torch.equal(a, b) for a, b in zip(outs[False], outs[True]))
    steps = rope_module.Config((batch * seq,), 1, 8, 4, q_heads=2, k_heads=1)  # a loop over heads, dense kernel
    q_out, k_out = (torch.full_like(t, float("nan")) for t in outs[False])
    rope_module.launch(q, k, cos, sin, q_out, k_out, backward, steps)
    assert torch.equal(q_out, outs[True][0]) and torch.equal(k_out, outs[True][1])


def test_other_layouts_take_the_strided_kernel(device, gen):
    q, k = _layout("seq-major", 2, 5, 4, 8, device, gen), _layout("seq-major", 2, 5, 2, 8, device, gen)
    cos, sin = rotary_cos_sin(2, 5, 8, device=device)
    out = torch.empty_like(q), torch.empty_like(k)
    assert rope_module._dense_flags(q, k, cos, sin, *out) == (True, True, True)
    assert rope_module._dense_flags(_layout("strided", 2, 5, 4, 8, device, gen), k, cos, sin, *out) is None
    assert rope_module._dense_flags(q, k.contiguous(), cos, sin, *out) is None  # q and k in different orders
    wide = torch.randn(2, 5, 16, device=device)
    assert rope_module._dense_flags(q, k, wide[..., :8], sin, *out) is None  # cos rows 16 apart
    q_embed, k_embed = apply_rotary(*(t.requires_grad_() for t in (q, k)), wide[..., :8], sin)
    ref = rotary_reference(q.detach().double(), k.detach().double(), wide[..., :8].double(), sin.double())
    assert relative_error(q_embed, ref[0]) < TOL[torch.float32] and relative_error(k_embed, ref[1]) < TOL[torch.float32]


def test_launch_config_for_a_gpu_gives_every_sm_work():
    h100 = rope_module.runtime.DeviceProps("H100", False, 132, 227 * 1024, 65536)
    cfg = rope_module.rope_config(2048, 128, 32, 8, h100)
    assert cfg.block_h == 64 and cfg.grid[0] >= 4 * 132 // 2
    # Llama's 32 q heads in one step of a [32, 1, 64] tile, its 8 kv heads in one of 8: no masked-off heads, and
    # eight warps for the kernel that issues both tensors' loads before its stores.
    assert (cfg.rows, cfg.q_heads, cfg.k_heads, cfg.num_warps) == (1, 32, 8, 8)
    odd = rope_module.rope_config(2048, 128, 28, 4, h100)  # Qwen2-7B's heads: padded to a power of two
    assert (odd.q_heads, odd.k_heads) == (32, 4)
    big = rope_module.rope_config(16 * 8192, 256, 64, 8, h100)
    assert big.rows * big.q_heads * big.block_h == 2048 and big.k_heads == 8 and big.num_warps == 4  # a loop
    assert rope_module.rope_config(4096, 128, 32, 8, rope_module.runtime.INTERPRETER).grid[0] < 1000


def _qkcs(device, q_shape=(2, 4, 5, 8), k_shape=(2, 2, 5, 8), cs_shape=(2, 5, 8), dtype=torch.float32):
    return (torch.randn(q_shape, device=device, dtype=dtype), torch.randn(k_shape, device=device, dtype=dtype),
            torch.randn(cs_shape, device=device), torch.randn(cs_shape, device=device))


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda d: _qkcs(d, (2, 4, 5, 7), (2, 2, 5, 7), (2, 5, 7)), ValueError, "head_dim must be even"),
        (lambda d: _qkcs(d, k_shape=(2, 2, 6, 8)), ValueError, "k must be [batch=2, kv_heads, seq=5, head_dim=8]"),
        (lambda d: _qkcs(d, cs_shape=(2, 5, 4)), ValueError, "cos must be [batch=2 (or 1), seq=5, head_dim=8]"),
        (lambda d: _qkcs(d, (4, 5, 8), (2, 5, 8)), ValueError, "q and k must be 4-D"),
        (lambda d: (*_qkcs(d)[:3], torch.randn(2, 5, 8, device=d).bfloat16()), TypeError,
         "cos torch.float32 and sin torch.bfloat16"),
        (lambda d: (_qkcs(d)[0], _qkcs(d)[1].bfloat16(), *_qkcs(d)[2:]), TypeError, "q torch.float32 and k torch.bf"),
        (lambda d: (_qkcs(d)[0].int(), *_qkcs(d)[1:]), TypeError, "q must be a floating-point tensor"),
        (lambda d: (*_qkcs(d)[:3], torch.randn(2, 5, 8, device="meta")), ValueError, "on one device"),
    ],
    ids=["odd-head-dim", "k-seq", "cos-width", "3d", "sin-dtype", "k-dtype", "int", "device"],
)
def test_bad_input_is_refused_clearly(make, error, message, device):
    with pytest.raises(error, match=re.escape(message)):
        apply_rotary(*make(device))
    with pytest.raises(ValueError, match="unsqueeze_dim must be 1"):
        apply_rotary(*_qkcs(device), unsqueeze_dim=0)


@pytest.mark.gpu
def test_gpu_llama_8b_shape_bf16_every_element_written(gen):
    q, k = llama_qk(1, 2048, 32, 8, 128, torch.bfloat16, "cuda", gen)
    cos, sin = rotary_cos_sin(1, 2048, 128, dtype=torch.bfloat16, device="cuda")
    q_out, k_out = torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))
    rope_module.launch(q, k, cos, sin, q_out, k_out, False, None)
    assert torch.isfinite(q_out).all() and torch.isfinite(k_out).all()
    errors = errors_against_float64(q, k, cos, sin, gen)
    assert all(e < TOL[torch.bfloat16] for e in errors), errors


def test_gradients_come_back_in_the_layout_of_q_and_k(device, gen):
    """Llama's q and k are transposed views of [batch, seq, heads, D] projections: their gradients are made in that
    memory order, so they flow back through the view to the projection without a copy."""
    b, t, hq, hk, d = 2, 5, 4, 2, 8
    q_base = torch.randn(b, t, hq, d, generator=gen).to(device).requires_grad_()
    k_base = torch.randn(b, t, hk, d, generator=gen).to(device).requires_grad_()
    q, k = q_base.transpose(1, 2), k_base.transpose(1, 2)
    seen = []
    q.register_hook(lambda g: seen.append(("q", g)))
    k.register_hook(lambda g: seen.append(("k", g)))
    cos, sin = rotary_cos_sin(b, t, d, device=device)
    q_embed, k_embed = apply_rotary(q, k, cos, sin)
    (q_embed.square().sum() + k_embed.sum()).backward()
    assert {name for name, _ in seen} == {"q", "k"}
    for name, grad in seen:
        assert grad.transpose(1, 2).is_contiguous(), f"d{name} has strides {grad.stride()}"
    # A contiguous [batch, heads, seq, D] input keeps the gradient's own layout.
    dq, dk = rope_module.rope_backward(torch.randn(b, hq, t, d, generator=gen).to(device),
                                       torch.randn(b, hk, t, d, generator=gen).to(device), cos, sin, torch.float32)
    assert dq.is_contiguous() and dk.is_contiguous()
