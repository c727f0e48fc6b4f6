"""The whole full-fine-tuning step side by side, against the matmul-bound limit (chapter 17).

``python -m kernels.bench.step`` runs one full fine-tuning step loop (every parameter trained, AdamW)
per setup, one setup after the other, each on a fresh model built from the same seed and fed the
same batches, the previous one freed first:

* ``hf``: Hugging Face's model as it is, ``torch.optim.AdamW(fused=True)``;
* ``ours``: ``patch_llama``'s defaults, ``kernels.adamw.TritonAdamW``;
* ``ours_in_backward``: ``patch_llama``'s defaults, AdamW applied inside the backward
  (``OptimizerInBackward``: a post-accumulate-grad hook per parameter) on a side CUDA stream;
  its ``step()`` only closes the step;
* ``ours_in_backward_inline``: the same with each update on the backward's own stream
  (``side_stream=False``): what the side stream adds or costs shows against it;
* ``ours_in_backward_no_add_norm``: the same with the ``add_rms_norm`` switch off, so that its share
  shows (listed only once ``patch_llama`` has that switch);
* ``liger``: Liger-Kernel on every Llama kernel (RoPE, SwiGLU, RMSNorm, fused linear
  cross-entropy), ``torch.optim.AdamW(fused=True)``; last, because Liger patches the modeling
  module for the whole process. Skipped, with the reason, where ``liger_kernel`` is not installed.

Per setup: tokens/s by wall clock over the timed steps (each step synchronised at its end), the
device time of each step (CUDA events around it), its host time (until the step's last call
returns, before the synchronisation: what the Python caller spends launching), the peak memory
(``torch.cuda.max_memory_allocated``, reset before the model is built), the loss of every step, and
one more step under ``torch.profiler`` with its kernels sorted into GEMM, optimizer, attention and
the rest (``classify_kernel``). The losses are compared with ``hf``'s step by step (the largest
relative difference, against the bound of ``kernels.tolerances`` for the dtype).

The limit: the matmul FLOP of one step (``step_flop``: 6 per parameter of every projection and the
LM head per token, and the causal attention's score and value products) at the bf16 matmul rate
measured in the same run (``kernels.bench.timing.measure_ceilings``), as tokens per second; every
setup is shown as a fraction of it. The derivation, and how host and device time are taken:
``assets/notes/step.md``.

Results go to ``runs/step/<name>.json`` (``--out`` picks another results root; an existing file is
replaced only with ``--force``); ``--record`` writes ``assets/results/step/<name>.json``, the files
chapter 17 reads. ``load_step_results`` and ``plot_step_breakdown`` read and draw them. In Triton's
interpreter it runs the tiny preset in float32; its times mean nothing and no fraction is shown.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels import runtime
from kernels.adamw import TritonAdamW
from kernels.hf.patch import SWITCHES, patch_llama
from kernels.hf.presets import PRESETS, llama_config
from kernels.optim_in_backward import OptimizerInBackward
from kernels.tolerances import RELATIVE_ERROR_TOL

from . import cli
from .lora import build_llama, make_batches
from .progress import progress_bar
from .results import device_slug, first_line, results_file
from .tables import html_table
from .timing import measure_ceilings

GROUP = "step"
GIB = 2**30
IGNORE_INDEX = -100
LR = 1e-5
CATEGORIES = ("gemm", "optimizer", "attention", "rest")
CATEGORY_TITLES = {"gemm": "GEMM", "optimizer": "optimizer", "attention": "attention", "rest": "rest"}


@dataclass(frozen=True)
class Setup:
    """One row of the benchmark: how the model is patched and which optimizer trains it.

    ``patch`` is None for Hugging Face's model as it is, else ``patch_llama``'s keyword arguments;
    ``optimizer`` is ``"fused"`` (``torch.optim.AdamW(fused=True)``), ``"triton"``
    (``TritonAdamW``), ``"in_backward"`` (``OptimizerInBackward`` on a side stream) or
    ``"in_backward_inline"`` (on the backward's stream).
    """

    name: str
    label: str
    patch: dict | None
    optimizer: str
    liger: bool = False


# In the order they run: Liger last, because it patches the modeling module for the whole process.
SETUP_TABLE = (
    Setup("hf", "Hugging Face eager + fused AdamW", None, "fused"),
    Setup("ours", "patch_llama defaults + TritonAdamW", {}, "triton"),
    Setup("ours_in_backward", "patch_llama defaults + AdamW in the backward", {}, "in_backward"),
    Setup("ours_in_backward_inline", "patch_llama defaults + AdamW in the backward, one stream", {},
          "in_backward_inline"),
    Setup("ours_in_backward_no_add_norm", "patch_llama(add_rms_norm=False) + AdamW in the backward",
          {"add_rms_norm": False}, "in_backward"),
    Setup("liger", "Liger (every Llama kernel) + fused AdamW", None, "fused", liger=True),
)
SETUPS = tuple(s.name for s in SETUP_TABLE)
SHORT_LABELS = {"hf": "Hugging Face", "ours": "ours", "ours_in_backward": "ours,\nAdamW in\nbackward",
                "ours_in_backward_inline": "ours, in\nbackward,\none stream",
                "ours_in_backward_no_add_norm": "ours, in\nbackward,\nno add-norm", "liger": "Liger"}
BY_NAME = {s.name: s for s in SETUP_TABLE}
IN_BACKWARD = ("in_backward", "in_backward_inline")  # the optimizers whose updates run in the backward


# --------------------------------------------------------------------------------------------------
# What can run here
# --------------------------------------------------------------------------------------------------


def why_not(setup: Setup) -> str | None:
    """Why ``setup`` cannot run in this process (a missing package or piece), or None if it can.

    Args:
        setup: an entry of ``SETUP_TABLE``.

    Returns:
        The reason, or None.
    """
    if setup.liger and importlib.util.find_spec("liger_kernel") is None:
        return "liger_kernel is not installed (pip install liger-kernel)"
    if setup.patch and any(name not in SWITCHES for name in setup.patch):
        missing = [name for name in setup.patch if name not in SWITCHES]
        return f"patch_llama has no switch {', '.join(missing)}"
    return None


# --------------------------------------------------------------------------------------------------
# The limit: matmul FLOP per step at the measured matmul rate
# --------------------------------------------------------------------------------------------------


def projection_parameters(config) -> int:
    """Weights that multiply every token in a GEMM: q, k, v, o, gate, up, down of every layer and
    the LM head (counted even where it shares the embedding's weight: its GEMM runs all the same).
    Embeddings (a lookup) and norms (elementwise) are not in it.

    Args:
        config: a ``LlamaConfig``.

    Returns:
        The number of such weights.
    """
    h = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q_out, kv_out = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    per_layer = h * q_out + 2 * h * kv_out + q_out * h + 3 * h * config.intermediate_size
    return config.num_hidden_layers * per_layer + config.vocab_size * h


def step_flop(config, batch: int, seq: int) -> dict:
    """The matmul FLOP of one training step of ``batch`` rows of ``seq`` tokens (one micro-batch).

    Projections: 2 FLOP per weight per token forward, 4 backward (the input's gradient and the
    weight's), so 6·P·tokens. Causal attention, per layer and row: query i meets i + 1 keys, in
    Q·Kᵀ and P·V (2·head_dim FLOP per pair and head each), so the forward is
    2·d_q·s·(s + 1) and the backward's four products twice that: 6·d_q·s·(s + 1), with d_q the
    query heads × head_dim. Derived in ``assets/notes/step.md``.

    Args:
        config: a ``LlamaConfig``.
        batch: rows per micro-batch.
        seq: tokens per row.

    Returns:
        ``{"projections", "attention", "total", "per_token"}`` in FLOP.
    """
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    d_q = config.num_attention_heads * head_dim
    tokens = batch * seq
    projections = 6 * projection_parameters(config) * tokens
    attention = 6 * config.num_hidden_layers * d_q * seq * (seq + 1) * batch
    total = projections + attention
    return {"projections": projections, "attention": attention, "total": total, "per_token": total / tokens}


def limit_tokens_per_s(config, batch: int, seq: int, matmul_tflops: float) -> float:
    """Tokens per second if a step did nothing but its matmuls, each at ``matmul_tflops``.

    Args:
        config: a ``LlamaConfig``.
        batch: rows per micro-batch.
        seq: tokens per row.
        matmul_tflops: the measured bf16 matmul rate (TFLOP/s).

    Returns:
        The limit in tokens per second.
    """
    if not matmul_tflops > 0:
        raise ValueError(f"matmul_tflops must be positive, got {matmul_tflops!r}")
    return matmul_tflops * 1e12 / step_flop(config, batch, seq)["per_token"]


# --------------------------------------------------------------------------------------------------
# Kernels (or CPU operators) into four categories
# --------------------------------------------------------------------------------------------------

_CATEGORY_PATTERNS = (
    # AdamW: torch's fused/foreach (multi_tensor_apply), our Triton kernel, the CPU operators.
    ("optimizer", ("adam", "multi_tensor_apply", "_foreach_")),
    # Attention: SDPA's flash / memory-efficient / cuDNN kernels, and our FlashAttention's four.
    ("attention", ("flash", "fmha", "cudnn", "sdpa", "attention")),
    # GEMMs: cuBLAS / cuBLASLt / CUTLASS kernel families, the CPU's aten matmuls.
    ("gemm", ("gemm", "cutlass", "cublas", "nvjet", "xmma", "s16816", "splitkreduce", "aten::mm",
              "aten::addmm", "aten::bmm", "aten::baddbmm")),
)

# kernels.attention's Triton kernels, whose names say only which pass they are.
_OUR_ATTENTION = frozenset({"_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel", "_delta_kernel"})


def classify_kernel(name: str) -> str:
    """The category of a kernel (or, on the CPU, an operator) from its name: one of ``CATEGORIES``.

    Checked in order: optimizer, attention (before GEMMs: ``fmha_cutlass``), GEMM; the rest is
    everything else (norms, activations, the loss, copies).

    Args:
        name: the kernel's or operator's name as the profiler records it.

    Returns:
        ``"gemm"``, ``"optimizer"``, ``"attention"`` or ``"rest"``.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if name in _OUR_ATTENTION:
        return "attention"
    lower = name.lower()
    for category, needles in _CATEGORY_PATTERNS:
        if any(n in lower for n in needles):
            return category
    return "rest"


def _merged_length(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``intervals``: time at least one kernel ran."""
    busy, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if a > end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    return busy


def breakdown(events, on_device: bool) -> dict:
    """Sum a profiled step's time by category.

    On a GPU: each kernel's duration (``kernel_ms``), the union of their intervals (``busy_ms``:
    below the sum where kernels overlapped, as the optimizer does on its side stream) and the span
    from the first kernel's start to the last one's end (``span_ms``). On the CPU: each operator's
    self time; the three totals are then their sum.

    Args:
        events: ``prof.events()`` of a ``torch.profiler.profile``.
        on_device: True for CUDA kernels, False for CPU operators.

    Returns:
        ``{"kernel_ms": {category: ms}, "sum_ms", "busy_ms", "span_ms", "time_kind"}``.
    """
    from torch.autograd import DeviceType

    sums = dict.fromkeys(CATEGORIES, 0.0)
    intervals = []
    if on_device:
        ranges = {e.name for e in events if e.device_type == DeviceType.CPU}
        for e in events:
            if e.device_type != DeviceType.CUDA or e.is_async or e.name in ranges:
                continue
            start, end = e.time_range.start, e.time_range.end
            sums[classify_kernel(e.name)] += (end - start) / 1e3
            intervals.append((start, end))
        busy = _merged_length(intervals) / 1e3
        span = (max(b for _, b in intervals) - min(a for a, _ in intervals)) / 1e3 if intervals else 0.0
    else:
        for e in events:
            if e.device_type == DeviceType.CPU and not e.is_async:
                sums[classify_kernel(e.name)] += e.self_cpu_time_total / 1e3
        busy = span = sum(sums.values())
    return {"kernel_ms": sums, "sum_ms": sum(sums.values()), "busy_ms": busy, "span_ms": span,
            "time_kind": "GPU kernel time" if on_device else "CPU self time (interpreter)"}


# --------------------------------------------------------------------------------------------------
# One setup: build, patch, train, profile
# --------------------------------------------------------------------------------------------------


def _liger_patch(model) -> None:
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    apply_liger_kernel_to_llama(rope=True, swiglu=True, rms_norm=True, cross_entropy=False,
                                fused_linear_cross_entropy=True, model=model)


def make_optimizer(kind: str, model: torch.nn.Module, lr: float):
    """The optimizer of a setup over ``model``'s parameters, torch.optim.AdamW's defaults otherwise.

    Args:
        kind: ``"fused"``, ``"triton"``, ``"in_backward"`` or ``"in_backward_inline"`` (see
            ``Setup``).
        model: the model whose parameters it trains.
        lr: the learning rate.

    Returns:
        The optimizer (the in-backward one updates inside the backward; ``step()`` closes its step).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "fused":
        return torch.optim.AdamW(params, lr=lr, fused=params[0].device.type == "cuda")
    if kind == "triton":
        return TritonAdamW(params, lr=lr)
    if kind in IN_BACKWARD:
        return OptimizerInBackward(params, lr=lr, side_stream=kind == "in_backward")
    raise ValueError(f"kind must be one of 'fused', 'triton', {', '.join(map(repr, IN_BACKWARD))}, got {kind!r}")


def one_step(model, optimizer, updates_in_backward: bool, micro: list[dict],
             num_items: int | None) -> torch.Tensor:
    """Forward and backward of a step's micro-batches, then the optimizer.

    Args:
        model: the (patched, compiled) model.
        optimizer: the setup's optimizer.
        updates_in_backward: the optimizer updates in the backward: every backward but the last
            runs inside its ``accumulating()``, and no ``zero_grad`` follows.
        micro: the step's micro-batches.
        num_items: the labels counted over all of them (each loss is then its sum over this
            number, so the accumulated gradient is that of the step's mean), or None for one
            micro-batch (the loss's own mean).

    Returns:
        The step's loss as a tensor (reading it waits for the GPU).
    """
    total = torch.zeros((), dtype=torch.float32, device=micro[0]["input_ids"].device)
    last = len(micro) - 1
    for i, batch in enumerate(micro):
        kwargs = {} if num_items is None else {"num_items_in_batch": num_items}
        loss = model(**batch, **kwargs).loss
        accumulating = optimizer.accumulating() if updates_in_backward and i < last else nullcontext()
        with accumulating:
            loss.backward()
        total += loss.detach()
        del loss
    optimizer.step()  # in the backward's case no arithmetic: it closes the step and checks it
    if not updates_in_backward:  # the in-backward updates freed every gradient already
        optimizer.zero_grad(set_to_none=True)
    return total


def _labels(batch: dict) -> int:
    return int((batch["labels"][..., 1:] != IGNORE_INDEX).sum())


def _timed(step: Callable[[], torch.Tensor], device: torch.device) -> dict:
    """One step: wall time (synchronised), host time (until its last call returns) and, on a GPU,
    device time between CUDA events recorded before and after it."""
    on_gpu = device.type == "cuda"
    runtime.synchronize(device)
    if on_gpu:
        start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start = time.perf_counter()
    if on_gpu:
        start_event.record()
    loss = step()
    if on_gpu:
        end_event.record()
    host = time.perf_counter() - start
    runtime.synchronize(device)
    wall = time.perf_counter() - start
    return {"loss": float(loss), "wall_ms": wall * 1e3, "host_ms": host * 1e3,
            "device_ms": start_event.elapsed_time(end_event) if on_gpu else None}


def _profiled(step: Callable[[], torch.Tensor], device: torch.device) -> tuple[float, dict]:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if not torch.cuda.is_available():  # Kineto's start/stop lines on machines without CUDA; read once
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    runtime.synchronize(device)
    with profile(activities=activities) as prof:
        loss = step()
        runtime.synchronize(device)
    return float(loss), breakdown(prof.events(), device.type == "cuda")


def _free() -> None:
    # A compiled setup's graphs hold its model; patched models and the in-backward hooks hold cycles.
    torch.compiler.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_setup(setup: Setup, preset: str, dtype: torch.dtype, steps_batches: list[list[dict]],
              warmup: int, steps: int, lr: float, compile: bool, seed: int = 0) -> dict:
    """Build a fresh model, patch it as ``setup`` says, run ``warmup`` + ``steps`` steps and one
    profiled step on ``steps_batches`` (each step's micro-batches), and return the setup's row.

    Args:
        setup: an entry of ``SETUP_TABLE``.
        preset: the model's preset.
        dtype: the model's dtype.
        steps_batches: per step, its micro-batches (on the device).
        warmup: untimed steps first.
        steps: timed steps.
        lr: AdamW's learning rate.
        compile: ``torch.compile`` the model.
        seed: the weights' seed.

    Returns:
        The setup's row (see the module docstring).
    """
    device = steps_batches[0][0]["input_ids"].device
    _free()
    left = None
    if device.type == "cuda":  # what the previous setups left allocated, if anything (the batches)
        left = torch.cuda.memory_allocated(device) / GIB
        torch.cuda.reset_peak_memory_stats(device)
    model = build_llama(preset, dtype, device, seed)
    if setup.liger:
        _liger_patch(model)
    elif setup.patch is not None:
        patch_llama(model, **setup.patch)
    optimizer = make_optimizer(setup.optimizer, model, lr)
    net = model
    if compile:  # inductor on a GPU; in the interpreter a backend whose graphs run eagerly
        net = torch.compile(model, **({} if runtime.MODE == "gpu" else {"backend": runtime.COMPILE_BACKEND}))
    updates_in_backward = setup.optimizer in IN_BACKWARD
    grad_accum = len(steps_batches[0])
    counts = [sum(_labels(b) for b in group) if grad_accum > 1 else None for group in steps_batches]

    def step_fn(i):
        return functools.partial(one_step, net, optimizer, updates_in_backward, steps_batches[i], counts[i])

    records = []
    bar = progress_bar(range(warmup + steps), desc=setup.name, leave=True)
    for i in bar:
        records.append(_timed(step_fn(i), device))
        bar.set_postfix({"loss": f"{records[-1]['loss']:.4f}"})
    bar.close()
    profiled_loss, profile = _profiled(step_fn(warmup + steps), device)
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
    if updates_in_backward:
        optimizer.remove()  # its hooks: the model is done with
    timed = records[warmup:]
    tokens = sum(b["input_ids"].numel() for b in steps_batches[0]) * steps
    wall = sum(r["wall_ms"] for r in timed)
    row = {
        "label": setup.label, "optimizer": setup.optimizer, "patch": setup.patch, "liger": setup.liger,
        "tokens_per_s": tokens / (wall / 1e3), "step_ms": wall / steps,
        "host_ms": sum(r["host_ms"] for r in timed) / steps,
        "device_ms": sum(r["device_ms"] for r in timed) / steps if device.type == "cuda" else None,
        "peak_gib": peak, "allocated_before_gib": left, "losses": [r["loss"] for r in records] + [profiled_loss],
        "steps": records, "profile": profile,
    }
    return row  # the model and optimizer go with this frame; the next setup collects them first


# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------


def loss_check(rows: dict, dtype: torch.dtype) -> dict:
    """Every setup's losses against ``hf``'s, step by step: the largest relative difference.

    Args:
        rows: the setups' rows (with ``losses``), ``hf`` among them.
        dtype: the model's dtype, which sets the bound (``RELATIVE_ERROR_TOL``).

    Returns:
        ``{"tolerance", "steps", "max_rel_diff": {setup: x}, "ok"}``; empty without an ``hf`` row.
    """
    reference = rows.get("hf", {}).get("losses")
    if not reference:
        return {}
    tol = RELATIVE_ERROR_TOL[dtype]
    diffs = {}
    for name, row in rows.items():
        if name == "hf" or "losses" not in row:
            continue
        n = min(len(reference), len(row["losses"]))
        diffs[name] = max(abs(a - b) / abs(b) for a, b in zip(row["losses"][:n], reference[:n]))
    return {"tolerance": tol, "steps": len(reference), "max_rel_diff": diffs,
            "ok": all(d <= tol for d in diffs.values())}


def ceilings_here() -> dict | None:
    """The ceilings of this GPU, measured now.

    Returns:
        ``kernels.bench.timing.measure_ceilings``'s dict (copy GB/s, bf16 matmul TFLOP/s), or None
        in the interpreter.
    """
    if runtime.MODE != "gpu":
        return None
    return measure_ceilings()


def run(preset: str, batch: int, seq: int, grad_accum: int, warmup: int, steps: int,
        setups=SETUPS, compile: bool = False, lr: float = LR, seed: int = 0, log=print) -> dict:
    """Measure the ceilings, then every setup of ``setups`` that can run here, in ``SETUPS``'
    order.

    Args:
        preset: the model's preset.
        batch: rows per micro-batch.
        seq: tokens per row.
        grad_accum: micro-batches per optimizer step.
        warmup: untimed steps per setup.
        steps: timed steps per setup.
        setups: names from ``SETUPS``.
        compile: ``torch.compile`` every model.
        lr: AdamW's learning rate.
        seed: the weights' and batches' seed.
        log: where progress lines go.

    Returns:
        The results dict (see the module docstring).

    Raises:
        ValueError: a count that is not a positive int (``warmup``: not ≥ 0), an unknown setup or
            preset; before any work.
    """
    _check_run_args(batch=batch, seq=seq, grad_accum=grad_accum, steps=steps, warmup=warmup, setups=setups)
    config = llama_config(preset)
    log(runtime.describe())
    device = runtime.device()
    dtype = torch.bfloat16 if runtime.MODE == "gpu" else torch.float32
    ceilings = ceilings_here()  # first: its buffers are gone before any model is built
    flop = step_flop(config, batch, seq)
    limit = limit_tokens_per_s(config, batch, seq, ceilings["matmul_tflops"]) if ceilings else None
    count = (warmup + steps + 1) * grad_accum
    micro = make_batches(config.vocab_size, batch, seq, count, device, seed)
    steps_batches = [micro[i:i + grad_accum] for i in range(0, count, grad_accum)]
    rows, skipped = {}, {}
    for setup in SETUP_TABLE:
        if setup.name not in setups:
            continue
        reason = why_not(setup)
        if reason is not None:
            skipped[setup.name] = reason
            log(f"  {setup.label}: skipped ({reason})")
            continue
        log(f"  {setup.label} …", flush=True)
        try:
            rows[setup.name] = run_setup(setup, preset, dtype, steps_batches, warmup, steps, lr, compile,
                                         seed)
        except torch.OutOfMemoryError as err:
            rows[setup.name] = {"label": setup.label, "error": f"out of memory: {first_line(err)}"}
        except Exception as err:  # noqa: BLE001  (one setup's failure is its row; the others still run)
            rows[setup.name] = {"label": setup.label, "error": f"{type(err).__name__}: {first_line(err)}"}
            log(f"    failed: {rows[setup.name]['error']}")
        if limit and "tokens_per_s" in rows[setup.name]:
            rows[setup.name]["fraction_of_limit"] = rows[setup.name]["tokens_per_s"] / limit
    settings = dict(preset=preset, batch=batch, seq=seq, grad_accum=grad_accum, warmup=warmup, steps=steps,
                    compile=compile, lr=lr, seed=seed, dtype=str(dtype).replace("torch.", ""),
                    setups=list(setups))
    return {"group": GROUP, "device": runtime.device_name(), "device_slug": device_slug(), "mode": runtime.MODE,
            "versions": _versions(), "settings": settings, "ceilings": ceilings,
            "projection_parameters": projection_parameters(config), "flop": flop,
            "limit_tokens_per_s": limit, "rows": rows, "skipped": skipped,
            "loss_check": loss_check(rows, dtype)}


def _check_run_args(*, warmup, setups, **counts) -> None:
    for name, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    unknown = [s for s in setups if s not in SETUPS] if not isinstance(setups, str) else [setups]
    if unknown or not setups:
        raise ValueError(f"setups must be names from {SETUPS}, got {setups!r}")


def _versions() -> dict:
    found = runtime.versions()
    if importlib.util.find_spec("liger_kernel") is not None:
        from importlib.metadata import version

        found["liger_kernel"] = version("liger-kernel")
    return found


# --------------------------------------------------------------------------------------------------
# Reading: the table, the file, the plot
# --------------------------------------------------------------------------------------------------


def format_table(result: dict):
    """The run as a table, one row per setup.

    Args:
        result: a results dict (``run`` or ``load_step_results``).

    Returns:
        A ``kernels.bench.tables.Table``: ``print`` it, or display it in a notebook.
    """
    s = result["settings"]
    timed = result.get("mode") == "gpu"
    limit = result.get("limit_tokens_per_s")
    hf = result["rows"].get("hf", {}).get("tokens_per_s") if timed else None
    check = result.get("loss_check", {}).get("max_rel_diff", {})
    rows = []
    for name in SETUPS:
        row = result["rows"].get(name)
        if row is None:
            continue
        if "error" in row:
            rows.append((name, row["error"], None, None, None, None, None, None, None, None))
            continue
        profile = row["profile"]
        split = " / ".join(f"{profile['kernel_ms'][c]:.0f}" for c in CATEGORIES)
        rows.append((
            name, f"{row['tokens_per_s']:,.0f}",
            f"{row['tokens_per_s'] / hf:.3f}×" if hf else None,
            f"{row['fraction_of_limit']:.1%}" if timed and row.get("fraction_of_limit") else None,
            f"{row['host_ms']:.0f}", f"{row['device_ms']:.0f}" if row.get("device_ms") is not None else None,
            split, f"{profile['sum_ms'] - profile['busy_ms']:.1f}",
            f"{row['peak_gib']:.1f}" if row.get("peak_gib") is not None else None,
            f"{check[name]:.1e}" if name in check else None,
        ))
    columns = ("setup", "tokens/s", "vs hf", "of limit", "host ms", "device ms",
               "GEMM / optim / attn / rest ms", "overlap ms", "peak GiB", "loss vs hf")
    caption = (f"Full fine-tuning step, {s['preset']}, batch {s['batch']} × {s['seq']}, gradient accumulation "
               f"{s['grad_accum']}{', compiled' if s['compile'] else ''} on {result['device']}")
    notes = []
    if limit:
        notes.append(f"limit: {result['flop']['per_token'] / 1e9:.2f} GFLOP per token at "
                     f"{result['ceilings']['matmul_tflops']:,.0f} TFLOP/s (measured now) = {limit:,.0f} tokens/s")
    notes += [f"{name}: {result['rows'][name]['label']}" for name in SETUPS if name in result["rows"]]
    notes += ["host ms: until the step's last call returns; device ms: CUDA events around the step",
              "the split: summed kernel time of one profiled step (overlapping kernels count in full); "
              "overlap ms: that sum less the time any kernel ran"]
    if result.get("loss_check"):
        notes.append(f"loss vs hf: largest relative difference over {result['loss_check']['steps']} steps "
                     f"(bound {result['loss_check']['tolerance']:g})")
    for name, reason in result.get("skipped", {}).items():
        notes.append(f"{name} skipped: {reason}")
    if not timed:
        notes.append("Triton's CPU interpreter: times mean nothing (no ratio, no limit)")
    return html_table(columns, rows, caption=caption, notes=notes)


def load_step_results(path) -> dict:
    """A step benchmark's results file (``assets/results/step/<name>.json``).

    Args:
        path: the JSON file's path, or a name in ``assets/results/step/`` (without ``.json``).

    Returns:
        The results dict, as ``run`` returned it.
    """
    path = Path(path)
    if not path.suffix and not path.exists():
        path = results_file(GROUP, str(path))
    result = json.loads(path.read_text())
    if result.get("group") != GROUP:
        raise ValueError(f"{path} is not a step benchmark's results file (group {result.get('group')!r})")
    return result


def plot_step_breakdown(result: dict, ax=None):
    """One stacked bar per setup: its profiled step's GEMM, optimizer, attention and other kernel
    time, in milliseconds per 1,000 tokens, with the step's measured time (a dot) and the limit
    (a line: the matmul FLOP at the measured rate).

    Args:
        result: a results dict (``run`` or ``load_step_results``).
        ax: a matplotlib Axes to draw on (default: a new figure's).

    Returns:
        The Axes.
    """
    import matplotlib.pyplot as plt

    names = [n for n in SETUPS if "profile" in result["rows"].get(n, {})]
    if ax is None:
        _, ax = plt.subplots(figsize=(1.6 * len(names) + 3, 4))
    s = result["settings"]
    per_k = 1e3 / (s["batch"] * s["seq"] * s["grad_accum"])  # ms per step → ms per 1,000 tokens
    colors = {"gemm": "#4c72b0", "optimizer": "#937860", "attention": "#55a868", "rest": "#b0b0b0"}
    bottoms = [0.0] * len(names)
    for category in CATEGORIES:
        heights = [result["rows"][n]["profile"]["kernel_ms"][category] * per_k for n in names]
        ax.bar(range(len(names)), heights, bottom=bottoms, color=colors[category],
               label=CATEGORY_TITLES[category])
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.scatter(range(len(names)), [result["rows"][n]["step_ms"] * per_k for n in names], color="black",
               zorder=3, label="step (wall clock)")
    if result.get("limit_tokens_per_s"):
        ax.axhline(1e6 / result["limit_tokens_per_s"], color="crimson", linestyle="--",
                   label="matmul-bound limit")
    ax.set_xticks(range(len(names)), [SHORT_LABELS[n] for n in names], fontsize=8)
    ax.set_ylabel("ms per 1,000 tokens")
    ax.set_title(f"Where a step's time goes: {s['preset']}, {result['device']}")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    return ax


# --------------------------------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------------------------------


def default_name(preset: str, batch: int, seq: int, grad_accum: int, compile: bool) -> str:
    """The results file's name when ``--name`` does not give one.

    Args:
        preset: the model's preset.
        batch: rows per micro-batch.
        seq: tokens per row.
        grad_accum: micro-batches per optimizer step.
        compile: the models were compiled.

    Returns:
        ``<preset>_b<batch>_s<seq>_ga<grad_accum>[_compile]``.
    """
    return f"{preset}_b{batch}_s{seq}_ga{grad_accum}{'_compile' if compile else ''}"


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser.

    Returns:
        The ``argparse.ArgumentParser`` of ``python -m kernels.bench.step``.
    """
    parser = argparse.ArgumentParser(prog="python -m kernels.bench.step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default=None, choices=tuple(PRESETS),
                        help="llama-3.1-8b (GPU default), llama-3.2-1b, tiny (CPU default)")
    parser.add_argument("--batch", type=cli.positive_int, default=1, help="rows per micro-batch (default 1)")
    parser.add_argument("--seq", type=cli.positive_int, default=None, help="tokens per row (default 2048; CPU 32)")
    parser.add_argument("--grad-accum", type=cli.positive_int, default=1,
                        help="micro-batches per optimizer step (default 1)")
    parser.add_argument("--warmup", type=cli.non_negative_int, default=None,
                        help="untimed steps first (default 2; CPU 0)")
    parser.add_argument("--steps", type=cli.positive_int, default=None, help="timed steps per setup (default 5; CPU 2)")
    parser.add_argument("--setups", type=cli.names(SETUPS), default=SETUPS,
                        help=f"comma-separated subset of {','.join(SETUPS)} (run in that order)")
    parser.add_argument("--compile", action="store_true", help="torch.compile each setup's model")
    parser.add_argument("--lr", type=cli.positive_float, default=LR, help=f"AdamW's learning rate (default {LR:g})")
    parser.add_argument("--name", type=cli.file_name, default=None,
                        help="results file name (default <preset>_b<batch>_s<seq>_ga<N>[_compile])")
    cli.add_output_arguments(parser, f"{GROUP}/<name>.json")
    return parser


def main(argv=None) -> int:
    """The command line (``python -m kernels.bench.step --help``).

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    preset = args.preset or runtime.pick("tiny", "llama-3.1-8b")
    seq = args.seq or runtime.pick(32, 2048)
    warmup = args.warmup if args.warmup is not None else runtime.pick(0, 2)
    steps = args.steps or runtime.pick(2, 5)
    name = args.name or default_name(preset, args.batch, seq, args.grad_accum, args.compile)
    path = results_file(GROUP, name, cli.output_root(args))
    problems = []
    if preset != "tiny":
        problems += cli.gpu_problems(f"--preset {preset}", "a full-size model's step in the interpreter "
                                     "would take hours; use --preset tiny")
    cli.check_outputs(parser, args, [path], problems)
    result = run(preset, args.batch, seq, args.grad_accum, warmup, steps, args.setups, args.compile, args.lr)
    print(format_table(result))
    print("saved", cli.write_json(path, result))
    failed = [name for name, row in result["rows"].items() if "error" in row]
    if failed:
        print(f"failed: {', '.join(failed)} (their errors are in the table and the file)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
