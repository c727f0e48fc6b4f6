"""Timing and the machine's ceilings.

On a GPU, times are ``triton.testing.do_bench`` medians (CUDA events, after warm-up, with the L2 cache flushed
before every repetition). In the interpreter they are wall-clock medians of a few calls, labelled as such: they
measure NumPy, not a GPU.

The ceilings are what every kernel is judged against: the device-to-device copy bandwidth (bytes read + bytes
written) and the bf16 matrix-multiply rate, both measured on this machine, not taken from a datasheet.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from . import runtime

ASSETS = Path(__file__).resolve().parent.parent / "assets"
RESULTS = ASSETS / "results"
CEILINGS_FILE = RESULTS / "ceilings.json"


def time_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 100, grad_to_none=None, cpu_reps: int = 3) -> float:
    """Median time of ``fn()`` in milliseconds.

    GPU: ``do_bench`` with ``warmup``/``rep`` in milliseconds of device time. ``grad_to_none`` lists tensors whose
    ``.grad`` is reset before each call, so a backward pass writes its gradient instead of adding to an old one.
    Interpreter: the wall-clock median of ``cpu_reps`` calls after one warm-up call.
    """
    if runtime.MODE == "gpu":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median"))
    times = []
    for i in range(cpu_reps + 1):
        for t in grad_to_none or []:
            t.grad = None
        start = time.perf_counter()
        fn()
        if i:  # the first call is the warm-up
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure_ceilings(copy_bytes: int = 2 << 30, matmul_n: int = 8192) -> dict:
    """Measure the two ceilings on this GPU: device-to-device copy GB/s (read + write) and bf16 matmul TFLOP/s.

    The copy moves ``copy_bytes`` one way (so 2 × copy_bytes of traffic); the matmul is ``matmul_n``³ on random
    bf16 data (zeros run faster than real data and would flatter the ceiling).
    """
    if runtime.MODE != "gpu":
        raise RuntimeError("the ceilings can only be measured on a GPU; in the interpreter there is nothing to measure")
    n = copy_bytes // 2
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src), warmup=50, rep=200)
    del src, dst
    a = torch.randn(matmul_n, matmul_n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(matmul_n, matmul_n, device="cuda", dtype=torch.bfloat16)
    mm_ms = time_ms(lambda: a @ b, warmup=50, rep=200)
    del a, b
    torch.cuda.empty_cache()
    return {
        "device": runtime.device_name(),
        "copy_gbps": 2 * copy_bytes / (copy_ms * 1e-3) / 1e9,
        "matmul_tflops": 2 * matmul_n**3 / (mm_ms * 1e-3) / 1e12,
        "copy_bytes": copy_bytes,
        "matmul_n": matmul_n,
        "versions": runtime.versions(),
    }


def save_ceilings(ceilings: dict, path: Path = CEILINGS_FILE) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(ceilings, indent=2) + "\n")
    return path


def load_ceilings(path: Path = CEILINGS_FILE) -> dict | None:
    """The ceilings stored by notebook 00 (or ``None`` if it has not run on a GPU yet)."""
    return json.loads(path.read_text()) if path.exists() else None


def gbps(n_bytes: float, ms: float) -> float:
    """Achieved bandwidth in GB/s for ``n_bytes`` moved in ``ms`` milliseconds."""
    return n_bytes / (ms * 1e-3) / 1e9
