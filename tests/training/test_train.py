"""The training loop: baseline and patched learn identically, gradient accumulation, records, gradient
checkpointing, the three AdamW implementations, compiled runs, the fit search."""

import json

import matplotlib
import pytest
import torch

from kernels import runtime
from kernels.hf.patch import patch_llama
from kernels.memory import logits_bytes_per_token
from kernels.reference import relative_error
from kernels.training.data import get_tokenizer, make_sft_batches
from kernels.training.fit import Probe, growth_bytes_per_token, max_seq_len_that_fits, search_longest
from kernels.training.loop import (
    Comparison,
    compare,
    compile_model,
    count_trained_labels,
    gradient_check,
    make_adamw,
    parameter_kind,
    train,
)
from kernels.training.models import build_model, llama_config

matplotlib.use("Agg")


def seed_from(gen) -> int:
    return int(torch.randint(0, 2**31 - 1, (1,), generator=gen))


def record_grads(store, weights=None):
    """An ``after_backward`` hook that keeps each step's gradients and, if ``weights`` is a list, the weights they
    were taken at (the optimizer has not stepped yet when the hook runs)."""

    def hook(step, model):
        store.append({name: p.grad.detach().clone() for name, p in model.named_parameters()})
        if weights is not None:
            weights.append({name: p.detach().clone() for name, p in model.named_parameters()})

    return hook


def baseline_step_grads(weights, micro_batches, seed, device):
    """Hugging Face's own gradients for one step of ``micro_batches``, taken at ``weights``."""
    model = build_model("tiny", dtype=torch.float32, device=device, seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name])
    grads = []
    run = train(model, micro_batches, grad_accum=len(micro_batches), lr=1e-3, warmup_steps=0, progress=False,
                after_backward=record_grads(grads))
    return run.losses[0], grads[0]


def test_patched_training_matches_plain_training(device, gen):
    """Three steps of AdamW with gradient accumulation, float32: the two runs' losses agree at every step, and each
    patched step's gradients are Hugging Face's at the same weights."""
    seed = seed_from(gen)
    batches = make_sft_batches(get_tokenizer(), 2, 96, 6, seed=seed)  # 3 steps × 2 micro-batches, with padding
    runs, grads, weights = {}, {}, []
    for variant in ("baseline", "patched"):
        model = build_model("tiny", dtype=torch.float32, device=device, seed=seed)
        patch = patch_llama(model) if variant == "patched" else None
        grads[variant] = []
        runs[variant] = train(model, batches, grad_accum=2, lr=1e-3, label=variant, progress=False,
                              after_backward=record_grads(grads[variant], weights if patch else None))
        if patch is not None:
            assert "TritonRMSNorm" in str(runs[variant].what_ran["norms"])
            patch.undo()
    assert runs["baseline"].what_ran["norms"] == {"LlamaRMSNorm": 9}
    for step in range(3):
        b, p = runs["baseline"].losses[step], runs["patched"].losses[step]
        assert abs(p - b) / abs(b) < 1e-4, f"step {step}: losses {b} and {p}"
    # Gradients are compared at the patched run's own weights: after AdamW's first step the two runs' weights are no
    # longer equal (AdamW moves a near-zero gradient by about ±lr whatever its size, so float32 rounding in it can
    # move a weight by a whole step), and later gradients would compare two different points.
    for step in range(3):
        loss, expected = baseline_step_grads(weights[step], batches[2 * step:2 * step + 2], seed, device)
        assert abs(runs["patched"].losses[step] - loss) / abs(loss) < 1e-5, f"step {step}: losses {loss} and patched"
        for name, ref in expected.items():
            err = relative_error(grads["patched"][step][name], ref)
            assert err < 1e-4, f"step {step}, gradient of {name}: relative error {err:.2e}"
    assert runs["baseline"].losses[-1] < runs["baseline"].losses[0]  # it does learn


@pytest.mark.parametrize("patched", [False, True], ids=["baseline", "patched"])
def test_gradient_accumulation_equals_one_big_batch(patched, device, gen):
    """Two micro-batches of one row with num_items_in_batch give the gradient of one batch of both rows."""
    # The two rows must train on different numbers of tokens, or the mean of means would equal the global mean
    # and the test could not tell them apart: draw until they do (rarely more than one draw).
    first = seed_from(gen)
    for seed in range(first, first + 50):
        rows = make_sft_batches(get_tokenizer(), 2, 80, 1, seed=seed)[0]
        if count_trained_labels({"labels": rows["labels"][:1]}) != count_trained_labels({"labels": rows["labels"][1:]}):
            break
    else:
        pytest.fail("50 draws in a row gave both rows the same number of trained tokens")
    micro = [{k: v[i:i + 1] for k, v in rows.items()} for i in range(2)]
    grads = {}
    for name, batches, accum in (("big", [rows], 1), ("accumulated", micro, 2)):
        model = build_model("tiny", dtype=torch.float32, device=device, seed=seed)
        patch = patch_llama(model) if patched else None
        grads[name] = []
        run = train(model, batches, grad_accum=accum, lr=1e-3, progress=False, after_backward=record_grads(grads[name]))
        grads[name + " loss"] = run.losses[0]
        if patch is not None:
            patch.undo()
    assert abs(grads["big loss"] - grads["accumulated loss"]) < 1e-5 * abs(grads["big loss"])
    for name, ref in grads["big"][0].items():
        assert relative_error(grads["accumulated"][0][name], ref) < 1e-5, name


def test_step_records(device, gen):
    seed = seed_from(gen)
    batches = make_sft_batches(get_tokenizer(), 2, 64, 4, seed=seed)
    model = build_model("tiny", dtype=torch.float32, device=device, seed=seed)
    run = train(model, batches, grad_accum=2, lr=1e-3, progress=False, warmup_steps=3)
    assert len(run.records) == 2 and run.warmup_steps == 1  # at most all steps but one are warm-up
    assert [r.timed for r in run.records] == [False, True]
    first = run.records[0]
    assert first.tokens == 2 * 2 * 64
    assert first.real_tokens == int(batches[0]["attention_mask"].sum() + batches[1]["attention_mask"].sum())
    assert first.trained_tokens == count_trained_labels(batches[0]) + count_trained_labels(batches[1])
    assert first.trained_tokens < first.real_tokens < first.tokens
    assert run.tokens_per_s == pytest.approx(run.records[1].tokens / run.records[1].time_s)
    assert run.real_tokens_per_s < run.tokens_per_s
    assert (run.peak_memory is None) == (runtime.MODE != "gpu")
    with pytest.raises(ValueError, match="not a multiple of grad_accum=3"):
        train(model, batches, grad_accum=3, progress=False)
    with pytest.raises(ValueError, match="lr must be a positive number"):
        train(model, batches, lr=0, progress=False)


def test_compare_table_json_and_plot(tmp_path, gen):
    result = compare("tiny", steps=2, seq_len=64, batch_size=1, grad_accum=1, seed=seed_from(gen), progress=False)
    assert isinstance(result, Comparison)
    summary = result.summary()
    assert summary["max_abs_loss_difference"] < 0.05  # bf16: the two implementations round differently
    assert len(result.baseline.records) == len(result.patched.records) == 2
    assert "tokens/s (all tokens)" in result.table() and "max |loss difference|" in result.table()
    json_path, png_path = result.save(tmp_path)
    data = json.loads(json_path.read_text())
    assert {"device", "versions", "settings", "summary", "baseline", "patched"} <= set(data)
    assert len(data["patched"]["steps"]) == 2 and data["settings"]["preset"] == "tiny"
    assert png_path.stat().st_size > 10_000


def test_gradient_check_bf16_as_accurate_as_hugging_face(device, gen):
    seed = seed_from(gen)
    batch = make_sft_batches(get_tokenizer(), 2, 64, 1, seed=seed)[0]
    check = gradient_check("tiny", batch, seed=seed, device=device)
    assert len(check.errors) == 2 + 4 * 9 + 1  # embeddings, lm_head, 4 layers of 9 tensors, the final norm
    assert abs(check.losses["patched"] - check.losses["float32"]) < 1e-2 * check.losses["float32"]
    # bf16 rounding, not a zero or wrong gradient: small, and no larger than Hugging Face's own bf16 error
    assert 0 < check.worst("patched") <= 1.5 * check.worst("baseline") < 0.05
    assert 0 < check.worst("patched_vs_baseline") < 0.05
    kinds = check.by_kind()
    assert kinds["q_proj"]["count"] == 4 and kinds["norm"]["count"] == 1
    assert "patched vs fp32" in check.table()


def test_parameter_kind():
    assert parameter_kind("model.layers.3.mlp.up_proj.weight") == "up_proj"
    assert parameter_kind("model.layers.0.self_attn.q_norm.weight") == "q_norm"
    assert parameter_kind("model.norm.weight") == "norm"
    assert parameter_kind("lm_head.weight") == "lm_head"


def test_compare_with_checkpointing_gives_the_same_losses(gen):
    plain = compare("tiny", steps=2, seq_len=40, batch_size=1, warmup_steps=1, progress=False)
    ckpt = compare("tiny", steps=2, seq_len=40, batch_size=1, warmup_steps=1, progress=False,
                   gradient_checkpointing=True)
    assert ckpt.settings["gradient_checkpointing"] is True
    for a, b in ((plain.baseline, ckpt.baseline), (plain.patched, ckpt.patched)):
        assert max(abs(x - y) for x, y in zip(a.losses, b.losses)) < 1e-3


def test_every_adamw_takes_the_same_steps(gen, device):
    weights = torch.randn(7, 33, generator=gen).to(device)
    grads = [torch.randn(7, 33, generator=gen).to(device) for _ in range(3)]
    finals = []
    for adamw in ("foreach", "fused", "triton"):
        layer = torch.nn.Linear(33, 7, bias=False, device=device)
        with torch.no_grad():
            layer.weight.copy_(weights)
        optimizer = make_adamw(layer, 1e-2, adamw)
        for g in grads:
            layer.weight.grad = g.clone()
            optimizer.step()
        finals.append(layer.weight.detach().clone())
    for other in finals[1:]:
        torch.testing.assert_close(other, finals[0], rtol=1e-5, atol=1e-6)
    assert not torch.equal(finals[0], weights)
    with pytest.raises(ValueError, match="adamw must be one of"):
        make_adamw(torch.nn.Linear(2, 2), 1e-3, "sgd")


# ---------------------------------------------------------------------------------------------------------------
# The search for the longest sequence that fits, against a memory model
# ---------------------------------------------------------------------------------------------------------------


def fake_probe(capacity, base=10_000, per_token=7, quadratic=0.0, with_memory=True):
    """A step whose peak is base + per_token·S + quadratic·S² and which runs out of memory above ``capacity``."""
    calls = []

    def probe(seq_len):
        calls.append(seq_len)
        peak = base + per_token * seq_len + quadratic * seq_len**2
        fits = peak <= capacity
        return Probe(seq_len, fits, peak if fits and with_memory else None, base if with_memory else None)

    return probe, calls


def true_longest(capacity, base=10_000, per_token=7, quadratic=0.0, step=256, hi=65536):
    best = None
    for s in range(step, hi + 1, step):
        if base + per_token * s + quadratic * s**2 <= capacity:
            best = s
    return best


CAPACITIES = [10_000 + 7 * 9_000, 10_000 + 7 * 20_100, 10_000 + 7 * 40_000, 10_000 + 7 * 4_200]


# Real steps grow almost linearly with the length (the [B, 1, S, S] attention mask is about 1% at the limit): the
# prediction then lands within a step or two. A strongly convex growth costs more probes but still converges.
@pytest.mark.parametrize("capacity", CAPACITIES)
@pytest.mark.parametrize("quadratic, most_probes", [(0.0, 6), (1e-5, 6), (2e-4, 10)],
                         ids=["linear", "realistic", "convex"])
def test_search_finds_the_boundary_in_few_probes(capacity, quadratic, most_probes):
    probe, calls = fake_probe(capacity, quadratic=quadratic)
    result = search_longest(probe, lo=4096, hi=65536, max_probes=12, budget=capacity)
    assert result.longest == true_longest(capacity, quadratic=quadratic)
    assert result.exact and len(calls) <= most_probes and len(set(calls)) == len(calls)
    assert calls[0] == 4096 and all(s % 256 == 0 for s in calls)


def test_search_without_memory_figures_doubles_then_bisects():
    capacity = 10_000 + 7 * 20_100
    probe, calls = fake_probe(capacity, with_memory=False)
    result = search_longest(probe, lo=4096, hi=65536, max_probes=20)
    assert result.longest == true_longest(capacity) and result.exact
    assert calls[:4] == [4096, 8192, 16384, 32768]
    short = search_longest(fake_probe(capacity, with_memory=False)[0], lo=4096, hi=65536, max_probes=4)
    assert short.longest == 16384 and short.shortest_failing == 32768 and not short.exact
    assert "at least 16,384" in short.summary()


def test_search_edges():
    probe, calls = fake_probe(10_000 + 7 * 1_000)  # even lo fails: bisect below it
    result = search_longest(probe, lo=4096, hi=65536, budget=10_000 + 7 * 1_000)
    assert result.longest == 768 and calls[0] == 4096
    probe, calls = fake_probe(10**12)  # everything fits: stop at hi
    result = search_longest(probe, lo=4096, hi=16384, budget=10**12)
    assert result.longest == 16384 and result.exact and len(calls) <= 3
    with pytest.raises(ValueError, match="multiples of step"):
        search_longest(probe, lo=1000, hi=16384)


@pytest.fixture
def simulated_gpu(monkeypatch):
    """The GPU path of the fit search, run on the CPU: CUDA's memory functions are replaced by a fake device whose
    steps run out of memory above 1,024 tokens and whose peak grows by 100 bytes per token; the model is the tiny
    one. Real training steps, real patch. Yields the state: the models built and the memory fractions set."""
    if runtime.MODE == "gpu":
        pytest.skip("a GPU runs the real thing: see test_fit_on_gpu")
    import kernels.training.fit as fit_module

    state = {"seq": 0, "built": [], "limit": 1024, "fractions": []}

    def fake_build(preset, dtype, seed):
        model = build_model(preset, dtype=torch.float32, device="cpu", seed=seed)

        def pre_hook(module, args, kwargs):
            state["seq"] = kwargs["input_ids"].shape[1]
            if state["seq"] > state["limit"]:
                raise torch.cuda.OutOfMemoryError("simulated: CUDA out of memory")

        model.register_forward_pre_hook(pre_hook, with_kwargs=True)
        state["built"].append(model)
        return model

    fake_cuda = {
        "is_available": lambda: True, "synchronize": lambda *a: None, "empty_cache": lambda: None,
        "reset_peak_memory_stats": lambda *a: None, "memory_allocated": lambda *a: 10_000,
        "max_memory_allocated": lambda *a: 10_000 + 100 * state["seq"], "mem_get_info": lambda *a: (95_000, 200_000),
        "set_per_process_memory_fraction": lambda fraction, *a: state["fractions"].append(fraction),
    }
    for name, fn in fake_cuda.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    monkeypatch.setattr(runtime, "MODE", "gpu")
    monkeypatch.setattr(fit_module, "build_model", fake_build)
    return state


def test_fit_search_code_path_with_a_simulated_gpu(simulated_gpu, gen):
    limit = simulated_gpu["limit"]
    result = max_seq_len_that_fits("tiny", patched=True, lo=256, hi=2048, max_probes=6, seed=seed_from(gen))
    assert result.longest == limit and result.shortest_failing == limit + 256 and result.exact
    assert [p.fits for p in result.probes].count(False) >= 1 and len(result.probes) <= 6
    assert result.measured_bytes_per_token() == pytest.approx(100)
    model = simulated_gpu["built"][0]
    assert type(model.model.norm).__name__ == "LlamaRMSNorm" and "forward" not in model.__dict__  # undone


def test_fit_options_and_memory_slope_with_a_simulated_gpu(simulated_gpu, gen):
    from kernels.training.fit import memory_slope

    result = max_seq_len_that_fits("tiny", patched=True, lo=256, hi=2048, max_probes=6, seed=seed_from(gen),
                                   patch_options=dict(rms_norm=False, linear_cross_entropy=True),
                                   gradient_checkpointing=True, memory_fraction=0.5)
    assert result.longest == simulated_gpu["limit"]
    assert simulated_gpu["fractions"] == [0.5, 1.0]  # the cap is set for the search and lifted after it
    model = simulated_gpu["built"][0]
    assert model.is_gradient_checkpointing and "_kernels_patch" not in model.__dict__
    slope = memory_slope("tiny", patched=False, lengths=(512, 768), seed=seed_from(gen))
    assert slope["bytes_per_token"] == pytest.approx(100)
    assert memory_slope("tiny", patched=False, lengths=(512, 2048))["bytes_per_token"] is None  # 2,048 does not fit


def test_fit_is_gpu_only_on_the_cpu(capsys):
    if runtime.MODE == "gpu":
        pytest.skip("runs the real search on a GPU: see test_fit_on_gpu")
    assert max_seq_len_that_fits("tiny", patched=True) is None
    assert "GPU-only" in capsys.readouterr().out


def test_logits_and_growth_bytes_per_token():
    config = llama_config("llama-3.1-8b")
    vocab, h, layers = config.vocab_size, config.hidden_size, config.num_hidden_layers
    assert logits_bytes_per_token(vocab) == {"baseline": 12 * vocab, "patched": 2 * vocab}
    growth = growth_bytes_per_token(config)
    assert growth["baseline"] - growth["patched"] == 10 * vocab + (2 * layers + 1) * 4 * h
    assert 5e6 < growth["activations"] < 1e7  # about 6.7 MB per token for the 8B shape in bf16


def test_measured_bytes_per_token_from_probes():
    probe, _ = fake_probe(10_000 + 7 * 20_100)
    result = search_longest(probe, lo=4096, hi=65536, budget=10_000 + 7 * 20_100)
    assert result.measured_bytes_per_token() == pytest.approx(7)


@pytest.mark.gpu
def test_fit_on_gpu():
    result = max_seq_len_that_fits("tiny", patched=True, lo=256, hi=2048, max_probes=4)
    assert result.longest == 2048 and result.exact and len(result.probes) <= 4


@pytest.mark.gpu
def test_compare_on_gpu_saves_memory():
    result = compare("tiny", steps=4, seq_len=1024, batch_size=4, progress=False)
    assert result.summary()["memory_saved_bytes"] > 0
    assert result.summary()["max_abs_loss_difference"] < 0.05


def test_compare_compiled_trains_like_eager():
    # Both models through torch.compile (aot_eager on the CPU): the same losses as the eager comparison, to bf16
    # rounding (the traced graph rounds some bf16 intermediates differently); the second step's loss differs from
    # the first by about 0.2, so a compiled run that did not train would fail.
    eager = compare("tiny", steps=2, seq_len=32, batch_size=1, warmup_steps=1, progress=False)
    compiled = compare("tiny", steps=2, seq_len=32, batch_size=1, warmup_steps=1, progress=False, compile="default")
    assert compiled.settings["compile"] == "default"
    for variant in ("baseline", "patched"):
        a, b = getattr(compiled, variant).losses, getattr(eager, variant).losses
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-2, (variant, a, b)
    with pytest.raises(ValueError, match="compile mode"):
        compile_model(torch.nn.Linear(2, 2), "fastest")
