"""The patched model with the clients fine-tuning users bring: Hugging Face's Trainer (gradient accumulation and
gradient checkpointing) and ``generate``. Each must behave exactly as with the unpatched model."""

import copy
import functools
import importlib

import pytest
import torch

from kernels.hf.patch import patch_llama
from kernels.training.models import build_model

transformers = pytest.importorskip("transformers")
NORM_AND_LOSS = ("rms_norm", "cross_entropy")


def _tiny(device, gen):
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=gen)))
    return build_model("tiny", dtype=torch.float32).to(device)


def _dataset(vocab: int, gen, rows: int = 8, seq: int = 24) -> list[dict]:
    data = []
    for i in range(rows):
        length = seq - (i % 3) * 4  # rows of different lengths: padding inside a batch
        ids = torch.randint(0, vocab, (seq,), generator=gen)
        labels = ids.clone()
        labels[: 3 + i % 5] = -100  # a masked prompt of varying length
        mask = torch.ones(seq, dtype=torch.long)
        mask[length:] = 0
        labels[length:] = -100
        data.append({"input_ids": ids, "labels": labels, "attention_mask": mask})
    return data


def _train_with_trainer(model, data, tmp_path, optimizers=(None, None), data_collator=None, **overrides):
    overrides.setdefault("max_steps", 2)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no", seed=0, data_seed=0,
        dataloader_num_workers=0, use_cpu=not torch.cuda.is_available(), disable_tqdm=True, **overrides,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, optimizers=optimizers,
                                   data_collator=data_collator)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _count_calls(monkeypatch, module_name: str, function: str) -> list:
    """Count the calls of ``module.function`` (a list that grows by one per call)."""
    module = importlib.import_module(module_name)
    real, calls = getattr(module, function), []

    def counted(*args, **kwargs):
        calls.append(kwargs.get("num_items_in_batch"))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, function, counted)
    return calls


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient-checkpointing"])
def test_trainer_with_gradient_accumulation(device, gen, tmp_path, monkeypatch, checkpointing):
    base = _tiny(device, gen).train()
    base.config.use_cache = False
    data = _dataset(base.config.vocab_size, gen)
    expected = _train_with_trainer(copy.deepcopy(base), data, tmp_path / "hf", gradient_checkpointing=checkpointing)
    patched = copy.deepcopy(base)
    patch = patch_llama(patched, kernels=NORM_AND_LOSS)
    loss_calls = _count_calls(monkeypatch, "kernels.hf.patch", "causal_lm_loss")
    norm_calls = _count_calls(monkeypatch, "kernels.rmsnorm", "rms_norm")
    losses = _train_with_trainer(patched, data, tmp_path / "patched", gradient_checkpointing=checkpointing)
    # Our kernels ran: 2 steps × 2 micro-batches, each with the Trainer's count of trained tokens.
    assert len(loss_calls) == 4 and all(n is not None for n in loss_calls)
    assert len(norm_calls) >= 4 * len(patch.replaced)  # checkpointing runs the layers' norms again in backward
    assert len(losses) == len(expected) == 2
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-4, atol=1e-4)
    patch.undo()


def test_trainer_with_peft_lora_fused(device, gen, tmp_path, monkeypatch):
    """The Trainer on a PEFT LoRA model, gradient accumulation and checkpointing: patched (every default kernel and
    the fused adapters), the logged losses are PEFT's own."""
    peft = pytest.importorskip("peft", reason="peft is a test requirement (requirements.txt)")
    base = _tiny(device, gen).train()
    base.config.use_cache = False
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0,
                                                      target_modules=["q_proj", "k_proj", "up_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # B starts at zero: give it values, so the adapters shape the losses from step 1
                p.copy_(torch.randn(p.shape, generator=gen).to(p) * 0.1)
    data = _dataset(base.config.vocab_size, gen)
    expected = _train_with_trainer(copy.deepcopy(model), data, tmp_path / "peft", gradient_checkpointing=True)
    from kernels.lora import LoRALinearFunction, SwiGLULoRADownFunction

    fused = []
    for function in (LoRALinearFunction, SwiGLULoRADownFunction):
        monkeypatch.setattr(function, "apply", lambda *args, apply=function.apply: fused.append(1) or apply(*args))
    with patch_llama(model) as patch:
        assert "lora" in patch.kernels and "lora" not in patch.left_off
        losses = _train_with_trainer(model, data, tmp_path / "patched", gradient_checkpointing=True)
    # 4 adapted layers per decoder layer (down_proj with its SwiGLU), 2 steps × 2 micro-batches, each forward run
    # again under checkpointing.
    assert len(fused) == 2 * 4 * base.config.num_hidden_layers * 2 * 2
    assert len(losses) == len(expected) == 2
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-4, atol=1e-4)


def test_trainer_on_a_model_patched_before_peft_wraps_it(device, gen, tmp_path, monkeypatch):
    """``patch_llama(model)`` first, ``get_peft_model`` after (how Liger-style scripts run), then the Trainer: the
    default fuses the adapters PEFT put in after the patch, and the logged losses are PEFT's own."""
    peft = pytest.importorskip("peft", reason="peft is a test requirement (requirements.txt)")
    base = _tiny(device, gen).train()
    base.config.use_cache = False
    config = peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "up_proj",
                                                                                    "down_proj"])
    reference = peft.get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if "lora_B" in name:  # B starts at zero: give it values, so the adapters shape the losses from step 1
                p.copy_(torch.randn(p.shape, generator=gen).to(p) * 0.1)
    data = _dataset(base.config.vocab_size, gen)
    inner = copy.deepcopy(base)
    patch = patch_llama(inner)
    model = peft.get_peft_model(inner, config)
    model.load_state_dict(reference.state_dict())
    expected = _train_with_trainer(reference, data, tmp_path / "peft")
    from kernels.lora import LoRALinearFunction, SwiGLULoRADownFunction

    fused = []
    for function in (LoRALinearFunction, SwiGLULoRADownFunction):
        monkeypatch.setattr(function, "apply", lambda *args, apply=function.apply: fused.append(1) or apply(*args))
    losses = _train_with_trainer(model, data, tmp_path / "patched")
    assert "lora" in patch.kernels and "lora" not in patch.left_off
    # 4 adapted layers per decoder layer (down_proj with its SwiGLU), 2 steps × 2 micro-batches.
    assert len(fused) == 4 * base.config.num_hidden_layers * 2 * 2
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-4, atol=1e-4)
    patch.undo()


def _shadowed_triton_adamw(params, **hyperparameters):
    """A ``TritonAdamW`` that, at every step, also steps ``torch.optim.AdamW`` on copies of the same weights with the
    same gradients and learning rate, and records how far apart the two steps' results are beyond float32 rounding
    (the largest |ours − torch's| − 1e-6·|torch's|)."""
    from kernels.adamw import TritonAdamW

    class Shadowed(TritonAdamW):
        def __init__(self):
            super().__init__(params, **hyperparameters)
            self.ours = [p for group in self.param_groups for p in group["params"]]
            self.copies = [p.detach().clone() for p in self.ours]
            self.torch_adamw = torch.optim.AdamW(self.copies, **hyperparameters)
            self.gaps = []

        def step(self, closure=None):
            with torch.no_grad():
                for copy_, p in zip(self.copies, self.ours):
                    copy_.copy_(p)
                    copy_.grad = None if p.grad is None else p.grad.clone()
            self.torch_adamw.param_groups[0]["lr"] = self.param_groups[0]["lr"]
            loss = super().step(closure)
            self.torch_adamw.step()
            with torch.no_grad():
                pairs = zip(self.ours, self.copies)
                self.gaps.append(max(float(((p - c).abs() - 1e-6 * c.abs()).max()) for p, c in pairs))
            return loss

    return Shadowed()


def test_trainer_with_triton_adamw(device, gen, tmp_path):
    # The Trainer takes an optimizer from outside (``optimizers=(optimizer, None)``) and puts its own learning-rate
    # schedule on it: ours must train as the Trainer's own torch AdamW with the same hyperparameters does.
    base = _tiny(device, gen).train()
    base.config.use_cache = False
    data = _dataset(base.config.vocab_size, gen)
    expected = _train_with_trainer(copy.deepcopy(base), data, tmp_path / "torch", optim="adamw_torch", max_steps=3)
    ours = copy.deepcopy(base)
    optimizer = _shadowed_triton_adamw(ours.parameters(), lr=1e-3, weight_decay=0.0)
    losses = _train_with_trainer(ours, data, tmp_path / "triton", optimizers=(optimizer, None), max_steps=3)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-5)
    # Each of our steps against torch's from the same weights and gradients: float32 rounding apart (a few units in
    # the last place of the weight, plus 1e-9 where that is near zero; a step moves a weight by up to lr, 1e-3).
    # The two whole runs' weights are not compared: AdamW moves a weight whose gradient is near zero by about ±lr
    # whatever the gradient's size, so a rounding difference in such a gradient can put a weight a whole step apart
    # after the first step.
    assert len(optimizer.gaps) == 3 and max(optimizer.gaps) < 1e-9, optimizer.gaps
    assert any(not torch.equal(a, start) for a, start in zip(ours.parameters(), base.parameters()))
    assert optimizer.param_groups[0]["lr"] < 1e-3  # the Trainer's schedule reached our optimizer


@pytest.mark.parametrize("options", [dict(), dict(kernels=NORM_AND_LOSS, attention=True)],
                         ids=["defaults", "our-attention"])
def test_generate_is_unchanged(device, gen, options):
    # With a cache (every step after the prompt) and with a padded prompt, our attention hands the call to SDPA.
    model = _tiny(device, gen).eval()
    prompt = torch.randint(0, model.config.vocab_size, (2, 7), generator=gen).to(device)
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0  # the second prompt left-padded, as generate wants
    settings = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    expected = [model.generate(prompt, **settings), model.generate(prompt, attention_mask=mask, **settings)]
    with patch_llama(model, **options):
        tokens = [model.generate(prompt, **settings), model.generate(prompt, attention_mask=mask, **settings)]
    for got, want in zip(tokens, expected):
        assert torch.equal(got, want)


def test_generate_with_fused_lora_adapters(device, gen):
    peft = pytest.importorskip("peft", reason="peft is a test requirement (requirements.txt)")
    model = peft.get_peft_model(_tiny(device, gen), peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0,
                                                                     target_modules=["q_proj", "v_proj", "up_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # B starts at zero: give it values, or the adapters change nothing
                p.copy_(torch.randn(p.shape, generator=gen).to(p) * 0.5)
    model.eval()
    prompt = torch.randint(0, model.config.vocab_size, (2, 7), generator=gen).to(device)
    settings = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    expected = model.generate(input_ids=prompt, **settings)
    with patch_llama(model) as patch:  # wrapped first: lora is on by default
        assert "lora" in patch.kernels
        tokens = model.generate(input_ids=prompt, **settings)
    assert torch.equal(tokens, expected)


def test_trainer_with_the_redundant_mask_dropped(device, gen, tmp_path, monkeypatch):
    # Right-padded rows whose padding carries no label: DropRedundantMask hands the model no attention_mask, and the
    # Trainer's losses are those of Hugging Face's model with the masks.
    from kernels.hf.padding_mask import DropRedundantMask

    base = _tiny(device, gen).train()
    base.config.use_cache = False
    data = _dataset(base.config.vocab_size, gen)
    expected = _train_with_trainer(copy.deepcopy(base), data, tmp_path / "hf")
    patched = copy.deepcopy(base)
    patch_llama(patched, kernels=(*NORM_AND_LOSS, "skip_causal_mask"))
    masks, inner = [], patched.forward

    @functools.wraps(inner)  # the Trainer keeps the dataset columns the forward's signature names
    def spy(*args, **kwargs):
        masks.append(kwargs.get("attention_mask"))
        return inner(*args, **kwargs)

    monkeypatch.setattr(patched, "forward", spy)
    losses = _train_with_trainer(patched, data, tmp_path / "dropped", data_collator=DropRedundantMask())
    assert masks and all(m is None for m in masks)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-4, atol=1e-5)

