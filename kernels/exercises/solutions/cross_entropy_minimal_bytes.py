"""Chapter 07: the bytes the two-read cross-entropy's forward + backward moves over its logits."""


def cross_entropy_minimal_bytes(M, N, dtype):
    """Bytes moved over [M, N] logits (N the vocabulary) of ``dtype`` by a kernel that reads each
    row twice and writes its gradient once."""
    s = dtype.itemsize  # bytes per element: 2 for bf16
    # Read once for the running max and sum (the logsumexp), read again to compute the gradient,
    # write the gradient (over the logits, in place): three logit-sized transfers. The int64 targets
    # and a float32 logsumexp per row may be counted too; like kernels.bench.sweep, this count
    # leaves them out.
    return 3 * M * N * s
