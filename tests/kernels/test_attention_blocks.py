"""The attention tile sweep (kernels.bench.attention_blocks): every candidate checked before it is timed, one that
computes something else or cannot run recorded as failing with why, the fastest of each kernel named, and the file
written where the command-line policy says."""

import json

import pytest

from kernels import runtime
from kernels.attention import BlockConfig
from kernels.bench import attention_blocks as sweep

CPU_ONLY = pytest.mark.skipif(runtime.MODE == "gpu", reason="interpreter shapes; on a GPU the sweep takes minutes")


def test_each_list_starts_with_the_configured_tiles():
    gpu = runtime.DeviceProps("H200", False, 132, 232448, 65536, capability=(9, 0))
    from kernels.attention import attention_config

    configured = attention_config(8192, 128, gpu)
    for kernel in sweep.KERNELS:
        blocks = sweep.candidates(kernel, gpu)
        assert blocks[0] == sweep.configured(configured, kernel, gpu) and len(set(blocks)) == len(blocks) > 3
        if kernel in ("forward", "dq"):  # their walks need whole key blocks before the query block's first row
            assert all(c.block.block_m % c.block.block_n == 0 for c in blocks), kernel
    assert dict(sweep.candidates("forward", gpu)[0].flags) == {"tma": True}  # Hopper's configuration
    with pytest.raises(ValueError, match="kernel must be one of"):
        sweep.candidates("delta")


@CPU_ONLY
def test_the_command_checks_times_and_names_the_fastest(tmp_path, capsys):
    assert sweep.main(["--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "attention_blocks" / "cpu-interpreter.json").read_text())
    for kernel in sweep.KERNELS:
        rows = [r for r in result["rows"] if r["kernel"] == kernel and not r.get("baseline")]
        listed = {(tuple(c.block.__dict__.values()), c.flags) for c in sweep.candidates(kernel)}
        ran = {(tuple(r["block"].values()), tuple(sorted(r["flags"].items()))) for r in rows}
        # every listed tile, and first the configured one (listed or not: dQ's inherits dK/dV's flags)
        assert listed <= ran and len(rows) - len(listed) in (0, 1)
        assert all(r["ms"] > 0 and r["error"] < 1e-5 for r in rows)
        assert result["best"][kernel]["ms"] == min(r["ms"] for r in rows)
    assert [r["ms"] > 0 for r in result["rows"] if r.get("baseline")] == [True]  # the one pass's comparison
    assert "backward, dQ tiles" in capsys.readouterr().out


@CPU_ONLY
def test_packed_rows_are_swept_into_their_own_file(tmp_path, capsys):
    assert sweep.main(["--out", str(tmp_path), "--documents", "13", "--kernels", "forward,dq"]) == 0
    result = json.loads((tmp_path / "attention_blocks" / "cpu-interpreter_documents13.json").read_text())
    assert result["settings"]["documents"] == 13 and {r["kernel"] for r in result["rows"]} == {"forward", "dq"}
    assert all(r["ms"] > 0 and r["error"] < 1e-5 for r in result["rows"])
    assert "packed documents of 13 tokens" in capsys.readouterr().out


def test_packed_segments_restart_every_document():
    start, end = sweep.packed_segments(dict(batch=2, seq=10, documents=4), "cpu")
    assert start.tolist() == [[0, 0, 0, 0, 4, 4, 4, 4, 8, 8]] * 2
    assert end.tolist() == [[4, 4, 4, 4, 8, 8, 8, 8, 10, 10]] * 2
    assert sweep.packed_segments(dict(batch=2, seq=10), "cpu") == ()


@CPU_ONLY
def test_a_wrong_or_broken_tile_is_recorded_and_never_timed(monkeypatch):
    # 16 query rows with 32-key tiles: the forward's mask-free walk would end inside a key block and count keys
    # after the diagonal (attention_config never gives it; the launch refuses it by name); a zero-row tile cannot
    # launch at all.
    monkeypatch.setitem(sweep.CPU_CANDIDATES, "forward", [(16, 16, 4, 1), (16, 32, 4, 1), (0, 16, 4, 1)])
    result = sweep.run(kernels=("forward",))
    good, wrong, broken = result["rows"]
    assert "ms" in good and result["best"]["forward"] is good
    assert "ms" not in wrong and "the forward kernel needs block_m a multiple of block_n" in wrong["failed"]
    assert "ms" not in broken and broken["failed"]
    assert "failed" in sweep.format_table(result)
    assert BlockConfig(**good["block"]) == sweep.candidates("forward")[0].block


@CPU_ONLY
def test_the_dq_candidates_keep_the_fastest_dkdv_rows_flags(monkeypatch):
    # dK/dV's fastest row is the one with the TMA: the dQ rows then run with it, and their first row (the
    # configuration they are compared with) says so.
    monkeypatch.setitem(sweep.CPU_CANDIDATES, "dkdv", [(16, 16, 4, 1), (16, 16, 4, 1, sweep.TMA)])
    monkeypatch.setattr(sweep, "fastest", lambda rows: rows[-1])
    result = sweep.run(kernels=("dkdv", "dq"))
    first_dq = next(r for r in result["rows"] if r["kernel"] == "dq")
    assert first_dq["flags"] == {"tma": True}

