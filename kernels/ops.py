"""The ``kernels`` operator namespace: every kernel launch of the package as a PyTorch operator.

A Python function that launches a Triton kernel is opaque to PyTorch: ``torch.compile`` tries to
trace into it (and, in Triton's interpreter, into NumPy), CUDA-graph capture cannot see what it
allocates, and tensor subclasses get raw pointers. Registered as an operator
(``torch.ops.kernels.<name>``) it becomes one node that PyTorch knows
how to handle:

* the *implementation* runs the launch on real tensors (CPU tensors in the interpreter, CUDA tensors
  on a GPU);
* the *fake* implementation only says what the outputs look like (shape, dtype, device) without
  computing anything, which is all the compiler needs while it traces a model;
* a schema string declares which inputs an operator writes (``Tensor(a!)``), so that the compiler
  never reorders or drops a mutation.

Autograd is not registered on the operators themselves: each kernel family wraps its forward and
backward operators in one ``torch.autograd.Function``, which ``torch.compile`` traces like any
other. ``torch.library.register_autograd`` costs more host time per forward + backward than the
``autograd.Function``, far more than the kernels themselves take (assets/notes/rmsnorm.md, "Host
overhead").

The operator is what a *tracer* needs: the compiler, fake tensors, a tensor subclass, a
``TorchDispatchMode``. A plain eager call needs none of it, and the trip through the dispatcher into
a Python implementation costs host time on every call. So RMSNorm's, cross-entropy's, SwiGLU's and
RoPE's ``autograd.Function``s and the AdamW step call their operators through ``call(op, ...)``,
which runs the registered implementation itself when ``direct(...)`` finds nothing tracing or
intercepting: the same function the operator would have run, with the same version-counter bumps for
what it writes (chapter 09 measures what that saves). The linear cross-entropy calls its operators
plainly: it runs once per step, on milliseconds of matmuls, where the dispatcher's microseconds do
not show.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

NAMESPACE = "kernels"
_LIBRARY = torch.library.Library(NAMESPACE, "DEF")
_IMPLS: dict[torch._ops.OpOverload, Callable] = {}  # each operator's implementation, for ``call``


# The dtypes every kernel takes (it loads them, computes in float32 and stores them back); float64
# and the rest are refused with what to do instead (docs/ARCHITECTURE.md, "What the ops accept").
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_kernel_dtype(name: str, t: torch.Tensor, instead: str) -> None:
    """Refuse a tensor whose dtype no kernel takes.

    Args:
        name: the argument's name, for the message.
        t: the tensor to check.
        instead: what the caller should do then, appended to the message.

    Raises:
        TypeError: ``t``'s dtype is not one of ``KERNEL_DTYPES``.
    """
    if t.dtype not in KERNEL_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got dtype {t.dtype}: the kernels compute in "
                        f"float32; {instead}")

def define(schema: str, impl: Callable, fake: Callable) -> torch._ops.OpOverload:
    """Register ``torch.ops.kernels.<name>`` and remember its implementation for ``call``.

    Chapter 09 teaches operator registration.

    Args:
        schema: the operator's schema, such as ``"rms_norm_fwd(Tensor x, float eps) -> Tensor"``;
            ``Tensor(a!)`` marks an input the operator writes.
        impl: runs on real tensors of any device (the Triton launch).
        fake: returns empty outputs of the right shape, dtype and device.

    Returns:
        The operator's default overload, the cheapest handle to call it through.
    """
    name = schema.split("(", 1)[0]
    _LIBRARY.define(schema)
    # CompositeExplicitAutograd: one implementation for every device, and autograd is left to the
    # caller.
    _LIBRARY.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIBRARY)
    op = getattr(getattr(torch.ops, NAMESPACE), name).default
    _IMPLS[op] = impl
    return op


# Tensors an eager call may hand straight to an implementation. Subclasses (FakeTensor while
# tracing, DTensor, FunctionalTensor) go through the dispatcher, which routes each to the right
# kernel.
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def direct(*args) -> bool:
    """Whether a call with ``args`` may run an operator's implementation itself instead of through
    the operator.

    Not while ``torch.compile`` traces, not under a ``TorchDispatchMode`` (which would miss the
    call), and only when every tensor among ``args`` is a plain tensor or parameter with data (a
    meta tensor goes to the fake implementation through the operator). Chapter 09 uses it.

    Args:
        args: the operator's arguments; those that are not tensors are ignored.

    Returns:
        True when the implementation may be called directly.
    """
    return (not torch.compiler.is_compiling() and not torch._C._len_torch_dispatch_stack()
            and all(type(a) in _PLAIN and not a.is_meta for a in args if isinstance(a, torch.Tensor)))


def call(op: torch._ops.OpOverload, *args):
    """``op(*args)``: its implementation called directly when ``direct(*args)`` allows it, else the
    operator. Chapter 09 shows what it saves.

    Args:
        op: an operator returned by ``define``.
        args: its arguments, positional, in the schema's order.

    Returns:
        What the operator returns (None for one that only writes its inputs).
    """
    return (_IMPLS[op] if direct(*args) else op)(*args)


def implementation(op: torch._ops.OpOverload) -> Callable:
    """The function registered as ``op``'s implementation: what ``call`` runs when ``direct`` allows
    it. A benchmark that times the layers of a call (``kernels.bench.overhead``) calls it on its
    own.

    Args:
        op: an operator returned by ``define``.

    Returns:
        Its implementation, the ``impl`` given to ``define``.
    """
    return _IMPLS[op]


def registered() -> list[str]:
    """Qualified names of the operators registered so far; chapters 09 and 13 list them.

    Returns:
        The names, sorted, e.g. ``["kernels::rms_norm_fwd", ...]``.
    """
    return sorted(
        f"{NAMESPACE}::{name}"
        for name in dir(getattr(torch.ops, NAMESPACE))
        if isinstance(getattr(getattr(torch.ops, NAMESPACE), name, None), torch._ops.OpOverloadPacket)
    )
