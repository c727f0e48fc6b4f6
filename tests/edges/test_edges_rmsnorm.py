"""The edges of ``rms_norm`` and ``TritonRMSNorm``: every input a caller can pass gives PyTorch's answer (Hugging
Face's LlamaRMSNorm formula, in float64) or a clear TypeError/ValueError.

The property test draws shapes (0, 1 and odd sizes), a dtype for x and another for the weight, a memory layout for
x, the weight and the incoming gradient, and which inputs require a gradient; it checks the output and every
gradient. What it found is kept below as plain regression tests, named for the case.
"""

import pytest
import strategies
import torch
from hypothesis import given
from hypothesis import strategies as st

from kernels import runtime
from kernels.reference import relative_error, rms_norm_reference
from kernels.rmsnorm import TritonRMSNorm, rms_norm, rms_norm_bwd_op, rms_norm_fwd_op
from kernels.tolerances import RELATIVE_ERROR_TOL as TOL


def tolerance(*dtypes: torch.dtype) -> float:
    """The bound of the least precise dtype involved (a bfloat16 x with a float32 weight rounds like bfloat16)."""
    return max(TOL[d] for d in dtypes)


def grad_error(grad: torch.Tensor, grad64: torch.Tensor, *scales: float) -> float:
    """A leaf's gradient against float64, relative to the largest of ‖grad64‖ and ``scales``: the norms of the
    terms the gradient is a sum or difference of, which float32 can only be exact to a fraction of.

    Two such sums cancel. A leaf broadcast by ``expand`` gets the sum of the view's rows of gradient (scale: the
    view's gradient). And dx = rstd · (g − x̂ · mean(g ⊙ x̂)) subtracts two terms of size ‖rstd · g‖, which at hidden
    size 1 (x̂ = ±1) cancel almost exactly (scale: ‖rstd · (dy ⊙ w)‖). Where nothing cancels, as for every
    non-expanded layout at realistic sizes, the scales are about ‖grad64‖ and this is the plain relative error; an
    all-zero gradient still fails it wherever the gradient is not itself negligible against its terms."""
    expected_norm = grad64.double().norm().item()
    diff = relative_error(grad, grad64) * (expected_norm if expected_norm > 0 else 1.0)
    return diff / max(expected_norm, *scales, 1e-300)


def make_input(values: torch.Tensor, layout: str, requires_grad: bool):
    """(leaf or None, what the op sees): ``strategies.shaped_leaf``'s view, detached when no gradient is wanted."""
    leaf, view = strategies.shaped_leaf(values, layout)
    return (leaf, view) if requires_grad else (None, view.detach())


@st.composite
def rms_cases(draw):
    lead = draw(strategies.leading_dims())
    return dict(
        lead=lead, hidden=draw(strategies.sizes(70)),
        x_dtype=draw(strategies.kernel_dtypes()), w_dtype=draw(strategies.kernel_dtypes()),
        x_layout=draw(strategies.layouts()), w_layout=draw(strategies.layouts()),
        dy_layout=draw(strategies.layouts()),
        grads=draw(st.sampled_from(["both", "x", "weight"])),
        scale=draw(st.sampled_from([1e-3, 1.0, 30.0])), eps=draw(st.sampled_from([1e-6, 1e-5])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def check_against_float64(case, device):
    """Run the case through ``rms_norm`` and the float64 reference; assert the output and every gradient match."""
    gen = torch.Generator().manual_seed(case["seed"])
    shape = (*case["lead"], case["hidden"])
    x_values = (torch.randn(shape, generator=gen) * case["scale"]).to(device, case["x_dtype"])
    w_values = (torch.randn(case["hidden"], generator=gen) + 0.5).to(device, case["w_dtype"])  # never all ones
    grad_x, grad_w = case["grads"] in ("both", "x"), case["grads"] in ("both", "weight")
    x_leaf, x = make_input(x_values, case["x_layout"], grad_x)
    w_leaf, w = make_input(w_values, case["w_layout"], grad_w)
    x64_leaf, x64 = make_input(x_values.double(), case["x_layout"], grad_x)
    w64_leaf, w64 = make_input(w_values.double(), case["w_layout"], grad_w)

    y = rms_norm(x, w, case["eps"])
    for view in (x64, w64):
        if view.requires_grad:
            view.retain_grad()  # the gradient of the view itself, before an expanded leaf sums it
    y64 = rms_norm_reference(x64, w64, case["eps"])
    assert y.shape == x.shape and y.dtype == torch.promote_types(x.dtype, w.dtype)
    tol = tolerance(x.dtype, w.dtype)
    assert relative_error(y, y64) < tol, ("y", relative_error(y, y64))

    dy = strategies.laid_out((torch.randn(y.shape, generator=gen)).to(device, y.dtype), case["dy_layout"])
    y.backward(dy)
    y64.backward(dy.double())
    if grad_w:
        assert w_leaf.grad is not None and w_leaf.grad.shape == w_leaf.shape
        err = grad_error(w_leaf.grad, w64_leaf.grad, w64.grad.norm().item())
        assert err < tol, ("dw", err)
    if grad_x:
        assert x_leaf.grad is not None and x_leaf.grad.shape == x_leaf.shape
        rstd = torch.rsqrt(x64.detach().pow(2).mean(-1, keepdim=True) + case["eps"])
        scale = (rstd * dy.double() * w64.detach()).norm().item()
        err = grad_error(x_leaf.grad, x64_leaf.grad, scale, x64.grad.norm().item())
        assert err < tol, ("dx", err)


@given(case=rms_cases())
def test_every_shape_dtype_and_layout_matches_float64(case, device):
    check_against_float64(case, device)


# --------------------------------------------------------------------------------------------------------------------
# Regression tests: the cases that were silently wrong
# --------------------------------------------------------------------------------------------------------------------


def test_strided_weight_is_read_with_its_stride(device, gen):
    # rms_norm(x, w[::2]) read the weight as if it were contiguous: output and dx wrong by O(1).
    case = dict(lead=(5,), hidden=8, x_dtype=torch.float32, w_dtype=torch.float32, x_layout="contiguous",
                w_layout="strided", dy_layout="contiguous", grads="both", scale=1.0, eps=1e-6,
                seed=int(torch.randint(0, 2**31 - 1, (), generator=gen)))
    check_against_float64(case, device)
    x = torch.randn(5, 8, generator=gen).to(device)
    wide = torch.randn(16, generator=gen).to(device)
    assert relative_error(rms_norm(x, wide[::2]), rms_norm_reference(x.double(), wide[::2].double())) < TOL[x.dtype]


@pytest.mark.parametrize("layout", ["strided", "offset", "expanded"])
def test_expanded_offset_and_strided_weights(device, gen, layout):
    case = dict(lead=(3, 7), hidden=33, x_dtype=torch.bfloat16, w_dtype=torch.float32, x_layout="transposed",
                w_layout=layout, dy_layout="expanded", grads="both", scale=1.0, eps=1e-6,
                seed=int(torch.randint(0, 2**31 - 1, (), generator=gen)))
    check_against_float64(case, device)


def test_module_whose_weight_parameter_is_strided_gets_its_gradient(device, gen):
    wide = torch.randn(2 * 24, generator=gen).to(device)
    module = TritonRMSNorm(24).to(device)
    module.weight = torch.nn.Parameter(wide[::2])  # a Parameter that is a strided view of a larger buffer
    assert not module.weight.is_contiguous()
    x = torch.randn(6, 24, generator=gen).to(device)
    w64 = wide[::2].double().requires_grad_()
    dy = torch.randn(6, 24, generator=gen).to(device)
    module(x).backward(dy)
    rms_norm_reference(x.double(), w64).backward(dy.double())
    assert relative_error(module(x), rms_norm_reference(x.double(), w64)) < TOL[torch.float32]
    assert relative_error(module.weight.grad, w64.grad) < TOL[torch.float32]


def test_hidden_size_zero_returns_empty_rows(device):
    # as_rows viewed [3, 0] as [-1, 0], which PyTorch cannot resolve: a RuntimeError instead of an empty result.
    x = torch.randn(3, 0, device=device, requires_grad=True)
    w = torch.randn(0, device=device, requires_grad=True)
    y = rms_norm(x, w)
    assert y.shape == (3, 0) and y.shape == rms_norm_reference(x, w).shape
    y.backward(torch.randn(3, 0, device=device))
    assert x.grad.shape == (3, 0) and w.grad.shape == (0,)
    y_rows, rstd = torch.ops.kernels.rms_norm_fwd(x.detach(), w.detach(), 1e-6)
    assert y_rows.shape == (3, 0) and rstd.shape == (0,)  # as the fake and the C++ operators say


@pytest.mark.parametrize("shape", [(0, 5), (2, 0, 5), (0,)])
def test_no_rows(device, shape):
    x = torch.randn(shape, device=device, requires_grad=True)
    w = torch.randn(shape[-1], device=device, requires_grad=True)
    y = rms_norm(x, w)
    assert y.shape == x.shape
    y.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w)) and x.grad.shape == x.shape


# --------------------------------------------------------------------------------------------------------------------
# dtypes: float64 and other non-kernel dtypes are refused, mixed kernel dtypes follow PyTorch's promotion
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["x", "weight"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float8_e4m3fn, torch.int32, torch.complex64])
def test_non_kernel_dtypes_are_refused_naming_the_argument(device, which, dtype):
    x = torch.randn(3, 8, device=device)
    w = torch.randn(8, device=device)
    args = {"x": x, "weight": w}
    args[which] = args[which].to(dtype)
    with pytest.raises(TypeError, match=f"^{which} must be"):
        rms_norm(args["x"], args["weight"])


def test_float64_error_says_what_to_do(device):
    with pytest.raises(TypeError, match=r"float32, bfloat16 or float16.*\.float\(\)"):
        rms_norm(torch.randn(2, 4, dtype=torch.float64, device=device), torch.randn(4, dtype=torch.float64,
                                                                                   device=device))


@pytest.mark.parametrize("x_dtype", strategies.KERNEL_DTYPES)
@pytest.mark.parametrize("w_dtype", strategies.KERNEL_DTYPES)
def test_mixed_dtypes_promote_as_hugging_face(device, gen, x_dtype, w_dtype):
    x = torch.randn(4, 40, generator=gen).to(device, x_dtype)
    w = torch.randn(40, generator=gen).to(device, w_dtype)
    hf = w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x_dtype)
    y = rms_norm(x, w)
    assert y.dtype == hf.dtype
    assert relative_error(y, rms_norm_reference(x.double(), w.double())) < tolerance(x_dtype, w_dtype)


# --------------------------------------------------------------------------------------------------------------------
# Tensors without data: meta and FakeTensor
# --------------------------------------------------------------------------------------------------------------------


def test_meta_tensors_give_shapes_and_dtypes():
    x = torch.randn(2, 3, 16, device="meta", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(16, device="meta", requires_grad=True)
    y = rms_norm(x, w)
    assert y.is_meta and y.shape == x.shape and y.dtype == torch.float32
    y.sum().backward()
    assert x.grad.is_meta and x.grad.shape == x.shape and x.grad.dtype == x.dtype
    assert w.grad.is_meta and w.grad.shape == w.shape and w.grad.dtype == w.dtype
    assert TritonRMSNorm(16, device="meta")(x).shape == x.shape


def test_fake_tensor_mode_gives_shapes_and_dtypes(device):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.randn(5, 0 + 12, device=device, dtype=torch.float16, requires_grad=True)
        w = torch.randn(12, device=device, dtype=torch.float16, requires_grad=True)
        y = rms_norm(x, w[:12])
        y.sum().backward()
        assert y.shape == (5, 12) and y.dtype == torch.float16
        assert x.grad.shape == x.shape and w.grad.shape == w.shape


def test_fake_implementations_agree_with_the_kernels(device, gen):
    # Hidden size 0 among them: the kernel's rstd must have the fake's shape (no rows of it).
    for shape in [(3, 0), (0, 4), (2, 3, 5)]:
        x = torch.randn(shape, generator=gen).to(device)
        w = torch.randn(shape[-1], generator=gen).to(device)[:shape[-1]]
        torch.library.opcheck(rms_norm_fwd_op, (x, w, 1e-6), test_utils=("test_schema", "test_faketensor"))
        _, rstd = torch.ops.kernels.rms_norm_fwd(x, w, 1e-6)
        args = (torch.randn(shape, generator=gen).to(device), x, w, rstd, True)
        torch.library.opcheck(rms_norm_bwd_op, args, test_utils=("test_schema", "test_faketensor"))


# --------------------------------------------------------------------------------------------------------------------
# TritonRMSNorm.from_hf: only a norm with LlamaRMSNorm's formula is converted
# --------------------------------------------------------------------------------------------------------------------


class RMSNormWithBias(torch.nn.Module):
    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))
        self.bias = torch.nn.Parameter(torch.zeros(n))
        self.variance_epsilon = eps

    def forward(self, x):
        return rms_norm_reference(x, self.weight, self.variance_epsilon) + self.bias


class RMSNormOtherEps(torch.nn.Module):
    """Says eps 1e-6, adds 1e-2: the conversion must not trust the attribute."""

    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))
        self.eps = 1e-6

    def forward(self, x):
        return rms_norm_reference(x, self.weight, 1e-2)


def gemma_norm(n):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    return GemmaRMSNorm(n, eps=1e-6)


@pytest.mark.parametrize("make, match", [
    (lambda n: torch.nn.LayerNorm(n), "subtracts the mean"),
    (lambda n: torch.nn.LayerNorm(n, bias=False), "subtracts the mean"),
    (gemma_norm, "1 \\+ weight"),
    (RMSNormWithBias, "has a bias"),
    (RMSNormOtherEps, "does not compute LlamaRMSNorm"),
], ids=["layernorm", "layernorm-no-bias", "gemma", "with-bias", "other-eps"])
def test_from_hf_refuses_a_norm_of_another_kind(make, match):
    with pytest.raises(TypeError, match=match):
        TritonRMSNorm.from_hf(make(16))


def test_from_hf_refuses_gemma_on_the_meta_device():
    with torch.device("meta"):
        module = gemma_norm(16)
    with pytest.raises(TypeError, match="1 \\+ weight"):
        TritonRMSNorm.from_hf(module)


@pytest.mark.parametrize("make", [
    lambda n: __import__("transformers.models.llama.modeling_llama", fromlist=["x"]).LlamaRMSNorm(n, eps=1e-5),
    lambda n: torch.nn.RMSNorm(n, eps=1e-5),
    lambda n: TritonRMSNorm(n, eps=1e-5),
], ids=["llama", "torch", "triton"])
def test_from_hf_converts_norms_with_llamas_formula(device, gen, make):
    module = make(16).to(device)
    with torch.no_grad():
        module.weight.copy_(torch.randn(16, generator=gen))
    ours = TritonRMSNorm.from_hf(module)
    assert ours.weight is module.weight and ours.variance_epsilon == 1e-5
    x = torch.randn(4, 16, generator=gen).to(device)
    assert relative_error(ours(x), rms_norm_reference(x.double(), module.weight.double(), 1e-5)) < TOL[x.dtype]


def test_from_hf_converts_a_llama_norm_on_the_meta_device():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    with torch.device("meta"):
        module = LlamaRMSNorm(32, eps=1e-5)
    ours = TritonRMSNorm.from_hf(module)
    assert ours.weight is module.weight and module.weight.is_meta


def test_from_hf_refuses_a_module_without_a_numeric_eps():
    module = torch.nn.RMSNorm(8)  # eps=None: torch's default depends on the input's dtype
    with pytest.raises(TypeError, match="eps"):
        TritonRMSNorm.from_hf(module)


@pytest.mark.skipif(runtime.MODE != "gpu", reason="the device check of gpu mode")
def test_gpu_mode_refuses_cpu_tensors():
    with pytest.raises(ValueError, match="CUDA tensors"):
        rms_norm(torch.randn(2, 4), torch.randn(4))
