"""RMSNorm in CUDA C++ beside its Triton twin: lines of code, build time, and a side-by-side benchmark.

``python -m kernels.bench.cuda_compare`` checks against float64 and then times, at chapter 04's
shapes, forward and forward+backward of three implementations in one run:

* ``cuda``: the CUDA C++ kernels of ``kernels/csrc/rmsnorm_cuda.cu``
  (``kernels.cuda_rmsnorm.rms_norm_cuda``);
* ``triton``: the package's Triton kernels (``kernels.rms_norm``), which the CUDA version is judged
  against;
* ``native``: PyTorch's own fused ``F.rms_norm``.

It reuses the benchmark sweep (``kernels.bench.sweep``: cases, float64 checks, eager and CUDA-graph
device times, the measured copy bandwidth), so every number means what it means in chapter 04. The
results, with the CUDA build's time and each kernel's lines of code, go to
``cuda_rmsnorm/<device>.json`` and a PNG beside it, in the runs folder (with ``--record``: in
``assets/results/``, where chapter 13 reads them). On a machine without a GPU it runs the tiny sizes
(Triton in the interpreter, ``F.rms_norm`` on the CPU), skips the CUDA version with the reason, and
saves nothing unless ``--out`` asks: those timings say nothing about a GPU. ``--build-only`` builds
the two C++ extensions this machine can build (``kernels.cuda_rmsnorm``) and says how long each
took, without the benchmark.
"""

from __future__ import annotations

import argparse
import inspect
import io
import re
import tokenize
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels import cuda_rmsnorm, runtime

from . import cli
from .peers import Impl
from .results import RESULTS, device_slug, format_table, results_file, runs

TARGET_SHAPE = (16384, 4096)  # where the targets are judged: tokens × hidden, bf16
TARGET_VS_TRITON = 1.05  # CUDA forward time at most 5% above Triton's
TARGET_FRAC_COPY = 0.85  # and at least 85% of the measured copy bandwidth


# --------------------------------------------------------------------------------------------------
# Lines of code, counted rather than typed in
# --------------------------------------------------------------------------------------------------


def count_cpp_lines(text: str) -> int:
    """Lines of C++/CUDA that hold code: blank lines and comments (``//`` and ``/* */``) do not count.

    Args:
        text: C++ or CUDA source.

    Returns:
        the count.
    """
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return sum(1 for line in text.splitlines() if line.split("//", 1)[0].strip())


def count_python_lines(text: str) -> int:
    """Lines of Python that hold code: blank lines, comments and docstrings do not count.

    Args:
        text: Python source.

    Returns:
        the count.
    """
    lines: set[int] = set()
    previous = tokenize.NEWLINE
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        docstring = tok.type == tokenize.STRING and previous in (tokenize.NEWLINE, tokenize.INDENT,
                                                                 tokenize.DEDENT)
        if tok.type not in skip and not docstring:
            lines.update(range(tok.start[0], tok.end[0] + 1))
        if tok.type not in (tokenize.COMMENT, tokenize.NL):
            previous = tok.type
    return len(lines)


def _cuda_parts() -> tuple[str, str]:
    """The CUDA source split at its launch-configuration banner: (device code, host code and
    registration)."""
    text = cuda_rmsnorm.CUDA_SOURCE.read_text()
    marker = "// Launch configuration"
    head, _, tail = text.partition(marker)
    return head, marker + tail


def triton_kernel_source() -> str:
    """The source of the three Triton kernels of ``kernels/rmsnorm.py`` (forward, backward, dW sum).

    Returns:
        the source, kernels separated by a blank line.
    """
    from kernels import rmsnorm

    kernels = (rmsnorm.rms_norm_fwd_kernel, rmsnorm.rms_norm_bwd_kernel, rmsnorm.rms_norm_dw_kernel)
    return "\n\n".join(inspect.getsource(k.fn) for k in kernels)


def triton_host_source() -> str:
    """The Triton version's host side: launch configuration, launches and operator registration.

    Returns:
        the source.
    """
    from kernels import rmsnorm

    parts = (rmsnorm.tile_width, rmsnorm.tile_elements, rmsnorm.cached_forward_config, rmsnorm.dw_tiles,
             rmsnorm.cached_backward_config, rmsnorm.as_rows, rmsnorm.out_dtype, rmsnorm.rms_norm_forward,
             rmsnorm.rms_norm_backward, rmsnorm.rms_norm_fwd_fake, rmsnorm.rms_norm_bwd_fake)
    source = "\n\n".join(inspect.getsource(getattr(p, "__wrapped__", p)) for p in parts)
    registration = inspect.getsource(rmsnorm).split("rms_norm_fwd_op = ops.define(",
                                                    1)[1].split("\n\n\n", 1)[0]
    return source + "\n\nrms_norm_fwd_op = ops.define(" + registration


def cuda_kernel_source() -> str:
    """The device code of ``kernels/csrc/rmsnorm_cuda.cu``: packs, reductions and the three kernels.

    Returns:
        the source.
    """
    return _cuda_parts()[0]


def cpp_snippet(name: str, path: Path | None = None) -> str:
    """The definition of the C++ function, kernel or struct ``name`` in ``path`` (the CUDA source by
    default), with its ``template`` line and the comment block right above it: what a chapter shows
    beside the Triton twin.

    Chapter 13 shows the CUDA kernels with it.

    Args:
        name: the function's, kernel's or struct's name.
        path: the C++ source (None: ``kernels/csrc/rmsnorm_cuda.cu``).

    Returns:
        the definition's lines.

    Raises:
        ValueError: when ``path`` defines no ``name``.
    """
    lines = (path or cuda_rmsnorm.CUDA_SOURCE).read_text().splitlines()
    # A definition's first line, not a comment that names it: "void f(", "__global__ void f(",
    # "struct f {".
    pattern = re.compile(rf"^(?!//)(?:__global__ |__device__ |struct |\S.*\s)\**{re.escape(name)}\b[ (<]")
    start = next((i for i,
                  line in enumerate(lines) if pattern.match(line) or line.startswith(f"struct {name}")),
                 None)
    if start is None:
        raise ValueError(f"no definition of {name!r} in {path or cuda_rmsnorm.CUDA_SOURCE}")
    first = start
    while first > 0 and (lines[first - 1].startswith(("template", "//", "struct alignas")) or
                         lines[first - 1].startswith("__global__")):
        first -= 1
    depth, end = 0, start
    for end in range(start, len(lines)):
        depth += lines[end].count("{") - lines[end].count("}")
        if depth == 0 and "}" in lines[end]:
            break
    return "\n".join(lines[first:end + 1])


def lines_of_code() -> dict[str, dict[str, int]]:
    """Lines of code of each version, counted from the sources: ``kernels`` (what runs on the GPU)
    and ``host`` (launch configuration, launches, operator registration), blank lines, comments and
    docstrings left out.

    Chapter 13 prints them.

    Returns:
        version (``cuda``, ``triton``, ``cpp_cpu``) -> ``{"kernels", "host"}`` line counts.
    """
    device, host = _cuda_parts()
    return {
        "cuda": {"kernels": count_cpp_lines(device), "host": count_cpp_lines(host)},
        "triton": {"kernels": count_python_lines(triton_kernel_source()),
                   "host": count_python_lines(triton_host_source())},
        "cpp_cpu": {"kernels": count_cpp_lines(cuda_rmsnorm.CPU_SOURCE.read_text()), "host": 0},
    }


# --------------------------------------------------------------------------------------------------
# The implementations compared
# --------------------------------------------------------------------------------------------------


def _weight_param(case) -> torch.nn.Parameter:
    return torch.nn.Parameter(case.weight.detach().clone())


def _build_cuda(case):
    weight = _weight_param(case)
    return (lambda x: cuda_rmsnorm.rms_norm_cuda(x, weight, case.eps)), [weight]


def _build_triton(case):
    from kernels.rmsnorm import rms_norm

    weight = _weight_param(case)
    return (lambda x: rms_norm(x, weight, case.eps)), [weight]


def _build_native(case):
    weight = _weight_param(case)
    shape = (case.hidden,)
    return (lambda x: F.rms_norm(x, shape, weight, case.eps)), [weight]


IMPLS = (
    Impl("cuda", "CUDA C++ (kernels_cuda)", "ours", _build_cuda, cuda_rmsnorm.cuda_build_unavailable),
    Impl("triton", "Triton (kernels.rms_norm)", "peer", _build_triton),
    Impl("native", "F.rms_norm (native fused)", "peer", _build_native),
)


def sizes(quick: bool = False) -> dict:
    """Chapter 04's RMSNorm sizes (``kernels.bench.sweep``): the full sweep on a GPU, tiny ones in
    the interpreter.

    Args:
        quick: the quick sweep's sizes.

    Returns:
        the sizes: ``tokens``, ``hidden`` and the hidden-size sweep.
    """
    from . import sweep

    if runtime.MODE == "gpu":
        return dict((sweep.GPU_QUICK_SIZES if quick else sweep.GPU_SIZES)["rmsnorm"])
    return dict((sweep.CPU_QUICK_SIZES if quick else sweep.CPU_SIZES)["rmsnorm"])


# --------------------------------------------------------------------------------------------------
# Running, reading and saving
# --------------------------------------------------------------------------------------------------


def run_comparison(quick: bool = False, size: dict | None = None, warmup: int = 25, rep: int = 50,
                   ceilings: dict | None = None, progress: bool = True) -> dict:
    """Check and time the three implementations; returns a results dict (``kernels.bench.sweep``'s,
    plus the CUDA build, the lines of code and the targets). ``size`` overrides ``sizes(quick)``
    (same keys).

    Chapter 13 runs it.

    Args:
        quick: the quick sweep's sizes.
        size: the sizes (None: ``sizes(quick)``).
        warmup: ``do_bench`` warm-up, ms.
        rep: ``do_bench`` repetitions, ms.
        ceilings: the GPU's ceilings (None: the stored ones).
        progress: show a progress bar.

    Returns:
        the results dict.
    """
    from .sweep import run_benchmark

    size = dict(size or sizes(quick))
    build = None
    if cuda_rmsnorm.cuda_build_unavailable() is None:
        build = cuda_rmsnorm.build_cuda().to_json()  # timed here, before any timing of the kernels
    results = run_benchmark(
        "rmsnorm", size["tokens"], size["hidden"], width_sweep=size.get("hidden_sweep", ()),
        width_sweep_tokens=size.get("hidden_sweep_tokens"), impls=list(IMPLS), warmup=warmup, rep=rep,
        ceilings=ceilings, progress=progress,
    )
    results["comparison"] = "cuda_rmsnorm"
    results["cuda_build"] = build
    results["cuda_unavailable"] = cuda_rmsnorm.cuda_build_unavailable()
    results["lines_of_code"] = lines_of_code()
    results["targets"] = targets(results)
    return results


def _row(results: dict, impl: str, tokens: int, width: int, pass_: str) -> dict | None:
    return next((r for r in results["rows"] if (r["impl"], r["tokens"], r["width"], r["pass"]) ==
                 (impl, tokens, width, pass_) and r["status"] == "ok"), None)


def targets(results: dict, shape: tuple[int, int] = TARGET_SHAPE) -> list[dict]:
    """The CUDA forward's targets at ``shape`` (device times): within 5% of Triton's time or faster,
    and at least 85% of the measured copy bandwidth. ``met`` is None where the run has no such
    numbers (no GPU, shape absent).

    Args:
        results: the comparison's results dict.
        shape: ``(tokens, hidden)`` the targets are read at.

    Returns:
        one entry per target: its text, the value and ``met``.
    """
    cuda, triton = (_row(results, k, *shape, "fwd") for k in ("cuda", "triton"))
    ratio = (cuda["device_ms"] / triton["device_ms"]) if (cuda and triton and cuda["device_ms"]
                                                           and triton["device_ms"]) else None
    frac = cuda["frac_copy"] if cuda else None
    where = f"{shape[0]}×{shape[1]} forward"
    return [
        {"target": f"CUDA time / Triton time ≤ {TARGET_VS_TRITON} ({where})", "value": ratio,
         "met": None if ratio is None else ratio <= TARGET_VS_TRITON},
        {"target": f"CUDA ≥ {TARGET_FRAC_COPY:.0%} of copy bandwidth ({where})", "value": frac,
         "met": None if frac is None else frac >= TARGET_FRAC_COPY},
    ]


def save_comparison(results: dict, directory: Path = RESULTS) -> tuple[Path, Path]:
    """Write the results as ``cuda_rmsnorm/<device>.json`` under the results root ``directory`` (a
    folder of their own, never over chapter 04's ``rmsnorm/<device>.json``) and their plot as PNG
    beside it; returns both paths.

    Args:
        results: the comparison's results dict.
        directory: the results root.

    Returns:
        ``(json_path, png_path)``.
    """
    path = results_file("cuda_rmsnorm", results["device_slug"], directory)
    fig = plot_comparison(results)
    png = cli.write_json_and_figure(path, results, fig, path.with_suffix(".png"), dpi=110,
                                    bbox_inches="tight")[1]
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path, png


def load_comparison(directory: Path = RESULTS) -> dict | None:
    """The newest GPU comparison in ``directory/cuda_rmsnorm/``, or None (there is none until one
    has run on a GPU).

    Chapter 13 reads it.

    Args:
        directory: the results root.

    Returns:
        the results dict, or None.
    """
    found = [results for results in runs("cuda_rmsnorm", directory).values() if results.get("mode") == "gpu"]
    return max(found, key=lambda r: r.get("date", "")) if found else None


def describe_targets(results: dict) -> str:
    """The targets, one line each, with the measured value or why there is none.

    Args:
        results: the comparison's results dict.

    Returns:
        the lines, joined by newlines.
    """
    lines = []
    for t in results.get("targets") or targets(results):
        if t["met"] is None:
            lines.append(f"  {t['target']}: not measured here")
        else:
            lines.append(f"  {t['target']}: {t['value']:.3f} → {'met' if t['met'] else 'NOT met'}")
    return "\n".join(lines)


def describe_lines(loc: dict) -> str:
    """The lines of code of each version, one line each (chapter 13 prints them).

    Args:
        loc: the dict of ``lines_of_code``.

    Returns:
        the lines, joined by newlines.
    """
    names = {"cuda": "CUDA C++", "triton": "Triton", "cpp_cpu": "C++ CPU forward"}
    return "\n".join(f"  {names.get(k, k):<16} kernels {v['kernels']:>4}   host {v['host']:>4}" for k, v in loc.items())


def report(results: dict) -> str:
    """Everything a reader wants from one run, as text: the table, targets, build and lines of code.

    Chapter 13 prints it.

    Args:
        results: the comparison's results dict.

    Returns:
        the text.
    """
    build = results.get("cuda_build")
    build_line = (f"CUDA build: {'compiled' if build['compiled'] else 'from the build cache'} in "
                  f"{build['seconds']:.1f} s" if build else f"CUDA version not run: {results.get('cuda_unavailable')}")
    return "\n".join([format_table(results), "", build_line, "targets:", describe_targets(results),
                      "lines of code (no blanks, comments or docstrings):",
                      describe_lines(results["lines_of_code"])])


def plot_comparison(results: dict):
    """A 2 × 2 figure: time per call and bandwidth against the measured copy line, forward and
    forward+backward, over the token sweep at the fixed hidden size.

    Chapter 13 draws it.

    Args:
        results: the comparison's results dict.

    Returns:
        the matplotlib figure.
    """
    import matplotlib.pyplot as plt

    from .plots import plot_bandwidth, plot_times

    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    for col, pass_ in enumerate(("fwd", "fwd+bwd")):
        plot_times(results, pass_, ax=axes[0, col])
        plot_bandwidth(results, pass_, ax=axes[1, col])
    fig.suptitle("RMSNorm: CUDA C++ against Triton and F.rms_norm", fontsize=11)
    fig.tight_layout()
    return fig


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m kernels.bench.cuda_compare``.

    Returns:
        the parser.
    """
    parser = argparse.ArgumentParser(prog="python -m kernels.bench.cuda_compare",
                                     description=__doc__.split("\n\n")[0],
                                     epilog="Without a GPU nothing is saved unless --out names a folder: interpreter "
                                            "timings say nothing about a GPU.")
    parser.add_argument("--quick", action="store_true", help="three token counts and two hidden sizes only")
    cli.add_output_arguments(parser, "cuda_rmsnorm/<device>.json and .png", out_flags=("--out", "--out-dir"))
    parser.add_argument("--warmup", type=cli.positive_int, default=25, help="do_bench warm-up, ms")
    parser.add_argument("--rep", type=cli.positive_int, default=50, help="do_bench repetitions, ms")
    parser.add_argument("--build-only", action="store_true",
                        help="build (or load from PyTorch's cache) the extensions this machine can build, then stop")
    return parser


def _out_dir(args) -> Path | None:
    """Where this run saves: the chosen results root, except on a CPU without ``--out`` (interpreter
    timings)."""
    if args.build_only or (runtime.MODE != "gpu" and args.out is None and not args.record):
        return None
    return cli.output_root(args)


def main(argv=None) -> int:
    """Build, check and time the three RMSNorms from the command line, then print and save the report.

    Args:
        argv: the command line's arguments (None: ``sys.argv``'s).

    Returns:
        the exit status, 0 (a refused flag exits through ``argparse``).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    out_dir = _out_dir(args)
    targets = [] if out_dir is None else [results_file("cuda_rmsnorm", device_slug(), out_dir, suffix)
                                          for suffix in (".json", ".png")]
    cli.check_outputs(parser, args, targets)
    print(runtime.describe())
    if args.build_only:
        print(cuda_rmsnorm.build_cpu().describe())
        reason = cuda_rmsnorm.cuda_build_unavailable()
        print(cuda_rmsnorm.build_cuda().describe() if reason is None else f"CUDA extension not built: {reason}")
        return 0
    results = run_comparison(quick=args.quick, warmup=args.warmup, rep=args.rep)
    print(report(results))
    if out_dir is not None:
        for path in save_comparison(results, out_dir):
            print(f"wrote {path}")
    else:
        print("not saved: interpreter timings are no GPU numbers (pass --out to write them anyway)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
