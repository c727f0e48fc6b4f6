"""The attention benchmark's command line (kernels.bench.attention): tiny shapes in the interpreter, the FLOP count,
where it writes, and that it refuses to replace the committed results without --record."""

import json

import pytest

from kernels import runtime
from kernels.bench import attention as bench


def test_flop_count_is_the_stated_one():
    # 2·2·B·H·S²·D/2 forward, 2.5× that backward: 3.5× the forward.
    assert bench.causal_flops(1, 32, 2048, 128) == pytest.approx(3.5 * 2 * 2 * 32 * 2048**2 * 128 / 2)


def test_command_writes_a_checked_run(tmp_path, capsys):
    assert bench.main(["--seqs", "32", "--tokens", "32", "--out", str(tmp_path)]) == 0
    (path,) = (tmp_path / "attention").glob("*.json")
    result = json.loads(path.read_text())
    row, docs = result["rows"][0], result["documents"][0]
    if runtime.MODE == "gpu":  # bf16; a peer without a kernel for this tiny case is recorded as missing, with why
        assert row["seq"] == 32 and {"ours", "sdpa_flash"} <= set(row["ms"]) and row["error"]["sdpa_flash"] < 3e-2
    else:
        assert row["seq"] == 32 and set(row["ms"]) == {"ours", "sdpa_math"} and not row["missing"]
        assert row["error"]["sdpa_math"] < 1e-5  # float32 in the interpreter: checked against ours before timing
    assert docs["ms"]["ours_packed"] > 0
    out = capsys.readouterr().out
    assert "ours against peers" in out and f"kernel version {bench.attention.VERSION}, the package's" in out
    older = {**result, "kernel_version": bench.attention.VERSION - 1}
    assert "not timed in this run" in bench.format_table(older)
    del older["kernel_version"]  # a run recorded before the field timed version 1
    assert "kernel version 1;" in bench.format_table(older)


def test_refuses_to_replace_recorded_results_without_record():
    with pytest.raises(SystemExit):
        bench.main(["--out", str(bench.RESULTS), "--seqs", "32"])
    with pytest.raises(SystemExit):
        bench.main(["--seqs", "0"])
