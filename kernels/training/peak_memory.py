"""What a training step's peak memory is made of, measured: the blocks alive at the peak, and the
slope per token.

``fit.memory_slope`` gives one number, the bytes one more token adds to a step's peak. This module
takes the peak apart. It runs a checkpointed training step (forward, backward, AdamW) at two lengths
with PyTorch's allocator history on (``torch.cuda.memory._record_memory_history``), replays the
history of the longer step to find the moment of the peak, and lists the tensors alive at that
moment by size and by the Python line that allocated them. A tensor's bytes per token (size /
tokens) names it: 2·H is a [tokens, H] bf16 activation, 2·I the MLP's intermediate, 2·tokens the row
of a [tokens, tokens] bf16 mask.

Variants: Hugging Face's model; this package's patch with the linear cross-entropy (``ours_lce``),
with every kernel (``ours_all``) and with every kernel and the padding mask as one additive bias
(``ours_bias``, ``kernels.hf.attention_mask``); Liger-Kernel's fused linear cross-entropy and
RMSNorm (``liger_flce``) and all its Llama kernels (``liger_all``), when installed. Each runs with
and without the padding mask (``kernels.hf.padding_mask``). Liger patches Hugging Face's Llama
classes for the rest of the process, so its variants always run last.

    python -m kernels.training.peak_memory --preset llama-3.2-1b   # GPU only

It writes ``peak_memory/<preset>_<gpu>.json`` into the runs folder, or with ``--record`` into
``assets/results/``, where chapters 10 and 11 read it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch

from kernels import runtime
from kernels.bench import cli
from kernels.bench.results import RESULTS, device_slug, results_file
from kernels.hf.patch import patch_llama
from kernels.hf.presets import PRESETS

from .data import get_tokenizer
from .fit import probe_batch
from .loop import default_lr, enable_checkpointing, free_memory
from .models import build_model

OURS = {"ours_lce": dict(kernels=("rms_norm", "linear_cross_entropy")),
        "ours_all": dict(kernels=("rms_norm", "linear_cross_entropy", "swiglu", "rope")),
        "ours_bias": dict(kernels=("rms_norm", "linear_cross_entropy", "swiglu", "rope", "additive_mask"))}
LIGER = {"liger_flce": dict(rms_norm=True, fused_linear_cross_entropy=True, cross_entropy=False, rope=False,
                            swiglu=False),
         "liger_all": dict(rms_norm=True, fused_linear_cross_entropy=True, cross_entropy=False, rope=True,
                           swiglu=True)}
VARIANTS = ("hf", *OURS, *LIGER)
LENGTHS = (16384, 32768)
FREES = ("free_requested", "free_completed")


# --------------------------------------------------------------------------------------------------
# The replay: pure functions over the allocator's trace (a list of dicts), testable without a GPU
# --------------------------------------------------------------------------------------------------


def peak_index(trace: list[dict]) -> tuple[int, int]:
    """(index of the allocation that reached the peak, bytes alive then) over the trace's own
    allocations; blocks allocated before the history started are not in it, so the bytes are
    relative to the start.

    Args:
        trace: the allocator's history: one device's ``device_traces`` of ``torch.cuda.memory._snapshot()``.

    Returns:
        ``(index, bytes)``; index -1 when the trace allocates nothing.
    """
    live: dict[int, int] = {}
    current = best = 0
    best_at = -1
    for i, event in enumerate(trace):
        if event["action"] == "alloc":
            live[event["addr"]] = event["size"]
            current += event["size"]
            if current > best:
                best, best_at = current, i
        elif event["action"] in FREES and event["addr"] in live:
            current -= live.pop(event["addr"])
    return best_at, best


def _site(frames: list[dict], depth: int = 3) -> str:
    # The innermost lines outside PyTorch's own files (checkpointing excepted: it names the
    # recomputed layer).
    own = [f for f in frames if "torch/" not in f["filename"] or "checkpoint" in f["filename"]]
    return " < ".join(f"{Path(f['filename']).name}:{f['line']}:{f['name']}" for f in own[:depth]) or "(autograd)"


def live_at(trace: list[dict], index: int, tokens: int, top: int = 12) -> list[dict]:
    """The blocks alive just after ``trace[index]``, grouped by (size, allocating site), largest total first:
    ``total_bytes``, ``size``, ``count``, ``bytes_per_token`` (size / ``tokens``) and ``site``.

    Args:
        trace: the allocator's history.
        index: the event after which to look.
        tokens: the step's tokens.
        top: how many groups to keep.

    Returns:
        the groups, largest total first.
    """
    live: dict[int, dict] = {}
    for event in trace[: index + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] in FREES:
            live.pop(event["addr"], None)
    groups = Counter((e["size"], _site(e.get("frames", []))) for e in live.values())
    rows = [{"total_bytes": size * n, "size": size, "count": n, "bytes_per_token": size / tokens,
             "site": site}
            for (size, site), n in groups.items()]
    return sorted(rows, key=lambda r: -r["total_bytes"])[:top]


def slope(short: dict, long: dict, key: str = "peak_bwd") -> float:
    """Bytes per token between two probes (``measure``'s dicts).

    Args:
        short: the shorter probe.
        long: the longer probe.
        key: which peak: ``"after_fwd"``, ``"peak_fwd"`` or ``"peak_bwd"``.

    Returns:
        bytes per token.
    """
    return (long[key] - short[key]) / (long["tokens"] - short["tokens"])


# --------------------------------------------------------------------------------------------------
# The measurement (GPU)
# --------------------------------------------------------------------------------------------------


def _prepare(preset: str, variant: str):
    model = build_model(preset, dtype=torch.bfloat16, seed=0)
    enable_checkpointing(model)
    if variant in OURS:
        patch_llama(model, **OURS[variant])
    elif variant in LIGER:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(model=model, **LIGER[variant])
    return model, torch.optim.AdamW(model.parameters(), lr=default_lr(preset))


def _step(model, optimizer, tokenizer, tokens: int, padding_mask: bool, record: bool) -> dict:
    cpu, n_items = probe_batch(tokenizer, 1, tokens, 0, model.config.vocab_size, padding_mask)
    batch = {k: v.cuda() for k, v in cpu.items()}
    free_memory()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    if record:
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    loss = model(**batch, num_items_in_batch=n_items).loss
    after_forward, peak_forward = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    del loss
    peak_backward = torch.cuda.max_memory_allocated()
    found = {"tokens": tokens, "after_fwd": after_forward - base, "peak_fwd": peak_forward - base,
             "peak_bwd": peak_backward - base}
    if record:
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
        torch.cuda.memory._record_memory_history(enabled=None)
        index, _ = peak_index(trace)
        found["live_at_peak"] = live_at(trace, index, tokens)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return found


def measure(preset: str, variant: str, lengths: tuple[int, int] = LENGTHS,
            padding_mask: bool = True) -> dict:
    """GPU only: one variant's probes at both lengths (the longer one with the blocks alive at its
    peak) and its slopes per token (after the forward pass, at the forward's peak, at the backward's
    peak).

    Args:
        preset: the model preset.
        variant: one of ``VARIANTS``.
        lengths: the two sequence lengths.
        padding_mask: keep the padding mask.

    Returns:
        ``{"variant", "padding_mask", "probes", "bytes_per_token"}``.

    Raises:
        ValueError: when ``variant`` is not one of ``VARIANTS``.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    free_memory()
    model, optimizer = _prepare(preset, variant)
    tokenizer = get_tokenizer()
    # Checkpointing's early stop ends a layer's recomputation by raising from inside the last save
    # of the layer. With the allocator history on, PyTorch 2.11 turns that into a SystemError when
    # the saver is a custom autograd.Function (pytorch/pytorch#179536), as the patched MLP's
    # SwiGLUDownFunction is. Every variant recomputes whole layers here, so all of them are measured
    # the same way.
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        _step(model, optimizer, tokenizer, 256, padding_mask, False)  # AdamW's states, outside the probes
        probes = [_step(model, optimizer, tokenizer, n, padding_mask, n == lengths[-1]) for n in lengths]
    del model, optimizer
    free_memory()
    return {"variant": variant, "padding_mask": padding_mask, "probes": probes,
            "bytes_per_token": {k: slope(*probes, k) for k in ("after_fwd", "peak_fwd", "peak_bwd")}}


def _available(variant: str) -> bool:
    if variant not in LIGER:
        return True
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError:
        return False
    return True


def run(preset: str = "llama-3.2-1b", variants=VARIANTS, lengths=LENGTHS, masks=(True, False)) -> dict:
    """GPU only: ``measure`` for each variant (Liger's last) with and without the padding mask.

    Args:
        preset: the model preset.
        variants: the variants to measure (those not installed are left out).
        lengths: the two sequence lengths.
        masks: the padding-mask settings to measure each variant with.

    Returns:
        preset, device, versions, lengths and one row per (variant, mask).
    """
    order = [v for v in VARIANTS if v in variants and _available(v)]
    rows = [measure(preset, v, tuple(lengths), m) for v in order for m in masks]
    return {"preset": preset, "device": runtime.device_name(), "versions": runtime.versions(),
            "lengths": list(lengths), "gradient_checkpointing": True, "rows": rows}


def table(results: dict) -> str:
    """Bytes per token at the backward's peak, each variant with and without the mask.

    Chapters 10 and 11 print it.

    Args:
        results: the dict of ``run`` (or ``load``).

    Returns:
        the table, lines joined by newlines.
    """
    lines = [f"{results['preset']}, checkpointed, between {results['lengths'][0]:,} and {results['lengths'][1]:,} "
             f"tokens ({results['device']}): KiB per token at the step's peak",
             f"{'variant':<12} {'with mask':>10} {'no mask':>10}"]
    by = {(r["variant"],
           r["padding_mask"]): r["bytes_per_token"]["peak_bwd"] / 1024 for r in results["rows"]}
    for variant in dict.fromkeys(r["variant"] for r in results["rows"]):
        cells = [f"{by[(variant, m)]:10.1f}" if (variant, m) in by else f"{'-':>10}" for m in (True, False)]
        lines.append(f"{variant:<12} {' '.join(cells)}")
    return "\n".join(lines)


def load(preset: str = "llama-3.2-1b", directory: Path = RESULTS) -> dict | None:
    """The committed measurement of ``preset`` (``peak_memory/<preset>_<gpu>.json``), whichever GPU
    made it, or None.

    Chapters 10 and 11 read it.

    Args:
        preset: the model preset.
        directory: the results root.

    Returns:
        the measurement's dict, or None.
    """
    pattern = results_file("peak_memory", f"{preset}_*", directory)  # one file per GPU
    found = sorted(pattern.parent.glob(pattern.name))
    return json.loads(found[0].read_text()) if found else None


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m kernels.training.peak_memory``.

    Returns:
        the parser.
    """
    p = argparse.ArgumentParser(prog="python -m kernels.training.peak_memory",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama-3.2-1b", choices=tuple(PRESETS))
    p.add_argument("--variants", type=cli.names(VARIANTS), default=tuple(VARIANTS),
                   help=f"comma-separated, from {', '.join(VARIANTS)}")
    p.add_argument("--lengths", type=cli.increasing_pair, default=tuple(LENGTHS),
                   help=f"the two sequence lengths the slope is taken between (default {','.join(map(str, LENGTHS))})")
    cli.add_output_arguments(p, "peak_memory/<preset>_<gpu>.json")
    return p


def main(argv: list[str] | None = None) -> int:
    """Measure from the command line (GPU only), print the table, write ``peak_memory/<preset>_<gpu>.json``.

    Args:
        argv: the command line's arguments (None: ``sys.argv``'s).

    Returns:
        the exit status, 0 (without a GPU, or with a refused flag, it exits through ``argparse``).
    """
    p = build_parser()
    args = p.parse_args(argv)
    path = results_file("peak_memory", f"{args.preset}_{device_slug()}", cli.output_root(args))
    gpu = cli.gpu_problems("this command", "it reads the GPU allocator's peaks, which the CPU does not keep")
    cli.check_outputs(p, args, [path], gpu)
    results = run(args.preset, args.variants, args.lengths)
    print(table(results))
    print(f"wrote {cli.write_json(path, results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
