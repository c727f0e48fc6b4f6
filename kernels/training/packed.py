"""Padded against packed SFT batches, end to end: ``python -m kernels.training.packed``.

The same independent examples (``make_sft_examples``: log-normal lengths, median 256 tokens, σ = 1,
clipped to ``--max-len``) go through one model two ways:

* **padded**: ``pad_examples``, ``--batch`` examples per batch, each padded on the right to the
  batch's longest, with the padding mask; ``patch_llama``'s defaults (attention by SDPA with the
  mask);
* **packed**: ``pack_examples``, rows of ``--tokens`` tokens holding whole examples back to back,
  position ids restarting in each example and the document offsets beside them; ``patch_llama``'s
  defaults with ``attention=True`` (the package's FlashAttention with the document mask), so no
  example attends to another.

Each batch is a forward and a backward (every weight's gradient, freed after the batch) with no
optimizer step, so both layouts see the same weights: the loss summed over every example (each
batch's mean times its trained labels) must agree between them, to the rounding of the dtype. One
batch of each layout runs first, untimed (compilation, allocation). The time is the whole pass over
the examples; *useful* tokens per second count the examples' own tokens, not the padding: the
measure of a fine-tuning step's work.

On a GPU: the Llama-3.1-8B shape with random bf16 weights and gradient checkpointing, 256 examples
of at most 2,048 tokens, padded 4 per batch, packed 8,192 tokens per row. In the interpreter: a
one-layer tiny Llama in float32 and a few short examples (the timings there mean nothing; the losses
are checked). Results: ``runs/packing/<name>.json``; ``--record`` writes
``assets/results/packing/<name>.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

import torch

from kernels import runtime
from kernels.bench import cli
from kernels.bench.results import results_file
from kernels.hf.patch import patch_llama
from kernels.hf.presets import PRESETS

from .data import get_tokenizer, make_sft_examples, pack_examples, pad_examples, useful_fraction
from .loop import count_trained_labels, enable_checkpointing, free_memory
from .models import build_model, llama_config

GROUP = "packing"
LAYOUTS = ("padded", "packed")


@dataclass(frozen=True)
class Setup:
    """What one comparison runs: the model, the examples and how each layout groups them."""

    preset: str
    examples: int
    max_len: int
    batch: int  # examples per padded batch
    tokens: int  # tokens per packed row
    median: int = 256
    checkpointing: bool = True
    seed: int = 0


GPU_SETUP = Setup("llama-3.1-8b", examples=256, max_len=2048, batch=4, tokens=8192)
CPU_SETUP = Setup("tiny", examples=6, max_len=48, batch=2, tokens=128, median=24, checkpointing=False)


def _on(batch: dict, device) -> dict:
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def one_pass(model: torch.nn.Module, batches: list[dict], progress: bool = True, desc: str = "") -> dict:
    """Forward and backward over every batch (gradients freed after each): the pass's time, its
    summed loss, and the batches' tokens. The first batch runs once more before the clock starts,
    untimed.

    Args:
        model: the model, on its device.
        batches: the batches, on the CPU.
        progress: show a progress bar.
        desc: the progress bar's label.

    Returns:
        ``{"seconds", "summed_loss", "batches", "tokens", "labels"}``.
    """
    from kernels.bench.progress import progress_bar as tqdm

    device = next(model.parameters()).device
    counted = [(b, count_trained_labels(b)) for b in batches]

    def step(batch: dict, count: int) -> float:
        loss = model(**_on(batch, device)).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.detach() * count

    step(*counted[0])
    runtime.synchronize(device)
    start = time.perf_counter()
    total = torch.zeros((), device=device, dtype=torch.float64)
    for batch, count in tqdm(counted, desc=desc, disable=not progress):
        if count:  # an example truncated to its prompt trains no label: its mean loss is 0/0
            total += step(batch, count)
    runtime.synchronize(device)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "summed_loss": float(total), "batches": len(batches),
            "tokens": sum(b["input_ids"].numel() for b in batches), "labels": sum(c for _, c in counted)}


def run(setup: Setup, progress: bool = True) -> dict:
    """Both layouts over the same examples on one model; the rows and their ratio.

    Chapter 16 shows the recorded result.

    Args:
        setup: the sizes, the preset and the seed.
        progress: show progress bars.

    Returns:
        device, mode, versions, settings, the useful tokens, a row per layout, the speedup and the
        summed losses' relative difference.
    """
    tokenizer = get_tokenizer()
    examples = make_sft_examples(tokenizer, setup.examples, setup.max_len, setup.seed, median=setup.median)
    useful = sum(len(ids) for ids, _ in examples)
    layouts = {"padded": pad_examples(examples, setup.batch),
               "packed": pack_examples(examples, setup.tokens)}
    dtype = torch.bfloat16 if runtime.MODE == "gpu" else torch.float32
    config = llama_config(setup.preset) if setup.preset != "tiny" else llama_config("tiny",
                                                                                    num_hidden_layers=1)
    model = build_model(config, dtype=dtype, seed=setup.seed)
    if setup.checkpointing:
        enable_checkpointing(model)
    result = {"device": runtime.device_name(), "mode": runtime.MODE, "versions": runtime.versions(),
              "settings": {**setup.__dict__, "dtype": str(dtype).removeprefix("torch.")},
              "useful_tokens": useful, "rows": {}}
    for layout in LAYOUTS:
        with patch_llama(model, attention=layout == "packed") as patch:
            row = one_pass(model, layouts[layout], progress, desc=layout)
            row["attention"] = patch.attention
        row["useful_fraction"] = useful_fraction(examples, layouts[layout])
        row["useful_tokens_per_s"] = useful / row["seconds"]
        result["rows"][layout] = row
        free_memory()
    padded, packed = result["rows"]["padded"], result["rows"]["packed"]
    result["speedup"] = packed["useful_tokens_per_s"] / padded["useful_tokens_per_s"]
    result["loss_relative_difference"] = abs(packed["summed_loss"] - padded["summed_loss"]) / abs(padded["summed_loss"])
    return result


def format_table(result: dict) -> str:
    """The two layouts' rows as text, and packed against padded (chapter 16 prints it).

    Args:
        result: the dict of ``run`` (or ``load``).

    Returns:
        the table, lines joined by newlines.
    """
    st = result["settings"]
    lines = [f"{result['device']}: {st['examples']} examples (median {st['median']} tokens, at most {st['max_len']:,})"
             f", {result['useful_tokens']:,} tokens of their own; {st['preset']}, {st['dtype']}"
             f"{', checkpointing' if st['checkpointing'] else ''}; forward + backward, no optimizer step"]
    for layout, row in result["rows"].items():
        shape = f"{st['batch']} per batch, padded" if layout == "padded" else f"{st['tokens']:,} tokens per row"
        lines.append(f"  {layout:<7} {row['batches']:>4} batches ({shape}), {row['useful_fraction']:6.1%} useful: "
                     f"{row['seconds']:8.2f} s, {row['useful_tokens_per_s']:10,.0f} useful tokens/s; summed loss "
                     f"{row['summed_loss']:.6g}")
    lines.append(f"  packed against padded: {result['speedup']:.2f}× the useful tokens/s; summed losses differ by "
                 f"{result['loss_relative_difference']:.1e} (relative)")
    return "\n".join(lines)


def load(name: str = GPU_SETUP.preset) -> dict | None:
    """The recorded run ``assets/results/packing/<name>.json``, or None when there is none yet.

    Chapter 16 reads it.

    Args:
        name: the results' name.

    Returns:
        the result's dict, or None.
    """
    path = results_file(GROUP, name)
    return json.loads(path.read_text()) if path.exists() else None


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m kernels.training.packed`` (a flag left out keeps the mode's setup).

    Returns:
        the parser.
    """
    parser = argparse.ArgumentParser(prog="python -m kernels.training.packed",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=tuple(PRESETS), default=None,
                        help=f"model shape (GPU default {GPU_SETUP.preset}; CPU: a one-layer tiny Llama)")
    parser.add_argument("--examples", type=cli.positive_int, default=None,
                        help=f"how many examples (GPU default {GPU_SETUP.examples})")
    parser.add_argument("--max-len", type=cli.positive_int, default=None,
                        help=f"longest example in tokens, at least 32 (GPU default {GPU_SETUP.max_len})")
    parser.add_argument("--batch", type=cli.positive_int, default=None,
                        help=f"examples per padded batch (GPU default {GPU_SETUP.batch})")
    parser.add_argument("--tokens", type=cli.positive_int, default=None,
                        help=f"tokens per packed row, at least --max-len (GPU default {GPU_SETUP.tokens})")
    parser.add_argument("--no-checkpointing", action="store_true",
                        help="keep every activation (GPU default: gradient checkpointing)")
    parser.add_argument("--name", type=cli.file_name, default=None,
                        help="the results' name (default: the preset)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    cli.add_output_arguments(parser, f"{GROUP}/<name>.json")
    return parser


def setup_from_args(args) -> Setup:
    """The mode's default ``Setup`` with the flags that were given over it.

    Args:
        args: the parsed flags.

    Returns:
        the ``Setup``.
    """
    base = GPU_SETUP if runtime.MODE == "gpu" else CPU_SETUP
    chosen = {k: getattr(args, k) for k in ("preset", "examples", "max_len", "batch", "tokens")
              if getattr(args, k) is not None}
    if args.no_checkpointing:
        chosen["checkpointing"] = False
    return Setup(**{**base.__dict__, **chosen})


def main(argv=None) -> int:
    """Run both layouts from the command line, print the table, write ``packing/<name>.json``.

    Args:
        argv: the command line's arguments (None: ``sys.argv``'s).

    Returns:
        the exit status, 0 (a refused flag exits through ``argparse``).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    setup = setup_from_args(args)
    problems = []
    if setup.max_len < 32:
        problems.append(f"--max-len must be at least 32 (the shortest example), got {setup.max_len}")
    if setup.tokens < setup.max_len:
        problems.append(f"--tokens {setup.tokens} is below --max-len {setup.max_len}: the longest example would not "
                        "fit a packed row")
    path = results_file(GROUP, args.name or setup.preset, cli.output_root(args))
    cli.check_outputs(parser, args, [path], problems)
    print(runtime.describe())
    result = run(setup, progress=not args.no_progress)
    print(format_table(result))
    print("saved", cli.write_json(path, result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
