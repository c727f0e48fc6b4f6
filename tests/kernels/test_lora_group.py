"""LoRA layers on one input as one node (``kernels.lora.lora_group``) against float64 and against the layers fused one
by one: every output and gradient (x, each A and B; W and the bias where they train), float32 and bfloat16, ranks
that differ per layer, odd sizes, no tokens, checkpointing, any shape and layout, bad input."""

import pytest
import strategies
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_lora import _layer
from torch.utils.checkpoint import checkpoint

from kernels import runtime as kernels_runtime
from kernels.lora import GROUP_EPILOGUES, lora_group, lora_linear, lora_linear_reference
from kernels.reference import relative_error
from kernels.tolerances import RELATIVE_ERROR_TOL as TOL

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
def test_any_shape_dtype_and_layout_against_float64(tokens, n_in, outs, rank, dtype, layout, epilogue, seed):
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
