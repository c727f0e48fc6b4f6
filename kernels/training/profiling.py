"""Profile one fine-tuning step: where the time goes, by operator family, and where the memory goes.

``profile_training_step`` warms the step up, times a few plain steps, then records one full step
(forward, backward, ``optimizer.step()``, ``zero_grad``) with ``torch.profiler``, exports the trace
for Perfetto, and sorts every microsecond into one of the families in ``FAMILIES``.

What is timed
    On a GPU: the duration of every kernel (and memory copy) the step ran on the device. On the CPU:
    each operator's *self* time (its own time, not its children's), so nothing is counted twice.

How time is sorted into families
    1. *Regions.* While profiling, each RMSNorm module's forward and Hugging Face's loss function
       run inside ``torch.profiler.record_function`` ranges (``region::rmsnorm``, ``region::loss``),
       and the optimizer's step and zero_grad inside ``region::optimizer`` (PyTorch's own
       ``Optimizer.step#...`` ranges count too). Every operator that runs inside a range, and every
       kernel such an operator launches (the profiler links each kernel to the operator that
       launched it), belongs to that range's family. Forward attribution is exact.
    2. *Backward through autograd sequence numbers.* Each operator recorded in the forward pass
       carries the sequence number of the autograd node it created; the backward pass runs that node
       under ``autograd::engine::evaluate_function: <Node>`` with the same sequence number. The
       backward of everything that ran inside a region is attributed to that region, so RMSNorm's
       and the loss's backward are exact too (where a profiler records no sequence numbers, step 3
       takes over).
    3. *Names.* Everything else is classified by ``classify(name)``, a pure function of the operator
       or kernel name: ``aten::mm`` or ``nvjet_…``/``sm90_xmma_gemm…`` are matmuls,
       ``flash_fwd…``/``fmha_cutlass…`` attention, ``vectorized_elementwise_kernel<…>`` elementwise,
       ``multi_tensor_apply_kernel`` the optimizer, and so on. A kernel name alone cannot always
       tell: an ``aten::mul`` kernel may belong to RMSNorm, RoPE or SwiGLU, which is why step 1 and
       2 come first. By name, ``pow``, ``mean`` and ``rsqrt`` count as RMSNorm (in a Llama only
       RMSNorm uses them) and softmax kernels as the loss (attention's softmax is fused inside
       sdpa's kernels).

Memory
    On a GPU, one extra step is measured with ``torch.cuda`` allocator statistics between its
    phases: weights, gradients and optimizer states are summed from the tensors themselves,
    activations are what the forward pass left allocated (less the loss's fp32 log-softmax), and the
    peak is ``torch.cuda.max_memory_allocated``. On the CPU the allocator keeps no such statistics;
    the result carries ``full_finetune_memory``'s computed estimate.

The trace (``assets/traces/*.json``) opens in https://ui.perfetto.dev (drag the file in) or
chrome://tracing.
"""

from __future__ import annotations

import math
import os
import re
import statistics
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from kernels import runtime
from kernels.bench.results import ASSETS
from kernels.memory import hf_loss_buffers

from .models import HIGH_POINTS, GiB, MemoryBudget, full_finetune_memory

TRACES = ASSETS / "traces"
REPOSITORY = ASSETS.parent

# A notice some PyTorch versions give on a profile's start, about events of earlier profiling
# cycles; a profile of one step has one cycle, so there is nothing to act on.
PROFILER_NOTICE = r".*Profiler clears events at the end of each cycle"
FAMILIES = ("matmul", "attention", "rmsnorm", "cross_entropy", "elementwise", "optimizer", "other")
FAMILY_TITLES = {
    "matmul": "matmul (linear layers, lm_head)",
    "attention": "attention (sdpa kernels)",
    "rmsnorm": "RMSNorm (pow, mean, rsqrt, mul, casts)",
    "cross_entropy": "loss (fp32 copy, log-softmax, nll)",
    "elementwise": "elementwise (adds, SiLU, RoPE, casts, copies)",
    "optimizer": "optimizer (AdamW, zero_grad)",
    "other": "other (embedding, views, allocation, overhead)",
}
REGIONS = {"region::rmsnorm": "rmsnorm", "region::loss": "cross_entropy", "region::optimizer": "optimizer"}
TRACE_NOTE = (
    "Open the trace in https://ui.perfetto.dev (drag the .json file in; keys W/S zoom, A/D pan) or in Chrome at "
    "chrome://tracing. Each row is a thread or a GPU stream; click a kernel to see the operator that launched it."
)

# --------------------------------------------------------------------------------------------------
# Names -> families
# --------------------------------------------------------------------------------------------------

# Checked in this order: the first family with a matching pattern wins.
_RULES: tuple[tuple[str, re.Pattern], ...] = tuple(
    (family, re.compile(pattern))
    for family, pattern in (
        # Optimizer: PyTorch's ranges, foreach/fused kernels (multi_tensor_apply), our own range.
        ("optimizer", r"^Optimizer\.|region::optimizer|multi_tensor_apply|_foreach_|(?i:fused_?adam)"),
        # Loss: cross-entropy, nll, log-softmax (CPU ops, autograd nodes, cunn_SoftMax* and
        # softmax_warp* kernels).
        ("cross_entropy", r"region::loss|(?i:cross_?entropy|nll_?loss|log_?softmax|softmax)"),
        # Attention: sdpa and its flash / memory-efficient / cuDNN kernels.
        ("attention", r"(?i:flash|fmha|attention|sdpa|_scaled_dot_product)"),
        # RMSNorm: its own kernels and the pieces only RMSNorm uses in a Llama (pow, mean, rsqrt).
        # PyTorch's fused F.rms_norm reuses its layer-norm kernels on the GPU.
        ("rmsnorm",
         r"(?i:rms_?norm|layer_?norm|rsqrt)|(?i:\bpow\b|pow_|powbackward)|aten::mean\b|MeanOps|MeanBackward"),
        # Matmul: aten ops and autograd nodes, cuBLAS/cuBLASLt/CUTLASS kernel families (gemm, gemv,
        # nvjet, xmma).
        (
            "matmul",
            r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_addmm_activation|mkldnn_\w+)$|(Mm|Addmm|Bmm)Backward"
            r"|(?i:gemm|gemv|nvjet|xmma|s16816|cutlass|cublas|splitkreduce)",
        ),
        # Elementwise and simple reductions: pointwise math, casts, copies, fills, sums.
        (
            "elementwise",
            r"(?i:elementwise|CatArrayBatchedCopy|reduce_kernel|memcpy|memset|copy_kernel|fill_kernel)"
            r"|^aten::(add|add_|sub|rsub|mul|mul_|div|div_|neg|silu|silu_backward|sigmoid|exp|tanh|cat|clone|copy_"
            r"|_to_copy|fill_|zero_|zeros_like|sum|where|masked_fill_?|clamp|maximum|minimum|lerp_?)$"
            r"|(Add|Sub|Mul|Div|Neg|Silu|Cat|ToCopy|Clone|Sum|Where|Slice|Sigmoid)Backward",
        ),
    )
)


def classify(name: str) -> str:
    """The family of an operator, autograd node or kernel, from its name alone (one of ``FAMILIES``).

    Chapter 01 sorts a step's operators with it.

    Args:
        name: the operator's, node's or kernel's name.

    Returns:
        the family, ``"other"`` when no rule matches.

    Raises:
        TypeError: when ``name`` is not a str.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    for family, pattern in _RULES:
        if pattern.search(name):
            return family
    return "other"


def short_name(name: str, width: int = 90) -> str:
    """A kernel's demangled name without ``void``, its argument list and template noise, cut to ``width``.

    Args:
        name: the kernel's name.
        width: the most characters kept (the last one an ellipsis when cut).

    Returns:
        the short name.
    """
    name = re.sub(r"^void\s+", "", name)
    if name.endswith(")") and "(" in name and not name.startswith("autograd"):
        depth = 0  # drop the trailing argument list "(...)" but keep template arguments
        for i in range(len(name) - 1, -1, -1):
            depth += name[i] == ")"
            depth -= name[i] == "("
            if depth == 0:
                name = name[:i] if i > 0 else name
                break
    return name if len(name) <= width else name[: width - 1] + "…"


# --------------------------------------------------------------------------------------------------
# Labelling regions while profiling
# --------------------------------------------------------------------------------------------------


def is_rmsnorm(module: torch.nn.Module) -> bool:
    """RMSNorm modules are recognised by class name (LlamaRMSNorm, TritonRMSNorm, LigerRMSNorm, ...).

    Args:
        module: any module.

    Returns:
        whether its class name ends in ``RMSNorm``.
    """
    return type(module).__name__.endswith("RMSNorm")


def _wrap_forward(module: torch.nn.Module, label: str) -> Callable[[], None]:
    original = module.__dict__.get("forward")
    bound = module.forward

    def forward(*args, **kwargs):
        with record_function(label):
            return bound(*args, **kwargs)

    module.forward = forward

    def restore():
        if original is None:
            del module.forward
        else:
            module.forward = original

    return restore


def _loss_owner(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module whose forward calls ``self.loss_function``: the model itself, or the Hugging Face
    model inside a wrapper (a PEFT ``PeftModel`` hands attribute reads to it, but an attribute set
    on the wrapper stays there, where the forward that computes the loss never looks). None where no
    module has the property."""
    for module in model.modules():
        if isinstance(getattr(type(module), "loss_function", None), property):
            return module
    return None


def _wrap_loss_function(model: torch.nn.Module) -> Callable[[], None] | None:
    """Put Hugging Face's ``loss_function`` (of ``model`` or the model it wraps) inside
    ``region::loss``; None where there is none."""
    model = _loss_owner(model)
    inner = getattr(model, "loss_function", None)
    if inner is None or not callable(inner):
        return None
    had_own = "_loss_function" in model.__dict__
    previous = model.__dict__.get("_loss_function")

    def loss_function(*args, **kwargs):
        with record_function("region::loss"):
            return inner(*args, **kwargs)

    try:
        model.loss_function = loss_function
    except AttributeError:  # a transformers version without the setter: the loss is then classified by name
        return None

    def restore():
        if had_own:
            model._loss_function = previous
        else:
            delattr(model, "_loss_function")

    return restore


@contextmanager
def labelled_regions(model: torch.nn.Module):
    """While inside, every RMSNorm forward runs in ``region::rmsnorm`` and the HF loss in
    ``region::loss``.

    A context manager; leaving it puts every wrapped forward and the loss function back.

    Args:
        model: the model whose norms and loss are labelled.
    """
    restores = [_wrap_forward(m, "region::rmsnorm") for m in model.modules() if is_rmsnorm(m)]
    loss_restore = _wrap_loss_function(model)
    if loss_restore is not None:
        restores.append(loss_restore)
    try:
        yield
    finally:
        for restore in reversed(restores):
            restore()


# --------------------------------------------------------------------------------------------------
# The training step
# --------------------------------------------------------------------------------------------------


def hf_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Forward pass and loss as Hugging Face computes them (labels passed in). The output object,
    and with it the bf16 logits, is dropped as soon as the loss is out, as in any training loop that
    keeps only the loss.

    Args:
        model: a Hugging Face causal LM.
        batch: its inputs, labels included, on the model's device.

    Returns:
        the loss.
    """
    return model(**batch).loss


def training_step(model, batch, optimizer, compute_loss=hf_loss) -> torch.Tensor:
    """One full step: forward + loss, backward, ``optimizer.step()``,
    ``optimizer.zero_grad(set_to_none=True)``.

    Args:
        model: the model.
        batch: its inputs, on the model's device.
        optimizer: the optimizer over the model's parameters.
        compute_loss: ``compute_loss(model, batch)`` returns the loss.

    Returns:
        the loss, detached.
    """
    loss = compute_loss(model, batch)
    loss.backward()
    with record_function("region::optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss.detach()



def _unique_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _optimizer_tensors(optimizer):
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                yield value


def _loss_shapes(model, batch) -> tuple[int, int, torch.dtype]:
    tokens = batch["input_ids"].numel()
    vocab = model.config.vocab_size
    dtype = next(model.parameters()).dtype
    return tokens, vocab, dtype


def measure_step_memory(model, batch, optimizer, compute_loss=hf_loss) -> MemoryBudget:
    """Run one step on a GPU with allocator statistics taken between its phases (see the module
    docstring).

    Args:
        model: the model, on a CUDA device.
        batch: its inputs, on that device.
        optimizer: the optimizer over the model's parameters.
        compute_loss: ``compute_loss(model, batch)`` returns the loss.

    Returns:
        the ``MemoryBudget``, its parts measured where the allocator can tell them apart.

    Raises:
        RuntimeError: when the model is not on a CUDA device.
    """
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise RuntimeError("measure_step_memory needs a model on a CUDA device; on the CPU use full_finetune_memory")
    runtime.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    loss = compute_loss(model, batch)
    runtime.synchronize(device)
    after_forward = torch.cuda.memory_allocated(device)
    peak_forward = torch.cuda.max_memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    loss.backward()
    runtime.synchronize(device)
    after_backward = torch.cuda.memory_allocated(device)
    peak_backward = torch.cuda.max_memory_allocated(device)
    gradients = _unique_bytes(p.grad for p in model.parameters())
    torch.cuda.reset_peak_memory_stats(device)
    optimizer.step()
    runtime.synchronize(device)
    peak_step = torch.cuda.max_memory_allocated(device)
    optimizer.zero_grad(set_to_none=True)
    del loss

    tokens, vocab, dtype = _loss_shapes(model, batch)
    loss_buffers = hf_loss_buffers(tokens, vocab, dtype)
    weights = _unique_bytes(model.parameters())
    states = _unique_bytes(_optimizer_tensors(optimizer))
    return MemoryBudget(
        weights=weights,
        gradients=gradients,
        optimizer_states=states,
        optimizer_temporaries=max(0, peak_step - after_backward),
        activations=max(0, after_forward - base - loss_buffers["log_softmax_fp32"]),
        **loss_buffers,
        measured=True,
        measured_peak=max(peak_forward, peak_backward, peak_step),
        phase_peaks={"forward": peak_forward, "backward": peak_backward, "optimizer step": peak_step},
        notes={
            "weights": "measured: the parameters' storage",
            "gradients": "measured: the gradients' storage after backward",
            "optimizer_states": "measured: the tensors in optimizer.state",
            "optimizer_temporaries": "measured: peak during optimizer.step() above what was allocated before it",
            "activations": "measured: allocated after forward, less the weights, states and fp32 log-softmax",
            "logits": f"computed: [{tokens:,}, {vocab:,}] in {dtype}",
            "logits_fp32": "computed: the fp32 copy in Hugging Face's loss",
            "log_softmax_fp32": "computed: kept by F.cross_entropy for backward",
            "logit_grads_fp32": "computed: the fp32 gradients in the loss's backward",
        },
    )


# --------------------------------------------------------------------------------------------------
# Attribution of profiler events
# --------------------------------------------------------------------------------------------------


@dataclass
class Row:
    """One line of a table: an operator, kernel or family, its number of calls, its time and share
    of the total."""

    name: str
    family: str
    calls: int
    time_ms: float
    share: float


@dataclass
class _Tally:
    calls: int = 0
    us: float = 0.0


def _is_cpu_op(event) -> bool:
    from torch.autograd import DeviceType

    return event.device_type == DeviceType.CPU and not event.is_async


# Bookkeeping records of the profiler itself (CUPTI), not operators. When many launches are queued,
# "Command Buffer Full" records appear and carry the durations of other operators' kernels: counting
# them would count those twice.
PROFILER_OVERHEAD = frozenset({"Command Buffer Full", "Activity Buffer Request"})


def _is_backward_node(name: str) -> bool:
    return name.startswith("autograd::engine::evaluate_function")


def _region_keys(roots) -> dict[tuple[int, int], str]:
    """(forward thread, sequence number) -> family, for every forward operator that ran inside a region."""
    keys: dict[tuple[int, int], str] = {}

    def visit(event, family):
        family = REGIONS.get(event.name, family)
        if family is not None and event.sequence_nr >= 0:
            keys[(event.thread, event.sequence_nr)] = family
        for child in event.cpu_children:
            visit(child, family)

    for root in roots:
        if not _is_backward_node(root.name):
            visit(root, None)
    return keys


def attribute_events(events, use_device: bool):
    """Sort profiler events into families, operators, kernels and phases (see the module docstring).

    Returns ``(families, ops, kernels, phases, total_us)``: tallies keyed by family, by (operator,
    family), by (kernel, family) and by phase ("forward", "backward", "optimizer"), and the total
    time they share.

    Args:
        events: the profiler's events (``prof.events()``).
        use_device: charge GPU kernel time to the operators that launched it (False: CPU self time).
    """
    cpu_ops = [e for e in events if _is_cpu_op(e)]
    roots = [e for e in cpu_ops if e.cpu_parent is None]
    keys = _region_keys(roots)
    families: dict[str, _Tally] = defaultdict(_Tally)
    ops: dict[tuple[str, str], _Tally] = defaultdict(_Tally)
    kernels: dict[tuple[str, str], _Tally] = defaultdict(_Tally)
    phases: dict[str, float] = defaultdict(float)

    def add(name, family, phase, us, family_calls, kernel_name=None):
        families[family].us += us
        families[family].calls += family_calls
        ops[(name, family)].us += us
        phases[phase] += us
        if kernel_name is not None:
            kernels[(kernel_name, family)].us += us
            kernels[(kernel_name, family)].calls += 1

    # Depth-first over every thread's tree of operators, carrying the region and the phase down to
    # the leaves.
    stack = [(root, None, "forward", False) for root in roots]
    while stack:
        event, inherited, phase, parent_is_op = stack.pop()
        name = event.name
        if name in PROFILER_OVERHEAD:
            continue
        if name in REGIONS:
            inherited = REGIONS[name]
        if name.startswith("Optimizer."):
            inherited = "optimizer"
        if inherited == "optimizer":
            phase = "optimizer"
        if _is_backward_node(name):
            phase = "backward"
            inherited = keys.get((event.fwd_thread, event.sequence_nr), inherited)
        is_op = name.startswith("aten::")
        if use_device:
            # Device time: each kernel is charged to the operator that launched it; calls count
            # kernel launches.
            for kernel in event.kernels:
                family = inherited or classify(kernel.name)
                if family == "other":
                    family = classify(name)
                add(name, family, phase, kernel.duration, 1, kernel_name=kernel.name)
            if event.kernels:
                ops[(name, family)].calls += 1
        else:
            # CPU self time; calls count outermost aten operators (aten::linear, not also the
            # aten::mm inside it).
            family = inherited or classify(name)
            add(name, family, phase, event.self_cpu_time_total, int(is_op and not parent_is_op))
            ops[(name, family)].calls += 1
        stack.extend((child, inherited, phase, is_op) for child in event.cpu_children)

    attributed = sum(t.us for t in families.values())
    total = attributed
    if use_device:
        # Device work the profiler could not link to an operator (rare): counted, as "other", so
        # shares stay honest. Device-side records of ranges (record_function, the optimizer's step)
        # share their names with the CPU ranges and span kernels already counted: only kernels,
        # copies and fills are device work.
        range_names = {e.name for e in cpu_ops} | PROFILER_OVERHEAD
        device_total = sum(
            e.time_range.end - e.time_range.start
            for e in events
            if not _is_cpu_op(e) and not e.is_async and e.name not in range_names
        )
        if device_total > attributed:
            families["other"].us += device_total - attributed
            ops[("(device work not linked to an operator)", "other")].us += device_total - attributed
            total = device_total
    return families, ops, kernels, phases, total


def _rows(tallies: dict, total_us: float, n: int | None) -> list[Row]:
    rows = [
        Row(name=key[0], family=key[1], calls=t.calls, time_ms=t.us / 1e3,
            share=t.us / total_us if total_us else 0.0)
        for key, t in tallies.items()
        if t.us > 0
    ]
    rows.sort(key=lambda r: r.time_ms, reverse=True)
    return rows if n is None else rows[:n]


# --------------------------------------------------------------------------------------------------
# The result and the entry point
# --------------------------------------------------------------------------------------------------


@dataclass
class StepProfile:
    """What ``profile_training_step`` found. Times in milliseconds; ``time_kind`` says which time
    they are."""

    device: str
    time_kind: str
    step_ms: float
    profiled_step_ms: float
    tokens: int
    families: dict[str, Row]
    phases: dict[str, float]
    top_ops: list[Row]
    top_kernels: list[Row]
    memory: MemoryBudget
    trace_path: Path | None
    total_ms: float

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second of the timed (plain) steps."""
        return self.tokens / (self.step_ms / 1e3)

    @property
    def trace_note(self) -> str:
        """Where the Chrome trace was written and how to open it, or that none was."""
        return f"Trace: {display_path(self.trace_path)}\n{TRACE_NOTE}" if self.trace_path else "No trace was exported."

    def share(self, *families: str) -> float:
        """The summed share of the step's profiled time of ``families`` (a family not seen counts 0).

        Args:
            *families: names from ``FAMILIES``.

        Returns:
            the share, a fraction.
        """
        return sum(self.families[f].share for f in families if f in self.families)

    def family_table(self) -> str:
        """One line per family seen: calls, milliseconds and share, then the total (chapter 01 prints it).

        Returns:
            the table, lines joined by newlines.
        """
        lines = [f"{'family':<48}{'calls':>8}{'ms':>11}{'share':>8}"]
        for name in FAMILIES:
            row = self.families.get(name)
            if row is not None:
                lines.append(f"{FAMILY_TITLES[name]:<48}{row.calls:>8}{row.time_ms:>11.3f}{row.share:>8.1%}")
        lines.append(f"{'total (' + self.time_kind + ')':<48}{'':>8}{self.total_ms:>11.3f}{1:>8.0%}")
        return "\n".join(lines)

    def top_table(self, n: int = 15, kernels: bool = False) -> str:
        """The costliest operators (or kernels), one line each, with family, calls, milliseconds and share.

        Args:
            n: how many lines.
            kernels: list GPU kernels instead of operators (empty on the CPU).

        Returns:
            the table, lines joined by newlines.
        """
        rows = self.top_kernels if kernels else self.top_ops
        head = "kernel" if kernels else "operator"
        lines = [f"{head:<70}{'family':<15}{'calls':>7}{'ms':>10}{'share':>8}"]
        for r in rows[:n]:
            lines.append(f"{short_name(r.name, 68):<70}{r.family:<15}{r.calls:>7}{r.time_ms:>10.3f}{r.share:>8.1%}")
        return "\n".join(lines)

    def summary(self) -> str:
        """The step in two sentences: time, tokens/s, the profiled step's phases, the peak memory.

        Returns:
            the text.
        """
        phase = ", ".join(f"{k} {v:.1f} ms" for k, v in self.phases.items())
        return (
            f"{self.device}: step {self.step_ms:.1f} ms for {self.tokens:,} tokens ({self.tokens_per_s:,.0f} tokens/s, "
            f"median of plain steps without the profiler). Profiled step: {self.total_ms:.1f} ms of {self.time_kind} "
            f"({phase}). Peak memory {self.memory.peak / GiB:.2f} GiB "
            f"({'measured' if self.memory.measured else 'computed estimate'})."
        )


def display_path(path: Path) -> str:
    """``path`` as a reader of the repository writes it: relative to the repository when it lies
    inside it.

    Args:
        path: any path.

    Returns:
        the path as text.
    """
    path = Path(path)
    try:
        return path.resolve().relative_to(REPOSITORY).as_posix()
    except ValueError:
        return str(path)


@contextmanager
def quiet_profiler():
    """Keep a ``torch.profiler.profile`` opened inside this block to what a reader can act on.

    Python side: the notice about earlier profiling cycles (``PROFILER_NOTICE``) is filtered inside
    the block. C++ side: on machines without CUDA, some PyTorch builds print two lines per profile
    ("USDT: ... profiler_start") from Kineto, the profiler's tracing library, at its default log
    level. Kineto reads ``KINETO_LOG_LEVEL`` once, at the process's first profile, so where the user
    has not set it this sets it to 6, above every message, before that profile starts. Not on a GPU:
    there the same level would also hide CUPTI's errors (a missing permission to read the GPU's
    counters, say), which a reader can act on.
    """
    if not torch.cuda.is_available():
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=PROFILER_NOTICE)
        yield


def _default_trace_path(model, batch, device: torch.device) -> Path:
    cfg = model.config
    rows, seq = batch["input_ids"].shape
    where = "gpu" if device.type == "cuda" else "cpu"
    return TRACES / f"step_{where}_{cfg.num_hidden_layers}L_h{cfg.hidden_size}_b{rows}_s{seq}.json"


def _check_batch(batch) -> None:
    if not isinstance(batch, dict) or "input_ids" not in batch:
        raise TypeError("batch must be a dict with input_ids (and labels, attention_mask), as make_sft_batches gives")
    if "labels" not in batch:
        raise ValueError("batch has no labels: the step needs a loss (make_sft_batches provides labels)")


def profile_training_step(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    warmup: int = 2,
    timed_steps: int = 3,
    trace_path: str | Path | None = "auto",
    compute_loss: Callable = hf_loss,
    label_regions: bool = True,
    top: int = 25,
    measure_memory: bool = True,
) -> StepProfile:
    """Warm up, time ``timed_steps`` plain steps, measure memory (GPU), then profile one full training step.

    ``warmup`` steps (at least 1) also create the optimizer's states, so the profiled step is a
    steady-state one. ``trace_path="auto"`` writes ``assets/traces/step_<device>_<shape>.json``;
    None exports nothing. ``compute_loss(model, batch)`` returns the loss (default: Hugging Face's,
    with the labels in the batch). Every step updates the weights, as training does.

    Chapter 01 profiles a Llama step with it; chapters 04, 08 and 15 profile again.

    Args:
        model: the model (its device decides GPU or CPU time).
        batch: inputs with ``input_ids`` and ``labels``, on any device (moved to the model's).
        optimizer: the optimizer over the model's parameters.
        warmup: untimed steps first (at least 1).
        timed_steps: plain steps timed (the median is kept).
        trace_path: where to export the Chrome trace, ``"auto"`` or None.
        compute_loss: ``compute_loss(model, batch)`` returns the loss.
        label_regions: label the norms and the loss (``labelled_regions``).
        top: how many operators and kernels to keep.
        measure_memory: measure the memory on a GPU (False: the computed estimate).

    Returns:
        the ``StepProfile``.

    Raises:
        TypeError: when ``batch`` is not a dict with ``input_ids`` or ``optimizer`` is not an
            optimizer.
        ValueError: when ``batch`` has no labels, ``warmup`` < 1 or ``timed_steps`` < 1.
    """
    _check_batch(batch)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not isinstance(warmup, int) or warmup < 1:
        raise ValueError(f"warmup must be an int >= 1 (it creates the optimizer's states), got {warmup!r}")
    if not isinstance(timed_steps, int) or timed_steps < 1:
        raise ValueError(f"timed_steps must be a positive int, got {timed_steps!r}")
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in batch.items() if k != "roles"}
    use_device = device.type == "cuda"

    def step():
        return training_step(model, batch, optimizer, compute_loss)

    for _ in range(warmup):
        step()
    runtime.synchronize(device)
    times = []
    for _ in range(timed_steps):
        start = time.perf_counter()
        step()
        runtime.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)

    tokens, vocab, dtype = _loss_shapes(model, batch)
    if use_device and measure_memory:
        memory = measure_step_memory(model, batch, optimizer, compute_loss)
    else:
        rows, seq = batch["input_ids"].shape
        memory = full_finetune_memory(model.config, rows, seq, dtype)
        if not use_device:
            memory.notes["activations"] += " (the CPU allocator keeps no statistics: nothing here is measured)"

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if use_device else [])
    labels = labelled_regions(model) if label_regions else nullcontext()
    with labels, quiet_profiler(), profile(activities=activities, record_shapes=False, with_stack=False,
                                           profile_memory=False) as prof:
        start = time.perf_counter()
        step()
        runtime.synchronize(device)
        profiled_ms = (time.perf_counter() - start) * 1e3

    if trace_path is not None:
        trace_path = _default_trace_path(model, batch, device) if trace_path == "auto" else Path(trace_path)
        trace_path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace_path))

    fams, ops, kernels, phases, total_us = attribute_events(prof.events(), use_device)
    family_rows = {f: Row(f, f, t.calls, t.us / 1e3, t.us / total_us if total_us else 0.0) for f,
                   t in fams.items()}
    device_name = torch.cuda.get_device_name(device) if use_device else "CPU"
    return StepProfile(
        device=device_name,
        time_kind="GPU kernel time" if use_device else "CPU self time",
        step_ms=statistics.median(times),
        profiled_step_ms=profiled_ms,
        tokens=tokens,
        families=family_rows,
        phases={k: phases[k] / 1e3 for k in ("forward", "backward", "optimizer") if k in phases},
        top_ops=_rows(ops, total_us, top),
        top_kernels=_rows(kernels, total_us, top) if use_device else [],
        memory=memory,
        trace_path=trace_path,
        total_ms=total_us / 1e3,
    )


# --------------------------------------------------------------------------------------------------
# Amdahl's law: what a step could gain
# --------------------------------------------------------------------------------------------------


@dataclass
class AmdahlEstimate:
    """The most a step can gain if ``targets`` cost nothing, and what the loss costs in memory."""

    targets: tuple[str, ...]
    shares: dict[str, float]
    share: float
    step_ms: float
    max_speedup: float
    best_step_ms: float
    loss_bytes: int
    peak_bytes: int

    def summary(self) -> str:
        """The bound in words: the targets' shares, the fastest step they allow, the loss's part of the peak.

        Returns:
            the text.
        """
        parts = " + ".join(f"{t} {self.shares[t]:.1%}" for t in self.targets)
        return (
            f"{parts} = {self.share:.1%} of the step's measured time. If they cost nothing, the step could be at "
            f"most {self.max_speedup:.2f}× faster ({self.step_ms:.1f} → {self.best_step_ms:.1f} ms): Amdahl's law, "
            f"1 / (1 - {self.share:.3f}). Memory: the loss's [tokens, vocab] buffers (bf16 logits, their fp32 copy, "
            f"the fp32 log-softmax, fp32 gradients) take up to {self.loss_bytes / GiB:.2f} GiB at once, "
            f"{self.loss_bytes / self.peak_bytes:.1%} of the step's peak of {self.peak_bytes / GiB:.2f} GiB."
        )


def step_speedup(share: float, factor: float = math.inf) -> float:
    """Amdahl's law: how many times faster a step runs when a part taking ``share`` of its time (a
    fraction) runs ``factor`` times faster. The rest, 1 − share, is unchanged and the part shrinks
    to share / factor; with the default ``factor=math.inf`` the part costs nothing and the bound is
    1 / (1 − share).

    Chapter 01 derives it.

    Args:
        share: the part's fraction of the step, in [0, 1).
        factor: how many times faster the part runs.

    Returns:
        the step's speedup.

    Raises:
        ValueError: when ``share`` is outside [0, 1) or ``factor`` is not positive.
    """
    if not 0 <= share < 1:
        raise ValueError(f"share must be a fraction of the step's time, 0 <= share < 1, got {share!r}")
    if not factor > 0:
        raise ValueError(f"factor must be positive, got {factor!r}")
    return 1.0 / ((1.0 - share) + share / factor)


def amdahl(profile: StepProfile, targets: tuple[str, ...] = ("rmsnorm", "cross_entropy")) -> AmdahlEstimate:
    """Amdahl's bound: with a share s of the time removed, a step runs at most 1 / (1 - s) times faster.

    s is the targets' share of the profiled time (GPU kernel time, or CPU self time). It is a bound:
    a kernel never costs nothing, and on a GPU idle gaps between kernels do not shrink with them.

    Chapters 01 and 08 apply it.

    Args:
        profile: the ``StepProfile``.
        targets: the families that would cost nothing.

    Returns:
        the ``AmdahlEstimate``.

    Raises:
        ValueError: when a target is not one of ``FAMILIES``.
    """
    unknown = [t for t in targets if t not in FAMILIES]
    if unknown:
        raise ValueError(f"targets must be families from {FAMILIES}, got {unknown}")
    shares = {t: profile.families[t].share if t in profile.families else 0.0 for t in targets}
    share = min(sum(shares.values()), 0.999999)
    return AmdahlEstimate(
        targets=tuple(targets),
        shares=shares,
        share=share,
        step_ms=profile.step_ms,
        max_speedup=step_speedup(share),
        best_step_ms=profile.step_ms * (1 - share),
        loss_bytes=profile.memory.loss_bytes,
        peak_bytes=profile.memory.peak,
    )


# --------------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------------

_COLORS = {
    "matmul": "#4c72b0", "attention": "#55a868", "rmsnorm": "#dd8452", "cross_entropy": "#c44e52",
    "elementwise": "#8172b3", "optimizer": "#937860", "other": "#b0b0b0",
}


def plot_family_times(profile: StepProfile, ax=None):
    """Horizontal bars: milliseconds per family, labelled with their share of the step.

    Chapters 01 and 04 draw it.

    Args:
        profile: the ``StepProfile``.
        ax: a matplotlib axes to draw on (None: a new figure).

    Returns:
        the axes.
    """
    import matplotlib.pyplot as plt

    names = [f for f in FAMILIES if f in profile.families]
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.45 * len(names) + 1.2))
    times = [profile.families[f].time_ms for f in names]
    bars = ax.barh([FAMILY_TITLES[f] for f in names], times, color=[_COLORS[f] for f in names])
    for bar, f in zip(bars, names):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                f" {profile.families[f].share:.1%}", va="center")
    ax.invert_yaxis()
    ax.set_xlabel(f"ms ({profile.time_kind}, one step)")
    ax.set_title(f"Where a training step's time goes — {profile.device}")
    ax.set_xlim(0, max(times) * 1.18)
    return ax


def plot_memory(memory: MemoryBudget, ax=None, capacity: int | None = None):
    """Stacked bars of the three moments a step can peak at (``HIGH_POINTS``), with the measured
    peak if any.

    Chapter 01 draws it.

    Args:
        memory: the ``MemoryBudget``.
        ax: a matplotlib axes to draw on (None: a new figure).
        capacity: the GPU's memory in bytes, drawn as a line (None: not drawn).

    Returns:
        the axes.
    """
    import matplotlib.pyplot as plt

    colors = {
        "weights": "#4c72b0", "gradients": "#64b5cd", "optimizer_states": "#55a868",
        "optimizer_temporaries": "#8fd19e",
        "activations": "#8172b3", "logits": "#c44e52", "logits_fp32": "#e17c7e",
        "log_softmax_fp32": "#f2b5b6",
        "logit_grads_fp32": "#fbe0e0",
    }
    parts = memory.parts()
    largest = max(max(memory.high_points().values()), memory.measured_peak or 0, capacity or 0)
    unit, scale = ("GiB", GiB) if largest >= GiB else ("MiB", 1024**2)
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3.6))
    labelled = set()
    for y, names in enumerate(HIGH_POINTS.values()):
        left = 0.0
        for name in names:
            width = parts[name] / scale
            ax.barh(y, width, left=left, color=colors[name],
                    label=None if name in labelled else name.replace("_", " "))
            labelled.add(name)
            left += width
    if memory.measured_peak is not None:
        ax.axvline(memory.measured_peak / scale, color="black", linestyle="--", label="measured peak")
    if capacity:
        ax.axvline(capacity / scale, color="grey", linestyle=":", label="GPU memory")
    ax.set_yticks(range(len(HIGH_POINTS)), list(HIGH_POINTS))
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    kind = "measured on the GPU" if memory.measured else "computed estimate"
    ax.set_title(f"Memory at the moments a step can peak ({kind})")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=4, frameon=False, fontsize=8)
    return ax
