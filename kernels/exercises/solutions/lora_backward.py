"""Chapter 15's exercise, one answer: the backward of y = x·Wᵀ + s·(x·Aᵀ)·Bᵀ with W frozen."""


def lora_backward(dy, x, weight, lora_a, lora_b, scale):
    """(dx, dA, dB) for 2-D x [tokens, in], dy [tokens, out], W [out, in], A [r, in], B [out, r]."""
    xa = x @ lora_a.t()  # [tokens, r]: recomputed here; the fused layer saves it from the forward
    dxa = scale * (dy @ lora_b)  # [tokens, r]: the gradient reaching x·Aᵀ goes back through B, and the scale
    dx = dy @ weight + dxa @ lora_a  # the base layer's term and the adapter's
    d_lora_a = dxa.t() @ x  # [r, in]: a sum over the tokens
    d_lora_b = scale * (dy.t() @ xa)  # [out, r]: a sum over the tokens
    return dx, d_lora_a, d_lora_b
