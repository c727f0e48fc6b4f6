"""The kernels as PyTorch operators: opcheck, torch.compile (with no graph break), CUDA graphs on a GPU; SwiGLU
and RoPE in a section of their own at the end.

On the CPU the compiled tests use ``backend="aot_eager"``: AOTAutograd traces the model with fake tensors (the
operators' fake implementations) and runs the captured graph eagerly, so the operators' Triton launches run in the
interpreter. On a GPU the same tests run with inductor, and the CUDA-graph test with ``mode="reduce-overhead"``.
"""

import copy

import pytest
import torch
import torch._dynamo.testing

from kernels import ops, runtime
from kernels.cross_entropy import cross_entropy
from kernels.hf.patch import patch_llama
from kernels.reference import rotary_cos_sin
from kernels.rmsnorm import rms_norm
from kernels.rope import apply_rotary
from kernels.swiglu import swiglu
from kernels.training.models import build_model

BACKEND = runtime.COMPILE_BACKEND
EXPECTED_OPS = {
    "kernels::rms_norm_fwd", "kernels::rms_norm_bwd",
    "kernels::cross_entropy_fwd", "kernels::cross_entropy_fwd_inplace", "kernels::cross_entropy_scale_grad_",
    "kernels::linear_cross_entropy_fwd", "kernels::linear_cross_entropy_bwd", "kernels::linear_cross_entropy_chunked",
}

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def test_every_kernel_is_registered():
    assert EXPECTED_OPS <= set(ops.registered())


# ---------------------------------------------------------------------------------------------------------------------
# opcheck: schema, fake implementation, AOT dispatch (static and dynamic shapes)
# ---------------------------------------------------------------------------------------------------------------------


def _rms_inputs(device, gen, dtype=torch.float32, shape=(3, 7, 48)):
    x = torch.randn(shape, generator=gen).to(device, dtype)
    w = torch.randn(shape[-1], generator=gen).to(device, dtype)
    rows = x.numel() // shape[-1]
    return x, w, torch.rand(rows, generator=gen).add_(0.5).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_rms_norm(device, gen, dtype):
    x, w, rstd = _rms_inputs(device, gen, dtype)
    torch.library.opcheck(torch.ops.kernels.rms_norm_fwd.default, (x, w, 1e-6))
    strided = torch.randn(5, 2, 96, generator=gen).to(device, dtype)[:, :, ::2]
    torch.library.opcheck(torch.ops.kernels.rms_norm_fwd.default, (strided, w, 1e-6))
    for compute_dw in (True, False):
        dy = torch.randn(x.shape, generator=gen).to(device, dtype)
        torch.library.opcheck(torch.ops.kernels.rms_norm_bwd.default, (dy, x, w, rstd, compute_dw))


def _ce_inputs(device, gen, shape=(2, 5, 300)):
    logits = (torch.randn(shape, generator=gen) * 3).to(device)
    target = torch.randint(0, shape[-1], shape[:-1], generator=gen).to(device)
    target[0, 0] = -100
    return logits, target


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_opcheck_cross_entropy(device, gen, reduction):
    logits, target = _ce_inputs(device, gen)
    for compute_grad in (True, False):
        args = (logits, target, -100, reduction, None, None, compute_grad)
        torch.library.opcheck(torch.ops.kernels.cross_entropy_fwd.default, args)
    torch.library.opcheck(torch.ops.kernels.cross_entropy_fwd_inplace.default,
                          (logits.clone(), target, -100, reduction, None, None))
    go = torch.rand(target.shape if reduction == "none" else (), generator=gen).to(device)
    torch.library.opcheck(torch.ops.kernels.cross_entropy_scale_grad_.default, (logits.clone(), go))


def test_opcheck_cross_entropy_normalizer(device, gen):
    logits, target = _ce_inputs(device, gen)
    norm = torch.tensor(7.0, device=device)
    torch.library.opcheck(torch.ops.kernels.cross_entropy_fwd.default, (logits, target, -100, "sum", norm, None, True))
    torch.library.opcheck(torch.ops.kernels.cross_entropy_fwd.default, (logits, target, -100, "sum", None, 7.0, True))


def test_inplace_operator_declares_its_write(device, gen):
    # The schema says the operator writes `logits`: the version counter moves, so autograd can catch misuse.
    logits, target = _ce_inputs(device, gen)
    version = logits._version
    torch.ops.kernels.cross_entropy_fwd_inplace(logits, target, -100, "mean", None, None)
    assert logits._version > version
    assert torch.ops.kernels.cross_entropy_fwd_inplace.default._schema.arguments[0].alias_info.is_write


# ---------------------------------------------------------------------------------------------------------------------
# torch.compile of the functions: equal to eager, no graph break
# ---------------------------------------------------------------------------------------------------------------------


def _norm_linear_loss(h, w, linear, target, inplace):
    logits = linear(rms_norm(h, w))
    return cross_entropy(logits, target, check_targets=False, inplace_backward=inplace)


@pytest.mark.parametrize("inplace", [False, True], ids=["grad-buffer", "grad-in-place"])
def test_compiled_function_matches_eager(device, gen, inplace):
    linear = torch.nn.Linear(48, 300).to(device)
    target = torch.randint(0, 300, (2, 5), generator=gen).to(device)
    target[1, 2] = -100
    h0 = torch.randn(2, 5, 48, generator=gen).to(device)
    w0 = torch.randn(48, generator=gen).to(device)

    def run(fn):
        linear.zero_grad(set_to_none=True)
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss = fn(h, w, linear, target, inplace)
        loss.backward()
        return [loss.detach(), h.grad, w.grad, linear.weight.grad, linear.bias.grad]

    eager = run(_norm_linear_loss)
    compiled = run(torch.compile(_norm_linear_loss, backend=BACKEND, fullgraph=True))
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_rms_norm_compiles_without_graph_break(device, gen):
    x = torch.randn(4, 64, generator=gen).to(device)
    w = torch.randn(64, generator=gen).to(device)
    explanation = torch._dynamo.explain(lambda a, b: rms_norm(a, b) * 2)(x, w)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


# ---------------------------------------------------------------------------------------------------------------------
# The patched model under torch.compile
# ---------------------------------------------------------------------------------------------------------------------


def _tiny_llama_and_batch(device, gen):
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=gen)))
    model = build_model("tiny", dtype=torch.float32).to(device).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=gen).to(device)
    labels = ids.clone()
    labels[:, :5] = -100  # a masked prompt
    return model, ids, labels


def _train_steps(model, ids, labels, steps=2):
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        torch.compiler.cudagraph_mark_step_begin()  # CUDA graphs: a new step may reuse the last one's output memory
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        optimizer.step()
        losses.append(out.loss.detach().clone())  # a copy outlives the next replay
    return torch.stack(losses)


def test_compiled_patched_model_trains_like_eager(device, gen):
    model, ids, labels = _tiny_llama_and_batch(device, gen)
    eager = copy.deepcopy(model)
    patch_llama(eager)
    compiled_model = copy.deepcopy(model)
    patch_llama(compiled_model)
    eager_losses = _train_steps(eager, ids, labels)
    compiled_losses = _train_steps(torch.compile(compiled_model, backend=BACKEND), ids, labels)
    torch.testing.assert_close(compiled_losses, eager_losses, rtol=1e-5, atol=1e-5)
    for (name, a), b in zip(compiled_model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


def test_patch_adds_no_graph_break(device, gen):
    model, ids, labels = _tiny_llama_and_batch(device, gen)
    unpatched = torch._dynamo.explain(model)(input_ids=ids, labels=labels)
    torch._dynamo.reset()
    with patch_llama(copy.deepcopy(model)) as patch:
        patched = torch._dynamo.explain(patch.model)(input_ids=ids, labels=labels)
    assert patched.graph_break_count == unpatched.graph_break_count, patched.break_reasons
    assert patched.graph_count == unpatched.graph_count


# ---------------------------------------------------------------------------------------------------------------------
# GPU: inductor, CUDA graphs
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"], ids=["default", "cuda-graphs"])
def test_gpu_compiled_patched_bf16_model(gen, mode):
    model, ids, labels = _tiny_llama_and_batch("cuda", gen)
    model = model.to(torch.bfloat16)
    eager = copy.deepcopy(model)
    patch_llama(eager)
    compiled_model = copy.deepcopy(model)
    patch_llama(compiled_model)
    eager_losses = _train_steps(eager, ids, labels, steps=4)
    compiled_losses = _train_steps(torch.compile(compiled_model, mode=mode), ids, labels, steps=4)
    # bf16: inductor fuses the model's own elementwise work differently from eager, so the losses agree to bf16
    # rounding, not bit for bit.
    torch.testing.assert_close(compiled_losses, eager_losses, rtol=2e-2, atol=2e-2)


def test_a_changing_item_count_does_not_recompile(device, gen):
    # Gradient accumulation passes the number of trained tokens, a Python int that changes every step. The compiled
    # loss must take it as data, not as a constant that recompiles the model at each new value.
    model, ids, labels = _tiny_llama_and_batch(device, gen)
    patch_llama(model)
    counter = torch._dynamo.testing.CompileCounterWithBackend(BACKEND)
    compiled = torch.compile(model, backend=counter)
    losses = []
    for n_items in (37, 41, 43, 47, 53):
        torch.compiler.cudagraph_mark_step_begin()
        loss = compiled(input_ids=ids, labels=labels, num_items_in_batch=n_items).loss
        loss.backward()
        losses.append(loss.detach())
    # The first value compiles a graph; the second may compile one with the count as a symbol; then no more.
    assert counter.frame_count <= 2, counter.frame_count
    # And the count is used: the loss is the sum over trained tokens divided by it.
    ratios = [float(losses[0] * 37 / (loss * n)) for loss, n in zip(losses, (37, 41, 43, 47, 53))]
    assert max(abs(r - 1) for r in ratios) < 0.05


# ---------------------------------------------------------------------------------------------------------------------
# SwiGLU and RoPE: registered, opcheck, torch.compile equal to eager with no graph break
# ---------------------------------------------------------------------------------------------------------------------


def test_swiglu_and_rope_operators_are_registered():
    expected = {"kernels::swiglu_fwd", "kernels::swiglu_bwd", "kernels::swiglu_bwd_", "kernels::rope_fwd",
                "kernels::rope_bwd"}
    assert expected <= set(ops.registered())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_swiglu(device, gen, dtype):
    gu = torch.randn(3, 5, 2 * 40, generator=gen).to(device, dtype)
    gate, up = gu[..., :40], gu[..., 40:]  # strided halves
    torch.library.opcheck(torch.ops.kernels.swiglu_fwd.default, (gate, up))
    dy = torch.randn(3, 5, 40, generator=gen).to(device, dtype)
    torch.library.opcheck(torch.ops.kernels.swiglu_bwd.default, (dy, gate, up))
    # The in-place backward declares its writes: opcheck verifies the schema against what the kernel touches.
    torch.library.opcheck(torch.ops.kernels.swiglu_bwd_.default, (dy, gate.contiguous(), up.contiguous()))


@pytest.mark.parametrize("q_dtype, trig_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                 (torch.bfloat16, torch.bfloat16)])
def test_opcheck_rope(device, gen, q_dtype, trig_dtype):
    q = torch.randn(2, 5, 4 * 16, generator=gen).to(device, q_dtype).view(2, 5, 4, 16).transpose(1, 2)
    k = torch.randn(2, 5, 2 * 16, generator=gen).to(device, q_dtype).view(2, 5, 2, 16).transpose(1, 2)
    cos, sin = rotary_cos_sin(2, 5, 16, dtype=trig_dtype, device=device)
    torch.library.opcheck(torch.ops.kernels.rope_fwd.default, (q, k, cos, sin))
    out = torch.promote_types(q_dtype, trig_dtype)
    torch.library.opcheck(torch.ops.kernels.rope_bwd.default, (q.to(out), k.to(out), cos, sin, q_dtype))


def _mlp_and_rope(x, w_gate, w_up, w_q, w_k, cos, sin):
    gate, up = x @ w_gate, x @ w_up
    h = swiglu(gate, up)
    b, s, _ = x.shape
    q = (x @ w_q).view(b, s, 4, 8).transpose(1, 2)
    k = (x @ w_k).view(b, s, 2, 8).transpose(1, 2)
    q, k = apply_rotary(q, k, cos, sin)
    return h.square().mean() + (q.sum(1) * k.sum(1)).mean()


def test_swiglu_and_rope_compiled_match_eager_without_graph_break(device, gen):
    x0 = torch.randn(2, 6, 24, generator=gen).to(device)
    weights0 = [torch.randn(24, n, generator=gen).to(device) / 5 for n in (40, 40, 32, 16)]
    cos, sin = rotary_cos_sin(2, 6, 8, theta=100.0, device=device)

    def run(fn):
        x = x0.clone().requires_grad_()
        weights = [w.clone().requires_grad_() for w in weights0]
        loss = fn(x, *weights, cos, sin)
        loss.backward()
        return [loss.detach(), x.grad, *(w.grad for w in weights)]

    eager = run(_mlp_and_rope)
    compiled = run(torch.compile(_mlp_and_rope, backend=BACKEND, fullgraph=True))
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    explanation = torch._dynamo.explain(_mlp_and_rope)(x0, *weights0, cos, sin)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
