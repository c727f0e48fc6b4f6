"""RMSNorm with FP8 output, fused against the norm and the quantiser as two kernels.

``python -m kernels.bench.rmsnorm_fp8`` times, at 8,192 tokens and Llama-3.1-8B's hidden size 4,096
in bf16 (the input of the q/k/v and gate/up projections): ``rms_norm`` then ``quantize_rows`` (two
kernels: the norm's output written, then read again), ``kernels.rmsnorm_fp8.rms_norm_fp8`` (one
kernel), and ``rms_norm`` alone. It first checks that the fused kernel's codes and scales are the
two kernels' (``rmsnorm_fp8.disagreement_allowed``: bit for bit in the interpreter, a code in a
million one step off on a GPU) and records how many differ. Times are medians of ``do_bench``
(µs); GB/s are each one's minimal bytes over its time (x and the weight read once; the FP8 codes
and one float32 scale per row written, or for the norm alone its output and rstd), beside the
copy bandwidth measured in the same run. Writes ``rmsnorm_fp8/<gpu>.json`` into the runs folder,
or with ``--record`` into ``assets/results/``; an existing file is replaced only with ``--force``.
In the interpreter it runs tiny sizes; its times mean nothing. What to expect:
assets/notes/fp8.md, "Fused into RMSNorm".
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from kernels import runtime
from kernels.fp8 import quantize_rows
from kernels.rmsnorm import out_dtype, rms_norm
from kernels.rmsnorm_fp8 import MAX_HIDDEN, rms_norm_fp8

from . import cli
from .results import device_slug
from .timing import gbps, measure_copy_gbps, time_ms

EPS = 1e-6
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
LABELS = {"unfused": "rms_norm, then quantize_rows", "fused": "ours: rms_norm_fp8", "norm": "rms_norm alone"}


def make_inputs(tokens: int, hidden: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random x and a weight around 1, on this device.

    Args:
        tokens: rows.
        hidden: the hidden size.
        dtype: the storage dtype of both.
        seed: the generator's seed.

    Returns:
        ``(x, weight)``.
    """
    g = torch.Generator(device=runtime.device()).manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, device=runtime.device()).to(dtype)
    weight = (0.5 + torch.rand(hidden, generator=g, device=runtime.device())).to(dtype)
    return x, weight


def implementations(fp8_dtype: torch.dtype) -> dict[str, Callable]:
    """The calls timed, by key, each a function of ``(x, weight)``.

    Args:
        fp8_dtype: the format of the codes.

    Returns:
        ``{"unfused": ..., "fused": ..., "norm": ...}``; the first two return ``(q, scale)``.
    """
    def unfused(x, w):
        return quantize_rows(rms_norm(x, w, EPS).reshape(-1, x.shape[-1]), fp8_dtype)

    return {"unfused": unfused, "fused": lambda x, w: rms_norm_fp8(x, w, EPS, fp8_dtype),
            "norm": lambda x, w: rms_norm(x, w, EPS)}


def minimal_bytes(tokens: int, hidden: int, dtype: torch.dtype) -> dict[str, int]:
    """Each call's minimal bytes: its inputs read once, its outputs written once.

    The norm then the quantiser (``unfused``) has the fused op's minimum too: what it moves on top
    (the norm's output written and read again, its rstd) is the cost the fusion removes.

    Args:
        tokens, hidden: x's shape.
        dtype: the storage dtype of x and the weight.

    Returns:
        ``{"unfused": bytes, "fused": bytes, "norm": bytes}``.
    """
    inputs = tokens * hidden * dtype.itemsize + hidden * dtype.itemsize
    fp8_out = tokens * hidden + 4 * tokens  # one byte a code, one float32 scale a row
    norm_out = tokens * hidden * out_dtype(dtype, dtype).itemsize + 4 * tokens  # y and rstd
    return {"unfused": inputs + fp8_out, "fused": inputs + fp8_out, "norm": inputs + norm_out}


def two_kernel_bytes(tokens: int, hidden: int, dtype: torch.dtype) -> int:
    """What the norm and the quantiser move at least as two kernels: the norm's minimal bytes, then
    its output read again and the codes and scales written.

    Args:
        tokens, hidden: x's shape.
        dtype: the storage dtype of x and the weight.

    Returns:
        bytes.
    """
    y = tokens * hidden * out_dtype(dtype, dtype).itemsize
    return minimal_bytes(tokens, hidden, dtype)["norm"] + y + tokens * hidden + 4 * tokens


def check_same_bits(x: torch.Tensor, weight: torch.Tensor, fp8_dtype: torch.dtype) -> dict:
    """Refuse a fused result that differs from the two kernels' more than
    ``rmsnorm_fp8.disagreement_allowed`` lets it, before anything is timed.

    Args:
        x, weight: the inputs.
        fp8_dtype: the format.

    Returns:
        ``{"codes_differing": …, "max_steps": …, "scales_differing": …}``.

    Raises:
        RuntimeError: codes or scales that differ more, with how many.
    """
    from kernels.rmsnorm_fp8 import code_disagreements, disagreement_allowed, scales_agree

    calls = implementations(fp8_dtype)
    q, scale = calls["fused"](x, weight)
    q_ref, scale_ref = calls["unfused"](x, weight)
    codes, steps = code_disagreements(q, q_ref)
    scales = int((scale.view(torch.int32) != scale_ref.view(torch.int32)).sum())
    if not scales_agree(scale, scale_ref, runtime.INTERPRET) or not disagreement_allowed(codes, steps, q.numel(),
                                                                                         runtime.INTERPRET):
        raise RuntimeError(f"rms_norm_fp8 differs from rms_norm then quantize_rows: {codes} codes (up to {steps} "
                           f"steps) and {scales} scales of {q.numel()} and {scale.numel()}")
    return {"codes_differing": codes, "max_steps": steps, "scales_differing": scales}


def run(tokens: int, hidden: int, dtype: str, fp8: str) -> dict:
    """Check, then time the three calls.

    Args:
        tokens, hidden: x's shape.
        dtype: ``bf16``, ``fp16`` or ``fp32``.
        fp8: ``e4m3`` or ``e5m2``.

    Returns:
        The settings, the copy bandwidth, the fused op's minimal bytes, what the two kernels move
        at least (``unfused_bytes``), and a row per call: ``impl``, ``label``, ``us``, ``bytes``,
        ``gbps``, ``frac_copy``.
    """
    torch_dtype, fp8_dtype = DTYPES[dtype], FP8[fp8]
    bandwidth = measure_copy_gbps() if runtime.MODE == "gpu" else None
    x, weight = make_inputs(tokens, hidden, torch_dtype)
    agreement = check_same_bits(x, weight, fp8_dtype)
    floor = minimal_bytes(tokens, hidden, torch_dtype)
    rows = []
    for key, fn in implementations(fp8_dtype).items():
        with torch.no_grad():
            ms = time_ms(lambda fn=fn: fn(x, weight))
        achieved = gbps(floor[key], ms)
        rows.append({"impl": key, "label": LABELS[key], "us": ms * 1e3, "bytes": floor[key], "gbps": achieved,
                     "frac_copy": achieved / bandwidth if bandwidth else None})
    return {"device": runtime.device_name(), "device_slug": device_slug(), "mode": runtime.MODE,
            "versions": runtime.versions(), "tokens": tokens, "hidden": hidden, "dtype": dtype, "fp8_dtype": fp8,
            "eps": EPS, "copy_gbps": bandwidth, "fused_bytes": floor["fused"],
            "unfused_bytes": two_kernel_bytes(tokens, hidden, torch_dtype), "agreement": agreement,
            "rows": rows}


def format_table(result: dict) -> str:
    """The result as text: each call's time, GB/s and share of the copy bandwidth, and the fused
    kernel's speed-up over the two kernels.

    Args:
        result: the dict of ``run``.

    Returns:
        The table, lines joined by newlines.
    """
    copy = f"{result['copy_gbps']:.0f} GB/s" if result["copy_gbps"] else "n/a (no GPU)"
    lines = [f"RMSNorm → FP8 ({result['fp8_dtype']}) at [{result['tokens']}, {result['hidden']}] {result['dtype']} "
             f"on {result['device']}; copy {copy}",
             f"minimal bytes: fused {result['fused_bytes']:,}; the two kernels move at least "
             f"{result['unfused_bytes']:,}"]
    by = {r["impl"]: r for r in result["rows"]}
    for r in result["rows"]:
        share = f"{r['frac_copy']:6.1%} of copy" if r["frac_copy"] else ""
        lines.append(f"  {r['label']:<32}{r['us']:10.1f} µs {r['gbps']:8.1f} GB/s  {share}")
    lines.append(f"fused / unfused: {by['unfused']['us'] / by['fused']['us']:.2f}× faster; the fused kernel "
                 f"takes {by['fused']['us'] / by['norm']['us']:.2f}× the norm alone")
    lines.append(runtime.timings_note())
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m kernels.bench.rmsnorm_fp8``.

    Returns:
        The parser.
    """
    parser = argparse.ArgumentParser(prog="python -m kernels.bench.rmsnorm_fp8",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=cli.positive_int, default=None,
                        help="rows of x (default 8192 on a GPU; 64 on a CPU)")
    parser.add_argument("--hidden", type=cli.positive_int, default=None,
                        help="hidden size (default 4096 on a GPU, Llama-3.1-8B's; 256 on a CPU)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16", help="storage dtype (default bf16)")
    parser.add_argument("--fp8", choices=tuple(FP8), default="e4m3", help="FP8 format (default e4m3)")
    cli.add_output_arguments(parser, "rmsnorm_fp8/<gpu>.json")
    parser.add_argument("--no-save", action="store_true", help="print only; write no JSON")
    return parser


def _hidden(args) -> int:
    return args.hidden or runtime.pick(256, 4096)


def _problems(args) -> list[str]:
    hidden = _hidden(args)
    if hidden > MAX_HIDDEN:
        return [f"--hidden {hidden} is above {MAX_HIDDEN}, the widest row rms_norm_fp8 takes"]
    return []


def _work(args) -> dict:
    return run(args.tokens or runtime.pick(64, 8192), _hidden(args), args.dtype, args.fp8)


def main(argv=None) -> int:
    """Check and time the three calls from the command line, print the table, write
    ``rmsnorm_fp8/<gpu>.json``.

    Args:
        argv: the command line's arguments (None: ``sys.argv``'s).

    Returns:
        the exit status (``cli.run_command``).
    """
    return cli.run_command(build_parser(), argv, "rmsnorm_fp8", _work, format_table, _problems)


if __name__ == "__main__":
    raise SystemExit(main())
