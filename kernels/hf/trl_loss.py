"""Training with TRL's ``SFTTrainer`` on the patched loss.

TRL's ``SFTTrainer`` does not ask the model for its loss: it adds a fused LM head of its own to the
model (a chunked log-probability kernel over the positions that count) and computes the loss from
its per-token log-probabilities. A model patched by ``kernels.patch_llama`` therefore trains under
it with TRL's loss, and the patched loss is never called; only the swapped norms act. To train with
the patched loss (the fused cross-entropy, or the linear cross-entropy without logits), put
``ModelLossMixin`` before the trainer class:

    from trl import SFTTrainer
    from kernels.hf.trl_loss import ModelLossMixin

    class KernelsSFTTrainer(ModelLossMixin, SFTTrainer):
        pass

    patch = kernels.patch_llama(model, linear_cross_entropy=True) trainer =
    KernelsSFTTrainer(model=model, args=SFTConfig(...), train_dataset=...,
    processing_class=tokenizer)

The loss is then computed as ``transformers.Trainer`` computes it, by the model (with the labels
TRL's collator makes and the ``num_items_in_batch`` of gradient accumulation): the same loss, so the
same training. What the mixin gives up is TRL's per-token metrics that come out of its fused head
(``entropy`` and ``mean_token_accuracy`` in the logs); everything else of ``SFTTrainer`` (datasets,
packing, collators, PEFT) is unchanged.
"""

from __future__ import annotations


class ModelLossMixin:
    """Mixed into a ``transformers.Trainer`` subclass (first among the bases): the training loss is
    the model's own loss, as ``transformers.Trainer.compute_loss`` computes it, instead of the
    subclass's.

    Chapter 10 (``notebooks/10_linear_cross_entropy.ipynb``) trains the patched loss under TRL with
    it.
    """

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The model's own loss on ``inputs``, by ``transformers.Trainer.compute_loss``.

        Args:
            model: the (patched) model the trainer trains.
            inputs: the batch from the trainer's collator, with its ``labels``.
            return_outputs: also return the model's outputs, as ``transformers.Trainer`` does.
            num_items_in_batch: the tokens that count across gradient accumulation, passed on to the
                model's loss.

        Returns:
            The loss, or ``(loss, outputs)`` with ``return_outputs``.
        """
        from transformers import Trainer

        return Trainer.compute_loss(self, model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)
