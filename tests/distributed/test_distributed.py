"""FSDP2 across processes: the global batch split by rows, the global label count, and a 2-process run on the CPU
(gloo, Triton's interpreter) whose losses and gradients equal one process's on the same global batches."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import seed_of_test  # the module pytest loaded (its stash key holds the session's seed)

from kernels import runtime
from kernels.distributed.fsdp import backend_for, free_port
from kernels.distributed.parallel import global_label_counts, shard_batches, split_rows, torchrun_command
from kernels.hf.patch import SWITCHES, patch_llama
from kernels.reference import relative_error
from kernels.tolerances import RELATIVE_ERROR_TOL
from kernels.training.loop import count_trained_labels, make_run_batches, train
from kernels.training.models import build_model, llama_config

WORKER = Path(__file__).resolve().parents[1] / "support" / "fsdp_worker.py"
STEPS, SEQ_LEN, BATCH, GRAD_ACCUM, LR = 3, 64, 4, 2, 1e-3
# Every kernel but the linear cross-entropy (the tiny model's logits are small): the sharded MLPs then run
# SwiGLUDownFunction and the in-place SwiGLU backward on FSDP2's gathered weights.
KERNELS = ("rms_norm", "cross_entropy", "swiglu", "rope")
# Both runs step with the package's AdamW: on the sharded run it updates each rank's DTensor shards in place, and the
# losses after the first step show whether that is the update one process makes. (torch.optim.AdamW, the default of
# kernels.distributed.finetune, is the optimizer of the command-line run in test_scaling.)
ADAMW = "triton"
# Both runs compute in float32 and differ only in the order of additions: the weight gradients of the two ranks'
# rows are computed separately and summed by the reduce-scatter, where one process sums all rows in one matmul.
# Measured: losses agree to ~1e-7 relative and gradients to ~1e-7 (a few float32 ulps, 2⁻²³ ≈ 1.2e-7); AdamW's
# normalised steps then carry such differences into later steps at the same relative size. The bounds are the
# float32 bound of tolerances.py (1e-5): 100× the measured error, and 10⁴× below what a wrong normalisation gives
# (a gradient off by the world size is a relative error of 0.5; a loss counted per rank instead of globally moves
# the loss by percents).
LOSS_TOL = GRAD_TOL = RELATIVE_ERROR_TOL[torch.float32]

# Two processes: two gloo processes on the CPU, or two GPUs (one each, NCCL) in GPU mode.
two_processes = pytest.mark.skipif(
    runtime.MODE == "gpu" and torch.cuda.device_count() < 2,
    reason="two processes in GPU mode need two GPUs (one per process)",
)


def test_split_rows_gives_each_rank_its_rows_in_order(gen):
    batch = {"input_ids": torch.randint(0, 100, (6, 5), generator=gen), "labels": torch.randint(0, 100, (6, 5))}
    parts = [split_rows(batch, r, 3) for r in range(3)]
    assert all(p["input_ids"].shape == (2, 5) for p in parts)
    assert torch.equal(torch.cat([p["input_ids"] for p in parts]), batch["input_ids"])
    with pytest.raises(ValueError, match="multiple of the number of processes"):
        split_rows(batch, 0, 4)
    assert len(shard_batches([batch, batch], 1, 2)) == 2


def test_global_label_count_of_one_process_is_its_own_count(seed):
    batches = make_run_batches("tiny", 2, 48, 2, 2, seed)
    groups = [batches[0:2], batches[2:4]]
    expected = [sum(count_trained_labels(b) for b in g) for g in groups]
    assert global_label_counts(groups, torch.device("cpu")) == expected


def test_backend_follows_the_device():
    assert backend_for(torch.device("cpu")) == "gloo"
    assert backend_for(torch.device("cuda", 1)) == "nccl"


def test_sharded_run_refuses_compile_and_fit(capsys):
    from kernels.distributed.finetune import main

    for flag in ("--compile", "--fit"):
        with pytest.raises(SystemExit) as exit_info:
            main([flag])
        assert exit_info.value.code == 2 and "a sharded run trains the eager loop" in capsys.readouterr().err


def test_single_gpu_command_line_points_sharded_runs_to_torchrun(capsys):
    from kernels.training.finetune import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--fsdp"])
    assert exit_info.value.code == 2 and "-m kernels.distributed.finetune" in capsys.readouterr().err


def test_torchrun_command_uses_loopback_and_the_finetune_module():
    cmd = torchrun_command(2, ["--steps", "2"], port=29555)
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert "--master-addr=127.0.0.1" in cmd and "--master-port=29555" in cmd and "--nproc-per-node=2" in cmd
    assert cmd[-3:] == ["kernels.distributed.finetune", "--steps", "2"]


def _first_step_grads(store):
    def hook(step, model):
        if step == 0:
            store.update({name: p.grad.detach().clone() for name, p in model.named_parameters()})

    return hook


@pytest.fixture(scope="module")
def two_and_one(request, tmp_path_factory):
    """The 2-process FSDP2 run (torchrun, gloo; all-gathers two layers ahead; gradient checkpointing, whose
    recomputation in the backward must give the very values of the forward) and the 1-process run on the same
    global batches without checkpointing, float32, both stepped by ``ADAMW``."""
    seed = seed_of_test(request.config, "tests/distributed/test_distributed.py::two_and_one")
    out = tmp_path_factory.mktemp("fsdp") / "rank0.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--nnodes=1",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(WORKER), "--out", str(out),
           "--seed", str(seed), "--steps", str(STEPS), "--seq-len", str(SEQ_LEN), "--batch-size", str(BATCH),
           "--grad-accum", str(GRAD_ACCUM), "--lr", str(LR), "--prefetch", "2", "--gradient-checkpointing",
           "--kernels", ",".join(KERNELS), "--adamw", ADAMW]
    # The worker is a script, so Python looks for modules beside it (tests/support/), not in the working
    # directory: put this checkout's root first on the path, so the workers import the kernels under test and not
    # an installed copy.
    root = str(Path(__file__).parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    # start_new_session: on a timeout the whole group (torchrun and its workers) is ended, not torchrun alone.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            cwd=root, env=env)
    try:
        output, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        import signal

        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("the 2-process FSDP2 run did not finish in 180 s")
    assert proc.returncode == 0, output[-4000:]
    sharded = torch.load(out, weights_only=False)

    batches = make_run_batches("tiny", STEPS, SEQ_LEN, BATCH, GRAD_ACCUM, seed)
    model = build_model("tiny", dtype=torch.float32, device=runtime.device(), seed=seed)
    patch_llama(model, **{name: name in KERNELS for name in SWITCHES})
    grads: dict = {}
    single = train(model, batches, grad_accum=GRAD_ACCUM, lr=LR, progress=False,
                   after_backward=_first_step_grads(grads), adamw=ADAMW)
    return sharded, single, grads, batches


@two_processes
def test_two_processes_have_the_losses_of_one(two_and_one):
    sharded, single, _, batches = two_and_one
    assert sharded["world_size"] == 2 and sharded["gradient_checkpointing"]
    assert set(sharded["norms"]) == {"TritonRMSNorm"}, "the sharded model must run the patched norms"
    assert sharded["mlps"] == ["TritonSwiGLUMLP"], "and the patched MLPs"
    assert "TritonAdamW" in sharded["optimizer"] and "TritonAdamW" in single.what_ran["optimizer"]
    # The global count all-reduced across ranks is the count one process takes over the whole step.
    assert sharded["global_trained_labels"] == [r.trained_tokens for r in single.records]
    errors = [abs(two - one) / abs(one) for one, two in zip(single.losses, sharded["losses"])]
    print(f"relative loss differences, 2 processes against 1: {[f'{e:.1e}' for e in errors]}")
    for step, (one, two) in enumerate(zip(single.losses, sharded["losses"])):
        assert abs(two - one) / abs(one) < LOSS_TOL, f"step {step}: one process {one!r}, two {two!r}"


@two_processes
def test_every_gradient_gathered_from_its_shards_equals_one_process(two_and_one):
    sharded, _, grads, _ = two_and_one
    assert set(sharded["grads"]) == set(grads)
    worst = max(relative_error(sharded["grads"][n]["full"], g) for n, g in grads.items())
    print(f"largest relative gradient error, 2 processes against 1: {worst:.1e}")
    for name, ref in grads.items():
        err = relative_error(sharded["grads"][name]["full"], ref)
        assert err < GRAD_TOL, f"{name}: relative error {err:.2e} against one process"


@two_processes
def test_rmsnorm_weight_gradient_from_dtensor_shards(two_and_one):
    """Each rank holds half of every norm weight's gradient (a DTensor, Shard(0)); gathered, it is the gradient the
    unsharded model computes, norm by norm, and not zero."""
    sharded, _, grads, _ = two_and_one
    config = llama_config("tiny")
    norm_names = [n for n in grads if n.endswith("layernorm.weight") or n == "model.norm.weight"]
    assert len(norm_names) == 2 * config.num_hidden_layers + 1
    for name in norm_names:
        got = sharded["grads"][name]
        assert got["placements"] == ["S(0)"] and got["local_shape"] == (config.hidden_size // 2,), got
        assert grads[name].norm() > 0
        err = relative_error(got["full"], grads[name])
        assert err < GRAD_TOL, f"{name}: relative error {err:.2e}"


@two_processes
def test_patching_after_sharding_fails_loudly(two_and_one):
    """The other order: FSDP2 writes gathered parameters into the modules it sharded, so a norm swapped in later
    keeps the sharded DTensor; the kernel's operator refuses it rather than compute with half a weight."""
    error = two_and_one[0]["patch_after_shard_error"]
    assert "DTensor" in error, error


@two_processes
def test_fused_lora_under_fsdp2_equals_peft_in_one_process(two_and_one):
    """PEFT LoRA wrapped, patched (the fused adapters on by default) and sharded with FSDP2 over two processes: the
    global loss and every adapter gradient, gathered from its shards, equal PEFT's own layers in one process."""
    pytest.importorskip("peft", reason="peft is a test requirement (requirements.txt)")
    from fsdp_worker import LORA_TARGETS, lora_tiny

    sharded, _, _, batches = two_and_one
    lora, seed = sharded["lora"], sharded["seed"]
    assert "lora" in lora["kernels"] and lora["fused"] == len(LORA_TARGETS) * llama_config("tiny").num_hidden_layers
    inner = lora_tiny(runtime.device(), seed).get_base_model()  # PEFT's own layers, one process
    loss = inner(**{k: v.to(runtime.device()) for k, v in batches[0].items()}).loss
    loss.backward()
    assert abs(lora["loss"] - loss.item()) < LOSS_TOL * abs(loss.item())
    grads = {name: p.grad for name, p in inner.named_parameters() if p.requires_grad}
    assert set(lora["grads"]) == set(grads) and all("lora_" in name for name in grads)
    for name, ref in grads.items():
        err = relative_error(lora["grads"][name], ref)
        assert err < GRAD_TOL, f"{name}: relative error {err:.2e} against PEFT in one process"


GPU_CHECK_ARGS = ["--preset", "llama-3.2-1b", "--steps", "200", "--seq-len", "2048", "--batch-size", "2",
                  "--compare", "--prefetch", "2"]


@pytest.mark.gpu
def test_gpu_200_patched_steps_on_two_gpus_with_prefetch(tmp_path):
    """Two GPUs, NCCL, FSDP2 all-gathering two layers ahead, so NCCL's kernels run next to ours on other streams:
    200 steps of Hugging Face's model, then 200 of the patched one, on the same batches. The RMSNorm backward never
    waits on another program (its dW partials are summed by a second launch), so nothing can hang whatever NCCL
    occupies; a hang would hit the timeout. The patched losses must stay finite and track the baseline's: over the
    first 20 steps within the bound the single-process bf16 comparison of 20 steps uses (0.05,
    tests/training/test_train.py); later, two bf16 runs that round differently drift apart step by step, so the last
    20 steps are compared by their mean (a wrong gradient moves the whole curve, rounding only jitters it)."""
    import math

    from kernels.distributed.parallel import launch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, this host has {torch.cuda.device_count()}")
    result = launch(2, GPU_CHECK_ARGS, tmp_path, timeout_s=900)
    data = result.load()
    base = [s["loss"] for s in data["runs"]["baseline"]["steps"]]
    ours = [s["loss"] for s in data["runs"]["patched"]["steps"]]
    assert len(ours) == 200 and all(math.isfinite(x) for x in ours + base)
    assert data["backend"] == "nccl" and data["world_size"] == 2
    assert max(abs(a - b) for a, b in zip(base[:20], ours[:20])) < 0.05, data["summary"]
    assert abs(sum(base[-20:]) - sum(ours[-20:])) / 20 < 0.05, data["summary"]


@two_processes
def test_a_global_batch_the_ranks_cannot_share_is_refused(tmp_path):
    from kernels.distributed.parallel import launch

    result = launch(2, ["--steps", "1", "--seq-len", "32", "--batch-size", "3"], tmp_path, timeout_s=120)
    assert result.returncode != 0 and result.results is None
    assert "make it a multiple of 2, e.g. --batch-size 6" in result.output, result.output[-2000:]
