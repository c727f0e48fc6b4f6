"""RMSNorm: forward, dx and dW against a float64 reference; odd shapes, views, bad input; Llama shapes on a GPU."""

import pytest
import torch

import kernels
from kernels import host_path
from kernels.reference import relative_error, rms_norm_reference
from kernels.rmsnorm import TritonRMSNorm, rms_norm
from kernels.tolerances import RELATIVE_ERROR_TOL as TOL

# Relative-error bounds: float32 arithmetic lands near 1e-7; bf16 storage rounds each value by up to 2**-8.


def make_inputs(shape, dtype, device, gen, scale=1.0):
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(device)
    # Weights spread around 1 but never all ones: an all-ones weight hides a missing multiply or a transposed read.
    w = (0.5 + torch.rand(shape[-1], generator=gen, dtype=torch.float64)).to(dtype).to(device)
    dy = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).to(device)
    return x, w, dy


def check_against_float64(x, w, dy, eps=1e-6):
    """Run the kernel and the float64 reference; return relative errors of y, dx and dW."""
    xk = x.detach().clone().requires_grad_()
    wk = w.detach().clone().requires_grad_()
    y = rms_norm(xk, wk, eps)
    y.backward(dy)
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    y64 = rms_norm_reference(x64, w64, eps)
    y64.backward(dy.double())
    assert y.dtype == torch.result_type(w, x) and y.shape == x.shape
    assert xk.grad.dtype == x.dtype and wk.grad.dtype == w.dtype
    return relative_error(y, y64), relative_error(xk.grad, x64.grad), relative_error(wk.grad, w64.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape",
    [(1, 64), (7, 100), (2, 33, 300), (5, 1000), (3, 2, 4, 65), (129, 257)],
    ids=lambda s: "x".join(map(str, s)),
)
def test_matches_float64_reference(shape, dtype, device, gen):
    errors = check_against_float64(*make_inputs(shape, dtype, device, gen))
    assert all(e < TOL[dtype] for e in errors), f"relative errors y, dx, dW = {errors}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_magnitudes_and_custom_eps(dtype, device, gen):
    # 1e4 squared is 1e8 per element: the mean of squares must be taken in float32 without overflow or bf16 loss.
    errors = check_against_float64(*make_inputs((9, 513), dtype, device, gen, scale=1e4), eps=1e-5)
    assert all(e < TOL[dtype] for e in errors), f"relative errors y, dx, dW = {errors}"


def test_bf16_output_matches_hugging_face_to_the_bit_almost_everywhere(device, gen):
    # Same casts as LlamaRMSNorm, so the bf16 outputs agree bit for bit except where the float32 rsqrt itself differs
    # in its last bit (Triton's rsqrt vs torch.rsqrt) and that flips the bf16 rounding of x̂: rare. x̂ then differs by
    # one bf16 ulp, and the product w · x̂, rounded to bf16 again, by at most two: e.g. x̂ = -1.37109363 rounds to
    # -1.3671875 or -1.375, and times w = 1.28125 gives -1.75 or -1.765625 (seen with --seed 2892488183).
    x, w, _ = make_inputs((4, 37, 384), torch.bfloat16, device, gen)
    ours, ref = rms_norm(x, w).float(), rms_norm_reference(x, w).float()
    differ = ours != ref
    assert differ.float().mean().item() < 0.01, f"{differ.sum().item()} of {differ.numel()} elements differ"
    one_ulp = ref.abs() * 2.0**-7  # bf16 keeps 8 significant bits: neighbours are at most |v|·2**-7 apart
    assert ((ours - ref).abs() <= 2 * one_ulp * 1.0001).all(), "an element differs by more than two bf16 ulps"


def test_float32_weight_with_bf16_input_promotes_like_pytorch(device, gen):
    x, _, dy = make_inputs((6, 200), torch.bfloat16, device, gen)
    w = (0.5 + torch.rand(200, generator=gen)).to(device)
    errors = check_against_float64(x, w, dy.float())
    assert all(e < TOL[torch.bfloat16] for e in errors), errors


def test_non_contiguous_views(device, gen):
    base, w, _ = make_inputs((6, 11, 2 * 96), torch.float32, device, gen)
    views = {
        "column slice (row stride > width)": base[..., :96],
        "every other token": base[:, ::2, :96],
        "transposed leading dims": base[..., 96:].transpose(0, 1),
    }
    for name, x in views.items():
        dy = torch.randn(x.shape, generator=gen).to(device)
        errors = check_against_float64(x, w[:96], dy)
        assert all(e < TOL[torch.float32] for e in errors), f"{name}: {errors}"


def test_non_contiguous_upstream_gradient(device, gen):
    x, w, _ = make_inputs((8, 160), torch.float32, device, gen)
    dy = torch.randn(160, 8, generator=gen).to(device).t()  # a transposed gradient, stride (1, 8)
    errors = check_against_float64(x, w, dy)
    assert all(e < TOL[torch.float32] for e in errors), errors


def test_weight_without_grad_skips_dw(device, gen):
    x, w, dy = make_inputs((5, 70), torch.float32, device, gen)
    xk = x.clone().requires_grad_()
    rms_norm(xk, w).backward(dy)
    x64 = x.double().requires_grad_()
    rms_norm_reference(x64, w.double()).backward(dy.double())
    assert w.grad is None
    assert relative_error(xk.grad, x64.grad) < TOL[torch.float32]


def test_every_row_written_when_rows_exceed_one_program(device, gen):
    # More rows than one program's tile, not a multiple of it: the tail rows must be normalised too.
    rows = 4 * kernels.rmsnorm.forward_config(10_000, 64).rows + 3
    x, w, dy = make_inputs((rows, 64), torch.float32, device, gen)
    errors = check_against_float64(x, w, dy)
    assert all(e < TOL[torch.float32] for e in errors), errors


def test_module_shares_weight_with_hugging_face_norm(device, gen):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(96, eps=1e-5).to(device)
    with torch.no_grad():
        hf.weight.copy_(0.5 + torch.rand(96, generator=gen))
    ours = TritonRMSNorm.from_hf(hf)
    assert ours.weight is hf.weight and ours.variance_epsilon == 1e-5
    x = torch.randn(3, 5, 96, generator=gen).to(device)
    assert relative_error(ours(x), hf(x)) < 1e-6
    assert "96, eps=1e-05" in repr(ours)
    del transformers


def test_module_default_construction(device):
    norm = TritonRMSNorm(48, eps=1e-5).to(device)
    assert norm.weight.shape == (48,) and norm.variance_epsilon == 1e-5


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda d: (torch.randn(4, 8, device=d), torch.randn(9, device=d)), ValueError, "weight must have shape (8,)"),
        (lambda d: (torch.randn(4, 8, device=d), torch.randn(2, 4, device=d)), ValueError, "got (2, 4)"),
        (lambda d: (torch.ones(4, 8, dtype=torch.int32, device=d), torch.randn(8, device=d)), TypeError, "torch.int32"),
        (lambda d: (torch.randn(4, 8, device=d), torch.ones(8, dtype=torch.int64, device=d)), TypeError, "weight"),
        (lambda d: (torch.randn(4, 8, device=d), torch.randn(8, device="meta")), ValueError, "same device"),
        (lambda d: (torch.tensor(1.0, device=d), torch.randn(1, device=d)), ValueError, "scalar"),
    ],
    ids=["wrong-width", "2d-weight", "int-input", "int-weight", "device-mismatch", "scalar"],
)
def test_bad_input_raises_clear_errors(make, error, message, device):
    x, w = make(device)
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        rms_norm(x, w)


def test_empty_input(device):
    x = torch.randn(0, 16, device=device, requires_grad=True)
    w = torch.randn(16, device=device, requires_grad=True)
    y = rms_norm(x, w)
    y.sum().backward()
    assert y.shape == (0, 16) and x.grad.shape == (0, 16) and torch.equal(w.grad, torch.zeros_like(w))


# ---------------------------------------------------------------------------------------------------------------------
# GPU: Llama shapes, bf16, poisoned outputs
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("rows, hidden", [(16384, 4096), (4096, 4096), (8191, 2048), (3, 8192), (40000, 4096)])
def test_gpu_llama_shapes_bf16(rows, hidden, gen):
    x, w, dy = make_inputs((rows, hidden), torch.bfloat16, "cuda", gen)
    errors = check_against_float64(x, w, dy)
    assert all(e < TOL[torch.bfloat16] for e in errors), errors


@pytest.mark.gpu
def test_gpu_every_element_written(gen, monkeypatch):
    # Poison: make torch.empty hand out NaN-filled memory, so any element a kernel forgets to write stays NaN. The
    # Python path allocates through torch.empty; the C++ node (same kernels, same bits: tests/kernels/test_host_path.py)
    # allocates in C++, which the poison cannot reach, so it is turned off here.
    monkeypatch.setattr(host_path, "takes_rms_norm", lambda *args: False)
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    monkeypatch.setattr(torch, "empty_like",
                        lambda t, **kw: poisoned_empty(t.shape, dtype=kw.get("dtype", t.dtype), device=t.device))
    x, w, dy = make_inputs((16384 + 5, 4096), torch.bfloat16, "cuda", gen)
    xk = x.clone().requires_grad_()
    wk = w.clone().requires_grad_()
    y = rms_norm(xk, wk)
    y.backward(dy)
    for name, t in (("y", y), ("dx", xk.grad), ("dW", wk.grad)):
        assert torch.isfinite(t).all(), f"{name} has unwritten (NaN) elements"
    monkeypatch.undo()
    errors = check_against_float64(x, w, dy)
    assert all(e < TOL[torch.bfloat16] for e in errors), errors
