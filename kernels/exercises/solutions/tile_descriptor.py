"""Chapter 16's exercise on the TMA, one answer: a tensor descriptor over [batch, heads, seq,
head_dim] whose box is one head's [rows, head_dim] tile."""

from triton.tools.tensor_descriptor import TensorDescriptor


def tile_descriptor(t, rows):
    # The descriptor names t's own shape and strides (a transposed view included: the copy engine
    # follows the strides, so nothing is copied) and a box with a size for every dimension: one
    # batch, one head, rows rows, the whole head_dim.
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, t.shape[-1]])
