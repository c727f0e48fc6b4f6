"""patch_llama with PEFT LoRA models. First the norm and the loss alone, in either order (wrap then patch, patch
then wrap; undo in both). Then the ``lora`` switch: the same losses and adapter gradients as PEFT (float32 to
rounding, bfloat16 within the tolerance table), both orders, r = 1, rsLoRA, attention-only targets, an SFT label
mask, what is left to PEFT and why, undo, save_pretrained, merge_and_unload after undo, checkpointing."""

import copy

import pytest
import torch

from kernels.hf import lora as hf_lora
from kernels.hf.lora import LoraFusion, why_not_fused
from kernels.hf.patch import patch_llama
from kernels.lora import LoRAGroupFunction, LoRALinearFunction, SwiGLULoRADownFunction
from kernels.reference import relative_error
from kernels.tolerances import RELATIVE_ERROR_TOL as TOL
from kernels.training.models import build_model

peft = pytest.importorskip("peft", reason="peft is a test requirement (requirements.txt)")
NORM_AND_LOSS = ("rms_norm", "cross_entropy")


def _lora_config():
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


@pytest.fixture
def base_and_batch(device, gen):
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=gen)))
    model = build_model("tiny", dtype=torch.float32).to(device).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=gen).to(device)
    labels = ids.clone()
    labels[:, :4] = -100
    return model, ids, labels


def lora_with_values(model, config):
    """``model`` wrapped by PEFT with ``config``, its B matrices given values (LoRA starts B at zero, which would make
    the adapters' effect and dA zero, and a test of them pass on anything)."""
    wrapped = peft.get_peft_model(model, config)
    for name, p in wrapped.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    return wrapped


def _lora(model):
    return lora_with_values(model, _lora_config())


def loss_and_grads(model, ids, labels):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads


def _assert_same(result, reference):
    (loss, grads), (ref_loss, ref_grads) = result, reference
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys() and any("lora_A" in k for k in grads)  # only the adapters train
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.fixture
def lora_reference(base_and_batch):
    """The unpatched LoRA model and its loss and gradients: what every patched variant must reproduce."""
    base, ids, labels = base_and_batch
    reference = _lora(copy.deepcopy(base))
    return reference, loss_and_grads(reference, ids, labels)


@pytest.mark.parametrize("kernels", [NORM_AND_LOSS, "auto"], ids=["norm-and-loss", "defaults"])
def test_wrap_then_patch(base_and_batch, lora_reference, kernels):
    _, ids, labels = base_and_batch
    reference, expected = lora_reference
    model = copy.deepcopy(reference)
    patch = patch_llama(model, kernels=kernels)
    assert len(patch.replaced) > 0 and patch.model is model.get_base_model()
    _assert_same(loss_and_grads(model, ids, labels), expected)
    patch.undo()
    assert not any("TritonRMSNorm" in type(m).__name__ for m in model.modules())
    _assert_same(loss_and_grads(model, ids, labels), expected)


def test_patch_then_wrap(base_and_batch, lora_reference):
    base, ids, labels = base_and_batch
    reference, expected = lora_reference
    inner = copy.deepcopy(base)
    patch = patch_llama(inner, kernels=NORM_AND_LOSS)
    model = peft.get_peft_model(inner, _lora_config())
    model.load_state_dict(reference.state_dict())  # the same adapter weights as the reference
    _assert_same(loss_and_grads(model, ids, labels), expected)
    patch.undo()
    _assert_same(loss_and_grads(model, ids, labels), expected)


def test_patching_a_patched_peft_model_twice_is_refused(base_and_batch):
    base, _, _ = base_and_batch
    model = _lora(copy.deepcopy(base))
    patch_llama(model, kernels=NORM_AND_LOSS)
    with pytest.raises(RuntimeError, match="already patched"):
        patch_llama(model)


# The lora switch: PEFT's adapters as fused nodes.

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _config(r=4, alpha=8, targets=ALL_TARGETS, **kwargs):
    return peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=kwargs.pop("dropout", 0.0),
                           **kwargs)


def _batch(model, gen, device, seq=21):
    ids = torch.randint(0, model.config.vocab_size, (2, seq), generator=gen).to(device)
    labels = ids.clone()
    labels[0, :7] = -100  # an SFT mask: the prompt's labels do not count
    labels[1, :3] = -100
    return ids, labels


def _base(device, gen, dtype=torch.float32):
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=gen)))
    return build_model("tiny", dtype=dtype).to(device).train()


def _assert_close(result, reference, tol):
    (loss, grads), (ref_loss, ref_grads) = result, reference
    assert relative_error(loss, ref_loss) < tol
    assert grads.keys() == ref_grads.keys()
    assert any("lora_A" in k for k in grads) and all("lora_" in k for k in grads)  # only the adapters train
    for name in ref_grads:
        assert relative_error(grads[name], ref_grads[name]) < tol, name


def _fused_count(model) -> int:
    return sum(1 for m in model.modules() if "forward" in m.__dict__ and hasattr(m, "lora_A"))


@pytest.mark.parametrize("config", [
    dict(r=4, alpha=8),
    dict(r=1, alpha=3, use_rslora=True, targets=["q_proj", "k_proj", "v_proj", "o_proj"]),
], ids=["all-targets", "r1-rslora-attention-only"])
def test_wrap_then_patch_float32(device, gen, config):
    base = _base(device, gen)
    reference = lora_with_values(copy.deepcopy(base), _config(**config))
    ids, labels = _batch(base, gen, device)
    expected = loss_and_grads(reference, ids, labels)
    model = copy.deepcopy(reference)
    patch = patch_llama(model, kernels=("lora",))
    assert patch.kernels == ("lora",) and "lora" not in patch.left_off
    assert _fused_count(model) == len(patch.lora.layers) > 0
    _assert_close(loss_and_grads(model, ids, labels), expected, TOL[torch.float32])
    patch.undo()
    assert _fused_count(model) == 0
    _assert_close(loss_and_grads(model, ids, labels), expected, TOL[torch.float32])


def test_lora_is_a_default_where_the_model_holds_lora_layers(device, gen):
    base = _base(device, gen)
    wrapped = lora_with_values(copy.deepcopy(base), _config(targets=["q_proj", "down_proj"]))
    patch = patch_llama(wrapped)  # wrapped first: the adapters are there, lora is on
    assert "lora" in patch.kernels and _fused_count(wrapped) == 2 * wrapped.config.num_hidden_layers
    patch.undo()
    with patch_llama(wrapped, lora=False) as off:
        assert "lora" not in off.kernels and _fused_count(wrapped) == 0
    with patch_llama(copy.deepcopy(base)) as plain:  # no adapter, nothing to say about lora
        assert "lora" not in plain.kernels and "lora" not in plain.left_off


def _counting(monkeypatch, cls, calls, name):
    apply = cls.apply
    monkeypatch.setattr(cls, "apply", lambda *a: calls.append(name) or apply(*a))


def _patched_in_order(order, base, reference):
    """(model, handle): PEFT's LoRA model with reference's values, patched with swiglu and lora, wrapped then patched
    or patched then wrapped."""
    if order == "wrap, patch":
        model = copy.deepcopy(reference)
        return model, patch_llama(model, kernels=("swiglu", "lora"))
    inner = copy.deepcopy(base)
    patch = patch_llama(inner, kernels=("swiglu", "lora"))
    model = peft.get_peft_model(inner, _config())
    model.load_state_dict(reference.state_dict())
    return model, patch


def test_down_proj_over_the_fused_swiglu_keeps_no_product(device, gen, monkeypatch):
    # With the SwiGLU kernel on, each LoRA down_proj and its SwiGLU are one node (SwiGLULoRADownFunction), in both
    # orders; PEFT's losses and gradients; after undo no layer keeps the method.
    calls = []
    _counting(monkeypatch, SwiGLULoRADownFunction, calls, 1)
    base = _base(device, gen)
    reference = lora_with_values(copy.deepcopy(base), _config())
    ids, labels = _batch(base, gen, device)
    expected = loss_and_grads(reference, ids, labels)
    layers = base.config.num_hidden_layers
    for order in ("wrap, patch", "patch, wrap"):
        calls.clear()
        model, patch = _patched_in_order(order, base, reference)
        _assert_close(loss_and_grads(model, ids, labels), expected, TOL[torch.float32])
        assert len(calls) == layers, order
        patch.undo()
        assert not any("forward_after_swiglu" in m.__dict__ for m in model.modules())
        calls.clear()
        _assert_close(loss_and_grads(model, ids, labels), expected, TOL[torch.float32])
        assert calls == []


@pytest.mark.parametrize("order", ["wrap, patch", "patch, wrap"])
def test_layers_on_a_shared_input_run_as_one_node(device, gen, monkeypatch, order):
    # q/k/v and gate/up are one node each per decoder layer (kernels.lora.lora_group), o_proj fused alone and down_proj
    # over the SwiGLU, in both orders; PEFT's losses and gradients; with SHARED_INPUT off, each layer on its own.
    calls = []
    for cls, name in ((LoRAGroupFunction, "group"), (LoRALinearFunction, "one"), (SwiGLULoRADownFunction, "down")):
        _counting(monkeypatch, cls, calls, name)
    base = _base(device, gen)
    reference = lora_with_values(copy.deepcopy(base), _config())
    ids, labels = _batch(base, gen, device)
    expected = loss_and_grads(reference, ids, labels)
    model, patch = _patched_in_order(order, base, reference)
    _assert_close(loss_and_grads(model, ids, labels), expected, TOL[torch.float32])
    layers = base.config.num_hidden_layers
    assert sorted(calls) == sorted(["group"] * 2 * layers + ["one"] * layers + ["down"] * layers)
    assert f"{2 * layers} groups of them on a shared input" in patch.lora.summary()
    assert not any("_lora_pending" in m.__dict__ for m in model.modules())  # every output handed out
    calls.clear()
    monkeypatch.setattr(hf_lora, "SHARED_INPUT", False)
    _assert_close(loss_and_grads(model, ids, labels), expected, TOL[torch.float32])
    assert sorted(calls) == sorted(["one"] * 6 * layers + ["down"] * layers)
    patch.undo()
    assert not any(k.startswith("_lora") for m in model.modules() for k in m.__dict__)


def test_a_sibling_takes_the_group_output_only_for_the_same_input(device, gen):
    # k_proj hands out what q_proj's group node left for it only when called on the very tensor q_proj was, with
    # nothing changed since: another input, an in-place change of the input or of its adapter, or another grad mode
    # computes afresh.
    model = lora_with_values(_base(device, gen), _config(targets=["q_proj", "k_proj", "v_proj"]))
    patch_llama(model, kernels=("lora",))
    attn = model.base_model.model.model.layers[0].self_attn
    hidden = model.config.hidden_size

    def fresh(layer, x):
        with torch.no_grad():
            return type(layer).forward(layer, x)  # PEFT's own forward

    x = torch.randn(3, 5, hidden, generator=gen).to(device)
    other = torch.randn(3, 5, hidden, generator=gen).to(device)
    attn.q_proj(x)
    assert torch.allclose(attn.k_proj(other), fresh(attn.k_proj, other), atol=1e-5)
    attn.q_proj(x)
    x.add_(1.0)
    assert torch.allclose(attn.k_proj(x), fresh(attn.k_proj, x), atol=1e-5)
    attn.q_proj(x)
    with torch.no_grad():
        attn.v_proj.lora_B["default"].weight.mul_(2.0)
    assert torch.allclose(attn.v_proj(x), fresh(attn.v_proj, x), atol=1e-5)
    with torch.no_grad():
        attn.q_proj(x)
    y = attn.k_proj(x)
    assert y.requires_grad and torch.allclose(y, fresh(attn.k_proj, x), atol=1e-5)
    attn.q_proj(x)
    y = attn.k_proj(x)
    assert y.grad_fn is not None and "LoRAGroup" in type(y.grad_fn).__name__ + str(y.grad_fn.next_functions)
    # A sibling with a forward pre-hook keeps its own computation: the hook may change its weights in ways no
    # version counter sees (through .data), after the group would have run.
    lora_b = attn.v_proj.lora_B["default"].weight

    def double_b(module, args):
        lora_b.data.mul_(2.0)

    handle = attn.v_proj.register_forward_pre_hook(double_b)
    attn.v_proj.__dict__.pop("_lora_pending", None)
    attn.q_proj(x)
    assert "_lora_pending" not in attn.v_proj.__dict__
    y = attn.v_proj(x)  # the hook doubles B, then v_proj computes
    handle.remove()
    assert torch.allclose(y, fresh(attn.v_proj, x), atol=1e-5)


def test_patch_then_wrap_with_every_default_kernel(device, gen):
    base = _base(device, gen)
    reference = lora_with_values(copy.deepcopy(base), _config())
    ids, labels = _batch(base, gen, device, seq=19)
    expected = loss_and_grads(reference, ids, labels)
    inner = copy.deepcopy(base)
    patch = patch_llama(inner, lora=True)  # the defaults and lora: no LoRA layer yet
    assert "lora" in patch.kernels and patch.lora.layers == []
    model = peft.get_peft_model(inner, _config())
    model.load_state_dict(reference.state_dict())
    result = loss_and_grads(model, ids, labels)
    assert _fused_count(model) == 7 * model.config.num_hidden_layers  # found by the hook at the first forward
    _assert_close(result, expected, 5e-5)  # every kernel on: the norms and the loss round differently too
    patch.undo()  # the MLPs are the Llama's own again, with the adapters PEFT put into the patched ones
    assert _fused_count(model) == 0
    assert model.state_dict().keys() == reference.state_dict().keys()
    _assert_close(loss_and_grads(model, ids, labels), expected, TOL[torch.float32])


def test_bfloat16_as_close_to_float64_as_peft(device, gen):
    """In bfloat16 both PEFT's step and the fused one round, layer after layer: each is measured against the same
    model in float64, and the fused one must be as close as PEFT's own (and within bfloat16's bound on the loss)."""
    base = _base(device, gen, torch.bfloat16)
    reference = lora_with_values(copy.deepcopy(base), _config(r=2, alpha=4))  # PEFT keeps the adapters in float32
    ids, labels = _batch(base, gen, device)
    peft_result = loss_and_grads(reference, ids, labels)
    exact = loss_and_grads(copy.deepcopy(reference).double(), ids, labels)
    model = copy.deepcopy(reference)
    patch_llama(model, kernels=("lora",))
    assert next(p for n, p in model.named_parameters() if "lora_A" in n).dtype == torch.float32
    (loss, grads), (_, peft_grads), (loss64, grads64) = loss_and_grads(model, ids, labels), peft_result, exact
    assert relative_error(loss, loss64) < TOL[torch.bfloat16]
    assert grads.keys() == grads64.keys()
    # The fused GEMMs keep x in bfloat16 (no float32 copy of it, which is where PEFT's extra memory goes) and round
    # the [tokens, r] product once more. Over all adapter gradients together that costs little: over 60 seeds the
    # fused error was 0.87-1.32x PEFT's. One small tensor alone varies more (up to 2.6x PEFT's in the same seeds),
    # so each is held to 4x, still far below what zeros or a wrong gradient give (a relative error near 1).
    assert_adapter_grads_near_peft(grads, peft_grads, grads64)


def test_under_gradient_checkpointing(device, gen):
    base = _base(device, gen)
    reference = lora_with_values(copy.deepcopy(base), _config())
    ids, labels = _batch(base, gen, device)
    expected = loss_and_grads(reference, ids, labels)
    model = copy.deepcopy(reference)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    patch_llama(model, kernels=("lora",))
    _assert_close(loss_and_grads(model, ids, labels), expected, TOL[torch.float32])


def test_what_stays_peft_and_why(device, gen):
    base = _base(device, gen)
    dropout = lora_with_values(copy.deepcopy(base), _config(targets=["q_proj"], dropout=0.1))
    reference = copy.deepcopy(dropout)
    patch = patch_llama(dropout, kernels=("lora",))
    assert "lora_dropout=0.1" in patch.left_off["lora"] and "q_proj" in patch.left_off["lora"]
    # Every layer of a q/k/v group left to PEFT: no group runs as one node ("0 of 14 fused, 4 groups ... as one node
    # each" said both).
    all_dropout = patch_llama(lora_with_values(copy.deepcopy(base), _config(dropout=0.1)), kernels=("lora",))
    assert all_dropout.lora.summary().startswith("0 of ") and "one node" not in all_dropout.lora.summary()
    dora = lora_with_values(copy.deepcopy(base), _config(targets=["v_proj"], use_dora=True))
    assert "variant" in patch_llama(dora, kernels=("lora",)).left_off["lora"]
    two = lora_with_values(copy.deepcopy(base), _config(targets=["q_proj"]))
    two.add_adapter("second", _config(targets=["q_proj"]))
    two.base_model.set_adapter(["default", "second"])
    assert "2 active adapters" in patch_llama(two, kernels=("lora",)).left_off["lora"]
    merged = lora_with_values(copy.deepcopy(base), _config(targets=["k_proj"]))
    layer = merged.base_model.model.model.layers[0].self_attn.k_proj
    layer.merge()
    assert why_not_fused(layer) == "adapter merged into the base weight"
    # What stays PEFT's still computes PEFT's answer (the fused forward hands those calls back).
    ids, _ = _batch(base, gen, device)
    dropout.eval(), reference.eval()
    torch.testing.assert_close(dropout(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_no_lora_layers_changes_nothing(device, gen):
    model = _base(device, gen)
    patch = patch_llama(model, kernels=("lora",))
    assert isinstance(patch.lora, LoraFusion) and patch.lora.layers == []
    ids, _ = _batch(model, gen, device)
    model(input_ids=ids)
    patch.undo()
    assert not model.model._forward_pre_hooks  # the hook that finds later layers is gone


def test_save_pretrained_and_merge_after_undo(device, gen, tmp_path):
    base = _base(device, gen)
    reference = lora_with_values(copy.deepcopy(base), _config(r=2, alpha=4))
    model = copy.deepcopy(reference)
    patch = patch_llama(model, kernels=("lora",))
    model.save_pretrained(tmp_path / "adapter")
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "adapter")
    ids, _ = _batch(base, gen, device)
    reference.eval(), loaded.eval(), model.eval()
    expected = reference(input_ids=ids).logits
    torch.testing.assert_close(loaded(input_ids=ids).logits, expected)
    torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
    patch.undo()
    merged = model.merge_and_unload()
    assert not any(hasattr(m, "lora_A") for m in merged.modules())
    torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_patched_peft_model_has_one_graph_and_peft_gradients(device, gen):
    from kernels import runtime

    base = _base(device, gen)
    reference = lora_with_values(copy.deepcopy(base), _config(targets=["q_proj", "v_proj", "up_proj"]))
    ids, labels = _batch(base, gen, device)
    expected = loss_and_grads(reference, ids, labels)
    model = copy.deepcopy(reference)
    patch = patch_llama(model)
    assert "lora" in patch.kernels
    explained = torch._dynamo.explain(model)(input_ids=ids, labels=labels)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=runtime.COMPILE_BACKEND)
    loss, grads = loss_and_grads(compiled, ids, labels)
    grads = {name.removeprefix("_orig_mod."): g for name, g in grads.items()}  # the compiled wrapper's prefix
    _assert_close((loss, grads), expected, 5e-5)  # every kernel on, as patch-then-wrap


# patch_llama(model) first and the adapters after it: the order of Liger-style scripts and of TRL's
# SFTTrainer(model, peft_config=...). The default fuses the LoRA layers whichever way they arrive.

def _count_nodes(monkeypatch) -> list:
    calls = []
    for cls, name in ((LoRAGroupFunction, "group"), (LoRALinearFunction, "one"), (SwiGLULoRADownFunction, "down")):
        _counting(monkeypatch, cls, calls, name)
    return calls


def _every_node(layers: int) -> list:
    # Each decoder layer with all seven projections adapted: q/k/v and gate/up one node each, o_proj one, down_proj
    # over the SwiGLU one.
    return sorted(["group"] * 2 * layers + ["one"] * layers + ["down"] * layers)


def _with_values(model, gen):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # B starts at zero: give it values, so the adapters change the loss and dA
                p.copy_(torch.randn(p.shape, generator=gen).to(p) * 0.05)
    return model


def test_patch_then_get_peft_model_fuses_by_default(device, gen, monkeypatch):
    base = _base(device, gen)
    reference = lora_with_values(copy.deepcopy(base), _config())
    ids, labels = _batch(base, gen, device)
    expected = loss_and_grads(reference, ids, labels)
    inner = copy.deepcopy(base)
    patch = patch_llama(inner)  # the defaults, no LoRA layer yet: lora waits for them and is not listed
    assert "lora" not in patch.kernels and "lora" not in patch.left_off and patch.lora.layers == []
    model = peft.get_peft_model(inner, _config())
    model.load_state_dict(reference.state_dict())
    assert "lora" in patch.kernels  # the model holds LoRA layers now
    calls = _count_nodes(monkeypatch)
    result = loss_and_grads(model, ids, labels)
    assert sorted(calls) == _every_node(base.config.num_hidden_layers)
    _assert_close(result, expected, 5e-5)  # every default kernel on: the norms and the loss round differently too
    assert _fused_count(model) == 7 * model.config.num_hidden_layers and "lora" not in patch.left_off
    patch.undo()
    assert _fused_count(model) == 0 and not model.base_model.model.model._forward_pre_hooks
    _assert_close(loss_and_grads(model, ids, labels), expected, TOL[torch.float32])
    with patch_llama(copy.deepcopy(base), lora=False) as off:  # lora=False: no hook waits for layers
        assert off.lora is None and not off.model.model._forward_pre_hooks


def test_patch_then_wrap_names_what_stays_peft_after_the_first_forward(device, gen):
    base = _base(device, gen)
    inner = copy.deepcopy(base)
    patch = patch_llama(inner)
    model = _with_values(peft.get_peft_model(inner, _config(targets=["q_proj", "o_proj"], dropout=0.1)), gen)
    ids, labels = _batch(base, gen, device)
    model(input_ids=ids, labels=labels)
    assert "lora_dropout=0.1" in patch.left_off["lora"] and "o_proj" in patch.left_off["lora"]
    assert patch.lora.summary().startswith(f"0 of {2 * base.config.num_hidden_layers} LoRA layers fused")


def _add_adapter(client, model, config):
    """Inject PEFT's LoRA layers into ``model`` itself, as transformers' ``add_adapter`` does, or through PEFT's own
    ``inject_adapter_in_model`` (what ``add_adapter`` calls)."""
    if client == "inject_adapter_in_model":
        return peft.inject_adapter_in_model(config, model)
    try:
        model.add_adapter(config)
    except ValueError as err:  # transformers 5 asks for a newer peft than some installs have
        if "version of PEFT" not in str(err):
            raise
        pytest.skip(f"transformers' add_adapter refuses the installed peft {peft.__version__}: {err}")


def _load_adapter(client, model, directory):
    """Load the adapter saved in ``directory`` into ``model`` itself, trainable: transformers' ``load_adapter``, or
    PEFT's ``inject_adapter_in_model`` and ``set_peft_model_state_dict`` (what ``load_adapter`` calls)."""
    if client == "inject_adapter_in_model":
        from safetensors.torch import load_file

        config = peft.LoraConfig.from_pretrained(directory)
        config.inference_mode = False  # saved as True: trainable, as load_adapter's is_trainable=True makes it
        peft.inject_adapter_in_model(config, model)
        saved = load_file(directory / "adapter_model.safetensors")
        peft.set_peft_model_state_dict(model, {k.removeprefix("base_model.model."): v for k, v in saved.items()})
        return
    try:
        model.load_adapter(str(directory), is_trainable=True)  # a local folder: no download
    except ValueError as err:
        if "version of PEFT" not in str(err):
            raise
        pytest.skip(f"transformers' load_adapter refuses the installed peft {peft.__version__}: {err}")


@pytest.mark.parametrize("client", ["add_adapter", "inject_adapter_in_model"])
def test_adapters_added_to_the_patched_model_are_fused(device, gen, monkeypatch, client):
    # The adapters go into the Llama itself (no PeftModel around it), after the patch.
    base = _base(device, gen)
    ids, labels = _batch(base, gen, device)
    reference = copy.deepcopy(base)
    _add_adapter(client, reference, _config())
    _with_values(reference, gen)
    expected = loss_and_grads(reference, ids, labels)
    model = copy.deepcopy(base)
    patch = patch_llama(model)
    _add_adapter(client, model, _config())
    model.load_state_dict(reference.state_dict())
    calls = _count_nodes(monkeypatch)
    result = loss_and_grads(model, ids, labels)
    assert sorted(calls) == _every_node(base.config.num_hidden_layers) and "lora" in patch.kernels
    _assert_close(result, expected, 5e-5)
    patch.undo()
    assert _fused_count(model) == 0


@pytest.mark.parametrize("client", ["load_adapter", "inject_adapter_in_model"])
def test_an_adapter_loaded_into_the_patched_model_is_fused(device, gen, monkeypatch, tmp_path, client):
    # From a directory this test writes (save_pretrained of a PEFT model): nothing is downloaded.
    base = _base(device, gen)
    ids, labels = _batch(base, gen, device)
    lora_with_values(copy.deepcopy(base), _config()).save_pretrained(tmp_path / "adapter")
    reference = copy.deepcopy(base)
    _load_adapter(client, reference, tmp_path / "adapter")
    expected = loss_and_grads(reference, ids, labels)
    model = copy.deepcopy(base)
    patch = patch_llama(model)
    _load_adapter(client, model, tmp_path / "adapter")
    calls = _count_nodes(monkeypatch)
    result = loss_and_grads(model, ids, labels)
    assert sorted(calls) == _every_node(base.config.num_hidden_layers)
    assert any(p.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)  # the saved B, not zeros
    _assert_close(result, expected, 5e-5)
    patch.undo()


def test_under_autocast_as_close_to_float64_as_peft(device, gen, monkeypatch):
    """Under autocast (the Trainer's and TRL's ``bf16=True``) PEFT's layers compute in bfloat16; the fused node then
    does too, its operands cast as autocast casts them, rather than leave every call to PEFT. Each is measured
    against the same model in float64 without autocast."""
    base = _base(device, gen)
    reference = lora_with_values(copy.deepcopy(base), _config(r=2, alpha=4))
    ids, labels = _batch(base, gen, device)
    device_type = torch.device(device).type

    def under_autocast(model):
        with torch.autocast(device_type, dtype=torch.bfloat16):
            return loss_and_grads(model, ids, labels)

    peft_result = under_autocast(reference)
    exact = loss_and_grads(copy.deepcopy(reference).double(), ids, labels)
    model = copy.deepcopy(reference)
    patch_llama(model, kernels=("lora",))
    calls = _count_nodes(monkeypatch)
    (loss, grads), (_, peft_grads), (loss64, grads64) = under_autocast(model), peft_result, exact
    layers = base.config.num_hidden_layers
    assert sorted(calls) == sorted(["group"] * 2 * layers + ["one"] * 2 * layers)
    assert all(g.dtype == torch.float32 for g in grads.values())  # the Parameters' gradients, through the casts
    assert relative_error(loss, loss64) < TOL[torch.bfloat16]
    assert_adapter_grads_near_peft(grads, peft_grads, grads64)


def assert_adapter_grads_near_peft(grads: dict, peft_grads: dict, grads64: dict) -> None:
    """The fused bf16 adapter gradients against float64, held to PEFT's own error: 1.75x over all of them together
    and 4x for each (one small tensor alone varies more), far below what zeros or a wrong gradient give."""
    everything = lambda g: torch.cat([g[name].flatten().double() for name in sorted(grads64)])  # noqa: E731
    ours, theirs = (relative_error(everything(g), everything(grads64)) for g in (grads, peft_grads))
    assert ours < 1.75 * theirs, (ours, theirs)
    for name in grads64:
        ours, theirs = relative_error(grads[name], grads64[name]), relative_error(peft_grads[name], grads64[name])
        assert ours < max(TOL[torch.bfloat16], 4 * theirs), (name, ours, theirs)
