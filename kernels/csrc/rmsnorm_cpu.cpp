// RMSNorm forward on the CPU, as a PyTorch operator: kernels_cpp::rms_norm_fwd.
//
// The smallest complete C++ extension that goes the same way as the CUDA one (kernels/csrc/rmsnorm_cuda.cu):
// a C++ function over at::Tensor, a schema declared with TORCH_LIBRARY, an implementation registered for one
// dispatch key with TORCH_LIBRARY_IMPL, built just in time by torch.utils.cpp_extension.load (see
// kernels/cuda_rmsnorm.py). Its loops are plain and single-threaded on purpose: the point is the path, not speed.
//
//     y = w * round_to_input_dtype(x * rstd),    rstd = 1 / sqrt(mean(x^2) + eps)
//
// As in Hugging Face's LlamaRMSNorm: normalise in float32, round to x's dtype, then multiply by the weight.
// Only the headers that are needed are included (not <torch/extension.h>, which also pulls in pybind11 and the
// Python headers): that halves the build time, and the operator needs no Python binding.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>

namespace {

// One row at a time. `In` is x's element type, `Out` the output's (and the weight's): they differ only for a
// bfloat16 or float16 x with a float32 weight, where PyTorch promotes `weight * x_hat` to float32.
template <typename In, typename Out>
void rms_norm_rows(const In* x, int64_t x_row_stride, const Out* w, Out* y, float* rstd, int64_t rows,
                   int64_t cols, float eps) {
  for (int64_t row = 0; row < rows; ++row) {
    // int64 offsets: row * stride passes 2^31 once rows x hidden does.
    const In* x_row = x + row * x_row_stride;
    Out* y_row = y + row * cols;

    float sum_sq = 0.0f;  // accumulate in float32 whatever the storage type
    for (int64_t c = 0; c < cols; ++c) {
      const float v = static_cast<float>(x_row[c]);
      sum_sq += v * v;
    }
    const float r = 1.0f / std::sqrt(sum_sq / static_cast<float>(cols) + eps);

    for (int64_t c = 0; c < cols; ++c) {
      // Round the normalised value to x's dtype first (Hugging Face's order), then multiply in float32.
      const float x_hat = static_cast<float>(static_cast<In>(static_cast<float>(x_row[c]) * r));
      y_row[c] = static_cast<Out>(x_hat * static_cast<float>(w[c]));
    }
    rstd[row] = r;
  }
}

// Numbers in error messages are turned into strings with std::to_string before they reach TORCH_CHECK. On the GPU
// machines this workbook was measured on (torch 2.11.0+cu130, g++ 13.3), streaming an integer into a TORCH_CHECK
// message (c10::str, an std::ostringstream) crashed the process with a segmentation fault instead of raising, while
// strings streamed fine; to_string does not go through a stream.
std::string shape_string(at::IntArrayRef sizes) {  // as Python prints a shape, e.g. "(4, 8)"
  std::string text = "(";
  for (size_t i = 0; i < sizes.size(); ++i) {
    text += (i ? ", " : "") + std::to_string(sizes[i]);
  }
  return text + (sizes.size() == 1 ? ",)" : ")");
}

void check_inputs(const at::Tensor& x, const at::Tensor& weight) {
  // TORCH_CHECK_TYPE / TORCH_CHECK_VALUE reach Python as TypeError / ValueError.
  TORCH_CHECK_VALUE(x.dim() >= 1, "x must have at least one dimension (the hidden size), got a scalar");
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == x.size(-1), "weight must have shape (",
                    std::to_string(x.size(-1)), ",) to match the last dimension of x ", shape_string(x.sizes()),
                    ", got ", shape_string(weight.sizes()));
  const auto xt = x.scalar_type();
  TORCH_CHECK_TYPE(xt == at::kFloat || xt == at::kBFloat16 || xt == at::kHalf,
                   "x must be float32, bfloat16 or float16, got ", xt);
  TORCH_CHECK_TYPE(weight.scalar_type() == xt || weight.scalar_type() == at::kFloat,
                   "weight must have x's dtype (", xt, ") or float32, got ", weight.scalar_type());
  TORCH_CHECK_VALUE(x.device().is_cpu() && weight.device().is_cpu(), "kernels_cpp runs on the CPU, got x on ",
                    x.device().str(), " and weight on ", weight.device().str());
}

template <typename In>
void dispatch_output(const at::Tensor& x_rows, const at::Tensor& w, at::Tensor& y, at::Tensor& rstd, float eps) {
  const int64_t rows = x_rows.size(0), cols = x_rows.size(1), stride = x_rows.stride(0);
  if (y.scalar_type() == at::kFloat) {
    rms_norm_rows<In, float>(x_rows.data_ptr<In>(), stride, w.data_ptr<float>(), y.data_ptr<float>(),
                             rstd.data_ptr<float>(), rows, cols, eps);
  } else {
    rms_norm_rows<In, In>(x_rows.data_ptr<In>(), stride, w.data_ptr<In>(), y.data_ptr<In>(),
                          rstd.data_ptr<float>(), rows, cols, eps);
  }
}

// The operator: (y, rstd) = rms_norm_fwd(x, weight, eps), the same schema as torch.ops.kernels.rms_norm_fwd.
std::tuple<at::Tensor, at::Tensor> rms_norm_fwd_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_inputs(x, weight);
  const int64_t cols = x.size(-1);
  const int64_t rows = cols ? x.numel() / cols : 0;
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(weight.scalar_type()));  // promote(x, w) = w's dtype
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  if (rows == 0) return {y, rstd};

  // Rows must be evenly spaced with unit stride along the hidden size; reshape copies only when they are not.
  const at::Tensor x_rows = (x.stride(-1) == 1 ? x : x.contiguous()).reshape({rows, cols});
  const at::Tensor w = weight.contiguous();
  const float eps_f = static_cast<float>(eps);
  switch (x.scalar_type()) {
    case at::kFloat: dispatch_output<float>(x_rows, w, y, rstd, eps_f); break;
    case at::kBFloat16: dispatch_output<c10::BFloat16>(x_rows, w, y, rstd, eps_f); break;
    default: dispatch_output<c10::Half>(x_rows, w, y, rstd, eps_f); break;  // float16: check_inputs allows no other
  }
  return {y, rstd};
}

}  // namespace

// The schema: the operator's name and types, in PyTorch's own language. Python reaches it as
// torch.ops.kernels_cpp.rms_norm_fwd once this library is loaded.
TORCH_LIBRARY(kernels_cpp, m) {
  m.def("rms_norm_fwd(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)");
}

// The implementation for CPU tensors. The fake implementation (shapes only, for torch.compile) is registered from
// Python, next to the Triton operators' (kernels/cuda_rmsnorm.py).
TORCH_LIBRARY_IMPL(kernels_cpp, CPU, m) {
  m.impl("rms_norm_fwd", &rms_norm_fwd_cpu);
}
