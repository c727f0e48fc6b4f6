"""Plain-PyTorch references that the Triton kernels are tested against.

They follow Hugging Face's code operation for operation, casts included, so that "matches the reference" means
"matches what a Hugging Face model computes today". Run them on float64 inputs to get the ground truth that the
tests measure relative errors against.
"""

from __future__ import annotations

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm exactly as ``transformers``' ``LlamaRMSNorm.forward`` computes it.

    Normalise in float32, cast back to the input's dtype, *then* multiply by the weight (so a bfloat16 model rounds
    the normalised value to bfloat16 before the weight product, and a float32 weight promotes the output to float32).
    """
    input_dtype = x.dtype
    hidden = x.to(torch.float32) if x.dtype != torch.float64 else x
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(input_dtype)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖ / ‖expected‖ in float64; NaN or infinity anywhere in ``actual`` gives ``inf``."""
    actual = actual.detach().to(torch.float64).cpu()
    expected = expected.detach().to(torch.float64).cpu()
    if actual.shape != expected.shape:
        raise ValueError(f"shapes differ: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    if not torch.isfinite(actual).all():
        return float("inf")
    denom = expected.norm().item()
    diff = (actual - expected).norm().item()
    return diff / denom if denom > 0 else diff
