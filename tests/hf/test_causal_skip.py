"""The causal mask under torch.compile (``patch_llama``'s ``skip_causal_mask``): a call without mask, positions
or cache reaches SDPA as ``is_causal`` with shared key/value heads, in the compiled graph itself; any call that may
need a mask (packed sequences, padding) still gets one; same losses and gradients; undoable."""

import inspect

import pytest
import torch
import torch.nn.functional as F

from kernels import runtime
from kernels.hf.attention_mask import CAUSAL_CALL, CAUSAL_IMPLEMENTATION, causal_skip_sdpa_mask, is_plain_causal_call
from kernels.hf.patch import patch_llama
from kernels.reference import relative_error
from kernels.training.loop import enable_checkpointing
from kernels.training.models import build_model

BACKEND = runtime.COMPILE_BACKEND
NORM_AND_LOSS = ("rms_norm", "cross_entropy")
WITH_SKIP = (*NORM_AND_LOSS, "skip_causal_mask")

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def attention_calls_in_graph(model, **batch):
    """Compile ``model`` with a backend that reads Dynamo's graph before running it eagerly; returns, for each SDPA
    call in it, (has a mask, is_causal, enable_gqa)."""
    calls = []

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target is F.scaled_dot_product_attention:
                calls.append((node.kwargs.get("attn_mask") is not None, node.kwargs.get("is_causal", False),
                              node.kwargs.get("enable_gqa", False)))
        return gm.forward

    torch.compile(model, backend=backend, fullgraph=True)(**batch)
    return calls


def tiny(device, dtype=torch.float32):
    return build_model("tiny", dtype=dtype, seed=0).to(device).train()


def loss_and_grads(model, batch):
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()}


def test_a_plain_call_compiles_to_causal_attention_with_shared_heads(device, gen):
    model = tiny(device)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=gen).to(device)
    with patch_llama(model, kernels=WITH_SKIP) as patch:
        assert "causal mask: skipped" in patch.summary()
        calls = attention_calls_in_graph(model, input_ids=ids, labels=ids)
    layers = model.config.num_hidden_layers
    # No mask tensor, SDPA's causal flag, and the 2 key/value heads shared by the 4 query heads (not repeated).
    assert calls == [(False, True, True)] * layers
    assert CAUSAL_CALL.plain is False  # reset after the call


@pytest.mark.parametrize("given", ["position_ids", "attention_mask"])
def test_a_call_that_may_need_a_mask_still_gets_one(device, gen, given):
    model = tiny(device)
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=gen).to(device)
    if given == "position_ids":  # two documents packed in one row: each attends only to itself
        extra = torch.cat([torch.arange(10), torch.arange(14)])[None].to(device)
    else:  # left padding
        extra = torch.ones(1, 24, dtype=torch.long, device=device)
        extra[0, :4] = 0
    batch = dict(input_ids=ids, labels=ids, **{given: extra})
    loss_ref, grads_ref = loss_and_grads(model, batch)
    with patch_llama(model, kernels=("skip_causal_mask",)):
        calls = attention_calls_in_graph(model, **batch)
        torch._dynamo.reset()
        loss, grads = loss_and_grads(torch.compile(model, backend=BACKEND), batch)
    assert calls and all(has_mask and not causal for has_mask, causal, _ in calls)
    # Treating this row as one causal sequence would change the loss: it is the packed (or padded) one.
    assert relative_error(loss, loss_ref) < 1e-5
    assert max(relative_error(grads[n], grads_ref[n]) for n in grads) < 1e-4


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_compiled_with_the_skip_trains_like_eager_without_it(device, gen, checkpointing):
    # With checkpointing the layers run again in the backward pass, from the mask (None) the forward built.
    model = tiny(device)
    if checkpointing:
        enable_checkpointing(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=gen).to(device)
    labels = ids.clone()
    labels[:, :5] = -100
    batch = dict(input_ids=ids, labels=labels)
    with patch_llama(model, kernels=NORM_AND_LOSS):
        loss_ref, grads_ref = loss_and_grads(model, batch)
    with patch_llama(model, kernels=WITH_SKIP):
        loss, grads = loss_and_grads(torch.compile(model, backend=BACKEND), batch)
    assert relative_error(loss, loss_ref) < 1e-5
    assert max(relative_error(grads[n], grads_ref[n]) for n in grads) < 1e-4


def test_with_the_additive_mask_a_plain_call_also_skips(device, gen):
    model = tiny(device, torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=gen).to(device)
    with patch_llama(model, kernels=(*NORM_AND_LOSS, "additive_mask", "skip_causal_mask")) as patch:
        assert "additive bias" in patch.summary() and "causal mask: skipped" in patch.summary()
        assert attention_calls_in_graph(model, input_ids=ids, labels=ids) == [(False, True, True)] * 4


@pytest.mark.parametrize("args, kwargs, plain", [
    ((), dict(input_ids=1, labels=2), True),
    (("ids",), dict(labels=2, attention_mask=None), True),
    (("ids", "mask"), {}, False),  # the attention mask by position
    ((), dict(input_ids=1, attention_mask=3), False),
    ((), dict(input_ids=1, position_ids=3), False),
    ((), dict(input_ids=1, past_key_values=3), False),
    ((), dict(input_ids=1, cache_position=3), False),
])
def test_what_makes_a_call_plain_causal(args, kwargs, plain):
    assert is_plain_causal_call(args, kwargs) is plain


def mask_arguments(q_length, kv_length, **kwargs):
    """Keyword arguments of transformers' mask function, whichever signature is installed (q_length, or the older
    cache_position)."""
    from transformers.masking_utils import sdpa_mask

    if "q_length" in inspect.signature(sdpa_mask).parameters:
        return dict(batch_size=1, q_length=q_length, kv_length=kv_length, **kwargs)
    return dict(batch_size=1, cache_position=torch.arange(q_length), kv_length=kv_length, **kwargs)


def test_the_mask_function_skips_only_the_full_causal_mask(monkeypatch):
    monkeypatch.setattr(CAUSAL_CALL, "plain", True)
    assert causal_skip_sdpa_mask(**mask_arguments(6, 6)) is None
    padding = torch.tensor([[False, True, True, True, True, True]])
    for q_length, kv_length, kwargs in ((6, 6, dict(attention_mask=padding)), (6, 6, dict(local_size=3)),
                                        (6, 8, {})):
        mask = causal_skip_sdpa_mask(**mask_arguments(q_length, kv_length, allow_is_causal_skip=False, **kwargs))
        assert mask is not None and mask.dtype == torch.bool, kwargs
    # Not a plain call: transformers' own mask, even where this module would have skipped it.
    monkeypatch.setattr(CAUSAL_CALL, "plain", False)
    mask = causal_skip_sdpa_mask(**mask_arguments(6, 6, allow_is_causal_skip=False))
    assert mask is not None and torch.equal(mask[0, 0], torch.ones(6, 6, dtype=torch.bool).tril())


def test_refused_without_sdpa_and_undone_exactly():
    model = build_model("tiny", dtype=torch.float32, seed=0)
    model.config._attn_implementation = "eager"
    with pytest.raises(ValueError, match="skip_causal_mask=True needs SDPA attention"):
        patch_llama(model, kernels=WITH_SKIP)
    assert "forward" not in model.__dict__
    model.config._attn_implementation = "sdpa"
    patch = patch_llama(model, kernels=("rms_norm", "skip_causal_mask"))
    assert model.config._attn_implementation == CAUSAL_IMPLEMENTATION and "forward" in model.__dict__
    patch.undo()
    assert model.config._attn_implementation == "sdpa" and "forward" not in model.__dict__


def test_generate_is_unchanged(device, gen):
    # generate passes a cache (and a mask): never a plain call, so every step gets transformers' own mask.
    model = tiny(device).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=gen).to(device)
    settings = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, **settings)
    with patch_llama(model, kernels=WITH_SKIP):
        assert torch.equal(model.generate(ids, **settings), expected)


def test_a_lora_model_compiles_to_causal_attention(device, gen):
    # PEFT's forward hands the Llama its arguments by keyword, None where the caller gave none: still a plain call.
    peft = pytest.importorskip("peft", reason="peft is a test requirement (requirements.txt)")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(tiny(device), config)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=gen).to(device)
    with patch_llama(model, kernels=WITH_SKIP):
        calls = attention_calls_in_graph(model, input_ids=ids, labels=ids)
    assert calls == [(False, True, True)] * model.config.num_hidden_layers
