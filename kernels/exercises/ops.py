"""Check for the exercise of chapter 09: the fake implementation of the RMSNorm forward operator.

A fake implementation receives fake tensors (shape, dtype, device and strides, but no data) and must
return fake outputs that describe the real ones exactly: that is all ``torch.compile`` learns about
an operator while it traces a model. The check runs the reader's function under ``FakeTensorMode``
on inputs chosen to expose the usual mistakes (a float32 weight with a bfloat16 input promotes the
output, a 3-D input, a transposed view, a single row, an input on a GPU) and compares every output's
shape, dtype, strides and device with what ``torch.ops.kernels.rms_norm_fwd`` really returns. While
the reader's function runs, launching a Triton kernel raises instead of running: on a GPU, a kernel
handed fake tensors would read and write memory nobody owns. The package's own fake, and its
operator ``torch.ops.kernels.rms_norm_fwd`` that answers from it, are out of reach
(``reach.FORBIDDEN["rms_norm_fake"]``): calling either is refused by name.

The sentence that names each mistake is in ``HINTS``; the tests feed every mistake to the check and
look for its sentence. The check never raises because the reader's function is wrong or unfinished:
it prints its verdict and returns a ``Report``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)
from triton.runtime.jit import KernelInterface

from kernels import runtime
from kernels.rmsnorm import rms_norm_fwd_op

from .reach import FinishedCodeCalled, call_learner
from .rmsnorm import Report, verdict
from .sentences import sentence_lookup

EXERCISE = "rms_norm_fake"

# Every diagnosis, in one place. Fields in braces are filled in for the input at hand.
HINTS = {
    "stub": ("rms_norm_fake is still the stub (it raises NotImplementedError): return two empty "
             "tensors, (y, rstd)"),
    "reads_values": ("your fake read the values of its input ({error}): a fake tensor has none. A "
                     "fake may only look at shapes, dtypes and devices (x.shape, x.dtype, "
                     "x.device), never at values (.item(), float(...), a boolean mask)"),
    "launched": ("your fake launched a Triton kernel: a fake implementation must compute nothing, "
                 "only describe the outputs. On a GPU, the kernel would read and write at "
                 "addresses that fake tensors do not own (an illegal memory access ends the CUDA "
                 "context). Return torch.empty(...) tensors instead"),
    "raised": "your fake raised {error}",
    "not_pair": "your fake returned {got}; the operator returns two tensors, (y, rstd)",
    "not_tensor": "{name} is {got}, not a tensor",
    "y_flat": ("y has shape {got}, the rows the kernel sees; the real y has x's shape {expected}: "
               "y keeps every dimension of x (the rows are the kernel's view, not the caller's)"),
    "y_shape": "y has shape {got}, but the real y has x's shape {expected}",
    "y_dtype": ("y has dtype {got}, but the real y has dtype {expected}: its dtype is that of "
                "weight * x in PyTorch, torch.promote_types(x.dtype, weight.dtype) (a float32 "
                "weight promotes a bfloat16 input, as in Hugging Face's LlamaRMSNorm)"),
    "y_strides": ("y has strides {got}, but the real y is contiguous, strides {expected}: "
                  "torch.empty_like(x) copies the memory layout of x (a transposed x gives a "
                  "transposed y), while the kernel writes a fresh, row-major y: use "
                  "torch.empty(x.shape, ...)"),
    "device": ("{name} is on {got}, but the real {name} is on {expected}, where x is: "
               "torch.empty(...) allocates on the CPU unless told otherwise: pass device=x.device"),
    "rstd_not_flat": ("rstd has shape {got}, x's leading dimensions, but the real rstd is flat, "
                      "{expected}: one float32 per row, and the kernel sees x as rows = x.numel() "
                      "// x.shape[-1] rows"),
    "rstd_one_dimension": ("rstd has shape {got}: one value per row of one leading dimension only, "
                           "but x has {expected_rows} rows in all (rows = x.numel() // "
                           "x.shape[-1], every leading dimension counts)"),
    "rstd_shape": "rstd has shape {got}, but the real rstd has shape {expected}: one float32 per row of x",
    "rstd_dtype": ("rstd has dtype {got}, but the real rstd is float32: the kernel keeps rstd in "
                   "float32 whatever the input's dtype (the backward needs it exact)"),
    "rstd_strides": "rstd has strides {got}, but the real rstd is contiguous, strides {expected}",
    "aliases": ("{name} is {what} itself (or a view of it), not a new tensor: the schema, (Tensor, "
                "Tensor) with no alias annotation, promises fresh outputs, and the compiler may "
                "then free or overwrite x while y lives. x.to(dtype) returns x itself when the "
                "dtype already matches: allocate with torch.empty(...)"),
    "opcheck": ("your fake describes every input above, but torch.library.opcheck, with your fake "
                "registered by torch.library.register_fake, failed {test}: {error}"),
}


hint = sentence_lookup(HINTS)


@dataclass(frozen=True)
class Case:
    """One input: how to make x and the weight, and, for a case on another device, which device to
    pretend."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    weight_dtype: torch.dtype
    view: str = ""  # "strided": x[:, ::2] of a wider tensor; "transposed": x.t() of a [cols, rows] tensor
    fake_device: str | None = None  # the case runs on fake tensors of this device (no such device is needed)


CASES = (
    Case("float32 input of 5 × 64", (5, 64), torch.float32, torch.float32),
    Case("bfloat16 input of 2 × 3 × 40 (3-D)", (2, 3, 40), torch.bfloat16, torch.bfloat16),
    Case("bfloat16 input with a float32 weight", (4, 32), torch.bfloat16, torch.float32),
    Case("strided view x[:, ::2] of a 6 × 96 tensor", (6, 48), torch.float32, torch.float32, view="strided"),
    Case("transposed view: x = t.t() of a 64 × 6 tensor t", (6, 64), torch.float32, torch.float32,
         view="transposed"),
    Case("single row of 16", (16,), torch.float32, torch.float32),
    Case("bfloat16 input of 3 × 32 on a GPU (fake tensors: no GPU is needed)", (3, 32), torch.bfloat16,
         torch.bfloat16, fake_device="cuda"),
)


def _make(case: Case, device, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    def rand(*shape, dtype):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    if case.view == "strided":
        x = rand(case.shape[0], 2 * case.shape[1], dtype=case.dtype)[:, ::2]
    elif case.view == "transposed":
        x = rand(case.shape[1], case.shape[0], dtype=case.dtype).t()
    else:
        x = rand(*case.shape, dtype=case.dtype)
    return x, rand(case.shape[-1], dtype=case.weight_dtype)


@dataclass(frozen=True)
class Meta:
    """What a fake output must match: everything about a tensor except its values."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...]
    device: str

    @classmethod
    def of(cls, t: torch.Tensor, device: str | None = None) -> Meta:
        """The shape, dtype, strides and device of ``t``.

        Args:
            t: a real or fake tensor.
            device: the device type to record instead of ``t``'s (a case that pretends a GPU).

        Returns:
            A ``Meta`` of ``t``.
        """
        return cls(tuple(t.shape), t.dtype, tuple(t.stride()), device or t.device.type)


class _KernelLaunched(RuntimeError):
    pass


@contextlib.contextmanager
def _no_kernel_launches():
    """While inside, ``kernel[grid](...)`` raises instead of launching (every Triton kernel, compiled or
    interpreted, is launched through ``KernelInterface.__getitem__``)."""

    def refuse(self, grid):
        def launch(*args, **kwargs):
            raise _KernelLaunched("a Triton kernel "
                                  f"({getattr(self, '__name__', type(self).__name__)}) was "
                                  "launched")
        return launch

    original = KernelInterface.__getitem__
    KernelInterface.__getitem__ = refuse
    try:
        yield
    finally:
        KernelInterface.__getitem__ = original


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _dtype(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _run(fake: Callable, case: Case, x: torch.Tensor, w: torch.Tensor):
    """The reader's outputs on fake copies of x and w (on ``case.fake_device`` when it has one), and
    those copies."""
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        if case.fake_device is None:
            fx, fw = mode.from_tensor(x), mode.from_tensor(w)
        else:
            fx = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=case.fake_device)
            fw = torch.empty_strided(w.shape, w.stride(), dtype=w.dtype, device=case.fake_device)
        with _no_kernel_launches():
            return call_learner(EXERCISE, fake, fx, fw, 1e-6), {"x": fx, "weight": fw}


def _aliased(got: torch.Tensor, inputs: dict[str, torch.Tensor]) -> str | None:
    """Which input ``got`` is, or is a view of (fake tensors have no data pointer: compared by identity)."""
    for what, t in inputs.items():
        if got is t or (got._base is not None and (got._base is t or got._base is t._base)):
            return what
    return None


def _compare(name: str, got: torch.Tensor, real: Meta, x: torch.Tensor) -> str | None:
    """The first difference between a fake output and the real one, named."""
    if tuple(got.shape) != real.shape:
        fields = dict(got=tuple(got.shape), expected=real.shape)
        if name == "y":
            flat = (x.numel() // x.shape[-1], x.shape[-1]) if x.dim() else ()
            return hint("y_flat" if x.dim() > 2 and tuple(got.shape) == flat else "y_shape", **fields)
        if x.dim() > 1 and tuple(got.shape) == tuple(x.shape[:-1]):
            return hint("rstd_not_flat", **fields)
        if got.dim() == 1 and x.dim() > 2 and got.shape[0] in (x.shape[0], x.shape[-2]):
            return hint("rstd_one_dimension", got=tuple(got.shape), expected_rows=real.shape[0])
        return hint("rstd_shape", **fields)
    if got.dtype != real.dtype:
        fields = dict(got=_dtype(got.dtype), expected=_dtype(real.dtype))
        return hint("y_dtype" if name == "y" else "rstd_dtype", **fields)
    if got.device.type != real.device:
        return hint("device", name=name, got=got.device.type, expected=real.device)
    if tuple(got.stride()) != real.stride and got.numel() > 1:
        return hint(f"{name}_strides", got=tuple(got.stride()), expected=real.stride)
    return None


def check_rms_norm_fake(fake: Callable, verbose: bool = True) -> Report:
    """Check the reader's fake RMSNorm forward: its outputs must describe the real operator's.

    Runs ``fake`` under ``FakeTensorMode`` on each input of ``CASES`` (Triton launches refused, the
    package's fake and operator out of reach), compares each output's shape, dtype, strides and
    device with those of ``torch.ops.kernels.rms_norm_fwd``'s real outputs, then runs
    ``torch.library.opcheck`` with ``fake`` registered on a scratch operator. Chapter:
    ``notebooks/09_pytorch_ops.ipynb``.

    Args:
        fake: the reader's ``fake(x, weight, eps) -> (y, rstd)``, called with fake tensors.
        verbose: print the verdict (False: only return it).

    Returns:
        The ``Report``: ``passed``, and a message with the first mismatch, on which input, in words
        (or what opcheck found). It never raises because ``fake`` is wrong or unfinished.
    """
    device = runtime.device()
    g = torch.Generator().manual_seed(0)
    for case in CASES:
        x, w = _make(case, device, g)
        y_real, rstd_real = rms_norm_fwd_op(x, w, 1e-6)
        real = {"y": Meta.of(y_real, case.fake_device), "rstd": Meta.of(rstd_real, case.fake_device)}
        where = f"on a {case.name}: "
        try:
            out, fakes = _run(fake, case, x, w)
        except FinishedCodeCalled as called:
            return verdict(False, str(called), verbose)
        except NotImplementedError:
            return verdict(False, hint("stub"), verbose)
        except _KernelLaunched:
            return verdict(False, where + hint("launched"), verbose)
        except (DataDependentOutputException, DynamicOutputShapeException) as exc:
            return verdict(False, where + hint("reads_values", error=type(exc).__name__), verbose)
        except Exception as exc:  # noqa: BLE001  (the reader's code may raise anything: say what)
            error = (f"{type(exc).__name__}: "
                     f"{str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ''}")
            key = "reads_values" if "data pointer" in str(exc) or "numpy" in str(exc).lower() else "raised"
            return verdict(False, where + hint(key, error=error), verbose)
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            return verdict(False, where + hint("not_pair", got=_describe(out)), verbose)
        for name, got in zip(("y", "rstd"), out):
            if not isinstance(got, torch.Tensor):
                return verdict(False, where + hint("not_tensor", name=name, got=_describe(got)), verbose)
            aliased = _aliased(got, fakes)
            if aliased:
                return verdict(False, where + hint("aliases", name=name, what=aliased), verbose)
            problem = _compare(name, got, real[name], x)
            if problem:
                return verdict(False, where + problem, verbose)
    problem = _opcheck(fake, device, g)
    if problem:
        return verdict(False, problem, verbose)
    return verdict(True, ("your fake describes the real outputs (shape, dtype, strides, device) on "
                          f"all {len(CASES)} inputs, without computing anything, and "
                          "torch.library.opcheck passes with it registered (the schema, fake "
                          "against real, tracing with static and dynamic shapes)."), verbose)


# A scratch namespace for the check's own operators: each check registers the reader's fake on a new one (an
# operator cannot be defined twice, nor its fake replaced).
SCRATCH_NAMESPACE = "kernels_exercise"
_scratch: list = []  # [the Library, the number of operators defined so far]


def _guarded(fake: Callable, refused: list) -> Callable:
    """``fake`` as opcheck calls it, with the exercise's finished answers out of reach; a refusal is kept in
    ``refused`` (opcheck reports errors as failed tests, in its own words)."""

    def guarded(x, weight, eps):
        try:
            return call_learner(EXERCISE, fake, x, weight, eps)
        except FinishedCodeCalled as called:
            refused.append(str(called))
            raise

    return guarded


def _scratch_operator(fake: Callable):
    """A new operator ``kernels_exercise::rms_norm_fwd_<n>`` with the package's implementation and ``fake``,
    registered with ``torch.library.register_fake`` as a reader would."""
    if not _scratch:
        _scratch.extend([torch.library.Library(SCRATCH_NAMESPACE, "FRAGMENT"), 0])
    lib, n = _scratch[0], _scratch[1] + 1
    _scratch[1] = n
    name = f"rms_norm_fwd_{n}"
    lib.define(f"{name}(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)")
    lib.impl(name, rms_norm_fwd_op, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{SCRATCH_NAMESPACE}::{name}", fake, lib=lib)
    return getattr(getattr(torch.ops, SCRATCH_NAMESPACE), name).default


def _opcheck(fake: Callable, device, g: torch.Generator) -> str | None:
    """``torch.library.opcheck`` of the reader's fake registered on a scratch operator, on one 3-D
    bfloat16 input with a float32 weight; the first test that failed, in words, or None."""
    refused: list[str] = []
    op = _scratch_operator(_guarded(fake, refused))
    x = torch.randn(2, 3, 40, generator=g).to(device=device, dtype=torch.bfloat16)
    w = torch.randn(40, generator=g).to(device=device)
    results = torch.library.opcheck(op, (x, w, 1e-6), raise_exception=False)
    if refused:
        return refused[0]
    for test, outcome in results.items():
        if outcome != "SUCCESS":
            text = str(outcome).strip().splitlines()
            return hint("opcheck", test=test, error=(text[0] if text else type(outcome).__name__)[:200])
    return None
