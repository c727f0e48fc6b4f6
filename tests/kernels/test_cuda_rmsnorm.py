"""RMSNorm in C++: the CPU extension (built once per session) against float64, its fake implementation and opcheck;
the CUDA extension's forward, backward, dW and operators on a GPU; the side-by-side benchmark at tiny size."""

import json

import pytest
import torch

from kernels import cuda_rmsnorm
from kernels.bench import cuda_compare
from kernels.reference import relative_error, rms_norm_reference
from kernels.tolerances import RELATIVE_ERROR_TOL as TOL


def make_inputs(shape, dtype, device, gen, scale=1.0, w_dtype=None):
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(device)
    # Weights spread around 1, never all ones: an all-ones weight hides a missing multiply or a transposed read.
    w = (0.5 + torch.rand(shape[-1], generator=gen, dtype=torch.float64)).to(w_dtype or dtype).to(device)
    dy = torch.randn(shape, generator=gen, dtype=torch.float64).to(torch.promote_types(dtype, w.dtype)).to(device)
    return x, w, dy


def reference(x, w, eps=1e-6):
    return rms_norm_reference(x.double(), w.double(), eps)


# --------------------------------------------------------------------------------------------------------------------
# The C++ CPU extension (every machine with a C++ compiler)
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def cpu_extension():
    """The CPU extension, built (or taken from PyTorch's build cache) once for the whole session."""
    reason = cuda_rmsnorm.cpu_build_unavailable()
    if reason:
        pytest.skip(f"the C++ extension cannot be built here: {reason}")
    return cuda_rmsnorm.build_cpu()


def cpp_fwd(x, w, eps=1e-6):
    return torch.ops.kernels_cpp.rms_norm_fwd.default(x, w, eps)


def test_cpu_build_is_loaded_once_per_process(cpu_extension):
    assert cuda_rmsnorm.build_cpu() is cpu_extension  # the second call neither compiles nor loads again
    assert cpu_extension.seconds > 0 and cpu_extension.library.endswith(".so")
    assert "kernels_cpp::rms_norm_fwd" in str(torch.ops.kernels_cpp.rms_norm_fwd.default._schema)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 64), (7, 100), (2, 33, 300), (5, 1001), (3, 2, 4, 65)],
                         ids=lambda s: "x".join(map(str, s)))
def test_cpu_op_matches_float64(cpu_extension, shape, dtype, gen):
    x, w, _ = make_inputs(shape, dtype, "cpu", gen)
    y, rstd = cpp_fwd(x, w)
    assert y.shape == x.shape and y.dtype == dtype
    assert rstd.shape == (x.numel() // shape[-1],) and rstd.dtype == torch.float32
    assert relative_error(y, reference(x, w)) < TOL[dtype]
    rstd64 = (x.double().pow(2).mean(-1) + 1e-6).rsqrt().reshape(-1)
    assert relative_error(rstd, rstd64) < TOL[torch.float32]


def test_cpu_op_large_magnitudes_and_eps(cpu_extension, gen):
    x, w, _ = make_inputs((9, 513), torch.float32, "cpu", gen, scale=1e4)
    assert relative_error(cpp_fwd(x, w, 1e-5)[0], reference(x, w, 1e-5)) < TOL[torch.float32]
    tiny = x * 1e-7  # mean(x²) far below eps: eps decides the result, so a missing eps cannot pass
    assert relative_error(cpp_fwd(tiny, w, 1e-5)[0], reference(tiny, w, 1e-5)) < TOL[torch.float32]


def test_cpu_op_bf16_has_hugging_face_cast_order(cpu_extension, gen):
    # Rounding x̂ to bf16 before the weight product gives Hugging Face's bits; multiplying first changes many.
    x, w, _ = make_inputs((4, 37, 384), torch.bfloat16, "cpu", gen)
    ours, hf = cpp_fwd(x, w)[0].float(), rms_norm_reference(x, w).float()
    assert (ours != hf).float().mean().item() < 0.01
    assert ((ours - hf).abs() <= 2 * hf.abs() * 2.0**-7 * 1.0001).all()


def test_cpu_op_float32_weight_promotes_like_pytorch(cpu_extension, gen):
    x, w, _ = make_inputs((6, 200), torch.bfloat16, "cpu", gen, w_dtype=torch.float32)
    y = cpp_fwd(x, w)[0]
    assert y.dtype == torch.float32
    assert relative_error(y, reference(x, w)) < TOL[torch.bfloat16]


def test_cpu_op_strided_views(cpu_extension, gen):
    base, w, _ = make_inputs((6, 11, 2 * 96), torch.float32, "cpu", gen)
    views = {
        "column slice (row stride > width)": base[..., :96],
        "every other token": base[:, ::2, :96],
        "transposed leading dims": base[..., 96:].transpose(0, 1),
        "hidden not contiguous": base[..., ::2],
    }
    for name, view in views.items():
        err = relative_error(cpp_fwd(view, w[:96])[0], reference(view, w[:96]))
        assert err < TOL[torch.float32], f"{name}: relative error {err}"


def test_cpu_op_empty_input(cpu_extension):
    y, rstd = cpp_fwd(torch.empty(0, 64), torch.rand(64) + 0.5)
    assert y.shape == (0, 64) and rstd.shape == (0,)


# Inputs each operator must refuse with a Python exception (never a crash), the exception and its message.
BAD_INPUTS = [
    (lambda: (torch.randn(4, 8), torch.rand(7)), ValueError,
     r"weight must have shape \(8,\) to match the last dimension of x \(4, 8\), got \(7,\)"),
    (lambda: (torch.randn(4, 8, dtype=torch.float64), torch.rand(8, dtype=torch.float64)), TypeError, "float32"),
    (lambda: (torch.randn(4, 8), torch.rand(8, dtype=torch.bfloat16)), TypeError, "weight must have"),
]


@pytest.mark.parametrize("make, error, message", BAD_INPUTS)
def test_cpu_op_bad_input_raises_clear_errors(cpu_extension, make, error, message):
    with pytest.raises(error, match=message):
        cpp_fwd(*make())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_op_opcheck(cpu_extension, gen, dtype):
    # Schema, the fake implementation registered from Python, and tracing with static and dynamic shapes.
    x, w, _ = make_inputs((3, 5, 48), dtype, "cpu", gen)
    torch.library.opcheck(torch.ops.kernels_cpp.rms_norm_fwd.default, (x, w, 1e-6))
    torch.library.opcheck(torch.ops.kernels_cpp.rms_norm_fwd.default, (x[:, ::2], w, 1e-5))


def test_cpu_op_compiles_without_graph_break(cpu_extension, gen):
    x, w, _ = make_inputs((8, 64), torch.float32, "cpu", gen)
    torch._dynamo.reset()
    fn = torch.compile(lambda a, b: cpp_fwd(a, b)[0] * 2, backend="aot_eager", fullgraph=True)
    assert relative_error(fn(x, w), 2 * reference(x, w)) < TOL[torch.float32]


def test_rms_norm_cpp_checks_its_inputs(cpu_extension, gen):
    x, w, _ = make_inputs((4, 32), torch.float32, "cpu", gen)
    assert relative_error(cuda_rmsnorm.rms_norm_cpp(x, w), reference(x, w)) < TOL[torch.float32]
    with pytest.raises(ValueError, match="weight must have shape"):
        cuda_rmsnorm.rms_norm_cpp(x, w[:5])


# --------------------------------------------------------------------------------------------------------------------
# Without a GPU: clear errors; the benchmark and the line counts
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given where there is no GPU")
def test_no_gpu_gives_a_clear_error():
    assert "no CUDA GPU" in cuda_rmsnorm.cuda_build_unavailable()
    with pytest.raises(RuntimeError, match="cannot build the CUDA extension: no CUDA GPU"):
        cuda_rmsnorm.build_cuda()
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        cuda_rmsnorm.rms_norm_cuda(torch.randn(2, 8), torch.rand(8) + 0.5)


def test_sources_ship_with_the_package():
    assert cuda_rmsnorm.CPU_SOURCE.is_file() and cuda_rmsnorm.CUDA_SOURCE.is_file()
    text = cuda_rmsnorm.CUDA_SOURCE.read_text()
    assert "TORCH_LIBRARY(kernels_cuda" in text and "__shfl_xor_sync" in text and "atomicAdd" not in text


def test_line_counts_skip_blanks_comments_and_docstrings():
    assert cuda_compare.count_cpp_lines("int a;\n\n// note\n/* block\n comment */ int b; // tail\n") == 2
    src = 'def f(x):\n    """Doc\n    string."""\n    # comment\n\n    return x + 1\n'
    assert cuda_compare.count_python_lines(src) == 2
    loc = cuda_compare.lines_of_code()
    assert all(loc[k]["kernels"] > 20 for k in ("cuda", "triton", "cpp_cpu"))
    assert loc["cuda"]["host"] > 0 and loc["triton"]["host"] > 0


def test_comparison_runs_at_tiny_size(tmp_path):
    size = dict(tokens=(8,), hidden=96, hidden_sweep=(), hidden_sweep_tokens=8)
    results = cuda_compare.run_comparison(size=size, progress=False)
    rows = {(r["impl"], r["pass"]): r for r in results["rows"]}
    for impl in ("triton", "native"):
        for pass_ in ("fwd", "fwd+bwd"):
            assert rows[(impl, pass_)]["status"] == "ok", rows[(impl, pass_)]
    if not torch.cuda.is_available():
        assert rows[("cuda", "fwd")]["status"] == "skipped" and "GPU" in rows[("cuda", "fwd")]["note"]
        assert all(t["met"] is None for t in results["targets"])
    assert results["lines_of_code"]["cuda"]["kernels"] > 0
    json_path, png_path = cuda_compare.save_comparison(results, tmp_path)
    assert json.loads(json_path.read_text())["comparison"] == "cuda_rmsnorm" and png_path.stat().st_size > 0
    assert "targets:" in cuda_compare.report(results)


def test_targets_are_judged_from_device_times():
    def row(impl, ms, frac):
        return {"impl": impl, "tokens": 16384, "width": 4096, "pass": "fwd", "status": "ok", "device_ms": ms,
                "frac_copy": frac}

    met = cuda_compare.targets({"rows": [row("cuda", 0.074, 0.86), row("triton", 0.072, 0.88)]})
    assert [t["met"] for t in met] == [True, True]
    missed = cuda_compare.targets({"rows": [row("cuda", 0.080, 0.80), row("triton", 0.072, 0.88)]})
    assert [t["met"] for t in missed] == [False, False]


# --------------------------------------------------------------------------------------------------------------------
# The CUDA extension (GPU only)
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def cuda_extension():
    reason = cuda_rmsnorm.cuda_build_unavailable()
    if reason:
        pytest.skip(reason)
    return cuda_rmsnorm.build_cuda()


def forward_backward(fn, x, w, dy, eps=1e-6):
    xk = x.detach().clone().requires_grad_()
    wk = w.detach().clone().requires_grad_()
    y = fn(xk, wk, eps)
    y.backward(dy)
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    y64 = rms_norm_reference(x64, w64, eps)
    y64.backward(dy.double())
    assert y.dtype == torch.promote_types(x.dtype, w.dtype) and xk.grad.dtype == x.dtype and wk.grad.dtype == w.dtype
    return relative_error(y, y64), relative_error(xk.grad, x64.grad), relative_error(wk.grad, w64.grad)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 64), (7, 100), (2, 33, 300), (5, 1001), (3, 2, 4, 65), (129, 4096),
                                   (64, 8192), (3, 4104), (2, 40960)], ids=lambda s: "x".join(map(str, s)))
def test_gpu_forward_backward_match_float64(cuda_extension, shape, dtype, gen):
    # Widths that are multiples of 8 take the 16-byte path, the others the scalar fallback. On the 16-byte path the
    # forward keeps the row in registers up to 4 packs × 1,024 threads (32,768 bf16 values, 16,384 float32); 4,104
    # leaves the last thread with fewer packs than the others, and 40,960 is wide enough for the looping kernel.
    errors = forward_backward(cuda_rmsnorm.rms_norm_cuda, *make_inputs(shape, dtype, "cuda", gen))
    assert all(e < TOL[dtype] for e in errors), f"relative errors y, dx, dW = {errors}"


@pytest.mark.gpu
def test_gpu_float32_weight_large_values_and_eps(cuda_extension, gen):
    x, w, dy = make_inputs((33, 768), torch.bfloat16, "cuda", gen, scale=1e4, w_dtype=torch.float32)
    errors = forward_backward(cuda_rmsnorm.rms_norm_cuda, x, w, dy, eps=1e-5)
    assert all(e < TOL[torch.bfloat16] for e in errors), errors


@pytest.mark.gpu
def test_gpu_strided_and_misaligned_views(cuda_extension, gen):
    base, w, _ = make_inputs((6, 11, 2 * 96 + 8), torch.bfloat16, "cuda", gen)
    views = {
        "column slice": base[..., :96],
        "every other token": base[:, ::2, :96],
        "transposed leading dims": base[..., 96:192].transpose(0, 1),
        "rows starting 2 bytes off a 16-byte boundary (scalar fallback)": base[..., 1:97],
    }
    for name, view in views.items():
        dy = torch.randn(view.shape, generator=gen).to("cuda", torch.bfloat16)
        errors = forward_backward(cuda_rmsnorm.rms_norm_cuda, view, w[:96], dy)
        assert all(e < TOL[torch.bfloat16] for e in errors), f"{name}: {errors}"


@pytest.mark.gpu
def test_gpu_every_element_written(cuda_extension, gen):
    # Fill the caching allocator's blocks with NaN before the call: any output element the kernels skip stays NaN.
    x, w, dy = make_inputs((4099, 4096), torch.bfloat16, "cuda", gen)
    torch.empty(64 << 20, device="cuda").fill_(float("nan"))
    errors = forward_backward(cuda_rmsnorm.rms_norm_cuda, x, w, dy)
    assert all(e < TOL[torch.bfloat16] for e in errors), errors


@pytest.mark.gpu
@pytest.mark.parametrize("make, error, message", BAD_INPUTS)
def test_gpu_op_bad_input_raises_clear_errors(cuda_extension, make, error, message):
    # The operator's own checks, called directly (rms_norm_cuda checks in Python first): an error, not a crash.
    x, w = (t.cuda() for t in make())
    with pytest.raises(error, match=message):
        torch.ops.kernels_cuda.rms_norm_fwd.default(x, w, 1e-6)


@pytest.mark.gpu
def test_gpu_frozen_weight_skips_dw(cuda_extension, gen):
    x, w, dy = make_inputs((16, 256), torch.bfloat16, "cuda", gen)
    x.requires_grad_()
    cuda_rmsnorm.rms_norm_cuda(x, w).backward(dy)
    assert w.grad is None and x.grad is not None
    _, dw = torch.ops.kernels_cuda.rms_norm_bwd.default(dy, x.detach(), w, torch.ones(16, device="cuda"), False)
    assert dw.shape == (0,)


@pytest.mark.gpu
def test_gpu_dw_is_deterministic(cuda_extension, gen):
    x, w, dy = make_inputs((8192, 2048), torch.bfloat16, "cuda", gen)
    _, rstd = torch.ops.kernels_cuda.rms_norm_fwd.default(x, w, 1e-6)
    first = torch.ops.kernels_cuda.rms_norm_bwd.default(dy, x, w, rstd, True)[1]
    for _ in range(3):
        assert torch.equal(torch.ops.kernels_cuda.rms_norm_bwd.default(dy, x, w, rstd, True)[1], first)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_opcheck(cuda_extension, gen, dtype):
    x, w, dy = make_inputs((3, 5, 64), dtype, "cuda", gen)
    torch.library.opcheck(torch.ops.kernels_cuda.rms_norm_fwd.default, (x, w, 1e-6))
    torch.library.opcheck(torch.ops.kernels_cuda.rms_norm_fwd.default, (x[:, ::2], w, 1e-6))
    _, rstd = torch.ops.kernels_cuda.rms_norm_fwd.default(x, w, 1e-6)
    for compute_dw in (True, False):
        torch.library.opcheck(torch.ops.kernels_cuda.rms_norm_bwd.default, (dy, x, w, rstd, compute_dw))


@pytest.mark.gpu
def test_gpu_agrees_with_the_triton_operator(cuda_extension, gen):
    # Same casts, same rstd per row up to the last bit of rsqrt: bf16 outputs agree almost everywhere, dx and dW
    # to within bf16 rounding of each other.
    x, w, dy = make_inputs((2048, 4096), torch.bfloat16, "cuda", gen)
    y_cuda, rstd_cuda = torch.ops.kernels_cuda.rms_norm_fwd.default(x, w, 1e-6)
    y_triton, rstd_triton = torch.ops.kernels.rms_norm_fwd.default(x, w, 1e-6)
    assert (y_cuda != y_triton).float().mean().item() < 0.01
    assert relative_error(rstd_cuda, rstd_triton) < 1e-6
    dx_c, dw_c = torch.ops.kernels_cuda.rms_norm_bwd.default(dy, x, w, rstd_cuda, True)
    dx_t, dw_t = torch.ops.kernels.rms_norm_bwd.default(dy, x, w, rstd_triton, True)
    assert relative_error(dx_c, dx_t) < TOL[torch.bfloat16] and relative_error(dw_c, dw_t) < TOL[torch.bfloat16]


@pytest.mark.gpu
def test_gpu_compiles_and_captures_in_a_cuda_graph(cuda_extension, gen):
    x, w, dy = make_inputs((512, 1024), torch.bfloat16, "cuda", gen)
    torch._dynamo.reset()
    compiled = torch.compile(cuda_rmsnorm.rms_norm_cuda, fullgraph=True)
    assert relative_error(compiled(x, w), reference(x, w)) < TOL[torch.bfloat16]
    from kernels.bench.timing import device_time_ms

    xg = x.clone().requires_grad_()
    ms, note = device_time_ms(lambda: cuda_rmsnorm.rms_norm_cuda(xg, w).backward(dy), grad_to_none=[xg])
    assert ms is not None, note


def test_cpp_snippet_finds_whole_definitions():
    snippet = cuda_compare.cpp_snippet("warp_sum")
    assert snippet.startswith("//") and "__shfl_xor_sync" in snippet and snippet.rstrip().endswith("}")
    kernel = cuda_compare.cpp_snippet("rms_norm_fwd_kernel")
    assert kernel.count("{") == kernel.count("}") and "template <typename In, typename Out, int VEC>" in kernel
    assert "TORCH_LIBRARY" not in kernel and "rms_norm_fwd_regs_kernel(" not in kernel
    regs = cuda_compare.cpp_snippet("rms_norm_fwd_regs_kernel")
    assert "int PACKS>" in regs and regs.count("{") == regs.count("}") and "rms_norm_bwd_kernel(" not in regs
    with pytest.raises(ValueError, match="no definition"):
        cuda_compare.cpp_snippet("no_such_function")


@pytest.mark.gpu
def test_gpu_rows_past_two_to_the_31_elements(cuda_extension, gen):
    # 524,291 rows × 4,096 = 2.1e9 elements: offsets of the last rows overflow int32. Only the last rows are checked
    # (each row is independent for y and dx). Each bf16 tensor of that shape is 4.3 GB; at most three live at once.
    rows, hidden = (1 << 31) // 4096 + 3, 4096
    x = torch.empty(rows, hidden, device="cuda", dtype=torch.bfloat16).normal_()
    w = (0.5 + torch.rand(hidden, generator=gen)).to("cuda", torch.bfloat16)
    tail_x = torch.randn(8, hidden, generator=gen).to("cuda", torch.bfloat16)
    tail_dy = torch.randn(8, hidden, generator=gen).to("cuda", torch.bfloat16)
    x[-8:] = tail_x
    y, rstd = torch.ops.kernels_cuda.rms_norm_fwd.default(x, w, 1e-6)
    assert relative_error(y[-8:], reference(tail_x, w)) < TOL[torch.bfloat16]
    del y
    dy = torch.zeros_like(x)
    dy[-8:] = tail_dy
    dx, _ = torch.ops.kernels_cuda.rms_norm_bwd.default(dy, x, w, rstd, False)
    x64 = tail_x.double().requires_grad_()
    rms_norm_reference(x64, w.double()).backward(tail_dy.double())
    assert relative_error(dx[-8:], x64.grad) < TOL[torch.bfloat16]
