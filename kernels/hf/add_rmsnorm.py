"""The attention's residual add fused into ``post_attention_layernorm`` (``patch_llama(...,
add_rms_norm=True)``).

``LlamaDecoderLayer.forward`` adds the attention's output to the residual stream and normalises the
sum: ``hidden_states = residual + hidden_states``, then ``self.post_attention_layernorm``. Patched,
each decoder layer computes both with ``kernels.add_rmsnorm.add_rms_norm``: one kernel reads the two
tensors once and writes the sum and its norm, one kernel computes their gradients.

How the layer gets it. In transformers 5.24 the class's forward is wrapped twice:
``deprecate_kwarg`` renames an old keyword, and ``GradientCheckpointingLayer`` puts the checkpoint
around the call (it compares ``type(self).forward`` with itself to find the outermost wrapper, so
that FSDP2's subclass of the layer checkpoints once); in 5.17 the forward is the plain function and
the checkpoint sits in ``GradientCheckpointingLayer.__call__``. The patch gives each layer an
instance-level forward that runs the class's chain of wrappers, whatever it is, rebuilt around the
fused function: each wrapper's code and closure as they are, the cell that held the function below
it pointing at the rebuilt one. Checkpointing, the keyword's renaming and FSDP2's wrapper behave as
before. ``undo()`` deletes the instance attribute.

What it checks before any change: every decoder layer is Llama's (or Mistral's, Qwen2's, Qwen3's,
whose layers compute the same) and its class's forward is statement for statement one that a fused
function reproduces (compared as syntax trees with its parameters, so a transformers version that
changes it is refused rather than guessed at): the forward of 5.24, whose cache argument is named
``cache``, or that of 5.17, where it is ``past_key_values``; each gets the fused function with its
own parameter names. Its ``post_attention_layernorm`` computes Llama's formula (that family's
RMSNorm, or ``TritonRMSNorm`` where the ``rms_norm`` switch swapped it); its forward was not already
replaced on the instance.

Where a call cannot take the kernel (the sum's inputs in two dtypes, as under autocast, where
PyTorch would promote the sum; a dtype the kernel does not take; hooks on the norm; a norm swapped
for another module after the patch) the layer adds and normalises as Hugging Face does.

Only the add inside the layer is fused. The MLP's add at the end of the layer feeds the next
layer's ``input_layernorm``, across the layer boundary: fusing it would change what a layer returns
(the sum, which ``output_hidden_states``, gradient checkpointing, the offloaded checkpoints and
FSDP2's per-layer units all take as the layer's output), so it stays Hugging Face's
(assets/notes/add_rmsnorm.md).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
import types
from collections.abc import Callable

import torch

from kernels.add_rmsnorm import add_rms_norm
from kernels.ops import KERNEL_DTYPES
from kernels.rmsnorm import TritonRMSNorm
from kernels.runtime import INTERPRET

from .wrappers import rebuilt_around

# (modeling module, decoder layer class, its RMSNorm class) of the families whose decoder layer is
# Llama's; those the installed transformers lacks are skipped.
FAMILIES = tuple((f"transformers.models.{path}.modeling_{path}", f"{name}DecoderLayer", f"{name}RMSNorm")
                 for path, name in (("llama", "Llama"), ("mistral", "Mistral"), ("qwen2", "Qwen2"),
                                    ("qwen3", "Qwen3")))

# The body of LlamaDecoderLayer.forward that the fused forwards reproduce, and its parameters with
# their defaults: a class whose forward differs is refused. ``{cache}`` is the name of the cache
# argument, which transformers renamed (``past_key_values`` in 5.17, ``cache`` in 5.24).
_EXPECTED_BODY = """
residual = hidden_states
hidden_states = self.input_layernorm(hidden_states)
hidden_states, _ = self.self_attn(
    hidden_states=hidden_states,
    attention_mask=attention_mask,
    position_ids=position_ids,
    {cache}={cache},
    use_cache=use_cache,
    position_embeddings=position_embeddings,
    **kwargs,
)
hidden_states = residual + hidden_states
residual = hidden_states
hidden_states = self.post_attention_layernorm(hidden_states)
hidden_states = self.mlp(hidden_states)
hidden_states = residual + hidden_states
return hidden_states
"""


def expected_parameters(cache: str) -> tuple[tuple[str, object], ...]:
    """(name, default) of each parameter of the forward the patch reproduces, its cache argument
    named ``cache``.

    Args:
        cache: the name of the cache argument: ``"cache"`` or ``"past_key_values"``.

    Returns:
        ``(name, default)`` pairs in the forward's order, ``inspect.Parameter.empty`` where there is
        no default (``self``, ``hidden_states``, ``**kwargs``).
    """
    return (("self", inspect.Parameter.empty), ("hidden_states", inspect.Parameter.empty), ("attention_mask", None),
            ("position_ids", None), (cache, None), ("use_cache", False), ("position_embeddings", None),
            ("kwargs", inspect.Parameter.empty))


def supported_classes() -> tuple[dict[type, type], frozenset[type]]:
    """The decoder layer classes whose add the patch fuses, each with its family's RMSNorm class, and
    the norms of Llama's formula it reads the weight of, among those the installed transformers has.

    Returns:
        ``({layer class: its RMSNorm class}, {norm classes, TritonRMSNorm included})``.
    """
    global _SUPPORTED
    # Found once, in a plain global rather than functools.cache: each fused forward reads it, and
    # torch.compile traces a global but breaks its graph at a cached function.
    if _SUPPORTED is None:
        layers = {}
        for module_path, layer_name, norm_name in FAMILIES:
            try:
                module = importlib.import_module(module_path)
                layers[getattr(module, layer_name)] = getattr(module, norm_name)
            except (ImportError, AttributeError):  # a transformers version without this family
                continue
        _SUPPORTED = layers, frozenset({TritonRMSNorm, *layers.values()})
    return _SUPPORTED


_SUPPORTED: tuple[dict[type, type], frozenset[type]] | None = None


# --------------------------------------------------------------------------------------------------
# The fused layer
# --------------------------------------------------------------------------------------------------


def takes_kernel(norm: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor) -> bool:
    """Whether ``norm(residual + x)`` may be computed by ``add_rms_norm``: a norm of Llama's formula
    without hooks, and two tensors the kernel adds exactly as PyTorch would.

    Args:
        norm: the layer's ``post_attention_layernorm`` at the time of the call.
        x: the attention's output.
        residual: the residual stream.

    Returns:
        True where the fused kernel gives Hugging Face's answer.
    """
    return (type(norm) in supported_classes()[1]
            and not (norm._forward_hooks or norm._forward_pre_hooks)
            and x.dtype == residual.dtype and x.dtype in KERNEL_DTYPES and norm.weight.dtype in KERNEL_DTYPES
            and x.shape == residual.shape and x.device == residual.device == norm.weight.device
            and (INTERPRET or x.device.type in ("cuda", "meta")))


def add_then_norm(norm: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(residual + x), residual + x)``: one fused kernel where ``takes_kernel`` allows it, else
    Hugging Face's add and the norm module.

    Args:
        norm: the norm of the sum (``post_attention_layernorm``).
        x: what is added to the residual stream.
        residual: the residual stream.

    Returns:
        The normalised sum and the sum.
    """
    if takes_kernel(norm, x, residual):
        return add_rms_norm(x, residual, norm.weight, norm.variance_epsilon)
    h = residual + x
    return norm(h), h


def fused_layer(self, hidden_states, attention_kwargs: dict):
    """The decoder layer's computation with the attention's residual add fused into
    ``post_attention_layernorm``: ``attention_kwargs`` are the keywords the layer passes its
    attention, under the names of the transformers version. Chapter 17
    (``notebooks/17_whole_step.ipynb``) turns it on as ``add_rms_norm=True``.

    Args:
        self: the decoder layer.
        hidden_states: the residual stream entering the layer.
        attention_kwargs: the keywords for ``self.self_attn``, ``hidden_states`` aside.

    Returns:
        The residual stream leaving the layer.
    """
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, **attention_kwargs)
    hidden_states, residual = add_then_norm(self.post_attention_layernorm, hidden_states, residual)
    hidden_states = self.mlp(hidden_states)
    return residual + hidden_states


def fused_decoder_forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None,
                          use_cache=False, position_embeddings=None, **kwargs):
    """``LlamaDecoderLayer.forward`` of transformers 5.24 (cache argument ``cache``) with the
    attention's residual add fused into ``post_attention_layernorm``: the same arguments, the same
    calls, the same result.

    Args:
        self: the decoder layer.
        hidden_states, attention_mask, position_ids, cache, use_cache, position_embeddings, **kwargs:
            those of ``LlamaDecoderLayer.forward``, passed to the attention as it passes them.

    Returns:
        The residual stream leaving the layer, as ``LlamaDecoderLayer.forward`` returns it.
    """
    return fused_layer(self, hidden_states, dict(
        attention_mask=attention_mask, position_ids=position_ids, cache=cache, use_cache=use_cache,
        position_embeddings=position_embeddings, **kwargs))


def fused_decoder_forward_past_key_values(self, hidden_states, attention_mask=None, position_ids=None,
                                          past_key_values=None, use_cache=False, position_embeddings=None,
                                          **kwargs):
    """``LlamaDecoderLayer.forward`` of transformers 5.17 (cache argument ``past_key_values``) with
    the attention's residual add fused into ``post_attention_layernorm``.

    Args:
        self: the decoder layer.
        hidden_states, attention_mask, position_ids, past_key_values, use_cache, position_embeddings,
        **kwargs: those of ``LlamaDecoderLayer.forward``, passed to the attention as it passes them.

    Returns:
        The residual stream leaving the layer, as ``LlamaDecoderLayer.forward`` returns it.
    """
    return fused_layer(self, hidden_states, dict(
        attention_mask=attention_mask, position_ids=position_ids, past_key_values=past_key_values,
        use_cache=use_cache, position_embeddings=position_embeddings, **kwargs))


# The fused forward for each spelling of the cache argument: a layer gets the one whose parameters
# are its own forward's, so callers' keywords reach it unchanged.
FUSED_FORWARDS = {"cache": fused_decoder_forward, "past_key_values": fused_decoder_forward_past_key_values}


def _body_dump(fn) -> list[str] | None:
    """The statements of ``fn``'s body as syntax trees (docstring, comments and layout aside), or
    None where its source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    body = tree.body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return [ast.dump(node) for node in body]


def check_llama_forward(cls: type) -> tuple[types.FunctionType, types.FunctionType]:
    """The function under ``cls.forward``'s wrappers and the fused forward that replaces it, after
    checking that it is the forward that one reproduces; a ValueError saying what differs otherwise.

    Args:
        cls: the decoder layer's class.

    Returns:
        ``(inner, fused)``: the innermost forward function (what the wrappers of ``cls.forward`` end
        in) and its entry of ``FUSED_FORWARDS``.
    """
    inner = inspect.unwrap(cls.forward)
    parameters = tuple((p.name, p.default) for p in inspect.signature(inner).parameters.values())
    body = _body_dump(inner)
    for cache, fused in FUSED_FORWARDS.items():
        expected = [ast.dump(node) for node in ast.parse(_EXPECTED_BODY.format(cache=cache)).body]
        if parameters == expected_parameters(cache) and body == expected:
            return inner, fused
    raise ValueError(
        f"{cls.__name__}.forward is not the forward this patch reproduces with the add fused (a transformers "
        "version whose decoder layer computes something else, or that cannot be read): use add_rms_norm=False"
    )


class _FusedForwards:
    """The fused forward of each class a patched layer has, rebuilt once per class: FSDP2 turns a
    layer into an instance of a subclass of its own, whose forward adds one wrapper."""

    def __init__(self, checked: dict[types.FunctionType, types.FunctionType]):
        self.checked = checked  # the innermost forwards check_llama_forward accepted, each with its fused one
        self.by_class: dict[type, types.FunctionType] = {}

    def __call__(self, cls: type):
        forward = self.by_class.get(cls)
        if forward is None:
            inner = inspect.unwrap(cls.forward)
            try:
                if inner not in self.checked:
                    raise ValueError(f"{cls.__name__}.forward ends in a function that was not checked")
                forward = rebuilt_around(cls.forward, inner, self.checked[inner],
                                         f"cannot fuse the add into {cls.__name__}.forward")
            except ValueError:  # a subclass whose forward does not end in the checked one: left as it is
                forward = cls.forward
            self.by_class[cls] = forward
        return forward


def _instance_forward(fused: _FusedForwards):
    def forward(self, *args, **kwargs):
        return fused(type(self))(self, *args, **kwargs)

    forward.__doc__ = "The decoder layer's forward with the attention's residual add fused into its norm (patch_llama)."
    forward.fuses_residual_add = True
    return forward


# --------------------------------------------------------------------------------------------------
# What patch_llama's switch finds and changes
# --------------------------------------------------------------------------------------------------


def find_decoder_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(qualified name, layer) of every decoder layer whose add can be fused; a ValueError naming the
    first that cannot, before any change.

    Args:
        model: the Hugging Face model.

    Returns:
        The layers, in model order (at least one).
    """
    layers, _ = supported_classes()
    found = []
    for where, module in model.named_modules():
        cls = type(module)
        if cls not in layers:
            if cls.__name__.endswith("DecoderLayer"):
                raise ValueError(
                    f"cannot fuse the residual add of {where}: {cls.__module__}.{cls.__name__} is not a decoder "
                    f"layer whose forward this patch reproduces (it fuses {sorted(c.__name__ for c in layers)})")
            continue
        check_llama_forward(cls)
        norm = getattr(module, "post_attention_layernorm", None)
        if type(norm) not in (layers[cls], TritonRMSNorm):
            raise ValueError(f"cannot fuse the residual add of {where}: its post_attention_layernorm is "
                             f"{type(norm).__name__}, not {layers[cls].__name__} or TritonRMSNorm")
        if "forward" in module.__dict__:
            raise ValueError(f"cannot fuse the residual add of {where}: its forward was already replaced on the "
                             "instance (by another patch, or accelerate's hooks). Use add_rms_norm=False")
        found.append((where, module))
    if not found:
        raise ValueError(f"{type(model).__name__} has no decoder layer of Llama's kind: add_rms_norm has nothing "
                         "to fuse")
    return found


def fuse_residual_adds(layers: list[tuple[str, torch.nn.Module]]) -> tuple[Callable[[], None], Callable[[], None]]:
    """Give each layer of ``layers`` (from ``find_decoder_layers``) the fused forward.

    Args:
        layers: (qualified name, layer) pairs.

    Returns:
        ``(undo, check)``: ``undo()`` deletes each instance-level forward; ``check()`` raises,
        changing nothing, where one was replaced since the patch.
    """
    fused = _FusedForwards(dict(check_llama_forward(type(layer)) for _, layer in layers))
    for _, layer in layers:
        fused(type(layer))  # rebuilt now: under torch.compile a first call would break the graph there
    forward = _instance_forward(fused)
    done = []
    for where, layer in layers:
        layer.forward = types.MethodType(forward, layer)
        done.append((where, layer, layer.forward))

    def check() -> None:
        for where, layer, installed in done:
            if layer.__dict__.get("forward") is not installed:
                raise RuntimeError(f"cannot undo: the forward of {where} was replaced after the patch")

    def undo() -> None:
        for _, layer, _ in done:
            del layer.forward  # the class's forward is seen again

    return undo, check


def fused_layers(model: torch.nn.Module) -> list[str]:
    """Qualified names of the decoder layers of ``model`` that run the fused forward now.

    Args:
        model: the Hugging Face model.

    Returns:
        The names, in model order.
    """
    return [where for where, module in model.named_modules()
            if getattr(getattr(module.__dict__.get("forward"), "__func__", None), "fuses_residual_add", False)]


def describe(model: torch.nn.Module) -> str:
    """The switch's part of ``summary()``.

    Args:
        model: the patched model.

    Returns:
        One phrase: how many layers fuse the add, or that none does.
    """
    names: dict[str, int] = {}
    for where in fused_layers(model):
        name = type(model.get_submodule(where)).__name__
        names[name] = names.get(name, 0) + 1
    if not names:
        return "residual add: Hugging Face's"
    return f"residual add fused into post_attention_layernorm in {', '.join(f'{n} {c}' for c, n in names.items())}"
