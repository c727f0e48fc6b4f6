"""The eager shortcut past the dispatcher (``ops.call``, ``ops.direct``): when it applies, and that it changes no bit.

A plain eager call runs an operator's implementation itself; a tracer (``torch.compile``, a ``TorchDispatchMode``,
a tensor subclass) gets the operator. Each kernel family is run both ways, forward and backward, and must give the
same bits; the run under a dispatch mode must show the family's operators, so a shortcut that ignored the mode
would fail here.
"""

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels import ops
from kernels.adamw import TritonAdamW
from kernels.cross_entropy import cross_entropy
from kernels.reference import rotary_cos_sin
from kernels.rmsnorm import rms_norm
from kernels.rope import apply_rotary
from kernels.swiglu import swiglu

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class _RecordOps(TorchDispatchMode):
    """Passes every call on unchanged and records the ``kernels::`` operators among them."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name.startswith(f"{ops.NAMESPACE}::"):
            self.seen.add(name)
        return func(*args, **(kwargs or {}))


def test_direct_only_for_plain_eager_tensors():
    t, p = torch.ones(3), torch.nn.Parameter(torch.ones(3))
    assert ops.direct(t, p)
    with _RecordOps():
        assert not ops.direct(t)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = mode.from_tensor(t)
    assert not ops.direct(t, fake)

    @torch.compile(backend="eager", fullgraph=True)
    def traced(x):
        return x + (1 if ops.direct(x) else 2)

    torch.testing.assert_close(traced(t), t + 2)


def _rmsnorm_case(device, gen):
    x = torch.randn(3, 5, 48, generator=gen).to(device).requires_grad_()
    w = torch.randn(48, generator=gen).to(device).requires_grad_()
    dy = torch.randn(3, 5, 48, generator=gen).to(device)
    return (x, w), lambda x, w: [rms_norm(x, w)], [dy]


def _cross_entropy_case(device, gen):
    logits = torch.randn(2, 5, 70, generator=gen).to(device).requires_grad_()
    target = torch.randint(0, 70, (2, 5), generator=gen).to(device)
    target[0, 1] = -100

    def run(logits):
        # In place on a copy: the leaf keeps its values for the second run, and the gradient flows to it.
        return [cross_entropy(logits * 1.0, target, inplace_backward=True)]

    return (logits,), run, [torch.tensor(1.5, device=device)]


def _swiglu_case(device, gen):
    g0 = torch.randn(4, 9, 40, generator=gen).to(device).requires_grad_()
    u0 = torch.randn(4, 9, 40, generator=gen).to(device).requires_grad_()
    dy = torch.randn(4, 9, 40, generator=gen).to(device)
    # Outputs of other operations, so the in-place backward runs too.
    return (g0, u0), lambda g, u: [swiglu(g * 1.5, u * 0.5, inplace_backward=True)], [dy]


def _rope_case(device, gen):
    def llama_view(heads):
        x = torch.randn(2, 7, heads * 16, generator=gen).to(device)
        return x.view(2, 7, heads, 16).transpose(1, 2).requires_grad_()

    q, k = llama_view(4), llama_view(2)
    cos, sin = rotary_cos_sin(1, 7, 16, device=device)
    dq, dk = torch.randn(q.shape, generator=gen).to(device), torch.randn(k.shape, generator=gen).to(device)
    return (q, k), lambda q, k: list(apply_rotary(q, k, cos, sin)), [dq, dk]


CASES = {
    "rmsnorm": (_rmsnorm_case, {"kernels::rms_norm_fwd", "kernels::rms_norm_bwd"}),
    "cross_entropy": (_cross_entropy_case,
                      {"kernels::cross_entropy_fwd_inplace", "kernels::cross_entropy_scale_grad_"}),
    "swiglu": (_swiglu_case, {"kernels::swiglu_fwd", "kernels::swiglu_bwd_"}),
    "rope": (_rope_case, {"kernels::rope_fwd", "kernels::rope_bwd"}),
}


def _forward_backward(inputs, run, grads):
    for t in inputs:
        t.grad = None
    outputs = run(*inputs)
    torch.autograd.backward(outputs, grads)
    return [o.detach().clone() for o in outputs] + [t.grad.clone() for t in inputs]


def test_adamw_direct_and_operator_paths_give_the_same_bits(device, gen):
    weights = [torch.randn(37, generator=gen).to(device), torch.randn(5, 8, generator=gen).to(device)]
    grads = [torch.randn(w.shape, generator=gen).to(device) for w in weights]
    after = []
    for record in (None, _RecordOps()):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt = TritonAdamW(params, lr=1e-2, weight_decay=0.1)
        with record or contextlib.nullcontext():
            opt.step()
            opt.step()
        after.append([p.detach().clone() for p in params] + [opt.state[p]["exp_avg_sq"].clone() for p in params])
    assert "kernels::adamw_step_" in record.seen
    assert all(torch.equal(a, b) for a, b in zip(*after))
    assert not any(torch.equal(a, w) for a, w in zip(after[0], weights))  # the step changed every parameter


@pytest.mark.parametrize("family", CASES)
def test_direct_and_operator_paths_give_the_same_bits(device, gen, family):
    make, expected_ops = CASES[family]
    inputs, run, grads = make(device, gen)
    direct = _forward_backward(inputs, run, grads)
    with _RecordOps() as record:
        through_operators = _forward_backward(inputs, run, grads)
    assert expected_ops <= record.seen
    for a, b in zip(direct, through_operators):
        assert torch.equal(a, b)
    assert all(d.abs().sum() > 0 for d in direct)  # gradients were computed, not left at zero

