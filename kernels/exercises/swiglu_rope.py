"""Checks for the exercises of chapter 11: the SwiGLU backward as a tile kernel, and the RoPE backward.

``check_swiglu_backward_tile`` launches the reader's *kernel* itself, one program per [ROWS,
BLOCK_N] tile, on tensors that sit inside larger buffers: foreign values around every input, a
sentinel around both outputs. A kernel that stores past the last row or column, before the first
row, at another tensor's stride or into the other gradient's buffer therefore changes memory the
check owns, and the check can say where.

``check_rope_backward`` calls the reader's *function* ``fn(dy, cos, sin) -> dx`` (or launches a
kernel written like the chapter's, with ``launch_rope_one``) on a few fresh inputs: Llama's strided
layout, a head_dim whose half is not a power of two, cos and sin whose two halves differ, bfloat16.

The reader's code runs with each exercise's finished answers out of reach (``reach.FORBIDDEN
["swiglu_bwd_tile_kernel"]`` and ``["rope_bwd_one_kernel"]``: the package's backward kernels and
launchers, the float64 references, PyTorch's SiLU, Hugging Face's RoPE and autograd): calling one,
or handing one to the check, is refused by name. A check shows the derivation it holds the answer to
only once the answer passes.

When a result is wrong, a check recomputes the usual mistakes in float64 and says which one the
output reproduces. Every diagnosis is worded once, in ``HINTS``. A check never raises because the
reader's code is wrong or unfinished: it prints its verdict and returns a :class:`Report`.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton

from kernels import runtime
from kernels.reference import relative_error, rotary_cos_sin
from kernels.tolerances import RELATIVE_ERROR_TOL

from .reach import FinishedCodeCalled, call_learner, finished_answer
from .rmsnorm import Report, bad_elements, generator, last_line, verdict
from .sentences import sentence_lookup

# Every diagnosis, in one place. Fields in braces are filled in for the input at hand.
HINTS = {
    # What the reader's code did rather than what it computed.
    "not_kernel": ("check_swiglu_backward_tile takes a Triton kernel (an @triton.jit function), "
                   "got {got}: the exercise is the kernel itself, its tiles, masks, strides and "
                   "stores"),
    "raised": "your function raised {error}",
    "kernel_raised": "your kernel raised {error}",
    "not_a_tensor": "your function returned {type}, expected a tensor shaped like dy",
    "shape_dtype": ("dx has shape {shape} and dtype {dtype}, expected {want_shape} and "
                    "{want_dtype} (those of dy)"),
    "not_finite": "{name} holds NaN or infinity: an element was read out of bounds or never written",
    "unrecognised": ("{name} differs from float64 (relative error {error:.2e}, bound {tol:g}), "
                     "first at {where}. None of the usual mistakes reproduces it: print it beside "
                     "the reference to see the pattern"),
    # The SwiGLU backward: which memory the kernel wrote.
    "nothing_written": ("nothing was stored, neither d_gate nor d_up: are the stores still "
                        "missing, or the mask still the placeholder? (the stub as given stores "
                        "nothing)"),
    "never_stored": ("{name} was never stored while {other} was: store {name} through {ptr} + the "
                     "tile's offsets, with the mask"),
    "d_gate_into_d_up": ("DUP holds d_gate's values and DGATE was never written: d_gate was stored "
                         "into d_up's buffer. Store d_gate through DGATE and d_up through DUP"),
    "d_up_into_d_gate": ("DGATE holds d_up's values and DUP was never written: d_up was stored "
                         "into d_gate's buffer. Store d_gate through DGATE and d_up through DUP"),
    "swapped": ("the two gradients are swapped: DGATE holds dy·silu(g), which is d_up, and DUP "
                "holds d_gate. d_gate = dy·up·silu'(g) goes to DGATE, d_up = dy·silu(g) to DUP"),
    "rows_past_end": ("{name} was written in {rows}, past its last row ({n_rows} rows): the last "
                      "row block hangs past n_rows, and the mask must switch those rows off: "
                      "(rows[:, None] < n_rows) & (cols[None, :] < n_cols)"),
    "row_at_end": ("{name} was written in row {row}, one past its last: the row mask must be rows "
                   "< n_rows, not <="),
    "rows_before_start": ("{name} was written before its first row: the row index is off by one. "
                          "Program pid's rows are pid * ROWS + tl.arange(0, ROWS), and the first "
                          "one is row 0"),
    "columns_past_end": ("{name} was written in columns {first}–{last}, past its last column "
                         "({n_cols} columns): the mask is missing on the last columns. The last "
                         "column block hangs past n_cols; switch those lanes off with cols[None, "
                         ":] < n_cols, on the loads and on the stores"),
    "output_stride": ("{name}'s rows were written {used} elements apart ({what}), but they are "
                      "{right} apart: offset the outputs' rows by stride_out"),
    "column_blocks": ("only columns 0–{last_right} of {name} were written, the first column block: "
                      "the column index ignores the grid's second axis: cols = tl.program_id(1) * "
                      "BLOCK_N + tl.arange(0, BLOCK_N)"),
    "row_blocks": ("only rows 0–{last_right} of {name} were written, the first row block: the row "
                   "index ignores the grid's first axis: rows = tl.program_id(0) * ROWS + "
                   "tl.arange(0, ROWS), in int64"),
    "tail_columns": ("columns {first}–{last} of {name} are wrong while columns 0–{right} are "
                     "right: the last column block is not computed right: check the column mask "
                     "and that cols start at tl.program_id(1) * BLOCK_N"),
    "tail_rows": ("rows {first}–{last} of {name} are wrong while rows 0–{right} are right: check "
                  "the row mask (rows < n_rows) and that each program starts at its own first row, "
                  "tl.program_id(0) * ROWS"),
    "input_stride": ("the rows of {tensor} were read {used} elements apart ({what}), but they are "
                     "{right} apart: offset {tensor}'s rows by stride_{tensor}"),
    # The SwiGLU backward: what the kernel computed.
    "sigma_prime_sign": ("d_gate has the wrong sign inside silu'(g): it is σ(g)·(1 + g·(1 − σ(g))), a plus, "
                         "because silu'(g) = σ(g) + g·σ(g)·(1 − σ(g))"),
    "no_sigma_prime": ("d_gate is dy·up·σ(g): the σ'(g) term of silu'(g) is missing. silu(g) = g·σ(g), so "
                       "silu'(g) = σ(g) + g·σ'(g) = σ(g)·(1 + g·(1 − σ(g)))"),
    "silu_not_derivative": ("d_gate is dy·up·silu(g): silu itself where its derivative belongs: "
                            "d_gate = dy·up·σ(g)·(1 + g·(1 − σ(g)))"),
    "sigmoid_derivative": ("d_gate is dy·up·σ(g)·(1 − σ(g)), the derivative of σ, not of silu(g) = g·σ(g): "
                           "d_gate = dy·up·σ(g)·(1 + g·(1 − σ(g)))"),
    "d_gate_negated": "d_gate has the wrong sign: d_gate = + dy·up·σ(g)·(1 + g·(1 − σ(g)))",
    "d_gate_no_up": "up is missing from d_gate: y = silu(g)·up, so d_gate = dy·up·silu'(g)",
    "d_gate_no_dy": "dy is missing from d_gate: every gradient is dy times the local derivative",
    "d_up_sigma": "d_up is dy·σ(g): the factor g is missing, d_up = dy·silu(g) = dy·g·σ(g)",
    "d_up_negated": "d_up has the wrong sign: d_up = + dy·silu(g)",
    "d_up_no_dy": "dy is missing from d_up: d_up = dy·silu(g)",
    "d_up_derivative": ("d_up used silu'(g): y = silu(g)·up, so d_up = dy·silu(g), the value, not "
                        "the derivative"),
    "placeholder_zeros": ("every value of {name} is 0: is its line still the placeholder? (the "
                          "stub as given computes zeros)"),
    "no_upcast": ("float32 inputs are right but this bfloat16 one is not ({detail}): the loaded "
                  "tiles were not converted to float32 before the arithmetic. Load, then "
                  ".to(tl.float32): a product of two bfloat16 values is rounded to 8 bits, and "
                  "Triton's interpreter computes bfloat16 arithmetic wrongly"),
    "no_upcast_raised": ("your kernel raised \"{error}\": tl.sigmoid (like tl.exp) takes float32, "
                         "and the tile it got is bfloat16. Convert every loaded tile to float32 "
                         "before any arithmetic: tl.load(...).to(tl.float32)"),
    "truncation": ("values are truncated to bfloat16 instead of rounded: Triton's interpreter truncates "
                   ".to(tl.bfloat16), so store through cast_to(value, DGATE.dtype.element_ty)"),
    "tile_shapes": ("Triton could not combine two blocks of different shapes ({error}): the offsets are "
                    "rows[:, None] * stride + cols[None, :], a [ROWS, BLOCK_N] block, and so is the mask: "
                    "(rows[:, None] < n_rows) & (cols[None, :] < n_cols)"),
    # The RoPE backward.
    "rope_forward": ("your dx is the forward rotation of dy (by +θ). The backward is its "
                     "transpose, the rotation by −θ: dx1 = dy1·cos1 + dy2·sin2 and dx2 = dy2·cos2 "
                     "− dy1·sin1"),
    "rope_no_sin": "your dx is dy·cos alone: the rotate_half term (the partner column times sin) is missing",
    "rope_same_signs": ("both halves add their partner's term: dx2 must subtract it, dx2 = "
                        "dy2·cos2 − dy1·sin1"),
    "rope_own_sin": ("each half multiplies its partner's dy by its own half of sin. The transpose "
                     "moves sin with the partner: dx1 = dy1·cos1 + dy2·sin2, dx2 = dy2·cos2 − "
                     "dy1·sin1 (Llama's equal halves hide this; general cos and sin do not)"),
    "partner_placeholder": ("the partner half is still the placeholder (zeros): load dy2, c2 and "
                            "s2 from the columns D/2 to the right of d: dy_at + half, c_at + half, "
                            "s_at + half"),
    "partner_off_by_one": ("the partner half was read {shift} column{s} {side} of where it is: the "
                           "partner of column d < D/2 is column d + D/2 exactly, so dy2, c2 and s2 "
                           "load from dy_at + half, c_at + half, s_at + half (not half {sign} 1)"),
    "partner_own_half": ("the partner half is the first half again (the offset D/2 is missing): "
                         "dy2, c2 and s2 must load from dy_at + half, c_at + half, s_at + half; "
                         "column d pairs with d + D/2"),
    "rope_contiguous": "dy was read as if contiguous: use the strides of the view",
    "rope_compare": "compare your two lines with dx1 = dy1·cos1 + dy2·sin2, dx2 = dy2·cos2 − dy1·sin1",
}


hint = sentence_lookup(HINTS)


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(device="cpu", dtype=torch.float64)


def _is_kernel(obj) -> bool:
    """A Triton kernel (compiled or interpreted), as opposed to a plain function."""
    return isinstance(obj, triton.runtime.jit.KernelInterface)


def _shorten(text: str, width: int = 160) -> str:
    text = text.strip().strip("'\"")
    return text if len(text) <= width else text[: width - 3] + "..."


# ==================================================================================================
# The SwiGLU backward as a tile kernel
# ==================================================================================================

# The tile every launch of the check uses: ROWS rows × BLOCK_N columns per program, a 2-D grid of
# them. The widths below are no multiple of BLOCK_N (the last column block hangs past n_cols), the
# row counts no multiple of ROWS.
SWIGLU_EXERCISE = "swiglu_bwd_tile_kernel"
SWIGLU_ROWS = 4
SWIGLU_BLOCK_N = 32
GUARD_ROWS = SWIGLU_ROWS + 1  # rows of guard before and after each tensor: a whole tile, and one
# what the outputs' surroundings hold (exact in bfloat16): a kernel that changes it wrote there
SENTINEL = -4096.0
# A bfloat16 gradient computed in float32 and rounded once differs from the check's float32 value in
# at most this fraction of its elements (a last-bit difference of σ on the GPU); arithmetic on
# bfloat16 values differs in most.
BF16_MAX_DIFFERENT = 0.02


@dataclass(frozen=True)
class SwigluCase:
    """One launch: the shape and the row strides of dy, gate, up and of both outputs (every stride
    above the last column block's end, so that a lane past n_cols lands in the memory around the
    tensor, not in the next row)."""

    dtype: torch.dtype
    rows: int
    cols: int
    strides: tuple[int, int, int, int]  # dy, gate, up, out

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')} input of {self.rows} × {self.cols}"

    @property
    def grid(self) -> tuple[int, int]:
        """The launch grid: (tiles of SWIGLU_ROWS rows, blocks of SWIGLU_BLOCK_N columns)."""
        return triton.cdiv(self.rows, SWIGLU_ROWS), triton.cdiv(self.cols, SWIGLU_BLOCK_N)


# float32 first, so that a mistake only bfloat16 shows (the missing upcast) is named as such.
SWIGLU_CASES = (
    # two whole column blocks; two rows of the last tile padding
    SwigluCase(torch.float32, 6, 64, (72, 80, 88, 96)),
    SwigluCase(torch.float32, 9, 100, (136, 144, 152, 160)),  # the last column block has 4 of 32 lanes real
    SwigluCase(torch.bfloat16, 7, 72, (104, 112, 120, 128)),  # the float32 upcast
)
INPUTS = ("dy", "gate", "up")


def _swiglu64(dy, g, u, d_gate: str = "right", d_up: str = "right") -> tuple[torch.Tensor, torch.Tensor]:
    """d_gate and d_up in float64, or one of the usual misreadings of the formulas."""
    dy, g, u = _f64(dy), _f64(g), _f64(u)
    s = torch.sigmoid(g)
    silu, silu_prime = g * s, s * (1 + g * (1 - s))
    gates = {
        "right": dy * u * silu_prime,
        "sigma_prime_sign": dy * u * s * (1 - g * (1 - s)),
        "no_sigma_prime": dy * u * s,
        "silu_not_derivative": dy * u * silu,
        "sigmoid_derivative": dy * u * s * (1 - s),
        "d_gate_negated": -dy * u * silu_prime,
        "d_gate_no_up": dy * silu_prime,
        "d_gate_no_dy": u * silu_prime,
    }
    ups = {
        "right": dy * silu,
        "d_up_sigma": dy * s,
        "d_up_negated": -dy * silu,
        "d_up_no_dy": silu,
        "d_up_derivative": dy * silu_prime,
    }
    return gates[d_gate], ups[d_up]


GATE_MISTAKES = ("sigma_prime_sign", "no_sigma_prime", "silu_not_derivative", "sigmoid_derivative",
                 "d_gate_negated", "d_gate_no_up", "d_gate_no_dy")
UP_MISTAKES = ("d_up_sigma", "d_up_negated", "d_up_no_dy", "d_up_derivative")


def _swiglu32(dy, g, u) -> tuple[torch.Tensor, torch.Tensor]:
    """d_gate and d_up as a right kernel computes them: in float32 from the stored inputs (then
    rounded once)."""
    dy, g, u = (t.detach().cpu().float() for t in (dy, g, u))
    s = torch.sigmoid(g)
    return dy * u * s * (1 + g * (1 - s)), dy * g * s


def _guarded_input(data: torch.Tensor, stride: int, dtype: torch.dtype, gen: torch.Generator):
    """``data`` as a view into a buffer of rows ``stride`` apart, ``GUARD_ROWS`` rows before and
    after, all around it foreign values (about 8, never the tensor's): a kernel that reads them
    computes something visibly different."""
    rows, cols = data.shape
    buffer = 8 + 4 * torch.randn(rows + 2 * GUARD_ROWS, stride, generator=gen, dtype=torch.float64)
    buffer[GUARD_ROWS:GUARD_ROWS + rows, :cols] = data
    buffer = buffer.to(dtype).to(runtime.device())
    return buffer[GUARD_ROWS:GUARD_ROWS + rows, :cols]


def _guarded_output(rows: int, cols: int, stride: int, dtype: torch.dtype):
    """An output view inside a buffer like ``_guarded_input``'s: NaN inside (an element never
    written stays NaN), ``SENTINEL`` around. Returns (buffer, view, a copy of the buffer as it was)."""
    buffer = torch.full((rows + 2 * GUARD_ROWS, stride), SENTINEL, dtype=dtype, device=runtime.device())
    view = buffer[GUARD_ROWS:GUARD_ROWS + rows, :cols]
    view.fill_(float("nan"))
    return buffer, view, buffer.clone()


def _changed(buffer: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """Where ``buffer`` differs from ``before`` bit for bit (NaN included), on the CPU."""
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[buffer.element_size()]
    return (buffer.view(bits) != before.view(bits)).cpu()


def _as_if_strided(t: torch.Tensor, stride: int) -> torch.Tensor:
    """What a kernel reads from (or writes to) the memory of view ``t`` when it steps between rows
    by ``stride``."""
    return torch.as_strided(t, t.shape, (stride, 1))


def _fits(t: torch.Tensor, stride: int) -> bool:
    """Whether rows ``stride`` apart, from ``t``'s first element, stay inside ``t``'s storage."""
    last = t.storage_offset() + (t.shape[0] - 1) * stride + t.shape[1]
    return last * t.element_size() <= t.untyped_storage().nbytes()


def _same(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> bool:
    return not bad_elements(out, ref, dtype).any()


def _first_bad(out: torch.Tensor, ref: torch.Tensor, bad: torch.Tensor) -> str:
    row, col = (int(i) for i in bad.nonzero()[0])
    return (f"row {row}, column {col} (got {_f64(out)[row, col].item():.5g}, expected "
            f"{ref[row, col].item():.5g})")


def _span(noun: str, first: int, last: int) -> str:
    """'row 3' or 'rows 3–5'."""
    return f"{noun} {first}" if first == last else f"{noun}s {first}–{last}"


def _suffix(bad_along: list[bool]) -> int | None:
    """k > 0 when exactly the positions k, k+1, ... are bad; otherwise None."""
    if all(bad_along) or not any(bad_along):
        return None
    k = bad_along.index(True)
    return k if all(bad_along[k:]) else None


def _truncate_bf16(t: torch.Tensor) -> torch.Tensor:
    """float32 → bfloat16 by dropping the low 16 bits (what a truncating conversion does)."""
    bits = t.float().contiguous().view(torch.int32) & -65536  # 0xFFFF0000 as a signed 32-bit integer
    return bits.view(torch.float32).bfloat16()


def _launch_swiglu(kernel, case: SwigluCase, dy, g, u, d_gate, d_up) -> str | None:
    """Launch the reader's kernel; None, or what went wrong. Raises ``FinishedCodeCalled`` when it
    called a finished answer."""
    try:
        # NumPy's overflow warnings of bfloat16 arithmetic: the verdict explains them
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)

            def launch():
                kernel[case.grid](dy, g, u, d_gate, d_up, case.rows, case.cols, dy.stride(0), g.stride(0),
                                  u.stride(0), d_gate.stride(0), ROWS=SWIGLU_ROWS, BLOCK_N=SWIGLU_BLOCK_N)

            call_learner(SWIGLU_EXERCISE, launch, watch=getattr(kernel, "fn", kernel))
    except FinishedCodeCalled:
        raise  # the verdict is the tripwire's alone
    except Exception as error:  # noqa: BLE001  (any failure of the reader's kernel is reported, not raised)
        text, detail = str(error), last_line(error)
        refused = re.search(r"Expected dtype \[[^\]]*\] but got (bf16|fp16)", text)
        if refused:
            return hint("no_upcast_raised", error=refused.group(0).replace("\\'", "'"))
        if "incompatible dimensions" in text or "Cannot broadcast" in text:
            clash = next((line.strip() for line in text.splitlines() if "incompatible dimensions" in line),
                         detail)
            return hint("tile_shapes", error=_shorten(clash))
        return hint("kernel_raised", error=f"{type(error).__name__}: {detail}")
    return None


def _where_written(outputs: dict, case: SwigluCase, refs: dict) -> str | None:
    """None when each output was written inside its own view only; otherwise what was written where."""
    changed = {name: _changed(buf, before) for name, (buf, _, before) in outputs.items()}
    inside = torch.zeros_like(changed["d_gate"])
    inside[GUARD_ROWS:GUARD_ROWS + case.rows, :case.cols] = True
    if not any(c.any() for c in changed.values()):
        return hint("nothing_written")
    views = {name: view for name, (_, view, _) in outputs.items()}
    wrote = {name: bool((c & inside).any()) for name, c in changed.items()}
    # One buffer holds the other gradient's values, or both are swapped.
    holds = {(name, which): _same(views[name], refs[which], case.dtype) for name in views for which in refs}
    if holds[("d_gate", "d_up")] and holds[("d_up", "d_gate")]:
        return hint("swapped")
    if not wrote["d_gate"] and holds[("d_up", "d_gate")]:
        return hint("d_gate_into_d_up")
    if not wrote["d_up"] and holds[("d_gate", "d_up")]:
        return hint("d_up_into_d_gate")
    for name, other, ptr in (("d_gate", "d_up", "DGATE"), ("d_up", "d_gate", "DUP")):
        if not changed[name].any():
            return hint("never_stored", name=name, other=other, ptr=ptr)
    for name, c in changed.items():
        outside = c & ~inside
        if not outside.any():
            continue
        view, right = views[name], views[name].stride(0)
        others = {case.cols: "n_cols, the width", **{s: f"stride_{t}, {t}'s row stride"
                                                     for s, t in zip(case.strides[:3], INPUTS)}}
        for used, what in others.items():
            if used != right and _fits(view, used) and _same(_as_if_strided(view, used), refs[name],
                                                             case.dtype):
                return hint("output_stride", name=name, used=used, what=what, right=right)
        problems = []
        if outside[:GUARD_ROWS].any():
            problems.append(hint("rows_before_start", name=name))
        after = [int(i) + case.rows for i in outside[GUARD_ROWS + case.rows:].any(1).nonzero().flatten()]
        padding_rows = -case.rows % SWIGLU_ROWS
        if after == [case.rows] and padding_rows > 1:
            problems.append(hint("row_at_end", name=name, row=case.rows))
        elif after:
            problems.append(hint("rows_past_end", name=name, rows=_span("row", after[0], after[-1]),
                                 n_rows=case.rows))
        columns = outside[GUARD_ROWS:GUARD_ROWS + case.rows].any(0).nonzero().flatten()
        if len(columns):
            problems.append(hint("columns_past_end", name=name, first=int(columns[0]), last=int(columns[-1]),
                                 n_cols=case.cols))
        return "; and ".join(problems)
    return None


def _values(name: str, out: torch.Tensor, ref: torch.Tensor, suspects: list, case: SwigluCase) -> str | None:
    """None when ``out`` is right; otherwise the most precise explanation of what is wrong with it.
    ``suspects`` are (diagnosis, float64 result) pairs, the usual mistakes recomputed."""
    bad = bad_elements(out, ref, case.dtype)
    if not bad.any() and relative_error(out, ref) < RELATIVE_ERROR_TOL[case.dtype]:
        return None
    out64 = _f64(out)
    if torch.count_nonzero(out64.nan_to_num(1.0)) == 0:
        return hint("placeholder_zeros", name=name)
    for text, wrong in suspects:
        if _same(out, wrong, case.dtype):
            return text
    # Whole column or row blocks never written (still NaN) while the first block is right: a grid
    # axis ignored.
    never = torch.isnan(out64)
    if _suffix(never.all(0).tolist()) == SWIGLU_BLOCK_N and not bad[:, :SWIGLU_BLOCK_N].any():
        return hint("column_blocks", name=name, last_right=SWIGLU_BLOCK_N - 1)
    if _suffix(never.all(1).tolist()) == SWIGLU_ROWS and not bad[:SWIGLU_ROWS].any():
        return hint("row_blocks", name=name, last_right=SWIGLU_ROWS - 1)
    tail = _suffix(bad.any(0).tolist())
    if tail is not None:
        return hint("tail_columns", first=tail, last=case.cols - 1, name=name, right=tail - 1)
    tail = _suffix(bad.any(1).tolist())
    if tail is not None:
        return hint("tail_rows", first=tail, last=case.rows - 1, name=name, right=tail - 1)
    if never.any() or not torch.isfinite(out64).all():
        return f"at {_first_bad(out, ref, bad)}, " + hint("not_finite", name=name)
    return hint("unrecognised", name=name, error=relative_error(out, ref),
                tol=RELATIVE_ERROR_TOL[case.dtype],
                where=_first_bad(out, ref, bad) if bad.any() else "the largest element")


def _stride_suspects(case: SwigluCase, inputs: dict) -> list[tuple[str, dict]]:
    """What the kernel computes when it steps between one input's rows by a wrong stride: the width,
    or another input's stride; each as (the diagnosis, {output name: float64 result})."""
    strides = dict(zip(INPUTS, case.strides[:3]))
    suspects = []
    for name, t in inputs.items():
        wrong = {case.cols: "n_cols, the width", **{s: f"stride_{o}, {o}'s row stride"
                                                    for o, s in strides.items() if o != name}}
        for used, what in wrong.items():
            if used == strides[name] or not _fits(t, used):
                continue
            misread = dict(inputs, **{name: _as_if_strided(t, used)})
            d_gate, d_up = _swiglu64(misread["dy"], misread["gate"], misread["up"])
            suspects.append((hint("input_stride", tensor=name, used=used, what=what, right=strides[name]),
                             {"d_gate": d_gate, "d_up": d_up}))
    return suspects


def _swiglu_values(views: dict, refs: dict, inputs: dict, case: SwigluCase) -> str | None:
    """None when both gradients are right; otherwise what is wrong with the first one that is not."""
    strides = _stride_suspects(case, inputs)
    for name, mistakes, which in (("d_gate", GATE_MISTAKES, 0), ("d_up", UP_MISTAKES, 1)):
        suspects = [(hint(key), _swiglu64(*inputs.values(), **{name: key})[which]) for key in mistakes]
        suspects += [(text, wrong[name]) for text, wrong in strides]
        problem = _values(name, views[name], refs[name], suspects, case)
        if problem is not None:
            return problem
    return None


def _bf16_bits(outs: dict, inputs: dict, fp32_passed: bool) -> str | None:
    """A bfloat16 gradient must be the float32 result rounded once; None when it is (nearly everywhere)."""
    exact = dict(zip(("d_gate", "d_up"), _swiglu32(inputs["dy"], inputs["gate"], inputs["up"])))
    for name, out in outs.items():
        out = out.cpu()
        differs = (out != exact[name].bfloat16()).float().mean().item()
        if differs <= BF16_MAX_DIFFERENT:
            continue
        if (out != _truncate_bf16(exact[name])).float().mean().item() <= BF16_MAX_DIFFERENT:
            return hint("truncation")
        detail = f"{100 * differs:.0f}% of {name}'s values are not the float32 result rounded once"
        if fp32_passed:
            return hint("no_upcast", detail=detail)
        return detail
    return None


def check_swiglu_backward_tile(kernel, seed: int | None = None, verbose: bool = True) -> Report:
    """Check a Triton kernel for the SwiGLU backward, one [ROWS, BLOCK_N] tile per program.

    The check launches it itself, ``(cdiv(n_rows, ROWS), cdiv(n_cols, BLOCK_N))`` programs, as
    ``kernel[grid](DY, GATE, UP, DGATE, DUP, n_rows, n_cols, stride_dy, stride_gate, stride_up,
    stride_out, ROWS=SWIGLU_ROWS, BLOCK_N=SWIGLU_BLOCK_N)``, on tensors inside larger buffers (DGATE
    and DUP share the row stride ``stride_out``), so it sees every element the kernel writes. With y
    = silu(gate)·up, the kernel must store ``d_gate = dy·up·σ(g)·(1 + g·(1 − σ(g)))`` in DGATE and
    ``d_up = dy·silu(g)`` in DUP, computed in float32 and rounded once. Chapter:
    ``notebooks/11_swiglu_rope.ipynb``.

    Args:
        kernel: the reader's ``@triton.jit`` kernel, with the parameters above (something else is
            refused with a verdict that says so).
        seed: seed of the random inputs; None draws fresh ones on every call.
        verbose: print the verdict (False: only return it).

    Returns:
        The ``Report``: ``passed``, and a message that names the first mistake (a wrong value, a
        write outside the outputs, the precision), on which input and where, or, on a pass, the
        largest relative errors. It never raises because ``kernel`` is wrong or unfinished.
    """
    refused = finished_answer(SWIGLU_EXERCISE, kernel)
    if refused is None and not _is_kernel(kernel):
        refused = hint("not_kernel", got=type(kernel).__name__)
    if refused is not None:
        return verdict(False, refused, verbose)
    gen = generator(seed)
    worst: dict[torch.dtype, float] = {}
    for case in SWIGLU_CASES:
        data = {name: torch.randn(case.rows, case.cols, generator=gen, dtype=torch.float64) * scale
                for name, scale in zip(INPUTS, (1.0, 3.0, 1.0))}  # gate × 3: σ in both of its tails
        inputs = {name: _guarded_input(data[name], stride, case.dtype, gen)
                  for (name, stride) in zip(INPUTS, case.strides)}
        outputs = {name: _guarded_output(case.rows, case.cols, case.strides[3], case.dtype)
                   for name in ("d_gate", "d_up")}
        views = {name: view for name, (_, view, _) in outputs.items()}
        refs = dict(zip(("d_gate", "d_up"), _swiglu64(*inputs.values())))
        try:
            problem = _launch_swiglu(kernel, case, *inputs.values(), views["d_gate"], views["d_up"])
        except FinishedCodeCalled as called:
            return verdict(False, str(called), verbose)
        if problem is None:
            problem = _where_written(outputs, case, refs)
        if problem is None:
            problem = _swiglu_values(views, refs, inputs, case)
            # float32 passed, bfloat16 did not
            if problem is not None and case.dtype == torch.bfloat16 and worst:
                detail = ", ".join(f"relative error of {n} {relative_error(views[n], refs[n]):.1e}"
                                   for n in refs)
                problem = hint("no_upcast", detail=detail)
        if problem is None and case.dtype == torch.bfloat16:
            problem = _bf16_bits(views, inputs, fp32_passed=bool(worst))
        if problem is not None:
            return verdict(False, f"on a {case}, {problem}.", verbose)
        worst[case.dtype] = max([worst.get(case.dtype, 0.0)] + [relative_error(views[n],
                                                                               refs[n]) for n in refs])
    errors = ", ".join(f"{str(d).removeprefix('torch.')} {e:.1e}" for d, e in worst.items())
    return verdict(True, (f"SwiGLU backward tile kernel correct on {len(SWIGLU_CASES)} inputs "
                          f"(widths {'/'.join(str(c.cols) for c in SWIGLU_CASES)} in column blocks "
                          f"of {SWIGLU_BLOCK_N}, row counts no multiple of {SWIGLU_ROWS}, strided "
                          "rows, float32 and bfloat16), and nothing written outside d_gate and "
                          f"d_up. Largest relative errors: {errors}. The derivation, for checking "
                          "yours: silu'(g) = s + g·s·(1 − s) = s·(1 + g·(1 − s)) with s = σ(g), so "
                          "d_up = dy·g·s and d_gate = dy·up·s·(1 + g·(1 − s))."), verbose)


# ==================================================================================================
# The RoPE backward
# ==================================================================================================


@dataclass(frozen=True)
class RopeCase:
    """One input of the RoPE backward: dy's dtype, shape and layout, and cos and sin's halves."""

    dtype: torch.dtype
    batch: int
    heads: int
    seq: int
    head_dim: int
    llama_layout: bool = True  # dy as the transposed view Llama's attention makes, else contiguous
    general_halves: bool = False  # cos and sin with two different halves (not Llama's cat((f, f)))

    def __str__(self) -> str:
        text = (f"{str(self.dtype).removeprefix('torch.')} dy of shape [{self.batch}, "
                f"{self.heads}, {self.seq}, {self.head_dim}]")
        text += " (Llama's transposed view)" if self.llama_layout else " (contiguous)"
        if self.general_halves:
            text += " with cos and sin whose two halves differ"
        return text


ROPE_EXERCISE = "rope_bwd_one_kernel"
ROPE_CASES = (
    RopeCase(torch.float32, 1, 2, 3, 8, llama_layout=False),
    RopeCase(torch.float32, 2, 4, 5, 16),
    RopeCase(torch.float32, 2, 3, 4, 12, general_halves=True),  # half = 6: masks matter
    RopeCase(torch.bfloat16, 1, 4, 7, 32),
)


def launch_rope_one(kernel, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_dtype: torch.dtype):
    """Launch a chapter-11-style RoPE kernel over every (batch, head) of ``x``.

    One program per (batch, head), all positions as the rows of a [BLOCK_T, BLOCK_H] tile of one
    half of the head, as ``kernel[(batch * heads,)](X, COS, SIN, OUT, heads, seq, D // 2, x's
    strides of batch, head and position, the same three of OUT, COS's strides of batch and
    position, BLOCK_T=next_power_of_2(seq), BLOCK_H=next_power_of_2(D // 2))``. Chapter:
    ``notebooks/11_swiglu_rope.ipynb``.

    Args:
        kernel: a ``@triton.jit`` kernel with the parameters above.
        x: [batch, heads, seq, D], any strides along its first three dimensions.
        cos, sin: [batch, seq, D] (made contiguous before the launch).
        out_dtype: the dtype of the output.

    Returns:
        The output, of ``x``'s shape and memory layout, in ``out_dtype``.
    """
    batch, heads, seq, dim = x.shape
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty_like(x, dtype=out_dtype)  # keeps x's memory layout, as PyTorch's elementwise ops do
    kernel[(batch * heads,)](x, cos, sin, out, heads, seq, dim // 2, *x.stride()[:3], *out.stride()[:3],
                             cos.stride(0), cos.stride(1), BLOCK_T=triton.next_power_of_2(seq),
                             BLOCK_H=triton.next_power_of_2(dim // 2))
    return out


def _halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = t.shape[-1] // 2
    return t[..., :half], t[..., half:]


def _partner(t: torch.Tensor, shift: int) -> torch.Tensor:
    """The second half as a kernel reads it at columns d + D/2 + shift (d < D/2); NaN where that
    leaves the row."""
    dim = t.shape[-1]
    half = dim // 2
    index = torch.arange(half) + half + shift
    out = t[..., index.clamp(0, dim - 1)].clone()
    out[..., (index < 0) | (index >= dim)] = float("nan")
    return out


def _rope64(dy, cos, sin, mistake: str | None = None) -> torch.Tensor:
    """dx in float64: dx1 = dy1·c1 + dy2·s2, dx2 = dy2·c2 − dy1·s1, or the same with one usual mistake."""
    dy, cos, sin = dy.double().cpu(), cos.double().cpu()[:, None], sin.double().cpu()[:, None]
    (dy1, dy2), (c1, c2), (s1, s2) = _halves(dy), _halves(cos), _halves(sin)
    if mistake is not None and mistake.startswith("partner"):  # the partner half read somewhere else
        shift = {"partner +1": 1, "partner -1": -1, "partner own half": -dy.shape[-1] // 2}.get(mistake)
        if shift is None:  # the placeholders: zeros
            dy2, c2, s2 = (torch.zeros_like(t) for t in (dy2, c2, s2))
        else:
            dy2, c2, s2 = (_partner(t, shift) for t in (dy, cos.expand_as(dy), sin.expand_as(dy)))
        if mistake == "partner stub":  # the stub's two lines as given, with the placeholders
            return torch.cat((dy1 * c1, dy2 * c2), dim=-1)
    if mistake == "forward":  # the forward rotation, by +θ
        return torch.cat((dy1 * c1 - dy2 * s1, dy2 * c2 + dy1 * s2), dim=-1)
    if mistake == "no sin":
        return torch.cat((dy1 * c1, dy2 * c2), dim=-1)
    if mistake == "same signs":
        return torch.cat((dy1 * c1 + dy2 * s2, dy2 * c2 + dy1 * s1), dim=-1)
    # the partner's value times this half's sin, instead of the partner's sin
    if mistake == "own half's sin":
        return torch.cat((dy1 * c1 + dy2 * s1, dy2 * c2 - dy1 * s2), dim=-1)
    return torch.cat((dy1 * c1 + dy2 * s2, dy2 * c2 - dy1 * s1), dim=-1)


# The RoPE mistakes the check recomputes, in the order it tries them, and their diagnoses.
ROPE_MISTAKES = {
    "forward": "rope_forward",
    "no sin": "rope_no_sin",
    "same signs": "rope_same_signs",
    "own half's sin": "rope_own_sin",
    "partner stub": "partner_placeholder",
    "partner zeros": "partner_placeholder",
    "partner own half": "partner_own_half",
    "partner +1": "partner_off_by_one",
    "partner -1": "partner_off_by_one",
}


def _rope_hint(mistake: str) -> str:
    key = ROPE_MISTAKES[mistake]
    if key == "partner_off_by_one":
        plus = mistake.endswith("+1")
        return hint(key, shift=1, s="", side="right" if plus else "left", sign="+" if plus else "-")
    return hint(key)


def _rope_inputs(case: RopeCase, gen: torch.Generator):
    device = runtime.device()
    shape = (case.batch, case.seq, case.heads, case.head_dim) if case.llama_layout else (
        case.batch, case.heads, case.seq, case.head_dim)
    dy = torch.randn(shape, generator=gen).to(device, case.dtype)
    if case.llama_layout:
        dy = dy.transpose(1, 2)
    if case.general_halves:
        cos, sin = (torch.randn(case.batch, case.seq, case.head_dim,
                                generator=gen).to(device) for _ in range(2))
    else:
        positions = torch.randint(0, 4096, (case.batch, case.seq), generator=gen).to(device)
        cos, sin = rotary_cos_sin(case.batch, case.seq, case.head_dim, theta=10_000.0, dtype=case.dtype,
                                  device=device, positions=positions)
    return dy, cos.to(case.dtype), sin.to(case.dtype)


def _rope_call(fn, dy, cos, sin, case):
    try:
        if _is_kernel(fn):
            out = call_learner(ROPE_EXERCISE, launch_rope_one, fn, dy, cos, sin, dy.dtype,
                               watch=getattr(fn, "fn", fn))
        else:
            out = call_learner(ROPE_EXERCISE, fn, dy, cos, sin)
    except FinishedCodeCalled as called:
        return None, str(called)
    except Exception as error:  # noqa: BLE001  (any failure of the reader's code is reported, not raised)
        key = "kernel_raised" if _is_kernel(fn) else "raised"
        return None, f"on a {case}, " + hint(key, error=f"{type(error).__name__}: {last_line(error)}")
    if not isinstance(out, torch.Tensor):
        return None, f"on a {case}, " + hint("not_a_tensor", type=type(out).__name__)
    if out.shape != dy.shape or out.dtype != dy.dtype:
        return None, f"on a {case}, " + hint("shape_dtype", shape=tuple(out.shape), dtype=out.dtype,
                                             want_shape=tuple(dy.shape), want_dtype=dy.dtype)
    return out.detach(), None


def _close_where_defined(out: torch.Tensor, ref: torch.Tensor, tol: float) -> bool:
    """``out`` matches ``ref`` wherever ``ref`` is defined (a mistake that reads past the row leaves
    NaN there)."""
    defined = torch.isfinite(ref)
    return bool(defined.any()) and relative_error(_f64(out)[defined], ref[defined]) < tol


def _rope_diagnose(out, dy, cos, sin, case) -> str:
    tol = RELATIVE_ERROR_TOL[case.dtype]
    if not torch.isfinite(out.float()).all():
        return f"on a {case}, " + hint("not_finite", name="dx")
    for mistake in ROPE_MISTAKES:
        if _close_where_defined(out, _rope64(dy, cos, sin, mistake), tol):
            return f"on a {case}: {_rope_hint(mistake)}."
    ref = _rope64(dy, cos, sin)
    wrong = ((_f64(out) - ref).abs() > 1e-2 * ref.abs().max().item() + 1e-3).nonzero()
    b, h, t, d = (int(i) for i in wrong[0])
    where = "first half" if d < case.head_dim // 2 else "second half"
    contiguous = case.llama_layout and not _close_where_defined(out, _rope64(dy.contiguous(), cos, sin), tol)
    advice = hint("rope_contiguous") if contiguous else hint("rope_compare")
    return (f"on a {case}, dx differs from float64 (relative error "
            f"{relative_error(out, ref):.2e}), first at batch {b}, head {h}, position {t}, column "
            f"{d} ({where}); {len(wrong)} elements are off. Hint: {advice}.")


def check_rope_backward(fn: Callable, seed: int | None = None, verbose: bool = True) -> Report:
    """Check the RoPE backward: the gradient of ``x·cos + rotate_half(x)·sin`` with respect to x.

    ``fn`` is either a function ``fn(dy, cos, sin) -> dx`` or a Triton kernel written like chapter
    11's, which the check launches with ``launch_rope_one``. ``dy`` is [batch, heads, seq, head_dim]
    (possibly Llama's transposed view), ``cos`` and ``sin`` are [batch, seq, head_dim]; dx must have
    dy's shape and dtype. Chapter: ``notebooks/11_swiglu_rope.ipynb``.

    Args:
        fn: the reader's ``fn(dy, cos, sin) -> dx``, or their ``@triton.jit`` kernel (launched
            with ``launch_rope_one``).
        seed: seed of the random inputs; None draws fresh ones on every call.
        verbose: print the verdict (False: only return it).

    Returns:
        The ``Report``: ``passed``, and a message that names the first mistake, on which input and
        where, or, on a pass, the largest relative errors and the two halves' formulas. It never
        raises because ``fn`` is wrong or unfinished.
    """
    refused = finished_answer(ROPE_EXERCISE, fn)
    if refused is not None:
        return verdict(False, refused, verbose)
    gen = generator(seed)
    worst: dict[torch.dtype, float] = {}
    for case in ROPE_CASES:
        dy, cos, sin = _rope_inputs(case, gen)
        out, problem = _rope_call(fn, dy, cos, sin, case)
        if problem is None:
            error = relative_error(out, _rope64(dy, cos, sin))
            if not error < RELATIVE_ERROR_TOL[case.dtype]:
                problem = _rope_diagnose(out, dy, cos, sin, case)
            worst[case.dtype] = max(worst.get(case.dtype, 0.0), error)
        if problem is not None:
            return verdict(False, problem, verbose)
    errors = ", ".join(f"{str(d).removeprefix('torch.')} {e:.1e}" for d, e in worst.items())
    return verdict(True, (f"RoPE backward correct on {len(ROPE_CASES)} inputs (Llama's strided "
                          "layout, head_dim 8/16/12/32, cos and sin with unequal halves, "
                          f"bfloat16). Largest relative errors: {errors}. The halves, for checking "
                          "yours: dx1 = dy1·cos1 + dy2·sin2, dx2 = dy2·cos2 − dy1·sin1."),
                   verbose)
