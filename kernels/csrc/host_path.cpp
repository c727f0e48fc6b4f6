// The host path in C++ of SwiGLU, RoPE and RMSNorm: the autograd nodes and the launches of the Triton-compiled
// kernels.
//
// A Python autograd.Function with one Triton launch per pass costs more host time per forward + backward than
// Hugging Face's SwiGLU in C++ operators before its kernels do anything (kernels.bench.overhead.floor). Here the
// kernels of kernels/swiglu.py, kernels/rope.py and kernels/rmsnorm.py, compiled by Triton as always, are launched
// from C++ torch::autograd::Functions: no Python runs between a forward's launch and its backward's. Only the dense
// layouts take this path (SwiGLU: tensors read as rows of 1,024; RoPE: the layouts of its dense kernel; RMSNorm:
// contiguous x and dy); the Python side (kernels/host_path.py) decides, compiles each kernel variant through Triton
// and registers it here.
//
// A Triton kernel is specialised on its arguments: an integer equal to 1 becomes a constant and leaves the
// parameter list, and 16-byte alignment of a pointer or divisibility by 16 of an integer selects another compiled
// variant. Variants are looked up by exactly those properties and by everything the launch configuration depends
// on; a miss (or anything unusual: a layout the kernel does not read, a tensor subclass, a dispatch mode) calls
// back into Python, which runs the Python path and registers the variant it compiled for the next call.

#include <torch/extension.h>

#include <ATen/record_function.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>
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
  int64_t rows;      // RMSNorm: rows per program (forward) or per loop step (backward)
  int64_t programs;  // RMSNorm: the most programs of the persistent backward (one per SM); the dW sum's grid
};

enum Kind : int64_t {
  kSwiGLUForward = 0, kSwiGLUBackward = 1, kRoPEForward = 2, kRoPEBackward = 3,
  kRMSNormForward = 4, kRMSNormBackward = 5, kRMSNormDW = 6
};

LaunchFn g_launch = nullptr;
int64_t g_cols = 0;  // the row width dense SwiGLU tensors are read as (kernels/swiglu.py's _RECUT_COLS)
std::mutex g_mutex;  // registrations come from Python, lookups also from autograd's device threads
std::unordered_map<std::string, Variant> g_variants;
// The Python paths, which also register what they compiled. Never freed: a py::object destroyed after the
// interpreter has finalised would crash the process at exit.
py::object* g_swiglu_forward_fallback = nullptr;   // (gate, up) -> y
py::object* g_swiglu_backward_fallback = nullptr;  // (dy, gate, up) -> (d_gate, d_up)
py::object* g_rope_forward_fallback = nullptr;     // (q, k, cos, sin) -> (q_embed, k_embed)
py::object* g_rope_backward_fallback = nullptr;    // (dq_embed, dk_embed, cos, sin, like, seq_major) -> (dq, dk)
py::object* g_rms_norm_forward_fallback = nullptr;   // (x, weight, eps) -> (y, rstd)
py::object* g_rms_norm_backward_fallback = nullptr;  // (dy, x, weight, rstd, compute_dw) -> (dx, dw)

// A launch's kernel arguments, and the properties of them that Triton specialises on.
struct Args {
  std::vector<void*> pointers;
  std::vector<int64_t> ints;
  std::vector<float> reals;  // float arguments (RMSNorm's eps): Triton passes them as 32-bit, specialises on nothing
  std::vector<int64_t> key;

  explicit Args(Kind kind, std::initializer_list<int64_t> config) : key{kind} { key.insert(key.end(), config); }
  void pointer(const at::Tensor& t) {
    pointers.push_back(t.data_ptr());
    key.push_back(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0);
    key.push_back(static_cast<int64_t>(t.scalar_type()));
  }
  void integer(int64_t v) {  // below 2**31 on these paths: Triton passes it as a 32-bit integer
    ints.push_back(v);
    key.push_back(v == 1);
    key.push_back(v % 16 == 0);
  }
  void real(double v) { reals.push_back(static_cast<float>(v)); }
  std::string id() const { return std::string(reinterpret_cast<const char*>(key.data()), key.size() * 8); }
};

bool find(const Args& args, Variant* out) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_variants.find(args.id());
  if (it == g_variants.end()) return false;
  *out = it->second;
  return true;
}

// One launch of a registered variant on the current stream of ``device``, ``grid`` programs.
void launch(const Variant& v, const Args& args, at::Device device, int64_t grid) {
  std::vector<void*> pointers = args.pointers;
  std::vector<int32_t> ints;
  for (int64_t i : args.ints) ints.push_back(static_cast<int32_t>(i));
  std::vector<float> reals = args.reals;
  void* null_pointer = nullptr;
  std::vector<void*> params;
  for (void*& p : pointers) params.push_back(&p);
  for (size_t i = 0; i < ints.size(); ++i) {
    if (args.ints[i] != 1) params.push_back(&ints[i]);  // an integer equal to 1 is a constant in that variant
  }
  for (float& r : reals) params.push_back(&r);  // after the integers: the kernels declare their floats last
  for (int i = 0; i < v.n_scratch; ++i) params.push_back(&null_pointer);
  c10::cuda::CUDAGuard guard(device);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  int rc = g_launch(v.function, static_cast<unsigned>(grid), 1, 1, v.threads, 1, 1, v.shared, stream,
                    params.data(), nullptr);
  TORCH_CHECK(rc == 0, "cuLaunchKernel failed with CUDA driver error ", rc);
}

void do_register(const Args& args, int64_t function, int64_t threads, int64_t shared, int64_t n_scratch,
                 int64_t rows = 1, int64_t programs = 0) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_variants[args.id()] = {reinterpret_cast<void*>(function), static_cast<unsigned>(threads),
                           static_cast<unsigned>(shared), static_cast<int>(n_scratch), rows, programs};
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Nothing that intercepts calls: no dispatch mode, no tensor subclass (the Python path goes through the operators).
bool plain(std::initializer_list<const at::Tensor*> tensors) {
  if (c10::impl::TorchDispatchModeTLS::stack_len() != 0) return false;
  for (const at::Tensor* t : tensors) {
    if (t->key_set().has(c10::DispatchKey::Python)) return false;
  }
  return true;
}

// ------------------------------------------------------------------------------------------------------------------
// SwiGLU: swiglu_fwd_kernel(GATE, UP, Y, n_rows, n_cols, 3 strides), swiglu_bwd_kernel(DY, GATE, UP, DGATE, DUP,
// n_rows, n_cols, 5 strides); dense tensors as rows of 1,024, one row per program.
// ------------------------------------------------------------------------------------------------------------------

Args swiglu_args(Kind kind, std::initializer_list<const at::Tensor*> tensors) {
  Args args(kind, {(*tensors.begin())->get_device()});
  for (const at::Tensor* t : tensors) args.pointer(*t);
  args.integer((*tensors.begin())->numel() / g_cols);
  for (size_t i = 0; i <= tensors.size(); ++i) args.integer(g_cols);  // n_cols, then one stride per tensor
  return args;
}

at::Tensor swiglu_forward_impl(const at::Tensor& gate, const at::Tensor& up) {
  at::Tensor y = at::empty_like(gate);
  if (gate.numel() == 0) return y;
  Args args = swiglu_args(kSwiGLUForward, {&gate, &up, &y});
  Variant v;
  if (!find(args, &v)) {
    py::gil_scoped_acquire gil;
    return (*g_swiglu_forward_fallback)(gate, up).cast<at::Tensor>();
  }
  launch(v, args, gate.device(), gate.numel() / g_cols);
  return y;
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward_impl(const at::Tensor& dy, const at::Tensor& gate,
                                                        const at::Tensor& up) {
  at::Tensor d_gate = at::empty_like(gate), d_up = at::empty_like(up);
  if (gate.numel() == 0) return {d_gate, d_up};
  bool dense = dy.is_contiguous() && dy.scalar_type() == gate.scalar_type() && dy.sizes() == gate.sizes() &&
               plain({&dy});
  Variant v;
  Args args = swiglu_args(kSwiGLUBackward, {&dy, &gate, &up, &d_gate, &d_up});
  if (!dense || !find(args, &v)) {
    py::gil_scoped_acquire gil;
    return (*g_swiglu_backward_fallback)(dy, gate, up).cast<std::tuple<at::Tensor, at::Tensor>>();
  }
  launch(v, args, gate.device(), gate.numel() / g_cols);
  return {d_gate, d_up};
}

struct SwiGLUNode : public torch::autograd::Function<SwiGLUNode> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up) {
    ctx->save_for_backward({gate, up});
    return swiglu_forward_impl(gate, up);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    // The kernels are not differentiable: refuse a second backward, as Python's once_differentiable does.
    TORCH_CHECK(!at::GradMode::is_enabled(), "kernels.swiglu: a second derivative (create_graph=True) is not "
                "supported");
    auto saved = ctx->get_saved_variables();
    auto [d_gate, d_up] = swiglu_backward_impl(grads[0], saved[0], saved[1]);
    return {ctx->needs_input_grad(0) ? d_gate : at::Tensor(), ctx->needs_input_grad(1) ? d_up : at::Tensor()};
  }
};

// ------------------------------------------------------------------------------------------------------------------
// RoPE: _rope_dense_kernel(Q, K, COS, SIN, QO, KO, n_rows, seq) with three layout flags, one position per program.
// ------------------------------------------------------------------------------------------------------------------

// As kernels/rope.py's _head_order: 1 for [batch, heads, seq, D] seen from dense [batch, seq, heads, D] memory
// (Llama's q and k), 0 for contiguous [batch, heads, seq, D] (attention's gradients), -1 for any other layout.
int head_order(const at::Tensor& t) {
  auto s = t.strides();
  int64_t h = t.size(1), n = t.size(2), d = t.size(3);
  if (s[0] == n * h * d && s[1] == d && s[2] == h * d && s[3] == 1) return 1;
  if (s[0] == h * n * d && s[1] == n * d && s[2] == d && s[3] == 1) return 0;
  return -1;
}

// As _trig_batched: 0 for one [seq, D] block for every batch ([1, seq, D]), 1 for contiguous [batch, seq, D].
int trig_batched(const at::Tensor& t) {
  auto s = t.strides();
  int64_t n = t.size(1), d = t.size(2);
  if (t.size(0) == 1 && s[1] == d && s[2] == 1) return 0;
  return s[0] == n * d && s[1] == d && s[2] == 1 ? 1 : -1;
}

// Whether q and k (or their gradients), cos and sin are laid out as the dense kernel reads them (the inputs' half of
// _dense_flags): checked before the outputs are allocated, since a miss hands the call to Python, which allocates
// its own.
bool dense_inputs(const at::Tensor& x, const at::Tensor& y, const at::Tensor& cos, const at::Tensor& sin) {
  int xo = head_order(x), trig = trig_batched(cos);
  return xo >= 0 && trig >= 0 && head_order(y) == xo && trig_batched(sin) == trig;
}

// The launch's arguments, or false when a layout is not the dense kernel's (as _dense_flags).
bool rope_args(Kind kind, const at::Tensor& x, const at::Tensor& y, const at::Tensor& cos, const at::Tensor& sin,
               const at::Tensor& x_out, const at::Tensor& y_out, Args* out) {
  int oo = head_order(x_out);
  if (!dense_inputs(x, y, cos, sin) || oo < 0 || head_order(y_out) != oo) return false;
  *out = Args(kind, {x.get_device(), x.size(1), y.size(1), x.size(3), head_order(x), oo, trig_batched(cos)});
  for (const at::Tensor* t : {&x, &y, &cos, &sin, &x_out, &y_out}) out->pointer(*t);
  out->integer(x.size(0) * x.size(2));  // rows: (batch, position) pairs
  out->integer(x.size(2));
  return true;
}

std::tuple<at::Tensor, at::Tensor> rope_forward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                                     const at::Tensor& sin) {
  auto fallback = [&] {
    py::gil_scoped_acquire gil;
    return (*g_rope_forward_fallback)(q, k, cos, sin).cast<std::tuple<at::Tensor, at::Tensor>>();
  };
  if (!dense_inputs(q, k, cos, sin)) return fallback();
  auto dtype = at::promote_types(q.scalar_type(), cos.scalar_type());
  at::Tensor q_out = at::empty_like(q, q.options().dtype(dtype)), k_out = at::empty_like(k, k.options().dtype(dtype));
  int64_t n_rows = q.size(0) * q.size(2);
  if (n_rows == 0) return {q_out, k_out};
  Args args(kRoPEForward, {});
  Variant v;
  if (!rope_args(kRoPEForward, q, k, cos, sin, q_out, k_out, &args) || !find(args, &v)) return fallback();
  launch(v, args, q.device(), n_rows);
  return {q_out, k_out};
}

// As _grad_buffer: the gradient in q's memory order when q was seq-major, else in the incoming gradient's layout.
at::Tensor grad_buffer(const at::Tensor& like, at::ScalarType dtype, bool seq_major) {
  if (!seq_major) return at::empty_like(like, like.options().dtype(dtype));
  return at::empty({like.size(0), like.size(2), like.size(1), like.size(3)}, like.options().dtype(dtype))
      .transpose(1, 2);
}

std::tuple<at::Tensor, at::Tensor> rope_backward_impl(const at::Tensor& dq_embed, const at::Tensor& dk_embed,
                                                      const at::Tensor& cos, const at::Tensor& sin,
                                                      at::ScalarType dtype, bool seq_major) {
  auto fallback = [&] {
    py::gil_scoped_acquire gil;
    // The gradients' dtype travels as an empty tensor of it: a tensor is what both sides already convert.
    at::Tensor like = at::empty({0}, dq_embed.options().dtype(dtype));
    return (*g_rope_backward_fallback)(dq_embed, dk_embed, cos, sin, like, seq_major)
        .cast<std::tuple<at::Tensor, at::Tensor>>();
  };
  if (!plain({&dq_embed, &dk_embed}) || dq_embed.scalar_type() != dk_embed.scalar_type() ||
      !dense_inputs(dq_embed, dk_embed, cos, sin)) {
    return fallback();
  }
  at::Tensor dq = grad_buffer(dq_embed, dtype, seq_major), dk = grad_buffer(dk_embed, dtype, seq_major);
  int64_t n_rows = dq_embed.size(0) * dq_embed.size(2);
  if (n_rows == 0) return {dq, dk};
  Args args(kRoPEBackward, {});
  Variant v;
  if (!rope_args(kRoPEBackward, dq_embed, dk_embed, cos, sin, dq, dk, &args) || !find(args, &v)) return fallback();
  launch(v, args, dq_embed.device(), n_rows);
  return {dq, dk};
}

bool is_seq_major(const at::Tensor& t) { return t.transpose(1, 2).is_contiguous(); }

struct RotaryNode : public torch::autograd::Function<RotaryNode> {
  // cos and sin need no gradient on this path (the Python side checks): only they are saved.
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                                                const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["dtype"] = static_cast<int64_t>(q.scalar_type());
    ctx->saved_data["seq_major"] = is_seq_major(q) && is_seq_major(k);
    auto [q_out, k_out] = rope_forward_impl(q, k, cos, sin);
    return {q_out, k_out};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(), "kernels.apply_rotary: a second derivative (create_graph=True) is "
                "not supported on this path");
    auto saved = ctx->get_saved_variables();
    auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    auto [dq, dk] = rope_backward_impl(grads[0], grads[1], saved[0], saved[1], dtype,
                                       ctx->saved_data["seq_major"].toBool());
    return {ctx->needs_input_grad(0) ? dq : at::Tensor(), ctx->needs_input_grad(1) ? dk : at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};


// ------------------------------------------------------------------------------------------------------------------
// RMSNorm: rms_norm_fwd_kernel(X, W, Y, RSTD, n_rows, n_cols, stride_x, stride_y, eps), cdiv(n_rows, ROWS)
// programs; rms_norm_bwd_kernel(X, W, DY, RSTD, DX, DW_PARTIAL, n_rows, n_cols, stride_x, stride_dy, stride_dx) on
// a persistent grid, then rms_norm_dw_kernel(PARTIAL, DW, n_partials, n_cols) when the weight needs a gradient.
// Contiguous x and dy only (the Python side checks x; dy is checked here), so every row stride is n_cols.
// ------------------------------------------------------------------------------------------------------------------

int64_t n_cols_of(const at::Tensor& x) { return x.size(-1); }
int64_t n_rows_of(const at::Tensor& x) { return x.numel() / x.size(-1); }

// The launch configurations depend on the width (and the device): it is part of every key, exactly.
Args rms_forward_args(const at::Tensor& x, const at::Tensor& w, const at::Tensor& y, const at::Tensor& rstd) {
  int64_t n_cols = n_cols_of(x);
  Args args(kRMSNormForward, {x.get_device(), n_cols});
  for (const at::Tensor* t : {&x, &w, &y, &rstd}) args.pointer(*t);
  for (int64_t v : {n_rows_of(x), n_cols, n_cols, n_cols}) args.integer(v);
  return args;
}

// Without DW_PARTIAL, which is allocated once the variant's grid is known: a fresh float32 buffer, or dx itself
// when no dW is computed, so compute_dw and dx's properties already fix its own.
Args rms_backward_args(const at::Tensor& x, const at::Tensor& w, const at::Tensor& dy, const at::Tensor& rstd,
                       const at::Tensor& dx, bool compute_dw) {
  int64_t n_cols = n_cols_of(x);
  Args args(kRMSNormBackward, {x.get_device(), n_cols, compute_dw});
  for (const at::Tensor* t : {&x, &w, &dy, &rstd, &dx}) args.pointer(*t);
  for (int64_t v : {n_rows_of(x), n_cols, n_cols, n_cols, n_cols}) args.integer(v);
  return args;
}

// The dW sum's tile of partials depends on how many there are (one per program of the backward).
Args rms_dw_args(const at::Tensor& partial, const at::Tensor& dw) {
  Args args(kRMSNormDW, {partial.get_device(), partial.size(1), partial.size(0)});
  args.pointer(partial);
  args.pointer(dw);
  args.integer(partial.size(0));
  args.integer(partial.size(1));
  return args;
}

std::tuple<at::Tensor, at::Tensor> rms_norm_forward_impl(const at::Tensor& x, const at::Tensor& w, double eps) {
  auto dtype = at::promote_types(x.scalar_type(), w.scalar_type());
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(dtype));
  at::Tensor rstd = at::empty({n_rows_of(x)}, x.options().dtype(at::kFloat));
  Args args = rms_forward_args(x, w, y, rstd);
  Variant v;
  if (!find(args, &v)) {
    py::gil_scoped_acquire gil;
    return (*g_rms_norm_forward_fallback)(x, w, eps).cast<std::tuple<at::Tensor, at::Tensor>>();
  }
  args.real(eps);
  launch(v, args, x.device(), ceil_div(n_rows_of(x), v.rows));
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_impl(const at::Tensor& dy, const at::Tensor& x,
                                                          const at::Tensor& w, const at::Tensor& rstd,
                                                          bool compute_dw) {
  auto fallback = [&] {
    py::gil_scoped_acquire gil;
    return (*g_rms_norm_backward_fallback)(dy, x, w, rstd, compute_dw).cast<std::tuple<at::Tensor, at::Tensor>>();
  };
  if (!plain({&dy}) || !dy.is_contiguous() || dy.sizes() != x.sizes()) return fallback();
  at::Tensor dx = at::empty(x.sizes(), x.options());
  Args args = rms_backward_args(x, w, dy, rstd, dx, compute_dw);
  Variant v, dv;
  if (!find(args, &v)) return fallback();
  int64_t programs = std::max<int64_t>(1, std::min(v.programs, ceil_div(n_rows_of(x), v.rows)));
  at::Tensor partial = compute_dw ? at::empty({programs, n_cols_of(x)}, x.options().dtype(at::kFloat)) : dx;
  at::Tensor dw = compute_dw ? at::empty_like(w) : w.new_empty({0});
  Args dw_args = compute_dw ? rms_dw_args(partial, dw) : Args(kRMSNormDW, {});
  if (compute_dw && !find(dw_args, &dv)) return fallback();
  args.pointers.push_back(partial.data_ptr());  // DW_PARTIAL: the last pointer parameter
  launch(v, args, x.device(), programs);
  if (compute_dw) launch(dv, dw_args, x.device(), dv.programs);
  return {dx, dw};
}

struct RMSNormNode : public torch::autograd::Function<RMSNormNode> {
  // Saved: x and the weight (inputs), and the float32 rstd per row, which needs no gradient.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            double eps) {
    auto [y, rstd] = rms_norm_forward_impl(x, w, eps);
    ctx->save_for_backward({x, w});
    ctx->saved_data["rstd"] = rstd;
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(), "kernels.rms_norm: a second derivative (create_graph=True) is not "
                "supported");
    auto saved = ctx->get_saved_variables();
    bool compute_dw = ctx->needs_input_grad(1);  // a frozen weight skips the dW sum
    auto [dx, dw] = rms_norm_backward_impl(grads[0], saved[0], saved[1], ctx->saved_data["rstd"].toTensor(),
                                           compute_dw);
    return {ctx->needs_input_grad(0) ? dx : at::Tensor(), compute_dw ? dw : at::Tensor(), at::Tensor()};
  }
};

}  // namespace

// Each entry point opens a profiler record, as a Python autograd.Function's apply does: a profiler attributes a
// kernel to the operator active when it was launched, and without one the forward's launches would show up as device
// work linked to nothing. (Backward launches run inside the autograd engine's record of the node.)

// gate and up: dense, same shape, dtype and CUDA device, numel divisible by 1,024 (the Python side checks).
at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up, bool with_grad) {
  RECORD_FUNCTION("SwiGLUNode", std::vector<c10::IValue>({gate, up}));
  if (with_grad) return SwiGLUNode::apply(gate, up);
  return swiglu_forward_impl(gate, up);
}

// q, k, cos, sin: checked by the Python side (apply_rotary's checks, CUDA, cos and sin needing no gradient).
std::tuple<at::Tensor, at::Tensor> rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                        const at::Tensor& sin, bool with_grad) {
  RECORD_FUNCTION("RotaryNode", std::vector<c10::IValue>({q, k, cos, sin}));
  if (!with_grad) return rope_forward_impl(q, k, cos, sin);
  auto out = RotaryNode::apply(q, k, cos, sin);
  return {out[0], out[1]};
}

// x: contiguous, on a CUDA device, at least one element; weight: contiguous, [x.size(-1)] (the Python side checks).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool with_grad) {
  RECORD_FUNCTION("RMSNormNode", std::vector<c10::IValue>({x, weight}));
  if (with_grad) return RMSNormNode::apply(x, weight, eps);
  return std::get<0>(rms_norm_forward_impl(x, weight, eps));
}

void set_launcher(int64_t cu_launch_kernel, int64_t cols, py::object swiglu_forward, py::object swiglu_backward,
                  py::object rope_forward, py::object rope_backward, py::object rms_norm_forward,
                  py::object rms_norm_backward) {
  g_launch = reinterpret_cast<LaunchFn>(cu_launch_kernel);
  g_cols = cols;
  g_swiglu_forward_fallback = new py::object(std::move(swiglu_forward));
  g_swiglu_backward_fallback = new py::object(std::move(swiglu_backward));
  g_rope_forward_fallback = new py::object(std::move(rope_forward));
  g_rope_backward_fallback = new py::object(std::move(rope_backward));
  g_rms_norm_forward_fallback = new py::object(std::move(rms_norm_forward));
  g_rms_norm_backward_fallback = new py::object(std::move(rms_norm_backward));
}

// Register the variant Triton compiled for these very arguments (the Python side has checked its parameter list).
void register_swiglu(bool backward, std::vector<at::Tensor> tensors, int64_t function, int64_t threads,
                     int64_t shared, int64_t n_scratch) {
  Kind kind = backward ? kSwiGLUBackward : kSwiGLUForward;
  Args args = backward ? swiglu_args(kind, {&tensors[0], &tensors[1], &tensors[2], &tensors[3], &tensors[4]})
                       : swiglu_args(kind, {&tensors[0], &tensors[1], &tensors[2]});
  do_register(args, function, threads, shared, n_scratch);
}

bool register_rope(bool backward, std::vector<at::Tensor> t, int64_t function, int64_t threads, int64_t shared,
                   int64_t n_scratch) {
  Kind kind = backward ? kRoPEBackward : kRoPEForward;
  Args args(kind, {});
  if (!rope_args(kind, t[0], t[1], t[2], t[3], t[4], t[5], &args)) return false;
  do_register(args, function, threads, shared, n_scratch);
  return true;
}

// stage 0: the forward (x, weight, y, rstd); 1: the backward (x, weight, dy, rstd, dx, with compute_dw); 2: the dW
// sum (partial, dw). ``rows`` and ``programs`` as in Variant.
void register_rms_norm(int64_t stage, std::vector<at::Tensor> t, bool compute_dw, int64_t function, int64_t threads,
                       int64_t shared, int64_t n_scratch, int64_t rows, int64_t programs) {
  Args args = stage == 0   ? rms_forward_args(t[0], t[1], t[2], t[3])
              : stage == 1 ? rms_backward_args(t[0], t[1], t[2], t[3], t[4], compute_dw)
                           : rms_dw_args(t[0], t[1]);
  do_register(args, function, threads, shared, n_scratch, rows, programs);
}

int64_t n_variants() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return static_cast<int64_t>(g_variants.size());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("swiglu", &swiglu, "silu(gate) * up through the C++ autograd node", py::arg("gate"), py::arg("up"),
        py::arg("with_grad"));
  m.def("rope", &rope, "(q_embed, k_embed) through the C++ autograd node", py::arg("q"), py::arg("k"),
        py::arg("cos"), py::arg("sin"), py::arg("with_grad"));
  m.def("rms_norm", &rms_norm, "RMSNorm through the C++ autograd node", py::arg("x"), py::arg("weight"),
        py::arg("eps"), py::arg("with_grad"));
  m.def("set_launcher", &set_launcher);
  m.def("register_rms_norm", &register_rms_norm);
  m.def("register_swiglu", &register_swiglu);
  m.def("register_rope", &register_rope);
  m.def("n_variants", &n_variants);
}
