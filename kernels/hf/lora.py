"""PEFT's LoRA layers computed by the fused LoRA linear (``patch_llama``'s ``lora`` switch: on by
default wherever PEFT's LoRA layers appear, before the patch or after it; ``lora=False`` turns it
off).

Each PEFT ``lora.Linear`` of the model gets an instance-level ``forward`` that computes its base
layer and its adapter in one ``kernels.lora.lora_linear`` node, from the very same ``Parameter``
objects (the base weight, ``lora_A[name].weight``, ``lora_B[name].weight``) and PEFT's own
``scaling[name]`` (α/r, or α/√r with rsLoRA). Nothing else changes: the modules, their names, the
``state_dict``, ``save_pretrained`` (PEFT's own adapter format) and the optimizer see what they saw
before. ``undo()`` deletes the instance attributes, and PEFT's class forward is seen again (so
``merge_and_unload()`` then works as PEFT intends).

**down_proj over the SwiGLU.** Each fused layer also gets ``forward_after_swiglu(gate, up)``, which
the patched MLP (``kernels.swiglu.TritonSwiGLUMLP``) calls on its ``down_proj``: the layer and the
SwiGLU before it as one node (``kernels.lora.SwiGLULoRADownFunction``) that keeps gate and up but
not their product, the widest input of the layer, recomputed in the backward for dA instead. It
declines (returns None) any call that is not the plain case.

**Layers that share an input.** q_proj, k_proj and v_proj of an attention block read one input, and
so do gate_proj and up_proj of an MLP. When all of a group are fused LoRA layers, the first one
called computes the whole group as one node (``kernels.lora.lora_group``: x read once for the
adapters, the input gradients summed by the GEMMs instead of by autograd's adds) and leaves each
sibling its output; the sibling's own call hands it out when it comes with the very same input
tensor, unchanged since (version counters of the input, base weight and adapters), under the same
grad mode. A call with another input computes on its own, as does everything under
``torch.compile``, a group where a sibling has a forward pre-hook (it could change the sibling's
weights after the group ran), and one whose parameters are not plain tensors (a sharded DTensor,
say). ``SHARED_INPUT = False`` turns grouping off.

**Both orders.** Wrapped first (``patch_llama(get_peft_model(llama, config))``), the LoRA layers are
there to find. Patched first (``get_peft_model(patch_llama-ed llama, config)``, TRL's
``SFTTrainer(model, peft_config=...)``, transformers' ``add_adapter``/``load_adapter``), PEFT
injects its layers afterwards; so the patch also leaves a forward pre-hook on the decoder that,
before each forward, gives the fused forward to any LoRA layer that has taken a linear layer's place
since (it looks at the children of the modules that held linear layers at the patch, not at every
module). On a model that never gets LoRA layers the hook finds none and changes nothing.

**Each call decides.** The fused path runs when the call is the plain case it computes, checked on
attributes at each call (PEFT's state can change between steps): adapters enabled and not merged,
exactly one active adapter, vanilla LoRA (no DoRA or other variant), dropout an identity (p = 0), no
bias on ``lora_B``, ``fan_in_fan_out`` off, the base a plain ``nn.Linear`` (or an ``Fp8Linear``, below),
no extra arguments, and the input in the base weight's dtype, or any dtype under autocast (the
Trainer's and TRL's ``bf16=True``): then the node computes in autocast's dtype, its operands cast as autocast casts
PEFT's. Anything else runs PEFT's forward, unchanged. The layers found so far that stay on PEFT's
path are listed, with the reason, in ``handle.left_off["lora"]`` (after the first forward for layers
added after the patch).

**A base stored in FP8** (``patch_llama(fp8_base=True)``, chapter 18): a layer whose base is a
``kernels.fp8_linear.Fp8Linear`` runs ``kernels.lora_fp8``'s node instead, grouped on a shared input
the same way, and down_proj over the SwiGLU as ``Fp8SwiGLULoRADownFunction``; ``GRAD_INPUT`` and
``SAVED_INPUT`` choose its input gradient and what it keeps of x. A group mixing FP8 and bf16 bases
runs layer by layer.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass, field

import torch

from kernels.fp8_linear import Fp8Linear
from kernels.gemm import KERNEL_DTYPES
from kernels.lora import (
    GROUP_EPILOGUES,
    LoRAGroupFunction,
    LoRALinearFunction,
    SwiGLULoRADownFunction,
    adapters_share_dtype,
)
from kernels.lora_fp8 import Fp8LoRAFunction, Fp8SwiGLULoRADownFunction

# How the fused layer computes its two halves (``kernels.lora``): the benchmark flips these to
# compare. The low-rank product first, then the base GEMM onto it: the faster order at the 8B shape
# (assets/notes/lora.md).
EPILOGUE = "cublas_lowrank_first"
SKINNY = "cublas"
# Whether LoRA layers on one input run as one node (``kernels.lora.lora_group``), and which layers
# those are.
SHARED_INPUT = True
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# How a base stored in FP8 (``patch_llama(fp8_base=True)``) computes its input gradient: one of
# ``kernels.lora_fp8.GRAD_INPUTS``.
GRAD_INPUT = "fp8"
# What such a node keeps of its input for dA (``kernels.lora_fp8.SAVED_INPUTS``).
SAVED_INPUT = "bf16"


def lora_linear_class() -> type | None:
    """PEFT's LoRA ``Linear`` class, or None when peft is not installed.

    Returns:
        ``peft.tuners.lora.layer.Linear``, or None.
    """
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:
        return None
    return Linear


def why_not_fused(layer: torch.nn.Module) -> str | None:
    """Why a PEFT LoRA layer runs PEFT's own forward right now (chapter 15).

    Args:
        layer: a PEFT ``lora.Linear``.

    Returns:
        The reason in words, or None when the fused forward computes it.
    """
    if layer.disable_adapters:
        return "adapters disabled"
    if layer.merged:
        return "adapter merged into the base weight"
    active = layer.active_adapters
    if len(active) != 1:
        return f"{len(active)} active adapters (the fused layer computes one)"
    name = active[0]
    if name not in layer.lora_A:
        return f"the active adapter {name!r} is not on this layer"
    if name in getattr(layer, "lora_variant", {}):
        return f"a LoRA variant ({type(layer.lora_variant[name]).__name__}, e.g. DoRA) is not fused"
    dropout = layer.lora_dropout[name]
    if not isinstance(dropout, torch.nn.Identity) and getattr(dropout, "p", 1.0) != 0:
        return f"lora_dropout={getattr(dropout, 'p', '?')} (dropout is not reproduced: it stays PEFT's)"
    if layer.lora_B[name].bias is not None:
        return "lora_bias=True is not fused"
    if getattr(layer, "fan_in_fan_out", False):
        return "fan_in_fan_out=True (a transposed base weight) is not fused"
    base = layer.get_base_layer()
    if type(base) not in (torch.nn.Linear, Fp8Linear):
        return f"the base layer is {type(base).__name__}, not a plain nn.Linear or Fp8Linear (e.g. quantised)"
    if base.weight.dtype not in KERNEL_DTYPES:
        return f"the base weight is {base.weight.dtype}"
    return None


def _compute_dtype(layer: torch.nn.Module, x: torch.Tensor) -> torch.dtype | None:
    """The dtype the fused node computes a call of ``layer`` on ``x`` in, or None when the call is
    not the plain case (the module docstring): under autocast, autocast's dtype, as PEFT's layers
    then compute in it; else ``x``'s, which must be the base weight's."""
    if why_not_fused(layer) is not None or x.dtype not in KERNEL_DTYPES:
        return None
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        return dtype if dtype in KERNEL_DTYPES else None
    return x.dtype if x.dtype == layer.get_base_layer().weight.dtype else None


def _plain_call(layer: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether a call of ``layer`` on ``x`` is the plain case the fused layer computes (the module
    docstring)."""
    return _compute_dtype(layer, x) is not None


def _cast(x: torch.Tensor) -> torch.dtype | None:
    # Under autocast, the dtype every operand of the fused node is cast to first (autocast's own
    # casts, which the fused node's matmuls would otherwise not see); else None: the operands as
    # they are.
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else None


def _adapter(layer: torch.nn.Module, cast: torch.dtype | None = None) -> tuple:
    # The fused node's arguments after the input: base weight and bias, A, B, the scale, how to
    # compute; each tensor cast to ``cast`` (autocast's dtype) where given, differentiably, so the
    # gradients reach the Parameters.
    base, name = layer.get_base_layer(), layer.active_adapters[0]
    tensors = (base.weight, base.bias, layer.lora_A[name].weight, layer.lora_B[name].weight)
    if cast is not None:
        tensors = tuple(t if t is None else t.to(cast) for t in tensors)
    return (*tensors, float(layer.scaling[name]), EPILOGUE, SKINNY)


def _fused_forward(self, x, *args, **kwargs):
    """PEFT's ``lora.Linear.forward`` for the plain case, as one fused node (or its share of a group
    node, see the module docstring); any other call goes to PEFT's."""
    if args or kwargs or not _plain_call(self, x):
        self.__dict__.pop("_lora_pending", None)
        return type(self).forward(self, x, *args, **kwargs)
    y = None if torch.compiler.is_compiling() else _pending_output(self, x)
    if y is None:
        cast = _cast(x)
        with torch.autocast(x.device.type, enabled=False) if cast is not None else contextlib.nullcontext():
            y = _group_call(self, x, cast)
            if y is None and _fp8_base(self):
                y = _fp8_call((self,), x, cast)[0]
            elif y is None:
                y = LoRALinearFunction.apply(x if cast is None else x.to(cast), *_adapter(self, cast))
    return y.reshape(*x.shape[:-1], self.get_base_layer().out_features)


def _fp8_base(layer: torch.nn.Module) -> bool:
    # Whether the layer's frozen base is stored in FP8 (patch_llama(fp8_base=True)).
    return type(layer.get_base_layer()) is Fp8Linear


def _fp8_adapter(layer: torch.nn.Module, cast: torch.dtype | None = None) -> tuple[tuple, float]:
    # ((codes, scales, bias, A, B), s) of a layer over an FP8 base, the bias and adapters cast to
    # ``cast`` where given (differentiably, as _adapter does).
    w, name = layer.get_base_layer().fp8_weight, layer.active_adapters[0]
    tensors = (w.bias, layer.lora_A[name].weight, layer.lora_B[name].weight)
    if cast is not None:
        tensors = tuple(t if t is None else t.to(cast) for t in tensors)
    return (w.q, w.scale, *tensors), float(layer.scaling[name])


def _fp8_call(members, x: torch.Tensor, cast: torch.dtype | None = None) -> tuple | None:
    """The outputs of LoRA layers over FP8 bases on one input, as one ``Fp8LoRAFunction`` node
    (x quantised once for all of them); None where their adapters' dtypes differ."""
    layers = [_fp8_adapter(m, cast) for m in members]
    if not adapters_share_dtype([t[3] for t, _ in layers], [t[4] for t, _ in layers]):
        return None
    params = [t for tensors, _ in layers for t in tensors]
    return Fp8LoRAFunction.apply(x if cast is None else x.to(cast), GRAD_INPUT, SAVED_INPUT,
                                 tuple(s for _, s in layers), *params)


def _versioned(layer: torch.nn.Module) -> tuple:
    # The tensors whose version counters say a layer changed: its base (the FP8 codes, or the
    # weight and bias) and its adapters.
    if _fp8_base(layer):
        name = layer.active_adapters[0]
        return layer.get_base_layer().q_bits, layer.lora_A[name].weight, layer.lora_B[name].weight
    return tuple(t for t in _adapter(layer)[:4] if t is not None)


def _state(layer: torch.nn.Module, x: torch.Tensor) -> tuple:
    # What a sibling's output was computed from: the input's and parameters' version counters, and
    # the grad mode.
    tensors = (x, *_versioned(layer))
    return (torch.is_grad_enabled(), *((id(t), t._version) for t in tensors))


def _pending_output(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """The output a group node left for ``layer``, if it was computed from this very ``x`` as it is
    now."""
    pending = layer.__dict__.pop("_lora_pending", None)
    if pending is None or pending[0] is not x or pending[1] != _state(layer, x):
        return None
    return pending[2]


def _group_call(first: torch.nn.Module, x: torch.Tensor,
                cast: torch.dtype | None = None) -> torch.Tensor | None:
    """``first``'s output from one node for its whole group, the siblings' outputs left for their
    calls (operands cast to ``cast`` where given: autocast's dtype); None when ``first`` leads no
    group or the group cannot run as one now."""
    siblings = first.__dict__.get("_lora_siblings")
    if (not siblings or not SHARED_INPUT or EPILOGUE not in GROUP_EPILOGUES or torch.compiler.is_compiling()
            or not all(_plain_call(m, x) for m in siblings)
            # A sibling's pre-hook may change its input or weights after the group ran.
            or any(m._forward_pre_hooks for m in siblings)):
        return None
    fp8 = [_fp8_base(m) for m in (first, *siblings)]
    if any(fp8):
        outputs = _fp8_call((first, *siblings), x, cast) if all(fp8) else None
        return None if outputs is None else _leave_pending(siblings, x, outputs)
    plain = [_adapter(m)[:4] for m in (first, *siblings)]
    tensors = [t for layer in plain for t in layer if t is not None]
    if not all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors):
        return None  # a sharded DTensor, say
    layers = [_adapter(m, cast) for m in (first, *siblings)]
    params = [t for layer in layers for t in layer[:4]]
    if not adapters_share_dtype([layer[2] for layer in layers], [layer[3] for layer in layers]):
        return None
    outputs = LoRAGroupFunction.apply(x if cast is None else x.to(cast), EPILOGUE, SKINNY,
                                      tuple(layer[4] for layer in layers), *params)
    return _leave_pending(siblings, x, outputs)


def _leave_pending(siblings, x: torch.Tensor, outputs) -> torch.Tensor:
    # Each sibling's output left for its own call (with what it was computed from); the first's
    # returned.
    for sibling, y in zip(siblings, outputs[1:]):
        sibling.__dict__["_lora_pending"] = (x, _state(sibling, x), y)
    return outputs[0]


def _forward_after_swiglu(self, gate, up):
    """This layer (a ``down_proj``) over ``swiglu(gate, up)`` as one node that keeps gate and up,
    not the product (``kernels.lora.SwiGLULoRADownFunction``); None for a call that is not the plain
    case (the MLP then runs ``down_proj(swiglu(gate, up))``)."""
    if not _plain_call(self, gate):
        return None
    cast = _cast(gate)
    if _fp8_base(self):
        with torch.autocast(gate.device.type, enabled=False) if cast is not None else contextlib.nullcontext():
            (q, ws, bias, a, b), s = _fp8_adapter(self, cast)
            gate, up = (gate, up) if cast is None else (gate.to(cast), up.to(cast))
            return Fp8SwiGLULoRADownFunction.apply(gate, up, GRAD_INPUT, s, q, ws, bias, a, b)
    if cast is None:
        return SwiGLULoRADownFunction.apply(gate, up, *_adapter(self))
    with torch.autocast(gate.device.type, enabled=False):
        return SwiGLULoRADownFunction.apply(gate.to(cast), up.to(cast), *_adapter(self, cast))


@dataclass
class LoraFusion:
    """The LoRA layers given the fused forward, and the hook that finds those PEFT adds later;
    ``undo()``. Chapter 15 (``notebooks/15_lora.ipynb``) reads it as ``handle.lora``
    (``patch_llama``'s handle).

    Args:
        model: the model patched (its decoder carries ``pre_hook``).
        layers: the LoRA layers given the fused forward, in the order found.
        left_off: qualified name of each such layer that runs PEFT's forward at the patch, and why.
        hook: the handle of ``pre_hook`` on the decoder, removed by ``undo()``.
        active: False once undone.
        parents: ``(qualified name, module)`` of the modules holding linear layers, which
            ``pre_hook`` looks into.
        leaders: the first layer of each group of ``GROUPS`` on a shared input.
    """

    model: torch.nn.Module
    layers: list[torch.nn.Module] = field(default_factory=list)
    left_off: dict[str, str] = field(default_factory=dict)  # qualified name → why PEFT's forward stays
    hook: object = None
    active: bool = True
    parents: list = field(default_factory=list)  # (qualified name, module) of those holding linear layers
    leaders: set = field(default_factory=set)  # the first layer of each group on a shared input

    def fuse_new_layers(self) -> int:
        """Give the fused forward to every LoRA layer of the model that lacks it (a walk over every
        module); note the modules PEFT puts its layers into, for the cheap walk of ``pre_hook``.

        Returns:
            How many layers were given the fused forward by this call.
        """
        cls = lora_linear_class()
        self.parents = []
        new = 0
        for where, module in self.model.named_modules():
            if type(module) is cls and "forward" not in module.__dict__:
                self._fuse(where, module)
                new += 1
            if type(module) is not cls and not isinstance(module, torch.nn.ModuleDict) and any(
                    type(c) is cls or isinstance(c, torch.nn.Linear) for c in module._modules.values()):
                self.parents.append((where, module))
        for _, parent in self.parents:
            self._link(parent)
        return new

    def _link(self, parent: torch.nn.Module) -> None:
        # Each group of ``parent``'s children on one input (GROUPS) whose members are all fused LoRA
        # layers: the first member computes the group (_group_call), the others take their outputs.
        cls = lora_linear_class()
        for names in GROUPS:
            members = [parent._modules.get(name) for name in names]
            if all(type(m) is cls and m in self.layers for m in members):
                members[0].__dict__["_lora_siblings"] = tuple(members[1:])
                self.leaders.add(members[0])

    def _fuse(self, where: str, module: torch.nn.Module) -> None:
        module.forward = types.MethodType(_fused_forward, module)
        # Read by the patched MLP.
        module.forward_after_swiglu = types.MethodType(_forward_after_swiglu, module)
        self.layers.append(module)
        reason = why_not_fused(module)
        if reason is not None:
            self.left_off[where] = reason

    def pre_hook(self, module, args) -> None:
        """The decoder's forward pre-hook: fuse the LoRA layers PEFT has put, since the patch, where
        a linear layer was. Only the children of the modules that held a linear layer at the patch
        are looked at (PEFT swaps a targeted ``nn.Linear`` in its parent): a few hundred attribute
        reads, not a walk over thousands of modules. Returns None: the arguments stay.

        Args:
            module: the module the hook is on (unused).
            args: its forward's positional arguments (unused, left as they are).
        """
        cls = lora_linear_class()
        for where, parent in self.parents:
            new = False
            for name, child in parent._modules.items():
                if type(child) is cls and "forward" not in child.__dict__:
                    self._fuse(f"{where + '.' if where else ''}{name}", child)
                    new = True
            if new:
                self._link(parent)

    def summary(self) -> str:
        """"N of M LoRA layers fused", the groups that run as one node, and for each layer left
        to PEFT at the patch, why.

        Returns:
            One line, parts separated by ``"; "``.
        """
        text = f"{len(self.layers) - len(self.left_off)} of {len(self.layers)} LoRA layers fused"
        # A group runs as one node only where every member is fused: a member left to PEFT runs
        # PEFT's forward.
        unfused = {id(m) for m in self.layers if why_not_fused(m) is not None}
        groups = [first for first in self.leaders
                  if not any(id(m) in unfused for m in (first, *first.__dict__.get("_lora_siblings", ())))]
        if groups and SHARED_INPUT:
            text += f", {len(groups)} groups of them on a shared input run as one node each"
        return text + "".join(f"; {where}: {why}" for where, why in self.left_off.items())

    def undo(self) -> None:
        """Remove the hook and the fused forwards: PEFT's class forward is seen again. A second call
        does nothing."""
        if not self.active:
            return
        if self.hook is not None:
            self.hook.remove()
        for module in self.layers:
            if getattr(module.__dict__.get("forward"), "__func__", None) is _fused_forward:
                del module.forward
            for name in ("forward_after_swiglu", "_lora_siblings", "_lora_pending"):
                module.__dict__.pop(name, None)
        self.layers.clear()
        self.leaders.clear()
        self.active = False


def has_lora_layers(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds a PEFT LoRA ``Linear`` now.

    Args:
        model: any module.

    Returns:
        True where one of its modules is PEFT's ``lora.Linear``.
    """
    cls = lora_linear_class()
    return cls is not None and any(type(m) is cls for m in model.modules())


def lora_can_follow(model: torch.nn.Module) -> bool:
    """Whether the lora switch applies to ``model``: ``kernels="auto"``'s default for it.

    Args:
        model: the model being patched.

    Returns:
        True where ``check_lora`` accepts it: peft installed, and LoRA layers now or a model PEFT
        could wrap later.
    """
    try:
        check_lora(model)
    except TypeError:
        return False
    return True


def check_lora(model: torch.nn.Module) -> None:
    """Raise where the lora switch cannot apply.

    Args:
        model: the model being patched.

    Raises:
        TypeError: peft is not installed, or the model has no PEFT LoRA layer and is no Hugging Face
            model (with a ``config``) that PEFT could wrap after the patch.
    """
    if lora_linear_class() is None:
        raise TypeError("lora needs peft (pip install peft), which is not installed; use lora=False")
    if not hasattr(model, "config") and not has_lora_layers(model):
        raise TypeError(f"{type(model).__name__} has no PEFT LoRA layer and is no Hugging Face model PEFT could wrap "
                        "later: lora has nothing to fuse")


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    # The module every forward goes through as a call (so its hooks run): the decoder inside a
    # causal LM.
    get = getattr(model, "get_decoder", None)
    decoder = get() if callable(get) else None
    return decoder if isinstance(decoder, torch.nn.Module) else model


def enable_lora_fusion(model: torch.nn.Module) -> LoraFusion:
    """Fuse the LoRA layers of ``model`` now and, through a forward pre-hook, those PEFT injects
    later.

    Args:
        model: the Hugging Face model (the Llama inside a PEFT model).

    Returns:
        The ``LoraFusion`` handle: its layers, those left to PEFT and why (``summary()``),
        ``undo()``.
    """
    check_lora(model)
    fusion = LoraFusion(model)
    fusion.fuse_new_layers()
    fusion.hook = _decoder(model).register_forward_pre_hook(fusion.pre_hook)
    return fusion
