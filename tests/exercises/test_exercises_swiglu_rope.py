"""Chapter 11's exercise checks: each passes a right answer and names each planted mistake, without raising."""

import importlib

import pytest
import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.exercises import solutions
from kernels.exercises.swiglu_rope import HINTS, check_rope_backward, check_swiglu_backward_tile
from kernels.rope import rope_backward
from kernels.triton_utils import cast_to

# ----------------------------------------------------------------------------------------------------------------------
# The SwiGLU backward tile kernel
# ----------------------------------------------------------------------------------------------------------------------

# The planted mistakes, one constexpr value each (0 is the right kernel).
SWIGLU_MISTAKES = {
    "right": 0, "sigma_prime_sign": 1, "no_sigma_prime": 2, "no_upcast_raised": 3, "no_upcast": 4,
    "columns_past_end": 5, "d_gate_into_d_up": 6, "swapped": 7, "rows_past_end": 8, "row_at_end": 9,
    "rows_before_start": 10, "column_blocks": 11, "input_stride": 12, "output_stride": 13, "truncation": 14,
    "nothing_written": 15, "d_up_sigma": 16, "silu_not_derivative": 17, "d_gate_negated": 18, "placeholder_zeros": 19,
}


@triton.jit
def _swiglu_bwd_planted(DY, GATE, UP, DGATE, DUP, n_rows, n_cols, stride_dy, stride_gate, stride_up, stride_out,
                        ROWS: tl.constexpr, BLOCK_N: tl.constexpr, MISTAKE: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    if MISTAKE == 10:  # the row index off by one
        rows = rows - 1
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if MISTAKE == 11:  # the grid's second axis ignored
        cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    if MISTAKE == 5:  # no mask on the columns
        mask = (rows[:, None] < n_rows) & (cols[None, :] >= 0)
    if MISTAKE == 8:  # no mask on the rows
        mask = (rows[:, None] >= 0) & (cols[None, :] < n_cols)
    if MISTAKE == 9:  # rows <= n_rows
        mask = (rows[:, None] <= n_rows) & (cols[None, :] < n_cols)
    if MISTAKE == 15:  # the stub's placeholder mask: nothing is stored
        mask = tl.zeros((ROWS, BLOCK_N), dtype=tl.int1)
    gate_stride = n_cols if MISTAKE == 12 else stride_gate
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
    g = tl.load(GATE + rows[:, None] * gate_stride + cols[None, :], mask=mask, other=0.0)
    u = tl.load(UP + rows[:, None] * stride_up + cols[None, :], mask=mask, other=0.0)
    if MISTAKE != 3:  # 3: no upcast at all
        g = g.to(tl.float32)
        if MISTAKE != 4:  # 4: dy and up stay bfloat16
            dy = dy.to(tl.float32)
            u = u.to(tl.float32)
    s = tl.sigmoid(g)
    d_gate = dy * u * s * (1.0 + g * (1.0 - s))
    d_up = dy * g * s
    if MISTAKE == 1:
        d_gate = dy * u * s * (1.0 - g * (1.0 - s))
    if MISTAKE == 2:
        d_gate = dy * u * s
    if MISTAKE == 16:
        d_up = dy * s
    if MISTAKE == 17:
        d_gate = dy * u * g * s
    if MISTAKE == 18:
        d_gate = -d_gate
    if MISTAKE == 19:
        d_up = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    out_stride = stride_dy if MISTAKE == 13 else stride_out
    out = rows[:, None] * out_stride + cols[None, :]
    if MISTAKE == 6:  # d_up stored, then d_gate over it, in DUP
        tl.store(DUP + out, cast_to(d_up, DUP.dtype.element_ty), mask=mask)
        tl.store(DUP + out, cast_to(d_gate, DUP.dtype.element_ty), mask=mask)
    elif MISTAKE == 7:
        tl.store(DGATE + out, cast_to(d_up, DGATE.dtype.element_ty), mask=mask)
        tl.store(DUP + out, cast_to(d_gate, DUP.dtype.element_ty), mask=mask)
    elif MISTAKE == 14:
        tl.store(DGATE + out, d_gate.to(DGATE.dtype.element_ty), mask=mask)
        tl.store(DUP + out, d_up.to(DUP.dtype.element_ty), mask=mask)
    else:
        tl.store(DGATE + out, cast_to(d_gate, DGATE.dtype.element_ty), mask=mask)
        tl.store(DUP + out, cast_to(d_up, DUP.dtype.element_ty), mask=mask)


class _Planted:
    """``_swiglu_bwd_planted`` with one mistake bound, launched like the reader's kernel (``kernel[grid](...)``)."""

    def __init__(self, mistake: str):
        self.mistake = SWIGLU_MISTAKES[mistake]

    def __getitem__(self, grid):
        return lambda *args, **kwargs: _swiglu_bwd_planted[grid](*args, **kwargs, MISTAKE=self.mistake)


# The words of each diagnosis that the message must contain: taken from HINTS, where the wording lives.
def _words(key: str) -> str:
    return HINTS[key].split("{")[0].split(":")[0][:60]


@pytest.fixture(autouse=True)
def planted_kernels_are_kernels(monkeypatch):
    # The checks insist on a Triton kernel: let the stand-ins that bind MISTAKE pass for one.
    monkeypatch.setattr(triton.runtime.jit, "KernelInterface", (triton.runtime.jit.KernelInterface, _Planted))


def test_swiglu_solution_passes(capsys):
    assert "swiglu_bwd_tile_kernel" in solutions.names()
    report = check_swiglu_backward_tile(solutions.load("swiglu_bwd_tile_kernel"), seed=3)
    out = capsys.readouterr().out
    assert report.passed and "correct on 3 inputs" in out and "d_up = dy·g·s" in out  # the derivation, once passed


def test_swiglu_planted_right_kernel_passes():
    assert check_swiglu_backward_tile(_Planted("right"), seed=4, verbose=False).passed


@pytest.mark.parametrize("mistake, key", [
    ("sigma_prime_sign", "sigma_prime_sign"),  # the wrong sign in the backward
    ("d_gate_negated", "d_gate_negated"),
    ("no_sigma_prime", "no_sigma_prime"),  # a missing σ'(g) term
    ("silu_not_derivative", "silu_not_derivative"),
    ("d_up_sigma", "d_up_sigma"),
    ("no_upcast_raised", "no_upcast_raised"),  # no float32 upcast: tl.sigmoid refuses bfloat16
    ("no_upcast", "no_upcast"),  # dy and up left bfloat16: float32 right, bfloat16 wrong
    ("columns_past_end", "columns_past_end"),  # a missing mask on the last columns
    ("rows_past_end", "rows_past_end"),
    ("row_at_end", "row_at_end"),
    ("rows_before_start", "rows_before_start"),
    ("column_blocks", "column_blocks"),
    ("input_stride", "input_stride"),
    ("output_stride", "output_stride"),
    ("d_gate_into_d_up", "d_gate_into_d_up"),  # writing d_gate into d_up's buffer
    ("swapped", "swapped"),
    ("nothing_written", "nothing_written"),
    ("placeholder_zeros", "placeholder_zeros"),
])
def test_swiglu_each_mistake_is_named(mistake, key, capsys):
    report = check_swiglu_backward_tile(_Planted(mistake), seed=5)
    assert not report.passed and "✗" in capsys.readouterr().out
    assert _words(key) in report.message, report.message


def test_swiglu_named_wording():
    """The diagnoses the chapter promises, in the learner's words."""
    def message(mistake):
        return check_swiglu_backward_tile(_Planted(mistake), seed=6, verbose=False).message

    assert "wrong sign inside silu'(g)" in message("sigma_prime_sign")
    assert "σ'(g) term of silu'(g) is missing" in message("no_sigma_prime")
    assert "converted to float32" in message("no_upcast") and "bfloat16" in message("no_upcast")
    assert "mask is missing on the last columns" in message("columns_past_end")
    assert "d_gate was stored into d_up's buffer" in message("d_gate_into_d_up")
    assert "rows of gate were read 64 elements apart (n_cols, the width)" in message("input_stride")


@pytest.mark.skipif(runtime.MODE == "gpu", reason="only Triton's interpreter truncates .to(tl.bfloat16)")
def test_swiglu_truncating_store_is_named():
    assert _words("truncation") in check_swiglu_backward_tile(_Planted("truncation"), seed=7, verbose=False).message


def test_swiglu_bad_kernels_are_reported_not_raised():
    class Raises(_Planted):
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("kernel exploded")
            return launch

    assert "raised RuntimeError: kernel exploded" in check_swiglu_backward_tile(Raises("right"), verbose=False).message


# The chapter's exercise as the reader finds it: the placeholders of the stub.
@triton.jit
def _swiglu_stub(DY, GATE, UP, DGATE, DUP, n_rows, n_cols, stride_dy, stride_gate, stride_up, stride_out,
                 ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.zeros((ROWS,), dtype=tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = tl.zeros((ROWS, BLOCK_N), dtype=tl.int1)
    dy = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    g = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    u = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    d_gate = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32) * dy * g * u
    d_up = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    out = rows[:, None] * stride_out + cols[None, :]
    tl.store(DGATE + out, cast_to(d_gate, DGATE.dtype.element_ty), mask=mask)
    tl.store(DUP + out, cast_to(d_up, DUP.dtype.element_ty), mask=mask)


def test_the_chapters_swiglu_stub():
    assert "nothing was stored" in check_swiglu_backward_tile(_swiglu_stub, verbose=False).message


# ----------------------------------------------------------------------------------------------------------------------
# The RoPE backward
# ----------------------------------------------------------------------------------------------------------------------


def ours(dy, cos, sin):
    # The package's backward: a finished answer, which the check refuses.
    return rope_backward(dy, dy[:, :1], cos, sin, dy.dtype)[0]


def _partner(t, shift):
    """The second half as read at columns d + D/2 + shift; a shift that leaves the row reads the next element."""
    dim = t.shape[-1]
    index = (torch.arange(dim // 2) + dim // 2 + shift).clamp(0, dim - 1)
    return t[..., index]


def planted(mistake):
    def fn(dy, cos, sin):
        half = dy.shape[-1] // 2
        d1, d2 = dy.float()[..., :half], dy.float()[..., half:]
        c, s = cos.float()[:, None], sin.float()[:, None]
        c1, c2, s1, s2 = c[..., :half], c[..., half:], s[..., :half], s[..., half:]
        if mistake in ("partner +1", "partner -1", "partner own half"):
            shift = {"partner +1": 1, "partner -1": -1, "partner own half": -half}[mistake]
            d2, c2, s2 = (_partner(t, shift) for t in (dy.float(), c.expand_as(dy).float(), s.expand_as(dy).float()))
        if mistake == "forward":
            parts = d1 * c1 - d2 * s1, d2 * c2 + d1 * s2
        elif mistake == "no sin":
            parts = d1 * c1, d2 * c2
        elif mistake == "same signs":
            parts = d1 * c1 + d2 * s2, d2 * c2 + d1 * s1
        elif mistake == "own half":
            parts = d1 * c1 + d2 * s1, d2 * c2 - d1 * s2
        elif mistake == "stub":
            parts = d1 * c1, torch.zeros_like(d2)
        else:
            parts = d1 * c1 + d2 * s2, d2 * c2 - d1 * s1
        return torch.cat(parts, dim=-1).to(dy.dtype)

    return fn


def test_rope_right_answer_passes(capsys):
    report = check_rope_backward(planted("right"), seed=3)
    out = capsys.readouterr().out
    assert report.passed and "correct on 4 inputs" in out and "dx2 = dy2·cos2 − dy1·sin1" in out  # once passed


def test_rope_solution_passes():
    assert "rope_bwd_one_kernel" in solutions.names()
    assert check_rope_backward(solutions.load("rope_bwd_one_kernel"), seed=2, verbose=False).passed


@pytest.mark.parametrize("mistake, words", [
    ("forward", "forward rotation of dy"),  # the wrong sign in the backward
    ("no sin", "rotate_half term"),
    ("same signs", "dx2 must subtract"),
    ("own half", "its own half of sin"),
    ("stub", "still the placeholder"),
    ("partner +1", "1 column right of where it is"),  # the partner offset off by one
    ("partner -1", "1 column left of where it is"),
    ("partner own half", "first half again"),  # the wrong half
])
def test_rope_each_mistake_is_named(mistake, words, capsys):
    report = check_rope_backward(planted(mistake), seed=5)
    assert not report.passed and words in report.message and "✗" in capsys.readouterr().out


def test_rope_bad_calls_are_reported_not_raised():
    def raises(dy, cos, sin):
        raise RuntimeError("kernel exploded")

    def contiguous_reader(dy, cos, sin):  # reads dy's memory as if it were contiguous [b, h, s, D]
        flat = torch.as_strided(dy, dy.shape, dy.contiguous().stride())
        return planted("right")(flat.contiguous(), cos, sin)

    assert "raised RuntimeError: kernel exploded" in check_rope_backward(raises, verbose=False).message
    assert "dtype" in check_rope_backward(lambda dy, c, s: planted("right")(dy, c, s).double(),
                                          verbose=False).message
    message = check_rope_backward(contiguous_reader, seed=1, verbose=False).message
    assert "strides of the view" in message and "first at batch" in message


# The chapter's exercise as the reader finds it (a Triton kernel with the partner half and the two dx lines to
# write), and completed; the check launches a kernel itself.
@triton.jit
def _rope_bwd_kernel(DY, COS, SIN, DX, n_heads, seq, half, sx_b, sx_h, sx_t, so_b, so_h, so_t, sc_b, sc_t,
                     BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, COMPLETED: tl.constexpr):
    pid = tl.program_id(0)
    b, h = (pid // n_heads).to(tl.int64), (pid % n_heads).to(tl.int64)
    t = tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_H)
    ok = (t < seq)[:, None] & (d < half)[None, :]
    dy_at = DY + b * sx_b + h * sx_h + t[:, None] * sx_t + d[None, :]
    c_at = COS + b * sc_b + t[:, None] * sc_t + d[None, :]
    s_at = SIN + b * sc_b + t[:, None] * sc_t + d[None, :]
    dy1 = tl.load(dy_at, mask=ok, other=0.0).to(tl.float32)
    c1 = tl.load(c_at, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(s_at, mask=ok, other=0.0).to(tl.float32)
    if COMPLETED:
        dy2 = tl.load(dy_at + half, mask=ok, other=0.0).to(tl.float32)
        c2 = tl.load(c_at + half, mask=ok, other=0.0).to(tl.float32)
        s2 = tl.load(s_at + half, mask=ok, other=0.0).to(tl.float32)
        dx1 = dy1 * c1 + dy2 * s2
        dx2 = dy2 * c2 - dy1 * s1
    else:
        dy2 = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
        c2 = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
        s2 = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32) * s1
        dx1 = dy1 * c1
        dx2 = dy2 * c2
    o_at = DX + b * so_b + h * so_h + t[:, None] * so_t + d[None, :]
    tl.store(o_at, cast_to(dx1, DX.dtype.element_ty), mask=ok)
    tl.store(o_at + half, cast_to(dx2, DX.dtype.element_ty), mask=ok)


class _Bound:
    def __init__(self, completed):
        self.completed = completed

    def __getitem__(self, grid):
        return lambda *args, **kwargs: _rope_bwd_kernel[grid](*args, **kwargs, COMPLETED=self.completed)


def test_the_chapters_rope_stub_and_its_completion():
    # _Bound is no Triton kernel: wrap it in the launch the check uses for one.
    from kernels.exercises.swiglu_rope import launch_rope_one

    def as_function(bound):
        return lambda dy, cos, sin: launch_rope_one(bound, dy, cos, sin, dy.dtype)

    assert "still the placeholder" in check_rope_backward(as_function(_Bound(False)), verbose=False).message
    assert check_rope_backward(as_function(_Bound(True)), verbose=False).passed


# ----------------------------------------------------------------------------------------------------------------------
# The finished answers: refused by name, wherever the learner's code reaches them
# ----------------------------------------------------------------------------------------------------------------------

import torch.nn.functional as F  # noqa: E402

from kernels.reference import rotary_reference  # noqa: E402

swiglu_module = importlib.import_module("kernels.swiglu")  # the module: kernels.swiglu is also the function's name


class _BorrowsTheBackward(_Planted):
    """A launcher (let through as a kernel here) that hands the work to the package's backward."""

    def __init__(self):
        super().__init__("right")

    def __getitem__(self, grid):
        def launch(dy, g, u, d_gate, d_up, *args, **kwargs):
            a, b = swiglu_module.swiglu_backward(dy, g, u)
            d_gate.copy_(a)
            d_up.copy_(b)
        return launch


class _PythonLauncher:
    """Not a kernel: d_gate and d_up by autograd through F.silu, written through the launch syntax."""

    def __getitem__(self, grid):
        def launch(dy, g, u, d_gate, d_up, *args, **kwargs):
            gg, uu = g.float().requires_grad_(), u.float().requires_grad_()
            (F.silu(gg) * uu).backward(dy.float())
            d_gate.copy_(gg.grad)
            d_up.copy_(uu.grad)
        return launch


def test_swiglu_finished_answers_are_refused_by_name():
    message = check_swiglu_backward_tile(swiglu_module.swiglu_bwd_kernel, verbose=False).message
    assert "swiglu_bwd_kernel" in message and "finished answer" in message, message
    message = check_swiglu_backward_tile(_BorrowsTheBackward(), verbose=False).message
    assert "swiglu_backward" in message and "finished answer" in message, message
    message = check_swiglu_backward_tile(_PythonLauncher(), verbose=False).message
    assert _words("not_kernel") in message, message


def _by_autograd_through_the_reference(dy, cos, sin):
    x = torch.zeros(dy.shape, dtype=torch.float64, requires_grad=True)
    rotary_reference(x, x, cos.double(), sin.double())[0].backward(dy.double())
    return x.grad.to(dy.dtype)


def _by_hugging_face(dy, cos, sin):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    x = torch.zeros(dy.shape, dtype=torch.float32, requires_grad=True)
    (grad,) = torch.autograd.grad(apply_rotary_pos_emb(x, x, cos.float(), sin.float())[0], x, dy.float())
    return grad.to(dy.dtype)


def _by_the_package_caught(dy, cos, sin):
    try:
        return ours(dy, cos, sin)
    except Exception:  # noqa: BLE001  (a learner hiding the refusal: still refused)
        return planted("right")(dy, cos, sin)


@pytest.mark.parametrize("fn, name", [
    (rope_backward, "rope_backward"),  # handed to the check itself
    (ours, "rope_backward"),
    (_by_autograd_through_the_reference, "rotary_reference"),
    (_by_hugging_face, "apply_rotary_pos_emb"),
    (_by_the_package_caught, "rope_backward"),
])
def test_rope_finished_answers_are_refused_by_name(fn, name):
    message = check_rope_backward(fn, verbose=False).message
    assert name in message and "finished answer" in message, message
