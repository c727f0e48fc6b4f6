// Fused RMSNorm in CUDA C++: forward and backward, registered as the PyTorch operators
// kernels_cuda::rms_norm_fwd and kernels_cuda::rms_norm_bwd (the same schemas as the Triton operators
// torch.ops.kernels.rms_norm_fwd/_bwd in kernels/rmsnorm.py, which this file mirrors kernel for kernel).
//
//     y = w * round_to_input_dtype(x * rstd),    rstd = 1 / sqrt(mean(x^2) + eps)
//
// For a reader who has not written CUDA before, the vocabulary:
//   * a __global__ function is a *kernel*: the host launches it as a grid of *blocks*, each block a group of up to
//     1,024 *threads* that run the same code on one streaming multiprocessor (SM) and can share memory and wait
//     for each other (__syncthreads). Threads are scheduled in *warps* of 32 that execute in lockstep.
//   * a Triton *program* corresponds to a CUDA *block*; what Triton does for a whole tile at once (tl.load of a
//     row, tl.sum), CUDA spells out per thread: each thread loads its share, and the block combines the shares.
//   * __device__ functions are called from kernels; __host__ code (plain C++) runs on the CPU and launches them.
//
// Design (kernels/rmsnorm.py does the same in Triton):
//   * all arithmetic in float32, whatever the storage type; values are rounded only when stored;
//   * 16-byte loads and stores: each thread moves a "pack" of 16 bytes (8 bf16/fp16 values, 4 fp32) per
//     instruction when every row start is 16-byte aligned and the width a multiple of the pack; otherwise the same
//     kernels are instantiated with packs of one element (the scalar fallback);
//   * row offsets in int64 (row * stride passes 2^31 once rows x hidden does);
//   * sums across a row: first within a warp with register shuffles, then across warps through shared memory;
//   * dW without atomics: each block of the backward grid keeps float32 partial sums of dW for the rows it handled
//     and writes them as one row of a [blocks, hidden] buffer; a second kernel adds the rows in a fixed order, so
//     dW is the same bits on every run;
//   * every kernel states the largest block it is launched with, __launch_bounds__(threads), and the host never
//     launches a larger one (block_threads below takes the bound). A block of T threads needs T times the registers
//     one thread uses, out of 65,536 per block; told T, the compiler keeps registers per thread within 65,536 / T
//     (64 at 1,024 threads). Without the bound it is free to use more, and the float32 backward wants more on
//     Blackwell: compiled for RTX Blackwell and GB10 (sm_120, sm_121) it was found at 72 registers, and its
//     1,024-thread launch at hidden >= 8,192 failed with "too many resources requested for launch" (bounded at
//     512 threads instead, it takes 88). Held to 64, a few kernels keep a few dozen bytes per thread in local
//     memory on sm_100 and later ("spill"): correct everywhere first. scripts/cuda_resource_usage.py prints the
//     registers and spills of every kernel per architecture, and checks them against the bounds.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>

namespace {

constexpr int kWarp = 32;
// The largest block the row kernels are launched with (the hardware's limit): their __launch_bounds__.
constexpr int kMaxThreads = 1024;

// ------------------------------------------------------------------------------------------------------------------
// Packs: N values moved by one load or store instruction
// ------------------------------------------------------------------------------------------------------------------

// alignas tells the compiler that a Pack's address is a multiple of its size, so that it may use one wide
// (128-bit) memory instruction for all N values instead of N narrow ones. The host only takes the wide path when
// that promise holds (see `packable` below).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ Pack<T, N> load_pack(const T* base, int64_t pack_index) {
  return reinterpret_cast<const Pack<T, N>*>(base)[pack_index];
}

template <typename T, int N>
__device__ __forceinline__ void store_pack(T* base, int64_t pack_index, const Pack<T, N>& pack) {
  reinterpret_cast<Pack<T, N>*>(base)[pack_index] = pack;
}

// Round a float32 value to T and back: what storing to a T tensor and loading it again would give. This is where
// Hugging Face's cast order shows: x_hat is rounded to x's dtype before it meets the weight.
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// ------------------------------------------------------------------------------------------------------------------
// Reductions: a warp with shuffles, a block through shared memory
// ------------------------------------------------------------------------------------------------------------------

// Sum over the 32 lanes of a warp. __shfl_xor_sync hands each lane the value of the lane whose index differs in
// one bit; after five exchanges (16, 8, 4, 2, 1 lanes apart) every lane holds the total. No shared memory, no
// synchronisation beyond the warp: the values travel between registers.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}

// Sum over every thread of the block; every thread gets the result. Each warp reduces its own values, lane 0 of
// each warp writes its warp's sum to shared memory, and then every warp adds those (at most 32) partial sums.
// `scratch` must hold 32 floats. blockDim.x must be a multiple of 32 (the host launches it so).
// This is what tl.sum(..., axis=1) does for a Triton program behind the scenes.
__device__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  const int n_warps = blockDim.x / kWarp;
  v = warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();  // every warp's sum is in shared memory
  v = lane < n_warps ? scratch[lane] : 0.0f;
  v = warp_sum(v);
  __syncthreads();  // everyone has read `scratch` before the next call may overwrite it
  return v;
}

// ------------------------------------------------------------------------------------------------------------------
// Kernels
// ------------------------------------------------------------------------------------------------------------------

// Forward. One block per row (a grid-stride loop covers any number of rows). Thread t handles packs t, t + B,
// t + 2B, ... of the row (B = blockDim.x), so that neighbouring threads read neighbouring 16-byte packs: the
// warp's loads combine into whole cache lines ("coalesced").
// This version reads the row twice and works for any width; the host uses it for the one-element packs of the
// fallback and for rows too wide for rms_norm_fwd_regs_kernel below, which keeps the row in registers instead.
//
// `In` is x's element type, `Out` that of y and the weight (float32 when a float32 weight promotes a bf16 x).
// VEC is the number of x values per pack: 16 / sizeof(In) on the wide path, 1 on the scalar fallback.
template <typename In, typename Out, int VEC>
__global__ void __launch_bounds__(kMaxThreads) rms_norm_fwd_kernel(const In* __restrict__ x, const Out* __restrict__ w, Out* __restrict__ y,
                                    float* __restrict__ rstd, int64_t rows, int64_t cols, int64_t x_row_stride,
                                    float eps) {
  __shared__ float scratch[kWarp];
  const int64_t packs = cols / VEC;  // the host guarantees cols % VEC == 0

  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const In* x_row = x + row * x_row_stride;  // int64 arithmetic throughout
    Out* y_row = y + row * cols;

    // Pass 1: this thread's share of sum(x^2), then the whole row's.
    float sum_sq = 0.0f;
    for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
      const Pack<In, VEC> xs = load_pack<In, VEC>(x_row, p);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float v = static_cast<float>(xs.v[i]);
        sum_sq += v * v;
      }
    }
    const float r = rsqrtf(block_sum(sum_sq, scratch) / static_cast<float>(cols) + eps);

    // Pass 2: normalise and scale. The row is read again; this block read it a moment ago, so the second read
    // is served from the on-chip caches (L1/L2), not from HBM.
    for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
      const Pack<In, VEC> xs = load_pack<In, VEC>(x_row, p);
      const Pack<Out, VEC> ws = load_pack<Out, VEC>(w, p);
      Pack<Out, VEC> ys;
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float x_hat = round_to<In>(static_cast<float>(xs.v[i]) * r);
        ys.v[i] = static_cast<Out>(x_hat * static_cast<float>(ws.v[i]));
      }
      store_pack<Out, VEC>(y_row, p, ys);
    }
    if (threadIdx.x == 0) rstd[row] = r;
  }
}

// The forward again, with the row kept in registers: each thread loads its PACKS packs of the row once, into an
// array the compiler keeps in registers (PACKS is a compile-time constant and every loop over it is unrolled), so
// the second pass reads registers instead of the caches. This is what the Triton forward does implicitly: its tile
// of the row lives in registers between tl.sum and the store. The host takes this kernel on the wide path when
// PACKS packs per thread cover the row (at most 1,024 threads), and rms_norm_fwd_kernel otherwise.
template <typename In, typename Out, int VEC, int PACKS>
__global__ void __launch_bounds__(kMaxThreads) rms_norm_fwd_regs_kernel(const In* __restrict__ x, const Out* __restrict__ w, Out* __restrict__ y,
                                         float* __restrict__ rstd, int64_t rows, int64_t cols, int64_t x_row_stride,
                                         float eps) {
  __shared__ float scratch[kWarp];
  const int64_t packs = cols / VEC;

  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const In* x_row = x + row * x_row_stride;
    Out* y_row = y + row * cols;

    // All PACKS loads are issued before any value is used: PACKS x 16 bytes in flight per thread.
    Pack<In, VEC> xs[PACKS];
#pragma unroll
    for (int j = 0; j < PACKS; ++j) {
      const int64_t p = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
      if (p < packs) xs[j] = load_pack<In, VEC>(x_row, p);
    }
    float sum_sq = 0.0f;
#pragma unroll
    for (int j = 0; j < PACKS; ++j) {
      const int64_t p = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float v = p < packs ? static_cast<float>(xs[j].v[i]) : 0.0f;
        sum_sq += v * v;
      }
    }
    const float r = rsqrtf(block_sum(sum_sq, scratch) / static_cast<float>(cols) + eps);

#pragma unroll
    for (int j = 0; j < PACKS; ++j) {
      const int64_t p = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
      if (p < packs) {
        // The weight is loaded here, after the block sum, not before it: loaded early, its packs stay live across
        // the sum's barriers, and the kernel needed 89 registers per thread instead of 56 (bf16), so fewer blocks
        // fit on an SM. It is read by every block, so it comes from L2.
        const Pack<Out, VEC> ws = load_pack<Out, VEC>(w, p);
        Pack<Out, VEC> ys;
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float x_hat = round_to<In>(static_cast<float>(xs[j].v[i]) * r);
          ys.v[i] = static_cast<Out>(x_hat * static_cast<float>(ws.v[i]));
        }
        store_pack<Out, VEC>(y_row, p, ys);
      }
    }
    if (threadIdx.x == 0) rstd[row] = r;
  }
}

// Backward: dx = rstd * (g - x_hat * mean(g * x_hat)) with g = dy * w, and this block's part of
// dW = sum over rows of dy * x_hat (x_hat rounded as in the forward pass, since that is what w multiplied).
//
// A fixed number of blocks (a few per SM) walk the rows: block b takes rows b, b + G, b + 2G, ... Each thread
// always handles the same columns (its packs), so it can keep running dW sums for them in shared memory without
// ever racing another thread; at the end the block writes its sums as row b of `dw_partial` ([G, cols] float32).
// The shared array is laid out [VEC][packs]: element i of pack p at dw_acc[i * packs + p], so that the 32 threads
// of a warp (consecutive p) touch 32 consecutive floats, which sit in 32 different banks of shared memory.
template <typename In, typename Out, int VEC>
__global__ void __launch_bounds__(kMaxThreads) rms_norm_bwd_kernel(const Out* __restrict__ dy, const In* __restrict__ x, const Out* __restrict__ w,
                                    const float* __restrict__ rstd, In* __restrict__ dx,
                                    float* __restrict__ dw_partial, int64_t rows, int64_t cols,
                                    int64_t x_row_stride, int64_t dy_row_stride, bool compute_dw) {
  __shared__ float scratch[kWarp];
  extern __shared__ float dw_acc[];  // cols floats when compute_dw, sized by the launch
  const int64_t packs = cols / VEC;

  if (compute_dw) {
    for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) dw_acc[i * packs + p] = 0.0f;
    }
  }

  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const In* x_row = x + row * x_row_stride;
    const Out* dy_row = dy + row * dy_row_stride;
    In* dx_row = dx + row * cols;
    const float r = rstd[row];

    // Pass 1: this thread's share of sum(g * x_hat), and its columns' dW terms.
    float dot = 0.0f;
    for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
      const Pack<In, VEC> xs = load_pack<In, VEC>(x_row, p);
      const Pack<Out, VEC> dys = load_pack<Out, VEC>(dy_row, p);
      const Pack<Out, VEC> ws = load_pack<Out, VEC>(w, p);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float x_hat = static_cast<float>(xs.v[i]) * r;
        const float d = static_cast<float>(dys.v[i]);
        dot += d * static_cast<float>(ws.v[i]) * x_hat;
        if (compute_dw) dw_acc[i * packs + p] += d * round_to<In>(x_hat);
      }
    }
    const float c = block_sum(dot, scratch) / static_cast<float>(cols);

    // Pass 2: dx, from x and dy read again (from the caches: this block just read them).
    for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
      const Pack<In, VEC> xs = load_pack<In, VEC>(x_row, p);
      const Pack<Out, VEC> dys = load_pack<Out, VEC>(dy_row, p);
      const Pack<Out, VEC> ws = load_pack<Out, VEC>(w, p);
      Pack<In, VEC> dxs;
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float x_hat = static_cast<float>(xs.v[i]) * r;
        const float g = static_cast<float>(dys.v[i]) * static_cast<float>(ws.v[i]);
        dxs.v[i] = static_cast<In>(r * (g - x_hat * c));
      }
      store_pack<In, VEC>(dx_row, p, dxs);
    }
  }

  if (compute_dw) {
    float* out = dw_partial + static_cast<int64_t>(blockIdx.x) * cols;
    for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) out[p * VEC + i] = dw_acc[i * packs + p];
    }
  }
}

constexpr int kSlices = 8;  // threads per column in the dW sum
constexpr int kDwThreads = kWarp * kSlices;  // its block: 32 columns x kSlices, always this size

// dW = column sums of the [n_partials, cols] float32 partials. A block owns 32 columns and has kSlices warps, so
// kSlices threads per column: thread (slice s, column c) adds partials s, s + kSlices, s + 2 kSlices, ... in that
// order, then slice 0 adds the kSlices results in order. The order never depends on timing, so neither does dW.
template <typename Out>
__global__ void __launch_bounds__(kDwThreads) dw_sum_kernel(const float* __restrict__ partial, Out* __restrict__ dw, int64_t n_partials,
                              int64_t cols) {
  __shared__ float sums[kSlices][kWarp];
  const int lane = threadIdx.x % kWarp;  // which of the block's 32 columns
  const int slice = threadIdx.x / kWarp;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kWarp + lane;
  float acc = 0.0f;
  if (col < cols) {
    for (int64_t p = slice; p < n_partials; p += kSlices) acc += partial[p * cols + col];
  }
  sums[slice][lane] = acc;
  __syncthreads();
  if (slice == 0 && col < cols) {
    float total = 0.0f;
#pragma unroll
    for (int s = 0; s < kSlices; ++s) total += sums[s][lane];
    dw[col] = static_cast<Out>(total);
  }
}

// ------------------------------------------------------------------------------------------------------------------
// Launch configuration: from the shape and the device's properties, never from one GPU model's numbers
// ------------------------------------------------------------------------------------------------------------------

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Threads per block for `want` threads' worth of work: whole warps, at least one, and at most `bound`, the
// __launch_bounds__ of the kernel launched (a larger block than a kernel was compiled for may not fit its registers).
int block_threads(int64_t want, int bound) {
  const int64_t warps = ceil_div(std::max<int64_t>(want, 1), kWarp);
  return static_cast<int>(std::min<int64_t>(bound, warps * kWarp));
}

// Threads per block of the looping kernels: about two packs per thread (so each thread has two 16-byte loads in
// flight per tensor), within the kernel's bound. 4,096 bf16 values = 512 packs -> 256 threads.
int threads_for(int64_t packs, int bound) { return block_threads(ceil_div(packs, 2), bound); }

struct DeviceInfo {
  int sm_count;
  int max_shared_optin;  // bytes of shared memory one block may ask for
};

// Read once per device; cudaDeviceGetAttribute does not touch any stream, so it is safe during CUDA-graph capture.
DeviceInfo device_info(int device) {
  constexpr int kMaxDevices = 64;
  static DeviceInfo cache[kMaxDevices] = {};
  TORCH_CHECK(device >= 0 && device < kMaxDevices, "device index out of range: ", std::to_string(device));
  DeviceInfo& info = cache[device];
  if (info.sm_count == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.max_shared_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.sm_count, cudaDevAttrMultiProcessorCount, device));
  }
  return info;
}

// Blocks of the backward grid: as many as fit on the GPU at once (by registers and shared memory, as the
// occupancy calculator says), capped at 4 per SM. More blocks keep more loads in flight; fewer mean fewer dW
// partial rows to add at the end (each is one [hidden] float32 row).
template <typename Kernel>
int64_t backward_blocks(Kernel kernel, int threads, size_t shared_bytes, const DeviceInfo& info, int64_t rows) {
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, shared_bytes));
  per_sm = std::max(1, std::min(per_sm, 4));
  return std::max<int64_t>(1, std::min<int64_t>(rows, static_cast<int64_t>(info.sm_count) * per_sm));
}

// The wide path needs every row of every tensor to start on a 16-byte boundary (a pack of Out values may be 32
// bytes: then on a 32-byte one) and the width to be a whole number of packs.
bool packable(const void* ptr, int64_t row_stride, int64_t cols, int vec, size_t itemsize) {
  const size_t pack_bytes = itemsize * vec;
  return reinterpret_cast<uintptr_t>(ptr) % pack_bytes == 0 && (row_stride * itemsize) % pack_bytes == 0 &&
         cols % vec == 0;
}

// ------------------------------------------------------------------------------------------------------------------
// Host launches for one (In, Out) pair
// ------------------------------------------------------------------------------------------------------------------

// Packs of the row per thread in the register-resident forward: four 16-byte loads in flight per thread, as many as
// the Triton forward has (two rows of 4,096 bf16 over 256 threads); 4,096 bf16 values -> 128 threads. Measured on an
// H200 against 2 and 8 (assets/notes/cuda_rmsnorm.md): 4 was fastest at every width from 2,048 to 16,384. Rows of
// up to 4 x 1,024 packs (32,768 bf16 values) take the register kernel; wider rows the looping one.
constexpr int kFwdPacks = 4;

template <typename In, typename Out>
void launch_forward(const at::Tensor& x_rows, const at::Tensor& w, at::Tensor& y, at::Tensor& rstd, float eps) {
  constexpr int kVec = 16 / sizeof(In);
  const int64_t rows = x_rows.size(0), cols = x_rows.size(1), stride = x_rows.stride(0);
  const In* xp = x_rows.data_ptr<In>();
  const Out* wp = w.data_ptr<Out>();
  Out* yp = y.data_ptr<Out>();
  const bool wide = packable(xp, stride, cols, kVec, sizeof(In)) && packable(wp, 0, cols, kVec, sizeof(Out)) &&
                    packable(yp, cols, cols, kVec, sizeof(Out));
  const int64_t grid = std::min<int64_t>(rows, INT32_MAX);  // one block per row; the kernels loop past 2^31
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t packs = cols / kVec;
  if (wide && packs <= static_cast<int64_t>(kFwdPacks) * kMaxThreads) {
    // kFwdPacks packs per thread; the condition above keeps the block within the bound, so threads x kFwdPacks
    // covers the row.
    const int threads = block_threads(ceil_div(packs, kFwdPacks), kMaxThreads);
    rms_norm_fwd_regs_kernel<In, Out, kVec, kFwdPacks><<<grid, threads, 0, stream>>>(
        xp, wp, yp, rstd.data_ptr<float>(), rows, cols, stride, eps);
  } else if (wide) {
    const int threads = threads_for(packs, kMaxThreads);
    rms_norm_fwd_kernel<In, Out, kVec><<<grid, threads, 0, stream>>>(
        xp, wp, yp, rstd.data_ptr<float>(), rows, cols, stride, eps);
  } else {
    const int threads = threads_for(cols, kMaxThreads);
    rms_norm_fwd_kernel<In, Out, 1><<<grid, threads, 0, stream>>>(
        xp, wp, yp, rstd.data_ptr<float>(), rows, cols, stride, eps);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename In, typename Out, int VEC>
void launch_backward_vec(const at::Tensor& dy_rows, const at::Tensor& x_rows, const at::Tensor& w,
                         const at::Tensor& rstd, at::Tensor& dx, at::Tensor& dw, bool compute_dw) {
  const int64_t rows = x_rows.size(0), cols = x_rows.size(1);
  const auto kernel = rms_norm_bwd_kernel<In, Out, VEC>;
  const int threads = threads_for(cols / VEC, kMaxThreads);
  const DeviceInfo info = device_info(x_rows.get_device());
  const size_t shared_bytes = compute_dw ? static_cast<size_t>(cols) * sizeof(float) : 0;
  TORCH_CHECK(shared_bytes <= static_cast<size_t>(info.max_shared_optin), "rms_norm_bwd: a hidden size of ",
              std::to_string(cols), " needs ", std::to_string(shared_bytes),
              " bytes of shared memory for the dW sums, more than this GPU's ", std::to_string(info.max_shared_optin));
  if (shared_bytes > 48 * 1024) {  // above 48 KB a kernel must opt in to more shared memory
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(shared_bytes)));
  }
  const int64_t blocks = backward_blocks(kernel, threads, shared_bytes, info, rows);
  at::Tensor partial = compute_dw ? at::empty({blocks, cols}, x_rows.options().dtype(at::kFloat)) : at::Tensor();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  kernel<<<blocks, threads, shared_bytes, stream>>>(
      dy_rows.data_ptr<Out>(), x_rows.data_ptr<In>(), w.data_ptr<Out>(), rstd.data_ptr<float>(), dx.data_ptr<In>(),
      compute_dw ? partial.data_ptr<float>() : nullptr, rows, cols, x_rows.stride(0), dy_rows.stride(0),
      compute_dw);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (compute_dw) {
    const int64_t dw_blocks = ceil_div(cols, kWarp);  // 32 columns per block
    dw_sum_kernel<Out><<<dw_blocks, kDwThreads, 0, stream>>>(
        partial.data_ptr<float>(), dw.data_ptr<Out>(), blocks, cols);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

template <typename In, typename Out>
void launch_backward(const at::Tensor& dy_rows, const at::Tensor& x_rows, const at::Tensor& w,
                     const at::Tensor& rstd, at::Tensor& dx, at::Tensor& dw, bool compute_dw) {
  constexpr int kVec = 16 / sizeof(In);
  const int64_t cols = x_rows.size(1);
  const bool wide = packable(x_rows.data_ptr(), x_rows.stride(0), cols, kVec, sizeof(In)) &&
                    packable(dy_rows.data_ptr(), dy_rows.stride(0), cols, kVec, sizeof(Out)) &&
                    packable(w.data_ptr(), 0, cols, kVec, sizeof(Out)) &&
                    packable(dx.data_ptr(), cols, cols, kVec, sizeof(In));
  if (wide) {
    launch_backward_vec<In, Out, kVec>(dy_rows, x_rows, w, rstd, dx, dw, compute_dw);
  } else {
    launch_backward_vec<In, Out, 1>(dy_rows, x_rows, w, rstd, dx, dw, compute_dw);
  }
}

// ------------------------------------------------------------------------------------------------------------------
// The operators
// ------------------------------------------------------------------------------------------------------------------

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

void check_pair(const at::Tensor& x, const at::Tensor& weight) {
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
  TORCH_CHECK_VALUE(x.is_cuda() && weight.device() == x.device(),
                    "x and weight must be on the same CUDA device, got ", x.device().str(), " and ",
                    weight.device().str());
}

// [..., hidden] -> [rows, hidden] with unit stride along hidden; copies only when no such view exists.
at::Tensor as_rows(const at::Tensor& t, int64_t rows, int64_t cols) {
  return (t.stride(-1) == 1 ? t : t.contiguous()).reshape({rows, cols});
}

// The (x dtype, weight dtype) pairs that check_pair allows, each one instantiation of the templates above. A
// float32 weight with a bfloat16 or float16 x promotes the output (and dy, and dW) to float32, as in PyTorch.
void forward_for(const at::Tensor& x_rows, const at::Tensor& w, at::Tensor& y, at::Tensor& rstd, float eps) {
  const bool w32 = w.scalar_type() == at::kFloat;
  switch (x_rows.scalar_type()) {
    case at::kFloat: launch_forward<float, float>(x_rows, w, y, rstd, eps); break;
    case at::kBFloat16:
      if (w32) launch_forward<c10::BFloat16, float>(x_rows, w, y, rstd, eps);
      else launch_forward<c10::BFloat16, c10::BFloat16>(x_rows, w, y, rstd, eps);
      break;
    default:  // float16
      if (w32) launch_forward<c10::Half, float>(x_rows, w, y, rstd, eps);
      else launch_forward<c10::Half, c10::Half>(x_rows, w, y, rstd, eps);
  }
}

void backward_for(const at::Tensor& dy_rows, const at::Tensor& x_rows, const at::Tensor& w, const at::Tensor& rstd,
                  at::Tensor& dx, at::Tensor& dw, bool compute_dw) {
  const bool w32 = w.scalar_type() == at::kFloat;
  switch (x_rows.scalar_type()) {
    case at::kFloat: launch_backward<float, float>(dy_rows, x_rows, w, rstd, dx, dw, compute_dw); break;
    case at::kBFloat16:
      if (w32) launch_backward<c10::BFloat16, float>(dy_rows, x_rows, w, rstd, dx, dw, compute_dw);
      else launch_backward<c10::BFloat16, c10::BFloat16>(dy_rows, x_rows, w, rstd, dx, dw, compute_dw);
      break;
    default:  // float16
      if (w32) launch_backward<c10::Half, float>(dy_rows, x_rows, w, rstd, dx, dw, compute_dw);
      else launch_backward<c10::Half, c10::Half>(dy_rows, x_rows, w, rstd, dx, dw, compute_dw);
  }
}

std::tuple<at::Tensor, at::Tensor> rms_norm_fwd_cuda(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_pair(x, weight);
  const c10::cuda::CUDAGuard guard(x.device());  // launch on x's GPU, whichever is current
  const int64_t cols = x.size(-1);
  const int64_t rows = cols ? x.numel() / cols : 0;
  // The output's dtype is promote(x, w), which for the allowed pairs is the weight's.
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(weight.scalar_type()));
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  if (rows == 0) return {y, rstd};
  const at::Tensor x_rows = as_rows(x, rows, cols);
  const at::Tensor w = weight.contiguous();
  forward_for(x_rows, w, y, rstd, static_cast<float>(eps));
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_bwd_cuda(const at::Tensor& dy, const at::Tensor& x,
                                                     const at::Tensor& weight, const at::Tensor& rstd,
                                                     bool compute_dw) {
  check_pair(x, weight);
  TORCH_CHECK_VALUE(dy.sizes() == x.sizes(), "dy must have x's shape ", shape_string(x.sizes()), ", got ",
                    shape_string(dy.sizes()));
  TORCH_CHECK_TYPE(dy.scalar_type() == weight.scalar_type(), "dy must have the output's dtype ",
                   weight.scalar_type(), ", got ", dy.scalar_type());
  TORCH_CHECK_TYPE(rstd.scalar_type() == at::kFloat, "rstd must be float32, got ", rstd.scalar_type());
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t cols = x.size(-1);
  const int64_t rows = cols ? x.numel() / cols : 0;
  TORCH_CHECK_VALUE(rstd.numel() == rows, "rstd must hold one value per row (", std::to_string(rows),
                    "), got ", std::to_string(rstd.numel()));
  at::Tensor dx = at::empty(x.sizes(), x.options());
  if (rows == 0) {  // no rows: dW is a sum over nothing
    return {dx, compute_dw ? at::zeros_like(weight) : weight.new_empty({0})};
  }
  at::Tensor dw = compute_dw ? at::empty_like(weight) : weight.new_empty({0});
  const at::Tensor x_rows = as_rows(x, rows, cols);
  const at::Tensor dy_rows = as_rows(dy, rows, cols);
  const at::Tensor w = weight.contiguous();
  const at::Tensor r = rstd.contiguous();
  backward_for(dy_rows, x_rows, w, r, dx, dw, compute_dw);
  return {dx, dw};
}

}  // namespace

// The schemas, identical to the Triton operators' (kernels/rmsnorm.py). Python reaches them as
// torch.ops.kernels_cuda.rms_norm_fwd / rms_norm_bwd once this library is loaded; their fake implementations
// (shapes only, for torch.compile) are registered from Python in kernels/cuda_rmsnorm.py.
TORCH_LIBRARY(kernels_cuda, m) {
  m.def("rms_norm_fwd(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rms_norm_bwd(Tensor dy, Tensor x, Tensor weight, Tensor rstd, bool compute_dw) -> (Tensor, Tensor)");
}

// The implementations for CUDA tensors: the dispatcher calls these when the inputs live on a GPU.
TORCH_LIBRARY_IMPL(kernels_cuda, CUDA, m) {
  m.impl("rms_norm_fwd", &rms_norm_fwd_cuda);
  m.impl("rms_norm_bwd", &rms_norm_bwd_cuda);
}
