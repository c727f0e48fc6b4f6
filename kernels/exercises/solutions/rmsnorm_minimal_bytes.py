"""Chapter 04: the fewest bytes RMSNorm's forward + backward moves, the weight and its gradient included."""


def rmsnorm_minimal_bytes(M, N, dtype):
    """Bytes moved by RMSNorm's forward and backward over x [M, N] with a weight [N], every tensor
    of ``dtype``."""
    s = dtype.itemsize  # bytes per element: 2 for bf16 (not 16, its bits; not 4, float32's size)
    # [M, N] tensors: the forward reads x and writes y; the backward, a separate kernel run later,
    # reads x again and dy, and writes dx. Five transfers.
    activations = (2 + 3) * M * N * s
    # [N] tensors: each pass reads w, and the backward writes dW. The float32 rstd per row (4 bytes
    # written, 4 read) may be counted too; like kernels.bench.sweep, this count leaves it out.
    weight = 3 * N * s
    return activations + weight
