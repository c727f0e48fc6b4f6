"""What a check keeps out of reach while it runs the learner's code: a ✓ means the learner wrote it.

Each exercise rebuilds something the package (or PyTorch) already has: chapter 16 writes the online-softmax loop that
``attention_reference`` and ``F.scaled_dot_product_attention`` compute, chapter 15 the backward that autograd through
``lora_linear`` computes. While a check calls the learner's function, every finished answer to *that* exercise listed
in ``FORBIDDEN`` is replaced by a tripwire. Calling one stops the check with a verdict that names what was called and
why it does not count, even if the learner's code catches the error.

The tripwire replaces the finished function wherever a learner can reach it by name: as an attribute of its module
(``kernels.attention.attention_reference``, ``F.cross_entropy``, ``torch.Tensor.backward``), under any other name a
module of the package binds it to (``kernels.flash_attention``), in the learner's own namespace (a notebook's
``from kernels.attention import attention_reference``: the function's ``__globals__``) and in its closure. Everything
is put back when the call returns. Handing the finished function itself (or a ``functools.partial`` of it) to the
check is caught before the call.

Use it in a check as::

    try:
        out = call_learner("attention_loop", fn, q, k, v, causal, block_n)
    except FinishedCodeCalled as called:
        return verdict(False, str(called), verbose)
    except Exception as error:
        ...  # the learner's code raised: name the error

Each row of ``FORBIDDEN`` is one exercise (named like its solution in ``solutions/``); adding an exercise means adding
its row, and the test of the table calls every target.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Forbid:
    """One finished answer: ``target`` is ``"module:attribute"`` (``"torch:Tensor.backward"`` for a method), ``what``
    says in a few words what it is, and ``when`` (optional) limits the tripwire to the calls it returns True for (a
    launcher the exercise may call with ``compute_grad=False`` but not with ``compute_grad=True``)."""

    target: str
    what: str
    when: Callable[..., bool] | None = None


class FinishedCodeCalled(Exception):
    """Raised when the learner's code calls a finished answer to the exercise being checked; the message is the
    check's verdict."""


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
CROSS_ENTROPY = (
    Forbid("kernels.cross_entropy:cross_entropy", "the package's finished cross-entropy"),
    Forbid("kernels.cross_entropy:cross_entropy_forward", "the package's cross-entropy kernel with its gradient",
           when=lambda *args, **kwargs: kwargs.get("compute_grad", True)),
    Forbid("kernels.cross_entropy:TritonCrossEntropyLoss.forward", "the package's finished cross-entropy module"),
    Forbid("kernels.reference:cross_entropy_hf", "the reference the check compares with"),
    Forbid("torch.nn.functional:cross_entropy", "PyTorch's own cross-entropy"),
    Forbid("torch.nn.functional:nll_loss", "PyTorch's own cross-entropy (its second half)"),
    *AUTOGRAD,
)
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
    *AUTOGRAD,
)

# What each exercise keeps out of reach, by the name of its solution.
FORBIDDEN: dict[str, tuple[Forbid, ...]] = {
    "rms_norm_tile_kernel": RMS_NORM_FORWARD,
    "rms_norm_dx": RMS_NORM_BACKWARD,
    "rms_norm_bwd_tile_kernel": RMS_NORM_BACKWARD,
    "online_update": (Forbid("kernels.reference:online_softmax_steps", "the package's online softmax"),
                      Forbid("kernels.reference:online_logsumexp", "the package's online softmax")),
    "ce_gradient": CROSS_ENTROPY,
    "inplace_gradient": CROSS_ENTROPY,
    "lora_backward": LORA,
    "attention_loop": ATTENTION,
}


def targets(exercise: str) -> tuple[Forbid, ...]:
    """What ``exercise`` keeps out of reach (its row of ``FORBIDDEN`` and the hidden solutions); a ValueError names
    the exercises there are."""
    if exercise not in FORBIDDEN:
        raise ValueError(f"no exercise named {exercise!r} in FORBIDDEN; there are: {', '.join(sorted(FORBIDDEN))}")
    return FORBIDDEN[exercise] + SOLUTIONS


def resolve(target: str) -> tuple[Any, str, Any]:
    """``(owner, attribute, value)`` for ``"module:attribute"`` or ``"module:Class.attribute"``."""
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
        if not self.called:
            return None
        name, what = self.called[0]
        return (f"your code called {name} ({what}): that is a finished answer to this exercise, so the check keeps it "
                f"out of reach, and a ✓ would not be yours. Write it yourself; solution(\"{self.exercise}\") shows "
                f"one answer once you have tried.")

    def wire(self, forbid: Forbid, original: Callable) -> Callable:
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
                   if module is not None and (name == "kernels" or name.startswith("kernels.") or name == "__main__")]
    for namespace in candidates:
        if isinstance(namespace, dict) and id(namespace) not in seen:
            seen.add(id(namespace))
            yield namespace


@contextmanager
def out_of_reach(exercise: str, fn: Any = None) -> Iterator[Tripwire]:
    """Within the block, each finished answer to ``exercise`` is a tripwire, wherever ``fn`` (the learner's function)
    could reach it by name; everything is restored on the way out."""
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


def call_learner(exercise: str, fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)`` with ``exercise``'s finished answers out of reach. Raises ``FinishedCodeCalled``
    (its message is the verdict) when ``fn`` is a finished answer or called one, even if ``fn`` caught the error;
    any other error of ``fn`` propagates as it is."""
    finished = {id(resolve(forbid.target)[2]): forbid for forbid in targets(exercise)}
    base = _base(fn)
    if id(base) in finished:
        forbid = finished[id(base)]
        tripwire = Tripwire(exercise, [(forbid.target.replace(":", "."), forbid.what)])
        raise FinishedCodeCalled(tripwire.message)
    with out_of_reach(exercise, fn) as tripwire:
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
