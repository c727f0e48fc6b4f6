"""The results folder: one file per group and name (``results_file``), a run found by its settings (``find_run``),
a writer that replaces its file, and the committed results themselves."""

import json

import pytest

from kernels.bench.results import KERNELS, RESULTS, find_run, results_file, run_settings, runs
from kernels.training.finetune import main as finetune_main

# --------------------------------------------------------------------------------------------------------------------
# The layout
# --------------------------------------------------------------------------------------------------------------------


def test_results_file_is_group_folder_and_name(tmp_path):
    assert results_file("finetune", "every_kernel", tmp_path) == tmp_path / "finetune" / "every_kernel.json"
    assert results_file("rmsnorm", "nvidia-h200", tmp_path, suffix=".png") == tmp_path / "rmsnorm" / "nvidia-h200.png"
    assert results_file("fsdp", "llama-3.1-8b_2gpu").parent == RESULTS / "fsdp"
    for group, name in (("finetune", "a/b"), ("finetune", ""), ("..", "x"), ("fine/tune", "x"), ("finetune", "..")):
        with pytest.raises(ValueError, match="file name without a folder"):
            results_file(group, name, tmp_path)


# --------------------------------------------------------------------------------------------------------------------
# Finding a run by its settings
# --------------------------------------------------------------------------------------------------------------------


def _write(directory, group, name, data):
    path = results_file(group, name, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


EVERY = {"rms_norm": True, "cross_entropy": True, "swiglu": True, "rope": True}


@pytest.fixture
def finetune_runs(tmp_path):
    settings = {"preset": "llama-3.1-8b", "seq_len": 2048, "patch_options": EVERY, "compile": None,
                "gradient_checkpointing": False, "padding_mask": False, "adamw": "fused", "patched_adamw": "triton"}
    _write(tmp_path, "finetune", "every_kernel_nomask_adamw", {"device": "NVIDIA H200", "settings": settings})
    _write(tmp_path, "finetune", "every_kernel_compiled", {"device": "NVIDIA H200",
                                                           "settings": {**settings, "compile": "default"}})
    # Written before the command line recorded the mask, checkpointing and AdamW: the defaults of then apply.
    _write(tmp_path, "finetune", "rmsnorm_ce", {"device": "NVIDIA H200", "settings": {
        "preset": "llama-3.1-8b", "seq_len": 2048, "patch_options": {}, "compile": None}})
    return tmp_path


def test_find_run_returns_the_one_run_with_every_given_setting(finetune_runs):
    run = find_run("finetune", finetune_runs, compile="default", patch_options=EVERY)
    assert run["settings"]["compile"] == "default"
    assert find_run("finetune", finetune_runs, adamw="fused", compile=None)["settings"]["patched_adamw"] == "triton"
    assert find_run("finetune", finetune_runs, device="NVIDIA H200", patch_options={})["settings"]["seq_len"] == 2048
    older = find_run("finetune", finetune_runs, padding_mask=True, adamw="foreach", patched_adamw="foreach",
                     gradient_checkpointing=False)
    assert older["settings"]["patch_options"] == {}


def test_nested_settings_compare_exactly(finetune_runs):
    with pytest.raises(LookupError):
        find_run("finetune", finetune_runs, patch_options={"rms_norm": True})  # a part of EVERY is not EVERY
    with pytest.raises(LookupError):
        find_run("finetune", finetune_runs, patch_options={**EVERY, "linear_cross_entropy": False})


def test_no_match_lists_the_runs_that_are_there(finetune_runs):
    with pytest.raises(LookupError) as info:
        find_run("finetune", finetune_runs, seq_len=8192)
    message = str(info.value)
    assert "seq_len': 8192" in message
    for name in ("every_kernel_nomask_adamw.json", "every_kernel_compiled.json", "rmsnorm_ce.json"):
        assert name in message
    assert "'compile': 'default'" in message and "'padding_mask': True" in message
    with pytest.raises(LookupError, match="none"):
        find_run("scaling", finetune_runs, preset="tiny")  # no such folder: no runs


def test_two_matches_name_both_files(finetune_runs):
    with pytest.raises(ValueError) as info:
        find_run("finetune", finetune_runs, patch_options=EVERY)
    assert "every_kernel_nomask_adamw.json" in str(info.value) and "every_kernel_compiled.json" in str(info.value)
    assert "rmsnorm_ce.json" not in str(info.value)


def test_runs_without_settings_are_found_by_their_top_level_values(tmp_path):
    _write(tmp_path, "adamw", "nvidia-h200", {"preset": "llama-3.1-8b", "device_slug": "nvidia-h200", "mode": "gpu",
                                              "rows": [{"impl": "ours"}]})
    _write(tmp_path, "adamw", "nvidia-h100", {"preset": "llama-3.1-8b", "device_slug": "nvidia-h100", "mode": "gpu",
                                              "rows": []})
    assert find_run("adamw", tmp_path, device_slug="nvidia-h200")["rows"] == [{"impl": "ours"}]
    assert set(runs("adamw", tmp_path)) == {"nvidia-h200.json", "nvidia-h100.json"}
    assert "rows" not in run_settings(runs("adamw", tmp_path)["nvidia-h200.json"])


# --------------------------------------------------------------------------------------------------------------------
# A writer replaces its file
# --------------------------------------------------------------------------------------------------------------------


def test_a_second_run_under_the_same_name_replaces_the_first(tmp_path):
    common = ["--preset", "tiny", "--steps", "1", "--seq-len", "32", "--batch-size", "1", "--grad-accum", "1",
              "--name", "tiny_check", "--out", str(tmp_path), "--no-progress"]
    assert finetune_main(common) == 0
    assert finetune_main([*common, "--no-padding-mask", "--kernels", "rms_norm", "--force"]) == 0  # asked to
    assert sorted(p.name for p in (tmp_path / "finetune").iterdir()) == ["tiny_check.json", "tiny_check.png"]
    run = find_run("finetune", tmp_path, preset="tiny")
    assert run["settings"]["padding_mask"] is False and run["settings"]["patch_options"]["rms_norm"] is True
    assert find_run("finetune", tmp_path, padding_mask=False, patch_options=run["settings"]["patch_options"]) == run


# --------------------------------------------------------------------------------------------------------------------
# The committed results
# --------------------------------------------------------------------------------------------------------------------

# Benchmarks whose configuration sits at the top level of their JSON, as they have always written it.
TOP_LEVEL_KEYS = {
    "ceilings": {"device", "copy_gbps", "matmul_tflops", "copy_bytes", "matmul_n"},
    "adamw": {"device", "device_slug", "mode", "preset", "reps"},
    "overhead": {"device", "device_slug", "mode", "calls"},
    "linear_cross_entropy": {"kernel", "device", "device_slug", "mode", "hidden", "vocab", "tokens"},
    "peak_memory": {"device", "preset", "lengths", "gradient_checkpointing"},
    "attention": {"device", "device_slug", "mode", "versions", "matmul_tflops", "settings", "rows"},
    "attention_blocks": {"device", "device_slug", "mode", "kernel_version", "settings", "configured", "rows", "best"},
    "add_rmsnorm": {"device", "device_slug", "mode", "versions", "hidden", "dtype", "tokens", "copy_gbps", "rows"},
    "fp8_gemm": {"device", "device_slug", "mode", "versions", "tokens", "shapes", "check_tolerance", "rows"},
    "rmsnorm_fp8": {"device", "device_slug", "mode", "versions", "tokens", "hidden", "dtype", "fp8_dtype", "copy_gbps",
                    "rows"},
}
SWEEP_KEYS = {"kernel", "device", "device_slug", "mode", "date", "settings"}


def _committed():
    return sorted(RESULTS.rglob("*.json"))


def test_every_committed_result_parses_and_carries_its_configuration():
    assert _committed()
    for path in _committed():
        data = json.loads(path.read_text())
        group = "ceilings" if path.parent == RESULTS else path.parent.name
        assert isinstance(data, dict), path
        if group in TOP_LEVEL_KEYS:
            assert TOP_LEVEL_KEYS[group] <= set(data), (path, TOP_LEVEL_KEYS[group] - set(data))
        elif group in KERNELS or group == "cuda_rmsnorm":  # the kernel sweep, named by its device
            assert SWEEP_KEYS <= set(data) and path.stem == data["device_slug"], path
        else:
            assert isinstance(data.get("settings"), dict) and data["settings"].get("preset"), path


def test_committed_layout_is_short_names_in_group_folders():
    files = [p for p in RESULTS.rglob("*") if p.is_file()]
    assert len(files) <= 60  # each a run a chapter, the README or a note cites
    for path in files:
        relative = path.relative_to(RESULTS)
        assert len(path.name) <= 60, relative
        assert len(relative.parts) == 2 or relative.name == "ceilings.json", relative


def test_the_runs_the_chapters_read_are_found_by_their_settings():
    eager = find_run("finetune", preset="llama-3.1-8b", patch_options={}, compile=None)  # chapter 09
    compiled = find_run("finetune", preset="llama-3.1-8b", patch_options={}, compile="default")
    assert eager is not compiled and eager["summary"]["tokens_per_s"] and compiled["summary"]["tokens_per_s"]
    assert find_run("fsdp", preset="llama-3.1-8b", world_size=2, steps=6)["summary"]["speedup"] > 1  # chapter 12
