"""TRL's SFTTrainer: under it a patched model's loss is never called (TRL computes the loss with its own fused LM
head); with ``ModelLossMixin`` the patched loss trains, with the same losses as TRL's own."""

import copy

import pytest
import torch

from kernels.hf.patch import patch_llama
from kernels.hf.trl_loss import ModelLossMixin
from kernels.training.models import build_model

trl = pytest.importorskip("trl", reason="trl is a test requirement (requirements.txt)")
datasets = pytest.importorskip("datasets")
WITH_LINEAR = ("rms_norm", "cross_entropy", "linear_cross_entropy")


def _sft_data(vocab: int, gen, rows: int = 8, seq: int = 20):
    """Token ids with labels masked (-100) on a prompt of varying length, as TRL's completion-only loss makes them."""
    data = []
    for i in range(rows):
        ids = torch.randint(3, vocab, (seq - i % 3,), generator=gen).tolist()
        prompt = 3 + i % 4
        data.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return datasets.Dataset.from_list(data)


def _train(trainer_cls, model, data, tmp_path, with_trainer=False, **trainer_kwargs):
    from kernels.training.data import get_tokenizer

    args = trl.SFTConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2,
        learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no", seed=0, data_seed=0,
        use_cpu=not torch.cuda.is_available(), disable_tqdm=True, dataset_kwargs={"skip_prepare_dataset": True},
        remove_unused_columns=False, dataloader_num_workers=0,
    )
    trainer = trainer_cls(model=model, args=args, train_dataset=data, processing_class=get_tokenizer(),
                          **trainer_kwargs)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return (losses, trainer) if with_trainer else losses


class KernelsSFTTrainer(ModelLossMixin, trl.SFTTrainer):
    pass


def test_sft_trainer_trains_with_the_patched_loss_only_through_the_mixin(device, gen, tmp_path, monkeypatch):
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=gen)))
    base = build_model("tiny", dtype=torch.float32).to(device).train()
    data = _sft_data(base.config.vocab_size, gen)
    expected = _train(trl.SFTTrainer, copy.deepcopy(base), data, tmp_path / "trl")

    import kernels.hf.patch

    calls = []
    real = kernels.hf.patch.causal_lm_linear_loss
    monkeypatch.setattr(kernels.hf.patch, "causal_lm_linear_loss",
                        lambda *a, **k: calls.append(k.get("num_items_in_batch")) or real(*a, **k))

    plain = copy.deepcopy(base)
    with patch_llama(plain, kernels=WITH_LINEAR):
        under_trl = _train(trl.SFTTrainer, plain, data, tmp_path / "plain")
    assert calls == []  # TRL's own head computed the loss: the patched loss was never called
    torch.testing.assert_close(torch.tensor(under_trl), torch.tensor(expected), rtol=1e-4, atol=1e-4)

    mixed = copy.deepcopy(base)
    with patch_llama(mixed, kernels=WITH_LINEAR):
        losses = _train(KernelsSFTTrainer, mixed, data, tmp_path / "mixin")
    assert len(calls) == 4 and all(n is not None for n in calls)  # 2 steps × 2 micro-batches, with the token count
    # Two different implementations of the loss (TRL's head, ours) under gradient accumulation and AdamW, which turns
    # float32 differences in the smallest gradient components into whole steps of lr (m / sqrt(v) is about ±1
    # whatever their size): at most 1.2e-4 apart in the runs seen. A step moves the loss by about 2e-3, so a wrong loss
    # or gradient still fails 5e-4.
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=5e-4, atol=5e-4)


def test_sft_trainer_with_peft_config_fuses_the_adapters_of_a_patched_model(device, gen, tmp_path, monkeypatch):
    """``SFTTrainer(model=patched_model, peft_config=LoraConfig(...))``: TRL wraps the model with PEFT after the
    patch, and the default fuses the adapters it injects; the logged losses are those of the unpatched model."""
    peft = pytest.importorskip("peft", reason="peft is a test requirement (requirements.txt)")
    from kernels.lora import LoRAGroupFunction, LoRALinearFunction, SwiGLULoRADownFunction

    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=gen)))
    base = build_model("tiny", dtype=torch.float32).to(device).train()
    data = _sft_data(base.config.vocab_size, gen)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

    def config():
        return peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=targets)

    torch.manual_seed(0)  # PEFT draws A from the global generator: the same adapters in both runs
    expected = _train(trl.SFTTrainer, copy.deepcopy(base), data, tmp_path / "peft", peft_config=config())
    fused = []
    for function in (LoRAGroupFunction, LoRALinearFunction, SwiGLULoRADownFunction):
        monkeypatch.setattr(function, "apply", lambda *args, apply=function.apply: fused.append(1) or apply(*args))
    model = copy.deepcopy(base)
    patch = patch_llama(model)
    torch.manual_seed(0)
    losses, trainer = _train(trl.SFTTrainer, model, data, tmp_path / "patched", peft_config=config(),
                             with_trainer=True)
    assert trainer.args.bf16 and "lora" in patch.kernels and "lora" not in patch.left_off
    # Per decoder layer and forward: q/k/v and gate/up one node each, o_proj one, down_proj over the SwiGLU one;
    # 2 steps × 2 micro-batches, each forward run again in the backward under gradient checkpointing.
    forwards = 2 * 2 * (2 if trainer.args.gradient_checkpointing else 1)
    assert len(fused) == 4 * base.config.num_hidden_layers * forwards
    # SFTConfig's bf16=True (its default) runs the step under autocast: PEFT's layers and the fused nodes compute in
    # bfloat16, rounding in different places, and AdamW turns the smallest gradient differences into whole steps
    # of lr (as above). The losses were about 1e-5 apart relatively; a step moves them by about 2e-3.
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=5e-4, atol=5e-4)
    patch.undo()
