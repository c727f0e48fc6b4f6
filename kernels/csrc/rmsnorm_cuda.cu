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
//   * where values live, fastest first: *registers* (private to one thread, at most 255 of 4 bytes each), *shared
//     memory* (per block, on the SM, tens of KB), the L1 and L2 *caches*, and HBM (the GPU's main memory). A
//     kernel like this one is fast when every value crosses the HBM bus once and then stays as close as it can.
//
// Design (kernels/rmsnorm.py does the same in Triton, where the compiler decides what this file spells out):
//   * all arithmetic in float32, whatever the storage type; values are rounded only when stored;
//   * the row stays in registers: each thread loads its share of a row once into small register arrays (PACKS
//     packs, a compile-time number), the block adds up the shares, and each thread finishes the row from what it
//     holds. No value is read twice. Thread t of a B-thread block owns packs t, t + B, t + 2B, ... of *every* row,
//     the same columns each time, so it loads its share of the weight once and (backward) keeps its columns' dW
//     sums in registers too;
//   * 16-byte loads and stores: each thread moves a "pack" of 16 bytes (8 bf16/fp16 values, 4 fp32) per
//     instruction when every row start is 16-byte aligned and the width a multiple of the pack; otherwise the same
//     kernels are instantiated with packs of one element (the scalar fallback);
//   * persistent grids: as many blocks as fit on the GPU at once, each walking rows b, b + G, b + 2G, ... (G blocks),
//     so the weight (forward and backward) and the dW sums (backward) are set up once per block, not once per row;
//   * row offsets in int64 (row * stride passes 2^31 once rows x hidden does);
//   * sums across a row: first within a warp with register shuffles, then across warps through shared memory;
//   * dW without atomics: each block of the backward grid keeps float32 partial sums of dW for the rows it handled
//     (in its threads' registers) and writes them as one row of a [blocks, hidden] buffer; a second kernel adds the rows in a fixed order, so
//     dW is the same bits on every run.
//
// The widest hidden size. Registers are the price of keeping the row: a thread holds at most 8 packs of a row and
// a block has at most 1,024 threads, so a row is at most 8 x 1,024 packs: 65,536 bf16/fp16 or 32,768 fp32 values on
// the 16-byte path, 8,192 on the scalar fallback. The register file lowers that further: an SM has 65,536 32-bit
// registers, so a kernel that needs R registers per thread cannot run more than about 65,536 / R threads in a
// block. The host reads that limit from the compiled kernel (cudaFuncGetAttributes) and refuses a wider row with
// an error naming the widest hidden size that works for the dtypes and path at hand. Any kernel can run 256 threads
// (256 x 255 registers fit), so on the 16-byte path every width up to 256 x 8 packs always works: 16,384 bf16/fp16
// (the widest Llama hidden size, 405B's) and 8,192 fp32. The register counts ptxas reports for the widest kernels
// (nvcc 13.0, sm_90: H100/H200) put the limits at about: forward 22,528 bf16, 30,720 fp16, 19,456 fp32; backward
// (which holds x, dy, w and the dW sums) 16,384 bf16/fp16 and 12,288 fp32; the scalar fallback 8,192 forward and
// 7,168 backward; the error message gives the exact figure on the GPU at hand. A float32 x at Llama-405B's 16,384
// is beyond the backward's reach: a block's fp32 row of x, dy and w plus its dW sums is 256 KB, the whole register
// file of an SM.

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
#include <tuple>

namespace {

constexpr int kWarp = 32;
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
// `scratch` must hold 32 floats: the only shared memory the kernels below use. blockDim.x must be a multiple of 32
// (the host launches it so). This is what tl.sum(..., axis=1) does for a Triton program behind the scenes.
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

// Why registers. The earlier version of this file read each row twice (once for the sum of squares, once to
// normalise), trusting the caches to serve the second read. They mostly did, but not for free: the second read
// still costs L1/L2 bandwidth and instructions, and with many blocks in flight a row can be evicted before it is
// read again. Registers are the only memory that is private to a thread and as fast as the arithmetic itself, so
// the kernels below load a row once into register arrays and never read it again.
//
// A register array must have a size the compiler knows, and every index into it must be a compile-time constant
// after unrolling (otherwise the compiler puts the array in "local memory", which lives in the caches and HBM).
// Hence PACKS, a template parameter, and `#pragma unroll` on every loop over it: the loop `for k < PACKS` becomes
// PACKS copies of its body, each with its own registers. The host instantiates PACKS = 1, 2, 4 and 8 and picks
// per width (`packs_per_thread` below).
//
// Which packs a thread owns: thread t of B takes packs t, t + B, ..., t + (PACKS - 1) B of the row. Neighbouring
// threads read neighbouring 16-byte packs, so a warp's loads combine into whole cache lines ("coalesced"); the
// last slots of the last threads may fall past the row's end, hence the guard `p < packs` on each of them.

// Pack index of slot k of this thread: thread t of B owns packs t, t + B, t + 2B, ...
__device__ __forceinline__ int64_t owned_pack(int k) {
  return threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
}

// Forward. A persistent grid: G blocks (as many as fit on the GPU at once) walk the rows, block b taking rows
// b, b + G, b + 2G, ... Each thread loads its weight packs into registers once, before the row loop; then, per
// row, it loads its x packs into registers (one read of x), adds its share of sum(x^2), waits for the block's
// total, and writes y from the registers it already holds.
//
// `In` is x's element type, `Out` that of y and the weight (float32 when a float32 weight promotes a bf16 x).
// VEC is the number of x values per pack: 16 / sizeof(In) on the wide path, 1 on the scalar fallback. PACKS is
// the number of packs each thread owns; the host launches at least packs / PACKS threads.
template <typename In, typename Out, int VEC, int PACKS>
__global__ void rms_norm_fwd_kernel(const In* __restrict__ x, const Out* __restrict__ w, Out* __restrict__ y,
                                    float* __restrict__ rstd, int64_t rows, int64_t cols, int64_t x_row_stride,
                                    float eps) {
  __shared__ float scratch[kWarp];
  const int64_t packs = cols / VEC;  // the host guarantees cols % VEC == 0 and packs <= PACKS * blockDim.x

  // The weight, once per block: this thread always owns the same columns, whatever the row.
  Pack<Out, VEC> ws[PACKS];
#pragma unroll
  for (int k = 0; k < PACKS; ++k) {
    if (owned_pack(k) < packs) ws[k] = load_pack<Out, VEC>(w, owned_pack(k));
  }

  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const In* x_row = x + row * x_row_stride;  // int64 arithmetic throughout
    Out* y_row = y + row * cols;

    // Load this thread's packs of the row (all loads are issued before any is needed: PACKS 16-byte loads in
    // flight per thread) and add up its share of sum(x^2); then the whole row's.
    Pack<In, VEC> xs[PACKS];
    float sum_sq = 0.0f;
#pragma unroll
    for (int k = 0; k < PACKS; ++k) {
      if (owned_pack(k) < packs) xs[k] = load_pack<In, VEC>(x_row, owned_pack(k));
    }
#pragma unroll
    for (int k = 0; k < PACKS; ++k) {
      if (owned_pack(k) < packs) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float v = static_cast<float>(xs[k].v[i]);
          sum_sq += v * v;
        }
      }
    }
    const float r = rsqrtf(block_sum(sum_sq, scratch) / static_cast<float>(cols) + eps);

    // Normalise and scale from the registers: x is not read again.
#pragma unroll
    for (int k = 0; k < PACKS; ++k) {
      if (owned_pack(k) < packs) {
        Pack<Out, VEC> ys;
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float x_hat = round_to<In>(static_cast<float>(xs[k].v[i]) * r);
          ys.v[i] = static_cast<Out>(x_hat * static_cast<float>(ws[k].v[i]));
        }
        store_pack<Out, VEC>(y_row, owned_pack(k), ys);
      }
    }
    if (threadIdx.x == 0) rstd[row] = r;
  }
}

// Backward: dx = rstd * (g - x_hat * mean(g * x_hat)) with g = dy * w, and this block's part of
// dW = sum over rows of dy * x_hat (x_hat rounded as in the forward pass, since that is what w multiplied).
//
// A persistent grid again (a few blocks per SM), block b taking rows b, b + G, b + 2G, ... Per row, each thread
// loads its packs of x and dy into registers once; they serve both the sum(g * x_hat) and, after the block's total
// is known, dx. The weight is loaded into registers once per block, as in the forward.
//
// dW needs no shared memory: thread t owns the same columns in every row, so the running dW sums of those
// columns (PACKS x VEC floats) are needed by this thread alone and can live in its registers. No other thread
// ever adds to them, so there is no race and nothing to synchronise. At the end the block writes them, each
// thread its own columns, as row b of `dw_partial` ([G, cols] float32); `dw_sum_kernel` adds the G rows.
template <typename In, typename Out, int VEC, int PACKS>
__global__ void rms_norm_bwd_kernel(const Out* __restrict__ dy, const In* __restrict__ x, const Out* __restrict__ w,
                                    const float* __restrict__ rstd, In* __restrict__ dx,
                                    float* __restrict__ dw_partial, int64_t rows, int64_t cols,
                                    int64_t x_row_stride, int64_t dy_row_stride, bool compute_dw) {
  __shared__ float scratch[kWarp];
  const int64_t packs = cols / VEC;

  Pack<Out, VEC> ws[PACKS];  // the weight, once per block
  float dw_acc[PACKS][VEC];  // this thread's columns' dW sums, over the rows this block handles
#pragma unroll
  for (int k = 0; k < PACKS; ++k) {
    if (owned_pack(k) < packs) ws[k] = load_pack<Out, VEC>(w, owned_pack(k));
#pragma unroll
    for (int i = 0; i < VEC; ++i) dw_acc[k][i] = 0.0f;
  }

  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const In* x_row = x + row * x_row_stride;
    const Out* dy_row = dy + row * dy_row_stride;
    In* dx_row = dx + row * cols;
    const float r = rstd[row];

    // One read of this thread's packs of x and dy.
    Pack<In, VEC> xs[PACKS];
    Pack<Out, VEC> dys[PACKS];
#pragma unroll
    for (int k = 0; k < PACKS; ++k) {
      if (owned_pack(k) < packs) {
        xs[k] = load_pack<In, VEC>(x_row, owned_pack(k));
        dys[k] = load_pack<Out, VEC>(dy_row, owned_pack(k));
      }
    }

    // This thread's share of sum(g * x_hat), and its columns' dW terms (added in registers).
    float dot = 0.0f;
#pragma unroll
    for (int k = 0; k < PACKS; ++k) {
      if (owned_pack(k) < packs) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float x_hat = static_cast<float>(xs[k].v[i]) * r;
          const float d = static_cast<float>(dys[k].v[i]);
          dot += d * static_cast<float>(ws[k].v[i]) * x_hat;
          if (compute_dw) dw_acc[k][i] += d * round_to<In>(x_hat);
        }
      }
    }
    const float c = block_sum(dot, scratch) / static_cast<float>(cols);

    // dx, from the registers: x and dy are not read again.
#pragma unroll
    for (int k = 0; k < PACKS; ++k) {
      if (owned_pack(k) < packs) {
        Pack<In, VEC> dxs;
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float x_hat = static_cast<float>(xs[k].v[i]) * r;
          const float g = static_cast<float>(dys[k].v[i]) * static_cast<float>(ws[k].v[i]);
          dxs.v[i] = static_cast<In>(r * (g - x_hat * c));
        }
        store_pack<In, VEC>(dx_row, owned_pack(k), dxs);
      }
    }
  }

  if (compute_dw) {
    float* out = dw_partial + static_cast<int64_t>(blockIdx.x) * cols;
#pragma unroll
    for (int k = 0; k < PACKS; ++k) {
      if (owned_pack(k) < packs) {
        Pack<float, VEC> sums;
#pragma unroll
        for (int i = 0; i < VEC; ++i) sums.v[i] = dw_acc[k][i];
        store_pack<float, VEC>(out, owned_pack(k), sums);
      }
    }
  }
}

constexpr int kSlices = 8;  // threads per column in the dW sum

// dW = column sums of the [n_partials, cols] float32 partials. A block owns 32 columns and has kSlices warps, so
// kSlices threads per column: thread (slice s, column c) adds partials s, s + kSlices, s + 2 kSlices, ... in that
// order, then slice 0 adds the kSlices results in order. The order never depends on timing, so neither does dW.
template <typename Out>
__global__ void dw_sum_kernel(const float* __restrict__ partial, Out* __restrict__ dw, int64_t n_partials,
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

constexpr int kTargetThreads = 256;  // threads per block the choice of PACKS aims for (see below)
constexpr int kMaxPacks = 8;         // the largest PACKS instantiated
constexpr int kScalarPacks = 8;      // the scalar fallback's only PACKS

// Packs per thread on the 16-byte path: the smallest of 1, 2, 4, 8 that covers the row with at most 256 threads.
// 4,096 bf16 values = 512 packs -> 2 packs per thread, 256 threads; 8,192 -> 4; 16,384 -> 8. Why 256: a block of
// 256 threads leaves room for several blocks per SM, and few packs per thread keeps the register arrays small;
// beyond 8 packs per thread a thread would hold more registers than occupancy can afford, so wider rows take more
// threads instead. Each value of PACKS is one more instantiation of each kernel (and more build time), hence only
// these four; the scalar fallback (odd widths, misaligned views) is instantiated with 8 alone.
int packs_per_thread(int64_t packs) {
  for (int p = 1; p < kMaxPacks; p *= 2) {
    if (ceil_div(packs, p) <= kTargetThreads) return p;
  }
  return kMaxPacks;
}

// Threads per block for PACKS packs per thread: enough to cover the row, in whole warps (block_sum needs them).
int threads_for(int64_t packs, int packs_per_thread) {
  return static_cast<int>(std::max<int64_t>(kWarp, ceil_div(ceil_div(packs, packs_per_thread), kWarp) * kWarp));
}

constexpr int kMaxDevices = 64;

// Read once per device; cudaDeviceGetAttribute does not touch any stream, so it is safe during CUDA-graph capture.
int sm_count(int device) {
  static int cache[kMaxDevices] = {};
  TORCH_CHECK(device >= 0 && device < kMaxDevices, "device index out of range: ", device);
  if (cache[device] == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&cache[device], cudaDevAttrMultiProcessorCount, device));
  }
  return cache[device];
}

// What one compiled kernel allows on one device, read once and kept (one cache per kernel instantiation, since the
// function that holds it is a template of the kernel's parameters):
//   * max_threads: the most threads per block it can be launched with. 1,024 unless its registers per thread
//     times 1,024 exceed what one SM has (65,536 on current GPUs): the register arrays above make that a real
//     limit for the wide kernels, so it is read from the compiled kernel (cudaFuncGetAttributes), not assumed;
//   * per_sm[threads / 32]: how many blocks of that many threads fit on one SM at once (the *occupancy*, limited by
//     registers, shared memory and the SM's 2,048 threads), from cudaOccupancyMaxActiveBlocksPerMultiprocessor.
// Neither call touches a stream, and after the first call nothing is asked of the driver at all.
struct KernelLimits {
  int max_threads = 0;
  int per_sm[kMaxThreads / kWarp + 1] = {};
};

template <typename Kernel>
int max_threads_of(Kernel kernel, KernelLimits& limits) {
  if (limits.max_threads == 0) {
    cudaFuncAttributes attributes;
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
    limits.max_threads = std::min(kMaxThreads, attributes.maxThreadsPerBlock / kWarp * kWarp);
  }
  return limits.max_threads;
}

template <typename Kernel>
int blocks_per_sm(Kernel kernel, KernelLimits& limits, int threads) {
  int& per_sm = limits.per_sm[threads / kWarp];
  if (per_sm == 0) {
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
    per_sm = std::max(per_sm, 1);
  }
  return per_sm;
}

// A row wider than the kernel can hold in registers: a clear error naming the widest hidden size that works for
// this dtype pair and path (the limit the file header describes), rather than a failed launch.
void check_width(const char* op, int64_t cols, int threads, int max_threads, int packs_per_thread, int vec,
                 at::ScalarType x_type, at::ScalarType w_type) {
  const int64_t widest = static_cast<int64_t>(max_threads) * packs_per_thread * vec;
  TORCH_CHECK_VALUE(threads <= max_threads, op, ": hidden size ", cols, " is wider than this kernel supports: ",
                    "each thread keeps at most ", packs_per_thread, " packs of ", vec, " value(s) of a row in ",
                    "registers and a block of this kernel may have at most ", max_threads, " threads on this GPU, so ",
                    "the widest supported hidden size for ", x_type, " x with a ", w_type, " weight on the ",
                    vec == 1 ? "scalar fallback path (rows not 16-byte aligned, or a width that is not a whole "
                               "number of 16-byte packs; contiguous inputs of such widths take the 16-byte path)"
                             : "16-byte path",
                    " is ", widest);
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

// Forward for one (VEC, PACKS). The grid is persistent: SMs x resident blocks per SM (all the blocks the GPU can
// run at once, no more), capped at the number of rows. More blocks than that would only queue behind the first
// wave and load their weight packs again; fewer would leave SMs idle.
//
// Occupancy, here, is how many of these blocks an SM holds at once, and the register arrays decide it: an SM has
// 65,536 registers and at most 2,048 threads, so a kernel of up to 32 registers per thread can fill it with
// threads, one of 64 with half as many, one of 128 with a quarter. Fewer resident threads mean fewer loads in
// flight to hide HBM's latency; what makes up for it is that each thread now has PACKS 16-byte loads in flight at
// once, issued together before the first is needed, and never reads anything twice.
template <typename In, typename Out, int VEC, int PACKS>
void launch_forward_packs(const at::Tensor& x_rows, const at::Tensor& w, at::Tensor& y, at::Tensor& rstd,
                          float eps) {
  static KernelLimits limits[kMaxDevices];  // one per device, for this instantiation
  const auto kernel = rms_norm_fwd_kernel<In, Out, VEC, PACKS>;
  const int64_t rows = x_rows.size(0), cols = x_rows.size(1);
  const int device = x_rows.get_device();
  const int sms = sm_count(device);  // checks the device index too
  const int threads = threads_for(cols / VEC, PACKS);
  check_width("rms_norm_fwd", cols, threads, max_threads_of(kernel, limits[device]), PACKS, VEC,
              x_rows.scalar_type(), w.scalar_type());
  const int64_t blocks =
      std::min<int64_t>(rows, static_cast<int64_t>(sms) * blocks_per_sm(kernel, limits[device], threads));
  kernel<<<blocks, threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      x_rows.data_ptr<In>(), w.data_ptr<Out>(), y.data_ptr<Out>(), rstd.data_ptr<float>(), rows, cols,
      x_rows.stride(0), eps);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename In, typename Out>
void launch_forward(const at::Tensor& x_rows, const at::Tensor& w, at::Tensor& y, at::Tensor& rstd, float eps) {
  constexpr int kVec = 16 / sizeof(In);
  const int64_t cols = x_rows.size(1);
  const bool wide = packable(x_rows.data_ptr(), x_rows.stride(0), cols, kVec, sizeof(In)) &&
                    packable(w.data_ptr(), 0, cols, kVec, sizeof(Out)) &&
                    packable(y.data_ptr(), cols, cols, kVec, sizeof(Out));
  if (!wide) return launch_forward_packs<In, Out, 1, kScalarPacks>(x_rows, w, y, rstd, eps);
  switch (packs_per_thread(cols / kVec)) {
    case 1: return launch_forward_packs<In, Out, kVec, 1>(x_rows, w, y, rstd, eps);
    case 2: return launch_forward_packs<In, Out, kVec, 2>(x_rows, w, y, rstd, eps);
    case 4: return launch_forward_packs<In, Out, kVec, 4>(x_rows, w, y, rstd, eps);
    default: return launch_forward_packs<In, Out, kVec, 8>(x_rows, w, y, rstd, eps);
  }
}

// Backward for one (VEC, PACKS). Blocks of the backward grid: as many as fit on the GPU at once (by registers, as
// the occupancy calculator says), capped at 4 per SM. More blocks keep more loads in flight; fewer mean fewer dW
// partial rows to write and add at the end (each is one [hidden] float32 row), and fewer weight loads.
template <typename In, typename Out, int VEC, int PACKS>
void launch_backward_packs(const at::Tensor& dy_rows, const at::Tensor& x_rows, const at::Tensor& w,
                           const at::Tensor& rstd, at::Tensor& dx, at::Tensor& dw, bool compute_dw) {
  static KernelLimits limits[kMaxDevices];
  const auto kernel = rms_norm_bwd_kernel<In, Out, VEC, PACKS>;
  const int64_t rows = x_rows.size(0), cols = x_rows.size(1);
  const int device = x_rows.get_device();
  const int sms = sm_count(device);
  const int threads = threads_for(cols / VEC, PACKS);
  check_width("rms_norm_bwd", cols, threads, max_threads_of(kernel, limits[device]), PACKS, VEC,
              x_rows.scalar_type(), w.scalar_type());
  const int per_sm = std::min(blocks_per_sm(kernel, limits[device], threads), 4);
  const int64_t blocks = std::min<int64_t>(rows, static_cast<int64_t>(sms) * per_sm);
  // The partial sums: one float32 row per block. Pack stores of them are aligned: the allocation is, and each row
  // is cols floats long, a multiple of VEC.
  at::Tensor partial = compute_dw ? at::empty({blocks, cols}, x_rows.options().dtype(at::kFloat)) : at::Tensor();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  kernel<<<blocks, threads, 0, stream>>>(
      dy_rows.data_ptr<Out>(), x_rows.data_ptr<In>(), w.data_ptr<Out>(), rstd.data_ptr<float>(), dx.data_ptr<In>(),
      compute_dw ? partial.data_ptr<float>() : nullptr, rows, cols, x_rows.stride(0), dy_rows.stride(0),
      compute_dw);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (compute_dw) {
    dw_sum_kernel<Out><<<ceil_div(cols, kWarp), kWarp * kSlices, 0, stream>>>(
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
  if (!wide) return launch_backward_packs<In, Out, 1, kScalarPacks>(dy_rows, x_rows, w, rstd, dx, dw, compute_dw);
  switch (packs_per_thread(cols / kVec)) {
    case 1: return launch_backward_packs<In, Out, kVec, 1>(dy_rows, x_rows, w, rstd, dx, dw, compute_dw);
    case 2: return launch_backward_packs<In, Out, kVec, 2>(dy_rows, x_rows, w, rstd, dx, dw, compute_dw);
    case 4: return launch_backward_packs<In, Out, kVec, 4>(dy_rows, x_rows, w, rstd, dx, dw, compute_dw);
    default: return launch_backward_packs<In, Out, kVec, 8>(dy_rows, x_rows, w, rstd, dx, dw, compute_dw);
  }
}

// ------------------------------------------------------------------------------------------------------------------
// The operators
// ------------------------------------------------------------------------------------------------------------------

void check_pair(const at::Tensor& x, const at::Tensor& weight) {
  // TORCH_CHECK_TYPE / TORCH_CHECK_VALUE reach Python as TypeError / ValueError.
  TORCH_CHECK_VALUE(x.dim() >= 1, "x must have at least one dimension (the hidden size), got a scalar");
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == x.size(-1), "weight must have shape (", x.size(-1),
                    ",) to match the last dimension of x ", x.sizes(), ", got ", weight.sizes());
  const auto xt = x.scalar_type();
  TORCH_CHECK_TYPE(xt == at::kFloat || xt == at::kBFloat16 || xt == at::kHalf,
                   "x must be float32, bfloat16 or float16, got ", xt);
  TORCH_CHECK_TYPE(weight.scalar_type() == xt || weight.scalar_type() == at::kFloat,
                   "weight must have x's dtype (", xt, ") or float32, got ", weight.scalar_type());
  TORCH_CHECK_VALUE(x.is_cuda() && weight.device() == x.device(),
                    "x and weight must be on the same CUDA device, got ", x.device(), " and ", weight.device());
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
  TORCH_CHECK_VALUE(dy.sizes() == x.sizes(), "dy must have x's shape ", x.sizes(), ", got ", dy.sizes());
  TORCH_CHECK_TYPE(dy.scalar_type() == weight.scalar_type(), "dy must have the output's dtype ",
                   weight.scalar_type(), ", got ", dy.scalar_type());
  TORCH_CHECK_TYPE(rstd.scalar_type() == at::kFloat, "rstd must be float32, got ", rstd.scalar_type());
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t cols = x.size(-1);
  const int64_t rows = cols ? x.numel() / cols : 0;
  TORCH_CHECK_VALUE(rstd.numel() == rows, "rstd must hold one value per row (", rows, "), got ", rstd.numel());
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
