"""LoRA over an FP8 base: the quantiser's column scale, the FP8 input gradient (the weight's scale moved onto dy),
one layer and a group against float64 references of the same FP8 roundings, both input-gradient paths, the SwiGLU
down node, adapters in float32, the refusals; on a GPU, an 8B-like group."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.fp8 import quantize_rows, quantize_rows_reference
from kernels.fp8_linear import Fp8Weight
from kernels.lora_fp8 import (
    Fp8LoRAFunction,
    Fp8SwiGLULoRADownFunction,
    base_grad_input,
    fp8_lora_linear,
)
from kernels.reference import relative_error
from kernels.tolerances import RELATIVE_ERROR_TOL as TOL

F64 = torch.float64


def _dequant(q, s):
    return q.to(F64) * s.to(F64)[:, None]


def _layer(gen, n, k, r, device, dtype=torch.bfloat16, adapter_dtype=torch.float32, bias=False):
    w = (torch.randn(n, k, generator=gen) / k**0.5) * torch.logspace(-1, 1, n)[:, None]
    b = torch.randn(n, generator=gen).to(device, dtype) if bias else None
    weight = Fp8Weight.from_linear(w.to(device, dtype), b)
    a = (torch.randn(r, k, generator=gen) / k**0.5).to(device, adapter_dtype).requires_grad_()
    bb = (torch.randn(n, r, generator=gen) / r**0.5).to(device, adapter_dtype).requires_grad_()
    return weight, a, bb


def _expected(x, weight, a, b, s, dy, grad_input, saved_input="bf16"):
    """Float64 output and gradients of x, A, B, with the same FP8 roundings as the kernels (x's rows for the base
    GEMM, dy's rows times the weight's scales for the FP8 input gradient, x's codes for dA where they are saved)."""
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    x_for_da = x2.to(F64) if saved_input == "bf16" else _dequant(*quantize_rows_reference(x2)).to(x.dtype).to(F64)
    w = _dequant(weight.q, weight.scale)
    af, bf = a.detach().to(x.dtype).to(F64), b.detach().to(x.dtype).to(F64)
    xa = x2.to(F64) @ af.T
    y = _dequant(*quantize_rows_reference(x2, weight.q.dtype)) @ w.T + s * xa @ bf.T
    if weight.bias is not None:
        y += weight.bias.to(F64)
    dxa = s * dy2.to(F64) @ bf
    if grad_input == "fp8":
        dq, ds = quantize_rows_reference(dy2, weight.q.dtype, col_scale=weight.scale)
        dx = _dequant(dq, ds) @ weight.q.to(F64)
    else:
        dx = dy2.to(F64) @ w.to(x.dtype).to(F64)
    dx = dx + dxa @ af
    return y, dx, dxa.T @ x_for_da, s * dy2.to(F64).T @ xa


def test_column_scale_is_applied_before_the_row_scale(device, gen):
    x = torch.randn(37, 70, generator=gen).to(device, torch.bfloat16)
    cs = torch.logspace(-2, 2, 70).to(device)
    q, s = quantize_rows(x, col_scale=cs)
    rq, rs = quantize_rows_reference(x, col_scale=cs)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    assert relative_error(_dequant(q, s), x.to(F64) * cs.to(F64)) < 0.05  # e4m3: ≤ 6% a value, far less on average
    unscaled = quantize_rows(x)[0]
    assert not torch.equal(q.view(torch.uint8), unscaled.view(torch.uint8))


def test_column_scale_refusals(device):
    x = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match=r"col_scale must have shape \(8,\)"):
        quantize_rows(x, col_scale=torch.ones(7, device=device))
    with pytest.raises(TypeError, match="col_scale must be a float32"):
        quantize_rows(x, col_scale=torch.ones(8, device=device, dtype=torch.float64))


@pytest.mark.parametrize("grad_input", ["fp8", "bf16"])
def test_base_grad_input_moves_the_weight_scale_onto_dy(grad_input, device, gen):
    weight, _, _ = _layer(gen, 70, 45, 4, device)
    dy = torch.randn(33, 70, generator=gen).to(device, torch.bfloat16)
    dx = base_grad_input(dy, weight.q, weight.scale, grad_input)
    if grad_input == "fp8":
        dq, ds = quantize_rows_reference(dy, col_scale=weight.scale)
        exact = _dequant(dq, ds) @ weight.q.to(F64)
    else:
        exact = dy.to(F64) @ _dequant(weight.q, weight.scale).to(torch.bfloat16).to(F64)
    assert relative_error(dx, exact) <= TOL[torch.bfloat16]
    # and both within FP8's rounding of the true product dy · Ŵ
    assert relative_error(dx, dy.to(F64) @ _dequant(weight.q, weight.scale)) < 0.05


@pytest.mark.parametrize("saved_input", ["bf16", "fp8"])
@pytest.mark.parametrize("grad_input", ["fp8", "bf16"])
@pytest.mark.parametrize("bias", [False, True])
def test_one_layer_against_float64(grad_input, saved_input, bias, device, gen):
    weight, a, b = _layer(gen, 48, 64, 8, device, bias=bias)
    x = torch.randn(2, 19, 64, generator=gen).to(device, torch.bfloat16).requires_grad_()
    y = fp8_lora_linear(x, weight, a, b, 2.0, grad_input, saved_input)
    assert y.shape == (2, 19, 48) and y.dtype == torch.bfloat16
    dy = torch.randn(y.shape, generator=gen).to(device, torch.bfloat16)
    y.backward(dy)
    ey, edx, eda, edb = _expected(x.detach(), weight, a, b, 2.0, dy, grad_input, saved_input)
    assert relative_error(y.reshape(-1, 48), ey) <= TOL[torch.bfloat16]
    assert relative_error(x.grad.reshape(-1, 64), edx) <= TOL[torch.bfloat16]
    assert a.grad.dtype == torch.float32 and b.grad.dtype == torch.float32
    assert relative_error(a.grad, eda) <= TOL[torch.bfloat16]
    assert relative_error(b.grad, edb) <= TOL[torch.bfloat16]


def test_a_group_quantises_x_once_and_sums_the_input_gradients(device, gen, monkeypatch):
    from kernels import lora_fp8

    layers = [_layer(gen, n, 64, r, device) for n, r in ((64, 8), (16, 4), (16, 4))]
    x = torch.randn(23, 64, generator=gen).to(device, torch.bfloat16).requires_grad_()
    calls = []
    real = lora_fp8.quantize_rows
    monkeypatch.setattr(lora_fp8, "quantize_rows", lambda t, *args, **kw: calls.append(t.shape) or real(t, *args, **kw))
    params = [t for w, a, b in layers for t in (w.q, w.scale, w.bias, a, b)]
    ys = Fp8LoRAFunction.apply(x, "fp8", "bf16", (1.0, 2.0, 0.5), *params)
    assert calls == [(23, 64)]  # x quantised once for the three layers
    dys = [torch.randn(y.shape, generator=gen).to(device, torch.bfloat16) for y in ys]
    torch.autograd.backward(ys, dys)
    edx = torch.zeros(23, 64, dtype=F64, device=device)
    for (w, a, b), s, y, dy in zip(layers, (1.0, 2.0, 0.5), ys, dys):
        ey, dx_i, eda, edb = _expected(x.detach(), w, a, b, s, dy, "fp8")
        edx += dx_i
        assert relative_error(y, ey) <= TOL[torch.bfloat16]
        assert relative_error(a.grad, eda) <= TOL[torch.bfloat16] and relative_error(b.grad, edb) <= TOL[torch.bfloat16]
    assert relative_error(x.grad, edx) <= TOL[torch.bfloat16]


def test_swiglu_down_keeps_gate_and_up_and_matches(device, gen):
    weight, a, b = _layer(gen, 32, 96, 8, device)
    gate = torch.randn(2, 9, 96, generator=gen).to(device, torch.bfloat16).requires_grad_()
    up = torch.randn(2, 9, 96, generator=gen).to(device, torch.bfloat16).requires_grad_()
    y = Fp8SwiGLULoRADownFunction.apply(gate, up, "fp8", 2.0, weight.q, weight.scale, None, a, b)
    dy = torch.randn(y.shape, generator=gen).to(device, torch.bfloat16)
    y.backward(dy)
    h = (torch.nn.functional.silu(gate.detach().float()) * up.detach().float()).to(torch.bfloat16)
    hh = h.detach().requires_grad_()
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    y2 = fp8_lora_linear(hh, weight, a2, b2, 2.0, "fp8")
    y2.backward(dy)
    assert relative_error(y, y2) <= TOL[torch.bfloat16]
    assert relative_error(a.grad, a2.grad) <= TOL[torch.bfloat16]
    assert relative_error(b.grad, b2.grad) <= TOL[torch.bfloat16]
    g64, u64 = gate.detach().to(F64).requires_grad_(), up.detach().to(F64).requires_grad_()
    (torch.nn.functional.silu(g64) * u64).backward(hh.grad.to(F64))
    assert relative_error(gate.grad, g64.grad) <= TOL[torch.bfloat16]
    assert relative_error(up.grad, u64.grad) <= TOL[torch.bfloat16]


def test_refusals(device, gen):
    weight, a, b = _layer(gen, 16, 32, 4, device)
    x = torch.randn(3, 32, device=device, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="Fp8Weight"):
        fp8_lora_linear(x, torch.ones(16, 32), a, b, 1.0)
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., 32\]"):
        fp8_lora_linear(x[:, :31], weight, a, b, 1.0)
    with pytest.raises(ValueError, match="lora_a must be"):
        fp8_lora_linear(x, weight, a[:, :31], b, 1.0)
    with pytest.raises(TypeError, match="share a dtype"):
        fp8_lora_linear(x, weight, a, b.detach().to(torch.bfloat16), 1.0)
    with pytest.raises(ValueError, match="grad_input must be one of"):
        fp8_lora_linear(x, weight, a, b, 1.0, "e5m2")
    with pytest.raises(ValueError, match="saved_input must be one of"):
        fp8_lora_linear(x, weight, a, b, 1.0, "fp8", "fp16")
    with pytest.raises(TypeError, match="x must be"):
        fp8_lora_linear(x.to(torch.int32), weight, a, b, 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("grad_input", ["fp8", "bf16"])
def test_gpu_8b_group(grad_input, gen):
    layers = [_layer(gen, n, 4096, 16, "cuda") for n in (4096, 1024, 1024)]
    x = torch.randn(512, 4096, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    params = [t for w, a, b in layers for t in (w.q, w.scale, w.bias, a, b)]
    ys = Fp8LoRAFunction.apply(x, grad_input, "bf16", (2.0, 2.0, 2.0), *params)
    dys = [torch.randn(y.shape, generator=gen).to("cuda", torch.bfloat16) for y in ys]
    torch.autograd.backward(ys, dys)
    edx = torch.zeros(512, 4096, dtype=F64, device="cuda")
    for (w, a, b), y, dy in zip(layers, ys, dys):
        ey, dx_i, eda, edb = _expected(x.detach(), w, a, b, 2.0, dy, grad_input)
        edx += dx_i
        assert relative_error(y, ey) <= TOL[torch.bfloat16]
        assert relative_error(a.grad, eda) <= TOL[torch.bfloat16] and relative_error(b.grad, edb) <= TOL[torch.bfloat16]
    assert relative_error(x.grad, edx) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("shape", [(1, 1), (37, 70), (130, 65), (0, 5), (64, 128)])
def test_transpose_codes(shape, device, gen):
    from kernels.fp8 import transpose_codes

    q = torch.randn(shape, generator=gen).to(device).to(torch.float8_e5m2)
    t = transpose_codes(q)
    assert t.shape == shape[::-1] and t.dtype == q.dtype and t.is_contiguous()
    assert torch.equal(t.view(torch.uint8), q.t().contiguous().view(torch.uint8))


def test_transpose_codes_refusals(device):
    from kernels.fp8 import transpose_codes

    with pytest.raises(TypeError, match="FP8 tensor"):
        transpose_codes(torch.ones(3, 4, device=device))
    with pytest.raises(ValueError, match="2-D and contiguous"):
        transpose_codes(torch.ones(4, 3, device=device).to(torch.float8_e4m3fn).t())


@pytest.mark.parametrize("saved_input", ["bf16", "fp8"])
def test_what_the_node_keeps_of_x(saved_input, device, gen):
    weight, a, b = _layer(gen, 32, 64, 4, device)
    x = torch.randn(40, 64, generator=gen).to(device, torch.bfloat16).requires_grad_()
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append((t.dtype, tuple(t.shape))) or t, lambda t: t):
        fp8_lora_linear(x, weight, a, b, 1.0, "fp8", saved_input)
    assert ((torch.bfloat16, (40, 64)) in kept) == (saved_input == "bf16")
    assert ((torch.float8_e4m3fn, (40, 64)) in kept) == (saved_input == "fp8")


@settings(max_examples=8, deadline=None)
@given(tokens=st.integers(0, 20), n_in=st.integers(1, 40), n_out=st.integers(1, 40), rank=st.integers(1, 6),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), transposed=st.booleans(),
       grad_input=st.sampled_from(["fp8", "bf16"]), saved_input=st.sampled_from(["bf16", "fp8"]),
       seed=st.integers(0, 2**31))
def test_any_shape_dtype_and_view(tokens, n_in, n_out, rank, dtype, transposed, grad_input, saved_input, seed):
    """Odd sizes, no tokens, every input dtype, a transposed view of x: the float64 answer of the same roundings."""
    from kernels import runtime

    device = runtime.device()
    gen = torch.Generator().manual_seed(seed)
    weight, a, b = _layer(gen, n_out, n_in, rank, device, dtype=dtype)
    base = torch.randn(n_in, tokens, generator=gen) if transposed else torch.randn(tokens, n_in, generator=gen)
    x = (base.t() if transposed else base).to(device, dtype).requires_grad_()
    y = fp8_lora_linear(x, weight, a, b, 1.5, grad_input, saved_input)
    assert y.shape == (tokens, n_out) and y.dtype == dtype
    dy = torch.randn(y.shape, generator=gen).to(device, dtype)
    y.backward(dy)
    assert x.grad.shape == x.shape and a.grad.shape == a.shape and b.grad.shape == b.shape
    if tokens == 0:  # nothing to sum: the adapters' gradients are zeros, as PyTorch's would be
        assert not a.grad.any() and not b.grad.any()
        return
    ey, edx, eda, edb = _expected(x.detach(), weight, a, b, 1.5, dy, grad_input, saved_input)
    for got, want in ((y, ey), (x.grad, edx), (a.grad, eda), (b.grad, edb)):
        assert relative_error(got, want) <= 2 * TOL[dtype]


def test_under_torch_compile(device, gen, fresh_dynamo):
    """torch.compile (aot_eager: the tracing, not Inductor's code) gives the eager node's output and gradients."""
    weight, a, b = _layer(gen, 24, 48, 4, device)
    x = torch.randn(2, 7, 48, generator=gen).to(device, torch.bfloat16).requires_grad_()
    dy = torch.randn(2, 7, 24, generator=gen).to(device, torch.bfloat16)

    def layer(x, a, b):
        return fp8_lora_linear(x, weight, a, b, 2.0)

    results = []
    for fn in (layer, torch.compile(layer, backend="aot_eager")):
        y = fn(x, a, b)
        y.backward(dy)
        results.append([y.detach(), x.grad, a.grad, b.grad])
        x.grad = a.grad = b.grad = None
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)


@settings(max_examples=8, deadline=None)
@given(rows=st.integers(0, 12), cols=st.integers(0, 70), transposed=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       fp8_dtype=st.sampled_from([torch.float8_e4m3fn, torch.float8_e5m2]), seed=st.integers(0, 2**31))
def test_column_scale_any_shape_and_view(rows, cols, transposed, dtype, fp8_dtype, seed):
    """quantize_rows with col_scale: the reference's bits for any size (empty too), dtype, format and a transposed x."""
    from kernels import runtime

    device = runtime.device()
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(cols, rows, generator=gen) if transposed else torch.randn(rows, cols, generator=gen)
    x = (base.t() if transposed else base).to(device, dtype)
    cs = torch.logspace(-2, 2, cols).to(device)
    q, s = quantize_rows(x, fp8_dtype, col_scale=cs)
    rq, rs = quantize_rows_reference(x, fp8_dtype, col_scale=cs)
    assert q.shape == (rows, cols) and s.shape == (rows,)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
