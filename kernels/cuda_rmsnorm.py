"""The RMSNorm of kernels/rmsnorm.py again, in C++: find the sources, build them just in time,
register, expose.

Two C++ extensions live in ``kernels/csrc``:

* ``rmsnorm_cuda.cu``: the fused forward and backward in CUDA C++, registered with ``TORCH_LIBRARY``
  as ``torch.ops.kernels_cuda.rms_norm_fwd`` / ``rms_norm_bwd`` (the same schemas as the Triton
  operators ``torch.ops.kernels.rms_norm_fwd`` / ``_bwd``). ``rms_norm_cuda(x, weight, eps)`` is the
  differentiable function over them. Needs a CUDA GPU and the CUDA compiler (nvcc).
* ``rmsnorm_cpu.cpp``: a small forward on the CPU, ``torch.ops.kernels_cpp.rms_norm_fwd``, built the
  same way (compiler, ``TORCH_LIBRARY``, fake implementation from Python), so the mechanics can be
  run and tested on a machine without a GPU. ``rms_norm_cpp(x, weight, eps)`` calls it.

Both are compiled by ``torch.utils.cpp_extension.load`` (with ninja) the first time they are asked
for, into PyTorch's extensions directory (``~/.cache/torch_extensions`` unless
``TORCH_EXTENSIONS_DIR`` says otherwise). PyTorch keys that build by name and by a hash of the
sources and flags, so a second process reuses it (a second or so to check and load) until a source
changes. A build that compiles says so in one line before it starts
(``kernels.host_path.load_announced``): the C++ extension takes about ``CPU_BUILD_SECONDS`` seconds
of one CPU core, the CUDA one about ``CUDA_BUILD_SECONDS_PER_ARCH`` per GPU architecture. The CUDA
extension is compiled for this machine's GPU only (``cuda_build_arch_list``;
``TORCH_CUDA_ARCH_LIST`` overrides), not for every architecture PyTorch supports. ``python -m
kernels.prebuild`` builds both ahead of time.

The libraries register their operators when loaded; no Python binding (pybind11) is involved. Fake
implementations, which ``torch.compile`` needs, are the Triton operators' own (same schema, same
outputs), registered here from Python.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from . import runtime
from .host_path import CSRC, arch_names, cpu_build_unavailable, cuda_arch_list, load_announced, split_arch_list
from .rmsnorm import check_tensors, rms_norm_bwd_fake, rms_norm_fwd_fake

CPU_SOURCE = CSRC / "rmsnorm_cpu.cpp"
CUDA_SOURCE = CSRC / "rmsnorm_cuda.cu"

CPU_EXTENSION = "kernels_cpp_rmsnorm"  # the build's name: its folder in the extensions directory
CUDA_EXTENSION = "kernels_cuda_rmsnorm"
CPU_NAMESPACE = "kernels_cpp"  # the operators' namespace, as TORCH_LIBRARY declares it in the source
CUDA_NAMESPACE = "kernels_cuda"

# -O2 for the C++ compiler; nvcc gets -O3 for the device code (its default host flags are
# PyTorch's).
CPU_FLAGS = ["-O2"]
CUDA_FLAGS = ["-O3", "-lineinfo"]

# About how long a cold build takes, for the line that announces it (one compiler process each: more
# cores do not make it faster). The CUDA source takes a host pass, shared by all architectures, and
# one device pass per architecture. The build times these round up are in
# assets/notes/cuda_rmsnorm.md ("Build times").
CPU_BUILD_SECONDS = 15
CUDA_BUILD_SECONDS_PER_ARCH = 30


@dataclass(frozen=True)
class BuildInfo:
    """One build of an extension, as ``build_cpu`` and ``build_cuda`` return it (chapter 13 prints it).

    Attributes:
        name: the extension's name (``CPU_EXTENSION`` or ``CUDA_EXTENSION``).
        library: the path of the shared library loaded.
        seconds: how long ``load`` took, compile included.
        compiled: whether the compiler ran (False: PyTorch's cache already held a build of these
            very sources).
        arch_list: the CUDA architectures compiled for, in ``TORCH_CUDA_ARCH_LIST``'s spelling;
            None for the C++ extension.
    """

    name: str
    library: str
    seconds: float
    compiled: bool
    # the CUDA architectures compiled for (TORCH_CUDA_ARCH_LIST's spelling); None: C++
    arch_list: str | None = None

    def describe(self) -> str:
        """Say in one line what the build did.

        Returns:
            The name, compiled or taken from the cache, the architectures, the seconds and the
            library's path.
        """
        how = "compiled" if self.compiled else "taken from PyTorch's build cache"
        archs = f" for {arch_names(self.arch_list)}" if self.arch_list else ""
        return f"{self.name}: {how}{archs} in {self.seconds:.2f} s ({self.library})"

    def to_json(self) -> dict:
        """Give the build's fields for a results file.

        Returns:
            The dataclass's fields by name (``dataclasses.asdict``).
        """
        return asdict(self)


# one build per extension and process: loaded libraries cannot be unloaded
_BUILDS: dict[str, BuildInfo] = {}


# --------------------------------------------------------------------------------------------------
# What a build needs: a C++ compiler and ninja (kernels.host_path checks both) and, for CUDA, nvcc
# and a GPU
# --------------------------------------------------------------------------------------------------


def cuda_build_unavailable() -> str | None:
    """Say why the CUDA extension cannot be built and run here (chapter 13 checks it first).

    Returns:
        The reason (no GPU, a PyTorch without CUDA, no nvcc, no C++ compiler or no ninja), or None
        when it can be built.
    """
    from torch.utils.cpp_extension import CUDA_HOME

    if not torch.cuda.is_available():
        return "no CUDA GPU here: the CUDA C++ RMSNorm needs one (the C++ CPU extension runs without)"
    if torch.version.cuda is None:
        return f"this PyTorch ({torch.__version__}) is not built with CUDA"
    if CUDA_HOME is None or not (Path(CUDA_HOME) / "bin" / "nvcc").exists():
        return "no CUDA compiler: nvcc was not found (set CUDA_HOME to the CUDA toolkit, e.g. /usr/local/cuda)"
    return cpu_build_unavailable()  # nvcc hands the host code to the C++ compiler, and ninja drives both


# --------------------------------------------------------------------------------------------------
# Building and registering
# --------------------------------------------------------------------------------------------------


def _library_mtime(name: str, build_directory: str | None) -> float | None:
    from torch.utils.cpp_extension import _get_build_directory

    folder = Path(build_directory or _get_build_directory(name, verbose=False))
    found = sorted(folder.glob(f"{name}*.so"))
    return max(p.stat().st_mtime for p in found) if found else None


def cuda_build_arch_list() -> tuple[str, str]:
    """Choose the architectures the CUDA extension compiles for.

    ``TORCH_CUDA_ARCH_LIST`` when set, else the compute capability of each GPU of this machine
    (``kernels.host_path.cuda_arch_list`` decides).

    Returns:
        ``(arch_list, source)``: the list in ``TORCH_CUDA_ARCH_LIST``'s spelling, and where it came
        from, in words.
    """
    capabilities = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
    return cuda_arch_list(os.environ.get("TORCH_CUDA_ARCH_LIST"), capabilities)


def _build(name: str, sources: list[Path], verbose: bool, build_directory: str | None, what: str,
           seconds: str,
           arch_list: str | None = None, **flags) -> BuildInfo:
    before = _library_mtime(name, build_directory)
    start = time.perf_counter()
    # is_python_module=False: load the shared library into the process (torch.ops.load_library),
    # which runs its TORCH_LIBRARY registrations; no Python module, so no pybind11 to compile.
    library = load_announced(name, sources, what, seconds, build_directory=build_directory,
                             arch_list=arch_list,
                             is_python_module=False, verbose=verbose, **flags)
    elapsed = time.perf_counter() - start
    after = _library_mtime(name, build_directory)
    return BuildInfo(name, str(library), elapsed, compiled=before is None or after != before,
                     arch_list=arch_list)


def build_cpu(verbose: bool = False, build_directory: str | None = None) -> BuildInfo:
    """Build (or take from the cache) and load the C++ CPU extension; register its fake implementation.

    Registers ``torch.ops.kernels_cpp.rms_norm_fwd``. Once per process: later calls return the first
    call's ``BuildInfo`` and ignore their arguments (a library's operators can be registered only
    once). Chapter 13 builds it.

    Args:
        verbose: show the compiler's output.
        build_directory: a folder replacing PyTorch's extensions cache (an empty folder forces a
            fresh compile, to time it).

    Returns:
        The ``BuildInfo`` of this process's build.

    Raises:
        RuntimeError: saying what is missing when no C++ compiler or no ninja is found.
    """
    if CPU_EXTENSION not in _BUILDS:
        reason = cpu_build_unavailable()
        if reason:
            raise RuntimeError(f"cannot build the C++ extension: {reason}")
        info = _build(CPU_EXTENSION, [CPU_SOURCE], verbose, build_directory, "the C++ RMSNorm for the CPU",
                      f"about {CPU_BUILD_SECONDS} s of one CPU core", extra_cflags=CPU_FLAGS)
        torch.library.register_fake(f"{CPU_NAMESPACE}::rms_norm_fwd", rms_norm_fwd_fake)
        _BUILDS[CPU_EXTENSION] = info
    return _BUILDS[CPU_EXTENSION]


def build_cuda(verbose: bool = False, build_directory: str | None = None) -> BuildInfo:
    """Build (or take from the cache) and load the CUDA extension; register its fake implementations.

    Registers ``torch.ops.kernels_cuda.rms_norm_fwd`` and ``rms_norm_bwd``, compiled for this
    machine's GPUs only (``cuda_build_arch_list``: ``TORCH_CUDA_ARCH_LIST`` overrides). Once per
    process, as ``build_cpu``. Chapter 13 builds it.

    Args:
        verbose: show the compilers' output.
        build_directory: as in ``build_cpu``.

    Returns:
        The ``BuildInfo`` of this process's build.

    Raises:
        RuntimeError: saying what is missing when there is no GPU, no nvcc, no C++ compiler or no
            ninja.
    """
    if CUDA_EXTENSION not in _BUILDS:
        reason = cuda_build_unavailable()
        if reason:
            raise RuntimeError(f"cannot build the CUDA extension: {reason}")
        arch_list, source = cuda_build_arch_list()
        n_archs = len(split_arch_list(arch_list))
        what = f"the CUDA C++ RMSNorm for {arch_names(arch_list)} ({source})"
        seconds = (f"about {CUDA_BUILD_SECONDS_PER_ARCH * n_archs} s of one CPU core "
                   f"({CUDA_BUILD_SECONDS_PER_ARCH} s per architecture)")
        info = _build(CUDA_EXTENSION, [CUDA_SOURCE], verbose, build_directory, what, seconds,
                      arch_list=arch_list,
                      extra_cflags=CPU_FLAGS, extra_cuda_cflags=CUDA_FLAGS)
        torch.library.register_fake(f"{CUDA_NAMESPACE}::rms_norm_fwd", rms_norm_fwd_fake)
        torch.library.register_fake(f"{CUDA_NAMESPACE}::rms_norm_bwd", rms_norm_bwd_fake)
        _BUILDS[CUDA_EXTENSION] = info
    return _BUILDS[CUDA_EXTENSION]


def builds() -> dict[str, BuildInfo]:
    """List the extensions built (or loaded from the cache) in this process so far.

    Returns:
        A copy of the ``BuildInfo``s by extension name.
    """
    return dict(_BUILDS)


# --------------------------------------------------------------------------------------------------
# The functions
# --------------------------------------------------------------------------------------------------


class CUDARMSNormFunction(torch.autograd.Function):
    """autograd over the CUDA operators, exactly as ``kernels.rmsnorm.RMSNormFunction`` over the
    Triton ones: the forward saves x (no copy), the weight and one float32 rstd per row; dW only
    when the weight needs it. ``rms_norm_cuda`` applies it (chapter 13)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        """Run ``kernels_cuda::rms_norm_fwd`` and save what the backward needs.

        Args:
            ctx: autograd's context.
            x, weight, eps: as ``rms_norm_cuda`` takes them, already checked.

        Returns:
            The normalised output.
        """
        y, rstd = torch.ops.kernels_cuda.rms_norm_fwd.default(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        """Run ``kernels_cuda::rms_norm_bwd``; the dW reduction only when the weight needs a gradient.

        Args:
            ctx: autograd's context, holding x, the weight and rstd.
            dy: the gradient of the output.

        Returns:
            ``(dx, dw, None)``: dw is None when the weight needs no gradient; eps has none.
        """
        x, weight, rstd = ctx.saved_tensors
        compute_dw = ctx.needs_input_grad[1]
        dx, dw = torch.ops.kernels_cuda.rms_norm_bwd.default(dy, x, weight, rstd, compute_dw)
        return dx, (dw if compute_dw else None), None


def rms_norm_cuda(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x`` by the CUDA C++ kernels (built on first use; chapter 13).

    What ``kernels.rms_norm`` computes, for CUDA tensors of float32, bfloat16 or float16 (a float32
    weight may go with a 16-bit ``x``). Differentiable in ``x`` and ``weight``.

    Args:
        x: the input, ``[..., hidden]``, on a CUDA device.
        weight: the scale, ``(x.shape[-1],)``, on ``x``'s device, of ``x``'s dtype or float32.
        eps: added to the mean of squares before the square root.

    Returns:
        ``weight * x / sqrt(mean(x²) + eps)``, of ``x``'s shape and ``weight * x``'s dtype.

    Raises:
        TypeError: for a non-tensor or an unsupported dtype (``kernels.rmsnorm.check_tensors``).
        ValueError: for mismatched shapes or devices, or tensors not on a CUDA device.
        RuntimeError: when the extension cannot be built here (``build_cuda``), or from the
            operator for a weight of another dtype.
    """
    check_tensors(x, weight)
    if x.device.type != "cuda":
        raise ValueError(f"rms_norm_cuda needs CUDA tensors, got x on {x.device}")
    build_cuda()
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return CUDARMSNormFunction.apply(x, weight, float(eps))
    return torch.ops.kernels_cuda.rms_norm_fwd.default(x, weight, float(eps))[0]


def rms_norm_cpp(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm forward over the last dimension of ``x`` by the C++ CPU extension (built on first use).

    CPU tensors of float32, bfloat16 or float16, on any machine; forward only (no autograd: the
    extension exists to show chapter 13's mechanics on a machine without a GPU).

    Args:
        x: the input, ``[..., hidden]``, on the CPU.
        weight: the scale, ``(x.shape[-1],)``, on the CPU, of ``x``'s dtype or float32.
        eps: added to the mean of squares before the square root.

    Returns:
        ``weight * x / sqrt(mean(x²) + eps)``, of ``x``'s shape and ``weight * x``'s dtype.

    Raises:
        TypeError: for a non-tensor or an unsupported dtype (``kernels.rmsnorm.check_tensors``).
        ValueError: for mismatched shapes or devices, or tensors not on the CPU.
        RuntimeError: when the extension cannot be built here (``build_cpu``), or from the
            operator for a weight of another dtype.
    """
    check_tensors(x, weight)
    if x.device.type != "cpu":
        raise ValueError(f"rms_norm_cpp runs on the CPU, got x on {x.device}")
    build_cpu()
    return torch.ops.kernels_cpp.rms_norm_fwd.default(x, weight, float(eps))[0]


def default_device_note() -> str:
    """Say which of the two extensions this machine can run (chapter 13 prints it).

    Returns:
        A sentence: the CUDA extension is available on this GPU, or why not and that the C++ CPU
        extension shows the same path.
    """
    reason = cuda_build_unavailable()
    if reason is None:
        return f"CUDA extension available on {runtime.device_name()}"
    return f"CUDA extension unavailable ({reason}); the C++ CPU extension shows the same path"
