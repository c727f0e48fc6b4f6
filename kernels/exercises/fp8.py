"""Check for chapter 18's exercise: a Triton kernel that quantises one row to FP8 with its own scale.

The reader completes ``quantize_row_kernel(X, Q, S, cols, stride_x, FP8_MAX_VALUE, FLOOR, FP8,
MBITS, EMIN, BLOCK)``: one program per row, the whole row in one block of ``BLOCK`` lanes (the
width's next power of two). It stores the row's float32 scale ``amax(|x|) / FP8_MAX_VALUE`` (at
least ``FLOOR``; 1 for a row of zeros) into ``S[row]``, and the FP8 codes of ``x / scale``, clamped to
±FP8_MAX_VALUE and converted by ``kernels.fp8.fp8_bits``, into row ``row`` of ``Q``: the uint8 bytes
of a contiguous [rows, cols] FP8 tensor, whose rows are ``cols`` apart whatever x's stride.

``check_quantize_row_kernel`` launches the kernel itself, ``kernel[(rows,)](x, q, s, cols,
x.stride(0), FLOOR=SCALE_FLOOR, **fp8_format(fp8_dtype), BLOCK=next_power_of_2(cols))``, on three
fresh bfloat16 inputs: rows of very different magnitudes with a row of zeros and a row whose largest
magnitude is a negative outlier, in e4m3; a strided view of an odd width with a row of tiny values
(its scale is the floor); and large rows in e5m2. Around each input lie foreign values, and around
each output guard memory: a read past the last column changes a scale, a store past it changes
memory the check owns. It compares the scales exactly and the codes bit for bit with
``quantize_rows_reference``, and when they differ recomputes the usual mistakes in PyTorch and names
the one the output reproduces; every diagnosis is worded once, in ``HINTS``. A missing clamp is not
among them: with the right scale, ``x / scale`` passes FP8_MAX_VALUE by at most a rounding step,
which the conversion rounds back onto FP8_MAX_VALUE, so no output shows it.

The package's quantiser, its operator, its kernel and its references are out of reach while the
reader's kernel runs (``reach.FORBIDDEN["quantize_row_kernel"]``). A check never raises because the
reader's code is wrong or unfinished: it prints its verdict and returns a ``Report``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from kernels import runtime
from kernels.fp8 import FP8_MAX, SCALE_FLOOR, fp8_format, quantize_rows_reference, triton_problem

from .reach import FinishedCodeCalled, call_learner
from .rmsnorm import Report, generator, last_line, verdict
from .sentences import sentence_lookup

EXERCISE = "quantize_row_kernel"
FOREIGN = 2.0 ** 20  # what lies around x's rows: larger than any row's values, exact in bfloat16
Q_SENTINEL = 0xA5  # what Q's memory holds before the launch
S_SENTINEL = -1234.5  # what S's memory holds before the launch (a scale is never negative)
S_GUARD = 4  # scales of guard after S

HINTS = {
    "not_kernel": ("{name} is not a Triton kernel (got {type}): decorate it with @triton.jit, so that "
                   "the check can launch it as kernel[(rows,)](...)"),
    "raised": "your kernel raised {error}",
    "no_fp8": ("this GPU cannot run Triton's FP8 conversion ({problem}): run the chapter on a GPU of "
               "compute capability 8.9 and up, or on the CPU, where Triton's interpreter runs it"),
    "stub": ("nothing was stored into Q or S: is the kernel still the stub? Store each row's scale "
             "at S + row and its codes, fp8_bits(y, FP8, MBITS, EMIN), at Q + row * cols + c"),
    "q_never_stored": ("the scales were stored but no code was: store fp8_bits(y, FP8, MBITS, EMIN) "
                       "at Q + row * cols + c, with the mask c < cols"),
    "s_never_stored": "the codes were stored but no scale was: store the row's scale at S + row",
    "scale_slot": ("only S[0] was written: every program stored its scale into the same slot. One "
                   "scale per row, at S + row"),
    "s_outside": ("S was written past its last row ({count} slots of guard): S holds one scale per "
                  "row, at S + row"),
    "no_divide": ("the scales are amax(|x|) itself: the scale maps the row's largest magnitude onto "
                  "the format's largest value, so it is amax / FP8_MAX_VALUE"),
    "inverted": ("the scales are FP8_MAX_VALUE / amax, upside down: x ≈ q · scale, so scale = amax / "
                 "FP8_MAX_VALUE, and y = x / scale"),
    "signed_max": ("row {row}'s scale is {got:.4g}, that of its largest value, not of its largest "
                   "magnitude ({want:.4g}): its largest magnitude is negative. Take the max of "
                   "tl.abs(x)"),
    "per_tensor": ("every row got the same scale, {got:.4g}, that of the whole tensor's amax: the "
                   "exercise is one scale per row. A row of small values under one tensor-wide scale "
                   "lands in FP8's coarse, subnormal bottom (row {row} here: its own scale is "
                   "{want:.4g})"),
    "hard448": ("the scales divide by 448, e4m3's largest value, on an e5m2 input: divide by "
                "FP8_MAX_VALUE, the launched format's (57,344 for e5m2)"),
    "load_mask": ("row {row}'s scale is {got:.4g}: its amax counted values past its last column "
                  "(expected {want:.4g}). BLOCK is the width's next power of two; load with mask=c < "
                  "cols and other=0.0, so that the extra lanes hold 0"),
    "stride": ("the scales are those of rows read cols apart: x's rows are stride_x apart in memory "
               "(here {stride}, the width is {cols}). Load X + row * stride_x + c"),
    "scale_rounding": ("row {row}'s scale is {got!r}, expected {want!r}: right but for the last bits. "
                       "Compute amax / FP8_MAX_VALUE with tl.math.div_rn, IEEE division, the bits "
                       "PyTorch's `/` gives: a product with the reciprocal, or `/` on a GPU, rounds "
                       "otherwise"),
    "zero_nan": ("row {row} is all zeros and its scale is {got!r}: 0 / FP8_MAX_VALUE is 0, and x / 0 "
                 "is NaN. A row of zeros gets scale 1: scale = tl.where(amax == 0, 1.0, scale)"),
    "zero_floor": ("row {row} is all zeros and its scale is FLOOR ({got:.4g}): a row of zeros gets "
                   "scale 1, tl.where(amax == 0, 1.0, scale), so that its scale stays an ordinary "
                   "number whoever multiplies by it"),
    "no_floor": ("row {row} holds tiny values (amax {amax:.3g}) and its scale is {got:.4g}, below FLOOR "
                 "({floor:.4g}): amax / FP8_MAX_VALUE underflows into float32's subnormals there, "
                 "and to 0 where those are flushed. scale = tl.maximum(amax / FP8_MAX_VALUE, FLOOR)"),
    "scale": ("row {row}'s scale is {got!r}, expected {want!r} (amax {amax:.4g} / FP8_MAX_VALUE "
              "{fp8_max:g}, at least FLOOR, 1 for a row of zeros)"),
    "q_stride": ("the codes were stored stride_x apart: Q is a contiguous [rows, cols] tensor, its "
                 "rows cols apart, whatever x's stride (here {stride}, the width is {cols}). Store "
                 "at Q + row * cols + c"),
    "store_mask": ("{count} codes were stored past Q's last column: the lanes c ≥ cols are "
                   "padding. Store with mask=c < cols"),
    "multiplied": ("the scales are right, but the codes are of x · scale: divide, y = x / scale "
                   "(x ≈ q · scale)"),
    "clamp448": ("the scales are right, but the codes are clamped to ±448, e4m3's largest value, "
                 "on an e5m2 input: clamp to ±FP8_MAX_VALUE, the launched format's"),
    "rounding": ("{count} of {total} codes are a rounding away from the right ones (first Q[{row}, "
                 "{col}] = {got:#04x}, expected {want:#04x}): store fp8_bits(y, FP8, MBITS, EMIN), "
                 "which rounds to nearest-even (Triton's interpreter converts y.to(FP8) wrongly: it "
                 "drops the carry of a rounding), and divide with tl.math.div_rn"),
    "codes": ("{count} of {total} codes differ, first Q[{row}, {col}] = {got:#04x} ({got_value:.4g}), "
              "expected {want:#04x} ({want_value:.4g} = x / scale clamped to ±FP8_MAX_VALUE and "
              "rounded to the nearest FP8 value)"),
    "passed": ("your kernel quantises every row as the package's quantiser does on {n} inputs "
               "({what}): scales exactly, codes bit for bit, nothing written outside Q and S"),
}
hint = sentence_lookup(HINTS)


@dataclass(frozen=True)
class QuantCase:
    """One input: its format, shape and row stride, each row's magnitude (0 for a row of zeros,
    None for a row of tiny values), and the row whose largest magnitude is a negative outlier."""

    fp8: torch.dtype
    cols: int
    stride: int
    magnitudes: tuple[float | None, ...]
    outlier_row: int | None = None

    @property
    def rows(self) -> int:
        """The number of rows."""
        return len(self.magnitudes)

    @property
    def block(self) -> int:
        """BLOCK: the width's next power of two."""
        return triton.next_power_of_2(self.cols)

    def __str__(self) -> str:
        fmt = "e4m3" if self.fp8 == torch.float8_e4m3fn else "e5m2"
        view = f", a view whose rows are {self.stride} elements apart" if self.stride != self.cols else ""
        return f"the {fmt} input of {self.rows} × {self.cols}{view}"


CASES = (
    QuantCase(torch.float8_e4m3fn, 64, 64, (0.01, 1.0, 0.0, 300.0, 2.0, 0.1), outlier_row=4),
    QuantCase(torch.float8_e4m3fn, 37, 48, (3.0, None, 0.5, 40.0, 0.02)),
    QuantCase(torch.float8_e5m2, 50, 72, (1e4, 1.0, 300.0, 5.0), outlier_row=1),
)
WHAT = ("rows of magnitudes from 0.01 to 10,000, a row of zeros, a negative outlier, an odd width "
        "in a strided view, a row of tiny values, e4m3 and e5m2")


@dataclass
class Buffers:
    """One launch's memory: x's flat buffer and its [rows, cols] view, the codes' and the scales'
    flat buffers and their views, and copies of the outputs' buffers before the launch."""

    x_flat: torch.Tensor
    x: torch.Tensor
    q_flat: torch.Tensor
    q: torch.Tensor
    s_flat: torch.Tensor
    s: torch.Tensor
    q_before: torch.Tensor
    s_before: torch.Tensor


def _data(case: QuantCase, gen: torch.Generator) -> torch.Tensor:
    """The rows, float64: random values times each row's magnitude, the outlier, the tiny row."""
    data = torch.randn(case.rows, case.cols, generator=gen, dtype=torch.float64)
    for row, magnitude in enumerate(case.magnitudes):
        if magnitude is None:
            # Normal bfloat16 values between 2⁻¹²⁴ and 2⁻¹¹⁹: amax / 448 is below float32's
            # smallest normal number, so the scale is the floor.
            exponent = -124 + 5 * torch.rand(case.cols, generator=gen, dtype=torch.float64)
            data[row] = torch.where(data[row] < 0, -1.0, 1.0) * 2.0 ** exponent
        else:
            data[row] *= magnitude
    if case.outlier_row is not None:
        row = case.outlier_row
        col = int(torch.randint(case.cols, (1,), generator=gen))
        size = 1 + float(torch.rand(1, generator=gen, dtype=torch.float64))
        data[row, col] = -40 * case.magnitudes[row] * size
    return data


def buffers(case: QuantCase, gen: torch.Generator) -> Buffers:
    """Fresh memory for one launch: x a bfloat16 view inside foreign values, Q and S inside guards.

    Args:
        case: the input.
        gen: the generator the values are drawn from.

    Returns:
        The ``Buffers``: x's flat buffer holds ``rows × stride + BLOCK`` values, Q's as many bytes,
        so that a kernel's reads and stores at ``row × stride + c`` for every lane stay inside memory
        the check owns.
    """
    device = runtime.device()
    size = case.rows * case.stride + case.block
    x_flat = torch.full((size,), FOREIGN, dtype=torch.float64)
    x_flat[:case.rows * case.stride].view(case.rows, case.stride)[:, :case.cols] = _data(case, gen)
    x_flat = x_flat.to(torch.bfloat16).to(device)
    x = x_flat[:case.rows * case.stride].view(case.rows, case.stride)[:, :case.cols]
    q_flat = torch.full((size,), Q_SENTINEL, dtype=torch.uint8, device=device)
    s_flat = torch.full((case.rows + S_GUARD,), S_SENTINEL, dtype=torch.float32, device=device)
    return Buffers(x_flat, x, q_flat, q_flat[:case.rows * case.cols].view(case.rows, case.cols),
                   s_flat, s_flat[:case.rows], q_flat.clone(), s_flat.clone())


def _launchable(obj) -> bool:
    return callable(getattr(obj, "__getitem__", None))


def _launch(kernel, case: QuantCase, mem: Buffers) -> None:
    kernel[(case.rows,)](mem.x, mem.q, mem.s, case.cols, mem.x.stride(0), FLOOR=SCALE_FLOOR,
                         **fp8_format(case.fp8), BLOCK=case.block)


def _run(kernel, case: QuantCase, mem: Buffers) -> str | None:
    """Launch the reader's kernel with the finished answers out of reach: None, or the verdict."""
    try:
        call_learner(EXERCISE, _launch, kernel, case, mem, watch=getattr(kernel, "fn", kernel))
    except FinishedCodeCalled as called:
        return str(called)
    except Exception as error:  # noqa: BLE001  (the reader's error is the verdict)
        return f"on {case}, " + hint("raised", error=f"{type(error).__name__}: {last_line(error)}")
    return None


def _unwritten(case: QuantCase, mem: Buffers) -> str | None:
    """Which output was never stored, or stored into the wrong slots of S."""
    q_untouched = bool((mem.q == Q_SENTINEL).all())
    s_unwritten = (mem.s == S_SENTINEL).cpu()
    if q_untouched and s_unwritten.all():
        return hint("stub")
    if q_untouched:
        return hint("q_never_stored")
    if s_unwritten.all():
        return hint("s_never_stored")
    if s_unwritten[1:].all() and case.rows > 1:
        return hint("scale_slot")
    past = int((mem.s_flat[case.rows:] != mem.s_before[case.rows:]).sum())
    if past:
        return hint("s_outside", count=past)
    return None


# --------------------------------------------------------------------------------------------------
# The scales: the usual mistakes, recomputed
# --------------------------------------------------------------------------------------------------


def _amax(rows: torch.Tensor) -> torch.Tensor:
    return rows.double().abs().amax(dim=1)


def _rows_at(flat: torch.Tensor, rows: int, apart: int, width: int) -> torch.Tensor:
    """[rows, width] of a flat buffer, its rows ``apart`` elements apart: what a kernel whose rows
    start at ``row * apart`` and span ``width`` lanes reads or writes."""
    return torch.stack([flat[r * apart:r * apart + width] for r in range(rows)])


def _close(got: torch.Tensor, want: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether ``got`` equals ``want`` to a relative 1e-6 on the rows ``rows`` selects."""
    g, w = got.double()[rows], want.double()[rows]
    return bool(((g - w).abs() <= 1e-6 * w.abs()).all())


def _scale_suspects(case: QuantCase, mem: Buffers) -> list[tuple[str, torch.Tensor]]:
    """(hint, the scales that mistake gives), float64, one per row."""
    x = mem.x.cpu().double()
    amax = _amax(x)
    fp8_max = FP8_MAX[case.fp8]
    flat = mem.x_flat.cpu().double()
    past_end = _rows_at(flat, case.rows, case.stride, case.block)
    cols_apart = _rows_at(flat, case.rows, case.cols, case.cols)
    return [
        ("no_divide", amax),
        ("inverted", fp8_max / amax),
        ("per_tensor", torch.full_like(amax, float(amax.max()) / fp8_max)),
        ("hard448", amax / 448.0),
        ("load_mask", _amax(past_end) / fp8_max),
        ("stride", _amax(cols_apart) / fp8_max),
        ("signed_max", x.amax(dim=1).clamp_min(0) / fp8_max),
    ]


def _worst_row(got: torch.Tensor, want: torch.Tensor, rows: torch.Tensor) -> int:
    """The row of ``rows`` where ``got`` is furthest from ``want``, relatively."""
    error = ((got.double() - want.double()).abs() / want.double().abs()).nan_to_num(nan=float("inf"))
    return int(torch.where(rows, error, -1.0).argmax())


def _check_scales(case: QuantCase, mem: Buffers, want: torch.Tensor) -> str | None:
    """The scales against the reference's: None when exact, else the mistake they reproduce."""
    got = mem.s.cpu()
    if torch.equal(got, want):
        return None
    x = mem.x.cpu()
    amax = _amax(x)
    # Rows of ordinary values first: the row of zeros and the tiny row have diagnoses of their own.
    ordinary = (amax / FP8_MAX[case.fp8] >= SCALE_FLOOR) & (amax > 0)
    if not _close(got, want, ordinary):
        for key, suspect in _scale_suspects(case, mem):
            if _close(suspect, want, ordinary) or not _close(got, suspect, ordinary):
                continue  # that mistake gives the right scales here, or not these
            row = _worst_row(suspect, want, ordinary)
            return hint(key, row=row, got=float(got[row]), want=float(want[row]), stride=case.stride,
                        cols=case.cols)
    elif not torch.equal(got[ordinary], want[ordinary]):
        row = _worst_row(got, want, ordinary)
        return hint("scale_rounding", row=row, got=float(got[row]), want=float(want[row]))
    for row in range(case.rows):
        g, w = float(got[row]), float(want[row])
        if g == w:
            continue
        if amax[row] == 0 and (g == 0 or g != g or g == float("inf")):
            return hint("zero_nan", row=row, got=g)
        if amax[row] == 0 and g == SCALE_FLOOR:
            return hint("zero_floor", row=row, got=g)
        if amax[row] > 0 and w == SCALE_FLOOR and g < SCALE_FLOOR:
            return hint("no_floor", row=row, amax=float(amax[row]), got=g, floor=SCALE_FLOOR)
        return hint("scale", row=row, got=g, want=w, amax=float(amax[row]), fp8_max=FP8_MAX[case.fp8])
    return None


# --------------------------------------------------------------------------------------------------
# The codes
# --------------------------------------------------------------------------------------------------


def _codes(y: torch.Tensor, fp8: torch.dtype, limit: float) -> torch.Tensor:
    """The uint8 codes of float32 ``y`` clamped to ±limit."""
    y = torch.where(y > limit, limit, torch.where(y < -limit, -limit, y))
    return y.to(fp8).view(torch.uint8)


def _outside_q(case: QuantCase, mem: Buffers, want: torch.Tensor) -> str | None:
    """What the kernel stored past Q's end, in words; None when nothing."""
    tail = mem.q_flat[case.rows * case.cols:].cpu()
    changed = int((tail != mem.q_before[case.rows * case.cols:].cpu()).sum())
    if not changed:
        return None
    flat = mem.q_flat.cpu()
    if case.stride != case.cols:
        at_stride = _rows_at(flat, case.rows, case.stride, case.cols)
        if torch.equal(at_stride, want):
            return hint("q_stride", stride=case.stride, cols=case.cols)
    return hint("store_mask", count=changed)


def _a_rounding_away(got: torch.Tensor, want: torch.Tensor, fp8: torch.dtype) -> bool:
    """Whether the differing codes are few (an eighth at most), each of the right sign and within
    one binade of the right one: a rounding the other way, or its carry into the exponent dropped."""
    differ = got != want
    if differ.float().mean() > 1 / 8:
        return False
    g, w = got[differ].int(), want[differ].int()
    binade = 1 << {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}[fp8]
    return bool(((g & 0x80) == (w & 0x80)).all() and ((g & 0x7F) - (w & 0x7F)).abs().le(binade).all())


def _check_codes(case: QuantCase, mem: Buffers, want: torch.Tensor, scale: torch.Tensor) -> str | None:
    """The codes against the reference's (the scales being right): None, or the mistake."""
    problem = _outside_q(case, mem, want)
    if problem is not None:
        return problem
    got = mem.q.cpu()
    if torch.equal(got, want):
        return None
    x = mem.x.cpu().float()
    fp8_max = FP8_MAX[case.fp8]
    suspects = [("multiplied", _codes(x * scale[:, None], case.fp8, fp8_max))]
    if fp8_max != 448.0:
        suspects.append(("clamp448", _codes(x / scale[:, None], case.fp8, 448.0)))
    for key, suspect in suspects:
        if not torch.equal(suspect, want) and (suspect == got).float().mean() >= 0.99:
            return hint(key)
    row, col = (int(i) for i in (got != want).nonzero()[0])
    fields = dict(count=int((got != want).sum()), total=got.numel(), row=row, col=col,
                  got=int(got[row, col]), want=int(want[row, col]))
    if _a_rounding_away(got, want, case.fp8):
        return hint("rounding", **fields)
    value = {code: float(torch.tensor([fields[code]], dtype=torch.uint8).view(case.fp8).float())
             for code in ("got", "want")}
    return hint("codes", got_value=value["got"], want_value=value["want"], **fields)


def check_quantize_row_kernel(kernel, verbose: bool = True, seed: int | None = None) -> Report:
    """Check the reader's per-row FP8 quantiser: scales exactly, codes bit for bit.

    Chapter: ``notebooks/18_fp8_lora.ipynb``.

    Args:
        kernel: the reader's ``@triton.jit`` kernel, launched by the check as ``kernel[(rows,)](x,
            q, s, cols, x.stride(0), FLOOR=SCALE_FLOOR, **fp8_format(fp8_dtype),
            BLOCK=next_power_of_2(cols))``, q being the uint8 view of the FP8 codes.
        verbose: print the verdict.
        seed: the inputs' seed; None draws fresh inputs on every call.

    Returns:
        The ``Report``: passed, and the message that names what is right or what is wrong.
    """
    if not _launchable(kernel):
        name = getattr(kernel, "__name__", "the object given")
        return verdict(False, hint("not_kernel", name=name, type=type(kernel).__name__), verbose)
    problem = triton_problem(runtime.device())
    if problem is not None:
        return verdict(False, hint("no_fp8", problem=problem), verbose)
    gen = generator(seed)
    for case in CASES:
        mem = buffers(case, gen)
        want_q, want_s = quantize_rows_reference(mem.x.cpu(), case.fp8)
        want_q = want_q.view(torch.uint8)
        problem = _run(kernel, case, mem)
        if problem is not None:
            return verdict(False, problem, verbose)
        problem = (_unwritten(case, mem) or _check_scales(case, mem, want_s)
                   or _check_codes(case, mem, want_q, want_s))
        if problem is not None:
            return verdict(False, f"on {case}: {problem}", verbose)
    return verdict(True, hint("passed", n=len(CASES), what=WHAT), verbose)
