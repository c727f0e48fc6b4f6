"""``python -m kernels.training.finetune``: the command line runs, prints the table and writes the JSON and the PNG;
its flags (kernels, checkpointing, AdamW) reach the run and bad arguments are refused before any work."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import runtime
from kernels.training.finetune import build_parser, main

ROOT = Path(__file__).resolve().parents[2]


def test_compare_on_the_command_line(tmp_path):
    if runtime.MODE == "gpu":
        pytest.skip("on a GPU the default preset is a full-size model; the CLI is exercised by test_single_run")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "kernels.training.finetune", "--compare", "--steps", "2", "--seq-len", "96",
           "--batch-size", "1",
           "--grad-accum", "2", "--out", str(tmp_path), "--no-progress"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "baseline (HF)" in done.stdout and "max |loss difference|" in done.stdout
    # Interpreter wall-clock: no speed-up printed as if it were one (it printed "0.131×"), and the table says why.
    assert re.search(r"\d\.\d+×", done.stdout) is None and "meaningless as GPU speed" in done.stdout
    data = json.loads((tmp_path / "finetune" / "tiny.json").read_text())
    assert data["settings"] == {**data["settings"], "preset": "tiny", "steps": 2, "seq_len": 96, "grad_accum": 2}
    assert len(data["baseline"]["steps"]) == len(data["patched"]["steps"]) == 2
    assert data["summary"]["max_abs_loss_difference"] < 0.05
    assert "LlamaRMSNorm" in data["baseline"]["what_ran"]["norms"]
    assert "TritonRMSNorm" in data["patched"]["what_ran"]["norms"]
    assert (tmp_path / "finetune" / "tiny.png").stat().st_size > 10_000


def test_single_run_and_fit_message(tmp_path, capsys):
    if runtime.MODE != "gpu":  # --fit needs the GPU's memory: refused before any work, not after the run
        with pytest.raises(SystemExit) as exit_info:
            main(["--preset", "tiny", "--fit", "--out", str(tmp_path)])
        assert exit_info.value.code == 2 and "--fit needs a CUDA GPU" in capsys.readouterr().err
        assert not (tmp_path / "finetune").exists()
    assert main(["--preset", "tiny", "--steps", "2", "--seq-len", "64", "--batch-size", "1", "--grad-accum", "1",
                 "--out", str(tmp_path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "patched:" in out and "tokens/s" in out
    data = json.loads((tmp_path / "finetune" / "tiny_patched.json").read_text())
    assert len(data["patched"]["steps"]) == 2 and "baseline" not in data


def test_help_and_bad_arguments(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--help"])
    assert exit_info.value.code == 0
    assert "--compare" in capsys.readouterr().out
    for bad, says in ((["--steps", "0"], "argument --steps: must be a positive integer, got '0'"),
                      (["--preset", "llama-99b"], "argument --preset: invalid choice: 'llama-99b'")):
        with pytest.raises(SystemExit) as exit_info:
            main(bad)
        assert exit_info.value.code == 2 and says in capsys.readouterr().err


def test_lr_help_states_the_default_learning_rates():
    from kernels.training.loop import default_lr

    help_text = " ".join(build_parser().format_help().split())
    assert f"{default_lr('tiny'):g} for tiny" in help_text
    assert f"{default_lr('llama-3.1-8b'):g} for the Llama" in help_text


def test_kernels_switches_and_checkpointing_reach_the_patched_run(tmp_path, capsys):
    from kernels.hf.patch import SWITCHES

    assert main(["--preset", "tiny", "--steps", "1", "--seq-len", "48", "--batch-size", "1", "--grad-accum", "1",
                 "--kernels", "cross_entropy", "--gradient-checkpointing", "--out", str(tmp_path),
                 "--no-progress"]) == 0
    data = json.loads((tmp_path / "finetune" / "tiny_patched.json").read_text())
    assert data["settings"]["patch_options"] == {name: name == "cross_entropy" for name in SWITCHES}
    assert data["settings"]["gradient_checkpointing"] is True
    # Only the loss was patched: the norms stay Hugging Face's.
    assert "TritonRMSNorm" not in data["patched"]["what_ran"]["norms"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--kernels", "rms_norm,flash"])
    assert "unknown kernel flash" in capsys.readouterr().err


def test_fused_adamw_reaches_the_run(tmp_path):
    assert main(["--preset", "tiny", "--steps", "2", "--seq-len", "48", "--batch-size", "1", "--grad-accum", "1",
                 "--adamw", "fused", "--out", str(tmp_path), "--no-progress"]) == 0
    data = json.loads((tmp_path / "finetune" / "tiny_patched.json").read_text())
    assert data["settings"]["adamw"] == "fused"
    assert "fused=True" in data["patched"]["what_ran"]["optimizer"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--name", "runs/fused"])  # a file name, not a folder


def test_the_patched_run_can_have_its_own_adamw(tmp_path, capsys):
    # Hugging Face with torch's fused AdamW (its Trainer's default) against the patched model with the Triton AdamW.
    assert main(["--compare", "--preset", "tiny", "--steps", "2", "--seq-len", "48", "--batch-size", "1",
                 "--adamw", "fused", "--patched-adamw", "triton", "--out", str(tmp_path), "--no-progress"]) == 0
    data = json.loads((tmp_path / "finetune" / "tiny.json").read_text())  # the flags are in its settings
    assert (data["settings"]["adamw"], data["settings"]["patched_adamw"]) == ("fused", "triton")
    assert "fused=True" in data["baseline"]["what_ran"]["optimizer"]
    assert "TritonAdamW" in data["patched"]["what_ran"]["optimizer"]
    losses = [[step["loss"] for step in data[run]["steps"]] for run in ("baseline", "patched")]
    assert max(abs(a - b) for a, b in zip(*losses)) < 0.05
    from kernels.distributed.finetune import main as sharded_main

    with pytest.raises(SystemExit) as exit_info:
        sharded_main(["--patched-adamw", "triton"])
    assert exit_info.value.code == 2 and "leave out --adamw fused and --patched-adamw" in capsys.readouterr().err
