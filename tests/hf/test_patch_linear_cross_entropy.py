"""patch_llama's linear_cross_entropy: no [tokens, vocab] tensor in training, the same losses and gradients as
Hugging Face for every family (tied embeddings, checkpointing, num_items_in_batch), logits where they are wanted,
undo, the Trainer, PEFT and torch.compile."""

import copy

import pytest
import torch
from test_clients import _count_calls, _dataset, _train_with_trainer
from test_patch import TINY, assert_grads_close, loss_and_grads, random_batch, seed_from, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from kernels import runtime
from kernels.hf.patch import patch_llama
from kernels.reference import relative_error
from kernels.training.loop import enable_checkpointing

ONLY_LINEAR = dict(kernels=("linear_cross_entropy",))
WITH_LINEAR = dict(kernels=("rms_norm", "cross_entropy", "linear_cross_entropy"))  # the logits' loss in eval mode


class RowsOfWidth(TorchDispatchMode):
    """Records the most rows of any tensor whose last dimension is ``width`` that an operator returns."""

    def __init__(self, width: int):
        super().__init__()
        self.width, self.most_rows = width, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.width:
                self.most_rows = max(self.most_rows, t.numel() // self.width)
        return out


def assert_patch_keeps_loss_and_grads(model, batch, measure=loss_and_grads, **switches):
    """Loss and gradients of ``model`` on ``batch``, unpatched and patched with ``switches``, agree."""
    ref_loss, ref_grads = measure(model, batch)
    with patch_llama(model, **switches):
        loss, grads = measure(model, batch)
    assert relative_error(loss, ref_loss) < 1e-5
    assert_grads_close(grads, ref_grads, 1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("switches", [ONLY_LINEAR, WITH_LINEAR, dict(linear_cross_entropy=True)],
                         ids=["linear-only", "with-norm-and-loss", "defaults-and-linear"])
def test_same_loss_and_gradients_without_logits(family, switches, device, gen):
    model = tiny_model(family, seed_from(gen))
    batch = random_batch(gen, device=device)
    ref_loss, ref_grads = loss_and_grads(model, batch)
    ref_loss_n, ref_grads_n = loss_and_grads(model, batch, num_items_in_batch=31)
    with RowsOfWidth(TINY["vocab_size"]) as seen:
        loss_and_grads(model, batch)
    assert seen.most_rows >= batch["input_ids"].numel()  # unpatched, the logits are there to be seen
    with patch_llama(model, **switches) as patch:
        assert "linear cross-entropy" in patch.summary()
        with RowsOfWidth(TINY["vocab_size"]) as seen:
            loss, grads = loss_and_grads(model, batch)
        # The weight of the LM head and its gradient are [vocab, hidden]; logits would be [tokens, vocab].
        assert seen.most_rows == 0, f"a tensor of {seen.most_rows} rows of logits was made"
        assert relative_error(loss, ref_loss) < 1e-5
        assert_grads_close(grads, ref_grads, 1e-5)
        loss_n, grads_n = loss_and_grads(model, batch, num_items_in_batch=31)
        assert relative_error(loss_n, ref_loss_n) < 1e-5
        assert_grads_close(grads_n, ref_grads_n, 1e-5)


def test_tied_embeddings_and_checkpointing(device, gen):
    model = tiny_model("llama", seed_from(gen))
    model.config.tie_word_embeddings = True
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    enable_checkpointing(model)
    assert_patch_keeps_loss_and_grads(model, random_batch(gen, device=device), **WITH_LINEAR)


def test_logits_only_where_they_are_wanted(device, gen):
    model = tiny_model("llama", seed_from(gen))
    batch = random_batch(gen, device=device)
    with torch.no_grad():
        expected = model(**batch).logits
    patch = patch_llama(model, **ONLY_LINEAR)
    out = model(**batch)
    assert out.logits is None and out.loss.requires_grad  # training with labels: no logits were made
    no_labels = {k: v for k, v in batch.items() if k != "labels"}
    torch.testing.assert_close(model(**no_labels).logits, expected)  # no labels: logits as usual
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, expected)
    model.eval()
    out = model(**batch)
    torch.testing.assert_close(out.logits, expected)
    assert out.loss is not None
    model.train()
    as_tuple = model(**batch, return_dict=False)
    assert as_tuple[1] is None if len(as_tuple) > 1 else True
    patch.undo()
    assert "forward" not in model.lm_head.__dict__ and "forward" not in model.__dict__
    torch.testing.assert_close(model(**no_labels).logits, expected)


def test_lora_on_the_head_is_refused_and_nothing_changes(device, gen):
    peft = pytest.importorskip("peft")
    model = tiny_model("llama", seed_from(gen))
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["lm_head", "q_proj"]))
    with pytest.raises(TypeError, match="plain nn.Linear"):
        patch_llama(wrapped, **WITH_LINEAR)
    assert "_kernels_patch" not in model.__dict__


def test_lora_on_attention_trains_like_unpatched(device, gen):
    peft = pytest.importorskip("peft")
    model = tiny_model("llama", seed_from(gen))
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for name, p in wrapped.named_parameters():
        if "lora_B" in name:  # LoRA starts B at zero; give it values so that the adapters' gradients are tested
            torch.nn.init.normal_(p, std=0.05)
    assert_patch_keeps_loss_and_grads(wrapped, random_batch(gen, device=device), _adapter_grads,
                                      **WITH_LINEAR)


@pytest.mark.parametrize("order", ["patch-then-wrap", "wrap-then-patch"])
def test_modules_to_save_head_is_the_one_the_loss_uses(order, device, gen):
    # PEFT's modules_to_save=["lm_head"] trains a copy of the head. Patched first, the copy inherited the patched
    # forward bound to the original head: the loss used the frozen original and the copy got no gradient. Wrapped
    # first, the patch refused the wrapper. Both orders now train the copy, as PEFT does unpatched.
    peft = pytest.importorskip("peft")
    seed = seed_from(gen)
    config = dict(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    reference = peft.get_peft_model(tiny_model("llama", seed), peft.LoraConfig(**config))
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:  # a copy unlike the original, adapters not at zero
                p.add_(torch.randn(p.shape, generator=gen).to(p.device) * 0.05)
    state = reference.state_dict()
    batch = random_batch(gen, device=device)
    ref_loss, ref_grads = _adapter_grads(reference, batch)
    assert any("modules_to_save" in name for name in ref_grads)

    model = tiny_model("llama", seed)
    if order == "patch-then-wrap":
        patch = patch_llama(model, lora=True, linear_cross_entropy=True)
        wrapped = peft.get_peft_model(model, peft.LoraConfig(**config))
    else:
        wrapped = peft.get_peft_model(model, peft.LoraConfig(**config))
        patch = patch_llama(wrapped, lora=True, linear_cross_entropy=True)
    wrapped.load_state_dict(state)
    with RowsOfWidth(TINY["vocab_size"]) as rows:
        loss, grads = _adapter_grads(wrapped, batch)
    assert rows.most_rows < batch["input_ids"].numel()  # no logits: the loss without them ran
    assert relative_error(loss, ref_loss) < 1e-5
    assert_grads_close(grads, ref_grads, 1e-5)
    wrapped.eval()
    with torch.no_grad():  # the copy's logits where logits are wanted, not the original head's
        expected = reference.eval()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        got = wrapped(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    patch.undo()


def _adapter_grads(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_trainer_with_gradient_accumulation(device, gen, tmp_path, monkeypatch):
    torch.manual_seed(seed_from(gen))
    base = tiny_model("llama", seed_from(gen))
    data = _dataset(base.config.vocab_size, gen)
    expected = _train_with_trainer(copy.deepcopy(base), data, tmp_path / "hf")
    patched = copy.deepcopy(base)
    patch = patch_llama(patched, **WITH_LINEAR)
    calls = _count_calls(monkeypatch, "kernels.hf.patch", "causal_lm_linear_loss")
    losses = _train_with_trainer(patched, data, tmp_path / "patched")
    assert len(calls) == 4 and all(n is not None for n in calls)  # 2 steps × 2 micro-batches, each with the count
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-4, atol=1e-4)
    patch.undo()


def test_compiled_patched_model_without_graph_break(device, gen):
    backend = runtime.COMPILE_BACKEND
    model = tiny_model("llama", seed_from(gen))
    batch = random_batch(gen, device=device)
    ref_loss, ref_grads = loss_and_grads(model, batch)
    torch._dynamo.reset()
    with patch_llama(model, **WITH_LINEAR):
        explanation = torch._dynamo.explain(model)(**batch)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        compiled = torch.compile(model, backend=backend)
        loss, grads = loss_and_grads(compiled, batch)
    torch._dynamo.reset()
    assert relative_error(loss, ref_loss) < 1e-5
    assert_grads_close({k.removeprefix("_orig_mod."): v for k, v in grads.items()}, ref_grads, 1e-4)
