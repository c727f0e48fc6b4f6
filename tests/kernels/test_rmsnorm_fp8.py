"""RMSNorm with its output quantised to FP8 in the same kernel: ``rms_norm_fp8`` bit for bit against ``rms_norm``
then ``quantize_rows`` (codes and scales; e4m3fn and e5m2; float32, bfloat16 and float16 inputs and mixed weights;
odd sizes, leading dimensions, strided and expanded rows; zero, infinite, NaN, huge and tiny rows; no rows), within
the FP8 rounding of the float64 norm, the errors, the launch configuration, the operator; on a GPU, the 8B shape."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kernels import rmsnorm_fp8
from kernels import runtime as kernels_runtime
from kernels.fp8 import FP8_DTYPES, fp8_format, quantize_rows
from kernels.reference import rms_norm_reference
from kernels.rmsnorm import cached_forward_config, rms_norm
from kernels.rmsnorm_fp8 import (
    MAX_HIDDEN,
    code_disagreements,
    disagreement_allowed,
    rms_norm_fp8,
    rms_norm_fp8_config,
    scales_agree,
)
from kernels.runtime import DeviceProps

IN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
EPS = 1e-6
# The unit roundoff of each storage dtype: the norm rounds twice (x̂ to x's dtype, the product to the output's).
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
HOPPER = DeviceProps("H100-like", False, 132, 227 * 1024, 65536, (9, 0))


def _rows(gen, shape, dtype, device, spread=3.0):
    """Random rows whose magnitudes span 10^±spread (the norm divides it out; the edge tests need it kept)."""
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    rows = x.reshape(-1, shape[-1])
    rows *= torch.logspace(-spread, spread, rows.shape[0], dtype=torch.float64)[:, None]
    return x.to(device, dtype)


def _weight(gen, hidden, dtype, device):
    return (torch.randn(hidden, generator=gen, dtype=torch.float64) + 0.5).to(device, dtype)


def _assert_same_as_two_kernels(x, w, fp8_dtype):
    """The fused result against ``quantize_rows(rms_norm(x))``: the same scales and the same bits, -0 and NaN too."""
    q, scale = rms_norm_fp8(x, w, EPS, fp8_dtype)
    q_ref, scale_ref = quantize_rows(rms_norm(x, w, EPS).reshape(-1, x.shape[-1]), fp8_dtype)
    assert q.dtype == fp8_dtype and q.shape == q_ref.shape and q.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == scale_ref.shape
    assert scales_agree(scale, scale_ref, kernels_runtime.INTERPRET), (scale, scale_ref)
    count, steps = code_disagreements(q, q_ref)
    assert disagreement_allowed(count, steps, q.numel(), kernels_runtime.INTERPRET), (count, steps)
    return q, scale


# --------------------------------------------------------------------------------------------------------------------
# Bit for bit against the two kernels
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", IN_DTYPES)
def test_same_bits_as_rms_norm_then_quantize_rows(dtype, fp8_dtype, device, gen):
    x = _rows(gen, (3, 5, 77), dtype, device)
    _assert_same_as_two_kernels(x, _weight(gen, 77, dtype, device), fp8_dtype)


@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16)])
def test_mixed_weight_quantises_the_promoted_output(x_dtype, w_dtype, device, gen):
    # bf16 x with a float32 weight makes a float32 norm output: that is what gets quantised
    x = _rows(gen, (9, 130), x_dtype, device)
    for fp8_dtype in FP8_DTYPES:
        _assert_same_as_two_kernels(x, _weight(gen, 130, w_dtype, device), fp8_dtype)


def test_views(device, gen):
    base = _rows(gen, (2, 12, 100), torch.bfloat16, device)
    w = _weight(gen, 61, torch.bfloat16, device)
    views = (base[..., 7:68], base[:, ::3, 20:81], base.transpose(0, 1)[..., :61], base[:1, 4:5, :61].expand(3, 4, 61))
    for view in views:
        for fp8_dtype in FP8_DTYPES:
            _assert_same_as_two_kernels(view, w, fp8_dtype)
    strided_weight = _weight(gen, 122, torch.bfloat16, device)[::2]
    _assert_same_as_two_kernels(base[..., :61], strided_weight, torch.float8_e4m3fn)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_infinite_nan_huge_and_tiny_rows(dtype, fp8_dtype, device, gen):
    x = _rows(gen, (7, 45), torch.float64, "cpu", spread=1.0)
    big = torch.finfo(dtype).max
    x[0] = 0.0
    x[1, 3] = float("inf")
    x[2, 10] = float("nan")
    x[3] *= big / 64  # x² overflows: rstd is 0 and so is the whole row
    x[6] *= 1e18  # huge, x² still finite in float32
    x[4] *= torch.finfo(dtype).tiny  # x² underflows: the norm amplifies by 1/sqrt(eps) only
    x[5, :] = 0.0
    x[5, 20] = -1.0  # one value: its row quantises to exactly ±FP8_MAX
    x = x.to(device, dtype)
    q, scale = _assert_same_as_two_kernels(x, _weight(gen, 45, dtype, device), fp8_dtype)
    assert scale[0] == 1 and (q[0].float() == 0).all()
    assert scale[1:3].isnan().all() and q[1:3].float().isnan().all()
    assert torch.isfinite(scale[3:]).all()


@pytest.mark.parametrize("shape", [(0, 16), (3, 0, 16), (4, 0), (2, 3, 0)])
def test_empty(shape, device):
    x = torch.empty(shape, dtype=torch.bfloat16, device=device)
    q, scale = rms_norm_fp8(x, torch.ones(shape[-1], dtype=torch.bfloat16, device=device))
    rows = math.prod(shape[:-1])
    assert q.shape == (rows, shape[-1]) and q.dtype == torch.float8_e4m3fn and scale.shape == (rows,)
    assert (scale == 1).all()  # rows of no columns, as quantize_rows gives them


def test_the_widest_row(device, gen):
    x = _rows(gen, (2, MAX_HIDDEN), torch.bfloat16, device)
    _assert_same_as_two_kernels(x, _weight(gen, MAX_HIDDEN, torch.bfloat16, device), torch.float8_e4m3fn)


def test_a_gpu_without_fp8_runs_the_two_steps(monkeypatch, device, gen):
    monkeypatch.setattr(rmsnorm_fp8, "triton_problem", lambda device: "no FP8 here")
    monkeypatch.setattr(rmsnorm_fp8, "rms_norm_fp8_kernel", None)  # launching it would fail loudly
    _assert_same_as_two_kernels(_rows(gen, (6, 33), torch.bfloat16, device), _weight(gen, 33, torch.bfloat16, device),
                                torch.float8_e5m2)


@given(rows=st.integers(1, 20), hidden=st.integers(1, 300), dtype=st.sampled_from(IN_DTYPES),
       fp8_dtype=st.sampled_from(FP8_DTYPES), seed=st.integers(0, 2**31))
def test_property_any_shape(rows, hidden, dtype, fp8_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    device = kernels_runtime.device()
    _assert_same_as_two_kernels(_rows(gen, (rows, hidden), dtype, device), _weight(gen, hidden, dtype, device),
                                fp8_dtype)


# --------------------------------------------------------------------------------------------------------------------
# Against float64
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", IN_DTYPES)
def test_within_fp8_rounding_of_the_float64_norm(dtype, fp8_dtype, device, gen):
    x = _rows(gen, (4, 9, 203), dtype, device)
    w = _weight(gen, 203, dtype, device)
    q, scale = rms_norm_fp8(x, w, EPS, fp8_dtype)
    ref = rms_norm_reference(x.double(), w.double(), EPS).reshape(-1, 203).cpu()
    s64 = scale.double().cpu()[:, None]
    got = q.double().cpu() * s64
    fmt = fp8_format(fp8_dtype)
    # The FP8 step at the larger of the two magnitudes (where one sits just above a power of two the other is below).
    where = torch.maximum(ref.abs(), got.abs()) / s64
    exponent = torch.floor(torch.log2(where.clamp_min(1e-300))).clamp_min(fmt["EMIN"])
    step = torch.exp2(exponent - fmt["MBITS"])
    # Half an FP8 step and the float32 division before it, plus the norm's two roundings and its float32 rstd.
    norm = (2 * UNIT_ROUNDOFF[dtype] + 2.0**-20) * ref.abs()
    bound = s64 * (step / 2 + where * 2.0**-23) + norm * (1 + 2.0 ** -fmt["MBITS"])
    error = (got - ref).abs()
    assert (error <= bound).all(), (error / bound).max()
    assert (error > 0).any()  # FP8 does round: a bound nothing reaches would test nothing


# --------------------------------------------------------------------------------------------------------------------
# Errors, configuration, operator
# --------------------------------------------------------------------------------------------------------------------


def test_bad_inputs_are_named(device):
    x = torch.randn(4, 8, device=device)
    w = torch.randn(8, device=device)
    with pytest.raises(TypeError, match="x and weight must be tensors"):
        rms_norm_fp8([[1.0]], w)
    for bad in (x.double(), x.to(torch.int32), x.to(torch.float8_e4m3fn)):
        with pytest.raises(TypeError, match="x must be"):
            rms_norm_fp8(bad, w)
    with pytest.raises(TypeError, match="weight must be"):
        rms_norm_fp8(x, w.double())
    for bad in (torch.bfloat16, torch.float8_e4m3fnuz, "e4m3"):
        with pytest.raises(TypeError, match="fp8_dtype must be"):
            rms_norm_fp8(x, w, EPS, bad)
    for bad in ("1e-6", None, True):
        with pytest.raises(TypeError, match="eps must be a number"):
            rms_norm_fp8(x, w, bad)
    for bad in (torch.randn(7, device=device), torch.randn(1, 8, device=device)):
        with pytest.raises(ValueError, match=r"weight must have shape \(8,\)"):
            rms_norm_fp8(x, bad)
    with pytest.raises(ValueError, match="at least one dimension"):
        rms_norm_fp8(torch.tensor(1.0, device=device), w[:1])
    wide = torch.empty(1, MAX_HIDDEN + 1, device="meta")
    with pytest.raises(ValueError, match=f"above {MAX_HIDDEN}.*quantize_rows"):
        rms_norm_fp8(wide, torch.empty(MAX_HIDDEN + 1, device="meta"))
    with pytest.raises(ValueError, match="same device"):
        rms_norm_fp8(x, torch.empty(8, device="meta"))


def test_config_is_the_norms_forward_tile():
    # The same tile as rms_norm's forward: the same float32 sum of squares, so the same bits.
    for props in (HOPPER, kernels_runtime.INTERPRETER):
        for rows, hidden in ((1, 1), (8192, 4096), (8192, 8192), (3, MAX_HIDDEN), (5000, 77)):
            cfg = rms_norm_fp8_config(rows, hidden, props)
            assert cfg == cached_forward_config(rows, hidden, props)
            assert cfg.block_n >= hidden and cfg.grid[0] * cfg.rows >= rows


def test_opcheck(device, gen):
    x = _rows(gen, (2, 5, 40), torch.bfloat16, device)
    w = _weight(gen, 40, torch.bfloat16, device)
    # test_schema compares FP8 outputs with arithmetic PyTorch's CPU lacks for FP8
    torch.library.opcheck(rmsnorm_fp8.rms_norm_fp8_op, (x, w, EPS, torch.float8_e4m3fn),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_meta_tensors_give_shapes():
    x = torch.empty(2, 3, 10, dtype=torch.bfloat16, device="meta")
    q, scale = rms_norm_fp8(x, torch.empty(10, dtype=torch.bfloat16, device="meta"), EPS, torch.float8_e5m2)
    assert q.shape == (6, 10) and q.dtype == torch.float8_e5m2 and scale.shape == (6,) and q.is_meta


# --------------------------------------------------------------------------------------------------------------------
# On a GPU: Llama-3.1-8B's hidden size
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_llama_8b_shape_on_gpu(fp8_dtype, gen):
    x = _rows(gen, (8192, 4096), torch.bfloat16, "cuda", spread=2.0)
    q, scale = _assert_same_as_two_kernels(x, _weight(gen, 4096, torch.bfloat16, "cuda"), fp8_dtype)
    assert torch.isfinite(scale).all() and (q.float().abs().amax(dim=1) == fp8_format(fp8_dtype)["FP8_MAX_VALUE"]).all()


def test_code_disagreements_counts_steps():
    q = torch.tensor([1.0, 2.0, -3.0, 0.5]).to(torch.float8_e4m3fn)
    r = q.clone()
    assert code_disagreements(q, r) == (0, 0)
    r.view(torch.uint8)[1] += 1  # the next code up: one step
    assert code_disagreements(q, r) == (1, 1)
    r.view(torch.uint8)[3] ^= 0x80  # the sign flipped: far apart
    assert code_disagreements(q, r) == (2, 256)
    assert disagreement_allowed(0, 0, 10, interpreter=True) and not disagreement_allowed(1, 1, 10, interpreter=True)
    assert disagreement_allowed(1, 1, 10, interpreter=False) and not disagreement_allowed(1, 2, 10, interpreter=False)
    assert disagreement_allowed(33, 1, 33_554_432, interpreter=False)
    assert not disagreement_allowed(34, 1, 33_554_432, interpreter=False)


def test_scales_agree():
    a = torch.tensor([1.0, float("nan"), 3.0])
    assert scales_agree(a, a.clone(), interpreter=True)
    b = a.clone()
    b[2] = torch.nextafter(b[2], torch.tensor(4.0))  # one float32 step apart
    assert not scales_agree(a, b, interpreter=True) and scales_agree(a, b, interpreter=False)
    b[2] = 3.0 * (1 + 2.0**-20)
    assert not scales_agree(a, b, interpreter=False)
    assert not scales_agree(a, torch.tensor([1.0, 2.0, 3.0]), interpreter=False)  # a NaN lost
