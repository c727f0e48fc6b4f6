"""The SwiGLU and RoPE benchmark entries: minimal bytes, cases that catch wrong peers, the command line on the CPU."""

import json

import pytest
import torch

from kernels import runtime
from kernels.bench import sweep
from kernels.bench.peers import Impl
from kernels.bench.sweep import rope_bytes, run_benchmark, swiglu_bytes


def test_swiglu_bytes_at_llama_8b_shape():
    # 16,384 tokens × 14,336 in bf16: forward 3 tensors, forward + backward 8.
    assert swiglu_bytes(16384, 14336, 2, "fwd") == 3 * 16384 * 14336 * 2
    assert swiglu_bytes(16384, 14336) == 8 * 16384 * 14336 * 2 == 3_758_096_384
    with pytest.raises(ValueError, match="pass_"):
        swiglu_bytes(1, 1, pass_="bwd")


def test_rope_bytes_count_cos_sin_once_per_position():
    # 32 q heads + 8 kv heads, D = 128, bf16: q and k read and written, cos and sin read once per position.
    fwd = rope_bytes(2048, 128, 32, 8, 2, "fwd")
    assert fwd == 2 * 40 * 2048 * 128 * 2 + 2 * 2048 * 128 * 2
    assert rope_bytes(2048, 128) == 2 * fwd
    assert rope_bytes(2048, 128, trig_itemsize=4, pass_="fwd") == fwd + 2 * 2048 * 128 * 2


def _half_gradient_swiglu(case):
    from kernels.reference import swiglu_reference

    class Half(torch.autograd.Function):
        @staticmethod
        def forward(ctx, gate, up):
            return swiglu_reference(gate, up)

        @staticmethod
        def backward(ctx, dy):
            return torch.zeros_like(dy), torch.zeros_like(dy)  # no gradient: must fail, never pass as "small"

    return Half.apply, []


def _unrotated_k(case):
    from kernels.rope import apply_rotary

    def fn(q, k, cos, sin):
        return apply_rotary(q, k, cos, sin)[0], k * 1.0  # k left as it was

    return fn, []


def test_wrong_peers_are_caught_and_ours_passes(device):
    results = run_benchmark("swiglu", [7], 40, impls=["ours", "hf", Impl("zero", "planted", "peer",
                                                                            _half_gradient_swiglu)],
                            progress=False, rep=1, warmup=1)
    rows = {(r["impl"], r["pass"]): r for r in results["rows"]}
    assert rows[("zero", "fwd")]["status"] == "ok"
    assert rows[("zero", "fwd+bwd")]["status"] == "check failed"
    assert rows[("zero", "fwd+bwd")]["check"]["errors"]["d_gate"] == pytest.approx(1.0)
    assert all(rows[("ours", p)]["check"]["ok"] and rows[("hf", p)]["check"]["ok"] for p in ("fwd", "fwd+bwd"))
    assert results["width_name"] == "intermediate"

    results = run_benchmark("rope", [5], 16, impls=["ours", "hf", Impl("k-as-is", "planted", "peer", _unrotated_k)],
                            progress=False, rep=1, warmup=1)
    rows = {(r["impl"], r["pass"]): r for r in results["rows"]}
    assert rows[("k-as-is", "fwd")]["status"] == "check failed" and rows[("k-as-is", "fwd")]["check"]["errors"][
        "q_embed"] < 1e-2
    assert all(rows[("ours", p)]["check"]["ok"] and rows[("hf", p)]["check"]["ok"] for p in ("fwd", "fwd+bwd"))
    assert results["width_name"] == "head_dim"


def _logged_swiglu(name, log):
    """A correct SwiGLU peer that appends ``name`` to ``log`` at every call."""
    from kernels.reference import swiglu_reference

    def build(case):
        def fn(gate, up):
            log.append(name)
            return swiglu_reference(gate, up)

        return fn, []

    return Impl(name, name, "peer", build)


def test_rounds_time_every_implementation_in_turn(device):
    # Three rounds: each implementation is checked once, then timed once per round, in turn, the order rotated from
    # one round to the next, and each row keeps the median of its rounds.
    log = []
    results = run_benchmark("swiglu", [6], 32, impls=["ours", _logged_swiglu("a", log), _logged_swiglu("b", log)],
                            passes=["fwd"], progress=False, rep=1, warmup=1, rounds=3)
    turns = [name for i, name in enumerate(log) if i == 0 or log[i - 1] != name]
    # The checks (a b), then round 1 (ours a b), round 2 (a b ours), round 3 (b ours a).
    assert turns == ["a", "b", "a", "b", "a", "b", "a"]
    assert results["settings"]["rounds"] == 3
    for row in results["rows"]:
        assert row["status"] == "ok" and len(row["eager_ms_rounds"]) == 3
        assert row["eager_ms"] == sorted(row["eager_ms_rounds"])[1]  # the median of three
    with pytest.raises(ValueError, match="rounds"):
        run_benchmark("swiglu", [6], 32, progress=False, rounds=0)


@pytest.mark.skipif(runtime.MODE == "gpu", reason="the CPU run of the command line (the GPU sweep is run by hand)")
def test_command_line_runs_swiglu_and_rope_on_the_cpu(tmp_path, capsys):
    for kernel, width in (("swiglu", "--intermediate"), ("rope", "--head-dim")):
        argv = ["--kernel", kernel, "--tokens", "3", width, "24", "--out", str(tmp_path), "--no-progress",
                "--warmup", "1", "--rep", "1"]
        assert sweep.main(argv) == 0
        printed = capsys.readouterr().out
        assert "mode=interpreter" in printed and f"wrote {tmp_path / kernel / 'cpu-interpreter.png'}" in printed
        results = json.loads((tmp_path / kernel / "cpu-interpreter.json").read_text())
        assert {r["shape"] for r in results["rows"]} == {"3×24"} and results["settings"]["width"] == 24
        for row in results["rows"]:
            if row["impl"] in ("compile", "liger"):
                assert row["status"] == "skipped" and row["note"]
            else:
                assert row["status"] == "ok" and row["check"]["ok"], row
