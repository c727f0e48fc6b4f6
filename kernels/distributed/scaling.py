"""Scaling with FSDP2: tokens/s and peak memory per GPU, 1 GPU against N, Hugging Face's model
against patched.

    python -m kernels.distributed.scaling --preset llama-3.1-8b --gpus 1,2 --seq-lens 2048,4096,8192,16384   # 2 × H200

For every number of GPUs, variant (``baseline``, ``patched``) and sequence length, one ``torchrun
--nproc-per-node N -m kernels.distributed.finetune`` run (``kernels.distributed.parallel.launch``)
at the same per-GPU batch (``--batch-per-gpu`` rows; the global batch grows with N). Sequence
lengths are tried in increasing order; the first that does not fit (the run dies with
``torch.OutOfMemoryError``) ends that series, so the longest length that ran is the longest that
fits per GPU among those tried. Each run is a fresh process group, so an OOM leaves nothing behind
for the next. Results: ``scaling/<preset>.json`` and ``.png`` (``plot_scaling``) in the runs folder,
or with ``--record`` in ``assets/results/``, where chapter 12 reads them (over the preset's earlier
run only with ``--force``); its flags are the JSON's ``settings``. On the CPU the same command runs
tiny sizes with gloo processes (times there mean nothing).

``fsdp_budget`` is the arithmetic on paper for larger runs: state per GPU, bytes each GPU sends per
step, the time that takes over a link, against the compute time of a step measured on one GPU.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from kernels import runtime
from kernels.bench import cli
from kernels.bench.results import find_run, results_file
from kernels.hf.presets import PRESETS
from kernels.training.models import GiB, count_parameters, llama_config

from .parallel import launch

# 50 timed steps and more per point on a GPU (plus the warm-up steps): fewer drift by several
# percent between runs.
GPU_DEFAULTS = dict(preset="llama-3.1-8b", gpus="1,2", seq_lens="2048,4096,8192,16384", steps=53,
                    batch_per_gpu=1)
CPU_DEFAULTS = dict(preset="tiny", gpus="1,2", seq_lens="64,128", steps=3, batch_per_gpu=1)


# --------------------------------------------------------------------------------------------------
# The benchmark: one torchrun per (GPUs, variant, sequence length)
# --------------------------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return list(cli.positive_ints(text))


def run_point(gpus: int, variant: str, seq_len: int, *, preset: str, steps: int, batch_per_gpu: int,
              gradient_checkpointing: bool, timeout_s: float, work_dir: Path, profile_steps: int = 0,
              kernels: str | None = None, prefetch: int = 0) -> dict:
    """One sharded run; returns its row of the results (``fits`` False when it ran out of GPU
    memory). ``profile_steps`` > 0 adds rank 0's profile of that many more steps (``comm_profile``);
    ``kernels`` is the patched variant's ``--kernels`` list (default: ``patch_llama``'s defaults);
    ``prefetch`` FSDP2's explicit prefetch depth (0: its implicit one layer).

    Args:
        gpus: processes (GPUs) of the run.
        variant: ``"baseline"`` or ``"patched"``.
        seq_len: tokens per row.
        preset: the model preset.
        steps: optimizer steps.
        batch_per_gpu: rows per GPU per micro-batch.
        gradient_checkpointing: checkpoint each decoder layer.
        timeout_s: seconds before the run is ended.
        work_dir: the folder the run writes its results under.
        profile_steps: steps to profile after the timed run (0: none).
        kernels: the patched variant's ``--kernels`` (None: the defaults).
        prefetch: layers to all-gather ahead (0: FSDP2's implicit one).

    Returns:
        the row: the point's settings and seconds, then its figures, losses, device and versions when it
        ran, or ``fits`` (False on out-of-memory, None on another failure) and the output's end.
    """
    args = ["--preset", preset, "--steps", str(steps), "--seq-len", str(seq_len), "--batch-size",
            str(batch_per_gpu * gpus), "--grad-accum", "1"]
    if variant == "baseline":
        args.append("--baseline")
    elif kernels:
        args += ["--kernels", kernels]
    if gradient_checkpointing:
        args.append("--gradient-checkpointing")
    if profile_steps:
        args += ["--profile-steps", str(profile_steps)]
    if prefetch:
        args += ["--prefetch", str(prefetch)]
    out = work_dir / f"{variant}_n{gpus}_seq{seq_len}"
    result = launch(gpus, args, out, preset=preset, timeout_s=timeout_s)
    row = {"gpus": gpus, "variant": variant, "seq_len": seq_len, "batch_per_gpu": batch_per_gpu,
           "seconds": result.seconds}
    if result.results is None:
        oom = "OutOfMemoryError" in result.output or "CUDA out of memory" in result.output
        row.update(fits=False if oom else None, error=result.output[-2000:])
        return row
    data = result.load()
    summary = data["summary"][variant]
    row.update(fits=True, tokens_per_s_per_gpu=summary["tokens_per_s_per_gpu"],
               tokens_per_s_total=summary["tokens_per_s_total"], step_time_s=summary["step_time_s"],
               peak_memory_bytes_max_rank=summary["peak_memory_bytes_max_rank"],
               final_loss=summary["final_loss"],
               losses=[s["loss"] for s in data["runs"][variant]["steps"]],
               timed_steps=sum(1 for s in data["runs"][variant]["steps"] if s.get("timed", True)),
               device=data["device"], versions=data["versions"], backend=data["backend"])
    if data.get("comm_profile", {}).get(variant):
        row["comm_profile"] = data["comm_profile"][variant]
    return row


def run_scaling(preset: str, gpus: list[int], seq_lens: list[int], *, variants=("baseline", "patched"),
                steps: int = 8, batch_per_gpu: int = 1, gradient_checkpointing: bool = False,
                timeout_s: float = 600, work_dir: str | Path | None = None, echo: bool = True,
                profile_steps: int = 0, kernels: str | None = None, prefetch: int = 0) -> dict:
    """Every point of the grid (see the module docstring); returns the results dict ``plot_scaling``
    reads.

    Chapter 12 runs the grid with it.

    Args:
        preset: the model preset.
        gpus: the GPU counts to compare.
        seq_lens: the sequence lengths to try at each count (shortest first; the longer ones are
            skipped after one that does not fit or fails).
        variants: ``"baseline"``, ``"patched"`` or both.
        steps: optimizer steps per run.
        batch_per_gpu: rows per GPU per micro-batch.
        gradient_checkpointing: checkpoint each decoder layer in every run.
        timeout_s: seconds one run may take.
        work_dir: where the runs write (None: a temporary folder).
        echo: print each row as it finishes.
        profile_steps: steps to profile after each timed run (0: none).
        kernels: the patched variant's ``--kernels`` (None: the defaults).
        prefetch: layers to all-gather ahead (0: FSDP2's implicit one).

    Returns:
        device, mode, versions, settings, the rows, ``longest_fitting`` and ``scaling_efficiency``.
    """
    rows = []
    with tempfile.TemporaryDirectory(prefix="scaling_") as tmp:
        work = Path(work_dir) if work_dir is not None else Path(tmp)
        for n in gpus:
            for variant in variants:
                for seq_len in sorted(seq_lens):
                    row = run_point(n, variant, seq_len, preset=preset, steps=steps,
                                    batch_per_gpu=batch_per_gpu,
                                    gradient_checkpointing=gradient_checkpointing, timeout_s=timeout_s,
                                    work_dir=work, profile_steps=profile_steps, kernels=kernels,
                                    prefetch=prefetch)
                    rows.append(row)
                    if echo:
                        print(_row_text(row), flush=True)
                    if not row["fits"]:
                        break  # longer sequences do not fit either (or the run failed: see its error)
    return {
        "device": runtime.device_name(), "mode": runtime.MODE, "versions": runtime.versions(),
        "settings": {"preset": preset, "gpus": gpus, "seq_lens": sorted(seq_lens),
                     "variants": list(variants),
                     "steps": steps, "batch_per_gpu": batch_per_gpu,
                     "gradient_checkpointing": gradient_checkpointing,
                     "profile_steps": profile_steps, "kernels": kernels or "patch_llama defaults",
                     "prefetch": prefetch or "FSDP2 default (one layer, implicit)",
                     "sharding": "FSDP2 per decoder layer + root, bf16 compute, float32 gradient reduction"},
        "runs": rows,
        "longest_fitting": longest_fitting(rows),
        "scaling_efficiency": scaling_efficiency(rows),
    }


def scaling_efficiency(rows: list[dict]) -> dict:
    """variant -> sequence length -> ``{"base_gpus": B, "N": tokens/s per GPU at N over at B,
    ...}``, with B the fewest GPUs at which that length ran (1, or 2 where one GPU cannot hold the
    model), and ``"N/M"`` the same ratio between consecutive counts (``"2/1"``, ``"4/2"``). 1.0 is
    perfect scaling: each GPU as fast as alone.

    Args:
        rows: the rows of ``run_scaling``.

    Returns:
        the ratios, keyed by variant, then by sequence length (as a string).
    """
    out: dict = {}
    points: dict = {}
    for row in rows:
        if row["fits"]:
            points.setdefault(row["variant"], {}).setdefault(row["seq_len"], {})[row["gpus"]] = \
                row["tokens_per_s_per_gpu"]
    for variant, by_len in points.items():
        for seq_len, by_gpus in by_len.items():
            counts = sorted(by_gpus)
            base = counts[0]
            entry = {"base_gpus": base}
            entry.update({str(n): by_gpus[n] / by_gpus[base] for n in counts})
            entry.update({f"{b}/{a}": by_gpus[b] / by_gpus[a] for a, b in zip(counts, counts[1:])})
            out.setdefault(variant, {})[str(seq_len)] = entry
    return out


def efficiency_table(results: dict) -> str:
    """One line per (variant, length): tokens/s per GPU at each count, and the efficiency between counts.

    Chapter 12 prints it.

    Args:
        results: the dict of ``run_scaling``.

    Returns:
        the table, lines joined by newlines.
    """
    eff = results.get("scaling_efficiency") or scaling_efficiency(results["runs"])
    gpus = sorted({r["gpus"] for r in results["runs"]})
    head = f"{'variant':<10}{'seq':>7}" + "".join(f"{f'{n} GPU tok/s/GPU':>18}" for n in gpus) + "  efficiency"
    lines = [head]
    for variant, by_len in eff.items():
        for seq_len, entry in sorted(by_len.items(), key=lambda kv: int(kv[0])):
            cells = []
            for n in gpus:
                row = next((r for r in results["runs"] if r["variant"] == variant and r["gpus"] == n
                            and r["seq_len"] == int(seq_len) and r["fits"]), None)
                cells.append(f"{row['tokens_per_s_per_gpu']:>18,.0f}" if row else f"{'—':>18}")
            ratios = ", ".join(f"{k}: {v:.3f}" for k, v in entry.items() if "/" in k)
            lines.append(f"{variant:<10}{int(seq_len):>7}" + "".join(cells) + f"  {ratios}")
    return "\n".join(lines)


def longest_fitting(rows: list[dict]) -> dict:
    """variant -> {GPUs: the longest sequence length that ran}.

    Args:
        rows: the rows of ``run_scaling``.

    Returns:
        the lengths, keyed by variant, then by GPU count (as a string).
    """
    out: dict = {}
    for row in rows:
        if row["fits"]:
            best = out.setdefault(row["variant"], {})
            best[str(row["gpus"])] = max(best.get(str(row["gpus"]), 0), row["seq_len"])
    return out


def _row_text(row: dict) -> str:
    head = f"{row['variant']:<9} {row['gpus']} GPU(s) seq {row['seq_len']:>6}: "
    if not row["fits"]:
        return head + ("does not fit (out of memory)" if row["fits"] is False else "FAILED, see 'error'")
    peak = row["peak_memory_bytes_max_rank"]
    peak_text = f"{peak / GiB:.1f} GiB" if peak is not None else "n/a (CPU)"
    return head + f"{row['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, peak {peak_text} per GPU"


def predicted_sent_bytes(preset: str, gpus: int) -> float:
    """``bytes_sent_per_step`` of ``preset`` on ``gpus`` GPUs under ``shard_llama``: the paper
    figure that the profiled bytes (``comm_profile``) are checked against.

    Args:
        preset: the model preset.
        gpus: the number of GPUs.

    Returns:
        bytes each GPU sends per step.
    """
    config = llama_config(preset)
    return bytes_sent_per_step(count_parameters(config), gathered_once_count(config), gpus)


def profile_table(results: dict) -> str:
    """Per profiled run: the timed step (from tokens/s), and the profiled step's GPU timeline split
    into compute, collectives, their exposed part (no compute kernel running) and idle time; the
    bytes rank 0 sent per step against ``predicted_sent_bytes``. The profiled step runs under the
    profiler, which slows the host: compare its parts with each other, and the timed step with the
    timed steps of other runs.

    Chapter 12 prints it.

    Args:
        results: the dict of ``run_scaling``, run with ``profile_steps``.

    Returns:
        the table, lines joined by newlines (only the header when no run was profiled).
    """
    lines = [f"{'variant':<10}{'GPUs':>5}{'seq':>7}{'timed':>9}{'profiled':>10}{'compute':>10}{'collect.':>10}"
             f"{'exposed':>10}{'idle':>9}{'sent GB':>9}{'predicted':>10}"]
    preset = results["settings"]["preset"]
    for row in results["runs"]:
        prof = row.get("comm_profile")
        if not prof:
            continue
        s = prof["summary"]
        predicted = predicted_sent_bytes(preset, row["gpus"])
        head = f"{row['variant']:<10}{row['gpus']:>5}{row['seq_len']:>7}{row['step_time_s'] * 1e3:>7.1f}ms"
        sent = f"{s['sent_bytes_per_step'] / 1e9:>9.2f}{predicted / 1e9:>10.2f}"
        if s["step_ms"] is None:
            lines.append(head + f"{'(no GPU kernels: a CPU run)':>49}" + sent)
            continue
        lines.append(head + f"{s['step_ms']:>8.1f}ms{s['compute_ms']:>8.1f}ms{s['comm_ms']:>8.1f}ms"
                     f"{s['exposed_comm_ms']:>8.1f}ms{s['idle_ms']:>7.1f}ms" + sent)
    return "\n".join(lines)


def plot_scaling(results: dict, axes=None):
    """Left: tokens/s per GPU against sequence length, one line per (variant, GPUs). Right: peak
    memory per GPU (GPU runs only). Points that did not fit are left out.

    Chapter 12 draws it.

    Args:
        results: the dict of ``run_scaling``.
        axes: two matplotlib axes to draw on (None: a new figure).

    Returns:
        the two axes.
    """
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(11, 4))
    left, right = axes
    colours = {"baseline": "#4c72b0", "patched": "#c44e52"}
    styles = ["o-", "s--", "^:", "d-."]
    gpus = sorted({r["gpus"] for r in results["runs"]})
    for variant in results["settings"]["variants"]:
        for i, n in enumerate(gpus):
            rows = [r for r in results["runs"] if r["variant"] == variant and r["gpus"] == n and r["fits"]]
            if not rows:
                continue
            x = [r["seq_len"] for r in rows]
            name = f"{variant}, {n} GPU{'s' if n > 1 else ''}"
            left.plot(x, [r["tokens_per_s_per_gpu"] for r in rows], styles[i % 4], color=colours[variant],
                      label=name)
            peaks = [r["peak_memory_bytes_max_rank"] for r in rows]
            if all(p is not None for p in peaks):
                right.plot(x, [p / GiB for p in peaks], styles[i % 4], color=colours[variant], label=name)
    for ax in axes:
        if ax.lines:
            ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (tokens per row)")
    left.set_ylabel("tokens/s per GPU")
    left.set_title(f"{results['settings']['preset']} on {results['device']}")
    right.set_ylabel("peak memory per GPU (GiB)")
    right.set_title("peak memory per GPU (max over ranks)")
    if not right.lines:
        right.text(0.5, 0.5, "no GPU memory statistics\n(CPU run)", ha="center", va="center",
                   transform=right.transAxes)
        right.set_xticks([])
        right.set_yticks([])
    left.legend(fontsize=8)
    if right.lines:
        right.legend(fontsize=8)
    return axes


# --------------------------------------------------------------------------------------------------
# On paper: 8 GPUs and more than one node
# --------------------------------------------------------------------------------------------------

# Link speeds, one direction, per link, as the vendor publishes them (peak figures, not measured
# here; NCCL reaches less: measure yours with nccl-tests' all_gather_perf and reduce_scatter_perf
# and pass link_gb_s). NVLink 4 of an H100/H200 counted one way, and one InfiniBand NDR port; the
# datasheets they come from and the arithmetic are in assets/notes/scaling.md. A DGX H200 has 8
# single-port ConnectX-7 for the compute fabric, one per GPU.
NVLINK_GB_S = 450.0
INFINIBAND_PORT_GB_S = 50.0


def link_bandwidth(gpus: int, gpus_per_node: int = 8, nics_per_node: int = 8) -> tuple[str, float]:
    """The bandwidth (GB/s, one direction) that bounds a ring collective over ``gpus`` GPUs, per GPU.

    Inside one node every hop is NVLink. Across nodes NCCL runs one ring per network port: in each
    ring one GPU per node sends over the network and the others over NVLink, so each GPU sends
    1/ports of its bytes through a port and a node's bytes leave through all its ports at once: the
    network bounds each GPU as if it had ports × port speed to itself (on a DGX H200, 8 ×
    ``INFINIBAND_PORT_GB_S``, near ``NVLINK_GB_S``). With fewer ports per node it falls in
    proportion: one port for 8 GPUs gives one port's speed.

    Args:
        gpus: GPUs in the ring.
        gpus_per_node: GPUs of one node (all NVLink inside it).
        nics_per_node: network ports of one node.

    Returns:
        ``(link, gb_s)``: the link's name and its bandwidth in GB/s, one direction, per GPU.
    """
    if gpus <= gpus_per_node:
        return "nvlink", NVLINK_GB_S
    return f"infiniband ×{nics_per_node}/node", min(NVLINK_GB_S, nics_per_node * INFINIBAND_PORT_GB_S)


# The settings of the committed single-GPU run the arithmetic starts from (python -m
# kernels.training.finetune --compare on one H200, patch_llama's default kernels, the padding mask,
# one row of 2,048 tokens, eager, foreach AdamW), found among the fine-tuning runs by ``find_run``.
SINGLE_GPU_SETTINGS = {"preset": "llama-3.1-8b", "patch_options": {}, "compile": None,
                       "seq_len": 2048, "batch_size": 1,
                       "grad_accum": 1, "gradient_checkpointing": False, "padding_mask": True,
                       "adamw": "foreach",
                       "patched_adamw": "foreach"}


@dataclass
class FsdpBudget:
    """Per GPU and per optimizer step, for ``gpus`` GPUs sharing one model with FSDP2 (see
    ``fsdp_budget``)."""

    preset: str
    gpus: int
    nodes: int
    link: str
    link_gb_s: float
    parameters: int
    state_bytes_per_param: int
    state_bytes_per_gpu: float
    rest_bytes_per_gpu: float
    memory_bytes_per_gpu: float
    sent_bytes_per_gpu: float
    comm_s: float
    compute_s: dict
    step_s: dict
    tokens_per_s_per_gpu: dict
    speedup: float
    tokens_to_hide_comm: float

    def to_dict(self) -> dict:
        """The budget's fields as a dict.

        Returns:
            a JSON-ready dict.
        """
        return asdict(self)


def state_bytes_per_param(master_dtype: str = "bfloat16") -> int:
    """What the loop keeps per parameter: the parameter, its gradient and AdamW's two moments, each
    in the dtype of the stored parameter (PyTorch's AdamW keeps its states in the parameter's
    dtype): 4 × 2 B in bf16, as the single-GPU loop runs; 4 × 4 B with float32 master weights (the
    16 B/param usually quoted).

    Args:
        master_dtype: ``"bfloat16"`` or ``"float32"``.

    Returns:
        bytes per parameter.
    """
    size = {"bfloat16": 2, "float32": 4}[master_dtype]
    return 4 * size


def bytes_sent_per_step(parameters: int, gathered_once: int, gpus: int, compute_bytes: int = 2,
                        reduce_bytes: int = 4) -> float:
    """Bytes each GPU sends per step with FSDP2 and ring collectives.

    A ring all-gather or reduce-scatter of S bytes in total has every GPU send (N − 1)/N · S. Per
    step: the parameters are all-gathered in ``compute_bytes`` for the forward and again for the
    backward (they were freed after the forward), except ``gathered_once`` of them, which stay
    gathered until the backward (the root unit: embeddings, final norm, LM head; and the last
    decoder layer, see ``shard_llama``); every gradient is reduce-scattered in ``reduce_bytes``.

    Args:
        parameters: the model's parameter count.
        gathered_once: parameters all-gathered only once per step.
        gpus: the number of GPUs.
        compute_bytes: bytes per gathered parameter.
        reduce_bytes: bytes per reduced gradient.

    Returns:
        bytes each GPU sends per step.
    """
    gathered = compute_bytes * (2 * parameters - gathered_once)
    reduced = reduce_bytes * parameters
    return (gpus - 1) / gpus * (gathered + reduced)


def root_parameter_count(config) -> int:
    """Parameters outside the decoder layers: embeddings, LM head (unless tied), final norm.

    Args:
        config: a ``LlamaConfig``.

    Returns:
        the count.
    """
    embeddings = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    return embeddings + config.hidden_size


def gathered_once_count(config) -> int:
    """Parameters FSDP2 gathers once per step under ``shard_llama``: the root unit's and the last layer's.

    Args:
        config: a ``LlamaConfig``.

    Returns:
        the count.
    """
    per_layer = (count_parameters(config) - root_parameter_count(config)) // config.num_hidden_layers
    return root_parameter_count(config) + per_layer


# Shapes for the arithmetic on paper only (never built): Llama-3.1-70B's published configuration.
PAPER_SHAPES = {
    "llama-3.1-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64,
                          num_key_value_heads=8, head_dim=128),
}


def shape_config(name: str):
    """A preset's ``LlamaConfig``, or one of ``PAPER_SHAPES`` (the 8B configuration with that
    model's sizes).

    Args:
        name: a preset or a key of ``PAPER_SHAPES``.

    Returns:
        the ``LlamaConfig``.
    """
    if name in PAPER_SHAPES:
        return llama_config("llama-3.1-8b", **PAPER_SHAPES[name])
    return llama_config(name)


def fsdp_budget(gpus: int, *, gpus_per_node: int = 8, nics_per_node: int = 8, preset: str = "llama-3.1-8b",
                master_dtype: str = "bfloat16", single_gpu: dict | None = None,
                link_gb_s: float | None = None) -> FsdpBudget:
    """The arithmetic of one FSDP2 step at the per-GPU batch of a single-GPU run: ``single_gpu`` (a
    fine-tuning comparison's JSON), by default the committed run of ``SINGLE_GPU_SETTINGS``.

    * Memory per GPU: the sharded state (``state_bytes_per_param`` × parameters / N) plus what the
      single-GPU run held besides its state (measured peak − state: activations, logits, the
      optimizer's temporaries), taken as unchanged, so this is an upper bound (the optimizer's
      temporaries shrink with N too); for a paper shape, scaled by its hidden size × layers over the
      measured model's.
    * Communication: ``bytes_sent_per_step`` over the bandwidth of ``link_bandwidth`` (or
      ``link_gb_s``, e.g. one measured with nccl-tests). Collectives' latency is left out: FSDP2
      issues two all-gathers and one reduce-scatter per layer per step, tens of µs each, against
      hundreds of ms of compute.
    * Compute: the measured single-GPU step time of each variant (same tokens per GPU, so the same
      work per GPU). For a larger shape than the measured run's (``PAPER_SHAPES``: 70B), that time
      scaled by the ratio of parameter counts: a step's FLOPs are about 6 × parameters × tokens
      (attention's share, which grows with the hidden size rather than the parameters, is left out),
      at the same achieved FLOP rate.
    * Step time: max(compute, comm) if FSDP2's prefetching hides the collectives behind compute
      completely, which is the best case; the patched variant's speed-up over Hugging Face's
      follows.

    Chapter 12 draws its budgets with it.

    Args:
        gpus: the number of GPUs.
        gpus_per_node: GPUs per host (sets the link: NVLink within a host, the network across).
        nics_per_node: network cards per host.
        preset: a preset or a key of ``PAPER_SHAPES``.
        master_dtype: the stored parameters' dtype (``state_bytes_per_param``).
        single_gpu: a fine-tuning comparison's JSON (None: the committed one).
        link_gb_s: the link's bandwidth in GB/s (None: ``link_bandwidth``'s).

    Returns:
        the ``FsdpBudget``.

    Raises:
        ValueError: when ``gpus`` is not a positive int.
    """
    if not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus must be a positive int, got {gpus!r}")
    single = single_gpu or find_run("finetune", **SINGLE_GPU_SETTINGS)
    config = shape_config(preset)
    params = count_parameters(config)
    scale = params / count_parameters(llama_config(single["settings"]["preset"]))
    per_param = state_bytes_per_param(master_dtype)
    state = per_param * params
    tokens = single["settings"]["seq_len"] * single["settings"]["batch_size"] * single["settings"]["grad_accum"]
    summary = single["summary"]
    peak = max(summary["peak_memory_bytes"].values())
    measured = llama_config(single["settings"]["preset"])
    rest = peak - state_bytes_per_param(single["settings"]["dtype"]) * count_parameters(measured)
    # Activations per token grow with hidden size × layers: scale the measured rest to a larger
    # paper shape.
    rest *= (config.hidden_size * config.num_hidden_layers) / (measured.hidden_size * measured.num_hidden_layers)
    link, speed = link_bandwidth(gpus, gpus_per_node, nics_per_node)
    if link_gb_s is not None:
        link, speed = f"{link} (given)", link_gb_s
    sent = bytes_sent_per_step(params, gathered_once_count(config), gpus)
    comm = sent / (speed * 1e9)
    compute = {v: t * scale for v, t in summary["step_time_s"].items()}
    step = {v: max(t, comm) for v, t in compute.items()}
    return FsdpBudget(
        preset=preset, gpus=gpus, nodes=-(-gpus // gpus_per_node), link=link, link_gb_s=speed,
        parameters=params,
        state_bytes_per_param=per_param,
        state_bytes_per_gpu=state / gpus, rest_bytes_per_gpu=rest, memory_bytes_per_gpu=state / gpus + rest,
        sent_bytes_per_gpu=sent, comm_s=comm, compute_s=compute, step_s=step,
        tokens_per_s_per_gpu={v: tokens / t for v, t in step.items()},
        speedup=step["baseline"] / step["patched"],
        tokens_to_hide_comm=comm * summary["tokens_per_s"]["patched"] / scale,
    )


def budget_table(budgets: list[FsdpBudget]) -> str:
    """One line per budget: memory, bytes sent, comm and compute time, tokens/s per GPU, the
    kernels' speed-up.

    Chapter 12 prints it.

    Args:
        budgets: the budgets, one line each.

    Returns:
        the table, lines joined by newlines.
    """
    lines = [f"{'model':<14}{'GPUs':>5}{'nodes':>6} {'link':<23}{'state/GPU':>10}{'mem/GPU ≤':>11}{'sent/GPU':>10}"
             f"{'comm':>9}{'compute HF/ours':>17}{'tok/s/GPU HF/ours':>19}{'speed-up':>9}{'tokens to hide comm':>21}"]
    for b in budgets:
        lines.append(
            f"{b.preset.replace('llama-3.1-', ''):<14}{b.gpus:>5}{b.nodes:>6} {b.link:<23}"
            f"{b.state_bytes_per_gpu / GiB:>7.1f}GiB{b.memory_bytes_per_gpu / GiB:>8.1f}GiB"
            f"{b.sent_bytes_per_gpu / 1e9:>8.1f}GB{b.comm_s * 1e3:>7.0f}ms"
            f"{b.compute_s['baseline'] * 1e3:>9.0f}/{b.compute_s['patched'] * 1e3:.0f}ms"
            f"{b.tokens_per_s_per_gpu['baseline']:>12,.0f}/{b.tokens_per_s_per_gpu['patched']:,.0f}"
            f"{b.speedup:>8.3f}×{b.tokens_to_hide_comm:>21,.0f}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m kernels.distributed.scaling`` (its defaults follow the mode).

    Returns:
        the parser.
    """
    d = GPU_DEFAULTS if runtime.MODE == "gpu" else CPU_DEFAULTS
    p = argparse.ArgumentParser(prog="python -m kernels.distributed.scaling",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default=d["preset"], choices=tuple(PRESETS),
                   help=f"model preset (default {d['preset']})")
    p.add_argument("--gpus", type=_ints, default=_ints(d["gpus"]),
                   help=f"numbers of processes (GPUs) to compare, comma-separated (default {d['gpus']})")
    p.add_argument("--seq-lens", type=_ints, default=_ints(d["seq_lens"]),
                   help=f"sequence lengths to try, comma-separated (default {d['seq_lens']})")
    p.add_argument("--variants", type=cli.names(("baseline", "patched")), default=("baseline", "patched"),
                   help="baseline, patched or both (default both)")
    p.add_argument("--steps", type=cli.positive_int, default=d["steps"],
                   help=f"steps per run (default {d['steps']})")
    p.add_argument("--batch-per-gpu", type=cli.positive_int, default=d["batch_per_gpu"],
                   help=f"rows per GPU per step (default {d['batch_per_gpu']})")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="activation checkpointing in every run")
    p.add_argument("--profile-steps", type=cli.non_negative_int, default=0, metavar="K",
                   help="profile K more steps of every run on rank 0: compute, collectives, exposed collective time "
                        "and bytes sent (default 0: none)")
    p.add_argument("--kernels", default=None, metavar="NAME[,NAME...]",
                   help="the patched variant's kernels (finetune's --kernels; default: patch_llama's defaults)")
    p.add_argument("--prefetch", type=cli.non_negative_int, default=0, metavar="K",
                   help="all-gather K layers ahead explicitly (default 0: FSDP2's implicit one layer)")
    p.add_argument("--name", default=None,
                   help="results file name under scaling/ (default: the preset)")
    p.add_argument("--timeout", type=cli.positive_float, default=600,
                   help="seconds one run may take (default 600)")
    cli.add_output_arguments(p, "scaling/<name>.json and .png")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the grid from the command line, then write its JSON and figure under ``scaling/``.

    Args:
        argv: the command line's arguments (None: ``sys.argv``'s).

    Returns:
        the exit status, 0 (a refused flag exits through ``argparse``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parser = build_parser()
    args = parser.parse_args(argv)
    variants = args.variants
    problems = []
    if runtime.MODE == "gpu":
        import torch

        have = torch.cuda.device_count()
        if max(args.gpus) > have:
            problems.append(f"--gpus asks for {max(args.gpus)} GPUs; this host has {have}")
    root = cli.output_root(args)
    json_path = results_file("scaling", args.name or args.preset, root)
    cli.check_outputs(parser, args, [json_path, json_path.with_suffix(".png")], problems)
    print(runtime.describe())
    results = run_scaling(args.preset, args.gpus, args.seq_lens, variants=variants, steps=args.steps,
                          batch_per_gpu=args.batch_per_gpu,
                          gradient_checkpointing=args.gradient_checkpointing,
                          timeout_s=args.timeout, profile_steps=args.profile_steps, kernels=args.kernels,
                          prefetch=args.prefetch)
    axes = plot_scaling(results)
    fig = axes[0].figure
    fig.tight_layout()
    cli.write_json_and_figure(json_path, results, fig, json_path.with_suffix(".png"), dpi=120)
    plt.close(fig)
    print(efficiency_table(results))
    if args.profile_steps:
        print(profile_table(results))
    print(f"longest sequence that fits per GPU: {results['longest_fitting']}")
    print(f"wrote {json_path} and its .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
