"""Where a sharded step's time goes: compute kernels, collectives, and how much of the collectives
nothing hides.

FSDP2 all-gathers each layer's parameters before the layer runs and reduce-scatters its gradients
after its backward, on a stream of their own, so that the collectives overlap the compute of the
neighbouring layers. Whether they do is a question for the profiler. ``StepProfiler`` records a few
steps of a run on rank 0 with ``torch.profiler`` and ``summarize_trace`` reads the recorded trace:

* **kernel time** on the GPU's timeline: the union of the intervals in which any compute kernel runs
  (``compute``), the union of the intervals in which a collective kernel runs (NCCL's kernels,
  ``comm``), and the part of ``comm`` during which no compute kernel runs: ``exposed``, the
  collectives' time the step waits for. Unions, not sums: kernels on several streams at once count
  once.
* **bytes**: every collective FSDP2 issues is a c10d operator that the profiler records with its
  arguments' shapes (``c10d::_allgather_base_``, ``c10d::_reduce_scatter_base_``,
  ``c10d::allreduce_``). Each is turned into the bytes this rank *sends* with a ring algorithm: (N −
  1)/N of the gathered buffer for an all-gather, of the input buffer for a reduce-scatter, twice
  that for an all-reduce. ``kernels.distributed.scaling.bytes_sent_per_step`` predicts the same
  quantity on paper.

Each profiled "step" is the stretch between two calls of ``StepProfiler.step`` (the training loop
calls it after a step's backward), so it holds one optimizer step and one forward and backward: a
whole step's work. On the CPU (gloo) there are no kernels: only the bytes are counted.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

# Kernel names of collectives: NCCL's device kernels (``ncclDevKernel_AllGather_RING_LL``,
# ``ncclKernel_…``).
COMM_KERNEL_PREFIXES = ("nccl",)

# The c10d operators of the collectives, as the profiler names them: (kind, index of the argument
# whose size is the gathered / reduced buffer, multiple of (N − 1)/N of that buffer a rank sends
# with a ring algorithm).
C10D_COLLECTIVES = {
    # (output, input, ...): the output is the gathered buffer
    "c10d::_allgather_base_": ("all_gather", 0, 1.0),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", 1, 1.0),  # (output, input, ...): the input is reduced
    "c10d::allreduce_": ("all_reduce", 0, 2.0),  # (tensors, ...): reduce-scatter then all-gather of each
}

_TYPE_BYTES = {"c10::bfloat16": 2, "c10::half": 2, "float": 4, "double": 8, "long int": 8, "int": 4,
               "unsigned char": 1, "signed char": 1, "bool": 1}

@dataclass
class CollectiveBytes:
    """One kind of collective over the profiled steps: how many calls, and the bytes this rank sent."""

    calls: int = 0
    sent_bytes: float = 0.0


@dataclass
class TraceSummary:
    """Per profiled step, in milliseconds (means over the steps), and the bytes sent per step."""

    steps: int
    step_ms: float | None
    compute_ms: float | None
    comm_ms: float | None
    exposed_comm_ms: float | None
    idle_ms: float | None
    sent_bytes_per_step: float
    collectives: dict = field(default_factory=dict)  # name -> CollectiveBytes (per step)
    top_comm_kernels: list = field(default_factory=list)  # [(name, total ms per step)], longest first

    def to_dict(self) -> dict:
        """The summary's fields as a dict, the collectives' entries too.

        Returns:
            a JSON-ready dict.
        """
        out = asdict(self)
        out["collectives"] = {k: asdict(v) if isinstance(v, CollectiveBytes) else v
                              for k, v in self.collectives.items()}
        return out

    def text(self) -> str:
        """The summary in one sentence: the step's parts and the bytes sent (only the bytes on a CPU run).

        Returns:
            the sentence.
        """
        if self.step_ms is None:
            return (f"{self.steps} profiled step(s): no GPU kernels recorded (CPU run); "
                    f"{self.sent_bytes_per_step / 1e9:.3f} GB sent per step by this rank")
        share = self.exposed_comm_ms / self.step_ms if self.step_ms else float("nan")
        return (f"step {self.step_ms:.1f} ms: compute {self.compute_ms:.1f} ms, collectives {self.comm_ms:.1f} ms, "
                f"of which exposed {self.exposed_comm_ms:.1f} ms ({share:.1%} of the step), GPU idle "
                f"{self.idle_ms:.1f} ms; {self.sent_bytes_per_step / 1e9:.2f} GB sent per step by this rank")


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``(start, end)`` intervals as disjoint, sorted intervals.

    Args:
        intervals: ``(start, end)`` pairs, in any order, overlapping or not.

    Returns:
        the union.
    """
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def total(intervals: list[tuple[float, float]]) -> float:
    """The summed length of ``(start, end)`` intervals (disjoint ones, as ``merge`` returns).

    Args:
        intervals: the intervals.

    Returns:
        the length.
    """
    return sum(b - a for a, b in intervals)


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two unions (each disjoint and sorted, as ``merge`` returns).

    Args:
        a: one union of intervals.
        b: the other.

    Returns:
        the length the two share.
    """
    i = j = 0
    length = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            length += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return length


def is_comm_kernel(name: str) -> bool:
    """Whether a GPU kernel's name is a collective's (NCCL's or gloo's prefixes, ``COMM_KERNEL_PREFIXES``).

    Args:
        name: the kernel's name in the trace.

    Returns:
        True for a collective.
    """
    return name.lower().startswith(COMM_KERNEL_PREFIXES)


def _numel(dims) -> int:
    """Elements of a recorded shape; a list of shapes (a tensor list) counts all of them."""
    if dims and isinstance(dims[0], list):
        return sum(_numel(d) for d in dims)
    n = 1
    for d in dims:
        n *= int(d)
    return n


def sent_bytes(name: str, args: dict, world_size: int) -> tuple[str, float] | None:
    """``(collective, bytes this rank sends)`` of one recorded c10d operator (``record_shapes=True``
    gives its arguments' shapes and types), or None for any other event. A tensor list's dtype is
    not recorded: taken as 4-byte (only the loss's all-reduce of one float is one here).

    Args:
        name: the operator's name in the trace.
        args: the event's ``args`` (its ``Input Dims`` and ``Input type``).
        world_size: the number of ranks.

    Returns:
        the collective's kind and the bytes, or None.
    """
    known = C10D_COLLECTIVES.get(name)
    if known is None:
        return None
    kind, index, factor = known
    dims, types = args.get("Input Dims", []), args.get("Input type", [])
    if index >= len(dims) or world_size <= 1:
        return kind, 0.0
    nbytes = _TYPE_BYTES.get(str(types[index]).lower(), 4) if index < len(types) else 4
    return kind, factor * (world_size - 1) / world_size * _numel(dims[index]) * nbytes


def summarize_trace(trace: dict, steps: int, world_size: int) -> TraceSummary:
    """Read a Chrome trace (``torch.profiler``'s ``export_chrome_trace``, recorded with
    ``record_shapes=True``) of ``steps`` profiled steps of one rank among ``world_size``.

    Args:
        trace: the trace, as loaded from its JSON.
        steps: the profiled steps it holds (at least 1 is taken).
        world_size: the number of ranks.

    Returns:
        the per-step means, as a ``TraceSummary`` (its times None when no GPU kernel was recorded).
    """
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    steps = max(int(steps), 1)
    collectives: dict[str, CollectiveBytes] = {}
    for e in events:
        if e.get("cat") == "cpu_op":
            found = sent_bytes(e.get("name", ""), e.get("args", {}), world_size)
            if found is not None:
                entry = collectives.setdefault(found[0], CollectiveBytes())
                entry.calls += 1
                entry.sent_bytes += found[1]
    per_step = {k: CollectiveBytes(v.calls / steps, v.sent_bytes / steps) for k, v in collectives.items()}
    sent = sum(v.sent_bytes for v in per_step.values())
    if not kernels:
        return TraceSummary(steps, None, None, None, None, None, sent, per_step)
    comm_iv = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if is_comm_kernel(e["name"])]
    compute_iv = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if not is_comm_kernel(e["name"])]
    comm, compute = merge(comm_iv), merge(compute_iv)
    window = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
    busy = total(merge(comm_iv + compute_iv))
    by_name: dict[str, float] = {}
    for e in kernels:
        if is_comm_kernel(e["name"]):
            short = e["name"].split("(")[0]
            by_name[short] = by_name.get(short, 0.0) + e["dur"]
    top = sorted(((k, v / 1e3 / steps) for k, v in by_name.items()), key=lambda kv: -kv[1])[:6]
    ms = 1e3 * steps  # trace times are µs over all profiled steps
    return TraceSummary(
        steps=steps, step_ms=window / ms, compute_ms=total(compute) / ms, comm_ms=total(comm) / ms,
        exposed_comm_ms=(total(comm) - overlap(comm, compute)) / ms, idle_ms=(window - busy) / ms,
        sent_bytes_per_step=sent, collectives=per_step, top_comm_kernels=top,
    )


def timeline_excerpt(trace: dict, *, max_ms: float | None = None, gap_ms: float = 0.02) -> list[dict]:
    """The GPU's busy spans from the first recorded kernel on, as ``{"row": "compute"|"collective",
    "start_ms", "dur_ms"}`` (ms from the first kernel): each row's kernels merged where less than
    ``gap_ms`` apart, so a step is a few hundred spans, not tens of thousands of kernels. ``max_ms``
    cuts it short (e.g. at one step).

    Args:
        trace: the trace, as loaded from its JSON.
        max_ms: keep spans starting up to this time (None: all).
        gap_ms: close gaps shorter than this.

    Returns:
        the spans, sorted by start (empty when the trace has no kernel).
    """
    kernels = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") == "kernel"]
    if not kernels:
        return []
    t0 = min(e["ts"] for e in kernels)
    rows = {"compute": [], "collective": []}
    for e in kernels:
        start = (e["ts"] - t0) / 1e3
        if max_ms is None or start <= max_ms:
            rows["collective" if is_comm_kernel(e["name"]) else "compute"].append((start,
                                                                                   start + e["dur"] / 1e3))
    return merged_spans(rows, gap_ms)


def merged_spans(rows: dict, gap_ms: float) -> list[dict]:
    """``{row: [(start, end), …]}`` → spans with gaps under ``gap_ms`` closed, in the excerpt's format.

    Args:
        rows: row name -> ``(start, end)`` intervals in ms.
        gap_ms: close gaps shorter than this.

    Returns:
        ``{"row", "start_ms", "dur_ms"}`` dicts, sorted by start.
    """
    out = []
    for row, intervals in rows.items():
        for start, end in merge([(a, b + gap_ms) for a, b in intervals]):
            out.append({"row": row, "start_ms": round(start, 3), "dur_ms": round(end - gap_ms - start, 3)})
    return sorted(out, key=lambda span: span["start_ms"])


def plot_timeline(excerpts: dict, ax=None, *, title: str = ""):
    """Two rows per variant (compute kernels, collectives) over one step: ``excerpts`` is variant ->
    excerpt.

    Chapter 12 draws one step with it.

    Args:
        excerpts: variant -> ``timeline_excerpt``.
        ax: a matplotlib axes to draw on (None: a new figure).
        title: the title (empty: a default one).

    Returns:
        the axes.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(11, 0.9 + 0.7 * len(excerpts)))
    colours = {"compute": "#4c72b0", "collective": "#dd8452"}
    labels = []
    for i, (variant, excerpt) in enumerate(excerpts.items()):
        for j, row in enumerate(("compute", "collective")):
            y = 2 * i + j
            spans = [(k["start_ms"], k["dur_ms"]) for k in excerpt if k["row"] == row]
            ax.broken_barh(spans, (y - 0.4, 0.8), color=colours[row])
            labels.append(f"{variant}: {row}")
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("ms from the step's first kernel")
    ax.set_title(title or "one profiled step: compute kernels and collectives (rank 0)")
    ax.invert_yaxis()
    return ax


class StepProfiler:
    """``torch.profiler`` over ``active`` steps after ``wait`` steps, on this rank; ``step()`` marks
    a step's end.

    After the run, ``summary`` is the ``TraceSummary`` of the recorded steps and ``excerpt`` the
    GPU's busy spans over the first step's length (``timeline_excerpt``; ``excerpt_ms`` sets another
    length). Nothing is recorded on a rank that is not asked (``enabled=False``): use it on rank 0
    only, the other ranks run the same steps unprofiled.

    Args:
        wait: steps before recording starts (0 or more).
        active: steps to record (1 or more).
        world_size: the number of ranks (for the bytes sent).
        enabled: record on this rank.
        excerpt_ms: the excerpt's length (None: the first recorded step's).

    Raises:
        ValueError: when ``wait`` < 0 or ``active`` < 1.
    """

    def __init__(self, wait: int, active: int, *, world_size: int = 1, enabled: bool = True,
                 excerpt_ms: float | None = None):
        if wait < 0 or active < 1:
            raise ValueError(f"wait must be ≥ 0 and active ≥ 1, got wait={wait}, active={active}")
        self.wait, self.active, self.enabled, self.excerpt_ms = wait, active, enabled, excerpt_ms
        self.world_size = world_size
        self.summary: TraceSummary | None = None
        self.excerpt: list[dict] = []
        self._prof = None
        self._recording = False
        self._calls = 0

    def _analyse(self, prof, steps: int) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(path))
            trace = json.loads(path.read_text())
        self.summary = summarize_trace(trace, steps, self.world_size)
        self.excerpt = timeline_excerpt(trace, max_ms=self.excerpt_ms if self.excerpt_ms is not None
                                        else (self.summary.step_ms or None))

    def __enter__(self):
        self._calls = 0
        if not self.enabled:
            return self
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        # Started and stopped by hand at step boundaries, not by a profiler schedule: the profiler
        # also counts optimizer steps as its steps, which would move a schedule's windows.
        self._prof = profile(activities=activities, record_shapes=True)
        if self.wait == 0:
            self._start()
        return self

    def _start(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._prof.start()
        self._recording = True

    def _stop(self, steps: int) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._prof.stop()
        self._recording = False
        if steps > 0:
            self._analyse(self._prof, steps)
        self._prof = None

    def step(self, *_args) -> None:
        """The end of one step: start recording after ``wait`` of them, stop after ``active`` more.

        Args:
            *_args: ignored, so it can be an ``after_backward(step, model)`` callback.
        """
        self._calls += 1
        if self._prof is None:
            return
        if self._calls == self.wait and not self._recording:
            self._start()
        elif self._calls == self.wait + self.active and self._recording:
            self._stop(self.active)

    def __exit__(self, *exc):
        if self._prof is not None:
            if self._recording:
                self._stop(self._calls - self.wait)
            self._prof = None
        return False


__all__ = ["StepProfiler", "TraceSummary", "CollectiveBytes", "summarize_trace", "timeline_excerpt",
           "merged_spans",
           "plot_timeline", "sent_bytes", "merge", "overlap", "total", "is_comm_kernel"]
