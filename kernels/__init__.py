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

# Chapter 01, profiling a fine-tuning step: Llama presets with random weights, an SFT batch stream, the profiler.
from .models import PRESETS, build_model, full_finetune_memory, llama_config, load_pretrained, pick_preset_for_gpu
from .data import get_tokenizer, make_sft_batches
from .profiling import amdahl, classify, profile_training_step

__all__ += [
    "PRESETS", "build_model", "full_finetune_memory", "llama_config", "load_pretrained", "pick_preset_for_gpu",
    "get_tokenizer", "make_sft_batches",
    "amdahl", "classify", "profile_training_step",
]
