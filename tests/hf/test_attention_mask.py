"""The padding mask as one additive bias (``patch_llama(..., additive_mask=True)``): the same losses and gradients as
the boolean mask, one tensor shared by every layer, only for half-precision SDPA models, undoable; on a GPU, the
per-layer copies it saves."""

import pytest
import torch

from kernels.hf import attention_mask
from kernels.hf.attention_mask import IMPLEMENTATION, additive_sdpa_mask
from kernels.hf.patch import patch_llama
from kernels.reference import relative_error
from kernels.training.models import build_model


def masked_batch(vocab, gen, device, rows=2, seq=24):
    """Left padding in row 0 and a hole in row 1 (if any): a mask no causal shortcut can replace."""
    ids = torch.randint(0, vocab, (rows, seq), generator=gen)
    mask = torch.ones(rows, seq, dtype=torch.long)
    mask[0, :5] = 0
    if rows > 1:
        mask[1, 9:12] = 0
    labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
    return {k: v.to(device) for k, v in dict(input_ids=ids, attention_mask=mask, labels=labels).items()}


def masks_seen(model):
    """Record the attention_mask every attention module receives; returns (list, remove)."""
    seen = []
    handles = [layer.self_attn.register_forward_pre_hook(lambda m, a, k: seen.append(k.get("attention_mask")),
                                                         with_kwargs=True) for layer in model.model.layers]
    return seen, lambda: [h.remove() for h in handles]


def loss_and_grads(model, batch):
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_the_bias_gives_the_boolean_masks_losses_and_gradients(device, gen, monkeypatch):
    # float32 so the comparison is tight: let the bias be built for float32 too.
    monkeypatch.setattr(attention_mask, "HALF_DTYPES", (torch.float32,))
    model = build_model("tiny", dtype=torch.float32, seed=0).to(device).train()
    batch = masked_batch(model.config.vocab_size, gen, device)
    loss_ref, grads_ref = loss_and_grads(model, batch)
    seen, remove = masks_seen(model)
    with patch_llama(model, rms_norm=False, cross_entropy=False, additive_mask=True):
        loss, grads = loss_and_grads(model, batch)
    remove()
    # -inf, as SDPA converts booleans: row 0's left padding makes fully masked rows, and the first real token's
    # label is predicted at the last of them, so any other value would change the loss.
    assert seen[0].dtype == torch.float32 and seen[0].min() == float("-inf")
    assert relative_error(loss, loss_ref) < 1e-6
    assert max(relative_error(grads[n], grads_ref[n]) for n in grads) < 1e-5


def test_a_half_precision_model_gets_one_bias_for_every_layer(device, gen):
    model = build_model("tiny", dtype=torch.bfloat16, seed=0).to(device).train()
    batch = masked_batch(model.config.vocab_size, gen, device)
    seen, remove = masks_seen(model)
    model(**batch)
    assert all(m.dtype == torch.bool for m in seen)  # Hugging Face's: booleans, copied by each SDPA call
    seen.clear()
    with patch_llama(model, additive_mask=True) as patch:
        assert "additive bias" in patch.summary()
        model(**batch)
        assert all(m is seen[0] for m in seen) and seen[0].dtype == torch.bfloat16
        allowed = seen[0] == 0
        assert not allowed[0, 0, 10, :5].any() and allowed[0, 0, 10, 5:11].all() and not allowed[0, 0, 10, 11:].any()
        assert not allowed[1, 0, 15, 9:12].any() and allowed[1, 0, 15, 12:16].all()
        seen.clear()
        model(input_ids=batch["input_ids"], labels=batch["labels"])  # no mask: SDPA's causal flag, no tensor at all
        assert all(m is None for m in seen)
    remove()


def test_float32_keeps_the_boolean_mask():
    # A float32 bias would be 4 bytes per element against 1 + the copy's.
    padding = torch.tensor([[False, True, True, True, True, True]])
    mask = additive_sdpa_mask(batch_size=1, q_length=6, kv_length=6, attention_mask=padding, dtype=torch.float32)
    assert mask.dtype == torch.bool
    bias = additive_sdpa_mask(batch_size=1, q_length=6, kv_length=6, attention_mask=padding, dtype=torch.bfloat16)
    assert bias.dtype == torch.bfloat16 and torch.equal(bias == 0, mask) and torch.isneginf(bias[~mask]).all()


def test_refused_without_sdpa_and_undone_exactly():
    model = build_model("tiny", dtype=torch.float32, seed=0)
    model.config._attn_implementation = "eager"
    with pytest.raises(ValueError, match="needs SDPA attention"):
        patch_llama(model, additive_mask=True)
    assert "_kernels_patch" not in model.__dict__ and type(model.model.norm).__name__ == "LlamaRMSNorm"
    model.config._attn_implementation = "sdpa"
    patch = patch_llama(model, additive_mask=True)
    assert model.config._attn_implementation == IMPLEMENTATION
    model.config._attn_implementation = "eager"
    with pytest.raises(RuntimeError, match="changed to 'eager' after the patch"):
        patch.undo()
    assert patch.active and type(model.model.norm).__name__ == "TritonRMSNorm"  # the refusal changed nothing
    model.config._attn_implementation = IMPLEMENTATION
    patch.undo()
    assert model.config._attn_implementation == "sdpa" and not patch.active


@pytest.mark.gpu
def test_gpu_the_bias_saves_a_copy_per_layer(gen):
    # One left-padded row of 4,096 tokens, 4 layers: each SDPA call on booleans keeps a [4,096, 4,096] bf16 copy
    # (32 MiB) for its backward; with the bias, every layer keeps the same one. (On an H200 the forward held
    # exactly 3 copies' worth less: 4 copies and the booleans, against the bias and 16 MiB more.)
    model = build_model("tiny", dtype=torch.bfloat16, seed=0).to("cuda").train()
    seq, layers = 4096, model.config.num_hidden_layers
    batch = masked_batch(model.config.vocab_size, gen, "cuda", rows=1, seq=seq)

    def held_after_forward():
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = model(**batch)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        out.loss.backward()
        model.zero_grad(set_to_none=True)
        return held

    plain = held_after_forward()
    with patch_llama(model, rms_norm=False, cross_entropy=False, additive_mask=True):
        bias = held_after_forward()
    copy = seq * seq * 2
    assert plain - bias >= (layers - 1) * copy, f"saved {(plain - bias) / 2**20:.0f} MiB, a copy is {copy / 2**20:.0f}"
