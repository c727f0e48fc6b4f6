"""SwiGLU's C++ host path (kernels/host_path.py): the same bits as the Python path, for every variant it registers,
and the Python path wherever the C++ launch does not fit."""

import importlib
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels import host_path, runtime

sw = importlib.import_module("kernels.swiglu")


# --------------------------------------------------------------------------------------------------------------------
# Everywhere: the checks that decide whether a compiled kernel fits the C++ launch
# --------------------------------------------------------------------------------------------------------------------


def test_expected_parameters_drop_a_row_count_of_one():
    assert host_path.expected_sizes(3, 7) == [8, 8, 8, 4, 4, 4, 4, 4]
    assert host_path.expected_sizes(3, 1) == [8, 8, 8, 4, 4, 4, 4]  # Triton makes an integer equal to 1 a constant
    assert host_path.expected_sizes(5, 32) == [8] * 5 + [4] * 7


@pytest.mark.parametrize("extra, metadata, expected", [
    ([], {}, 0),
    ([8, 8], {"global_scratch_size": 0, "profile_scratch_size": 0}, 2),
    ([8], {"global_scratch_size": 256}, None),  # a kernel that uses scratch memory needs a real buffer
    ([4], {}, None),  # not a pointer
    ([8, 8, 8], {}, None),
    ([], {"num_ctas": 2}, None),
    ([], {"cluster_dims": (2, 1, 1)}, None),
])
def test_scratch_count(extra, metadata, expected):
    want = host_path.expected_sizes(3, 5)
    assert host_path.scratch_count(want + extra, want, SimpleNamespace(**metadata)) == expected


def test_a_parameter_list_that_differs_is_refused():
    want = host_path.expected_sizes(3, 5)
    assert host_path.scratch_count([8, 8, 8, 8, 4, 4, 4, 4], want, SimpleNamespace()) is None  # a 64-bit row count


@pytest.mark.skipif(runtime.MODE == "gpu", reason="the interpreter's answer")
def test_interpreter_runs_the_python_path(gen):
    gate = torch.randn(4, 1024, generator=gen)
    assert host_path.unavailable() and not host_path.takes(gate, gate.clone(), False)


# --------------------------------------------------------------------------------------------------------------------
# On a GPU: bits, variants, streams, graphs, fallbacks
# --------------------------------------------------------------------------------------------------------------------


def _pair(shape, dtype, gen, offset=0):
    # gate and up, each a dense tensor; ``offset`` elements into a larger buffer moves the pointer off 16 bytes.
    n = torch.Size(shape).numel()
    bufs = [torch.randn(n + offset, generator=gen).to("cuda", dtype) for _ in range(2)]
    return [b[offset:].view(shape).requires_grad_() for b in bufs]


def _randn(shape, dtype, gen):
    return torch.randn(shape, generator=gen).to("cuda", dtype)


def _both_paths(gate, up, dy):
    """(y, d_gate, d_up, node name) through ``swiglu`` (the C++ node) and through the Python autograd.Function."""
    out = []
    for python in (False, True):
        gate.grad = up.grad = None
        y = sw.SwiGLUFunction.apply(gate, up, False) if python else sw.swiglu(gate, up)
        y.backward(dy)
        out.append((y.detach(), gate.grad, up.grad, y.grad_fn.name()))
    return out


def _require_path():
    if host_path.extension() is None:
        pytest.skip(f"the C++ host path is off here: {host_path.status()['reason']}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1024), (3, 2048), (16, 1024), (2, 17, 14336), (5, 7168)])
def test_gpu_same_bits_as_the_python_path(dtype, shape, gen):
    _require_path()
    gate, up = _pair(shape, dtype, gen)
    dy = _randn(shape, dtype, gen)
    for _ in range(2):  # the first call registers the variants (through Python), the second runs in C++ only
        (y, dg, du, node), (y0, dg0, du0, node0) = _both_paths(gate, up, dy)
        assert torch.equal(y, y0) and torch.equal(dg, dg0) and torch.equal(du, du0)
    assert "SwiGLUNode" in node and node0 == "SwiGLUFunctionBackward"  # each path was the one taken


@pytest.mark.gpu
def test_gpu_unaligned_pointers_get_their_own_variant(gen):
    _require_path()
    before = host_path.status()["variants"]
    gate, up = _pair((4, 1024), torch.bfloat16, gen, offset=3)  # 6 bytes past a 16-byte boundary
    assert gate.data_ptr() % 16 != 0
    dy = _randn((4, 1024), torch.bfloat16, gen)
    for _ in range(2):
        (y, dg, du, _), (y0, dg0, du0, _) = _both_paths(gate, up, dy)
        assert torch.equal(y, y0) and torch.equal(dg, dg0) and torch.equal(du, du0)
    assert host_path.status()["variants"] > before


@pytest.mark.gpu
def test_gpu_only_the_inputs_that_need_a_gradient_get_one(gen):
    _require_path()
    gate, up = _pair((8, 1024), torch.bfloat16, gen)
    up = up.detach()
    sw.swiglu(gate, up).sum().backward()
    assert gate.grad is not None and up.grad is None


@pytest.mark.gpu
def test_gpu_second_derivative_is_refused(gen):
    _require_path()
    gate, up = _pair((8, 1024), torch.float32, gen)
    y = sw.swiglu(gate, up)
    with pytest.raises(RuntimeError, match="second derivative"):
        torch.autograd.grad(y.sum(), gate, create_graph=True)


@pytest.mark.gpu
def test_gpu_strided_gradient_takes_the_python_backward(gen):
    _require_path()
    gate, up = _pair((8, 1024), torch.bfloat16, gen)
    dy = _randn((1024, 8), torch.bfloat16, gen).t()  # not contiguous
    (y, dg, du, _), (y0, dg0, du0, _) = _both_paths(gate, up, dy)
    assert torch.equal(dg, dg0) and torch.equal(du, du0)


@pytest.mark.gpu
def test_gpu_side_stream_and_cuda_graph(gen):
    _require_path()
    gate, up = _pair((32, 1024), torch.bfloat16, gen)
    dy = _randn((32, 1024), torch.bfloat16, gen)
    (y0, dg0, du0, _), _ = _both_paths(gate, up, dy)  # registers the variants

    def step():
        gate.grad = up.grad = None
        y = sw.swiglu(gate, up)
        y.backward(dy)
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = step()
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(y, y0) and torch.equal(gate.grad, dg0)

    graph = torch.cuda.CUDAGraph()
    gate.grad = up.grad = None
    with torch.cuda.graph(graph):
        y = sw.swiglu(gate, up)
        y.backward(dy)
    with torch.no_grad():
        gate.grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, y0) and torch.equal(gate.grad, dg0) and torch.equal(up.grad, du0)


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.gpu
def test_gpu_a_dispatch_mode_sees_the_operators(gen):
    _require_path()
    gate, up = _pair((8, 1024), torch.bfloat16, gen)
    with _Recorder() as rec:
        y = sw.swiglu(gate, up)
    assert any("swiglu_fwd" in op for op in rec.ops) and "SwiGLUNode" not in y.grad_fn.name()
    y = sw.swiglu(gate, up)  # through the C++ node; a mode active during its backward still sees the operator
    with _Recorder() as rec:
        y.sum().backward()
    assert any("swiglu_bwd" in op for op in rec.ops)


@pytest.mark.gpu
def test_gpu_compiled_calls_keep_the_operators(gen):
    _require_path()
    gate, up = _pair((8, 1024), torch.bfloat16, gen)
    compiled = torch.compile(lambda g, u: sw.swiglu(g, u) * 2, fullgraph=True)
    assert torch.equal(compiled(gate, up), sw.swiglu(gate, up) * 2)
