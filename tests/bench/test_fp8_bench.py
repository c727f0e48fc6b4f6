"""The FP8 GEMM benchmark in the interpreter: it checks each FP8 result before it times it, refuses a wrong one,
writes its JSON, and replaces it only with ``--force`` (the GPU run is the same code at Llama-3.1-8B's shapes)."""

import json

import pytest
import torch

from kernels.bench import fp8_gemm
from kernels.bench.fp8_gemm import FP8_CHECK_TOL, format_table, main, quantize_bytes, tflops
from kernels.bench.results import device_slug


def test_command_line_writes_json_and_refuses_to_overwrite(tmp_path, capsys):
    args = ["--tokens", "40", "--shapes", "32x48,48x16", "--out", str(tmp_path)]
    assert main(args) == 0
    path = tmp_path / "fp8_gemm" / f"{device_slug()}.json"
    data = json.loads(path.read_text())
    assert data["tokens"] == 40 and data["shapes"] == [[32, 48], [48, 16]]
    rows = {(r["impl"], r["k"], r["n"]): r for r in data["rows"]}
    assert set(rows) == {(impl, k, n) for impl in ("bf16", "cublas", "triton", "quantize") for k, n in ((32, 48),
                                                                                                         (48, 16))}
    for (impl, _, _), row in rows.items():
        assert row["ms"] > 0, impl
        if impl in ("cublas", "triton"):
            assert 0 < row["rel_error"] < FP8_CHECK_TOL and row["tflops"] > 0
    assert rows[("quantize", 32, 48)]["gbps"] > 0
    assert "ours/cuBLAS" in capsys.readouterr().out
    before = path.read_text()
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2 and "--force" in capsys.readouterr().err
    assert path.read_text() == before
    assert main([*args, "--force", "--shapes", "16x16"]) == 0
    assert json.loads(path.read_text())["shapes"] == [[16, 16]]


def test_flags_are_checked_before_any_work(tmp_path, capsys):
    for bad in (["--shapes", "4096"], ["--shapes", "0x16"], ["--tokens", "0"], ["--record"]):
        with pytest.raises(SystemExit) as exit_info:
            main([*bad, "--out", str(tmp_path)] if bad != ["--record"] else bad)
        assert exit_info.value.code == 2, bad
    assert not (tmp_path / "fp8_gemm").exists()


def test_a_wrong_fp8_gemm_is_refused_before_it_is_timed(monkeypatch):
    def forgets_a_scale(a, a_scale, b, b_scale, out_dtype, backend):
        return fp8_gemm.fp8_matmul_reference(a, a_scale, b, torch.ones_like(b_scale), out_dtype)

    monkeypatch.setattr(fp8_gemm, "fp8_matmul", forgets_a_scale)
    with pytest.raises(RuntimeError, match="relative error"):
        fp8_gemm.run_shape(16, 32, 32)


def test_a_backend_that_cannot_run_is_skipped_with_its_reason(monkeypatch):
    def refuses(a, a_scale, b, b_scale, out_dtype, backend):
        raise ValueError(f"backend={backend!r} cannot run here: a test says so")

    monkeypatch.setattr(fp8_gemm, "fp8_matmul", refuses)
    result = {"tokens": 16, "device": "here", "shapes": [[32, 32]], "rows": fp8_gemm.run_shape(16, 32, 32)}
    assert {r["impl"] for r in result["rows"] if "skipped" in r} == {"cublas", "triton"}
    assert "triton skipped: backend='triton' cannot run here" in format_table(result)


def test_counts():
    assert tflops(8192, 4096, 14336, 1.0) == pytest.approx(2 * 8192 * 4096 * 14336 / 1e9)
    assert quantize_bytes(8192, 4096) == 8192 * 4096 * 3 + 8192 * 4
