"""The benchmark: byte accounting, speed-ups and targets from a results dict, the check-before-timing path (a planted
wrong implementation is never timed), the command line end to end (tiny sizes on the CPU), and on a GPU the CUDA-
graph device times."""

import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from kernels import runtime
from kernels.bench import plots, sweep
from kernels.bench import results as results_module
from kernels.bench.peers import Impl
from kernels.bench.results import format_table, load_results, save_results, speedups, summarize, targets
from kernels.bench.sweep import cross_entropy_bytes, rmsnorm_bytes, run_benchmark
from kernels.bench.timing import floor_ms, measure_copy_gbps, same_bytes_copy_ms

# --------------------------------------------------------------------------------------------------------------------
# Bytes
# --------------------------------------------------------------------------------------------------------------------


def test_rmsnorm_bytes_count_each_tensor_once():
    m, n = 16384, 4096
    assert rmsnorm_bytes(m, n, 2, "fwd") == 2 * m * n * 2  # read x, write y
    assert rmsnorm_bytes(m, n, 2, "fwd+bwd") == 5 * m * n * 2  # + read x, dy, write dx
    assert rmsnorm_bytes(m, n, 4, "fwd+bwd") == 2 * rmsnorm_bytes(m, n, 2, "fwd+bwd")
    # The floor at 16384 × 4096 bf16: 671 MB, ≈ 158 µs at 4,250 GB/s.
    assert rmsnorm_bytes(m, n) == 671_088_640
    assert floor_ms(rmsnorm_bytes(m, n), 4250) == pytest.approx(0.1579, rel=1e-3)
    with pytest.raises(ValueError, match="pass_"):
        rmsnorm_bytes(m, n, 2, "backward")


def test_cross_entropy_bytes_two_read_design_and_single_read_floor():
    t, v = 16384, 128_256
    assert cross_entropy_bytes(t, v, 2, "two_read") == 6 * t * v  # 6 bytes per bf16 logit
    assert cross_entropy_bytes(t, v, 2, "single_read") == 4 * t * v
    assert cross_entropy_bytes(t, v, 4, "two_read") == 12 * t * v
    # 6 bytes per logit at 4,250 GB/s
    assert floor_ms(cross_entropy_bytes(t, v), 4250) == pytest.approx(2.967, rel=1e-3)
    with pytest.raises(ValueError, match="design"):
        cross_entropy_bytes(t, v, 2, "three_read")


# --------------------------------------------------------------------------------------------------------------------
# Speed-ups and targets from a results dict (synthetic numbers, so the arithmetic is checked exactly)
# --------------------------------------------------------------------------------------------------------------------


def _row(impl, role, tokens, eager, device, status="ok", pass_="fwd+bwd", width=4096):
    return {"kernel": "rmsnorm", "impl": impl, "label": impl.upper(), "role": role, "tokens": tokens, "width": width,
            "shape": f"{tokens}×{width}", "pass": pass_, "status": status, "note": "", "eager_ms": eager,
            "device_ms": device, "device_note": None, "gbps": None, "frac_copy": 0.8 if role == "ours" else None,
            "peak_extra_mib": 1.0}


def _synthetic_results():
    rows = [
        # 1024 tokens: ours fastest on the device, but the native op wins in eager mode (host-bound).
        _row("ours", "ours", 1024, eager=0.30, device=0.05),
        _row("native", "peer", 1024, eager=0.12, device=0.06),
        _row("liger", "peer", 1024, eager=0.31, device=0.10),
        _row("compile", "peer", 1024, eager=0.55, device=None),  # graph capture failed: no device time
        # 16384 tokens: liger beats ours on the device; a failed peer must not count.
        _row("ours", "ours", 16384, eager=0.40, device=0.30),
        _row("native", "peer", 16384, eager=0.31, device=0.31),
        _row("liger", "peer", 16384, eager=0.29, device=0.24),
        _row("hf", "peer", 16384, eager=None, device=None, status="check failed"),
        _row("variant", "variant", 16384, eager=0.01, device=0.01),  # a variant is never a peer
    ]
    impls = {k: {"label": k.upper(), "role": r} for k, r in
             [("ours", "ours"), ("native", "peer"), ("liger", "peer"), ("compile", "peer"), ("hf", "peer"),
              ("variant", "variant")]}
    return {"kernel": "rmsnorm", "mode": "gpu", "device": "Test GPU", "date": "2026-01-01", "rows": rows,
            "implementations": impls, "settings": {"passes": ["fwd+bwd"]}, "ceilings": {"copy_gbps": 4000.0}}


def test_speedups_per_peer_and_fastest_peer():
    results = _synthetic_results()
    by_tokens = {e["tokens"]: e for e in speedups(results, "device")}
    small, large = by_tokens[1024], by_tokens[16384]
    assert small["speedup"] == pytest.approx({"native": 0.06 / 0.05, "liger": 0.10 / 0.05})  # compile: no time
    assert small["fastest_peer"] == "native" and small["vs_fastest"] == pytest.approx(1.2)
    assert large["fastest_peer"] == "liger" and large["vs_fastest"] == pytest.approx(0.24 / 0.30)
    assert "hf" not in large["peers"] and "variant" not in large["peers"]
    eager_small = {e["tokens"]: e for e in speedups(results, "eager")}[1024]
    assert eager_small["fastest_peer"] == "native" and eager_small["vs_fastest"] == pytest.approx(0.12 / 0.30)
    with pytest.raises(ValueError, match="basis"):
        speedups(results, "wall")


def test_targets_say_where_ours_beats_the_fastest_peer():
    found = {(t["tokens"], t["basis"]): t for t in targets(_synthetic_results(), min_speedup=1.0)}
    assert found[(1024, "device")]["met"] is True and found[(1024, "device")]["fastest_peer"] == "NATIVE"
    assert found[(16384, "device")]["met"] is False
    assert found[(1024, "eager")]["met"] is False
    assert found[(1024, "device")]["frac_copy"] == 0.8 and found[(1024, "eager")]["frac_copy"] is None
    strict = {(t["tokens"], t["basis"]): t for t in targets(_synthetic_results(), min_speedup=1.5)}
    assert strict[(1024, "device")]["met"] is False


def test_targets_without_ours_or_without_peers_are_undecided():
    results = _synthetic_results()
    results["rows"] = [r for r in results["rows"] if r["impl"] in ("ours", "hf")]
    assert all(t["met"] is None for t in targets(results))


def test_summary_and_table_name_the_failed_row():
    results = _synthetic_results()
    text = summarize(results)
    assert "at 1 of 2 shapes" in text and "CHECK FAILED: HF" in text
    table = format_table(results)
    assert "check failed" in table and "1.2" in table  # native at 1024: 0.06 / 0.05


def test_a_copy_of_the_same_bytes_is_the_yardstick_at_each_size():
    # add_rates: the copy's time over the row's; the summary quotes it at the smallest shape, the table per row
    results = _synthetic_results()
    for row in results["rows"]:
        row.update(bytes=8_000_000, bytes_floor=8_000_000, copy_same_bytes_ms=0.04 if row["tokens"] == 1024 else 0.2)
    sweep.add_rates(results["rows"], results["ceilings"])
    ours = {r["tokens"]: r for r in results["rows"] if r["impl"] == "ours"}
    assert ours[1024]["frac_same_bytes_copy"] == pytest.approx(0.04 / 0.05)
    assert ours[16384]["frac_same_bytes_copy"] == pytest.approx(0.2 / 0.30)
    assert ours[1024]["gbps"] == pytest.approx(8_000_000 / 0.05e-3 / 1e9)
    failed = next(r for r in results["rows"] if r["status"] == "check failed")
    assert failed.get("frac_same_bytes_copy") is None  # no device time, no fraction
    found = {(t["tokens"], t["basis"]): t for t in targets(results)}
    assert found[(1024, "device")]["frac_same_bytes_copy"] == pytest.approx(0.8)
    assert found[(1024, "eager")]["frac_same_bytes_copy"] is None
    assert "at 1024×4096, 80% of a copy of the same bytes" in summarize(results)
    assert " 80.0 " in format_table(results).splitlines()[2]  # ours at 1,024 tokens, the first row
    # the bandwidth plot draws that yardstick per size: ours' bytes over the copy's time
    results["settings"].update(width=4096, tokens=[1024, 16384])
    ax = plots.plot_bandwidth(results)
    line = next(ln for ln in ax.get_lines() if ln.get_label() == "a copy of the same bytes")
    assert list(line.get_ydata()) == pytest.approx([8_000_000 / 0.04e-3 / 1e9, 8_000_000 / 0.2e-3 / 1e9])


def test_the_same_bytes_copy_needs_a_gpu():
    if runtime.MODE == "gpu":
        pytest.skip("the GPU test below measures it")
    assert same_bytes_copy_ms(1 << 20) is None


@pytest.mark.gpu
def test_gpu_a_large_same_bytes_copy_runs_at_the_copy_bandwidth():
    # At 1 GiB the size no longer matters: the copy's time matches the copy ceiling; a few megabytes take longer
    # than their bytes at that bandwidth.
    n_bytes, small = 1 << 30, 8 << 20
    copy_gbps = measure_copy_gbps(n_bytes // 2)
    assert same_bytes_copy_ms(n_bytes) == pytest.approx(floor_ms(n_bytes, copy_gbps), rel=0.1)
    assert same_bytes_copy_ms(small) > floor_ms(small, copy_gbps)


# --------------------------------------------------------------------------------------------------------------------
# Check before timing: a wrong implementation is recorded, never timed
# --------------------------------------------------------------------------------------------------------------------


def _wrong_rmsnorm_forward(case):
    weight = torch.nn.Parameter(case.weight.detach().clone())

    def fn(x):  # forgets the rsqrt: y = x * w
        return x * weight

    return fn, [weight]


def _wrong_rmsnorm_backward(case):
    weight = torch.nn.Parameter(case.weight.detach().clone())

    class HalfGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y):
            return y.clone()

        @staticmethod
        def backward(ctx, dy):
            return dy * 0.5

    def fn(x):  # right forward, gradients scaled by 1/2
        return HalfGrad.apply(F.rms_norm(x, (x.shape[-1],), weight, case.eps))

    return fn, [weight]


def _raising(case):
    def fn(x):
        raise RuntimeError("boom")

    return fn, []


def test_wrong_implementations_are_marked_and_not_timed(device):
    impls = ["ours", Impl("wrong-fwd", "planted: no rsqrt", "peer", _wrong_rmsnorm_forward),
             Impl("wrong-bwd", "planted: half gradient", "peer", _wrong_rmsnorm_backward),
             Impl("raises", "planted: raises", "peer", _raising)]
    results = run_benchmark("rmsnorm", [6], 40, impls=impls, progress=False, rep=1)
    rows = {(r["impl"], r["pass"]): r for r in results["rows"]}
    for key in [("wrong-fwd", "fwd"), ("wrong-fwd", "fwd+bwd"), ("wrong-bwd", "fwd+bwd")]:
        row = rows[key]
        assert row["status"] == "check failed" and row["check"]["ok"] is False, key
        assert row["eager_ms"] is None and row["device_ms"] is None and "not timed" in row["note"]
    assert rows[("wrong-bwd", "fwd+bwd")]["check"]["errors"]["dx"] > 0.3  # half the gradient: 50% error
    assert rows[("wrong-bwd", "fwd+bwd")]["check"]["errors"]["y"] < 1.5e-2
    assert rows[("wrong-bwd", "fwd")]["status"] == "ok" and rows[("wrong-bwd", "fwd")]["eager_ms"] > 0
    assert rows[("raises", "fwd")]["status"] == "error" and "boom" in rows[("raises", "fwd")]["note"]
    for p in ("fwd", "fwd+bwd"):
        ours = rows[("ours", p)]
        assert ours["status"] == "ok" and ours["check"]["ok"] and ours["eager_ms"] > 0
        assert all(0 <= e < 1.5e-2 for e in ours["check"]["errors"].values())
    assert "CHECK FAILED" in summarize(results)


def _wrong_ce_gradient(case):
    class NoGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits, target):
            return F.cross_entropy(logits.float(), target)

        @staticmethod
        def backward(ctx, g):
            return None, None  # no gradient at all

    return (lambda logits, target: NoGrad.apply(logits, target)), []


def test_cross_entropy_wrong_gradient_is_caught(device):
    impls = ["ours", "fp32", Impl("nograd", "planted: no gradient", "peer", _wrong_ce_gradient)]
    results = run_benchmark("cross_entropy", [20], 300, impls=impls, progress=False, rep=1)
    rows = {r["impl"]: r for r in results["rows"]}
    assert rows["nograd"]["status"] == "check failed" and rows["nograd"]["eager_ms"] is None
    assert rows["nograd"]["check"]["errors"]["loss"] < 1e-5  # the loss is right; only the gradient is missing
    assert rows["nograd"]["check"]["errors"]["grad (sampled rows)"] is None  # inf: no gradient
    for key in ("ours", "fp32"):
        assert rows[key]["status"] == "ok" and rows[key]["check"]["ok"] and rows[key]["eager_ms"] > 0


def test_cross_entropy_case_reference_includes_an_ignored_row(device):
    case = sweep.CrossEntropyCase(10, 50, seed=3)
    ref = case.reference()
    assert int(ref["rows"][0]) == 3 and case.target[3] == case.IGNORE_INDEX
    assert torch.all(ref["grad_rows"][0] == 0)
    x64 = case.logits.detach().double()
    expected = F.cross_entropy(x64, case.target, ignore_index=case.IGNORE_INDEX)
    assert ref["loss"].item() == pytest.approx(expected.item(), rel=1e-12)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="kernel"):
        run_benchmark("layernorm", [4], 8, progress=False)
    with pytest.raises(ValueError, match="unknown implementation"):
        run_benchmark("rmsnorm", [4], 8, impls=["nope"], progress=False)
    with pytest.raises(ValueError, match="passes"):
        run_benchmark("cross_entropy", [4], 8, passes=["fwd"], progress=False)
    with pytest.raises(ValueError, match="positive"):
        sweep.sweep_shapes([0], 8)


# --------------------------------------------------------------------------------------------------------------------
# The command line, end to end, and the results files
# --------------------------------------------------------------------------------------------------------------------

ROW_KEYS = {"kernel", "impl", "label", "role", "tokens", "width", "shape", "pass", "dtype", "status", "note",
            "eager_ms", "device_ms", "device_note", "eager_ms_rounds", "device_ms_rounds", "bytes", "bytes_floor",
            "gbps", "frac_copy", "gbps_floor", "frac_copy_floor", "copy_same_bytes_ms", "frac_same_bytes_copy",
            "peak_extra_mib", "check"}


@pytest.mark.skipif(runtime.MODE == "gpu", reason="the CPU run of the command line; the GPU test below covers GPUs")
def test_command_line_writes_json_and_png(tmp_path, capsys):
    argv = ["--kernel", "all", "--tokens", "5,12", "--hidden", "48", "--hidden-sweep", "24,48",
            "--hidden-sweep-tokens", "12", "--vocab", "300", "--out", str(tmp_path), "--no-progress"]
    assert sweep.main(argv) == 0
    printed = capsys.readouterr().out
    assert "mode=interpreter" in printed and "wall ms*" in printed

    rms = json.loads((tmp_path / "rmsnorm" / "cpu-interpreter.json").read_text())
    ce = json.loads((tmp_path / "cross_entropy" / "cpu-interpreter.json").read_text())
    assert (tmp_path / "rmsnorm" / "cpu-interpreter.png").stat().st_size > 10_000
    assert (tmp_path / "cross_entropy" / "cpu-interpreter.png").stat().st_size > 10_000
    for results, n_shapes, n_impls, n_passes in ((rms, 3, 5, 2), (ce, 2, 6, 1)):
        assert results["schema"] == results_module.SCHEMA_VERSION and results["mode"] == "interpreter"
        expected_keys = {"device", "date", "versions", "git_commit", "ceilings", "settings", "time_basis", "rows"}
        assert expected_keys <= set(results)
        assert results["ceilings"] is None and "meaningless" in results["time_basis"]["eager_ms"]
        assert len(results["rows"]) == n_shapes * n_impls * n_passes  # 5×48 and 12×48 run once for both sweeps
        for row in results["rows"]:
            assert set(row) == ROW_KEYS
            if row["impl"] in ("compile", "liger"):
                assert row["status"] == "skipped" and row["note"]
                continue
            assert row["status"] == "ok", row
            assert row["check"]["ok"] and all(e < 1.5e-2 for e in row["check"]["errors"].values())
            assert row["eager_ms"] > 0 and row["device_ms"] is None and "interpreter" in row["device_note"]
    assert {r["shape"] for r in rms["rows"]} == {"5×48", "12×48", "12×24"}
    assert rms["implementations"]["compile"]["skipped"]


def test_module_entry_point_help():
    out = subprocess.run([sys.executable, "-m", "kernels.bench.sweep", "--help"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    for flag in ("--kernel", "--tokens", "--hidden", "--vocab", "--out", "--quick"):
        assert flag in out


def test_load_results_picks_the_newest_gpu_run(tmp_path):
    base = {"kernel": "rmsnorm", "rows": []}
    save_results(dict(base, mode="gpu", device_slug="nvidia-h100", date="2026-01-01T00:00:00"), tmp_path)
    save_results(dict(base, mode="gpu", device_slug="nvidia-h200", date="2026-02-01T00:00:00"), tmp_path)
    save_results(dict(base, mode="interpreter", device_slug="cpu-interpreter", date="2026-03-01T00:00:00"), tmp_path)
    assert load_results("rmsnorm", tmp_path)["device_slug"] == "nvidia-h200"
    assert load_results("rmsnorm", tmp_path, include_interpreter=True)["device_slug"] == "cpu-interpreter"
    assert load_results("cross_entropy", tmp_path) is None


def test_plots_draw_gpu_like_and_interpreter_results():
    import matplotlib

    matplotlib.use("Agg")

    results = _synthetic_results()
    results["settings"] = {"passes": ["fwd+bwd"], "width": 4096, "tokens": [1024, 16384], "width_sweep": [],
                           "width_sweep_tokens": None}
    for row in results["rows"]:
        row["gbps"] = 1000.0 if row["device_ms"] else None
    fig = plots.summary_figure(results)
    assert len(fig.axes) == 4
    ax = plots.plot_speedups(results, "fwd+bwd", "tokens", "device")
    assert len(ax.patches) == 4  # native and liger at both sizes (compile has no device time at all)
    results["mode"] = "interpreter"
    for row in results["rows"]:
        row["device_ms"] = row["gbps"] = None
    assert len(plots.summary_figure(results).axes) == 4  # says "nothing to show" instead of failing


# --------------------------------------------------------------------------------------------------------------------
# GPU: device times from CUDA graphs, memory, every peer
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_rmsnorm_device_times():
    results = run_benchmark("rmsnorm", [2048], 4096, impls=["ours", "hf", "native", "compile", "liger"],
                            passes=["fwd"], progress=False, rep=20)
    rows = {r["impl"]: r for r in results["rows"]}
    assert results["ceilings"]["copy_gbps"] > 100
    for key in ("ours", "hf", "native", "compile", "liger"):
        row = rows[key]
        if row["status"] == "skipped":
            continue
        assert row["status"] == "ok" and row["device_ms"] > 0 and row["eager_ms"] > 0, row
        assert row["gbps"] > 0 and 0 < row["frac_copy"] < 1.2 and row["peak_extra_mib"] >= 0
        assert row["copy_same_bytes_ms"] > 0 and 0 < row["frac_same_bytes_copy"] < 1.3


_PLANTED_SYNC = textwrap.dedent(
    """
    import json
    import torch.nn.functional as F
    from kernels.bench.peers import Impl
    from kernels.bench.sweep import run_benchmark

    def syncs_the_host(case):
        def fn(x):
            scale = float(x.float().abs().max().item())  # a host synchronisation: CUDA graphs cannot capture it
            return F.rms_norm(x, (x.shape[-1],), None, case.eps) * case.weight * (scale / scale)
        return fn, []

    impls = ["ours", Impl("sync", "planted: .item()", "peer", syncs_the_host)]
    results = run_benchmark("rmsnorm", [2048], 4096, impls=impls, passes=["fwd"], progress=False, rep=20)
    print(json.dumps([r for r in results["rows"] if r["impl"] == "sync"][0]))
    """
)


@pytest.mark.gpu
def test_gpu_capture_failure_is_recorded_not_raised():
    # In its own process: a capture that fails part-way can leave CUDA's random-number generator unusable for the
    # rest of the process, which would fail every later GPU test for a reason that is not theirs.
    done = subprocess.run([sys.executable, "-c", _PLANTED_SYNC], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    row = json.loads(done.stdout.strip().splitlines()[-1])
    assert row["status"] == "ok" and row["device_ms"] is None and row["eager_ms"] > 0
    assert "capture failed" in row["device_note"]


@pytest.mark.gpu
def test_gpu_cross_entropy_memory_in_place_vs_upcast():
    results = run_benchmark("cross_entropy", [1024], 128_256, impls=["ours", "ours-buffer", "fp32"], progress=False,
                            rep=20)
    rows = {r["impl"]: r for r in results["rows"]}
    for row in rows.values():
        assert row["status"] == "ok" and row["device_ms"] is not None, row
    logits_mib = 1024 * 128_256 * 2 / 2**20
    assert rows["ours"]["peak_extra_mib"] < 0.05 * logits_mib  # the gradient lives in the logits
    assert rows["ours-buffer"]["peak_extra_mib"] == pytest.approx(logits_mib, rel=0.1)  # one bf16 gradient
    assert rows["fp32"]["peak_extra_mib"] > 3 * logits_mib  # fp32 copy, fp32 softmax, fp32 and bf16 gradients
    assert math.isfinite(rows["ours"]["gbps"])


# --------------------------------------------------------------------------------------------------------------------
# Crossovers and memory budgets (chapter 07)
# --------------------------------------------------------------------------------------------------------------------


def _ce_results(points):
    """Synthetic cross-entropy results: points are (impl, role, tokens, device_ms, peak_mib)."""
    rows = []
    for impl, role, tokens, ms, peak in points:
        row = _row(impl, role, tokens, eager=ms, device=ms, width=1000)
        row.update(kernel="cross_entropy", dtype="bfloat16", peak_extra_mib=peak)
        rows.append(row)
    return {"kernel": "cross_entropy", "mode": "gpu", "rows": rows, "settings": {"width": 1000},
            "implementations": {}}


def test_crossovers_need_ours_faster_at_every_larger_size():
    results = _ce_results([
        ("ours", "ours", 256, 1.0, 0), ("ours", "ours", 1024, 2.0, 0), ("ours", "ours", 4096, 4.0, 0),
        ("a", "peer", 256, 0.5, 0), ("a", "peer", 1024, 2.5, 0), ("a", "peer", 4096, 5.0, 0),  # from 1024 on
        ("b", "peer", 256, 2.0, 0), ("b", "peer", 1024, 1.0, 0), ("b", "peer", 4096, 8.0, 0),  # dips at 1024
        ("c", "peer", 256, 0.1, 0), ("c", "peer", 1024, 0.1, 0), ("c", "peer", 4096, 0.1, 0),  # never
    ])
    assert results_module.crossovers(results, "device") == {"a": 1024, "b": 4096, "c": None}


def test_tokens_that_fit_count_the_logits_and_the_measured_extra():
    mib = 2**20
    results = _ce_results([
        ("ours", "ours", 1024, 1.0, 0.25), ("ours", "ours", 4096, 1.0, 1.0),  # the largest measurement is used
        ("fp32", "peer", 4096, 1.0, 4096 * 1000 * 12 / mib),  # 12 extra bytes per logit
    ])
    fit = results_module.tokens_that_fit(results, budget_bytes=1e9)
    assert fit["ours"]["measured_at_tokens"] == 4096
    assert fit["ours"]["bytes_per_token"] == pytest.approx(2000 + mib / 4096)
    assert fit["fp32"]["bytes_per_token"] == pytest.approx(2000 + 12_000)
    assert fit["fp32"]["tokens"] == int(1e9 // 14_000)
    assert fit["ours"]["tokens"] > 6 * fit["fp32"]["tokens"]
