"""The LoRA benchmark's command line on the CPU at the tiny preset: its file, its rows, the same first loss for PEFT
and the fused layers, the micro-benchmark's row, and its argument checks (timings here mean nothing)."""

import json

import pytest

from kernels import runtime
from kernels.bench import lora as bench

pytest.importorskip("peft", reason="peft is a test requirement (requirements.txt)")


def test_one_run_writes_its_rows_and_the_losses_agree(tmp_path, capsys):
    code = bench.main(["--preset", "tiny", "--batch", "1", "--seq", "13", "--steps", "1", "--warmup", "0",
                       "--setups", "hf_peft,patched_peft,patched_peft_triton", "--no-micro", "--out", str(tmp_path)])
    assert code == 0
    result = json.loads((tmp_path / "lora" / "tiny_b1.json").read_text())
    rows = result["rows"]
    assert set(rows) == {"hf_peft", "patched_peft", "patched_peft_triton"}
    assert all(row["tokens_per_s"] > 0 for row in rows.values())
    # Every PEFT setup starts from the same adapters and batch: the fused layers give PEFT's loss (float32 here).
    for name in ("patched_peft", "patched_peft_triton"):
        assert rows[name]["first_loss"] == pytest.approx(rows["hf_peft"]["first_loss"], rel=1e-5)
    assert result["settings"]["rank"] == 16
    if runtime.MODE == "gpu":
        assert "vs_hf_peft" in result["targets"]
    else:  # interpreter wall-clock: no target judged on it ("target ... NOT met" was printed), and the table says so
        assert result["targets"] == {}
        text = capsys.readouterr().out
        assert "NOT met" not in text and "× HF+PEFT" not in text and "meaningless as GPU time" in text
    assert "28 of 28 LoRA layers fused" in result["lora_layers"]


def test_micro_line_with_and_without_the_low_rank_first_timing():
    row = {"layer": "q_proj", **{k: 1.0 for k in ("fwd_peft_ms", "fwd_cublas_epilogue_ms", "fwd_triton_epilogue_ms",
                                               "base_gemm_cublas_ms", "base_gemm_triton_ms", "dA_cublas_ms",
                                               "dA_splitk_ms", "dB_cublas_ms", "dB_splitk_ms")}}
    result = {"settings": {"preset": "tiny", "batch": 1, "seq": 8, "rank": 2, "alpha": 4.0, "checkpointing": False},
              "device": "cpu", "rows": {}, "targets": {}, "micro": [row]}
    older = bench.format_table(result).splitlines()[-1]
    assert "low-rank first" not in older and "cuBLAS epilogue 1.000, Triton epilogue 1.000" in older
    row["fwd_cublas_lowrank_first_ms"], row["fwd_merged_ms"] = 0.5, 0.25
    assert "cuBLAS epilogue 1.000, low-rank first 0.500, merged 0.250, Triton" in bench.format_table(result)


def test_micro_row_has_every_timing():
    (row,) = bench.micro("tiny", tokens=9, rank=2, alpha=4.0, names=("k_proj",))
    assert row["in"] == 128 and row["out"] == 64
    assert all(row[k] > 0 for k in row if k.endswith("_ms")) and len([k for k in row if k.endswith("_ms")]) == 11


@pytest.mark.parametrize("argv,message", [
    (["--setups", "floor_hf,nope"], "argument --setups: unknown 'nope'"),
    (["--batch", "0"], "argument --batch: must be a positive integer"),
    (["--record", "--out", "x"], "argument --out: not allowed with argument --record"),
    (["--alpha", "-1"], "argument --alpha: must be a number > 0"),
])
def test_bad_arguments_exit_before_any_work(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_finetune_lora_compare_writes_its_file(tmp_path):
    from kernels.training import finetune

    code = finetune.main(["--lora", "2", "--lora-alpha", "4", "--compare", "--preset", "tiny", "--steps", "2",
                          "--seq-len", "64", "--batch-size", "1", "--grad-accum", "1", "--no-progress",
                          "--out", str(tmp_path)])
    assert code == 0
    data = json.loads((tmp_path / "lora" / "tiny_r2.json").read_text())
    assert data["settings"]["lora"] == {"rank": 2, "alpha": 4.0, "dropout": 0.0, "targets": list(finetune.LORA_TARGETS)}
    assert (tmp_path / "lora" / "tiny_r2.png").exists()
    # The same weights, adapters and batches: the first step's losses agree (bf16 kernels round differently).
    assert data["summary"]["first_step_loss_difference"] < 0.05


def test_finetune_lora_needs_compare(capsys):
    from kernels.training import finetune

    with pytest.raises(SystemExit) as stop:
        finetune.main(["--lora", "4", "--preset", "tiny", "--steps", "1"])
    assert stop.value.code == 2 and "--lora RANK runs with --compare" in capsys.readouterr().err
