"""Check for the exercise of chapter 17: the residual add fused into RMSNorm's forward.

The reader writes the forward of ``h = x + residual; y = rms_norm(h) · weight``: one read of x
and of the residual, h and y written, float32 inside, and Hugging Face's casts (the add rounded to
the model's dtype, as ``residual + hidden_states`` is; the norm of that rounded h, rounded again
before the weight's product).

``check_add_rms_norm`` takes either the reader's Triton *kernel*, which it launches itself, one
program per ``TILE_ROWS`` rows, as ``kernel[grid](X, R, W, Y, H, n_rows, n_cols, stride_x,
stride_r, stride_y, stride_h, eps, ROWS=TILE_ROWS, BLOCK_N=next_power_of_2(n_cols))`` on tensors
inside larger buffers (foreign values around the inputs, a sentinel around the outputs: a store
past the last column or row changes memory the check owns); or a *function* ``fn(x, residual,
weight, eps) -> (y, h)`` that launches it. A function whose y and h no Triton kernel of the
reader's was given to write (plain PyTorch, however right) gets no ✓: the exercise is the
kernel. The inputs are fresh random views with odd widths, a row whose mean square is below eps,
a row large enough that float16 squares overflow, float32 and bfloat16.

The reader's code runs with the finished answers out of reach (``reach.FORBIDDEN
["add_rms_norm_kernel"]``: the package's fused add + RMSNorm and its operators, its RMSNorm,
PyTorch's ``rms_norm``, Hugging Face's, the float64 reference below and the hidden solution).
When a result is wrong the check recomputes the usual mistakes in float64 and names the one the
output reproduces; every diagnosis is worded once, in ``HINTS``. A check never raises because the
reader's code is wrong or unfinished: it prints its verdict and returns a ``Report``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton

from kernels import runtime
from kernels.reference import relative_error, rms_norm_reference
from kernels.tolerances import RELATIVE_ERROR_TOL

from .cross_entropy import launches
from .reach import FinishedCodeCalled, call_learner, finished_answer, out_of_reach
from .rmsnorm import Report, bad_elements, generator, last_line, verdict
from .sentences import sentence_lookup

EXERCISE = "add_rms_norm_kernel"
TILE_ROWS = 4
GUARD_ROWS = TILE_ROWS + 1  # rows of guard before and after each tensor: a whole tile, and one
SENTINEL = -4096.0  # what the outputs' surroundings hold (exact in bfloat16)
# A right bfloat16 kernel stores h bit for bit as PyTorch's add, and y as Hugging Face's norm of
# that h except in at most this fraction of values (a last-bit difference of rsqrt).
BF16_MAX_DIFFERENT = 0.02
FLOAT16_MAX = 65504.0

# Every diagnosis, in one place. Fields in braces are filled in for the input at hand.
HINTS = {
    "raised": "your function raised {error}",
    "no_kernel": ("the values are right, but no kernel of yours wrote them: your function computed y "
                  "and h without launching a Triton kernel of its own that is given y and h to store "
                  "into. The exercise is the kernel: allocate y and h, launch yours, kernel[grid](x, "
                  "residual, weight, y, h, ...), and return them"),
    "kernel_raised": "your kernel raised {error}",
    "tile_shapes": ("Triton could not combine two blocks of different shapes ({error}): the "
                    "offsets are rows[:, None] * stride + cols[None, :], a [ROWS, BLOCK_N] block, "
                    "and so is the mask; the weight is a [BLOCK_N] block, used as w[None, :]"),
    "not_a_pair": ("your function returned {type}, expected a pair of tensors (y, h): the fused "
                   "kernel's point is that it writes both, the norm and the sum the next layer adds to"),
    "shape": "{name} has shape {got}, expected {expected} (that of x)",
    "h_float32": ("h is float32 while x is {dtype}: h is the residual stream, which the next layer "
                  "reads and adds to in the model's dtype (Hugging Face's add gives {dtype}). "
                  "Storing it in float32 doubles its bytes and changes every later sum; allocate h "
                  "like x and round once on the store"),
    "dtype": "{name} has dtype {got}, expected {expected}",
    "h_never_stored": ("h was never stored (it still holds the NaN the check filled it with): "
                       "forgetting the add's output is the usual slip, but the next layer needs the "
                       "sum; store h through H + the tile's offsets, with the mask"),
    "y_never_stored": "y was never stored (it still holds the NaN the check filled it with)",
    "not_finite": "{name} holds NaN or infinity in {count} elements: were they all written?",
    "columns_past_end": ("{name} was written in columns {first}–{last}, past its last column "
                         "({n_cols} columns): the mask is missing. BLOCK_N is the next power of two "
                         "above the width, so switch the extra lanes off with cols < n_cols, on "
                         "the loads and on the stores"),
    "rows_past_end": ("{name} was written past its last row ({n_rows} rows): the last tile hangs "
                      "past n_rows; the mask must switch those rows off: rows[:, None] < n_rows"),
    "rows_before_start": ("{name} was written before its first row: the row index is off by one. "
                          "Program pid's rows are pid * ROWS + tl.arange(0, ROWS)"),
    "written_outside": ("{name} was written outside the tensor ({count} elements around it): "
                        "offset its rows by its own stride, stride_{name}, and mask the stores"),
    "placeholder_zeros": ("every value of {name} is 0: is its line still the placeholder? (the "
                          "stub as given computes zeros)"),
    "h_is_x": "h holds x, not x + residual: store the sum",
    "h_is_residual": "h holds the residual, not x + residual: store the sum",
    "h_is_y": "h holds the normalised output y: y goes through Y, the sum through H",
    "h_truncated": ("h is the right sum, truncated to {dtype} instead of rounded: Triton's "
                    "interpreter truncates .to(tl.bfloat16), so store through cast_to(h, "
                    "H.dtype.element_ty), as PyTorch's add rounds to nearest"),
    "h_wrong": ("h differs from x + residual (relative error {error:.2e}) first at {where}: h is "
                "the sum in float32 of the two loaded rows, rounded once on the store"),
    "swapped": ("y and h are swapped: the first output holds x + residual and the second the "
                "norm. Return (y, h), and store y through Y and h through H"),
    "normalises_x": ("y is the norm of x, not of h = x + residual: the sum is what the next "
                     "layer's norm sees. Compute the mean square of h"),
    "normalises_residual": "y is the norm of the residual, not of h = x + residual",
    "no_weight": "y is h / rms(h) without the weight: multiply by w (loaded once per program)",
    "eps_outside": ("eps is added outside the square root, h / (sqrt(mean(h²)) + eps): it belongs "
                    "inside, rsqrt(mean(h²) + eps), which only a row of tiny values shows"),
    "no_eps": ("eps is missing: rsqrt(mean(h²)) blows up a row of tiny values; it is rsqrt(mean(h²) "
               "+ eps)"),
    "block_divisor": ("the mean square divides by BLOCK_N ({block}), not by the width ({n_cols}): "
                      "the padded lanes hold zeros but are not values, so divide by n_cols"),
    "sqrt_not_rsqrt": "y is h times rms(h), not divided by it: use rsqrt (or 1 / sqrt)",
    "y_is_h": "y holds h, not its norm: y = rms_norm(h) · weight goes through Y",
    "float16_accumulation": ("y is {what} in the row of large values (row {row}, about "
                             "{scale:.0f}): the squares were summed in float16, whose largest value is "
                             "65504, so mean(h²) overflowed. Convert the loaded tiles to float32 "
                             "(.to(tl.float32)) before any arithmetic"),
    "unrounded_h": ("y normalises the float32 sum before its rounding: Hugging Face adds in "
                    "{dtype} (h is rounded), then normalises that h. Round the sum to the input's "
                    "dtype first (cast_to(h, H.dtype.element_ty).to(tl.float32)), then normalise"),
    "cast_order": ("y multiplies by the weight before rounding the normalised value: Hugging Face "
                   "rounds h · rstd to the input's dtype first, then multiplies by the weight (and "
                   "rounds again)"),
    "no_upcast": ("float32 inputs are right but this bfloat16 one is not ({detail}): the loaded "
                  "tiles were not converted to float32 before the arithmetic; Triton's interpreter "
                  "computes bfloat16 arithmetic wrongly, and a GPU rounds every product to 8 bits"),
    "bf16_bits": ("{share:.0f}% of y's values differ from Hugging Face's in the last bits: compute "
                  "in float32 from the rounded h, round h · rstd to bfloat16, multiply by the "
                  "weight and round once more"),
    "unrecognised": ("{name} differs from float64 (relative error {error:.2e}, bound {tol:g}), "
                     "first at {where}. None of the usual mistakes reproduces it: print it beside "
                     "the reference to see the pattern"),
}


hint = sentence_lookup(HINTS)


@dataclass(frozen=True)
class AddCase:
    """One input: the shape, the row strides of x, residual, y and h (each above the width's next
    power of two, so that a lane past the last column lands in guard memory), eps, and the rows
    scaled to tiny or to large values."""

    dtype: torch.dtype
    rows: int
    cols: int
    strides: tuple[int, int, int, int]
    eps: float = 1e-6
    tiny_row: int | None = None
    large_row: int | None = None

    def __str__(self) -> str:
        text = f"{str(self.dtype).removeprefix('torch.')} input of {self.rows} × {self.cols}"
        if self.tiny_row is not None:
            text += f" (row {self.tiny_row} holds tiny values; eps={self.eps:g})"
        if self.large_row is not None:
            text += f" (row {self.large_row} holds values near {LARGE_SCALE:g})"
        return text

    @property
    def block(self) -> int:
        """BLOCK_N: the width's next power of two."""
        return triton.next_power_of_2(self.cols)


LARGE_SCALE = 300.0  # h ≈ 400: h² passes float16's largest value, not float32's
# float32 first, so that a mistake only bfloat16 shows (the missing upcast) is named as such.
CASES = (
    AddCase(torch.float32, 6, 64, (72, 80, 88, 96), eps=1e-5, tiny_row=2, large_row=4),
    AddCase(torch.float32, 9, 100, (136, 144, 152, 160)),  # BLOCK_N 128: 28 lanes padding
    AddCase(torch.bfloat16, 7, 72, (136, 144, 152, 160)),
    AddCase(torch.bfloat16, 5, 37, (72, 80, 88, 96), eps=1e-5, tiny_row=1),
)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 answer the check compares with: ``(y, h)``.

    h is the sum as stored in x's dtype (Hugging Face's add), y the RMSNorm of that h times the
    weight, in float64. Out of the reader's reach while the check runs. Chapter:
    ``notebooks/17_whole_step.ipynb``.

    Args:
        x, residual: [rows, cols] tensors of one dtype (any device and strides).
        weight: [cols].
        eps: the epsilon added to the mean of squares.

    Returns:
        ``(y, h)``, both float64 on the CPU, of ``x``'s shape.
    """
    h = (_f64(x) + _f64(residual)).to(x.dtype)
    return _norm64(h, weight, eps), _f64(h)


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(device="cpu", dtype=torch.float64)


def _norm64(h, w, eps, *, weight=True, eps_outside=False, no_eps=False, divisor=None,
            power=-0.5) -> torch.Tensor:
    """RMSNorm of h in float64, or one of its usual misreadings."""
    h, w = _f64(h), _f64(w)
    mean_square = h.pow(2).sum(-1, keepdim=True) / (divisor or h.shape[-1])
    if eps_outside:
        y = h / (mean_square.sqrt() + eps)
    else:
        y = h * (mean_square + (0.0 if no_eps else eps)) ** power
    return w * y if weight else y


def _is_kernel(obj) -> bool:
    return isinstance(obj, triton.runtime.jit.KernelInterface)


def _inputs(case: AddCase, gen: torch.Generator):
    """x and residual as views inside guarded buffers, the weight (never all ones)."""
    views = []
    for stride in case.strides[:2]:
        data = torch.randn(case.rows, case.cols, generator=gen, dtype=torch.float64)
        if case.tiny_row is not None:
            data[case.tiny_row] *= 1e-3  # mean(h²) ≈ 2e-6, below eps: the result depends on eps
        if case.large_row is not None:
            data[case.large_row] *= LARGE_SCALE
        buffer = 8 + 4 * torch.randn(case.rows + 2 * GUARD_ROWS, stride, generator=gen,
                                     dtype=torch.float64)
        buffer[GUARD_ROWS:GUARD_ROWS + case.rows, :case.cols] = data
        buffer = buffer.to(case.dtype).to(runtime.device())
        views.append(buffer[GUARD_ROWS:GUARD_ROWS + case.rows, :case.cols])
    weight = (0.5 + torch.rand(case.cols, generator=gen, dtype=torch.float64)).to(case.dtype)
    return views[0], views[1], weight.to(runtime.device())


def _guarded_output(case: AddCase, stride: int):
    buffer = torch.full((case.rows + 2 * GUARD_ROWS, stride), SENTINEL, dtype=case.dtype,
                        device=runtime.device())
    view = buffer[GUARD_ROWS:GUARD_ROWS + case.rows, :case.cols]
    view.fill_(float("nan"))
    return buffer, view, buffer.clone()


def _launch(kernel, case: AddCase, x, r, w):
    """Launch the reader's kernel into guarded outputs: ``(outputs, None)`` or ``(None, problem)``;
    outputs maps "y" and "h" to (buffer, view, buffer before)."""
    outputs = {"y": _guarded_output(case, case.strides[2]), "h": _guarded_output(case, case.strides[3])}
    y, h = outputs["y"][1], outputs["h"][1]
    tripwire = None
    try:
        with out_of_reach(EXERCISE, getattr(kernel, "fn", kernel)) as tripwire:
            kernel[(triton.cdiv(case.rows, TILE_ROWS),)](
                x, r, w, y, h, case.rows, case.cols, x.stride(0), r.stride(0), y.stride(0),
                h.stride(0), case.eps, ROWS=TILE_ROWS, BLOCK_N=case.block)
    except Exception as error:  # noqa: BLE001  (any failure of the reader's kernel is reported)
        if tripwire is not None and tripwire.called:
            return None, tripwire.message
        text = str(error)
        if "incompatible dimensions" in text or "Cannot broadcast" in text:
            return None, f"on a {case}, " + hint("tile_shapes", error=_shorten(last_line(error)))
        return None, f"on a {case}, " + hint("kernel_raised",
                                              error=f"{type(error).__name__}: {last_line(error)}")
    if tripwire.called:
        return None, tripwire.message
    return outputs, None


def _written_by_a_kernel(launched, y: torch.Tensor, h: torch.Tensor) -> bool:
    """Whether a Triton kernel of the reader's was handed y's and h's memory (True where Triton's
    launches cannot be recorded: then nothing is known)."""
    if launched is None:
        return True
    mine = [launch for launch in launched if launch.readers]
    return any(launch.writes_to(y) for launch in mine) and any(launch.writes_to(h) for launch in mine)


def _call(fn, case: AddCase, x, r, w):
    """Call the reader's function: ``((y, h), None, by_kernel)`` or ``(None, problem, False)``;
    ``by_kernel`` says whether a kernel of the reader's was handed y and h to write."""
    pair, problem, launched = _call_recorded(fn, case, x, r, w)
    return pair, problem, pair is not None and _written_by_a_kernel(launched, *pair)


def _call_recorded(fn, case: AddCase, x, r, w):
    where = f"on a {case}, "
    launched = None
    try:
        with launches() as launched:
            out = call_learner(EXERCISE, fn, x, r, w, case.eps)
    except FinishedCodeCalled as called:
        return None, str(called), launched
    except Exception as error:  # noqa: BLE001  (any failure of the reader's code is reported)
        return None, where + hint("raised", error=f"{type(error).__name__}: {last_line(error)}"), launched
    if not (isinstance(out, (tuple, list)) and len(out) == 2
            and all(isinstance(t, torch.Tensor) for t in out)):
        return None, where + hint("not_a_pair", type=type(out).__name__), launched
    for name, t in zip(("y", "h"), out):
        if t.shape != x.shape:
            return None, where + hint("shape", name=name, got=tuple(t.shape), expected=tuple(x.shape)), launched
    y, h = (t.detach() for t in out)
    if h.dtype == torch.float32 and x.dtype != torch.float32:
        return None, where + hint("h_float32", dtype=str(x.dtype).removeprefix("torch.")), launched
    for name, t in (("y", y), ("h", h)):
        if t.dtype != x.dtype:
            return None, where + hint("dtype", name=name, got=t.dtype, expected=x.dtype), launched
    return (y, h), None, launched


def _outside(name: str, buffer, view, before, case: AddCase) -> str | None:
    """What the kernel wrote around ``name``'s view, in words; None when nothing."""
    bits = {2: torch.int16, 4: torch.int32}[buffer.element_size()]
    changed = (buffer.view(bits) != before.view(bits)).cpu()
    changed[GUARD_ROWS:GUARD_ROWS + case.rows, :case.cols] = False
    if not changed.any():
        return None
    where = f"on a {case}, "
    body = changed[GUARD_ROWS:GUARD_ROWS + case.rows]
    columns = body[:, case.cols:].any(0).nonzero().flatten()
    if len(columns):
        return where + hint("columns_past_end", name=name, first=case.cols + int(columns[0]),
                            last=case.cols + int(columns[-1]), n_cols=case.cols)
    if changed[GUARD_ROWS + case.rows:].any():
        return where + hint("rows_past_end", name=name, n_rows=case.rows)
    if changed[:GUARD_ROWS].any():
        return where + hint("rows_before_start", name=name)
    return where + hint("written_outside", name=name, count=int(changed.sum()))


def _first_difference(out64, ref, name: str, dtype) -> str:
    bad = bad_elements(out64, ref, dtype)
    if not bad.any():
        return f"{name} overall"
    row, col = (int(i) for i in bad.nonzero()[0])
    return f"{name}[{row}, {col}] = {float(out64[row, col]):.4g} (expected {float(ref[row, col]):.4g})"


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> float:
    """The fraction of equal values of two tensors of one dtype (NaN never equal)."""
    return float((a.cpu() == b.cpu()).float().mean()) if a.numel() else 1.0


def _truncate(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype != torch.bfloat16:
        return t.to(dtype)
    bits = t.float().contiguous().view(torch.int32) & -65536  # drop the low 16 bits
    return bits.view(torch.float32).bfloat16()


def _check_h(h, x, r, w, case: AddCase) -> str | None:
    """None when h is x + residual as PyTorch's add stores it; else the diagnosis."""
    where = f"on a {case}, "
    right = (x.cpu().double() + r.cpu().double()).to(case.dtype)
    if _same_bits(h, right) >= 1 - BF16_MAX_DIFFERENT:
        return None
    h64 = _f64(h)
    if not torch.isfinite(h64).any():
        return where + hint("h_never_stored")
    if torch.count_nonzero(h64) == 0:
        return where + hint("placeholder_zeros", name="h")
    for key, candidate in (("h_is_x", x), ("h_is_residual", r)):
        if _same_bits(h, candidate) >= 1 - BF16_MAX_DIFFERENT:
            return where + hint(key)
    exact = x.cpu().float() + r.cpu().float()
    if case.dtype != torch.float32 and _same_bits(h, _truncate(exact, case.dtype)) > 0.99:
        return where + hint("h_truncated", dtype=str(case.dtype).removeprefix("torch."))
    if not bad_elements(h64, _norm64(right, w, case.eps), case.dtype).any():
        return where + hint("h_is_y")
    if not torch.isfinite(h64).all():
        return where + hint("not_finite", name="h", count=int((~torch.isfinite(h64)).sum()))
    return where + hint("h_wrong", error=relative_error(h64, _f64(right)),
                        where=_first_difference(h64, _f64(right), "h", case.dtype))


def _y_suspects(h_right, x, r, w, case: AddCase) -> list[tuple[str, torch.Tensor]]:
    """The usual mistakes of y, each as the float64 output it computes."""
    eps = case.eps
    return [
        (hint("y_is_h"), _f64(h_right)),
        (hint("normalises_x"), _norm64(x, w, eps)),
        (hint("normalises_residual"), _norm64(r, w, eps)),
        (hint("no_weight"), _norm64(h_right, w, eps, weight=False)),
        (hint("eps_outside"), _norm64(h_right, w, eps, eps_outside=True)),
        (hint("no_eps"), _norm64(h_right, w, eps, no_eps=True)),
        (hint("block_divisor", block=case.block, n_cols=case.cols),
         _norm64(h_right, w, eps, divisor=case.block)),
        (hint("sqrt_not_rsqrt"), _norm64(h_right, w, eps, power=0.5)),
    ]


def _float16_row(y64, ref, case: AddCase) -> str | None:
    """The float16 accumulation: the row of large values all zero or not finite (its squares
    overflowed), where float32 gives finite values."""
    if case.large_row is None:
        return None
    row = y64[case.large_row]
    if bool((row == 0).all()) or not bool(torch.isfinite(row).any()):
        what = "0" if bool((row == 0).all()) else "NaN or infinite"
        return f"on a {case}, " + hint("float16_accumulation", what=what, row=case.large_row,
                                       scale=LARGE_SCALE * 2**0.5)
    return None


def _check_y(y, h_right, x, r, w, case: AddCase) -> str | None:
    """None when y is the norm of h within the dtype's tolerance; else the diagnosis."""
    where = f"on a {case}, "
    ref = _norm64(h_right, w, case.eps)
    y64 = _f64(y)
    if (not bad_elements(y64, ref, case.dtype).any()
            and relative_error(y64, ref) < RELATIVE_ERROR_TOL[case.dtype]):
        return None
    if not torch.isfinite(y64).any():
        return where + hint("y_never_stored")
    if torch.count_nonzero(y64) == 0:
        return where + hint("placeholder_zeros", name="y")
    found = _float16_row(y64, ref, case)
    if found:
        return found
    first = _first_difference(y64, ref, "y", case.dtype)
    for text, wrong in _y_suspects(h_right, x, r, w, case):
        if not bad_elements(y64, wrong, case.dtype).any():
            return f"{where}{first}: {text}."
    if not torch.isfinite(y64).all():
        return where + hint("not_finite", name="y", count=int((~torch.isfinite(y64)).sum()))
    return where + hint("unrecognised", name="y", error=relative_error(y64, ref),
                        tol=RELATIVE_ERROR_TOL[case.dtype], where=first)


def _check_bf16_bits(y, h_right, x, r, w, case: AddCase) -> str | None:
    """A bfloat16 y must be Hugging Face's bits: the norm of the rounded h, rounded before the weight."""
    hf = rms_norm_reference(h_right.cpu(), w.cpu(), case.eps)
    same = _same_bits(y, hf)
    if same >= 1 - BF16_MAX_DIFFERENT:
        return None
    exact = x.cpu().float() + r.cpu().float()
    w32 = w.cpu().float()

    def normalised(h32):
        return h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + case.eps)

    near_misses = (
        ("unrounded_h", w.cpu() * normalised(exact).to(case.dtype)),
        ("cast_order", (normalised(h_right.cpu().float()) * w32).to(case.dtype)),
    )
    dtype = str(case.dtype).removeprefix("torch.")
    for key, candidate in near_misses:
        if 1 - _same_bits(y, candidate) < (1 - same) / 4:
            return f"on a {case}, " + hint(key, dtype=dtype)
    return f"on a {case}, " + hint("bf16_bits", share=100 * (1 - same))


def _shorten(text: str, width: int = 160) -> str:
    text = text.strip().strip("'\"")
    return text if len(text) <= width else text[: width - 3] + "..."


def _named(problem: str) -> bool:
    """Whether ``problem`` is one of the precise diagnoses (not the catch-alls)."""
    catch_all = ("None of the usual mistakes reproduces it", "values differ from Hugging Face's",
                 "differs from x + residual", "holds NaN or infinity")
    return not any(text in problem for text in catch_all)


def check_add_rms_norm(fn: Callable, seed: int | None = None, verbose: bool = True) -> Report:
    """Check the fused residual add + RMSNorm forward: ``h = x + residual``, ``y = rms_norm(h) ·
    weight``, h and y in x's dtype, as Hugging Face computes them.

    Chapter: ``notebooks/17_whole_step.ipynb``.

    Args:
        fn: the reader's Triton kernel, launched by the check as ``kernel[grid](X, R, W, Y, H,
            n_rows, n_cols, stride_x, stride_r, stride_y, stride_h, eps, ROWS=TILE_ROWS,
            BLOCK_N=next_power_of_2(n_cols))``; or a function ``fn(x, residual, weight, eps) ->
            (y, h)``.
        seed: the inputs' seed; None draws fresh inputs on every call.
        verbose: print the verdict.

    Returns:
        The ``Report``: passed, and the message that names what is right or what is wrong.
    """
    refused = finished_answer(EXERCISE, getattr(fn, "fn", fn))
    if refused is not None:
        return verdict(False, refused, verbose)
    gen = generator(seed)
    worst: dict[torch.dtype, float] = {}
    same_bits = []
    # per input, for a function: whether a kernel of the reader's wrote y and h
    by_kernels: list[bool] = []
    for case in CASES:
        x, r, w = _inputs(case, gen)
        y = h = None
        if _is_kernel(fn):
            outputs, problem = _launch(fn, case, x, r, w)
            if problem is None:
                for name in ("h", "y"):
                    problem = problem or _outside(name, *outputs[name], case)
                y, h = outputs["y"][1], outputs["h"][1]
        else:
            pair, problem, by_kernel = _call(fn, case, x, r, w)
            by_kernels.append(by_kernel)
            if problem is None:
                y, h = pair
                swapped = (_same_bits(y, (x.cpu().double() + r.cpu().double()).to(case.dtype))
                           >= 1 - BF16_MAX_DIFFERENT)
                if swapped:
                    problem = f"on a {case}, " + hint("swapped")
        if problem is None:
            problem = _check_h(h, x, r, w, case)
        h_right = (x.cpu().double() + r.cpu().double()).to(case.dtype)
        if problem is None:
            problem = _check_y(y, h_right, x.cpu(), r.cpu(), w.cpu(), case)
        if problem is None and case.dtype == torch.bfloat16:
            problem = _check_bf16_bits(y, h_right, x, r, w, case)
            same_bits.append(_same_bits(y, rms_norm_reference(h_right, w.cpu(), case.eps)))
        if (problem is not None and case.dtype == torch.bfloat16 and torch.float32 in worst
                and y is not None and not _named(problem)):
            detail = (f"relative error of h {relative_error(_f64(h), _f64(h_right)):.1e}, of y "
                      f"{relative_error(_f64(y), _norm64(h_right, w, case.eps)):.1e}")
            problem = f"on a {case}, " + hint("no_upcast", detail=detail)
        if problem is not None:
            return verdict(False, problem, verbose)
        worst[case.dtype] = max(worst.get(case.dtype, 0.0),
                                relative_error(_f64(y), _norm64(h_right, w, case.eps)))
    if not all(by_kernels):
        return verdict(False, hint("no_kernel"), verbose)
    errors = ", ".join(f"{str(d).removeprefix('torch.')} {e:.1e}" for d, e in worst.items())
    kernel = _is_kernel(fn)
    written = " and nothing written outside y and h" if kernel else ""
    # Only a kernel is known to read each input once; a function may launch anything.
    fused = (" One read of x and of the residual, two writes: the add's kernel and its second "
             "read of h are gone.") if kernel else ""
    return verdict(True, (
        f"fused add + RMSNorm correct on {len(CASES)} inputs (widths "
        f"{'/'.join(str(c.cols) for c in CASES)}, strided rows, a row of tiny values, a row of "
        f"large ones, float32 and bfloat16){written}. Largest relative errors of y: {errors}; h "
        f"bit for bit PyTorch's add, bfloat16 y identical to Hugging Face's in "
        f"{100 * min(same_bits):.2f}% of values.{fused}"), verbose)
