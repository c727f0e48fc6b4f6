"""The residual add and RMSNorm, fused against unfused, forward and backward.

``python -m kernels.bench.add_rmsnorm`` times, at Llama's hidden size (4,096 for the 8B model) and
a few token counts, four ways to compute ``h = x + residual`` and ``y = RMSNorm(h)`` with the
gradients of x, residual and the weight from both dy and dh: Hugging Face's add and
``LlamaRMSNorm``; the add and ``TritonRMSNorm``; ``torch.compile`` of the add and the norm; and
``kernels.add_rmsnorm.add_rms_norm``. Each is checked against float64 first. Times are medians of
``do_bench`` (µs); GB/s are the fused op's minimal bytes over each time, beside the copy bandwidth
measured in the same run. Writes ``add_rmsnorm/<gpu>.json`` into the runs folder, or with
``--record`` into ``assets/results/``; an existing file is replaced only with ``--force``. In the
interpreter it runs tiny sizes; its times mean nothing. The byte count: assets/notes/add_rmsnorm.md.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from kernels import runtime
from kernels.add_rmsnorm import add_rms_norm
from kernels.reference import relative_error, rms_norm_reference
from kernels.rmsnorm import rms_norm
from kernels.tolerances import RELATIVE_ERROR_TOL

from . import cli
from .results import device_slug
from .timing import gbps, measure_copy_gbps, time_ms

EPS = 1e-6
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def add_then(norm: Callable) -> Callable:
    """The decoder layer's two steps unfused: PyTorch's add, then ``norm`` of the sum.

    Args:
        norm: ``norm(h, weight, eps)``, e.g. ``rms_norm_reference`` (``LlamaRMSNorm``'s operations,
            Hugging Face's layer) or the package's ``rms_norm``.

    Returns:
        A function of ``(x, residual, weight)`` returning ``(y, h)``, as ``add_rms_norm`` does.
    """
    def add_and_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor):
        h = residual + x
        return norm(h, weight, EPS), h

    return add_and_norm


hf_add_norm = add_then(rms_norm_reference)


def fused(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused kernel, with the benchmark's eps.

    Args:
        x: the sublayer's output.
        residual: the residual stream.
        weight: the norm's weight.

    Returns:
        ``(y, h)``.
    """
    return add_rms_norm(x, residual, weight, EPS)


def implementations() -> dict[str, tuple[str, Callable]]:
    """The implementations compared, by key: (label, function of x, residual and weight).

    Returns:
        ``{key: (label, fn)}``, Hugging Face's first.
    """
    return {
        "hf": ("Hugging Face: add + LlamaRMSNorm", hf_add_norm),
        "triton_norm": ("add + TritonRMSNorm", add_then(rms_norm)),
        "compiled": (f"torch.compile(add + LlamaRMSNorm), {runtime.COMPILE_BACKEND}",
                     torch.compile(hf_add_norm, backend=runtime.COMPILE_BACKEND)),
        "fused": ("ours: add_rms_norm", fused),
    }


def minimal_bytes(tokens: int, hidden: int, itemsize: int) -> dict[str, int]:
    """The fused op's minimal bytes: each input read once, each output written once.

    Forward: x and residual read, h and y written, one float32 rstd per row, the weight read.
    Backward: dy, dh and h read with rstd and the weight; one gradient written for x and residual
    (the same tensor), and dW.

    Args:
        tokens: rows.
        hidden: the hidden size.
        itemsize: bytes per element.

    Returns:
        ``{"fwd": bytes, "fwd+bwd": bytes}``.
    """
    row = tokens * hidden * itemsize
    forward = 4 * row + 4 * tokens + hidden * itemsize
    backward = 4 * row + 4 * tokens + 2 * hidden * itemsize
    return {"fwd": forward, "fwd+bwd": forward + backward}


def make_inputs(tokens: int, hidden: int, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random x, residual, weight (around 1) and the incoming gradients dy and dh, on this device.

    Args:
        tokens: rows.
        hidden: the hidden size.
        dtype: the storage dtype.
        seed: the generator's seed.

    Returns:
        The tensors by name.
    """
    g = torch.Generator(device=runtime.device()).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=runtime.device()).to(dtype)

    weight = (0.5 + torch.rand(hidden, generator=g, device=runtime.device())).to(dtype)
    return dict(x=randn(tokens, hidden), residual=randn(tokens, hidden), weight=weight,
                dy=randn(tokens, hidden), dh=randn(tokens, hidden))


def forward_backward(fn: Callable, t: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """One forward and backward of ``fn`` on leaves made from ``t``: y, h and the three gradients.

    Args:
        fn: an implementation.
        t: the inputs of ``make_inputs``.

    Returns:
        ``[y, h, dx, dresidual, dweight]``.
    """
    x, r, w = (t[k].detach().clone().requires_grad_() for k in ("x", "residual", "weight"))
    y, h = fn(x, r, w)
    torch.autograd.backward([y, h], [t["dy"], t["dh"]])
    return [y.detach(), h.detach(), x.grad, r.grad, w.grad]


def check(fn: Callable, t: dict[str, torch.Tensor]) -> float:
    """The largest relative error of ``fn``'s outputs and gradients against float64.

    Args:
        fn: an implementation.
        t: the inputs of ``make_inputs``.

    Returns:
        The largest of the five relative errors.
    """
    expected = forward_backward(hf_add_norm, {k: v.double() for k, v in t.items()})
    return max(relative_error(a, b, on_device=True) for a, b in zip(forward_backward(fn, t), expected))


def time_passes(fn: Callable, t: dict[str, torch.Tensor]) -> dict[str, float]:
    """Median milliseconds of the forward alone and of forward + backward.

    Args:
        fn: an implementation.
        t: the inputs of ``make_inputs``.

    Returns:
        ``{"fwd": ms, "fwd+bwd": ms}``.
    """
    x, r, w = (t[k].detach().clone().requires_grad_() for k in ("x", "residual", "weight"))

    def forward():
        with torch.no_grad():
            fn(x, r, w)

    def step():
        y, h = fn(x, r, w)
        torch.autograd.backward([y, h], [t["dy"], t["dh"]])

    return {"fwd": time_ms(forward), "fwd+bwd": time_ms(step, grad_to_none=[x, r, w])}


def run(tokens: tuple[int, ...], hidden: int, dtype: str) -> dict:
    """Check, then time every implementation at each token count.

    Args:
        tokens: the token counts.
        hidden: the hidden size.
        dtype: ``bf16``, ``fp16`` or ``fp32``.

    Returns:
        The settings, the copy bandwidth and a row per implementation × token count × pass.
    """
    torch_dtype = DTYPES[dtype]
    bandwidth = measure_copy_gbps() if runtime.MODE == "gpu" else None
    rows = []
    for n in tokens:
        t = make_inputs(n, hidden, torch_dtype)
        floor = minimal_bytes(n, hidden, torch_dtype.itemsize)
        for key, (label, fn) in implementations().items():
            error = check(fn, t)
            if not error < RELATIVE_ERROR_TOL[torch_dtype]:
                raise RuntimeError(f"{label} at {n} tokens: relative error {error:.3g} against float64")
            for pass_, ms in time_passes(fn, t).items():
                achieved = gbps(floor[pass_], ms)
                rows.append({"impl": key, "label": label, "tokens": n, "pass": pass_, "us": ms * 1e3,
                             "gbps": achieved, "frac_copy": achieved / bandwidth if bandwidth else None,
                             "max_rel_error": error})
        del t
    return {"device": runtime.device_name(), "device_slug": device_slug(), "mode": runtime.MODE,
            "versions": runtime.versions(), "hidden": hidden, "dtype": dtype, "tokens": list(tokens),
            "eps": EPS, "copy_gbps": bandwidth, "rows": rows}


def format_table(result: dict) -> str:
    """The result as text: per token count and pass, each implementation's time, GB/s and speed-up
    over Hugging Face's.

    Args:
        result: the dict of ``run``.

    Returns:
        The table, lines joined by newlines.
    """
    copy = f"{result['copy_gbps']:.0f} GB/s" if result["copy_gbps"] else "n/a (no GPU)"
    lines = [f"add + RMSNorm, hidden {result['hidden']}, {result['dtype']}, on {result['device']}; copy {copy}"]
    for n in result["tokens"]:
        for pass_ in ("fwd", "fwd+bwd"):
            rows = [r for r in result["rows"] if r["tokens"] == n and r["pass"] == pass_]
            base = next(r["us"] for r in rows if r["impl"] == "hf")
            lines.append(f"{n} tokens, {pass_}:")
            for r in rows:
                share = f"{r['frac_copy']:6.1%} of copy" if r["frac_copy"] else ""
                lines.append(f"  {r['label']:<46}{r['us']:10.1f} µs {r['gbps']:8.1f} GB/s "
                             f"{base / r['us']:6.2f}× HF  {share}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m kernels.bench.add_rmsnorm``.

    Returns:
        The parser.
    """
    parser = argparse.ArgumentParser(prog="python -m kernels.bench.add_rmsnorm",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=cli.positive_ints, default=None,
                        help="token counts, comma-separated (default 4096,16384 on a GPU; 64 on a CPU)")
    parser.add_argument("--hidden", type=cli.positive_int, default=None,
                        help="hidden size (default 4096 on a GPU, Llama-3.1-8B's; 256 on a CPU)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16", help="storage dtype (default bf16)")
    cli.add_output_arguments(parser, "add_rmsnorm/<gpu>.json")
    parser.add_argument("--no-save", action="store_true", help="print only; write no JSON")
    return parser


def _work(args) -> dict:
    tokens = args.tokens or runtime.pick((64,), (4096, 16384))
    return run(tuple(tokens), args.hidden or runtime.pick(256, 4096), args.dtype)


def main(argv=None) -> int:
    """Check and time the implementations from the command line, print the table, write
    ``add_rmsnorm/<gpu>.json``.

    Args:
        argv: the command line's arguments (None: ``sys.argv``'s).

    Returns:
        the exit status (``cli.run_command``).
    """
    return cli.run_command(build_parser(), argv, "add_rmsnorm", _work, format_table)


if __name__ == "__main__":
    raise SystemExit(main())
