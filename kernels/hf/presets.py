"""Llama configurations by name: the shapes every chapter, benchmark and training run measures at.

* ``"tiny"``: four layers, hidden size 128, grouped-query attention (4 query heads sharing 2
  key/value heads), vocabulary 2,048 (the size of the tokenizer that ``kernels.training.data``
  trains), so the CPU gets through a step in well under a second on the code paths a real Llama
  takes;
* ``"llama-3.2-1b"``, ``"llama-3.1-8b"`` and ``"llama-3.1-70b"``: the published shapes of those
  models (vocabulary 128,256, rope theta 500,000, the llama3 RoPE frequency scaling, GQA 32/8 and
  64/8 for 70B).

They sit in the Hugging Face wing because they are transformers ``LlamaConfig`` objects and nothing
more: the benchmarks read parameter shapes from them without building a model
(``kernels.training.models`` builds them). ``transformers`` is imported inside the functions that
need it so that ``import kernels`` stays fast.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from transformers import LlamaConfig

# What every preset shares: the settings of a Llama 3 model trained with full fine-tuning.
_COMMON = dict(
    hidden_act="silu",
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    attention_bias=False,
    mlp_bias=False,
    attention_dropout=0.0,
    initializer_range=0.02,
    use_cache=False,  # training never reads a KV cache; building one costs time and memory
)

# The llama3 RoPE frequency scaling of the published checkpoints (only the rotary frequencies depend
# on it).
_LLAMA3_ROPE = dict(
    rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192,
)

_PRESET_ARGS: dict[str, dict] = {
    "tiny": dict(
        vocab_size=2048,
        hidden_size=128,
        intermediate_size=344,  # about 8/3 of hidden, as in Llama, and deliberately not a power of two
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention, so the repeat-KV path of the real models runs
        head_dim=32,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    ),
    "llama-3.2-1b": dict(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        rope_scaling=dict(_LLAMA3_ROPE, factor=32.0),
        bos_token_id=128000,
        eos_token_id=128001,
    ),
    "llama-3.1-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        rope_scaling=dict(_LLAMA3_ROPE, factor=8.0),
        bos_token_id=128000,
        eos_token_id=128001,
    ),
    "llama-3.1-70b": dict(
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        rope_scaling=dict(_LLAMA3_ROPE, factor=8.0),
        bos_token_id=128000,
        eos_token_id=128001,
    ),
}


def _make_config(preset: str, **overrides) -> LlamaConfig:
    from transformers import LlamaConfig

    args = {**_COMMON, **_PRESET_ARGS[preset]}
    reference = LlamaConfig()
    for key in overrides:
        if key not in args and not hasattr(reference, key):
            raise TypeError(f"llama_config: {key!r} is not a LlamaConfig setting (preset {preset!r})")
    args.update(overrides)
    config = LlamaConfig(**args)
    config._attn_implementation = "sdpa"
    return config


def _preset_factory(preset: str) -> Callable[..., LlamaConfig]:
    def make(**overrides) -> LlamaConfig:
        return _make_config(preset, **overrides)

    make.__name__ = f"{preset.replace('-', '_').replace('.', '_')}_config"
    make.__doc__ = f"A fresh LlamaConfig of the {preset!r} preset; keyword arguments override its settings."
    return make


# name -> function returning a fresh LlamaConfig (keyword arguments override settings, e.g.
# vocab_size=...).
PRESETS: dict[str, Callable[..., LlamaConfig]] = {name: _preset_factory(name) for name in _PRESET_ARGS}


def llama_config(preset: str = "tiny", **overrides) -> LlamaConfig:
    """The ``LlamaConfig`` of a preset, with any setting overridden, e.g. ``llama_config("tiny",
    vocab_size=4096)``.

    Chapters 01, 08, 12, 14, 16 and 17 build their models from it
    (``notebooks/01_profile_baseline.ipynb`` first).

    Args:
        preset: a name of ``PRESETS``: ``"tiny"``, ``"llama-3.2-1b"``, ``"llama-3.1-8b"`` or
            ``"llama-3.1-70b"``.
        **overrides: ``LlamaConfig`` settings that replace the preset's.

    Returns:
        A fresh ``LlamaConfig``.

    Raises:
        ValueError: ``preset`` is not a name of ``PRESETS``.
    """
    if not isinstance(preset, str) or preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    return PRESETS[preset](**overrides)


def count_parameters(config: LlamaConfig) -> int:
    """Parameters of a ``LlamaForCausalLM`` with this configuration, counted from the shapes (tied
    weights once).

    Chapters 01, 12 and 14 size models and memory with it (``notebooks/01_profile_baseline.ipynb``).

    Args:
        config: a ``LlamaConfig`` (attention and MLP biases, grouped-query heads and ``head_dim``
            are read from it).

    Returns:
        The number of parameters, without building the model.
    """
    h, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q_out = config.num_attention_heads * head_dim
    kv_out = config.num_key_value_heads * head_dim
    attention = h * q_out + 2 * h * kv_out + q_out * h
    mlp = 3 * h * inter
    norms = 2 * h
    if getattr(config, "attention_bias", False):
        attention += q_out + 2 * kv_out + h
    if getattr(config, "mlp_bias", False):
        mlp += 2 * inter + h
    per_layer = attention + mlp + norms
    embeddings = vocab * h * (1 if config.tie_word_embeddings else 2)
    return config.num_hidden_layers * per_layer + embeddings + h  # + the final norm


__all__ = ["PRESETS", "llama_config", "count_parameters"]
