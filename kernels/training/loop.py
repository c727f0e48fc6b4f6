"""A plain PyTorch fine-tuning loop, and the same run twice: Hugging Face's model as it is, then patched.

``train(model, batches, ...)`` is the loop a reader would write: AdamW (``torch.optim.AdamW`` with
its defaults, "foreach" on a GPU; ``adamw="fused"`` for its one-kernel implementation, the default
optimizer of Hugging Face's Trainer; ``adamw="triton"`` for this package's
``kernels.adamw.TritonAdamW``; ``optimizer_in_backward=True`` for that kernel run inside the
backward, ``kernels.optim_in_backward``), the model's own loss (``model(**batch).loss``),
gradient accumulation over ``grad_accum`` micro-batches, and per step a record of the loss, the
time, the tokens and the peak memory. Its step loop (``train_steps``) also runs every rank of a
sharded run (``kernels.distributed.parallel.train_fsdp``), given the global label count of each
step and a sum of the loss across ranks.

Gradient accumulation follows Hugging Face's Trainer: every micro-batch's forward gets
``num_items_in_batch``, the number of labels the loss counts over *all* micro-batches of the step
(labels that are not -100 after the shift by one, i.e. ``labels[..., 1:] != -100``). Each
micro-batch's loss is then its sum divided by that number, and the accumulated gradient is the
gradient of the mean over the whole step: exactly what one big batch would give. The count is taken
on the CPU copy of the labels before the loop, so it costs the GPU nothing (a Python int; the
Trainer passes a tensor, which both losses accept too).

What a step record holds (``StepRecord``):

* ``loss``: the step's mean loss over its counted labels (the sum of its micro-batch losses);
* ``time_s``: wall time from the start of the step to its end, with the GPU synchronised at the end,
  so the time covers every kernel of the step;
* ``tokens``: every position processed, batch × seq × grad_accum, padding included: the work the GPU
  does, and what the headline tokens/s counts (the usual convention of training benchmarks).
  ``real_tokens`` counts only non-padding positions (attention_mask = 1), ``trained_tokens`` only
  the labels the loss counts;
* ``peak_memory``: ``torch.cuda.max_memory_allocated`` since the run started (statistics reset at
  its start), so it includes the weights, gradients and optimizer states; None on the CPU, whose
  allocator keeps no statistics.

Warm-up: the first ``warmup_steps`` steps (``WARMUP_STEPS`` = 3, fewer when a run is shorter: at
most all steps but one) are excluded from tokens/s and time per step (the first steps create AdamW's
states, pick kernels, compile Triton kernels), but they are in the loss curve.

``compare(...)`` builds the model twice from the same seed on the same device, trains Hugging Face's
version, frees it, then trains the patched version (``kernels.hf.patch.patch_llama``) on the same
batches in the same order, and returns both runs side by side. ``gradient_check(...)`` compares one
batch's gradients three ways (float32, Hugging Face in bf16, patched in bf16). The longest sequence
that fits is searched in ``kernels.training.fit``.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kernels import runtime
from kernels.adamw import TritonAdamW
from kernels.bench.cli import write_json_and_figure
from kernels.bench.results import RESULTS, results_file
from kernels.hf.padding_mask import drop_padding_mask
from kernels.hf.patch import patch_llama
from kernels.optim_in_backward import OptimizerInBackward
from kernels.reference import relative_error

from .data import IGNORE_INDEX, get_tokenizer, make_sft_batches
from .models import GiB, build_model, llama_config

WARMUP_STEPS = 3
VARIANTS = ("baseline", "patched")


def default_lr(preset: str) -> float:
    """A learning rate at which 20 steps lower the loss of a randomly initialised preset in bf16, stably.

    bf16 weights near 0.02 are spaced about 1e-4 apart, so much smaller AdamW steps mostly round
    away. At 1e-4 the Llama-3.1-8B shape's loss was unstable in the first steps, and runs that
    differ only in rounding drifted apart (assets/notes/training.md); 3e-5 still moves the smaller
    weights. The tiny model tolerates (and needs, to show learning in a few steps) a larger one.

    Args:
        preset: a preset name of ``kernels.training.models``.

    Returns:
        The learning rate.
    """
    return 1e-3 if preset == "tiny" else 3e-5


# --------------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------------


@dataclass
class StepRecord:
    """One optimizer step of a run: its loss, time, token counts and peak memory (the module
    docstring says what each counts)."""

    step: int
    loss: float
    time_s: float
    tokens: int
    real_tokens: int
    trained_tokens: int
    peak_memory: int | None
    timed: bool  # False for the warm-up steps, which tokens/s and time per step leave out

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.time_s

    @property
    def real_tokens_per_s(self) -> float:
        return self.real_tokens / self.time_s


@dataclass
class RunResult:
    """One training run: what ran, and a record per step."""

    label: str
    what_ran: dict
    records: list[StepRecord]
    warmup_steps: int

    @property
    def losses(self) -> list[float]:
        return [r.loss for r in self.records]

    def _timed(self) -> list[StepRecord]:
        return [r for r in self.records if r.timed]

    @property
    def tokens_per_s(self) -> float:
        """All tokens processed (padding included) over the timed steps, divided by their total time."""
        timed = self._timed()
        return sum(r.tokens for r in timed) / sum(r.time_s for r in timed)

    @property
    def real_tokens_per_s(self) -> float:
        """Non-padding tokens over the timed steps, divided by their total time."""
        timed = self._timed()
        return sum(r.real_tokens for r in timed) / sum(r.time_s for r in timed)

    @property
    def step_time_s(self) -> float:
        """Mean time per timed step (consistent with tokens/s; ``median_step_time_s`` is the
        median)."""
        timed = self._timed()
        return sum(r.time_s for r in timed) / len(timed)

    @property
    def median_step_time_s(self) -> float:
        return statistics.median(r.time_s for r in self._timed())

    @property
    def peak_memory(self) -> int | None:
        peaks = [r.peak_memory for r in self.records if r.peak_memory is not None]
        return max(peaks) if peaks else None

    def to_dict(self) -> dict:
        """The run as JSON-ready data, for a results file.

        Returns:
            ``label``, ``what_ran``, ``warmup_steps``, the run's rates, mean and median step time and
            peak memory, and ``steps``: each ``StepRecord``'s fields with its two rates.
        """
        return {
            "label": self.label,
            "what_ran": self.what_ran,
            "warmup_steps": self.warmup_steps,
            "tokens_per_s": self.tokens_per_s,
            "real_tokens_per_s": self.real_tokens_per_s,
            "step_time_s": self.step_time_s,
            "median_step_time_s": self.median_step_time_s,
            "peak_memory_bytes": self.peak_memory,
            "steps": [
                {**asdict(r), "tokens_per_s": r.tokens_per_s, "real_tokens_per_s": r.real_tokens_per_s}
                for r in self.records
            ],
        }


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------



def count_trained_labels(batch: dict[str, torch.Tensor], ignore_index: int = IGNORE_INDEX) -> int:
    """Labels a causal-LM loss counts in one batch: those not ignored after the shift by one.

    Chapter 12 (notebooks/12_multi_gpu.ipynb) sums these counts over ranks.

    Args:
        batch: a batch with ``labels`` ([batch, seq] or [seq]).
        ignore_index: the label the loss skips.

    Returns:
        The number of ``labels[..., 1:]`` entries that are not ``ignore_index``, as a Python int.
    """
    return int((batch["labels"][..., 1:] != ignore_index).sum())


def describe_model(model: torch.nn.Module) -> dict:
    """What will run, for a run's record: the norm modules by class, the loss function, dtype,
    device, attention implementation.

    Args:
        model: a Hugging Face causal LM, patched or not.

    Returns:
        A dict with ``model`` (its class name), ``norms`` (RMSNorm class name -> count), ``loss``
        (the patched loss's repr, or a description of Hugging Face's own), ``dtype`` and ``device``
        (of its first parameter), ``attention`` (``config._attn_implementation``) and
        ``parameters`` (their total count).
    """
    norms: dict[str, int] = {}
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm"):
            norms[name] = norms.get(name, 0) + 1
    loss = model.__dict__.get("_loss_function")
    param = next(model.parameters())
    return {
        "model": type(model).__name__,
        "norms": norms,
        "loss": repr(loss) if loss is not None
        else "transformers ForCausalLMLoss (fp32 copy of the logits, F.cross_entropy)",
        "dtype": str(param.dtype).replace("torch.", ""),
        "device": str(param.device),
        "attention": getattr(model.config, "_attn_implementation", None),
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def _micro_batches_on(batches, device, padding_mask: bool = True) -> list[dict[str, torch.Tensor]]:
    keep = ("input_ids", "attention_mask", "labels")
    if not padding_mask:
        # on the CPU copies: the check reads the whole mask
        batches = [drop_padding_mask(b) for b in batches]
    return [{k: v.to(device) for k, v in b.items() if k in keep} for b in batches]


def check_train_args(batches, grad_accum, lr, warmup_steps) -> None:
    """Check the arguments every loop over micro-batches takes (this one and the sharded one).

    Args:
        batches: a non-empty list (or tuple) of batch dicts, as ``make_sft_batches`` gives.
        grad_accum: micro-batches per optimizer step; a positive int that divides ``len(batches)``.
        lr: the learning rate, a positive number.
        warmup_steps: steps left out of the timings, a non-negative int.

    Raises:
        TypeError: ``batches`` is empty, not a list or tuple, or holds something other than dicts.
        ValueError: ``grad_accum``, ``lr`` or ``warmup_steps`` is out of range, or ``grad_accum``
            does not divide ``len(batches)``.
    """
    if not isinstance(batches,
                      (list, tuple)) or not batches or not all(isinstance(b, dict) for b in batches):
        raise TypeError(
            "batches must be a non-empty list of dicts (input_ids, attention_mask, labels), as make_sft_batches gives"
        )
    if not isinstance(grad_accum, int) or isinstance(grad_accum, bool) or grad_accum < 1:
        raise ValueError(f"grad_accum must be a positive int, got {grad_accum!r}")
    if len(batches) % grad_accum:
        raise ValueError(f"len(batches)={len(batches)} is not a multiple of grad_accum={grad_accum}")
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not lr > 0:
        raise ValueError(f"lr must be a positive number, got {lr!r}")
    if not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be a non-negative int, got {warmup_steps!r}")


def step_groups(batches: list[dict], grad_accum: int) -> list[list[dict]]:
    """The micro-batches of each optimizer step: ``grad_accum`` consecutive ones per step.

    Chapter 12 (notebooks/12_multi_gpu.ipynb) splits a sharded run's batches with it.

    Args:
        batches: the micro-batches, in order.
        grad_accum: micro-batches per step (``check_train_args`` checks it divides their number).

    Returns:
        One list of ``grad_accum`` micro-batches per step (a last shorter one if it does not divide).
    """
    return [list(batches[s:s + grad_accum]) for s in range(0, len(batches), grad_accum)]


def labels_per_step(groups: list[list[dict]]) -> list[int]:
    """Per step, the labels the loss counts over the step's micro-batches (taken on the CPU copies).

    Each micro-batch's loss divides its sum by its step's count (``num_items_in_batch``), so the
    step's gradient is that of the mean over the whole step (chapter 12,
    notebooks/12_multi_gpu.ipynb, sums the counts over ranks).

    Args:
        groups: each step's micro-batches, as ``step_groups`` gives.

    Returns:
        One ``count_trained_labels`` total per step.
    """
    return [sum(count_trained_labels(b) for b in group) for group in groups]


def train(
    model: torch.nn.Module,
    batches: list[dict[str, torch.Tensor]],
    *,
    grad_accum: int = 1,
    lr: float = 1e-4,
    label: str = "run",
    warmup_steps: int = WARMUP_STEPS,
    progress: bool = True,
    after_backward: Callable[[int, torch.nn.Module], None] | None = None,
    padding_mask: bool = True,
    adamw: str = "foreach",
    optimizer_in_backward: bool = False,
) -> RunResult:
    """Fine-tune ``model`` on ``batches`` (micro-batches, ``grad_accum`` per optimizer step).

    The loop chapter 08 (notebooks/08_training_loop.ipynb) writes and runs; the module docstring
    says what a step does and records.

    ``adamw`` picks the AdamW implementation (``make_adamw``): ``"foreach"``
    (``torch.optim.AdamW``'s default on a GPU), ``"fused"`` (its one-kernel step, what Hugging
    Face's Trainer uses by default, ``optim="adamw_torch_fused"``) or ``"triton"``
    (``kernels.adamw.TritonAdamW``, the same algorithm as one Triton kernel per parameter tensor).

    ``padding_mask=False`` leaves out each batch's ``attention_mask`` where
    ``kernels.hf.padding_mask`` shows it redundant (right padding, padded labels ignored): the same
    losses and gradients, without the [seq, seq] mask.

    ``after_backward(step, model)``, if given, is called once per step after the last backward and
    before ``optimizer.step()`` (tests read the gradients there; its time counts in the step's
    time).

    ``optimizer_in_backward=True`` steps each parameter inside the step's last backward
    (``kernels.optim_in_backward.OptimizerInBackward``, the Triton kernel of
    ``adamw="triton"``, which ``adamw`` must then be); the other micro-batches accumulate. Their
    gradients are gone by ``after_backward``'s call, so the two are not taken together.

    Args:
        model: a causal LM whose ``model(**batch, num_items_in_batch=n).loss`` is the loss.
        batches: the micro-batches (CPU copies of ``input_ids``, ``attention_mask``, ``labels``),
            moved to the model's device before the first step.
        grad_accum: micro-batches per optimizer step.
        lr: AdamW's learning rate.
        label: the run's name, on its record and its progress bar.
        warmup_steps: the first steps left out of tokens/s and time per step (at most all but one).
        progress: show a progress bar.
        after_backward: called as ``after_backward(step, model)`` before each optimizer step.
        padding_mask: keep every batch's ``attention_mask`` (False: drop it where redundant).
        adamw: ``"foreach"``, ``"fused"`` or ``"triton"``.
        optimizer_in_backward: step each parameter inside the step's last backward (chapter 17,
            notebooks/17_whole_step.ipynb).

    Returns:
        A ``RunResult``: what ran and one ``StepRecord`` per optimizer step.

    Raises:
        TypeError: ``batches`` is not a non-empty list of dicts (``check_train_args``).
        ValueError: another argument ``check_train_args`` rejects, ``after_backward`` given with
            ``optimizer_in_backward=True``, or ``adamw`` unknown (or not ``"triton"`` with
            ``optimizer_in_backward=True``).
    """
    check_train_args(batches, grad_accum, lr, warmup_steps)
    groups = step_groups(batches, grad_accum)
    return train_steps(model, groups, labels_per_step(groups), lr=lr, label=label, warmup_steps=warmup_steps,
                        progress=progress, after_backward=after_backward, padding_mask=padding_mask,
                        adamw=adamw, optimizer_in_backward=optimizer_in_backward)


def _own_loss(step_loss: torch.Tensor) -> torch.Tensor:
    """One process's step loss is the whole step's loss: nothing to add from elsewhere."""
    return step_loss


def _forward_backward(model: torch.nn.Module, micro_batches: list[dict], num_items: int,
                      optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor:
    """Forward and backward over one step's micro-batches, the gradients accumulating in ``.grad``;
    returns the sum of their losses. Each loss is a sum over labels divided by ``num_items``, so the
    sum is a mean over them. With an ``OptimizerInBackward`` as ``optimizer``, every backward but
    the last runs inside its ``accumulating()``, and the last one updates the parameters."""
    step_loss = torch.zeros((), dtype=torch.float32, device=micro_batches[0]["input_ids"].device)
    in_backward = isinstance(optimizer, OptimizerInBackward)
    for i, batch in enumerate(micro_batches):
        # Under CUDA graphs (torch.compile mode="reduce-overhead") each call is a new step whose
        # outputs may reuse the last call's memory; the loss is added to step_loss before the next
        # call. Elsewhere a no-op.
        torch.compiler.cudagraph_mark_step_begin()
        loss = model(**batch, num_items_in_batch=num_items).loss
        final = i == len(micro_batches) - 1
        with optimizer.accumulating() if in_backward and not final else contextlib.nullcontext():
            loss.backward()
        step_loss += loss.detach()  # in float32, whatever the loss's dtype
        del loss
    return step_loss


ADAMW_IMPLEMENTATIONS = ("foreach", "fused", "triton")


def make_adamw(model: torch.nn.Module, lr: float, adamw: str = "foreach",
               in_backward: bool = False) -> torch.optim.Optimizer:
    """AdamW over ``model``'s parameters with PyTorch's default hyperparameters.

    Args:
        model: the model whose parameters it steps.
        lr: the learning rate.
        adamw: ``"foreach"`` (``torch.optim.AdamW`` as it is), ``"fused"`` (with ``fused=True``) or
            ``"triton"`` (``kernels.adamw.TritonAdamW``).
        in_backward: the Triton kernel inside the backward instead
            (``kernels.optim_in_backward.OptimizerInBackward``, chapter 17); ``adamw``
            must be ``"triton"``. Its hooks stay on the parameters until its ``remove()``.

    Returns:
        The optimizer.

    Raises:
        ValueError: ``adamw`` is not one of ``ADAMW_IMPLEMENTATIONS``, or ``in_backward`` is set
            and ``adamw`` is not ``"triton"``.
    """
    if adamw not in ADAMW_IMPLEMENTATIONS:
        raise ValueError(f"adamw must be one of {ADAMW_IMPLEMENTATIONS}, got {adamw!r}")
    if in_backward:
        if adamw != "triton":
            raise ValueError("the optimizer in the backward runs the Triton kernel: adamw must be 'triton' "
                             f"with it, got {adamw!r}")
        # Trainable parameters only: a frozen one's hook would never fire (a LoRA model's base).
        return OptimizerInBackward([p for p in model.parameters() if p.requires_grad], lr=lr)
    if adamw == "triton":
        return TritonAdamW(model.parameters(), lr=lr)
    return torch.optim.AdamW(model.parameters(), lr=lr, **({"fused": True} if adamw == "fused" else {}))


def describe_optimizer(optimizer: torch.optim.Optimizer, lr: float) -> str:
    """What ran, for a run's record: e.g. ``torch.optim.AdamW(lr=0.0001, fused=True), defaults
    otherwise``.

    Args:
        optimizer: what ``make_adamw`` returned.
        lr: its learning rate, as the description gives it.

    Returns:
        One line naming the optimizer's class and the settings that differ from AdamW's defaults.
    """
    if isinstance(optimizer, OptimizerInBackward):
        return (f"kernels.optim_in_backward.OptimizerInBackward(lr={lr:g}, "
                f"side_stream={optimizer.side_stream}), torch.optim.AdamW's defaults otherwise; each "
                "parameter stepped in the step's last backward")
    if isinstance(optimizer, TritonAdamW):
        return f"kernels.adamw.TritonAdamW(lr={lr:g}), torch.optim.AdamW's defaults otherwise"
    fused = ", fused=True" if optimizer.defaults.get("fused") else ""
    return f"torch.optim.AdamW(lr={lr:g}{fused}), defaults otherwise"


def train_steps(
    model: torch.nn.Module,
    groups: list[list[dict[str, torch.Tensor]]],
    label_counts: list[int],
    *,
    lr: float,
    label: str,
    warmup_steps: int,
    progress: bool,
    after_backward: Callable[[int, torch.nn.Module], None] | None,
    padding_mask: bool,
    device: torch.device | None = None,
    reduce_loss: Callable[[torch.Tensor], torch.Tensor] = _own_loss,
    desc: str | None = None,
    rate_name: str = "tok_s",
    adamw: str = "foreach",
    optimizer_in_backward: bool = False,
) -> RunResult:
    """The step loop of ``train`` and of ``kernels.distributed.parallel.train_fsdp``. ``groups``
    holds each optimizer step's micro-batches (CPU copies); per step, a forward and backward of
    each, one AdamW step and a ``StepRecord``. ``lr``, ``label``, ``warmup_steps``, ``progress``,
    ``after_backward``, ``padding_mask``, ``adamw`` and ``optimizer_in_backward`` are ``train``'s.

    What differs between one process and several ranks comes in as two arguments:

    * ``label_counts[step]``: the ``num_items_in_batch`` each micro-batch of the step divides its
      loss sum by, and the step's ``trained_tokens``. One process counts its own labels; under FSDP
      every rank gets the count over all ranks, so its loss is its share of the global mean.
    * ``reduce_loss(step_loss)``: this process's step loss to the step's loss on record, inside the
      timed step. The identity for one process; under FSDP the sum of the ranks' shares (a
      collective: every rank calls it).

    ``device`` is where the micro-batches go (default: the model's first parameter's). ``desc`` and
    ``rate_name`` label the progress bar and its tokens/s (default: ``label`` and ``tok_s``).

    Args:
        model: the model (or each rank's sharded model).
        groups: each optimizer step's micro-batches, as ``step_groups`` gives.
        label_counts: per step, the labels each micro-batch's loss divides by.
        lr, label, warmup_steps, progress, after_backward, padding_mask, adamw,
            optimizer_in_backward: ``train``'s.
        device: where the micro-batches go.
        reduce_loss: this process's step loss to the step's loss on record.
        desc: the progress bar's title.
        rate_name: the progress bar's name for tokens/s.

    Returns:
        A ``RunResult`` with one ``StepRecord`` per group.

    Raises:
        ValueError: ``after_backward`` is given with ``optimizer_in_backward=True``, or
            ``make_adamw`` rejects ``adamw``.
    """
    if optimizer_in_backward and after_backward is not None:
        raise ValueError("after_backward reads the gradients after the last backward, and with "
                         "optimizer_in_backward=True they are freed inside it: take one or the other")
    device = next(model.parameters()).device if device is None else device
    steps = len(groups)
    warmup = min(warmup_steps, steps - 1)
    model.train()
    micro = [_micro_batches_on(group, device, padding_mask) for group in groups]
    real = [sum(int(b["attention_mask"].sum()) for b in group) for group in groups]
    total = [sum(b["input_ids"].numel() for b in group) for group in groups]

    optimizer = make_adamw(model, lr, adamw, in_backward=optimizer_in_backward)
    try:
        return _step_loop(model, groups, label_counts, micro, real, total, optimizer, lr=lr, label=label,
                          warmup=warmup, progress=progress, after_backward=after_backward, device=device,
                          reduce_loss=reduce_loss, desc=desc, rate_name=rate_name)
    finally:
        if isinstance(optimizer, OptimizerInBackward):
            optimizer.remove()  # the hooks would keep the optimizer, and its states, alive with the model


def _step_loop(model, groups, label_counts, micro, real, total, optimizer, *, lr, label, warmup, progress,
               after_backward, device, reduce_loss, desc, rate_name) -> RunResult:
    """``train_steps``' loop over the steps, given the optimizer and the micro-batches on the device."""
    steps = len(groups)
    what_ran = describe_model(model)
    what_ran["optimizer"] = describe_optimizer(optimizer, lr)
    what_ran["optimizer_in_backward"] = isinstance(optimizer, OptimizerInBackward)
    what_ran["grad_accum"] = len(groups[0])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    from kernels.bench.progress import progress_bar as tqdm

    records: list[StepRecord] = []
    bar = tqdm(range(steps), desc=desc or label, disable=not progress, leave=True)
    runtime.synchronize(device)
    for step in bar:
        start = time.perf_counter()
        step_loss = _forward_backward(model, micro[step], label_counts[step], optimizer)
        if after_backward is not None:
            after_backward(step, model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_loss = reduce_loss(step_loss)
        # the step's time covers every kernel it launched, the reduction's included
        runtime.synchronize(device)
        elapsed = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        record = StepRecord(step, float(step_loss), elapsed, total[step], real[step],
                            label_counts[step], peak,
                            step >= warmup)
        records.append(record)
        bar.set_postfix({"loss": f"{record.loss:.4f}", rate_name: f"{record.tokens_per_s:,.0f}"})
    bar.close()
    return RunResult(label, what_ran, records, warmup)


def free_memory() -> None:
    """Collect garbage (patched models hold reference cycles) and return cached GPU memory to the driver."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------
# Baseline against patched
# --------------------------------------------------------------------------------------------------


@dataclass
class Comparison:
    """Two runs of the same fine-tuning, Hugging Face's model and the patched one; numbers, table,
    plot, JSON."""

    settings: dict
    baseline: RunResult
    patched: RunResult
    device: str = field(default_factory=runtime.device_name)
    versions: dict = field(default_factory=runtime.versions)
    fit: dict = field(default_factory=dict)  # variant -> FitResult.to_dict(), when a fit search ran
    # variant -> fit.memory_slope(...), when the slope was measured
    slope: dict = field(default_factory=dict)
    # "gpu", or the interpreter's, whose times mean nothing
    mode: str = field(default_factory=lambda: runtime.MODE)

    @property
    def loss_differences(self) -> list[float]:
        return [p - b for b, p in zip(self.baseline.losses, self.patched.losses)]

    def summary(self) -> dict:
        """The two runs' headline numbers side by side.

        Returns:
            tokens/s (all and non-padding), ``speedup``, step time, peak memory and final loss of
            each run, the largest and the first step's loss difference, the warm-up steps left out;
            ``memory_saved_bytes`` when both peaks are known, and the longest sequence that fits
            and the memory per token when ``fit`` and ``slope`` hold them.
        """
        b, p = self.baseline, self.patched
        out = {
            "tokens_per_s": {"baseline": b.tokens_per_s, "patched": p.tokens_per_s},
            "real_tokens_per_s": {"baseline": b.real_tokens_per_s, "patched": p.real_tokens_per_s},
            "speedup": p.tokens_per_s / b.tokens_per_s,
            "step_time_s": {"baseline": b.step_time_s, "patched": p.step_time_s},
            "peak_memory_bytes": {"baseline": b.peak_memory, "patched": p.peak_memory},
            "final_loss": {"baseline": b.losses[-1], "patched": p.losses[-1]},
            "max_abs_loss_difference": max(abs(d) for d in self.loss_differences),
            "first_step_loss_difference": abs(self.loss_differences[0]),
            "warmup_steps_excluded_from_timing": b.warmup_steps,
            "headline_tokens": "all positions processed (batch × seq × grad_accum, padding included)",
        }
        if b.peak_memory is not None and p.peak_memory is not None:
            out["memory_saved_bytes"] = b.peak_memory - p.peak_memory
        for variant, result in self.fit.items():
            out.setdefault("max_seq_len_that_fits", {})[variant] = result.get("longest")
        for variant, result in self.slope.items():
            out.setdefault("activation_bytes_per_token", {})[variant] = result.get("bytes_per_token")
        return out

    def table(self) -> str:
        """``summary`` as a printed table, baseline and patched side by side (chapters 08 and 11,
        notebooks/08_training_loop.ipynb).

        Off the GPU the change column shows no speed ratios: the interpreter's times say nothing of
        GPU speed.

        Returns:
            The table, with a closing line on the device, the preset and the warm-up steps.
        """
        s = self.summary()
        b_mem, p_mem = s["peak_memory_bytes"]["baseline"], s["peak_memory_bytes"]["patched"]

        def mem(v):
            return f"{v / GiB:.2f} GiB" if v is not None else "n/a (CPU)"

        timed = self.mode == "gpu"  # the interpreter's wall-clock says nothing of GPU speed: no ratios of it
        rows = [
            ("tokens/s (all tokens)", f"{s['tokens_per_s']['baseline']:,.0f}",
             f"{s['tokens_per_s']['patched']:,.0f}",
             f"{s['speedup']:.3f}×" if timed else "—"),
            ("tokens/s (non-padding)", f"{s['real_tokens_per_s']['baseline']:,.0f}",
             f"{s['real_tokens_per_s']['patched']:,.0f}", ""),
            ("time per step", f"{s['step_time_s']['baseline'] * 1e3:,.1f} ms",
             f"{s['step_time_s']['patched'] * 1e3:,.1f} ms",
             f"{s['step_time_s']['patched'] / s['step_time_s']['baseline'] - 1:+.1%}" if timed else "—"),
            ("peak memory", mem(b_mem), mem(p_mem),
             f"{(p_mem - b_mem) / GiB:+.2f} GiB" if b_mem is not None and p_mem is not None else ""),
            ("final loss", f"{s['final_loss']['baseline']:.4f}", f"{s['final_loss']['patched']:.4f}", ""),
            ("max |loss difference|", "", "", f"{s['max_abs_loss_difference']:.2e}"),
        ]
        if "max_seq_len_that_fits" in s:
            fits = s["max_seq_len_that_fits"]
            rows.append(("longest seq that fits", _fmt_len(fits.get("baseline")),
                         _fmt_len(fits.get("patched")), ""))
        if "activation_bytes_per_token" in s:
            per = {k: (f"{v / 1024:,.0f} KiB" if v is not None else "n/a")
                   for k, v in s["activation_bytes_per_token"].items()}
            rows.append(("memory per token", per.get("baseline", ""), per.get("patched", ""), ""))
        lines = [f"{'':<24}{'baseline (HF)':>16}{'patched':>16}{'change':>12}"]
        lines += [f"{name:<24}{b:>16}{p:>16}{d:>12}" for name, b, p, d in rows]
        steps = len(self.baseline.records)
        lines.append(
            f"{self.device}, {self.settings.get('preset')}; {steps} steps, the first {self.baseline.warmup_steps} "
            "excluded from tokens/s and time per step"
        )
        if self.settings.get("compile"):
            lines.append(f"both models run through torch.compile (mode {self.settings['compile']!r})")
        if not timed:
            lines.append("tokens/s and times: wall-clock of Triton's CPU interpreter, meaningless as GPU speed (no "
                         "speed-up shown); the losses are the check here")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """The comparison as JSON-ready data, for ``save``.

        Returns:
            Device, mode, versions, settings, ``summary()``, both runs' ``to_dict()``, and the fit
            and slope results when present.
        """
        return {
            "device": self.device,
            "mode": self.mode,
            "versions": self.versions,
            "settings": self.settings,
            "summary": self.summary(),
            "baseline": self.baseline.to_dict(),
            "patched": self.patched.to_dict(),
            "fit": self.fit,
            "slope": self.slope,
        }

    def plot(self, axes=None):
        """Both loss curves on one plot, and the difference (patched − baseline) below it.

        Args:
            axes: two matplotlib axes, top and bottom; None makes a new figure with them.

        Returns:
            The two axes.
        """
        import matplotlib.pyplot as plt

        if axes is None:
            _, axes = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True,
                                   gridspec_kw={"height_ratios": [2, 1]})
        top, bottom = axes
        steps = [r.step + 1 for r in self.baseline.records]
        top.plot(steps, self.baseline.losses, "o-", label="baseline (Hugging Face)", color="#4c72b0")
        top.plot(steps, self.patched.losses, "x--",
                 label="patched (Triton RMSNorm + cross-entropy)", color="#c44e52")
        top.set_ylabel("loss")
        top.set_title(f"Same run, two implementations — {self.settings.get('preset')} on {self.device}")
        top.legend()
        bottom.axhline(0, color="grey", linewidth=0.8)
        bottom.plot(steps, self.loss_differences, "o-", color="#8172b3")
        bottom.set_ylabel("patched − baseline")
        bottom.set_xlabel("optimizer step")
        return axes

    def save(self, out_dir: str | Path = RESULTS, name: str | None = None) -> tuple[Path, Path]:
        """Write ``finetune/<name>.json`` and ``.png`` (the loss curves) under the results root
        ``out_dir``, over any earlier run of that name, each file complete or not at all; ``name``
        defaults to the preset. What the run was set up with is in the JSON's ``settings``
        (``kernels.bench.results.find_run`` finds it by them).

        Args:
            out_dir: the results root.
            name: the files' base name; None for the preset's name.

        Returns:
            The paths of the JSON file and the PNG file.
        """
        import matplotlib.pyplot as plt

        name = name or self.settings.get("preset")
        json_path = results_file("finetune", name, out_dir)
        png_path = results_file("finetune", name, out_dir, suffix=".png")
        axes = self.plot()
        fig = axes[0].figure
        fig.tight_layout()
        write_json_and_figure(json_path, self.to_dict(), fig, png_path, dpi=120)
        plt.close(fig)
        return json_path, png_path


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")


def compile_model(model: torch.nn.Module, mode: str = "default") -> torch.nn.Module:
    """``torch.compile(model, mode=mode)``: inductor on a GPU, ``runtime.COMPILE_BACKEND`` elsewhere.

    Off the GPU the backend is ``"aot_eager"``, whose graphs run eagerly, so Triton's interpreter runs
    the kernels (and ``mode`` is checked but not passed on). Chapter 09
    (notebooks/09_pytorch_ops.ipynb) compiles the patched model.

    Args:
        model: the model to compile.
        mode: one of ``COMPILE_MODES``.

    Returns:
        The compiled module (it shares ``model``'s parameters).

    Raises:
        ValueError: ``mode`` is not one of ``COMPILE_MODES``.
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode must be one of {COMPILE_MODES}, got {mode!r}")
    if runtime.MODE != "gpu":
        return torch.compile(model, backend=runtime.COMPILE_BACKEND)
    return torch.compile(model, mode=None if mode == "default" else mode)


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Turn on Hugging Face's gradient checkpointing, non-reentrant, in place.

    Non-reentrant is the variant PyTorch recommends: it needs no input that requires a gradient, and
    it composes with torch.compile and FSDP2. Chapter 14 (notebooks/14_long_context.ipynb) starts
    from it.

    Args:
        model: a Hugging Face model (``activation_checkpointing_enable`` or
            ``gradient_checkpointing_enable``, whichever its transformers release has).
    """
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # the name newer transformers releases use
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _fmt_len(n) -> str:
    return f"{n:,}" if isinstance(n, int) else "n/a"


def make_run_batches(preset: str, steps: int, seq_len: int, batch_size: int, grad_accum: int, seed: int = 0,
                     tokenizer=None) -> list[dict[str, torch.Tensor]]:
    """``steps × grad_accum`` micro-batches of the workbook's SFT data, on the CPU (``train`` moves them).

    Args:
        preset: the model preset, whose vocabulary bounds the token ids.
        steps: optimizer steps.
        seq_len: tokens per row.
        batch_size: rows per micro-batch.
        grad_accum: micro-batches per step.
        seed: the draw of examples.
        tokenizer: the tokenizer; None for ``get_tokenizer()``.

    Returns:
        The micro-batches, as ``make_sft_batches`` gives them.
    """
    tokenizer = tokenizer or get_tokenizer()
    vocab = llama_config(preset).vocab_size
    return make_sft_batches(tokenizer, batch_size, seq_len, steps * grad_accum, seed, vocab_size=vocab)


def compare(
    preset: str = "tiny",
    steps: int = 20,
    seq_len: int = 2048,
    batch_size: int = 1,
    grad_accum: int = 1,
    lr: float | None = None,
    seed: int = 0,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device=None,
    warmup_steps: int = WARMUP_STEPS,
    progress: bool = True,
    tokenizer=None,
    patch_options: dict | None = None,
    compile: str | None = None,
    gradient_checkpointing: bool = False,
    padding_mask: bool = True,
    adamw: str = "foreach",
    patched_adamw: str | None = None,
    optimizer_in_backward: bool = False,
) -> Comparison:
    """Train the baseline, then the patched model, from the same initial weights on the same batches.

    Each model is built with ``build_model(preset, dtype, device, seed)`` (same seed, same device:
    the same weights) and freed before the next one is built, so the two never share the GPU. ``lr``
    defaults to ``default_lr``. ``patch_options`` go to ``patch_llama`` (none: its default, every
    kernel that applies; e.g. ``dict(kernels=("cross_entropy",))`` to patch the loss alone).
    ``compile`` (``"default"``, ``"reduce-overhead"``, ...) runs both models through
    ``compile_model`` with that mode; the compilation happens in the first steps, which
    ``warmup_steps`` keeps out of the timings. ``gradient_checkpointing`` turns on Hugging Face's
    activation checkpointing in both models (non-reentrant): each decoder layer keeps only its input
    and recomputes the rest in the backward pass. ``padding_mask=False`` leaves out the redundant
    padding masks of both runs (``train``). ``adamw`` is ``train``'s, for both runs unless
    ``patched_adamw`` names another for the patched run (e.g. Hugging Face with ``"fused"``, the
    default of its Trainer, against the patched model with ``"triton"``: every kernel of this
    package, the optimizer's too). ``optimizer_in_backward=True`` steps the patched run's
    parameters inside its backward (``train``'s; its AdamW must then be ``"triton"``).

    Chapter 08 (notebooks/08_training_loop.ipynb) runs it; chapters 10 and 11 again with their kernels.

    Args:
        preset: the model preset (``kernels.training.models``).
        steps: optimizer steps per run.
        seq_len: tokens per row.
        batch_size: rows per micro-batch.
        grad_accum: micro-batches per optimizer step.
        lr: the learning rate; None for ``default_lr(preset)``.
        seed: the weights' and the data's seed.
        dtype: the models' dtype.
        device: where the models are built; None for ``runtime.device()``.
        warmup_steps: steps left out of the timings.
        progress: show progress bars.
        tokenizer: the tokenizer; None for ``get_tokenizer()``.
        patch_options: keyword arguments of ``patch_llama``.
        compile: a ``compile_model`` mode for both models, or None for eager.
        gradient_checkpointing: checkpoint every decoder layer in both models.
        padding_mask: keep redundant padding masks (``train``'s).
        adamw: both runs' AdamW (``train``'s).
        patched_adamw: the patched run's AdamW, if not ``adamw``.
        optimizer_in_backward: step the patched run's parameters inside its backward.

    Returns:
        A ``Comparison`` of the two runs, with the settings they ran with.

    Raises:
        ValueError: ``steps`` is not a positive int, or ``optimizer_in_backward`` is set and the
            patched run's AdamW is not ``"triton"`` (and what ``train`` raises).
    """
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if optimizer_in_backward and (patched_adamw or adamw) != "triton":
        raise ValueError("optimizer_in_backward runs the Triton kernel in the patched run: its AdamW must be "
                         f"'triton', got {patched_adamw or adamw!r}")
    lr = default_lr(preset) if lr is None else lr
    batches = make_run_batches(preset, steps, seq_len, batch_size, grad_accum, seed, tokenizer)
    settings = {
        "preset": preset, "steps": steps, "seq_len": seq_len, "batch_size": batch_size,
        "grad_accum": grad_accum,
        "lr": lr, "seed": seed, "dtype": str(dtype).replace("torch.", ""), "warmup_steps": warmup_steps,
        "patch_options": dict(patch_options or {}), "compile": compile,
        "gradient_checkpointing": gradient_checkpointing, "padding_mask": padding_mask, "adamw": adamw,
        "patched_adamw": patched_adamw or adamw, "optimizer_in_backward": optimizer_in_backward,
    }
    runs = {}
    for variant in VARIANTS:
        free_memory()
        model = build_model(preset, dtype=dtype, device=device, seed=seed)
        if gradient_checkpointing:
            enable_checkpointing(model)
        handle = patch_llama(model, **(patch_options or {})) if variant == "patched" else None
        runner = compile_model(model, compile) if compile else model
        variant_adamw = settings["patched_adamw"] if variant == "patched" else adamw
        runs[variant] = train(runner, batches, grad_accum=grad_accum, lr=lr, label=variant,
                              warmup_steps=warmup_steps, progress=progress, padding_mask=padding_mask,
                              adamw=variant_adamw,
                              optimizer_in_backward=optimizer_in_backward and variant == "patched")
        del runner
        torch._dynamo.reset()  # the next model compiles afresh, not against this one's guards
        if handle is not None:
            handle.undo()
        del model, handle
        free_memory()
    return Comparison(settings, runs["baseline"], runs["patched"])


# --------------------------------------------------------------------------------------------------
# One batch, three ways: the float32 truth, Hugging Face in bf16, patched in bf16
# --------------------------------------------------------------------------------------------------


PARAMETER_KINDS = ("embed_tokens", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                   "down_proj",
                   "input_layernorm", "post_attention_layernorm", "q_norm", "k_norm", "norm", "lm_head")


def parameter_kind(name: str) -> str:
    """The kind of a parameter from its name: ``model.layers.3.mlp.up_proj.weight`` -> ``up_proj``.

    Args:
        name: a dotted parameter name, as ``named_parameters`` gives.

    Returns:
        The last part of ``name`` that is one of ``PARAMETER_KINDS``; failing that, the part before
        the last (the module's name), or ``name`` itself if it has no dot.
    """
    parts = name.split(".")
    for part in reversed(parts):
        if part in PARAMETER_KINDS:
            return part
    return parts[-2] if len(parts) > 1 else name


@dataclass
class GradientCheck:
    """Loss and per-parameter gradient errors of Hugging Face's bf16 model and the patched bf16
    model, each against the same model computed in float32 (the reference), and of the patched model
    against Hugging Face's."""

    losses: dict[str, float]  # "float32", "baseline", "patched"
    errors: dict[str, dict[str, float]]  # parameter -> {"baseline", "patched", "patched_vs_baseline"}

    def by_kind(self) -> dict[str, dict[str, float]]:
        """The largest error of each kind of parameter (over layers), for each comparison.

        Returns:
            Kind (``parameter_kind``) -> {comparison -> largest error, ``"count"`` -> parameters},
            in the order the kinds first appear.
        """
        out: dict[str, dict[str, float]] = {}
        for name, errs in self.errors.items():
            row = out.setdefault(parameter_kind(name), {k: 0.0 for k in errs} | {"count": 0})
            for k, v in errs.items():
                row[k] = max(row[k], v)
            row["count"] += 1
        return out

    def worst(self, which: str) -> float:
        """The largest error of one comparison over every parameter.

        Args:
            which: ``"baseline"``, ``"patched"`` or ``"patched_vs_baseline"``.

        Returns:
            The largest relative error.
        """
        return max(e[which] for e in self.errors.values())

    def table(self) -> str:
        """``by_kind`` as a printed table, with the three losses below it (chapter 08,
        notebooks/08_training_loop.ipynb).

        Returns:
            The table.
        """
        lines = [f"{'parameter kind':<26}{'count':>6}{'HF bf16 vs fp32':>18}{'patched vs fp32':>18}"
                 f"{'patched vs HF':>16}"]
        for kind, row in self.by_kind().items():
            lines.append(f"{kind:<26}{row['count']:>6}{row['baseline']:>18.2e}{row['patched']:>18.2e}"
                         f"{row['patched_vs_baseline']:>16.2e}")
        lines.append("(largest relative error ‖g − g_ref‖ / ‖g_ref‖ over the parameters of each kind)")
        loss = self.losses
        lines.append(f"loss: float32 {loss['float32']:.6f}, HF bf16 {loss['baseline']:.6f}, "
                     f"patched bf16 {loss['patched']:.6f}")
        return "\n".join(lines)

    def plot(self, ax=None):
        """Each parameter's error against float32: Hugging Face's (x) against the patched model's (y).

        Args:
            ax: a matplotlib axis; None makes a new figure with one.

        Returns:
            The axis.
        """
        import matplotlib.pyplot as plt

        if ax is None:
            _, ax = plt.subplots(figsize=(5.5, 5))
        x = [e["baseline"] for e in self.errors.values()]
        y = [e["patched"] for e in self.errors.values()]
        ax.scatter(x, y, s=14, alpha=0.7)
        top = max(x + y) * 1.15
        ax.plot([0, top], [0, top], color="grey", linestyle="--", label="equally accurate")
        ax.set_xlim(0, top)
        ax.set_ylim(0, top)
        ax.set_xlabel("Hugging Face bf16: relative error vs float32")
        ax.set_ylabel("patched bf16: relative error vs float32")
        ax.set_title("Every parameter's gradient, one batch")
        ax.legend()
        return ax


def _loss_and_grads(model, batch, n_items):
    model.zero_grad(set_to_none=True)
    loss = model(**batch, num_items_in_batch=n_items).loss
    loss.backward()
    return float(loss.detach()), {name: p.grad for name, p in model.named_parameters()}


def gradient_check(preset_or_config="tiny", batch: dict | None = None, seed: int = 0,
                   device=None) -> GradientCheck:
    """One forward and backward pass on one batch, three ways, from the same weights: in float32
    (the reference), in bf16 as Hugging Face computes it, and in bf16 patched. The model is built
    once in float32 and its parameters are cast to bf16, so all three start from the same values (up
    to the bf16 rounding of the weights). The patched pass patches chapter 08's two kernels
    (RMSNorm and cross-entropy); notebooks/08_training_loop.ipynb runs it, and later chapters again.

    Args:
        preset_or_config: a preset name or a ``LlamaConfig``, as ``build_model`` takes.
        batch: one batch (``input_ids``, ``attention_mask``, ``labels``); None for one row of 128
            tokens of the workbook's SFT data.
        seed: the weights' (and the default batch's) seed.
        device: where the model is built; None for ``runtime.device()``.

    Returns:
        A ``GradientCheck`` with the three losses and every parameter's three relative errors.
    """
    model = build_model(preset_or_config, dtype=torch.float32, device=device, seed=seed)
    device = next(model.parameters()).device
    if batch is None:
        batch = make_sft_batches(get_tokenizer(), 1, 128, 1, seed, vocab_size=model.config.vocab_size)[0]
    n_items = count_trained_labels(batch)
    batch = _micro_batches_on([batch], device)[0]
    losses = {}
    losses["float32"], reference = _loss_and_grads(model, batch, n_items)
    reference = {k: g.detach().clone() for k, g in reference.items()}
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        # Parameters only: model.to(torch.bfloat16) would also round the rotary frequencies (a
        # float32 buffer that a bf16 model built directly keeps in float32), and the bf16 runs would
        # then test RoPE's rounding.
        for param in model.parameters():
            param.data = param.data.to(torch.bfloat16)
    losses["baseline"], grads = _loss_and_grads(model, batch, n_items)
    baseline = {k: g.detach().clone() for k, g in grads.items()}
    # Where the gradients live, in float32: no copy of a large gradient to the host, no float64
    # copies on the GPU.
    error = functools.partial(relative_error, on_device=True, dtype=torch.float32)
    errors = {k: {"baseline": error(baseline[k], reference[k])} for k in reference}
    with patch_llama(model, kernels=("rms_norm", "cross_entropy")):  # chapter 08's two kernels
        losses["patched"], grads = _loss_and_grads(model, batch, n_items)
        for k in reference:
            errors[k]["patched"] = error(grads[k], reference[k])
            errors[k]["patched_vs_baseline"] = error(grads[k], baseline[k])
    del model, grads, baseline, reference
    free_memory()
    return GradientCheck(losses, errors)


__all__ = [
    "WARMUP_STEPS", "VARIANTS", "StepRecord", "RunResult", "Comparison", "train", "compare",
    "count_trained_labels",
    "describe_model", "default_lr", "make_run_batches", "free_memory", "gradient_check", "GradientCheck",
    "parameter_kind", "check_train_args", "step_groups", "labels_per_step", "train_steps",
]
