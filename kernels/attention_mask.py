"""A padding mask that attention does not copy: one additive bias per forward pass instead of one per layer.

When a batch needs its mask (left padding, holes, packed rows: ``kernels.padding_mask`` says when it does not),
Hugging Face's SDPA attention builds a boolean [batch, 1, seq, seq] mask once per forward pass and hands it to every
layer. PyTorch's memory-efficient attention, the SDPA kernel that accepts a mask, wants an additive bias in the
activations' dtype, so each call turns the booleans into a new bf16 [seq, seq] tensor (``where(mask, 0, -inf)``),
and the autograd node keeps that copy for the backward pass:

* without gradient checkpointing, every layer keeps its own copy: 32 layers × 2 bytes × seq² (4 GiB at 8,192
  tokens of the 8B shape) beside the 1-byte boolean mask;
* with checkpointing, the recomputed layer's copy sits beside the boolean mask at the step's peak: 3 bytes per
  element where 2 would do.

``use_additive_mask(model)`` builds the mask as that bias in the first place: the same booleans (transformers' own
``sdpa_mask``), written once as 0 where a position may attend and −inf where it may not, the very bias SDPA makes of
the booleans itself, so attention computes the same values, fully masked rows (left padding) included. Every layer
then receives the same tensor, and SDPA uses it as it is.
The change is scoped to the one model: it registers an attention implementation, ``"sdpa_additive_mask"`` (the
same ``sdpa_attention_forward``, this mask function), with transformers and points the model's config at it; the
returned function points it back. Only a half-precision model gets the bias (a float32 bias would be 4 bytes per
element, and autocast would cast it per call); no mask, or a mask SDPA can skip (``is_causal``), stays None.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

IMPLEMENTATION = "sdpa_additive_mask"
# The dtypes whose bias is smaller than the boolean mask plus the copy each SDPA call makes of it.
HALF_DTYPES = (torch.bfloat16, torch.float16)


def additive_sdpa_mask(*args, dtype: torch.dtype = torch.float32, **kwargs) -> torch.Tensor | None:
    """transformers' SDPA mask function (same arguments), returning the boolean mask as an additive bias in
    ``dtype`` when ``dtype`` is half precision: 0 where attention is allowed, −inf where not (as SDPA converts it;
    not the dtype's lowest finite value, which would turn a fully masked row into a uniform average)."""
    from transformers.masking_utils import sdpa_mask

    mask = sdpa_mask(*args, **kwargs)
    if mask is None or mask.dtype != torch.bool or dtype not in HALF_DTYPES:
        return mask
    # One allocation of the bias, no boolean temporary: start from "masked" everywhere, clear what may attend.
    return torch.full(mask.shape, float("-inf"), dtype=dtype, device=mask.device).masked_fill_(mask, 0.0)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, sdpa_attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, additive_sdpa_mask)


def check_sdpa(model: torch.nn.Module) -> None:
    """Raise unless ``model`` uses SDPA attention (``config._attn_implementation == "sdpa"``, transformers' default
    where PyTorch provides it): eager, flash or flex attention build their masks differently."""
    current = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if current != "sdpa":
        raise ValueError(
            f"additive_mask=True needs SDPA attention (config._attn_implementation 'sdpa'), got {current!r}: load the "
            "model with attn_implementation='sdpa', or leave additive_mask off"
        )


def use_additive_mask(model: torch.nn.Module) -> Callable[[], None]:
    """Point ``model``'s attention at ``"sdpa_additive_mask"``; returns the function that points it back.
    ``check_sdpa`` first."""
    check_sdpa(model)
    config = model.config
    current = config._attn_implementation
    _register()
    config._attn_implementation = IMPLEMENTATION

    def restore() -> None:
        if config._attn_implementation != IMPLEMENTATION:
            raise RuntimeError(
                f"cannot undo: the model's attention implementation was changed to {config._attn_implementation!r} "
                "after the patch"
            )
        config._attn_implementation = current

    return restore
