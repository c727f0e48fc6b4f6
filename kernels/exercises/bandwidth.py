"""Check for the exercise of chapters 04 and 07: predict a memory-bound kernel's floor from the
bytes it moves.

The reader writes two functions:

    minimal_bytes(M, N, dtype) -> int    the fewest bytes the kernel's forward + backward over
                                         [M, N] moves
    floor_us(n_bytes, gbps) -> float     the time those bytes take at a copy bandwidth of ``gbps``
                                         GB/s, in µs

Chapter 04 counts RMSNorm over x [M, N] with its weight [N]; chapter 07 the cross-entropy over [N,
V] logits (N tokens, V words; its chapter writes ``minimal_bytes(N, V, dtype)``, and the messages
name the dimensions so, see ``DIMS``), read twice and its gradient written once, the design of this
package's kernel. Each kernel's tensor transfers are listed once, in ``TRANSFERS``.
``check_floor(minimal_bytes, floor_us, kernel)`` is the same check for both chapters:

* ``minimal_bytes`` is run on several shapes in bf16 and in float32, and its answer split into bytes
  per element of the [rows, columns] tensors, per element of a [columns] vector (the weight), per
  row and a constant. The first two must be what the transfers add up to; per-row scalars (RMSNorm's
  float32 rstd, the cross-entropy's int64 targets and float32 logsumexp) may be counted or left out,
  as ``kernels.bench.sweep`` leaves them out. A wrong count is compared with what the usual mistakes
  add up to, alone or two at a time (``BYTES_MISTAKES``, ``EXTRA_TRANSFERS``, ``SIZE_MISTAKES``),
  and a count in kB, MB or GiB instead of bytes is named as such.
* ``floor_us`` is run on a few byte counts and bandwidths; an answer a constant factor away from the
  right one names the unit mistake that factor comes from (``FLOOR_MISTAKES``), alone or two at a
  time.

Both run with their exercise's finished answers out of reach (``reach.FORBIDDEN``: the package's
count ``transfer_bytes``, the sweep's ``rmsnorm_bytes``/``cross_entropy_bytes``,
``timing.floor_ms``): a call of one is refused by name. Every diagnosis is worded once, in
``HINTS``. The check never raises because the reader's code is unfinished or wrong: it prints a
verdict and returns a :class:`~kernels.exercises.rmsnorm.Report`.

``compare_floor`` then sets the floor beside measured device times of the package's kernel: the rows
of a results file of ``kernels.bench.sweep`` (the committed GPU run,
``kernels.bench.results.load_results``) or a time measured in the chapter, each against the copy
bandwidth measured in the same run.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from kernels.bench.timing import floor_ms

from .reach import FinishedCodeCalled, call_learner
from .rmsnorm import Report, last_line

KERNELS = ("rmsnorm", "cross_entropy")
# What each chapter calls the two dimensions: M tokens × N hidden for RMSNorm, N tokens × V words
# for the loss.
DIMS = {"rmsnorm": ("M", "N"), "cross_entropy": ("N", "V")}


@dataclass(frozen=True)
class Transfer:
    """One tensor moved once between memory and the chip: ``per`` is ``"element"`` for a [rows,
    columns] tensor, ``"column"`` for a [columns] one (RMSNorm's weight), each element of the data's
    dtype."""

    tensor: str
    step: str  # when it moves: "forward"/"backward" (RMSNorm), "first pass"/"second pass" (cross-entropy)
    direction: str  # "read" or "write"
    per: str

    def __str__(self) -> str:
        return f"{self.tensor} ({self.step})"


TRANSFERS: dict[str, tuple[Transfer, ...]] = {
    "rmsnorm": (
        Transfer("x", "forward", "read", "element"),
        Transfer("w", "forward", "read", "column"),
        Transfer("y", "forward", "write", "element"),
        Transfer("x", "backward", "read", "element"),
        Transfer("dy", "backward", "read", "element"),
        Transfer("w", "backward", "read", "column"),
        Transfer("dx", "backward", "write", "element"),
        Transfer("dW", "backward", "write", "column"),
    ),
    "cross_entropy": (
        Transfer("logits", "first pass", "read", "element"),  # the running max and sum: the logsumexp
        Transfer("logits", "second pass", "read", "element"),  # again, to compute the gradient
        Transfer("gradient", "second pass", "write", "element"),  # over the logits, in place
    ),
}

# Per-row scalars a count may hold or leave out, in bytes per row at most: RMSNorm's float32 rstd
# (written by the forward, read by the backward); the cross-entropy's int64 target (read in each
# pass) and float32 logsumexp and loss.
ROW_SLACK = {"rmsnorm": 8, "cross_entropy": 32}
# A constant that depends on no shape (a scalar loss, a scale) may be counted too, up to this many bytes.
CONSTANT_SLACK = 64

# The usual ways of miscounting, each a filter over the transfers it keeps (a kernel lists those
# that apply to it).
BYTES_MISTAKES: dict[str, dict[str, Callable[[Transfer], bool]]] = {
    "rmsnorm": {
        "reads_only": lambda t: t.direction == "read",
        "writes_only": lambda t: t.direction == "write",
        "forward_only": lambda t: t.step == "forward",
        "backward_only": lambda t: t.step == "backward",
        "x_once": lambda t: not (t.tensor == "x" and t.step == "backward"),
        "no_dw": lambda t: t.tensor != "dW",
        "no_weight": lambda t: t.per != "column",
    },
    "cross_entropy": {
        "reads_only": lambda t: t.direction == "read",
        "writes_only": lambda t: t.direction == "write",
        "logits_once": lambda t: not (t.tensor == "logits" and t.step == "second pass"),
    },
}

# The usual ways of counting a transfer that does not happen: the transfer each adds.
EXTRA_TRANSFERS: dict[str, dict[str, Transfer]] = {
    "rmsnorm": {"y_read": Transfer("y", "backward", "read", "element")},
    "cross_entropy": {"four_transfers": Transfer("gradient", "second pass", "write", "element")},
}

# Element sizes a count may use instead of the dtype's: the bytes per element it gives for a dtype
# of ``itemsize``.
SIZE_MISTAKES: dict[str, Callable[[int], int]] = {
    "element_in_bits": lambda itemsize: 8 * itemsize,
    "float32_size": lambda itemsize: 4,
    "fixed_2_bytes": lambda itemsize: 2,
}

# Unit mistakes of floor_us: the factor each puts on the right answer.
FLOOR_MISTAKES: dict[str, float] = {
    "milliseconds": 1e-3,
    "seconds": 1e-6,
    "nanoseconds": 1e3,
    "gib": 1e9 / 2**30,
    "gib_bytes": 2**30 / 1e9,
    "bytes_as_bits": 8.0,
    "gigabits": 1 / 8,
    "halved_bandwidth": 2.0,
    "doubled_bandwidth": 0.5,
}

HINTS = {
    # minimal_bytes: what is missing or broken
    "not_done_bytes": ("not done yet: minimal_bytes returns None. Count the bytes of every tensor "
                       "the kernel reads or writes: {transfers}"),
    "not_done_floor": ("not done yet: floor_us returns None. Divide the bytes by the bandwidth in "
                       "bytes per second, and give the time in microseconds"),
    "raised": "{name} raised {error} for {args}",
    "not_a_number": "{name} returned {type} for {args}, expected a number",
    # minimal_bytes: the mistakes
    "reads_only": "you counted only the reads ({reads}): the writes move bytes too ({writes})",
    "writes_only": "you counted only the writes ({writes}): the reads move bytes too ({reads})",
    "forward_only": "you counted the forward alone ({forward}): the backward moves bytes too ({backward})",
    "backward_only": "you counted the backward alone ({backward}): the forward moves bytes too ({forward})",
    "x_once": ("x is counted once: the forward and the backward are two kernels, run at different "
               "moments of the step, so each reads x from memory (the backward recomputes x·rstd "
               "from it)"),
    "no_dw": ("the weight gradient's write is missing (or the weight's read in one of the passes): "
              "the backward writes dW, N elements, and both passes read w"),
    "no_weight": ("the weight is left out: no read of w, no write of dW. That is the sweep's count "
                  "(sweep.rmsnorm_bytes, 5·M·N·s), which leaves them out as a rounding error at "
                  "Llama sizes; count them here: w read by each pass and dW written once, N "
                  "elements each"),
    "logits_once": ("the [{rows}, {cols}] logits are read once in your count, but this design "
                    "reads each row twice: once for its running max and sum (the logsumexp), once "
                    "more to write the gradient. Three logit-sized transfers, not two; one read is "
                    "the floor of a design that keeps the whole row on chip"),
    "y_read": ("you counted y read by the backward: the backward reads x and dy (and w) and "
               "recomputes x·rstd from x; y is written once, by the forward, and read by the next "
               "layer, not by this kernel"),
    "four_transfers": ("your count holds four [{rows}, {cols}] transfers (the output counted "
                       "twice, or the logits read three times): this design reads the logits "
                       "twice, once for the logsumexp and once for the gradient, and writes the "
                       "gradient once, over the logits: three transfers"),
    "element_in_bits": ("the element size is in bits: torch.finfo(dtype).bits is 16 for bf16, and "
                        "a byte count needs bytes, dtype.itemsize (2)"),
    "float32_size": ("4 bytes per element is float32's size, but the data here are bf16, 2 bytes "
                     "per element: take the size from the dtype (dtype.itemsize)"),
    "fixed_2_bytes": ("the element size is fixed at 2 bytes: float32 data have 4 bytes per "
                      "element; take the size from the dtype (dtype.itemsize)"),
    "two_mistakes": "two mistakes at once: {first}; and {second}",
    "ambiguous": "your count fits more than one mistake, so look for either: {options}",
    "per_row": ("your count holds {per_row:g} bytes per row, beyond the [{rows}, {cols}] and "
                "[{cols}] tensors: the per-row scalars (float32 or int64, a few per row) add at "
                "most {slack} bytes per row, and none below zero"),
    "constant": ("your count holds a constant {constant:g} bytes that grows with no shape: a "
                 "kernel's bytes grow with its tensors"),
    "not_linear": ("your count does not grow like the kernel's tensors, which add bytes in "
                   "proportion to {rows}·{cols} (the [{rows}, {cols}] tensors), to {cols} (a "
                   "[{cols}] vector such as a weight) and to {rows} (per-row scalars): at {shape} "
                   "it gives {got:,}; the transfers add up to {expected:,}"),
    "not_bytes": ("your count is in {unit}, not bytes: at {shape} it gives {got:g} where the "
                  "transfers add up to {expected:,} bytes. Return bytes; floor_us divides them by "
                  "the bandwidth"),
    "unrecognised": ("at {shape} your count is {got:,} bytes, the transfers add up to "
                     "{expected:,}. Per element of [{rows}, {cols}] you count {got_element:g} "
                     "bytes, the transfers {element:g}{column_terms}. The transfers: {transfers}"),
    "column_terms": "; per element of [{cols}] you count {got_column:g}, the transfers {column:g}",
    "passed_bytes": ("minimal_bytes is right on {cases} shapes in bf16 and float32: at {shape} it "
                     "counts {total:,} bytes, {per_element:g} per element of [{rows}, "
                     "{cols}]{column_note}"),
    "column_note": ("; the weight and dW add {column:,} bytes, {share:.4%} of the total, the rounding error "
                    "sweep.rmsnorm_bytes leaves out"),
    # floor_us
    "milliseconds": "the floor is in milliseconds: a microsecond is a thousandth of one, so multiply by 1e3",
    "seconds": "the floor is in seconds: multiply by 1e6 for microseconds",
    "nanoseconds": "the floor is in nanoseconds: divide by 1e3 for microseconds",
    "gib": ("the bandwidth is taken as GiB/s (2**30 bytes per second): the copy bandwidth is "
            "measured in GB/s, 1e9 bytes per second"),
    "gib_bytes": ("bytes and bandwidth are in different units, one in GiB (2**30 bytes) and the "
                  "other in GB (1e9): the floor is n_bytes / (gbps · 1e9) seconds"),
    "bytes_as_bits": "the bytes are turned into bits (× 8): GB/s counts bytes per second",
    "gigabits": "the bandwidth is multiplied by 8, as if GB/s were gigabits: it counts bytes per second",
    "halved_bandwidth": ("the bandwidth is halved (or the bytes doubled): the copy bandwidth "
                         "already counts the bytes read plus the bytes written, as minimal_bytes "
                         "does, so divide by it as it is"),
    "doubled_bandwidth": ("the floor is half what it should be: the bandwidth doubled, or the "
                          "bytes halved; the copy bandwidth and minimal_bytes both count reads "
                          "plus writes, once each"),
    "multiplied": "the bytes are multiplied by the bandwidth: a time is bytes divided by bytes per second",
    "inverted": "the bandwidth is divided by the bytes: a time is bytes divided by bytes per second",
    "unrecognised_floor": ("for {n_bytes:,} bytes at {gbps:g} GB/s your floor_us gives {got:.6g} "
                           "µs; the floor is n_bytes / (gbps · 1e9) seconds, {expected:.6g} µs"),
    "passed_floor": "floor_us is right: {n_bytes:,} bytes at {gbps:,.0f} GB/s take {us:.1f} µs",
}

# Shapes minimal_bytes is run on: four to split its answer into its terms, then others to confirm the split.
_FIT_SHAPES = ((1000, 512), (3000, 512), (1000, 2048), (3000, 2048))
_CONFIRM_SHAPES = ((16384, 4096), (7, 128256), (333, 777), (1, 1))
_DTYPES = (torch.bfloat16, torch.float32)
_SHOWN = {"rmsnorm": (16384, 4096), "cross_entropy": (16384, 128256)}
# Units a count may come back in instead of bytes, and how many bytes each is.
_UNITS = {"kB (1e3 bytes)": 1e3, "MB (1e6 bytes)": 1e6, "GB (1e9 bytes)": 1e9, "KiB (2**10 bytes)": 2**10,
          "MiB (2**20 bytes)": 2**20, "GiB (2**30 bytes)": 2**30}
# (bytes, GB/s) floor_us is run on.
_FLOOR_CASES = ((671_088_640, 4000.0), (1_000_000, 3350.0), (12_345_678, 2039.5))


def hint(key: str, kernel: str = "rmsnorm", **fields) -> str:
    """The diagnosis ``HINTS[key]`` with its fields filled in, the dimensions named as ``kernel``'s
    chapter names them.

    Args:
        key: a key of ``HINTS``.
        kernel: ``"rmsnorm"`` (rows M, columns N, chapter 04) or ``"cross_entropy"`` (N tokens, V
            words, chapter 07); picks the names of ``DIMS``.
        **fields: the hint's other fields (byte counts, shapes, the reader's answer).

    Returns:
        the hint's text.

    Raises:
        KeyError: when ``key`` or ``kernel`` is unknown, or a field the hint names is missing.
    """
    rows, cols = DIMS[kernel]
    return HINTS[key].format(rows=rows, cols=cols, **fields)


def _check_kernel(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float32: "float32"}.get(dtype, str(dtype).removeprefix("torch."))


def _shape(kernel: str, m: int, n: int, dtype: torch.dtype) -> str:
    rows, cols = DIMS[kernel]
    return f"{rows}={m:,}, {cols}={n:,}, {_dtype_name(dtype)}"


def _listing(transfers: Iterable[Transfer]) -> str:
    return ", ".join(str(t) for t in transfers) or "nothing"


def transfer_bytes(kernel: str, m: int, n: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """The bytes ``kernel``'s forward + backward over [m, n] moves: every transfer of ``TRANSFERS``,
    each [m, n] tensor m·n elements and each [n] tensor n elements of ``dtype``, per-row scalars
    left out. The package's answer to the exercise's ``minimal_bytes`` (chapters 04 and 07).

    Args:
        kernel: ``"rmsnorm"`` (x [m, n], weight [n]) or ``"cross_entropy"`` (logits [m, n]).
        m, n: rows and columns of the kernel's [rows, columns] tensors.
        dtype: the tensors' element type.

    Returns:
        the byte count.

    Raises:
        ValueError: when ``kernel`` is not one of ``KERNELS``.
    """
    _check_kernel(kernel)
    element, column = _count(TRANSFERS[kernel], dtype.itemsize)
    return element * m * n + column * n


def _count(transfers: Iterable[Transfer], size: int) -> tuple[int, int]:
    """(bytes per element of the [rows, columns] tensors, bytes per element of the [columns] ones)
    of ``transfers`` at ``size`` bytes per element."""
    transfers = list(transfers)
    return (size * sum(t.per == "element" for t in transfers),
            size * sum(t.per == "column" for t in transfers))


# --------------------------------------------------------------------------------------------------
# Calling the reader's functions
# --------------------------------------------------------------------------------------------------


class _Problem(Exception):
    """What is wrong, in words: ends a check early."""


class _NotDone(_Problem):
    """The reader's function returned None: the stub as the chapter ships it."""


# The name each function's exercise has in ``reach.FORBIDDEN`` (its solution's name).
_EXERCISES = {("minimal_bytes", "rmsnorm"): "rmsnorm_minimal_bytes",
              ("minimal_bytes", "cross_entropy"): "cross_entropy_minimal_bytes",
              ("floor_us", "rmsnorm"): "floor_us", ("floor_us", "cross_entropy"): "floor_us"}


def _number(fn: Callable, name: str, args: tuple, shown: str, kernel: str = "rmsnorm") -> float:
    """``fn(*args)`` as a finite float, run with its exercise's finished answers out of reach."""
    try:
        out = call_learner(_EXERCISES[name, kernel], fn, *args)
    except FinishedCodeCalled as called:
        raise _Problem(str(called)) from None
    except Exception as error:  # noqa: BLE001  (any failure of the reader's code is reported, not raised)
        raise _Problem(hint("raised", name=name, error=f"{type(error).__name__}: {last_line(error)}",
                            args=shown)) from None
    if out is None:
        raise _NotDone(name)
    if isinstance(out, bool):
        raise _Problem(hint("not_a_number", name=name, type="bool", args=shown))
    try:
        value = float(out)
    except (TypeError, ValueError):
        raise _Problem(hint("not_a_number", name=name, type=type(out).__name__, args=shown)) from None
    if not math.isfinite(value):
        raise _Problem(hint("not_a_number", name=name, type=f"the non-finite {value}", args=shown))
    return value


def _close(a: float, b: float, rel: float = 1e-6) -> bool:
    return math.isclose(a, b, rel_tol=rel)


# --------------------------------------------------------------------------------------------------
# minimal_bytes
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Terms:
    """A count split into bytes per [rows, columns] element, per [columns] element, per row and a
    constant."""

    element: float
    column: float
    row: float
    constant: float

    def at(self, m: int, n: int) -> float:
        return self.element * m * n + self.column * n + self.row * m + self.constant


def _terms(fn: Callable, kernel: str, dtype: torch.dtype) -> _Terms:
    """Split ``fn``'s count at ``dtype`` into its terms (four shapes fix them), then confirm them on
    other shapes."""
    f = {(m, n): _number(fn, "minimal_bytes", (m, n, dtype), _shape(kernel, m, n, dtype), kernel)
         for m, n in _FIT_SHAPES}
    (m1, n1), (m2, _), (_, n2) = _FIT_SHAPES[0], _FIT_SHAPES[1], _FIT_SHAPES[2]
    element = (f[m2, n2] - f[m1, n2] - f[m2, n1] + f[m1, n1]) / ((m2 - m1) * (n2 - n1))
    column = (f[m1, n2] - f[m1, n1]) / (n2 - n1) - element * m1
    row = (f[m2, n1] - f[m1, n1]) / (m2 - m1) - element * n1
    constant = f[m1, n1] - element * m1 * n1 - column * n1 - row * m1
    return _Terms(element, column, row, constant)


def _candidates(kernel: str) -> list[tuple[tuple[str, ...], dict[torch.dtype, tuple[int, int]]]]:
    """Every way of counting with at most two of the usual mistakes (at most one of them an element
    size): the mistakes' names and the (per-element, per-column) bytes they give for each dtype. The
    right count comes first."""
    transfers, filters, extras = TRANSFERS[kernel], BYTES_MISTAKES[kernel], EXTRA_TRANSFERS[kernel]
    counting = [*filters, *extras]
    combos: list[tuple[str, ...]] = [()]
    combos += [(k,) for k in counting] + [(k,) for k in SIZE_MISTAKES]
    combos += [pair for pair in itertools.combinations(counting, 2)]
    combos += [(f, s) for f in counting for s in SIZE_MISTAKES]
    out = []
    for combo in combos:
        kept = [t for t in transfers if all(filters[k](t) for k in combo if k in filters)]
        kept += [extras[k] for k in combo if k in extras]
        size_mistake = next((SIZE_MISTAKES[k] for k in combo if k in SIZE_MISTAKES), None)
        out.append((combo, {dt: _count(kept, size_mistake(dt.itemsize) if size_mistake else dt.itemsize)
                            for dt in _DTYPES}))
    return out


def _mistake_words(kernel: str, key: str) -> str:
    transfers = TRANSFERS[kernel]
    groups = {
        "reads": [t for t in transfers if t.direction == "read"],
        "writes": [t for t in transfers if t.direction == "write"],
        "forward": [t for t in transfers if t.step == "forward"],
        "backward": [t for t in transfers if t.step == "backward"],
    }
    return hint(key, kernel, **{k: _listing(v) for k, v in groups.items()})


def _name_mistakes(kernel: str, combo: tuple[str, ...]) -> str:
    words = [_mistake_words(kernel, k) for k in combo]
    return words[0] if len(words) == 1 else hint("two_mistakes", first=words[0], second=words[1])


def _check_bytes(fn: Callable, kernel: str) -> str | None:
    """None when ``fn`` counts the kernel's bytes right, else what is wrong."""
    got: dict[torch.dtype, _Terms] = {}
    for dtype in _DTYPES:
        terms = _terms(fn, kernel, dtype)
        for m, n in _CONFIRM_SHAPES:
            shape = _shape(kernel, m, n, dtype)
            value = _number(fn, "minimal_bytes", (m, n, dtype), shape, kernel)
            if not _close(value, terms.at(m, n)):
                right = transfer_bytes(kernel, m, n, dtype)
                raise _Problem(_in_units(value, right, shape)
                               or hint("not_linear", kernel, shape=shape, got=_show_int(value),
                                       expected=right))
        got[dtype] = terms
    seen = {dt: (t.element, t.column) for dt, t in got.items()}
    candidates = _candidates(kernel)
    matching = [combo for combo, counts in candidates if all(_close(seen[dt][0], counts[dt][0])
                                                            and _close(seen[dt][1],
                                                                       counts[dt][1]) for dt in _DTYPES)]
    if matching and matching[0] == ():
        for terms in got.values():
            if not (-1e-6 <= terms.row <= ROW_SLACK[kernel] + 1e-6):
                return hint("per_row", kernel, per_row=terms.row, slack=ROW_SLACK[kernel])
            if not (-1e-6 <= terms.constant <= CONSTANT_SLACK + 1e-6):
                return hint("constant", constant=terms.constant)
        return None
    if matching:
        fewest = min(len(c) for c in matching)
        best = [c for c in matching if len(c) == fewest]
        if len(best) == 1:
            return _name_mistakes(kernel, best[0])
        return hint("ambiguous", options=" — or — ".join(_name_mistakes(kernel, c) for c in best))
    dtype = next((dt for dt in _DTYPES if seen[dt] != _count(TRANSFERS[kernel], dt.itemsize)), _DTYPES[0])
    m, n = _SHOWN[kernel]
    got_total, right_total = got[dtype].at(m, n), transfer_bytes(kernel, m, n, dtype)
    in_units = _in_units(got_total, right_total, _shape(kernel, m, n, dtype))
    if in_units:
        return in_units
    element, column = _count(TRANSFERS[kernel], dtype.itemsize)
    column_terms = ""
    if column or got[dtype].column:
        column_terms = hint("column_terms", kernel, got_column=got[dtype].column, column=column)
    return hint("unrecognised", kernel, shape=_shape(kernel, m, n, dtype), got=_show_int(got_total),
                expected=right_total,
                got_element=got[dtype].element, element=element,
                column_terms=column_terms,
                transfers=f"{_listing(TRANSFERS[kernel])}, {dtype.itemsize} bytes per element")


def _in_units(got: float, right: int, shape: str) -> str | None:
    """The diagnosis of a count given in kB, MB, GB, KiB, MiB or GiB instead of bytes, if it is one."""
    for unit, factor in _UNITS.items():
        if _close(got, right / factor, rel=1e-3):
            return hint("not_bytes", unit=unit, shape=shape, got=got, expected=right)
    return None


def _show_int(value: float) -> int | float:
    return int(value) if float(value).is_integer() else value


def _bytes_passed(fn: Callable, kernel: str) -> str:
    m, n = _SHOWN[kernel]
    total = int(_number(fn, "minimal_bytes", (m, n, torch.bfloat16),
                        _shape(kernel, m, n, torch.bfloat16), kernel))
    element, column = _count(TRANSFERS[kernel], 2)
    column_note = ""
    if column:
        column_note = hint("column_note", column=column * n, share=column * n / total)
    return hint("passed_bytes", kernel, cases=len(_FIT_SHAPES) + len(_CONFIRM_SHAPES),
                shape=_shape(kernel, m, n, torch.bfloat16),
                total=total, per_element=element, column_note=column_note)


# --------------------------------------------------------------------------------------------------
# floor_us
# --------------------------------------------------------------------------------------------------


def floor_reference_us(n_bytes: float, gbps: float) -> float:
    """The floor in µs: ``n_bytes`` at ``gbps`` GB/s (1e9 bytes per second),
    ``kernels.bench.timing.floor_ms`` × 1e3; the answer the reader's ``floor_us`` is held to.

    Args:
        n_bytes: the bytes moved.
        gbps: the copy bandwidth, in GB/s.

    Returns:
        the time those bytes take at that bandwidth, in µs.
    """
    return floor_ms(n_bytes, gbps) * 1e3


def _check_floor_us(fn: Callable) -> str | None:
    got = []
    for n_bytes, gbps in _FLOOR_CASES:
        value = _number(fn, "floor_us", (n_bytes, gbps), f"n_bytes={n_bytes:,}, gbps={gbps:g}")
        got.append((n_bytes, gbps, value, floor_reference_us(n_bytes, gbps)))
    ratios = [value / expected for _, _, value, expected in got]
    if all(_close(r, 1.0) for r in ratios):
        return None
    if all(_close(r, ratios[0]) for r in ratios) and ratios[0] > 0:
        ratio = ratios[0]
        singles = [(k,) for k in FLOOR_MISTAKES]
        pairs = list(itertools.combinations(FLOOR_MISTAKES, 2))
        for combo in singles + pairs:
            if _close(ratio, math.prod(FLOOR_MISTAKES[k] for k in combo)):
                words = [hint(k) for k in combo]
                return words[0] if len(words) == 1 else hint("two_mistakes", first=words[0], second=words[1])
    # Not a constant factor: is it bytes × bandwidth, or bandwidth / bytes, up to a constant?
    for key, shape in (("multiplied", lambda n, g: n * g), ("inverted", lambda n, g: g / n)):
        scaled = [value / shape(n, g) for n, g, value, _ in got]
        if scaled[0] != 0 and all(_close(s, scaled[0]) for s in scaled):
            return hint(key)
    n_bytes, gbps, value, expected = next(c for c, r in zip(got, ratios) if not _close(r, 1.0))
    return hint("unrecognised_floor", n_bytes=n_bytes, gbps=gbps, got=value, expected=expected)


# --------------------------------------------------------------------------------------------------
# The check
# --------------------------------------------------------------------------------------------------


def _run(check: Callable, fn: Callable, *args) -> tuple[str | None, bool]:
    """(what is wrong or None, whether the function is still the unfinished stub)."""
    try:
        return check(fn, *args), False
    except _NotDone:
        return None, True
    except _Problem as problem:
        return str(problem), False


def check_floor(minimal_bytes: Callable, floor_us: Callable, kernel: str = "rmsnorm",
                verbose: bool = True) -> Report:
    """Check the reader's ``minimal_bytes(M, N, dtype)`` for ``kernel`` (``"rmsnorm"`` or
    ``"cross_entropy"``) and ``floor_us(n_bytes, gbps)``. Prints one verdict line for each (unless
    ``verbose=False``) and returns the ``Report``, passed when both are right (chapters 04 and 07,
    notebooks/04_rmsnorm_benchmark.ipynb and notebooks/07_cross_entropy_benchmark.ipynb).

    Never raises for the reader's code: an error, a non-number, a stub's None or a call of a
    finished answer is reported in its function's line.

    Args:
        minimal_bytes: the reader's ``minimal_bytes(M, N, dtype) -> int``, the fewest bytes the
            kernel's forward + backward over [M, N] moves.
        floor_us: the reader's ``floor_us(n_bytes, gbps) -> float``, the time in µs those bytes take
            at ``gbps`` GB/s.
        kernel: which kernel the bytes are counted for, ``"rmsnorm"`` or ``"cross_entropy"``.
        verbose: print the two verdict lines (✓ or ✗ each).

    Returns:
        a ``Report``: ``passed`` when both functions are right, and the two lines as its message
        (for a wrong answer, the mistake it reproduces).

    Raises:
        ValueError: when ``kernel`` is not one of ``KERNELS``.
    """
    _check_kernel(kernel)
    lines, passed = [], True
    for name, check, fn, args in (("minimal_bytes", _check_bytes, minimal_bytes, (kernel,)),
                                  ("floor_us", _check_floor_us, floor_us, ())):
        problem, not_done = _run(check, fn, *args)
        if not_done:
            problem = (hint("not_done_bytes",
                            transfers=_listing(TRANSFERS[kernel])) if name == "minimal_bytes"
                       else hint("not_done_floor"))
        if problem is None:
            lines.append("✓ " + (_bytes_passed(fn, kernel) if name == "minimal_bytes" else hint(
                "passed_floor", n_bytes=_FLOOR_CASES[0][0], gbps=_FLOOR_CASES[0][1],
                us=floor_reference_us(*_FLOOR_CASES[0]))))
        else:
            passed = False
            lines.append(f"✗ {name}: {problem}")
    report = Report(passed, "\n".join(lines))
    if verbose:
        print(report.message)
    return report


# --------------------------------------------------------------------------------------------------
# The prediction against the clock
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Measurement:
    """A device time of the kernel's forward + backward over [m, n], with the copy bandwidth of the
    same run."""

    m: int
    n: int
    device_ms: float
    copy_gbps: float
    dtype: torch.dtype = torch.bfloat16
    source: str = ""


def measurements(results: dict, label: str = "", impl: str = "ours",
                 pass_: str = "fwd+bwd") -> list[Measurement]:
    """The device times of ``impl`` in a results dict of ``kernels.bench.sweep`` (GPU runs only: an
    interpreter's wall-clock times say nothing about a GPU's floor), each with the copy bandwidth
    measured in that run; their source reads ``label`` (such as "committed run"), the device and the
    date.

    Args:
        results: a results dict as ``kernels.bench.sweep`` writes it (``mode``, ``ceilings``,
            ``rows``, ``device``, ``date``), or None.
        label: the words that open each measurement's source.
        impl: the implementation whose rows are taken.
        pass_: the pass whose rows are taken (``"fwd+bwd"``).

    Returns:
        one ``Measurement`` per row of ``impl`` and ``pass_`` that ran; empty when ``results`` is
        None, is not a GPU run or holds no copy bandwidth.
    """
    if (results is None or results.get("mode") != "gpu"
            or not (results.get("ceilings") or {}).get("copy_gbps")):
        return []
    copy = results["ceilings"]["copy_gbps"]
    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    source = ", ".join(part for part in (label, results.get("device"),
                                         str(results.get("date", ""))[:10]) if part)
    return [Measurement(r["tokens"], r["width"], r["device_ms"], copy,
                        dtypes.get(r.get("dtype"), torch.bfloat16), source)
            for r in results["rows"]
            if r["impl"] == impl and r["pass"] == pass_ and r.get("device_ms") and r.get("status") == "ok"]


def _yours(minimal_bytes, floor_us, m: int, n: int, dtype, copy: float, kernel: str) -> float | None:
    """The reader's floor at one shape, or None where their functions give no number of their own
    (unfinished, failing, or calling a finished answer)."""
    try:
        n_bytes = _number(minimal_bytes, "minimal_bytes", (m, n, dtype), "", kernel)
        return _number(floor_us, "floor_us", (n_bytes, copy), "", kernel)
    except _Problem:  # an unfinished or refused answer leaves its column empty
        return None


def compare_floor(kernel: str, measured: Iterable[Measurement], minimal_bytes: Callable | None = None,
                  floor_us: Callable | None = None, verbose: bool = True) -> list[dict]:
    """The floor beside each measured device time: the package's count (``transfer_bytes``) at the
    copy bandwidth of the measurement's run, and, where the reader's ``minimal_bytes`` and
    ``floor_us`` give a number, theirs. Prints a table (unless ``verbose=False``) and returns its
    rows (chapters 04 and 07).

    Args:
        kernel: ``"rmsnorm"`` or ``"cross_entropy"``.
        measured: the device times, as ``measurements`` returns them.
        minimal_bytes, floor_us: the reader's functions, as ``check_floor`` takes them; None (either
            one) leaves the column 'yours' empty.
        verbose: print the table, and under it whether the reader's floor agrees with the package's
            (or is beaten by a measured time, which shows it is wrong).

    Returns:
        one dict per measurement: ``m``, ``n``, ``bytes``, ``copy_gbps``, ``floor_us``,
        ``yours_us`` (None where the reader's functions give no number), ``device_us``,
        ``floor_over_device`` and ``source``.

    Raises:
        ValueError: when ``kernel`` is not one of ``KERNELS``.
    """
    _check_kernel(kernel)
    rows = []
    for meas in measured:
        n_bytes = transfer_bytes(kernel, meas.m, meas.n, meas.dtype)
        floor = floor_reference_us(n_bytes, meas.copy_gbps)
        yours = (_yours(minimal_bytes, floor_us, meas.m, meas.n, meas.dtype, meas.copy_gbps, kernel)
                 if minimal_bytes is not None and floor_us is not None else None)
        rows.append({"m": meas.m, "n": meas.n, "bytes": n_bytes, "copy_gbps": meas.copy_gbps,
                     "floor_us": floor, "yours_us": yours, "device_us": meas.device_ms * 1e3,
                     "floor_over_device": floor / (meas.device_ms * 1e3), "source": meas.source})
    if verbose:
        print(_format(rows, minimal_bytes is not None))
    return rows


def _format(rows: list[dict], asked_for_yours: bool) -> str:
    if not rows:
        return "no GPU device times to compare with"
    lines, source = [], None
    head = (f"{'shape':>14} {'MB moved':>9} {'floor µs':>9} {'yours µs':>9} {'device µs':>10} "
            f"{'floor ÷ device':>15}")
    for r in rows:
        if r["source"] != source:
            source = r["source"]
            lines += [f"{source}: copy bandwidth {r['copy_gbps']:,.0f} GB/s, measured in the same run", head]
        yours = f"{r['yours_us']:9.1f}" if r["yours_us"] is not None else f"{'—':>9}"
        lines.append(f"{r['m']:>6,}×{r['n']:<7,} {r['bytes'] / 1e6:9.1f} {r['floor_us']:9.1f} {yours} "
                     f"{r['device_us']:10.1f} {r['floor_over_device']:15.0%}")
    beaten = [r for r in rows if r["yours_us"] is not None and r["yours_us"] > r["device_us"] * 1.001]
    if beaten:
        r = beaten[0]
        lines.append(f"✗ at {r['m']:,}×{r['n']:,} the kernel ran in {r['device_us']:.1f} µs, under "
                     f"your floor of {r['yours_us']:.1f} µs: no kernel beats its floor, so the "
                     "floor is wrong (check_floor says why)")
    elif asked_for_yours and all(r["yours_us"] is None for r in rows):
        lines.append("(your minimal_bytes and floor_us give no number yet: the column 'yours' stays empty)")
    elif asked_for_yours and all(r["yours_us"] is not None and _close(r["yours_us"], r["floor_us"], rel=1e-3)
                                 for r in rows):
        lines.append("✓ your floor is the package's at every shape")
    elif asked_for_yours:
        lines.append("your floor differs from the package's at some shapes: check_floor above says why")
    return "\n".join(lines)
