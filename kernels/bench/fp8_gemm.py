"""FP8 GEMMs against bf16 at Llama-3.1-8B's projection shapes, and the cost of quantising the activation.

``python -m kernels.bench.fp8_gemm`` times, at M = 8,192 tokens and each projection shape K × N of
Llama-3.1-8B (q/o 4,096 × 4,096, k/v 4,096 × 1,024, gate/up 4,096 × 14,336, down 14,336 × 4,096,
the LM head 4,096 × 128,256): the bf16 product ``torch.matmul(x, w.t())``, cuBLAS's FP8 GEMM with
row-wise scales (``kernels.fp8.fp8_matmul(backend="cublas")``, ``torch._scaled_mm``), ours in
Triton (``backend="triton"``), and ``quantize_rows`` of the [M, K] bf16 activation on its own. Each
FP8 result is checked against the dequantised float32 reference first. It prints TFLOP/s per GEMM,
ours / cuBLAS and the quantisation's time beside the FP8 GEMM's. Writes ``fp8_gemm/<gpu>.json``
into the runs folder, or with ``--record`` into ``assets/results/``; an existing file is replaced
only with ``--force``. In the interpreter it runs tiny shapes; its times mean nothing. What to
expect, and why: assets/notes/fp8.md.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from kernels import runtime
from kernels.fp8 import fp8_matmul, fp8_matmul_reference, quantize_rows
from kernels.reference import relative_error

from . import cli
from .results import device_slug
from .timing import gbps, time_ms

LLAMA_8B_SHAPES = ((4096, 14336), (14336, 4096), (4096, 4096), (4096, 1024), (4096, 128256))
TINY_SHAPES = ((32, 64), (64, 32))
# Relative error of an FP8 GEMM's bf16 output against the float32 product of the same dequantised
# operands. Both sum the same exact FP8 products (each is exact in float32), so what differs is the
# order of the float32 sums (about 1e-6) and the rounding of the output to bf16 (at most 2^-9 of each
# value, and less in the norm). 1e-2 leaves that a margin of five and still refuses a forgotten or
# doubled scale, a wrong tile or a transposed operand, each an error of order 1.
FP8_CHECK_TOL = 1e-2
BACKENDS = ("cublas", "triton")


def make_operands(tokens: int, k: int, n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A bf16 activation [tokens, K] and weight [N, K] (nn.Linear's layout, scaled by 1/√K), and
    both quantised by rows.

    Args:
        tokens: M, the rows of the activation.
        k: the reduced dimension (in_features).
        n: out_features.
        seed: the generator's seed.

    Returns:
        ``x``, ``w``, and ``xq``, ``xs``, ``wq``, ``ws`` (the FP8 codes and float32 scales).
    """
    g = torch.Generator(device=runtime.device()).manual_seed(seed)
    x = torch.randn(tokens, k, generator=g, device=runtime.device()).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g, device=runtime.device()) / k**0.5).to(torch.bfloat16)
    xq, xs = quantize_rows(x)
    wq, ws = quantize_rows(w)
    return dict(x=x, w=w, xq=xq, xs=xs, wq=wq, ws=ws)


def fp8_call(t: dict[str, torch.Tensor], backend: str) -> Callable[[], torch.Tensor]:
    """The FP8 GEMM of ``t``'s quantised operands with ``backend``, as a call without arguments.

    Args:
        t: the operands of ``make_operands``.
        backend: ``"cublas"`` or ``"triton"``.

    Returns:
        the call; it returns the bf16 [M, N] product.
    """
    return lambda: fp8_matmul(t["xq"], t["xs"], t["wq"], t["ws"], torch.bfloat16, backend=backend)


def check_fp8(out: torch.Tensor, t: dict[str, torch.Tensor]) -> float:
    """The relative error of an FP8 GEMM's output against the dequantised float32 reference.

    Args:
        out: the GEMM's [M, N] output.
        t: the operands of ``make_operands``.

    Returns:
        ‖out − ref‖ / ‖ref‖, computed on the device in float32.
    """
    ref = fp8_matmul_reference(t["xq"], t["xs"], t["wq"], t["ws"], torch.float32)
    return relative_error(out, ref, on_device=True, dtype=torch.float32)


def tflops(tokens: int, k: int, n: int, ms: float) -> float:
    """TFLOP/s of an [tokens, K] × [K, N] product that took ``ms`` milliseconds.

    Args:
        tokens, k, n: the sizes.
        ms: milliseconds.

    Returns:
        2·M·N·K / time, in 10¹² per second.
    """
    return 2 * tokens * k * n / (ms * 1e-3) / 1e12


def quantize_bytes(tokens: int, k: int) -> int:
    """The quantiser's minimal bytes: the bf16 activation read once, its FP8 codes and float32
    scales written once (the kernel reads each row twice; the second read should come from the
    L2 cache).

    Args:
        tokens, k: the activation's sizes.

    Returns:
        bytes.
    """
    return tokens * k * 2 + tokens * k + tokens * 4


def run_shape(tokens: int, k: int, n: int) -> list[dict]:
    """Check, then time each GEMM and the quantiser at one shape.

    Args:
        tokens: M.
        k, n: the weight's in and out features.

    Returns:
        one row per implementation: ``impl``, ``k``, ``n``, ``ms``, ``tflops`` (or ``gbps`` for
        the quantiser), ``rel_error`` for the FP8 GEMMs; a backend that cannot run here has
        ``skipped``, its reason.

    Raises:
        RuntimeError: an FP8 result off the reference by more than ``FP8_CHECK_TOL``.
    """
    t = make_operands(tokens, k, n)
    base = {"k": k, "n": n}
    ms = time_ms(lambda: torch.matmul(t["x"], t["w"].t()))
    rows = [{**base, "impl": "bf16", "ms": ms, "tflops": tflops(tokens, k, n, ms)}]
    for backend in BACKENDS:
        call = fp8_call(t, backend)
        try:
            out = call()
        except ValueError as err:  # fp8_matmul's clear refusal: this backend cannot run here
            rows.append({**base, "impl": backend, "skipped": str(err)})
            continue
        error = check_fp8(out, t)
        del out
        if not error < FP8_CHECK_TOL:
            raise RuntimeError(f"FP8 {backend} at K={k}, N={n}: relative error {error:.3g} against the "
                               "dequantised float32 reference")
        ms = time_ms(call)
        rows.append({**base, "impl": backend, "ms": ms, "tflops": tflops(tokens, k, n, ms), "rel_error": error})
    x = t["x"]
    ms = time_ms(lambda: quantize_rows(x))
    rows.append({**base, "impl": "quantize", "ms": ms, "gbps": gbps(quantize_bytes(tokens, k), ms)})
    return rows


def run(tokens: int, shapes: tuple[tuple[int, int], ...]) -> dict:
    """Run every shape.

    Args:
        tokens: M.
        shapes: the (K, N) pairs.

    Returns:
        the settings and the rows of ``run_shape`` for every shape.
    """
    rows = []
    for k, n in shapes:
        rows += run_shape(tokens, k, n)
        if runtime.MODE == "gpu":
            torch.cuda.empty_cache()  # the LM head's operands and outputs take gigabytes
    return {"device": runtime.device_name(), "device_slug": device_slug(), "mode": runtime.MODE,
            "versions": runtime.versions(), "tokens": tokens, "shapes": [list(s) for s in shapes],
            "check_tolerance": FP8_CHECK_TOL, "rows": rows}


def _cell(row: dict | None, key: str, spec: str) -> str:
    if row is None or key not in row:
        return "—"
    return format(row[key], spec)


def format_table(result: dict) -> str:
    """The result as text: per shape, the TFLOP/s of bf16, cuBLAS FP8 and ours, ours / cuBLAS, and
    the quantisation's time against the FP8 GEMM's.

    Args:
        result: the dict of ``run``.

    Returns:
        the table, lines joined by newlines.
    """
    lines = [f"FP8 GEMMs at M = {result['tokens']} tokens on {result['device']} (TFLOP/s; bf16 output)",
             f"{'K × N':>16} {'bf16':>8} {'cuBLAS':>8} {'ours':>8} {'ours/cuBLAS':>12} {'quantise µs':>12} "
             f"{'vs FP8 GEMM':>12}"]
    skipped = {}
    for k, n in result["shapes"]:
        by = {r["impl"]: r for r in result["rows"] if (r["k"], r["n"]) == (k, n)}
        for impl in BACKENDS:
            if "skipped" in by.get(impl, {}):
                skipped[impl] = by.pop(impl)["skipped"]
        fastest = min((by[i]["ms"] for i in BACKENDS if i in by), default=None)
        ratio = (f"{by['triton']['tflops'] / by['cublas']['tflops']:12.2f}" if "triton" in by and "cublas" in by
                 else f"{'—':>12}")
        share = f"{by['quantize']['ms'] / fastest:12.1%}" if fastest else f"{'—':>12}"
        lines.append(f"{f'{k} × {n}':>16} {_cell(by.get('bf16'), 'tflops', '8.4g')} "
                     f"{_cell(by.get('cublas'), 'tflops', '8.4g'):>8} {_cell(by.get('triton'), 'tflops', '8.4g'):>8} "
                     f"{ratio} {by['quantize']['ms'] * 1e3:12.1f} {share}")
    lines += [f"{impl} skipped: {why}" for impl, why in skipped.items()]
    lines.append(runtime.timings_note())
    return "\n".join(lines)


def _shapes(text: str) -> tuple[tuple[int, int], ...]:
    # "4096x14336,4096x1024": K × N pairs, each a positive int
    try:
        pairs = tuple(tuple(int(v) for v in item.lower().split("x")) for item in text.split(","))
    except ValueError:
        pairs = ()
    if not pairs or any(len(p) != 2 or min(p) < 1 for p in pairs):
        raise argparse.ArgumentTypeError(f"expected K×N pairs such as 4096x14336,4096x1024, got {text!r}")
    return pairs


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m kernels.bench.fp8_gemm``.

    Returns:
        the parser.
    """
    parser = argparse.ArgumentParser(prog="python -m kernels.bench.fp8_gemm",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=cli.positive_int, default=None,
                        help="M, the activation's rows (default 8192 on a GPU; 64 on a CPU)")
    parser.add_argument("--shapes", type=_shapes, default=None,
                        help="K×N pairs, comma-separated (default Llama-3.1-8B's projections on a GPU; "
                             "32x64,64x32 on a CPU)")
    cli.add_output_arguments(parser, "fp8_gemm/<gpu>.json")
    parser.add_argument("--no-save", action="store_true", help="print only; write no JSON")
    return parser


def _work(args) -> dict:
    tokens = args.tokens or runtime.pick(64, 8192)
    return run(tokens, tuple(args.shapes or runtime.pick(TINY_SHAPES, LLAMA_8B_SHAPES)))


def main(argv=None) -> int:
    """Check and time the GEMMs from the command line, print the table, write ``fp8_gemm/<gpu>.json``.

    Args:
        argv: the command line's arguments (None: ``sys.argv``'s).

    Returns:
        the exit status (``cli.run_command``).
    """
    return cli.run_command(build_parser(), argv, "fp8_gemm", _work, format_table)


if __name__ == "__main__":
    raise SystemExit(main())
