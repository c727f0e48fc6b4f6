"""apply_rotary at its edges: every layout of q, k, cos and sin, sizes with 0 and 1, mixed and refused dtypes, meta.

Outputs and every gradient (q, k, and cos and sin when they require one) are compared with Hugging Face's formula
in float64 (``kernels.reference.rotary_reference``) through ``kernels.tolerances``. The kernel never writes into its
inputs: q, k, cos and sin (and the leaves they were cut from) are unchanged after forward and backward.
"""

from __future__ import annotations

import pytest
import strategies
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from kernels import apply_rotary
from kernels.reference import rotary_reference


# Head counts and head_dim are compile-time constants of the kernel: on a GPU each new combination compiles (about a
# second), so the GPU profile's 300 examples are capped here; the interpreter compiles nothing.
@settings(max_examples=min(settings().max_examples, 100))
@given(
    batch=strategies.sizes(3), q_heads=strategies.sizes(4), k_heads=strategies.sizes(3), seq=strategies.sizes(9),
    half=strategies.sizes(9), trig_batch=st.booleans(),
    x_dtype=strategies.kernel_dtypes(), trig_dtype=strategies.kernel_dtypes(),
    layout_q=strategies.layouts(), layout_k=strategies.layouts(), layout_cos=strategies.layouts(),
    layout_sin=strategies.layouts(), trig_grad=st.booleans(), unsqueeze_dim=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**31 - 1),
)
def test_outputs_and_every_gradient_match_float64(batch, q_heads, k_heads, seq, half, trig_batch, x_dtype,
                                                  trig_dtype, layout_q, layout_k, layout_cos, layout_sin, trig_grad,
                                                  unsqueeze_dim, seed, device):
    gen = torch.Generator().manual_seed(seed)
    d = 2 * half
    shape = (lambda h: (batch, h, seq, d)) if unsqueeze_dim == 1 else (lambda h: (batch, seq, h, d))
    values = {
        "q": torch.randn(shape(q_heads), generator=gen).to(device, x_dtype),
        "k": torch.randn(shape(k_heads), generator=gen).to(device, x_dtype),
        "cos": torch.randn(batch if trig_batch else 1, seq, d, generator=gen).to(device, trig_dtype),
        "sin": torch.randn(batch if trig_batch else 1, seq, d, generator=gen).to(device, trig_dtype),
    }
    layouts = {"q": layout_q, "k": layout_k, "cos": layout_cos, "sin": layout_sin}
    leaves, views = {}, {}
    for name, v in values.items():
        leaves[name], views[name] = strategies.shaped_leaf(v, layouts[name])
        if name in ("cos", "sin") and not trig_grad:
            views[name] = views[name].detach()  # as a model's cos and sin: no gradient
        elif views[name] is not leaves[name]:
            views[name].retain_grad()
    before = {name: leaf.detach().clone() for name, leaf in leaves.items()}

    q_embed, k_embed = apply_rotary(views["q"], views["k"], views["cos"], views["sin"], unsqueeze_dim)
    out_dtype = torch.promote_types(x_dtype, trig_dtype)
    assert q_embed.dtype == k_embed.dtype == out_dtype
    assert q_embed.shape == views["q"].shape and k_embed.shape == views["k"].shape
    dq = torch.randn(q_embed.shape, generator=gen).to(device, out_dtype)
    dk = torch.randn(k_embed.shape, generator=gen).to(device, out_dtype)
    torch.autograd.backward((q_embed, k_embed), (dq, dk))

    ref_leaves, ref_views = {}, {}
    for name, v in values.items():
        ref_leaves[name], ref_views[name] = strategies.shaped_leaf(v.double(), layouts[name])
        ref_views[name].retain_grad()
    q64, k64 = rotary_reference(ref_views["q"], ref_views["k"], ref_views["cos"], ref_views["sin"], unsqueeze_dim)
    torch.autograd.backward((q64, k64), (dq.double(), dk.double()))

    strategies.assert_within("q_embed", q_embed, q64, q64, out_dtype)
    strategies.assert_within("k_embed", k_embed, k64, k64, out_dtype)
    for name in ("q", "k"):
        ref = ref_views[name].grad
        strategies.assert_within(f"d{name}", views[name].grad, ref, ref.abs(), x_dtype)
        strategies.assert_within(f"{name}'s leaf gradient", leaves[name].grad, ref_leaves[name].grad,
                      strategies.grad_on_leaf(values[name], layouts[name], ref.abs()), x_dtype)
    if trig_grad:
        # Each value of cos and sin meets every head of q and k: its gradient is a sum over heads (in float32).
        xs = [(ref_views["q"], dq.double()), (ref_views["k"], dk.double())]
        dims = (1,) if unsqueeze_dim == 1 else (2,)
        for name, rot in (("cos", lambda x: x), ("sin", lambda x: torch.cat((-x[..., half:], x[..., :half]), -1))):
            terms = sum((g * rot(x.detach())).abs().sum(dims) for x, g in xs)
            scale = terms.sum_to_size(ref_views[name].shape)
            strategies.assert_within(f"d{name}", views[name].grad, ref_views[name].grad, scale, trig_dtype)
    for name, leaf in leaves.items():
        torch.testing.assert_close(leaf.detach(), before[name], rtol=0, atol=0, equal_nan=True)


# ---- dtypes, meta and fake tensors --------------------------------------------------------------------------------


def _qkcs(device, dtype=torch.float32):
    return (torch.randn(2, 4, 5, 8, device=device, dtype=dtype), torch.randn(2, 2, 5, 8, device=device, dtype=dtype),
            torch.randn(1, 5, 8, device=device, dtype=dtype), torch.randn(1, 5, 8, device=device, dtype=dtype))


@pytest.mark.parametrize("which", [0, 1, 2, 3])
def test_float64_is_refused_with_what_to_do(which, device):
    # cos and sin in float64 used to give a float64 output computed in float32 (3.8e-7 off): looked exact, was not.
    args = list(_qkcs(device))
    names = ["q", "k", "cos", "sin"]
    for i in ({0, 1} if which < 2 else {2, 3}):
        args[i] = args[i].double()
    first = names[0 if which < 2 else 2]
    with pytest.raises(TypeError, match=f"{first} must be float32, bfloat16 or float16, got dtype torch.float64"):
        apply_rotary(*args)


def test_mixed_dtypes_follow_pytorch_promotion(device, gen):
    q, k, cos, sin = _qkcs(device)
    q, k, cos, sin = q.half(), k.half(), cos.bfloat16(), sin.bfloat16()
    q_embed, k_embed = apply_rotary(q, k, cos, sin)
    q64, k64 = rotary_reference(q.double(), k.double(), cos.double(), sin.double())
    assert q_embed.dtype == (q * cos.unsqueeze(1)).dtype == torch.float32
    strategies.assert_within("q_embed", q_embed, q64, q64, torch.float32)
    strategies.assert_within("k_embed", k_embed, k64, k64, torch.float32)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_meta_tensors_give_shapes_and_dtypes(requires_grad):
    q, k, cos, sin = (t.to("meta") for t in _qkcs("cpu", torch.bfloat16))
    q.requires_grad_(requires_grad)
    q_embed, k_embed = apply_rotary(q, k, cos, sin)
    assert q_embed.device.type == "meta" and q_embed.shape == q.shape and k_embed.shape == k.shape
    assert q_embed.dtype == torch.bfloat16
    if requires_grad:
        (q_embed.sum() + k_embed.sum()).backward()
        assert q.grad.shape == q.shape and q.grad.device.type == "meta"


def test_fake_tensors_give_shapes_and_dtypes(device):
    with FakeTensorMode():
        q, k, cos, sin = _qkcs(device)
        q.requires_grad_()
        q_embed, k_embed = apply_rotary(q, k, cos.float(), sin)
        assert q_embed.shape == q.shape and k_embed.dtype == torch.float32
        q_embed.sum().backward()
        assert q.grad.shape == q.shape
