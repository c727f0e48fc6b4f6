"""The scaling benchmark runs end to end (1 and 2 gloo processes on the CPU, tiny sizes), and the arithmetic on
paper for larger runs is right."""

import json

import matplotlib
import pytest
import torch

from kernels import runtime
from kernels.bench.results import find_run
from kernels.distributed.scaling import (
    INFINIBAND_PORT_GB_S,
    NVLINK_GB_S,
    SINGLE_GPU_SETTINGS,
    bytes_sent_per_step,
    fsdp_budget,
    gathered_once_count,
    link_bandwidth,
    main,
    plot_scaling,
    root_parameter_count,
    state_bytes_per_param,
)
from kernels.training.models import count_parameters, llama_config

matplotlib.use("Agg")


@pytest.mark.skipif(runtime.MODE == "gpu" and torch.cuda.device_count() < 2,
                    reason="two processes in GPU mode need two GPUs (one per process)")
def test_scaling_command_runs_one_and_two_processes(tmp_path, capsys):
    """``python -m kernels.distributed.scaling`` on the CPU: torchrun with 1 and 2 gloo processes, baseline and patched,
    each through ``python -m kernels.distributed.finetune``; JSON and plot written. At the same per-GPU batch the 1- and
    2-process runs see different global batches, so their losses are not compared here
    (tests/distributed/test_distributed.py does that at the same global batch); baseline and patched are, at each
    size."""
    assert main(["--preset", "tiny", "--gpus", "1,2", "--seq-lens", "48", "--steps", "2", "--out", str(tmp_path),
                 "--timeout", "240"]) == 0
    data = json.loads((tmp_path / "scaling" / "tiny.json").read_text())
    assert (tmp_path / "scaling" / "tiny.png").exists()
    runs = data["runs"]
    assert [(r["gpus"], r["variant"]) for r in runs] == [(1, "baseline"), (1, "patched"), (2, "baseline"),
                                                         (2, "patched")]
    assert all(r["fits"] for r in runs), [r.get("error") for r in runs]
    backend = "nccl" if runtime.MODE == "gpu" else "gloo"
    assert all(r["backend"] == backend and r["tokens_per_s_per_gpu"] > 0 for r in runs)
    assert data["longest_fitting"] == {"baseline": {"1": 48, "2": 48}, "patched": {"1": 48, "2": 48}}
    for n in (1, 2):
        base, ours = (next(r for r in runs if r["gpus"] == n and r["variant"] == v) for v in ("baseline", "patched"))
        # bf16, two implementations of the same model that round differently: the bound
        # tests/training/test_train.py uses.
        assert all(abs(a - b) < 0.05 for a, b in zip(base["losses"], ours["losses"])), (base["losses"], ours["losses"])
    axes = plot_scaling(data)
    assert axes[0].lines


def test_state_bytes_are_what_the_loop_keeps():
    assert state_bytes_per_param("bfloat16") == 8  # parameter, gradient, two AdamW moments, all bf16
    assert state_bytes_per_param("float32") == 16


def test_ring_traffic_per_gpu():
    # 2 GPUs: each sends half of each collective's bytes; 1 GPU sends nothing.
    assert bytes_sent_per_step(100, 0, 1) == 0
    assert bytes_sent_per_step(100, 0, 2) == 0.5 * (2 * 2 * 100 + 4 * 100)
    assert bytes_sent_per_step(100, 100, 2) == 0.5 * (2 * 100 + 4 * 100)  # all kept gathered: once each


def test_link_bandwidth_inside_and_across_nodes():
    assert link_bandwidth(8) == ("nvlink", NVLINK_GB_S)
    assert link_bandwidth(16)[1] == 8 * INFINIBAND_PORT_GB_S
    assert link_bandwidth(16, nics_per_node=1)[1] == INFINIBAND_PORT_GB_S


def test_fsdp_budget_of_the_8b_shape():
    config = llama_config("llama-3.1-8b")
    params = count_parameters(config)
    assert root_parameter_count(config) == 2 * 128256 * 4096 + 4096
    per_layer = 4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096  # q, o; k, v; MLP; two norms
    assert gathered_once_count(config) == root_parameter_count(config) + per_layer
    one, eight = fsdp_budget(1), fsdp_budget(8)
    assert one.sent_bytes_per_gpu == 0 and one.comm_s == 0
    # One GPU: the state plus the rest is the committed run's measured peak.
    single = find_run("finetune", **SINGLE_GPU_SETTINGS)
    assert one.memory_bytes_per_gpu == pytest.approx(max(single["summary"]["peak_memory_bytes"].values()))
    assert eight.state_bytes_per_gpu == pytest.approx(8 * params / 8)
    assert eight.speedup == pytest.approx(single["summary"]["speedup"])  # comm hidden: the kernels' gain stays
    slow = fsdp_budget(16, nics_per_node=1)
    assert slow.comm_s > slow.compute_s["baseline"] and slow.speedup == pytest.approx(1.0)  # comm-bound: gone
    with pytest.raises(ValueError, match="gpus"):
        fsdp_budget(0)


def _row(gpus, variant, seq_len, fits, tps=1000.0, peak=None):
    row = {"gpus": gpus, "variant": variant, "seq_len": seq_len, "fits": fits}
    if fits:
        row.update(tokens_per_s_per_gpu=tps, peak_memory_bytes_max_rank=peak)
    return row


def test_longest_fitting_and_the_memory_panel_of_a_gpu_grid():
    """A grid as a GPU run leaves it (peaks per GPU, a length that did not fit): the longest length that ran per
    variant and GPU count, and both panels drawn, the unfit point left out."""
    from kernels.distributed.scaling import longest_fitting

    rows = [_row(1, "baseline", 2048, True, 6500, 75 * 2**30), _row(1, "baseline", 4096, False),
            _row(2, "baseline", 2048, True, 6400, 45 * 2**30), _row(2, "baseline", 4096, True, 6600, 60 * 2**30),
            _row(1, "patched", 2048, True, 7100, 75 * 2**30), _row(2, "patched", 2048, True, 7000, 45 * 2**30)]
    assert longest_fitting(rows) == {"baseline": {"1": 2048, "2": 4096}, "patched": {"1": 2048, "2": 2048}}
    results = {"device": "GPU", "settings": {"preset": "llama-3.1-8b", "variants": ["baseline", "patched"]},
               "runs": rows}
    left, right = plot_scaling(results)
    assert len(left.lines) == 4 and len(right.lines) == 4
    baseline_one_gpu = left.lines[0]
    assert list(baseline_one_gpu.get_xdata()) == [2048]  # the 4,096 run did not fit and is not drawn
