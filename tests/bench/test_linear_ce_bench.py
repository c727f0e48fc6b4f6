"""The linear cross-entropy benchmark: it checks before it times, marks a wrong implementation, skips with a reason,
and writes its JSON and plot (at CPU sizes here; the GPU run is the same code)."""

import importlib.util
import json

import torch

from kernels import runtime
from kernels.bench import linear_ce as bench
from kernels.bench.linear_ce import LinearImpl, main, matmul_flop, measure
from kernels.bench.results import device_slug


def test_command_line_writes_json_and_png(tmp_path, capsys):
    assert main(["--tokens", "6,10", "--hidden", "16", "--vocab", "300", "--out", str(tmp_path),
                 "--no-progress", "--impls", "ours,ours-recompute-all,ours-chunked,torch-fp32,trl,liger"]) == 0
    data = json.loads((tmp_path / "linear_cross_entropy" / f"{device_slug()}.json").read_text())
    rows = {(r["impl"], r["tokens"]): r for r in data["rows"]}
    assert set(rows) == {(k, n) for k in ("ours", "ours-recompute-all", "ours-chunked", "torch-fp32", "trl", "liger")
                         for n in (6, 10)}
    # TRL's head has a PyTorch path on the CPU; it is checked wherever TRL is installed whole (a test requirement,
    # but a GPU image may carry TRL without its dependencies, and then the row says why it failed)
    for key in ("ours", "ours-recompute-all", "ours-chunked", "torch-fp32") + (("trl",) if _trl_installed() else ()):
        assert rows[(key, 10)]["check"]["ok"] and rows[(key, 10)]["eager_ms"] > 0
    assert "skipped" in rows[("liger", 6)] or runtime.MODE == "gpu"  # Liger runs only on a GPU
    assert (tmp_path / "linear_cross_entropy" / f"{device_slug()}.png").stat().st_size > 10_000
    assert "Cut Cross-Entropy" not in capsys.readouterr().out  # only the implementations asked for


def _trl_installed() -> bool:
    # TRL's head imports without datasets, a dependency of TRL's, but calling it needs it
    return all(importlib.util.find_spec(name) is not None for name in ("trl", "datasets"))


def test_a_wrong_implementation_is_marked_and_not_timed():
    def almost(hidden, weight, target):  # sums where the loss is a mean: plausible, and wrong
        return torch.nn.functional.cross_entropy(hidden @ weight.T, target, reduction="sum")

    row = measure(LinearImpl("wrong", "wrong", lambda: almost), 12, 16, 200, None)
    assert row["check"]["ok"] is False and "eager_ms" not in row
    assert "WRONG" in bench.table({"rows": [row]})


def test_flop_floor():
    assert matmul_flop(8192, 4096, 128_256) == 6 * 8192 * 4096 * 128_256
