"""The C++ host path of SwiGLU and RoPE (kernels/host_path.py): the same bits as the Python path, for every variant
it registers, and the Python path wherever the C++ launch does not fit."""

import importlib
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch.utils import cpp_extension
from torch.utils._python_dispatch import TorchDispatchMode

from kernels import host_path, runtime
from kernels.training.profiling import PROFILER_OVERHEAD

sw = importlib.import_module("kernels.swiglu")


# --------------------------------------------------------------------------------------------------------------------
# Everywhere: the checks that decide whether a compiled kernel fits the C++ launch
# --------------------------------------------------------------------------------------------------------------------


def test_expected_parameters_drop_an_integer_equal_to_one():
    assert host_path.expected_sizes(3, [7, 1024, 1024]) == [8, 8, 8, 4, 4, 4]
    assert host_path.expected_sizes(3, [1, 1024]) == [8, 8, 8, 4]  # Triton makes an integer equal to 1 a constant
    assert host_path.expected_sizes(6, [1, 1]) == [8] * 6


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
    want = host_path.expected_sizes(3, [5, 1024])
    assert host_path.scratch_count(want + extra, want, SimpleNamespace(**metadata)) == expected


def test_a_parameter_list_that_differs_is_refused():
    want = host_path.expected_sizes(3, [5, 1024])
    assert host_path.scratch_count([8, 8, 8, 8, 4], want, SimpleNamespace()) is None  # a 64-bit row count


def test_floats_come_after_the_integers():
    assert host_path.expected_sizes(4, [5, 1024, 1024, 1024], 1) == [8] * 4 + [4] * 4 + [4]
    # The C++ launch passes a kernel's floats after its integers, and parameter sizes cannot tell an fp32 from an
    # int32: RMSNorm's forward, the one kernel on the path with a float, must declare eps after every integer.
    rms = importlib.import_module("kernels.rmsnorm")
    names = rms.rms_norm_fwd_kernel.arg_names
    runtime_args = [n for n in names if n not in ("ROWS", "BLOCK_N")]
    assert runtime_args[-1] == "eps" and runtime_args[4:8] == ["n_rows", "n_cols", "stride_x", "stride_y"]


def test_a_failed_build_warns_once_and_leaves_the_python_path(monkeypatch):
    monkeypatch.setattr(host_path, "_state", {"ext": None, "reason": None, "seconds": None, "cols": None})
    monkeypatch.setattr(host_path, "unavailable", lambda: None)
    tries = []

    def fail():
        tries.append(1)
        raise RuntimeError("the compiler said no\nError building extension 'kernels_host_path'")

    monkeypatch.setattr(host_path, "_build", fail)
    with pytest.warns(UserWarning, match="Python host path: the C\\+\\+ build failed"):
        assert host_path.extension() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert host_path.extension() is None  # no second try, no second warning
    assert len(tries) == 1 and not host_path.status()["built"]
    assert host_path.status()["reason"].endswith("Error building extension 'kernels_host_path')")


def test_each_family_hands_over_what_the_path_launches():
    # host_path imports no kernel family: each registered its parts when `import kernels` imported it.
    rms = importlib.import_module("kernels.rmsnorm")
    rope = importlib.import_module("kernels.rope")
    given = host_path._families_given
    assert set(given) == {host_path.SwiGLUFamily, host_path.RopeFamily, host_path.RMSNormFamily}
    swiglu_parts = given[host_path.SwiGLUFamily]
    assert swiglu_parts.cols == 1024 and swiglu_parts.forward is sw.swiglu_forward
    assert swiglu_parts.forward_kernel is sw.swiglu_fwd_kernel and swiglu_parts.backward_op is sw.swiglu_bwd_op
    assert given[host_path.RopeFamily].forward is rope.rope_forward
    rms_parts = given[host_path.RMSNormFamily]
    assert rms_parts.dw_kernel is rms.rms_norm_dw_kernel and rms_parts.backward_config is rms.cached_backward_config
    with pytest.raises(TypeError, match="SwiGLUFamily, RopeFamily or RMSNormFamily"):
        host_path.register_family(object())


def test_a_build_without_every_family_is_refused(monkeypatch):
    monkeypatch.setattr(host_path, "_state", {"ext": None, "reason": None, "seconds": None, "cols": None})
    monkeypatch.setattr(host_path, "unavailable", lambda: None)
    monkeypatch.setattr(host_path, "_families_given", {})

    def compile_nothing(*args, **kwargs):
        raise AssertionError("compiled without the families")

    monkeypatch.setattr(cpp_extension, "load", compile_nothing)
    with pytest.warns(UserWarning, match="no SwiGLUFamily: kernels.swiglu hands it over"):
        assert host_path.extension() is None
    assert not host_path.status()["built"]


@pytest.mark.skipif(runtime.MODE == "gpu", reason="the interpreter's answer")
def test_interpreter_runs_the_python_path(gen):
    gate = torch.randn(4, 1024, generator=gen)
    q, cos = torch.randn(1, 4, 8, 16, generator=gen), torch.randn(1, 8, 16, generator=gen)
    assert host_path.unavailable() and not host_path.takes(gate, gate.clone(), False)
    assert not host_path.takes_rope(q, q.clone(), cos, cos.clone())


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


def _replayed(step, leaves):
    """Capture ``step()`` (a forward and its backward) in a CUDA graph, zero the leaves' gradients, replay: what it
    returns and the gradients then come from the replay alone."""
    graph = torch.cuda.CUDAGraph()
    for t in leaves:
        t.grad = None
    with torch.cuda.graph(graph):
        out = step()
    with torch.no_grad():
        for t in leaves:
            t.grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
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

    y = _replayed(step, (gate, up))
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


# --------------------------------------------------------------------------------------------------------------------
# RoPE on a GPU
# --------------------------------------------------------------------------------------------------------------------

rope = importlib.import_module("kernels.rope")


def _llama_qk(batch, seq, n_q, n_k, d, dtype, gen, offset=0):
    # q and k as Llama's attention makes them: [batch, seq, heads, D] projections seen as [batch, heads, seq, D].
    def one(heads):
        n = batch * seq * heads * d
        flat = _randn((n + offset,), dtype, gen)[offset:]
        return flat.view(batch, seq, heads, d).transpose(1, 2).requires_grad_()
    return one(n_q), one(n_k)


def _trig(batch, seq, d, dtype, gen):
    return _randn((batch, seq, d), dtype, gen), _randn((batch, seq, d), dtype, gen)


def _rope_both_paths(q, k, cos, sin, dq, dk):
    out = []
    for python in (False, True):
        q.grad = k.grad = None
        qe, ke = rope.RotaryFunction.apply(q, k, cos, sin) if python else rope.apply_rotary(q, k, cos, sin)
        torch.autograd.backward([qe, ke], [dq, dk])
        out.append((qe.detach(), ke.detach(), q.grad, k.grad, qe.grad_fn.name()))
    return out


def _rope_equal(a, b):
    return all(torch.equal(x, y) and x.stride() == y.stride() for x, y in zip(a[:4], b[:4]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, trig_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                               (torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("batch, seq, n_q, n_k, d", [(1, 1, 4, 2, 64), (1, 7, 32, 8, 128), (2, 33, 32, 8, 128),
                                                     (3, 16, 12, 4, 96)])
def test_gpu_rope_same_bits_as_the_python_path(dtype, trig_dtype, batch, seq, n_q, n_k, d, gen):
    _require_path()
    q, k = _llama_qk(batch, seq, n_q, n_k, d, dtype, gen)
    cos, sin = _trig(1 if batch == 3 else batch, seq, d, trig_dtype, gen)  # batch 3: cos and sin broadcast
    out_dtype = torch.promote_types(dtype, trig_dtype)
    dq = _randn((batch, n_q, seq, d), out_dtype, gen)  # attention's gradients: contiguous [batch, heads, seq, D]
    dk = _randn((batch, n_k, seq, d), out_dtype, gen)
    for _ in range(2):  # the first call registers the variants (through Python), the second runs in C++ only
        ours, python = _rope_both_paths(q, k, cos, sin, dq, dk)
        assert _rope_equal(ours, python)
    assert "RotaryNode" in ours[4] and python[4] == "RotaryFunctionBackward"


@pytest.mark.gpu
def test_gpu_rope_unaligned_and_other_layouts(gen):
    _require_path()
    q, k = _llama_qk(1, 8, 32, 8, 128, torch.bfloat16, gen, offset=3)
    cos, sin = _trig(1, 8, 128, torch.bfloat16, gen)
    dq, dk = _randn((1, 32, 8, 128), torch.bfloat16, gen), _randn((1, 8, 8, 128), torch.bfloat16, gen)
    for _ in range(2):
        assert _rope_equal(*_rope_both_paths(q, k, cos, sin, dq, dk))
    # Contiguous [batch, heads, seq, D] inputs (their own variant) and a strided q (the Python path, in C++'s hands).
    qc, kc = (t.detach().contiguous().requires_grad_() for t in (q, k))
    for _ in range(2):
        assert _rope_equal(*_rope_both_paths(qc, kc, cos, sin, dq, dk))
    wide = _randn((1, 32, 8, 256), torch.bfloat16, gen)[..., :128].requires_grad_()
    ours, python = _rope_both_paths(wide, kc, cos, sin, dq, dk)
    assert _rope_equal(ours, python)


@pytest.mark.gpu
def test_gpu_rope_gradient_of_one_output_only_and_no_grad(gen):
    _require_path()
    q, k = _llama_qk(1, 8, 8, 2, 64, torch.bfloat16, gen)
    cos, sin = _trig(1, 8, 64, torch.bfloat16, gen)
    qe, ke = rope.apply_rotary(q, k, cos, sin)
    qe.float().sum().backward()  # k's output never reaches the loss: its incoming gradient is zeros
    assert torch.count_nonzero(k.grad) == 0 and q.grad is not None
    with torch.no_grad():
        qe2, ke2 = rope.apply_rotary(q, k, cos, sin)
    assert qe2.grad_fn is None and torch.equal(qe2, qe.detach()) and torch.equal(ke2, ke.detach())


@pytest.mark.gpu
def test_gpu_rope_cos_with_a_gradient_takes_the_python_path(gen):
    _require_path()
    q, k = _llama_qk(1, 8, 8, 2, 64, torch.float32, gen)
    cos, sin = (t.requires_grad_() for t in _trig(1, 8, 64, torch.float32, gen))
    qe, ke = rope.apply_rotary(q, k, cos, sin)
    assert qe.grad_fn.name() == "RotaryFunctionBackward"


@pytest.mark.gpu
def test_gpu_rope_cuda_graph(gen):
    _require_path()
    q, k = _llama_qk(1, 16, 32, 8, 128, torch.bfloat16, gen)
    cos, sin = _trig(1, 16, 128, torch.bfloat16, gen)
    dq, dk = _randn((1, 32, 16, 128), torch.bfloat16, gen), _randn((1, 8, 16, 128), torch.bfloat16, gen)
    ours, _ = _rope_both_paths(q, k, cos, sin, dq, dk)  # registers the variants

    def step():
        qe, ke = rope.apply_rotary(q, k, cos, sin)
        torch.autograd.backward([qe, ke], [dq, dk])
        return qe

    qe = _replayed(step, (q, k))
    assert torch.equal(qe, ours[0]) and torch.equal(q.grad, ours[2]) and torch.equal(k.grad, ours[3])


# --------------------------------------------------------------------------------------------------------------------
# RMSNorm on a GPU
# --------------------------------------------------------------------------------------------------------------------

rms = importlib.import_module("kernels.rmsnorm")


def _rms_inputs(shape, dtype, w_dtype, gen, offset=0):
    n = torch.Size(shape).numel()
    x = _randn((n + offset,), dtype, gen)[offset:].view(shape).requires_grad_()
    w = (1 + 0.1 * _randn((shape[-1],), w_dtype, gen)).requires_grad_()
    return x, w


def _rms_both_paths(x, w, dy, eps=1e-6):
    """(y, dx, dw, node name) through ``rms_norm`` (the C++ node) and through the Python autograd.Function."""
    out = []
    for python in (False, True):
        x.grad = w.grad = None
        y = rms.RMSNormFunction.apply(x, w, eps) if python else rms.rms_norm(x, w, eps)
        y.backward(dy)
        out.append((y.detach(), x.grad, w.grad, y.grad_fn.name()))
    return out


def _rms_equal(a, b):
    return all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a[:3], b[:3]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, w_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                            (torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("shape", [(1, 64), (7, 1000), (2, 33, 4096), (300, 2048), (4096,)])
def test_gpu_rms_norm_same_bits_as_the_python_path(dtype, w_dtype, shape, gen):
    _require_path()
    x, w = _rms_inputs(shape, dtype, w_dtype, gen)
    dy = _randn(shape, torch.promote_types(dtype, w_dtype), gen)
    for _ in range(2):  # the first call registers the variants (through Python), the second runs in C++ only
        ours, python = _rms_both_paths(x, w, dy)
        assert _rms_equal(ours, python)
    assert "RMSNormNode" in ours[3] and python[3] == "RMSNormFunctionBackward"


@pytest.mark.gpu
def test_gpu_rms_norm_unaligned_frozen_weight_and_no_grad(gen):
    _require_path()
    x, w = _rms_inputs((5, 512), torch.bfloat16, torch.bfloat16, gen, offset=3)
    assert x.data_ptr() % 16 != 0
    dy = _randn((5, 512), torch.bfloat16, gen)
    for _ in range(2):
        assert _rms_equal(*_rms_both_paths(x, w, dy))
    w.requires_grad_(False)  # a frozen weight (LoRA): no dW, no sum of partials
    for _ in range(2):
        ours, python = _rms_both_paths(x, w, dy)
        assert _rms_equal(ours, python) and ours[2] is None
    x2 = x.detach().requires_grad_(False)
    w.requires_grad_(True)  # only the weight trains: dx is not returned
    y = rms.rms_norm(x2, w)
    y.backward(dy)
    assert w.grad is not None and x2.grad is None
    with torch.no_grad():
        y2 = rms.rms_norm(x, w)
    assert y2.grad_fn is None and torch.equal(y2, rms.RMSNormFunction.apply(x, w, 1e-6).detach())


@pytest.mark.gpu
def test_gpu_rms_norm_strided_inputs_and_gradients(gen):
    _require_path()
    x, w = _rms_inputs((6, 256), torch.bfloat16, torch.bfloat16, gen)
    dy = _randn((256, 6), torch.bfloat16, gen).t()  # a strided incoming gradient: the Python backward
    assert _rms_equal(*_rms_both_paths(x, w, dy))
    xt = _randn((256, 6), torch.bfloat16, gen).t().requires_grad_()  # a strided x: the Python path altogether
    assert rms.rms_norm(xt, w).grad_fn.name() == "RMSNormFunctionBackward"
    with pytest.raises(RuntimeError, match="second derivative"):
        torch.autograd.grad(rms.rms_norm(x, w).sum(), x, create_graph=True)


@pytest.mark.gpu
def test_gpu_rms_norm_cuda_graph_and_dispatch_mode(gen):
    _require_path()
    x, w = _rms_inputs((64, 1024), torch.bfloat16, torch.bfloat16, gen)
    dy = _randn((64, 1024), torch.bfloat16, gen)
    ours, _ = _rms_both_paths(x, w, dy)  # registers the variants

    def step():
        y = rms.rms_norm(x, w)
        y.backward(dy)
        return y

    y = _replayed(step, (x, w))
    assert torch.equal(y, ours[0]) and torch.equal(x.grad, ours[1]) and torch.equal(w.grad, ours[2])
    with _Recorder() as rec:
        y = rms.rms_norm(x, w)
    assert any("rms_norm_fwd" in op for op in rec.ops) and "RMSNormNode" not in y.grad_fn.name()
    y = rms.rms_norm(x, w)
    with _Recorder() as rec:
        y.backward(dy)
    assert any("rms_norm_bwd" in op for op in rec.ops)


@pytest.mark.gpu
def test_gpu_the_profiler_links_every_launch_to_a_node(gen):
    # A profile attributes each kernel to the operator active at its launch (kernels.training.profiling's families):
    # the C++ entry points open a record for their forward launches, as a Python autograd.Function's apply does.
    _require_path()
    x, w = _rms_inputs((64, 1024), torch.bfloat16, torch.bfloat16, gen)
    gate, up = _pair((8, 1024), torch.bfloat16, gen)
    q, k = _llama_qk(1, 8, 8, 2, 64, torch.bfloat16, gen)
    cos, sin = _trig(1, 8, 64, torch.bfloat16, gen)
    grads = [_randn(shape, torch.bfloat16, gen) for shape in ((64, 1024), (8, 1024), (1, 8, 8, 64), (1, 2, 8, 64))]

    def step():  # dense incoming gradients, so that every backward runs in C++ too
        rms.rms_norm(x, w).backward(grads[0])
        sw.swiglu(gate, up).backward(grads[1])
        torch.autograd.backward(list(rope.apply_rotary(q, k, cos, sin)), grads[2:])

    step()  # registers the variants
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        step()
        torch.cuda.synchronize()
    events = prof.events()
    ours = ("rms_norm_fwd_kernel", "rms_norm_bwd_kernel", "rms_norm_dw_kernel", "swiglu_fwd_kernel",
            "swiglu_bwd_kernel", "_rope_dense_kernel")
    launched = {name: 0 for name in ours}
    linked = {name: [] for name in ours}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA and e.name in launched:
            launched[e.name] += 1
        if e.name in PROFILER_OVERHEAD:  # the profiler's own records, which also list a kernel they waited on
            continue
        for kernel in getattr(e, "kernels", []):
            if kernel.name in linked:
                linked[kernel.name].append(e.name)
    assert launched == {**{name: 1 for name in ours}, "_rope_dense_kernel": 2}, launched
    assert {name: len(ops) for name, ops in linked.items()} == launched, linked
    assert linked["rms_norm_fwd_kernel"] == ["RMSNormNode"] and linked["swiglu_fwd_kernel"] == ["SwiGLUNode"]
