// SwiGLU's host path in C++: the autograd node and the launches of the Triton-compiled kernels.
//
// kernels/swiglu.py's autograd.Function costs more host time per forward + backward than Hugging Face's two C++
// operators before its kernels do anything (kernels.overhead.floor). Here the same two kernels, compiled by Triton
// as always, are launched from a C++ torch::autograd::Function: no Python runs between the forward's launch and
// the backward's. Only dense tensors read as rows of 1,024 (kernels/swiglu.py, _RECUT_COLS) take this path; the
// Python side (kernels/host_path.py) decides, compiles each kernel variant through Triton and registers it here.
//
// A Triton kernel is specialised on its arguments: an integer equal to 1 becomes a constant and leaves the
// parameter list, and 16-byte alignment of a pointer or divisibility by 16 of an integer selects another compiled
// variant. Variants are looked up by exactly those properties; a miss (or anything unusual: a strided gradient, a
// tensor subclass, a dispatch mode, double backward) calls back into Python, which runs the Python path and
// registers the variant it compiled for the next call.

#include <torch/extension.h>

#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace {

// cuLaunchKernel, found by the Python side in the driver library (no link against libcuda needed here).
using LaunchFn = int (*)(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                         unsigned shared, void* stream, void** params, void** extra);

struct Variant {
  void* function;    // the CUfunction Triton loaded for this device
  unsigned threads;  // num_warps * 32
  unsigned shared;   // bytes of dynamic shared memory
  int n_scratch;     // trailing scratch-pointer parameters (passed as null; registered only when unused)
};

constexpr int64_t kCols = 1024;  // the rows dense tensors are read as (kernels/swiglu.py, _RECUT_COLS)
enum Kind : uint64_t { kForward = 0, kBackward = 1 };

LaunchFn g_launch = nullptr;
std::mutex g_mutex;  // registrations come from Python, lookups also from autograd's device threads
std::unordered_map<uint64_t, Variant> g_variants;
// The Python path, which also registers what it compiled: (gate, up) -> y and (dy, gate, up) -> (d_gate, d_up).
// Never freed: a py::object destroyed after the interpreter has finalised would crash the process at exit.
py::object* g_forward_fallback = nullptr;
py::object* g_backward_fallback = nullptr;

// The properties Triton specialises on, for the pointers and the one runtime integer (the row count) that vary.
uint64_t variant_key(Kind kind, const std::vector<const at::Tensor*>& tensors, int64_t n_rows) {
  const at::Tensor& first = *tensors[0];
  uint64_t key = kind;
  key = key << 8 | static_cast<uint64_t>(first.get_device());
  key = key << 8 | static_cast<uint64_t>(first.scalar_type());
  key = key << 1 | (n_rows == 1);
  key = key << 1 | (n_rows % 16 == 0);
  for (const at::Tensor* t : tensors) {
    key = key << 1 | (reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0);
  }
  return key;
}

bool find(uint64_t key, Variant* out) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_variants.find(key);
  if (it == g_variants.end()) return false;
  *out = it->second;
  return true;
}

// One launch of a registered variant on the current stream of the tensors' device, one program per row.
void launch(const Variant& v, const at::Tensor& like, int64_t n_rows, std::vector<void*>& pointers) {
  int32_t rows32 = static_cast<int32_t>(n_rows), cols = static_cast<int32_t>(kCols);
  void* null_pointer = nullptr;
  std::vector<void*> params;
  for (void*& p : pointers) params.push_back(&p);
  if (n_rows != 1) params.push_back(&rows32);  // a row count of 1 is a constant in that variant
  size_t n_ints = pointers.size() == 3 ? 4 : 6;  // n_cols and the strides: all kCols for dense rows
  for (size_t i = 0; i < n_ints; ++i) params.push_back(&cols);
  for (int i = 0; i < v.n_scratch; ++i) params.push_back(&null_pointer);
  c10::cuda::CUDAGuard guard(like.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(like.get_device()).stream();
  int rc = g_launch(v.function, static_cast<unsigned>(n_rows), 1, 1, v.threads, 1, 1, v.shared, stream,
                    params.data(), nullptr);
  TORCH_CHECK(rc == 0, "cuLaunchKernel failed with CUDA driver error ", rc);
}

int64_t rows_of(const at::Tensor& t) { return t.numel() / kCols; }

at::Tensor forward_impl(const at::Tensor& gate, const at::Tensor& up) {
  at::Tensor y = at::empty_like(gate);
  int64_t n_rows = rows_of(gate);
  Variant v;
  if (n_rows == 0) return y;
  if (!find(variant_key(kForward, {&gate, &up, &y}, n_rows), &v)) {
    py::gil_scoped_acquire gil;
    return (*g_forward_fallback)(gate, up).cast<at::Tensor>();
  }
  std::vector<void*> pointers = {gate.data_ptr(), up.data_ptr(), y.data_ptr()};
  launch(v, gate, n_rows, pointers);
  return y;
}

bool plain_dense(const at::Tensor& dy, const at::Tensor& gate) {
  return dy.is_contiguous() && dy.scalar_type() == gate.scalar_type() && dy.device() == gate.device() &&
         dy.sizes() == gate.sizes() && !dy.key_set().has(c10::DispatchKey::Python) &&
         c10::impl::TorchDispatchModeTLS::stack_len() == 0;
}

std::tuple<at::Tensor, at::Tensor> backward_impl(const at::Tensor& dy, const at::Tensor& gate,
                                                 const at::Tensor& up) {
  int64_t n_rows = rows_of(gate);
  at::Tensor d_gate = at::empty_like(gate), d_up = at::empty_like(up);
  Variant v;
  if (n_rows == 0) return {d_gate, d_up};
  if (!plain_dense(dy, gate) || !find(variant_key(kBackward, {&dy, &gate, &up, &d_gate, &d_up}, n_rows), &v)) {
    py::gil_scoped_acquire gil;
    return (*g_backward_fallback)(dy, gate, up).cast<std::tuple<at::Tensor, at::Tensor>>();
  }
  std::vector<void*> pointers = {dy.data_ptr(), gate.data_ptr(), up.data_ptr(), d_gate.data_ptr(),
                                 d_up.data_ptr()};
  launch(v, gate, n_rows, pointers);
  return {d_gate, d_up};
}

struct SwiGLUNode : public torch::autograd::Function<SwiGLUNode> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up) {
    ctx->save_for_backward({gate, up});
    return forward_impl(gate, up);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    // The kernels are not differentiable: refuse a second backward, as Python's once_differentiable does.
    TORCH_CHECK(!at::GradMode::is_enabled(), "kernels.swiglu: a second derivative (create_graph=True) is not "
                "supported");
    auto saved = ctx->get_saved_variables();
    auto [d_gate, d_up] = backward_impl(grads[0], saved[0], saved[1]);
    return {ctx->needs_input_grad(0) ? d_gate : at::Tensor(), ctx->needs_input_grad(1) ? d_up : at::Tensor()};
  }
};

}  // namespace

// gate and up: dense, same shape, dtype and CUDA device, numel divisible by 1,024 (the Python side checks).
at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up, bool with_grad) {
  if (with_grad) return SwiGLUNode::apply(gate, up);
  return forward_impl(gate, up);
}

void set_launcher(int64_t cu_launch_kernel, py::object forward_fallback, py::object backward_fallback) {
  g_launch = reinterpret_cast<LaunchFn>(cu_launch_kernel);
  g_forward_fallback = new py::object(std::move(forward_fallback));
  g_backward_fallback = new py::object(std::move(backward_fallback));
}

// Register the variant Triton compiled for these very arguments (the Python side has checked its parameter list).
void register_forward(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& y, int64_t function,
                      int64_t threads, int64_t shared, int64_t n_scratch) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_variants[variant_key(kForward, {&gate, &up, &y}, rows_of(gate))] = {
      reinterpret_cast<void*>(function), static_cast<unsigned>(threads), static_cast<unsigned>(shared),
      static_cast<int>(n_scratch)};
}

void register_backward(const at::Tensor& dy, const at::Tensor& gate, const at::Tensor& up, const at::Tensor& d_gate,
                       const at::Tensor& d_up, int64_t function, int64_t threads, int64_t shared, int64_t n_scratch) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_variants[variant_key(kBackward, {&dy, &gate, &up, &d_gate, &d_up}, rows_of(gate))] = {
      reinterpret_cast<void*>(function), static_cast<unsigned>(threads), static_cast<unsigned>(shared),
      static_cast<int>(n_scratch)};
}

int64_t n_variants() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return static_cast<int64_t>(g_variants.size());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("swiglu", &swiglu, "silu(gate) * up through the C++ autograd node", py::arg("gate"), py::arg("up"),
        py::arg("with_grad"));
  m.def("set_launcher", &set_launcher);
  m.def("register_forward", &register_forward);
  m.def("register_backward", &register_backward);
  m.def("n_variants", &n_variants);
}
