"""patch_llama: the loss against Hugging Face's, norms of every supported family, logits in training, undo, refusals,
and which kernels it turns on (the defaults, a list, a keyword)."""

import importlib

import pytest
import torch

from kernels import runtime
from kernels.hf.attention_mask import IMPLEMENTATION
from kernels.hf.patch import (
    DEFAULT_KERNELS,
    SWITCHES,
    causal_lm_loss,
    patch_llama,
    shift_labels_like_hf,
    supported_norm_classes,
)
from kernels.reference import relative_error
from kernels.rmsnorm import TritonRMSNorm
from kernels.swiglu import TritonSwiGLUMLP
from kernels.tolerances import RELATIVE_ERROR_TOL
from kernels.training.models import build_model, init_weights_, llama_config

VOCAB = 512
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
# The norms and the loss: what the tests of those two kernels patch (chapter 08's pair).
NORM_AND_LOSS = ("rms_norm", "cross_entropy")
# Every switch but the two memory switches of long sequences, which need checkpointing (tested at the end).
# Our attention replaces the two SDPA mask switches when on (tests/hf/test_attention_hf.py), and lora applies to PEFT
# models only: neither is among these.
SPEED_SWITCHES = tuple(name for name in SWITCHES
                       if name not in ("tiled_mlp", "offload_checkpoints", "lora", "attention", "fp8_base"))

# model family -> (module, config class, model class, norm class)
FAMILIES = {
    "llama": ("llama", "LlamaConfig", "LlamaForCausalLM", "LlamaRMSNorm"),
    "mistral": ("mistral", "MistralConfig", "MistralForCausalLM", "MistralRMSNorm"),
    "qwen2": ("qwen2", "Qwen2Config", "Qwen2ForCausalLM", "Qwen2RMSNorm"),
    "qwen3": ("qwen3", "Qwen3Config", "Qwen3ForCausalLM", "Qwen3RMSNorm"),
    "gemma": ("gemma", "GemmaConfig", "GemmaForCausalLM", "GemmaRMSNorm"),
}


def tiny_model(family: str, seed: int, dtype=torch.float32):
    """A two-layer model of ``family`` with seeded random weights (norm weights around 1, never all ones)."""
    module_name, config_name, model_name, _ = FAMILIES[family]
    try:
        transformers = importlib.import_module("transformers")
        config_cls, model_cls = getattr(transformers, config_name), getattr(transformers, model_name)
    except (ImportError, AttributeError):
        pytest.skip(f"this transformers has no {model_name}")
    config = config_cls(**TINY, use_cache=False)
    config._attn_implementation = "sdpa"
    with torch.device(runtime.device()):
        model = model_cls(config).to(dtype)
    return init_weights_(model, seed).train()


def random_batch(gen, batch=2, seq=24, vocab=VOCAB, device=None):
    """Token ids, a padded attention mask and labels with -100 on a masked prompt and on the padding."""
    device = device or runtime.device()
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, seq - 5:] = 0  # padding at the end of row 0
    labels = ids.clone()
    labels[:, :4] = -100  # a masked prompt
    labels[mask == 0] = -100
    labels[1, 9:12] = -100  # and a masked span in the middle of row 1
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}


def loss_and_grads(model, batch, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(**batch, **kwargs)
    out.loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return out.loss.detach(), grads


def assert_grads_close(grads, ref, tol):
    assert grads.keys() == ref.keys()
    for name in ref:
        err = relative_error(grads[name], ref[name])
        assert err < tol, f"gradient of {name}: relative error {err:.2e}"


def seed_from(gen) -> int:
    return int(torch.randint(0, 2**31 - 1, (1,), generator=gen))


# ---------------------------------------------------------------------------------------------------------------
# The loss on its own, against Hugging Face's ForCausalLMLoss
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_items", [None, 37], ids=["mean", "num_items_in_batch"])
@pytest.mark.parametrize("inplace", [False, True])
def test_causal_lm_loss_matches_hf(dtype, num_items, inplace, device, gen):
    from transformers.loss.loss_utils import ForCausalLMLoss

    batch = random_batch(gen, batch=3, seq=17, vocab=300, device=device)
    logits = (3 * torch.randn(3, 17, 300, generator=gen)).to(dtype).to(device)
    ref_logits = logits.clone().requires_grad_()
    ref = ForCausalLMLoss(ref_logits, batch["labels"], 300, num_items_in_batch=num_items)
    ref.backward()
    ours_logits = logits.clone().requires_grad_()
    ours = causal_lm_loss(ours_logits, batch["labels"], 300, num_items_in_batch=num_items, inplace_backward=inplace)
    ours.backward()
    assert ours.dtype == ref.dtype == torch.float32
    assert relative_error(ours, ref) < 1e-6
    tol = RELATIVE_ERROR_TOL[dtype]  # the gradient is stored in the logits' dtype
    assert relative_error(ours_logits.grad, ref_logits.grad) < tol


def test_shift_and_explicit_shift_labels(device, gen):
    labels = random_batch(gen, device=device)["labels"]
    shifted = shift_labels_like_hf(labels)
    assert torch.equal(shifted[:, :-1], labels[:, 1:]) and (shifted[:, -1] == -100).all()
    logits = torch.randn(*labels.shape, VOCAB, generator=gen).to(device)
    a = causal_lm_loss(logits, labels, VOCAB)
    b = causal_lm_loss(logits, None, VOCAB, shift_labels=shifted)
    assert torch.equal(a, b)


def test_num_items_in_batch_as_a_tensor_and_bad_vocab(device, gen):
    labels = random_batch(gen, device=device)["labels"]
    logits = torch.randn(*labels.shape, VOCAB, generator=gen).to(device)
    as_int = causal_lm_loss(logits, labels, VOCAB, num_items_in_batch=50)
    as_tensor = causal_lm_loss(logits, labels, VOCAB, num_items_in_batch=torch.tensor(50))
    assert torch.equal(as_int, as_tensor)
    with pytest.raises(ValueError, match="vocab_size=511"):
        causal_lm_loss(logits, labels, VOCAB - 1)


def test_out_of_range_label_gives_nan_without_host_check(device, gen):
    batch = random_batch(gen, device=device)
    batch["labels"][1, 20] = VOCAB + 3  # never checked on the host: the loss shows it instead
    logits = torch.randn(2, 24, VOCAB, generator=gen).to(device)
    assert torch.isnan(causal_lm_loss(logits, batch["labels"], VOCAB))


# ---------------------------------------------------------------------------------------------------------------
# The patched model against the original
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_patched_model_matches_original(family, device, gen):
    seed = seed_from(gen)
    model = tiny_model(family, seed)
    batch = random_batch(gen, device=device)
    ref_loss, ref_grads = loss_and_grads(model, batch)
    ref_loss_n, ref_grads_n = loss_and_grads(model, batch, num_items_in_batch=29)

    patch = patch_llama(model, kernels=NORM_AND_LOSS)
    norm_cls = FAMILIES[family][3]
    assert not any(type(m).__name__ == norm_cls for m in model.modules())
    n_norms = sum(isinstance(m, TritonRMSNorm) for m in model.modules())
    per_layer = 4 if family == "qwen3" else 2  # Qwen3 adds a q_norm and a k_norm over head_dim in every layer
    assert n_norms == per_layer * TINY["num_hidden_layers"] + 1
    loss, grads = loss_and_grads(model, batch)
    assert relative_error(loss, ref_loss) < 1e-5
    assert_grads_close(grads, ref_grads, 1e-5)
    loss_n, grads_n = loss_and_grads(model, batch, num_items_in_batch=29)
    assert relative_error(loss_n, ref_loss_n) < 1e-5
    assert_grads_close(grads_n, ref_grads_n, 1e-5)
    patch.undo()


def test_qwen3_head_norms_are_replaced_and_correct(device, gen):
    model = tiny_model("qwen3", seed_from(gen))
    attention = model.model.layers[0].self_attn
    original = attention.q_norm
    x = torch.randn(2, 5, TINY["num_attention_heads"], TINY["head_dim"], generator=gen).to(device)  # [B, S, H, D]
    expected = original(x)
    patch = patch_llama(model, kernels=NORM_AND_LOSS)
    assert isinstance(attention.q_norm, TritonRMSNorm) and isinstance(attention.k_norm, TritonRMSNorm)
    assert attention.q_norm.weight is original.weight
    assert relative_error(attention.q_norm(x), expected) < 1e-6
    # A transposed (non-contiguous) view, as the gradient flowing back through .transpose(1, 2) is.
    xt = x.transpose(1, 2).contiguous().transpose(1, 2)
    assert relative_error(attention.q_norm(xt), expected) < 1e-6
    patch.undo()
    assert attention.q_norm is original


def test_parameters_state_dict_and_optimizer_unchanged(device, gen):
    model = build_model(llama_config("tiny", vocab_size=VOCAB), dtype=torch.float32, device=device, seed=seed_from(gen))
    params = dict(model.named_parameters())
    keys = list(model.state_dict().keys())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # created before the patch
    patch = patch_llama(model, kernels=NORM_AND_LOSS)
    assert list(model.state_dict().keys()) == keys
    after = dict(model.named_parameters())
    assert after.keys() == params.keys() and all(after[k] is params[k] for k in params)
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in model.parameters()}
    patch.undo()


def test_logits_are_none_only_when_overwritten(device, gen):
    model = build_model(llama_config("tiny", vocab_size=VOCAB), dtype=torch.float32, device=device, seed=seed_from(gen))
    batch = random_batch(gen, device=device)
    with torch.no_grad():
        expected = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    with patch_llama(model, kernels=NORM_AND_LOSS):
        train_out = model(**batch)
        assert train_out.logits is None and train_out.loss is not None  # the logits now hold their gradient
        assert "logits" not in train_out.keys() and train_out.to_tuple()[0] is train_out.loss
        as_tuple = model(**batch, return_dict=False)
        assert as_tuple[1] is None
        with torch.no_grad():
            assert relative_error(model(**batch).logits, expected) < 1e-5
        model.eval()
        assert relative_error(model(**batch).logits, expected) < 1e-5
        model.train()
        assert relative_error(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                              expected) < 1e-5  # no labels, no loss: nothing overwritten
    with patch_llama(model, kernels=NORM_AND_LOSS, inplace_logits=False):
        kept = model(**batch)
        assert relative_error(kept.logits, expected) < 1e-5
        kept.loss.backward()  # a separate gradient buffer: the logits stay valid after backward too
        assert relative_error(kept.logits, expected) < 1e-5


def test_undo_restores_the_model(device, gen):
    seed = seed_from(gen)
    config = llama_config("tiny", vocab_size=VOCAB)
    model = build_model(config, dtype=torch.float32, device=device, seed=seed)
    reference = build_model(config, dtype=torch.float32, device=device, seed=seed)
    modules_before = dict(model.named_modules())
    batch = random_batch(gen, device=device)

    patch = patch_llama(model, kernels=NORM_AND_LOSS)
    assert "TritonRMSNorm" in patch.summary()
    with pytest.raises(RuntimeError, match="already patched"):
        patch_llama(model)
    patch.undo()
    patch.undo()  # a second undo does nothing
    assert not patch.active and "undone" in patch.summary()
    assert {k: type(v) for k, v in model.named_modules()} == {k: type(v) for k, v in modules_before.items()}
    assert all(model.get_submodule(k) is v for k, v in modules_before.items())
    assert "forward" not in model.__dict__ and "_loss_function" not in model.__dict__
    loss, grads = loss_and_grads(model, batch)
    ref_loss, ref_grads = loss_and_grads(reference, batch)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
    out, ref_out = model(**batch), reference(**batch)
    assert torch.equal(out.logits, ref_out.logits)
    sd, ref_sd = model.state_dict(), reference.state_dict()
    assert list(sd) == list(ref_sd) and all(torch.equal(sd[k], ref_sd[k]) for k in sd)
    patch_llama(model, kernels=NORM_AND_LOSS).undo()  # patching again after an undo works


def test_undo_keeps_a_loss_function_set_before(device, gen):
    model = build_model(llama_config("tiny", vocab_size=VOCAB), dtype=torch.float32, device=device, seed=seed_from(gen))
    from transformers.loss.loss_utils import ForCausalLMLoss

    def custom(*args, **kwargs):
        return ForCausalLMLoss(*args, **kwargs)

    model.loss_function = custom
    with patch_llama(model, kernels=NORM_AND_LOSS):
        assert model.loss_function is not custom
    assert model.loss_function is custom


# ---------------------------------------------------------------------------------------------------------------
# What it refuses
# ---------------------------------------------------------------------------------------------------------------


def test_gemma_norm_is_refused_and_nothing_changes(gen):
    model = tiny_model("gemma", seed_from(gen))
    before = {k: type(v) for k, v in model.named_modules()}
    with pytest.raises(ValueError, match=r"GemmaRMSNorm.*1 \+ weight"):
        patch_llama(model, kernels=NORM_AND_LOSS)
    assert {k: type(v) for k, v in model.named_modules()} == before
    assert "_loss_function" not in model.__dict__ and "_kernels_patch" not in model.__dict__
    with patch_llama(model, kernels=("cross_entropy",)):  # the loss alone is fine: it does not depend on the norm
        assert model.loss_function.__class__.__name__ == "_PatchedLoss"


def test_unknown_rmsnorm_class_is_refused(device, gen):
    class MyRMSNorm(torch.nn.Module):
        def __init__(self, n):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(n))

    model = build_model(llama_config("tiny", vocab_size=VOCAB), dtype=torch.float32, device=device, seed=seed_from(gen))
    model.model.layers[1].post_attention_layernorm = MyRMSNorm(128)
    expected = r"model\.layers\.1\.post_attention_layernorm.*MyRMSNorm.*refuses rather than guess"
    with pytest.raises(ValueError, match=expected):
        patch_llama(model, kernels=NORM_AND_LOSS)
    assert type(model.model.norm).__name__ == "LlamaRMSNorm"  # nothing was swapped before the refusal


def test_bad_arguments(device, gen):
    model = build_model(llama_config("tiny", vocab_size=VOCAB), dtype=torch.float32, device=device, seed=seed_from(gen))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        patch_llama("llama")
    with pytest.raises(TypeError, match="inplace_logits must be True or False"):
        patch_llama(model, inplace_logits=1)
    with pytest.raises(TypeError, match="loss_function"):  # the switches are checked in SWITCH_TABLE's order
        patch_llama(torch.nn.Sequential(torch.nn.Linear(2, 2)), kernels=("cross_entropy",))
    with pytest.raises(ValueError, match="Sequential has no norm patch_llama knows"):
        patch_llama(torch.nn.Sequential(torch.nn.Linear(2, 2)), kernels=NORM_AND_LOSS)
    with pytest.raises(TypeError, match="causal-LM loss"):
        patch_llama(model.model, kernels=NORM_AND_LOSS)  # LlamaModel has no language-model head
    with patch_llama(model.model, kernels=("rms_norm",)) as patch:  # the norms alone are fine
        assert len(patch.swaps) == 9


def test_supported_classes_are_found():
    names = set(supported_norm_classes())
    assert "LlamaRMSNorm" in names and names <= {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}


# ---------------------------------------------------------------------------------------------------------------
# Which kernels: the defaults, a list, a keyword
# ---------------------------------------------------------------------------------------------------------------


def llama_with(seed: int, hidden_act: str = "silu", attention: str = "sdpa"):
    """A two-layer Llama (float32, seeded weights) with the MLP activation and attention implementation given."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**TINY, hidden_act=hidden_act, use_cache=False)
    config._attn_implementation = attention
    with torch.device(runtime.device()):
        model = LlamaForCausalLM(config)
    return init_weights_(model, seed).train()


def three_ways(model, batch):
    """Loss and gradients with the padding mask, with ``num_items_in_batch``, and without any mask (a plain causal
    call, the one ``skip_causal_mask`` recognises)."""
    plain = {k: v for k, v in batch.items() if k != "attention_mask"}
    return [loss_and_grads(model, batch), loss_and_grads(model, batch, num_items_in_batch=29),
            loss_and_grads(model, plain)]


def assert_same_as(got, expected):
    for (loss, grads), (ref_loss, ref_grads) in zip(got, expected):
        assert relative_error(loss, ref_loss) < 1e-5
        assert_grads_close(grads, ref_grads, 1e-5)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_the_default_turns_on_every_default_kernel_and_matches_hf(family, device, gen):
    model = tiny_model(family, seed_from(gen))
    batch = random_batch(gen, device=device)
    expected = three_ways(model, batch)
    patch = patch_llama(model)
    assert patch.kernels == DEFAULT_KERNELS and patch.left_off == {}
    layers = TINY["num_hidden_layers"]
    assert not any(type(m).__name__ == FAMILIES[family][3] for m in model.modules())
    assert sum(isinstance(m, TritonSwiGLUMLP) for m in model.modules()) == layers
    assert len(patch.rotary) == layers and model.loss_function is patch.loss and patch.head is None
    assert model.config._attn_implementation == IMPLEMENTATION and "causal mask: skipped" in patch.summary()
    assert_same_as(three_ways(model, batch), expected)
    patch.undo()
    assert model.config._attn_implementation == "sdpa" and "forward" not in model.__dict__


def test_a_list_turns_on_exactly_those_kernels(device, gen):
    model = tiny_model("llama", seed_from(gen))
    with patch_llama(model, kernels=["rms_norm", "swiglu"]) as patch:
        assert patch.kernels == ("rms_norm", "swiglu") and patch.left_off == {}
        assert all(isinstance(layer.mlp, TritonSwiGLUMLP) for layer in model.model.layers)
        assert isinstance(model.model.norm, TritonRMSNorm) and not patch.rotary and patch.loss is None
        assert "_loss_function" not in model.__dict__ and "forward" not in model.__dict__
        assert model.config._attn_implementation == "sdpa"
    with patch_llama(model, kernels=()) as patch:  # nothing asked, nothing done
        assert patch.kernels == () and not patch.swaps and "forward" not in model.__dict__
    with patch_llama(model, kernels=reversed(SPEED_SWITCHES)) as patch:  # any iterable; in SWITCHES' order
        assert patch.kernels == SPEED_SWITCHES and patch.head is model.lm_head


def test_a_keyword_overrides_the_selector(device, gen):
    model = tiny_model("llama", seed_from(gen))
    cases = [
        (dict(swiglu=False), ("rms_norm", "cross_entropy", "rope", "add_rms_norm", "additive_mask",
                              "skip_causal_mask")),
        (dict(linear_cross_entropy=True), SPEED_SWITCHES),  # the defaults and the loss without logits
        (dict(kernels=("rms_norm",), cross_entropy=True), NORM_AND_LOSS),
        (dict(kernels=NORM_AND_LOSS, cross_entropy=False), ("rms_norm",)),
        (dict(kernels=NORM_AND_LOSS, rope=None, swiglu=False), NORM_AND_LOSS),  # None follows the selector
    ]
    for switches, turned_on in cases:
        with patch_llama(model, **switches) as patch:
            assert patch.kernels == turned_on, switches
    # True requires the kernel even in "auto": on eager attention the mask kernels cannot apply.
    model.config._attn_implementation = "eager"
    with pytest.raises(ValueError, match="skip_causal_mask=True needs SDPA attention"):
        patch_llama(model, skip_causal_mask=True)
    assert "_kernels_patch" not in model.__dict__ and isinstance(model.model.layers[0].mlp, torch.nn.Module)
    assert type(model.model.norm).__name__ == "LlamaRMSNorm"


def test_unknown_names_and_values_are_refused(device, gen):
    model = tiny_model("llama", seed_from(gen))
    with pytest.raises(ValueError, match="'flash' in kernels=: choose from rms_norm, cross_entropy, linear_cross"):
        patch_llama(model, kernels=("rms_norm", "flash"))
    with pytest.raises(ValueError, match=r"kernels=\('rms_norm',\)"):  # a bare name is not a tuple of names
        patch_llama(model, kernels="rms_norm")
    with pytest.raises(TypeError, match='kernels must be "auto" or a tuple of names'):
        patch_llama(model, False)  # the per-kernel switches are keyword-only: a positional one is refused
    with pytest.raises(TypeError, match="rope must be True or False"):
        patch_llama(model, rope=1)
    assert "_kernels_patch" not in model.__dict__ and "forward" not in model.__dict__
    assert type(model.model.norm).__name__ == "LlamaRMSNorm"


def test_auto_leaves_off_what_does_not_apply_and_a_request_for_it_raises(device, gen):
    model = llama_with(seed_from(gen), hidden_act="gelu", attention="eager")
    batch = random_batch(gen, device=device)
    expected = three_ways(model, batch)
    patch = patch_llama(model)
    assert patch.kernels == ("rms_norm", "cross_entropy", "rope", "add_rms_norm")
    assert set(patch.left_off) == {"swiglu", "additive_mask", "skip_causal_mask"}
    assert "hidden_act='gelu'" in patch.left_off["swiglu"] and "SDPA" in patch.left_off["skip_causal_mask"]
    assert_same_as(three_ways(model, batch), expected)
    patch.undo()
    for request, message in [(dict(kernels=("swiglu",)), "hidden_act='gelu'"), (dict(swiglu=True), "hidden_act='gelu'"),
                             (dict(kernels=("additive_mask",)), "additive_mask=True needs SDPA attention")]:
        with pytest.raises(ValueError, match=message):
            patch_llama(model, **request)
        assert "_kernels_patch" not in model.__dict__ and "forward" not in model.__dict__
        assert type(model.model.norm).__name__ == "LlamaRMSNorm"


def test_auto_on_gemma_patches_the_loss_and_leaves_the_rest(device, gen):
    model = tiny_model("gemma", seed_from(gen))
    batch = random_batch(gen, device=device)
    expected = three_ways(model, batch)
    with patch_llama(model) as patch:
        assert patch.kernels == ("cross_entropy", "additive_mask", "skip_causal_mask")
        assert set(patch.left_off) == {"rms_norm", "swiglu", "rope", "add_rms_norm"}
        assert "1 + weight" in patch.left_off["rms_norm"]
        assert_same_as(three_ways(model, batch), expected)


def test_auto_refuses_a_model_none_applies_to():
    # Each refusal, in SWITCH_TABLE's order.
    with pytest.raises(TypeError, match="no kernel of patch_llama applies to Sequential: rms_norm: .*; cross_entropy: "
                                        ".*loss_func"):
        patch_llama(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_the_memory_switches_tile_the_mlps_and_offload_the_checkpoints(device, gen):
    # tiled_mlp takes the SwiGLU MLP's place (same kernel, one tile of rows at a time); offload_checkpoints needs
    # Hugging Face's checkpointing on first. Together with the defaults, the loss and every gradient are Hugging
    # Face's, and undo() takes both back.
    from kernels.hf.tiled_mlp import TiledSwiGLUMLP

    model = tiny_model("llama", seed_from(gen))
    batch = random_batch(gen, device=device)
    with pytest.raises(ValueError, match="enable them first"):
        patch_llama(model, offload_checkpoints=True)
    assert "forward" not in model.__dict__  # the refusal changed nothing
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    expected = loss_and_grads(model, batch)
    patch = patch_llama(model, tiled_mlp=True, offload_checkpoints=True)
    assert "tiled_mlp" in patch.kernels and "offload_checkpoints" in patch.kernels and "swiglu" not in patch.kernels
    assert all(isinstance(layer.mlp, TiledSwiGLUMLP) for layer in model.model.layers)
    assert "TiledSwiGLUMLP replaces" in patch.summary() and "offloaded" in patch.summary()
    loss, grads = loss_and_grads(model, batch)
    assert relative_error(loss, expected[0]) < RELATIVE_ERROR_TOL[torch.float32]
    assert_grads_close(grads, expected[1], RELATIVE_ERROR_TOL[torch.float32])
    assert patch.offload.stats.forwards > 0
    patch.undo()
    assert not any(isinstance(layer.mlp, TiledSwiGLUMLP) for layer in model.model.layers)
    assert all(getattr(layer, "_gradient_checkpointing_func", None) is not None for layer in model.model.layers)

