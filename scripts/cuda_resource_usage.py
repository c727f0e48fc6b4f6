#!/usr/bin/env python3
"""Registers per thread of every kernel in kernels/csrc/rmsnorm_cuda.cu, per GPU architecture, and whether the
largest block the host code launches fits the register file.

    python scripts/cuda_resource_usage.py                 # sm_90 sm_100 sm_103 sm_120 sm_121, as nvcc supports
    python scripts/cuda_resource_usage.py 90 120          # chosen architectures

Needs nvcc and PyTorch's headers only (no GPU, and a CPU-only PyTorch will do): the .cu file is compiled to an object
file with `--resource-usage`, and ptxas's report is read back. A block of T threads using R registers each needs
R x T of the SM's 65,536 registers (every architecture from sm_50 to sm_121 has 64K 32-bit registers per SM and per
block); when R x T is larger, the launch fails with "too many resources requested for launch". `__launch_bounds__(T)`
on a kernel tells the compiler the T it must fit, so R x T <= 65,536 holds by construction; this script shows it.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "kernels" / "csrc" / "rmsnorm_cuda.cu"
REGISTERS_PER_BLOCK = 65536  # sm_50 ... sm_121
DEFAULT_ARCHS = ["90", "100", "103", "120", "121"]

# What PyTorch's extension build passes to nvcc besides the include folders and the architectures.
NVCC_FLAGS = ["-std=c++17", "-O3", "--expt-relaxed-constexpr", "-D__CUDA_NO_HALF_OPERATORS__",
              "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
              "-D__CUDA_NO_HALF2_OPERATORS__", "-Xcompiler", "-fPIC"]


def torch_includes(shim: Path) -> list[str]:
    """PyTorch's include folders, and a stand-in for the one header a CPU-only PyTorch does not ship."""
    import torch

    include = Path(torch.__file__).parent / "include"
    if not (include / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").exists():
        header = shim / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
        header.parent.mkdir(parents=True, exist_ok=True)
        header.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    return [f"-I{shim}", f"-I{include}", f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}"]


def supported_archs() -> set[str]:
    out = subprocess.run(["nvcc", "--list-gpu-arch"], capture_output=True, text=True, check=True).stdout
    return {m.group(1) for m in re.finditer(r"compute_(\d+)\b", out)}


def demangle(names: list[str]) -> list[str]:
    if shutil.which("c++filt") is None:
        return names
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def parse(report: str) -> list[dict]:
    """(kernel, arch, registers, spill bytes) for each entry function in ptxas's --resource-usage report."""
    rows, current = [], None
    for line in report.splitlines():
        m = re.search(r"Compiling entry function '(\S+)' for '(sm_\d+\w*)'", line)
        if m:
            current = {"mangled": m.group(1), "arch": m.group(2), "spill": 0}
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and current is not None:
            current["spill"] = int(m.group(1)) + int(m.group(2))
        m = re.search(r"Used (\d+) registers", line)
        if m and current is not None:
            current["registers"] = int(m.group(1))
            rows.append(current)
            current = None
    for row, name in zip(rows, demangle([r["mangled"] for r in rows])):
        short = re.sub(r"^void ", "", name.replace("(anonymous namespace)::", ""))  # a template's return type
        short = short.split("(")[0]  # the parameter list
        row["kernel"] = short.replace("c10::", "").replace("BFloat16", "bf16").replace("Half", "fp16")
    return rows


def launch_bounds(source: str) -> dict[str, int]:
    """The __launch_bounds__ of each kernel in the source, by name, with the constants it names resolved."""
    constants = {m.group(1): m.group(2) for m in re.finditer(r"constexpr int (\w+) = ([^;]+);", source)}
    bounds = {}
    for m in re.finditer(r"__global__ void __launch_bounds__\(([^)]+)\)\s*(\w+)\(", source):
        expression = m.group(1)
        for _ in range(len(constants)):  # constants defined from other constants: substitute until none is left
            for name, value in constants.items():
                expression = re.sub(rf"\b{name}\b", f"({value})", expression)
        bounds[m.group(2)] = int(eval(expression, {"__builtins__": {}}))  # integer arithmetic on the constants
    return bounds


def compile_report(wanted: list[str]) -> str | None:
    """ptxas's report of the source compiled for the wanted architectures this nvcc supports; None on failure."""
    if shutil.which("nvcc") is None:
        print("nvcc not found: install the CUDA toolkit or put its bin/ folder on PATH", file=sys.stderr)
        return None
    supported = supported_archs()
    archs = [a for a in wanted if a in supported]
    skipped = sorted(set(wanted) - set(archs))
    if skipped:
        print(f"this nvcc cannot compile for sm_{', sm_'.join(skipped)}: skipped")
    if not archs:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
        cmd = ["nvcc", "-c", str(SOURCE), "-o", str(Path(tmp) / "rmsnorm_cuda.o"), "--resource-usage",
               *NVCC_FLAGS, *torch_includes(Path(tmp)), *gencode]
        done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stderr[-4000:], file=sys.stderr)
        return None
    return done.stdout + done.stderr


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("archs", nargs="*", help="compute capabilities without the dot (90, 100, 120, ...)")
    parser.add_argument("--keep", type=Path, help="also write ptxas's whole report to this file")
    parser.add_argument("--report", type=Path, help="read a report written by --keep instead of compiling")
    args = parser.parse_args(argv)
    bounds = launch_bounds(SOURCE.read_text())
    if args.report:
        report = args.report.read_text()
    else:
        report = compile_report(args.archs or DEFAULT_ARCHS)
        if report is None:
            return 2
    if args.keep:
        args.keep.write_text(report)
    rows = parse(report)
    failures = 0
    print(f"{'arch':7} {'kernel':62} {'regs':>4} {'spill':>5} {'bound':>5} {'regs x bound':>12}")
    for row in sorted(rows, key=lambda r: (r["arch"], r["kernel"])):
        bound = bounds.get(row["kernel"].split("<")[0])
        need = row["registers"] * bound if bound else None
        fits = need is not None and need <= REGISTERS_PER_BLOCK
        failures += not fits
        print(f"{row['arch']:7} {row['kernel'][:62]:62} {row['registers']:4} {row['spill']:5} "
              f"{bound or '-':>5} {need or '-':>12} {'fits' if fits else 'DOES NOT FIT'}")
    print(f"{len(rows)} kernels x architectures; {failures} whose largest block does not fit "
          f"{REGISTERS_PER_BLOCK:,} registers")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
