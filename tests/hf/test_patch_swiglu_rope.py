"""SwiGLU and RoPE in patch_llama (``kernels=("swiglu", "rope")``): equal losses and gradients, one model only, undo,
refusals, PEFT, compile."""

import copy
import functools
import importlib
import inspect

import pytest
import torch
from spies import count_calls
from test_patch import assert_grads_close, loss_and_grads, random_batch, seed_from, tiny_model

from kernels import host_path, runtime
from kernels.hf.patch import SWITCHES, patch_llama
from kernels.rope import apply_rotary
from kernels.swiglu import TritonSwiGLUMLP

BACKEND = runtime.COMPILE_BACKEND
# The modules by their paths: ``kernels.swiglu`` at the top level is the function.
rope_module = importlib.import_module("kernels.rope")
swiglu_module = importlib.import_module("kernels.swiglu")
rotary_module = importlib.import_module("kernels.hf.rotary")
ONLY_NEW = dict(kernels=("swiglu", "rope"))


@pytest.fixture
def calls(monkeypatch):
    """Counts of RoPE launches and SwiGLU forward/backward launches (spies on the host functions they go through)."""
    counts = {"rope": 0, "swiglu_fwd": 0, "swiglu_bwd": 0}

    count_calls(monkeypatch, counts, rope_module, "launch", "rope")
    count_calls(monkeypatch, counts, swiglu_module, "_forward_config", "swiglu_fwd")
    count_calls(monkeypatch, counts, swiglu_module, "_backward_config", "swiglu_bwd")
    return counts


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
def test_patched_model_matches_original(family, device, gen, calls, monkeypatch):
    # The counts below are the Python path's launches: on a GPU, RoPE's C++ node launches the same kernel without
    # passing through launch (tests/kernels/test_host_path.py compares the two; the next test runs the model
    # through it).
    monkeypatch.setattr(host_path, "takes_rope", lambda *args: False)
    model = tiny_model(family, seed_from(gen))
    reference = copy.deepcopy(model)
    batch = random_batch(gen)
    ref_loss, ref_grads = loss_and_grads(reference, batch)
    assert calls == {"rope": 0, "swiglu_fwd": 0, "swiglu_bwd": 0}
    patch = patch_llama(model, **ONLY_NEW)
    loss, grads = loss_and_grads(model, batch)
    layers = model.config.num_hidden_layers
    # Forward and backward ran ours; SwiGLU's forward kernel twice per layer: the backward recomputes the product
    # for down_proj's weight gradient (SwiGLUDownFunction).
    assert calls == {"rope": 2 * layers, "swiglu_fwd": 2 * layers, "swiglu_bwd": layers}
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert_grads_close(grads, ref_grads, 1e-5)
    summary = patch.summary()
    assert f"TritonSwiGLUMLP replaces {layers} " in summary and "RoPE: Triton apply_rotary in" in summary


def test_every_kernel_on_matches_original(device, gen, calls):
    model = tiny_model("qwen2", seed_from(gen))
    reference = copy.deepcopy(model)
    batch = random_batch(gen)
    ref_loss, ref_grads = loss_and_grads(reference, batch)
    # Every kernel that speeds a step up; the two memory switches need checkpointing (tests/hf/test_patch.py), and the
    # FP8 base rounds the weights and needs PEFT's layers (tests/hf/test_fp8_base_lora.py bounds what it changes).
    left_off = ("tiled_mlp", "offload_checkpoints", "fp8_base")
    patch_llama(model, **{name: True for name in SWITCHES if name not in left_off})
    loss, grads = loss_and_grads(model, batch)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(grads, ref_grads, 1e-5)
    assert calls["rope"] and calls["swiglu_bwd"]


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_inplace_backward_under_gradient_checkpointing(reentrant, device, gen, monkeypatch):
    # The patched MLP lets the SwiGLU backward overwrite gate and up; under checkpointing those are the recomputed
    # layer's tensors. Equal gradients, and the in-place path taken in every layer.
    model = tiny_model("llama", seed_from(gen))
    reference = copy.deepcopy(model)
    for m in (model, reference):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        m.train()
    batch = random_batch(gen)
    ref_loss, ref_grads = loss_and_grads(reference, batch)
    in_place = []
    original = swiglu_module._in_place_addressable
    monkeypatch.setattr(swiglu_module, "_in_place_addressable",
                        lambda g, u: in_place.append(original(g, u)) or in_place[-1])
    patch_llama(model, kernels=("swiglu",))
    loss, grads = loss_and_grads(model, batch)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert_grads_close(grads, ref_grads, 1e-5)
    assert in_place and all(in_place)  # once per layer and pass that saved gate and up


def test_a_second_model_is_untouched_and_undo_restores(device, gen, calls):
    model = tiny_model("llama", seed_from(gen))
    other = copy.deepcopy(model)
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    mlp_types = [type(layer.mlp) for layer in model.model.layers]
    patch = patch_llama(model, **ONLY_NEW)
    assert all(isinstance(layer.mlp, TritonSwiGLUMLP) for layer in model.model.layers)
    assert [n for n, _ in model.named_parameters()] == names and list(model.parameters()) == params
    assert all(a is b for a, b in zip(model.parameters(), params))
    # The model beside it: its classes' code and its modules are as they were, and it never calls our kernels.
    assert all("forward" not in layer.self_attn.__dict__ for layer in other.model.layers)
    other(**random_batch(gen))
    assert calls == {"rope": 0, "swiglu_fwd": 0, "swiglu_bwd": 0}
    batch = random_batch(gen)
    patched_loss = model(**batch).loss
    patch.undo()
    assert [type(layer.mlp) for layer in model.model.layers] == mlp_types
    assert all("forward" not in layer.self_attn.__dict__ for layer in model.model.layers)
    assert [n for n, _ in model.named_parameters()] == names and "undone" in patch.summary()
    before = dict(calls)
    torch.testing.assert_close(model(**batch).loss, patched_loss, rtol=1e-6, atol=1e-6)
    assert calls == before
    patch_llama(model, **ONLY_NEW).undo()  # patch again after undo, and undo again


def test_refusals_leave_the_model_unchanged(device, gen):
    model = tiny_model("llama", seed_from(gen))
    for layer in model.model.layers:
        layer.mlp.config = copy.copy(layer.mlp.config)
        layer.mlp.config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        patch_llama(model, **ONLY_NEW)
    assert not any(isinstance(layer.mlp, TritonSwiGLUMLP) for layer in model.model.layers)
    assert all("forward" not in layer.self_attn.__dict__ for layer in model.model.layers)
    patch_llama(model, kernels=("rope",)).undo()  # rope alone is fine

    model = tiny_model("llama", seed_from(gen))
    model.model.layers[1].self_attn.forward = lambda *a, **k: None  # e.g. a hook that wraps forward
    with pytest.raises(ValueError, match="already replaced on the instance"):
        patch_llama(model, **ONLY_NEW)
    with pytest.raises(ValueError, match="has no attention module"):
        patch_llama(torch.nn.Sequential(torch.nn.Linear(2, 2)), kernels=("rope",))
    with pytest.raises(TypeError, match="swiglu must be True or False"):
        patch_llama(model, swiglu="yes")

    # Classes it does not know are refused by name, even subclasses of the known ones.
    model = tiny_model("llama", seed_from(gen))
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    attention.__class__ = type("MyAttention", (type(attention),), {})
    with pytest.raises(ValueError, match="MyAttention is not an attention class patch_llama knows"):
        patch_llama(model, kernels=("rope",))
    mlp.__class__ = type("MyMLP", (type(mlp),), {})
    with pytest.raises(ValueError, match="MyMLP is not an MLP whose code patch_llama knows"):
        patch_llama(model, kernels=("swiglu",))
    assert all("forward" not in layer.self_attn.__dict__ for layer in model.model.layers)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):  # the name a patched forward resolves to our kernel
    raise AssertionError("the patched function called the original")


def _renaming(fn):
    # A decorator that keeps the function it wraps, as transformers' deprecate_kwarg does around some forwards.
    @functools.wraps(fn)
    def wrapper(*args, old=None, **kwargs):
        if old is not None:
            kwargs["new"] = old
        return fn(*args, **kwargs)
    return wrapper


@_renaming
def _wrapped_forward(new=None):
    return apply_rotary_pos_emb, new


def test_a_wrapped_forward_keeps_its_wrapper_around_the_rebuilt_function():
    rebuilt = rotary_module._rebuilt_with_kernel_rotary(_wrapped_forward, "here")
    assert rebuilt(old=3) == (apply_rotary, 3)  # our kernel inside, and the wrapper still renames the argument
    assert _wrapped_forward(old=3) == (apply_rotary_pos_emb, 3)  # the original untouched
    assert inspect.unwrap(rebuilt).__globals__["apply_rotary_pos_emb"] is apply_rotary

    def opaque(*args, **kwargs):  # says what it wraps but calls it through something else
        return registry["fn"](*args, **kwargs)
    registry = {"fn": inspect.unwrap(_wrapped_forward)}
    opaque.__wrapped__ = registry["fn"]
    with pytest.raises(ValueError, match="cannot be rebuilt around the patched function"):
        rotary_module._rebuilt_with_kernel_rotary(opaque, "here")


# LoRA on gate and up leaves down_proj a frozen nn.Linear (the MLP's fused down projection, nothing recomputed); LoRA
# on down_proj makes it a PEFT layer, which keeps its own forward.
@pytest.mark.parametrize("targets", [("q_proj", "gate_proj", "up_proj"), ("down_proj",)], ids=["gate-up", "down"])
def test_peft_lora_still_trains(targets, device, gen):
    peft = pytest.importorskip("peft", reason="peft is a test requirement (requirements.txt)")
    base = tiny_model("llama", seed_from(gen))
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), lora_dropout=0.0)

    def lora(model):
        wrapped = peft.get_peft_model(model, config)
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for name, p in wrapped.named_parameters():
                if "lora_B" in name:  # B starts at zero; give it values so the adapters' gradients are tested
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        return wrapped

    reference = lora(base)  # LoRA's A matrices are drawn at random: copy one wrapped model rather than wrap twice
    model = copy.deepcopy(reference)
    patch_llama(model, **ONLY_NEW)  # wrap, then patch: the gate/up projections carry LoRA layers
    batch = random_batch(gen)

    def loss_and_adapter_grads(m):
        m.zero_grad(set_to_none=True)
        loss = m(**batch).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}

    ref_loss, ref_grads = loss_and_adapter_grads(reference)
    loss, grads = loss_and_adapter_grads(model)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert all("lora_" in n for n in ref_grads) and any(f"mlp.{targets[-1]}.lora_A" in n for n in ref_grads)
    assert_grads_close(grads, ref_grads, 1e-5)
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1).step()
    assert loss_and_adapter_grads(model)[0] < loss


def test_compiled_patched_model_has_no_new_graph_break(device, gen):
    # RMSNorm and the loss under torch.compile are tested in test_ops.py; here the two new swaps.
    torch._dynamo.reset()
    model = tiny_model("llama", seed_from(gen))
    batch = random_batch(gen)
    unpatched = torch._dynamo.explain(model)(**batch)
    torch._dynamo.reset()
    patch_llama(model, **ONLY_NEW)
    eager_loss, eager_grads = loss_and_grads(model, batch)
    if unpatched.graph_break_count == 0:
        compiled = torch.compile(model, backend=BACKEND, fullgraph=True)  # any graph break raises
    else:  # a transformers version whose model breaks by itself: the patch must add none
        patched = torch._dynamo.explain(model)(**batch)
        assert patched.graph_break_count == unpatched.graph_break_count, patched.break_reasons
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=BACKEND)
    compiled_loss, compiled_grads = loss_and_grads(compiled, batch)
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close({n.removeprefix("_orig_mod."): g for n, g in compiled_grads.items()}, eager_grads, 1e-5)
    torch._dynamo.reset()
