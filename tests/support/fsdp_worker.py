"""One rank of the 2-process FSDP2 check in ``tests/distributed/test_distributed.py`` (torchrun starts it).

Every rank trains the patched tiny model, float32, sharded with FSDP2, on the global batches the test gives, with
the AdamW named by ``--adamw``; after the first step's backward it gathers every gradient from its DTensor shards.
Then it checks the other patch order: a model sharded first and patched after must fail loudly, not train. Rank 0
saves what it saw to ``--out``.
"""

import argparse

import torch
from torch.distributed.tensor import DTensor, Shard

import kernels  # noqa: F401  (interpreter mode before any kernel is defined)
from kernels.distributed.fsdp import prepare_model, setup, shard_llama, teardown
from kernels.distributed.parallel import train_fsdp
from kernels.hf.patch import SWITCHES, patch_llama
from kernels.training.loop import make_run_batches
from kernels.training.models import build_model


def first_step_grads(store: dict):
    def hook(step, model):
        if step:
            return
        for name, param in model.named_parameters():
            grad = param.grad
            assert isinstance(grad, DTensor), f"{name}: gradient is a {type(grad).__name__}, not a DTensor shard"
            store[name] = {
                "local_shape": tuple(grad.to_local().shape),
                "placements": [str(p) for p in grad.placements],
                "sharded_dim0": grad.placements == (Shard(0),),
                "full": grad.full_tensor().detach().clone(),  # a collective: every rank calls it
            }

    return hook


def patch_after_shard_error(env, batch) -> str:
    """Shard, then patch: the swapped-in norms hold the sharded DTensor, which FSDP2 never replaces."""
    model = build_model("tiny", dtype=torch.float32, device=env.device, seed=0)
    shard_llama(model)
    patch_llama(model)
    try:
        model(**batch, num_items_in_batch=1).loss.backward()
    except RuntimeError as err:
        return str(err).splitlines()[0]
    return ""


LORA_TARGETS = ["q_proj", "v_proj", "gate_proj", "down_proj"]


def lora_tiny(device, seed: int):
    """The tiny Llama in float32 wrapped with PEFT LoRA on ``LORA_TARGETS``, every adapter weight drawn from
    ``seed`` (PEFT draws A from the global random state and starts B at zero): the same model in every process."""
    import peft

    model = build_model("tiny", dtype=torch.float32, device=device, seed=seed)
    model = peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0,
                                                       target_modules=LORA_TARGETS))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator).to(param) * 0.1)
    return model


def lora_under_fsdp(env, batch, seed: int) -> dict:
    """``lora_tiny``, patched (the fused LoRA layers on by default), then sharded with FSDP2 in float32: the loss of
    ``batch`` (this rank's rows, its share of the global mean) and every adapter's gradient gathered from its shards.
    Every rank calls it (the gathers are collectives)."""
    from kernels.distributed.fsdp import mixed_precision
    from kernels.training.loop import count_trained_labels

    model = lora_tiny(env.device, seed)
    patch = patch_llama(model)
    inner = model.get_base_model()
    shard_llama(inner, mixed_precision(torch.float32, torch.float32))
    total = torch.tensor(float(count_trained_labels(batch)), device=env.device)
    torch.distributed.all_reduce(total)
    loss = inner(**batch, num_items_in_batch=total).loss
    loss.backward()
    grads = {name: p.grad.full_tensor().detach().clone() for name, p in inner.named_parameters() if p.requires_grad}
    summed = loss.detach().clone()
    torch.distributed.all_reduce(summed)
    return {"kernels": patch.kernels, "loss": summed.item(), "grads": grads,
            "fused": sum(1 for m in inner.modules() if "forward" in m.__dict__ and hasattr(m, "lora_A"))}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--prefetch", type=int, default=0)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--kernels", default="rms_norm,cross_entropy", help="patch_llama switches to turn on")
    p.add_argument("--adamw", default="foreach", help="kernels.training.loop.make_adamw's choice")
    args = p.parse_args()
    patch_options = {name: name in args.kernels.split(",") for name in SWITCHES}
    env = setup()
    try:
        batches = make_run_batches("tiny", args.steps, args.seq_len, args.batch_size, args.grad_accum, args.seed)
        model, _ = prepare_model("tiny", env, dtype=torch.float32, param_dtype=torch.float32,
                                 reduce_dtype=torch.float32, seed=args.seed, prefetch=args.prefetch,
                                 gradient_checkpointing=args.gradient_checkpointing, patch_options=patch_options)
        grads: dict = {}
        run = train_fsdp(model, batches, env, grad_accum=args.grad_accum, lr=args.lr, progress=False,
                         after_backward=first_step_grads(grads), adamw=args.adamw)
        norms = sorted(type(m).__name__ for m in model.modules() if type(m).__name__.endswith("RMSNorm"))
        mlps = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("MLP")})
        model_checkpointed = bool(getattr(model, "is_gradient_checkpointing", False))
        del model
        local_batch = {k: v[: args.batch_size // env.world_size] for k, v in batches[0].items()}
        order_error = patch_after_shard_error(env, local_batch)
        rows = args.batch_size // env.world_size
        rank_batch = {k: v[env.rank * rows:(env.rank + 1) * rows].to(env.device) for k, v in batches[0].items()}
        lora = lora_under_fsdp(env, rank_batch, args.seed)
        if env.is_rank0:
            torch.save({"losses": run.losses, "optimizer": run.what_ran["optimizer"],
                        "gradient_checkpointing": model_checkpointed, "grads": grads,
                        "norms": norms, "mlps": mlps, "world_size": env.world_size,
                        "global_trained_labels": run.what_ran["global_trained_labels"],
                        "patch_after_shard_error": order_error, "lora": lora, "seed": args.seed}, args.out)
    finally:
        teardown()


if __name__ == "__main__":
    main()
