"""Build every just-in-time extension of the package now, instead of at its first use in a chapter.

    python -m kernels.prebuild

Three C++ extensions compile on first use (each announces itself in one line, and PyTorch caches it
in ``TORCH_EXTENSIONS_DIR``): the C++ RMSNorm for the CPU and the CUDA C++ RMSNorm of
``kernels.cuda_rmsnorm`` (chapter 13), and the C++ host path of SwiGLU, RoPE and RMSNorm
(``kernels.host_path``, which every eager call on a GPU takes). This builds each one this machine
can build, says which it skips and why (on a machine without a GPU: the CUDA one and the host path),
and prints where the caches live. Inside the workbook's container the caches sit in the mounted
checkout (``.cache/``), so a build done once serves every later container. Triton's kernels are not
built here: they compile per shape at their first call (a second or so each) into
``TRITON_CACHE_DIR``.

Exit status 0 when everything buildable here was built, 1 when a build failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from . import cuda_rmsnorm, host_path, runtime


@dataclass(frozen=True)
class Step:
    """One extension: its name, why it cannot be built here (None: it can), and the build."""

    name: str
    unavailable: Callable[[], str | None]
    build: Callable[[], str]  # builds (or loads from the cache) and returns a line saying what happened


def _host_path() -> str:
    ext = host_path.extension()  # builds on first call; warns and returns None when the build fails
    status = host_path.status()
    if ext is None:
        raise RuntimeError(status["reason"])
    return f"built in {status['build_seconds']:.1f} s (or taken from the cache)"


STEPS = (
    Step("C++ RMSNorm for the CPU (chapter 13)", cuda_rmsnorm.cpu_build_unavailable,
         lambda: cuda_rmsnorm.build_cpu().describe()),
    Step("CUDA C++ RMSNorm (chapter 13)", cuda_rmsnorm.cuda_build_unavailable,
         lambda: cuda_rmsnorm.build_cuda().describe()),
    Step("C++ host path of SwiGLU, RoPE and RMSNorm", host_path.unavailable, _host_path),
)


def caches() -> list[str]:
    """Say where the compiled extensions and Triton's kernels are cached (chapter 13 shows them).

    Returns:
        Two lines: the C++ extensions' folder (``TORCH_EXTENSIONS_DIR``) and Triton's cache
        (``TRITON_CACHE_DIR``, else ``~/.triton/cache``).
    """
    extensions = host_path.build_directory_for(cuda_rmsnorm.CPU_EXTENSION).parent
    triton = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    return [f"C++ extensions: {extensions} (TORCH_EXTENSIONS_DIR)",
            f"Triton kernels: {triton} (TRITON_CACHE_DIR)"]


def prebuild(steps=STEPS, out=None) -> int:
    """Build each step that can be built here, printing one line per step: skipped, ready or FAILED.

    A failed build is reported with the last line of its error, and the next step goes on.

    Args:
        steps: the ``Step``s to build, in order (default: the package's three extensions).
        out: a text stream for the lines (default: standard output).

    Returns:
        The number of builds that failed (skipped steps do not count).
    """
    out = out or sys.stdout
    failed = 0
    for step in steps:
        reason = step.unavailable()
        if reason is not None:
            print(f"skipped  {step.name}: {reason}", file=out, flush=True)
            continue
        start = time.perf_counter()
        try:
            done = step.build()
        except Exception as exc:  # noqa: BLE001  (report every failure, then go on with the next extension)
            failed += 1
            last = (str(exc).strip().splitlines() or [""])[-1]
            print(f"FAILED   {step.name}: {type(exc).__name__}: {last}", file=out, flush=True)
            continue
        print(f"ready    {step.name} ({time.perf_counter() - start:.1f} s): {done}", file=out, flush=True)
    return failed


def main(argv: list[str] | None = None) -> int:
    """Run ``python -m kernels.prebuild``: print where this runs, build every step, print the caches.

    Args:
        argv: the command-line arguments (none are taken but ``--help``; default: ``sys.argv``).

    Returns:
        The exit status: 0 when every build attempted succeeded, 1 when one failed.
    """
    parser = argparse.ArgumentParser(prog="python -m kernels.prebuild", description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    print(runtime.describe(), flush=True)
    failed = prebuild()
    for line in caches():
        print(line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
