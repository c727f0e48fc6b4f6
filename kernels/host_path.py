"""SwiGLU's host path in C++: the autograd node and the kernel launches out of Python, for dense tensors on a GPU.

``kernels.overhead.floor`` shows why: an ``autograd.Function`` that launches one *empty* Triton kernel per pass
costs more host time per forward + backward than Hugging Face's whole SwiGLU in C++ operators, so where the host
decides (small tensors), no Python-level SwiGLU can keep up. ``kernels/csrc/swiglu_host.cpp`` is a C++
``torch::autograd::Function`` that launches the very kernels of ``kernels/swiglu.py``, compiled by Triton as always,
through the CUDA driver (``cuLaunchKernel``) with the handles Triton returns.

How a variant gets there. The first call with a given set of argument properties (those Triton specialises on:
16-byte alignment of each pointer, a row count equal to 1 or divisible by 16) misses in the C++ table and calls
back into Python, which runs the Python path, asks Triton for the kernel it compiled for exactly those arguments
(``JITFunction.warmup``), checks the kernel's parameter list against what the C++ launch passes
(``cuFuncGetParamInfo``: a mismatch, say from another Triton version, leaves that variant to the Python path) and
registers it. Every later call with the same properties runs in C++ only.

``swiglu`` uses this path for dense ``gate`` and ``up`` whose size divides into rows of 1,024 (every Llama MLP),
eagerly, on a GPU, with ``inplace_backward`` off; everything else (strided views, ``torch.compile``, tensor
subclasses, dispatch modes, the interpreter) takes the Python path, with the same kernels and the same bits. The
extension is compiled on first use (``torch.utils.cpp_extension``, about 40 s, then cached by PyTorch);
``KERNELS_HOST_PATH=0`` turns the path off, and a machine without a C++ compiler or ninja runs the Python path.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import threading
import time
import warnings

import torch

from . import ops, runtime
from .cuda_rmsnorm import CSRC, cpu_build_unavailable

SOURCE = CSRC / "swiglu_host.cpp"
EXTENSION = "kernels_swiglu_host"
COLS = 1024  # dense tensors are read as rows of 1,024 (kernels/swiglu.py, _RECUT_COLS)
_MAX_ROWS = 2**31 - 1  # the C++ launch passes the row count as a 32-bit integer, as Triton types it below this

_lock = threading.Lock()
_state: dict = {"ext": None, "reason": None, "seconds": None}


def unavailable() -> str | None:
    """Why the C++ host path cannot be used here (before any build is tried), or None."""
    if os.environ.get("KERNELS_HOST_PATH", "1") == "0":
        return "turned off (KERNELS_HOST_PATH=0)"
    if runtime.MODE != "gpu":
        return "no GPU: the Triton interpreter runs the Python path"
    if _driver_function("cuLaunchKernel") is None or _driver_function("cuFuncGetParamInfo") is None:
        return "the CUDA driver library has no cuLaunchKernel or cuFuncGetParamInfo (a driver for CUDA 12.4+)"
    return cpu_build_unavailable()


def extension():
    """The built extension, compiled and loaded on the first call; None (with the reason in ``status()``) when the
    path cannot be used here. A failed build warns once and leaves every call on the Python path."""
    if _state["ext"] is not None or _state["reason"] is not None:
        return _state["ext"]
    with _lock:
        if _state["ext"] is None and _state["reason"] is None:
            reason = unavailable()
            if reason is None:
                try:
                    _state["ext"] = _build()
                except Exception as exc:  # noqa: BLE001  (any build failure leaves the Python path, with a warning)
                    reason = f"the C++ build failed ({type(exc).__name__}: {str(exc).strip().splitlines()[-1:]})"
                    warnings.warn(f"kernels.swiglu runs its Python host path: {reason}", stacklevel=3)
            _state["reason"] = reason
    return _state["ext"]


def status() -> dict:
    """Whether the path is built, why not, how long the build took, and how many kernel variants it holds."""
    ext = _state["ext"]
    return {"built": ext is not None, "reason": _state["reason"], "build_seconds": _state["seconds"],
            "variants": ext.n_variants() if ext is not None else 0}


def takes(gate: torch.Tensor, up: torch.Tensor, inplace_backward: bool) -> bool:
    """Whether ``swiglu(gate, up)`` runs through the C++ node (inputs already checked by ``swiglu``)."""
    return (not inplace_backward and gate.is_cuda and gate.is_contiguous() and up.is_contiguous()
            and gate.numel() % COLS == 0 and gate.numel() // COLS <= _MAX_ROWS and ops.direct(gate, up)
            and extension() is not None)


def swiglu(gate: torch.Tensor, up: torch.Tensor, with_grad: bool) -> torch.Tensor:
    """``silu(gate) * up`` through the C++ node (``with_grad``: recorded for autograd) or its forward alone."""
    return _state["ext"].swiglu(gate, up, with_grad)


# --------------------------------------------------------------------------------------------------------------------
# The driver, the build, and the variants
# --------------------------------------------------------------------------------------------------------------------


def _libcuda():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def _driver_function(name: str):
    lib = _libcuda()
    return getattr(lib, name, None) if lib is not None else None


def _build():
    from torch.utils.cpp_extension import load

    start = time.perf_counter()
    ext = load(name=EXTENSION, sources=[str(SOURCE)], with_cuda=True, extra_cflags=["-O2"], verbose=False)
    _state["seconds"] = time.perf_counter() - start
    launch = ctypes.cast(_driver_function("cuLaunchKernel"), ctypes.c_void_p).value
    ext.set_launcher(launch, _forward_fallback, _backward_fallback)
    return ext


def param_sizes(function: int) -> list[int]:
    """The byte size of each parameter of a loaded kernel (``cuFuncGetParamInfo``), in order."""
    get = _driver_function("cuFuncGetParamInfo")
    offset, size, sizes = ctypes.c_size_t(), ctypes.c_size_t(), []
    while get(ctypes.c_void_p(function), ctypes.c_size_t(len(sizes)), ctypes.byref(offset), ctypes.byref(size)) == 0:
        sizes.append(size.value)
    return sizes


def expected_sizes(n_pointers: int, n_rows: int) -> list[int]:
    """The parameters the C++ launch passes before any scratch pointers: the tensors' pointers, the row count
    (a 32-bit integer, absent when it is 1: Triton makes it a constant), then n_cols and one stride per tensor."""
    return [8] * n_pointers + ([] if n_rows == 1 else [4]) + [4] * (1 + n_pointers)


def scratch_count(sizes: list[int], expected: list[int], metadata) -> int | None:
    """How many trailing scratch pointers a kernel with parameter ``sizes`` takes after ``expected``, when the C++
    launch can pass them as null (Triton allotted no scratch memory, one CTA, no cluster); None when it cannot."""
    extra = sizes[len(expected):]
    if sizes[:len(expected)] != expected or len(extra) > 2 or any(s != 8 for s in extra):
        return None
    if getattr(metadata, "global_scratch_size", 0) or getattr(metadata, "profile_scratch_size", 0):
        return None
    if getattr(metadata, "num_ctas", 1) != 1 or tuple(getattr(metadata, "cluster_dims", (1, 1, 1)) or (1, 1, 1)) \
            not in ((1, 1, 1), (1,), ()):
        return None
    return len(extra)


def _compiled(kernel, args, cfg, device) -> tuple[int, int, int, object] | None:
    """(handle, threads, shared bytes, metadata) of the variant Triton compiled for ``args`` with ``cfg``."""
    with torch.cuda.device(device):
        compiled = kernel.warmup(*args, ROWS=cfg.rows, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, grid=cfg.grid)
        if getattr(compiled, "function", None) is None:
            compiled._init_handles()
    md = compiled.metadata
    return int(compiled.function), md.num_warps * 32, md.shared, md


def _register(kind: str, tensors: tuple[torch.Tensor, ...]) -> None:
    """Register Triton's variant for these tensors (the inputs and outputs of one launch) if the C++ launch fits it."""
    sw = importlib.import_module("kernels.swiglu")
    ext, gate = _state["ext"], tensors[0] if kind == "fwd" else tensors[1]
    n_rows = gate.numel() // COLS
    props = runtime.device_props(gate.device)
    cfg = (sw._forward_config if kind == "fwd" else sw._backward_config)(n_rows, COLS, props)
    if cfg.grid != (n_rows, 1) or cfg.rows != 1 or cfg.block_n != COLS:
        return  # not the one-row-per-program layout the C++ launch assumes
    kernel = sw._swiglu_fwd_kernel if kind == "fwd" else sw._swiglu_bwd_kernel
    args = (*tensors, n_rows, COLS, *(COLS,) * len(tensors))
    handle, threads, shared, md = _compiled(kernel, args, cfg, gate.device)
    n_scratch = scratch_count(param_sizes(handle), expected_sizes(len(tensors), n_rows), md)
    if n_scratch is None:
        return
    register = ext.register_forward if kind == "fwd" else ext.register_backward
    register(*tensors, handle, threads, shared, n_scratch)


def _forward_fallback(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    # A miss in the C++ table: the Python path's launch (which compiles), then its variant registered.
    y = importlib.import_module("kernels.swiglu").swiglu_forward(gate, up)
    _register("fwd", (gate, up, y))
    return y


def _backward_fallback(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    sw = importlib.import_module("kernels.swiglu")
    d_gate, d_up = ops.call(sw.swiglu_bwd_op, dy, gate, up)
    if (ops.direct(dy, gate, up) and dy.is_contiguous() and dy.dtype == gate.dtype and dy.shape == gate.shape):
        _register("bwd", (dy, gate, up, d_gate, d_up))
    return d_gate, d_up
