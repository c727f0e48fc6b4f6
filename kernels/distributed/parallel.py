"""The fine-tuning loop of ``kernels.training.loop`` across ranks, with FSDP2: same global batch,
loss and gradients.

Run it with torchrun (one process per GPU; on the CPU, gloo processes that share it)::

    torchrun --nproc-per-node 2 -m kernels.distributed.finetune --batch-size 2            # patched model
    torchrun --nproc-per-node 2 -m kernels.distributed.finetune --batch-size 2 --compare  # Hugging Face's, then patched

or from Python: ``launch(2, ["--steps", "3", ...], out_dir)`` starts that command as a subprocess
(bounded in time, on a free loopback port) and returns where rank 0 wrote its results JSON
(``fsdp/<preset>_<N>gpu.json`` under ``out_dir``); inside a process group, ``fsdp_finetune`` is one
rank's whole run and ``train_fsdp`` the loop itself.

**The global batch is split by rows.** Every rank generates the same global micro-batches (the
workbook's data is deterministic) and keeps rows ``[r·B/N, (r+1)·B/N)`` of each, ``B`` the global
rows per micro-batch and ``N`` the world size. A 2-process run with ``batch_size=4`` sees, step by
step, the very rows a 1-process run with ``batch_size=4`` sees, two on each rank.

**Loss normalisation.** The single-process loop passes ``num_items_in_batch`` = the labels the loss
counts over the whole step, so each micro-batch's loss is a sum divided by that count. Here that
count must be *global*: each rank counts its own labels per step (on the CPU copy, before the loop),
and one all-reduce (sum) over all steps' counts gives every rank the global count of every step.
Rank r's loss is then ``sum_r / count_global``, its share of the global mean: the shares add up to
the loss one process computes, and their gradients add up to its gradient. FSDP2 is therefore told
to *sum* gradients across ranks (``shard_llama(..., sum_gradients=True)``), not to average them
(averaging would divide the gradient by N). The step's loss on record is the sum of the shares,
all-reduced.

**Mixed precision.** ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: layers compute
in bf16 and gradients are summed across ranks in float32. The stored (sharded) parameters keep the
dtype the model was built in: bf16 by default, as in the single-GPU loop (so AdamW's states are bf16
too), or float32 with ``master_dtype=torch.float32`` (float32 master weights and AdamW states, bf16
compute). The correctness tests run everything in float32 on the CPU.

What one rank records: a ``kernels.training.loop.RunResult`` whose losses and trained-label counts
are global, whose tokens are this rank's (so its tokens/s is per GPU), and whose peak memory is this
rank's; ``FsdpRun`` adds the peak of every rank.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from kernels import runtime
from kernels.bench.cli import write_json
from kernels.bench.results import RESULTS, results_file
from kernels.training.loop import (
    VARIANTS,
    WARMUP_STEPS,
    RunResult,
    check_train_args,
    default_lr,
    free_memory,
    labels_per_step,
    make_run_batches,
    step_groups,
    train_steps,
)

from .comm_profile import StepProfiler
from .fsdp import DistEnv, free_port, prepare_model, print0, setup

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


# --------------------------------------------------------------------------------------------------
# The global batch, split by rows
# --------------------------------------------------------------------------------------------------


def split_rows(batch: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s rows of one global micro-batch: ``[rank·B/N, (rank+1)·B/N)``, B rows split
    over N ranks.

    Args:
        batch: one global micro-batch, tensors with rows first.
        rank: this rank.
        world_size: the number of ranks.

    Returns:
        the same keys, each tensor's slice of rows for ``rank`` (views).

    Raises:
        ValueError: when the rows do not split equally over ``world_size``.
    """
    rows = batch["input_ids"].shape[0]
    if rows % world_size:
        raise ValueError(
            f"the global micro-batch has {rows} rows, which {world_size} ranks cannot share equally: make "
            f"batch_size a multiple of the number of processes"
        )
    per_rank = rows // world_size
    return {k: v[rank * per_rank:(rank + 1) * per_rank] for k, v in batch.items()}


def shard_batches(batches: list[dict], rank: int, world_size: int) -> list[dict]:
    """This rank's rows of every global micro-batch, in the same order.

    Args:
        batches: the global micro-batches.
        rank: this rank.
        world_size: the number of ranks.

    Returns:
        one ``split_rows`` per micro-batch.
    """
    return [split_rows(b, rank, world_size) for b in batches]


def global_label_counts(local_groups: list[list[dict]], device: torch.device) -> list[int]:
    """Per step, the labels the loss counts over every rank's micro-batches: this rank's counts
    (taken on the CPU labels) summed across ranks by one all-reduce for the whole run, not one per
    step.

    Args:
        local_groups: this rank's micro-batches, grouped per optimizer step.
        device: where the all-reduce runs (this rank's device).

    Returns:
        the global label count of each step.
    """
    local = torch.tensor(labels_per_step(local_groups), dtype=torch.int64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(local, op=dist.ReduceOp.SUM)
    return [int(c) for c in local.cpu()]


def _global_sum(value: torch.Tensor) -> torch.Tensor:
    """The sum of ``value`` over all ranks (on every rank): the ranks' shares of a step's loss add
    up to its loss."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------


def train_fsdp(
    model: torch.nn.Module,
    batches: list[dict[str, torch.Tensor]],
    env: DistEnv,
    *,
    grad_accum: int = 1,
    lr: float = 1e-4,
    label: str = "run",
    warmup_steps: int = WARMUP_STEPS,
    progress: bool = True,
    after_backward: Callable[[int, torch.nn.Module], None] | None = None,
    padding_mask: bool = True,
    adamw: str = "foreach",
) -> RunResult:
    """``kernels.training.loop.train`` for a sharded model: ``batches`` are the *global*
    micro-batches (every rank passes the same list); each rank trains on its rows with the global
    label count (see the module docstring).

    The step loop is ``train``'s (``kernels.training.loop.train_steps``), given each step's label
    count over all ranks (every micro-batch's ``num_items_in_batch``) and ``_global_sum``, which
    adds the ranks' shares of the step's loss into the loss on record. AdamW over the sharded
    parameters, ``torch.optim.AdamW``'s foreach or ``adamw="triton"``
    (``kernels.adamw.TritonAdamW``): each rank updates its shards, and the update is elementwise, so
    sharding does not change it. ``after_backward(step, model)`` runs on every rank after the step's
    last backward, when the sharded gradients are complete. The progress bar shows on rank 0 only.

    Chapter 12 trains with it (through ``fsdp_finetune``).

    Args:
        model: the sharded model (``prepare_model``).
        batches: the global micro-batches, the same list on every rank.
        env: this process's ``DistEnv``.
        grad_accum: micro-batches per optimizer step.
        lr: the peak learning rate.
        label: the run's name in the progress bar and the result.
        warmup_steps: linear warm-up steps of the learning rate.
        progress: show a progress bar (rank 0 only).
        after_backward: called as ``after_backward(step, model)`` after each step's last backward.
        padding_mask: pass the batches' attention masks to the model.
        adamw: ``"foreach"`` (``torch.optim.AdamW``) or ``"triton"`` (``TritonAdamW``).

    Returns:
        this rank's ``RunResult``, its ``what_ran`` naming the world size and what is global.
    """
    check_train_args(batches, grad_accum, lr, warmup_steps)
    groups = step_groups(shard_batches(batches, env.rank, env.world_size), grad_accum)
    trained_global = global_label_counts(groups, env.device)
    run = train_steps(
        model, groups, trained_global, lr=lr, label=label, warmup_steps=warmup_steps,
        progress=progress and env.is_rank0, after_backward=after_backward, padding_mask=padding_mask,
        device=env.device, reduce_loss=_global_sum, desc=f"{label} ×{env.world_size}",
        rate_name="tok_s_per_gpu",
        adamw=adamw,
    )
    run.what_ran.update(
        world_size=env.world_size, backend=env.backend, global_trained_labels=trained_global,
        tokens="tokens and real_tokens: this rank's (tokens/s is per GPU); trained_tokens and loss: global",
    )
    return run


def gather_to_all(value) -> list:
    """``value`` of every rank, in rank order (a Python object; one small collective).

    Args:
        value: any picklable object.

    Returns:
        one value per rank (just ``[value]`` without a group of several ranks).
    """
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


# --------------------------------------------------------------------------------------------------
# One run per variant, and its results file
# --------------------------------------------------------------------------------------------------


@dataclass
class FsdpRun:
    """A sharded fine-tuning run on ``world_size`` ranks: settings, a RunResult per variant, peaks
    of every rank."""

    settings: dict
    world_size: int
    backend: str
    runs: dict[str, RunResult]
    peak_memory_per_rank: dict[str, list]
    # variant -> rank 0's profiled steps (``profile_variant``)
    comm_profile: dict = field(default_factory=dict)
    device: str = field(default_factory=runtime.device_name)
    versions: dict = field(default_factory=runtime.versions)

    def summary(self) -> dict:
        """Per variant: tokens/s per GPU and in total, step time, the largest rank's peak and the final loss.

        With both variants, also the patched run's speedup and the largest loss difference per step.

        Returns:
            the figures, keyed by variant (and ``speedup``, ``max_abs_loss_difference``).
        """
        out = {}
        for variant, run in self.runs.items():
            peaks = [p for p in self.peak_memory_per_rank[variant] if p is not None]
            out[variant] = {
                "tokens_per_s_per_gpu": run.tokens_per_s,
                "tokens_per_s_total": run.tokens_per_s * self.world_size,
                "step_time_s": run.step_time_s,
                "peak_memory_bytes_max_rank": max(peaks) if peaks else None,
                "final_loss": run.losses[-1],
            }
        if len(self.runs) == 2:
            b, p = self.runs["baseline"], self.runs["patched"]
            out["speedup"] = p.tokens_per_s / b.tokens_per_s
            out["max_abs_loss_difference"] = max(abs(x - y) for x, y in zip(b.losses, p.losses))
        return out

    def to_dict(self) -> dict:
        """Everything the results file keeps: device, versions, settings, summary, every run and its peaks.

        Returns:
            a JSON-ready dict.
        """
        return {
            "device": self.device, "mode": runtime.MODE, "versions": self.versions,
            "settings": self.settings,
            "world_size": self.world_size, "backend": self.backend, "summary": self.summary(),
            "runs": {v: {**r.to_dict(), "peak_memory_per_rank": self.peak_memory_per_rank[v]}
                     for v, r in self.runs.items()},
            "comm_profile": self.comm_profile,
        }

    def table(self) -> str:
        """The summary as a text table, one row per variant (chapter 12 prints it).

        Returns:
            the table, lines joined by newlines.
        """
        s = self.summary()
        lines = [f"{'':<10}{'tokens/s per GPU':>18}{'tokens/s total':>16}{'step':>11}{'peak (max rank)':>17}"
                 f"{'final loss':>12}"]
        for variant in self.runs:
            row = s[variant]
            peak = row["peak_memory_bytes_max_rank"]
            peak_text = f"{peak / 1024**3:.2f} GiB" if peak is not None else "n/a (CPU)"
            lines.append(f"{variant:<10}{row['tokens_per_s_per_gpu']:>18,.0f}{row['tokens_per_s_total']:>16,.0f}"
                         f"{row['step_time_s'] * 1e3:>9,.0f}ms{peak_text:>17}{row['final_loss']:>12.4f}")
        lines.append(f"{self.world_size} rank(s), {self.backend}, {self.device}")
        return "\n".join(lines)


def fsdp_results_file(name: str, world_size: int, directory: str | Path = RESULTS) -> Path:
    """``<directory>/fsdp/<name>_<N>gpu.json``: a sharded run of ``name`` (the preset unless
    ``--name`` says otherwise) on N ranks; its flags are the JSON's ``settings``, and a later run of
    that name and N replaces it.

    Args:
        name: the run's name.
        world_size: the number of ranks.
        directory: the results root.

    Returns:
        the path (its folder not created here).
    """
    return results_file("fsdp", f"{name}_{world_size}gpu", directory)


def fsdp_finetune(
    preset: str = "tiny",
    steps: int = 6,
    seq_len: int = 256,
    batch_size: int = 2,
    grad_accum: int = 1,
    lr: float | None = None,
    seed: int = 0,
    *,
    variants: tuple[str, ...] = ("patched",),
    master_dtype: torch.dtype = torch.bfloat16,
    compute_dtype: torch.dtype = torch.bfloat16,
    patch_options: dict | None = None,
    gradient_checkpointing: bool = False,
    padding_mask: bool = True,
    prefetch: int = 0,
    warmup_steps: int = WARMUP_STEPS,
    progress: bool = True,
    out_dir: str | Path | None = None,
    adamw: str = "foreach",
    name: str | None = None,
    profile_steps: int = 0,
) -> FsdpRun:
    """One rank's part of a sharded run (call it in every process of the group; ``setup()`` is
    called here if no group runs yet). For each variant: build from ``seed``, patch (the "patched"
    variant), shard, train on the global batches (``batch_size`` global rows per micro-batch), then,
    with ``profile_steps`` > 0, profile that many more steps (``profile_variant``: after the timed
    run, so the profiler's cost stays out of its tokens/s), free. Rank 0 writes
    ``<out_dir>/fsdp/<name>_<N>gpu.json`` (``name`` defaults to the preset) when ``out_dir``, the
    results root, is given.

    Chapter 12 runs it under ``torchrun`` (``launch``).

    Args:
        preset: the model preset.
        steps: optimizer steps.
        seq_len: tokens per row.
        batch_size: global rows per micro-batch (a multiple of the world size).
        grad_accum: micro-batches per step.
        lr: peak learning rate (None: the preset's default).
        seed: seed of the weights and the data.
        variants: which of ``VARIANTS`` to run, in order.
        master_dtype: the stored (sharded) parameters' dtype.
        compute_dtype: the dtype the layers compute in.
        patch_options: keyword arguments for ``patch_llama``.
        gradient_checkpointing: checkpoint each decoder layer.
        padding_mask: pass the attention masks to the model.
        prefetch: layers to all-gather ahead (0: FSDP2's implicit one).
        warmup_steps: linear warm-up steps of the learning rate.
        progress: show a progress bar on rank 0.
        out_dir: the results root (None: nothing written).
        adamw: ``"foreach"`` or ``"triton"``.
        name: the results file's name (None: the preset).
        profile_steps: steps to profile after each timed run (0: none).

    Returns:
        the ``FsdpRun`` (the same on every rank except the profiles, rank 0's only).

    Raises:
        ValueError: when ``variants`` is empty or names one not in ``VARIANTS``.
    """
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        raise ValueError(f"variants must be taken from {VARIANTS}, got {variants!r}")
    env = setup()
    lr = default_lr(preset) if lr is None else lr
    batches = make_run_batches(preset, steps, seq_len, batch_size, grad_accum, seed)
    settings = {
        "preset": preset, "steps": steps, "seq_len": seq_len, "global_batch_size": batch_size,
        "batch_size_per_rank": batch_size // env.world_size, "grad_accum": grad_accum, "lr": lr,
        "seed": seed,
        "master_dtype": str(master_dtype).replace("torch.", ""),
        "compute_dtype": str(compute_dtype).replace("torch.", ""), "reduce_dtype": "float32",
        "patch_options": dict(patch_options or {}), "gradient_checkpointing": gradient_checkpointing,
        "warmup_steps": warmup_steps, "sharding": "fully_shard per decoder layer + root; gradients summed",
        "prefetch_layers": prefetch or "FSDP2 default (one layer, implicit)", "adamw": adamw,
        "padding_mask": padding_mask,
    }
    runs, peaks, profiles = {}, {}, {}
    for variant in variants:
        free_memory()
        model, handle = prepare_model(
            preset, env, dtype=master_dtype, param_dtype=compute_dtype, reduce_dtype=torch.float32,
            seed=seed,
            patch=variant == "patched", patch_options=patch_options,
            gradient_checkpointing=gradient_checkpointing,
            prefetch=prefetch,
        )
        runs[variant] = train_fsdp(model, batches, env, grad_accum=grad_accum, lr=lr, label=variant,
                                   padding_mask=padding_mask, warmup_steps=warmup_steps, progress=progress,
                                   adamw=adamw)
        peaks[variant] = gather_to_all(runs[variant].peak_memory)
        if profile_steps:
            profiles[variant] = profile_variant(model, batches, env, profile_steps,
                                                grad_accum=grad_accum, lr=lr,
                                                padding_mask=padding_mask, adamw=adamw)
        del model, handle
        free_memory()
    result = FsdpRun(settings, env.world_size, env.backend, runs, peaks, profiles)
    if out_dir is not None and env.is_rank0:
        path = write_json(fsdp_results_file(name or preset, env.world_size, out_dir), result.to_dict())
        print0(f"wrote {path}")
    return result


def profile_variant(model: torch.nn.Module, batches: list[dict], env: DistEnv, steps: int, *,
                    grad_accum: int,
                    lr: float, padding_mask: bool, adamw: str, wait: int = 2) -> dict:
    """``steps`` more training steps of ``model``, recorded by the profiler on rank 0 after ``wait``
    unrecorded ones (every rank trains them: the collectives need all): ``{"summary":
    TraceSummary.to_dict(), "excerpt": the first recorded step's kernels}`` on rank 0, ``{}``
    elsewhere (``kernels.distributed.comm_profile``).

    Args:
        model: the sharded model, already trained by the timed run.
        batches: the global micro-batches (repeated when fewer than needed).
        env: this process's ``DistEnv``.
        steps: steps to record.
        grad_accum: micro-batches per step.
        lr: the learning rate.
        padding_mask: pass the attention masks to the model.
        adamw: ``"foreach"`` or ``"triton"``.
        wait: steps run before recording starts.

    Returns:
        the summary and excerpt on rank 0, ``{}`` on the others.
    """
    needed = (wait + steps) * grad_accum
    if needed > len(batches):
        batches = (batches * (needed // len(batches) + 1))
    profiler = StepProfiler(wait, steps, world_size=env.world_size, enabled=env.is_rank0)
    with profiler:
        train_fsdp(model, batches[:needed], env, grad_accum=grad_accum, lr=lr, label="profile",
                   warmup_steps=0,
                   progress=False, after_backward=profiler.step, padding_mask=padding_mask, adamw=adamw)
    if profiler.summary is None:
        return {}
    print0(f"profiled {steps} step(s): {profiler.summary.text()}")
    return {"summary": profiler.summary.to_dict(), "excerpt": profiler.excerpt}


# --------------------------------------------------------------------------------------------------
# Launching the torchrun entry point (kernels.distributed.finetune) as a subprocess
# --------------------------------------------------------------------------------------------------


def torchrun_command(nproc: int, finetune_args: list[str], port: int | None = None) -> list[str]:
    """``torchrun --nproc-per-node N -m kernels.distributed.finetune ARGS`` (as ``python -m
    torch.distributed.run``, which needs no ``torchrun`` on the PATH), rendezvous on the loopback
    interface.

    Args:
        nproc: processes to start (one per GPU).
        finetune_args: the arguments of ``kernels.distributed.finetune``.
        port: the rendezvous port (None: a free one).

    Returns:
        the command, as a list for ``subprocess``.

    Raises:
        ValueError: when ``nproc`` is not a positive int.
    """
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive int, got {nproc!r}")
    port = port or free_port()
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--nnodes=1",
            "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "kernels.distributed.finetune",
            *finetune_args]


@dataclass
class Launch:
    """What a launched run left: its exit status, its output, the results file rank 0 wrote (None if
    it failed)."""

    returncode: int
    output: str
    results: Path | None
    seconds: float

    def load(self) -> dict:
        """The results file rank 0 wrote, read back.

        Returns:
            its JSON content.

        Raises:
            RuntimeError: when the run failed, with the end of its output.
        """
        if self.results is None:
            raise RuntimeError(f"the run failed (exit status {self.returncode}):\n{self.output[-3000:]}")
        return json.loads(self.results.read_text())


def launch(nproc: int, finetune_args: list[str], out_dir: str | Path, *, preset: str = "tiny",
           timeout_s: float = 300, echo: bool = False) -> Launch:
    """Run ``torchrun_command(nproc, finetune_args + --out out_dir)`` as a subprocess and wait at
    most ``timeout_s``.

    The subprocess gets its own process group, so on a timeout torchrun and every worker it started
    are ended together (SIGTERM, then SIGKILL). ``out_dir`` is the results root the run writes
    under; the results file to look for is ``fsdp_results_file`` of ``--name`` if given, else of the
    preset (``preset`` unless ``--preset`` is given).

    Chapter 12 runs its sharded fine-tuning with it.

    Args:
        nproc: processes to start.
        finetune_args: the arguments of ``kernels.distributed.finetune`` (``--out`` and
            ``--no-progress`` are added).
        out_dir: the results root.
        preset: the preset added when ``finetune_args`` has no ``--preset``.
        timeout_s: seconds before the run is ended.
        echo: print the run's output.

    Returns:
        a ``Launch``: exit status, output, results file (None unless the run succeeded and wrote it),
        seconds.
    """
    out_dir = Path(out_dir)
    if "--preset" not in finetune_args:
        finetune_args = ["--preset", preset, *finetune_args]
    else:
        preset = finetune_args[finetune_args.index("--preset") + 1]
    name = finetune_args[finetune_args.index("--name") + 1] if "--name" in finetune_args else preset
    cmd = torchrun_command(nproc, [*finetune_args, "--out", str(out_dir), "--no-progress"])
    path = fsdp_results_file(name, nproc, out_dir)
    path.unlink(missing_ok=True)  # a file from an earlier run must not pass for this one's
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _end_group(proc)
        output, _ = proc.communicate()
        output += f"\n[stopped after {timeout_s:g} s]"
    seconds = time.perf_counter() - start
    if echo:
        print(output)
    ok = proc.returncode == 0 and path.exists()
    return Launch(proc.returncode, output, path if ok else None, seconds)


def _end_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the subprocess's own process group (torchrun and its workers), SIGKILL if it lingers."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


__all__ = [
    "split_rows", "shard_batches", "global_label_counts", "train_fsdp", "gather_to_all", "FsdpRun",
    "fsdp_finetune", "profile_variant", "torchrun_command", "launch", "Launch", "fsdp_results_file",
    "DTYPES",
]
