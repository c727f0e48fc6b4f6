"""``patch_llama(model, attention=True)``: Llama's attention through our FlashAttention, packed batches included.

A packed batch of independent examples must train like the examples one by one: the same loss (weighted by label
counts) and the same gradients, whether the boundaries come as restarting position ids or as the collator's
``cu_seq_lens_q``. Tiny float32 model, a few short examples: the interpreter runs every attention call.
"""

import json

import pytest
import torch

from kernels import patch_llama, runtime
from kernels.hf import attention as hf_attention
from kernels.hf.attention import IMPLEMENTATION, attention_choice
from kernels.reference import relative_error
from kernels.training.models import build_model, llama_config

LENGTHS = (9, 1, 17, 6)  # one example of a single token: it has no label to predict, only a position


def _model(seed):
    # One decoder layer of the tiny preset: every attention call runs in the interpreter, and one layer already
    # mixes the examples if a boundary leaks (the embedding of one example reaches the next one's logits).
    return build_model(llama_config("tiny", num_hidden_layers=1), dtype=torch.float32, seed=seed)


def _examples(gen, vocab):
    return [torch.randint(0, vocab, (n,), generator=gen) for n in LENGTHS]


def _grads(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def _alone(model, examples):
    # Sum of the per-example summed losses and the gradient of that sum, one example per forward.
    model.zero_grad()
    total, count = 0.0, 0
    for ids in examples:
        if len(ids) < 2:
            continue
        out = model(input_ids=ids[None].to(runtime.device()), labels=ids[None].to(runtime.device()))
        n = len(ids) - 1
        (out.loss * n).backward()
        total, count = total + out.loss.item() * n, count + n
    return total, count, _grads(model)


def _packed(model, examples, flash_kwargs: bool):
    from transformers import DataCollatorWithFlattening

    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    batch = collator([{"input_ids": ids.tolist()} for ids in examples])
    batch = {k: (v.to(runtime.device()) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    model.zero_grad()
    out = model(**batch)
    count = int((batch["labels"][:, 1:] != -100).sum())
    (out.loss * count).backward()
    return out.loss.item() * count, count, _grads(model), batch


@pytest.mark.parametrize("flash_kwargs", [False, True])
def test_packed_batch_trains_like_examples_one_by_one(gen, flash_kwargs):
    model = _model(1)
    examples = _examples(gen, model.config.vocab_size)
    calls = []
    forward = hf_attention.flash_attention_forward

    def counting(*args, **kwargs):
        calls.append(("cu_seq_lens_q" in kwargs, kwargs.get("position_ids") is not None))
        return forward(*args, **kwargs)

    patch = patch_llama(model, kernels=(), attention=True)
    try:
        from transformers import AttentionInterface

        AttentionInterface.register(IMPLEMENTATION, counting)
        assert patch.kernels == ("attention",) and "Triton flash_attention, asked for" in patch.summary()
        alone_loss, alone_count, alone_grads = _alone(model, examples)
        packed_loss, packed_count, packed_grads, batch = _packed(model, examples, flash_kwargs)
    finally:
        patch.undo()
    assert batch["input_ids"].shape == (1, sum(LENGTHS))
    assert calls and all(c[0] == flash_kwargs or not c[0] for c in calls)
    assert packed_count == alone_count
    assert abs(packed_loss - alone_loss) <= 1e-5 * abs(alone_loss)
    assert packed_grads.keys() == alone_grads.keys()
    for name, g in alone_grads.items():
        assert relative_error(packed_grads[name], g) < 1e-4, name
    assert model.config._attn_implementation == "sdpa"


def test_packed_batch_differs_without_the_boundaries(gen):
    # The check above can fail: attending across examples (SDPA's plain causal over the packed row) changes the loss.
    model = _model(1)
    examples = _examples(gen, model.config.vocab_size)
    ids = torch.cat(examples)[None].to(runtime.device())
    with patch_llama(model, kernels=(), attention=True):
        with torch.no_grad():
            positions = torch.cat([torch.arange(n) for n in LENGTHS])[None].to(runtime.device())
            packed = model(input_ids=ids, position_ids=positions).logits
            plain = model(input_ids=ids).logits
    assert relative_error(plain[:, LENGTHS[0]:], packed[:, LENGTHS[0]:]) > 1e-3
    assert relative_error(plain[:, :LENGTHS[0]], packed[:, :LENGTHS[0]]) < 1e-5  # the first example sees the same


def test_padded_batch_runs_sdpa_and_matches(gen):
    # A batch with a padding mask keeps transformers' mask and SDPA: the same logits as the unpatched model.
    model = _model(2)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=gen).to(runtime.device())
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding: the kernel would be wrong here, SDPA with the mask is right
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
        with patch_llama(model, attention=True, kernels=("rms_norm",)):
            got = model(input_ids=ids, attention_mask=mask).logits
            plain = model(input_ids=ids).logits
        plain_expected = model(input_ids=ids).logits
    assert relative_error(got[mask.bool()], expected[mask.bool()]) < 1e-5
    assert relative_error(plain, plain_expected) < 1e-5


def test_trainer_with_flattening_collator(tmp_path, gen):
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    model = _model(3)
    data = [{"input_ids": torch.randint(0, 2048, (int(n),), generator=gen).tolist()}
            for n in torch.randint(2, 16, (4,), generator=gen)]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, report_to=[],
                             logging_steps=1, use_cpu=runtime.MODE != "gpu", save_strategy="no", learning_rate=1e-3)
    with patch_llama(model, kernels=(), attention=True):
        trainer = Trainer(model=model, args=args, train_dataset=data,
                          data_collator=DataCollatorWithFlattening(return_flash_attn_kwargs=True))
        result = trainer.train()
    assert result.global_step == 2 and torch.isfinite(torch.tensor(result.training_loss))


def test_summary_and_choice(tmp_path):
    model = _model(0)
    with patch_llama(model) as patch:  # the default: SDPA in the interpreter, and the summary says why
        assert "attention" not in patch.kernels and "attention: sdpa" in patch.summary()
    with patch_llama(model, attention=False) as patch:
        assert "attention: sdpa (attention=False)" in patch.summary()
    assert attention_choice("GPU X", tmp_path)[0] is False
    row = {"seq": 2048, "ms": {"ours": 2.0, "sdpa_flash": 4.0, "sdpa_cudnn": 2.5}}
    (tmp_path / "a.json").write_text(json.dumps({"device": "GPU X", "rows": [row]}))
    use, why = attention_choice("GPU X", tmp_path)
    assert use and "a.json" in why
    row2 = {"seq": 8192, "ms": {"ours": 8.0, "sdpa_flash": 13.0, "sdpa_cudnn": 7.5}}
    (tmp_path / "a.json").write_text(json.dumps({"device": "GPU X", "rows": [row, row2]}))
    use, why = attention_choice("GPU X", tmp_path)
    assert not use and "seq 8192" in why


def test_refuses_other_attention():
    model = _model(0)
    model.config._attn_implementation = "eager"
    with pytest.raises(ValueError, match="attention=True replaces SDPA attention"):
        patch_llama(model, attention=True)


@pytest.mark.parametrize(
    ("offsets", "message"),
    [
        ([2, 5, 12], "rise from 0"),  # not from 0: was accepted
        ([0, 5, 9], "rise from 0"),  # ending before the sequence: was an IndexError inside segment_bounds
        ([0, 4, 12], "disagree"),  # other documents than the position ids': the offsets won silently
    ],
)
def test_collator_offsets_are_checked_like_flash_attentions(offsets, message, gen):
    device = runtime.device()
    q, k, v = (torch.randn(1, 2, 12, 16, generator=gen).to(device) for _ in range(3))
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]], device=device)
    module = torch.nn.Module()
    cu = torch.tensor(offsets, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=message):
        hf_attention.flash_attention_forward(module, q, k, v, None, is_causal=True, cu_seq_lens_q=cu,
                                             position_ids=positions)
    # Without position ids, the same offsets are refused as flash_attention refuses them (the last pair is right).
    if message != "disagree":
        with pytest.raises(ValueError, match=message):
            hf_attention.flash_attention_forward(module, q, k, v, None, is_causal=True, cu_seq_lens_q=cu)
    good = torch.tensor([0, 5, 12], dtype=torch.int32, device=device)
    out, _ = hf_attention.flash_attention_forward(module, q, k, v, None, is_causal=True, cu_seq_lens_q=good,
                                                  position_ids=positions)
    alone, _ = hf_attention.flash_attention_forward(module, q, k, v, None, is_causal=True, cu_seq_lens_q=good)
    assert torch.equal(out, alone)
