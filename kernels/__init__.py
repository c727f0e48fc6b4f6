"""Fused Triton kernels for LLM fine-tuning, and the tools the workbook builds them with.

``import kernels`` first decides where kernels run (see ``kernels.runtime``): on a CUDA GPU, or in Triton's
interpreter on the CPU. That decision has to come before any ``@triton.jit`` function is defined, which is why
``runtime`` is imported before everything else here (and why a notebook imports ``kernels`` before ``triton``).
"""

from . import runtime  # noqa: I001  (must come first: it sets TRITON_INTERPRET)
from .runtime import describe

# References the kernels are tested against (plain PyTorch).
from .reference import cross_entropy_hf, online_logsumexp, online_softmax_steps, relative_error, rms_norm_reference

# The kernels (chapters 02-03 and 05-06).
from .rmsnorm import RMSNormFunction, TritonRMSNorm, rms_norm
from .cross_entropy import CrossEntropyFunction, TritonCrossEntropyLoss, cross_entropy

# Chapter 01, profiling a fine-tuning step: Llama presets with random weights, an SFT batch stream, the profiler.
from .models import PRESETS, build_model, full_finetune_memory, llama_config, load_pretrained, pick_preset_for_gpu
from .data import get_tokenizer, make_sft_batches
from .profiling import amdahl, classify, profile_training_step

# Chapter 08, the kernels in a real fine-tuning loop: the patch, baseline against patched. (The loop itself is
# kernels.train.train: a top-level `train` would hide the module of that name.)
from .patch import LlamaPatch, causal_lm_loss, patch_llama
from .fit import max_seq_len_that_fits
from .train import compare

__all__ = [
    "runtime", "describe",
    "relative_error", "rms_norm_reference", "cross_entropy_hf", "online_logsumexp", "online_softmax_steps",
    "rms_norm", "RMSNormFunction", "TritonRMSNorm",
    "cross_entropy", "CrossEntropyFunction", "TritonCrossEntropyLoss",
    "PRESETS", "build_model", "full_finetune_memory", "llama_config", "load_pretrained", "pick_preset_for_gpu",
    "get_tokenizer", "make_sft_batches",
    "amdahl", "classify", "profile_training_step",
    "patch_llama", "LlamaPatch", "causal_lm_loss", "compare", "max_seq_len_that_fits",
]
