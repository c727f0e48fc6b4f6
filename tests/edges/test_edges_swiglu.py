"""SwiGLU at its edges: every layout, size and dtype a caller can pass, views of leaves, in-place backward, meta.

``swiglu(gate, up)`` and its gradients are compared with ``silu(gate) * up`` in float64 through
``kernels.tolerances``; ``inplace_backward=True`` is a memory hint: wherever the backward may not write over gate
and up (a leaf, a view of a leaf, a shared buffer, the module's own input), the gradients are the same and nothing
the caller holds changes.
"""

from __future__ import annotations

import pytest
import strategies
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from kernels import TritonSwiGLUMLP, swiglu
from kernels.reference import relative_error, swiglu_reference
from kernels.swiglu import inplace_backward_allowed, may_overwrite
from kernels.tolerances import RELATIVE_ERROR_TOL as TOL


def _reference_grads(values_gate, values_up, layout_gate, layout_up, dy):
    """Float64 output and gradients of the leaves, through the same layouts as the kernel's inputs."""
    leaf_g, g = strategies.shaped_leaf(values_gate.double(), layout_gate)
    leaf_u, u = strategies.shaped_leaf(values_up.double(), layout_up)
    y = swiglu_reference(g, u)
    y.backward(dy.double())
    return y.detach(), leaf_g.grad, leaf_u.grad


def _as_intermediate(leaf, view):
    """The same view, cut from an intermediate result (``leaf * 1``) instead of the leaf: what a projection gives."""
    inter = leaf * 1.0
    return inter.as_strided(view.shape, view.stride(), view.storage_offset() - leaf.storage_offset())


@given(
    shape=st.lists(strategies.sizes(37), min_size=1, max_size=3),
    dtype=strategies.kernel_dtypes(),
    layout_gate=strategies.layouts(), layout_up=strategies.layouts(), layout_dy=strategies.layouts(),
    source=st.sampled_from(["leaf", "intermediate"]), inplace=st.booleans(), same=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_output_and_every_gradient_match_float64(shape, dtype, layout_gate, layout_up, layout_dy, source, inplace,
                                                 same, seed, device):
    gen = torch.Generator().manual_seed(seed)
    values_g = torch.randn(shape, generator=gen).to(device, dtype)
    values_u = values_g if same else torch.randn(shape, generator=gen).to(device, dtype)
    layout_u = layout_gate if same else layout_up
    dy = strategies.laid_out(torch.randn(shape, generator=gen).to(device, dtype), layout_dy)

    leaf_g, g = strategies.shaped_leaf(values_g, layout_gate)
    leaf_u, u = (leaf_g, g) if same else strategies.shaped_leaf(values_u, layout_u)
    leaves_before = (leaf_g.detach().clone(), leaf_u.detach().clone())
    if source == "intermediate":
        g = _as_intermediate(leaf_g, g)
        u = g if same else _as_intermediate(leaf_u, u)
    g.retain_grad()
    u.retain_grad()

    y = swiglu(g, u, inplace_backward=inplace)
    assert y.shape == g.shape and y.dtype == dtype
    y.backward(dy)

    # float64: the output, the gradients of the views (what the kernel returns) and of the leaves (autograd's sums).
    leaf_g64, g64 = strategies.shaped_leaf(values_g.double(), layout_gate)
    leaf_u64, u64 = strategies.shaped_leaf(values_u.double(), layout_u)
    g64.retain_grad()
    u64.retain_grad()
    y64 = swiglu_reference(g64, u64)
    y64.backward(dy.double())
    strategies.assert_within("y", y, y64, y64, dtype)
    if same:  # gate is up: one input, whose gradient is d(gate) + d(up)
        scale = g64.grad.abs() + u64.grad.abs()
        strategies.assert_within("d(gate) + d(up)", g.grad, g64.grad + u64.grad, scale, dtype)
        strategies.assert_within("leaf gradient", leaf_g.grad, leaf_g64.grad + leaf_u64.grad,
                      strategies.grad_on_leaf(values_g, layout_gate, scale), dtype)
    else:
        strategies.assert_within("d(gate)", g.grad, g64.grad, g64.grad.abs(), dtype)
        strategies.assert_within("d(up)", u.grad, u64.grad, u64.grad.abs(), dtype)
        strategies.assert_within("gate's leaf gradient", leaf_g.grad, leaf_g64.grad,
                      strategies.grad_on_leaf(values_g, layout_gate, g64.grad.abs()), dtype)
        strategies.assert_within("up's leaf gradient", leaf_u.grad, leaf_u64.grad,
                      strategies.grad_on_leaf(values_u, layout_u, u64.grad.abs()), dtype)
    # Leaves are never written by a backward, whatever the flag (bit for bit; a buffer's unused, uninitialised
    # elements may hold NaN).
    for leaf, before in zip((leaf_g, leaf_u), leaves_before):
        torch.testing.assert_close(leaf.detach(), before, rtol=0, atol=0, equal_nan=True)


# ---- in-place backward: the silent cases, as plain regression tests ----------------------------------------------


def test_inplace_backward_never_writes_into_a_view_of_a_leaf(device, gen):
    # The case that used to overwrite the leaf's data with its gradient: h.view(4, 6) has a grad_fn (a view node),
    # but its memory is the leaf's.
    h = torch.randn(24, generator=gen).to(device).requires_grad_()
    h2 = torch.randn(24, generator=gen).to(device).requires_grad_()
    before, before2 = h.detach().clone(), h2.detach().clone()
    y = swiglu(h.view(4, 6), h2.view(4, 6), inplace_backward=True)
    dy = torch.randn(4, 6, generator=gen).to(device)
    y.backward(dy)
    assert torch.equal(h.detach(), before) and torch.equal(h2.detach(), before2)
    _, dg, du = _reference_grads(before.view(4, 6), before2.view(4, 6), "contiguous", "contiguous", dy)
    assert relative_error(h.grad.view(4, 6), dg) < TOL[torch.float32]
    assert relative_error(h2.grad.view(4, 6), du) < TOL[torch.float32]


@pytest.mark.parametrize("cut", ["view", "slice", "reshape", "unsqueeze", "detach_view"])
def test_no_view_of_a_leaf_is_ever_overwritten(cut, device, gen):
    w = torch.randn(6, 8, generator=gen).to(device).requires_grad_()
    before = w.detach().clone()
    cuts = {"view": lambda t: t.view(48)[:24].view(4, 6), "slice": lambda t: t[2:5],
            "reshape": lambda t: t.reshape(8, 6), "unsqueeze": lambda t: t.unsqueeze(0),
            "detach_view": lambda t: t.view(6, 8) * 1.0}  # an intermediate: may be overwritten, w may not
    gate = cuts[cut](w)
    up = torch.randn(gate.shape, generator=gen).to(device)
    assert may_overwrite(gate) == (cut == "detach_view")
    swiglu(gate, up, inplace_backward=True).sum().backward()
    assert torch.equal(w.detach(), before)


def test_inplace_backward_still_writes_over_intermediates(device, gen):
    # The hint keeps working where it is safe: a projection's outputs are overwritten by their gradients.
    x = torch.randn(5, 7, generator=gen).to(device).requires_grad_()
    gate, up = x * 2.0, x + 1.0
    assert inplace_backward_allowed(gate, up)
    y = swiglu(gate, up, inplace_backward=True)
    ptr = gate.data_ptr()
    version = gate._version
    y.sum().backward()
    assert gate._version > version and gate.data_ptr() == ptr  # written where it was
    g64 = (x.detach().double() * 2).requires_grad_()
    u64 = (x.detach().double() + 1).requires_grad_()
    swiglu_reference(g64, u64).sum().backward()
    assert relative_error(x.grad, 2 * g64.grad + u64.grad) < TOL[torch.float32]


def test_module_with_identity_projections_leaves_its_input_alone(device, gen):
    # A projection that hands x through (nn.Identity) would make the in-place backward overwrite the caller's x.
    x = (torch.randn(3, 6, generator=gen).to(device).requires_grad_() * 1.0)  # an intermediate, as in a model
    x.retain_grad()
    before = x.detach().clone()
    up = torch.nn.Linear(6, 6).to(device)
    mlp = TritonSwiGLUMLP(torch.nn.Identity(), up, torch.nn.Linear(6, 4).to(device))
    out = mlp(x)
    out.sum().backward()
    assert torch.equal(x.detach(), before)
    x64 = before.double().requires_grad_()
    ref = torch.nn.functional.linear(
        swiglu_reference(x64, torch.nn.functional.linear(x64, up.weight.double(), up.bias.double())),
        mlp.down_proj.weight.double(), mlp.down_proj.bias.double())
    ref.sum().backward()
    assert relative_error(out, ref) < TOL[torch.float32]
    assert relative_error(x.grad, x64.grad) < TOL[torch.float32]


# ---- dtypes, devices, meta and fake tensors -----------------------------------------------------------------------


@pytest.mark.parametrize("which", ["gate", "up", "both"])
def test_float64_is_refused_with_what_to_do(which, device):
    g = torch.randn(3, 4, device=device, dtype=torch.float64 if which in ("gate", "both") else torch.float32)
    u = torch.randn(3, 4, device=device, dtype=torch.float64 if which in ("up", "both") else torch.float32)
    name = "up" if which == "up" else "gate"
    with pytest.raises(TypeError, match=f"{name} must be float32, bfloat16 or float16, got dtype torch.float64"):
        swiglu(g, u)


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float16), (torch.bfloat16, torch.float16)])
def test_mixed_dtypes_are_refused(dtypes, device):
    with pytest.raises(TypeError, match="same dtype"):
        swiglu(torch.randn(2, 3, device=device, dtype=dtypes[0]), torch.randn(2, 3, device=device, dtype=dtypes[1]))


@pytest.mark.parametrize("requires_grad", [False, True])
def test_meta_tensors_give_the_shape_and_dtype(requires_grad):
    g = torch.empty(3, 5, 7, device="meta", dtype=torch.bfloat16, requires_grad=requires_grad)
    u = torch.empty(3, 5, 7, device="meta", dtype=torch.bfloat16)
    y = swiglu(g, u, inplace_backward=True)
    assert y.device.type == "meta" and y.shape == (3, 5, 7) and y.dtype == torch.bfloat16
    if requires_grad:
        y.sum().backward()
        assert g.grad.shape == g.shape and g.grad.device.type == "meta"


def test_fake_tensors_give_the_shape_and_dtype(device):
    with FakeTensorMode():
        g = torch.randn(4, 9, device=device).requires_grad_()
        u = torch.randn(4, 9, device=device)[:, :9]
        y = swiglu(g, u, inplace_backward=True)
        assert y.shape == (4, 9) and y.dtype == torch.float32
        y.sum().backward()
        assert g.grad.shape == (4, 9)
