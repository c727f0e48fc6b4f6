"""FP8 per-row quantisation and the scaled FP8 GEMM: ``quantize_rows`` bit for bit against its PyTorch reference
(every input dtype, e4m3fn and e5m2, odd shapes, views, zero, tiny, huge and non-finite rows, no rows), the round
trip within half an FP8 step per element, ``fp8_matmul``'s backends against float64 from the same FP8 values and
scales (odd sizes, every output dtype, views, empty sizes), the errors, the launch configurations, the operators;
on a GPU, both backends at Llama-3.1-8B's projection shapes and their agreement."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kernels import fp8
from kernels import runtime as kernels_runtime
from kernels.fp8 import (
    FP8_DTYPES,
    FP8_MAX,
    OUT_DTYPES,
    SCALE_FLOOR,
    choose_backend,
    cublas_problem,
    fp8_gemm_config,
    fp8_matmul,
    fp8_matmul_reference,
    quantize_config,
    quantize_rows,
    quantize_rows_reference,
    triton_problem,
)
from kernels.reference import relative_error
from kernels.runtime import DeviceProps
from kernels.tolerances import RELATIVE_ERROR_TOL as TOL

IN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The backends that run in this mode: Triton and the reference everywhere; torch._scaled_mm on the CPU (PyTorch's
# own implementation) and on GPUs of sm_89 and up.
BACKENDS = ("triton", "cublas", "reference", "auto")
MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}
MIN_EXPONENT = {torch.float8_e4m3fn: -6, torch.float8_e5m2: -14}
# float32 output: float32's rounding in the interpreter. On a GPU the FP8 tensor cores sum each K-tile with fewer bits
# than float32 before both backends add it into float32, which leaves more: still far below the error of order 1 of a
# forgotten scale or a transposed operand.
FP32_OUT_TOL = TOL[torch.float32] if kernels_runtime.INTERPRET else 2.0**-12
LLAMA_8B_KN = [(4096, 14336), (14336, 4096), (4096, 4096), (4096, 1024), (4096, 128256)]


def _rows(gen, rows, cols, dtype, device, spread=3.0):
    """Random rows whose magnitudes span 10^±spread, so that each row gets its own scale."""
    x = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    x *= torch.logspace(-spread, spread, rows, dtype=torch.float64)[torch.randperm(rows, generator=gen)][:, None]
    return x.to(device, dtype)


def _assert_same_quantisation(x, fp8_dtype):
    q, scale = quantize_rows(x, fp8_dtype)
    q_ref, scale_ref = quantize_rows_reference(x, fp8_dtype)
    assert q.dtype == fp8_dtype and q.shape == x.shape and q.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == (x.shape[0],)
    torch.testing.assert_close(scale, scale_ref, rtol=0, atol=0, equal_nan=True)
    nan = q.float().isnan()
    assert torch.equal(nan, q_ref.float().isnan())
    assert torch.equal(q.view(torch.uint8)[~nan], q_ref.view(torch.uint8)[~nan])  # the same bits, -0 included
    return q, scale


# --------------------------------------------------------------------------------------------------------------------
# quantize_rows
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", IN_DTYPES)
def test_quantize_matches_reference_bit_for_bit(dtype, fp8_dtype, device, gen):
    x = _rows(gen, 37, 301, dtype, device)
    x[4] = 0.0  # a row of zeros: scale 1
    x[5, ::3] = 0.0
    x[6] = -x[6].abs()  # every value negative, -0 among them after rounding
    x[7] *= 1e-5  # tiny values, FP8 subnormals after scaling
    q, scale = _assert_same_quantisation(x, fp8_dtype)
    assert scale[4] == 1 and not q[4].float().any()
    # the largest magnitude of every non-zero row lands on FP8_MAX: the scale uses the whole range
    peaks = q.float().abs().amax(dim=1)
    nonzero = x.float().abs().amax(dim=1) > 0
    assert torch.equal(peaks[nonzero], torch.full_like(peaks[nonzero], FP8_MAX[fp8_dtype]))


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_quantize_extreme_magnitudes(fp8_dtype, device, gen):
    x = _rows(gen, 6, 130, torch.float32, device, spread=0.0)
    x[0] *= 3e38 / x[0].abs().max()  # near float32's largest
    x[1] *= 1e-38  # float32 subnormals and near: amax / FP8_MAX underflows, the scale is floored
    x[2] *= 1e-42
    x[3, 0] = 1e-45  # one tiny value, every other zero
    x[3, 1:] = 0
    q, scale = _assert_same_quantisation(x, fp8_dtype)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert scale[1] == SCALE_FLOOR and scale[2] == SCALE_FLOOR
    assert torch.isfinite(q.float()).all()


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_quantize_rows_with_infinity_or_nan_come_out_nan(fp8_dtype, device, gen):
    x = _rows(gen, 5, 70, torch.bfloat16, device)
    x[1, 3] = float("nan")
    x[3, 60] = float("-inf")
    q, scale = _assert_same_quantisation(x, fp8_dtype)
    assert scale[[1, 3]].isnan().all() and q[[1, 3]].float().isnan().all()
    clean = [0, 2, 4]
    assert torch.isfinite(scale[clean]).all() and torch.isfinite(q[clean].float()).all()


@pytest.mark.parametrize("dtype", IN_DTYPES)
def test_quantize_views(dtype, device, gen):
    base = _rows(gen, 40, 90, dtype, device)
    for view in (base[3:30:2, 5:80:3], base.t(), base[:, 7:8], base[5:6].expand(9, 90)):
        for fp8_dtype in FP8_DTYPES:
            _assert_same_quantisation(view, fp8_dtype)


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (0, 0)])
def test_quantize_empty(shape, device):
    x = torch.empty(shape, dtype=torch.bfloat16, device=device)
    q, scale = quantize_rows(x)
    assert q.shape == shape and q.dtype == torch.float8_e4m3fn
    assert scale.shape == (shape[0],) and (scale == 1).all()


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", IN_DTYPES)
def test_round_trip_within_half_a_step(dtype, fp8_dtype, device, gen):
    x = _rows(gen, 23, 257, dtype, device)
    q, scale = quantize_rows(x, fp8_dtype)
    x64, s64 = x.double().cpu(), scale.double().cpu()[:, None]
    y = x64 / s64  # where each value sits in the FP8 range
    exponent = torch.floor(torch.log2(y.abs().clamp_min(1e-300))).clamp_min(MIN_EXPONENT[fp8_dtype])
    step = torch.exp2(exponent - MANTISSA_BITS[fp8_dtype])  # the FP8 spacing at that magnitude
    error = (x64 - q.double().cpu() * s64).abs()
    # half a step, plus the float32 rounding of x / scale before the FP8 rounding (double rounding)
    bound = s64 * (step / 2 + y.abs() * 2.0**-23)
    assert (error <= bound).all(), (error / bound).max()
    assert (error > 0).any()  # FP8 does round: a bound nothing reaches would test nothing


@given(rows=st.integers(1, 40), cols=st.integers(1, 200), dtype=st.sampled_from(IN_DTYPES),
       fp8_dtype=st.sampled_from(FP8_DTYPES), spread=st.floats(0, 6), seed=st.integers(0, 2**31))
def test_property_quantize_any_shape(rows, cols, dtype, fp8_dtype, spread, seed):
    gen = torch.Generator().manual_seed(seed)
    _assert_same_quantisation(_rows(gen, rows, cols, dtype, kernels_runtime.device(), spread), fp8_dtype)


def test_quantize_bad_inputs(device):
    x = torch.randn(4, 8, device=device)
    with pytest.raises(TypeError, match="x must be a tensor"):
        quantize_rows([[1.0]])
    for bad in (x.double(), x.to(torch.int32), x.to(torch.float8_e4m3fn)):
        with pytest.raises(TypeError, match="x must be float32, bfloat16 or float16"):
            quantize_rows(bad)
    for bad in (x[0], x[None]):
        with pytest.raises(ValueError, match="x must be 2-D"):
            quantize_rows(bad)
    for bad in (torch.bfloat16, torch.float8_e4m3fnuz, "e4m3"):
        with pytest.raises(TypeError, match="fp8_dtype must be"):
            quantize_rows(x, bad)


# --------------------------------------------------------------------------------------------------------------------
# fp8_matmul
# --------------------------------------------------------------------------------------------------------------------


def _operands(gen, m, n, k, device, fp8_dtype=torch.float8_e4m3fn):
    a, a_scale = quantize_rows(_rows(gen, m, k, torch.bfloat16, device, spread=2.0), fp8_dtype)
    b, b_scale = quantize_rows(_rows(gen, n, k, torch.bfloat16, device, spread=1.0), fp8_dtype)
    return a, a_scale, b, b_scale


def _exact(a, a_scale, b, b_scale):
    return fp8_matmul_reference(a, a_scale, b, b_scale, torch.float64, compute_dtype=torch.float64)


def _tol(out_dtype):
    return FP32_OUT_TOL if out_dtype == torch.float32 else TOL[out_dtype]


def _skip_unless_runs(backend, a, b, out_dtype):
    problem = {"cublas": cublas_problem(a, b, out_dtype) if a.is_cuda else None,
               "triton": triton_problem(a.device)}.get(backend)
    if problem is not None:
        pytest.skip(f"{backend} cannot run here: {problem}")


def _runnable(backends, a, b, out_dtype):
    return [be for be in backends
            if be in ("reference", "auto")
            or (be == "triton" and triton_problem(a.device) is None)
            or (be == "cublas" and (not a.is_cuda or cublas_problem(a, b, out_dtype) is None))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_matmul_matches_float64(backend, out_dtype, device, gen):
    m, n, k = (37, 45, 83) if backend != "cublas" or device.type == "cpu" else (37, 48, 96)
    a, a_scale, b, b_scale = _operands(gen, m, n, k, device)
    _skip_unless_runs(backend, a, b, out_dtype)
    out = fp8_matmul(a, a_scale, b, b_scale, out_dtype, backend=backend)
    assert out.dtype == out_dtype and out.shape == (m, n)
    assert relative_error(out, _exact(a, a_scale, b, b_scale)) < _tol(out_dtype)


@pytest.mark.parametrize("backend", ("triton", "reference"))
def test_matmul_e5m2_long_k_and_one_row(backend, device, gen):
    for m, n, k in ((1, 70, 300), (65, 1, 129), (3, 130, 16)):
        a, a_scale, b, b_scale = _operands(gen, m, n, k, device, torch.float8_e5m2)
        _skip_unless_runs(backend, a, b, torch.float32)
        out = fp8_matmul(a, a_scale, b, b_scale, torch.float32, backend=backend)
        assert relative_error(out, _exact(a, a_scale, b, b_scale)) < FP32_OUT_TOL


def test_matmul_float32_output_is_exact_to_float32_rounding(device, gen):
    # The products of FP8 values are exact in float32: only the sum and the scaling round. An error this small
    # rules out a scale applied twice, or one of the two scales forgotten.
    a, a_scale, b, b_scale = _operands(gen, 20, 33, 200, device)
    _skip_unless_runs("triton", a, b, torch.float32)
    out = fp8_matmul(a, a_scale, b, b_scale, torch.float32, backend="triton")
    assert relative_error(out, _exact(a, a_scale, b, b_scale)) < (1e-6 if kernels_runtime.INTERPRET else FP32_OUT_TOL)


def test_matmul_views(device, gen):
    a, a_scale, b, b_scale = _operands(gen, 40, 50, 64, device)
    exact = _exact(a, a_scale, b, b_scale)
    a_t = a.t().contiguous().t()  # column-major a
    b_strided = torch.empty(50, 128, dtype=b.dtype, device=device)
    b_strided[:, ::2] = b
    b_view = b_strided[:, ::2]
    for backend in _runnable(BACKENDS, a, b_view, torch.float32):
        out = fp8_matmul(a_t, a_scale, b_view, b_scale, torch.float32, backend=backend)
        assert relative_error(out, exact) < FP32_OUT_TOL, backend
    rows, cols = slice(3, 40, 4), slice(1, 50, 3)  # every 4th row of a, every 3rd of b, with their scales
    for backend in _runnable(BACKENDS, a[rows], b[cols], torch.float32):
        out = fp8_matmul(a[rows], a_scale[rows], b[cols], b_scale[cols], torch.float32, backend=backend)
        assert relative_error(out, exact[rows, cols]) < FP32_OUT_TOL, backend


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m,n,k", [(0, 5, 16), (5, 0, 16), (5, 7, 0), (0, 0, 0)])
def test_matmul_empty(m, n, k, backend, device):
    a = torch.empty(m, k, device=device).to(torch.float8_e4m3fn)
    b = torch.empty(n, k, device=device).to(torch.float8_e4m3fn)
    out = fp8_matmul(a, torch.ones(m, device=device), b, torch.ones(n, device=device), torch.bfloat16,
                     backend=backend)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16 and not out.any()


def test_matmul_bad_inputs(device, gen):
    a, a_scale, b, b_scale = _operands(gen, 8, 16, 32, device)
    good = dict(a=a, a_scale=a_scale, b=b, b_scale=b_scale)
    cases = [
        (TypeError, "a must be a tensor", dict(a=1.0)),
        (TypeError, "a's dtype must be torch.float8", dict(a=a.float())),
        (TypeError, "b's dtype must be torch.float8", dict(b=b.to(torch.bfloat16))),
        (TypeError, "one FP8 dtype", dict(b=b.float().to(torch.float8_e5m2))),
        (ValueError, "a must be 2-D", dict(a=a[0])),
        (ValueError, "their K differ", dict(b=b[:, :16])),
        (ValueError, r"a_scale must have shape \(8,\)", dict(a_scale=a_scale[:7])),
        (ValueError, r"b_scale must have shape \(16,\)", dict(b_scale=b_scale[None])),
        (TypeError, "a_scale must be float32", dict(a_scale=a_scale.double())),
        (TypeError, "b_scale must be float32", dict(b_scale=b_scale.bfloat16())),
        (ValueError, "b_scale must be on a's device", dict(b_scale=b_scale.to("meta"))),
    ]
    for error, message, change in cases:
        with pytest.raises(error, match=message):
            fp8_matmul(**{**good, **change})
    with pytest.raises(TypeError, match="out_dtype must be"):
        fp8_matmul(a, a_scale, b, b_scale, torch.float64)
    with pytest.raises(ValueError, match="backend must be one of"):
        fp8_matmul(a, a_scale, b, b_scale, backend="cutlass")


@pytest.mark.skipif(kernels_runtime.MODE == "gpu", reason="what the interpreter chooses")
def test_interpreter_runs_fp8_dots_in_triton(gen):
    a, a_scale, b, b_scale = _operands(gen, 4, 32, 32, "cpu")
    assert choose_backend(a, b, torch.bfloat16) == "triton"
    assert "not a CUDA GPU" in cublas_problem(a, b, torch.bfloat16)
    assert triton_problem(a.device) is None


# --------------------------------------------------------------------------------------------------------------------
# Launch configurations and the operators
# --------------------------------------------------------------------------------------------------------------------

HOPPER = DeviceProps("H100-like", False, 132, 227 * 1024, 65536, (9, 0))
SMALL = DeviceProps("small shared memory", False, 30, 99 * 1024, 65536, (8, 9))


def test_gemm_config_fits_the_shared_memory():
    for props in (HOPPER, SMALL, kernels_runtime.INTERPRETER):
        cfg = fp8_gemm_config(8192, 4096, 4096, props)
        assert cfg.block_k >= 32  # an FP8 tensor-core instruction reduces over 32 values
        stages = (cfg.block_m + cfg.block_n) * cfg.block_k * cfg.num_stages
        assert props.interpreter or stages <= props.shared_mem_per_block, props
    assert fp8_gemm_config(8192, 4096, 4096, HOPPER).block_n > fp8_gemm_config(8192, 4096, 4096, SMALL).block_n


def test_quantize_config_covers_rows_and_fills_the_gpu():
    for rows, cols in ((1, 1), (8192, 4096), (8192, 14336), (3, 50000)):
        cfg = quantize_config(rows, cols, HOPPER)
        assert 1 <= cfg.block_r <= 8 and cfg.block_c <= 1024 and cfg.block_c & (cfg.block_c - 1) == 0
    assert -(-8192 // quantize_config(8192, 4096, HOPPER).block_r) >= 4 * HOPPER.sm_count
    assert quantize_config(5000, 64, kernels_runtime.INTERPRETER).block_r == 64


def test_opcheck(device, gen):
    x = _rows(gen, 9, 40, torch.bfloat16, device)
    torch.library.opcheck(fp8.quantize_rows_op, (x, torch.float8_e4m3fn))
    a, a_scale, b, b_scale = _operands(gen, 9, 16, 32, device)
    _skip_unless_runs("triton", a, b, torch.bfloat16)
    before = [t.clone() for t in (a, a_scale, b, b_scale)]
    # test_schema compares FP8 inputs with arithmetic PyTorch's CPU lacks for FP8; what it would check, that the
    # operator writes none of its inputs, is checked below on the bytes.
    torch.library.opcheck(fp8.fp8_matmul_op, (a, a_scale, b, b_scale, torch.bfloat16, "triton"),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    for old, new in zip(before, (a, a_scale, b, b_scale)):
        assert torch.equal(old.view(torch.uint8), new.view(torch.uint8))


def test_meta_tensors_give_shapes():
    x = torch.empty(6, 10, dtype=torch.bfloat16, device="meta")
    q, scale = quantize_rows(x, torch.float8_e5m2)
    assert q.shape == (6, 10) and q.dtype == torch.float8_e5m2 and scale.shape == (6,) and q.is_meta
    a = torch.empty(6, 32, dtype=torch.float8_e4m3fn, device="meta")
    b = torch.empty(48, 32, dtype=torch.float8_e4m3fn, device="meta")
    out = fp8_matmul(a, torch.empty(6, device="meta"), b, torch.empty(48, device="meta"), torch.float16)
    assert out.shape == (6, 48) and out.dtype == torch.float16 and out.is_meta


# --------------------------------------------------------------------------------------------------------------------
# On a GPU: Llama-3.1-8B's projection shapes
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", LLAMA_8B_KN)
def test_gpu_both_backends_at_8b_shapes_and_their_agreement(k, n, gen):
    if torch.cuda.get_device_capability() < fp8.FP8_CAPABILITY:
        pytest.skip("no FP8 tensor cores below sm_89")
    a, a_scale, b, b_scale = _operands(gen, 256, n, k, "cuda")
    exact = _exact(a, a_scale, b, b_scale)
    outs = {}
    for backend in ("triton", "cublas"):
        outs[backend] = fp8_matmul(a, a_scale, b, b_scale, torch.bfloat16, backend=backend)
        assert torch.isfinite(outs[backend]).all(), backend
        assert relative_error(outs[backend], exact, on_device=True) < TOL[torch.bfloat16], backend
    # both round the same float32 sums to bf16: they differ by bf16 rounding steps at most
    assert relative_error(outs["triton"], outs["cublas"].double(), on_device=True) < 2**-7


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_gpu_triton_float32_and_fp16_outputs(out_dtype, gen):
    if torch.cuda.get_device_capability() < fp8.FP8_CAPABILITY:
        pytest.skip("no FP8 tensor cores below sm_89")
    a, a_scale, b, b_scale = _operands(gen, 300, 1000, 4100, "cuda")  # none a multiple of the tiles
    a_scale = a_scale / 64  # sums of 4,100 products stay inside float16's range (65,504)
    out = fp8_matmul(a, a_scale, b, b_scale, out_dtype, backend="triton")
    assert out.isfinite().all()
    assert relative_error(out, _exact(a, a_scale, b, b_scale), on_device=True) < _tol(out_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_gpu_quantize_matches_reference_at_8b_activation(fp8_dtype, gen):
    x = _rows(gen, 8192, 4096, torch.bfloat16, "cuda")
    x[17] = 0
    x[18, 5] = float("nan")
    _assert_same_quantisation(x, fp8_dtype)
    _assert_same_quantisation(x[:, :1000], fp8_dtype)  # a strided view
