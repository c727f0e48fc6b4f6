"""Check for the exercise of chapter 14: the tile loop of a tiled MLP's forward.

The reader writes ``fn(x, mlp_tile, tile_rows) -> out``: x is [batch, seq, hidden];
``mlp_tile(rows)`` runs the MLP on a [n, hidden] block of rows and returns [n, hidden]. The function
must flatten x to [tokens, hidden], cut the tokens into consecutive tiles of at most ``tile_rows``
rows (the last one partial when ``tile_rows`` does not divide the tokens), run ``mlp_tile`` on each,
write each result into the same rows of an output like x, and return it.

The check hands the reader's function an ``mlp_tile`` that records which rows of x each call
received (found by their values, so copies and views alike are traced), runs it on a few fresh
inputs (a ragged last tile, fewer rows than one tile, bfloat16, an exact multiple), and when
something is wrong says which mistake it was: the last partial tile dropped, tiles overlapping, rows
skipped between tiles, the hidden axis tiled instead of the tokens, a tile larger than
``tile_rows``, results written to the wrong rows, or the output's shape or dtype. While the reader's
code runs, the package's tile loop and tiled MLP are out of reach
(``reach.FORBIDDEN["tiled_forward"]``; the hooks of the second exercise likewise keep the package's
offload away). It never raises because the reader's function is wrong: it prints its verdict and
returns a ``Report``.

``solution("tiled_forward")`` prints a solution, only when called.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels import runtime
from kernels.reference import relative_error
from kernels.tolerances import ELEMENT_TOL, RELATIVE_ERROR_TOL

from .reach import FinishedCodeCalled, call_learner
from .rmsnorm import Report


@dataclass(frozen=True)
class TileCase:
    """One input of ``check_tiled_forward``: x [batch, seq, hidden] of ``dtype``, cut into tiles of
    ``tile_rows`` tokens."""

    dtype: torch.dtype
    batch: int
    seq: int
    hidden: int
    tile_rows: int

    @property
    def tokens(self) -> int:
        """How many rows x has once flattened: batch × seq."""
        return self.batch * self.seq

    def __str__(self) -> str:
        q, r = divmod(self.tokens, self.tile_rows)
        split = (f"{q} tiles + {r} rows" if q and r
                 else (f"{q} whole tiles" if q else f"one partial tile of {r}"))
        return (f"{str(self.dtype).removeprefix('torch.')} x of [{self.batch}, {self.seq}, "
                f"{self.hidden}] with tile_rows={self.tile_rows} ({self.tokens} tokens: {split})")


CASES = (
    TileCase(torch.float32, 2, 45, 24, 16),  # 90 tokens: 5 tiles + 10 rows; 24 columns, no multiple of 16
    TileCase(torch.float32, 1, 11, 24, 16),  # fewer tokens than one tile
    TileCase(torch.bfloat16, 3, 13, 32, 8),  # 39 tokens: 4 tiles + 7 rows, bfloat16
    TileCase(torch.float32, 1, 64, 16, 16),  # an exact multiple
)

# --------------------------------------------------------------------------------------------------
# The instrumented MLP tile
# --------------------------------------------------------------------------------------------------


class TracedMLP:
    """``mlp_tile`` for the reader's function: Llama's MLP (float32 arithmetic, rounded to x's dtype
    once) on a block of rows, recording for each call the rows of x it received (by value: x's rows
    are all different), its width and its row count. A block whose last dimension is not the hidden
    size is recorded and refused (``ValueError``, and ``TypeError`` for a block that is not a
    tensor).

    Args:
        x: the input the reader's function is given, [batch, seq, hidden]; its rows are what calls
            are traced by, and its last dimension the hidden size.
        gen: the random generator the MLP's weights are drawn from.
    """

    def __init__(self, x: torch.Tensor, gen: torch.Generator):
        self.hidden = x.shape[-1]
        self.rows = x.reshape(-1, self.hidden)
        inter = 2 * self.hidden + 8
        self.w_gate, self.w_up = (torch.randn(inter, self.hidden,
                                              generator=gen) / self.hidden**0.5 for _ in range(2))
        self.w_down = torch.randn(self.hidden, inter, generator=gen) / inter**0.5
        self.where = {tuple(row.tolist()): i for i, row in enumerate(self.rows.float().cpu())}
        self.calls: list[dict] = []

    def mlp(self, block: torch.Tensor) -> torch.Tensor:
        """Llama's MLP on ``block``, untraced: float32 on the CPU, rounded once to block's dtype.

        Args:
            block: rows of the hidden size, [..., hidden].

        Returns:
            block's shape, dtype and device.
        """
        h = block.float().cpu()
        y = torch.nn.functional.silu(h @ self.w_gate.t()) * (h @ self.w_up.t())
        return (y @ self.w_down.t()).to(block.dtype).to(block.device)

    def __call__(self, block: torch.Tensor) -> torch.Tensor:
        if not isinstance(block, torch.Tensor):
            raise TypeError(f"mlp_tile takes a tensor of rows, got {type(block).__name__}")
        if block.shape[-1] != self.hidden:
            self.calls.append({"width": block.shape[-1], "rows": [],
                               "n": block.numel() // max(block.shape[-1], 1)})
            raise ValueError(f"mlp_tile expects rows of the hidden size {self.hidden}, got a block of shape "
                             f"{tuple(block.shape)}")
        flat = block.reshape(-1, self.hidden)
        rows = [self.where.get(tuple(r.tolist()), -1) for r in flat.float().cpu()]
        self.calls.append({"width": self.hidden, "rows": rows, "n": flat.shape[0]})
        return self.mlp(block)

    def reference(self) -> torch.Tensor:
        """The MLP on every row of x at once, untraced: the answer the tile loop must give.

        Returns:
            [tokens, hidden], x's dtype and device.
        """
        return self.mlp(self.rows)


# --------------------------------------------------------------------------------------------------
# The diagnosis
# --------------------------------------------------------------------------------------------------


def _span(rows: list[int]) -> str:
    """``row 7``, ``rows 80–89`` when consecutive, else ``18 rows between 13 and 80``."""
    lo, hi = min(rows), max(rows)
    if len(rows) == 1:
        return f"row {lo}"
    return f"rows {lo}–{hi}" if hi - lo + 1 == len(rows) else f"{len(rows)} rows between {lo} and {hi}"


def _axis_problem(traced: TracedMLP, case: TileCase) -> str | None:
    wrong = next((call for call in traced.calls if call["width"] != case.hidden), None)
    if wrong is None:
        return None
    return (f"wrong axis tiled: a tile had {wrong['width']} columns where every row has "
            f"{case.hidden}. Cut the tokens (rows of x.reshape(-1, hidden)), never the hidden "
            "axis: the MLP needs whole rows")


def _coverage_problem(traced: TracedMLP, case: TileCase) -> str | None:
    """What is wrong with the tiles the reader cut, or None when every row went through the MLP
    once, in tiles of at most ``tile_rows``."""
    n, t = case.tokens, case.tile_rows
    if not traced.calls and n >= t:
        return "mlp_tile was never called: loop over the tiles and run each through it"
    if any(call["n"] == 0 for call in traced.calls):
        return ("an empty tile: mlp_tile was called on 0 rows, one step past the end of the "
                "tokens. On a GPU each call launches kernels (an empty grid is refused by some of "
                "them): the loop ends with the last row")
    biggest = max((call["n"] for call in traced.calls), default=0)
    if biggest > t:
        whole = " (all the tokens at once: no tiling at all)" if biggest >= n and n > t else ""
        return (f"a tile of {biggest} rows is larger than tile_rows={t}{whole}: each tile is at "
                "most tile_rows rows, so its [tile, intermediate] tensors stay small")
    if any(r < 0 for call in traced.calls for r in call["rows"]):
        return "a tile held rows that are not rows of x: slice x's rows, do not build new ones"
    seen: dict[int, int] = {}
    for call in traced.calls:
        for r in call["rows"]:
            seen[r] = seen.get(r, 0) + 1
    twice = sorted(r for r, count in seen.items() if count > 1)
    if twice:
        return (f"tiles overlap: {_span(twice)} went through the MLP more than once. Each tile "
                "starts where the last one stopped")
    missing = sorted(set(range(n)) - set(seen))
    if missing:
        tail = list(range(n - n % t, n)) if n % t else []
        if missing == tail or (missing == list(range(missing[0], n)) and missing[0] >= n - t):
            return (f"the last partial tile was dropped: {_span(missing)} never went through the "
                    f"MLP ({n} tokens = {n // t} × {t} + {n % t}): the tiles must reach the last "
                    "row even when tile_rows does not divide the tokens")
        return (f"rows skipped between tiles: {_span(missing)} never went through the MLP. "
                "Each tile starts where the last one stopped")
    return None


def _output_problem(out, x: torch.Tensor, traced: TracedMLP, case: TileCase) -> str | None:
    if not isinstance(out, torch.Tensor):
        return f"the function returned {type(out).__name__}, expected a tensor shaped like x"
    if out.shape != x.shape:
        return (f"the output has shape {tuple(out.shape)}, expected x's {tuple(x.shape)}: view the "
                "[tokens, hidden] result back as [batch, seq, hidden]")
    if out.dtype != x.dtype:
        return (f"the output has dtype {out.dtype}, expected x's {x.dtype}: allocate it like x "
                "(torch.empty_like of x's rows), not with torch's default dtype")
    ref = traced.reference().reshape(x.shape)
    rtol, atol = ELEMENT_TOL[case.dtype]
    got, want = (out.detach().double().cpu().reshape(-1, case.hidden),
                 ref.double().cpu().reshape(-1, case.hidden))
    bad = (((got - want).abs() > rtol * want.abs() + atol * want.abs().max()).any(-1)
           | ~torch.isfinite(got).all(-1))
    if bad.any():
        rows = bad.nonzero().flatten().tolist()
        return (f"{_span(rows)} of the output do not hold the MLP of the same rows of x: write "
                "each tile's result to out[start:stop], the rows it came from")
    return None


def _call(fn, x, traced, case):
    try:
        return call_learner("tiled_forward", fn, x, traced, case.tile_rows), None
    except FinishedCodeCalled:
        raise
    except Exception as error:  # noqa: BLE001  (any failure of the reader's code is reported, not raised)
        lines = [line for line in str(error).strip().splitlines() if line.strip()]
        return None, f"your function raised {type(error).__name__}: {lines[-1] if lines else repr(error)}"


def _verdict(passed: bool, message: str, verbose: bool) -> Report:
    report = Report(passed, ("✓ " if passed else "✗ ") + message)
    if verbose:
        print(report.message)
    return report


def check_tiled_forward(fn: Callable, seed: int | None = None, verbose: bool = True) -> Report:
    """Check ``fn(x, mlp_tile, tile_rows) -> out``, the tile loop of a tiled MLP forward (see the
    module docstring). Prints the verdict (unless ``verbose=False``) and returns it (chapter 14,
    notebooks/14_long_context.ipynb).

    Never raises for the reader's code: an error it raises, or a call of a finished answer, is
    reported in the verdict.

    Args:
        fn: the reader's ``tiled_forward(x, mlp_tile, tile_rows) -> out``: x [batch, seq, hidden],
            ``mlp_tile`` the MLP on a [n, hidden] block of rows, out like x.
        seed: seed of the random inputs and weights; None draws fresh ones.
        verbose: print the verdict: ✓, or ✗ with the input and the mistake recognised (a dropped,
            overlapping or oversized tile, skipped rows, the hidden axis tiled, rows written to the
            wrong place, the output's shape or dtype).

    Returns:
        a ``Report``: ``passed``, and the verdict's message.
    """
    gen = torch.Generator()
    if seed is None:
        gen.seed()  # fresh inputs every call: a loop must be right for any length, not one
    else:
        gen.manual_seed(seed)
    for case in CASES:
        x = torch.randn(case.batch, case.seq, case.hidden, generator=gen).to(case.dtype).to(runtime.device())
        traced = TracedMLP(x, gen)
        try:
            out, raised = _call(fn, x, traced, case)
        except FinishedCodeCalled as called:
            return _verdict(False, str(called), verbose)
        problem = (_axis_problem(traced, case) or raised or _coverage_problem(traced, case)
                   or _output_problem(out, x, traced, case))
        if problem is not None:
            return _verdict(False, f"on a {case}: {problem}.", verbose)
    return _verdict(True, (f"the tile loop is right on {len(CASES)} inputs (a ragged last tile, "
                           "fewer tokens than one tile, bfloat16, an exact multiple): every token "
                           "through the MLP once, in tiles of at most tile_rows, each result in "
                           "its own rows."), verbose)


# ==================================================================================================
# The second exercise: the pack/unpack pair that offloads a checkpoint to host memory
# ==================================================================================================
#
# The reader writes ``offload_pack(tensor, side) -> packed`` and ``offload_unpack(packed, side) ->
# tensor``: the pair of saved-tensor hooks that ``kernels/hf/offload.py`` builds on, without its
# pool, plan or prefetch. ``side`` is the side CUDA stream; the compute stream is
# ``torch.cuda.current_stream()``.
#
# Where there is no GPU, the check hands the functions a recording stand-in for ``side`` and, while
# they run, for ``torch.cuda.current_stream``, ``torch.cuda.stream``, ``torch.cuda.Event``,
# ``torch.cuda.synchronize`` and ``Tensor.record_stream``; a ``TorchDispatchMode`` notes every copy
# with the stream that was current. The order of those notes is what a GPU would execute, so the
# check can say which wait, mark or flag is missing. Then it runs the pair as hooks around every
# decoder layer of a checkpointed tiny Llama and compares the gradients, bit for bit. On a GPU the
# same pair runs on real streams and the check provokes each race instead: the tensor is written on
# a busy compute stream before the pack and its memory handed out again right after it; the unpack
# runs while a busy compute stream has yet to read a tensor whose memory was just freed; the side
# stream is held up before another unpack. The results must still be exact, the host copy must be
# pinned, and the pack must return before its copy is done. Without a GPU none of this can be
# provoked, and the verdict says so.

OFFLOAD_HINTS = {
    "stub": "offload_pack or offload_unpack is still the stub (it raises NotImplementedError)",
    "raised": "your {hook} raised {error}",
    "kept_tensor": ("pack's result still holds the tensor itself (or a view of it): nothing left "
                    "the device, so nothing is saved. Allocate a host buffer (torch.empty(..., "
                    "device='cpu', pin_memory=...)) and copy into it. (On a CPU, tensor.to('cpu') "
                    "returns the tensor itself: copy_ into a buffer)"),
    "no_copy_out": "pack issued no copy of the tensor: copy it into a host buffer with copy_",
    "copy_out_on_compute": ("pack copied the tensor on the compute stream: the forward's kernels "
                            "queue behind the copy. Issue it inside `with "
                            "torch.cuda.stream(side):`"),
    "no_wait_before_copy_out": ("pack's copy on the side stream does not wait for the compute "
                                "stream: the side stream may read the tensor before the kernels "
                                "that write it have run. Call "
                                "side.wait_stream(torch.cuda.current_stream()) before the copy"),
    "blocking_copy_out": ("pack's copy is blocking (non_blocking=False): from pinned memory the "
                          "host need not wait for it, so pass non_blocking=True"),
    "no_record_stream_out": ("pack never marks the tensor as used by the side stream "
                             "(tensor.record_stream(side)): once autograd drops it, the caching "
                             "allocator may hand its memory to the next layer while the side "
                             "stream is still copying it"),
    "synchronized": ("your {hook} waits on the host ({call}): every layer would stall until its "
                     "copy is done. Order the streams with wait_stream, events and wait_event "
                     "instead"),
    "no_copy_back": ("unpack issued no copy back: allocate the tensor on its device (torch.empty(..., "
                     "device=device)) and copy the host buffer into it"),
    "copy_back_on_compute": ("unpack copied back on the compute stream: in the package this copy "
                             "is issued one layer ahead, and only on the side stream can it "
                             "overlap the layer above's backward. Issue it inside `with "
                             "torch.cuda.stream(side):`"),
    "blocking_copy_back": "unpack's copy back is blocking (non_blocking=False): pass non_blocking=True",
    "no_wait_before_copy_back": ("unpack's copy back on the side stream does not wait for the "
                                 "compute stream: the tensor it copies into was allocated on the "
                                 "compute stream, whose memory may have belonged to a tensor that "
                                 "kernels queued there still read, and the copy would overwrite it "
                                 "under them. Call side.wait_stream(torch.cuda.current_stream()) "
                                 "after allocating and before the copy"),
    "no_wait_after_copy_back": ("the compute stream does not wait for the copy back: the backward "
                                "may read the tensor before it has arrived. Record an event on the "
                                "side stream after the copy (side.record_event()) and make the "
                                "compute stream wait for it "
                                "(torch.cuda.current_stream().wait_event(event))"),
    "wait_before_copy_back": ("the compute stream waits for an event recorded before the copy back "
                              "was queued: it does not wait for the copy. Record the event after "
                              "the copy"),
    "no_record_stream_back": ("the tensor unpack returns was allocated while the side stream was "
                              "current, and is used on the compute stream: mark it "
                              "(tensor.record_stream(torch.cuda.current_stream())) or allocate it "
                              "before entering the side stream, or the allocator may reuse its "
                              "memory while the backward still reads it"),
    "wrong_tensor": ("unpack returned {got} for a tensor of {expected}: it must give back the very "
                     "values, shape, dtype and device that were packed"),
    "not_pinned": ("the host buffer is not pinned: a copy from pageable memory makes the host wait "
                   "for it. Allocate it with pin_memory=True (torch.cuda.is_available() says when "
                   "that is possible)"),
    "pack_waited": ("pack returned only after {waited_ms:.0f} ms, with the compute stream busy for "
                    "{busy_ms:.0f} ms: it waited for the copy (a blocking copy, pageable memory or "
                    "a synchronize)"),
    "race_out": ("the host copy does not hold what the compute stream wrote just before the pack: "
                 "the side stream read the tensor too early "
                 "(side.wait_stream(torch.cuda.current_stream()) before the copy)"),
    "race_back": ("the tensor unpack returned was read by the compute stream before its copy back "
                  "had arrived: make the compute stream wait for an event recorded after the copy"),
    "gradients": ("with your hooks around the checkpointed tiny Llama, the gradient of {name} "
                  "differs from the one without them (relative error {error:.1e}): the checkpoints "
                  "did not come back as they left"),
    "no_checkpoint": ("your pack never received a layer's checkpoint in the tiny Llama's step: the "
                      "hooks did not run (is the model checkpointed?)"),
}


def offload_hint(key: str, **fields) -> str:
    """The diagnosis ``OFFLOAD_HINTS[key]`` with its fields filled in.

    Args:
        key: a key of ``OFFLOAD_HINTS``.
        **fields: the diagnosis's fields.

    Returns:
        the diagnosis's text.

    Raises:
        KeyError: when ``key`` is unknown or a field the diagnosis names is missing.
    """
    return OFFLOAD_HINTS[key].format(**fields)


class _Problem(Exception):
    """A diagnosis found while running the reader's hooks (the message is the verdict)."""


# -- the recording stand-ins (CPU)
# -----------------------------------------------------------------------------------


class _Recorder:
    """The notes of one run, in order, and which stand-in stream is current."""

    def __init__(self):
        self.notes: list[tuple] = []
        self.compute = _FakeStream("compute", self)
        self.side = _FakeStream("side", self)
        self.current = [self.compute]
        self.events = 0

    def note(self, *entry) -> None:
        self.notes.append(entry)

    def stream_context(self, stream):
        return _StreamContext(self, stream)

    def event(self, *args, **kwargs):
        return _FakeEvent(self)

    def current_stream(self, device=None):
        return self.current[-1]

    def synchronize(self, device=None):
        self.note("synchronize", "torch.cuda.synchronize()")

    def record_stream(self, tensor, stream):
        self.note("record_stream", tensor.untyped_storage().data_ptr(), getattr(stream, "name", "?"))


class _StreamContext:
    def __init__(self, recorder: _Recorder, stream):
        self.recorder, self.stream = recorder, stream

    def __enter__(self):
        if self.stream is not None:
            self.recorder.current.append(self.stream)
        return self.stream

    def __exit__(self, *exc):
        if self.stream is not None:
            self.recorder.current.pop()
        return False


class _FakeStream:
    """What the reader's hooks may ask of a stream, written down instead of done."""

    def __init__(self, name: str, recorder: _Recorder):
        self.name, self.recorder = name, recorder

    def wait_stream(self, other):
        self.recorder.note("wait_stream", self.name, getattr(other, "name", "?"))

    def wait_event(self, event):
        self.recorder.note("wait_event", self.name, getattr(event, "id", None))

    def record_event(self, event=None):
        event = event if event is not None else _FakeEvent(self.recorder)
        event.record(self)
        return event

    def synchronize(self):
        self.recorder.note("synchronize", f"{self.name}.synchronize()")

    def query(self):
        return True

    def __enter__(self):
        self.recorder.current.append(self)
        return self

    def __exit__(self, *exc):
        self.recorder.current.pop()
        return False


class _FakeEvent:
    def __init__(self, recorder: _Recorder):
        recorder.events += 1
        self.id, self.recorder = recorder.events, recorder

    def record(self, stream=None):
        stream = stream if stream is not None else self.recorder.current[-1]
        self.recorder.note("record_event", getattr(stream, "name", "?"), self.id)

    def wait(self, stream=None):
        (stream if stream is not None else self.recorder.current[-1]).wait_event(self)

    def synchronize(self):
        self.recorder.note("synchronize", "event.synchronize()")

    def query(self):
        return True


class _CopyNotes(TorchDispatchMode):
    """Notes every copy (``copy_``, ``_to_copy``) with the stream current at the time, whether it
    was non-blocking, and the storages it read and wrote; and every tensor allocated while the side
    stream was current."""

    def __init__(self, recorder: _Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        stream = self.recorder.current[-1].name
        packet = func.overloadpacket
        if packet is torch.ops.aten.copy_:
            blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            self.recorder.note("copy", stream, _storage(args[1]), _storage(args[0]), blocking)
        elif packet is torch.ops.aten._to_copy:
            self.recorder.note("copy", stream, _storage(args[0]), _storage(out),
                               not kwargs.get("non_blocking", False))
        if stream == "side":
            inputs = {_storage(a) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}
            for t in out if isinstance(out, (tuple, list)) else (out,):
                # new memory, not an in-place write
                if isinstance(t, torch.Tensor) and _storage(t) not in inputs:
                    self.recorder.note("allocated_on_side", _storage(t))
        return out


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@contextlib.contextmanager
def _recording(recorder: _Recorder):
    """The CUDA calls the hooks make, routed to ``recorder`` (only while the reader's functions run)."""
    with contextlib.ExitStack() as stack:
        for name, value in (("current_stream", recorder.current_stream), ("stream", recorder.stream_context),
                            ("Event", recorder.event), ("synchronize", recorder.synchronize)):
            stack.enter_context(mock.patch.object(torch.cuda, name, value))

        def record_stream(tensor, stream):  # a plain function: looked up on a tensor, it becomes its method
            recorder.record_stream(tensor, stream)

        stack.enter_context(mock.patch.object(torch.Tensor, "record_stream", record_stream))
        stack.enter_context(_CopyNotes(recorder))
        yield


def _tensors_in(obj, depth: int = 0):
    """Every tensor inside what pack returned (tuples, lists, dicts, an object's attributes)."""
    if depth > 4:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors_in(item, depth + 1)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors_in(item, depth + 1)
    elif hasattr(obj, "__dict__") or hasattr(obj, "__slots__"):
        names = list(getattr(obj, "__dict__", {})) + list(getattr(type(obj), "__slots__", ()))
        for name in names:
            yield from _tensors_in(getattr(obj, name, None), depth + 1)


def _guarded(hook: str, fn: Callable, *args, recorder: _Recorder | None = None):
    """``fn(*args)``, its CUDA calls written down by ``recorder`` when there is one; any failure becomes a
    ``_Problem`` that names it."""
    try:
        with _recording(recorder) if recorder is not None else contextlib.nullcontext():
            return call_learner("offload_hooks", fn, *args)
    except FinishedCodeCalled as called:
        raise _Problem(str(called)) from None
    except NotImplementedError as error:
        # the stub's own raise, not an operator PyTorch lacks for a backend
        if "Could not run" not in str(error):
            raise _Problem(offload_hint("stub")) from error
        lines = [line for line in str(error).strip().splitlines() if line.strip()]
        raise _Problem(offload_hint("raised", hook=hook, error=("NotImplementedError: "
                                                                f"{lines[0][:160]}"))) from error
    except _Problem:
        raise
    except Exception as error:  # noqa: BLE001  (the reader's code may raise anything: say what)
        lines = [line for line in str(error).strip().splitlines() if line.strip()]
        raise _Problem(offload_hint("raised", hook=hook, error=f"{type(error).__name__}: "
                                    f"{lines[0][:160] if lines else ''}")) from error


def _synchronized(notes, hook: str) -> None:
    sync = next((n for n in notes if n[0] == "synchronize"), None)
    if sync is not None:
        raise _Problem(offload_hint("synchronized", hook=hook, call=sync[1]))


def _check_pack_order(notes, source: int) -> None:
    """The pack's notes: a non-blocking copy of ``source`` on the side stream, after the side stream
    waited for the compute stream, and the tensor marked as used by the side stream."""
    _synchronized(notes, "pack")
    copies = [(i, n) for i, n in enumerate(notes) if n[0] == "copy" and n[2] == source]
    if not copies:
        raise _Problem(offload_hint("no_copy_out"))
    at, copy = copies[0]
    if copy[1] != "side":
        raise _Problem(offload_hint("copy_out_on_compute"))
    if not any(n[:3] == ("wait_stream", "side", "compute") for n in notes[:at]):
        raise _Problem(offload_hint("no_wait_before_copy_out"))
    if copy[4]:
        raise _Problem(offload_hint("blocking_copy_out"))
    if not any(n[0] == "record_stream" and n[1] == source and n[2] == "side" for n in notes):
        raise _Problem(offload_hint("no_record_stream_out"))


def _check_unpack_order(notes, result: torch.Tensor) -> None:
    """The unpack's notes: a non-blocking copy into the returned tensor on the side stream, after
    the side stream waited for the compute stream (unless the tensor was allocated on the side
    stream), an event recorded on the side stream after it that the compute stream waits for, and
    the allocator told when the returned tensor was allocated on the side stream."""
    _synchronized(notes, "unpack")
    target = _storage(result)
    copies = [(i, n) for i, n in enumerate(notes) if n[0] == "copy" and n[3] == target]
    if not copies:
        raise _Problem(offload_hint("no_copy_back"))
    at, copy = copies[-1]
    if copy[1] != "side":
        raise _Problem(offload_hint("copy_back_on_compute"))
    if copy[4]:
        raise _Problem(offload_hint("blocking_copy_back"))
    on_side = any(n[0] == "allocated_on_side" and n[1] == target for n in notes)
    # Memory the side stream allocated was last used on the side stream: only the compute stream's
    # needs a wait.
    if not on_side and not any(n[:3] == ("wait_stream", "side", "compute") for n in notes[:at]):
        raise _Problem(offload_hint("no_wait_before_copy_back"))
    recorded_after = {n[2] for n in notes[at + 1:] if n[0] == "record_event" and n[1] == "side"}
    recorded_before = {n[2] for n in notes[:at] if n[0] == "record_event" and n[1] == "side"}
    waits = [n for n in notes[at + 1:] if n[0] == "wait_event" and n[1] == "compute"]
    waited_stream = any(n[:3] == ("wait_stream", "compute", "side") for n in notes[at + 1:])
    if not waited_stream and not any(w[2] in recorded_after for w in waits):
        key = ("wait_before_copy_back" if any(w[2] in recorded_before for w in waits)
               else "no_wait_after_copy_back")
        raise _Problem(offload_hint(key))
    marked = any(n[0] == "record_stream" and n[1] == target and n[2] == "compute" for n in notes)
    if on_side and not marked:
        raise _Problem(offload_hint("no_record_stream_back"))


def _same(got, want: torch.Tensor) -> None:
    if not isinstance(got, torch.Tensor):
        raise _Problem(offload_hint("wrong_tensor", got=type(got).__name__, expected=_describe_tensor(want)))
    if (got.shape != want.shape or got.dtype != want.dtype or got.device != want.device
            or not torch.equal(got, want)):
        raise _Problem(offload_hint("wrong_tensor", got=_describe_tensor(got),
                                    expected=_describe_tensor(want)))


def _describe_tensor(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, {str(t.dtype).removeprefix('torch.')} on {t.device.type}"


def _check_order_on_stand_ins(pack: Callable, unpack: Callable, gen: torch.Generator) -> None:
    """One pack and one unpack of a [2, 37, 48] checkpoint, with every CUDA call written down and checked."""
    x = torch.randn(2, 37, 48, generator=gen)
    want = x.clone()
    recorder = _Recorder()
    packed = _guarded("pack", pack, x, recorder.side, recorder=recorder)
    if any(_storage(t) == _storage(x) for t in _tensors_in(packed)):
        raise _Problem(offload_hint("kept_tensor"))
    _check_pack_order(recorder.notes, _storage(x))
    x.zero_()  # the layer's memory is reused once autograd drops it: the pack's copy must not depend on it
    recorder.notes.clear()
    got = _guarded("unpack", unpack, packed, recorder.side, recorder=recorder)
    _same(got, want)
    _check_unpack_order(recorder.notes, got)


def _check_races_on_gpu(pack: Callable, unpack: Callable, gen: torch.Generator) -> None:
    """The same pair on real streams, each race provoked: the tensor written on a busy compute
    stream just before the pack and its memory handed out again at once; the copy back's new memory
    still to be read by kernels queued on a busy compute stream; the side stream held up before the
    unpack."""
    device = torch.device("cuda")
    side = torch.cuda.Stream(device)
    src = torch.randn(4, 1024, 1024, generator=gen).to(device)
    x = torch.zeros_like(src)
    torch.cuda.synchronize()
    busy_ms = _sleep_ms(side=None)
    start = time.perf_counter()
    torch.cuda._sleep(_CYCLES)  # the compute stream is busy, then writes the checkpoint
    x.copy_(src)
    packed = _guarded("pack", pack, x, side)
    waited_ms = (time.perf_counter() - start) * 1e3
    host = [t for t in _tensors_in(packed) if t.device.type == "cpu"]
    if any(_storage(t) == _storage(x) for t in _tensors_in(packed)) or not host:
        raise _Problem(offload_hint("kept_tensor"))
    # The layer is done with x: a block handed out again now is written on the compute stream at
    # once, while the side stream may still be copying it out (unless pack marked it with
    # record_stream).
    x_block = _storage(x)
    del x
    reused = torch.empty_like(src)
    reused.fill_(float("nan"))
    if not all(t.is_pinned() for t in host):
        raise _Problem(offload_hint("not_pinned"))
    if waited_ms > 0.5 * busy_ms:
        raise _Problem(offload_hint("pack_waited", waited_ms=waited_ms, busy_ms=busy_ms))
    torch.cuda.synchronize()
    if not any(t.numel() == src.numel() and torch.equal(t.reshape(src.shape), src.cpu()) for t in host):
        raise _Problem(offload_hint("no_record_stream_out" if _storage(reused) == x_block else "race_out"))
    del reused
    _race_before_copy_back(unpack, packed, side, src, gen)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    # Freed memory keeps its values: the one free block of this size, which the unpack gets, must
    # not hold the answer.
    torch.full_like(src, float("nan"))
    with torch.cuda.stream(side):
        torch.cuda._sleep(_CYCLES)  # the side stream is held up: its copy back lands late
    got = _guarded("unpack", unpack, packed, side)
    seen = got.clone() if isinstance(got, torch.Tensor) else got  # read at once, on the compute stream
    torch.cuda.synchronize()
    if isinstance(seen, torch.Tensor) and seen.shape == src.shape and not torch.equal(seen, src):
        if isinstance(got, torch.Tensor) and torch.equal(got, src):
            raise _Problem(offload_hint("race_back"))
    _same(got, src)


def _race_before_copy_back(unpack: Callable, packed, side, src: torch.Tensor, gen: torch.Generator) -> None:
    """Unpack while kernels queued on a busy compute stream still read a tensor that was just freed:
    the unpack's new tensor gets its memory (the caching allocator hands a block out again at once
    on the stream that freed it), and a copy back that does not wait for the compute stream
    overwrites it before those kernels read it."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # no other free block of this size: the unpack gets the one freed below
    values = torch.randn(src.shape, generator=gen)
    old = values.to(src.device)
    read = torch.empty_like(old)
    torch.cuda.synchronize()
    torch.cuda._sleep(_CYCLES)  # the compute stream is busy; then it reads `old`
    read.copy_(old)
    old_block = _storage(old)
    del old
    got = _guarded("unpack", unpack, packed, side)
    torch.cuda.synchronize()
    if (isinstance(got, torch.Tensor) and got.is_cuda and _storage(got) == old_block
            and not torch.equal(read.cpu(), values)):
        raise _Problem(offload_hint("no_wait_before_copy_back"))
    _same(got, src)


_CYCLES = 200_000_000  # torch.cuda._sleep's spin: tens of milliseconds on any recent GPU


def _sleep_ms(side) -> float:
    """How long ``torch.cuda._sleep(_CYCLES)`` keeps a stream busy here."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    torch.cuda._sleep(_CYCLES)
    end.record()
    end.synchronize()
    return begin.elapsed_time(end)


_KEPT = object()  # marks a saved tensor that stays where it is (not on the GPU, so nothing to offload)


def _check_gradients(pack: Callable, unpack: Callable, side, recorder: _Recorder | None) -> int:
    """The pair as saved-tensor hooks around every decoder layer's checkpoint call of a checkpointed
    tiny Llama (float32), against the same step without them; returns how many tensors pack
    received."""
    from kernels.training.loop import enable_checkpointing
    from kernels.training.models import build_model

    model = build_model("tiny", dtype=torch.float32, seed=0, device=runtime.device())
    enable_checkpointing(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 21), generator=torch.Generator().manual_seed(0))
    ids = ids.to(runtime.device())

    def grads():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain = grads()
    packs = []

    on_gpu = recorder is None

    def hooked_pack(t):
        if on_gpu and t.device.type != "cuda":
            # a host tensor the layer saved (none to offload): what the package's hook leaves too
            return _KEPT, t
        packs.append(tuple(t.shape))
        return _guarded("pack", pack, t, side, recorder=recorder)

    def hooked_unpack(packed):
        if isinstance(packed, tuple) and len(packed) == 2 and packed[0] is _KEPT:
            return packed[1]
        return _guarded("unpack", unpack, packed, side, recorder=recorder)

    hooks = torch.autograd.graph.saved_tensors_hooks(hooked_pack, hooked_unpack)

    def around(checkpoint):
        def checkpoint_with_hooks(function, *args, **kwargs):
            with hooks:
                return checkpoint(function, *args, **kwargs)
        return checkpoint_with_hooks

    layers = list(model.model.layers)
    originals = [layer._gradient_checkpointing_func for layer in layers]
    try:
        for layer in layers:
            layer._gradient_checkpointing_func = around(layer._gradient_checkpointing_func)
        hooked = grads()
    finally:
        for layer, original in zip(layers, originals):
            layer._gradient_checkpointing_func = original
    if not any(len(shape) == 3 for shape in packs):
        raise _Problem(offload_hint("no_checkpoint"))
    # On the CPU the two steps are the same arithmetic, bit for bit. On a GPU, some backward kernels
    # (attention's, the embedding's) add in an order that varies from run to run: equal within
    # float32 rounding there.
    exact = runtime.device().type != "cuda"
    for name, want in plain.items():
        got = hooked.get(name)
        error = relative_error(got, want) if got is not None else float("inf")
        if got is None or not (torch.equal(got,
                                           want) if exact else error <= RELATIVE_ERROR_TOL[torch.float32]):
            raise _Problem(offload_hint("gradients", name=name, error=error))
    return len(packs)


def check_offload_hooks(pack: Callable, unpack: Callable, seed: int | None = None,
                        verbose: bool = True) -> Report:
    """Check the reader's pair ``pack(tensor, side) -> packed`` and ``unpack(packed, side) ->
    tensor`` (see the notes above ``OFFLOAD_HINTS``). Without a GPU, the streams are recording
    stand-ins: the order of the copies, waits and marks is checked, and the verdict says that the
    asynchrony and the pinning were not. Prints the verdict (unless ``verbose=False``) and returns
    it (chapter 14, notebooks/14_long_context.ipynb).

    Args:
        pack: the reader's ``offload_pack(tensor, side) -> packed``, which starts the copy of a
            checkpoint to host memory on the side stream ``side``.
        unpack: the reader's ``offload_unpack(packed, side) -> tensor``, which brings it back to
            the device for the compute stream.
        seed: seed of the random inputs; None draws fresh ones.
        verbose: print the verdict: ✓ and what was (and, without a GPU, was not) checked, or ✗ and
            the missing wait, mark or flag, or the gradient that differs.

    Returns:
        a ``Report``: ``passed``, and the verdict's message.
    """
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    gpu = torch.cuda.is_available() and runtime.MODE == "gpu"
    try:
        if gpu:
            _check_races_on_gpu(pack, unpack, gen)
            packs = _check_gradients(pack, unpack, torch.cuda.Stream(), None)
        else:
            _check_order_on_stand_ins(pack, unpack, gen)
            recorder = _Recorder()
            packs = _check_gradients(pack, unpack, recorder.side, recorder)
    except _Problem as problem:
        return _verdict(False, str(problem), verbose)
    if gpu:
        return _verdict(True, ("on real CUDA streams, with each race provoked: the pack returned "
                               "while its copy was still queued, into pinned memory, after the "
                               "kernels that wrote the tensor and before its memory was reused; "
                               "the copy back waited for the compute stream's kernels, and the "
                               "compute stream for the copy back; and around the checkpointed tiny "
                               f"Llama ({packs} tensors packed) every gradient equals the one "
                               "without hooks, within float32 rounding."),
                        verbose)
    return _verdict(True, ("the order of your calls is right: copies, waits and marks, as recorded "
                           "by stand-ins for the streams; and around the checkpointed tiny Llama "
                           f"({packs} tensors packed) every gradient is equal, bit for bit. NOT "
                           "checked, since there is no GPU here: that the streams really wait for "
                           "each other (no race was provoked), that the pack returns before its "
                           "copy is done, and that the host buffer is pinned (pin_memory=False "
                           "passes here). Run the check on a GPU for those."), verbose)


__all__ = ["TileCase", "CASES", "TracedMLP", "check_tiled_forward", "OFFLOAD_HINTS", "check_offload_hooks"]
