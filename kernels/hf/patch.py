"""Put the workbook's kernels into a Hugging Face model: module surgery on one model, undoable.

``patch_llama(model)`` changes one model object, and nothing else. Each change below is one switch,
an entry of ``SWITCH_TABLE`` named as in ``SWITCHES``; ``patch_llama(model)`` turns on those of
``DEFAULT_KERNELS`` that apply to the model, and ``lora`` and ``attention`` where they do (below);
``patch_llama(model, kernels=("rms_norm", "cross_entropy"))`` turns on exactly the ones named.
Chapter 08 derives the first two, chapters 09 to 16 the rest:

* **RMSNorm** (``rms_norm``). Every norm module whose formula is Llama's, ``weight * (x /
  rms(x)).to(x.dtype)``, is replaced by a ``TritonRMSNorm`` that shares its weight ``Parameter``.
  First every norm is found (parent module, attribute name, module) and checked, then each is
  swapped with ``setattr(parent, name, new)``. Because the Parameter is the same object, the
  optimizer (even one created before the patch), weight tying and the ``state_dict`` keys are
  unchanged. Accepted classes: ``LlamaRMSNorm``, ``MistralRMSNorm``, ``Qwen2RMSNorm``,
  ``Qwen3RMSNorm`` (including Qwen3's per-head ``q_norm``/``k_norm``, which normalise over head_dim
  on [batch, seq, heads, head_dim] tensors). Gemma's norms compute ``x / rms(x) * (1 + weight)`` in
  float32 and are refused, as is any other class whose name contains "RMSNorm": a kernel that
  computes a slightly different formula would train a slightly different model.
* **The loss** (``cross_entropy``). ``model.loss_function`` (Hugging Face's ``ForCausalLMLoss``) is
  replaced, through the setter ``PreTrainedModel`` provides, by ``causal_lm_loss``: the same label
  shift (labels padded with ``ignore_index`` on the right and their first position dropped), the
  same ``ignore_index=-100``, the same ``num_items_in_batch`` rule (a sum divided by it under
  gradient accumulation, else a mean), computed by the fused Triton cross-entropy without the
  float32 copy of the logits and without a host synchronisation (``check_targets=False``: a label
  outside the vocabulary gives a NaN loss instead of an exception).
* **The logits, in training.** While the model is in train mode with autograd on, the loss writes
  the gradient of the logits over the logits themselves (``inplace_backward=True``): no [tokens,
  vocab] gradient buffer is ever allocated. The logits tensor then holds the gradient, so the
  patched ``forward`` returns ``logits=None`` rather than hand out a tensor that no longer holds
  logits. To get logits: call the model in eval mode (``model.eval()``) or under
  ``torch.no_grad()``, or patch with ``inplace_logits=False`` (the loss then allocates a separate
  gradient buffer, as any loss does, and the logits are returned).

* **The loss without the logits** (``linear_cross_entropy``, off by default: the memory switch). In
  train mode with autograd on and labels given, the LM head does not compute logits at all: its
  forward (patched on that one ``nn.Linear``) hands the hidden states through, and the loss computes
  the cross-entropy of ``hidden @ lm_head.weight.T`` slice by slice
  (``kernels.linear_cross_entropy``), so no [tokens, vocab] tensor ever exists. The output's
  ``logits`` is None. In eval mode, under ``no_grad`` or without labels the head computes logits as
  usual (and the loss uses the fused cross-entropy, or Hugging Face's with ``cross_entropy=False``).
  Tied embeddings work (the shared weight receives both gradients); an LM head that is not a plain
  ``nn.Linear`` without bias (LoRA on the head) is refused. PEFT's ``modules_to_save=["lm_head"]``
  trains a copy of the head, in either order of wrapping and patching: the loss takes the weight of
  whichever head the wrapper ran.
* **The MLP activation** (``swiglu``). Every ``LlamaMLP``, ``MistralMLP``, ``Qwen2MLP``,
  ``Qwen3MLP`` whose activation is SiLU is replaced by a ``TritonSwiGLUMLP`` that holds the very
  same ``gate_proj``, ``up_proj`` and ``down_proj`` submodules (so parameter names, the optimizer
  and PEFT adapter layers inside the projections are unchanged) and computes
  ``down_proj(swiglu(gate_proj(x), up_proj(x)))``. Any other activation (``hidden_act`` not
  ``"silu"``) or any other class whose name ends in "MLP" is refused.
* **The rotary embedding** (``rope``). The attention modules of these families call their modeling
  file's module-level ``apply_rotary_pos_emb`` by name, so the function cannot be swapped on one
  model by setting an attribute, and replacing it in the modeling module would change every model of
  the process (and the reference beside it). Instead each ``LlamaAttention`` (``Mistral…``,
  ``Qwen2…``, ``Qwen3…``) of this model gets an instance-level ``forward``: the class's own forward
  function, rebuilt over a copy of its module's globals in which ``apply_rotary_pos_emb`` is
  ``kernels.rope.apply_rotary``. Same code, same arguments, one name resolved differently, for these
  module objects only; ``undo()`` deletes the instance attribute and the class's forward is seen
  again. A forward wrapped by a decorator that keeps the function it wraps (``functools.wraps``, as
  transformers' ``deprecate_kwarg`` does) keeps its wrapper, rebuilt around the rebuilt function.
  Refused: an attention class the patch does not know, a forward that does not call
  ``apply_rotary_pos_emb`` by name (through such wrappers), a rotary function whose signature is not
  ``(q, k, cos, sin, unsqueeze_dim)``, and a module whose forward was already replaced on the
  instance (e.g. by accelerate's hooks). The code: ``kernels.hf.rotary``.

* **LoRA** (``lora``, chapter 15). Each PEFT ``lora.Linear`` computes its base layer and adapter as
  one fused node (``kernels.hf.lora``, ``kernels.lora``), in either order of wrapping and patching:
  on by default wherever peft is installed, it fuses the layers there at the patch and, through a
  hook on the decoder, those PEFT puts in later (``get_peft_model``, TRL's ``peft_config``,
  ``add_adapter``). ``handle.kernels`` lists it once the model holds LoRA layers; a model that never
  gets any is left as it was. What stays PEFT's is named in ``handle.left_off["lora"]`` with the
  reason.

* **The frozen base in FP8** (``fp8_base``, off by default, chapter 18). On a PEFT LoRA model,
  each frozen linear but the LM head is stored in FP8 (``kernels.hf.fp8_base``), and the fused LoRA
  layers run their base GEMMs in FP8 (``kernels.lora_fp8``). One-way: ``undo()`` leaves the FP8
  base in place; reload the model for bf16.

* **The padding mask** (``additive_mask``). Where a batch needs its mask, SDPA attention receives it
  as one additive bias in the model's dtype, built once per forward pass, instead of a boolean mask
  that every attention call copies into such a bias and keeps for its backward
  (``kernels.hf.attention_mask``).

* **The causal mask under torch.compile** (``skip_causal_mask``). Compiled, transformers builds a
  full [seq, seq] mask even for a batch without padding, and attention with a mask repeats the
  key/value heads and runs the masked kernel. The patched forward marks a call without mask,
  position ids or cache as plain causal, and the mask function then returns None, so SDPA runs with
  ``is_causal`` as it does eagerly (``kernels.hf.attention_mask``). Eagerly it changes nothing.

Which kernels are on by default, and the measurement behind each choice:
``assets/notes/patch_defaults.md``.

Why surgery on one model rather than editing Hugging Face's source or replacing
``LlamaRMSNorm.forward`` on the class for the whole process: the change is scoped to the model you
pass (a reference model next to it stays untouched, which is how the workbook compares the two), it
can be undone exactly, and it keeps every Parameter where it was. The handle's ``undo()`` puts the
original modules, loss function and forward back (``with patch_llama(model): ...`` undoes on leaving
the block). Do not ``copy.deepcopy`` a patched model: the copy's patched forward would still call
the original model; undo, copy, and patch each.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import numbers
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels.cross_entropy import cross_entropy as fused_cross_entropy
from kernels.linear_cross_entropy import linear_cross_entropy as fused_linear_cross_entropy
from kernels.rmsnorm import TritonRMSNorm
from kernels.swiglu import TritonSwiGLUMLP, may_overwrite

from .add_rmsnorm import describe as describe_fused_adds
from .add_rmsnorm import find_decoder_layers, fuse_residual_adds
from .attention import attention_choice, check_attention, use_flash_attention
from .attention_mask import CAUSAL_CALL, check_sdpa, is_plain_causal_call, use_mask_function
from .fp8_base import check_fp8_base, convert_base
from .fp8_base import describe as describe_fp8_base
from .lora import check_lora, enable_lora_fusion, has_lora_layers, lora_can_follow
from .offload import check_offloadable, enable_checkpoint_offload
from .rotary import RotarySwap, find_attention
from .tiled_mlp import TiledSwiGLUMLP, check_tileable

IGNORE_INDEX = -100

# (module path, class name) of the norms whose formula is Llama's: x · rsqrt(mean(x²) + eps) in
# float32, cast to the input dtype, then multiplied by the weight. Classes the installed
# transformers lacks are skipped.
SAME_FORMULA = (
    ("transformers.models.llama.modeling_llama", "LlamaRMSNorm"),
    ("transformers.models.mistral.modeling_mistral", "MistralRMSNorm"),
    ("transformers.models.qwen2.modeling_qwen2", "Qwen2RMSNorm"),
    ("transformers.models.qwen3.modeling_qwen3", "Qwen3RMSNorm"),
)

# (module path, class name) of the gated MLPs (down(act(gate(x)) * up(x))) and attention modules (q
# and k rotated by the modeling file's apply_rotary_pos_emb(q, k, cos, sin)) whose code patch_llama
# knows.
SUPPORTED_MLPS = tuple((path, f"{family}MLP") for path, family in (
    ("transformers.models.llama.modeling_llama", "Llama"), ("transformers.models.mistral.modeling_mistral", "Mistral"),
    ("transformers.models.qwen2.modeling_qwen2", "Qwen2"), ("transformers.models.qwen3.modeling_qwen3", "Qwen3"),
))
SUPPORTED_ATTENTION = tuple((path, name.replace("MLP", "Attention")) for path, name in SUPPORTED_MLPS)

# Norms that look alike but compute something else, by class name, with what differs.
_GEMMA = (
    "it computes (x / rms(x)) · (1 + weight) in float32 and casts the product, whereas Llama's norm "
    "computes "
    "weight · (x / rms(x)) cast to the input dtype first; its weight is stored as an offset from 1 "
    "(zeros at "
    "initialisation), so TritonRMSNorm would scale by w instead of 1 + w"
)
DIFFERENT_FORMULA = {"GemmaRMSNorm": _GEMMA, "Gemma2RMSNorm": _GEMMA, "Gemma3RMSNorm": _GEMMA}


def supported_norm_classes() -> dict[str, type]:
    """The RMSNorm classes ``patch_llama`` replaces, by name, among those the installed transformers
    has.

    Returns:
        {class name: class} of ``SAME_FORMULA``'s classes that import.
    """
    return _classes(SAME_FORMULA)


def _classes(table) -> dict[str, type]:
    found = {}
    for module_path, name in table:
        try:
            found[name] = getattr(importlib.import_module(module_path), name)
        except (ImportError, AttributeError):  # a transformers version without this model family
            continue
    return found


# --------------------------------------------------------------------------------------------------
# The loss
# --------------------------------------------------------------------------------------------------


def shift_labels_like_hf(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Shift labels as Hugging Face does: position t predicts token t + 1 (chapter 08).

    The labels are padded with ``ignore_index`` on the right and their first position dropped. The
    result has the labels' shape, so it lines up with the logits row for row and the logits are
    never sliced (a slice of the logits would make autograd allocate a full-size zero gradient for
    them).

    Args:
        labels: token ids, [..., seq].
        ignore_index: the id of a target that does not count.

    Returns:
        The shifted labels, of ``labels``' shape and dtype.
    """
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


# The logits' dtypes the fused losses compute (in float32 registers). float64 is refused, as by
# every kernel.
LOSS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_label_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor of token ids, got {type(t).__name__}")
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise TypeError(f"{name} must hold integer token ids (any integer dtype, e.g. torch.int64), got dtype {t.dtype}")


def loss_targets(labels, shift_labels, lead: tuple, ignore_index, device, where: str) -> torch.Tensor:
    """The int64 targets of the causal-LM loss, checked (chapter 08).

    ``labels`` must have the shape ``lead`` ([batch, seq], as input_ids): the shift runs along their
    last dimension, so labels of another shape with as many elements (transposed, flattened across
    sequences) would pair tokens with the wrong positions without an error. ``shift_labels`` may
    also be flat (``lead``'s rows in order). Labels of any integer dtype are read as int64 *before*
    the shift: its padding value ``ignore_index`` (-100) does not fit uint8, and int8 or int16 would
    wrap ids; bool and floating labels are refused.

    Args:
        labels: token ids to shift as Hugging Face shifts them, or None when ``shift_labels`` is
            given.
        shift_labels: targets already shifted, or None.
        lead: the logits' (or hidden states') leading dimensions, one target per row.
        ignore_index: the id of a target that does not count (an integer).
        device: where the targets go.
        where: the caller's name, for the error messages.

    Returns:
        The targets, int64, of shape ``lead``, on ``device``.
    """
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"ignore_index must be an integer, got {ignore_index!r}")
    ignore_index = int(ignore_index)
    lead = tuple(lead)
    if shift_labels is None:
        if labels is None:
            raise ValueError(f"{where} needs labels or shift_labels, got neither")
        _check_label_tensor("labels", labels)
        if tuple(labels.shape) != lead:
            raise ValueError(
                f"labels must have the shape of the logits without their last dimension, {lead} (that of "
                f"input_ids), got {tuple(labels.shape)}: the shift by one runs along the last dimension"
            )
        targets = shift_labels_like_hf(labels.long(), ignore_index)
    else:
        _check_label_tensor("shift_labels", shift_labels)
        if tuple(shift_labels.shape) != lead and not (shift_labels.dim() == 1 and shift_labels.numel() == math.prod(lead)):
            raise ValueError(
                f"shift_labels must have the shape of the logits without their last dimension, {lead}, "
                "or be those "
                f"{math.prod(lead)} targets flattened, got {tuple(shift_labels.shape)}"
            )
        targets = shift_labels.long()
    return targets.to(device).reshape(lead)


def shaped_like_hf(loss: torch.Tensor, num_items_in_batch) -> torch.Tensor:
    """The loss in the shape Hugging Face's has (a view: no copy, no synchronisation).

    Hugging Face's ``sum / num_items_in_batch`` broadcasts, so a one-element tensor of shape [1] (as
    some trainers pass) gives a loss of shape [1].

    Args:
        loss: the scalar loss.
        num_items_in_batch: what the caller passed (None, an int or a tensor).

    Returns:
        ``loss``, reshaped to ``num_items_in_batch``'s shape where that is a tensor of one or more
        dimensions.
    """
    if isinstance(num_items_in_batch, torch.Tensor) and num_items_in_batch.dim() > 0:
        return loss.reshape(num_items_in_batch.shape)
    return loss


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    vocab_size: int,
    num_items_in_batch=None,
    ignore_index: int = IGNORE_INDEX,
    shift_labels: torch.Tensor | None = None,
    *,
    inplace_backward: bool = False,
    **kwargs,
) -> torch.Tensor:
    """Hugging Face's ``ForCausalLMLoss``, computed by the fused Triton cross-entropy (chapter 08).

    Differences from Hugging Face's: the logits are not copied to float32 (the kernel computes in
    float32 anyway), labels are not range-checked on the host (an out-of-range label gives NaN), and
    with ``inplace_backward=True`` the logits are overwritten by their gradient
    (``kernels.cross_entropy``). Stricter (``loss_targets``): labels must have the logits' leading
    shape; labels of any integer dtype give the int64 labels' loss; float64 logits are refused.

    Args:
        logits: [..., vocab_size], float32, bfloat16 or float16.
        labels: token ids, shifted here unless ``shift_labels`` is given.
        vocab_size: the logits' last dimension.
        num_items_in_batch: under gradient accumulation, the number of counted labels over all
            micro-batches of the step: the loss is then the sum divided by it; None: the mean over
            counted labels.
        ignore_index: targets equal to it do not count.
        shift_labels: targets already shifted, or None.
        inplace_backward: write the logits' gradient over the logits.
        **kwargs: what Hugging Face passes along (attention flags and the like), ignored as
            ``ForCausalLMLoss`` ignores it.

    Returns:
        The loss, in the shape Hugging Face's has (``shaped_like_hf``).
    """
    if logits.dtype not in LOSS_DTYPES:
        raise TypeError(
            "logits must be float32, bfloat16 or float16 for the fused loss, got dtype "
            f"{logits.dtype}: it computes in "
            "float32. Run the model in float32 (model.float()), or patch it with cross_entropy=False "
            "to keep Hugging "
            "Face's loss"
        )
    if logits.shape[-1] != vocab_size:
        raise ValueError(f"logits must have vocab_size={vocab_size} classes in their last dimension, got shape {tuple(logits.shape)}")
    target = loss_targets(labels, shift_labels, logits.shape[:-1], ignore_index, logits.device, "causal_lm_loss")
    ignore_index = int(ignore_index)
    if num_items_in_batch is not None:
        reduction, normalizer = "sum", num_items_in_batch
    else:
        reduction, normalizer = "mean", None
    # No reshape of the logits: the kernel reads any leading dimensions in place, so a [batch, seq,
    # vocab] tensor is never copied (and, in place, its own memory receives the gradient).
    loss = fused_cross_entropy(
        logits, target, ignore_index, reduction, normalizer=normalizer,
        inplace_backward=inplace_backward, check_targets=False,
    )
    return shaped_like_hf(loss, num_items_in_batch)


def causal_lm_linear_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor | None,
    num_items_in_batch=None,
    ignore_index: int = IGNORE_INDEX,
    shift_labels: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """``causal_lm_loss`` of the logits ``hidden @ weight.T``, computed without them (chapter 10).

    Same label shift, ``ignore_index`` and ``num_items_in_batch`` rule as Hugging Face's
    ``ForCausalLMLoss``, by ``kernels.linear_cross_entropy``; no host synchronisation (an
    out-of-range label gives NaN). Labels are checked as ``causal_lm_loss`` checks them
    (``loss_targets``).

    Args:
        hidden: what the LM head would have received, [..., hidden].
        weight: the LM head's weight, [vocab, hidden].
        labels, num_items_in_batch, ignore_index, shift_labels, **kwargs: as for ``causal_lm_loss``.

    Returns:
        The loss, in the shape Hugging Face's has.
    """
    if hidden.dtype not in LOSS_DTYPES:
        raise TypeError(
            "hidden must be float32, bfloat16 or float16 for the fused loss, got dtype "
            f"{hidden.dtype}: it computes "
            "in float32. Run the model in float32 (model.float()), or patch it with "
            "linear_cross_entropy=False"
        )
    target = loss_targets(labels, shift_labels, hidden.shape[:-1], ignore_index, hidden.device,
                          "causal_lm_linear_loss")
    ignore_index = int(ignore_index)
    if num_items_in_batch is not None:
        reduction, normalizer = "sum", num_items_in_batch
    else:
        reduction, normalizer = "mean", None
    loss = fused_linear_cross_entropy(hidden, weight, target, ignore_index, reduction, normalizer=normalizer,
                                      check_targets=False)
    return shaped_like_hf(loss, num_items_in_batch)


class _PatchedLoss:
    """``model.loss_function`` while patched: the fused cross-entropy of the logits (in place
    exactly when that is safe and useful), or, when the LM head deferred them, the linear
    cross-entropy of its input."""

    def __init__(self, model: torch.nn.Module, inplace_logits: bool, cross_entropy: bool = True,
                 head: torch.nn.Module | None = None):
        self.model = model
        self.inplace_logits = inplace_logits
        self.cross_entropy = cross_entropy  # False: logits that do reach the loss go to the model's own loss
        self.original = model.loss_function  # that loss (Hugging Face's), read before the patch replaces it
        self.head = head  # the LM head whose logits may be deferred (linear_cross_entropy), else None
        self.consumed: torch.Tensor | None = None  # the tensor in the output's logits that holds no logits
        self.defer = False  # set by the patched forward: the head hands its input through instead of logits
        self.deferred: torch.Tensor | None = None  # what the head handed through
        # Which head handed it through: the patched head, or a copy of it (PEFT's modules_to_save
        # trains a copy of the head; its forward, copied with it, is bound to the copy). The loss
        # takes that head's weight.
        self.deferred_by: torch.nn.Module | None = None

    def __call__(self, logits, labels, vocab_size, **kwargs):
        if self.deferred is not None and logits is self.deferred:
            self.consumed = logits
            return causal_lm_linear_loss(logits, self.deferred_by.weight, labels, **kwargs)
        if self.defer:
            raise RuntimeError(
                "the LM head's input did not reach the loss unchanged (something wraps lm_head since "
                "the patch, "
                "e.g. an adapter): patch with linear_cross_entropy=False"
            )
        if not self.cross_entropy:
            return self.original(logits, labels, vocab_size, **kwargs)
        # In place only in training with autograd on: then the logits exist for the loss alone and
        # nothing reads them afterwards. In eval mode or under no_grad the kernel computes no
        # gradient at all. Never into a leaf or a view of one: logits a caller passes to
        # model.loss_function themselves are theirs. Under torch.compile (which cannot read grad_fn)
        # the logits are the traced LM head's output, never a leaf.
        inplace = (self.inplace_logits and self.model.training and torch.is_grad_enabled() and logits.requires_grad
                   and (torch.compiler.is_compiling() or may_overwrite(logits)))
        loss = causal_lm_loss(logits, labels, vocab_size, inplace_backward=inplace, **kwargs)
        if inplace:
            self.consumed = logits
        return loss

    def __repr__(self) -> str:
        parts = []
        if self.head is not None:
            parts.append("linear cross-entropy without logits in training")
        parts.append(f"Triton cross-entropy, inplace_logits={self.inplace_logits}" if self.cross_entropy
                     else "Hugging Face's loss on logits")
        return f"causal_lm_loss({'; '.join(parts)})"


def _deferring_head_forward(head: torch.nn.Linear, loss: _PatchedLoss):
    """An instance-level forward for the LM head: while ``loss.defer`` is set, hand the hidden
    states through.

    A bound method, not a closure over the head: a deep copy of the head (PEFT's ``modules_to_save``
    trains one) gets it bound to the copy, which then defers with its own weight instead of
    computing the original's logits."""

    inner = head.forward  # the class's forward, or an instance-level one already there (a device hook's)

    def logits(self, hidden_states):
        return inner(hidden_states) if self is head else torch.nn.Linear.forward(self, hidden_states)

    def forward(self, hidden_states):
        if loss.defer:
            loss.deferred, loss.deferred_by = hidden_states, self
            return hidden_states
        return logits(self, hidden_states)

    forward.logits = logits
    return types.MethodType(forward, head)


def _check_head(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The LM heads whose forward defers the logits: the model's head, or, where PEFT's
    ``modules_to_save`` wraps it (``ModulesToSaveWrapper``), the original head and each adapter's
    trainable copy, whichever the wrapper runs."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    heads = [head]
    if type(head).__name__ == "ModulesToSaveWrapper" and hasattr(head, "original_module"):
        heads = [head.original_module, *head.modules_to_save.values()]
    for h in heads:
        if type(h) is not torch.nn.Linear or h.bias is not None:
            raise TypeError(
                "linear_cross_entropy=True needs an LM head that is a plain nn.Linear without bias "
                "(or PEFT's "
                f"modules_to_save copies of one), got {type(h).__name__ if h is not None else 'none'} "
                "(an adapter "
                "on the head, e.g. LoRA, computes something else): use linear_cross_entropy=False"
            )
    return heads


def _with_logits(output, hidden: torch.Tensor, head: torch.nn.Module):
    """The model's output with the hidden states ``head`` handed through replaced by their logits.
    """
    logits = head.forward.__func__.logits(head, hidden)
    if dataclasses.is_dataclass(output) and getattr(output, "logits", None) is hidden:
        return dataclasses.replace(output, logits=logits)
    if isinstance(output, tuple):
        return tuple(logits if item is hidden else item for item in output)
    return output


def _without_consumed_logits(output, consumed: torch.Tensor):
    """The model's output with the overwritten logits replaced by None (a ModelOutput or a tuple).
    """
    if dataclasses.is_dataclass(output) and getattr(output, "logits", None) is consumed:
        # A new output object: setting ``output.logits = None`` would leave the tensor in the
        # ModelOutput's dict.
        return dataclasses.replace(output, logits=None)
    if isinstance(output, tuple):
        return tuple(None if item is consumed else item for item in output)
    return output


# --------------------------------------------------------------------------------------------------
# The MLP activation (the rotary embedding: kernels.hf.rotary)
# --------------------------------------------------------------------------------------------------

def _where(parent_name: str, name: str) -> str:
    return f"{parent_name + '.' if parent_name else ''}{name}"


def _find_mlps(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str, torch.nn.Module]]:
    """(qualified name, parent, attribute name, module) of every gated SiLU MLP; raises before
    anything changes."""
    accepted = set(_classes(SUPPORTED_MLPS).values())
    found = []
    for parent_name, parent in model.named_modules():
        for name, child in parent.named_children():
            cls, where = type(child), _where(parent_name, name)
            if cls in accepted:
                act = getattr(getattr(child, "config", None), "hidden_act", None)
                if act not in ("silu", "swish"):
                    raise ValueError(
                        f"cannot replace {where} ({cls.__name__}): its activation is "
                        f"hidden_act={act!r}, and the "
                        "fused kernel computes silu(gate) * up. Use swiglu=False"
                    )
                found.append((where, parent, name, child))
            elif cls.__name__.endswith("MLP") and cls is not TritonSwiGLUMLP:
                raise ValueError(
                    f"cannot replace {where}: {cls.__module__}.{cls.__name__} is not an MLP whose code "
                    "patch_llama "
                    f"knows (it replaces {sorted(c.__name__ for c in accepted)}); it refuses rather "
                    "than guess. "
                    "Use swiglu=False"
                )
    return found


def _tileable_mlps(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str, torch.nn.Module]]:
    """``_find_mlps``, each also checked for the tiled MLP (plain bias-free ``nn.Linear``
    projections: a LoRA-wrapped projection keeps Hugging Face's MLP)."""
    mlps = _found(_find_mlps(model), f"{type(model).__name__} has no MLP patch_llama knows: tiled_mlp has nothing "
                                     "to replace")
    for where, _, _, module in mlps:
        check_tileable(module, where)
    return mlps


def _count(names) -> str:
    """"2 LlamaMLP, 1 X" from an iterable of class names, in first-seen order."""
    counts: dict[str, int] = {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{n} {name}" for name, n in counts.items())


# --------------------------------------------------------------------------------------------------
# The patch and its handle
# --------------------------------------------------------------------------------------------------


@dataclass
class _Swap:
    where: str  # the module's qualified name, e.g. "model.layers.0.input_layernorm"
    parent: torch.nn.Module
    name: str
    original: torch.nn.Module
    replacement: torch.nn.Module


def _carry_new_children(replacement: torch.nn.Module, original: torch.nn.Module) -> None:
    """Give ``original`` the submodules put into ``replacement`` since the patch. A replacement
    shares the original's submodules (``TritonSwiGLUMLP`` keeps the very same projections), so a
    submodule that differs now was swapped in later: PEFT, wrapping a patched model, puts its LoRA
    layers there. Putting back the original without them would silently drop those adapters, weights
    and all."""
    for name, child in replacement._modules.items():
        if name in original._modules and original._modules[name] is not child:
            setattr(original, name, child)


@dataclass
class _Undo:
    """How one switch's change is taken back: ``check()`` raises, changing nothing, where it cannot
    be; ``run()``."""

    run: Callable[[], None]
    check: Callable[[], None] = lambda: None


def _chain(*steps) -> _Undo:
    """One ``_Undo`` of several (callables, ``_Undo``s or None), run in reverse order, every check
    first."""
    steps = [s if isinstance(s, _Undo) else _Undo(s) for s in steps if s is not None]

    def run() -> None:
        for step in reversed(steps):
            step.run()

    def check() -> None:
        for step in steps:
            step.check()

    return _Undo(run, check)


@dataclass(repr=False)
class LlamaPatch:
    """What ``patch_llama`` changed, and how to change it back (``undo()``; also a context manager).
    """

    model: torch.nn.Module
    turned_on: tuple[str, ...] = ()  # the switches applied at the patch, in SWITCHES' order
    refused: dict[str, str] = field(default_factory=dict)  # "auto": each switch left off at the patch, why
    undos: list[tuple[str, _Undo]] = field(default_factory=list)  # (switch, its undo), in the order applied
    active: bool = True
    # What the switches changed, for the caller and summary():
    swaps: list[_Swap] = field(default_factory=list)  # rms_norm
    mlp_swaps: list[_Swap] = field(default_factory=list)  # swiglu or tiled_mlp
    rotary: list[RotarySwap] = field(default_factory=list)  # rope
    loss: _PatchedLoss | None = None  # cross_entropy, linear_cross_entropy
    head: torch.nn.Module | None = None  # the LM head whose forward defers the logits (linear_cross_entropy)
    forward_wrapped: bool = False  # the model's forward is the patch's (the loss, or skip_causal_mask)
    mask: str = ""  # what the patched mask function does (additive_mask, skip_causal_mask)
    offload: object = None  # the CheckpointOffload handle (offload_checkpoints)
    lora: object = None  # the LoraFusion handle (lora): PEFT's LoRA layers fused (kernels.hf.lora)
    attention: str = ""  # which attention runs, and why (kernels.hf.attention.attention_choice)

    @property
    def kernels(self) -> tuple[str, ...]:
        """The switches turned on, by name, in SWITCHES' order (``lora`` once the model holds LoRA
        layers)."""
        return tuple(s.name for s in SWITCH_TABLE
                     if s.name in self.turned_on or (s.status is not None and s.status(self)[0]))

    @property
    def left_off(self) -> dict[str, str]:
        """Each switch left off and why; ``"lora"``: the LoRA layers found so far that stay PEFT's,
        and why."""
        live = {s.name: s.status(self)[1] for s in SWITCH_TABLE if s.status is not None}
        return {**self.refused, **{name: why for name, why in live.items() if why}}

    def summary(self) -> str:
        """One line: what each switch replaced or left as it was, in the table's order.

        Chapter 08 (``notebooks/08_training_loop.ipynb``) prints it after each patch.

        Returns:
            The switches' descriptions joined by ``"; "``, ending in ``" [undone]"`` after
            ``undo()``.
        """
        parts = [part for s in SWITCH_TABLE if s.describe is not None and (part := s.describe(self))]
        return "; ".join(parts) + ("" if self.active else " [undone]")

    @property
    def replaced(self) -> list[str]:
        """Qualified names of the replaced norm modules, in model order."""
        return [swap.where for swap in self.swaps]

    def undo(self) -> None:
        """Take back every switch, the last applied first; every check first. A second call does
        nothing."""
        if not self.active:
            return
        for _, step in self.undos:
            step.check()
        for _, step in reversed(self.undos):
            step.run()
        self.model.__dict__.pop("_kernels_patch", None)
        self.active = False

    def __repr__(self) -> str:
        return f"LlamaPatch({self.summary()})"

    def __enter__(self) -> "LlamaPatch":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


def _find_norms(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str, torch.nn.Module]]:
    """(qualified name, parent, attribute name, module) of every norm to replace; raises before
    anything changes."""
    accepted = set(supported_norm_classes().values())
    found = []
    for parent_name, parent in model.named_modules():
        for name, child in parent.named_children():
            cls = type(child)
            where = f"{parent_name + '.' if parent_name else ''}{name}"
            if cls in accepted:
                found.append((where, parent, name, child))
                continue
            if cls.__name__ in DIFFERENT_FORMULA:
                raise ValueError(
                    f"cannot replace {where} ({cls.__name__}): {DIFFERENT_FORMULA[cls.__name__]}. "
                    "patch_llama "
                    "supports the norms of Llama, Mistral, Qwen2 and Qwen3; leave the norms alone "
                    "with rms_norm=False "
                    "(patch_llama(model) leaves them off by itself)"
                )
            if "RMSNorm" in cls.__name__ and cls is not TritonRMSNorm:
                raise ValueError(
                    f"cannot replace {where}: {cls.__module__}.{cls.__name__} is not a norm whose "
                    "formula patch_llama "
                    f"knows (it replaces {sorted(c.__name__ for c in accepted)}, which compute "
                    "weight · (x / rms(x)).to(x.dtype)); it refuses rather than guess. Use "
                    "rms_norm=False to leave "
                    "the norms alone"
                )
    return found


def _check_causal_lm(model: torch.nn.Module, switch: str = "cross_entropy") -> None:
    if not hasattr(type(model), "loss_function"):
        raise TypeError(
            f"{switch}=True needs a Hugging Face model with a loss_function (e.g. LlamaForCausalLM), got "
            f"{type(model).__name__}"
        )
    loss_type = getattr(model, "loss_type", None)
    if loss_type != "ForCausalLM" and not type(model).__name__.endswith("ForCausalLM"):
        raise TypeError(
            f"the patched loss is the causal-LM loss (labels shifted by one); {type(model).__name__} uses "
            f"loss_type={loss_type!r}. Use cross_entropy=False to leave the loss alone"
        )


@dataclass
class _ForwardState:
    """What the patched model forward reads at each call: the patched loss (or None) and
    ``skip_causal_mask``."""

    loss: _PatchedLoss | None = None
    skip_causal_mask: bool = False


def _wrap_forward(model: torch.nn.Module, state: _ForwardState):
    """An instance-level forward that drops the logits when the loss overwrote them with their
    gradient (``state.loss``), and marks a call without mask, positions or cache as plain causal for
    the mask function (``state.skip_causal_mask``, ``kernels.hf.attention_mask``)."""
    inner = model.forward  # the bound method (or an earlier instance attribute)

    def forward(*args, **kwargs):
        loss = state.loss
        previous_plain = CAUSAL_CALL.plain
        CAUSAL_CALL.plain = state.skip_causal_mask and is_plain_causal_call(args, kwargs)
        if loss is not None:
            loss.consumed = loss.deferred = loss.deferred_by = None
            # Defer the logits only where they exist for the loss alone: training, autograd on,
            # labels given.
            loss.defer = (loss.head is not None and model.training and torch.is_grad_enabled()
                          and kwargs.get("labels") is not None)
        try:
            output = inner(*args, **kwargs)
            if loss is None:
                return output
            if loss.deferred is not None and loss.consumed is None:  # the loss was not computed after all
                output = _with_logits(output, loss.deferred, loss.deferred_by)
            return output if loss.consumed is None else _without_consumed_logits(output, loss.consumed)
        finally:
            CAUSAL_CALL.plain = previous_plain
            if loss is not None:
                loss.consumed = loss.deferred = loss.deferred_by = None  # keep no tensor alive past the call
                loss.defer = False

    forward.__doc__ = (
        "The model's forward, patched by kernels.patch_llama: in train mode with autograd on, the "
        "returned logits "
        "are None (the loss overwrote them with their gradient). Use model.eval() or torch.no_grad() "
        "to get them."
    )
    forward.__wrapped__ = inner
    return forward


def _model_to_patch(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside the wrappers users put around it: PEFT's ``PeftModel`` (LoRA
    and the other adapters keep the original model, with adapter layers injected, behind
    ``get_base_model()``) and the module ``torch.compile`` returns (``_orig_mod``). Patching the
    inner model is what a wrapper's forward then calls."""
    while True:
        if isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            model = model._orig_mod
        elif callable(getattr(model, "get_base_model", None)) and not hasattr(type(model), "loss_function"):
            model = model.get_base_model()
        else:
            return model


def _found(items: list, message: str) -> list:
    """``items``, or a ValueError with ``message`` when there are none (the kernel has nothing to
    replace)."""
    if not items:
        raise ValueError(message)
    return items


def _check_mask_function(model: torch.nn.Module, switch: str) -> None:
    """What ``use_mask_function`` needs, checked before any change: SDPA attention, and
    transformers' registries of attention and mask functions."""
    check_sdpa(model, switch)
    try:
        from transformers import AttentionInterface  # noqa: F401
        from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: F401
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: F401
    except ImportError as err:
        raise ValueError(f"{switch}=True needs transformers' AttentionInterface and AttentionMaskInterface, which "
                         f"this transformers lacks ({err})") from None


# --------------------------------------------------------------------------------------------------
# The switches, one entry each
# --------------------------------------------------------------------------------------------------


@dataclass
class _Surgery:
    """One call of ``patch_llama``: the model, its options, the switches that apply, the handle
    being filled."""

    model: torch.nn.Module
    handle: LlamaPatch
    inplace_logits: bool
    required: dict[str, bool]  # each switch tried: True where asked for (a refusal raises)
    keywords: dict[str, bool | None]  # the keyword switches as given
    on: set[str]  # the switches being applied
    forward: _ForwardState = field(default_factory=_ForwardState)

    def wrap_forward(self) -> Callable[[], None] | None:
        """Give the model the patch's forward, once; returns what puts the previous one back (None
        if done)."""
        if self.handle.forward_wrapped:
            return None
        model = self.model
        had_own, previous = "forward" in model.__dict__, model.__dict__.get("forward")
        model.forward = _wrap_forward(model, self.forward)
        self.handle.forward_wrapped = True

        def undo() -> None:
            if had_own:
                model.forward = previous
            else:
                model.__dict__.pop("forward", None)

        return undo

    def install_loss(self) -> _Undo | None:
        """Make ``model.loss_function`` the patched loss, once (for either loss switch); returns its
        undo."""
        if self.handle.loss is not None:
            return None
        model = self.model
        had_own, previous = "_loss_function" in model.__dict__, model.__dict__.get("_loss_function")
        loss = _PatchedLoss(model, self.inplace_logits, "cross_entropy" in self.on)
        model.loss_function = loss  # PreTrainedModel's setter stores it as model._loss_function
        self.handle.loss = self.forward.loss = loss

        def undo() -> None:
            if had_own:
                model._loss_function = previous
            else:
                model.__dict__.pop("_loss_function", None)

        return _chain(self.wrap_forward(), undo)


@dataclass(frozen=True)
class Switch:
    """One switch of ``patch_llama``: its name, whether ``kernels="auto"`` wants it, whether it
    applies to a model (``check``: what it would change, or a TypeError/ValueError saying why not)
    and how (``apply``: the change, returning how to undo it). ``SWITCH_TABLE`` lists them; the
    selector, ``left_off``, ``summary()`` and ``undo()`` all read it.

    Args:
        name: the switch's keyword of ``patch_llama`` and its name in ``kernels=``.
        default: True where ``kernels="auto"`` turns it on wherever it applies; a callable of the
            model where that depends on the model or the machine (``attention``, ``lora``).
        check: ``check(model)`` returns what ``apply`` needs; raises TypeError/ValueError where it
            cannot apply.
        apply: ``apply(surgery, found)`` makes the change and returns its undo (a callable, or
            ``_Undo``).
        describe: ``describe(handle)``: its part of ``summary()``, or None.
        supersedes: switches this one takes the place of where both apply.
        status: ``status(handle)`` → (on now, why layers stay off): a switch that follows layers
            added after the patch (``lora``); in ``"auto"`` it waits, unlisted, where it has nothing
            to change yet.
        note: ``note(surgery)``, run whether it applied or not: what the handle says about it.
    """

    name: str
    default: bool | Callable[[torch.nn.Module], bool]
    check: Callable[[torch.nn.Module], object]
    apply: Callable[[_Surgery, object], object]
    describe: Callable[[LlamaPatch], str | None] | None = None
    supersedes: tuple[str, ...] = ()
    status: Callable[[LlamaPatch], tuple[bool, str | None]] | None = None
    note: Callable[[_Surgery], None] | None = None


def _swap_modules(swaps: list[_Swap], replace, found) -> _Undo:
    """Replace each module of ``found`` by ``replace(module)`` in its parent, noting each swap in
    ``swaps``."""
    done = []
    for where, parent, attr, module in found:
        replacement = replace(module)
        setattr(parent, attr, replacement)
        done.append(_Swap(where, parent, attr, module, replacement))
    swaps.extend(done)

    def check() -> None:
        for swap in done:
            if getattr(swap.parent, swap.name) is not swap.replacement:
                raise RuntimeError(
                    f"cannot undo: {swap.where} was replaced by something else after the patch; undo "
                    "that first"
                )

    def run() -> None:
        for swap in reversed(done):
            _carry_new_children(swap.replacement, swap.original)
            setattr(swap.parent, swap.name, swap.original)

    return _Undo(run, check)


def _apply_rope(s: _Surgery, found) -> _Undo:
    for where, module, forward in found:
        module.forward = types.MethodType(forward, module)
        s.handle.rotary.append(RotarySwap(where, module, module.forward))
    swaps = list(s.handle.rotary)

    def check() -> None:
        for swap in swaps:
            if swap.module.__dict__.get("forward") is not swap.forward:
                raise RuntimeError(f"cannot undo: the forward of {swap.where} was replaced after the patch")

    def run() -> None:
        for swap in swaps:
            del swap.module.forward  # the class's forward is seen again

    return _Undo(run, check)


def _apply_linear_cross_entropy(s: _Surgery, heads: list[torch.nn.Linear]) -> _Undo:
    undo_loss = s.install_loss()
    s.handle.head = s.handle.loss.head = heads[0]
    previous = [(h, h.__dict__.get("forward")) for h in heads]
    for h in heads:
        h.forward = _deferring_head_forward(h, s.handle.loss)

    def undo() -> None:
        for head, forward in previous:
            if forward is not None:
                head.forward = forward
            else:
                del head.forward

    return _chain(undo_loss, undo)


def _apply_mask(s: _Surgery, additive: bool):
    what = ("padding mask: one additive bias per forward" if additive
            else "causal mask: skipped under torch.compile")
    s.handle.mask = f"{s.handle.mask}; {what}" if s.handle.mask else what
    if additive:
        return _attention_undo(s.model, use_mask_function(s.model, additive=True))
    s.forward.skip_causal_mask = True
    # With additive_mask on, its mask function also skips the causal mask of a plain call.
    if "additive_mask" in s.on:
        return s.wrap_forward()
    return _chain(s.wrap_forward(), _attention_undo(s.model, use_mask_function(s.model, additive=False)))


def _attention_undo(model: torch.nn.Module, restore: Callable[[], None]) -> _Undo:
    """``restore`` (which points the attention back, or raises where its implementation was changed
    since), with a check that raises as it would, before anything is undone."""
    config, implementation = model.config, model.config._attn_implementation

    def check() -> None:
        if config._attn_implementation != implementation:
            restore()  # raises, naming the implementation found

    return _Undo(restore, check)


def _note_attention(s: _Surgery) -> None:
    default, why = attention_choice()
    if "attention" in s.on:
        s.handle.attention = f"Triton flash_attention, {'asked for' if s.required['attention'] else why}"
    elif "attention" in s.required or s.keywords["attention"] is None:
        s.handle.attention = s.handle.refused.get("attention", why)
    else:
        s.handle.attention = "sdpa (attention=False)"


def _apply_offload(s: _Surgery, found) -> Callable[[], None]:
    s.handle.offload = enable_checkpoint_offload(s.model)
    return s.handle.offload.undo


def _apply_fp8_base(s: _Surgery) -> None:
    # One-way (kernels.hf.fp8_base): nothing to undo.
    convert_base(s.model)


def _apply_lora(s: _Surgery, found) -> Callable[[], None]:
    s.handle.lora = enable_lora_fusion(s.model)
    return s.handle.lora.undo


def _lora_status(handle: LlamaPatch) -> tuple[bool, str | None]:
    lora = handle.lora
    if lora is None:
        return False, None
    on = "lora" in handle.turned_on or (lora.active and bool(lora.layers or has_lora_layers(handle.model)))
    return on, (lora.summary() if lora.left_off else None)


def _describe_mlps(p: LlamaPatch) -> str:
    mlps = _count(type(swap.original).__name__ for swap in p.mlp_swaps)
    if not mlps:
        return "MLP activation: Hugging Face's (swiglu=False)"
    return f"{type(p.mlp_swaps[0].replacement).__name__} replaces {mlps}"


def _describe_rotary(p: LlamaPatch) -> str:
    rotary = _count(type(swap.module).__name__ for swap in p.rotary)
    if not rotary:
        return "RoPE: Hugging Face's apply_rotary_pos_emb (rope=False)"
    return f"RoPE: Triton apply_rotary in {rotary}"


def _nothing(model: torch.nn.Module, what: str, switch: str) -> str:
    return f"{type(model).__name__} has no {what} patch_llama knows: {switch} has nothing to replace"


def _check_norms(model: torch.nn.Module) -> list:
    return _found(_find_norms(model), _nothing(model, "norm", "rms_norm"))


def _check_mlps(model: torch.nn.Module) -> list:
    return _found(_find_mlps(model), _nothing(model, "MLP", "swiglu"))


def _check_rope(model: torch.nn.Module) -> list:
    attention = find_attention(model, set(_classes(SUPPORTED_ATTENTION).values()))
    return _found(attention, f"{type(model).__name__} has no attention module patch_llama knows: rope has "
                             "nothing to patch")


def _check_linear_cross_entropy(model: torch.nn.Module) -> list[torch.nn.Linear]:
    _check_causal_lm(model, "linear_cross_entropy")
    return _check_head(model)


def _swapping(attr: str, module_class: type):
    # apply: swap each module found for module_class.from_hf(module), noted in the handle's list ``attr``.
    return lambda s, found: _swap_modules(getattr(s.handle, attr), module_class.from_hf, found)


def _describe_norms(p: LlamaPatch) -> str:
    return f"TritonRMSNorm replaces {_count(type(w.original).__name__ for w in p.swaps) or 'no norms'}"


def _describe_loss(p: LlamaPatch) -> str:
    return f"loss: {p.loss!r}" if p.loss is not None else "loss: Hugging Face's loss (not patched)"


# patch_llama's switches, in the order they are checked, applied and listed (undone in reverse).
SWITCH_TABLE = (
    Switch("rms_norm", True, _check_norms, _swapping("swaps", TritonRMSNorm), _describe_norms),
    Switch("cross_entropy", True, _check_causal_lm, lambda s, found: s.install_loss(), _describe_loss),
    Switch("linear_cross_entropy", False, _check_linear_cross_entropy, _apply_linear_cross_entropy),
    Switch("swiglu", True, _check_mlps, _swapping("mlp_swaps", TritonSwiGLUMLP), _describe_mlps),
    Switch("rope", True, _check_rope, _apply_rope, _describe_rotary),
    # The attention's residual add and post_attention_layernorm as one kernel (kernels.hf.add_rmsnorm).
    Switch("add_rms_norm", True, find_decoder_layers, lambda s, found: _Undo(*fuse_residual_adds(found)),
           lambda p: describe_fused_adds(p.model)),
    Switch("additive_mask", True, lambda m: _check_mask_function(m, "additive_mask"),
           lambda s, found: _apply_mask(s, additive=True), lambda p: p.mask or None),
    Switch("skip_causal_mask", True, lambda m: _check_mask_function(m, "skip_causal_mask"),
           lambda s, found: _apply_mask(s, additive=False)),
    # Runs the SwiGLU kernel one tile of rows at a time, in place of swiglu.
    Switch("tiled_mlp", False, _tileable_mlps, _swapping("mlp_swaps", TiledSwiGLUMLP),
           supersedes=("swiglu",)),
    Switch("offload_checkpoints", False, check_offloadable, _apply_offload,
           lambda p: "checkpoints offloaded to host memory" if p.offload is not None else None),
    # The frozen base of PEFT's LoRA layers in FP8 (kernels.hf.fp8_base), before lora: one-way, no undo.
    Switch("fp8_base", False, check_fp8_base, lambda s, found: _apply_fp8_base(s),
           lambda p: describe_fp8_base(p.model)),
    # After the MLP switches: the hook that fuses layers PEFT puts in later looks at the modules present now.
    Switch("lora", lora_can_follow, lambda m: (check_lora(m), has_lora_layers(m))[1], _apply_lora,
           lambda p: p.lora.summary() if "lora" in p.kernels else None, status=_lora_status),
    # Our attention's mask function takes the place of the two SDPA mask switches.
    Switch("attention", lambda m: attention_choice()[0], check_attention,
           lambda s, found: _attention_undo(s.model, use_flash_attention(s.model)),
           lambda p: f"attention: {p.attention}" if p.attention else None,
           supersedes=("additive_mask", "skip_causal_mask"), note=_note_attention),
)
# patch_llama's switches, by name: what its ``kernels=`` selector and its keywords may name, and
# what ``python -m kernels.training.finetune --kernels`` and ``compare``'s ``patch_options`` pass
# on.
SWITCHES = tuple(s.name for s in SWITCH_TABLE)
# What ``kernels="auto"`` turns on wherever it applies (``lora`` and ``attention`` decide per model
# and machine).
DEFAULT_KERNELS = tuple(s.name for s in SWITCH_TABLE if s.default is True)


def _selection(kernels, keywords: dict[str, bool | None], model: torch.nn.Module) -> dict[str, bool]:
    """The switches to try, each mapped to whether it is required (a refusal raises) or wanted where
    it applies (a refusal leaves it off): the ``kernels`` selector, then each keyword switch that is
    not None."""
    for name, value in keywords.items():
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False (or None: as kernels= says), got {value!r}")
    if isinstance(kernels, str):
        if kernels != "auto":
            hint = f"; for this one kernel alone: kernels=({kernels!r},)" if kernels in SWITCHES else ""
            raise ValueError(f'kernels must be "auto" or a tuple of names from {", ".join(SWITCHES)}, got '
                             f"{kernels!r}{hint}")
        selected = {s.name: False for s in SWITCH_TABLE
                    if s.default is True or (callable(s.default) and s.default(model))}
    else:
        try:
            names = tuple(kernels)
        except TypeError:
            raise TypeError(f'kernels must be "auto" or a tuple of names from {", ".join(SWITCHES)}, got '
                            f"{kernels!r}") from None
        unknown = [name for name in names if name not in SWITCHES]
        if unknown:
            raise ValueError(f"unknown kernel{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} in "
                             f"kernels=: choose from {', '.join(SWITCHES)}")
        selected = dict.fromkeys(names, True)
    for name, value in keywords.items():
        if value is True:
            selected[name] = True
        elif value is False:
            selected.pop(name, None)
    return selected


def _check_switches(model: torch.nn.Module, required: dict[str, bool]) -> tuple[dict, dict, set[str]]:
    """Every check before the first change, so that a refusal leaves the model as it was: (what each
    switch that applies would change, each switch left off and why, the switches that only wait). A
    required switch's refusal raises; one that "auto" merely wants is left off. A switch that
    follows layers added later (``lora``), wanted by "auto" with nothing to change yet, waits;
    alone, it does not count as a switch that applies."""
    found, refused = {}, {}
    for switch in (s for s in SWITCH_TABLE if s.name in required):
        try:
            found[switch.name] = switch.check(model)
        except (TypeError, ValueError) as err:
            if required[switch.name]:
                raise
            refused[switch.name] = str(err)
    for switch in (s for s in SWITCH_TABLE if s.name in found):
        for other in switch.supersedes:
            found.pop(other, None)
    waiting = {s.name for s in SWITCH_TABLE
               if s.status is not None and s.name in found and not (required[s.name] or found[s.name])}
    if refused and len(found) == len(waiting):
        reasons = "; ".join(f"{name}: {why}" for name, why in refused.items())
        raise TypeError(f"no kernel of patch_llama applies to {type(model).__name__}: {reasons}")
    return found, refused, waiting


def _checked_model(model, inplace_logits) -> torch.nn.Module:
    """The model ``patch_llama`` patches (the one inside a PEFT or compiled wrapper), after the
    arguments' types are checked."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a Hugging Face model), got "
                        f"{type(model).__name__}")
    if not isinstance(inplace_logits, bool):
        raise TypeError(f"inplace_logits must be True or False, got {inplace_logits!r}")
    return _model_to_patch(model)


def _refuse_repatch(model: torch.nn.Module) -> None:
    previous = model.__dict__.get("_kernels_patch")
    if previous is not None and previous.active:
        raise RuntimeError("this model is already patched: call .undo() on the handle patch_llama returned "
                           "first")


def patch_llama(
    model: torch.nn.Module, kernels="auto", *, inplace_logits: bool = True, rms_norm: bool | None = None,
    cross_entropy: bool | None = None, linear_cross_entropy: bool | None = None, swiglu: bool | None = None,
    rope: bool | None = None, additive_mask: bool | None = None, skip_causal_mask: bool | None = None,
    tiled_mlp: bool | None = None, offload_checkpoints: bool | None = None, lora: bool | None = None,
    attention: bool | None = None, add_rms_norm: bool | None = None, fp8_base: bool | None = None,
) -> LlamaPatch:
    """Put the workbook's kernels into a Hugging Face Llama (or Mistral, Qwen2, Qwen3), undoably.

    Each switch is one entry of ``SWITCH_TABLE`` (what each changes: the module docstring; the
    derivations: chapters 08 to 16, one family each). ``kernels="auto"`` turns on every switch of
    ``DEFAULT_KERNELS`` that applies to the model, ``lora`` wherever PEFT's LoRA layers appear
    (before the patch or after it), and ``attention`` where ``attention_choice`` finds it no slower
    on this GPU; a switch that does not apply is left off, with the reason in ``handle.left_off``.
    Why these defaults, with each measurement and its results file:
    ``assets/notes/patch_defaults.md``.

    Args:
        model: the model to patch; also a PEFT model or a ``torch.compile``-d one (the model inside
            is patched).
        kernels: ``"auto"``, or a tuple of names from ``SWITCHES``: exactly those, each required
            (one that cannot apply raises before anything changes).
        inplace_logits: with ``cross_entropy``, in train mode with autograd on, the loss's gradient
            overwrites the logits and the output's ``logits`` is None; False keeps them (one more
            [tokens, vocab] buffer).
        rms_norm, cross_entropy, linear_cross_entropy, swiglu, rope, additive_mask, skip_causal_mask,
        tiled_mlp, offload_checkpoints, lora, attention, add_rms_norm, fp8_base: one switch each, over
            ``kernels``: True requires it, False leaves it off, None follows ``kernels``
            (``patch_llama(model, swiglu=False)``: the defaults but SwiGLU).

    Returns:
        The ``LlamaPatch`` handle: ``kernels`` (the switches on), ``left_off`` (each left off, and
        why), ``summary()``, and ``undo()`` (also on leaving a ``with patch_llama(model):`` block).

    Raises:
        TypeError, ValueError: a required switch cannot apply, or, under ``"auto"``, none does.
        RuntimeError: the model is already patched.
    """
    model = _checked_model(model, inplace_logits)
    keywords = dict(rms_norm=rms_norm, cross_entropy=cross_entropy, linear_cross_entropy=linear_cross_entropy,
                    swiglu=swiglu, rope=rope, additive_mask=additive_mask,
                    skip_causal_mask=skip_causal_mask, tiled_mlp=tiled_mlp,
                    offload_checkpoints=offload_checkpoints, lora=lora, attention=attention,
                    add_rms_norm=add_rms_norm, fp8_base=fp8_base)
    required = _selection(kernels, keywords, model)
    _refuse_repatch(model)
    found, refused, waiting = _check_switches(model, required)
    patch = LlamaPatch(model, tuple(n for n in SWITCHES if n in found and n not in waiting), refused)
    surgery = _Surgery(model, patch, inplace_logits, required, keywords, set(found))
    for switch in SWITCH_TABLE:
        if switch.name in found:
            patch.undos.append((switch.name, _chain(switch.apply(surgery, found[switch.name]))))
        if switch.note is not None:
            switch.note(surgery)
    model.__dict__["_kernels_patch"] = patch
    return patch
