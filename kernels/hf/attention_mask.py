"""A padding mask that attention does not copy: one additive bias per forward pass instead of one per layer.

When a batch needs its mask (left padding, holes, packed rows: ``kernels.hf.padding_mask`` says when
it does not), Hugging Face's SDPA attention builds a boolean [batch, 1, seq, seq] mask once per
forward pass and hands it to every layer. PyTorch's memory-efficient attention, the SDPA kernel that
accepts a mask, wants an additive bias in the activations' dtype, so each call turns the booleans
into a new bf16 [seq, seq] tensor (``where(mask, 0, -inf)``), and the autograd node keeps that copy
for the backward pass:

* without gradient checkpointing, every layer keeps its own copy: 32 layers × 2 bytes × seq² (4 GiB
  at 8,192 tokens of the 8B shape) beside the 1-byte boolean mask;
* with checkpointing, the recomputed layer's copy sits beside the boolean mask at the step's peak: 3
  bytes per element where 2 would do.

``use_mask_function(model, additive=True)`` builds the mask as that bias in the first place: the
same booleans (transformers' own ``sdpa_mask``), written once as 0 where a position may attend and
−inf where it may not, the very bias SDPA makes of the booleans itself, so attention computes the
same values, fully masked rows (left padding) included. Every layer then receives the same tensor,
and SDPA uses it as it is. The change is scoped to the one model: it registers an attention
implementation, ``"sdpa_additive_mask"`` (the same ``sdpa_attention_forward``, this mask function),
with transformers and points the model's config at it; the returned function points it back. Only a
half-precision model gets the bias (a float32 bias would be 4 bytes per element, and autocast would
cast it per call); no mask, or a mask SDPA can skip (``is_causal``), stays None.

**The causal mask under torch.compile** (``causal_skip_sdpa_mask``; ``use_mask_function`` with
either). A batch of one causal sequence per row needs no mask at all: SDPA's ``is_causal=True`` runs
the flash kernel, with the key/value heads shared (``enable_gqa``). Eagerly, transformers sees this
and passes None. While compiling, it cannot: it would have to read the position ids to rule out
packed sequences (several documents in one row), and reading a tensor's values is what a graph must
not do. So the compiled model builds the full [seq, seq] mask, every layer repeats its key/value
heads to match the query heads (SDPA's GQA path takes no mask), and attention runs a masked kernel,
several times slower than the flash kernel forward and backward (the timing at the Llama-3.1-8B
shape: assets/notes/attention.md, "The compiled model's mask").

The patched model's forward does know, without reading any tensor: the caller passed no attention
mask, no position ids and no cache, so the positions are 0, 1, 2, … in every row. It says so
(``CAUSAL_CALL.plain``) for the length of the call, and this module's mask function then returns
None when the mask asked for is the full causal one (as many keys as queries, no offset, no sliding
window), exactly where transformers returns None eagerly.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

IMPLEMENTATION = "sdpa_additive_mask"  # the additive bias (with the causal skip while a plain call runs)
CAUSAL_IMPLEMENTATION = "sdpa_causal_skip"  # transformers' boolean mask, with the causal skip
# The dtypes whose bias is smaller than the boolean mask plus the copy each SDPA call makes of it.
HALF_DTYPES = (torch.bfloat16, torch.float16)
# The model-forward arguments whose absence makes a call plain causal (positions 0, 1, 2, … in every
# row).
_NOT_PLAIN_IF_GIVEN = ("attention_mask", "position_ids", "past_key_values", "cache_position")


class CausalCall:
    """Whether the forward pass now running is plain causal (``plain``): set by the patched model's
    forward for the length of the call, read by the mask functions below. A Python attribute, not a
    tensor, so ``torch.compile`` traces the value the forward set."""

    def __init__(self) -> None:
        self.plain = False


# The one instance every patched forward sets. An instance attribute: torch.compile traces assigning
# it as a side effect of the call, whereas assigning a class attribute breaks the graph (PyTorch
# 2.11).
CAUSAL_CALL = CausalCall()


def is_plain_causal_call(args: tuple, kwargs: dict) -> bool:
    """Whether a causal LM's forward, called with ``args`` and ``kwargs``, sees one causal sequence
    per row: only the token ids (or embeddings) given, and no attention mask, position ids or cache,
    by keyword or by position.

    Args:
        args: the forward's positional arguments.
        kwargs: its keyword arguments.

    Returns:
        True when at most the first positional argument is given and none of ``attention_mask``,
        ``position_ids``, ``past_key_values`` or ``cache_position`` is (or each is None).
    """
    return len(args) <= 1 and all(kwargs.get(name) is None for name in _NOT_PLAIN_IF_GIVEN)


def _mask_arguments(args: tuple, kwargs: dict) -> dict:
    """transformers' mask-function arguments by name, whichever of its signatures is installed: (batch_size,
    q_length, kv_length, q_offset, kv_offset, …) or the older (batch_size, cache_position, kv_length, …)."""
    from transformers.masking_utils import sdpa_mask

    return inspect.signature(sdpa_mask).bind(*args, **kwargs).arguments


def _is_full_causal(arguments: dict) -> bool:
    """Whether the mask asked for is the full causal one, given a plain call: no padding mask, as
    many keys as queries from the same start, no sliding window."""
    q_length = arguments["q_length"] if "q_length" in arguments else arguments["cache_position"].shape[0]
    return (arguments.get("attention_mask") is None and arguments.get("local_size") is None
            and arguments.get("kv_offset", 0) == 0 and q_length == arguments["kv_length"])


def causal_skip_sdpa_mask(*args, **kwargs) -> torch.Tensor | None:
    """transformers' SDPA mask function (same arguments), returning None, so that SDPA runs with
    ``is_causal``, when the forward pass is plain causal (``CAUSAL_CALL.plain``) and the full causal
    mask is asked for. Chapters 09 and 11 (``notebooks/11_swiglu_rope.ipynb``) turn it on as
    ``skip_causal_mask=True``.

    Args:
        *args, **kwargs: those of transformers' ``sdpa_mask``, whichever of its signatures is
            installed.

    Returns:
        None where SDPA can run with ``is_causal``; otherwise what ``sdpa_mask`` returns.
    """
    from transformers.masking_utils import sdpa_mask

    if CAUSAL_CALL.plain and _is_full_causal(_mask_arguments(args, kwargs)):
        return None
    return sdpa_mask(*args, **kwargs)


def additive_sdpa_mask(*args, dtype: torch.dtype = torch.float32, **kwargs) -> torch.Tensor | None:
    """``causal_skip_sdpa_mask`` (same arguments), returning the boolean mask as an additive bias in
    ``dtype`` when ``dtype`` is half precision: 0 where attention is allowed, −inf where not (as
    SDPA converts it; not the dtype's lowest finite value, which would turn a fully masked row into
    a uniform average). Chapter 10 (``notebooks/10_linear_cross_entropy.ipynb``) turns it on as
    ``additive_mask=True``.

    Args:
        *args, **kwargs: those of transformers' ``sdpa_mask``.
        dtype: the model's activation dtype, which transformers passes to the mask function.

    Returns:
        None, the boolean mask (float32 and other full-precision dtypes, or a mask that is not
        boolean), or the additive bias in ``dtype``, of the boolean mask's shape.
    """
    mask = causal_skip_sdpa_mask(*args, **kwargs)
    if mask is None or mask.dtype != torch.bool or dtype not in HALF_DTYPES:
        return mask
    # One allocation of the bias, no boolean temporary: start from "masked" everywhere, clear what
    # may attend.
    return torch.full(mask.shape, float("-inf"), dtype=dtype, device=mask.device).masked_fill_(mask, 0.0)


def _register(name: str, mask_function: Callable) -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, sdpa_attention_forward)
    AttentionMaskInterface.register(name, mask_function)


def check_sdpa(model: torch.nn.Module, switch: str = "additive_mask") -> None:
    """Raise unless ``model`` uses SDPA attention (``config._attn_implementation == "sdpa"``,
    transformers' default where PyTorch provides it): eager, flash or flex attention build their
    masks differently. ``switch`` names the ``patch_llama`` keyword that needs it, for the
    message.

    Args:
        model: the model about to be patched.
        switch: the ``patch_llama`` keyword, named in the error.

    Raises:
        ValueError: the model's attention implementation is not ``"sdpa"``.
    """
    current = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if current != "sdpa":
        raise ValueError(
            f"{switch}=True needs SDPA attention (config._attn_implementation 'sdpa'), got {current!r}: load the "
            f"model with attn_implementation='sdpa', or leave {switch} off"
        )


def use_mask_function(model: torch.nn.Module, additive: bool) -> Callable[[], None]:
    """Point ``model``'s attention at ``"sdpa_additive_mask"`` (``additive``) or
    ``"sdpa_causal_skip"``; returns the function that points it back. ``check_sdpa`` first.
    Chapters 09 to 11 patch with it (``additive_mask``, ``skip_causal_mask``).

    Args:
        model: a Hugging Face model with SDPA attention; its config is changed in place.
        additive: True for the additive bias (with the causal skip), False for the causal skip
            alone.

    Returns:
        The undo: it restores the previous attention implementation, and raises ``RuntimeError``
        if the config's implementation was changed again in between.

    Raises:
        ValueError: the model does not use SDPA attention (``check_sdpa``).
    """
    check_sdpa(model, "additive_mask" if additive else "skip_causal_mask")
    config = model.config
    current = config._attn_implementation
    name = IMPLEMENTATION if additive else CAUSAL_IMPLEMENTATION
    _register(name, additive_sdpa_mask if additive else causal_skip_sdpa_mask)
    config._attn_implementation = name

    def restore() -> None:
        if config._attn_implementation != name:
            raise RuntimeError(
                f"cannot undo: the model's attention implementation was changed to {config._attn_implementation!r} "
                "after the patch"
            )
        config._attn_implementation = current

    return restore
