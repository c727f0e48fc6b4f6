"""What a check keeps out of reach while it runs the learner's code: a ✓ means the learner wrote it.

Each exercise rebuilds something the package (or PyTorch) already has: chapter 16 writes the
online-softmax loop that ``attention_reference`` and ``F.scaled_dot_product_attention`` compute,
chapter 15 the backward that autograd through ``lora_linear`` computes. While a check calls the
learner's function, every finished answer to *that* exercise listed in ``FORBIDDEN`` is replaced by
a tripwire. Calling one stops the check with a verdict that names what was called and why it does
not count, even if the learner's code catches the error.

The tripwire replaces the finished function wherever a learner can reach it by name: as an attribute
of its module (``kernels.attention.attention_reference``, ``F.cross_entropy``,
``torch.Tensor.backward``), under any other name a module of the package binds it to
(``kernels.flash_attention``), in the learner's own namespace (a notebook's ``from kernels.attention
import attention_reference``: the function's ``__globals__``) and in its closure. Everything is put
back when the call returns. Handing the finished function itself (or a ``functools.partial`` of it)
to the check is caught before the call.

Use it in a check as::

    try:
        out = call_learner("attention_loop", fn, q, k, v, causal, block_n)
    except FinishedCodeCalled as called:
        return verdict(False, str(called), verbose)
    except Exception as error:
        ...  # the learner's code raised: name the error

Each row of ``FORBIDDEN`` is one exercise (named like its solution in ``solutions/``); adding an
exercise means adding its row, and the test of the table calls every target.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Forbid:
    """One finished answer: ``target`` is ``"module:attribute"`` (``"torch:Tensor.backward"`` for a
    method), ``what`` says in a few words what it is, and ``when`` (optional) limits the tripwire to
    the calls it returns True for (a launcher the exercise may call with ``compute_grad=False`` but
    not with ``compute_grad=True``)."""

    target: str
    what: str
    when: Callable[..., bool] | None = None


class FinishedCodeCalled(Exception):
    """Raised when the learner's code calls a finished answer to the exercise being checked; the
    message is the check's verdict."""


# Finished answers that count for several exercises.
SOLUTIONS = (Forbid("kernels.exercises.solutions:load", "the hidden solution"),
             Forbid("kernels.exercises.solutions:source", "the hidden solution"))
AUTOGRAD = (
    Forbid("torch:Tensor.backward", "autograd, which computes this gradient for you"),
    Forbid("torch.autograd:backward", "autograd, which computes this gradient for you"),
    Forbid("torch.autograd:grad", "autograd, which computes this gradient for you"),
    Forbid("torch.autograd.functional:vjp", "autograd, which computes this gradient for you"),
    Forbid("torch.autograd.functional:jacobian", "autograd, which computes this gradient for you"),
    Forbid("torch.func:grad", "autograd, which computes this gradient for you"),
    Forbid("torch.func:vjp", "autograd, which computes this gradient for you"),
)
RMS_NORM_FORWARD = (
    Forbid("kernels.rmsnorm:rms_norm", "the package's finished RMSNorm"),
    Forbid("kernels.rmsnorm:rms_norm_forward", "the package's finished RMSNorm kernel"),
    Forbid("kernels.rmsnorm:TritonRMSNorm.forward", "the package's finished RMSNorm module"),
    Forbid("kernels.reference:rms_norm_reference", "the float64 reference the check compares with"),
    Forbid("torch.nn.functional:rms_norm", "PyTorch's own RMSNorm"),
)
RMS_NORM_BACKWARD = (
    Forbid("kernels.rmsnorm:rms_norm_backward", "the package's finished RMSNorm backward"),
    *RMS_NORM_FORWARD, *AUTOGRAD,
)


def _asks_for_gradient(*args, **kwargs) -> bool:
    """Whether a call of ``kernels.cross_entropy.cross_entropy_forward`` asks for the gradient
    (``compute_grad``, by name or by position): with ``compute_grad=False`` it gives only the loss
    and the logsumexp."""
    forward = resolve("kernels.cross_entropy:cross_entropy_forward")[2]
    bound = inspect.signature(forward).bind_partial(*args, **kwargs)
    bound.apply_defaults()
    return bool(bound.arguments["compute_grad"])


CROSS_ENTROPY = (
    Forbid("kernels.cross_entropy:cross_entropy", "the package's finished cross-entropy"),
    Forbid("kernels.cross_entropy:cross_entropy_forward", ("the package's cross-entropy kernel "
                                                           "with its gradient"),
           when=_asks_for_gradient),
    # Whoever launches it (an operator, the autograd Function, the module), the package's kernel
    # with its gradient sweep compiled in.
    Forbid("kernels.cross_entropy:cross_entropy_fwd_kernel.run", ("the package's cross-entropy "
                                                                  "kernel with its gradient"),
           when=lambda *args, **kwargs: bool(kwargs.get("COMPUTE_GRAD"))),
    Forbid("kernels.cross_entropy:TritonCrossEntropyLoss.forward", ("the package's finished "
                                                                    "cross-entropy module")),
    Forbid("kernels.reference:cross_entropy_hf", "the reference the check compares with"),
    Forbid("torch.nn.functional:cross_entropy", "PyTorch's own cross-entropy"),
    Forbid("torch.nn.functional:nll_loss", "PyTorch's own cross-entropy (its second half)"),
    *AUTOGRAD,
)
SOFTMAX = tuple(Forbid(target,
                       "PyTorch's softmax, which your kernel computes in this exercise") for target in (
    "torch:softmax", "torch:log_softmax", "torch:Tensor.softmax", "torch:Tensor.log_softmax",
    "torch.nn.functional:softmax", "torch.nn.functional:log_softmax", "torch.special:softmax",
    "torch.special:log_softmax",
)) + tuple(Forbid(target, "PyTorch's exp, the softmax's half, which your kernel computes in this exercise")
           for target in ("torch:exp", "torch:Tensor.exp", "torch:Tensor.exp_",
                          "torch.special:exp2", "torch:exp2"))
ATTENTION = (
    Forbid("kernels.attention:attention_reference", "the float64 reference the check compares with"),
    Forbid("kernels.attention:flash_attention", "the package's finished FlashAttention"),
    Forbid("kernels.attention:attention_forward", "the package's finished FlashAttention kernel"),
    Forbid("torch.nn.functional:scaled_dot_product_attention", "PyTorch's own attention"),
)
LORA = (
    Forbid("kernels.lora:lora_linear", "the package's finished LoRA layer"),
    Forbid("kernels.lora:lora_backward", "the package's finished LoRA backward"),
    Forbid("kernels.lora:lora_linear_reference", "the reference LoRA layer"),
    Forbid("kernels.lora:lora_group", "the package's finished LoRA group"),
    Forbid("kernels.lora:swiglu_lora_down", "the package's finished LoRA down_proj"),
    Forbid("kernels.lora:group_backward", "the package's finished LoRA group backward"),
    # The operator runs the backward's implementation as it was registered, not through the module's name.
    Forbid("kernels.lora:lora_bwd_op", "the package's finished LoRA backward operator"),
    Forbid("torch._ops:ops.kernels.lora_linear_bwd", "the package's finished LoRA backward operator"),
    Forbid("kernels.lora:LoRALinearFunction.backward", "the package's finished LoRA backward"),
    Forbid("kernels.lora:SwiGLULoRADownFunction.backward", "the package's finished LoRA backward"),
    Forbid("kernels.lora:LoRAGroupFunction.backward", "the package's finished LoRA group backward"),
    Forbid("kernels.exercises.lora:_terms", "the check's own float64 gradients"),
    *AUTOGRAD,
    # Autograd's transforms that AUTOGRAD's entries do not reach: they call autograd's internals,
    # not those names.
    Forbid("torch.func:jacrev", "autograd, which computes this gradient for you"),
    Forbid("torch.func:jacfwd", "autograd, which computes this gradient for you"),
    Forbid("torch.func:grad_and_value", "autograd, which computes this gradient for you"),
)
# Chapters 02 and 03: PyTorch's and Hugging Face's RMSNorm and the package's forward kernel (the
# first three, which the forward exercises keep out of reach too), then the package's backward
# kernel and autograd's transforms.
RMS_NORM_KERNELS = (
    Forbid("torch:rms_norm", "PyTorch's own RMSNorm"),
    Forbid("transformers.models.llama.modeling_llama:LlamaRMSNorm.forward",
           "Hugging Face's RMSNorm, the module the check compares with"),
    Forbid("kernels.rmsnorm:rms_norm_fwd_kernel.run", "the package's finished RMSNorm forward kernel"),
    Forbid("kernels.rmsnorm:rms_norm_bwd_kernel.run", "the package's finished RMSNorm backward kernel"),
    # Autograd's transforms that AUTOGRAD's entries do not reach (they call autograd's internals,
    # not those names).
    Forbid("torch.func:jacrev", "autograd, which computes this gradient for you"),
    Forbid("torch.func:jacfwd", "autograd, which computes this gradient for you"),
    Forbid("torch.func:grad_and_value", "autograd, which computes this gradient for you"),
)


def _is_rms_norm_fwd(op=None, *args, **kwargs) -> bool:
    """Whether an operator call (``op`` the OpOverload or its packet) is the package's
    ``kernels::rms_norm_fwd``."""
    name = getattr(op, "_qualified_op_name", None) or getattr(op, "_name", "")
    return name == "kernels::rms_norm_fwd"


AMDAHL = (
    Forbid("kernels.training.profiling:step_speedup", "the package's Amdahl's law"),
    Forbid("kernels.training.profiling:amdahl", "the package's Amdahl estimate of a profile"),
    Forbid("kernels.exercises.profile:amdahl_reference", "the formula the check compares with"),
)
BYTE_COUNTS = (
    Forbid("kernels.exercises.bandwidth:transfer_bytes", "the package's byte count the check compares with"),
    Forbid("kernels.bench.sweep:rmsnorm_bytes", "the sweep's RMSNorm byte count"),
    Forbid("kernels.bench.sweep:cross_entropy_bytes", "the sweep's cross-entropy byte count"),
)
FLOOR = (
    Forbid("kernels.bench.timing:floor_ms", "the package's floor, in milliseconds"),
    Forbid("kernels.exercises.bandwidth:floor_reference_us", "the floor the check compares with"),
)
NORM_SURGERY = (
    Forbid("kernels.hf.patch:patch_llama", "the package's finished patch, which does the whole surgery"),
    Forbid("kernels:patch_llama", "the package's finished patch, which does the whole surgery"),
)
RMS_NORM_FAKE = (
    Forbid("kernels.rmsnorm:rms_norm_fwd_fake", "the package's finished fake implementation"),
    Forbid("kernels.rmsnorm:rms_norm", ("the package's RMSNorm, whose operator answers from the "
                                        "finished fake")),
    Forbid("torch._ops:OpOverload.__call__",
           "the package's operator torch.ops.kernels.rms_norm_fwd, which answers from the finished fake",
           when=_is_rms_norm_fwd),
    Forbid("torch._ops:OpOverloadPacket.__call__",
           "the package's operator torch.ops.kernels.rms_norm_fwd, which answers from the finished fake",
           when=_is_rms_norm_fwd),
)
SLICE_GRADIENT = (
    Forbid("kernels.exercises.linear_cross_entropy:reference_slice_gradient",
           "the float64 slice gradient the check compares with"),
    Forbid("kernels.linear_cross_entropy:_grad_slice_kernel", ("the package's finished "
                                                               "slice-gradient kernel")),
    Forbid("kernels.linear_cross_entropy:gradient_pass", ("the package's finished gradient pass "
                                                          "over the slices")),
    Forbid("kernels.linear_cross_entropy:linear_cross_entropy", ("the package's finished linear "
                                                                 "cross-entropy")),
    Forbid("torch.nn.functional:cross_entropy", "PyTorch's own cross-entropy"),
    *AUTOGRAD,
)
SWIGLU_BACKWARD = (
    Forbid("kernels.swiglu:swiglu_bwd_kernel", "the package's finished SwiGLU backward kernel"),
    Forbid("kernels.swiglu:swiglu_backward", "the package's finished SwiGLU backward"),
    Forbid("kernels.swiglu:swiglu_backward_", "the package's finished in-place SwiGLU backward"),
    Forbid("kernels.swiglu:launch_backward", "the package's finished SwiGLU backward launch"),
    Forbid("kernels.swiglu:swiglu", "the package's finished SwiGLU"),
    Forbid("kernels.reference:swiglu_reference", "the float64 SwiGLU reference"),
    Forbid("torch.nn.functional:silu", "PyTorch's own SiLU, whose derivative is the exercise"),
    *AUTOGRAD,
)
ROPE_BACKWARD = (
    Forbid("kernels.rope:rope_backward", "the package's finished RoPE backward"),
    Forbid("kernels.rope:apply_rotary", "the package's finished RoPE"),
    Forbid("kernels.reference:rotary_reference", "the float64 RoPE reference"),
    Forbid("transformers.models.llama.modeling_llama:apply_rotary_pos_emb", "Hugging Face's RoPE"),
    *AUTOGRAD,
)
LABEL_COUNT = (
    Forbid("kernels.distributed.parallel:global_label_counts", "the package's finished global label count"),
    Forbid("kernels.training.loop:labels_per_step", "the package's finished count per step"),
    Forbid("kernels.training.loop:count_trained_labels", ("the package's finished count of a "
                                                          "batch's trained labels")),
    Forbid("kernels.exercises.distributed:expected_counts", "the counts the check compares with"),
)

# Chapter 13: the checks compile the learner's C++ and CUDA source, which cannot call Python; these
# rows name the package's finished versions all the same, so that a check that runs learner Python
# for them keeps them away.
CPP_RMS_NORM = (
    Forbid("kernels.cuda_rmsnorm:rms_norm_cpp", "the package's finished C++ RMSNorm"),
    Forbid("kernels.cuda_rmsnorm:rms_norm_cuda", "the package's finished CUDA RMSNorm"),
    *RMS_NORM_FORWARD,
)
# Chapter 14: the package's tile loop and tiled MLP; the package's offload, whose pack and unpack
# are the answer.
TILED_MLP = (
    Forbid("kernels.hf.tiled_mlp:tile_bounds", "the package's finished tile loop bounds"),
    Forbid("kernels.hf.tiled_mlp:tiled_swiglu_mlp", "the package's finished tiled MLP"),
    Forbid("kernels.hf.tiled_mlp:TiledSwiGLUFunction.forward", "the package's finished tiled MLP forward"),
    Forbid("kernels.hf.tiled_mlp:TiledSwiGLUMLP.forward", "the package's finished tiled MLP module"),
)
OFFLOAD = (
    Forbid("kernels.hf.offload:CheckpointOffload.__init__", "the package's finished checkpoint offload"),
    Forbid("kernels.hf.offload:CheckpointOffload.pack", "the package's finished offload pack hook"),
    Forbid("kernels.hf.offload:CheckpointOffload.unpack", "the package's finished offload unpack hook"),
    Forbid("kernels.hf.offload:CheckpointOffload._offload", "the package's finished copy to the host"),
    Forbid("kernels.hf.offload:CheckpointOffload._fetch", "the package's finished copy back"),
    Forbid("kernels.hf.offload:enable_checkpoint_offload", "the package's finished checkpoint offload"),
)

# What each exercise keeps out of reach, by the name of its solution.
FORBIDDEN: dict[str, tuple[Forbid, ...]] = {
    # Chapter 02's forward function and tile kernel, chapter 03's dx and backward tile kernel. The
    # package's Triton kernels trip when launched (``.run``), whoever launches them: the operators,
    # the Function, the module.
    "rms_norm_forward_rows": RMS_NORM_FORWARD + RMS_NORM_KERNELS[:3],
    "rms_norm_tile_kernel": RMS_NORM_FORWARD + RMS_NORM_KERNELS[:3],
    "rms_norm_dx": RMS_NORM_BACKWARD + RMS_NORM_KERNELS,
    "rms_norm_bwd_tile_kernel": RMS_NORM_BACKWARD + RMS_NORM_KERNELS,
    "online_update": (Forbid("kernels.reference:online_softmax_steps", "the package's online softmax"),
                      Forbid("kernels.reference:online_logsumexp", "the package's online softmax")),
    # Chapter 06: the gradient is the exercise's kernel, so PyTorch's softmax and exp stay out of reach too.
    "ce_gradient": CROSS_ENTROPY + SOFTMAX,
    "inplace_gradient": CROSS_ENTROPY + SOFTMAX,
    "lora_backward": LORA,
    "attention_loop": (*ATTENTION, Forbid("kernels.exercises.attention:blockwise_attention",
                                          "the check's own loop, which it recomputes your mistakes with")),
    "amdahl_speedup": AMDAHL,
    "rmsnorm_minimal_bytes": BYTE_COUNTS,
    "cross_entropy_minimal_bytes": BYTE_COUNTS,
    "floor_us": FLOOR,
    "patch_norms_by_hand": NORM_SURGERY,
    "rms_norm_fake": RMS_NORM_FAKE,
    "slice_gradient": SLICE_GRADIENT,
    "slice_gradient_kernel": SLICE_GRADIENT,
    "swiglu_bwd_tile_kernel": SWIGLU_BACKWARD,
    "rope_bwd_one_kernel": ROPE_BACKWARD,
    "global_label_count": LABEL_COUNT,
    "global_label_count_collective": LABEL_COUNT,
    "rms_norm_rows": CPP_RMS_NORM,
    "rstd_warp_per_row": CPP_RMS_NORM,
    "tiled_forward": TILED_MLP,
    "offload_hooks": OFFLOAD,
    # Chapter 17: the fused add + RMSNorm forward kernel; the package's fused version in every form,
    # its RMSNorm, PyTorch's and Hugging Face's, the check's reference and the solution's kernel.
    "add_rms_norm_kernel": (
        Forbid("kernels.add_rmsnorm:add_rms_norm", "the package's finished fused add + RMSNorm"),
        Forbid("kernels.add_rmsnorm:add_rms_norm_forward", "the package's finished fused add + RMSNorm"),
        Forbid("kernels.add_rmsnorm:add_rms_norm_fwd_kernel.run", "the package's finished fused kernel"),
        Forbid("kernels.add_rmsnorm:AddRMSNormFunction.forward", "the package's finished fused add + RMSNorm"),
        Forbid("torch._ops:ops.kernels.add_rms_norm_fwd", "the package's finished fused operator"),
        Forbid("kernels.exercises.whole_step:add_rms_norm_reference",
               "the float64 reference the check compares with"),
        Forbid("kernels.exercises.solutions.add_rms_norm_kernel:add_rms_norm_kernel.run",
               "the hidden solution's kernel"),
        *RMS_NORM_FORWARD, *RMS_NORM_KERNELS[:3],
    ),
    # Chapter 16: one head's tile as a tensor descriptor; the package's own descriptor function.
    "tile_descriptor": (
        Forbid("kernels.attention:_descriptor", "the package's finished descriptor of a head's tile"),
        Forbid("kernels.exercises.solutions.tile_descriptor:tile_descriptor", "the hidden solution"),
    ),
    # Chapter 18: one row quantised to FP8 with its own scale; the package's quantiser in every
    # form (its kernel trips when launched, whoever launches it) and the references the check
    # compares with.
    "quantize_row_kernel": (
        Forbid("kernels.fp8:quantize_rows", "the package's finished FP8 quantiser"),
        Forbid("kernels.fp8:quantize_rows_kernel.run", "the package's finished FP8 quantiser kernel"),
        Forbid("kernels.fp8:quantize_rows_reference", "the reference the check compares with"),
        Forbid("kernels.fp8:row_scales_reference", "the scales the check compares with"),
        Forbid("torch._ops:ops.kernels.quantize_rows", "the package's finished FP8 quantiser operator"),
        Forbid("kernels.exercises.solutions.quantize_row_kernel:quantize_row_kernel.run",
               "the hidden solution's kernel"),
    ),
}


def targets(exercise: str) -> tuple[Forbid, ...]:
    """What ``exercise`` keeps out of reach: its row of ``FORBIDDEN`` and the hidden solutions.

    Args:
        exercise: an exercise's name, a key of ``FORBIDDEN`` (``"lora_backward"``).

    Returns:
        Its ``Forbid`` entries, then those of ``SOLUTIONS``.

    Raises:
        ValueError: ``exercise`` is not in ``FORBIDDEN``; the message names the exercises there are.
    """
    if exercise not in FORBIDDEN:
        raise ValueError(f"no exercise named {exercise!r} in FORBIDDEN; there are: "
                         f"{', '.join(sorted(FORBIDDEN))}")
    return FORBIDDEN[exercise] + SOLUTIONS


def resolve(target: str) -> tuple[Any, str, Any]:
    """Find the object a ``Forbid`` target names, and where it lives.

    Args:
        target: ``"module:attribute"`` or ``"module:Class.attribute"`` (any depth of dots after the
            colon).

    Returns:
        ``(owner, attribute, value)``: the module or class that holds it, its name there, and the
        object itself.

    Raises:
        ImportError: the module cannot be imported.
        AttributeError: an attribute on the path does not exist.
    """
    module_name, _, path = target.partition(":")
    owner: Any = importlib.import_module(module_name)
    *parents, attribute = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    return owner, attribute, getattr(owner, attribute)


@dataclass
class Tripwire:
    """The calls of finished answers seen while the learner's code ran (the first one is the verdict)."""

    exercise: str
    called: list[tuple[str, str]] = field(default_factory=list)

    @property
    def message(self) -> str | None:
        """The verdict that names the first finished answer called, or None when none was."""
        if not self.called:
            return None
        name, what = self.called[0]
        return (f"your code called {name} ({what}): that is a finished answer to this exercise, so "
                "the check keeps it out of reach, and a ✓ would not be yours. Write it yourself; "
                f"solution(\"{self.exercise}\") shows one answer once you have tried.")

    def wire(self, forbid: Forbid, original: Callable) -> Callable:
        """A stand-in for ``original`` that records the call and raises instead of answering.

        Args:
            forbid: the finished answer ``original`` is (its ``when`` lets some calls through).
            original: the function, method or kernel to stand in for.

        Returns:
            A function with ``original``'s name and signature that, when called (and ``forbid.when``
            allows), appends the call to ``called`` and raises ``FinishedCodeCalled`` with
            ``message``; calls ``forbid.when`` turns away go to ``original``.
        """
        name = forbid.target.replace(":", ".")

        @functools.wraps(original)
        def tripped(*args, **kwargs):
            if forbid.when is not None and not forbid.when(*args, **kwargs):
                return original(*args, **kwargs)
            self.called.append((name, forbid.what))
            raise FinishedCodeCalled(self.message)

        return tripped


def _base(fn: Any) -> Any:
    """The function under partials and bound methods: where the learner's names live."""
    while True:
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif hasattr(fn, "__func__"):
            fn = fn.__func__
        else:
            return fn


def _namespaces(fn: Any) -> Iterator[dict]:
    """The dictionaries a learner's function can look a finished answer up in, by name."""
    seen: set[int] = set()
    base = _base(fn)
    candidates = [getattr(base, "__globals__", None)]
    candidates += [vars(module) for name, module in list(sys.modules.items())
                   if module is not None
                   and (name == "kernels" or name.startswith("kernels.") or name == "__main__")]
    for namespace in candidates:
        if isinstance(namespace, dict) and id(namespace) not in seen:
            seen.add(id(namespace))
            yield namespace


@contextmanager
def out_of_reach(exercise: str, fn: Any = None) -> Iterator[Tripwire]:
    """Within the block, every finished answer to ``exercise`` that ``fn`` can reach is a tripwire.

    The answers are replaced where they are defined, and under every name that holds them in
    ``fn``'s globals, in the ``kernels`` modules, in ``__main__`` and in ``fn``'s closure;
    everything is restored on the way out, even on an error.

    Args:
        exercise: a key of ``FORBIDDEN``.
        fn: the learner's function (a partial or bound method is looked through); None wires only
            the places the answers are defined and the modules' names.

    Yields:
        The ``Tripwire`` that records the calls made inside the block.

    Raises:
        ValueError: ``exercise`` is not in ``FORBIDDEN``.
    """
    tripwire = Tripwire(exercise)
    undo: list[Callable[[], None]] = []
    try:
        by_id: dict[int, Callable] = {}
        for forbid in targets(exercise):
            owner, attribute, original = resolve(forbid.target)
            wire = tripwire.wire(forbid, original)
            by_id[id(original)] = wire
            stored = vars(owner).get(attribute, original) if isinstance(owner, type) else original
            setattr(owner, attribute, wire)
            undo.append(functools.partial(setattr, owner, attribute, stored))
        for namespace in _namespaces(fn):
            for key, value in list(namespace.items()):
                if id(value) in by_id and not isinstance(value, type(sys)):
                    namespace[key] = by_id[id(value)]
                    undo.append(functools.partial(namespace.__setitem__, key, value))
        for cell in getattr(_base(fn), "__closure__", None) or ():
            value = cell.cell_contents if _filled(cell) else None
            if value is not None and id(value) in by_id:
                cell.cell_contents = by_id[id(value)]
                undo.append(functools.partial(setattr, cell, "cell_contents", value))
        yield tripwire
    finally:
        for step in reversed(undo):
            step()


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018  (an empty cell raises)
    except ValueError:
        return False
    return True


def finished_answer(exercise: str, obj: Any) -> str | None:
    """Say whether ``obj`` is one of ``exercise``'s finished answers, passed as the learner's.

    Args:
        exercise: a key of ``FORBIDDEN``.
        obj: what the learner handed to the check (a partial or bound method is looked through).

    Returns:
        The verdict (the ``Tripwire`` message naming the answer) when it is one, else None.

    Raises:
        ValueError: ``exercise`` is not in ``FORBIDDEN``.
    """
    base = _base(obj)
    for forbid in targets(exercise):
        if resolve(forbid.target)[2] is base:
            return Tripwire(exercise, [(forbid.target.replace(":", "."), forbid.what)]).message
    return None


def call_learner(exercise: str, fn: Callable, *args, watch: Any = None, **kwargs):
    """Call ``fn(*args, **kwargs)`` with ``exercise``'s finished answers out of reach.

    Args:
        exercise: a key of ``FORBIDDEN``.
        fn: the learner's function, or the check's launcher of the learner's code.
        *args, **kwargs: passed to ``fn``.
        watch: the learner's own code when ``fn`` is the check's launcher of it (a Triton kernel's
            Python function, ``kernel.fn``): the tripwire then replaces the names in ``watch``'s
            namespace; None: in ``fn``'s.

    Returns:
        What ``fn`` returns.

    Raises:
        FinishedCodeCalled: ``fn`` (or ``watch``) is a finished answer, or called one, even if it
            caught the error; its message is the verdict.
        ValueError: ``exercise`` is not in ``FORBIDDEN``.
        Exception: any other error of ``fn`` propagates as it is.
    """
    code = fn if watch is None else watch
    message = finished_answer(exercise, code)
    if message:
        raise FinishedCodeCalled(message)
    with out_of_reach(exercise, code) as tripwire:
        return run_watched(tripwire, fn, *args, **kwargs)


def run_watched(tripwire: Tripwire, fn: Callable, *args, **kwargs):
    """Call ``fn(*args, **kwargs)`` inside an ``out_of_reach`` block whose ``tripwire`` is given.

    For a check that wires more than its row of ``FORBIDDEN`` into the same tripwire.

    Args:
        tripwire: the ``Tripwire`` the enclosing ``out_of_reach`` block yielded.
        fn: the learner's function (or the check's launcher of it).
        *args, **kwargs: passed to ``fn``.

    Returns:
        What ``fn`` returns.

    Raises:
        FinishedCodeCalled: ``fn`` called a finished answer, even if it caught the error or turned
            it into another one.
        Exception: any other error of ``fn`` propagates as it is.
    """
    try:
        result = fn(*args, **kwargs)
    except FinishedCodeCalled:
        raise
    except Exception:
        if tripwire.called:  # the learner's code turned the tripwire's error into another one
            raise FinishedCodeCalled(tripwire.message) from None
        raise
    if tripwire.called:  # the learner's code caught the tripwire's error and went on
        raise FinishedCodeCalled(tripwire.message)
    return result
