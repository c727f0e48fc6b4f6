"""When a causal language model's padding mask can be left out, and what leaving it out saves.

A fine-tuning batch pads each row to the batch's length and passes ``attention_mask`` (1 for a real
token, 0 for padding). Given a mask, Hugging Face's Llama builds a 4-D mask of [batch, 1, seq, seq]
for scaled-dot-product attention: memory that grows with the square of the length, and a mask that
keeps PyTorch from choosing its fastest (flash) attention kernel. Without a mask it passes
``is_causal=True`` instead and builds nothing.

For a causal model the mask is redundant when every row is *right-padded* (its real tokens first,
then only padding) and no padded position carries a label:

* a real token at position i attends to positions 0..i, all real, with or without the mask;
* a padded position attends to whatever precedes it and so computes a different (meaningless)
  output, but its label is ``ignore_index``: it adds nothing to the loss, and so nothing to any
  gradient.

The loss and every gradient are the same; only the padded positions' logits differ. A left-padded
row (padding first, as generation uses) or a row with a hole in the middle is not covered, and keeps
its mask.

``drop_padding_mask(batch)`` leaves the mask out where it may go; ``DropRedundantMask`` does it as a
data collator, for Hugging Face's ``Trainer``.
"""

from __future__ import annotations

import torch

# The label Hugging Face's loss and F.cross_entropy skip (kernels.training.data marks prompt and
# padding with it).
IGNORE_INDEX = -100


def mask_is_redundant(batch: dict[str, torch.Tensor], ignore_index: int = IGNORE_INDEX) -> bool:
    """True when ``batch["attention_mask"]`` changes nothing a causal model's loss sees: every row's
    zeros come after all its ones (right padding), and every padded position's label is
    ``ignore_index``. A batch with no mask, or with no padding at all, is trivially so.

    Chapter 10 (``notebooks/10_linear_cross_entropy.ipynb``) checks its batches with it.

    Args:
        batch: a collated batch: ``input_ids``, and optionally ``attention_mask`` ([batch, seq]) and
            ``labels`` (the same shape).
        ignore_index: the label the loss skips.

    Returns:
        Whether the mask can be left out without changing the loss or any gradient.

    Raises:
        ValueError: ``attention_mask`` is not two-dimensional.
    """
    mask = batch.get("attention_mask")
    if mask is None:
        return True
    if mask.dim() != 2:
        raise ValueError(f"attention_mask must be [batch, seq], got shape {tuple(mask.shape)}")
    real = mask.bool()
    # Right padding: once a row has seen a zero it sees no more ones, i.e. the running minimum
    # equals the mask.
    right_padded = bool((real == real.cummin(dim=1).values).all())
    labels = batch.get("labels")
    padded_labels_ignored = labels is None or bool((labels[~real] == ignore_index).all())
    return right_padded and padded_labels_ignored


def drop_padding_mask(batch: dict[str, torch.Tensor], ignore_index: int = IGNORE_INDEX) -> dict[str,
                                                                                                torch.Tensor]:
    """``batch`` without its ``attention_mask`` when ``mask_is_redundant`` says it may go; otherwise
    ``batch`` itself, unchanged. Call it on the CPU copy of a batch: the check reads the whole mask
    (on a GPU that would be a host synchronisation per batch).

    Chapter 10 (``notebooks/10_linear_cross_entropy.ipynb``) drops its batches' masks with it.

    Args:
        batch: a collated batch, as ``mask_is_redundant`` takes it.
        ignore_index: the label the loss skips.

    Returns:
        A new dict without ``attention_mask``, or ``batch`` itself when the mask must stay (or there
        is none).

    Raises:
        ValueError: ``attention_mask`` is not two-dimensional.
    """
    if "attention_mask" not in batch or not mask_is_redundant(batch, ignore_index):
        return batch
    return {k: v for k, v in batch.items() if k != "attention_mask"}


class DropRedundantMask:
    """A data collator: ``collator``'s batch, without its ``attention_mask`` where
    ``drop_padding_mask`` may drop it. For Hugging Face's ``Trainer(...,
    data_collator=DropRedundantMask())``: the check runs in the data loader, on the CPU tensors the
    collator made, so it costs no host synchronisation.

    Args:
        collator: the collator to wrap (default: transformers' ``default_data_collator``, which
            stacks rows that are already padded).
        ignore_index: the label the loss skips, for ``drop_padding_mask``.
    """

    def __init__(self, collator=None, ignore_index: int = IGNORE_INDEX):
        if collator is None:
            from transformers import default_data_collator as collator
        self.collator = collator
        self.ignore_index = ignore_index

    def __call__(self, features):
        return drop_padding_mask(self.collator(features), self.ignore_index)


def attention_mask_bytes(batch_size: int, seq_len: int, itemsize: int = 1) -> int:
    """Bytes of the [batch, 1, seq, seq] mask Hugging Face builds from a padding mask (boolean: 1
    byte each). PyTorch's memory-efficient attention kernel, the one that accepts a mask, turns it
    into an additive mask of the activation dtype when it runs (2 bytes each in bf16): pass
    ``itemsize=2`` for that copy. Chapter 10 (``notebooks/10_linear_cross_entropy.ipynb``) sizes the
    mask it saves with it.

    Args:
        batch_size: rows of the batch.
        seq_len: the padded length of each row.
        itemsize: bytes per mask element (1 for the boolean mask, 2 for its bf16 additive copy).

    Returns:
        ``batch_size * seq_len * seq_len * itemsize``.
    """
    return batch_size * seq_len * seq_len * itemsize
