"""Gradient checkpoints offloaded to (pinned) host memory, copied on a side CUDA stream and
prefetched for the backward.

With Hugging Face's gradient checkpointing, each decoder layer keeps one tensor from its forward to
its backward: its input, the hidden states [batch, seq, hidden] (the layer is recomputed from it).
At the Llama-3.1-8B shape that is 4,096 × 2 bytes per token per layer, 256 KiB per token over 32
layers: 128 GiB at 512K tokens, more than the GPU has. The forward does not need a layer's input on
the GPU once the layer has consumed it, and the backward needs it again only when it reaches that
layer, in reverse order. So:

* **pack** (forward): as soon as a layer's checkpoint is saved, a copy to host memory is queued on a
  side CUDA stream, after the kernels that produced it (``wait_stream``), and the GPU tensor is
  marked as in use by that stream (``record_stream``), so the caching allocator does not hand its
  memory out before the copy has read it. The forward goes on at once; the GPU copy is freed when
  the next layer has consumed it.
* **unpack** (backward): the layer's checkpoint was brought back to the GPU on the side stream while
  the layer above it ran its backward (prefetch, ``prefetch`` layers ahead), and the compute stream
  waits for that copy's CUDA event (``wait_event``) before reading it. Nothing in the hot path calls
  ``synchronize()``.

It is built on ``torch.autograd.graph.saved_tensors_hooks``: autograd hands every tensor it saves to
the pack hook and stores what the hook returns; in the backward it hands that back to the unpack
hook and uses the tensor it returns. The hooks are active only around each decoder layer's
checkpoint call (the layer's ``_gradient_checkpointing_func``, which Hugging Face sets when
checkpointing is enabled, is wrapped), where the checkpoint saves its inputs through them before it
pushes its own, innermost hooks for everything saved inside the layer. Only a tensor that is the
layer's input, of shape [batch, seq, hidden], is offloaded; anything else passes through untouched.

**How many go to the host.** The last ``keep_on_gpu`` layers keep their checkpoints on the GPU
(their backward comes first, and hides the first prefetch); the others are offloaded. By default
``keep_on_gpu`` is chosen at the start of each forward: as many checkpoints as fit in
``gpu_fraction`` (half) of the GPU memory then free, after setting aside the weight gradients the
backward will allocate. Offloaded checkpoints must fit the host memory actually available
(``MemAvailable`` in /proc/meminfo) less a safety margin; when they do not, the forward stops with a
``HostMemoryError`` that says how many tokens would fit.

**Pinned buffers.** Copies between the GPU and host run asynchronously only from page-locked
("pinned") memory, and pinning is slow (it maps every page for the GPU), so the host buffers come
from a pool that is reused across steps. PyTorch's pinned-memory allocator rounds each block up to a
power of two (a 1.5 GiB checkpoint would take 2 GiB), so the pool holds power-of-two slabs
(``SLAB_BYTES``, smaller for small checkpoints) and a checkpoint spans as many as it needs: nothing
is wasted but the end of its last slab.

Without CUDA the same code runs with plain host tensors, synchronous copies and no streams: the
tests check there which tensors are offloaded, the pool's reuse, the order of the unpacks and
prefetches, and the memory error. Under ``torch.compile`` it refuses: the hooks run Python at every
layer and manage streams by hand, which a compiled graph does not replay.
"""

from __future__ import annotations

import math
import os
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .tiled_mlp import free_device_bytes

GiB = 1024**3
MEMINFO = Path("/proc/meminfo")
# Host memory left alone: a share of what is available, and at least a floor, for the Python
# process, the data loader and the operating system's page cache.
HOST_MARGIN = 0.10
HOST_FLOOR_BYTES = 2 * GiB
# The pinned slab: a power of two (the pinned allocator's rounding wastes nothing) large enough that
# one cudaMemcpyAsync per slab costs nothing next to the copy (a 64 MiB copy lasts about a
# millisecond over PCIe 5).
SLAB_BYTES = 64 << 20


class HostMemoryError(MemoryError):
    """The checkpoints that must leave the GPU do not fit in the host memory available."""


def host_available_bytes(meminfo: Path | str = MEMINFO) -> int:
    """``MemAvailable`` of /proc/meminfo in bytes: what the kernel estimates can be allocated
    without swapping (free memory plus reclaimable caches). Where the file is missing, the free
    physical pages.

    Args:
        meminfo: the file to read (``/proc/meminfo``; tests pass their own).

    Returns:
        The available host memory, in bytes.

    Raises:
        ValueError: the file exists but has no ``MemAvailable`` line.
    """
    path = Path(meminfo)
    if path.exists():
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
        raise ValueError(f"{path} has no MemAvailable line")
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def host_budget_bytes(available: int, margin: float = HOST_MARGIN, floor: int = HOST_FLOOR_BYTES) -> int:
    """The host bytes the pool may add: ``available`` less ``margin`` of it, and less at least ``floor``.

    Args:
        available: the host's available bytes (``host_available_bytes``).
        margin: the share of ``available`` left alone.
        floor: the fewest bytes left alone.

    Returns:
        ``max(0, available - max(available * margin, floor))``.
    """
    return max(0, available - max(int(available * margin), floor))


def slab_bytes_for(nbytes: int, slab_bytes: int = SLAB_BYTES) -> int:
    """The slab size for checkpoints of ``nbytes``: ``slab_bytes``, or the smallest power of two holding a
    smaller checkpoint whole.

    Args:
        nbytes: the bytes of one checkpoint.
        slab_bytes: the largest slab (a power of two).

    Returns:
        The slab size in bytes, a power of two.
    """
    return min(slab_bytes, 1 << max(0, nbytes - 1).bit_length())


def _fmt(n: float) -> str:
    if n >= GiB:
        return f"{n / GiB:,.2f} GiB"
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 1024:,.1f} KiB"


# --------------------------------------------------------------------------------------------------
# The pool of host slabs
# --------------------------------------------------------------------------------------------------


class HostSlabPool:
    """Host slabs (1-D uint8 tensors, pinned when ``pin``), by size, handed out and taken back;
    allocated only when none of that size is free. ``allocations`` counts every slab ever allocated,
    ``held_bytes`` what the pool owns.

    Args:
        pin: allocate pinned (page-locked) slabs, for asynchronous copies from a CUDA device.
    """

    def __init__(self, pin: bool):
        self.pin = pin
        self.free: dict[int, list[torch.Tensor]] = {}
        self.allocations = 0
        self.held_bytes = 0

    def free_bytes(self, size: int) -> int:
        """The bytes of the free slabs of one size.

        Args:
            size: the slab size in bytes.

        Returns:
            ``size`` times the number of free slabs of that size.
        """
        return size * len(self.free.get(size, ()))

    def take(self, size: int, count: int) -> list[torch.Tensor]:
        """Hand out ``count`` slabs of ``size`` bytes: free ones first, new ones for the rest.

        Args:
            size: the slab size in bytes.
            count: how many slabs.

        Returns:
            ``count`` 1-D uint8 tensors of ``size`` elements, no longer free.
        """
        free = self.free.setdefault(size, [])
        slabs = [free.pop() for _ in range(min(count, len(free)))]
        for _ in range(count - len(slabs)):
            slabs.append(torch.empty(size, dtype=torch.uint8, pin_memory=self.pin))
            self.allocations += 1
            self.held_bytes += size
        return slabs

    def give(self, slabs: list[torch.Tensor]) -> None:
        """Take slabs back: each becomes free under its own size.

        Args:
            slabs: slabs ``take`` handed out.
        """
        for slab in slabs:
            self.free.setdefault(slab.numel(), []).append(slab)

    def trim(self, keep_size: int) -> None:
        """Free the unused slabs of every size but ``keep_size`` (a new sequence length needs other
        slabs).

        Args:
            keep_size: the slab size whose free slabs stay.
        """
        for size in [s for s in self.free if s != keep_size]:
            self.held_bytes -= size * len(self.free.pop(size))

    def clear(self) -> None:
        """Forget every free slab (slabs still in use are freed when their checkpoints are)."""
        for size, slabs in self.free.items():
            self.held_bytes -= size * len(slabs)
        self.free.clear()


# --------------------------------------------------------------------------------------------------
# What the pack hook returns
# --------------------------------------------------------------------------------------------------


class KeptCheckpoint:
    """A checkpoint left on the GPU; the record tells the unpack hook which layer's backward is starting.

    Args:
        layer: the decoder layer's index.
        tensor: the checkpoint (the layer's input), kept as it is.
        forward: that forward's offloaded records by layer, for the prefetch below this layer.
    """

    __slots__ = ("layer", "tensor", "forward")

    def __init__(self, layer: int, tensor: torch.Tensor, forward):
        self.layer, self.tensor, self.forward = layer, tensor, forward


class OffloadedCheckpoint:
    """A checkpoint in host slabs: where it came from, its slabs, and its copy back to the GPU once
    issued. When autograd drops it (after its backward, or with a discarded graph), its slabs go
    back to the pool.

    Args:
        layer: the decoder layer's index.
        tensor: the checkpoint; its shape, dtype, device and size are kept, not the tensor.
        slabs: the host slabs its bytes are copied into.
        forward: that forward's offloaded records by layer (weak values), for the prefetch.
    """

    __slots__ = ("layer", "shape", "dtype", "device", "nbytes", "slabs", "gpu", "fetched",
                 "forward", "__weakref__")

    def __init__(self, layer, tensor, slabs, forward):
        self.layer = layer
        self.shape, self.dtype, self.device = tensor.shape, tensor.dtype, tensor.device
        self.nbytes = tensor.numel() * tensor.element_size()
        self.slabs = slabs
        self.gpu: torch.Tensor | None = None
        self.fetched = None  # the CUDA event recorded after the copy back
        # this forward's records by layer (weak values): the prefetch looks the next one up
        self.forward = forward


def _chunks(nbytes: int, size: int):
    """(start, stop) of each slab's share of a checkpoint of ``nbytes`` in slabs of ``size``."""
    return [(a, min(a + size, nbytes)) for a in range(0, nbytes, size)]


# --------------------------------------------------------------------------------------------------
# The handle
# --------------------------------------------------------------------------------------------------


@dataclass
class OffloadStats:
    """Counts since the handle was made: bytes and copies each way, the pool's slabs, and the last
    forward's plan."""

    bytes_offloaded: int = 0
    copies_to_host: int = 0
    copies_to_gpu: int = 0
    buffers: int = 0  # host slabs allocated, ever: flat across steps once the pool is warm
    host_bytes: int = 0  # host memory the pool holds (pinned on a GPU machine)
    kept_on_gpu: int = 0  # layers whose checkpoint stayed on the GPU in the last forward
    offloaded_layers: int = 0  # layers whose checkpoint went to the host in the last forward
    forwards: int = 0


@dataclass
class _Plan:
    tokens: int
    nbytes: int  # one checkpoint
    keep: int
    first_kept: int  # layers >= first_kept keep their checkpoint on the GPU
    slab: int
    records: weakref.WeakValueDictionary = field(default_factory=weakref.WeakValueDictionary)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers Hugging Face's gradient checkpointing wraps (``GradientCheckpointingLayer``), in
    model order.

    Args:
        model: a Hugging Face model.

    Returns:
        Its ``GradientCheckpointingLayer`` modules, possibly none.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def check_offloadable(model: torch.nn.Module) -> None:
    """Raise, changing nothing, unless ``enable_checkpoint_offload(model)`` can take this model:
    eager (not compiled), with decoder layers under non-reentrant gradient checkpointing
    (``patch_llama`` checks this first).

    Args:
        model: the model to offload.

    Raises:
        RuntimeError: the model is compiled.
        ValueError: it has no decoder layer, gradient checkpointing is off, or it is reentrant.
    """
    _check_model(model, decoder_layers(model))


def _check_model(model: torch.nn.Module, layers: list[torch.nn.Module]) -> None:
    if isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
        raise RuntimeError("checkpoint offload does not run under torch.compile: its hooks run Python at every layer "
                           "and order copies on a side CUDA stream by hand. Enable it on the eager model")
    if not layers:
        raise ValueError(f"{type(model).__name__} has no Hugging Face decoder layer (GradientCheckpointingLayer) "
                         "whose checkpoints could be offloaded")
    if not all(getattr(layer, "gradient_checkpointing", False) for layer in layers):
        raise ValueError("checkpoint offload moves gradient checkpoints: enable them first, with "
                         "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})")
    func = getattr(layers[0], "_gradient_checkpointing_func", None)
    if getattr(func, "keywords", {}).get("use_reentrant", False):
        raise ValueError("checkpoint offload needs non-reentrant checkpointing (its inputs are saved through "
                         "autograd's hooks): gradient_checkpointing_kwargs={'use_reentrant': False}")


@torch.compiler.disable(reason="raises eagerly, where Dynamo cannot swallow the error and run the layer eagerly")
def refuse_if_compiled(compiling: bool) -> None:
    """Raise when ``compiling``. Called with ``torch.compiler.is_compiling()`` from a hook: Dynamo
    evaluates that to True while tracing, and runs this function (excluded from tracing) eagerly, so
    the error reaches the caller. Raised inside traced code, Dynamo would treat it as a graph break
    and quietly run the hook eagerly instead.

    Args:
        compiling: ``torch.compiler.is_compiling()`` at the call site.

    Raises:
        RuntimeError: ``compiling`` is True.
    """
    if compiling:
        raise RuntimeError("checkpoint offload does not run under torch.compile: its hooks run Python at every layer "
                           "and order copies on a side CUDA stream by hand, which a compiled graph does not replay. "
                           "Call undo() on the offload handle before compiling, or run the model eagerly")


class CheckpointOffload:
    """Offload the gradient checkpoints of ``model``'s decoder layers to host memory (see the module
    docstring).

    Attaches on construction; ``undo()`` (or leaving a ``with`` block) removes the hooks and frees
    the pool.

    * ``keep_on_gpu``: how many of the last layers keep their checkpoint on the GPU; None chooses
      per forward from the free GPU memory (``gpu_fraction`` of it, after the weight gradients still
      to be allocated); 0 on a machine without CUDA.
    * ``host_margin``: the share of ``MemAvailable`` (read from ``meminfo``) left alone, at least
      ``HOST_FLOOR_BYTES``.
    * ``prefetch``: how many offloaded layers ahead of the backward the copies back are issued.
    * ``slab_bytes``: the host slab size (a power of two).
    * ``timeline``: record CUDA events around each layer's compute and each copy, for
      ``timeline()``.

    ``stats`` counts bytes and copies; ``log`` lists the last forward's and backward's events in
    order: ``("pack", layer, "host" | "gpu")``, ``("fetch", layer)`` when a copy back is issued,
    ``("unpack", layer)``. Chapter 14 (``notebooks/14_long_context.ipynb``) trains long sequences
    with it.

    Args:
        model: a Hugging Face model with non-reentrant gradient checkpointing on, not compiled.
        keep_on_gpu, gpu_fraction, host_margin, prefetch, slab_bytes, timeline: as above.
        meminfo: the file ``MemAvailable`` is read from at each forward.

    Raises:
        TypeError: ``model`` is not a module.
        ValueError: an option is out of range, or the model has no checkpointed decoder layers
            (``check_offloadable``).
        RuntimeError: the model is compiled; later, a forward under ``torch.compile``, or gradient
            checkpointing enabled again over the offload's wrappers.
        HostMemoryError: at a forward, the checkpoints to offload do not fit in host memory (the
            message says how many tokens would).
    """

    def __init__(self, model: torch.nn.Module, *, keep_on_gpu: int | None = None, gpu_fraction: float = 0.5,
                 host_margin: float = HOST_MARGIN, meminfo: Path | str = MEMINFO, prefetch: int = 1,
                 slab_bytes: int = SLAB_BYTES, timeline: bool = False):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        layers = decoder_layers(model)
        _check_model(model, layers)
        if keep_on_gpu is not None and (not isinstance(keep_on_gpu, int) or isinstance(keep_on_gpu, bool)
                                        or not 0 <= keep_on_gpu <= len(layers)):
            raise ValueError(f"keep_on_gpu must be None or an int in [0, {len(layers)}], got {keep_on_gpu!r}")
        if not 0 < gpu_fraction <= 1:
            raise ValueError(f"gpu_fraction must be in (0, 1], got {gpu_fraction!r}")
        if not 0 <= host_margin < 1:
            raise ValueError(f"host_margin must be in [0, 1), got {host_margin!r}")
        if not isinstance(prefetch, int) or prefetch < 1:
            raise ValueError(f"prefetch must be a positive int, got {prefetch!r}")
        if slab_bytes < 1 or slab_bytes & (slab_bytes - 1):
            raise ValueError(f"slab_bytes must be a power of two, got {slab_bytes!r}")
        self.layers = layers
        self.hidden = model.config.hidden_size if hasattr(model, "config") else None
        self.params = list(model.parameters())
        self.device = self.params[0].device
        self.cuda = self.device.type == "cuda"
        self.keep_on_gpu, self.gpu_fraction, self.host_margin = keep_on_gpu, gpu_fraction, host_margin
        self.meminfo, self.prefetch, self.slab_bytes = meminfo, prefetch, slab_bytes
        self.pool = HostSlabPool(pin=self.cuda)
        self.side = torch.cuda.Stream(self.device) if self.cuda else None
        self.stats = OffloadStats()
        self.log: list[tuple] = []
        self.record_timeline = timeline and self.cuda
        self.events: list[tuple[str, str, object, object]] = []
        self.plan: _Plan | None = None
        # (layer, its input) while a layer's forward runs
        self.current: tuple[int, torch.Tensor] | None = None
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        # Each layer's checkpoint function (set by Hugging Face's gradient_checkpointing_enable) is
        # wrapped: the wrapper is where the layer's inputs are saved, in every transformers release
        # (some run the layer's module hooks inside the checkpoint, some outside), and the
        # backward's recompute never calls it again.
        self.originals = [layer._gradient_checkpointing_func for layer in layers]
        self.wrappers = [self._wrap(index, original) for index, original in enumerate(self.originals)]
        for layer, wrapper in zip(layers, self.wrappers):
            layer._gradient_checkpointing_func = wrapper
        self.handles = [layer.register_forward_pre_hook(self._still_wrapped(index)) for index, layer in
                        enumerate(layers)]
        self.active = True

    # -- around each layer's checkpoint: the saved-tensor hooks for its inputs
    # ------------------------------------

    def _wrap(self, index: int, checkpoint):
        def checkpoint_with_offload(function, *args, **kwargs):
            refuse_if_compiled(torch.compiler.is_compiling())
            hidden = args[0] if args else None
            if not torch.is_grad_enabled() or not isinstance(hidden, torch.Tensor):
                # nothing is saved for a backward: nothing to offload
                return checkpoint(function, *args, **kwargs)
            if index == 0:
                self._begin_forward(hidden)
            if self.plan is None:
                return checkpoint(function, *args, **kwargs)
            self.current = (index, hidden)
            self._mark("compute", f"layer {index} forward", "start")
            try:
                # the checkpoint saves its inputs through these, then pushes its own for the layer
                with self.hooks:
                    output = checkpoint(function, *args, **kwargs)
            finally:
                current, self.current = self.current, None
            self._mark("compute", f"layer {index} forward", "end")
            if current[1] is not None:
                raise RuntimeError(f"decoder layer {index}'s input was not saved through autograd's hooks: checkpoint "
                                   "offload needs non-reentrant gradient checkpointing with the hidden states passed "
                                   "positionally, as Hugging Face's decoder loop does")
            if index == len(self.layers) - 1 and self.plan.first_kept == len(self.layers):
                # Nothing kept on the GPU: the last layer's checkpoint starts back now, under the
                # loss's backward.
                self._prefetch_below(len(self.layers), self.plan.records)
            return output

        checkpoint_with_offload.__wrapped__ = checkpoint
        return checkpoint_with_offload

    def _still_wrapped(self, index: int):
        def hook(layer, args):
            if (layer.gradient_checkpointing and layer.training
                    and layer._gradient_checkpointing_func is not self.wrappers[index]):
                raise RuntimeError("gradient checkpointing was enabled again after enable_checkpoint_offload, which "
                                   "replaced the checkpoint function the offload wraps: call undo() on the offload "
                                   "handle and enable it again")
            return None

        return hook

    # -- the plan of one forward
    # -----------------------------------------------------------------------------------

    def _begin_forward(self, hidden: torch.Tensor) -> None:
        self.plan = None
        self.log = []
        self.events = []
        n = len(self.layers)
        nbytes = hidden.numel() * hidden.element_size()
        tokens = hidden.numel() // hidden.shape[-1]
        keep, gpu_budget = self._keep_count(nbytes)
        slab = slab_bytes_for(nbytes, self.slab_bytes)
        self.pool.trim(slab)
        available = host_available_bytes(self.meminfo)
        host_room = self.pool.held_bytes + host_budget_bytes(available, self.host_margin)
        need = (n - keep) * math.ceil(nbytes / slab) * slab
        if need > host_room:
            raise HostMemoryError(self._too_long(tokens, nbytes, keep, gpu_budget, host_room, available))
        self.plan = _Plan(tokens, nbytes, keep, n - keep, slab)
        self.stats.kept_on_gpu, self.stats.offloaded_layers = keep, n - keep
        self.stats.forwards += 1

    def _keep_count(self, nbytes: int) -> tuple[int, int | None]:
        """(layers kept on the GPU, the GPU bytes that choice had for checkpoints, None when given)."""
        n = len(self.layers)
        if self.keep_on_gpu is not None:
            return self.keep_on_gpu, None
        if not self.cuda:
            return 0, 0
        pending = sum(p.numel() * p.element_size() for p in self.params if p.requires_grad and p.grad is None)
        budget = max(0, int((free_device_bytes(self.device) - pending) * self.gpu_fraction))
        return min(n, budget // max(nbytes, 1)), budget

    def _too_long(self, tokens, nbytes, keep, gpu_budget, host_room, available) -> str:
        n = len(self.layers)
        per_token_layer = nbytes / tokens
        if gpu_budget is None:
            fit = int(host_room / ((n - keep) * per_token_layer))
            gpu_side = f"keep_on_gpu={keep} leaves {n - keep} checkpoints for the host"
        elif not self.cuda:
            fit = int(host_room / (n * per_token_layer))
            gpu_side = "without CUDA every checkpoint goes to host memory"
        else:
            fit = int((gpu_budget + host_room) / (n * per_token_layer))
            gpu_side = f"the GPU has room for {keep} of them ({_fmt(gpu_budget)} for checkpoints)"
        return (f"checkpoint offload: {n} layer checkpoints of {tokens:,} tokens take {_fmt(n * nbytes)} "
                f"({per_token_layer:,.0f} bytes per token per layer); {gpu_side}, but host memory can take only "
                f"{_fmt(host_room)} (MemAvailable {_fmt(available)} less a {self.host_margin:.0%} margin, at least "
                f"{_fmt(HOST_FLOOR_BYTES)}, plus "
                f"the pool's {_fmt(self.pool.held_bytes)}), not the {_fmt((n - keep) * nbytes)} the other "
                f"{n - keep} need. At most about {fit:,} tokens per step (batch × sequence) fit")

    # -- pack and unpack
    # ------------------------------------------------------------------------------------------

    def pack(self, tensor: torch.Tensor):
        """autograd's pack hook: a layer's checkpoint input goes to the host or stays (as a record);
        anything else is returned as it is.

        Args:
            tensor: a tensor autograd saves for the backward.

        Returns:
            ``tensor`` itself, a ``KeptCheckpoint`` or an ``OffloadedCheckpoint``.
        """
        current = self.current
        if current is None or not self._is_layer_input(tensor, current[1]):
            return tensor
        layer = current[0]
        self.current = (layer, None)  # packed: a second save of the same input stays where it is
        if layer >= self.plan.first_kept:
            self.log.append(("pack", layer, "gpu"))
            return KeptCheckpoint(layer, tensor, self.plan.records)
        record = self._offload(layer, tensor)
        self.log.append(("pack", layer, "host"))
        return record

    def _is_layer_input(self, tensor: torch.Tensor, hidden: torch.Tensor | None) -> bool:
        if hidden is None or tensor.dim() != 3 or (self.hidden is not None and tensor.shape[-1] != self.hidden):
            return False
        return tensor is hidden or (tensor.data_ptr() == hidden.data_ptr() and tensor.shape == hidden.shape)

    def _offload(self, layer: int, tensor: torch.Tensor) -> OffloadedCheckpoint:
        plan = self.plan
        source = tensor.contiguous()
        slabs = self.pool.take(plan.slab, math.ceil(plan.nbytes / plan.slab))
        record = OffloadedCheckpoint(layer, tensor, slabs, plan.records)
        weakref.finalize(record, self.pool.give, slabs)  # the slabs come back when autograd drops the record
        flat = source.reshape(-1).view(torch.uint8)
        if self.cuda:
            # After the kernels that wrote the tensor; the forward does not wait for the copy.
            self.side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.side):
                self._mark("copy", f"layer {layer} to host", "start")
                for slab, (a, b) in zip(slabs, _chunks(plan.nbytes, plan.slab)):
                    slab[: b - a].copy_(flat[a:b], non_blocking=True)
                self._mark("copy", f"layer {layer} to host", "end")
            # The allocator must not reuse the tensor's memory before the side stream has read it.
            source.record_stream(self.side)
        else:
            for slab, (a, b) in zip(slabs, _chunks(plan.nbytes, plan.slab)):
                slab[: b - a].copy_(flat[a:b])
        plan.records[layer] = record
        self.stats.bytes_offloaded += plan.nbytes
        self.stats.copies_to_host += 1
        self.stats.buffers, self.stats.host_bytes = self.pool.allocations, self.pool.held_bytes
        return record

    def unpack(self, packed):
        """autograd's unpack hook: the checkpoint on the GPU (waiting for its copy back), with the next ones'
        copies issued.

        Args:
            packed: what ``pack`` returned.

        Returns:
            The saved tensor, on its device.
        """
        if isinstance(packed, torch.Tensor):
            return packed
        self.log.append(("unpack", packed.layer))
        self._mark("compute", f"layer {packed.layer} backward", "start")
        if isinstance(packed, KeptCheckpoint):
            self._prefetch_below(packed.layer, packed.forward)
            return packed.tensor
        if packed.gpu is None:  # not prefetched (the first one, or a second backward through the graph)
            self._fetch(packed)
        self._prefetch_below(packed.layer, packed.forward)
        # autograd owns it now: freed once this layer's backward is done
        tensor, packed.gpu = packed.gpu, None
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(packed.fetched)
        return tensor

    def _prefetch_below(self, layer: int, records: weakref.WeakValueDictionary) -> None:
        """Issue the copies back of the next ``prefetch`` checkpoints below ``layer`` (those
        offloaded, in the forward whose ``records`` these are) not yet issued."""
        for below in range(layer - 1, max(-1, layer - 1 - self.prefetch), -1):
            record = records.get(below)
            if record is not None and record.gpu is None:
                self._fetch(record)

    def _fetch(self, record: OffloadedCheckpoint) -> None:
        gpu = torch.empty(record.shape, dtype=record.dtype, device=record.device)
        flat = gpu.view(-1).view(torch.uint8)
        size = record.slabs[0].numel()
        if self.cuda:
            # The new block may still be read by kernels queued on the compute stream: copy after
            # them.
            self.side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.side):
                self._mark("copy", f"layer {record.layer} to GPU", "start")
                for slab, (a, b) in zip(record.slabs, _chunks(record.nbytes, size)):
                    flat[a:b].copy_(slab[: b - a], non_blocking=True)
                self._mark("copy", f"layer {record.layer} to GPU", "end")
                record.fetched = torch.cuda.Event()
                record.fetched.record(self.side)
            gpu.record_stream(self.side)
        else:
            for slab, (a, b) in zip(record.slabs, _chunks(record.nbytes, size)):
                flat[a:b].copy_(slab[: b - a])
        record.gpu = gpu
        self.log.append(("fetch", record.layer))
        self.stats.copies_to_gpu += 1

    # -- the timeline (GPU)
    # ---------------------------------------------------------------------------------------

    def _mark(self, stream: str, what: str, edge: str) -> None:
        if not self.record_timeline:
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # on the current stream: the side stream inside its `with` block
        self.events.append((stream, what, edge, event))

    def timeline(self) -> list[dict]:
        """The recorded intervals of the last step, ``{"stream", "what", "start_ms", "end_ms"}``
        relative to the first event; a layer's backward runs from its unpack to the next one.
        Synchronises the GPU: call it after the step, never inside one. Empty unless made with
        ``timeline=True`` on a GPU. Chapter 14 (``notebooks/14_long_context.ipynb``) draws it.

        Returns:
            The intervals, sorted by start.
        """
        if not self.events:
            return []
        torch.cuda.synchronize(self.device)
        first = self.events[0][3]
        opened: dict[tuple[str, str], float] = {}
        spans = []
        backward_starts = []
        for stream, what, edge, event in self.events:
            t = first.elapsed_time(event)
            if what.endswith("backward"):
                backward_starts.append((what, t))
            elif edge == "start":
                opened[(stream, what)] = t
            else:
                spans.append({"stream": stream, "what": what,
                              "start_ms": opened.pop((stream, what)), "end_ms": t})
        for (what, t0), (_, t1) in zip(backward_starts, backward_starts[1:]):
            spans.append({"stream": "compute", "what": what, "start_ms": t0, "end_ms": t1})
        return sorted(spans, key=lambda s: s["start_ms"])

    # -- the handle
    # ----------------------------------------------------------------------------------------------

    def undo(self) -> None:
        """Put each layer's checkpoint function back, remove the hooks and free the pool's unused slabs."""
        if not self.active:
            return
        for layer, original, wrapper in zip(self.layers, self.originals, self.wrappers):
            if layer.__dict__.get("_gradient_checkpointing_func") is wrapper:
                layer._gradient_checkpointing_func = original
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.pool.clear()
        self.plan = None
        self.active = False

    def __enter__(self) -> CheckpointOffload:
        return self

    def __exit__(self, *exc) -> None:
        self.undo()

    def summary(self) -> str:
        """One line: the last forward's plan, the copies each way and the pool.

        Returns:
            The line, sizes in KiB, MiB or GiB.
        """
        s = self.stats
        return (f"checkpoint offload over {len(self.layers)} layers: last forward kept {s.kept_on_gpu} on the GPU and "
                f"offloaded {s.offloaded_layers}; {_fmt(s.bytes_offloaded)} copied to the host in "
                f"{s.copies_to_host} copies, {s.copies_to_gpu} back; pool {s.buffers} slabs, {_fmt(s.host_bytes)}"
                f"{' pinned' if self.pool.pin else ''}")


def enable_checkpoint_offload(model: torch.nn.Module, **options) -> CheckpointOffload:
    """Offload ``model``'s gradient checkpoints to host memory; returns the handle (``undo()``,
    ``stats``). The options are ``CheckpointOffload``'s. Gradient checkpointing must be on,
    non-reentrant. Chapter 14 (``notebooks/14_long_context.ipynb``) trains with it;
    ``patch_llama(..., offload_checkpoints=True)`` calls it.

    Args:
        model: as ``CheckpointOffload`` takes it.
        **options: ``CheckpointOffload``'s keyword options.

    Returns:
        The attached ``CheckpointOffload``.

    Raises:
        TypeError, ValueError, RuntimeError: as ``CheckpointOffload`` raises them.
    """
    return CheckpointOffload(model, **options)


__all__ = ["MEMINFO", "HOST_MARGIN", "HOST_FLOOR_BYTES", "SLAB_BYTES", "HostMemoryError",
           "host_available_bytes",
           "host_budget_bytes", "slab_bytes_for", "HostSlabPool", "KeptCheckpoint", "OffloadedCheckpoint",
           "OffloadStats", "decoder_layers", "check_offloadable", "CheckpointOffload",
           "enable_checkpoint_offload"]
