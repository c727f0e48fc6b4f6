"""The chapter 13 exercise check: the solution passes; the stub and every usual mistake of the C++ row loop are named
with the sentence of ``DIAGNOSES``, never raised.

Each distinct source is one small build (no PyTorch headers: about a second, then cached by its hash)."""

import diagnoses
import pytest

from kernels import cuda_rmsnorm
from kernels.exercises import cuda_cpp, solutions
from kernels.exercises.cuda_cpp import DIAGNOSES, STUB, check_rms_norm_rows, diagnosis
from kernels.exercises.solutions import load

pytestmark = pytest.mark.skipif(cuda_rmsnorm.cpu_build_unavailable() is not None,
                                reason=f"no C++ build here: {cuda_rmsnorm.cpu_build_unavailable()}")

RIGHT = load("rms_norm_rows")()

# Each wrong answer: (diagnosis key, the edit of the right source that makes the mistake).
SUM = "sum_sq += x_row[c] * x_row[c];"
R = "const float r = 1.0f / std::sqrt(sum_sq / static_cast<float>(cols) + eps);"
WRITE = "y[row * cols + c] = w[c] * (x_row[c] * r);"
MISTAKES = {
    "not_written": (WRITE, "(void)w;"),
    "partly_written": ("for (int64_t c = 0; c < cols; ++c) y[", "for (int64_t c = 1; c < cols; ++c) y["),
    "past_y": ("for (int64_t c = 0; c < cols; ++c) y[", "for (int64_t c = 0; c <= cols; ++c) y["),
    "y_stride": (WRITE, "y[row * x_row_stride + c] = w[c] * (x_row[c] * r);"),
    "no_eps": (R, "const float r = 1.0f / std::sqrt(sum_sq / static_cast<float>(cols));"),
    "fixed_eps": (R, "const float r = 1.0f / std::sqrt(sum_sq / static_cast<float>(cols) + 1e-6f);"),
    "eps_outside": (R, "const float r = 1.0f / (std::sqrt(sum_sq / static_cast<float>(cols)) + eps);"),
    "no_weight": (WRITE, "y[row * cols + c] = x_row[c] * r;"),
    "sum_not_mean": (R, "const float r = 1.0f / std::sqrt(sum_sq + eps);"),
    "times_sqrt": (R, "const float r = std::sqrt(sum_sq / static_cast<float>(cols) + eps);"),
    "x_stride": ("x + row * x_row_stride", "x + row * cols"),
    "nan_y": (SUM, "sum_sq -= x_row[c] * x_row[c];"),
    "wrong_y": (SUM, "sum_sq += std::abs(x_row[c]);"),
    "no_rstd": ("rstd[row] = r;", ""),
    "rstd_is_std": ("rstd[row] = r;", "rstd[row] = 1.0f / r;"),
    "wrong_rstd": ("rstd[row] = r;", "rstd[row] = r * r;"),
    "no_function": ('extern "C" void', "void"),
    "int32_offset": ("x + row * x_row_stride", "x + static_cast<int>(row * x_row_stride)"),
}
# The same mistake as a learner more often writes it: a 32-bit offset variable, right on every small input.
INT_OFFSET = ("const float* x_row = x + row * x_row_stride;",
              "int offset = row * x_row_stride;\n    const float* x_row = x + offset;")


def test_the_solution_passes(seed):
    assert "rms_norm_rows" in solutions.names()
    report = check_rms_norm_rows(RIGHT, seed=seed, verbose=False)
    assert report, report.message
    assert report.message.startswith("✓ " + DIAGNOSES["passed"].split("{")[0])


@pytest.mark.parametrize("key", sorted(MISTAKES))
def test_each_mistake_is_named(key, seed):
    old, new = MISTAKES[key]
    assert old in RIGHT, f"the edit for {key} no longer applies to the solution"
    report = check_rms_norm_rows(RIGHT.replace(old, new), seed=seed, verbose=False)
    expected = DIAGNOSES[key].split("{")[0]  # the sentence up to its first field
    assert not report and expected in report.message, report.message


def test_a_32_bit_offset_variable_is_named_with_the_row_it_misread(seed):
    report = check_rms_norm_rows(RIGHT.replace(*INT_OFFSET), seed=seed, verbose=False)
    assert not report and diagnoses.says(DIAGNOSES["int32_offset"], report.message), report.message
    assert f"element {cuda_cpp.HIGH_WRAP}" in report.message and f"{cuda_cpp.HIGH_STRIDE:,}" in report.message


def test_the_pass_says_whether_offsets_past_2_31_were_checked(seed, monkeypatch):
    report = check_rms_norm_rows(RIGHT, seed=seed, verbose=False)
    assert report and cuda_cpp.OFFSETS_CHECKED in report.message, report.message
    monkeypatch.setattr(cuda_cpp, "mapped_buffer", lambda *args: None)  # a machine that will not map 16 GiB
    report = check_rms_norm_rows(RIGHT, seed=seed, verbose=False)
    assert report and cuda_cpp.OFFSETS_NOT_CHECKED in report.message, report.message


@pytest.mark.parametrize("given", [load("rms_norm_rows"), None, b"extern"])
def test_a_source_that_is_not_a_string_is_named_not_raised(given):
    report = check_rms_norm_rows(given, verbose=False)
    assert not report and diagnoses.says(DIAGNOSES["source_type"], report.message), report.message


def test_the_stub_is_reported_as_not_written(seed):
    report = check_rms_norm_rows(STUB, seed=seed, verbose=False)
    assert not report and DIAGNOSES["not_written"] in report.message


def test_the_case_is_named():
    report = check_rms_norm_rows(RIGHT.replace(*MISTAKES["x_stride"]), verbose=False)
    assert "128 floats apart" in report.message
    report = check_rms_norm_rows(RIGHT.replace(*MISTAKES["fixed_eps"]), verbose=False)
    assert "eps=1e-05" in report.message


def test_a_compile_error_is_reported_not_raised(seed):
    report = check_rms_norm_rows(RIGHT.replace("float sum_sq", "flaot sum_sq"), seed=seed, verbose=False)
    assert not report and DIAGNOSES["compile"].split("{")[0] in report.message and "flaot" in report.message
    assert "/" not in report.message.split("main.cpp:", 1)[0], "the build folder's path leaked into the message"


def test_no_compiler_is_reported_not_raised(monkeypatch):
    monkeypatch.setattr(cuda_rmsnorm, "cpu_build_unavailable", lambda: "no C++ compiler found")
    report = check_rms_norm_rows(RIGHT, verbose=False)
    assert not report and report.message == "✗ " + diagnosis("unavailable", reason="no C++ compiler found")


def test_every_diagnosis_has_a_test():
    tested = set(MISTAKES) | {"compile", "unavailable", "passed", "source_type"}
    assert tested == set(DIAGNOSES)


def test_the_verdict_is_printed(capsys):
    check_rms_norm_rows(STUB)
    assert capsys.readouterr().out.startswith("✗ on an input of 7 × 64, y was never written")


# --------------------------------------------------------------------------------------------------------------------
# The CUDA exercise: a warp per row, float4 loads, warp shuffles
# --------------------------------------------------------------------------------------------------------------------

import torch  # noqa: E402

from kernels.exercises.cuda_cpp import (  # noqa: E402
    POISON_BITS,
    ROWS_GUARD,
    WARP_CASES,
    WARP_DIAGNOSES,
    WARP_STUB,
    check_rstd_warp_per_row,
)

WARP_RIGHT = load("rstd_warp_per_row")()
SHUFFLE = "for (int offset = 16; offset > 0; offset >>= 1) sum_sq += __shfl_xor_sync(0xffffffffu, sum_sq, offset);"
LOAD = "const float4 v = packs[i];\n    sum_sq += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;"
# Mistakes the source shows by reading (or compiling) alone, found without a GPU: (key, old, new).
READ_MISTAKES = {
    "no_shuffle": (SHUFFLE, ""),
    "old_shuffle": ("__shfl_xor_sync(0xffffffffu, sum_sq, offset)", "__shfl_xor(sum_sq, offset)"),
    "partial_mask": ("0xffffffffu", "0x0000ffffu"),
    "atomic": (SHUFFLE + "\n  if (lane == 0) rstd[row] = rsqrtf(sum_sq / static_cast<float>(cols) + eps);",
               "__shared__ float total[32];\n  if (lane == 0) total[threadIdx.x / 32] = 0.0f;\n  __syncwarp();\n"
               "  atomicAdd(&total[threadIdx.x / 32], sum_sq);\n  __syncwarp();\n"
               "  if (lane == 0) rstd[row] = rsqrtf(total[threadIdx.x / 32] / static_cast<float>(cols) + eps);"),
    "no_vector_load": ("const float4* packs = reinterpret_cast<const float4*>(x + row * cols);\n"
                       "  float sum_sq = 0.0f;\n  for (int64_t i = lane; i < cols / 4; i += 32) {\n    "
                       + LOAD + "\n  }",
                       "const float* xr = x + row * cols;\n  float sum_sq = 0.0f;\n"
                       "  for (int64_t i = lane; i < cols; i += 32) sum_sq += xr[i] * xr[i];"),
    "int32_offset": ("const float4* packs = reinterpret_cast<const float4*>(x + row * cols);",
                     "int offset = row * cols;\n  const float4* packs = reinterpret_cast<const float4*>(x + offset);"),
}


@pytest.mark.parametrize("old, new", [
    ("x + row * cols", "x + static_cast<int>(row * cols)"),
    ("x + row * cols", "x + (unsigned)(row * cols)"),
    ("x + row * cols", "x + static_cast<int32_t>(row) * static_cast<int32_t>(cols)"),
])
def test_other_32_bit_offsets_are_named(old, new):
    assert cuda_cpp.read_warp_source(WARP_RIGHT.replace(old, new)) == cuda_cpp.warp_diagnosis(
        "int32_offset", code=new.removeprefix("x + ")), new
    assert cuda_cpp.read_warp_source(WARP_RIGHT) is None


def _has_nvcc():
    return cuda_cpp.nvcc_path() is not None


def test_the_cuda_solution_is_never_called_passed_without_a_gpu():
    report = check_rstd_warp_per_row(WARP_RIGHT, verbose=False)
    if torch.cuda.is_available():
        assert report.outcome == "passed", report.message
        return
    assert not report, "a kernel that was not run passed"
    if _has_nvcc():
        assert report.outcome == "compiled, not run" and report.message.startswith("○ compiled, not run: no GPU")
    else:
        assert report.outcome == "not compiled, not run", report.message


def test_without_nvcc_the_verdict_says_nothing_was_compiled(monkeypatch):
    monkeypatch.setattr(cuda_cpp.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cuda_cpp, "nvcc_path", lambda: None)
    report = check_rstd_warp_per_row(WARP_RIGHT, verbose=False)
    assert report.outcome == "not compiled, not run" and "no GPU and no nvcc" in report.message


def test_the_warp_stub_is_named():
    report = check_rstd_warp_per_row(WARP_STUB, verbose=False)
    assert report.outcome == "failed" and diagnoses.says(WARP_DIAGNOSES["stub"], report.message)


@pytest.mark.parametrize("key", sorted(READ_MISTAKES))
def test_each_mistake_read_in_the_source_is_named(key, monkeypatch):
    monkeypatch.setattr(cuda_cpp.torch.cuda, "is_available", lambda: False)
    old, new = READ_MISTAKES[key]
    assert old in WARP_RIGHT, f"the edit for {key} no longer applies"
    report = check_rstd_warp_per_row(WARP_RIGHT.replace(old, new), verbose=False)
    assert report.outcome == "failed"
    if key == "old_shuffle" and _has_nvcc():  # nvcc refuses it first, which is as good
        assert "does not compile" in report.message or diagnoses.says(WARP_DIAGNOSES[key], report.message)
        return
    assert diagnoses.says(WARP_DIAGNOSES[key], report.message), report.message


@pytest.mark.skipif(not _has_nvcc(), reason="needs nvcc")
def test_a_compile_error_and_a_renamed_kernel_are_named(monkeypatch):
    monkeypatch.setattr(cuda_cpp.torch.cuda, "is_available", lambda: False)
    report = check_rstd_warp_per_row(WARP_RIGHT.replace("float4 v", "flaot4 v"), verbose=False)
    assert report.outcome == "failed" and "flaot4" in report.message
    assert diagnoses.says(WARP_DIAGNOSES["compile"], report.message)
    report = check_rstd_warp_per_row(WARP_RIGHT.replace('extern "C" ', ""), verbose=False)
    assert diagnoses.says(WARP_DIAGNOSES["no_kernel"], report.message), report.message


# What the GPU would return for each mistake, emulated in float64 (the GPU path's diagnosis, tested anywhere).

def _poison(n):
    return torch.full((n,), POISON_BITS, dtype=torch.int32).view(torch.float32)


def _emulate(key, x, case):
    x64 = x.double()
    sumsq = x64.pow(2).sum(-1)
    packs = x64.pow(2).view(case.rows, -1, 4).sum(-1)
    values = {
        "right": (sumsq / case.cols + case.eps).rsqrt(),
        "no_reduction": (packs[:, ::32].sum(-1) / case.cols + case.eps).rsqrt(),
        "one_pack": (packs[:, :32].sum(-1) / case.cols + case.eps).rsqrt(),
        "mean_over_packs": (sumsq / (case.cols // 4) + case.eps).rsqrt(),
        "no_eps": (sumsq / case.cols).rsqrt(),
        "std": (sumsq / case.cols + case.eps).sqrt(),
        "wrong": (sumsq / case.cols + case.eps).rsqrt() * 1.01,
    }
    out = _poison(case.rows + ROWS_GUARD)
    if key == "not_written":
        return out
    out[: case.rows] = values.get(key, values["right"]).float()
    if key == "partly_written":
        out[case.rows - 1:case.rows] = _poison(1)
    if key == "past_rows":
        out[case.rows] = 1.0
    return out


GPU_MISTAKES = ["no_reduction", "one_pack", "mean_over_packs", "no_eps", "std", "wrong", "not_written",
                "partly_written", "past_rows"]


def _fake_gpu(monkeypatch, key, error=None):
    monkeypatch.setattr(cuda_cpp.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_rmsnorm, "cuda_build_unavailable", lambda: None)

    def run(source, inputs):
        results = [(None if error else _emulate(key, x, case), error) for x, case in zip(inputs, WARP_CASES)]
        return {"results": results, "device": "an emulated GPU"}

    monkeypatch.setattr(cuda_cpp, "run_on_gpu_process", run)


@pytest.mark.parametrize("key", GPU_MISTAKES)
def test_each_result_a_gpu_could_return_is_named(key, monkeypatch):
    _fake_gpu(monkeypatch, key)
    report = check_rstd_warp_per_row(WARP_RIGHT, seed=0, verbose=False)
    assert report.outcome == "failed"
    assert diagnoses.says(WARP_DIAGNOSES[key], report.message), report.message


def test_a_right_result_passes_and_a_crash_is_named(monkeypatch):
    _fake_gpu(monkeypatch, "right")
    report = check_rstd_warp_per_row(WARP_RIGHT, seed=0, verbose=False)
    assert report.outcome == "passed" and "an emulated GPU" in report.message
    _fake_gpu(monkeypatch, "right", error="misaligned address")
    report = check_rstd_warp_per_row(WARP_RIGHT, seed=0, verbose=False)
    assert diagnoses.says(WARP_DIAGNOSES["crashed"], report.message) and "misaligned" in report.message


def test_right_numbers_without_the_shuffles_do_not_pass(monkeypatch):
    _fake_gpu(monkeypatch, "right")
    old, new = READ_MISTAKES["atomic"]
    report = check_rstd_warp_per_row(WARP_RIGHT.replace(old, new), seed=0, verbose=False)
    assert report.outcome == "failed" and diagnoses.says(WARP_DIAGNOSES["atomic"], report.message)


def test_every_warp_diagnosis_has_a_test():
    tested = (set(READ_MISTAKES) | set(GPU_MISTAKES)
              | {"stub", "compile", "no_kernel", "crashed", "passed_gpu", "compiled_not_run", "not_compiled",
                 "unavailable_gpu"})
    assert tested == set(WARP_DIAGNOSES)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("key, old, new", [
    ("past_rows", "if (row >= rows) return;", ""),
    ("no_reduction", SHUFFLE, "__syncwarp(0xffffffffu); (void)__shfl_xor_sync(0xffffffffu, sum_sq, 1);"),
    ("one_pack", "for (int64_t i = lane; i < cols / 4; i += 32)",
     "for (int64_t i = lane; i < 32 && i < cols / 4; i += 32)"),
])
def test_on_a_gpu_the_kernel_runs_and_its_mistakes_are_named(key, old, new):
    assert check_rstd_warp_per_row(WARP_RIGHT, seed=0, verbose=False).outcome == "passed"
    report = check_rstd_warp_per_row(WARP_RIGHT.replace(old, new), seed=0, verbose=False)
    # Warps past the last row read past x too: a crash is as good a verdict there as the stray stores.
    named = [k for k in (key, "crashed") if diagnoses.says(WARP_DIAGNOSES[k], report.message)]
    assert report.outcome == "failed" and named and (named[0] == key or key == "past_rows"), report.message
