"""Chapter 17's exercise check: the solution passes, and each planted mistake is named, without raising."""


import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from diagnoses import key_words

from kernels import runtime
from kernels.exercises import solutions
from kernels.exercises.whole_step import HINTS, add_rms_norm_reference, check_add_rms_norm
from kernels.triton_utils import cast_to

# The planted mistakes, one constexpr value each (0 is the right kernel).
MISTAKES = {
    "right": 0, "h_never_stored": 1, "h_truncated": 2, "normalises_x": 3, "no_weight": 4, "eps_outside": 5,
    "no_eps": 6, "float16_accumulation": 7, "columns_past_end": 8, "block_divisor": 9, "unrounded_h": 10,
    "cast_order": 11, "h_is_x": 12, "h_is_y": 13, "rows_past_end": 14, "placeholder_zeros": 15,
    "sqrt_not_rsqrt": 16, "no_upcast": 17,
}


@triton.jit
def _planted(X, R, W, Y, H, n_rows, n_cols, stride_x, stride_r, stride_y, stride_h, eps,
             ROWS: tl.constexpr, BLOCK_N: tl.constexpr, MISTAKE: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    if MISTAKE == 8:  # no mask on the columns
        mask = (rows[:, None] < n_rows) & (cols[None, :] >= 0)
    if MISTAKE == 14:  # no mask on the rows
        mask = (rows[:, None] >= 0) & (cols[None, :] < n_cols)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0)
    if MISTAKE != 17:  # 17: arithmetic on the loaded dtype
        x = x.to(tl.float32)
        r = r.to(tl.float32)
        w = w.to(tl.float32)
    exact = x + r
    h = cast_to(exact, H.dtype.element_ty)
    if MISTAKE == 2:  # a truncating conversion where the add rounds
        h = exact.to(H.dtype.element_ty)
    if MISTAKE == 15:  # the stub's placeholders
        h = cast_to(tl.zeros((ROWS, BLOCK_N), dtype=tl.float32), H.dtype.element_ty)
    stored = h
    if MISTAKE == 12:
        stored = cast_to(x, H.dtype.element_ty)
    h = h.to(tl.float32)
    if MISTAKE == 10:  # the norm of the sum before its rounding
        h = exact
    src = h
    if MISTAKE == 3:
        src = x
    if MISTAKE == 7:  # squares summed in float16
        s16 = src.to(tl.float16)
        mean_square = tl.sum(s16 * s16, axis=1).to(tl.float32) / n_cols
    elif MISTAKE == 9:
        mean_square = tl.sum(src * src, axis=1) / BLOCK_N
    else:
        mean_square = tl.sum(src * src, axis=1) / n_cols
    if MISTAKE == 5:
        rstd = 1.0 / (tl.sqrt(mean_square) + eps)
    elif MISTAKE == 6:
        rstd = tl.math.rsqrt(mean_square)
    elif MISTAKE == 16:
        rstd = tl.sqrt(mean_square + eps)
    else:
        rstd = tl.math.rsqrt(mean_square + eps)
    if MISTAKE == 11:  # the weight before the rounding
        y = src * rstd[:, None] * w[None, :]
    elif MISTAKE == 4:
        y = cast_to(src * rstd[:, None], Y.dtype.element_ty).to(tl.float32)
    else:
        y = cast_to(src * rstd[:, None], Y.dtype.element_ty).to(tl.float32) * w[None, :]
    if MISTAKE == 15:
        y = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    if MISTAKE == 13:  # the two outputs into each other's buffers
        tl.store(Y + rows[:, None] * stride_y + cols[None, :], stored, mask=mask)
        tl.store(H + rows[:, None] * stride_h + cols[None, :], cast_to(y, H.dtype.element_ty), mask=mask)
    else:
        if MISTAKE != 1:  # 1: the add's output forgotten
            tl.store(H + rows[:, None] * stride_h + cols[None, :], stored, mask=mask)
        tl.store(Y + rows[:, None] * stride_y + cols[None, :], cast_to(y, Y.dtype.element_ty), mask=mask)


class _Planted:
    """``_planted`` with one mistake bound, launched like the reader's kernel (``kernel[grid](...)``)."""

    def __init__(self, mistake: str):
        self.mistake = MISTAKES[mistake]

    def __getitem__(self, grid):
        return lambda *args, **kwargs: _planted[grid](*args, **kwargs, MISTAKE=self.mistake)


@pytest.fixture(autouse=True)
def planted_kernels_are_kernels(monkeypatch):
    # The check launches what is a Triton kernel: let the stand-ins that bind MISTAKE pass for one.
    monkeypatch.setattr(triton.runtime.jit, "KernelInterface", (triton.runtime.jit.KernelInterface, _Planted))


def _words(key: str) -> str:
    return key_words(HINTS[key])


def test_the_solution_passes(capsys):
    assert "add_rms_norm_kernel" in solutions.names()
    report = check_add_rms_norm(solutions.load("add_rms_norm_kernel"), seed=3)
    out = capsys.readouterr().out
    assert report.passed and "correct on 4 inputs" in out and "nothing written outside y and h" in out


def test_the_planted_right_kernel_passes():
    assert check_add_rms_norm(_Planted("right"), seed=4, verbose=False).passed


INTERPRETER_ONLY = ("h_truncated", "no_upcast")  # a GPU rounds .to(tl.bfloat16) and a bfloat16 add right


@pytest.mark.parametrize("mistake", [m for m in MISTAKES if m != "right" and m not in INTERPRETER_ONLY])
def test_each_kernel_mistake_is_named(mistake, capsys):
    report = check_add_rms_norm(_Planted(mistake), seed=5)
    assert not report.passed and "✗" in capsys.readouterr().out
    assert _words(mistake) in report.message, report.message


@pytest.mark.skipif(runtime.MODE == "gpu", reason="only Triton's interpreter gets these bfloat16 operations wrong")
@pytest.mark.parametrize("mistake", INTERPRETER_ONLY)
def test_the_interpreters_bfloat16_mistakes_are_named(mistake):
    assert _words(mistake) in check_add_rms_norm(_Planted(mistake), seed=6, verbose=False).message


def test_each_diagnosis_says_what_to_do():
    def message(mistake):
        return check_add_rms_norm(_Planted(mistake), seed=7, verbose=False).message

    assert "forgetting the add's output" in message("h_never_stored")
    assert "norm of x, not of h" in message("normalises_x")
    assert "summed in float16" in message("float16_accumulation") and "(row 4," in message("float16_accumulation")
    assert "columns 100–127" in message("columns_past_end")
    assert "divides by BLOCK_N (128), not by the width (100)" in message("block_divisor")
    assert "row 2 holds tiny values" in message("eps_outside")


# The reader's function: fn(x, residual, weight, eps) -> (y, h), with the usual slips of a wrapper.
def _norm(h, weight, eps):
    hf = h.float()
    return weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)


def plain(x, residual, weight, eps):
    h = x + residual
    return _norm(h, weight, eps), h


def calls_the_package(x, residual, weight, eps):
    from kernels.add_rmsnorm import add_rms_norm
    return add_rms_norm(x, residual, weight, eps)


def calls_pytorchs_rms_norm(x, residual, weight, eps):
    h = x + residual
    return F.rms_norm(h, (h.shape[-1],), weight, eps), h


def calls_the_reference(x, residual, weight, eps):
    y, h = add_rms_norm_reference(x, residual, weight, eps)
    return y.to(x.dtype), h.to(x.dtype)


def h_in_float32(x, residual, weight, eps):
    h = x.float() + residual.float()
    return _norm(h.to(x.dtype), weight, eps), h


def returns_y_only(x, residual, weight, eps):
    return plain(x, residual, weight, eps)[0]


def returns_h_first(x, residual, weight, eps):
    y, h = plain(x, residual, weight, eps)
    return h, y


def catches_the_tripwire(x, residual, weight, eps):
    try:
        return calls_the_package(x, residual, weight, eps)
    except Exception:  # noqa: BLE001  (hiding the refusal does not help)
        return plain(x, residual, weight, eps)


@pytest.mark.parametrize("fn, words", [
    (calls_the_package, "kernels.add_rmsnorm.add_rms_norm (the package's finished fused add + RMSNorm)"),
    (catches_the_tripwire, "kernels.add_rmsnorm.add_rms_norm"),
    (calls_pytorchs_rms_norm, "torch.nn.functional.rms_norm (PyTorch's own RMSNorm)"),
    (calls_the_reference, "the float64 reference the check compares with"),
    (h_in_float32, _words("h_float32")),
    (returns_y_only, _words("not_a_pair")),
    (returns_h_first, _words("swapped")),
])
def test_each_function_mistake_is_named(fn, words):
    report = check_add_rms_norm(fn, seed=8, verbose=False)
    assert not report.passed and words in report.message, report.message


def test_the_finished_function_handed_over_is_refused():
    from kernels.add_rmsnorm import add_rms_norm
    report = check_add_rms_norm(add_rms_norm, seed=9, verbose=False)
    assert not report.passed and "finished answer" in report.message


def test_the_operator_is_out_of_reach():
    def through_the_operator(x, residual, weight, eps):
        import kernels.add_rmsnorm  # noqa: F401  (registers the operator)
        y, h, _ = torch.ops.kernels.add_rms_norm_fwd(x, residual, weight, eps)
        return y, h

    message = check_add_rms_norm(through_the_operator, seed=10, verbose=False).message
    assert "add_rms_norm_fwd" in message and "finished" in message


def test_a_plain_pytorch_function_gets_no_tick_and_errors_are_reported_not_raised():
    # Right values computed without a kernel of the reader's: refused, by name.
    report = check_add_rms_norm(plain, seed=11, verbose=False)
    assert not report.passed and _words("no_kernel") in report.message

    kernel = solutions.load("add_rms_norm_kernel")

    def launches_a_decoy(x, residual, weight, eps):  # a kernel of its own runs, but writes neither y nor h
        decoy_y, decoy_h = torch.empty_like(x), torch.empty_like(x)
        kernel[(triton.cdiv(x.shape[0], 4),)](x, residual, weight, decoy_y, decoy_h, x.shape[0], x.shape[1],
                                              x.stride(0), residual.stride(0), decoy_y.stride(0), decoy_h.stride(0),
                                              eps, ROWS=4, BLOCK_N=triton.next_power_of_2(x.shape[1]))
        return plain(x, residual, weight, eps)

    report = check_add_rms_norm(launches_a_decoy, seed=12, verbose=False)
    assert not report.passed and _words("no_kernel") in report.message

    def raises(x, residual, weight, eps):
        raise RuntimeError("kernel exploded")

    assert "raised RuntimeError: kernel exploded" in check_add_rms_norm(raises, verbose=False).message


# The chapter's exercise as the reader finds it: the placeholders of the stub.
@triton.jit
def _stub(X, R, W, Y, H, n_rows, n_cols, stride_x, stride_r, stride_y, stride_h, eps,
          ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    h = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    y = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32) * x
    tl.store(H + rows[:, None] * stride_h + cols[None, :], cast_to(h, H.dtype.element_ty), mask=mask)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], cast_to(y, Y.dtype.element_ty), mask=mask)


def test_the_chapters_stub():
    assert "every value of h is 0" in check_add_rms_norm(_stub, verbose=False).message


def test_every_diagnosis_is_its_own():
    messages = {m: check_add_rms_norm(_Planted(m), seed=12, verbose=False).message
                for m in MISTAKES if m != "right" and m not in INTERPRETER_ONLY}
    for mistake, message in messages.items():
        others = [key for key in messages if key != mistake and _words(key) in message]
        assert not others, f"{mistake}'s message also reads as {others}: {message}"


def test_a_function_that_launches_its_kernel_passes():
    kernel = solutions.load("add_rms_norm_kernel")

    def launcher(x, residual, weight, eps):
        y, h = torch.empty_like(x), torch.empty_like(x)
        kernel[(triton.cdiv(x.shape[0], 4),)](x, residual, weight, y, h, x.shape[0], x.shape[1], x.stride(0),
                                              residual.stride(0), y.stride(0), h.stride(0), eps, ROWS=4,
                                              BLOCK_N=triton.next_power_of_2(x.shape[1]))
        return y, h

    assert check_add_rms_norm(launcher, seed=13, verbose=False).passed

