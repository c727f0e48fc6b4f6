"""More than one process: the process group from torchrun's environment, one device per rank, FSDP2 sharding.

One concern, in the order a run meets it:

* ``setup()`` reads what ``torchrun`` puts in every worker's environment (``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), picks the device of this rank (``cuda:<local
  rank>`` in GPU mode, the CPU in Triton's interpreter) and starts the default process group with
  the backend that device needs: NCCL for GPUs, gloo for the CPU. Without torchrun's variables it
  starts a group of one, so the same code runs as a plain script. FSDP2 runs on gloo as it is
  (checked with torch 2.13 on the CPU: all-gather, reduce-scatter with SUM, and
  ``DTensor.full_tensor``), which is how the tests train two processes on one CPU.
* ``shard_llama(model)`` applies FSDP2 (``torch.distributed.fsdp.fully_shard``) the way FSDP2 users
  do: once per decoder layer, then at the root (embeddings, final norm, LM head). Every parameter
  becomes a ``DTensor`` that holds 1/N of it on each rank (dim-0 shards); each layer's parameters
  are all-gathered just before the layer runs and freed after, and their gradients are
  reduce-scattered as soon as the layer's backward is done.
  ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``: the gathered
  parameters are bf16 and gradients are summed across ranks in float32.
* ``print0`` prints on rank 0 only; ``teardown()`` destroys the group.

The workbook's kernels need nothing from this module: inside a layer's forward and backward FSDP2
has already gathered the parameters into plain tensors, so ``TritonRMSNorm`` and the loss see what
they see on one GPU. What *does* matter is the order: patch first, shard second (``prepare_model``).
``fully_shard`` records, for each parameter, the module that owns it and writes the gathered tensor
back into that module before every forward; a norm swapped in after sharding would keep reading the
sharded DTensor (the kernel's operator then refuses a mix of tensors and DTensors, which is the
error you get).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels import runtime

# torchrun's variables; a run without them is a group of one on this machine.
_ENV_DEFAULTS = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits: its rank among ``world_size``, its local rank on the host, device
    and backend."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_rank0(self) -> bool:
        """True on rank 0, the rank that prints and writes."""
        return self.rank == 0


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA tensors, gloo for CPU tensors (the two backends PyTorch ships for them).

    Args:
        device: the device this rank computes on.

    Returns:
        ``"nccl"`` or ``"gloo"``.
    """
    return "nccl" if device.type == "cuda" else "gloo"


def device_for(local_rank: int) -> torch.device:
    """One GPU per local rank in GPU mode; the CPU (every rank shares it) in Triton's interpreter.

    Args:
        local_rank: this process's rank on its host (torchrun's ``LOCAL_RANK``).

    Returns:
        ``cuda:<local_rank>`` in GPU mode, else the CPU.

    Raises:
        RuntimeError: in GPU mode, when the host has no GPU of that index.
    """
    if runtime.MODE == "gpu":
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"local rank {local_rank} has no GPU: this host has {torch.cuda.device_count()}; start at most that "
                "many processes per node (torchrun --nproc-per-node)"
            )
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _env_int(name: str) -> int:
    value = os.environ.get(name, _ENV_DEFAULTS[name])
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from None


def setup() -> DistEnv:
    """Start the default process group from torchrun's environment (or a group of one without it);
    see the module docstring. Idempotent: a second call returns the same ``DistEnv``.

    Chapter 12 calls it in every process.

    Returns:
        this process's ``DistEnv``.
    """
    world, local = _env_int("WORLD_SIZE"), _env_int("LOCAL_RANK")
    device = device_for(local)
    backend = backend_for(device)
    if not dist.is_initialized():
        if world == 1:
            # A group of one needs an address too; a port chosen by the OS keeps parallel runs
            # apart.
            os.environ.setdefault("MASTER_ADDR", _ENV_DEFAULTS["MASTER_ADDR"])
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("WORLD_SIZE", "1")
        if device.type == "cuda":
            torch.cuda.set_device(device)
            # device_id binds the NCCL communicator to this GPU at once (no guess from the current
            # device later).
            dist.init_process_group(backend, device_id=device)
        else:
            dist.init_process_group(backend)
    return DistEnv(dist.get_rank(), dist.get_world_size(), local, device, backend)


def teardown() -> None:
    """Destroy the default process group if one is running (every rank must call it).

    A barrier first: rank 0 hosts the rendezvous store, and a rank 0 that left while another rank
    was still finishing its last collective would take the store away from under it."""
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def free_port() -> int:
    """A TCP port on the loopback interface that is free now (the OS picks it).

    Returns:
        the port number.
    """
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_rank0() -> bool:
    """True on rank 0, and in a process with no process group (it is the only one).

    Returns:
        whether this process prints and writes for the group.
    """
    return not dist.is_initialized() or dist.get_rank() == 0


def print0(*args, **kwargs) -> None:
    """``print`` on rank 0 only (every rank runs the same script; one copy of each line is enough).

    Args:
        *args, **kwargs: as for ``print`` (``flush`` is always on).
    """
    if is_rank0():
        print(*args, **kwargs, flush=True)


# --------------------------------------------------------------------------------------------------
# FSDP2
# --------------------------------------------------------------------------------------------------


def mixed_precision(param_dtype: torch.dtype | None = torch.bfloat16,
                    reduce_dtype: torch.dtype | None = torch.float32):
    """FSDP2's ``MixedPrecisionPolicy``: parameters gathered (and computed with) in ``param_dtype``,
    gradients reduced across ranks in ``reduce_dtype``, then stored in the dtype of the sharded
    parameters. ``None`` keeps the sharded parameters' dtype.

    Args:
        param_dtype: the dtype parameters are gathered and computed in.
        reduce_dtype: the dtype gradients are reduced in.

    Returns:
        the ``torch.distributed.fsdp.MixedPrecisionPolicy``.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a Hugging Face causal LM (``model.model.layers``), each one FSDP unit.

    Args:
        model: a Hugging Face causal LM.

    Returns:
        its decoder layers, in order.

    Raises:
        TypeError: when ``model`` has no non-empty ``model.model.layers``.
    """
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise TypeError(f"expected a Hugging Face causal LM with model.model.layers, got {type(model).__name__}")
    return list(layers)


def shard_llama(
    model: torch.nn.Module,
    mp_policy=None,
    *,
    reshard_after_forward: bool = True,
    sum_gradients: bool = True,
    prefetch: int = 0,
) -> torch.nn.Module:
    """``fully_shard`` each decoder layer, then the root; returns ``model`` (its class is now
    ``FSDP<name>``).

    ``mp_policy`` defaults to ``mixed_precision()`` (bf16 parameters, float32 reduction).
    ``reshard_after_forward`` frees each layer's gathered parameters after its forward (gathered
    again for the backward): memory of one layer's full parameters at a time, at the price of a
    second all-gather; the last layer is kept, since the backward starts with it. FSDP2 prefetches
    the next layer's all-gather while the current layer computes (one layer ahead by default, in
    forward and backward); ``prefetch=k`` asks for ``k`` layers ahead explicitly
    (``set_modules_to_forward_prefetch`` and ``..._backward_prefetch``): more all-gathers in flight
    next to the layers' kernels, more memory for them.

    ``sum_gradients``: reduce-scatter with a plain sum instead of FSDP2's default average over
    ranks. The loop (``kernels.distributed.parallel``) makes each rank's loss its share of the
    global mean (its sum over labels divided by the label count of the whole global batch), so the
    sum across ranks is the gradient of the global mean, exactly what one process computes on the
    whole batch.

    Chapter 12 shards the Llama with it.

    Args:
        model: a Hugging Face causal LM, on this rank's device (patched or not).
        mp_policy: FSDP2's mixed-precision policy (None: ``mixed_precision()``).
        reshard_after_forward: free each layer's gathered parameters after its forward.
        sum_gradients: reduce-scatter gradients by sum instead of mean.
        prefetch: layers to all-gather ahead explicitly (0: FSDP2's implicit one layer).

    Returns:
        ``model`` itself, sharded in place.
    """
    from torch.distributed.fsdp import fully_shard

    mp_policy = mp_policy if mp_policy is not None else mixed_precision()
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        # The last layer is the first the backward needs: freeing it after its forward would only
        # gather it again.
        last = i == len(layers) - 1
        fully_shard(layer, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward and not last)
    # The root never reshards after forward: its parameters (LM head, final norm) are the first the
    # backward needs.
    fully_shard(model, mp_policy=mp_policy, reshard_after_forward=False)
    if prefetch > 0:
        _prefetch(decoder_layers(model), prefetch)
    if sum_gradients:
        for module in model.modules():
            if hasattr(module, "set_gradient_divide_factor"):
                module.set_gradient_divide_factor(1.0)
                # Plain SUM collectives (no pre-multiplied sum op): supported by NCCL and gloo
                # alike.
                module.set_force_sum_reduction_for_comms(True)
    return model


def _prefetch(layers: list, k: int) -> None:
    """Each layer starts the all-gathers of the next ``k`` layers (forward) or of the ``k`` before
    it (backward)."""
    for i, layer in enumerate(layers):
        layer.set_modules_to_forward_prefetch(layers[i + 1:i + 1 + k])
        layer.set_modules_to_backward_prefetch(layers[max(0, i - k):i][::-1])


def prepare_model(
    preset: str,
    env: DistEnv,
    *,
    dtype: torch.dtype = torch.bfloat16,
    param_dtype: torch.dtype | None = torch.bfloat16,
    reduce_dtype: torch.dtype | None = torch.float32,
    seed: int = 0,
    patch: bool = True,
    patch_options: dict | None = None,
    gradient_checkpointing: bool = False,
    prefetch: int = 0,
):
    """Build the model on this rank's device, turn on checkpointing, patch, then shard: in that order.

    Every rank builds the same full model from ``seed`` (``kernels.training.models.build_model``)
    and ``fully_shard`` keeps its 1/N of each parameter, so the sharded model starts from the very
    weights one process would. (The full model exists once per rank for a moment: 16 GB in bf16 for
    the 8B shape; a meta-device build would avoid it.) ``dtype`` is the dtype of the stored
    (sharded) parameters and so of AdamW's states; ``param_dtype`` the one the layers compute in;
    ``prefetch`` goes to ``shard_llama``. Returns ``(model, patch_handle or None)``.

    Chapter 12 builds its sharded models with it.

    Args:
        preset: the model preset (``kernels.training.models``).
        env: this process's ``DistEnv`` (its device).
        dtype: the stored (sharded) parameters' dtype.
        param_dtype: the dtype the layers compute in.
        reduce_dtype: the dtype gradients are reduced in.
        seed: the seed of the weights (the same on every rank).
        patch: apply ``patch_llama``.
        patch_options: keyword arguments for ``patch_llama``.
        gradient_checkpointing: checkpoint each decoder layer.
        prefetch: layers to all-gather ahead (``shard_llama``).

    Returns:
        ``(model, handle)``: the sharded model and the ``LlamaPatch`` (None when ``patch`` is False).
    """
    from kernels.hf.patch import patch_llama
    from kernels.training.loop import enable_checkpointing
    from kernels.training.models import build_model

    model = build_model(preset, dtype=dtype, device=env.device, seed=seed)
    if gradient_checkpointing:
        enable_checkpointing(model)
    handle = patch_llama(model, **(patch_options or {})) if patch else None
    shard_llama(model, mixed_precision(param_dtype, reduce_dtype), prefetch=prefetch)
    return model, handle


def is_sharded(model: torch.nn.Module) -> bool:
    """True when ``model`` went through ``fully_shard`` (its class is FSDP2's ``FSDPModule`` subclass).

    Args:
        model: any module.

    Returns:
        whether it is an ``FSDPModule``.
    """
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


__all__ = [
    "DistEnv", "setup", "teardown", "free_port", "is_rank0", "print0", "backend_for", "device_for",
    "mixed_precision", "decoder_layers", "shard_llama", "prepare_model", "is_sharded",
]
