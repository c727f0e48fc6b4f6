"""Llama models for the workbook: configurations, deterministic random weights, and the memory a
fine-tuning step needs.

A kernel's cost depends on the shapes it sees, not on the values of the weights, so the workbook
runs on Llama *configurations* with random weights and downloads nothing. The configurations by name
(``"tiny"``, ``"llama-3.2-1b"``, ``"llama-3.1-8b"``) live in ``kernels.hf.presets``;
``llama_config``, ``PRESETS`` and ``count_parameters`` are imported here too, so a training script
finds them beside ``build_model``.

``build_model`` gives the same weights for the same seed on the same device, which later chapters
rely on to build a baseline and a patched copy of one model. ``load_pretrained`` loads real weights
when they are already on disk.

``full_finetune_memory`` counts, from the configuration alone, the bytes full bf16 fine-tuning with
AdamW needs; ``pick_preset_for_gpu`` uses it to choose the largest preset that fits this GPU.

``transformers`` is imported inside the functions that need it so that ``import kernels`` stays
fast.

Chapter 01 (notebooks/01_profile_baseline.ipynb) builds its model here and counts the memory of a
step; every later chapter builds its models with ``build_model``.
"""

from __future__ import annotations

import copy
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kernels import runtime
from kernels.hf.presets import PRESETS, count_parameters, llama_config
from kernels.memory import hf_loss_buffers, hf_loss_peak

if TYPE_CHECKING:  # pragma: no cover
    from transformers import LlamaConfig, LlamaForCausalLM

GiB = 1024**3

# --------------------------------------------------------------------------------------------------
# Building models
# --------------------------------------------------------------------------------------------------


def _resolve_config(preset_or_config) -> LlamaConfig:
    from transformers import LlamaConfig

    if isinstance(preset_or_config, str):
        return llama_config(preset_or_config)
    if isinstance(preset_or_config, LlamaConfig):
        config = copy.deepcopy(preset_or_config)
        config._attn_implementation = "sdpa"
        return config
    raise TypeError(
        f"preset_or_config must be a preset name ({sorted(PRESETS)}) or a transformers.LlamaConfig, "
        f"got {type(preset_or_config).__name__}"
    )


def _check_dtype(dtype) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype such as torch.bfloat16, got {dtype!r}")


@contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@torch.no_grad()
def init_weights_(model: torch.nn.Module, seed: int = 0, std: float | None = None) -> torch.nn.Module:
    """Overwrite every parameter with seeded random values, in place; the same seed gives the same weights.

    Matrices and embeddings get N(0, std²) with the configuration's ``initializer_range`` (0.02), as
    Hugging Face initialises Llama. RMSNorm weights get N(1, 0.1²) rather than exactly 1: a kernel
    that forgot to multiply by the weight would still match a model whose weights are all ones. The
    values come from one generator on the parameters' device, so they are identical for the same
    seed on the same kind of device (the CPU's and CUDA's random streams differ from each other).
    Biases, where a model has them, become zeros.

    Args:
        model: the model; its parameters are overwritten.
        seed: the seed of each device's generator.
        std: the matrices' standard deviation; None for the configuration's ``initializer_range``
            (0.02 where the model has none).

    Returns:
        ``model`` itself.
    """
    if std is None:
        std = getattr(getattr(model, "config", None), "initializer_range", 0.02)
    generators: dict[torch.device, torch.Generator] = {}
    # Sorted names give an order that does not depend on how the model was assembled; tied weights
    # appear once.
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        gen = generators.get(param.device)
        if gen is None:
            gen = generators[param.device] = torch.Generator(device=param.device)
            gen.manual_seed(seed)
        if name.endswith("bias"):
            param.zero_()
        elif param.ndim == 1:
            param.normal_(1.0, 0.1, generator=gen)
        else:
            param.normal_(0.0, std, generator=gen)
    return model


def build_model(
    preset_or_config="tiny", dtype: torch.dtype = torch.bfloat16, device=None, seed: int = 0
) -> LlamaForCausalLM:
    """A ``LlamaForCausalLM`` of a preset (or any ``LlamaConfig``) with deterministic random
    weights, in train mode.

    The model is constructed directly on ``device`` (default: ``runtime.device()``) in ``dtype``, so
    an 8B model on a GPU never passes through slow fp32 initialisation on the CPU, then every weight
    is drawn by ``init_weights_`` from ``seed``. Attention runs through PyTorch's
    ``scaled_dot_product_attention`` ("sdpa"). The caller's random state is left as it was. Chapter
    01 (notebooks/01_profile_baseline.ipynb) builds its first model with it.

    Args:
        preset_or_config: a preset name of ``PRESETS``, or a ``transformers.LlamaConfig`` (copied;
            its attention set to "sdpa").
        dtype: a floating dtype for the weights.
        device: where the weights are made; None for ``runtime.device()``.
        seed: the weights' seed.

    Returns:
        The model, in train mode, with the KV cache off.

    Raises:
        TypeError: ``preset_or_config`` is neither a str nor a ``LlamaConfig``, or ``dtype`` is not
            a floating ``torch.dtype``.
        ValueError: the preset name is unknown (``llama_config``).
    """
    from transformers import LlamaForCausalLM

    config = _resolve_config(preset_or_config)
    _check_dtype(dtype)
    device = torch.device(device) if device is not None else runtime.device()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    # Construction runs Hugging Face's own initialisation, which draws from the global random state:
    # keep the caller's random state untouched, the weights come from init_weights_ below anyway.
    fork_devices = [device.index] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=fork_devices), _default_dtype(dtype), torch.device(device):
        model = LlamaForCausalLM(config)
    model.config.use_cache = False
    init_weights_(model, seed)
    return model.train()


def load_pretrained(name_or_path, dtype: torch.dtype = torch.bfloat16, device=None) -> LlamaForCausalLM:
    """Real weights from a local directory or a model already in the Hugging Face cache; never downloads.

    Chapter 01 (notebooks/01_profile_baseline.ipynb) shows how to use real weights.

    Args:
        name_or_path: a directory holding a saved model, or a hub id already in the cache (str or
            ``Path``).
        dtype: a floating dtype for the weights.
        device: where the model goes; None for ``runtime.device()``.

    Returns:
        The model in train mode with the KV cache off and attention through "sdpa", like
        ``build_model``.

    Raises:
        TypeError: ``dtype`` is not a floating ``torch.dtype``, or ``name_or_path`` is neither a str
            nor a ``Path``.
        FileNotFoundError: no such model is on disk (the message says how to get one).
    """
    from transformers import AutoModelForCausalLM

    _check_dtype(dtype)
    if not isinstance(name_or_path, (str, Path)):
        raise TypeError(
            f"name_or_path must be a directory or a hub id (str or Path), got {type(name_or_path).__name__}"
        )
    device = torch.device(device) if device is not None else runtime.device()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(name_or_path), dtype=dtype, local_files_only=True, attn_implementation="sdpa"
        )
    except OSError as err:  # transformers raises OSError (or a subclass) when nothing is found locally
        raise FileNotFoundError(
            f"No model weights found for {str(name_or_path)!r}: it is neither a directory with a saved model nor "
            "a model already in the Hugging Face cache, and this workbook never downloads. To use real weights, "
            "download them once where there is network access, e.g. "
            "`huggingface-cli download meta-llama/Llama-3.2-1B --local-dir ~/models/llama-3.2-1b` (Llama weights "
            "are gated: accept the licence on the model's page first), then pass that directory. "
            "Everything in the workbook also works without them: build_model(preset) gives the same shapes with "
            "random weights."
        ) from err
    model.config.use_cache = False
    return model.to(device).train()


# --------------------------------------------------------------------------------------------------
# Memory of full fine-tuning
# --------------------------------------------------------------------------------------------------


def _fmt_bytes(n: float) -> str:
    if n >= GiB:
        return f"{n / GiB:,.2f} GiB"
    if n >= 1024**2:
        return f"{n / 1024**2:,.1f} MiB"
    return f"{n / 1024:,.1f} KiB"


# The moments of a step at which memory can peak, and the parts alive at each (see MemoryBudget).
HIGH_POINTS: dict[str, tuple[str, ...]] = {
    "loss, forward": ("weights", "optimizer_states", "activations", "logits", "logits_fp32",
                      "log_softmax_fp32"),
    "loss, backward": ("weights", "optimizer_states", "activations", "log_softmax_fp32", "logit_grads_fp32"),
    "optimizer step": ("weights", "gradients", "optimizer_states", "optimizer_temporaries"),
}


@dataclass
class MemoryBudget:
    """Bytes a full fine-tuning step needs, part by part, and at the three moments where it can peak.

    * ``"loss, forward"``, while Hugging Face's loss runs at the end of the forward pass: weights,
      optimizer states, every activation saved for the backward pass, the bf16 logits, their fp32
      copy (``logits.float()``) and the fp32 log-softmax that ``F.cross_entropy`` keeps for its
      backward pass (10 bytes per logit);
    * ``"loss, backward"``, the first nodes of the backward pass: all activations are still alive,
      next to the saved log-softmax and two fp32 gradients of the logits, nll_loss's and
      log_softmax's (12 bytes per logit);
    * ``"optimizer step"``, inside ``optimizer.step()``: weights, gradients, optimizer states and
      the optimizer's temporaries. (Activations are gone by then: the backward pass freed them.)

    From ``full_finetune_memory`` every field is computed from the configuration (``measured`` is
    False and ``activations`` is an estimate). From ``kernels.training.profiling`` on a GPU, the
    parts are taken from the tensors and the allocator's statistics and ``measured_peak`` is
    ``torch.cuda.max_memory_allocated`` over a step.
    """

    weights: int
    gradients: int
    optimizer_states: int
    optimizer_temporaries: int
    activations: int
    logits: int
    logits_fp32: int
    log_softmax_fp32: int
    logit_grads_fp32: int
    measured: bool = False
    measured_peak: int | None = None
    phase_peaks: dict[str, int] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)

    def high_points(self) -> dict[str, int]:
        """Bytes alive at each moment of ``HIGH_POINTS``, from the parts.

        Returns:
            Moment -> the sum of the parts alive then.
        """
        parts = self.parts()
        return {moment: sum(parts[name] for name in names) for moment, names in HIGH_POINTS.items()}

    @property
    def peak(self) -> int:
        """The measured peak where there is one, otherwise the largest computed high point."""
        if self.measured_peak is not None:
            return self.measured_peak
        return max(self.high_points().values())

    @property
    def loss_bytes(self) -> int:
        """The most the loss's [tokens, vocab] buffers take at once (forward or backward) on top of
        the model."""
        return hf_loss_peak(self.logits, self.logits_fp32, self.log_softmax_fp32, self.logit_grads_fp32)

    def parts(self) -> dict[str, int]:
        """Every part's bytes by name, in the order of the fields.

        Returns:
            Part name -> bytes, ``weights`` to ``logit_grads_fp32``.
        """
        return {
            "weights": self.weights,
            "gradients": self.gradients,
            "optimizer_states": self.optimizer_states,
            "optimizer_temporaries": self.optimizer_temporaries,
            "activations": self.activations,
            "logits": self.logits,
            "logits_fp32": self.logits_fp32,
            "log_softmax_fp32": self.log_softmax_fp32,
            "logit_grads_fp32": self.logit_grads_fp32,
        }

    def table(self) -> str:
        """A plain-text table of every part, with the note that says how it was obtained, and the
        high points. Chapter 01 (notebooks/01_profile_baseline.ipynb) prints one computed and one
        measured.

        Returns:
            The table, ending with the peak and whether it was measured or computed.
        """
        lines = [f"{'part':<24}{'bytes':>14}  how"]
        for name, value in self.parts().items():
            lines.append(f"{name:<24}{_fmt_bytes(value):>14}  {self.notes.get(name, '')}")
        for moment, value in self.high_points().items():
            alive = ", ".join(name.replace("optimizer_", "").replace("_",
                                                                     " ") for name in HIGH_POINTS[moment])
            lines.append(f"{'at ' + moment:<24}{_fmt_bytes(value):>14}  {alive}")
        kind = "measured (torch.cuda.max_memory_allocated)" if self.measured_peak is not None else "computed"
        lines.append(f"{'peak':<24}{_fmt_bytes(self.peak):>14}  {kind}")
        return "\n".join(lines)


def norm_bytes_per_token(hidden: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes one Hugging Face RMSNorm saves for the backward pass per token: its fp32 input (4·h),
    the fp32 1/rms (4), and the normalised values before and after the weight multiply in
    ``dtype``.

    Args:
        hidden: the hidden size h.
        dtype: the model's dtype.

    Returns:
        The bytes, ``4·h + 4 + 2·size·h`` with ``size`` the bytes of ``dtype``.
    """
    size = torch.empty((), dtype=dtype).element_size()
    return 4 * hidden + 4 + 2 * size * hidden


def activation_bytes_per_token_layer(config: LlamaConfig, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes one decoder layer saves for the backward pass per token, in Hugging Face's Llama (an
    estimate).

    Counted from what autograd keeps (``tests/training/test_models.py`` checks it against the tensors
    a real step saves), with h the hidden size, q the query width (heads × head_dim) and ``size`` the
    bytes of ``dtype``:

    * each of the 2 RMSNorms: its fp32 input (4·h bytes; the square and the normalising multiply
      share it), the fp32 1/rms (4 bytes), the normalised values in ``dtype`` before the weight
      multiply and the output after it (the projections that follow read the output, so it is saved
      once);
    * attention: q, k and v (k and v repeated to every query head) and the output, in ``dtype``,
      plus one fp32 log-sum-exp per head; RoPE saves only the shared cos/sin tables, the o_proj
      input is a view of the output;
    * MLP (SwiGLU): gate, silu(gate), up and their product, in ``dtype``.

    The attention mask is not included: see ``full_finetune_memory``.

    Args:
        config: the model's configuration.
        dtype: the model's dtype.

    Returns:
        The bytes per token of one layer.
    """
    h = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    q = heads * head_dim
    size = torch.empty((), dtype=dtype).element_size()
    norms = 2 * norm_bytes_per_token(h, dtype)
    attention = 4 * size * q + 4 * heads
    mlp = 4 * size * config.intermediate_size
    return norms + attention + mlp


def full_finetune_memory(
    config: LlamaConfig, batch_size: int, seq_len: int, dtype: torch.dtype = torch.bfloat16
) -> MemoryBudget:
    """The memory of one step of full fine-tuning with ``torch.optim.AdamW``, computed from the
    configuration.

    Assumptions, each the behaviour of the libraries as they are:

    * weights and gradients are stored in ``dtype`` (bf16: 2 bytes per parameter each);
    * AdamW's two moments (``exp_avg``, ``exp_avg_sq``) are created with
      ``torch.zeros_like(param)``, so they take the parameter's dtype: bf16 parameters get bf16
      states, 4 bytes per parameter in all (not the 8 bytes of fp32 moments that mixed-precision
      recipes keep);
    * the default ("foreach") AdamW on a GPU computes ``sqrt(exp_avg_sq)`` for all parameters at
      once: one parameter-sized temporary during ``optimizer.step()``;
    * the loss is Hugging Face's: bf16 logits [B·S, V], an fp32 copy of them, and
      ``F.cross_entropy``'s fp32 log-softmax kept for the backward pass, whose first nodes then hold
      two fp32 gradients of the logits;
    * activations: ``activation_bytes_per_token_layer`` × layers × tokens, plus the final norm and
      one attention mask [B, 1, S, S] per layer. This part is an estimate.

    Chapter 01 (notebooks/01_profile_baseline.ipynb) counts its model's budget with it, before it
    measures one.

    Args:
        config: the model's configuration.
        batch_size: rows per step.
        seq_len: tokens per row.
        dtype: the dtype of the weights, gradients and optimizer states.

    Returns:
        A ``MemoryBudget`` with ``measured`` False and a note per part.

    Raises:
        ValueError: ``batch_size`` or ``seq_len`` is not a positive int.
        TypeError: ``dtype`` is not a floating ``torch.dtype``.
    """
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    _check_dtype(dtype)
    size = torch.empty((), dtype=dtype).element_size()
    n_params = count_parameters(config)
    tokens = batch_size * seq_len
    h, vocab = config.hidden_size, config.vocab_size
    per_layer = activation_bytes_per_token_layer(config, dtype)
    final_norm = norm_bytes_per_token(h, dtype)
    # A row with padding makes Hugging Face build a [B, 1, S, S] mask for sdpa; PyTorch's CPU
    # attention keeps a copy per layer (counted so, an upper bound where the GPU's attention shares
    # one).
    mask_per_layer = batch_size * seq_len * seq_len * size
    layers = config.num_hidden_layers
    activations = tokens * (layers * per_layer + final_norm) + layers * mask_per_layer
    notes = {
        "weights": f"{n_params:,} parameters × {size} B",
        "gradients": f"one per parameter, {dtype}",
        "optimizer_states": f"AdamW exp_avg + exp_avg_sq in the parameters' dtype ({dtype})",
        "optimizer_temporaries": "foreach AdamW: sqrt(exp_avg_sq) for all parameters at once",
        "activations": "estimate: saved tensors counted per layer",
        "logits": f"[{tokens:,}, {vocab:,}] in {dtype}",
        "logits_fp32": "the fp32 copy Hugging Face's loss makes (logits.float())",
        "log_softmax_fp32": "F.cross_entropy keeps its fp32 log-softmax for backward",
        "logit_grads_fp32": "backward of the loss: nll_loss's and log_softmax's fp32 gradients",
    }
    return MemoryBudget(
        weights=n_params * size,
        gradients=n_params * size,
        optimizer_states=2 * n_params * size,
        optimizer_temporaries=n_params * size,
        activations=activations,
        **hf_loss_buffers(tokens, vocab, dtype),
        notes=notes,
    )


def _presets_largest_first() -> list[str]:
    return sorted(PRESETS, key=lambda name: count_parameters(llama_config(name)), reverse=True)


def pick_preset_for_gpu(seq_len: int = 2048, batch_size: int = 1, free_bytes: int | None = None,
                        margin: float = 0.10):
    """``(preset, reason)``: the largest preset whose full bf16 fine-tuning with AdamW fits in free
    GPU memory.

    A preset fits when its computed peak (``full_finetune_memory(...).peak``) plus ``margin`` (10%)
    of it is at most ``free_bytes`` (default: what ``torch.cuda.mem_get_info`` reports free now).
    The margin covers what the count leaves out: the allocator's fragmentation, the CUDA context's
    workspaces, the profiler. Without a GPU and without ``free_bytes`` the answer is ``"tiny"``.
    Chapter 01 (notebooks/01_profile_baseline.ipynb) picks its preset with it.

    Args:
        seq_len: tokens per row of the step.
        batch_size: rows per step.
        free_bytes: the memory to fit in; None for the GPU's free memory now.
        margin: the fraction of the peak kept free, in [0, 1).

    Returns:
        ``(preset, reason)``: the preset's name and one sentence saying why; ``"tiny"`` when nothing
        fits, the reason saying so.

    Raises:
        ValueError: ``free_bytes`` is not a non-negative int, or ``margin`` is outside [0, 1).
    """
    if free_bytes is None:
        if not torch.cuda.is_available():
            return "tiny", "no CUDA GPU here: the tiny preset runs on the CPU (Triton's interpreter mode)"
        free_bytes = torch.cuda.mem_get_info()[0]
    if not isinstance(free_bytes, int) or isinstance(free_bytes, bool) or free_bytes < 0:
        raise ValueError(f"free_bytes must be a non-negative int, got {free_bytes!r}")
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), got {margin!r}")
    candidates = _presets_largest_first()
    rejected = []
    for name in candidates:
        need = full_finetune_memory(llama_config(name), batch_size, seq_len).peak
        need_with_margin = math.ceil(need * (1 + margin))
        if need_with_margin <= free_bytes:
            reason = (
                f"{name}: full bf16 fine-tuning with AdamW at batch {batch_size} × seq {seq_len} needs about "
                f"{need / GiB:.1f} GiB at its peak ({need_with_margin / GiB:.1f} GiB with a {margin:.0%} margin), "
                f"and {free_bytes / GiB:.1f} GiB are free"
            )
            if rejected:
                reason += "; larger presets do not fit: " + ", ".join(rejected)
            return name, reason
        rejected.append(f"{name} needs {need_with_margin / GiB:.1f} GiB")
    return "tiny", (
        f"not even the tiny preset fits in {free_bytes / GiB:.2f} GiB free ({', '.join(rejected)}); "
        "falling back to tiny"
    )
