"""The residual add fused into RMSNorm: y, h and every gradient against float64, with either gradient absent;
odd sizes, views, empty inputs, bad input, the operators (opcheck, torch.compile); the 8B shape on a GPU."""

import pytest
import strategies
import torch
from hypothesis import given
from hypothesis import strategies as st

from kernels import runtime
from kernels.add_rmsnorm import add_rms_norm, add_rms_norm_bwd_op, add_rms_norm_fwd_op
from kernels.reference import relative_error, rms_norm_reference
from kernels.tolerances import RELATIVE_ERROR_TOL as TOL

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_inputs(shape, dtype, device, gen, w_dtype=None):
    """x, residual, weight and the two incoming gradients dy, dh: random, the weight spread around 1 (never all
    ones: that hides a missing multiply)."""
    def randn():
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).to(device)

    w = (0.5 + torch.rand(shape[-1], generator=gen, dtype=torch.float64)).to(w_dtype or dtype).to(device)
    return randn(), randn(), w, randn(), randn()


def reference(x, r, w, dy, dh, eps=1e-6):
    """y, h and the gradients of x, residual and weight in float64 (None where an incoming gradient is None and the
    other is too)."""
    x64, r64, w64 = (t.detach().double().requires_grad_() for t in (x, r, w))
    h64 = x64 + r64
    y64 = rms_norm_reference(h64, w64, eps)
    outs, grads = zip(*[(o, g.double()) for o, g in ((y64, dy), (h64, dh)) if g is not None])
    torch.autograd.backward(outs, grads)
    return y64, h64, x64.grad, r64.grad, w64.grad


def run(x, r, w, dy, dh, eps=1e-6, weight_grad=True):
    """Ours: y, h and the leaves' gradients (the gradient is None where the leaf got none)."""
    xk, rk = (t.detach().clone().requires_grad_() for t in (x, r))
    wk = w.detach().clone().requires_grad_(weight_grad)
    y, h = add_rms_norm(xk, rk, wk, eps)
    outs, grads = zip(*[(o, g) for o, g in ((y, dy), (h, dh)) if g is not None])
    torch.autograd.backward(outs, grads)
    return y, h, xk.grad, rk.grad, wk.grad


def assert_close(ours, ref, dtype):
    names = ("y", "h", "dx", "dresidual", "dweight")
    errors = {n: relative_error(o, e) for n, o, e in zip(names, ours, ref)}
    assert all(e < TOL[dtype] for e in errors.values()), errors


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 64), (7, 100), (2, 33, 300), (3, 2, 4, 65), (129, 257)],
                         ids=lambda s: "x".join(map(str, s)))
def test_matches_float64_reference(shape, dtype, device, gen):
    x, r, w, dy, dh = make_inputs(shape, dtype, device, gen)
    ours = run(x, r, w, dy, dh)
    assert ours[0].dtype == ours[1].dtype == dtype and ours[0].shape == ours[1].shape == x.shape
    assert ours[2].dtype == ours[3].dtype == dtype and ours[4].dtype == dtype
    assert_close(ours, reference(x, r, w, dy, dh), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_either_gradient_may_be_none(dtype, device, gen):
    x, r, w, dy, dh = make_inputs((5, 3, 97), dtype, device, gen)
    # Only y used: the norm's backward alone.
    assert_close(run(x, r, w, dy, None), reference(x, r, w, dy, None), dtype)
    # Only h used: its gradient passes to both inputs unchanged, and the weight gets none.
    _, _, dx, dres, dw = run(x, r, w, None, dh)
    assert torch.equal(dx, dh) and torch.equal(dres, dh) and dw is None
    # A frozen weight: no dW reduction, the inputs' gradients as before.
    ours = run(x, r, w, dy, dh, weight_grad=False)
    assert ours[4] is None
    assert_close(ours[:4], reference(x, r, w, dy, dh)[:4], dtype)


def test_large_magnitudes_custom_eps_and_float32_weight(device, gen):
    x, r, _, dy, dh = make_inputs((9, 513), torch.bfloat16, device, gen)
    x, r = x * 1e4, r * 3e3  # squares of 1e8 per element: the mean of squares must be taken in float32
    w = (0.5 + torch.rand(513, generator=gen)).to(device)
    ours = run(x, r, w, dy.float(), dh, eps=1e-5)
    assert ours[0].dtype == torch.float32 and ours[1].dtype == torch.bfloat16  # as weight * h promotes in PyTorch
    assert_close(ours, reference(x, r, w, dy.float(), dh, eps=1e-5), torch.bfloat16)


def test_bf16_outputs_round_as_hugging_face(device, gen):
    # h is Hugging Face's bf16 sum exactly; y its norm, up to a rare last-bit difference of the rsqrt.
    x, r, w, _, _ = make_inputs((4, 37, 384), torch.bfloat16, device, gen)
    y, h = add_rms_norm(x, r, w)
    assert torch.equal(h, r + x)
    differ = y != rms_norm_reference(r + x, w)
    assert differ.float().mean().item() < 0.01, f"{differ.sum().item()} of {differ.numel()} elements differ"


def test_views_and_strides(device, gen):
    x, r, w, dy, dh = make_inputs((6, 11, 96), torch.float32, device, gen)
    wide = torch.randn(6, 11, 2 * 96, generator=gen).to(device)
    wide[..., ::2] = x
    transposed = r.transpose(0, 1).contiguous().transpose(0, 1)
    row = r[:1, :1].expand(6, 11, 96)  # stride 0: one residual row broadcast
    for xv, rv in ((wide[..., ::2], transposed), (x[:, ::2], r[:, ::2]), (x, row)):
        assert_close(run(xv, rv, w[::1], dy[:, :xv.shape[1]], dh[:, :xv.shape[1]]),
                     reference(xv, rv, w, dy[:, :xv.shape[1]], dh[:, :xv.shape[1]]), torch.float32)
    # A strided weight and views of leaves: the gradients reach the leaves through the views.
    wbig = torch.rand(192, generator=gen).add_(0.5).to(device)
    leaf_x, leaf_r = wide.clone().requires_grad_(), r.clone().requires_grad_()
    y, h = add_rms_norm(leaf_x[..., ::2], leaf_r, wbig[::2])
    torch.autograd.backward([y, h], [dy, dh])
    _, _, gx, gr, _ = reference(x, r, wbig[::2], dy, dh)
    assert relative_error(leaf_x.grad[..., ::2], gx) < TOL[torch.float32]
    assert leaf_x.grad[..., 1::2].abs().max() == 0 and relative_error(leaf_r.grad, gr) < TOL[torch.float32]


def test_leaves_accumulate_the_shared_gradient_without_aliasing(device, gen):
    # The backward hands one tensor to both inputs, as autograd's own add does: two leaves, two backward passes.
    x, r, w, dy, dh = make_inputs((5, 40), torch.float32, device, gen)
    xk, rk, wk = (t.clone().requires_grad_() for t in (x, r, w))
    for _ in range(2):
        y, h = add_rms_norm(xk, rk, wk)
        torch.autograd.backward([y, h], [dy, dh])
    _, _, gx, gr, gw = reference(x, r, w, dy, dh)
    for got, want in ((xk.grad, gx), (rk.grad, gr), (wk.grad, gw)):
        assert relative_error(got, 2 * want) < TOL[torch.float32]
    assert xk.grad.data_ptr() != rk.grad.data_ptr()


@pytest.mark.parametrize("shape", [(0, 32), (3, 0), (2, 0, 16)], ids=lambda s: "x".join(map(str, s)))
def test_empty(shape, device, gen):
    x, r, w, dy, dh = make_inputs(shape, torch.float32, device, gen)
    y, h, dx, dres, dw = run(x, r, w, dy, dh)
    assert y.shape == h.shape == dx.shape == dres.shape == shape
    assert dw.shape == w.shape and not dw.any()
    assert add_rms_norm(x, r, w)[1].shape == shape  # without autograd too


def test_bad_inputs(device, gen):
    x, r, w, _, _ = make_inputs((3, 16), torch.float32, device, gen)
    with pytest.raises(TypeError, match="residual must have x's dtype"):
        add_rms_norm(x, r.bfloat16(), w)
    with pytest.raises(ValueError, match="residual must have x's shape"):
        add_rms_norm(x, r[:2], w)
    with pytest.raises(ValueError, match="weight must have shape"):
        add_rms_norm(x, r, w[:8])
    with pytest.raises(TypeError, match="residual must be a tensor"):
        add_rms_norm(x, 1.0, w)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        add_rms_norm(x.double(), r.double(), w.double())
    with pytest.raises(TypeError, match="floating-point"):
        add_rms_norm(x.long(), r.long(), w)
    with pytest.raises(ValueError, match="scalar"):
        add_rms_norm(x[0, 0], r[0, 0], w[:1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck(dtype, device, gen):
    x, r, w, dy, dh = make_inputs((3, 7, 48), dtype, device, gen)
    torch.library.opcheck(add_rms_norm_fwd_op, (x, r, w, 1e-6))
    torch.library.opcheck(add_rms_norm_fwd_op, (x[..., ::2], r[..., ::2], w[::2], 1e-6))
    _, h, rstd = add_rms_norm_fwd_op(x, r, w, 1e-6)
    for incoming in (dh, None):
        for compute_dw in (True, False):
            torch.library.opcheck(add_rms_norm_bwd_op, (dy, incoming, h, w, rstd, compute_dw))


def test_under_torch_compile_as_eager(device, gen, fresh_dynamo):
    x, r, w, dy, dh = make_inputs((4, 9, 64), torch.float32, device, gen)

    def layer(x, r, w):
        y, h = add_rms_norm(x, r, w)
        return y * 2, h

    compiled = torch.compile(layer, backend=runtime.COMPILE_BACKEND, fullgraph=True)
    got = run_fn(compiled, x, r, w, dy, dh)
    want = run_fn(layer, x, r, w, dy, dh)
    for a, b in zip(got, want):
        assert relative_error(a, b) < TOL[torch.float32]


def run_fn(fn, x, r, w, dy, dh):
    xk, rk, wk = (t.clone().requires_grad_() for t in (x, r, w))
    y, h = fn(xk, rk, wk)
    torch.autograd.backward([y, h], [dy, dh])
    return y, h, xk.grad, rk.grad, wk.grad


@st.composite
def cases(draw):
    return dict(lead=draw(strategies.leading_dims()), hidden=draw(strategies.sizes(70)),
                dtype=draw(strategies.kernel_dtypes()), x_layout=draw(strategies.layouts()),
                r_layout=draw(strategies.layouts()), dy=draw(st.booleans()), dh=draw(st.booleans()))


def cancelling_terms(x, r, w, dy, eps=1e-6):
    """The norms of the terms that dx, dresidual and dweight are differences or sums of, in float64: what float32
    can be exact to a fraction of, where those terms cancel.

    dx = rstd · (g − ĥ · mean(g ⊙ ĥ)) subtracts two terms of size ‖rstd · g‖ that cancel almost exactly at hidden
    size 1 (ĥ = ±1). dW = Σ_rows dy ⊙ ĥ adds terms of either sign: at hidden size 1 two rows whose sums have
    opposite signs give dW ≈ dy₁ − dy₂, near 0 where the dy are equal, as torch.ones makes them (each ĥ is then
    exact only to an ulp of 1, and so is PyTorch's own float32 autograd). Where nothing cancels these are about the
    gradients' own norms. Returns {gradient name: norm of its terms}; empty without dy or values."""
    h64 = x.double() + r.double()
    if dy is None or h64.numel() == 0:
        return {}
    rstd = torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + eps)
    dx_terms = (rstd * dy.double() * w.double()).norm().item()
    dw_terms = (dy.double() * h64 * rstd).abs().reshape(-1, h64.shape[-1]).sum(0).norm().item()
    return {"dx": dx_terms, "dresidual": dx_terms, "dweight": dw_terms}


@given(case=cases())
def test_property_any_shape_layout_and_gradient(case, device):
    gen = torch.Generator().manual_seed(0)
    shape, dtype = (*case["lead"], case["hidden"]), case["dtype"]
    x, r, w, dy, dh = make_inputs(shape, dtype, device, gen)
    dy, dh = (dy if case["dy"] else None), (dh if case["dh"] else None)
    if dy is None and dh is None:
        dy = torch.ones_like(x)
    xv, rv = strategies.laid_out(x, case["x_layout"]), strategies.laid_out(r, case["r_layout"])
    ours = run(xv, rv, w, dy, dh)
    ref = reference(x, r, w, dy, dh)
    scales = cancelling_terms(x, r, w, dy)
    for name, got, want in zip(("y", "h", "dx", "dresidual", "dweight"), ours, ref):
        if want is None or want.numel() == 0:
            continue
        if name == "dweight" and want.norm() == 0:
            assert got is None or not got.any()
            continue
        scale = max(want.norm().item(), scales.get(name, 0.0))
        error = relative_error(got, want) * want.norm().item() / scale
        assert error < TOL[dtype], f"{name}: {error:.3g}"


@pytest.mark.parametrize("hidden", [1, 2, 3])
@pytest.mark.parametrize("rows", [1, 2, 17, 5000])
def test_tiny_hidden_sizes_reduce_every_row_into_the_weight_gradient(hidden, rows, device, gen):
    # Widths below any tile's minimum: BLOCK_N of 1 to 4, the dW sum's column block wider than the row, every
    # program of the persistent grid (5000 rows: several row blocks each) writing a partial. Positive sums and a
    # positive dy make every term of dW positive, so nothing cancels and the plain relative bound holds: a lost,
    # doubled or misplaced partial is off by whole rows' terms.
    x, r, w, dy, dh = make_inputs((rows, hidden), torch.float32, device, gen)
    x, r, dy = x.abs() + 0.1, r.abs(), dy.abs() + 0.1
    assert_close(run(x, r, w, dy, dh), reference(x, r, w, dy, dh), torch.float32)
    # Without dh: at hidden size 1 dx is a near-total cancellation (cancelling_terms), dW is not.
    y, h, _, _, dw = run(x, r, w, dy, None)
    y64, h64, _, _, dw64 = reference(x, r, w, dy, None)
    for got, want in ((y, y64), (h, h64), (dw, dw64)):
        assert relative_error(got, want) < TOL[torch.float32]


def test_weight_gradient_that_cancels_at_hidden_size_1(device):
    # Two rows of one column whose sums have opposite signs, dy of ones: dW = ĥ₁ + ĥ₂ ≈ 1 − 1, a few 1e-7, from two
    # values each exact to an ulp of 1 (6e-8). float32 cannot give it to 1e-5 relative, PyTorch's autograd neither;
    # the bound is the terms' size, and a wrong sum (one row's term, or 2) still fails it by far.
    x = torch.tensor([[0.9739494323730469], [-1.7577967643737793]], device=device)
    r = torch.zeros_like(x)
    w = torch.tensor([1.47005295753479], device=device)
    dy = torch.ones_like(x)
    _, _, _, _, dw = run(x, r, w, dy, None)
    _, _, _, _, dw64 = reference(x, r, w, dy, None)
    scale = cancelling_terms(x, r, w, dy)["dweight"]
    assert abs(dw.item() - dw64.item()) / scale < TOL[torch.float32], (dw.item(), dw64.item())


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [4096, 3 * 1021])
def test_llama_8b_hidden_size_in_bf16(tokens, gen):
    x, r, w, dy, dh = make_inputs((tokens, 4096), torch.bfloat16, "cuda", gen)
    ours = run(x, r, w, dy, dh)
    assert all(bool(t.isfinite().all()) for t in ours)
    assert_close(ours, reference(x, r, w, dy, dh), torch.bfloat16)
    assert torch.equal(ours[1], r + x)
