"""The host path in C++ of SwiGLU, RoPE and RMSNorm: the autograd nodes and the kernel launches out
of Python, on a GPU.

``kernels.bench.overhead.floor`` shows why: an ``autograd.Function`` that launches one *empty*
Triton kernel per pass costs more host time per forward + backward than Hugging Face's whole SwiGLU
in C++ operators, so where the host decides (small tensors, or kernels as short as RoPE's), no
Python-level operator can keep up. ``kernels/csrc/host_path.cpp`` holds three C++
``torch::autograd::Function``s that launch the very kernels of ``kernels/swiglu.py``,
``kernels/rope.py`` and ``kernels/rmsnorm.py``, compiled by Triton as always, through the CUDA
driver (``cuLaunchKernel``) with the handles Triton returns.

How a variant gets there. The first call with a given set of argument properties (those Triton
specialises on: 16-byte alignment of each pointer, an integer equal to 1 or divisible by 16; and
what the launch configuration depends on) misses in the C++ table and calls back into Python, which
runs the Python path, asks Triton for the kernel it compiled for exactly those arguments
(``JITFunction.warmup``), checks the kernel's parameter list against what the C++ launch passes
(``cuFuncGetParamInfo``: a mismatch, say from another Triton version, leaves that variant to the
Python path) and registers it. Every later call with the same properties runs in C++ only.

``swiglu`` takes this path for dense ``gate`` and ``up`` whose size divides into rows of 1,024
(every Llama MLP) without ``inplace_backward``; ``apply_rotary`` for the layouts of its dense kernel
(Llama's q and k) when cos and sin need no gradient; ``rms_norm`` for contiguous ``x`` and
``weight`` (and, in the backward, a contiguous incoming gradient). All only eagerly, on a GPU;
everything else (strided views, ``torch.compile``, tensor subclasses, dispatch modes, the
interpreter) takes the Python path, with the same kernels and the same bits. The extension is
compiled on first use (``torch.utils.cpp_extension``; one line says so before it starts: about
``HOST_PATH_BUILD_SECONDS`` seconds of one CPU core, minutes on a busy machine), then cached by
PyTorch in its extensions directory (``TORCH_EXTENSIONS_DIR``); ``python -m kernels.prebuild``
builds it ahead of time. ``KERNELS_HOST_PATH=0`` turns the path off, and a machine without a C++
compiler or ninja runs the Python path (``cpu_build_unavailable`` says which is missing;
``kernels.cuda_rmsnorm`` asks it too before its builds).

The just-in-time builds of the package (this one and ``kernels.cuda_rmsnorm``'s two) share the
helpers of the build section below: ``load_announced`` prints one line before a build that will
compile (what, why, for which architecture, about how long) and nothing when PyTorch's cache already
holds it; ``cuda_arch_list`` picks the GPU architectures a CUDA build compiles for.

What it launches comes from the kernel families themselves. This module sits below them (their
functions ask ``takes``, ``takes_rope`` and ``takes_rms_norm`` here, then call ``swiglu``, ``rope``
or ``rms_norm``) and imports none of them: ``kernels/swiglu.py``, ``kernels/rope.py`` and
``kernels/rmsnorm.py`` each hand over, when imported, their kernels, launch configurations and
Python path with ``register_family`` (a ``SwiGLUFamily``, ``RopeFamily`` or ``RMSNormFamily``),
which the build and every miss read.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from . import ops, runtime

# The C++ and CUDA sources of the package, shipped as package data (pyproject.toml): this module's
# and those of kernels.cuda_rmsnorm, which takes the folder and the build checks below from here.
CSRC = Path(__file__).resolve().parent / "csrc"
SOURCE = CSRC / "host_path.cpp"
EXTENSION = "kernels_host_path"
_MAX_INT = 2**31 - 1  # the C++ launch passes integers as 32-bit, as Triton types them below this

_lock = threading.Lock()
# cols: the row width dense SwiGLU tensors are read as (SwiGLUFamily.cols), handed to C++ at the
# build.
_state: dict = {"ext": None, "reason": None, "seconds": None, "cols": None}


# --------------------------------------------------------------------------------------------------
# What the kernel families hand over
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SwiGLUFamily:
    """What the host path takes from ``kernels.swiglu``: its Python path, launch configurations and
    kernels."""

    module: ClassVar[str] = "kernels.swiglu"
    cols: int  # the row width dense gate and up are read as (swiglu's recut rows), one tile per program
    forward: Callable  # swiglu_forward(gate, up): the Python path's forward launch
    # swiglu_bwd(dy, gate, up), called through ops.call on a missed backward
    backward_op: torch._ops.OpOverload
    forward_config: Callable  # (n_rows, n_cols, props) -> Config, as the Python path's launches ask for it
    backward_config: Callable  # the same for the backward kernel
    forward_kernel: object  # the @triton.jit kernels the C++ side launches by handle
    backward_kernel: object


@dataclass(frozen=True)
class RopeFamily:
    """What the host path takes from ``kernels.rope``: its Python path, launch configuration and
    dense kernel."""

    module: ClassVar[str] = "kernels.rope"
    forward: Callable  # rope_forward(q, k, cos, sin): the Python path's forward launch
    backward_op: torch._ops.OpOverload  # rope_bwd(dq_embed, dk_embed, cos, sin, dtype, seq_major)
    config: Callable  # (n_rows, head_dim, n_q_heads, n_k_heads, props) -> Config, both directions
    dense_flags: Callable  # (q, k, cos, sin, q_out, k_out) -> the dense kernel's layout flags, or None
    dense_kernel: object  # the @triton.jit kernel the C++ side launches by handle


@dataclass(frozen=True)
class RMSNormFamily:
    """What the host path takes from ``kernels.rmsnorm``: its Python path, launch configurations and
    kernels."""

    module: ClassVar[str] = "kernels.rmsnorm"
    forward: Callable  # rms_norm_forward(x, weight, eps) -> (y, rstd): the Python path's forward launch
    backward_op: torch._ops.OpOverload  # rms_norm_bwd(dy, x, weight, rstd, compute_dw)
    forward_config: Callable  # (n_rows, n_cols, props) -> ForwardConfig
    backward_config: Callable  # (n_rows, n_cols, itemsize, props) -> BackwardConfig
    forward_kernel: object  # the @triton.jit kernels the C++ side launches by handle
    backward_kernel: object
    dw_kernel: object


_FAMILIES = (SwiGLUFamily, RopeFamily, RMSNormFamily)
_families_given: dict[type, SwiGLUFamily | RopeFamily | RMSNormFamily] = {}


def register_family(family: SwiGLUFamily | RopeFamily | RMSNormFamily) -> None:
    """Hand the host path what it launches and falls back to for one kernel family.

    Each family's module calls this once, when it is imported; a later call for the same family
    replaces the earlier one.

    Args:
        family: a ``SwiGLUFamily``, ``RopeFamily`` or ``RMSNormFamily``.

    Raises:
        TypeError: for anything else.
    """
    if not isinstance(family, _FAMILIES):
        raise TypeError(f"family must be a SwiGLUFamily, RopeFamily or RMSNormFamily, got {type(family).__name__}")
    _families_given[type(family)] = family


def _family(kind: type):
    found = _families_given.get(kind)
    if found is None:
        raise RuntimeError(f"no {kind.__name__}: {kind.module} hands it over with register_family when imported")
    return found


# --------------------------------------------------------------------------------------------------
# What a C++ build needs: a compiler and ninja (kernels.cuda_rmsnorm asks the same before its
# builds)
# --------------------------------------------------------------------------------------------------


def _make_ninja_findable() -> bool:
    """True when ``ninja`` can be run. PyTorch looks for it on PATH; the ``ninja`` package from pip
    installs it in the environment's ``bin`` folder, which is not on PATH when Python is started
    without activating the environment (a Jupyter kernel, for instance): add that folder if so."""
    from torch.utils.cpp_extension import is_ninja_available

    if is_ninja_available():
        return True
    try:
        import ninja  # the pip package: a ninja binary in ninja.BIN_DIR
    except ImportError:
        return False
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    return is_ninja_available()


def cpu_build_unavailable() -> str | None:
    """Say why a C++ extension (this one, or the CPU part of any) cannot be built here.

    Puts the ``ninja`` of pip's package on ``PATH`` when only that is missing (see
    ``_make_ninja_findable``). ``python -m kernels.prebuild`` asks it first, and chapter 13 through
    ``kernels.cuda_rmsnorm``.

    Returns:
        The reason (no C++ compiler, or no ninja) with its fix, or None when it can be built.
    """
    from torch.utils.cpp_extension import get_cxx_compiler

    compiler = get_cxx_compiler()
    if shutil.which(compiler) is None:
        return f"no C++ compiler: `{compiler}` is not on PATH (install g++ or clang++, or set CXX)"
    if not _make_ninja_findable():
        return "ninja is not installed: `pip install ninja` (torch.utils.cpp_extension builds with it)"
    return None


# --------------------------------------------------------------------------------------------------
# Just-in-time builds that say what they do: one line before a build compiles, nothing when the
# cache is warm
# --------------------------------------------------------------------------------------------------

# About how long a cold build of this extension takes, for the line that announces it: one compiler
# process, so a machine with more cores is faster only by faster cores. The build time this rounds
# up is in assets/notes/overhead.md ("Build times").
HOST_PATH_BUILD_SECONDS = 60
_STAMP = "kernels-build.key"  # in the build folder: the key of the sources and flags last built there


def cuda_arch_list(env_value: str | None, capabilities: Iterable[tuple[int, int]]) -> tuple[str, str]:
    """Choose the architectures a CUDA build compiles for, and say where they came from.

    ``env_value`` wins when it is set to anything but empty or ``native``; otherwise the build is
    for the GPUs of this machine, from their compute capabilities (``(9, 0)`` -> ``"9.0"``), each
    once, in order. One architecture compiles in a fraction of the time of the six or more that a
    container's ``TORCH_CUDA_ARCH_LIST`` may name, and runs on exactly this GPU.

    Args:
        env_value: the ``TORCH_CUDA_ARCH_LIST`` environment variable, or None when unset.
        capabilities: ``(major, minor)`` of each GPU of this machine.

    Returns:
        ``(arch_list, source)``: the list as ``TORCH_CUDA_ARCH_LIST`` spells it, and
        ``"TORCH_CUDA_ARCH_LIST"`` or ``"this machine's GPU"``.

    Raises:
        ValueError: when neither is given (no GPU and no variable: nothing to build for).
    """
    wanted = (env_value or "").strip()
    if wanted and wanted != "native":
        return wanted, "TORCH_CUDA_ARCH_LIST"
    archs = sorted({(int(major), int(minor)) for major, minor in capabilities})
    if not archs:
        raise ValueError("no GPU found and TORCH_CUDA_ARCH_LIST is not set: no architecture to compile for "
                         "(set TORCH_CUDA_ARCH_LIST, e.g. '9.0;10.0', to build without a GPU)")
    return ";".join(f"{major}.{minor}" for major, minor in archs), "this machine's GPU"


def split_arch_list(arch_list: str) -> list[str]:
    """Split a ``TORCH_CUDA_ARCH_LIST`` into its entries.

    Args:
        arch_list: entries separated by semicolons, spaces or commas, as PyTorch accepts.

    Returns:
        The non-empty entries, in order (``"9.0;10.0+PTX"`` -> ``["9.0", "10.0+PTX"]``).
    """
    return [arch for arch in arch_list.replace(",", ";").replace(" ", ";").split(";") if arch]


def arch_names(arch_list: str) -> str:
    """Name the architectures of a ``TORCH_CUDA_ARCH_LIST`` as nvcc does, for messages.

    Args:
        arch_list: a ``TORCH_CUDA_ARCH_LIST`` value (see ``split_arch_list``).

    Returns:
        e.g. ``"9.0;10.3+PTX"`` -> ``"sm_90, sm_103 (+PTX)"``.
    """
    names = []
    for arch in split_arch_list(arch_list):
        base, ptx, _ = arch.partition("+PTX")
        names.append("sm_" + base.replace(".", "") + (" (+PTX)" if ptx else ""))
    return ", ".join(names)


@contextmanager
def arch_list_set(arch_list: str | None):
    """Set ``TORCH_CUDA_ARCH_LIST`` for the duration of a ``with`` block (PyTorch's build reads it).

    The variable's earlier value (or its absence) is restored on leaving, also on an error.

    Args:
        arch_list: the value to set; None leaves the variable as it is.
    """
    before = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if arch_list is not None:
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = before


def build_directory_for(name: str, build_directory: str | None = None) -> Path:
    """Find the folder PyTorch builds extension ``name`` in.

    Args:
        name: the extension's name.
        build_directory: a folder chosen by the caller, returned as it is.

    Returns:
        ``build_directory``, or else the folder ``name`` in PyTorch's extensions directory
        (``TORCH_EXTENSIONS_DIR``, else ``~/.cache/torch_extensions/<python and CUDA version>``).
    """
    if build_directory is not None:
        return Path(build_directory)
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def build_key(sources: Iterable[Path], options: dict) -> str:
    """Hash what a build's result depends on: the sources, the build options and PyTorch's version.

    The same key means PyTorch's cache holds the build; another means it compiles again.

    Args:
        sources: the source files, whose bytes are read.
        options: the build options (flags, architectures), compared through their ``repr``.

    Returns:
        The SHA-256 hex digest.
    """
    digest = hashlib.sha256(torch.__version__.encode())
    for source in sources:
        digest.update(Path(source).read_bytes())
    digest.update(repr(sorted(options.items())).encode())
    return digest.hexdigest()


def build_state(name: str, folder: Path, key: str, sources: Iterable[Path] = ()) -> str | None:
    """Say why a build of ``name`` in ``folder`` would compile, or None when the cache is warm.

    A library without a key (built before keys were kept) counts as warm when it is newer than
    every source.

    Args:
        name: the extension's name (its library is ``<name>*.so`` in ``folder``).
        folder: the build folder (``build_directory_for``).
        key: the ``build_key`` of the build about to run.
        sources: the source files, for a library built without a key.

    Returns:
        "not built yet here", or that the sources, flags or PyTorch changed; None when the folder
        holds a library built from exactly this key.
    """
    stamp = folder / _STAMP
    libraries = list(folder.glob(f"{name}*.so"))
    if not libraries:
        return "not built yet here"
    if not stamp.exists():
        newest_source = max((Path(s).stat().st_mtime for s in sources), default=float("inf"))
        return None if min(p.stat().st_mtime for p in libraries) >= newest_source else "not built yet here"
    if stamp.read_text().strip() != key:
        return "its sources, flags or PyTorch changed since the last build"
    return None


def announce_build(line: str) -> None:
    """Print the line that announces a build (to stderr, where a notebook shows it under the cell).

    Chapters 03 and 17 show such a line in their outputs.

    Args:
        line: the announcement, as ``load_announced`` writes it.
    """
    print(line, file=sys.stderr, flush=True)


def home_relative(path: Path) -> str:
    """Write ``path`` with the home folder as ``~``: what a message shows, the same on every machine.

    Args:
        path: a path, inside the home folder or not.

    Returns:
        ``~/...`` for a path inside the home folder, else ``path`` as it is.
    """
    try:
        return str(Path("~") / Path(path).resolve().relative_to(Path.home().resolve()))
    except ValueError:
        return str(path)


def load_announced(name: str, sources: list[Path], what: str, seconds: str,
                   build_directory: str | None = None,
                   arch_list: str | None = None, **options):
    """``torch.utils.cpp_extension.load`` of ``sources`` as extension ``name``, announced when it compiles.

    The line reads ``kernels: compiling <what> (<sources>): <why>; <seconds>, then cached in
    <folder>``; nothing is printed when the cache is warm. After the load the folder's key file
    records what it now holds (``build_key``).

    Args:
        name: the extension's name.
        sources: its source files.
        what: what is compiled, in words, for the line.
        seconds: about how long it takes, in words, for the line.
        build_directory: a folder replacing PyTorch's extensions cache (``build_directory_for``).
        arch_list: the ``TORCH_CUDA_ARCH_LIST`` of a CUDA build, set for the build's duration
            (None for C++ only).
        **options: passed on to ``load`` (flags, ``verbose``, ``is_python_module``, ...).

    Returns:
        What ``load`` returns: the module, or the library's path for ``is_python_module=False``.
    """
    from torch.utils.cpp_extension import load

    folder = build_directory_for(name, build_directory)
    # verbose changes what ninja prints, not what it builds
    key = build_key(sources,
                    {**{k: v for k, v in options.items() if k != "verbose"}, "arch_list": arch_list})
    why = build_state(name, folder, key, sources)
    if why is not None:
        files = ", ".join(f"kernels/csrc/{Path(s).name}" for s in sources)
        announce_build(f"kernels: compiling {what} ({files}): {why}; {seconds}, then cached in {home_relative(folder)}")
    with arch_list_set(arch_list):
        result = load(name=name, sources=[str(s) for s in sources], build_directory=build_directory,
                      **options)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / _STAMP).write_text(key + "\n")  # what the folder now holds
    return result


# --------------------------------------------------------------------------------------------------
# The path: can it run here, is it built, does a call take it
# --------------------------------------------------------------------------------------------------


def unavailable() -> str | None:
    """Say why the C++ host path cannot be used here, before any build is tried.

    Returns:
        The reason (turned off by ``KERNELS_HOST_PATH=0``, no GPU, a CUDA driver too old, or no
        C++ compiler or ninja), or None when the path can be built.
    """
    if os.environ.get("KERNELS_HOST_PATH", "1") == "0":
        return "turned off (KERNELS_HOST_PATH=0)"
    if runtime.MODE != "gpu":
        return "no GPU: the Triton interpreter runs the Python path"
    if _driver_function("cuLaunchKernel") is None or _driver_function("cuFuncGetParamInfo") is None:
        return "the CUDA driver library has no cuLaunchKernel or cuFuncGetParamInfo (a driver for CUDA 12.4+)"
    return cpu_build_unavailable()


def extension():
    """The built extension, compiled and loaded on the first call; None (with the reason in
    ``status()``) when the path cannot be used here. A failed build warns once and leaves every call
    on the Python path."""
    if _state["ext"] is not None or _state["reason"] is not None:
        return _state["ext"]
    with _lock:
        if _state["ext"] is None and _state["reason"] is None:
            reason = unavailable()
            if reason is None:
                try:
                    _state["ext"] = _build()
                except Exception as exc:  # noqa: BLE001  (any build failure leaves the Python path, with a warning)
                    last = (str(exc).strip().splitlines() or [""])[-1]
                    reason = f"the C++ build failed ({type(exc).__name__}: {last})"
                    warnings.warn(f"kernels.swiglu, apply_rotary and rms_norm run their Python host path: {reason}",
                                  stacklevel=3)
            _state["reason"] = reason
    return _state["ext"]


def status() -> dict:
    """Report whether the path is built, why not, how long the build took, and its kernel variants.

    Returns:
        ``built`` (bool), ``reason`` (why not, or None), ``build_seconds`` (None before a build)
        and ``variants`` (how many kernel variants the C++ table holds).
    """
    ext = _state["ext"]
    return {"built": ext is not None, "reason": _state["reason"], "build_seconds": _state["seconds"],
            "variants": ext.n_variants() if ext is not None else 0}


def takes(gate: torch.Tensor, up: torch.Tensor, inplace_backward: bool) -> bool:
    """Tell whether ``swiglu(gate, up)`` runs through the C++ node (inputs already checked by ``swiglu``).

    Builds the extension on the first call that could take the path.

    Args:
        gate, up: ``swiglu``'s inputs.
        inplace_backward: ``swiglu``'s flag; the C++ node does not take it.

    Returns:
        True for eager, contiguous CUDA inputs without ``inplace_backward`` whose size divides into
        rows of the family's width (a 32-bit count of them), once the extension is built.
    """
    # ops.direct first: under torch.compile it is False, and nothing after it adds guards on sizes
    # to the graph.
    return (ops.direct(gate, up) and not inplace_backward and gate.is_cuda and gate.is_contiguous()
            and up.is_contiguous() and extension() is not None and gate.numel() % _state["cols"] == 0
            and gate.numel() // _state["cols"] <= _MAX_INT)


def swiglu(gate: torch.Tensor, up: torch.Tensor, with_grad: bool) -> torch.Tensor:
    """``silu(gate) * up`` through the C++ node; call only where ``takes`` said True.

    Args:
        gate, up: ``swiglu``'s inputs.
        with_grad: record the node for autograd; False runs the forward alone.

    Returns:
        The activation, of ``gate``'s shape.
    """
    return _state["ext"].swiglu(gate, up, with_grad)


def takes_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Tell whether ``apply_rotary(q, k, cos, sin)`` runs through the C++ node (inputs already checked).

    Layouts the dense kernel does not read are found in C++ and handed back to the Python path
    there. Builds the extension on the first call that could take the path.

    Args:
        q, k, cos, sin: ``apply_rotary``'s inputs.

    Returns:
        True for eager CUDA inputs with a non-empty head dimension, cos and sin that need no
        gradient, and 32-bit row counts, once the extension is built.
    """
    return (ops.direct(q, k, cos,
                       sin) and q.is_cuda and q.size(3) > 0 and not (cos.requires_grad or sin.requires_grad)
            and q.size(0) * q.size(2) <= _MAX_INT and extension() is not None)


def rope(q, k, cos, sin, with_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k through the C++ node; call only where ``takes_rope`` said True.

    Args:
        q, k, cos, sin: ``apply_rotary``'s inputs.
        with_grad: record the node for autograd; False runs the forward alone.

    Returns:
        ``(q_embed, k_embed)``.
    """
    return _state["ext"].rope(q, k, cos, sin, with_grad)


def takes_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Tell whether ``rms_norm(x, weight)`` runs through the C++ node (inputs checked by ``rms_norm``).

    Builds the extension on the first call that could take the path.

    Args:
        x, weight: ``rms_norm``'s inputs.

    Returns:
        True for eager, contiguous, non-empty CUDA inputs with a 32-bit row count, once the
        extension is built.
    """
    return (ops.direct(x,
                       weight) and x.is_cuda and x.is_contiguous() and weight.is_contiguous() and x.numel() > 0
            and x.numel() // x.size(-1) <= _MAX_INT and extension() is not None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, with_grad: bool) -> torch.Tensor:
    """RMSNorm through the C++ node; call only where ``takes_rms_norm`` said True.

    Args:
        x, weight, eps: ``rms_norm``'s inputs.
        with_grad: record the node for autograd; False runs the forward alone.

    Returns:
        The normalised output, as ``kernels.rms_norm`` gives it.
    """
    return _state["ext"].rms_norm(x, weight, eps, with_grad)


# --------------------------------------------------------------------------------------------------
# The driver, the build, and the variants
# --------------------------------------------------------------------------------------------------


@functools.cache
def _libcuda():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def _driver_function(name: str):
    lib = _libcuda()
    return getattr(lib, name, None) if lib is not None else None


def _build():
    # every family's misses come back to Python through the launcher: all three, or no build
    for kind in _FAMILIES:
        _family(kind)
    start = time.perf_counter()
    # C++ only (CUDA's headers, no device code): nothing is compiled per GPU architecture.
    ext = load_announced(EXTENSION, [SOURCE], "the C++ host path of SwiGLU, RoPE and RMSNorm, C++ only",
                         f"about {HOST_PATH_BUILD_SECONDS} s of one CPU core", with_cuda=True,
                         extra_cflags=["-O2"], verbose=False)
    _state["seconds"] = time.perf_counter() - start
    launch = ctypes.cast(_driver_function("cuLaunchKernel"), ctypes.c_void_p).value
    _state["cols"] = _family(SwiGLUFamily).cols
    ext.set_launcher(launch, _state["cols"], _swiglu_forward_fallback, _swiglu_backward_fallback,
                     _rope_forward_fallback, _rope_backward_fallback, _rms_norm_forward_fallback,
                     _rms_norm_backward_fallback)
    return ext


def param_sizes(function: int) -> list[int]:
    """Read the byte size of each parameter of a loaded kernel (``cuFuncGetParamInfo``).

    Args:
        function: the kernel's ``CUfunction`` handle, as an integer.

    Returns:
        The sizes in bytes, in parameter order.
    """
    get = _driver_function("cuFuncGetParamInfo")
    offset, size, sizes = ctypes.c_size_t(), ctypes.c_size_t(), []
    while get(ctypes.c_void_p(function), ctypes.c_size_t(len(sizes)), ctypes.byref(offset),
              ctypes.byref(size)) == 0:
        sizes.append(size.value)
    return sizes


def expected_sizes(n_pointers: int, ints: list[int], n_floats: int = 0) -> list[int]:
    """List the parameter sizes the C++ launch passes before any scratch pointers.

    The tensors' pointers, then each integer as a 32-bit value, except those equal to 1, which
    Triton makes constants of the variant, then each float as 32 bits (a kernel's floats must come
    after its integers: sizes alone cannot tell the two apart).

    Args:
        n_pointers: how many tensor pointers lead.
        ints: the integer arguments' values.
        n_floats: how many float arguments follow.

    Returns:
        The sizes in bytes, to compare with ``param_sizes``.
    """
    return [8] * n_pointers + [4 for v in ints if v != 1] + [4] * n_floats


def scratch_count(sizes: list[int], expected: list[int], metadata) -> int | None:
    """Count the trailing scratch pointers a kernel takes after the parameters the C++ launch passes.

    Args:
        sizes: the kernel's parameter sizes (``param_sizes``).
        expected: what the C++ launch passes (``expected_sizes``).
        metadata: the compiled kernel's metadata (scratch sizes, CTAs, cluster).

    Returns:
        The number of scratch pointers (at most 2) when the launch can pass them as null (Triton
        allotted no scratch memory, one CTA, no cluster); None when ``sizes`` does not start with
        ``expected`` or it cannot.
    """
    extra = sizes[len(expected):]
    if sizes[:len(expected)] != expected or len(extra) > 2 or any(s != 8 for s in extra):
        return None
    if getattr(metadata, "global_scratch_size", 0) or getattr(metadata, "profile_scratch_size", 0):
        return None
    if getattr(metadata, "num_ctas",
               1) != 1 or tuple(getattr(metadata, "cluster_dims", (1, 1, 1)) or (1, 1, 1)) \
            not in ((1, 1, 1), (1,), ()):
        return None
    return len(extra)


def _compiled(kernel, args, constants: dict, grid, device) -> tuple[int, int, int, object]:
    """(handle, threads, shared bytes, metadata) of the variant Triton compiled for ``args`` and
    ``constants``."""
    with torch.cuda.device(device):
        compiled = kernel.warmup(*args, grid=grid, **constants)
        if getattr(compiled, "function", None) is None:
            compiled._init_handles()
    md = compiled.metadata
    return int(compiled.function), md.num_warps * 32, md.shared, md


def _checked(kernel, tensors, ints, constants, grid, device, floats=()) -> tuple | None:
    """The registration of Triton's variant for these arguments, if its parameter list fits the C++
    launch."""
    handle, threads, shared, md = _compiled(kernel, (*tensors, *ints, *floats), constants, grid, device)
    n_scratch = scratch_count(param_sizes(handle), expected_sizes(len(tensors), ints, len(floats)), md)
    return None if n_scratch is None else (handle, threads, shared, n_scratch)


def _register_swiglu(backward: bool, tensors: tuple[torch.Tensor, ...]) -> None:
    sw = _family(SwiGLUFamily)
    gate, cols = tensors[1] if backward else tensors[0], _state["cols"]
    n_rows = gate.numel() // cols
    cfg = (sw.backward_config if backward else sw.forward_config)(n_rows, cols,
                                                                  runtime.device_props(gate.device))
    if cfg.grid != (n_rows, 1) or cfg.rows != 1 or cfg.block_n != cols:
        return  # not the one-row-per-program layout the C++ launch assumes
    kernel = sw.backward_kernel if backward else sw.forward_kernel
    ints = [n_rows, cols] + [cols] * len(tensors)  # the row count, the columns, one stride per tensor
    constants = {"ROWS": cfg.rows, "BLOCK_N": cfg.block_n, "num_warps": cfg.num_warps}
    found = _checked(kernel, tensors, ints, constants, cfg.grid, gate.device)
    if found is not None:
        _state["ext"].register_swiglu(backward, list(tensors), *found)


def _register_rope(backward: bool, tensors: tuple[torch.Tensor, ...]) -> None:
    rope = _family(RopeFamily)
    x, y, cos, sin, x_out, y_out = tensors
    flags = rope.dense_flags(*tensors)
    batch, n_x, seq, head_dim = x.shape
    n_rows = batch * seq
    cfg = rope.config(n_rows, head_dim, n_x, y.shape[1], runtime.device_props(x.device))
    if flags is None or cfg.grid != (n_rows,) or cfg.rows != 1:
        return  # not the dense kernel, one position per program, that the C++ launch assumes
    constants = {"N_Q": n_x, "N_K": y.shape[1], "HALF": head_dim // 2, "ROWS": cfg.rows,
                 "BLOCK_H": cfg.block_h,
                 "Q_HEADS": cfg.q_heads, "K_HEADS": cfg.k_heads, "BACKWARD": backward,
                 "X_SEQ_MAJOR": flags[0],
                 "O_SEQ_MAJOR": flags[1], "TRIG_BATCHED": flags[2], "num_warps": cfg.num_warps}
    found = _checked(rope.dense_kernel, tensors, [n_rows, seq], constants, cfg.grid, x.device)
    if found is not None:
        _state["ext"].register_rope(backward, list(tensors), *found)


def _register_rms_norm_forward(x, weight, y, rstd, eps: float) -> None:
    rms = _family(RMSNormFamily)
    n_cols = x.size(-1)
    n_rows = x.numel() // n_cols
    cfg = rms.forward_config(n_rows, n_cols, runtime.device_props(x.device))
    constants = {"ROWS": cfg.rows, "BLOCK_N": cfg.block_n, "num_warps": cfg.num_warps}
    found = _checked(rms.forward_kernel, (x, weight, y, rstd), [n_rows, n_cols, n_cols, n_cols], constants,
                     cfg.grid, x.device, floats=(eps,))
    if found is not None:
        _state["ext"].register_rms_norm(0, [x, weight, y, rstd], False, *found, cfg.rows, 0)


def _register_rms_norm_backward(dy, x, weight, rstd, dx, dw, compute_dw: bool) -> None:
    # The backward kernel and, with dW, the sum of its partials: both or neither, as the C++ side
    # needs both.
    rms = _family(RMSNormFamily)
    n_cols = x.size(-1)
    n_rows = x.numel() // n_cols
    props = runtime.device_props(x.device)
    cfg = rms.backward_config(n_rows, n_cols, x.element_size(), props)
    programs = cfg.grid[0]
    if programs != max(1, min(props.sm_count, -(-n_rows // cfg.rows))):
        return  # not the persistent grid the C++ launch computes
    partial = torch.empty((programs, n_cols), dtype=torch.float32, device=x.device) if compute_dw else dx
    constants = {"ROWS": cfg.rows, "BLOCK_N": cfg.block_n, "COMPUTE_DW": compute_dw, "STAGES": cfg.stages,
                 "num_warps": cfg.num_warps}
    found = _checked(rms.backward_kernel, (x, weight, dy, rstd, dx, partial), [n_rows] + [n_cols] * 4,
                     constants, cfg.grid, x.device)
    dw_found = None
    if compute_dw:
        dw_constants = {"BLOCK_P": cfg.dw_block_p, "BLOCK_C": cfg.dw_block_c, "num_warps": 4}
        dw_found = _checked(rms.dw_kernel, (partial, dw), [programs, n_cols], dw_constants, cfg.dw_grid,
                            x.device)
    if found is None or (compute_dw and dw_found is None):
        return
    ext = _state["ext"]
    ext.register_rms_norm(1, [x, weight, dy, rstd, dx], compute_dw, *found, cfg.rows, props.sm_count)
    if compute_dw:
        ext.register_rms_norm(2, [partial, dw], False, *dw_found, 1, cfg.dw_grid[0])


# What the C++ side calls on a miss: the Python path's launch (which compiles), then its variant
# registered.


def _swiglu_forward_fallback(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    y = _family(SwiGLUFamily).forward(gate, up)
    _register_swiglu(False, (gate, up, y))
    return y


def _swiglu_backward_fallback(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    d_gate, d_up = ops.call(_family(SwiGLUFamily).backward_op, dy, gate, up)
    if ops.direct(dy, gate, up) and dy.is_contiguous() and dy.dtype == gate.dtype and dy.shape == gate.shape:
        _register_swiglu(True, (dy, gate, up, d_gate, d_up))
    return d_gate, d_up


def _rope_forward_fallback(q, k, cos, sin):
    q_out, k_out = _family(RopeFamily).forward(q, k, cos, sin)
    # A layout the dense kernel does not read (a copy made by the Python path included) registers
    # nothing.
    _register_rope(False, (q, k, cos, sin, q_out, k_out))
    return q_out, k_out


def _rope_backward_fallback(dq_embed, dk_embed, cos, sin, like: torch.Tensor, seq_major: bool):
    dq, dk = ops.call(_family(RopeFamily).backward_op, dq_embed, dk_embed, cos, sin, like.dtype, seq_major)
    # The C++ side takes only gradients of one dtype; layouts are checked where the variant is
    # registered.
    if ops.direct(dq_embed, dk_embed, cos, sin) and dq_embed.dtype == dk_embed.dtype:
        _register_rope(True, (dq_embed, dk_embed, cos, sin, dq, dk))
    return dq, dk


def _rms_norm_forward_fallback(x: torch.Tensor, weight: torch.Tensor, eps: float):
    y, rstd = _family(RMSNormFamily).forward(x, weight, eps)
    _register_rms_norm_forward(x, weight, y, rstd, eps)
    return y, rstd


def _rms_norm_backward_fallback(dy, x, weight, rstd, compute_dw: bool):
    dx, dw = ops.call(_family(RMSNormFamily).backward_op, dy, x, weight, rstd, compute_dw)
    if ops.direct(dy, x, weight) and dy.is_contiguous() and dy.shape == x.shape:
        _register_rms_norm_backward(dy, x, weight, rstd, dx, dw, compute_dw)
    return dx, dw
