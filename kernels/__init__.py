"""Fused Triton kernels for LLM fine-tuning: the product API.

``import kernels`` first decides where kernels run (see ``kernels.runtime``): on a CUDA GPU, or in
Triton's interpreter on the CPU. That decision has to come before any ``@triton.jit`` function is
defined, which is why ``runtime`` is imported before everything else here (and why a notebook
imports ``kernels`` before ``triton``).

At the top level, only what a training script needs:

* the kernels as functions, ``rms_norm``, ``cross_entropy``, ``linear_cross_entropy`` (the loss of
  an LM head without its logits), ``swiglu`` and ``apply_rotary``, and as modules,
  ``TritonRMSNorm``, ``TritonCrossEntropyLoss``, ``TritonLinearCrossEntropyLoss`` and
  ``TritonSwiGLUMLP``;
* ``patch_llama`` (and its handle, ``LlamaPatch``), which puts them into a Hugging Face model;
* ``TritonAdamW``, ``torch.optim.AdamW``'s algorithm with its step as one Triton kernel per tensor;
* ``flash_attention``, FlashAttention-2 in Triton (causal or not, grouped-query, packed documents by
  ``cu_seqlens``);
* ``describe()`` and ``runtime``: where the kernels run.

Three names are both: ``kernels.cross_entropy``, ``kernels.linear_cross_entropy`` and
``kernels.swiglu`` are the *functions* (the product API); the modules of the same names, with the
kernels and their launch configuration, are imported by their paths (``from kernels.cross_entropy
import cross_entropy_forward``, ``from kernels.swiglu import forward_config``). No other top-level
name hides a submodule. Everything the chapters use besides (models, data, profiling, the benchmark,
the training loop, the references) is imported from its module, e.g. ``from kernels.training.models
import build_model``; ``docs/ARCHITECTURE.md`` says which file holds what.
"""

from .name_check import require_ours

# another distribution named kernels (Hugging Face's Kernel Hub) beside ours: stop, with the fix
require_ours()

from . import runtime  # noqa: E402, I001  (must come before any kernel: it sets TRITON_INTERPRET)
from .runtime import describe

from .rmsnorm import TritonRMSNorm, rms_norm
from .cross_entropy import TritonCrossEntropyLoss, cross_entropy
from .linear_cross_entropy import TritonLinearCrossEntropyLoss, linear_cross_entropy
from .swiglu import TritonSwiGLUMLP, swiglu
from .rope import apply_rotary
from .hf.patch import LlamaPatch, patch_llama
from .adamw import TritonAdamW
from .attention import flash_attention

__all__ = [
    "runtime", "describe",
    "rms_norm", "TritonRMSNorm",
    "cross_entropy", "TritonCrossEntropyLoss",
    "linear_cross_entropy", "TritonLinearCrossEntropyLoss",
    "swiglu", "TritonSwiGLUMLP", "apply_rotary",
    "patch_llama", "LlamaPatch",
    "TritonAdamW",
    "flash_attention",
]
