"""The FP8-base LoRA benchmark in the interpreter, on a one-layer tiny Llama: each mode runs, writes its JSON (replaced
only with ``--force``) and prints its table; the step's rows share the first loss within FP8's rounding, the accuracy
run gives every curve its full length, the 70B path builds a model layer by layer straight into FP8. The GPU runs
are the same code at the 8B and 70B shapes."""

import json

import pytest
import torch

from kernels.bench import lora_fp8
from kernels.bench.lora_fp8 import main, speedups
from kernels.bench.results import device_slug
from kernels.fp8_linear import Fp8Linear


@pytest.fixture
def one_layer(monkeypatch):
    real_build, real_config = lora_fp8.build_llama, lora_fp8.llama_config
    monkeypatch.setattr(lora_fp8, "build_llama", lambda *a, **kw: real_build(*a, **{**kw, "num_hidden_layers": 1}))
    monkeypatch.setattr(lora_fp8, "llama_config", lambda preset: real_config(preset, num_hidden_layers=1))


def _run(tmp_path, mode, *extra):
    assert main(["--mode", mode, "--out", str(tmp_path), "--seq", "16", *extra]) == 0
    return json.loads((tmp_path / "lora_fp8" / f"{mode}_{device_slug()}.json").read_text())


def test_step_mode(one_layer, tmp_path, capsys):
    data = _run(tmp_path, "step")
    assert list(data["rows"]) == ["hf_peft", "patched_peft", "fp8_base", "fp8_base_bf16_dx", "fp8_base_saved_fp8"]
    losses = [row["first_loss"] for row in data["rows"].values()]
    assert max(losses) - min(losses) < 0.01 * losses[0]  # the same batch and adapters: FP8's rounding apart
    assert "7 frozen linears in FP8" in data["fp8_summary"]
    assert set(data["speedups"]["fp8_base"]) == {"vs_patched", "vs_hf"}
    assert "FP8 base, FP8 input gradient" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:  # an existing file is replaced only with --force
        main(["--mode", "step", "--out", str(tmp_path)])
    assert exit_info.value.code == 2


def test_accuracy_mode(one_layer, tmp_path):
    data = _run(tmp_path, "accuracy", "--train-steps", "2")
    assert set(data["losses"]) == set(lora_fp8.RUNS) and all(len(v) == 2 for v in data["losses"].values())
    assert data["curves"]["bf16"]["last_ratio"] == 1.0
    # the fused bf16 run against PEFT's own bf16 layers, and the FP8 runs against it: FP8-sized, not zero
    assert set(data["grad_errors"]) == {"peft_bf16", "fp8", "fp8_bf16_dx", "fp8_saved_fp8"}
    assert all(0 < e["together"] < 0.25 for run, e in data["grad_errors"].items() if run != "peft_bf16")
    assert 0 < data["layer_error"]["plain"] < 0.1


def test_70b_path_builds_straight_into_fp8(one_layer, monkeypatch):
    built = {}
    real = lora_fp8.build_fp8_lora_llama

    def spy(*args, **kwargs):
        built["model"] = real(*args, **kwargs)
        return built["model"]

    monkeypatch.setattr(lora_fp8, "build_fp8_lora_llama", spy)
    result = lora_fp8.run_70b("tiny", 1, 16, 4, 8.0, 0, 1, checkpointing=True, log=lambda *a, **k: None)
    assert result["row"]["tokens_per_s"] > 0 and result["layers"] == 1
    model = built["model"]
    assert sum(isinstance(m, Fp8Linear) for m in model.modules()) == 7
    assert not any(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())
    b_weights = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert b_weights and all(torch.count_nonzero(p) > 0 for p in b_weights)  # trained by the step: no longer zero


def test_speedups():
    rows = {"hf_peft": {"tokens_per_s": 1.0, "peak_gib": 9.0}, "patched_peft": {"tokens_per_s": 2.0, "peak_gib": 5.0},
            "fp8_base": {"tokens_per_s": 2.5, "peak_gib": 4.0}, "broken": {"error": "out of memory"}}
    out = speedups(rows)
    assert out["fp8_base"] == {"vs_patched": 1.25, "vs_hf": 2.5, "peak_below_patched_gib": 1.0}
    assert "broken" not in out
