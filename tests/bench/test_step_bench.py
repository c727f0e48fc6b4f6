"""The whole-step benchmark on the CPU at the tiny preset: its results file, every field, the same
losses for every setup, the limit's arithmetic against a hand count, the kernel categories, and its
command line's checks (timings here mean nothing)."""

import json
import subprocess

import pytest
import torch

from kernels import runtime
from kernels.bench import step as bench
from kernels.bench.cli import REPO
from kernels.hf.patch import SWITCHES
from kernels.hf.presets import llama_config
from kernels.tolerances import RELATIVE_ERROR_TOL

# The add-norm comparison exists once patch_llama has the switch.
SETUPS = ("hf", "ours", "ours_in_backward", "ours_in_backward_inline") + (
    ("ours_in_backward_no_add_norm",) if "add_rms_norm" in SWITCHES else ())
ROW_FIELDS = {"label", "optimizer", "tokens_per_s", "step_ms", "host_ms", "device_ms", "peak_gib", "losses",
              "steps", "profile"}


@pytest.fixture(scope="module")
def result():
    # One timed step and the profiled one per setup (two steps), 8 tokens: the interpreter's cost stays small.
    return bench.run("tiny", batch=1, seq=8, grad_accum=1, warmup=0, steps=1, setups=SETUPS,
                     log=lambda *a, **k: None)


def test_every_field_and_the_same_losses(result):
    assert {"group", "device", "mode", "versions", "settings", "ceilings", "flop", "limit_tokens_per_s",
            "rows", "skipped", "loss_check", "projection_parameters"} <= set(result)
    assert {"torch", "triton", "transformers"} <= set(result["versions"])
    assert set(result["rows"]) == set(SETUPS)
    for name, row in result["rows"].items():
        assert ROW_FIELDS <= set(row), name
        assert row["tokens_per_s"] > 0 and row["host_ms"] > 0
        assert len(row["losses"]) == 2 and all(loss == loss for loss in row["losses"])  # no NaN
        assert set(row["profile"]["kernel_ms"]) == set(bench.CATEGORIES)
        assert row["profile"]["kernel_ms"]["gemm"] > 0  # the interpreter's matmuls are aten::mm
    # The weights change between steps (AdamW at 1e-5 on float32 weights), so a stuck optimizer would
    # repeat the first loss; every setup takes the same steps.
    hf = result["rows"]["hf"]["losses"]
    assert hf[0] != hf[-1]
    check = result["loss_check"]
    assert set(check["max_rel_diff"]) == set(SETUPS) - {"hf"}
    # float32 in the interpreter, bf16 on a GPU: the bound of the run's dtype.
    assert check["tolerance"] == RELATIVE_ERROR_TOL[getattr(torch, result["settings"]["dtype"])] and check["ok"], check


def test_the_in_backward_setups_differ_only_in_the_stream():
    side = bench.make_optimizer("in_backward", torch.nn.Linear(2, 2), 1e-3)
    inline = bench.make_optimizer("in_backward_inline", torch.nn.Linear(2, 2), 1e-3)
    assert side.side_stream and not inline.side_stream
    side.remove(), inline.remove()
    assert bench.why_not(bench.BY_NAME["ours_in_backward_inline"]) is None
    with pytest.raises(ValueError, match="kind must be one of"):
        bench.make_optimizer("sgd", torch.nn.Linear(2, 2), 1e-3)


def test_losses_that_differ_fail_the_check():
    rows = {"hf": {"losses": [2.0, 1.5]}, "ours": {"losses": [2.0, 1.6]}}
    check = bench.loss_check(rows, torch.bfloat16)
    assert check["max_rel_diff"]["ours"] == pytest.approx(0.1 / 1.5)
    assert not check["ok"]


def test_the_limit_against_a_hand_count():
    config = llama_config("tiny")  # h 128, 4 layers, q 4×32, kv 2×32, MLP 344, vocab 2,048
    per_layer = 128 * 128 + 2 * 128 * 64 + 128 * 128 + 3 * 128 * 344
    assert bench.projection_parameters(config) == 4 * per_layer + 2048 * 128 == 987_136
    flop = bench.step_flop(config, batch=2, seq=10)
    assert flop["projections"] == 6 * 987_136 * 20
    assert flop["attention"] == 6 * 4 * 128 * 10 * 11 * 2  # 4 layers, d_q 128, 10·11 causal pairs ×2 / 2, 2 rows
    assert flop["per_token"] == pytest.approx(flop["total"] / 20)
    assert bench.limit_tokens_per_s(config, 2, 10, 500.0) == pytest.approx(500e12 / flop["per_token"])
    with pytest.raises(ValueError, match="matmul_tflops"):
        bench.limit_tokens_per_s(config, 2, 10, 0.0)


def test_the_8b_step_is_about_96_tflop_per_2048_tokens():
    flop = bench.step_flop(llama_config("llama-3.1-8b"), batch=1, seq=2048)
    assert 95e12 < flop["total"] < 96e12
    assert bench.limit_tokens_per_s(llama_config("llama-3.1-8b"), 1, 2048, 741.0) == pytest.approx(15_890, rel=1e-3)


@pytest.mark.parametrize("name, category", [
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
    ("_adamw_kernel", "optimizer"),
    ("kernels::adamw_step_", "optimizer"),
    ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "attention"),
    ("_bwd_dkdv_kernel", "attention"),
    ("nvjet_tst_192x192_64x4_2x1_v_bz_coopA_TNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm>", "gemm"),
    ("aten::mm", "gemm"),
    ("_rms_norm_fwd_kernel", "rest"),
    ("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<c10::BFloat16>>", "rest"),
])
def test_kernel_categories(name, category):
    assert bench.classify_kernel(name) == category


def test_overlapping_kernels_are_busy_once():
    assert bench._merged_length([(0, 10), (5, 12), (20, 25)]) == 17
    assert bench._merged_length([]) == 0


def test_results_file_reads_back_and_plots(result, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result))
    loaded = bench.load_step_results(path)
    ax = bench.plot_step_breakdown(loaded)
    assert len(ax.patches) == len(SETUPS) * len(bench.CATEGORIES)
    assert "tokens/s" in str(bench.format_table(loaded))
    path.write_text(json.dumps({"group": "lora"}))
    with pytest.raises(ValueError, match="not a step benchmark"):
        bench.load_step_results(path)


def test_the_command_line_writes_its_file_and_refuses_to_replace_it(tmp_path, capsys):
    args = ["--preset", "tiny", "--setups", "hf", "--seq", "8", "--steps", "1", "--warmup", "0", "--out", str(tmp_path)]
    assert bench.main(args) == 0
    path = tmp_path / "step" / "tiny_b1_s8_ga1.json"
    saved = json.loads(path.read_text())
    assert saved["rows"]["hf"]["losses"] and saved["settings"]["grad_accum"] == 1
    assert "ours_in_backward" not in saved["rows"]
    before = path.read_text()
    with pytest.raises(SystemExit) as exc:
        bench.main(args)
    assert exc.value.code == 2 and "--force" in capsys.readouterr().err
    assert path.read_text() == before


def test_grad_accum_gives_the_losses_of_each_step():
    result = bench.run("tiny", batch=1, seq=8, grad_accum=2, warmup=0, steps=1, setups=("hf",),
                       log=lambda *a, **k: None)
    assert len(result["rows"]["hf"]["losses"]) == 2  # one timed step, the profiled one


def test_recorded_files_are_tracked_and_never_replaced_by_accident():
    # The committed results are replaced only with --record and --force: a plain run writes runs/.
    tracked = subprocess.run(["git", "ls-files", "assets/results/step"], cwd=REPO, capture_output=True,
                             text=True).stdout.split()
    for name in tracked:
        stem = name.rsplit("/", 1)[-1].removesuffix(".json")
        with pytest.raises(SystemExit) as exc:
            bench.main(["--record", "--name", stem, "--setups", "hf"])
        assert exc.value.code == 2


@pytest.mark.parametrize("argv, message", [
    (["--grad-accum", "0"], "--grad-accum"),
    (["--setups", "hf,nope"], "unknown 'nope'"),
    (["--preset", "llama-3.1-8b"], "needs a CUDA GPU"),
    (["--name", "a/b"], "--name"),
    (["--record"], "--record"),
])
def test_argument_mistakes_exit_2_with_a_message(argv, message, capsys, tmp_path):
    if runtime.MODE == "gpu" and message in ("needs a CUDA GPU", "--record"):
        pytest.skip("a GPU accepts these")
    with pytest.raises(SystemExit) as exc:
        bench.main(argv + (["--out", str(tmp_path)] if "--record" not in argv else []))
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_failing_setup_is_its_row_and_the_exit_status(tmp_path, monkeypatch, capsys):
    def refuse(kind, model, lr):
        raise RuntimeError("no optimizer today")

    monkeypatch.setattr(bench, "make_optimizer", refuse)
    argv = ["--preset", "tiny", "--setups", "ours", "--seq", "8", "--steps", "1", "--out", str(tmp_path)]
    assert bench.main(argv) == 1
    saved = json.loads((tmp_path / "step" / "tiny_b1_s8_ga1.json").read_text())
    assert saved["rows"]["ours"]["error"] == "RuntimeError: no optimizer today"
    assert "failed: ours" in capsys.readouterr().err


@pytest.mark.gpu
def test_on_a_gpu_every_part_of_the_step_is_timed_and_sorted():
    # The tiny preset in bf16 on the GPU: CUDA events, kernels in every category, the limit from the ceiling.
    result = bench.run("tiny", batch=2, seq=256, grad_accum=2, warmup=1, steps=2, setups=SETUPS,
                       log=lambda *a, **k: None)
    assert result["ceilings"]["matmul_tflops"] > 0 and result["limit_tokens_per_s"] > 0
    for name, row in result["rows"].items():
        assert "error" not in row, row
        assert 0 < row["device_ms"] and 0 < row["host_ms"] and row["peak_gib"] > 0, name
        assert 0 < row["fraction_of_limit"] < 1, name
        profile = row["profile"]
        assert all(profile["kernel_ms"][c] > 0 for c in ("gemm", "optimizer", "attention", "rest")), (name, profile)
        assert profile["busy_ms"] <= profile["sum_ms"] + 1e-6 and profile["busy_ms"] <= profile["span_ms"] + 1e-6
    assert result["loss_check"]["ok"], result["loss_check"]


@pytest.mark.parametrize("kwargs, message", [
    ({"batch": 0}, "batch must be a positive int"),
    ({"seq": 2.5}, "seq must be a positive int"),
    ({"grad_accum": True}, "grad_accum must be a positive int"),
    ({"warmup": -1}, "warmup must be an int >= 0"),
    ({"setups": ("hf", "nope")}, "setups must be names"),
    ({"setups": "hf"}, "setups must be names"),
    ({"setups": ()}, "setups must be names"),
    ({"preset": "llama-9"}, "preset must be one of"),
])
def test_run_refuses_bad_arguments_before_any_work(kwargs, message):
    args = dict(preset="tiny", batch=1, seq=8, grad_accum=1, warmup=0, steps=1, setups=("hf",)) | kwargs
    with pytest.raises(ValueError, match=message):
        bench.run(**args, log=lambda *a, **k: None)
