"""Llama's attention through the workbook's FlashAttention (``patch_llama(model, attention=True)``),
packed batches included.

The change is scoped to one model, the way ``kernels.hf.attention_mask`` scopes its masks: it
registers an attention implementation, ``"kernels_flash_attention"``, with transformers (the
attention function below and a mask function) and points the model's config at it; the returned
function points it back.

**Packed batches.** Independent examples packed into one row train as if each were alone when no
query attends across an example's boundary. Two ways of saying where the boundaries are reach the
attention function:

* ``cu_seq_lens_q`` (int32 [n_docs + 1]), which
  ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` adds to the batch and the model
  passes through to attention: the document offsets (batch 1). The collator writes position ids that
  restart with each document too, and rotary embeddings already read those: the kernel takes its
  boundaries from the position ids, and offsets that do not rise from 0 to the sequence's length, or
  that disagree with the position ids, raise a ValueError. The check reads both to the host once per
  offsets tensor (every layer of one forward receives the same one), never while ``torch.compile``
  traces. Without position ids the offsets, checked the same way, give the boundaries;
* ``position_ids`` restarting at 0 in each example (``DataCollatorWithFlattening``'s default, or a
  caller's own packing): each row's documents are its runs of consecutive positions
  (``segment_bounds_from_positions``), so a batch of several packed rows works too. The model always
  passes position ids; a row of 0, 1, 2, ... is one document, the plain causal case.

Apart from that check, no host synchronisation: the boundaries become each token's document bounds
with tensor operations.

**The mask.** Transformers builds a [seq, seq] mask for packed rows (it detects the restarting
positions). Our kernel needs none, so the registered mask function returns None whenever the caller
gave no padding mask and the mask asked for is the full causal one (as many keys as queries, no
offset, no sliding window); otherwise it is transformers' ``sdpa_mask``, and a call that receives a
mask (padding, a cache during generation), dropout, or a dtype or head size the kernel does not take
runs transformers' SDPA attention instead, unchanged. A padded batch is therefore still correct,
just not ours.

**Whether it is on by default** comes from measurements, not from this file: ``attention_choice``
reads the recorded attention benchmark for this GPU (``python -m kernels.bench.attention --record``,
files in ``assets/results/attention/``) and turns ours on only where it was measured at least as
fast as SDPA's flash and cuDNN kernels at every length. The patch's ``summary()`` says which
attention runs and why.
"""

from __future__ import annotations

import inspect
import json
import weakref
from collections.abc import Callable
from pathlib import Path

import torch

from .. import runtime
from ..attention import (
    DTYPES,
    HEAD_DIMS,
    check_cu_seqlens,
    flash_attention,
    segment_bounds,
    segment_bounds_from_positions,
)

IMPLEMENTATION = "kernels_flash_attention"
RESULTS_DIR = Path(__file__).resolve().parents[2] / "assets" / "results" / "attention"
# the attention SDPA would run instead: ours must be no slower than either
PEERS = ("sdpa_flash", "sdpa_cudnn")


def _sdpa_mask_arguments(args: tuple, kwargs: dict) -> dict:
    from transformers.masking_utils import sdpa_mask

    return inspect.signature(sdpa_mask).bind(*args, **kwargs).arguments


def packed_causal_mask(*args, **kwargs) -> torch.Tensor | None:
    """transformers' SDPA mask function (same arguments), returning None where the kernel needs no
    mask: no padding mask given, as many keys as queries from the same start, no sliding window.
    Packed rows' boundaries come to the kernel through the position ids instead. Chapter 16
    (``notebooks/16_flash_attention.ipynb``) registers it with the attention.

    Args:
        *args, **kwargs: those of transformers' ``sdpa_mask``, whichever of its signatures is
            installed.

    Returns:
        None where the kernel needs no mask; otherwise what ``sdpa_mask`` returns (the call then
        runs SDPA, ``kernel_applies``).
    """
    from transformers.masking_utils import sdpa_mask

    a = _sdpa_mask_arguments(args, kwargs)
    q_length = a["q_length"] if "q_length" in a else a["cache_position"].shape[0]
    if (a.get("attention_mask") is None and a.get("local_size") is None and a.get("kv_offset", 0) == 0
            and a.get("q_offset", 0) == 0 and q_length == a["kv_length"]):
        return None
    return sdpa_mask(*args, **kwargs)


def kernel_applies(query: torch.Tensor, key: torch.Tensor, attention_mask, dropout: float) -> bool:
    """Whether this call can run our kernel: no mask to apply, no dropout, self-attention over one
    length, and a dtype and head size the kernel takes. Otherwise the call runs SDPA.

    Args:
        query: [batch, heads, seq, head_dim].
        key: [batch, kv_heads, kv_seq, head_dim].
        attention_mask: the mask transformers passes (None where ``packed_causal_mask`` made none).
        dropout: the attention dropout probability.

    Returns:
        True when the kernel can run this call.
    """
    return (attention_mask is None and not dropout and query.shape[2] == key.shape[2] and query.shape[2] > 0
            and query.dtype in DTYPES and query.shape[-1] in HEAD_DIMS)


def flash_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0,
                            scaling: float | None = None,
                            is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """An attention function of transformers' registry: query [batch, heads, seq, head_dim], key and
    value with the KV heads (not repeated); returns ([batch, seq, heads, head_dim], None) as
    ``sdpa_attention_forward`` does. Chapter 16 (``notebooks/16_flash_attention.ipynb``) patches it
    in as ``attention=True``.

    Args:
        module: the attention module calling (its ``is_causal`` is read when ``is_causal`` is None).
        query: [batch, heads, seq, head_dim].
        key, value: [batch, kv_heads, seq, head_dim].
        attention_mask: None for the kernel; a mask sends the call to SDPA.
        dropout: the dropout probability; nonzero sends the call to SDPA.
        scaling: the softmax scale (None: ``head_dim ** -0.5``).
        is_causal: whether attention is causal (None: the module's ``is_causal``, else True).
        **kwargs: passed to SDPA when it runs; the kernel reads ``position_ids`` (packed rows: each
            document's positions restart at 0) and ``cu_seq_lens_q`` (document offsets of one row).

    Returns:
        ``(output, None)``, the output [batch, seq, heads, head_dim].

    Raises:
        ValueError: ``cu_seq_lens_q`` are not offsets of the single row (``check_offsets``).
    """
    if not kernel_applies(query, key, attention_mask, dropout):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    cu_seqlens, position_ids = kwargs.get("cu_seq_lens_q"), kwargs.get("position_ids")
    if cu_seqlens is not None:
        check_offsets(cu_seqlens, position_ids, query)
    if cu_seqlens is not None and position_ids is None:
        out = flash_attention(query, key, value, causal, scaling, cu_seqlens=cu_seqlens.to(torch.int32),
                              check_cu_seqlens_values=False)  # check_offsets read them
    elif position_ids is not None:
        out = flash_attention(query, key, value, causal, scaling, position_ids=position_ids)
    else:
        out = flash_attention(query, key, value, causal, scaling)
    return out.transpose(1, 2), None  # [batch, seq, heads, head_dim], contiguous already


# the offsets tensor checked last (a weak reference) and its version counter then
_CHECKED: list = [None, -1]


def check_offsets(cu_seqlens, position_ids, query: torch.Tensor) -> None:
    """Raise a ``ValueError`` unless ``cu_seq_lens_q`` are document offsets of ``query``'s single
    row: an integer 1-D tensor rising from 0 to the sequence's length, and, where ``position_ids``
    are given, the same documents as their runs of consecutive positions. Reads both to the host
    once per offsets tensor (the same tensor reaches every layer); nothing while ``torch.compile``
    traces.

    Args:
        cu_seqlens: the ``cu_seq_lens_q`` transformers passes.
        position_ids: the call's position ids, or None.
        query: [batch, heads, seq, head_dim], whose batch must be 1.

    Raises:
        ValueError: the offsets are not a 1-D integer tensor rising from 0 to the length, the batch
            is not 1, or the offsets and the position ids disagree on the documents.
    """
    if torch.compiler.is_compiling():
        return
    last, version = _CHECKED
    if last is not None and last() is cu_seqlens and version == cu_seqlens._version:
        return
    if (not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2
            or cu_seqlens.is_floating_point() or cu_seqlens.is_complex() or cu_seqlens.dtype == torch.bool):
        got = (f"{cu_seqlens.dtype} tensor of shape {tuple(cu_seqlens.shape)}" if isinstance(cu_seqlens, torch.Tensor)
               else type(cu_seqlens).__name__)
        raise ValueError(f"cu_seq_lens_q must be a 1-D integer tensor of document offsets [0, ..., seq], got {got}")
    if query.shape[0] != 1:
        raise ValueError(f"cu_seq_lens_q packs documents along one row: the batch must be 1, got {query.shape[0]}")
    seq = query.shape[2]
    try:
        check_cu_seqlens(cu_seqlens, seq)
    except ValueError as err:
        raise ValueError(f"cu_seq_lens_q: {err}") from None
    if position_ids is not None:
        from_offsets = segment_bounds(cu_seqlens.to(torch.int32), seq)[0]
        from_positions = segment_bounds_from_positions(position_ids.expand(1, seq))[0]
        if not torch.equal(from_offsets.cpu(), from_positions.cpu()):
            raise ValueError(f"cu_seq_lens_q {cu_seqlens.tolist()[:12]} and position_ids disagree on where the "
                             "documents start (position ids restart at each document's first token): pass "
                             "offsets that match the positions, or only the position ids")
    _CHECKED[:] = [weakref.ref(cu_seqlens), cu_seqlens._version]


def check_attention(model: torch.nn.Module) -> None:
    """Raise (ValueError) unless ``patch_llama(model, attention=True)`` applies: SDPA attention in
    the config (the implementation it replaces), a head size the kernel takes, transformers'
    attention and mask registries.

    Args:
        model: the model about to be patched.

    Raises:
        ValueError: any of those is missing.
    """
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current != "sdpa":
        raise ValueError(f"attention=True replaces SDPA attention (config._attn_implementation 'sdpa'), got "
                         f"{current!r}: load the model with attn_implementation='sdpa', or leave attention off")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"attention=True needs a head_dim in {HEAD_DIMS}, this model's is {head_dim}")
    try:
        from transformers import AttentionInterface  # noqa: F401
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: F401
    except ImportError as err:
        raise ValueError(f"attention=True needs transformers' AttentionInterface and AttentionMaskInterface ({err})"
                         ) from None


def use_flash_attention(model: torch.nn.Module) -> Callable[[], None]:
    """Point ``model``'s attention at ``"kernels_flash_attention"``; returns the function that
    points it back (``check_attention`` first). Chapter 16 (``notebooks/16_flash_attention.ipynb``)
    patches with it.

    Args:
        model: a Hugging Face model with SDPA attention; its config is changed in place.

    Returns:
        The undo: it restores the previous attention implementation, and raises ``RuntimeError``
        if the config's implementation was changed again in between.

    Raises:
        ValueError: ``check_attention`` refuses the model.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    check_attention(model)
    AttentionInterface.register(IMPLEMENTATION, flash_attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, packed_causal_mask)
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = IMPLEMENTATION

    def restore() -> None:
        if config._attn_implementation != IMPLEMENTATION:
            raise RuntimeError(f"cannot undo: the model's attention implementation was changed to "
                               f"{config._attn_implementation!r} after the patch")
        config._attn_implementation = previous

    return restore


def _recorded(device_name: str, results_dir: Path) -> dict | None:
    # The newest recorded benchmark of this GPU model, or None.
    for path in sorted(results_dir.glob("*.json"), reverse=True):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if data.get("device") == device_name and data.get("rows"):
            return data | {"file": path.name}
    return None


def attention_choice(device_name: str | None = None, results_dir: Path = RESULTS_DIR) -> tuple[bool, str]:
    """``(use_ours, why)``: whether ``patch_llama``'s default turns our attention on for
    ``device_name`` (this GPU), from the recorded attention benchmark: on only where ours (dense,
    causal) was at least as fast as SDPA's flash and cuDNN kernels at every length measured. In the
    interpreter, and on a GPU with no recorded run, it stays off. Chapter 16
    (``notebooks/16_flash_attention.ipynb``) reads its verdict.

    Args:
        device_name: the GPU's name as the benchmark records it (None: this process's GPU).
        results_dir: the folder of recorded attention benchmarks (JSON files, newest name last).

    Returns:
        ``(use_ours, why)``: the verdict and a line saying which file decided it and how.
    """
    if device_name is None:
        if runtime.MODE != "gpu":
            return False, "sdpa: Triton's interpreter (timings there mean nothing)"
        try:
            device_name = runtime.device_name()
        # gpu mode where no CUDA device answers (a simulated GPU in tests)
        except (AssertionError, RuntimeError):
            return False, "sdpa: no CUDA device to look up a recorded run for"
    data = _recorded(device_name, results_dir)
    if data is None:
        return False, f"sdpa: not measured on this device ({device_name}; no run in assets/results/attention/)"
    slower = []
    for row in data["rows"]:
        ms = row["ms"]
        best = min((ms[p] for p in PEERS if ms.get(p) is not None), default=None)
        if ms.get("ours") is None or (best is not None and ms["ours"] > best):
            slower.append(f"seq {row['seq']}: {ms.get('ours')} against {best} ms")
    if slower:
        return False, f"sdpa: ours not measured faster on this device ({data['file']}: {'; '.join(slower)})"
    return True, f"ours: measured no slower than SDPA flash and cuDNN at every length ({data['file']})"
