"""patch_llama with PEFT LoRA models, in either order: wrap then patch, patch then wrap; undo in both."""

import copy

import pytest
import torch

from kernels.hf.patch import patch_llama
from kernels.training.models import build_model

peft = pytest.importorskip("peft", reason="peft is a test requirement (requirements.txt)")
NORM_AND_LOSS = ("rms_norm", "cross_entropy")


def _lora_config():
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


@pytest.fixture
def base_and_batch(device, gen):
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=gen)))
    model = build_model("tiny", dtype=torch.float32).to(device).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=gen).to(device)
    labels = ids.clone()
    labels[:, :4] = -100
    return model, ids, labels


def lora_with_values(model, config):
    """``model`` wrapped by PEFT with ``config``, its B matrices given values (LoRA starts B at zero, which would make
    the adapters' effect and dA zero, and a test of them pass on anything)."""
    wrapped = peft.get_peft_model(model, config)
    for name, p in wrapped.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    return wrapped


def _lora(model):
    return lora_with_values(model, _lora_config())


def loss_and_grads(model, ids, labels):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads


def _assert_same(result, reference):
    (loss, grads), (ref_loss, ref_grads) = result, reference
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys() and any("lora_A" in k for k in grads)  # only the adapters train
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.fixture
def lora_reference(base_and_batch):
    """The unpatched LoRA model and its loss and gradients: what every patched variant must reproduce."""
    base, ids, labels = base_and_batch
    reference = _lora(copy.deepcopy(base))
    return reference, loss_and_grads(reference, ids, labels)


@pytest.mark.parametrize("kernels", [NORM_AND_LOSS, "auto"], ids=["norm-and-loss", "defaults"])
def test_wrap_then_patch(base_and_batch, lora_reference, kernels):
    _, ids, labels = base_and_batch
    reference, expected = lora_reference
    model = copy.deepcopy(reference)
    patch = patch_llama(model, kernels=kernels)
    assert len(patch.replaced) > 0 and patch.model is model.get_base_model()
    _assert_same(loss_and_grads(model, ids, labels), expected)
    patch.undo()
    assert not any("TritonRMSNorm" in type(m).__name__ for m in model.modules())
    _assert_same(loss_and_grads(model, ids, labels), expected)


def test_patch_then_wrap(base_and_batch, lora_reference):
    base, ids, labels = base_and_batch
    reference, expected = lora_reference
    inner = copy.deepcopy(base)
    patch = patch_llama(inner, kernels=NORM_AND_LOSS)
    model = peft.get_peft_model(inner, _lora_config())
    model.load_state_dict(reference.state_dict())  # the same adapter weights as the reference
    _assert_same(loss_and_grads(model, ids, labels), expected)
    patch.undo()
    _assert_same(loss_and_grads(model, ids, labels), expected)


def test_patching_a_patched_peft_model_twice_is_refused(base_and_batch):
    base, _, _ = base_and_batch
    model = _lora(copy.deepcopy(base))
    patch_llama(model, kernels=NORM_AND_LOSS)
    with pytest.raises(RuntimeError, match="already patched"):
        patch_llama(model)
