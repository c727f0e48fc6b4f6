"""Fused Triton kernels for LLM fine-tuning, and the tools the workbook builds them with.

``import kernels`` first decides where kernels run (see ``kernels.runtime``): on a CUDA GPU, or in Triton's
interpreter on the CPU. That decision has to come before any ``@triton.jit`` function is defined, which is why
``runtime`` is imported before everything else here.
"""

from . import runtime  # noqa: I001  (must come first: it sets TRITON_INTERPRET)
from .runtime import describe
from .reference import relative_error, rms_norm_reference
from .rmsnorm import RMSNormFunction, TritonRMSNorm, rms_norm

__all__ = [
    "runtime",
    "describe",
    "relative_error",
    "rms_norm_reference",
    "rms_norm",
    "RMSNormFunction",
    "TritonRMSNorm",
]

# Cross-entropy (chapters 05 and 06)
from .reference import cross_entropy_hf, online_logsumexp, online_softmax_steps  # noqa: E402
from .cross_entropy import CrossEntropyFunction, TritonCrossEntropyLoss, cross_entropy  # noqa: E402

__all__ += [
    "cross_entropy_hf",
    "online_logsumexp",
    "online_softmax_steps",
    "cross_entropy",
    "CrossEntropyFunction",
    "TritonCrossEntropyLoss",
]
