"""The replay of an allocator trace: the peak's moment and the blocks alive then (no GPU needed)."""

import pytest

from kernels import runtime
from kernels.training import peak_memory


def alloc(addr, size, *files):
    frames = [{"filename": f, "line": i + 1, "name": "fn"} for i, f in enumerate(files)]
    return {"action": "alloc", "addr": addr, "size": size, "frames": frames}


def free(addr, action="free_requested"):
    return {"action": action, "addr": addr, "size": 0}


TRACE = [
    alloc(1, 100, "/x/torch/nn/functional.py", "/w/kernels/rmsnorm.py"),
    alloc(2, 400, "/w/kernels/swiglu.py"),
    free(1),
    free(1, "free_completed"),  # the same block's second event must not count twice
    alloc(3, 400, "/w/kernels/swiglu.py"),
    alloc(4, 50),  # no Python frame: allocated by autograd's engine
    free(2),
    alloc(5, 10, "/w/kernels/rmsnorm.py"),
]


def test_peak_index_finds_the_largest_live_total():
    index, peak = peak_memory.peak_index(TRACE)
    assert (index, peak) == (5, 850)


def test_live_at_groups_by_size_and_site():
    rows = peak_memory.live_at(TRACE, 5, tokens=10)
    assert [(r["size"], r["count"], r["site"]) for r in rows] == [
        (400, 2, "swiglu.py:1:fn"), (50, 1, "(autograd)")]
    assert rows[0]["total_bytes"] == 800 and rows[0]["bytes_per_token"] == 40
    # PyTorch's own frames are skipped, the package's kept.
    early = peak_memory.live_at(TRACE, 0, tokens=1)
    assert early[0]["site"] == "rmsnorm.py:2:fn"


def test_slope_and_table():
    short = {"tokens": 100, "peak_bwd": 1000}
    long = {"tokens": 300, "peak_bwd": 5000}
    assert peak_memory.slope(short, long) == 20
    results = {"preset": "tiny", "device": "test", "lengths": [100, 300], "rows": [
        {"variant": "hf", "padding_mask": True, "bytes_per_token": {"peak_bwd": 2048}},
        {"variant": "hf", "padding_mask": False, "bytes_per_token": {"peak_bwd": 1024}},
        {"variant": "ours_lce", "padding_mask": False, "bytes_per_token": {"peak_bwd": 512}}]}
    text = peak_memory.table(results)
    assert "hf" in text and "2.0" in text and "1.0" in text and "0.5" in text


@pytest.mark.skipif(runtime.MODE == "gpu", reason="on a GPU the command measures, for minutes, and writes results")
def test_cpu_says_gpu_only(capsys):
    # Like every command that needs a GPU: refused up front, exit 2 and one line that says why.
    with pytest.raises(SystemExit) as exited:
        peak_memory.main([])
    assert exited.value.code == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
