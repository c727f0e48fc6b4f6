"""What a language-model loss costs in memory: the one place its [tokens, vocab] buffers are counted, and the
measurement of the peak memory a call adds.

Hugging Face's causal-LM loss (``logits.float()`` then ``F.cross_entropy``) creates, per logit: the
logits in the model's dtype, their float32 copy, and the float32 log-softmax that
``F.cross_entropy`` keeps for backward; the backward pass then holds two float32 gradients of the
logits (``nll_loss``'s and ``log_softmax``'s) beside that log-softmax. The fused kernel keeps only
the logits, which receive their own gradient. ``models``, ``profiling``, ``fit`` and the chapters
all count the loss with the functions here.

The linear cross-entropy's budgets are set here too (``LOGITS_BUFFER_BYTES``,
``RECOMPUTE_BUDGET_BYTES``); what its plans add within them is counted beside the plans, by
``kernels.linear_cross_entropy.linear_loss_extra_bytes``.
"""

from __future__ import annotations

import torch

from . import runtime

FP32 = 4  # bytes of a float32


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def hf_loss_buffers(tokens: int, vocab: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
    """Bytes of each [tokens, vocab] tensor Hugging Face's loss creates (computed, not measured).

    Args:
        tokens: rows of the logits (batch × sequence).
        vocab: the vocabulary size.
        dtype: the logits' dtype, the model's.

    Returns:
        ``logits`` in ``dtype``; ``logits_fp32``, their float32 copy; ``log_softmax_fp32``, kept for
        backward; ``logit_grads_fp32``, the two float32 gradients of the backward pass together.
    """
    n = tokens * vocab
    return {"logits": n * _itemsize(dtype), "logits_fp32": n * FP32, "log_softmax_fp32": n * FP32,
            "logit_grads_fp32": 2 * n * FP32}


def hf_loss_peak(logits: int, logits_fp32: int, log_softmax_fp32: int, logit_grads_fp32: int) -> int:
    """The most bytes Hugging Face's loss buffers take at once (computed).

    The forward's (logits, fp32 copy, log-softmax) or the backward's (log-softmax, two fp32
    gradients), whichever is larger. Call it as ``hf_loss_peak(**hf_loss_buffers(...))``.

    Args:
        logits, logits_fp32, log_softmax_fp32, logit_grads_fp32: bytes of each buffer, the entries
            of ``hf_loss_buffers``.

    Returns:
        The peak in bytes.
    """
    return max(logits + logits_fp32 + log_softmax_fp32, log_softmax_fp32 + logit_grads_fp32)


def logits_bytes_per_token(vocab: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
    """Computed bytes per token that the loss keeps alive at its high point, Hugging Face's loss
    against the patch.

    Hugging Face: ``hf_loss_peak`` of one token's buffers (2 + 4 + 4 bytes per logit in bf16 in the
    forward pass, 4 + 4 + 4 in the backward pass; the larger counts). Patched: the logits only,
    which then receive their own gradient (2 bytes per logit in bf16).

    Args:
        vocab: the vocabulary size.
        dtype: the logits' dtype.

    Returns:
        ``{"baseline": bytes, "patched": bytes}`` per token.
    """
    return {"baseline": hf_loss_peak(**hf_loss_buffers(1, vocab, dtype)),
            "patched": vocab * _itemsize(dtype)}


def loss_memory_bytes(n_tokens: int, vocab: int) -> dict[str, int]:
    """Sizes of the [tokens, V] tensors a language-model loss can create with bf16 logits, in bytes
    (computed). Chapters 05 to 07 tabulate them.

    Args:
        n_tokens: rows of the logits (batch × sequence).
        vocab: the vocabulary size V.

    Returns:
        Each tensor's description mapped to its bytes: the bf16 logits, their fp32 upcast, the fp32
        log-softmax kept for backward, one fp32 gradient of the logits and one bf16 gradient.
    """
    hf = hf_loss_buffers(n_tokens, vocab, torch.bfloat16)
    return {
        "bf16 logits": hf["logits"],
        "fp32 upcast of the logits": hf["logits_fp32"],
        "fp32 softmax (log-softmax) kept for backward": hf["log_softmax_fp32"],
        "fp32 gradient of the logits": hf["logit_grads_fp32"] // 2,
        "bf16 gradient of the logits": hf["logits"],
    }


def peak_extra_bytes(fn) -> int:
    """GPU only: peak memory allocated while ``fn()`` runs, beyond what was allocated before it.

    Chapter 06 measures the loss's memory with it.

    Args:
        fn: a callable taking no arguments; its result is discarded.

    Returns:
        The peak of ``torch.cuda.max_memory_allocated()`` during the call, less what was allocated
        before it, in bytes.

    Raises:
        RuntimeError: outside gpu mode (no CUDA memory statistics to read).
    """
    if runtime.MODE != "gpu":
        raise RuntimeError("peak memory is measured with torch.cuda statistics and needs a GPU")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


# The most bytes of logits the linear cross-entropy computes in one matmul on a GPU (one slice of
# the vocabulary for every token, or one chunk of tokens for the whole vocabulary):
# kernels.linear_cross_entropy sizes its slices by it.
LOGITS_BUFFER_BYTES = 256 << 20
# What the linear cross-entropy's "recompute" plan may add beyond its inputs and gradients on a GPU:
# the float32 d_hidden and as many slices of logits, kept from the forward pass for the backward, as
# fit beside it. 896 MiB keeps the plan under 1 GB; every slice kept is one matmul the backward pass
# does not redo.
RECOMPUTE_BUDGET_BYTES = 896 << 20
