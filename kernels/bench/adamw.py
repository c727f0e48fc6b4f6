"""The optimizer step at a Llama's parameter shapes: torch.optim.AdamW (foreach, fused) against
``TritonAdamW``.

``python -m kernels.bench.adamw --preset llama-3.1-8b`` allocates the preset's parameters in bf16
with random gradients (no model: only the tensors the optimizer touches), checks ours against
torch's fused step on a few of the tensors, then times one optimizer step of each implementation
(median of ``--reps``, after a first step that creates the states) and prints it beside the floor:
14 bytes per parameter (read the parameter, its gradient and both moments, write the parameter and
both moments, all bf16) at the copy bandwidth measured in the same run. Writes ``adamw/<gpu>.json``
(the preset inside) into the runs folder, or with ``--record`` into ``assets/results/``, where
chapter 11 reads it. In the interpreter it runs the tiny preset; its times mean nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kernels import runtime
from kernels.adamw import TritonAdamW
from kernels.hf.presets import PRESETS, llama_config

from . import cli
from .results import device_slug
from .timing import floor_ms, measure_copy_gbps

IMPLEMENTATIONS = {
    "foreach": ("torch.optim.AdamW (foreach, its default)", lambda ps: torch.optim.AdamW(ps, lr=1e-5)),
    "fused": ("torch.optim.AdamW(fused=True)", lambda ps: torch.optim.AdamW(ps, lr=1e-5, fused=True)),
    "ours": ("ours: TritonAdamW", lambda ps: TritonAdamW(ps, lr=1e-5)),
}
BYTES_PER_PARAMETER = 14  # bf16: 4 reads (p, g, m, v) and 3 writes (p, m, v) of 2 bytes


def parameter_shapes(preset: str) -> list[tuple[int, ...]]:
    """The shapes of a ``LlamaForCausalLM``'s parameters for ``preset`` (a tied LM head once).

    Args:
        preset: the model preset.

    Returns:
        one shape per parameter tensor, in the model's order.
    """
    c = llama_config(preset)
    h, inter, vocab = c.hidden_size, c.intermediate_size, c.vocab_size
    head_dim = getattr(c, "head_dim", None) or h // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    layer = [(q, h), (kv, h), (kv, h), (h, q), (inter, h), (inter, h), (h, inter), (h,), (h,)]
    head = [] if c.tie_word_embeddings else [(vocab, h)]
    return [(vocab, h)] + layer * c.num_hidden_layers + [(h,)] + head


def _make_parameters(shapes, device, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator(device=device).manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, device=device, generator=g).mul_(0.02).to(torch.bfloat16))
        p.grad = torch.randn(shape, device=device, generator=g).mul_(1e-3).to(torch.bfloat16)
        params.append(p)
    return params


def check(params: list[torch.nn.Parameter], count: int = 3) -> float:
    """Largest difference of one step of ours against torch's fused step on the first ``count``
    tensors, in units of the bf16 spacing at the larger of each value before and after the step (0:
    the same bits; at most 1 expected). Before, not only after: where the update nearly cancels the
    value, float32 arithmetic is exact only to the operands' scale, and the result's own spacing is
    far finer.

    Args:
        params: parameters with gradients.
        count: how many of them to compare.

    Returns:
        the largest difference, in bf16 spacings.
    """
    worst = 0.0
    for p in params[:count]:
        a = torch.nn.Parameter(p.detach().clone())
        b = torch.nn.Parameter(p.detach().clone())
        a.grad, b.grad = p.grad.clone(), p.grad.clone()
        TritonAdamW([a], lr=1e-3).step()
        torch.optim.AdamW([b], lr=1e-3, fused=True).step()
        spacing = torch.maximum(b.detach().float().abs(),
                                p.detach().float().abs()).clamp_min(2**-126) * 2**-7
        worst = max(worst, float(((a.detach().float() - b.detach().float()).abs() / spacing).max()))
    return worst


def _sync() -> None:
    if runtime.MODE == "gpu":
        torch.cuda.synchronize()


def time_step(optimizer: torch.optim.Optimizer, reps: int) -> float:
    """Median wall time of one ``optimizer.step()`` in ms, synchronised around each, after a first step.

    Args:
        optimizer: the optimizer, over parameters with gradients.
        reps: timed steps.

    Returns:
        milliseconds.
    """
    optimizer.step()
    times = []
    for _ in range(reps):
        _sync()
        start = time.perf_counter()
        optimizer.step()
        _sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def copy_gbps() -> float | None:
    """Device-to-device copy bandwidth of this GPU (read + write), GB/s; None in the interpreter.

    Returns:
        GB/s, or None.
    """
    if runtime.MODE != "gpu":
        return None
    return measure_copy_gbps()


def run(preset: str, reps: int) -> dict:
    """Check ours, then time every implementation's step at ``preset``'s parameter shapes.

    Chapter 11 shows the recorded result.

    Args:
        preset: the model preset whose parameter shapes are stepped.
        reps: timed steps per implementation.

    Returns:
        the settings, the floor, the check and a row per implementation.
    """
    shapes = parameter_shapes(preset)
    params = _make_parameters(shapes, runtime.device())
    n = sum(p.numel() for p in params)
    bandwidth = copy_gbps()
    floor = floor_ms(n * BYTES_PER_PARAMETER, bandwidth) if bandwidth else None
    rows = []
    for key, (label, build) in IMPLEMENTATIONS.items():
        optimizer = build(params)
        ms = time_step(optimizer, reps)
        rows.append({"impl": key, "label": label, "step_ms": ms,
                     "frac_copy": floor / ms if floor else None})
        del optimizer  # its moments: two more copies of the parameters
        if runtime.MODE == "gpu":
            torch.cuda.empty_cache()
    return {"preset": preset, "device": runtime.device_name(), "device_slug": device_slug(),
            "mode": runtime.MODE,
            "versions": runtime.versions(), "tensors": len(shapes), "parameters": n, "reps": reps,
            "copy_gbps": bandwidth, "floor_ms": floor, "check_max_spacings": check(params), "rows": rows}


def format_table(result: dict) -> str:
    """The result as text: the floor, the check, each implementation's step time against the fastest.

    Args:
        result: the dict of ``run``.

    Returns:
        the table, lines joined by newlines.
    """
    floor = f"{result['floor_ms']:.1f} ms" if result["floor_ms"] else "n/a (no GPU)"
    lines = [f"AdamW step, {result['preset']}: {result['parameters'] / 1e9:.3f}B bf16 parameters in "
             f"{result['tensors']} tensors on {result['device']}; floor {floor} "
             f"({BYTES_PER_PARAMETER} bytes per parameter at the copy bandwidth)",
             f"ours against torch's fused step: at most {result['check_max_spacings']:.0f} bf16 spacing(s) apart"]
    fastest = min(r["step_ms"] for r in result["rows"])
    for r in result["rows"]:
        share = f"{r['frac_copy']:6.1%} of copy" if r["frac_copy"] else ""
        lines.append(f"  {r['label']:<42}{r['step_ms']:9.2f} ms  {r['step_ms'] / fastest:5.2f}× the fastest  {share}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m kernels.bench.adamw``.

    Returns:
        the parser.
    """
    parser = argparse.ArgumentParser(prog="python -m kernels.bench.adamw",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=tuple(PRESETS), default=None,
                        help="model shapes (default: llama-3.1-8b on a GPU, tiny on a CPU)")
    parser.add_argument("--reps", type=cli.positive_int, default=None,
                        help="timed steps per implementation (default 5; CPU 2)")
    cli.add_output_arguments(parser, "adamw/<gpu>.json")
    parser.add_argument("--no-save", action="store_true", help="print only; write no JSON")
    return parser


def _work(args) -> dict:
    preset = args.preset or ("llama-3.1-8b" if runtime.MODE == "gpu" else "tiny")
    return run(preset, args.reps or runtime.pick(2, 5))


def main(argv=None) -> int:
    """Check and time the AdamW steps from the command line, print the table, write ``adamw/<gpu>.json``.

    Args:
        argv: the command line's arguments (None: ``sys.argv``'s).

    Returns:
        the exit status (``cli.run_command``).
    """
    return cli.run_command(build_parser(), argv, "adamw", _work, format_table)


if __name__ == "__main__":
    raise SystemExit(main())
