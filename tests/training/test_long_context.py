"""The memory arithmetic of a long step, the extrapolation from two probes (made-up numbers on the CPU), the
switches composed on a real model, the command line; the probe itself needs a GPU."""

import json
import math

import matplotlib
import pytest
import torch

from kernels import runtime
from kernels.hf.presets import count_parameters, llama_config
from kernels.hf.tiled_mlp import TiledSwiGLUMLP
from kernels.training import long_context as lc

matplotlib.use("Agg")
GiB = 1024**3
KiB = 1024


# ---------------------------------------------------------------------------------------------------------------
# memory_table
# ---------------------------------------------------------------------------------------------------------------


def test_the_8b_checkpoints_take_256_kib_per_token():
    table = lc.memory_table("llama-3.1-8b", 524288)
    assert table.row("checkpoints").per_token == 32 * 4096 * 2 == 256 * KiB
    assert table.row("checkpoints").at(524288) == 128 * GiB
    n = count_parameters(llama_config("llama-3.1-8b"))
    assert table.row("weights").fixed == table.row("gradients").fixed == 2 * n
    assert table.row("adamw").fixed == 4 * n
    assert table.row("mlp_untiled").per_token == 3 * 14336 * 2


def test_each_switch_takes_its_part_off_the_total():
    table = lc.memory_table("llama-3.1-8b", 262144)
    untiled, tiled = table.total(), table.total(tiled_mlp=True)
    assert untiled - tiled == table.row("mlp_untiled").at(262144) - table.row("mlp_tiled").at(262144) > 0
    offloaded = table.total(offload=True)
    assert untiled - offloaded == table.row("checkpoints").at(262144) - table.row("prefetched").at(262144)
    assert table.total(True, True) < min(tiled, offloaded)
    assert table.total() == sum(table.row(k).at(262144) for k in table.keys())


def test_the_tiled_mlp_row_does_not_grow_with_the_length():
    short, long = lc.memory_table("llama-3.1-8b", 65536), lc.memory_table("llama-3.1-8b", 524288)
    assert short.row("mlp_tiled") == long.row("mlp_tiled")
    assert long.row("mlp_untiled").at(524288) == 8 * short.row("mlp_untiled").at(65536)
    assert lc.memory_table("llama-3.1-8b", 524288, tile=1024).row("mlp_tiled").fixed < long.row("mlp_tiled").fixed


def test_the_table_prints_every_part_and_takes_a_config():
    table = lc.memory_table(llama_config("tiny"), 1000)
    text = str(table)
    for row in table.rows:
        assert row.part in text
    assert "total, tiled MLP + checkpoints offloaded" in text
    with pytest.raises(ValueError, match="seq_len"):
        lc.memory_table("tiny", 0)
    with pytest.raises(KeyError, match="no row"):
        table.row("logits")


def test_offload_traffic():
    traffic = lc.offload_traffic("llama-3.1-8b", 131072, keep_on_gpu=4)
    assert traffic["to_host"] == traffic["to_gpu"] == 28 * 131072 * 4096 * 2
    assert traffic["total"] == 2 * traffic["to_host"]


# ---------------------------------------------------------------------------------------------------------------
# longest_that_fits, with made-up probes
# ---------------------------------------------------------------------------------------------------------------


def points(gpu_fixed, gpu_slope, host_slope, lengths=(131072, 262144)):
    return [lc.ProbePoint(n, True, int(gpu_fixed + gpu_slope * n), int(gpu_fixed * 0.9), int(host_slope * n), 10.0)
            for n in lengths]


def test_limited_by_the_gpu():
    fit = lc.longest_that_fits(points(70 * GiB, 100_000, 250_000), gpu_bytes=140 * GiB, host_bytes=10**13)
    assert fit.limited_by == "GPU memory"
    assert fit.longest == int((70 * GiB) / 100_000) // 1024 * 1024
    assert fit.gpu_per_token == pytest.approx(100_000, rel=1e-6) and fit.host_per_token == pytest.approx(250_000)
    assert f"{fit.longest:,}" in fit.text and "GPU memory" in fit.text


def test_limited_by_the_host():
    fit = lc.longest_that_fits(points(70 * GiB, 100_000, 262_144), gpu_bytes=140 * GiB, host_bytes=100 * GiB)
    assert fit.limited_by == "host memory"
    assert fit.longest == (100 * GiB) // 262_144 // 1024 * 1024 == 409600
    assert "host memory" in fit.text.splitlines()[-1]


def test_a_short_host_borrows_room_from_the_gpu_one_layer_at_a_time():
    # 32 layers offloaded: 8,192 bytes per token each. The host alone stops at 409,600 tokens; the GPU has room.
    made_up = points(58 * GiB, 107_000, 262_144)
    host_only = lc.longest_that_fits(made_up, gpu_bytes=139 * GiB, host_bytes=100 * GiB)
    split = lc.longest_that_fits(made_up, gpu_bytes=139 * GiB, host_bytes=100 * GiB, layers=32)
    assert host_only.keep_on_gpu == 0 and host_only.longest == 409600
    k = split.keep_on_gpu
    assert 0 < k < 32 and split.longest > host_only.longest
    gpu = (139 * GiB - 58 * GiB) / (107_000 + 8192 * k)
    host = 100 * GiB / (262_144 - 8192 * k)
    assert split.longest == int(min(gpu, host)) // 1024 * 1024
    for other in (k - 1, k + 1):  # one layer more or fewer on either side fits less
        assert min((139 * GiB - 58 * GiB) / (107_000 + 8192 * other), 100 * GiB / (262_144 - 8192 * other)) < \
            split.longest + 1024
    assert f"keep_on_gpu={k}" in split.text.splitlines()[-1]


def test_a_host_with_room_keeps_every_checkpoint_offloaded():
    made_up = points(70 * GiB, 100_000, 262_144)
    fit = lc.longest_that_fits(made_up, gpu_bytes=140 * GiB, host_bytes=10**13, layers=32)
    assert fit.keep_on_gpu == 0 and fit.limited_by == "GPU memory" and "keep_on_gpu" not in fit.text


def test_the_results_are_fitted_from_their_own_budgets():
    results = {"settings": {"preset": "llama-3.1-8b", "gpu_total_bytes": 139 * GiB, "host_budget_bytes": 100 * GiB},
               "variants": {"ours+both": {"points": [vars(p) for p in points(58 * GiB, 107_000, 262_144)]},
                            "ours": {"points": [vars(p) for p in points(58 * GiB, 400_000, 0)][:1]},
                            "liger": {"skipped": "Liger-Kernel is not installed", "points": []}}}
    fitted = lc.fit_variants(results)["variants"]
    assert fitted["ours+both"]["longest"]["keep_on_gpu"] > 0
    assert fitted["ours"]["longest"] is None and "two probes" in fitted["ours"]["longest_note"]
    assert fitted["liger"]["longest"] is None


def test_no_host_growth_is_no_limit_and_step_rounds_down():
    fit = lc.longest_that_fits(points(70 * GiB, 100_000, 0), gpu_bytes=140 * GiB, host_bytes=0, step=4096)
    assert fit.limited_by == "GPU memory" and fit.longest % 4096 == 0
    assert "no limit" in fit.text


def test_the_extrapolation_accepts_a_run_and_refuses_what_it_cannot_use():
    run = lc.ProbeRun("ours+both", "llama-3.1-8b", {}, points(70 * GiB, 100_000, 250_000))
    assert lc.longest_that_fits(run, 140 * GiB, 10**13).longest > 262144
    failed = points(70 * GiB, 100_000, 0)
    failed[1] = lc.ProbePoint(262144, False, error="OutOfMemoryError")
    with pytest.raises(ValueError, match="two probes"):
        lc.longest_that_fits(failed, 140 * GiB, 10**13)
    with pytest.raises(ValueError, match="did not grow"):
        lc.longest_that_fits(points(70 * GiB, 0, 0), 140 * GiB, 10**13)


def test_probe_runs_round_trip_through_json():
    run = lc.ProbeRun("ours", "tiny", {"tiled_mlp": False}, points(GiB, 1000, 0))
    assert lc.ProbeRun.from_dict(json.loads(json.dumps(run.to_dict()))) == run


# ---------------------------------------------------------------------------------------------------------------
# The step's pieces on the CPU, and the GPU-only parts refusing
# ---------------------------------------------------------------------------------------------------------------


def test_long_batch():
    batch, n_items = lc.long_batch(300, 2048, seed=1)
    assert batch["input_ids"].shape == (1, 300) and "attention_mask" not in batch
    assert batch["labels"][0, 0] == -100 and n_items == 299
    assert torch.equal(lc.long_batch(300, 2048, seed=1)[0]["input_ids"], batch["input_ids"])


def test_every_switch_composes_in_a_training_step():
    setup = lc.prepare("tiny", "ours", tiled_mlp=True, offload=True, offload_options={"keep_on_gpu": 0}, tile=64)
    try:
        assert isinstance(setup.model.model.layers[0].mlp, TiledSwiGLUMLP)
        assert all(m.tile_rows == 64 for m in setup.model.modules() if isinstance(m, TiledSwiGLUMLP))
        batch, n_items = lc.long_batch(3 * 64 + 5, setup.model.config.vocab_size)
        batch = {k: v.to(runtime.device()) for k, v in batch.items()}
        before = [p.detach().clone() for p in setup.model.parameters()]
        loss = lc.train_step(setup, batch, n_items)
        assert loss.dim() == 0 and not loss.requires_grad and torch.isfinite(loss)
        assert setup.offload.stats.copies_to_host == setup.model.config.num_hidden_layers
        assert any(not torch.equal(a, b) for a, b in zip(before, setup.model.parameters()))
    finally:
        setup.undo()
    assert type(setup.model.model.layers[0].mlp).__name__ == "LlamaMLP"


@pytest.mark.skipif(runtime.MODE == "gpu", reason="checks the refusal without a GPU")
def test_the_gpu_parts_refuse_on_the_cpu():
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        lc.probe("tiny", (64, 128))
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        lc.step_times("tiny", 64)
    with pytest.raises(SystemExit) as exit_info:  # the command line: refused with the argument mistakes, exit 2
        lc.main(["--preset", "tiny", "--probe", "64,128"])
    assert exit_info.value.code == 2


def test_the_command_line_parses_lengths_and_variants():
    args = lc.build_parser().parse_args(["--probe", "131_072,262144", "--variants", "hf,ours+both"])
    assert args.probe == (131072, 262144) and args.variants == ("hf", "ours+both")
    for bad in (["--probe", "5"], ["--probe", "8,8"], ["--variants", "ours+magic"]):
        with pytest.raises(SystemExit):
            lc.build_parser().parse_args(bad)


def test_a_variant_that_does_not_fit_is_probed_again_at_half_the_lengths(monkeypatch):
    calls = []

    def fake_worker(args, extra):
        lengths = [int(n) for n in extra[extra.index("--probe") + 1].split(",")]
        calls.append(lengths)
        return {"variant": "hf", "points": [vars(lc.ProbePoint(n, n <= 40_000, 10 * n if n <= 40_000 else None))
                                             for n in lengths]}

    monkeypatch.setattr(lc, "_in_subprocess", fake_worker)
    args = lc.build_parser().parse_args(["--probe", "131072,262144"])
    run = lc.probe_variant(args, "hf")
    assert calls == [[131072, 262144], [65536, 131072], [32768, 65536], [16384, 32768]]
    assert run["lengths_tried"] == calls and all(p["fits"] for p in run["points"])
    assert len(lc.probe_variant(args, "hf", halvings=1)["points"]) == 2  # gives up after one halving


def fake_results():
    variants = {}
    for name, slope in (("hf", 900_000), ("ours", 400_000), ("ours+both", 150_000)):
        pts = points(70 * GiB, slope, 262_144 if "both" in name else 0)
        fit = lc.longest_that_fits(pts, 140 * GiB, 100 * GiB)
        variants[name] = {"points": [vars(p) for p in pts], "longest": vars(fit)}
    variants["liger"] = {"skipped": "Liger-Kernel is not installed", "points": [], "longest": None}
    times = {"ours": {"step_s": 10.0, "tokens_per_s": 3276.8, "peak": 80 * GiB, "bytes_offloaded_per_step": 0,
                      "vs_ours": 1.0},
             "ours+offload": {"step_s": 10.3, "tokens_per_s": 3181, "peak": 72 * GiB,
                              "bytes_offloaded_per_step": 8 * GiB, "vs_ours": 1.03},
             "ours+liger_tiled": {"skipped": "Liger-Kernel is not installed"}}
    return {"device": "a made-up GPU", "settings": {"preset": "llama-3.1-8b"}, "variants": variants,
            "step_times": times}


def test_tables_and_plots_of_a_results_dict():
    results = fake_results()
    text = lc.format_probes(results)
    assert "ours+both" in text and f"{results['variants']['ours']['longest']['longest']:,}" in text
    assert "Liger-Kernel is not installed" in lc.format_step_times(results["step_times"], 32768)
    ax = lc.plot_longest(results, target=524288)
    assert len(ax.patches) == 4 and len(ax.lines) == 1
    ax = lc.plot_memory_table(lc.memory_table("llama-3.1-8b", 524288))
    assert len(ax.get_xticklabels()) == 4
    import matplotlib.pyplot as plt

    plt.close("all")


def test_bytes_per_token_are_the_slopes_between_the_probes():
    results = fake_results()
    slopes = lc.per_token_bytes(results)
    assert set(slopes) == {"hf", "ours", "ours+both"}  # liger was skipped: no probes
    assert slopes["ours+both"] == pytest.approx(150_000, rel=1e-5) and slopes["ours"] == pytest.approx(400_000)
    table = lc.format_per_token(results).splitlines()
    assert "× ours" in table[0] and "× liger" not in table[0]
    both = next(line for line in table if line.startswith("ours+both"))
    assert "0.375" in both and "128K,256K" in both
    assert f"{results['variants']['ours+both']['longest']['longest']:,}" in both


def test_separate_runs_build_up_one_file():
    first = fake_results()
    first["settings"].update(timing_len=32768, variants=list(first["variants"]))
    second = {"device": first["device"], "settings": {"preset": "llama-3.1-8b", "timing_len": 0},
              "variants": {"ours+both": {"points": [], "longest": None}, "ours+tiled": {"points": []}},
              "step_times": {}}
    merged = lc.merge_results(first, second)
    assert list(merged["variants"]) == ["hf", "liger", "ours", "ours+tiled", "ours+both"]  # VARIANTS's order
    assert merged["variants"]["ours+both"]["longest"] is None  # the newer run wins
    assert merged["step_times"] == first["step_times"] and merged["settings"]["timing_len"] == 32768
    other_gpu = dict(second, device="another GPU")
    assert lc.merge_results(first, other_gpu) is other_gpu


def test_a_timing_run_keeps_the_probes_settings():
    probes = fake_results()
    probes["settings"].update(timing_len=32768, steps=3, host_budget_bytes=100 << 30, lengths=[131072, 262144])
    timing = {"device": probes["device"], "variants": {},
              "settings": {"preset": "llama-3.1-8b", "timing_len": 16384, "steps": 5, "host_budget_bytes": 1 << 30,
                           "lengths": [8, 16]},
              "step_times": {"ours": {"step_s": 1.0}}}
    merged = lc.merge_results(probes, timing)
    assert merged["variants"] == probes["variants"] and merged["step_times"] == timing["step_times"]
    settings = merged["settings"]
    assert settings["host_budget_bytes"] == 100 << 30 and settings["lengths"] == [131072, 262144]
    assert settings["timing_len"] == 16384 and settings["steps"] == 5


def test_the_split_prediction_is_the_extrapolation_at_its_own_limit():
    # the host runs out first (100 GiB, 262,144 bytes per token), so the fit keeps some layers on the GPU; at the
    # longest length it found, the predicted GPU peak is at the GPU's memory and the host's within its budget
    pts = points(58 * GiB, 110_000, 262_144)
    fit = vars(lc.longest_that_fits(pts, 140 * GiB, 100 * GiB, layers=32))
    assert fit["keep_on_gpu"] > 0
    at_limit = lc.split_prediction(fit, fit["longest"], fit["keep_on_gpu"], 32)
    assert 139 * GiB < at_limit["gpu_peak"] <= 140 * GiB and at_limit["host_bytes"] <= 100 * GiB
    none_kept = lc.split_prediction(fit, 262_144, 0, 32)
    assert none_kept["gpu_peak"] == pytest.approx(pts[1].gpu_peak) and none_kept["host_bytes"] == 64 * GiB
    six = lc.split_prediction(fit, 262_144, 6, 32)
    moved = 6 * 8192 * 262_144  # six layers' checkpoints: 4,096 × 2 bytes per token each
    assert six["gpu_peak"] - none_kept["gpu_peak"] == pytest.approx(moved)
    assert none_kept["host_bytes"] - six["host_bytes"] == pytest.approx(moved)


def test_the_split_check_is_printed_and_kept_by_later_runs():
    results = fake_results()
    assert "not checked" in lc.format_split_check(results)
    fit = results["variants"]["ours+both"]["longest"]
    predicted = lc.split_prediction(fit, 262_144, 6, 32)
    point = lc.ProbePoint(262_144, True, int(predicted["gpu_peak"]) - GiB, 40 * GiB, 52 * GiB, 180.0, loss=12.3)
    results["split_check"] = {"variant": "ours+both", "keep_on_gpu": 6, "layers": 32, "point": vars(point),
                              "predicted": predicted}
    text = lc.format_split_check(results)
    assert "keep_on_gpu=6" in text and "262,144" in text and "loss 12.300" in text
    assert lc._fmt(predicted["gpu_peak"]) in text and lc._fmt(point.gpu_peak) in text
    later = {"device": results["device"], "settings": {"preset": "llama-3.1-8b", "timing_len": 32768},
             "variants": {}, "step_times": {"ours": {"step_s": 1.0}}}
    assert lc.merge_results(results, later)["split_check"] == results["split_check"]
    failed = dict(results["split_check"], point=vars(lc.ProbePoint(262_144, False, error="OutOfMemoryError: x")))
    assert "did not fit: OutOfMemoryError" in lc.format_split_check(dict(results, split_check=failed))
    args = lc.build_parser().parse_args(["--variants", "", "--timing-len", "0", "--check-split", "262144"])
    assert args.variants == () and args.check_split == 262144


def test_results_files_are_found(tmp_path):
    (tmp_path / "nvidia-h200.json").write_text(json.dumps(fake_results()))
    found = lc.load_all(tmp_path)
    assert list(found) == ["nvidia-h200"] and found["nvidia-h200"]["device"] == "a made-up GPU"
    assert lc.results_path("nvidia-h200").name == "nvidia-h200.json"


# ---------------------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_probe_of_a_small_preset_extrapolates():
    run = lc.probe("llama-3.2-1b", (2048, 4096), "ours", tiled_mlp=True, offload=True, warmup_len=512,
                   progress=False)
    assert all(p.fits and math.isfinite(p.loss) for p in run.points)
    assert run.points[1].gpu_peak > run.points[0].gpu_peak
    assert run.points[1].host_bytes > run.points[0].host_bytes > 0
    fit = lc.longest_that_fits(run, torch.cuda.mem_get_info()[1], 10**12)
    assert fit.longest > 4096 and fit.host_per_token > 0


def test_the_finetune_command_line_takes_the_memory_switches_and_probe(capsys):
    # `--kernels` names the two memory switches like any kernel; `--probe A,B` measures real steps on a GPU and, on
    # the CPU, says where the counted bytes are instead.
    from kernels.training.finetune import build_parser, main, patch_options

    args = build_parser().parse_args(["--kernels", "rms_norm,tiled_mlp,offload_checkpoints", "--probe", "4096,8192"])
    options = patch_options(args)
    assert options["tiled_mlp"] and options["offload_checkpoints"] and not options["swiglu"]
    assert args.probe == (4096, 8192)
    if runtime.MODE != "gpu":  # refused before any work, with where the counted bytes are
        with pytest.raises(SystemExit) as exit_info:
            main(["--kernels", "rms_norm,tiled_mlp", "--probe", "4096,8192", "--gradient-checkpointing"])
        assert exit_info.value.code == 2 and "memory_table" in capsys.readouterr().err
