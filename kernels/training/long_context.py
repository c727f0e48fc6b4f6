"""Half a million tokens on one GPU: where a long training step's memory goes, and the probe that
measures it.

Full fine-tuning of the Llama-3.1-8B shape in bf16 at batch 1, with gradient checkpointing, the
package's kernels and the linear cross-entropy (no logits), spends its GPU memory on:

* what does not grow with the sequence: weights, gradients and AdamW's two moments (2 + 2 + 4 bytes
  per parameter);
* the checkpoints: each decoder layer's input, hidden × 2 bytes per token per layer, 256 KiB per
  token at 32 × 4,096;
* the working set of the one layer being recomputed in the backward: its attention's tensors and
  gradients, and the MLP's [tokens, intermediate] intermediates, the largest of all (14,336
  columns);
* the loss, small with the linear cross-entropy (a float32 gradient of the hidden states and a
  logsumexp per token).

Two switches move the two growing parts out of the way: the tiled MLP (``kernels.hf.tiled_mlp``)
makes the MLP's intermediates one tile's worth, and checkpoint offload (``kernels.hf.offload``)
moves the checkpoints to host memory.

* ``memory_table(config, seq_len)`` counts each part from the shapes (a pure function, checked on
  the CPU);
* ``probe(...)`` runs one real training step per length on a GPU and measures its peak
  (``max_memory_allocated``) and the host memory the offload pinned;
* ``longest_that_fits(points, gpu_bytes, host_bytes, layers=...)`` extrapolates two probes linearly
  to the longest length that fits both memories, letting offloaded checkpoints stay on the GPU layer
  by layer when the host runs out first, and says how;
* ``check_split(...)`` runs one real step with the checkpoints split as that extrapolation chose,
  and ``split_prediction`` says what the two lines predicted for it;
* ``step_times(...)`` compares what the switches cost in time at a moderate length, against
  PyTorch's ``save_on_cpu(pin_memory=True)`` and Liger-Kernel's ``LigerTiledSwiGLUMLP`` where
  installed;
* ``python -m kernels.training.long_context --probe 131072,262144`` runs it all, one variant per
  process (Liger's patch changes transformers' classes for the whole process; a variant that does
  not fit both lengths is probed again at half of them), and writes ``long_context/<gpu>.json`` in
  the runs folder (``--record``: in ``assets/results/``, where the chapter reads it); ``--force``
  merges a run into an existing file, and ``--check-split N`` adds the split's check at N tokens to
  that file.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kernels import runtime
from kernels.bench import cli
from kernels.bench.results import RESULTS, device_slug, results_file
from kernels.hf.offload import (
    HOST_MARGIN,
    HostMemoryError,
    enable_checkpoint_offload,
    host_available_bytes,
    host_budget_bytes,
)
from kernels.hf.patch import patch_llama
from kernels.hf.presets import PRESETS, count_parameters, llama_config
from kernels.hf.tiled_mlp import TiledSwiGLUMLP, apply_tiled_mlp, tile_bytes_per_row, tile_rows
from kernels.linear_cross_entropy import linear_loss_extra_bytes

from .loop import count_trained_labels, default_lr, enable_checkpointing, free_memory, make_adamw
from .models import build_model

GiB = 1024**3
RESULTS_DIR = RESULTS / "long_context"

# The package's kernels for a long step: the norms, RoPE and SwiGLU, and the loss without logits.
OURS = dict(rms_norm=True, cross_entropy=False, linear_cross_entropy=True, swiglu=True, rope=True)
# Liger-Kernel's apply_liger_kernel_to_llama with every kernel on (its fused linear cross-entropy
# for the loss).
LIGER = dict(rope=True, swiglu=True, rms_norm=True, cross_entropy=False, fused_linear_cross_entropy=True)
# name -> (kernels, tiled MLP, checkpoint offload)
VARIANTS = {
    "hf": ("hf", False, False),
    "liger": ("liger", False, False),
    "ours": ("ours", False, False),
    "ours+tiled": ("ours", True, False),
    "ours+offload": ("ours", False, True),
    "ours+both": ("ours", True, True),
}
TIMINGS = ("ours", "ours+offload", "ours+save_on_cpu", "ours+tiled", "ours+liger_tiled")


def _fmt(n: float) -> str:
    if abs(n) >= GiB:
        return f"{n / GiB:,.2f} GiB"
    if abs(n) >= 2**20:
        return f"{n / 2**20:,.1f} MiB"
    return f"{n / 1024:,.1f} KiB"


# --------------------------------------------------------------------------------------------------
# Where a long step's memory goes, counted from the shapes
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryRow:
    """One part of a step's GPU memory: ``fixed`` bytes plus ``per_token`` bytes per token of
    sequence, spanning ``layers`` layers (the checkpoints span all of them, a working set one; 0 for
    model-wide parts)."""

    key: str
    part: str
    fixed: int
    per_token: int
    layers: int
    note: str

    def at(self, seq_len: int) -> int:
        """The part's bytes at ``seq_len`` tokens: ``fixed + per_token × seq_len``.

        Args:
            seq_len: tokens of the step.

        Returns:
            bytes.
        """
        return self.fixed + self.per_token * seq_len


@dataclass(frozen=True)
class MemoryTable:
    """``memory_table``'s rows at one length, and the totals with and without each switch."""

    seq_len: int
    tile_rows: int
    rows: tuple[MemoryRow, ...]

    def row(self, key: str) -> MemoryRow:
        """The row named ``key``.

        Args:
            key: the row's key (``"weights"``, ``"checkpoints"``, ...).

        Returns:
            the ``MemoryRow``.

        Raises:
            KeyError: when no row has that key.
        """
        for row in self.rows:
            if row.key == key:
                return row
        raise KeyError(f"no row {key!r}; rows: {[r.key for r in self.rows]}")

    def keys(self, tiled_mlp: bool = False, offload: bool = False) -> list[str]:
        """The rows alive at the step's peak (the start of the backward) with the given switches.

        Args:
            tiled_mlp: with the tiled MLP.
            offload: with the checkpoints offloaded.

        Returns:
            the rows' keys.
        """
        return ["weights", "gradients", "adamw", "prefetched" if offload else "checkpoints", "attention",
                "mlp_tiled" if tiled_mlp else "mlp_untiled", "hidden_grads", "loss"]

    def total(self, tiled_mlp: bool = False, offload: bool = False) -> int:
        """Bytes at the step's peak, counted: the sum of ``keys``' rows at ``seq_len``.

        Args:
            tiled_mlp: with the tiled MLP.
            offload: with the checkpoints offloaded.

        Returns:
            bytes.
        """
        return sum(self.row(k).at(self.seq_len) for k in self.keys(tiled_mlp, offload))

    def format(self) -> str:
        """The rows as a text table, then the total under each combination of the two switches.

        Returns:
            the table, lines joined by newlines.
        """
        lines = [f"{'part':<40}{'fixed':>12}{'per token':>12}{'layers':>8}{f'at {self.seq_len:,}':>14}  note"]
        for r in self.rows:
            per_token = f"{r.per_token:,} B" if r.per_token else "—"
            lines.append(f"{r.part:<40}{_fmt(r.fixed) if r.fixed else '—':>12}{per_token:>12}"
                         f"{r.layers or '':>8}{_fmt(r.at(self.seq_len)):>14}  {r.note}")
        for tiled, offload in ((False, False), (True, False), (False, True), (True, True)):
            name = {(False, False): "untiled MLP, checkpoints on the GPU", (True, False): "tiled MLP",
                    (False, True): "checkpoints offloaded",
                    (True, True): "tiled MLP + checkpoints offloaded"}
            lines.append(f"{'total, ' + name[(tiled, offload)]:<72}{_fmt(self.total(tiled, offload)):>14}")
        return "\n".join(lines)

    __str__ = format


def layer_working_bytes_per_token(config, itemsize: int = 2) -> int:
    """Bytes per token of one decoder layer's norms and attention while it is recomputed and
    differentiated, with the package's kernels (RMSNorm keeps its input and one float32 per row;
    RoPE keeps nothing; SDPA's flash kernel one float32 logsumexp per head): the two norms' outputs
    (the projections' inputs), q, k and v after RoPE, attention's output, the residual sum after
    attention, and in the backward the gradients of q, k, v and of attention's output. A count from
    the shapes: the probe measures.

    Args:
        config: a ``LlamaConfig``.
        itemsize: bytes per element of the activations.

    Returns:
        bytes per token.
    """
    h, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    q, kv = heads * head_dim, config.num_key_value_heads * head_dim
    kept = 2 * h + (q + 2 * kv) + q + h  # norm outputs, q/k/v, attention output, residual sum
    gradients = (q + 2 * kv) + q
    return itemsize * (kept + gradients) + 4 * heads + 2 * 4  # logsumexp per head, rstd per norm


def memory_table(config, seq_len: int, tile: int | None = None,
                 dtype: torch.dtype = torch.bfloat16) -> MemoryTable:
    """Where one training step's GPU memory goes at ``seq_len`` tokens (batch 1), part by part, for
    full fine-tuning in ``dtype`` with AdamW (moments in the parameters' dtype), gradient
    checkpointing, the package's kernels and the linear cross-entropy. ``config`` is a LlamaConfig
    or a preset name; ``tile`` the tiled MLP's rows per tile (default: ``tile_rows`` with unlimited
    free memory, i.e. ``MAX_TILE_BYTES`` worth). Counted from the shapes, not measured; ``probe``
    measures.

    Chapter 14 counts its budget with it.

    Args:
        config: a ``LlamaConfig`` or a preset name.
        seq_len: tokens of the step.
        tile: the tiled MLP's rows per tile (None: ``tile_rows``'s choice).
        dtype: the weights' and activations' dtype.

    Returns:
        the ``MemoryTable``.

    Raises:
        ValueError: when ``seq_len`` is not a positive int.
    """
    if isinstance(config, str):
        config = llama_config(config)
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    size = torch.empty((), dtype=dtype).element_size()
    h, inter, layers, vocab = (config.hidden_size, config.intermediate_size, config.num_hidden_layers,
                               config.vocab_size)
    n = count_parameters(config)
    tile = tile or tile_rows(seq_len, h, inter, dtype, free_bytes=2**62)
    loss = linear_loss_extra_bytes(seq_len, h, vocab, size)["recompute"]
    # float32 d_hidden and logsumexp; the final norm's input and output
    loss_per_token = 4 * h + 4 + 2 * size * h
    rows = (
        MemoryRow("weights", "weights", n * size, 0, 0,
                  f"{n:,} parameters in {str(dtype).removeprefix('torch.')}"),
        MemoryRow("gradients", "gradients", n * size, 0, 0, "one per parameter"),
        MemoryRow("adamw", "AdamW moments", 2 * n * size, 0, 0,
                  "exp_avg and exp_avg_sq in the parameters' dtype"),
        MemoryRow("checkpoints", "checkpoints (every layer's input)", 0, layers * h * size, layers,
                  f"hidden × {size} B per token per layer"),
        MemoryRow("prefetched", "checkpoints on the GPU when offloaded", 0, 2 * h * size, 2,
                  "the one in use and the one being prefetched"),
        MemoryRow("attention", "one layer: norms and attention", 0,
                  layer_working_bytes_per_token(config, size), 1,
                  "recomputed in the backward, with its gradients"),
        MemoryRow("mlp_untiled", "one layer: MLP intermediates, untiled", 0, 3 * inter * size, 1,
                  "gate, up and one more [tokens, intermediate] (Hugging Face's MLP: 4 kept, 2 gradients)"),
        MemoryRow("mlp_tiled", "one layer: MLP intermediates, tiled",
                  tile * tile_bytes_per_row(h, inter, dtype)
                  + 3 * h * inter * 4, 0, 1, f"one tile of {tile:,} rows, and float32 weight-gradient sums"),
        MemoryRow("hidden_grads", "gradients of the hidden states", 0, 3 * h * size, 0,
                  "the residual stream's, the layer output's and its input's"),
        MemoryRow("loss", "loss: linear cross-entropy", loss - seq_len * (4 * h + 4), loss_per_token, 0,
                  "float32 d_hidden and logsumexp, slices of logits; the final norm"),
    )
    return MemoryTable(seq_len, tile, rows)


def offload_traffic(config, seq_len: int, keep_on_gpu: int = 0, itemsize: int = 2) -> dict[str, int]:
    """Bytes the checkpoint offload moves per step at ``seq_len`` tokens (batch 1), each way: the
    checkpoints of every layer not kept on the GPU go to the host in the forward and come back in
    the backward.

    Chapter 14 uses it.

    Args:
        config: a ``LlamaConfig`` or a preset name.
        seq_len: tokens of the step.
        keep_on_gpu: layers whose checkpoints stay on the GPU.
        itemsize: bytes per element of a checkpoint.

    Returns:
        ``{"to_host", "to_gpu", "total"}`` in bytes.
    """
    if isinstance(config, str):
        config = llama_config(config)
    one_way = (config.num_hidden_layers - keep_on_gpu) * seq_len * config.hidden_size * itemsize
    return {"to_host": one_way, "to_gpu": one_way, "total": 2 * one_way}


# --------------------------------------------------------------------------------------------------
# The GPU probe
# --------------------------------------------------------------------------------------------------


@dataclass
class ProbePoint:
    """One training step at ``seq_len`` tokens: whether it fitted, the GPU's peak and what existed before it
    (weights, AdamW moments), the host memory the offload's pool held, its time and its loss."""

    seq_len: int
    fits: bool
    gpu_peak: int | None = None
    gpu_base: int | None = None
    host_bytes: int = 0
    step_s: float | None = None
    error: str = ""
    loss: float | None = None


@dataclass
class ProbeRun:
    """One variant's probes (``probe``): its name, preset, settings and a ``ProbePoint`` per length."""
    variant: str
    preset: str
    settings: dict
    points: list[ProbePoint] = field(default_factory=list)

    def to_dict(self) -> dict:
        """The run as a dict, its points too.

        Returns:
            a JSON-ready dict.
        """
        return {"variant": self.variant, "preset": self.preset, "settings": self.settings,
                "points": [asdict(p) for p in self.points]}

    @classmethod
    def from_dict(cls, d: dict) -> ProbeRun:
        """The run back from ``to_dict``'s dict.

        Args:
            d: the dict.

        Returns:
            the ``ProbeRun``.
        """
        return cls(d["variant"], d["preset"], d["settings"], [ProbePoint(**p) for p in d["points"]])


def long_batch(seq_len: int, vocab: int, seed: int = 0) -> tuple[dict[str, torch.Tensor], int]:
    """One row of ``seq_len`` random tokens on the CPU, its labels the tokens themselves (the first
    one ignored), no attention mask (causal attention takes the flash kernel; a [seq, seq] mask at
    262K tokens would take 128 GiB), and the labels its loss counts.

    Args:
        seq_len: tokens of the row.
        vocab: the vocabulary size (token ids stay below it).
        seed: the seed of the tokens.

    Returns:
        ``(batch, labels)``: the batch and the labels its loss counts.
    """
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, seq_len), generator=gen)
    labels = ids.clone()
    labels[:, 0] = -100
    batch = {"input_ids": ids, "labels": labels}
    return batch, count_trained_labels(batch)


@dataclass
class LongStepSetup:
    """A bf16 model of a preset on the GPU with gradient checkpointing and the chosen kernels and
    switches, with fused AdamW; ``undo()`` takes every switch back off."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    offload: object | None
    undos: list

    def undo(self) -> None:
        """Take every switch back off, last on first off (a second call does nothing)."""
        for undo in reversed(self.undos):
            undo()
        self.undos.clear()


def _apply_kernels(model: torch.nn.Module, kernels, tiled_mlp: bool = False) -> object | None:
    """Patch ``model`` with ``kernels``: "hf" (nothing), "ours" (``OURS``), "liger" (``LIGER``) or a
    dict of ``patch_llama`` options; returns what undoes it (None for Liger, whose patch cannot be
    undone). With our kernels, ``tiled_mlp`` is the patch's own switch (the tiled MLP takes the
    place of the SwiGLU MLP); with the others, the MLPs are tiled on top of them."""
    if kernels == "hf" or kernels is None or kernels == "liger":
        if kernels == "liger":
            from liger_kernel.transformers import apply_liger_kernel_to_llama

            apply_liger_kernel_to_llama(model=model, **LIGER)
        return apply_tiled_mlp(model).undo if tiled_mlp else None
    options = OURS if kernels == "ours" else kernels
    if not isinstance(options, dict):
        raise ValueError(f"kernels must be 'hf', 'ours', 'liger' or a dict of patch_llama options, got {kernels!r}")
    return patch_llama(model, **{**options, "tiled_mlp": tiled_mlp}).undo


def prepare(preset: str, kernels="ours", tiled_mlp: bool = False, offload: bool = False,
            gradient_checkpointing: bool = True, offload_options: dict | None = None,
            tile: int | None = None,
            seed: int = 0) -> LongStepSetup:
    """Build the model and its optimizer for ``probe`` and ``step_times`` (see ``LongStepSetup``).

    Args:
        preset: the model preset.
        kernels: ``"hf"``, ``"ours"``, ``"liger"`` or ``patch_llama`` options.
        tiled_mlp: use the tiled MLP.
        offload: offload the checkpoints to host memory.
        gradient_checkpointing: checkpoint each decoder layer.
        offload_options: keyword arguments for ``enable_checkpoint_offload``.
        tile: the tiled MLP's rows per tile (None: the one ``tile_rows`` picks from the free memory).
        seed: the seed of the weights.

    Returns:
        the ``LongStepSetup``.
    """
    model = build_model(preset, dtype=torch.bfloat16, seed=seed)
    if gradient_checkpointing:
        enable_checkpointing(model)
    undos = []
    undo = _apply_kernels(model, kernels, tiled_mlp)
    if undo is not None:
        undos.append(undo)
    if tile is not None:  # a fixed tile instead of the one tile_rows picks from the free memory
        for mlp in model.modules():
            if isinstance(mlp, TiledSwiGLUMLP):
                mlp.tile_rows = tile
    handle = None
    if offload:
        handle = enable_checkpoint_offload(model, **(offload_options or {}))
        undos.append(handle.undo)
    optimizer = make_adamw(model, default_lr(preset), "fused")  # one kernel, no parameter-sized temporaries
    return LongStepSetup(model, optimizer, handle, undos)


def train_step(setup: LongStepSetup, batch: dict[str, torch.Tensor], n_items: int,
               context=None) -> torch.Tensor:
    """One training step (forward, backward, AdamW step, gradients freed); ``context`` wraps the
    forward. Returns the loss, detached (a 0-d tensor: reading it is the caller's synchronisation,
    not the step's).

    Args:
        setup: the model and its optimizer (``prepare``).
        batch: the inputs, on the GPU.
        n_items: the labels the loss counts.
        context: a context manager around the forward (None: none).

    Returns:
        the loss, detached.
    """
    with context if context is not None else contextlib.nullcontext():
        loss = setup.model(**batch, num_items_in_batch=n_items).loss
    loss.backward()
    value = loss.detach()
    del loss
    setup.optimizer.step()
    setup.optimizer.zero_grad(set_to_none=True)
    return value


def measure_step(setup: LongStepSetup, seq_len: int, seed: int = 0) -> ProbePoint:
    """One step at ``seq_len`` on the GPU: peak, base, host bytes and time; an out-of-memory error
    (GPU, or the offload's host budget) gives a point that does not fit.

    Args:
        setup: the model and its optimizer (``prepare``).
        seq_len: tokens of the step.
        seed: the seed of the tokens.

    Returns:
        the ``ProbePoint`` (``fits`` False, with the error, when it ran out of memory).
    """
    device = next(setup.model.parameters()).device
    cpu_batch, n_items = long_batch(seq_len, setup.model.config.vocab_size, seed)
    free_memory()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    error = ""
    try:
        batch = {k: v.to(device) for k, v in cpu_batch.items()}
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        loss = train_step(setup, batch, n_items)
        torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        loss = loss.item()
    except (torch.cuda.OutOfMemoryError, HostMemoryError) as exc:
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    # Outside the except block: the exception and the frames holding the step's tensors are gone by
    # now.
    batch = None
    setup.optimizer.zero_grad(set_to_none=True)
    host = setup.offload.stats.host_bytes if setup.offload is not None else 0
    if error:
        free_memory()
        return ProbePoint(seq_len, False, None, base, host, None, error)
    return ProbePoint(seq_len, True, torch.cuda.max_memory_allocated(device), base, host, elapsed, loss=loss)


def require_gpu(what: str) -> None:
    """Refuse to run ``what`` without a CUDA GPU.

    Args:
        what: the function's name, for the message.

    Raises:
        RuntimeError: in Triton's interpreter or where no CUDA device answers.
    """
    if runtime.MODE != "gpu" or not torch.cuda.is_available():
        raise RuntimeError(f"{what} runs real training steps and measures GPU memory: it needs a CUDA GPU "
                           "(memory_table and longest_that_fits are the parts that run anywhere)")


def probe(preset: str = "llama-3.1-8b", lengths=(131072, 262144), kernels="ours", tiled_mlp: bool = False,
          offload: bool = False, gradient_checkpointing: bool = True, *, offload_options: dict | None = None,
          tile: int | None = None, warmup_len: int = 1024, seed: int = 0, variant: str | None = None,
          progress: bool = True) -> ProbeRun:
    """GPU only: one real training step of ``preset`` (bf16, batch 1, fused AdamW) at each of
    ``lengths``, with ``kernels`` ("hf", "ours", "liger" or ``patch_llama`` options), the tiled MLP
    and checkpoint offload on or off; the GPU's peak (``torch.cuda.max_memory_allocated``) and the
    host bytes the offload pinned, per length.

    A first step at ``warmup_len`` tokens creates AdamW's moments and compiles the kernels, so every
    probe starts from the same memory. ``offload_options`` go to ``enable_checkpoint_offload``
    (default ``keep_on_gpu=0``: every checkpoint on the host, so that both memories grow linearly
    with the length and two probes extrapolate).

    Chapter 14 shows the recorded probes.

    Args:
        preset: the model preset.
        lengths: the sequence lengths to probe.
        kernels: ``"hf"``, ``"ours"``, ``"liger"`` or ``patch_llama`` options.
        tiled_mlp: use the tiled MLP.
        offload: offload the checkpoints to host memory.
        gradient_checkpointing: checkpoint each decoder layer.
        offload_options: keyword arguments for ``enable_checkpoint_offload``.
        tile: the tiled MLP's rows per tile (None: chosen from the free memory).
        warmup_len: tokens of the warm-up step.
        seed: the seed of the weights and the tokens.
        variant: the run's name (None: ``describe_variant``'s).
        progress: show a progress bar.

    Returns:
        the ``ProbeRun``.

    Raises:
        RuntimeError: without a CUDA GPU, or when even the warm-up step does not fit.
    """
    require_gpu("probe")
    offload_options = {"keep_on_gpu": 0, **(offload_options or {})}
    settings = {"kernels": kernels, "tiled_mlp": tiled_mlp, "offload": offload,
                "offload_options": offload_options,
                "gradient_checkpointing": gradient_checkpointing, "tile": tile, "dtype": "bfloat16",
                "batch_size": 1, "optimizer": "torch.optim.AdamW(fused=True)", "warmup_len": warmup_len}
    run = ProbeRun(variant or describe_variant(kernels, tiled_mlp, offload), preset, settings)
    from kernels.bench.progress import progress_bar as tqdm

    setup = prepare(preset, kernels, tiled_mlp, offload, gradient_checkpointing, offload_options, tile, seed)
    try:
        warm = measure_step(setup, warmup_len, seed)
        if not warm.fits:
            raise RuntimeError(f"{run.variant}: even the warm-up step of {warmup_len} tokens does not fit: "
                               f"{warm.error}")
        for seq_len in tqdm(list(lengths), desc=run.variant, disable=not progress):
            run.points.append(measure_step(setup, seq_len, seed))
    finally:
        setup.undo()
        del setup
        free_memory()
    return run


def describe_variant(kernels, tiled_mlp: bool, offload: bool) -> str:
    """A variant's name from its switches: ``kernels`` (``"custom"`` for options), ``+tiled``, ``+offload``.

    Args:
        kernels: ``"hf"``, ``"ours"``, ``"liger"`` or ``patch_llama`` options.
        tiled_mlp: the tiled MLP is on.
        offload: the checkpoint offload is on.

    Returns:
        the name.
    """
    name = kernels if isinstance(kernels, str) else "custom"
    return name + ("+tiled" if tiled_mlp else "") + ("+offload" if offload else "")


# --------------------------------------------------------------------------------------------------
# From two probes to the longest length that fits
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FitEstimate:
    """The longest length (a multiple of ``step``) whose extrapolated GPU peak and host bytes both
    fit, what limits it, the two lines it came from, how many layers keep their checkpoint on the
    GPU to get there, and the arithmetic as text."""

    longest: int
    limited_by: str
    gpu_per_token: float
    gpu_fixed: float
    host_per_token: float
    host_fixed: float
    text: str
    keep_on_gpu: int = 0


def _line(x1: int, y1: float, x2: int, y2: float) -> tuple[float, float]:
    slope = (y2 - y1) / (x2 - x1)
    return slope, y1 - slope * x1


def fitted_pair(points) -> tuple[ProbePoint, ProbePoint] | None:
    """The shortest and the longest of the probes that fitted, or None without two different lengths
    among them.

    Args:
        points: ``ProbePoint``s.

    Returns:
        ``(shortest, longest)``, or None.
    """
    fitted = sorted((p for p in points if p.fits), key=lambda p: p.seq_len)
    if len(fitted) < 2 or fitted[0].seq_len == fitted[-1].seq_len:
        return None
    return fitted[0], fitted[-1]


def _split_slopes(gpu_slope: float, host_slope: float, keep: int, layers: int) -> tuple[float, float]:
    """The GPU's and the host's bytes per token when the checkpoints of ``keep`` of ``layers``
    offloaded layers stay on the GPU: each kept layer moves ``host_slope / layers`` from the host's
    line to the GPU's."""
    moved = keep * host_slope / layers
    return gpu_slope + moved, host_slope - moved


def _limits(gpu_bytes: int, host_bytes: int, gpu_slope: float, gpu_fixed: float, host_slope: float,
            host_fixed: float) -> dict[str, float]:
    limits = {"GPU memory": (gpu_bytes - gpu_fixed) / gpu_slope}
    if host_slope > 0:
        limits["host memory"] = (host_bytes - host_fixed) / host_slope
    return limits


def longest_that_fits(points, gpu_bytes: int, host_bytes: int, step: int = 1024,
                      layers: int = 0) -> FitEstimate:
    """Extrapolate two probes (``ProbePoint``s that fitted, or a ``ProbeRun`` with two) linearly:
    the GPU peak and the host bytes are each ``fixed + per_token × length`` through the two points,
    and the longest length is the largest multiple of ``step`` at which both stay within
    ``gpu_bytes`` and ``host_bytes``. A memory that does not grow with the length does not limit it.
    Linear is what the parts of ``memory_table`` are; attention with the flash kernel keeps nothing
    quadratic.

    ``layers``: for probes that offloaded the checkpoints of that many layers (``keep_on_gpu=0``),
    the host's bytes per token are ``layers`` equal checkpoints, and any of them may stay on the GPU
    instead (``enable_checkpoint_offload(keep_on_gpu=k)``): each moves ``host_per_token / layers``
    bytes per token from one memory to the other. The estimate then takes the ``k`` that fits the
    longest length, so that a host that runs out first borrows room from the GPU.

    Chapter 14 extrapolates its probes with it.

    Args:
        points: ``ProbePoint``s, or a ``ProbeRun``.
        gpu_bytes: the GPU's memory.
        host_bytes: the host memory the offload may use.
        step: the length's granularity.
        layers: layers whose checkpoints the probes offloaded (0: no split considered).

    Returns:
        the ``FitEstimate``, its ``text`` the arithmetic.

    Raises:
        ValueError: without two fitted probes of different lengths, or when the GPU peak did not grow
            between them.
    """
    if isinstance(points, ProbeRun):
        points = points.points
    pair = fitted_pair(points)
    if pair is None:
        raise ValueError("longest_that_fits needs two probes of different lengths that fitted, got "
                         + ", ".join(f"{p.seq_len:,} {'fitted' if p.fits else 'did not fit'}" for p in points))
    a, b = pair
    gpu_slope, gpu_fixed = _line(a.seq_len, a.gpu_peak, b.seq_len, b.gpu_peak)
    host_slope, host_fixed = _line(a.seq_len, a.host_bytes, b.seq_len, b.host_bytes)
    if not gpu_slope > 0:
        raise ValueError(f"the GPU peak did not grow between {a.seq_len:,} and {b.seq_len:,} tokens: nothing to "
                         "extrapolate")
    limits = _limits(gpu_bytes, host_bytes, gpu_slope, gpu_fixed, host_slope, host_fixed)
    lines = [
        f"GPU peak: {_fmt(a.gpu_peak)} at {a.seq_len:,} tokens, {_fmt(b.gpu_peak)} at {b.seq_len:,}: "
        f"{gpu_slope:,.0f} bytes per token on top of {_fmt(gpu_fixed)}; "
        f"{_fmt(gpu_bytes)} of GPU memory → {limits['GPU memory']:,.0f} tokens",
    ]
    if host_slope > 0:
        lines.append(f"host: {_fmt(a.host_bytes)} at {a.seq_len:,}, {_fmt(b.host_bytes)} at {b.seq_len:,}: "
                     f"{host_slope:,.0f} bytes per token on top of {_fmt(host_fixed)}; {_fmt(host_bytes)} of host "
                     f"memory → {limits['host memory']:,.0f} tokens")
    else:
        lines.append("host: no host memory used (nothing offloaded): no limit from it")
    keep = 0
    if layers > 0 and host_slope > 0:
        splits = []
        for k in range(layers + 1):
            gpu_k, host_k = _split_slopes(gpu_slope, host_slope, k, layers)
            splits.append(_limits(gpu_bytes, host_bytes, gpu_k, gpu_fixed, host_k, host_fixed))
        keep = max(range(layers + 1), key=lambda k: (min(splits[k].values()), -k))
        if keep:
            limits = splits[keep]
            moved = host_slope - _split_slopes(gpu_slope, host_slope, keep, layers)[1]
            host_text = (f"host → {limits['host memory']:,.0f} tokens" if "host memory" in limits
                         else "nothing on the host")
            lines.append(f"keeping the checkpoints of {keep} of the {layers} layers on the GPU "
                         f"(keep_on_gpu={keep}) moves {moved:,.0f} of the host's bytes per token to the GPU: "
                         f"GPU → {limits['GPU memory']:,.0f} tokens, {host_text}")
    limited_by = min(limits, key=limits.get)
    longest = max(0, int(limits[limited_by] // step) * step)
    lines.append(f"longest that fits both: {longest:,} tokens (a multiple of {step:,}), limited by {limited_by}"
                 + (f", with keep_on_gpu={keep}" if keep else ""))
    return FitEstimate(longest, limited_by, gpu_slope, gpu_fixed, host_slope, host_fixed,
                       "\n".join(lines), keep)


def fit_variants(results: dict) -> dict:
    """``results`` with each variant's ``longest`` (a ``FitEstimate`` as a dict, or None and a
    ``longest_note``) computed from its probes against the GPU memory and host budget its settings
    recorded; the checkpoints of an offloading variant may split between the two memories
    (``longest_that_fits``'s ``layers``).

    Args:
        results: a results file's dict (its ``settings`` and ``variants``), changed in place.

    Returns:
        ``results``.
    """
    settings = results["settings"]
    layers = llama_config(settings["preset"]).num_hidden_layers
    for name, run in results["variants"].items():
        if "points" not in run or name not in VARIANTS:
            continue
        offloads = VARIANTS[name][2]
        try:
            fit = longest_that_fits([ProbePoint(**p) for p in run["points"]], settings["gpu_total_bytes"],
                                    settings["host_budget_bytes"], layers=layers if offloads else 0)
            run["longest"] = asdict(fit)
            run.pop("longest_note", None)
        except ValueError as exc:
            run["longest"] = None
            run["longest_note"] = str(exc)
    return results


SPLIT_VARIANT = "ours+both"


def split_prediction(fit: dict, seq_len: int, keep: int, layers: int) -> dict[str, float]:
    """The GPU peak and host bytes ``longest_that_fits`` predicts at ``seq_len`` tokens when the
    checkpoints of ``keep`` of ``layers`` layers stay on the GPU, from a variant's two lines
    (``fit``, a ``FitEstimate`` as a dict) moved as ``longest_that_fits`` moves them
    (``_split_slopes``).

    Args:
        fit: a ``FitEstimate`` as a dict.
        seq_len: tokens of the step.
        keep: layers whose checkpoints stay on the GPU.
        layers: the model's layers.

    Returns:
        ``{"gpu_peak", "host_bytes"}`` in bytes.
    """
    gpu_slope, host_slope = _split_slopes(fit["gpu_per_token"], fit["host_per_token"], keep, layers)
    return {"gpu_peak": fit["gpu_fixed"] + gpu_slope * seq_len,
            "host_bytes": fit["host_fixed"] + host_slope * seq_len}


def format_split_check(results: dict) -> str:
    """The real step that checks the split (``check_split``) beside what the arithmetic predicted for it.

    Chapter 14 prints it.

    Args:
        results: a results file's dict.

    Returns:
        the text (one sentence when the split was not checked, or the step did not fit).
    """
    check = results.get("split_check")
    if not check:
        return "the split was not checked with a real step in this results file"
    point = ProbePoint(**check["point"])
    head = (f"{check['variant']} at {point.seq_len:,} tokens with keep_on_gpu={check['keep_on_gpu']} (the "
            f"checkpoints of {check['keep_on_gpu']} of {check['layers']} layers stay on the GPU)")
    if not point.fits:
        return f"{head}: did not fit: {point.error}"
    predicted = check["predicted"]
    lines = [head, f"{'':<10}{'predicted':>12}{'measured':>12}",
             f"{'GPU peak':<10}{_fmt(predicted['gpu_peak']):>12}{_fmt(point.gpu_peak):>12}",
             f"{'host':<10}{_fmt(predicted['host_bytes']):>12}{_fmt(point.host_bytes):>12}",
             f"step {point.step_s:.1f} s, loss {point.loss:.3f}"]
    return "\n".join(lines)


def check_split(preset: str, seq_len: int, fit: dict, layers: int, seed: int = 0) -> dict:
    """GPU only: one real step of ``SPLIT_VARIANT`` at ``seq_len`` tokens with the checkpoints of
    ``fit["keep_on_gpu"]`` layers kept on the GPU (the split ``longest_that_fits`` chose), and what
    its two lines predicted for that step.

    Args:
        preset: the model preset.
        seq_len: tokens of the step.
        fit: the variant's ``FitEstimate`` as a dict (its ``keep_on_gpu``).
        layers: the model's layers.
        seed: the seed of the weights and the tokens.

    Returns:
        the variant, the split, the measured point and the prediction.
    """
    keep = fit["keep_on_gpu"]
    kernels, tiled, offload = VARIANTS[SPLIT_VARIANT]
    run = probe(preset, (seq_len,), kernels, tiled, offload, offload_options={"keep_on_gpu": keep},
                variant=SPLIT_VARIANT, seed=seed, progress=False)
    return {"variant": SPLIT_VARIANT, "keep_on_gpu": keep, "layers": layers, "point": asdict(run.points[0]),
            "predicted": split_prediction(fit, seq_len, keep, layers)}


# --------------------------------------------------------------------------------------------------
# What the switches cost in time
# --------------------------------------------------------------------------------------------------


def _liger_tiled(model: torch.nn.Module):
    """Replace every decoder layer's MLP with Liger's ``LigerTiledSwiGLUMLP`` over the same
    projections; returns what puts the MLPs back."""
    from liger_kernel.transformers.tiled_mlp import LigerTiledSwiGLUMLP

    originals = [layer.mlp for layer in model.model.layers]
    for layer in model.model.layers:
        with torch.device("meta"):  # its own projections are replaced at once: build them nowhere
            tiled = LigerTiledSwiGLUMLP(model.config)
        tiled.gate_proj, tiled.up_proj, tiled.down_proj = layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj
        layer.mlp = tiled

    def undo() -> None:
        for layer, mlp in zip(model.model.layers, originals):
            layer.mlp = mlp

    return undo


def liger_available() -> bool:
    """Whether Liger-Kernel's Hugging Face integration imports here.

    Returns:
        True when ``liger_kernel.transformers`` imports.
    """
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _timing_setup(preset: str, config: str, seed: int) -> tuple[LongStepSetup, object]:
    """The setup of one timed configuration, and the context its forwards run in."""
    offload = config == "ours+offload"
    setup = prepare(preset, "ours", tiled_mlp=config == "ours+tiled", offload=offload,
                    offload_options={"keep_on_gpu": 0} if offload else None, seed=seed)
    if config == "ours+liger_tiled":
        setup.undos.append(_liger_tiled(setup.model))  # undone before the patch, whose MLPs it replaced
    context = torch.autograd.graph.save_on_cpu(pin_memory=True) if config == "ours+save_on_cpu" else None
    return setup, context


def step_times(preset: str = "llama-3.1-8b", seq_len: int = 32768, steps: int = 3, configs=TIMINGS,
               seed: int = 0, progress: bool = True) -> dict[str, dict]:
    """GPU only: the median time of ``steps`` training steps at ``seq_len`` tokens (after one
    warm-up step) for each configuration of ``TIMINGS``: our kernels with checkpointing (``ours``),
    plus checkpoint offload of every layer (``ours+offload``), plus PyTorch's
    ``save_on_cpu(pin_memory=True)`` around the forward instead (``ours+save_on_cpu``), plus the
    tiled MLP (``ours+tiled``), plus Liger's ``LigerTiledSwiGLUMLP`` (``ours+liger_tiled``, skipped
    where Liger is not installed). Each with its peak and bytes offloaded per step.

    Chapter 14 shows the recorded times.

    Args:
        preset: the model preset.
        seq_len: tokens per step.
        steps: timed steps per configuration.
        configs: the configurations, names from ``TIMINGS``.
        seed: the seed of the weights and the tokens.
        progress: show a progress bar.

    Returns:
        configuration -> its times, tokens/s, peak, bytes offloaded and ``vs_ours``, or ``{"skipped":
        why}`` where it could not run.

    Raises:
        RuntimeError: without a CUDA GPU.
    """
    require_gpu("step_times")
    from kernels.bench.progress import progress_bar as tqdm

    results = {}
    for config in tqdm(list(configs), desc=f"step time at {seq_len:,}", disable=not progress):
        if config == "ours+liger_tiled" and not liger_available():
            results[config] = {"skipped": "Liger-Kernel is not installed"}
            continue
        try:
            setup, context = _timing_setup(preset, config, seed)
        except Exception as exc:  # noqa: BLE001  (one configuration failing to build leaves the others to time)
            results[config] = {"skipped": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
            continue
        try:
            batch, n_items = long_batch(seq_len, setup.model.config.vocab_size, seed)
            batch = {k: v.cuda() for k, v in batch.items()}
            times = []
            torch.cuda.reset_peak_memory_stats()
            for i in range(steps + 1):
                torch.cuda.synchronize()
                start = time.perf_counter()
                train_step(setup, batch, n_items, context)
                torch.cuda.synchronize()
                if i:
                    times.append(time.perf_counter() - start)
            median = sorted(times)[len(times) // 2]
            offloaded = setup.offload.stats.bytes_offloaded / (steps + 1) if setup.offload is not None else 0
            results[config] = {"step_s": median, "times_s": times, "tokens_per_s": seq_len / median,
                               "peak": torch.cuda.max_memory_allocated(),
                               "bytes_offloaded_per_step": offloaded}
        except torch.cuda.OutOfMemoryError as exc:
            results[config] = {"skipped": f"out of memory: {str(exc).splitlines()[0][:200]}"}
        except Exception as exc:  # noqa: BLE001  (recorded with the results, the other configurations still run)
            results[config] = {"skipped": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
        finally:
            setup.undo()
            del setup
            free_memory()
    base = results.get("ours", {}).get("step_s")
    for values in results.values():
        if base and "step_s" in values:
            values["vs_ours"] = values["step_s"] / base
    return results


# --------------------------------------------------------------------------------------------------
# Results: tables, the file, plots
# --------------------------------------------------------------------------------------------------


def format_probes(results: dict) -> str:
    """The probes of every variant, and each one's extrapolated longest length.

    Chapter 14 prints it.

    Args:
        results: a results file's dict.

    Returns:
        the table, lines joined by newlines.
    """
    lines = [f"{'variant':<14}{'tokens':>10}{'fits':>6}{'GPU peak':>13}{'host':>12}{'step s':>9}{'loss':>8}"
             "  longest that fits"]
    for name, run in results["variants"].items():
        longest = run.get("longest")
        for i, p in enumerate(run["points"]):
            peak = _fmt(p["gpu_peak"]) if p["gpu_peak"] else "—"
            step = f"{p['step_s']:.1f}" if p["step_s"] else "—"
            loss = f"{p['loss']:.3f}" if p.get("loss") is not None else "—"
            tail = (f"{longest['longest']:,} ({longest['limited_by']})" if longest else "n/a") if i == 0 else ""
            lines.append(f"{name if i == 0 else '':<14}{p['seq_len']:>10,}{'yes' if p['fits'] else 'no':>6}"
                         f"{peak:>13}{_fmt(p['host_bytes']) if p['host_bytes'] else '—':>12}{step:>9}{loss:>8}  {tail}")
    return "\n".join(lines)


def per_token_bytes(results: dict) -> dict[str, float]:
    """Each variant's GPU bytes per token at the step's peak: the slope between its two probes that
    fitted (the fixed part, weights and AdamW's moments, drops out); variants without two such
    probes are left out.

    Args:
        results: a results file's dict.

    Returns:
        variant -> bytes per token.
    """
    slopes = {}
    for name, run in results["variants"].items():
        pair = fitted_pair([ProbePoint(**p) for p in run.get("points", [])])
        if pair is not None:
            a, b = pair
            slopes[name] = _line(a.seq_len, a.gpu_peak, b.seq_len, b.gpu_peak)[0]
    return slopes


def format_per_token(results: dict, against=("ours", "liger")) -> str:
    """A table of each variant's GPU bytes per token (``per_token_bytes``), as a fraction of those
    of the variants named in ``against`` (where they were measured), and the longest length each
    fits.

    Chapter 14 prints it.

    Args:
        results: a results file's dict.
        against: the variants to divide by.

    Returns:
        the table, lines joined by newlines.
    """
    slopes = per_token_bytes(results)
    bases = [name for name in against if name in slopes]
    lines = [f"{'variant':<14}{'probes':>18}{'GPU B/token':>13}" + "".join(f"{'× ' + b:>10}" for b in bases)
             + f"{'longest':>11}"]
    for name, slope in slopes.items():
        run = results["variants"][name]
        lengths = ",".join(f"{p['seq_len'] // 1024}K" for p in run["points"] if p["fits"])
        longest = (run.get("longest") or {}).get("longest")
        lines.append(f"{name:<14}{lengths:>18}{slope:>13,.0f}" + "".join(f"{slope / slopes[b]:>10.3f}" for b in bases)
                     + (f"{longest:>11,}" if longest else f"{'—':>11}"))
    return "\n".join(lines)


def format_step_times(times: dict, seq_len: int) -> str:
    """The step times as a table (chapter 14 prints it), a skipped configuration with its reason.

    Args:
        times: the dict of ``step_times`` (or ``{"error": why}``).
        seq_len: tokens per step.

    Returns:
        the table, lines joined by newlines.
    """
    if "error" in times:
        return f"step time at {seq_len:,} tokens: not measured ({times['error']})"
    lines = [f"step time at {seq_len:,} tokens", f"{'configuration':<20}{'s/step':>9}{'vs ours':>9}"
             f"{'tokens/s':>10}{'peak':>12}{'offloaded/step':>16}"]
    for name, v in times.items():
        if "step_s" not in v:
            lines.append(f"{name:<20}  {v.get('skipped', '')}")
            continue
        moved = _fmt(v["bytes_offloaded_per_step"]) if v["bytes_offloaded_per_step"] else "—"
        lines.append(f"{name:<20}{v['step_s']:>9.2f}{v.get('vs_ours', float('nan')):>9.3f}"
                     f"{v['tokens_per_s']:>10,.0f}{_fmt(v['peak']):>12}{moved:>16}")
    return "\n".join(lines)


def results_path(slug: str | None = None) -> Path:
    """This chapter's committed results file of a GPU.

    Args:
        slug: the GPU's short name (None: this machine's ``device_slug()``).

    Returns:
        the path.
    """
    return RESULTS_DIR / f"{slug or device_slug()}.json"


def load_all(directory: Path = RESULTS_DIR) -> dict[str, dict]:
    """Every results file of this chapter's GPU runs, by file name.

    Chapter 14 reads them.

    Args:
        directory: the folder of the results files.

    Returns:
        file stem -> its dict.
    """
    return {p.stem: json.loads(p.read_text()) for p in sorted(Path(directory).glob("*.json"))}


def plot_memory_table(table: MemoryTable, ax=None):
    """Stacked bars of the counted peak with each combination of switches.

    Chapter 14 draws it.

    Args:
        table: the ``MemoryTable``.
        ax: a matplotlib axes to draw on (None: a new figure).

    Returns:
        the axes.
    """
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(9, 4))[1]
    combos = [(False, False), (True, False), (False, True), (True, True)]
    labels = ["untiled", "tiled MLP", "offload", "tiled + offload"]
    colors = {}
    for x, (tiled, off) in enumerate(combos):
        bottom = 0.0
        for key in table.keys(tiled, off):
            row = table.row(key)
            value = row.at(table.seq_len) / GiB
            color = colors.setdefault(row.part, f"C{len(colors) % 10}")
            ax.bar(x, value, bottom=bottom, color=color, label=row.part)
            bottom += value
    handles, names = ax.get_legend_handles_labels()
    unique = dict(zip(names, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=7, loc="upper right")
    ax.set_xticks(range(len(combos)), labels)
    ax.set_ylabel("GiB at the step's peak (counted)")
    ax.set_title(f"{table.seq_len:,} tokens")
    return ax


def plot_longest(results: dict, ax=None, target: int | None = None):
    """The longest length each variant fits (extrapolated from its probes) as bars; a variant
    without two fitting probes is drawn at zero with "n/a"; ``target``, a length to reach, as a
    dashed line.

    Chapter 14 draws it.

    Args:
        results: a results file's dict.
        ax: a matplotlib axes to draw on (None: a new figure).
        target: a length to draw as a line (None: none).

    Returns:
        the axes.
    """
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(8, 3.5))[1]
    names = list(results["variants"])
    values = [(results["variants"][n].get("longest") or {}).get("longest", 0) for n in names]
    bars = ax.bar(range(len(names)), [v / 1000 for v in values], color=[f"C{i}" for i in range(len(names))])
    for bar, v in zip(bars, values):
        ax.annotate(f"{v:,}" if v else "n/a", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    if target:
        ax.axhline(target / 1000, color="0.4", linestyle="--", linewidth=1)
        ax.annotate(f"{target:,}", (len(names) - 0.5, target / 1000), ha="right", va="bottom", fontsize=8,
                    color="0.3")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("longest sequence (K tokens)")
    ax.set_title(f"{results['settings']['preset']} on {results['device']}")
    return ax


# --------------------------------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------------------------------


def _parse_lengths(text: str) -> tuple[int, ...]:
    try:
        lengths = tuple(int(x.replace("_", "")) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"lengths must be integers separated by commas, got {text!r}") from None
    if len(lengths) != 2 or lengths[0] == lengths[1] or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"give two different positive lengths, e.g. 131072,262144; got {text!r}")
    return lengths


def _parse_variants(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m kernels.training.long_context`` (and its hidden worker flags).

    Returns:
        the parser.
    """
    parser = argparse.ArgumentParser(prog="python -m kernels.training.long_context",
                                     description="The longest sequence one GPU trains: probes and step times.")
    parser.add_argument("--probe", type=_parse_lengths, default=(131072, 262144),
                        help="two lengths to probe (default 131072,262144)")
    parser.add_argument("--preset", default="llama-3.1-8b", choices=tuple(PRESETS))
    parser.add_argument("--variants", type=_parse_variants, default=tuple(VARIANTS),
                        help=f"comma-separated, of {', '.join(VARIANTS)} (liger only where liger_kernel imports)")
    parser.add_argument("--timing-len", type=cli.non_negative_int, default=32768,
                        help="tokens of the step-time comparison (0: skip)")
    parser.add_argument("--steps", type=cli.positive_int, default=3, help="timed steps per configuration")
    cli.add_output_arguments(parser, "long_context/<gpu>.json", out_is_file=True,
                             force_help="update a results file that exists: this run's variants replace theirs, the "
                                        "others are kept")
    parser.add_argument("--check-split", type=cli.non_negative_int, default=0, metavar="TOKENS",
                        help=f"one real {SPLIT_VARIANT} step at TOKENS with the checkpoints split between the GPU and "
                             "the host as the results file's extrapolation chose (0: skip)")
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-timing", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-split", type=Path, default=None, help=argparse.SUPPRESS)
    return parser


def _worker(args) -> None:
    """One variant's probes (or the step times) in this process, written as JSON to ``args.worker``."""
    if args.worker_timing:
        data = step_times(args.preset, args.timing_len, args.steps)
    elif args.worker_split is not None:
        fit = json.loads(args.worker_split.read_text())
        data = check_split(args.preset, args.check_split, fit, llama_config(args.preset).num_hidden_layers)
    else:
        (name,) = args.variants
        kernels, tiled, offload = VARIANTS[name]
        try:
            data = probe(args.preset, args.probe, kernels, tiled, offload, variant=name).to_dict()
        except RuntimeError as exc:  # e.g. the warm-up step does not fit
            data = {"variant": name, "error": str(exc)}
    args.worker.write_text(json.dumps(data))


def _in_subprocess(args, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "worker.json"
        command = [sys.executable, "-m", "kernels.training.long_context", "--preset", args.preset,
                   "--probe", ",".join(map(str, args.probe)), "--timing-len", str(args.timing_len),
                   "--steps", str(args.steps), "--worker", str(out), *extra]
        done = subprocess.run(command)
        if done.returncode or not out.exists():
            return {"error": f"worker exited with status {done.returncode}"}
        return json.loads(out.read_text())


MIN_PROBE_LEN = 4096


def probe_variant(args, name: str, halvings: int = 3) -> dict:
    """One variant's probes in a process of its own, at ``args.probe``; while fewer than two lengths
    fit, again at half the lengths (at most ``halvings`` times, never below ``MIN_PROBE_LEN``), so
    that a setup that stops short of the lengths asked for (Hugging Face's, say) still gets two
    points to extrapolate from.

    Args:
        args: the parsed flags.
        name: the variant.
        halvings: the most times the lengths are halved.

    Returns:
        the variant's run as a dict, with the lengths tried.
    """
    lengths = tuple(args.probe)
    tried = []
    for _ in range(halvings + 1):
        data = _in_subprocess(args, ["--variants", name, "--probe", ",".join(map(str, lengths))])
        tried.append(list(lengths))
        fitted = [p for p in data.get("points", []) if p["fits"]]
        if "points" not in data or len(fitted) >= 2 or min(lengths) // 2 < MIN_PROBE_LEN:
            break
        lengths = tuple(n // 2 for n in lengths)
    run = data if "points" in data else {"variant": name, "points": [], **data}
    run["lengths_tried"] = tried
    return run


def probe_budgets() -> tuple[int, int]:
    """What two probes are extrapolated against on this machine: the GPU's memory, and the host
    memory available now less the offload's safety margin (GPU only).

    Returns:
        ``(gpu_bytes, host_bytes)``.
    """
    return torch.cuda.mem_get_info()[1], host_budget_bytes(host_available_bytes(), HOST_MARGIN)


def run_all(args) -> dict:
    """Every variant's probes and the step times, each in a process of its own; the results dict
    (``main`` adds the extrapolations, ``fit_variants``, once this run is merged with the file's
    earlier ones).

    Args:
        args: the parsed flags.

    Returns:
        the results dict.
    """
    from tqdm.auto import tqdm

    gpu_total, host_budget = probe_budgets()
    host_available = host_available_bytes()
    variants = {}
    for name in tqdm(args.variants, desc="variants"):
        if name == "liger" and not liger_available():
            variants[name] = {"skipped": "Liger-Kernel is not installed", "points": []}
            continue
        variants[name] = probe_variant(args, name)
    timings = _in_subprocess(args, ["--worker-timing", "--variants", "ours"]) if args.timing_len else {}
    return {
        "chapter": "long_context", "date": datetime.date.today().isoformat(),
        "device": runtime.device_name(),
        "device_slug": device_slug(), "mode": runtime.MODE, "versions": runtime.versions(),
        "settings": {"preset": args.preset, "lengths": list(args.probe), "variants": list(args.variants),
                     "timing_len": args.timing_len, "steps": args.steps, "gpu_total_bytes": gpu_total,
                     "host_available_bytes": host_available, "host_budget_bytes": host_budget,
                     "host_margin": HOST_MARGIN, "kernels": {"ours": OURS, "liger": LIGER},
                     "batch_size": 1, "dtype": "bfloat16", "optimizer": "torch.optim.AdamW(fused=True)"},
        "variants": variants, "step_times": timings,
    }


def merge_results(old: dict | None, new: dict) -> dict:
    """``new`` with the variants (and step times) of ``old`` that ``new`` did not run, when both are
    runs of the same preset on the same device: separate invocations, one variant each, build up one
    file (its variants in ``VARIANTS``'s order). A run that timed steps and probed nothing keeps
    ``old``'s probe settings (the lengths and the memory budgets the variants were fitted against)
    and brings only its step times and their settings.

    Args:
        old: the results file's dict (None: no file).
        new: this run's dict.

    Returns:
        the merged dict.
    """
    if not old or old.get("device") != new["device"] or old["settings"].get("preset") != new["settings"]["preset"]:
        return new
    variants = {**old.get("variants", {}), **new["variants"]}
    order = [n for n in VARIANTS if n in variants] + [n for n in variants if n not in VARIANTS]
    merged = {**new, "variants": {n: variants[n] for n in order}}
    merged["step_times"] = new["step_times"] or old.get("step_times", {})
    if not new["variants"]:
        timing = {k: new["settings"][k] for k in ("timing_len", "steps") if k in new["settings"]}
        merged["settings"] = {**old["settings"], **timing}
    if not new["step_times"] and old.get("step_times"):
        merged["settings"] = {**merged["settings"], "timing_len": old["settings"].get("timing_len"),
                              "steps": old["settings"].get("steps", merged["settings"].get("steps"))}
    merged["settings"] = {**merged["settings"], "variants": list(merged["variants"])}
    if new.get("split_check") or old.get("split_check"):
        merged["split_check"] = new.get("split_check") or old["split_check"]
    return merged


def run_split_check(args, results: dict) -> dict | None:
    """``check_split`` in a process of its own, at ``args.check_split`` tokens, with the split that
    ``results``'s ``SPLIT_VARIANT`` was extrapolated to; None (and a message) where that variant has
    no extrapolation.

    Args:
        args: the parsed flags.
        results: the results file's dict, its variants fitted.

    Returns:
        ``check_split``'s dict, or None.
    """
    fit = (results.get("variants", {}).get(SPLIT_VARIANT) or {}).get("longest")
    if not fit:
        print(f"--check-split: the results file has no extrapolation of {SPLIT_VARIANT} to take the split from")
        return None
    with tempfile.TemporaryDirectory() as tmp:
        fit_file = Path(tmp) / "fit.json"
        fit_file.write_text(json.dumps(fit))
        data = _in_subprocess(args,
                              ["--check-split", str(args.check_split), "--worker-split", str(fit_file)])
    return None if "error" in data else data


def output_path(args) -> Path:
    """The results file: ``--out``, else this GPU's file of the committed results (``--record``) or
    of the runs folder.

    Args:
        args: the parsed flags.

    Returns:
        the path.
    """
    if args.out is not None:
        return Path(args.out)
    return results_path() if args.record else results_file("long_context", device_slug(), cli.runs_dir())


def main(argv=None) -> int:
    """Probe, time and extrapolate from the command line (GPU only), then write ``long_context/<gpu>.json``.

    Args:
        argv: the command line's arguments (None: ``sys.argv``'s).

    Returns:
        the exit status, 0 (a refused flag, or a machine without a GPU, exits through ``argparse``).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker is not None:
        _worker(args)
        return 0
    path = output_path(args)
    nothing = [] if args.variants or args.timing_len or args.check_split else [
        "--variants '' with --timing-len 0 and no --check-split: nothing to run"]
    gpu = cli.gpu_problems("this command",
                           "it runs real training steps and measures GPU memory; memory_table and "
                           "longest_that_fits are the parts that run anywhere")
    cli.check_outputs(parser, args, [path], [*nothing, *gpu], out_is_file=True)
    print(runtime.describe())
    print(memory_table(args.preset, max(args.probe)).format(), "\n")
    results = fit_variants(merge_results(json.loads(path.read_text()) if path.exists() else None,
                                         run_all(args)))
    if args.check_split:
        results["split_check"] = run_split_check(args, results) or results.get("split_check")
    cli.write_json(path, results)
    print(format_probes(results))
    for name, run in results["variants"].items():
        if run.get("longest"):
            print(f"\n{name}:\n{run['longest']['text']}")
    if results["step_times"]:
        print("\n" + format_step_times(results["step_times"], results["settings"]["timing_len"]))
    if results.get("split_check"):
        print("\n" + format_split_check(results))
    print(f"\nwritten: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["OURS", "LIGER", "VARIANTS", "TIMINGS", "MemoryRow", "MemoryTable",
           "layer_working_bytes_per_token",
           "memory_table", "offload_traffic", "ProbePoint", "ProbeRun", "long_batch",
           "LongStepSetup", "prepare",
           "train_step", "measure_step", "probe", "probe_budgets", "FitEstimate", "fitted_pair",
           "longest_that_fits",
           "fit_variants", "SPLIT_VARIANT", "split_prediction", "format_split_check", "check_split",
           "step_times",
           "per_token_bytes", "format_per_token", "format_probes", "format_step_times",
           "results_path", "load_all",
           "plot_memory_table", "plot_longest", "probe_variant", "run_all", "merge_results",
           "run_split_check", "main"]
