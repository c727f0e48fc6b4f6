"""The attention kernels' Hopper paths (kernels/attention.py, version 6) against float64: tiles loaded through tensor
descriptors (the TMA), and the one-pass backward that adds dQ into float32 as the dK/dV walk goes, with atomics or
with the TMA's bulk reduction (GPU only). Dense and packed rows, GQA, odd lengths, documents of one token; views the
copy engine cannot read fall back to pointer loads; the configuration turns the TMA on only where the GPU has it.

In Triton's interpreter the descriptor loads are emulated and the one pass adds with atomics; the TMA's reduction runs
only on a GPU (the gpu-marked tests).
"""

import dataclasses

import pytest
import torch

from kernels import attention as attention_module
from kernels import runtime
from kernels.attention import (
    BlockConfig,
    Config,
    attention_backward,
    attention_config,
    attention_forward,
    attention_reference,
    check_config,
    segment_bounds,
    tma_ready,
)
from kernels.reference import relative_error
from kernels.tolerances import RELATIVE_ERROR_TOL

SMALL = BlockConfig(16, 16, 4, 1)
BASE = Config(SMALL, BlockConfig(16, 32, 4, 1), SMALL, 16, interior=True)
VARIANTS = {
    "tma-loads": dict(tma=True),
    "one-pass": dict(onepass=BlockConfig(16, 32, 4, 1)),
    "one-pass-tma-loads": dict(onepass=BlockConfig(32, 16, 4, 1), tma=True),
}


def _bshd(gen, device, batch, heads, seq, head_dim, dtype):
    # [batch, heads, seq, head_dim] views of [batch, seq, heads, head_dim] memory, as Llama's projections give them
    x = torch.randn(batch, seq, heads, head_dim, generator=gen).to(device, dtype).transpose(1, 2)
    return x


def _against_float64(q, k, v, cfg, causal, bounds, gen, tol, layouts=True):
    """``cfg``'s kernels, forward and backward, against float64: the output and every gradient within ``tol``, each
    gradient in its input's layout (``layouts``: the inputs are dense)."""
    seq = q.shape[2]
    cu = torch.tensor(bounds, dtype=torch.int32) if bounds else None
    seg = segment_bounds(cu.to(q.device), seq) if bounds else (None, None)
    out, lse = attention_forward(q, k, v, causal, 0.25, *seg, config=cfg)
    grad = torch.randn(out.shape, generator=gen).to(q.device, q.dtype)
    grads = attention_backward(grad, q, k, v, out, lse, causal, 0.25, *seg, config=cfg)
    leaves = [x.double().requires_grad_(True) for x in (q, k, v)]
    ref = attention_reference(*leaves, causal=causal, scale=0.25, cu_seqlens=cu)
    ref_grads = torch.autograd.grad(ref, leaves, grad.double())
    for name, a, b, like in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads), (q, q, k, v)):
        assert a.shape == b.shape and (not layouts or a.stride() == like.stride()), name
        assert relative_error(a, b) < tol, f"{name}: {relative_error(a, b):.2e}"


# Each path on dense rows, on short and odd documents, and on one document across the row, causal or not (every
# pairing of a path with a mask is walked by some row).
CASES = [(variant, causal, bounds) for variant in VARIANTS
         for causal, bounds in ((True, None), (variant != "one-pass", [0, 1, 20, 21, 45, 70]),
                                (variant == "one-pass", [0, 70]))]


@pytest.mark.parametrize("variant, causal, bounds", CASES,
                         ids=[f"{v}-{'causal' if c else 'full'}-{'dense' if b is None else len(b) - 1}docs"
                              for v, c, b in CASES])
def test_hopper_paths_match_float64(device, gen, variant, causal, bounds):
    # 70 tokens: the last block is ragged (the copy engine zero-fills past the end, the reduction drops it).
    q = _bshd(gen, device, 1 if bounds else 2, 4, 70, 16, torch.float32)
    k, v = (_bshd(gen, device, 1 if bounds else 2, 2, 70, 16, torch.float32) for _ in range(2))
    _against_float64(q, k, v, dataclasses.replace(BASE, **VARIANTS[variant]), causal, bounds, gen, 1e-5)


def test_tma_ready_refuses_what_the_copy_engine_cannot_read(device):
    x = torch.zeros(2, 8, 3, 17, device=device)
    assert tma_ready(torch.zeros(2, 8, 3, 16, device=device).transpose(1, 2))
    assert not tma_ready(x[..., :16])  # rows 68 bytes apart: not a multiple of 16
    assert not tma_ready(x[..., 1:])  # starts 4 bytes past an aligned address
    assert not tma_ready(torch.zeros(2, 3, 16, 8, device=device).transpose(-1, -2))  # columns not adjacent
    if runtime.MODE == "gpu":
        assert not tma_ready(torch.zeros(2, 3, 8, 16))  # a CPU tensor: no copy engine
        if torch.cuda.get_device_capability()[0] < 9:
            assert not tma_ready(torch.zeros(2, 3, 8, 16, device=device))  # no TMA before Hopper


@pytest.mark.parametrize("variant", ["tma-loads", "one-pass-tma-loads"])
def test_views_the_copy_engine_cannot_read_take_pointer_loads(device, gen, variant):
    # q, k and v sliced out of wider rows (17 floats: 68 bytes between rows): tma_ready says no, the kernels read
    # through pointers and give the same answer.
    def sliced(heads):
        return torch.randn(1, 40, heads, 17, generator=gen).to(device)[..., :16].transpose(1, 2)
    q, k, v = sliced(4), sliced(2), sliced(2)
    assert not tma_ready(q)
    _against_float64(q, k, v, dataclasses.replace(BASE, **VARIANTS[variant]), True, None, gen, 1e-5, layouts=False)


def test_the_configuration_turns_the_tma_on_only_where_the_gpu_has_it(monkeypatch):
    hopper = runtime.DeviceProps("a Hopper GPU", False, 132, 227 << 10, 64 << 10, capability=(9, 0))
    ampere = dataclasses.replace(hopper, name="an Ampere GPU", capability=(8, 0))
    on = attention_config(8192, 128, hopper)
    assert on.tma and on.onepass is None and not on.tma_reduce and not on.warp_specialize
    assert not attention_config(8192, 128, ampere).tma
    assert not attention_config(77, 16, runtime.INTERPRETER).tma
    assert not attention_config(8192, 128, hopper, packed=True).tma  # packed rows: pointer loads
    monkeypatch.setattr(attention_module, "PACKED_TMA", True)
    assert attention_config(8192, 128, hopper, packed=True).tma
    monkeypatch.setattr(attention_module, "USE_TMA", False)
    assert not attention_config(8192, 128, hopper).tma and not attention_config(8192, 128, hopper, packed=True).tma


def test_tma_reduce_needs_a_one_pass_tile():
    with pytest.raises(ValueError, match="needs config.onepass"):
        check_config(dataclasses.replace(BASE, tma_reduce=True))


@pytest.mark.skipif(runtime.MODE == "gpu", reason="the interpreter's refusal")
def test_the_interpreter_refuses_the_tma_reduction(gen):
    q, k, v = (_bshd(gen, "cpu", 1, 2, 20, 16, torch.float32) for _ in range(3))
    out, lse = attention_forward(q, k, v, True, 0.25, config=BASE)
    cfg = dataclasses.replace(BASE, onepass=SMALL, tma_reduce=True)
    with pytest.raises(ValueError, match="no TMA reduction"):
        attention_backward(torch.ones_like(out), q, k, v, out, lse, True, 0.25, config=cfg)


def test_deterministic_algorithms_run_the_two_kernels(device, gen):
    # The one pass sums dQ in no fixed order; under torch.use_deterministic_algorithms the two kernels run instead:
    # the same bits as the two-kernel configuration.
    q, k, v = (_bshd(gen, device, 1, 2, 50, 16, torch.float32) for _ in range(3))
    out, lse = attention_forward(q, k, v, True, 0.25, config=BASE)
    grad = torch.randn(out.shape, generator=gen).to(device)
    two = attention_backward(grad, q, k, v, out, lse, True, 0.25, config=BASE)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        one = attention_backward(grad, q, k, v, out, lse, True, 0.25,
                                 config=dataclasses.replace(BASE, onepass=BlockConfig(16, 32, 4, 1)))
    finally:
        torch.use_deterministic_algorithms(was)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


GPU_VARIANTS = {
    "configured": {},
    "pointer-loads": dict(tma=False),
    "tma-loads": dict(tma=True),
    "one-pass-atomics": dict(onepass=BlockConfig(64, 128, 8, 2), tma=True),
    "one-pass-tma-reduce": dict(onepass=BlockConfig(64, 128, 8, 2), tma=True, tma_reduce=True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("variant", GPU_VARIANTS)
@pytest.mark.parametrize("seq, bounds", [(1000, None), (2049, None), (1500, [0, 1, 700, 701, 1500])],
                         ids=["dense-1000", "dense-2049", "packed-ragged"])
def test_gpu_hopper_paths_at_the_8b_shape(gen, variant, seq, bounds):
    # The 8B attention shape (32 query heads, 8 KV heads, d = 128, bf16) on the GPU: the configured kernels (the TMA
    # on Hopper), pointer loads, and the one pass with atomics and with the TMA's reduction, against float64.
    q = _bshd(gen, "cuda", 1, 32, seq, 128, torch.bfloat16)
    k, v = (_bshd(gen, "cuda", 1, 8, seq, 128, torch.bfloat16) for _ in range(2))
    cfg = attention_config(seq, 128, runtime.device_props(q.device), 2, packed=bounds is not None)
    _against_float64(q, k, v, dataclasses.replace(cfg, **GPU_VARIANTS[variant]), True, bounds, gen,
                     RELATIVE_ERROR_TOL[torch.bfloat16])
