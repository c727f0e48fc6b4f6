"""The frozen FP8 linear layer: the input-gradient kernel against its reference (odd shapes, every dtype, strided dy,
e4m3fn and e5m2, empty sizes), the forward against the dequantised FP8 product, dx against the float64 gradient of the
dequantised linear, the refusals, the module's properties and PEFT's lookups, the operator, ``convert_frozen_linears``
on a plain model; on a GPU, an 8B-like shape."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kernels import fp8_linear
from kernels import runtime as kernels_runtime
from kernels.fp8 import fp8_matmul_reference, quantize_rows_reference
from kernels.fp8_linear import (
    Fp8Linear,
    Fp8LinearFunction,
    Fp8Weight,
    convert_frozen_linears,
    fp8_weight_grad_input,
    fp8_weight_grad_input_reference,
    grad_input_config,
)
from kernels.reference import relative_error
from kernels.runtime import DeviceProps
from kernels.tolerances import RELATIVE_ERROR_TOL as TOL

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# A GPU's FP8 tensor cores sum each K-tile with fewer bits than float32 before the float32 accumulator
# (tests/kernels/test_fp8.py, the same bound): float32 output is exact to float32 only in the interpreter.
OUT_TOL = {**TOL, torch.float32: TOL[torch.float32] if kernels_runtime.INTERPRET else 2.0**-12}


def _weight(gen, n, k, device, dtype=torch.bfloat16, bias=False, fp8_dtype=torch.float8_e4m3fn):
    """A weight whose rows span two decades of magnitude, so that each output channel gets its own scale."""
    w = torch.randn(n, k, generator=gen, dtype=torch.float64) / k**0.5
    w *= torch.logspace(-1, 1, n, dtype=torch.float64)[torch.randperm(n, generator=gen)][:, None]
    b = torch.randn(n, generator=gen).to(device, dtype) if bias else None
    return Fp8Weight.from_linear(w.to(device, dtype), b, fp8_dtype)


def _assert_grad_input_matches(dy, w):
    dx = fp8_weight_grad_input(dy, w)
    assert dx.dtype == dy.dtype and dx.shape == (dy.shape[0], w.q.shape[1])
    exact = fp8_weight_grad_input_reference(dy, w, torch.float64)
    # the kernel against the float64 product of the same rounded operands: float32 accumulation, then dy's dtype
    assert relative_error(dx, exact) <= TOL[dy.dtype]
    if dy.dtype != torch.float32:
        # and against the float32 reference, which differs only in the order of float32 additions
        assert relative_error(dx, fp8_weight_grad_input_reference(dy, w)) <= TOL[dy.dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k", [(1, 1, 1), (37, 70, 100), (65, 129, 67)])
def test_grad_input_matches_the_reference(m, n, k, dtype, device, gen):
    w = _weight(gen, n, k, device)
    dy = torch.randn(m, n, generator=gen).to(device, dtype)
    _assert_grad_input_matches(dy, w)


def test_grad_input_float32_is_float32_exact(device, gen):
    w = _weight(gen, 70, 90, device)
    dy = torch.randn(33, 70, generator=gen).to(device)
    assert relative_error(fp8_weight_grad_input(dy, w), fp8_weight_grad_input_reference(dy, w, torch.float64)) <= 1e-5


def test_grad_input_bf16_rounds_the_weight_once(device, gen):
    # Ŵ rounded to bf16 (as a bf16 copy of it would be) and not kept in float32: the kernel is closer to the reference
    # that rounds than to the one that does not.
    w = _weight(gen, 64, 64, device)
    dy = torch.randn(64, 64, generator=gen).to(device, torch.bfloat16)
    dx = fp8_weight_grad_input(dy, w).double()
    rounded = dy.double() @ w.dequantized(torch.bfloat16).double()
    unrounded = dy.double() @ (w.q.double() * w.scale.double()[:, None])
    assert relative_error(dx, rounded) < relative_error(dx, unrounded)


def test_grad_input_strided_dy_and_e5m2(device, gen):
    w = _weight(gen, 40, 50, device, fp8_dtype=torch.float8_e5m2)
    big = torch.randn(40, 2 * 23, generator=gen).to(device, torch.bfloat16)
    _assert_grad_input_matches(big[:, ::2], _weight(gen, 23, 50, device))  # every other column
    _assert_grad_input_matches(torch.randn(40, 17, generator=gen).to(device, torch.bfloat16).t(), w)  # column-major


@given(m=st.integers(1, 70), n=st.integers(1, 70), k=st.integers(1, 70))
def test_grad_input_any_shape(m, n, k):
    g = torch.Generator().manual_seed(m * 10_000 + n * 100 + k)
    device = kernels_runtime.device()
    _assert_grad_input_matches(torch.randn(m, n, generator=g).to(device, torch.bfloat16), _weight(g, n, k, device))


def test_grad_input_empty_sizes(device, gen):
    w = _weight(gen, 8, 5, device)
    assert fp8_weight_grad_input(torch.ones(0, 8, device=device), w).shape == (0, 5)
    empty_n = Fp8Weight.from_linear(torch.ones(0, 5, device=device))
    dx = fp8_weight_grad_input(torch.ones(3, 0, device=device), empty_n)
    assert dx.shape == (3, 5) and not dx.any()


def test_from_linear_quantises_rows(device, gen):
    weight = torch.randn(9, 20, generator=gen).to(device, torch.bfloat16)
    bias = torch.randn(9, generator=gen).to(device, torch.bfloat16)
    w = Fp8Weight.from_linear(weight, bias)
    q, scale = quantize_rows_reference(weight)
    assert torch.equal(w.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(w.scale, scale)
    assert w.q.is_contiguous() and w.dtype == torch.bfloat16 and torch.equal(w.bias, bias)
    assert relative_error(w.dequantized(torch.float32), weight) < 2**-4  # half an e4m3 step at most


@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_is_the_fp8_product(dtype, device, gen):
    linear = torch.nn.Linear(48, 33, device=device, dtype=dtype).requires_grad_(False)
    layer = Fp8Linear.from_linear(linear)
    x = torch.randn(2, 7, 48, generator=gen).to(device, dtype)
    y = layer(x)
    assert y.shape == (2, 7, 33) and y.dtype == dtype
    xq, xs = quantize_rows_reference(x.reshape(-1, 48))
    w = layer.fp8_weight
    exact = fp8_matmul_reference(xq, xs, w.q, w.scale, torch.float64, torch.float64) + linear.bias.double()
    assert relative_error(y.reshape(-1, 33), exact) <= OUT_TOL[dtype]
    # and the FP8 product is near the unquantised layer (a forgotten scale would be off by orders of magnitude)
    assert relative_error(y, linear(x)) < 0.1


def test_forward_strided_input_and_no_bias(device, gen):
    layer = Fp8Linear.from_linear(torch.nn.Linear(24, 10, bias=False).to(device).requires_grad_(False))
    x = torch.randn(24, 11, generator=gen).to(device).t()  # [11, 24], column-major
    assert relative_error(layer(x), layer(x.contiguous())) == 0


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_input_gradient_against_the_dequantised_linear_in_float64(dtype, device, gen):
    # gradcheck cannot run in FP8: dx is compared with autograd's float64 gradient of x @ Ŵᵀ, Ŵ the dequantised weight
    # rounded to x's dtype
    layer = Fp8Linear.from_linear(torch.nn.Linear(40, 30, device=device).requires_grad_(False))
    x = torch.randn(3, 5, 40, generator=gen).to(device, dtype).requires_grad_()
    dy = torch.randn(3, 5, 30, generator=gen).to(device, dtype)
    layer(x).backward(dy)
    x64 = x.detach().double().requires_grad_()
    (x64 @ layer.fp8_weight.dequantized(dtype).double().t()).backward(dy.double())
    assert x.grad.dtype == dtype and relative_error(x.grad, x64.grad) <= TOL[dtype]


def test_backward_saves_no_input_and_skips_it_when_frozen(device, gen, monkeypatch):
    layer = Fp8Linear.from_linear(torch.nn.Linear(16, 8).to(device).requires_grad_(False))
    x = torch.randn(4, 16, generator=gen).to(device).requires_grad_()
    y = layer(x)
    saved = y.grad_fn.saved_tensors
    assert len(saved) == 2 and all(t.data_ptr() != x.data_ptr() for t in saved)
    assert not layer(x.detach()).requires_grad
    # a backward that x takes no part in (here a bias that requires grad) launches no input-gradient GEMM
    calls = []
    original = fp8_linear.ops.call
    monkeypatch.setattr(fp8_linear.ops, "call", lambda op, *args: calls.append(op) or original(op, *args))
    w = layer.fp8_weight
    bias = w.bias.clone().requires_grad_()
    Fp8LinearFunction.apply(x.detach(), w.q, w.scale, bias).sum().backward()
    assert fp8_linear.fp8_weight_grad_input_op not in calls and bias.grad is None


def test_from_linear_refuses_a_trainable_weight_and_other_inputs(device):
    linear = torch.nn.Linear(4, 3)
    with pytest.raises(ValueError, match="the FP8 base is frozen.*freeze it first or train it in bf16"):
        Fp8Linear.from_linear(linear)
    linear.weight.requires_grad_(False)
    with pytest.raises(ValueError, match="bias requires grad"):
        Fp8Linear.from_linear(linear)
    with pytest.raises(TypeError, match="nn.Linear"):
        Fp8Linear.from_linear(torch.nn.Conv1d(2, 2, 1))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        Fp8Weight.from_linear(torch.ones(3, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="2-D"):
        Fp8Weight.from_linear(torch.ones(3))
    with pytest.raises(ValueError, match=r"bias must have shape \(3,\)"):
        Fp8Weight.from_linear(torch.ones(3, 4), torch.ones(4))
    with pytest.raises(TypeError, match="fp8_dtype"):
        Fp8Weight.from_linear(torch.ones(3, 4), fp8_dtype=torch.bfloat16)


def test_refusals_of_the_kernel_and_the_module(device, gen):
    w = _weight(gen, 8, 6, device)
    with pytest.raises(TypeError, match="Fp8Weight"):
        fp8_weight_grad_input(torch.ones(2, 8, device=device), w.q)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        fp8_weight_grad_input(torch.ones(2, 8, dtype=torch.float64, device=device), w)
    with pytest.raises(ValueError, match="2-D"):
        fp8_weight_grad_input(torch.ones(8, device=device), w)
    with pytest.raises(ValueError, match="dy has 7 columns, the weight 8 rows"):
        fp8_weight_grad_input(torch.ones(2, 7, device=device), w)
    layer = Fp8Linear(w)
    with pytest.raises(ValueError, match=r"\[\.\.\., 6\]"):
        layer(torch.ones(2, 5, device=device))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        layer(torch.ones(2, 6, dtype=torch.float64, device=device))
    with pytest.raises(ValueError, match="device"):
        layer(torch.ones(2, 6, device="meta"))


def test_a_gpu_without_fp8_is_named(monkeypatch):
    monkeypatch.setattr(fp8_linear, "triton_problem", lambda device: "compute capability (8, 0) has no FP8 tensor "
                        "cores (sm_89 and up have)")
    with pytest.raises(RuntimeError, match=r"cannot run here: compute capability \(8, 0\).*Keep the base in bf16"):
        fp8_linear.require_fp8(torch.device("cpu"))


def test_convert_refuses_a_device_without_fp8_before_converting(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).requires_grad_(False)
    monkeypatch.setattr(fp8_linear, "triton_problem", lambda device: "compute capability (8, 0) has no FP8")
    with pytest.raises(RuntimeError, match=r"compute capability \(8, 0\)"):
        convert_frozen_linears(model)
    assert all(type(m) is torch.nn.Linear for m in model)


def test_empty_input(device, gen):
    layer = Fp8Linear.from_linear(torch.nn.Linear(6, 4).to(device).requires_grad_(False))
    x = torch.ones(0, 3, 6, device=device, requires_grad=True)
    y = layer(x)
    assert y.shape == (0, 3, 4)
    y.sum().backward()
    assert x.grad.shape == x.shape


def test_module_properties_repr_and_peft_lookups(device, gen):
    linear = torch.nn.Linear(20, 12, dtype=torch.bfloat16, device=device).requires_grad_(False)
    layer = Fp8Linear.from_linear(linear)
    assert (layer.in_features, layer.out_features) == (20, 12)
    assert list(layer.parameters()) == []
    assert layer.weight.dtype == torch.bfloat16 and layer.weight.shape == (12, 20)
    assert layer.weight.device == linear.weight.device
    with pytest.raises(AttributeError, match="stores its frozen weight in FP8.*dequantized"):
        _ = layer.weight.data
    text = repr(layer)
    assert "in_features=20, out_features=12, bias=True" in text and "float8_e4m3fn" in text and "bfloat16" in text
    assert relative_error(layer.dequantized(), linear.weight) < 2**-4
    # a model-wide cast leaves the codes and scales as they are (integer buffers): only the bias follows
    w_before = layer.dequantized()
    layer.to(torch.float16)
    assert torch.equal(layer.dequantized(), w_before) and layer.bias.dtype == torch.float16


def test_convert_frozen_linears_on_a_plain_model(device, gen):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model.add_module("lm_head", torch.nn.Linear(4, 4))
    model.to(device)[0].requires_grad_(False)
    model.lm_head.requires_grad_(False)
    assert convert_frozen_linears(model) == 1  # the trainable [2] and the skipped lm_head stay
    assert isinstance(model[0], Fp8Linear) and type(model[2]) is torch.nn.Linear
    assert type(model.lm_head) is torch.nn.Linear
    assert convert_frozen_linears(model, skip=()) == 1 and isinstance(model.lm_head, Fp8Linear)


def test_grad_input_config():
    assert grad_input_config(5, 5, 5, kernels_runtime.INTERPRETER).block_m == 64
    hopper = DeviceProps("H100-like", False, 132, 227 * 1024, 65536, (9, 0))
    small = DeviceProps("small shared memory", False, 30, 64 * 1024, 65536, (8, 9))
    assert grad_input_config(8192, 14336, 4096, hopper).block_m == 128
    assert grad_input_config(8192, 14336, 4096, small).block_m == 64


def test_opcheck(device, gen):
    w = _weight(gen, 16, 24, device)
    dy = torch.randn(9, 16, generator=gen).to(device, torch.bfloat16)
    before = [t.clone() for t in (dy, w.q, w.scale)]
    # test_schema would compare the FP8 input with arithmetic PyTorch's CPU lacks; that nothing is written is checked
    # on the bytes below
    torch.library.opcheck(fp8_linear.fp8_weight_grad_input_op, (dy, w.q, w.scale),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    for old, new in zip(before, (dy, w.q, w.scale)):
        assert torch.equal(old.view(torch.uint8), new.view(torch.uint8))


@pytest.mark.gpu
def test_gpu_8b_shape(gen):
    device = torch.device("cuda")
    w = _weight(gen, 14336, 4096, device)
    dy = torch.randn(256, 14336, generator=gen).to(device, torch.bfloat16)
    _assert_grad_input_matches(dy, w)
    layer = Fp8Linear(w)
    x = torch.randn(256, 4096, generator=gen).to(device, torch.bfloat16).requires_grad_()
    y = layer(x)
    xq, xs = quantize_rows_reference(x.detach())
    exact = fp8_matmul_reference(xq, xs, w.q, w.scale, torch.float64, torch.float64)
    assert relative_error(y, exact) <= TOL[torch.bfloat16]
    y.backward(dy)
    assert relative_error(x.grad, fp8_weight_grad_input_reference(dy, w, torch.float64)) <= TOL[torch.bfloat16]
