"""The fused LoRA linear and its two GEMMs against float64: output and every gradient (x, A, B; W and the bias when
they train), float32 and bfloat16, odd lengths, r = 1, rsLoRA's scale, 3-D and strided inputs, checkpointing,
the operators, bad input. Then LoRA layers on one input as one node (``kernels.lora.lora_group``) against float64
and against the layers fused one by one: ranks that differ per layer, no tokens, any shape and layout."""

import pytest
import strategies
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.checkpoint import checkpoint

from kernels import runtime as kernels_runtime
from kernels.gemm import gemm_epilogue, splitk_config, splitk_mm
from kernels.lora import (
    GROUP_EPILOGUES,
    SwiGLULoRADownFunction,
    lora_group,
    lora_linear,
    lora_linear_reference,
    lora_scale,
    swiglu_lora_down,
)
from kernels.reference import relative_error
from kernels.runtime import DeviceProps
from kernels.tolerances import RELATIVE_ERROR_TOL as TOL

COMBOS = [("cublas", "cublas"), ("cublas_lowrank_first", "cublas"), ("triton", "splitk"), ("merged", "cublas"),
          ("auto", "cublas")]


def _layer(gen, device, dtype, n_in, n_out, rank, adapter_dtype=torch.float32, bias=False):
    w = (torch.randn(n_out, n_in, generator=gen, dtype=torch.float64) / n_in**0.5).to(device, dtype)
    b = torch.randn(n_out, generator=gen, dtype=torch.float64).to(device, dtype) if bias else None
    a = (torch.randn(rank, n_in, generator=gen, dtype=torch.float64) / n_in**0.5).to(device, adapter_dtype)
    bb = torch.randn(n_out, rank, generator=gen, dtype=torch.float64).to(device, adapter_dtype)  # never zero
    return w, b, a, bb


def _errors(x, w, bias, a, b, scale, dy, epilogue, skinny, train_base=False):
    """Relative errors of y and of every gradient against the same computation in float64."""
    leaves = [x.detach().requires_grad_(), w.detach().requires_grad_(train_base),
              None if bias is None else bias.detach().requires_grad_(train_base),
              a.detach().requires_grad_(), b.detach().requires_grad_()]
    y = lora_linear(*leaves, scale, epilogue=epilogue, skinny=skinny)
    y.backward(dy)
    refs = [None if t is None else t.detach().double().requires_grad_(t.requires_grad) for t in leaves]
    y64 = lora_linear_reference(*refs, scale)
    y64.backward(dy.double())
    assert y.dtype == x.dtype and y.shape == y64.shape
    errors = {"y": relative_error(y, y64)}
    for name, t, r in zip(("dx", "dw", "dbias", "dA", "dB"), leaves, refs):
        if t is not None and t.requires_grad:
            assert t.grad is not None and t.grad.dtype == t.dtype, name
            errors[name] = relative_error(t.grad, r.grad)
    return errors


@pytest.mark.parametrize("epilogue,skinny", COMBOS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank,rslora", [(1, False), (6, True)])
def test_lora_linear_against_float64(device, gen, dtype, epilogue, skinny, rank, rslora):
    n_in, n_out = 72, 97  # no multiple of any tile; 3-D x with 2 × 67 tokens
    w, bias, a, b = _layer(gen, device, dtype, n_in, n_out, rank, bias=rank == 1)
    x = torch.randn(2, 67, n_in, generator=gen, dtype=torch.float64).to(device, dtype)
    dy = torch.randn(2, 67, n_out, generator=gen, dtype=torch.float64).to(device, dtype)
    errors = _errors(x, w, bias, a, b, lora_scale(16, rank, rslora), dy, epilogue, skinny)
    assert set(errors) == {"y", "dx", "dA", "dB"}
    for name, err in errors.items():
        assert err < TOL[dtype], (name, err)


@pytest.mark.parametrize("epilogue,skinny", COMBOS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("train_base", [False, True])
def test_down_proj_over_swiglu_keeps_no_product_and_matches_float64(device, gen, dtype, epilogue, skinny,
                                                                     train_base):
    # Llama's LoRA down_proj over its SwiGLU as one node: y and every gradient (gate, up, A, B, and W and the bias
    # when the base trains) against float64; gate and up are intermediate results, which its backward overwrites.
    n_mid, n_out, rank = 77, 45, 3
    w, bias, a, b = _layer(gen, device, dtype, n_mid, n_out, rank, bias=train_base)
    g0, u0 = (torch.randn(2, 29, n_mid, generator=gen, dtype=torch.float64).to(device, dtype).requires_grad_()
              for _ in range(2))
    dy = torch.randn(2, 29, n_out, generator=gen, dtype=torch.float64).to(device, dtype)
    leaves = [w.requires_grad_(train_base), None if bias is None else bias.requires_grad_(), a.requires_grad_(),
              b.requires_grad_()]
    scale = lora_scale(8, rank)
    y = SwiGLULoRADownFunction.apply(g0 * 1, u0 * 1, *leaves, scale, epilogue, skinny)
    # Saved: gate, up, W, A, B and the [tokens, r] xa; not the [tokens, n_mid] product.
    assert [tuple(s.shape) for s in y.grad_fn.saved_tensors] == [(2, 29, n_mid), (2, 29, n_mid), (n_out, n_mid),
                                                                  (rank, n_mid), (n_out, rank), (58, rank)]
    y.backward(dy)
    refs = [t.detach().double().requires_grad_(t.requires_grad) for t in (g0, u0)]
    refs += [None if t is None else t.detach().double().requires_grad_(t.requires_grad) for t in leaves]
    h = torch.nn.functional.silu(refs[0]) * refs[1]
    y64 = lora_linear_reference(h, *refs[2:], scale)
    y64.backward(dy.double())
    assert relative_error(y, y64) < TOL[dtype]
    for name, t, r in zip(("gate", "up", "W", "bias", "A", "B"), (g0, u0, *leaves), refs):
        if t is not None and t.requires_grad:
            assert t.grad is not None and relative_error(t.grad, r.grad) < TOL[dtype], name


@pytest.mark.parametrize("layout", ["leaves", "views of one tensor", "transposed"])
def test_down_proj_over_swiglu_leaves_a_callers_tensors_alone(device, gen, layout):
    # gate and up that are not the node's to overwrite (a caller's leaves, views of one, strided views): the
    # gradients are new tensors, gate and up keep their values, and every gradient matches float64.
    n_mid, n_out = 24, 10
    w, _, a, b = _layer(gen, device, torch.float32, n_mid, n_out, 2)
    values = torch.randn(2, 7, 2 * n_mid, generator=gen, dtype=torch.float64)
    if layout == "leaves":
        g0, u0 = (values[..., :n_mid].clone().to(device, torch.float32).requires_grad_(),
                  values[..., n_mid:].clone().to(device, torch.float32).requires_grad_())
        gate, up = g0, u0
    elif layout == "views of one tensor":
        g0 = values.to(device, torch.float32).requires_grad_()
        gate, up = g0[..., :n_mid], g0[..., n_mid:]
    else:
        g0 = values[..., :n_mid].transpose(0, 1).contiguous().to(device, torch.float32).requires_grad_()
        u0 = values[..., n_mid:].transpose(0, 1).contiguous().to(device, torch.float32).requires_grad_()
        gate, up = (g0 * 1).transpose(0, 1), (u0 * 1).transpose(0, 1)
    before = [t.detach().clone() for t in (gate, up)]
    a.requires_grad_(), b.requires_grad_()
    dy = torch.randn(2, 7, n_out, generator=gen, dtype=torch.float64)
    y = swiglu_lora_down(gate, up, w, None, a, b, 0.75)
    y.backward(dy.to(device, torch.float32))
    assert all(torch.equal(t.detach(), v) for t, v in zip((gate, up), before))
    g64, u64 = (t.detach().double().cpu().requires_grad_() for t in (gate, up))
    a64, b64 = (t.detach().double().cpu().requires_grad_() for t in (a, b))
    lora_linear_reference(torch.nn.functional.silu(g64) * u64, w.double().cpu(), None, a64, b64, 0.75).backward(dy)
    if layout == "views of one tensor":
        assert relative_error(g0.grad, torch.cat([g64.grad, u64.grad], -1)) < TOL[torch.float32]
    elif layout == "leaves":
        assert relative_error(g0.grad, g64.grad) < TOL[torch.float32]
        assert relative_error(u0.grad, u64.grad) < TOL[torch.float32]
    else:
        assert relative_error(g0.grad.transpose(0, 1), g64.grad) < TOL[torch.float32]
        assert relative_error(u0.grad.transpose(0, 1), u64.grad) < TOL[torch.float32]
    assert relative_error(a.grad, a64.grad) < TOL[torch.float32]
    assert relative_error(b.grad, b64.grad) < TOL[torch.float32]


def test_down_proj_over_swiglu_bad_input(device, gen):
    w, _, a, b = _layer(gen, device, torch.float32, 24, 10, 2)
    gate = torch.randn(5, 24, generator=gen).to(device)
    with pytest.raises(ValueError, match="one shape, dtype and device"):
        swiglu_lora_down(gate, gate[:, :20], w, None, a, b, 1.0)
    with pytest.raises(ValueError, match="in_features=24"):
        swiglu_lora_down(gate[:, :20], gate[:, :20], w, None, a, b, 1.0)
    with pytest.raises(TypeError, match="float64"):
        swiglu_lora_down(gate.double(), gate.double(), w, None, a, b, 1.0)
    with pytest.raises(TypeError, match="must be a tensor"):
        swiglu_lora_down(gate, None, w, None, a, b, 1.0)


@pytest.mark.parametrize("epilogue,skinny", COMBOS)
def test_trained_base_and_bias_and_bf16_adapters(device, gen, epilogue, skinny):
    w, bias, a, b = _layer(gen, device, torch.bfloat16, 40, 33, 3, adapter_dtype=torch.bfloat16, bias=True)
    x = torch.randn(37, 40, generator=gen).to(device, torch.bfloat16)
    dy = torch.randn(37, 33, generator=gen).to(device, torch.bfloat16)
    errors = _errors(x, w, bias, a, b, 0.5, dy, epilogue, skinny, train_base=True)
    assert set(errors) == {"y", "dx", "dw", "dbias", "dA", "dB"}
    for name, err in errors.items():
        assert err < TOL[torch.bfloat16], (name, err)


def test_strided_input_and_float32_exactness(device, gen):
    w, bias, a, b = _layer(gen, device, torch.float32, 48, 50, 4)
    x = torch.randn(30, 96, generator=gen).to(device)[:, ::2]  # a non-contiguous view
    dy = torch.randn(30, 50, generator=gen).to(device)
    for epilogue, skinny in COMBOS:
        errors = _errors(x, w, bias, a, b, 2.0, dy, epilogue, skinny)
        assert max(errors.values()) < TOL[torch.float32], errors


@pytest.mark.parametrize("epilogue,skinny", COMBOS)
def test_under_checkpointing(device, gen, epilogue, skinny):
    w, _, a, b = _layer(gen, device, torch.float32, 24, 20, 2)
    x = torch.randn(19, 24, generator=gen).to(device)
    results = []
    for use_checkpoint in (False, True):
        xx, aa, bb = (t.detach().requires_grad_() for t in (x, a, b))

        def layer(inp, aa=aa, bb=bb):
            return torch.tanh(lora_linear(inp, w, None, aa, bb, 1.5, epilogue=epilogue, skinny=skinny))

        y = checkpoint(layer, xx, use_reentrant=False) if use_checkpoint else layer(xx)
        y.square().sum().backward()
        results.append([y.detach(), xx.grad, aa.grad, bb.grad])
    for plain, recomputed in zip(*results):
        torch.testing.assert_close(recomputed, plain, rtol=0, atol=0)


def test_bad_input(device, gen):
    w, _, a, b = _layer(gen, device, torch.float32, 16, 8, 2)
    x = torch.randn(3, 16, generator=gen).to(device)
    with pytest.raises(TypeError, match="x must be float32, bfloat16 or float16, got torch.float64"):
        lora_linear(x.double(), w, None, a, b, 1.0)
    with pytest.raises(TypeError, match="weight .* must have x's dtype"):
        lora_linear(x, w.bfloat16(), None, a, b, 1.0)
    with pytest.raises(ValueError, match="in_features=16"):
        lora_linear(x[:, :15], w, None, a, b, 1.0)
    with pytest.raises(ValueError, match="lora_b must be"):
        lora_linear(x, w, None, a, b[:, :1], 1.0)
    with pytest.raises(ValueError, match="epilogue must be"):
        lora_linear(x, w, None, a, b, 1.0, epilogue="cutlass")
    with pytest.raises(TypeError, match="scale must be a finite float"):
        lora_linear(x, w, None, a, b, float("nan"))
    with pytest.raises(ValueError, match="rank must be a positive int"):
        lora_scale(16, 0)


def test_operators_opcheck(device, gen):
    w, bias, a, b = _layer(gen, device, torch.float32, 20, 12, 3, bias=True)
    x = torch.randn(9, 20, generator=gen).to(device)
    torch.library.opcheck(torch.ops.kernels.lora_linear_fwd.default, (x, w, bias, a, b, 0.5, "triton"))
    xa = x @ a.t()
    dy = torch.randn(9, 12, generator=gen).to(device)
    torch.library.opcheck(torch.ops.kernels.lora_linear_bwd.default,
                          (dy, x, w, a, b, xa, 0.5, True, "triton", "splitk"))
    torch.library.opcheck(torch.ops.kernels.splitk_mm.default, (dy, x, 1.0, torch.float32))


# ---------------------------------------------------------------------------------------------------------------------
# The two GEMMs on their own
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_epilogue_against_torch(device, gen, dtype):
    m, k, n, r = 70, 45, 130, 5
    a = torch.randn(m, k, generator=gen).to(device, dtype)
    w = torch.randn(n, k, generator=gen).to(device, dtype)
    u = torch.randn(m, r, generator=gen).to(device, dtype)
    v = torch.randn(r, n, generator=gen).to(device, dtype)
    bias = torch.randn(n, generator=gen).to(device, dtype)
    ref = a.double() @ w.double().t() + 0.3 * u.double() @ v.double() + bias.double()
    assert relative_error(gemm_epilogue(a, w.t(), u, v, 0.3, bias), ref) < TOL[dtype]
    assert relative_error(gemm_epilogue(a, w.t()), a.double() @ w.double().t()) < TOL[dtype]
    with pytest.raises(ValueError, match="give both or neither"):
        gemm_epilogue(a, w.t(), u)


@pytest.mark.parametrize("tokens", [1, 63, 301])
def test_splitk_against_torch(device, gen, tokens):
    g = torch.randn(tokens, 7, generator=gen).to(device, torch.bfloat16)
    x = torch.randn(tokens, 90, generator=gen).to(device, torch.bfloat16)
    out = splitk_mm(g, x, 0.25)
    assert out.dtype == torch.float32 and out.shape == (7, 90)
    assert relative_error(out, 0.25 * g.double().t() @ x.double()) < 1e-5  # float32 accumulation of exact products
    with pytest.raises(ValueError, match="same number of rows"):
        splitk_mm(g, x[:-1] if tokens > 1 else x[:0])


def test_splitk_config_fills_the_gpu():
    h200 = DeviceProps("H200", False, 132, 227 * 1024, 65536)
    cfg = splitk_config(8192, 16, 4096, h200)  # dA at the 8B shape: 32 tiles, so the tokens are split
    tiles = (16 + cfg.block_m - 1) // cfg.block_m * ((4096 + cfg.block_n - 1) // cfg.block_n)
    assert cfg.splits > 1 and tiles * cfg.splits >= h200.sm_count
    assert cfg.splits * cfg.chunk >= 8192 > (cfg.splits - 1) * cfg.chunk and cfg.chunk % cfg.block_t == 0


def test_compiles_without_graph_break(device, gen):
    from kernels import runtime

    w, bias, a, b = _layer(gen, device, torch.float32, 24, 18, 2, bias=True)
    x = torch.randn(11, 24, generator=gen).to(device)

    def step(x, a, b):
        return lora_linear(x, w, bias, a, b, 0.5, epilogue="triton", skinny="splitk").square().sum()

    compiled = torch.compile(step, backend=runtime.COMPILE_BACKEND, fullgraph=True)
    results = []
    for fn in (step, compiled):
        leaves = [t.detach().requires_grad_() for t in (x, a, b)]
        fn(*leaves).backward()
        results.append([t.grad for t in leaves])
    for eager, traced in zip(*results):
        torch.testing.assert_close(traced, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("epilogue,skinny", COMBOS)
def test_llama_shapes_on_the_gpu(gen, epilogue, skinny):
    """bf16 at a Llama-3.1-8B projection's shape (k_proj: 4,096 → 1,024, r=16) on 4,099 tokens (no multiple of any
    tile), against float64."""
    device = torch.device("cuda")
    w, _, a, b = _layer(gen, device, torch.bfloat16, 4096, 1024, 16)
    x = torch.randn(4099, 4096, generator=gen).to(device, torch.bfloat16)
    dy = torch.randn(4099, 1024, generator=gen).to(device, torch.bfloat16)
    errors = _errors(x, w, None, a, b, 2.0, dy, epilogue, skinny)
    for name, err in errors.items():
        assert err < TOL[torch.bfloat16], (name, err)


@pytest.mark.parametrize("epilogue,skinny", COMBOS)
def test_edges_zero_tokens_and_an_expanded_input(device, gen, epilogue, skinny):
    w, _, a, b = _layer(gen, device, torch.float32, 20, 9, 2)
    empty = torch.zeros(0, 20, device=device, requires_grad=True)
    y = lora_linear(empty, w, None, a.requires_grad_(), b.requires_grad_(), 1.0, epilogue=epilogue, skinny=skinny)
    y.sum().backward()
    assert y.shape == (0, 9) and empty.grad.shape == (0, 20)
    assert torch.equal(a.grad, torch.zeros_like(a)) and torch.equal(b.grad, torch.zeros_like(b))
    row = torch.randn(1, 20, generator=gen).to(device)
    expanded = row.expand(6, 20)  # stride 0 along the tokens: every row the same memory
    dy = torch.randn(6, 9, generator=gen).to(device)
    errors = _errors(expanded, w, None, a.detach(), b.detach(), 0.5, dy, epilogue, skinny)
    assert max(errors.values()) < TOL[torch.float32], errors


@given(tokens=strategies.sizes(40), n_in=strategies.sizes(40, allow_zero=False),
       n_out=strategies.sizes(40, allow_zero=False), rank=st.integers(1, 8), dtype=strategies.kernel_dtypes(),
       layout=strategies.layouts(), combo=st.sampled_from(COMBOS), seed=st.integers(0, 2**31 - 1),
       weight_layouts=st.tuples(*[st.sampled_from(["contiguous", "strided", "transposed", "offset"])] * 3))
def test_any_shape_dtype_and_layout_against_float64(tokens, n_in, n_out, rank, dtype, layout, combo, seed,
                                                   weight_layouts):
    """Every gradient against float64, measured against the size of the sums that make it up (‖got − want‖ over
    ‖the same products with absolute values‖): a single output whose terms cancel is held to the rounding of its
    terms, not of its small result; where nothing cancels this is the plain relative error."""
    gen = torch.Generator().manual_seed(seed)
    device = kernels_runtime.device()
    values = torch.randn(tokens, n_in, generator=gen, dtype=torch.float64).to(dtype).double()
    if layout == "expanded" and tokens > 1:
        values = values[:1].expand(tokens, n_in).clone()
    leaf, view = strategies.shaped_leaf(values.to(device, dtype), layout)
    leaf64, view64 = strategies.shaped_leaf(values, layout)
    w, _, a, b = _layer(gen, device, dtype, n_in, n_out, rank)
    # The base weight and the adapters in any layout too (a view into a larger buffer, a transpose, an offset).
    w, a, b = (strategies.laid_out(t, how) for t, how in zip((w, a, b), weight_layouts))
    aa, bb = (strategies.shaped_leaf(t, how)[1] for t, how in zip((a, b), weight_layouts[1:]))
    aa.retain_grad(), bb.retain_grad()  # views of leaves (or the leaves): their gradients, in the views' shapes
    dy = torch.randn(tokens, n_out, generator=gen, dtype=torch.float64).to(dtype).double()
    y = lora_linear(view, w, None, aa, bb, 1.5, epilogue=combo[0], skinny=combo[1])
    y.backward(dy.to(device, dtype))
    w64, a64, b64 = (t.double().cpu() for t in (w, a, b))
    a64.requires_grad_(), b64.requires_grad_()
    y64 = lora_linear_reference(view64, w64, None, a64, b64, 1.5)
    y64.backward(dy)
    x64 = view64.detach()
    y_mag = (x64.abs() @ w64.abs().t() + 1.5 * (x64.abs() @ a64.detach().abs().t()) @ b64.detach().abs().t()).norm()
    assert y.shape == y64.shape and y.dtype == dtype
    if y_mag > 0:
        assert float((y.detach().double().cpu() - y64.detach()).norm() / y_mag) < TOL[dtype], ("y", layout, dtype)
    # The same sums of products with every factor replaced by its absolute value.
    dxa_mag = 1.5 * dy.abs() @ b64.detach().abs()
    mags = {"dx": dy.abs() @ w64.abs() + dxa_mag @ a64.detach().abs(), "dA": dxa_mag.t() @ x64.abs(),
            "dB": 1.5 * dy.abs().t() @ (x64.abs() @ a64.detach().abs().t())}
    if layout == "expanded" and tokens > 1:  # the leaf is the one row all tokens share: its gradient sums them
        mags["dx"] = mags["dx"].sum(0, keepdim=True)
    # The leaves may be whole buffers around the views (zero gradient where a view does not reach): compare them
    # whole; the magnitudes are the view's.
    for name, got, want in (("dx", leaf.grad, leaf64.grad), ("dA", aa.grad, a64.grad), ("dB", bb.grad, b64.grad)):
        assert got is not None and got.shape == want.shape, name
        mag = mags[name].norm()
        if mag > 0:
            error = float((got.double().cpu() - want).norm() / mag)
            assert error < TOL[dtype], (name, layout, dtype, error)
        else:
            assert torch.all(got == 0), name


# LoRA layers on one input as one node (lora_group).

# q, k and v of a small GQA block: three output widths, three ranks, a bias on one layer.
OUTS, RANKS, SCALES = (40, 16, 16), (4, 1, 2), (2.0, 0.5, 8.0)


def _group(gen, device, dtype, n_in=36, outs=OUTS, ranks=RANKS, biases=(True, False, False)):
    return [_layer(gen, device, dtype, n_in, n_out, r, bias=bias) for n_out, r, bias in zip(outs, ranks, biases)]


def _leaves(layers, train_base=False):
    return [[None if t is None else t.detach().requires_grad_(train_base or i >= 2) for i, t in enumerate(layer)]
            for layer in layers]


def _run(fn, x, layers, dys):
    """Outputs and every gradient of ``fn(x, layers)`` under the output gradients ``dys``."""
    outputs = fn(x, layers)
    torch.autograd.backward(outputs, dys)
    grads = [x.grad] + [t.grad for layer in layers for t in layer if t is not None and t.requires_grad]
    return outputs, grads


def _grouped(epilogue):
    def fn(x, layers):
        return lora_group(x, *(list(col) for col in zip(*layers)), SCALES, epilogue=epilogue)
    return fn


def _reference(x, layers):
    return [lora_linear_reference(x, *layer, s) for layer, s in zip(layers, SCALES)]


@pytest.mark.parametrize("epilogue", GROUP_EPILOGUES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("train_base", [False, True])
def test_group_against_float64(device, gen, dtype, epilogue, train_base):
    layers = _group(gen, device, dtype)
    x = torch.randn(2, 23, 36, generator=gen, dtype=torch.float64).to(device, dtype)
    dys = [torch.randn(2, 23, n, generator=gen, dtype=torch.float64).to(device, dtype) for n in OUTS]
    got = _run(_grouped(epilogue), x.clone().requires_grad_(), _leaves(layers, train_base), dys)
    layers64 = [[None if t is None else t.double() for t in layer] for layer in layers]
    want = _run(_reference, x.double().requires_grad_(), _leaves(layers64, train_base), [d.double() for d in dys])
    assert len(got[1]) == len(want[1]) == 1 + 2 * 3 + (3 + 1 if train_base else 0)  # x, A/B's, W's and a bias
    for i, (a, b) in enumerate(zip(got[0] + got[1], want[0] + want[1])):
        assert a.shape == b.shape and a.dtype in (dtype, torch.float32), i
        assert relative_error(a, b) < TOL[dtype], (i, relative_error(a, b))


def test_group_is_the_layers_one_by_one(device, gen):
    # float32: the same sums as three fused layers, to rounding; the group also returns separate tensors.
    layers = _group(gen, device, torch.float32)
    x = torch.randn(31, 36, generator=gen).to(device)
    dys = [torch.randn(31, n, generator=gen).to(device) for n in OUTS]

    def one_by_one(x, layers):
        return [lora_linear(x, *layer, s) for layer, s in zip(layers, SCALES)]

    got = _run(_grouped("cublas_lowrank_first"), x.clone().requires_grad_(), _leaves(layers), dys)
    want = _run(one_by_one, x.clone().requires_grad_(), _leaves(layers), dys)
    assert len({y.data_ptr() for y in got[0]}) == 3
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        assert relative_error(a, b) < 1e-5


def test_group_no_tokens_and_checkpointing(device, gen):
    layers = _leaves(_group(gen, device, torch.float32))
    empty = torch.zeros(0, 36, device=device, requires_grad=True)
    outputs = _grouped("cublas")(empty, layers)
    sum(y.sum() for y in outputs).backward()
    assert [tuple(y.shape) for y in outputs] == [(0, n) for n in OUTS] and empty.grad.shape == (0, 36)
    assert all(torch.equal(t.grad, torch.zeros_like(t)) for layer in layers for t in layer[2:])
    x = torch.randn(9, 36, generator=gen).to(device)
    dys = [torch.randn(9, n, generator=gen).to(device) for n in OUTS]
    fn = _grouped("cublas_lowrank_first")
    plain = _run(fn, x.clone().requires_grad_(), _leaves(layers), dys)
    checkpointed = _run(lambda x, layers: checkpoint(fn, x, layers, use_reentrant=False), x.clone().requires_grad_(),
                        _leaves(layers), dys)
    for a, b in zip(plain[0] + plain[1], checkpointed[0] + checkpointed[1]):
        assert torch.equal(a, b)


def test_bad_group(device, gen):
    layers = _group(gen, device, torch.float32)
    x = torch.randn(4, 36, generator=gen).to(device)
    weights, biases, a_s, b_s = (list(col) for col in zip(*layers))
    with pytest.raises(ValueError, match="one weight, bias"):
        lora_group(x, weights, biases[:2], a_s, b_s, SCALES)
    with pytest.raises(ValueError, match="epilogue must be one of"):
        lora_group(x, weights, biases, a_s, b_s, SCALES, epilogue="triton")
    with pytest.raises(ValueError, match="in_features=30"):
        lora_group(x, [weights[0][:, :30]] + weights[1:], biases, a_s, b_s, SCALES)
    with pytest.raises(TypeError, match="share one dtype"):
        lora_group(x, weights, biases, [a_s[0].to(torch.bfloat16)] + a_s[1:], b_s, SCALES)
    with pytest.raises(TypeError, match="float64"):
        lora_group(x.double(), weights, biases, a_s, b_s, SCALES)


@given(tokens=strategies.sizes(24), n_in=strategies.sizes(24, allow_zero=False),
       outs=st.lists(strategies.sizes(24, allow_zero=False), min_size=1, max_size=3),
       rank=st.integers(1, 5), dtype=strategies.kernel_dtypes(), layout=strategies.layouts(),
       epilogue=st.sampled_from(GROUP_EPILOGUES), seed=st.integers(0, 2**31 - 1))
def test_group_any_shape_dtype_and_layout_against_float64(tokens, n_in, outs, rank, dtype, layout, epilogue,
                                                         seed):
    """Outputs and every gradient against float64 through the same sums, measured against the same products with
    absolute values (as the fused layer's test does): x in any layout, one to three layers."""
    gen = torch.Generator().manual_seed(seed)
    device = kernels_runtime.device()
    values = torch.randn(tokens, n_in, generator=gen, dtype=torch.float64).to(dtype).double()
    leaf, view = strategies.shaped_leaf(values.to(device, dtype), layout)
    leaf64, view64 = strategies.shaped_leaf(values, layout)
    layers = [_layer(gen, device, dtype, n_in, n, rank) for n in outs]
    scales = [1.5] * len(outs)
    leaves = [[w, None, a.requires_grad_(), b.requires_grad_()] for w, _, a, b in layers]
    dys = [torch.randn(tokens, n, generator=gen, dtype=torch.float64).to(dtype).double() for n in outs]
    ys = lora_group(view, *(list(col) for col in zip(*leaves)), scales, epilogue=epilogue)
    torch.autograd.backward(ys, [d.to(device, dtype) for d in dys])
    x64 = view64.detach()
    for (w, _, a, b), y, dy in zip(leaves, ys, dys):
        w64, a64, b64 = (t.detach().double().cpu() for t in (w, a, b))
        y64 = lora_linear_reference(x64, w64, None, a64, b64, 1.5)
        y_mag = (x64.abs() @ w64.abs().t() + 1.5 * (x64.abs() @ a64.abs().t()) @ b64.abs().t()).norm()
        assert y.shape == y64.shape and y.dtype == dtype
        if y_mag > 0:
            assert float((y.detach().double().cpu() - y64).norm() / y_mag) < TOL[dtype]
        dxa64 = 1.5 * dy @ b64
        for name, got, want, mag in (
                ("dA", a.grad, dxa64.t() @ x64, (1.5 * dy.abs() @ b64.abs()).t() @ x64.abs()),
                ("dB", b.grad, 1.5 * dy.t() @ (x64 @ a64.t()), 1.5 * dy.abs().t() @ (x64.abs() @ a64.abs().t()))):
            assert got is not None and got.shape == want.shape, name
            if mag.norm() > 0:
                assert float((got.double().cpu() - want).norm() / mag.norm()) < TOL[dtype], (name, dtype)
            else:
                assert torch.all(got == 0), name
    y64 = sum(lora_linear_reference(view64, *(t.detach().double().cpu() if t is not None else None
                                               for t in layer), 1.5).mul(dy).sum()
              for layer, dy in zip(leaves, dys))
    y64.backward()
    mag = sum(dy.abs() @ w.detach().double().cpu().abs()
              + (1.5 * dy.abs() @ b.detach().double().cpu().abs()) @ a.detach().double().cpu().abs()
              for (w, _, a, b), dy in zip(leaves, dys))
    if layout == "expanded" and tokens > 1:
        mag = mag.sum(0, keepdim=True)
    assert leaf.grad is not None and leaf.grad.shape == leaf64.grad.shape
    if mag.norm() > 0:
        assert float((leaf.grad.double().cpu() - leaf64.grad).norm() / mag.norm()) < TOL[dtype], ("dx", layout)
    else:
        assert torch.all(leaf.grad == 0)
