"""Chapter 13's CUDA exercise, one answer: each row's rstd, a warp per row, float4 loads and a
shuffle butterfly."""


def rstd_warp_per_row():
    """The CUDA source of ``rstd_warp_per_row``: pass it to
    ``check_rstd_warp_per_row(rstd_warp_per_row())``."""
    # Warp w of block b owns row b * (blockDim.x / 32) + w; a warp past the last row returns as a
    # whole, so the shuffles below always run on full warps. cols is a multiple of 4 and x is
    # 16-byte aligned, so every row is a whole number of float4 packs: lane l reads packs l, l + 32,
    # l + 64, ... (neighbouring lanes, neighbouring 16 bytes: one coalesced 512-byte read per step).
    # Five xor shuffles give every lane the warp's total.
    return r"""
extern "C" __global__ void rstd_warp_per_row(const float* x, float* rstd, int64_t rows, int64_t cols, float eps) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const float4* packs = reinterpret_cast<const float4*>(x + row * cols);
  float sum_sq = 0.0f;
  for (int64_t i = lane; i < cols / 4; i += 32) {
    const float4 v = packs[i];
    sum_sq += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
  }
  for (int offset = 16; offset > 0; offset >>= 1) sum_sq += __shfl_xor_sync(0xffffffffu, sum_sq, offset);
  if (lane == 0) rstd[row] = rsqrtf(sum_sq / static_cast<float>(cols) + eps);
}
"""
