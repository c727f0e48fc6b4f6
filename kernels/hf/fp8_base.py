"""``patch_llama``'s ``fp8_base`` switch: the frozen base of a PEFT LoRA model stored in FP8 (chapter 18).

Each frozen ``nn.Linear`` of the model (the ``base_layer`` of every PEFT LoRA layer, and any other
frozen linear but the LM head) becomes a ``kernels.fp8_linear.Fp8Linear``: its weight quantised
once, one scale per output channel, the bf16 copy freed. With the ``lora`` switch on, each LoRA
layer over such a base then runs ``kernels.lora_fp8``'s node: the base GEMMs in FP8, the adapters
in bf16.

**One-way.** The bf16 weights are gone once converted: ``undo()`` takes the other switches back
and leaves the FP8 base in place (PEFT's own forward runs over it, as it runs over any base
layer). To get the bf16 model back, reload it. The adapters are untouched:
``save_pretrained`` writes PEFT's format, with the same keys and values as without the switch.

**Refused**, before anything changes: a model without PEFT LoRA layers (wrap it with
``get_peft_model`` first: PEFT places its layers on ``nn.Linear`` modules and would not recognise an
``Fp8Linear``), a LoRA layer whose base weight requires grad (a trained weight has no FP8 copy to
update), and a device without the FP8 kernels (``fp8_linear.require_fp8``).
"""

from __future__ import annotations

import torch

from kernels.fp8_linear import Fp8Linear, convert_frozen_linears, require_fp8

from .lora import has_lora_layers, lora_linear_class


def check_fp8_base(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The PEFT LoRA layers whose base the switch converts, or a clear error.

    Args:
        model: the model being patched (a PEFT model's base model, or any module holding PEFT's
            LoRA layers).

    Returns:
        The LoRA layers (their bases are ``nn.Linear`` or already ``Fp8Linear``).

    Raises:
        TypeError: no PEFT LoRA layer in the model.
        ValueError: a LoRA layer's base weight (or bias) requires grad.
        RuntimeError: a base sits on a device without the FP8 kernels.
    """
    if not has_lora_layers(model):
        raise TypeError("fp8_base converts the frozen base under PEFT's LoRA layers, and this model has none: wrap "
                        "it with peft.get_peft_model first, then patch (PEFT does not place adapters on an FP8 "
                        "layer)")
    cls = lora_linear_class()
    named = [(name, m) for name, m in model.named_modules() if type(m) is cls]
    for name, module in named:
        base = module.get_base_layer()
        if any(isinstance(p, torch.Tensor) and p.requires_grad
               for p in (getattr(base, "weight", None), getattr(base, "bias", None))):
            raise ValueError(f"fp8_base stores frozen weights only, and the base of {name} requires grad: freeze "
                             "it (PEFT freezes the base unless told otherwise) or leave fp8_base off")
    layers = [m for _, m in named]
    for device in {m.get_base_layer().weight.device for m in layers}:
        require_fp8(device)
    return layers


def convert_base(model: torch.nn.Module) -> int:
    """Convert the frozen linears (not the LM head) to ``Fp8Linear``, in place: one-way.

    Args:
        model: the model ``check_fp8_base`` accepted.

    Returns:
        How many linears were converted (0 when they already were).
    """
    return convert_frozen_linears(model)


def describe(model: torch.nn.Module) -> str:
    """The switch's part of ``summary()``.

    Args:
        model: the patched model.

    Returns:
        How many linears hold FP8 weights, and that the conversion stays.
    """
    n = sum(type(m) is Fp8Linear for m in model.modules())
    return f"fp8_base: {n} frozen linears in FP8 (one-way: undo() keeps them)"
