"""The collective profile of a sharded step (kernels.distributed.comm_profile) on traces whose answer is known, and
the scaling benchmark's efficiency and paper shapes (kernels.distributed.scaling)."""

import pytest

from kernels.distributed.comm_profile import (
    StepProfiler,
    merge,
    merged_spans,
    overlap,
    sent_bytes,
    summarize_trace,
    timeline_excerpt,
)
from kernels.distributed.scaling import (
    bytes_sent_per_step,
    fsdp_budget,
    gathered_once_count,
    predicted_sent_bytes,
    scaling_efficiency,
    shape_config,
)
from kernels.training.models import count_parameters, llama_config


def kernel(name, ts, dur):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def c10d(name, dims, types):
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": 0, "dur": 1,
            "args": {"Input Dims": dims, "Input type": types}}


def test_unions_and_their_overlap():
    assert merge([(5, 7), (0, 2), (1, 3), (7, 8)]) == [(0, 3), (5, 8)]
    assert overlap([(0, 3), (5, 8)], [(2, 6)]) == pytest.approx(2.0)
    assert overlap([(0, 1)], [(2, 3)]) == 0.0


def test_exposed_collective_time_is_the_part_no_compute_kernel_covers():
    # One step of 100 µs: compute on two streams [0, 40) ∪ [30, 60), a collective [50, 90): 10 µs under compute,
    # 30 µs exposed; nothing runs in [90, 100).
    trace = {"traceEvents": [kernel("gemm", 0, 40), kernel("rmsnorm", 30, 30),
                             kernel("ncclDevKernel_AllGather_RING_LL(...)", 50, 40), kernel("add", 99, 1)]}
    s = summarize_trace(trace, steps=1, world_size=2)
    assert s.step_ms == pytest.approx(0.100)
    assert s.compute_ms == pytest.approx(0.061)
    assert s.comm_ms == pytest.approx(0.040)
    assert s.exposed_comm_ms == pytest.approx(0.030)
    assert s.idle_ms == pytest.approx(0.100 - 0.061 - 0.030)  # [60, 90) is the collective alone, [90, 99) idle
    assert s.top_comm_kernels[0][0] == "ncclDevKernel_AllGather_RING_LL"


def test_bytes_sent_by_a_ring_for_each_collective():
    # all-gather: the output (2,000 bf16) is gathered; reduce-scatter: the input (2,000 float32) is reduced;
    # all-reduce: twice the buffer. Each rank sends (N − 1)/N of that.
    assert sent_bytes("c10d::_allgather_base_", {"Input Dims": [[2000], [1000]], "Input type": ["c10::BFloat16",
                                                                                               "c10::BFloat16"]},
                      2) == ("all_gather", 2000.0)
    assert sent_bytes("c10d::_reduce_scatter_base_", {"Input Dims": [[1000], [2000]], "Input type": ["float",
                                                                                                    "float"]},
                      4) == ("reduce_scatter", 0.75 * 2000 * 4)
    assert sent_bytes("c10d::allreduce_", {"Input Dims": [[[10]]], "Input type": ["TensorList"]}, 2) == \
        ("all_reduce", 2 * 0.5 * 10 * 4)
    assert sent_bytes("aten::mm", {}, 2) is None
    trace = {"traceEvents": [c10d("c10d::_allgather_base_", [[8], [4]], ["float", "float"])] * 3}
    s = summarize_trace(trace, steps=3, world_size=2)
    assert s.step_ms is None and s.sent_bytes_per_step == pytest.approx(0.5 * 8 * 4)
    assert s.collectives["all_gather"].calls == 1


def test_timeline_excerpt_merges_each_rows_kernels():
    trace = {"traceEvents": [kernel("a", 1000, 10), kernel("b", 1015, 10), kernel("ncclKernel_x", 1005, 100),
                             kernel("c", 3000, 10)]}
    spans = timeline_excerpt(trace, gap_ms=0.01)
    compute = [s for s in spans if s["row"] == "compute"]
    assert compute[0] == {"row": "compute", "start_ms": 0.0, "dur_ms": 0.025}
    assert len(compute) == 2 and [s for s in spans if s["row"] == "collective"][0]["dur_ms"] == 0.1
    assert timeline_excerpt(trace, max_ms=1.0) == merged_spans(
        {"compute": [(0.0, 0.01), (0.015, 0.025)], "collective": [(0.005, 0.105)]}, 0.02)


def test_step_profiler_records_the_steps_after_the_wait(tmp_path):
    import torch

    layer = torch.nn.Linear(8, 8)
    with StepProfiler(wait=1, active=2) as prof:
        for _ in range(4):
            layer(torch.randn(4, 8)).sum().backward()
            prof.step()
    assert prof.summary is not None and prof.summary.steps == 2
    with pytest.raises(ValueError, match="active"):
        StepProfiler(wait=0, active=0)


def test_scaling_efficiency_against_the_fewest_gpus_that_ran():
    rows = [{"variant": "patched", "gpus": 1, "seq_len": 8, "fits": False},
            {"variant": "patched", "gpus": 2, "seq_len": 8, "fits": True, "tokens_per_s_per_gpu": 100.0},
            {"variant": "patched", "gpus": 4, "seq_len": 8, "fits": True, "tokens_per_s_per_gpu": 95.0},
            {"variant": "baseline", "gpus": 1, "seq_len": 8, "fits": True, "tokens_per_s_per_gpu": 50.0},
            {"variant": "baseline", "gpus": 2, "seq_len": 8, "fits": True, "tokens_per_s_per_gpu": 45.0}]
    eff = scaling_efficiency(rows)
    assert eff["patched"]["8"] == {"base_gpus": 2, "2": 1.0, "4": 0.95, "4/2": 0.95}
    assert eff["baseline"]["8"]["2/1"] == pytest.approx(0.9)


def test_paper_shapes_and_predicted_bytes():
    config = shape_config("llama-3.1-70b")
    assert 70e9 < count_parameters(config) < 71e9  # Llama-3.1-70B: 70.6 B parameters
    eight = llama_config("llama-3.1-8b")
    assert predicted_sent_bytes("llama-3.1-8b", 2) == bytes_sent_per_step(count_parameters(eight),
                                                                          gathered_once_count(eight), 2)
    small, large = fsdp_budget(8), fsdp_budget(8, preset="llama-3.1-70b")
    ratio = count_parameters(config) / count_parameters(eight)
    assert large.compute_s["patched"] == pytest.approx(small.compute_s["patched"] * ratio)
    assert large.sent_bytes_per_gpu > 8 * small.sent_bytes_per_gpu
