"""SwiGLU and RoPE as PyTorch operators: opcheck, torch.compile equal to eager with no graph break."""

import pytest
import torch

from kernels import ops, runtime
from kernels.reference import rotary_cos_sin
from kernels.rope import apply_rotary
from kernels.swiglu import swiglu

BACKEND = runtime.COMPILE_BACKEND

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def test_operators_are_registered():
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


def test_compiled_matches_eager_without_graph_break(device, gen):
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
