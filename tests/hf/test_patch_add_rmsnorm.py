"""The residual add fused into post_attention_layernorm in patch_llama (``add_rms_norm``): logits, loss and every
gradient as Hugging Face's, with the other switches, gradient checkpointing and generate; undo; refusals."""

import copy
import importlib.util
import inspect

import pytest
import torch
from spies import count_calls
from test_patch import TINY, assert_grads_close, loss_and_grads, random_batch, seed_from, tiny_model

import kernels.add_rmsnorm as kernel_module
import kernels.hf.add_rmsnorm as hf_module
from kernels import runtime
from kernels.hf.patch import patch_llama
from kernels.reference import relative_error
from kernels.tolerances import RELATIVE_ERROR_TOL

LAYERS = TINY["num_hidden_layers"]
ONLY = dict(kernels=("add_rms_norm",))


@pytest.fixture
def calls(monkeypatch):
    """How many fused forwards the layers ran, and how many fused backward launches."""
    counts = {"forward": 0, "backward": 0}

    count_calls(monkeypatch, counts, hf_module, "add_rms_norm", "forward")
    count_calls(monkeypatch, counts, kernel_module, "cached_backward_config", "backward")
    return counts


def assert_matches(got, expected, tol=1e-5):
    (loss, grads), (ref_loss, ref_grads) = got, expected
    assert relative_error(loss, ref_loss) < tol
    assert_grads_close(grads, ref_grads, tol)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_loss_and_every_gradient_as_hugging_face(family, device, gen, calls):
    model = tiny_model(family, seed_from(gen))
    reference = copy.deepcopy(model)
    batch = random_batch(gen, device=device)
    expected = loss_and_grads(reference, batch)
    patch = patch_llama(model, **ONLY)
    assert patch.kernels == ("add_rms_norm",)
    assert hf_module.fused_layers(model) == [f"model.layers.{i}" for i in range(LAYERS)]
    assert_matches(loss_and_grads(model, batch), expected)
    assert calls == {"forward": LAYERS, "backward": LAYERS}
    assert f"in {LAYERS} {type(model.model.layers[0]).__name__}" in patch.summary()


@pytest.mark.parametrize("reentrant", [False, True])
def test_with_every_default_switch_and_gradient_checkpointing(reentrant, device, gen, calls):
    model = tiny_model("llama", seed_from(gen))
    reference = copy.deepcopy(model)
    for m in (model, reference):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    batch = random_batch(gen, device=device)
    expected = loss_and_grads(reference, batch)
    patch = patch_llama(model, inplace_logits=False)
    assert "add_rms_norm" in patch.kernels and "rms_norm" in patch.kernels
    assert_matches(loss_and_grads(model, batch), expected)
    # The checkpoint recomputes each layer in the backward: two fused forwards per layer, one backward.
    assert calls == {"forward": 2 * LAYERS, "backward": LAYERS}


def test_a_subclass_made_after_the_patch_checkpoints_once(device, gen, calls):
    # FSDP2 turns each layer into an instance of a subclass of its class whose forward adds one wrapper: the patched
    # layer keeps the fused forward, and the checkpoint still runs once per layer, at the outermost wrapper.
    model = tiny_model("llama", seed_from(gen))
    reference = copy.deepcopy(model)
    for m in (model, reference):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = random_batch(gen, device=device)
    expected = loss_and_grads(reference, batch)
    patch_llama(model, **ONLY)
    layer_class = type(model.model.layers[0])
    sharded = type(f"Sharded{layer_class.__name__}", (layer_class,), {})
    checkpoints = []
    for layer in model.model.layers:
        layer.__class__ = sharded
        inner = layer._gradient_checkpointing_func
        layer._gradient_checkpointing_func = lambda *a, inner=inner, **k: (checkpoints.append(1), inner(*a, **k))[1]
    assert_matches(loss_and_grads(model, batch), expected)
    assert len(checkpoints) == LAYERS and calls == {"forward": 2 * LAYERS, "backward": LAYERS}


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_as_one_graph(device, gen, calls):
    model = tiny_model("llama", seed_from(gen))
    reference = copy.deepcopy(model)
    batch = random_batch(gen, device=device)
    expected = loss_and_grads(reference, batch)
    patch_llama(model, **ONLY)
    explained = torch._dynamo.explain(model)(**batch)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    loss, grads = loss_and_grads(torch.compile(model, backend=runtime.COMPILE_BACKEND), batch)
    assert_matches((loss, {n.removeprefix("_orig_mod."): g for n, g in grads.items()}), expected)


def test_bf16_logits_within_bf16_rounding(device, gen, calls):
    model = tiny_model("llama", seed_from(gen), dtype=torch.bfloat16).eval()
    batch = random_batch(gen, device=device)
    float64 = copy.deepcopy(model).double()
    with torch.no_grad():
        expected = float64(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        hf = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        with patch_llama(model, **ONLY):
            ours = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert calls["forward"] == LAYERS
    # Ours is no further from float64 than Hugging Face's bf16 model, and within the bf16 bound.
    assert relative_error(ours, expected) < max(2 * relative_error(hf, expected), RELATIVE_ERROR_TOL[torch.bfloat16])


def test_generate_with_a_cache_gives_the_same_tokens(device, gen, calls):
    model = tiny_model("llama", seed_from(gen)).eval()
    prompt = torch.randint(0, TINY["vocab_size"], (1, 7), generator=gen).to(device)
    # min_new_tokens: six steps whatever the tokens (a greedy end-of-sequence token would stop it early)
    options = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
    expected = model.generate(prompt, **options)
    with patch_llama(model):
        got = model.generate(prompt, **options)
    assert torch.equal(got, expected)
    assert calls["forward"] == 6 * LAYERS  # the prompt, then one token at a time through the cache


def test_undo_restores_the_layers(device, gen):
    model = tiny_model("llama", seed_from(gen))
    batch = random_batch(gen, device=device)
    expected = loss_and_grads(model, batch)
    patch = patch_llama(model, **ONLY)
    patch.undo()
    assert not any("forward" in layer.__dict__ for layer in model.model.layers)
    assert hf_module.fused_layers(model) == [] and "residual add: Hugging Face's" in patch.summary()
    loss, grads = loss_and_grads(model, batch)
    assert torch.equal(loss, expected[0]) and all(torch.equal(grads[n], g) for n, g in expected[1].items())
    # A forward replaced after the patch: undo refuses and changes nothing.
    patch = patch_llama(model, **ONLY)
    model.model.layers[1].forward = lambda *a, **k: None
    with pytest.raises(RuntimeError, match="model.layers.1 was replaced after the patch"):
        patch.undo()
    assert hf_module.fused_layers(model) == ["model.layers.0"]


def test_what_it_refuses_before_any_change(device, gen):
    gemma = tiny_model("gemma", seed_from(gen))
    with pytest.raises(ValueError, match="GemmaDecoderLayer is not a decoder layer whose forward this patch"):
        patch_llama(gemma, **ONLY)
    assert "add_rms_norm" in patch_llama(gemma).left_off
    model = tiny_model("llama", seed_from(gen))
    model.model.layers[1].forward = model.model.layers[1].forward
    with pytest.raises(ValueError, match="model.layers.1: its forward was already replaced"):
        patch_llama(model, **ONLY)
    del model.model.layers[1].forward
    model.model.layers[0].post_attention_layernorm = torch.nn.LayerNorm(TINY["hidden_size"])
    with pytest.raises(ValueError, match="post_attention_layernorm is LayerNorm"):
        patch_llama(model, **ONLY)
    assert hf_module.fused_layers(model) == [] and "_kernels_patch" not in model.__dict__


# LlamaDecoderLayer.forward of transformers 5.17, verbatim; 5.24's differs in the cache argument's name (``cache``)
# and a ``deprecate_kwarg`` decorator that maps the old name. The patch must fuse both and refuse anything else.
FORWARD_5_17 = """
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        # Self Attention
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = residual + hidden_states

        # Fully Connected
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states
"""
FORWARD_5_24 = FORWARD_5_17.replace("past_key_values", "cache")


def forward_from_source(text: str, tmp_path, name: str):
    """The method ``text`` defines, loaded from a module file so that ``inspect.getsource`` reads it as the patch's
    check does."""
    path = tmp_path / f"{name}.py"
    path.write_text("from __future__ import annotations\n\n\nclass Layer:\n" + text)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Layer.forward


@pytest.mark.parametrize("cache", ["past_key_values", "cache"])
def test_each_transformers_spelling_of_the_forward_is_fused_with_its_own_parameters(cache, device, gen, calls,
                                                                                   tmp_path, monkeypatch):
    # The installed LlamaDecoderLayer given the forward of 5.17 (cache argument past_key_values) or of 5.24 (cache),
    # whichever this transformers is: the model's own caller passes its cache under its own name, which the other
    # spelling's forward hands on to the attention through **kwargs, unpatched and patched alike.
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer as layer_class

    forward = forward_from_source(FORWARD_5_17 if cache == "past_key_values" else FORWARD_5_24, tmp_path, cache)
    monkeypatch.setattr(layer_class, "forward", forward)
    assert hf_module.check_llama_forward(layer_class) == (forward, hf_module.FUSED_FORWARDS[cache])
    assert cache in inspect.signature(hf_module.FUSED_FORWARDS[cache]).parameters
    model = tiny_model("llama", seed_from(gen))
    reference = copy.deepcopy(model)
    batch = random_batch(gen, device=device)
    expected = loss_and_grads(reference, batch)
    patch_llama(model, **ONLY)
    assert hf_module.fused_layers(model) == [f"model.layers.{i}" for i in range(LAYERS)]
    assert_matches(loss_and_grads(model, batch), expected)
    assert calls == {"forward": LAYERS, "backward": LAYERS}


@pytest.mark.parametrize("change", [
    ("past_key_values=past_key_values,", "cache=past_key_values,"),  # 5.17's parameters, another keyword passed on
    ("past_key_values: Cache | None = None,", "cache: Cache | None = None,"),  # 5.24's parameters, 5.17's call
    ("use_cache: bool | None = False,", "use_cache: bool | None = True,"),  # a default changed
    ("hidden_states = residual + hidden_states\n\n", "hidden_states = residual - hidden_states\n\n"),
], ids=["keyword", "parameter", "default", "statement"])
def test_a_near_miss_of_either_spelling_is_refused(change, tmp_path):
    changed = FORWARD_5_17.replace(*change, 1)
    assert changed != FORWARD_5_17
    layer = type("LlamaLikeDecoderLayer", (torch.nn.Module,), {"forward": forward_from_source(changed, tmp_path, "m")})
    with pytest.raises(ValueError, match="is not the forward this patch reproduces"):
        hf_module.check_llama_forward(layer)


def test_a_forward_that_differs_is_refused():
    class Changed(torch.nn.Module):
        def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                    position_embeddings=None, **kwargs):
            residual = hidden_states
            return residual + 2 * hidden_states

    with pytest.raises(ValueError, match="is not the forward this patch reproduces"):
        hf_module.check_llama_forward(Changed)


def test_calls_the_kernel_cannot_take_fall_back_to_hugging_face(device, gen):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(48).to(device)
    with torch.no_grad():  # drawn by the CPU generator, then moved: a CUDA weight cannot take it
        norm.weight.copy_((0.5 + torch.rand(48, generator=gen)).to(device))
    x = torch.randn(3, 48, generator=gen).to(device)
    residual = torch.randn(3, 48, generator=gen).to(device, torch.bfloat16)
    # Two dtypes (autocast gives a bf16 attention output on a float32 stream): PyTorch promotes the sum.
    assert not hf_module.takes_kernel(norm, x, residual)
    y, h = hf_module.add_then_norm(norm, x, residual)
    assert h.dtype == torch.float32 and torch.equal(h, residual + x) and torch.equal(y, norm(residual + x))
    # A hook on the norm runs, as it would unpatched.
    seen = []
    norm.register_forward_hook(lambda *args: seen.append(1))
    hf_module.add_then_norm(norm, x, residual.float())
    assert seen == [1]


def test_peft_lora_model(device, gen, calls):
    peft = pytest.importorskip("peft")
    model = tiny_model("llama", seed_from(gen))
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    wrapped = peft.get_peft_model(model, config)
    for name, p in wrapped.named_parameters():
        if "lora_B" in name:  # B starts at zero: give the adapters a part in the output
            torch.nn.init.normal_(p, std=0.02)
    reference = copy.deepcopy(wrapped)
    batch = random_batch(gen, device=device)

    def loss_and_adapter_grads(m):
        m.zero_grad(set_to_none=True)
        loss = m(**batch).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}

    expected = loss_and_adapter_grads(reference)
    with patch_llama(wrapped, inplace_logits=False) as patch:
        assert "add_rms_norm" in patch.kernels
        got = loss_and_adapter_grads(wrapped)
    assert calls["forward"] == LAYERS and len(expected[1]) == 3 * 2 * LAYERS
    assert_matches(got, expected)
