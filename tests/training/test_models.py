"""Llama presets, deterministic random weights, the memory count, the GPU-fit helper, loading saved weights."""

import pytest
import torch

from kernels import runtime
from kernels.training.models import (
    PRESETS,
    GiB,
    activation_bytes_per_token_layer,
    build_model,
    count_parameters,
    full_finetune_memory,
    llama_config,
    load_pretrained,
    pick_preset_for_gpu,
)


def meta_model(config):
    from transformers import LlamaForCausalLM

    with torch.device("meta"):  # shapes only, no memory: lets the test count an 8B model's parameters instantly
        return LlamaForCausalLM(config)


def small_config(**overrides):
    return llama_config("tiny", **{"num_hidden_layers": 2, **overrides})


# Published shapes of the two real models (their config.json files) and their parameter counts.
EXPECTED = {
    "llama-3.2-1b": dict(num_hidden_layers=16, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, params=1_235_814_400),
    "llama-3.1-8b": dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, params=8_030_261_248),
    # Llama-3.1-70B's published count: 70,553,706,496
    "llama-3.1-70b": dict(num_hidden_layers=80, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                          num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, params=70_553_706_496),
}


@pytest.mark.parametrize("preset", sorted(EXPECTED))
def test_full_size_presets_have_the_published_shapes(preset):
    config = llama_config(preset)
    expected = dict(EXPECTED[preset])
    params = expected.pop("params")
    for key, value in expected.items():
        assert getattr(config, key) == value, key
    assert config.rope_parameters["rope_theta"] == 500000.0 and config.rms_norm_eps == 1e-5
    assert config.rope_parameters["rope_type"] == "llama3"
    assert count_parameters(config) == params
    assert sum(p.numel() for p in meta_model(config).parameters()) == params


def test_tiny_preset_takes_the_real_code_paths():
    config = llama_config("tiny")
    assert config.num_key_value_heads < config.num_attention_heads  # grouped-query attention
    assert config._attn_implementation == "sdpa" and not config.use_cache
    assert set(PRESETS) == {"tiny", "llama-3.2-1b", "llama-3.1-8b", "llama-3.1-70b"}
    assert all(callable(make) and make().hidden_size > 0 for make in PRESETS.values())


def test_overrides_and_bad_arguments():
    assert llama_config("tiny", vocab_size=4099).vocab_size == 4099
    with pytest.raises(ValueError, match="preset must be one of"):
        llama_config("llama-9000")
    with pytest.raises(TypeError, match="not a LlamaConfig setting"):
        llama_config("tiny", hiden_size=64)
    with pytest.raises(TypeError, match="preset_or_config"):
        build_model(42)
    with pytest.raises(TypeError, match="dtype"):
        build_model(small_config(), dtype=torch.int32)


def test_same_seed_same_weights_other_seed_other_weights(device):
    a = build_model(small_config(), device=device, seed=3)
    b = build_model(small_config(), device=device, seed=3)
    c = build_model(small_config(), device=device, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert all(not torch.equal(sa[k], sc[k]) for k in sa if k.endswith("weight"))


def test_built_model_is_bf16_trainable_sdpa_and_leaves_the_global_rng_alone(device):
    before = torch.random.get_rng_state()
    model = build_model(small_config(), device=device)
    assert torch.equal(before, torch.random.get_rng_state())
    assert model.training and model.config._attn_implementation == "sdpa"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in model.parameters()} == {device.type}
    norm = model.model.layers[0].input_layernorm.weight.float()
    assert not torch.allclose(norm, torch.ones_like(norm))  # never all-ones norm weights
    assert 0.8 < norm.mean() < 1.2 and 0.05 < norm.std() < 0.2
    q = model.model.layers[0].self_attn.q_proj.weight.float()
    assert abs(q.std().item() - 0.02) < 0.003


def test_tied_embeddings_stay_tied(device):
    model = build_model(small_config(tie_word_embeddings=True), device=device)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_forward_gives_a_finite_loss_near_log_vocab(device):
    model = build_model(small_config(), device=device)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), device=device)
    loss = model(input_ids=ids, labels=ids).loss
    # Random weights predict nearly uniformly: the loss sits near ln(V).
    assert torch.isfinite(loss) and abs(loss.item() - torch.log(torch.tensor(2048.0)).item()) < 0.5


def test_memory_budget_counts_weights_gradients_states_logits():
    config = llama_config("llama-3.1-8b")
    budget = full_finetune_memory(config, batch_size=2, seq_len=1024)
    n = 8_030_261_248
    assert budget.weights == budget.gradients == 2 * n
    assert budget.optimizer_states == 4 * n  # two bf16 moments: torch.optim.AdamW keeps them in the param dtype
    assert budget.logits == 2048 * 128256 * 2 and budget.logits_fp32 == 2048 * 128256 * 4
    points = budget.high_points()
    assert points["optimizer step"] == 10 * n  # weights + grads + states + the foreach sqrt temporary
    assert points["loss, backward"] - points["loss, forward"] == 2048 * 128256 * 2  # 12 vs 10 bytes per logit
    assert budget.peak == max(points.values()) == points["optimizer step"]
    assert budget.loss_bytes == 2048 * 128256 * 12
    assert "activations" in budget.table() and "estimate" in budget.notes["activations"]
    fp32 = full_finetune_memory(config, 1, 1024, dtype=torch.float32)
    assert fp32.weights == 4 * n
    with pytest.raises(ValueError, match="seq_len"):
        full_finetune_memory(config, 1, 0)


def test_activation_estimate_matches_the_tensors_autograd_saves():
    """The per-layer count must match what a real forward pass saves for backward (counted by storage)."""
    B, S = 2, 48
    saved_per_model = []
    for layers in (1, 3):
        config = small_config(num_hidden_layers=layers)
        model = build_model(config, device="cpu")
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        storages = {}

        def pack(t, params=params, storages=storages):
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                storages[storage.data_ptr()] = storage.nbytes()
            return t

        ids = torch.randint(0, config.vocab_size, (B, S))
        mask = torch.ones(B, S, dtype=torch.long)
        mask[1, 30:] = 0  # padding, as in real batches
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, attention_mask=mask)
        saved_per_model.append(sum(storages.values()))
    measured_per_layer = (saved_per_model[1] - saved_per_model[0]) / 2
    estimate_per_layer = activation_bytes_per_token_layer(small_config()) * B * S + B * S * S * 2  # + the mask
    assert abs(estimate_per_layer - measured_per_layer) / measured_per_layer < 0.05


@pytest.mark.parametrize(
    "free_gib, expected",
    [(139.0, "llama-3.1-8b"), (79.0, "llama-3.2-1b"), (20.0, "llama-3.2-1b"), (4.0, "tiny"), (0.01, "tiny")],
)
def test_pick_preset_for_gpu_takes_the_largest_that_fits(free_gib, expected):
    name, reason = pick_preset_for_gpu(seq_len=2048, batch_size=1, free_bytes=int(free_gib * GiB))
    assert name == expected
    assert expected in reason and "GiB" in reason


def test_pick_preset_for_gpu_respects_its_margin_and_arguments():
    need = full_finetune_memory(llama_config("llama-3.2-1b"), 1, 2048).peak
    assert pick_preset_for_gpu(free_bytes=int(need * 1.11))[0] == "llama-3.2-1b"
    assert pick_preset_for_gpu(free_bytes=int(need * 1.05))[0] == "tiny"
    assert pick_preset_for_gpu(free_bytes=int(need * 1.05), margin=0.0)[0] == "llama-3.2-1b"
    with pytest.raises(ValueError, match="free_bytes"):
        pick_preset_for_gpu(free_bytes=-1)
    if runtime.MODE != "gpu":
        name, reason = pick_preset_for_gpu()
        assert name == "tiny" and "no CUDA GPU" in reason


def test_load_pretrained_round_trip(tmp_path, device):
    model = build_model(small_config(), device=device, seed=7)
    model.save_pretrained(tmp_path / "saved")
    loaded = load_pretrained(tmp_path / "saved", device=device)
    assert loaded.training and loaded.config._attn_implementation == "sdpa"
    expected, got = model.state_dict(), loaded.state_dict()
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_load_pretrained_says_how_to_get_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="never downloads.*build_model"):
        load_pretrained(tmp_path / "nothing-here")


@pytest.mark.gpu
def test_gpu_build_of_the_1b_preset_is_fast_and_on_device():
    import time

    start = time.perf_counter()
    model = build_model("llama-3.2-1b")
    torch.cuda.synchronize()
    assert time.perf_counter() - start < 60
    assert next(model.parameters()).is_cuda
    assert sum(p.numel() for p in model.parameters()) == EXPECTED["llama-3.2-1b"]["params"]
    del model
    torch.cuda.empty_cache()
