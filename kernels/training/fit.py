"""The longest sequence that fits: how long a sequence one full training step can take before the
GPU runs out of memory, Hugging Face's model against the patched one.

``max_seq_len_that_fits`` builds the model and AdamW once on the GPU and probes lengths with real
training steps (forward, backward, optimizer step); an out-of-memory error means a length does not
fit. ``search_longest`` picks the lengths: doubling, then a prediction from the measured peaks
(memory grows about linearly with the length), then bisection, so the answer takes few probes.
``fit_both`` runs the search for both variants, and ``growth_bytes_per_token`` computes what one
more token of sequence costs each of them; ``memory_slope`` measures it: the growth of a step's peak
between two lengths.

Both searches take the patch's switches (``patch_options``, e.g. the linear cross-entropy), Hugging
Face's gradient checkpointing, and a memory cap (``memory_fraction``:
``torch.cuda.set_per_process_memory_fraction``), which keeps a search short on a GPU with far more
memory than the lengths of interest need.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from kernels import runtime
from kernels.hf.padding_mask import drop_padding_mask
from kernels.hf.patch import patch_llama
from kernels.memory import logits_bytes_per_token

from .data import get_tokenizer, make_sft_batches
from .loop import VARIANTS, count_trained_labels, default_lr, enable_checkpointing, free_memory
from .models import activation_bytes_per_token_layer, build_model, norm_bytes_per_token


@dataclass
class Probe:
    """One training step at ``seq_len`` tokens: whether it fitted, its peak and base, how it was chosen."""
    seq_len: int
    fits: bool
    peak: int | None = None  # bytes at the peak of forward + backward (GPU), when it fit
    base: int | None = None  # bytes allocated before the forward (weights, optimizer states)
    how: str = ""  # how this length was chosen: start, doubling, prediction, bisection


@dataclass
class FitResult:
    """The outcome of a search: the longest length that fitted, the shortest that did not, every probe."""

    longest: int | None
    shortest_failing: int | None
    step: int
    hi: int
    probes: list[Probe]

    @property
    def exact(self) -> bool:
        """True when no multiple of ``step`` between the two is left untried (or the search hit ``hi``)."""
        if self.longest is None:
            return self.shortest_failing is not None and self.shortest_failing <= self.step
        if self.longest >= self.hi:
            return True
        return self.shortest_failing is not None and self.shortest_failing - self.longest <= self.step

    def summary(self) -> str:
        """The search in one line: what fitted and what did not, then every probe's length and outcome.

        Returns:
            the line.
        """
        tried = ", ".join(f"{p.seq_len:,}{'✓' if p.fits else '✗'}" for p in self.probes)
        if self.longest is None:
            head = "nothing tried fitted"
        elif self.exact and self.longest >= self.hi:
            head = f"{self.longest:,} fits (the upper end of the search)"
        elif self.exact:
            head = f"{self.longest:,} fits, {self.shortest_failing:,} does not"
        else:
            upper = f"below {self.shortest_failing:,}" if self.shortest_failing else "untested above"
            head = f"at least {self.longest:,} fits ({upper}; out of probes)"
        return f"{head}  [probes: {tried}]"

    def measured_bytes_per_token(self) -> float | None:
        """How much the step's peak grew per extra token of sequence between the two longest lengths
        that fitted.

        Returns:
            bytes per token, or None with fewer than two fitted probes that report a peak.
        """
        fitted = sorted((p for p in self.probes if p.fits and p.peak is not None), key=lambda p: p.seq_len)
        if len(fitted) < 2:
            return None
        a, b = fitted[-2], fitted[-1]
        return (b.peak - a.peak) / (b.seq_len - a.seq_len)

    def to_dict(self) -> dict:
        """The result's fields and every probe as a dict.

        Returns:
            a JSON-ready dict.
        """
        return {"longest": self.longest, "shortest_failing": self.shortest_failing, "exact": self.exact,
                "step": self.step, "hi": self.hi, "probes": [asdict(p) for p in self.probes]}


def _round_down(n: float, step: int) -> int:
    return int(n // step) * step


def _next_length(probes: list[Probe], lo: int, hi: int, step: int, budget: int | None) -> tuple[int,
                                                                                                str] | None:
    """The next length to try, or None when the answer is known to ``step``.

    Doubling from ``lo`` until a failure, with, once a length has fitted and memory figures are
    known, a prediction: the peak grows about linearly with the length, so the length at which it
    would reach ``budget`` is extrapolated from the last two lengths that fitted (or from one, and
    the memory before the step). After a failed prediction, plain bisection, so a poor prediction
    costs one probe at most.
    """
    fitted = sorted(p.seq_len for p in probes if p.fits)
    failed = sorted(p.seq_len for p in probes if not p.fits)
    good = fitted[-1] if fitted else None
    bad = failed[0] if failed else None
    if good is None:  # even lo failed: bisect below it
        candidate = _round_down(bad / 2, step)
        return (candidate, "bisection") if candidate >= step and candidate not in failed else None
    upper = min(hi, bad - step) if bad is not None else hi
    if good >= upper:
        return None
    tried = {p.seq_len for p in probes}
    last = probes[-1]
    predicted = _predict(probes, budget, step)
    if predicted is not None and not (last.how == "prediction" and not last.fits):
        # A long jump (more than half the length that fitted) aims 10% short: memory grows slightly
        # faster than linearly (the attention mask is S × S), so a far extrapolation overshoots, and
        # a probe just below the limit makes the next extrapolation short and exact.
        if predicted - good > max(2 * step, 0.5 * good):
            predicted = _round_down(good + 0.9 * (predicted - good), step)
        candidate = min(max(predicted, good + step), upper)
        if candidate not in tried:
            return candidate, "prediction"
    if bad is None:
        return min(_round_down(2 * good, step), upper), "doubling"
    candidate = _round_down((good + bad) / 2, step)
    return (candidate, "bisection") if good < candidate < bad and candidate not in tried else None


def _predict(probes: list[Probe], budget: int | None, step: int) -> int | None:
    if budget is None:
        return None
    fitted = sorted((p for p in probes if p.fits and p.peak is not None), key=lambda p: p.seq_len)
    if not fitted:
        return None
    top = fitted[-1]
    if len(fitted) >= 2:
        below = fitted[-2]
        slope = (top.peak - below.peak) / (top.seq_len - below.seq_len)
    elif top.base is not None:
        # everything the step added, as if it all grew with length
        slope = (top.peak - top.base) / top.seq_len
    else:
        return None
    if not slope > 0:
        return None
    return _round_down(top.seq_len + (budget - top.peak) / slope, step)


def search_longest(
    probe: Callable[[int], Probe], lo: int, hi: int, step: int = 256, max_probes: int = 8,
    budget: int | None = None
) -> FitResult:
    """The longest multiple of ``step`` in [``step``, ``hi``] for which ``probe(length).fits``, in
    few probes.

    ``probe`` runs one training step at a length and reports whether it fitted and, on a GPU, its
    peak memory; ``budget`` is the memory the peak may reach (enables predictions; see
    ``_next_length``). Starts at ``lo``.

    Args:
        probe: runs one step at a length and returns its ``Probe``.
        lo: the first length probed (a multiple of ``step``).
        hi: the longest length tried (a multiple of ``step``, at least ``lo``).
        step: the lengths' granularity.
        max_probes: the most probes to run.
        budget: the bytes a step's peak may reach (None: no predictions, bisection only).

    Returns:
        the ``FitResult``, ``longest`` None when no probe fitted.

    Raises:
        ValueError: when a size is not a positive int, or ``lo`` and ``hi`` are not multiples of
            ``step`` with ``lo`` <= ``hi``.
    """
    for name, value in (("lo", lo), ("hi", hi), ("step", step), ("max_probes", max_probes)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if lo % step or hi % step or lo > hi:
        raise ValueError(f"lo and hi must be multiples of step={step} with lo <= hi, got lo={lo}, hi={hi}")
    probes: list[Probe] = []
    nxt: tuple[int, str] | None = (lo, "start")
    while nxt is not None and len(probes) < max_probes:
        length, how = nxt
        result = probe(length)
        result.how = how
        probes.append(result)
        nxt = _next_length(probes, lo, hi, step, budget)
    fitted = [p.seq_len for p in probes if p.fits]
    failed = [p.seq_len for p in probes if not p.fits]
    return FitResult(max(fitted) if fitted else None, min(failed) if failed else None, step, hi, probes)


def probe_batch(tokenizer, batch_size: int, seq_len: int, seed: int, vocab_size: int,
                padding_mask: bool = True) -> tuple[dict[str, torch.Tensor], int]:
    """One SFT batch of ``seq_len`` tokens on the CPU for a one-step memory probe, and the labels
    its loss counts (the step's ``num_items_in_batch``); without its padding mask when
    ``padding_mask=False`` and the mask is redundant (``kernels.hf.padding_mask``).

    Args:
        tokenizer: the tokenizer that makes the examples.
        batch_size: rows of the batch.
        seq_len: tokens per row.
        seed: the data's seed.
        vocab_size: the model's vocabulary size (token ids stay below it).
        padding_mask: keep the padding mask even where it is redundant.

    Returns:
        ``(batch, labels)``: the batch and the labels its loss counts.
    """
    batch = make_sft_batches(tokenizer, batch_size, seq_len, 1, seed, vocab_size=vocab_size)[0]
    n_items = count_trained_labels(batch)
    return (batch if padding_mask else drop_padding_mask(batch)), n_items


def _gpu_probe(model, optimizer, tokenizer, batch_size: int, seed: int,
               padding_mask: bool = True) -> Callable[[int], Probe]:
    """One full training step at a given length on the GPU; an out-of-memory error means it does not fit."""
    device = next(model.parameters()).device
    vocab = model.config.vocab_size

    def step(batch, n_items) -> int:
        loss = model(**batch, num_items_in_batch=n_items).loss
        loss.backward()
        del loss
        peak = torch.cuda.max_memory_allocated(device)
        optimizer.step()
        torch.cuda.synchronize(device)
        return peak

    def probe(seq_len: int) -> Probe:
        cpu_batch, n_items = probe_batch(tokenizer, batch_size, seq_len, seed, vocab, padding_mask)
        free_memory()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        try:
            batch = {k: v.to(device) for k, v in cpu_batch.items()}
            peak = step(batch, n_items)
            fits = True
        except torch.cuda.OutOfMemoryError:
            peak, fits = None, False
        # Outside the except block: the exception and the frames holding the step's tensors are gone
        # by now.
        batch = None
        optimizer.zero_grad(set_to_none=True)
        free_memory()
        return Probe(seq_len, fits, peak, base)

    return probe


class _TrainingSetup:
    """The model (patched or not, checkpointed or not), AdamW and the probe, on the GPU, under an
    optional memory cap; everything is undone and freed on leaving."""

    def __init__(self, preset, patched, batch_size, seed, tokenizer, patch_options, gradient_checkpointing,
                 memory_fraction, padding_mask=True):
        self.args = (preset, patched, batch_size, seed, tokenizer, patch_options or {},
                     gradient_checkpointing,
                     padding_mask, memory_fraction)

    def __enter__(self):
        preset, patched, batch_size, seed, tokenizer, patch_options, checkpointing, padding_mask, fraction = self.args
        free_memory()
        if fraction is not None:
            torch.cuda.set_per_process_memory_fraction(fraction)  # the current device, where the model goes
        self.model = build_model(preset, dtype=torch.bfloat16, seed=seed)
        self.device = next(self.model.parameters()).device
        if checkpointing:
            enable_checkpointing(self.model)
        self.handle = patch_llama(self.model, **patch_options) if patched else None
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=default_lr(preset))
        self.probe = _gpu_probe(self.model, self.optimizer, tokenizer or get_tokenizer(), batch_size, seed,
                                padding_mask)
        free_memory()
        limit = torch.cuda.mem_get_info(self.device)[1] * fraction if fraction is not None else None
        free = torch.cuda.mem_get_info(self.device)[0]
        allocated = torch.cuda.memory_allocated(self.device)
        self.capacity = allocated + (free if limit is None else min(free, limit - allocated))
        return self

    def __exit__(self, *exc):
        if self.handle is not None:
            self.handle.undo()
        del self.model, self.optimizer, self.handle, self.probe  # the probe's closure holds both too
        if self.args[-1] is not None:
            torch.cuda.set_per_process_memory_fraction(1.0)
        free_memory()


def _gpu_only(what: str) -> bool:
    if runtime.MODE != "gpu" or not torch.cuda.is_available():
        print(f"{what} is GPU-only: the CPU has no device memory limit to search for.")
        return False
    return True


def max_seq_len_that_fits(
    preset: str,
    patched: bool,
    batch_size: int = 1,
    lo: int = 4096,
    hi: int = 65536,
    *,
    max_probes: int = 8,
    step: int = 256,
    seed: int = 0,
    margin: float = 0.02,
    tokenizer=None,
    patch_options: dict | None = None,
    gradient_checkpointing: bool = False,
    memory_fraction: float | None = None,
    padding_mask: bool = True,
) -> FitResult | None:
    """GPU only: the longest sequence (a multiple of ``step``) at which one full training step
    (forward, backward, AdamW step) of ``preset`` fits in memory, Hugging Face's model
    (``patched=False``) or the patched one.

    The model and AdamW stay on the GPU across probes (a first step at ``step`` tokens creates
    AdamW's states); each probe runs one step on a real SFT batch of that length;
    ``torch.cuda.OutOfMemoryError`` means it does not fit, and everything the step allocated is
    freed before the next probe. ``margin`` (2%) is left free when predicting. ``patch_options`` go
    to ``patch_llama``; ``gradient_checkpointing`` checkpoints every decoder layer;
    ``memory_fraction`` caps the memory the search may use (a fraction of the GPU's);
    ``padding_mask=False`` leaves out the redundant padding mask (``kernels.hf.padding_mask``). On
    the CPU there is no memory limit to find: prints so and returns None.

    Chapter 08 runs it through ``fit_both``.

    Args:
        preset: the model preset.
        patched: False for Hugging Face's model, True for the patched one.
        batch_size: rows per step.
        lo: the first length probed.
        hi: the longest length tried.
        max_probes: the most probes to run.
        step: the lengths' granularity.
        seed: the seed of the weights and the data.
        margin: the share of the GPU's memory left free when predicting.
        tokenizer: the tokenizer (None: the workbook's).
        patch_options: keyword arguments for ``patch_llama``.
        gradient_checkpointing: checkpoint each decoder layer.
        memory_fraction: the share of the GPU's memory the search may use (None: all).
        padding_mask: keep the padding mask even where it is redundant.

    Returns:
        the ``FitResult`` (with only the warm-up probe when even ``step`` tokens do not fit), or None
        on the CPU.

    Raises:
        TypeError: when ``patched`` is not a bool.
    """
    if not _gpu_only("max_seq_len_that_fits"):
        return None
    if not isinstance(patched, bool):
        raise TypeError(f"patched must be True or False, got {patched!r}")
    with _TrainingSetup(preset, patched, batch_size, seed, tokenizer, patch_options, gradient_checkpointing,
                        memory_fraction, padding_mask) as setup:
        budget = int(setup.capacity * (1 - margin))
        # One short step first, not counted as a probe: it creates AdamW's states, so that every
        # probe starts from the same memory (weights and states) and the peaks of different probes
        # can be compared.
        warm = setup.probe(step)
        if not warm.fits:
            warm.how = "warm-up"
            return FitResult(None, step, step, hi, [warm])
        return search_longest(setup.probe, lo, hi, step=step, max_probes=max_probes, budget=budget)


def memory_slope(preset: str, patched: bool, lengths: tuple[int, int] = (16384, 32768),
                 batch_size: int = 1, *,
                 seed: int = 0, tokenizer=None, patch_options: dict | None = None,
                 gradient_checkpointing: bool = False, padding_mask: bool = True) -> dict | None:
    """GPU only: the bytes one more token of sequence adds to a training step's peak, measured as
    the slope of the peak between two lengths (after a warm-up step that creates AdamW's states).
    Returns the two probes and the slope per token (batch × length tokens), or None on the CPU; a
    length that does not fit gives no slope. ``padding_mask=False`` leaves out the redundant padding
    mask, whose [seq, seq] 4-D form grows with the square of the length and so inflates a slope
    measured between two lengths.

    Args:
        preset: the model preset.
        patched: False for Hugging Face's model, True for the patched one.
        lengths: the two sequence lengths.
        batch_size: rows per step.
        seed: the seed of the weights and the data.
        tokenizer: the tokenizer (None: the workbook's).
        patch_options: keyword arguments for ``patch_llama``.
        gradient_checkpointing: checkpoint each decoder layer.
        padding_mask: keep the padding mask even where it is redundant.

    Returns:
        ``{"lengths", "batch_size", "probes", "bytes_per_token"}`` (the slope None when a length does
        not fit), or None on the CPU.
    """
    if not _gpu_only("memory_slope"):
        return None
    with _TrainingSetup(preset, patched, batch_size, seed, tokenizer, patch_options, gradient_checkpointing,
                        None, padding_mask) as setup:
        setup.probe(256)
        probes = [setup.probe(n) for n in lengths]
    slope = None
    if all(p.fits for p in probes):
        slope = (probes[1].peak - probes[0].peak) / ((lengths[1] - lengths[0]) * batch_size)
    return {"lengths": list(lengths), "batch_size": batch_size, "probes": [asdict(p) for p in probes],
            "bytes_per_token": slope}


def fit_both(preset: str, batch_size: int = 1, lo: int = 4096, hi: int = 65536, max_probes: int = 8,
             seed: int = 0, **options) -> dict[str, FitResult] | None:
    """``max_seq_len_that_fits`` for the baseline and the patched model, one after the other (GPU
    only). ``options``: ``patch_options``, ``gradient_checkpointing``, ``memory_fraction`` and
    ``padding_mask``, as there.

    Chapter 08 runs it.

    Args:
        preset: the model preset.
        batch_size: rows per step.
        lo: the first length probed.
        hi: the longest length tried.
        max_probes: the most probes per variant.
        seed: the seed of the weights and the data.
        **options: passed to ``max_seq_len_that_fits``.

    Returns:
        variant -> ``FitResult``, or None on the CPU.
    """
    if not _gpu_only("max_seq_len_that_fits"):
        return None
    return {variant: max_seq_len_that_fits(preset, variant == "patched", batch_size, lo, hi,
                                           max_probes=max_probes,
                                           seed=seed, **options) for variant in VARIANTS}


def growth_bytes_per_token(config, dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
    """Computed bytes that one more token of sequence adds at a step's forward/backward high point,
    Hugging Face's model against the patched one: what decides the longest sequence that fits once
    the weights, gradients and optimizer states are paid for.

    * activations saved for backward: ``models.activation_bytes_per_token_layer`` per layer, plus
      the final norm;
    * the patched norms save less: Hugging Face's keeps the float32 copy of its input (4·h bytes)
      and the normalised values before the weight multiply; the kernel keeps the bf16 input and one
      float32 rstd. 4·h bytes fewer per norm, 2·layers + 1 norms;
    * the loss at its high point: ``logits_bytes_per_token``.

    Chapter 08 compares it with the measured slopes.

    Args:
        config: a ``LlamaConfig``.
        dtype: the activations' dtype.

    Returns:
        bytes per token for ``"baseline"`` and ``"patched"``, and their parts.
    """
    h, layers = config.hidden_size, config.num_hidden_layers
    activations = layers * activation_bytes_per_token_layer(config, dtype) + norm_bytes_per_token(h, dtype)
    norm_saving = (2 * layers + 1) * 4 * h
    loss = logits_bytes_per_token(config.vocab_size, dtype)
    return {
        "baseline": activations + loss["baseline"],
        "patched": activations - norm_saving + loss["patched"],
        "activations": activations,
        "norm_saving": norm_saving,
        "loss_baseline": loss["baseline"],
        "loss_patched": loss["patched"],
    }


__all__ = ["Probe", "FitResult", "search_longest", "max_seq_len_that_fits", "fit_both", "memory_slope",
           "growth_bytes_per_token"]
