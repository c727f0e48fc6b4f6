"""Checkpoint offload: exact gradients, which tensors leave, the order of the copies back, the reused pool, the host
memory budget, the refusals; on a GPU, the streams (copies overlapping compute) and pinned memory."""

import copy
import re

import pytest
import torch

from kernels import runtime
from kernels.hf.offload import (
    HOST_FLOOR_BYTES,
    CheckpointOffload,
    HostMemoryError,
    HostSlabPool,
    enable_checkpoint_offload,
    host_available_bytes,
    host_budget_bytes,
    slab_bytes_for,
)
from kernels.hf.tiled_mlp import apply_tiled_mlp
from kernels.reference import relative_error
from kernels.tolerances import RELATIVE_ERROR_TOL as TOL
from kernels.training.loop import enable_checkpointing
from kernels.training.models import build_model

GiB = 1024**3


def tiny(device, checkpointing=True):
    model = build_model("tiny", dtype=torch.float32, device=device, seed=0)
    if checkpointing:
        enable_checkpointing(model)
    return model


def loss_and_grads(model, ids, retain=False):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward(retain_graph=retain)
    if retain:
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def fake_meminfo(tmp_path, available_bytes):
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal:       99999999 kB\nMemFree:  1 kB\nMemAvailable:   {available_bytes // 1024} kB\n")
    return path


@pytest.fixture
def ids(gen):
    return torch.randint(0, 2048, (2, 37), generator=gen).to(runtime.device())


# ---------------------------------------------------------------------------------------------------------------
# Exact gradients, and what leaves
# ---------------------------------------------------------------------------------------------------------------


def test_gradients_equal_those_without_offload_exactly(device, ids):
    model = tiny(device)
    reference = copy.deepcopy(model)
    ref_loss, ref_grads = loss_and_grads(reference, ids)
    with enable_checkpoint_offload(model, keep_on_gpu=0, slab_bytes=2048) as offload:  # several slabs each
        for _ in range(2):
            loss, grads = loss_and_grads(model, ids)
            assert torch.equal(loss, ref_loss)
            assert all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)
    layers = model.config.num_hidden_layers
    checkpoint = ids.numel() * model.config.hidden_size * 4
    assert offload.stats.copies_to_host == offload.stats.copies_to_gpu == 2 * layers
    assert offload.stats.bytes_offloaded == 2 * layers * checkpoint
    assert offload.stats.offloaded_layers == layers and offload.stats.kept_on_gpu == 0


def test_only_the_decoder_layers_inputs_leave(device, ids):
    model = tiny(device)
    offload = enable_checkpoint_offload(model)
    packed = []
    original = offload.pack

    def spy(tensor):
        result = original(tensor)
        packed.append((tuple(tensor.shape), result is tensor))
        return result

    offload.hooks = torch.autograd.graph.saved_tensors_hooks(spy, offload.unpack)
    loss_and_grads(model, ids)
    hidden = (*ids.shape, model.config.hidden_size)
    offloaded = [shape for shape, untouched in packed if not untouched]
    assert offloaded == [hidden] * model.config.num_hidden_layers  # each layer's input, nothing else
    # Some PyTorch releases save an empty placeholder beside the checkpoint's inputs: it passes through.
    assert all(shape == (0,) for shape, untouched in packed if untouched)
    # Anything that is not the current layer's input passes through untouched.
    small = torch.randn(3, 4)
    assert offload.pack(small) is small and offload.unpack(small) is small
    offload.undo()


def test_no_offload_without_grad_or_in_eval(device, ids):
    model = tiny(device)
    offload = enable_checkpoint_offload(model)
    with torch.no_grad():
        model(input_ids=ids)
    model.eval()
    model(input_ids=ids, labels=ids).loss.backward()
    assert offload.stats.copies_to_host == 0 and offload.log == []
    offload.undo()


def test_keep_on_gpu_keeps_the_last_layers(device, ids):
    model = tiny(device)
    reference = copy.deepcopy(model)
    _, ref_grads = loss_and_grads(reference, ids)
    with enable_checkpoint_offload(model, keep_on_gpu=2) as offload:
        _, grads = loss_and_grads(model, ids)
    assert all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)
    packs = [entry for entry in offload.log if entry[0] == "pack"]
    assert packs == [("pack", 0, "host"), ("pack", 1, "host"), ("pack", 2, "gpu"), ("pack", 3, "gpu")]
    assert offload.stats.kept_on_gpu == 2 and offload.stats.copies_to_host == 2


# ---------------------------------------------------------------------------------------------------------------
# The order of the copies back
# ---------------------------------------------------------------------------------------------------------------


def test_unpacks_run_backwards_each_copy_issued_one_layer_ahead(device, ids):
    model = tiny(device)
    with enable_checkpoint_offload(model, keep_on_gpu=0) as offload:
        loss_and_grads(model, ids)
    backward = [entry for entry in offload.log if entry[0] != "pack"]
    # Nothing kept: the last layer's copy starts at the end of the forward; each unpack then issues the next.
    assert backward == [("fetch", 3), ("unpack", 3), ("fetch", 2), ("unpack", 2), ("fetch", 1), ("unpack", 1),
                        ("fetch", 0), ("unpack", 0)]
    assert offload.log.index(("fetch", 3)) < offload.log.index(("unpack", 3))


def test_kept_layers_hide_the_first_copy_and_prefetch_depth(device, ids):
    model = tiny(device)
    with enable_checkpoint_offload(model, keep_on_gpu=1, prefetch=2) as offload:
        loss_and_grads(model, ids)
    backward = [entry for entry in offload.log if entry[0] != "pack"]
    # Layer 3 stayed on the GPU: its unpack issues layers 2 and 1; layer 2's unpack issues layer 0.
    assert backward == [("unpack", 3), ("fetch", 2), ("fetch", 1), ("unpack", 2), ("fetch", 0), ("unpack", 1),
                        ("unpack", 0)]


def test_a_second_backward_through_the_graph_fetches_again(device, ids):
    model = tiny(device)
    reference = copy.deepcopy(model)
    _, ref_grads = loss_and_grads(reference, ids, retain=True)
    with enable_checkpoint_offload(model, keep_on_gpu=0) as offload:
        _, grads = loss_and_grads(model, ids, retain=True)
    assert all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)
    assert offload.stats.copies_to_gpu == 2 * model.config.num_hidden_layers


# ---------------------------------------------------------------------------------------------------------------
# The pool
# ---------------------------------------------------------------------------------------------------------------


def test_the_pool_is_reused_across_steps(device, ids):
    model = tiny(device)
    with enable_checkpoint_offload(model, keep_on_gpu=0, slab_bytes=4096) as offload:
        counts = []
        for _ in range(4):
            loss_and_grads(model, ids)
            counts.append(offload.pool.allocations)
    per_checkpoint = -(-ids.numel() * model.config.hidden_size * 4 // 4096)
    assert counts == [model.config.num_hidden_layers * per_checkpoint] * 4
    assert offload.stats.buffers == counts[0] and offload.stats.host_bytes == counts[0] * 4096


def test_a_new_length_trims_the_slabs_of_the_old_one(device, gen):
    model = tiny(device)
    with enable_checkpoint_offload(model, keep_on_gpu=0, slab_bytes=1 << 20) as offload:
        for length in (64, 64, 16):  # 64 × 128 × 4 = 32 KiB checkpoints, then 8 KiB ones
            loss_and_grads(model, torch.randint(0, 2048, (1, length), generator=gen).to(device))
        assert set(offload.pool.free) == {8192}
        assert offload.pool.held_bytes == model.config.num_hidden_layers * 8192


def test_slab_pool_and_sizes():
    pool = HostSlabPool(pin=False)
    slabs = pool.take(1024, 3)
    assert pool.allocations == 3 and pool.held_bytes == 3072 and all(s.numel() == 1024 for s in slabs)
    pool.give(slabs)
    assert pool.take(1024, 2) and pool.allocations == 3  # reused, nothing new
    assert slab_bytes_for(5000, 1 << 20) == 8192 and slab_bytes_for(3 << 20, 1 << 20) == 1 << 20
    assert slab_bytes_for(4096, 1 << 20) == 4096


# ---------------------------------------------------------------------------------------------------------------
# Host memory
# ---------------------------------------------------------------------------------------------------------------


def test_host_memory_is_read_from_meminfo(tmp_path):
    assert host_available_bytes(fake_meminfo(tmp_path, 8 * GiB)) == 8 * GiB
    assert host_available_bytes() > 0  # this machine's
    assert host_budget_bytes(100 * GiB, 0.1) == 90 * GiB
    assert host_budget_bytes(10 * GiB, 0.1) == 10 * GiB - HOST_FLOOR_BYTES  # the floor wins on a small machine
    assert host_budget_bytes(GiB, 0.1) == 0
    (tmp_path / "bad").write_text("MemTotal: 1 kB\n")
    with pytest.raises(ValueError, match="MemAvailable"):
        host_available_bytes(tmp_path / "bad")


def test_too_long_for_host_memory_says_how_many_tokens_fit(device, gen, tmp_path):
    model = tiny(device)
    layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    # Room for exactly 8 KiB of checkpoints per layer after the floor and margin: 16 tokens of 128 float32 values.
    room = layers * 16 * hidden * 4
    meminfo = fake_meminfo(tmp_path, HOST_FLOOR_BYTES + room)
    offload = enable_checkpoint_offload(model, keep_on_gpu=0, meminfo=meminfo, host_margin=0.0)
    ids = torch.randint(0, 2048, (1, 40), generator=gen).to(device)
    with pytest.raises(HostMemoryError) as caught:
        model(input_ids=ids, labels=ids)
    message = str(caught.value)
    fit = int(re.search(r"At most about ([\d,]+) tokens", message).group(1).replace(",", ""))
    assert fit == 16 and f"{layers} layer checkpoints of 40 tokens" in message
    short = torch.randint(0, 2048, (1, fit), generator=gen).to(device)
    model(input_ids=short, labels=short).loss.backward()  # what it says fits, fits
    assert offload.stats.copies_to_host == layers
    offload.undo()


def test_host_budget_counts_the_pool_it_already_holds(device, gen, tmp_path):
    # Once the pool holds the slabs, the next steps need nothing new even though MemAvailable has shrunk.
    model = tiny(device)
    layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    meminfo = fake_meminfo(tmp_path, HOST_FLOOR_BYTES + layers * 16 * hidden * 4)
    offload = enable_checkpoint_offload(model, keep_on_gpu=0, meminfo=meminfo, host_margin=0.0)
    ids = torch.randint(0, 2048, (1, 16), generator=gen).to(device)
    loss_and_grads(model, ids)
    meminfo.write_text(f"MemAvailable: {HOST_FLOOR_BYTES // 1024} kB\n")  # the slabs took it all
    loss_and_grads(model, ids)
    assert offload.stats.forwards == 2
    offload.undo()


# ---------------------------------------------------------------------------------------------------------------
# Composition, undo, refusals
# ---------------------------------------------------------------------------------------------------------------


def test_with_the_tiled_mlp(device, ids):
    model = tiny(device)
    reference = copy.deepcopy(model)
    ref_loss, ref_grads = loss_and_grads(reference, ids)
    with apply_tiled_mlp(model, tile_rows=16), enable_checkpoint_offload(model):
        loss, grads = loss_and_grads(model, ids)
    assert relative_error(loss, ref_loss) < TOL[torch.float32]
    assert max(relative_error(grads[n], ref_grads[n]) for n in ref_grads) < TOL[torch.float32]


def test_undo_removes_every_hook(device, ids):
    model = tiny(device)
    functions = [layer._gradient_checkpointing_func for layer in model.model.layers]
    offload = enable_checkpoint_offload(model)
    assert all(layer._gradient_checkpointing_func is not f for layer, f in zip(model.model.layers, functions))
    offload.undo()
    offload.undo()  # twice is harmless
    loss_and_grads(model, ids)
    assert offload.stats.copies_to_host == 0
    assert all(not layer._forward_pre_hooks and not layer._forward_hooks for layer in offload.layers)
    assert [layer._gradient_checkpointing_func for layer in model.model.layers] == functions


def test_checkpointing_enabled_again_is_caught(device, ids):
    model = tiny(device)
    offload = enable_checkpoint_offload(model)
    enable_checkpointing(model)  # replaces the checkpoint function the offload wrapped
    with pytest.raises(RuntimeError, match="enabled again"):
        model(input_ids=ids, labels=ids)
    offload.undo()


def test_refuses_without_checkpointing_or_with_reentrant(device):
    with pytest.raises(ValueError, match="enable them first"):
        enable_checkpoint_offload(tiny(device, checkpointing=False))
    model = tiny(device, checkpointing=False)
    reentrant = {"use_reentrant": True}
    if hasattr(model, "activation_checkpointing_enable"):  # the name newer transformers releases use
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=reentrant)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=reentrant)
    with pytest.raises(ValueError, match="non-reentrant"):
        enable_checkpoint_offload(model)
    with pytest.raises(ValueError, match="keep_on_gpu"):
        enable_checkpoint_offload(tiny(device), keep_on_gpu=9)
    with pytest.raises(ValueError, match="power of two"):
        enable_checkpoint_offload(tiny(device), slab_bytes=3000)
    with pytest.raises(ValueError, match="no Hugging Face decoder layer"):
        CheckpointOffload(torch.nn.Linear(2, 2))


@pytest.mark.usefixtures("fresh_dynamo")
def test_refuses_torch_compile(device, ids):
    model = tiny(device)
    with pytest.raises(RuntimeError, match="torch.compile"):
        enable_checkpoint_offload(torch.compile(model, backend=runtime.COMPILE_BACKEND))
    offload = enable_checkpoint_offload(model)
    compiled = torch.compile(model, backend=runtime.COMPILE_BACKEND)
    with pytest.raises(RuntimeError, match="does not run under torch.compile"):
        compiled(input_ids=ids, labels=ids)
    assert offload.stats.copies_to_host == 0
    offload.undo()


# ---------------------------------------------------------------------------------------------------------------
# GPU: streams, events, pinned memory, the 8B width in bf16
# ---------------------------------------------------------------------------------------------------------------


def two_layer_8b_width(seed=0):
    from kernels.hf.presets import llama_config

    config = llama_config("llama-3.1-8b", num_hidden_layers=2, vocab_size=1024)
    return build_model(config, dtype=torch.bfloat16, device="cuda", seed=seed)


@pytest.mark.gpu
def test_gpu_offload_and_tiled_mlp_match_hugging_face_in_bf16(gen):
    # Hugging Face in bf16 with checkpointing, the same with the offload, and with the offload and the tiled MLP, at
    # a length that is no multiple of the tile, each against a float32 copy of the same model. The offload moves
    # bytes and changes no arithmetic; the tiled MLP rounds differently (float32 sums of the weight gradients), so
    # it must be as close to float32 as Hugging Face is, or within the bf16 bound.
    model = two_layer_8b_width()
    enable_checkpointing(model)
    reference = copy.deepcopy(model).float()
    ids = torch.randint(0, 1024, (1, 3 * 512 + 77), generator=gen).cuda()
    _, ref_grads = loss_and_grads(reference, ids)
    del reference
    _, hf_grads = loss_and_grads(model, ids)
    with enable_checkpoint_offload(model, keep_on_gpu=0) as offload:
        _, offloaded = loss_and_grads(model, ids)
    assert offload.stats.copies_to_host == offload.stats.copies_to_gpu == 2
    with apply_tiled_mlp(model, tile_rows=512), enable_checkpoint_offload(model, keep_on_gpu=0):
        _, both = loss_and_grads(model, ids)
    for name, ref in ref_grads.items():
        assert relative_error(offloaded[name], hf_grads[name]) < 2e-3, name
        ours, hf = relative_error(both[name], ref), relative_error(hf_grads[name], ref)
        assert ours < max(TOL[torch.bfloat16], 1.1 * hf), (name, ours, hf)


@pytest.mark.gpu
def test_gpu_copies_overlap_compute():
    model = two_layer_8b_width()
    enable_checkpointing(model)
    ids = torch.randint(0, 1024, (1, 16384), device="cuda")
    offload = enable_checkpoint_offload(model, keep_on_gpu=0, timeline=True)
    for _ in range(2):  # the first step pins the slabs and compiles kernels
        loss_and_grads(model, ids)
    spans = offload.timeline()
    offload.undo()

    def overlap(a, b):
        return min(a["end_ms"], b["end_ms"]) - max(a["start_ms"], b["start_ms"])

    copies = [s for s in spans if s["stream"] == "copy"]
    compute = [s for s in spans if s["stream"] == "compute"]
    to_host = [c for c in copies if c["what"].endswith("to host")]
    to_gpu = [c for c in copies if c["what"].endswith("to GPU")]
    assert len(to_host) == 2 and len(to_gpu) == 2
    # While layer 0's checkpoint goes to the host, layer 0's forward runs; layer 0's comes back under layer 1's
    # backward.
    forward0 = next(s for s in compute if s["what"] == "layer 0 forward")
    assert overlap(to_host[0], forward0) > 0.5 * (to_host[0]["end_ms"] - to_host[0]["start_ms"])
    backward1 = next(s for s in compute if s["what"] == "layer 1 backward")
    back0 = next(c for c in to_gpu if c["what"] == "layer 0 to GPU")
    assert overlap(back0, backward1) > 0


@pytest.mark.gpu
def test_gpu_pinned_pool_reused_across_steps():
    model = two_layer_8b_width()
    enable_checkpointing(model)
    ids = torch.randint(0, 1024, (1, 4099), device="cuda")
    with enable_checkpoint_offload(model, keep_on_gpu=0) as offload:
        counts = []
        for _ in range(3):
            loss_and_grads(model, ids)
            counts.append(offload.pool.allocations)
        slabs = [s for free in offload.pool.free.values() for s in free]
        assert slabs and all(s.is_pinned() for s in slabs)
    assert counts[0] > 0 and counts == [counts[0]] * 3
