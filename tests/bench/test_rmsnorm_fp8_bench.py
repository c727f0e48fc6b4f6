"""The fused RMSNorm → FP8 benchmark in the interpreter: it checks the fused kernel against the two kernels bit for
bit before it times anything, refuses a wrong one, writes its JSON and replaces it only with ``--force`` (the GPU run
is the same code at [8192, 4096] bf16)."""

import json

import pytest
import torch

from kernels.bench import rmsnorm_fp8
from kernels.bench.results import device_slug
from kernels.bench.rmsnorm_fp8 import main, minimal_bytes, two_kernel_bytes


def test_command_line_writes_json_and_refuses_to_overwrite(tmp_path, capsys):
    args = ["--tokens", "24", "--hidden", "72", "--out", str(tmp_path)]
    assert main(args) == 0
    path = tmp_path / "rmsnorm_fp8" / f"{device_slug()}.json"
    data = json.loads(path.read_text())
    assert (data["tokens"], data["hidden"], data["dtype"], data["fp8_dtype"]) == (24, 72, "bf16", "e4m3")
    assert [r["impl"] for r in data["rows"]] == ["unfused", "fused", "norm"]
    assert all(r["us"] > 0 and r["gbps"] > 0 and r["bytes"] > 0 for r in data["rows"])
    assert "fused / unfused" in capsys.readouterr().out
    before = path.read_text()
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2 and "--force" in capsys.readouterr().err
    assert path.read_text() == before
    assert main([*args, "--force", "--fp8", "e5m2", "--dtype", "fp16"]) == 0
    assert json.loads(path.read_text())["fp8_dtype"] == "e5m2"


def test_flags_are_checked_before_any_work(tmp_path):
    for bad in (["--tokens", "0"], ["--hidden", "16385"], ["--fp8", "e3m4"], ["--record"]):
        with pytest.raises(SystemExit) as exit_info:
            main([*bad, "--out", str(tmp_path)] if bad != ["--record"] else bad)
        assert exit_info.value.code == 2, bad
    assert not (tmp_path / "rmsnorm_fp8").exists()


def test_a_fused_result_off_by_one_code_is_refused_before_it_is_timed(monkeypatch):
    real = rmsnorm_fp8.rms_norm_fp8

    def one_code_off(x, w, eps, fp8_dtype):
        q, scale = real(x, w, eps, fp8_dtype)
        q.view(torch.uint8)[3, 5] ^= 1
        return q, scale

    monkeypatch.setattr(rmsnorm_fp8, "rms_norm_fp8", one_code_off)
    x, w = rmsnorm_fp8.make_inputs(8, 40, torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"1 codes \(up to 1 steps\) and 0 scales"):
        rmsnorm_fp8.check_same_bits(x, w, torch.float8_e4m3fn)


def test_byte_counts():
    t, h = 8192, 4096
    floor = minimal_bytes(t, h, torch.bfloat16)
    assert floor["fused"] == floor["unfused"] == 2 * t * h + 2 * h + t * h + 4 * t
    assert floor["norm"] == 2 * t * h + 2 * h + 2 * t * h + 4 * t
    # the fusion saves the bf16 output's write and its second read, and the rstd
    assert two_kernel_bytes(t, h, torch.bfloat16) - floor["fused"] == 4 * t * h + 4 * t
