"""The rotary embedding of an attention module computed by the RoPE kernel (``patch_llama(..., rope=True)``).

Llama's attention forward calls its modeling file's ``apply_rotary_pos_emb`` by name, so the
function cannot be swapped on one model by setting an attribute. The patch gives each attention
module an instance-level forward: the class's own forward function, rebuilt over a copy of its
module's globals in which ``apply_rotary_pos_emb`` is ``kernels.rope.apply_rotary``. Same code and
arguments, one name resolved differently, for these modules only; a decorator's wrapper is rebuilt
around the rebuilt function. A forward that does not call the function by name, or a rotary function
whose signature is not the kernel's, is refused before anything changes.
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass

import torch

from kernels.rope import apply_rotary

from .wrappers import rebuilt_around

_ROTARY_NAME = "apply_rotary_pos_emb"
_ROTARY_PARAMETERS = ["q", "k", "cos", "sin", "unsqueeze_dim"]


def _calls_rotary(forward) -> bool:
    # The function under any functools.wraps-style decorators (transformers' deprecate_kwarg wraps
    # some forwards).
    return _ROTARY_NAME in getattr(getattr(inspect.unwrap(forward), "__code__", None), "co_names", ())


def _forward_with_kernel_rotary(cls: type, where: str) -> types.FunctionType:
    """``cls.forward`` rebuilt over a copy of its module's globals in which ``apply_rotary_pos_emb``
    is ours, after checking that it calls that function by name and that the function has the
    kernel's signature."""
    if not _calls_rotary(cls.forward):
        raise ValueError(
            f"cannot patch the rotary embedding of {where} ({cls.__name__}): its forward does not call "
            f"{_ROTARY_NAME} by name (a transformers version this patch does not know). Use rope=False"
        )
    original = inspect.unwrap(cls.forward).__globals__.get(_ROTARY_NAME)
    try:
        parameters = list(inspect.signature(original).parameters)
    except (TypeError, ValueError):
        parameters = None
    if parameters != _ROTARY_PARAMETERS:
        raise ValueError(
            f"cannot patch the rotary embedding of {where}: {cls.__module__}.{_ROTARY_NAME} takes {parameters}, "
            f"not {_ROTARY_PARAMETERS} as the kernel does. Use rope=False"
        )
    rebuilt = _rebuilt_with_kernel_rotary(cls.forward, where)
    rebuilt.__doc__ = f"{cls.__name__}.forward with {_ROTARY_NAME} computed by the Triton RoPE kernel (patch_llama)."
    return rebuilt


def find_attention(model: torch.nn.Module,
                   accepted: set[type]) -> list[tuple[str, torch.nn.Module, types.FunctionType]]:
    """(qualified name, module, the forward to give it) of every attention module of the
    ``accepted`` classes, whose rotary call is swapped, the forward rebuilt once per class; raises
    before any change (also for an attention class outside ``accepted`` that calls the rotary
    function). Chapter 11 (``notebooks/11_swiglu_rope.ipynb``) turns it on as ``rope=True``.

    Args:
        model: the model whose attention modules are looked for.
        accepted: the attention classes whose forward the patch knows how to rebuild.

    Returns:
        One ``(where, module, forward)`` per attention module found, in ``named_modules`` order;
        ``forward`` is the rebuilt function, not yet bound to the module.

    Raises:
        ValueError: a forward does not call the rotary function by name, the rotary function's
            signature is not the kernel's, an instance's forward was already replaced, or an
            attention class outside ``accepted`` calls the rotary function.
    """
    forwards: dict[type, types.FunctionType] = {}
    found = []
    for where, module in model.named_modules():
        cls = type(module)
        if cls in accepted:
            if cls not in forwards:
                forwards[cls] = _forward_with_kernel_rotary(cls, where)
            if "forward" in module.__dict__:
                raise ValueError(
                    f"cannot patch the rotary embedding of {where}: its forward was already replaced on the "
                    "instance (by another patch, or accelerate's hooks). Use rope=False"
                )
            found.append((where, module, forwards[cls]))
        elif cls.__name__.endswith("Attention") and _calls_rotary(cls.forward):
            raise ValueError(
                f"cannot patch the rotary embedding of {where}: {cls.__module__}.{cls.__name__} is not an attention "
                f"class patch_llama knows (it patches {sorted(c.__name__ for c in accepted)}). Use rope=False"
            )
    return found


def _rebuilt_with_kernel_rotary(fn: types.FunctionType, where: str) -> types.FunctionType:
    """``fn`` with ``apply_rotary_pos_emb`` resolved to ours in its innermost function; the
    decorators' wrappers around it rebuilt (``kernels.hf.wrappers``), so what they do (a renamed
    keyword argument, a warning) still happens."""
    inner = inspect.unwrap(fn)
    namespace = dict(inner.__globals__)
    namespace[_ROTARY_NAME] = apply_rotary
    replacement = types.FunctionType(inner.__code__, namespace, inner.__name__, inner.__defaults__,
                                     inner.__closure__)
    replacement.__kwdefaults__ = inner.__kwdefaults__
    replacement.__qualname__ = inner.__qualname__
    try:
        return rebuilt_around(fn, inner, replacement, f"cannot patch the rotary embedding of {where}")
    except ValueError as err:
        raise ValueError(f"{err}. Use rope=False") from None


@dataclass
class RotarySwap:
    """An attention module given the forward with the kernel's rotary call: where, which, and that
    forward."""

    where: str
    module: torch.nn.Module
    forward: types.MethodType  # the instance-level forward the patch installed
