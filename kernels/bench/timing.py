"""Timing and the machine's ceilings: how long a call takes, on the device and on the host, and how
much memory.

On a GPU, times are ``triton.testing.do_bench`` medians (CUDA events, after warm-up, with the L2
cache flushed before every repetition). In the interpreter they are wall-clock medians of a few
calls, labelled as such: they measure NumPy, not a GPU. ``device_time_ms`` times the replays of a
CUDA graph captured once from the call (GPU time only); ``peak_extra_mib`` measures the peak memory
a call adds.

The ceilings are what every kernel is judged against: the device-to-device copy bandwidth (bytes
read + bytes written) and the bf16 matrix-multiply rate, both measured on this machine, not taken
from a datasheet. They are saved and loaded by ``kernels.bench.results``; the benchmark sweep that
uses all of this is ``kernels.bench.sweep``.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

import torch

from kernels import runtime
from kernels.memory import peak_extra_bytes

from .results import MIB, first_line


def time_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 100, grad_to_none=None,
            cpu_reps: int = 3) -> float:
    """Median time of ``fn()`` in milliseconds.

    GPU: ``do_bench`` with ``warmup``/``rep`` in milliseconds of device time. ``grad_to_none`` lists
    tensors whose ``.grad`` is reset before each call, so a backward pass writes its gradient
    instead of adding to an old one. Interpreter: the wall-clock median of ``cpu_reps`` calls after
    one warm-up call.

    Chapter 02 introduces it; later chapters time with it.

    Args:
        fn: the call to time, without arguments.
        warmup: GPU: milliseconds of warm-up.
        rep: GPU: milliseconds of timed calls.
        grad_to_none: tensors whose ``.grad`` is reset before each call.
        cpu_reps: interpreter: timed calls.

    Returns:
        milliseconds.
    """
    if runtime.MODE == "gpu":
        import triton.testing

        ms = triton.testing.do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none,
                                     return_mode="median")
        return float(ms)
    times = []
    for i in range(cpu_reps + 1):
        for t in grad_to_none or []:
            t.grad = None
        start = time.perf_counter()
        fn()
        if i:  # the first call is the warm-up
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure_copy_gbps(copy_bytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth of this GPU in GB/s (read + write): ``copy_bytes`` copied one way.

    Args:
        copy_bytes: bytes copied.

    Returns:
        GB/s.

    Raises:
        RuntimeError: in Triton's interpreter.
    """
    if runtime.MODE != "gpu":
        raise RuntimeError("the ceilings can only be measured on a GPU; in the interpreter there is nothing to measure")
    return 2 * copy_bytes / (_copy_ms(copy_bytes, warmup=50, rep=200) * 1e-3) / 1e9


def _copy_ms(one_way_bytes: int, warmup: int, rep: int) -> float:
    # do_bench of PyTorch's device-to-device copy of one_way_bytes (a copy's speed does not depend
    # on the values)
    src = torch.empty(max(one_way_bytes // 2, 1), device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return time_ms(functools.partial(dst.copy_, src), warmup=warmup, rep=rep)


def measure_ceilings(copy_bytes: int = 2 << 30, matmul_n: int = 8192) -> dict:
    """Measure the two ceilings on this GPU: device-to-device copy GB/s (read + write) and bf16
    matmul TFLOP/s.

    The copy moves ``copy_bytes`` one way (so 2 × copy_bytes of traffic); the matmul is
    ``matmul_n``³ on random bf16 data (zeros run faster than real data and would flatter the
    ceiling).

    Chapters 00, 04 and 07 measure them with it.

    Args:
        copy_bytes: bytes copied one way.
        matmul_n: the matmul's size.

    Returns:
        device, ``copy_gbps``, ``matmul_tflops``, the sizes and the versions.

    Raises:
        RuntimeError: in Triton's interpreter.
    """
    copy_gbps = measure_copy_gbps(copy_bytes)
    a = torch.randn(matmul_n, matmul_n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(matmul_n, matmul_n, device="cuda", dtype=torch.bfloat16)
    mm_ms = time_ms(functools.partial(torch.matmul, a, b), warmup=50, rep=200)
    del a, b
    torch.cuda.empty_cache()
    return {
        "device": runtime.device_name(),
        "copy_gbps": copy_gbps,
        "matmul_tflops": 2 * matmul_n**3 / (mm_ms * 1e-3) / 1e12,
        "copy_bytes": copy_bytes,
        "matmul_n": matmul_n,
        "versions": runtime.versions(),
    }


def gbps(n_bytes: float, ms: float) -> float:
    """Achieved bandwidth in GB/s for ``n_bytes`` moved in ``ms`` milliseconds.

    Args:
        n_bytes: bytes moved.
        ms: milliseconds.

    Returns:
        GB/s.
    """
    return n_bytes / (ms * 1e-3) / 1e9


def floor_ms(n_bytes: float, copy_gbps: float) -> float:
    """The time ``n_bytes`` take at the measured copy bandwidth: no memory-bound kernel can beat it.

    Args:
        n_bytes: bytes to move.
        copy_gbps: the copy bandwidth, GB/s.

    Returns:
        milliseconds.
    """
    return n_bytes / (copy_gbps * 1e9) * 1e3


# --------------------------------------------------------------------------------------------------
# Device time: capture once into a CUDA graph, time the replays
# --------------------------------------------------------------------------------------------------


def rotated(items: list, r: int) -> list:
    """``items`` in the order of timing round ``r``: rotated by ``r`` places, so that over the
    rounds no item always runs first, or always right after the same neighbour.

    Args:
        items: the items.
        r: the round.

    Returns:
        a new list.
    """
    k = r % len(items) if items else 0
    return items[k:] + items[:k]


def reset_grads(tensors) -> None:
    """Set ``.grad`` of every tensor to None, so the next backward writes its gradient instead of
    adding to one.

    Args:
        tensors: the tensors (None: none).
    """
    for t in tensors or ():
        t.grad = None


def capture_graph(fn: Callable[[], object], grad_to_none=(), warmup_calls: int = 3) -> torch.cuda.CUDAGraph:
    """Capture ``fn()`` into a CUDA graph (GPU only).

    Warm-up calls run on a side stream first (they compile, autotune and allocate outside the
    capture); the gradients are reset so the captured backward writes fresh ones, which every replay
    then rewrites in place.

    Args:
        fn: the call to capture, without arguments.
        grad_to_none: tensors whose ``.grad`` is reset before the capture.
        warmup_calls: calls before the capture.

    Returns:
        the ``torch.cuda.CUDAGraph``.
    """
    current = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(current)
    with torch.cuda.stream(side):
        for _ in range(warmup_calls):
            reset_grads(grad_to_none)
            fn()
    current.wait_stream(side)
    reset_grads(grad_to_none)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def device_time_ms(fn: Callable[[], object], grad_to_none=(), warmup: int = 25, rep: int = 50):
    """``(ms, None)``: the median replay time of ``fn`` captured in a CUDA graph; ``(None, reason)``
    if it cannot be.

    In the interpreter there is no device: ``(None, reason)``. A capture that fails (a host
    synchronisation inside ``fn``, an operation CUDA graphs do not allow) is reported, not raised,
    so one peer cannot stop a sweep.

    Chapter 04 times its kernels with it.

    Args:
        fn: the call to time, without arguments.
        grad_to_none: tensors whose ``.grad`` is reset around the capture.
        warmup: milliseconds of warm-up replays.
        rep: milliseconds of timed replays.

    Returns:
        ``(ms, None)`` or ``(None, reason)``.
    """
    if runtime.MODE != "gpu":
        return None, "interpreter: no GPU, so no device time (eager_ms is CPU wall-clock)"
    try:
        graph = capture_graph(fn, grad_to_none)
    except Exception as exc:  # noqa: BLE001  (any failure to capture is a result to record)
        torch.cuda.synchronize()
        reset_grads(grad_to_none)
        return None, f"CUDA graph capture failed: {type(exc).__name__}: {first_line(exc)}"
    try:
        return time_ms(graph.replay, warmup=warmup, rep=rep), None
    finally:
        del graph
        reset_grads(grad_to_none)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def same_bytes_copy_ms(n_bytes: int, warmup: int = 25, rep: int = 50) -> float | None:
    """Device time of PyTorch's copy of ``n_bytes`` (half of them read, half written): the yardstick
    at that size. The copy ceiling of ``measure_ceilings`` moves gigabytes; a launch that moves a
    few megabytes spends a larger share of its time starting up and draining, copy or kernel alike.
    At those sizes it is a reference, not a bound: a kernel with its loads all in flight at once can
    beat PyTorch's copy of the same bytes (the RoPE forward did: assets/notes/overhead.md, "The copy
    yardstick").

    Timed as that ceiling is, ``do_bench`` of the plain call (the L2 cache flushed before each call,
    as for every row), not as a CUDA-graph replay: captured in a graph, PyTorch's copy becomes a
    memcpy node, which is slower (assets/notes/overhead.md, "The copy yardstick"). Its host time is
    a single launch, far shorter than the cache flush the GPU runs before it, so the launch does not
    show in the time.

    Args:
        n_bytes: bytes the copy moves, half read and half written.
        warmup: calls before timing (``do_bench``'s warm-up).
        rep: timed calls.

    Returns:
        The median device time in ms, or None in the interpreter.
    """
    if runtime.MODE != "gpu":
        return None
    return _copy_ms(n_bytes // 2, warmup, rep)


def peak_extra_mib(fn: Callable[[], object], grad_to_none=()) -> float | None:
    """Peak memory allocated during one ``fn()`` beyond what existed before it, in MiB (GPU; None in
    the interpreter).

    Gradients are reset first, so a gradient the call allocates (and leaves in ``.grad``) counts: a
    training step holds it too. Inputs already exist and do not count.

    Args:
        fn: the call to measure, without arguments.
        grad_to_none: tensors whose ``.grad`` is reset first.

    Returns:
        MiB, or None.
    """
    if runtime.MODE != "gpu":
        return None
    reset_grads(grad_to_none)
    peak = peak_extra_bytes(fn)
    reset_grads(grad_to_none)
    return peak / MIB
