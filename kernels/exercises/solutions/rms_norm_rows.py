"""Chapter 13's exercise, one answer: the RMSNorm row loop in C++, as the source
``check_rms_norm_rows`` compiles."""


def rms_norm_rows():
    """The C++ source of ``rms_norm_rows``: pass it to ``check_rms_norm_rows(rms_norm_rows())``."""
    # Two strides: a row of x starts at row * x_row_stride (x may be a view into a wider buffer); y
    # is packed, so its row starts at row * cols. Offsets are int64_t: row * stride passes 2^31 once
    # rows × width does. The sum of squares accumulates in a float, eps goes inside the square root,
    # and rstd keeps r for the backward.
    return r"""
extern "C" void rms_norm_rows(const float* x, int64_t x_row_stride, const float* w, float* y, float* rstd,
                              int64_t rows, int64_t cols, float eps) {
  for (int64_t row = 0; row < rows; ++row) {
    const float* x_row = x + row * x_row_stride;
    float sum_sq = 0.0f;
    for (int64_t c = 0; c < cols; ++c) sum_sq += x_row[c] * x_row[c];
    const float r = 1.0f / std::sqrt(sum_sq / static_cast<float>(cols) + eps);
    for (int64_t c = 0; c < cols; ++c) y[row * cols + c] = w[c] * (x_row[c] * r);
    rstd[row] = r;
  }
}
"""
