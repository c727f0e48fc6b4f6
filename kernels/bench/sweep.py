"""The benchmark sweep: check, then time, every implementation of a kernel at every shape
(``python -m kernels.bench.sweep``).

Every implementation × shape × pass gets two times:

  eager_ms   the plain Python call: what an eager training loop sees, host overhead included (Python, autograd,
             Triton's launcher). On a slow host CPU small shapes are host-bound here.
  device_ms  the replay of a CUDA graph captured once from the same call: pure GPU time, what a step sees when the
             host runs ahead of the GPU. Bandwidth and the fraction of the copy ceiling use it.

Before anything is timed, its output (and its gradients, for forward+backward) is checked against
float64. A row that fails is recorded as such and never timed. With ``rounds`` > 1 (the command
line's default on a GPU) every implementation is timed once per round, in turn, and each row keeps
the median over the rounds (``measure_shape``).

Here: the sizes of the sweeps, the minimal bytes each kernel must move, the cases (inputs of one
shape, their float64 reference, the check and the timed step), running the sweep, and the command
line. The implementations are in ``kernels.bench.peers``, the timing in ``kernels.bench.timing``,
reading and saving results in ``kernels.bench.results``.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
from dataclasses import dataclass

import torch

from kernels import runtime
from kernels.reference import relative_error, rms_norm_reference, rotary_cos_sin, rotary_reference, swiglu_reference
from kernels.tolerances import RELATIVE_ERROR_TOL

from . import cli
from .peers import IMPLEMENTATIONS, Impl, implementations
from .results import (
    ASSETS,
    DTYPES,
    KERNELS,
    SCHEMA_VERSION,
    check_kernel,
    device_slug,
    first_line,
    format_table,
    results_file,
    speedups,
    summarize,
)
from .tables import Section, Table, html_table
from .timing import (
    device_time_ms,
    gbps,
    measure_ceilings,
    peak_extra_mib,
    reset_grads,
    rotated,
    same_bytes_copy_ms,
    time_ms,
)

PASSES = ("fwd", "fwd+bwd")
# Which passes each kernel is measured in. The cross-entropy of a training step is always
# forward+backward (the fused kernel even computes the gradient in its forward), so that is the one
# pass it is compared in.
KERNEL_PASSES = {"rmsnorm": ("fwd", "fwd+bwd"), "cross_entropy": ("fwd+bwd",), "swiglu": ("fwd", "fwd+bwd"),
                 "rope": ("fwd", "fwd+bwd")}
# What a case's width is, by kernel: the name in results and in the sizes tables.
WIDTH_NAMES = {"rmsnorm": "hidden", "cross_entropy": "vocab", "swiglu": "intermediate", "rope": "head_dim"}
# Llama-3.1-8B's attention: 32 query heads and 8 key-value heads of head_dim 128 (GQA). The tiny
# profile keeps the ratio with fewer heads.
ROPE_HEADS = runtime.pick((4, 2), (32, 8))


# Sweeps. GPU: sizes that fill the chip, as in the chapters; interpreter: tiny, so the CPU gets
# through in seconds.
GPU_SIZES = {
    "rmsnorm": dict(tokens=(256, 512, 1024, 2048, 4096, 8192, 16384, 32768), hidden=4096,
                    hidden_sweep=(1024, 2048, 4096, 8192), hidden_sweep_tokens=16384),
    "cross_entropy": dict(tokens=(256, 512, 1024, 2048, 4096, 8192, 16384), vocab=128_256),
    "swiglu": dict(tokens=(512, 1024, 2048, 4096, 8192, 16384), intermediate=14_336),
    "rope": dict(tokens=(512, 1024, 2048, 4096, 8192, 16384), head_dim=128),
}
GPU_QUICK_SIZES = {
    "rmsnorm": dict(tokens=(1024, 4096, 16384), hidden=4096, hidden_sweep=(1024, 8192),
                    hidden_sweep_tokens=16384),
    "cross_entropy": dict(tokens=(1024, 4096, 16384), vocab=128_256),
    "swiglu": dict(tokens=(1024, 4096, 16384), intermediate=14_336),
    "rope": dict(tokens=(1024, 4096, 16384), head_dim=128),
}
CPU_SIZES = {
    "rmsnorm": dict(tokens=(16, 64), hidden=128, hidden_sweep=(64, 200), hidden_sweep_tokens=32),
    "cross_entropy": dict(tokens=(8, 32), vocab=1000),
    "swiglu": dict(tokens=(16, 64), intermediate=224),
    "rope": dict(tokens=(16, 64), head_dim=32),
}
CPU_QUICK_SIZES = {
    "rmsnorm": dict(tokens=(8, 24), hidden=96, hidden_sweep=(), hidden_sweep_tokens=8),
    "cross_entropy": dict(tokens=(4, 12), vocab=500),
    "swiglu": dict(tokens=(8, 24), intermediate=112),
    "rope": dict(tokens=(8, 24), head_dim=16),
}


# --------------------------------------------------------------------------------------------------
# Minimal bytes: the floor every time is judged against
# --------------------------------------------------------------------------------------------------


def rmsnorm_bytes(tokens: int, hidden: int, itemsize: int = 2, pass_: str = "fwd+bwd") -> int:
    """Least bytes an RMSNorm over [tokens, hidden] must move.

    Forward reads x and writes y: 2·M·N·s. Backward reads x and dy and writes dx: 3·M·N·s more,
    5·M·N·s in all. The weight, dW and one float32 rstd per row are a rounding error at Llama sizes
    and are left out.

    Chapter 04 derives it.

    Args:
        tokens: rows.
        hidden: the hidden size.
        itemsize: bytes per element.
        pass_: ``"fwd"`` or ``"fwd+bwd"``.

    Returns:
        bytes.

    Raises:
        ValueError: when ``pass_`` is neither.
    """
    _check_pass(pass_)
    return (2 if pass_ == "fwd" else 5) * tokens * hidden * itemsize


# Logit-sized transfers per logit for a forward+backward cross-entropy.
CE_DESIGNS = {
    "two_read": 3,  # read the row for the logsumexp, read it again for the gradient, write the gradient
    "single_read": 2,  # read once (the row kept on chip), write the gradient: the floor
}


def cross_entropy_bytes(tokens: int, vocab: int, itemsize: int = 2, design: str = "two_read") -> int:
    """Bytes a forward+backward cross-entropy over [tokens, vocab] logits moves.

    ``"two_read"`` is the design of this package's kernel: 3 logit-sized transfers, 6 bytes per
    logit in bf16. ``"single_read"`` is the floor: 4 bytes per logit in bf16. Targets and per-row
    scalars are left out.

    Chapter 07 derives it.

    Args:
        tokens: rows of logits.
        vocab: the vocabulary size.
        itemsize: bytes per logit.
        design: ``"two_read"`` or ``"single_read"``.

    Returns:
        bytes.

    Raises:
        ValueError: when ``design`` is neither.
    """
    if design not in CE_DESIGNS:
        raise ValueError(f"design must be one of {tuple(CE_DESIGNS)}, got {design!r}")
    return CE_DESIGNS[design] * tokens * vocab * itemsize


def swiglu_bytes(tokens: int, intermediate: int, itemsize: int = 2, pass_: str = "fwd+bwd") -> int:
    """Least bytes a SwiGLU over [tokens, intermediate] must move.

    Forward reads gate and up and writes y: 3·M·I·s. Backward reads dy, gate and up and writes
    d(gate) and d(up): 5·M·I·s more, 8·M·I·s in all. Storing silu(gate) for the backward instead of
    recomputing it would add a write and a read: 10·M·I·s.

    Chapter 11 derives it.

    Args:
        tokens: rows.
        intermediate: the intermediate size.
        itemsize: bytes per element.
        pass_: ``"fwd"`` or ``"fwd+bwd"``.

    Returns:
        bytes.

    Raises:
        ValueError: when ``pass_`` is neither.
    """
    _check_pass(pass_)
    return (3 if pass_ == "fwd" else 8) * tokens * intermediate * itemsize


def rope_bytes(tokens: int, head_dim: int, q_heads: int = 32, kv_heads: int = 8, itemsize: int = 2,
               pass_: str = "fwd+bwd", trig_itemsize: int | None = None) -> int:
    """Least bytes RoPE on q [tokens, q_heads, D] and k [tokens, kv_heads, D] must move.

    Forward reads q and k and writes both rotated: 2·(Hq + Hkv)·T·D·s, plus cos and sin read once
    per position (2·T·D·s_trig), not once per head. Backward is the same traffic again with dy in
    and dx out.

    Chapter 11 derives it.

    Args:
        tokens: positions.
        head_dim: the head's size.
        q_heads: query heads.
        kv_heads: key/value heads.
        itemsize: bytes per element of q and k.
        pass_: ``"fwd"`` or ``"fwd+bwd"``.
        trig_itemsize: bytes per element of cos and sin (None: ``itemsize``).

    Returns:
        bytes.

    Raises:
        ValueError: when ``pass_`` is neither.
    """
    _check_pass(pass_)
    trig = itemsize if trig_itemsize is None else trig_itemsize
    one = 2 * (q_heads + kv_heads) * tokens * head_dim * itemsize + 2 * tokens * head_dim * trig
    return one if pass_ == "fwd" else 2 * one


def _check_pass(pass_: str) -> None:
    if pass_ not in PASSES:
        raise ValueError(f"pass_ must be one of {PASSES}, got {pass_!r}")




# --------------------------------------------------------------------------------------------------
# Cases: the inputs of one shape, their float64 reference, the check and the timed step
# --------------------------------------------------------------------------------------------------


@dataclass
class Check:
    """The result of comparing one implementation with float64: relative error per checked tensor."""

    ok: bool
    errors: dict[str, float]
    tol: float
    message: str = ""

    def to_json(self) -> dict:
        """The check as a JSON-ready dict (errors that are not finite become None).

        Returns:
            ``{"ok", "errors", "tol", "message"}``.
        """
        return {"ok": self.ok, "errors": {k: _finite_or_none(v) for k, v in self.errors.items()},
                "tol": self.tol,
                "message": self.message}


def _finite_or_none(v: float) -> float | None:
    return v if v == v and abs(v) != float("inf") else None


def _judge(errors: dict[str, float], tol: float) -> Check:
    bad = [f"{name} relative error {err:.3g} > {tol:g}" for name, err in errors.items() if not err <= tol]
    return Check(not bad, errors, tol, "; ".join(bad) or f"all relative errors ≤ {tol:g}")


def _generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


class RMSNormCase:
    """Inputs of one RMSNorm shape: x (requires grad), a weight around 1 (never all ones), dy;
    float64 references.

    Args:
        tokens: rows of x.
        hidden: the hidden size.
        dtype: the inputs' dtype.
        device: where the inputs live (None: this machine's device).
        seed: the seed of the inputs.
        eps: RMSNorm's epsilon.
    """

    kernel = "rmsnorm"

    def __init__(self, tokens: int, hidden: int, dtype=torch.bfloat16, device=None, seed: int = 0,
                 eps: float = 1e-6):
        self.tokens, self.hidden, self.dtype, self.eps, self.seed = tokens, hidden, dtype, eps, seed
        self.device = torch.device(device) if device is not None else runtime.device()
        self.x = torch.empty(tokens, hidden, dtype=dtype, device=self.device, requires_grad=True)
        self.dy = torch.empty(tokens, hidden, dtype=dtype, device=self.device)
        g = _generator(self.device, seed + 1)
        self.weight = (0.5 + torch.rand(hidden, generator=g, device=self.device)).to(dtype)
        self.reset_inputs()
        self._ref = None

    @property
    def width(self) -> int:
        """The swept width: the hidden size."""
        return self.hidden

    def reset_inputs(self) -> None:
        """Refill x and dy with the same values (an implementation may have written into dy: Liger does)."""
        g = _generator(self.device, self.seed)
        with torch.no_grad():
            self.x.normal_(generator=g)
            self.dy.normal_(generator=g)
        self.x.grad = None

    def bytes(self, pass_: str) -> tuple[int, int]:
        """The bytes one call moves, for the bandwidth and its floor.

        Args:
            pass_: ``"fwd"`` or ``"fwd+bwd"``.

        Returns:
            the minimal bytes, twice (no floor below them).
        """
        n = rmsnorm_bytes(self.tokens, self.hidden, self.dtype.itemsize, pass_)
        return n, n

    def reference(self) -> dict[str, torch.Tensor]:
        """The float64 references, computed once and kept.

        Returns:
            ``y``, ``dx``, ``dw``.
        """
        if self._ref is None:
            x64 = self.x.detach().double().requires_grad_()
            w64 = self.weight.double().requires_grad_()
            y64 = rms_norm_reference(x64, w64, self.eps)
            y64.backward(self.dy.double())
            self._ref = {"y": y64.detach(), "dx": x64.grad, "dw": w64.grad}
        return self._ref

    def check(self, fn, params, pass_: str) -> Check:
        """Run ``fn`` once (and its backward for ``"fwd+bwd"``) and compare with the float64 references.

        Args:
            fn: the implementation, ``fn(x)``, with its weight in ``params[0]``.
            params: its parameters (gradients reset around the check).
            pass_: ``"fwd"`` or ``"fwd+bwd"``.

        Returns:
            the ``Check``, judged against the dtype's bound.
        """
        ref = self.reference()
        reset_grads([self.x, *params])
        with torch.enable_grad():
            y = fn(self.x)
            errors = {"y": relative_error(y, ref["y"], on_device=True)}
            if pass_ == "fwd+bwd":
                y.backward(self.dy.clone())
                errors["dx"] = _grad_error(self.x, ref["dx"])
                errors["dw"] = _grad_error(params[0], ref["dw"]) if params else float("inf")
        reset_grads([self.x, *params])
        return _judge(errors, RELATIVE_ERROR_TOL[self.dtype])

    def step(self, fn, params, pass_: str):
        """``(call, grad_to_none)``: one timed call, and the tensors whose .grad must be reset
        between calls.

        Args:
            fn: the implementation, ``fn(x)``, with its weight in ``params[0]``.
            params: its parameters.
            pass_: ``"fwd"`` or ``"fwd+bwd"``.

        Returns:
            ``(call, grad_to_none)``.
        """
        x, dy = self.x, self.dy
        if pass_ == "fwd":
            return (lambda: fn(x)), [x, *params]

        def fwd_bwd():
            fn(x).backward(dy)

        return fwd_bwd, [x, *params]


def _grad_error(t: torch.Tensor, expected: torch.Tensor) -> float:
    return float("inf") if t.grad is None else relative_error(t.grad, expected, on_device=True)


class CrossEntropyCase:
    """Inputs of one cross-entropy shape: bf16 logits (requires grad), targets with some ignored (-100) rows.

    The float64 reference is the mean loss over all rows (in chunks, so it never needs a float64
    copy of all the logits) and the gradient of a sample of rows, which always includes an ignored
    one.

    Args:
        tokens: rows of the logits.
        vocab: the vocabulary size.
        dtype: the logits' dtype.
        device: where the inputs live (None: this machine's device).
        seed: the seed of the inputs.
    """

    kernel = "cross_entropy"
    IGNORE_INDEX = -100
    SAMPLE_ROWS = 64
    SCALE = 3.0  # logits spread enough that the softmax is far from uniform

    def __init__(self, tokens: int, vocab: int, dtype=torch.bfloat16, device=None, seed: int = 0):
        self.tokens, self.vocab, self.dtype, self.seed = tokens, vocab, dtype, seed
        self.device = torch.device(device) if device is not None else runtime.device()
        self.logits = torch.empty(tokens, vocab, dtype=dtype, device=self.device, requires_grad=True)
        g = _generator(self.device, seed + 1)
        target = torch.randint(0, vocab, (tokens,), generator=g, device=self.device)
        # one row in 16 masked, like prompt tokens
        ignored = torch.arange(tokens, device=self.device) % 16 == 3
        self.target = torch.where(ignored, torch.full_like(target, self.IGNORE_INDEX), target)
        self.reset_inputs()
        self._ref = None

    @property
    def width(self) -> int:
        """The swept width: the vocabulary size."""
        return self.vocab

    def reset_inputs(self) -> None:
        """Refill the logits with the same values (the in-place implementations overwrite them with
        the gradient)."""
        g = _generator(self.device, self.seed)
        with torch.no_grad():
            self.logits.normal_(generator=g).mul_(self.SCALE)
        self.logits.grad = None

    def bytes(self, pass_: str) -> tuple[int, int]:
        """The bytes one call moves, for the bandwidth and its floor.

        Args:
            pass_: ``"fwd"`` or ``"fwd+bwd"``.

        Returns:
            ``(two_read, single_read)``: the kernel's design and the floor.
        """
        s = self.dtype.itemsize
        return (cross_entropy_bytes(self.tokens, self.vocab, s, "two_read"),
                cross_entropy_bytes(self.tokens, self.vocab, s, "single_read"))

    def sample_rows(self) -> torch.Tensor:
        """The rows whose gradient the reference checks: up to ``SAMPLE_ROWS`` from the seed, row 3 first.

        Returns:
            the row indices, on the case's device.
        """
        n = min(self.tokens, self.SAMPLE_ROWS)
        g = _generator(torch.device("cpu"), self.seed + 2)
        rows = torch.randperm(self.tokens, generator=g)[:n]
        if self.tokens > 3:
            rows[0] = 3  # an ignored row: its gradient must be exactly zero
        return rows.to(self.device)

    def reference(self) -> dict[str, torch.Tensor]:
        """The float64 references, computed once and kept.

        Returns:
            ``loss``, the sampled ``rows`` and their ``grad_rows``.
        """
        if self._ref is None:
            logits, target = self.logits.detach(), self.target
            valid = target != self.IGNORE_INDEX
            n_valid = valid.sum().double()
            chunk = max(1, (1 << 30) // (8 * self.vocab))  # 1 GiB of float64 at a time
            total = torch.zeros((), dtype=torch.float64, device=self.device)
            for start in range(0, self.tokens, chunk):
                total += self._loss_sum(logits[start:start + chunk], target[start:start + chunk])
            rows = self.sample_rows()
            x = logits[rows].double()
            t = target[rows]
            grad = torch.softmax(x, dim=-1)
            keep = t != self.IGNORE_INDEX
            grad[torch.arange(len(rows), device=self.device)[keep], t[keep]] -= 1.0
            grad[~keep] = 0.0
            self._ref = {"loss": total / n_valid, "rows": rows, "grad_rows": grad / n_valid}
        return self._ref

    def _loss_sum(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        x = x.double()
        keep = t != self.IGNORE_INDEX
        picked = x.gather(1, t.clamp(min=0)[:, None])[:, 0]
        return ((torch.logsumexp(x, dim=-1) - picked) * keep).sum()

    def check(self, fn, params, pass_: str) -> Check:
        """Run ``fn`` once (and its backward for ``"fwd+bwd"``) and compare with the float64 references.

        Args:
            fn: the implementation, ``fn(logits, target)`` returning the mean loss.
            params: its parameters (gradients reset around the check).
            pass_: ``"fwd"`` or ``"fwd+bwd"``.

        Returns:
            the ``Check``, judged against the dtype's bound.
        """
        ref = self.reference()
        self.logits.grad = None
        with torch.enable_grad():
            loss = fn(self.logits, self.target)
            errors = {"loss": relative_error(loss.reshape(()), ref["loss"], on_device=True)}
            if pass_ == "fwd+bwd":
                loss.backward()
                grad = self.logits.grad
                errors["grad (sampled rows)"] = (
                    float("inf") if grad is None
                    else relative_error(grad[ref["rows"]], ref["grad_rows"], on_device=True))
        self.logits.grad = None
        return _judge(errors, RELATIVE_ERROR_TOL[self.dtype])

    def step(self, fn, params, pass_: str):
        """``(call, grad_to_none)``: one timed call, and the tensors whose ``.grad`` is reset between
        calls.

        Args:
            fn: the implementation, ``fn(logits, target)`` returning the mean loss.
            params: its parameters.
            pass_: ``"fwd"`` or ``"fwd+bwd"``.

        Returns:
            ``(call, grad_to_none)``.

        Raises:
            ValueError: for any pass but ``"fwd+bwd"``.
        """
        if pass_ != "fwd+bwd":
            raise ValueError(f"cross-entropy is measured forward+backward only, got pass_={pass_!r}")
        logits, target = self.logits, self.target

        def fwd_bwd():
            fn(logits, target).backward()

        return fwd_bwd, [logits]


class SwiGLUCase:
    """Inputs of one SwiGLU shape: gate (spread over the sigmoid's range) and up, both requiring
    grad, and dy; float64 references of y, d(gate) and d(up).

    Args:
        tokens: rows of gate and up.
        intermediate: the intermediate size.
        dtype: the inputs' dtype.
        device: where the inputs live (None: this machine's device).
        seed: the seed of the inputs.
    """

    kernel = "swiglu"
    GATE_SCALE = 2.0

    def __init__(self, tokens: int, intermediate: int, dtype=torch.bfloat16, device=None, seed: int = 0):
        self.tokens, self.intermediate, self.dtype, self.seed = tokens, intermediate, dtype, seed
        self.device = torch.device(device) if device is not None else runtime.device()
        shape = (tokens, intermediate)
        self.gate = torch.empty(shape, dtype=dtype, device=self.device, requires_grad=True)
        self.up = torch.empty(shape, dtype=dtype, device=self.device, requires_grad=True)
        self.dy = torch.empty(shape, dtype=dtype, device=self.device)
        self.reset_inputs()
        self._ref = None

    @property
    def width(self) -> int:
        """The swept width: the intermediate size."""
        return self.intermediate

    def reset_inputs(self) -> None:
        """Refill gate, up and dy with the same values (Liger's backward overwrites gate and up)."""
        g = _generator(self.device, self.seed)
        with torch.no_grad():
            self.gate.normal_(generator=g).mul_(self.GATE_SCALE)
            self.up.normal_(generator=g)
            self.dy.normal_(generator=g)
        self.gate.grad = self.up.grad = None

    def bytes(self, pass_: str) -> tuple[int, int]:
        """The bytes one call moves, for the bandwidth and its floor.

        Args:
            pass_: ``"fwd"`` or ``"fwd+bwd"``.

        Returns:
            the minimal bytes, twice (no floor below them).
        """
        n = swiglu_bytes(self.tokens, self.intermediate, self.dtype.itemsize, pass_)
        return n, n

    def reference(self) -> dict[str, torch.Tensor]:
        """The float64 references, computed once and kept.

        Returns:
            ``y``, ``d_gate``, ``d_up``.
        """
        if self._ref is None:
            g64 = self.gate.detach().double().requires_grad_()
            u64 = self.up.detach().double().requires_grad_()
            y64 = swiglu_reference(g64, u64)
            y64.backward(self.dy.double())
            self._ref = {"y": y64.detach(), "d_gate": g64.grad, "d_up": u64.grad}
        return self._ref

    def check(self, fn, params, pass_: str) -> Check:
        """Run ``fn`` once (and its backward for ``"fwd+bwd"``) and compare with the float64 references.

        Args:
            fn: the implementation, ``fn(gate, up)``.
            params: its parameters (gradients reset around the check).
            pass_: ``"fwd"`` or ``"fwd+bwd"``.

        Returns:
            the ``Check``, judged against the dtype's bound.
        """
        ref = self.reference()
        reset_grads([self.gate, self.up])
        with torch.enable_grad():
            y = fn(self.gate, self.up)
            errors = {"y": relative_error(y, ref["y"], on_device=True)}
            if pass_ == "fwd+bwd":
                y.backward(self.dy.clone())
                errors["d_gate"] = _grad_error(self.gate, ref["d_gate"])
                errors["d_up"] = _grad_error(self.up, ref["d_up"])
        reset_grads([self.gate, self.up])
        return _judge(errors, RELATIVE_ERROR_TOL[self.dtype])

    def step(self, fn, params, pass_: str):
        """``(call, grad_to_none)``: one timed call, and the tensors whose ``.grad`` is reset between
        calls.

        Args:
            fn: the implementation, ``fn(gate, up)``.
            params: its parameters.
            pass_: ``"fwd"`` or ``"fwd+bwd"``.

        Returns:
            ``(call, grad_to_none)``.
        """
        gate, up, dy = self.gate, self.up, self.dy
        if pass_ == "fwd":
            return (lambda: fn(gate, up)), [gate, up]

        def fwd_bwd():
            fn(gate, up).backward(dy)

        return fwd_bwd, [gate, up]


class RoPECase:
    """Inputs of one RoPE shape, batch 1 × ``tokens`` positions: q [1, Hq, T, D] and k [1, Hkv, T,
    D] as Llama's attention makes them (transposed views of [1, T, heads, D], requiring grad), cos
    and sin in the activation dtype at random positions, and the two upstream gradients; float64
    references of both outputs and both gradients.

    Args:
        tokens: positions.
        head_dim: the head's size (even).
        dtype: the inputs' dtype.
        device: where the inputs live (None: this machine's device).
        seed: the seed of the inputs.
        heads: ``(q_heads, kv_heads)`` (None: ``ROPE_HEADS``).
    """

    kernel = "rope"

    def __init__(self, tokens: int, head_dim: int, dtype=torch.bfloat16, device=None, seed: int = 0,
                 heads: tuple[int, int] | None = None):
        self.tokens, self.head_dim, self.dtype, self.seed = tokens, head_dim, dtype, seed
        self.q_heads, self.kv_heads = heads or ROPE_HEADS
        self.device = torch.device(device) if device is not None else runtime.device()

        def llama_view(n_heads):
            t = torch.empty(1, tokens, n_heads, head_dim, dtype=dtype, device=self.device).transpose(1, 2)
            return t.requires_grad_()

        self.q, self.k = llama_view(self.q_heads), llama_view(self.kv_heads)
        self.dq = torch.empty(self.q.shape, dtype=dtype, device=self.device)
        self.dk = torch.empty(self.k.shape, dtype=dtype, device=self.device)
        positions = torch.randint(0, 8192, (1, tokens), generator=_generator(self.device, seed + 1),
                                  device=self.device)
        self.cos, self.sin = rotary_cos_sin(1, tokens, head_dim, dtype=dtype, device=self.device,
                                            positions=positions)
        self.reset_inputs()
        self._ref = None

    @property
    def width(self) -> int:
        """The swept width: the head's size."""
        return self.head_dim

    def reset_inputs(self) -> None:
        """Refill q, k and the two upstream gradients with the same values; clear q's and k's gradients."""
        g = _generator(self.device, self.seed)
        with torch.no_grad():
            for t in (self.q, self.k, self.dq, self.dk):
                t.normal_(generator=g)
        self.q.grad = self.k.grad = None

    def bytes(self, pass_: str) -> tuple[int, int]:
        """The bytes one call moves, for the bandwidth and its floor.

        Args:
            pass_: ``"fwd"`` or ``"fwd+bwd"``.

        Returns:
            the minimal bytes, twice (no floor below them).
        """
        n = rope_bytes(self.tokens, self.head_dim, self.q_heads, self.kv_heads, self.dtype.itemsize, pass_)
        return n, n

    def reference(self) -> dict[str, torch.Tensor]:
        """The float64 references, computed once and kept.

        Returns:
            ``q_embed``, ``k_embed``, ``dq``, ``dk``.
        """
        if self._ref is None:
            q64 = self.q.detach().double().requires_grad_()
            k64 = self.k.detach().double().requires_grad_()
            q_out, k_out = rotary_reference(q64, k64, self.cos.double(), self.sin.double())
            torch.autograd.backward([q_out, k_out], [self.dq.double(), self.dk.double()])
            self._ref = {"q_embed": q_out.detach(), "k_embed": k_out.detach(), "dq": q64.grad,
                         "dk": k64.grad}
        return self._ref

    def check(self, fn, params, pass_: str) -> Check:
        """Run ``fn`` once (and its backward for ``"fwd+bwd"``) and compare with the float64 references.

        Args:
            fn: the implementation, ``fn(q, k, cos, sin)`` returning both rotated.
            params: its parameters (gradients reset around the check).
            pass_: ``"fwd"`` or ``"fwd+bwd"``.

        Returns:
            the ``Check``, judged against the dtype's bound.
        """
        ref = self.reference()
        reset_grads([self.q, self.k])
        with torch.enable_grad():
            q_out, k_out = fn(self.q, self.k, self.cos, self.sin)
            errors = {"q_embed": relative_error(q_out, ref["q_embed"], on_device=True),
                      "k_embed": relative_error(k_out, ref["k_embed"], on_device=True)}
            if pass_ == "fwd+bwd":
                torch.autograd.backward([q_out, k_out], [self.dq.clone(), self.dk.clone()])
                errors["dq"] = _grad_error(self.q, ref["dq"])
                errors["dk"] = _grad_error(self.k, ref["dk"])
        reset_grads([self.q, self.k])
        return _judge(errors, RELATIVE_ERROR_TOL[self.dtype])

    def step(self, fn, params, pass_: str):
        """``(call, grad_to_none)``: one timed call, and the tensors whose ``.grad`` is reset between
        calls.

        Args:
            fn: the implementation, ``fn(q, k, cos, sin)`` returning both rotated.
            params: its parameters.
            pass_: ``"fwd"`` or ``"fwd+bwd"``.

        Returns:
            ``(call, grad_to_none)``.
        """
        q, k, cos, sin, dq, dk = self.q, self.k, self.cos, self.sin, self.dq, self.dk
        if pass_ == "fwd":
            return (lambda: fn(q, k, cos, sin)), [q, k]

        def fwd_bwd():
            torch.autograd.backward(list(fn(q, k, cos, sin)), [dq, dk])

        return fwd_bwd, [q, k]


CASES = {"rmsnorm": RMSNormCase, "cross_entropy": CrossEntropyCase, "swiglu": SwiGLUCase, "rope": RoPECase}


# --------------------------------------------------------------------------------------------------
# The sweep: check, then time, every implementation at every shape
# --------------------------------------------------------------------------------------------------


def _base_row(case, impl: Impl, pass_: str) -> dict:
    n_bytes, n_floor = case.bytes(pass_)
    return {
        "kernel": case.kernel, "impl": impl.key, "label": impl.label, "role": impl.role,
        "tokens": case.tokens, "width": case.width, "shape": f"{case.tokens}×{case.width}", "pass": pass_,
        "dtype": str(case.dtype).removeprefix("torch."),
        "status": "ok", "note": "",
        "eager_ms": None, "device_ms": None, "device_note": None, "eager_ms_rounds": [],
        "device_ms_rounds": [],
        "bytes": n_bytes, "bytes_floor": n_floor,
        "gbps": None, "frac_copy": None, "gbps_floor": None, "frac_copy_floor": None,
        "copy_same_bytes_ms": None, "frac_same_bytes_copy": None,
        "peak_extra_mib": None, "check": None,
    }


def _free_device_memory() -> None:
    import gc

    gc.collect()
    if runtime.MODE == "gpu":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _checked_row(case, impl: Impl, fn, params, pass_: str) -> dict:
    """The row of one implementation and pass, its output checked against float64 (status "ok" if it
    passed)."""
    row = _base_row(case, impl, pass_)
    try:
        case.reset_inputs()
        check = case.check(fn, params, pass_)
    except Exception as exc:  # noqa: BLE001  (a peer that raises is a result, not the end of the sweep)
        row.update(status="error",
                   note=f"the correctness check raised {type(exc).__name__}: {first_line(exc)}")
        _free_device_memory()
        return row
    row["check"] = check.to_json()
    if not check.ok:
        row.update(status="check failed", note=f"not timed: {check.message}")
    return row


def _time_into(row: dict, case, fn, params, pass_: str, warmup: int, rep: int) -> None:
    """Time one call of a checked row once more: its eager and device times go to the row's
    per-round lists, and its peak memory is measured the first time."""
    try:
        case.reset_inputs()  # the check or an earlier round may have overwritten inputs (in-place gradients)
        call, grads = case.step(fn, params, pass_)
        row["eager_ms_rounds"].append(time_ms(call, warmup=warmup, rep=rep, grad_to_none=grads))
        if row["peak_extra_mib"] is None:
            row["peak_extra_mib"] = peak_extra_mib(call, grads)
        device_ms, row["device_note"] = device_time_ms(call, grads, warmup=warmup, rep=rep)
        if device_ms is not None:
            row["device_ms_rounds"].append(device_ms)
    except Exception as exc:  # noqa: BLE001  (out of memory at a large shape, for example)
        row.update(status="error", note=f"timing raised {type(exc).__name__}: {first_line(exc)}")
        _free_device_memory()


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def measure_shape(case, chosen, passes, warmup: int = 25, rep: int = 50, rounds: int = 1,
                  bar=None) -> list[dict]:
    """Rows for every implementation at one shape: skipped (with the reason), or checked and then
    timed, per pass.

    The timing goes round by round, every implementation once per round, and each row keeps the
    median over the rounds. A host whose speed drifts (another process, clock changes) then slows
    every implementation of a round alike instead of whichever was being timed, which matters for
    eager times at small shapes, where the host sets them. The order rotates from round to round, so
    that no implementation always runs first or after the same neighbour. The per-round times are
    kept in the row (``eager_ms_rounds``, ``device_ms_rounds``). Each round also times a copy of
    each pass's bytes (``same_bytes_copy_ms``); every row of the pass gets the median
    (``copy_same_bytes_ms``), the yardstick at this size.

    Args:
        case: the shape's inputs (a ``*Case``).
        chosen: the ``Impl`` objects.
        passes: the passes to check and time.
        warmup: ``do_bench`` warm-up, ms.
        rep: ``do_bench`` repetitions, ms.
        rounds: timing rounds.
        bar: a progress bar, advanced once per implementation and round (None: none).

    Returns:
        one row per implementation and pass.
    """
    rows, timed = [], {}  # timed: per implementation, its checked rows and what times them
    for impl in chosen:
        reason = impl.unavailable()
        if reason:
            rows += [dict(_base_row(case, impl, p), status="skipped", note=reason) for p in passes]
            continue
        try:
            fn, params = impl.build(case)
        except Exception as exc:  # noqa: BLE001
            note = f"building it raised {type(exc).__name__}: {first_line(exc)}"
            rows += [dict(_base_row(case, impl, p), status="error", note=note) for p in passes]
            continue
        for pass_ in passes:
            row = _checked_row(case, impl, fn, params, pass_)
            rows.append(row)
            if row["status"] == "ok":
                timed.setdefault(impl.key, []).append((row, fn, params, pass_))
    copies: dict[str, list[float]] = {p: [] for p in passes}
    for r in range(rounds):
        for impl in rotated(chosen, r):
            for row, fn, params, pass_ in timed.get(impl.key, ()):
                if row["status"] == "ok":
                    _time_into(row, case, fn, params, pass_, warmup, rep)
            if bar is not None:
                bar.update(1)
        for pass_ in copies if timed else ():
            ms = same_bytes_copy_ms(case.bytes(pass_)[0], warmup, rep)
            if ms is not None:
                copies[pass_].append(ms)
    for row, *_ in (entry for entries in timed.values() for entry in entries):
        row["eager_ms"] = _median(row["eager_ms_rounds"])
        row["device_ms"] = _median(row["device_ms_rounds"])
    for row in rows:
        row["copy_same_bytes_ms"] = _median(copies[row["pass"]])
    return rows


def add_rates(rows: list[dict], ceilings: dict | None) -> None:
    """Fill GB/s (from device time; minimal bytes), the fraction of the measured copy bandwidth, and
    the fraction of a copy of the row's own bytes (the copy's time over the row's: 1 is as fast as
    PyTorch's copy of them), in place.

    Args:
        rows: the rows, changed in place.
        ceilings: the GPU's ceilings (None: no fractions of the copy bandwidth).
    """
    copy = ceilings.get("copy_gbps") if ceilings else None
    for row in rows:
        if row["device_ms"] is None:
            continue
        if row.get("copy_same_bytes_ms"):
            row["frac_same_bytes_copy"] = row["copy_same_bytes_ms"] / row["device_ms"]
        row["gbps"] = gbps(row["bytes"], row["device_ms"])
        row["gbps_floor"] = gbps(row["bytes_floor"], row["device_ms"])
        if copy:
            row["frac_copy"] = row["gbps"] / copy
            row["frac_copy_floor"] = row["gbps_floor"] / copy


def sweep_shapes(tokens, width: int, width_sweep=(),
                 width_sweep_tokens: int | None = None) -> list[tuple[int, int]]:
    """The (tokens, width) shapes of a token sweep at ``width`` plus a width sweep at
    ``width_sweep_tokens``.

    Args:
        tokens: token counts of the token sweep.
        width: the width of the token sweep.
        width_sweep: the widths of the width sweep (empty: none).
        width_sweep_tokens: the token count of the width sweep.

    Returns:
        the shapes, the token sweep's first.

    Raises:
        ValueError: when a width sweep has no token count, or a size is not positive.
    """
    shapes = [(int(t), int(width)) for t in tokens]
    if width_sweep:
        if width_sweep_tokens is None:
            raise ValueError("a width sweep needs width_sweep_tokens (the token count it is run at)")
        shapes += [(int(width_sweep_tokens), int(w)) for w in width_sweep if (width_sweep_tokens,
                                                                              w) not in shapes]
    for t, w in shapes:
        if t < 1 or w < 1:
            raise ValueError(f"sizes must be positive, got tokens={t}, width={w}")
    return shapes


def run_benchmark(
    kernel: str,
    tokens,
    width: int,
    *,
    width_sweep=(),
    width_sweep_tokens: int | None = None,
    impls=None,
    passes=None,
    dtype: torch.dtype = torch.bfloat16,
    warmup: int = 25,
    rep: int = 50,
    seed: int = 0,
    ceilings: dict | None = None,
    progress: bool = True,
    rounds: int = 1,
) -> dict:
    """Check and time ``kernel``'s implementations over a token sweep (and, for RMSNorm, a
    hidden-size sweep).

    ``width`` is the hidden size (RMSNorm) or the vocabulary (cross-entropy). ``impls``: keys of
    ``peers.IMPLEMENTATIONS[kernel]`` or ``Impl`` objects (default: all). ``warmup``/``rep`` are
    do_bench's, in ms; ``rounds`` how many times every implementation is timed, in turn, at each
    shape (``measure_shape``). On a GPU the copy and matmul ceilings are measured first unless
    ``ceilings`` is given. Returns the results dict that ``save_results`` writes as JSON.

    Chapters 04, 07 and 11 run it.

    Args:
        kernel: one of ``KERNELS``.
        tokens: token counts of the token sweep.
        width: the hidden size or the vocabulary.
        width_sweep: widths swept at ``width_sweep_tokens`` (empty: none).
        width_sweep_tokens: the token count of the width sweep.
        impls: implementation keys or ``Impl`` objects (None: all).
        passes: the passes (None: the kernel's).
        dtype: the inputs' dtype (one of ``RELATIVE_ERROR_TOL``'s).
        warmup: ``do_bench`` warm-up, ms.
        rep: ``do_bench`` repetitions, ms.
        seed: the seed of the inputs.
        ceilings: the GPU's ceilings (None: measured here on a GPU).
        progress: show a progress bar.
        rounds: timing rounds per shape.

    Returns:
        the results dict.

    Raises:
        TypeError: when ``dtype`` has no error bound.
        ValueError: when ``kernel``, a pass, an implementation, a size or ``rounds`` is unknown or
            out of range.
    """
    check_kernel(kernel)
    if dtype not in RELATIVE_ERROR_TOL:
        raise TypeError(f"dtype must be one of {tuple(RELATIVE_ERROR_TOL)}, got {dtype}")
    passes = tuple(passes or KERNEL_PASSES[kernel])
    for p in passes:
        if p not in KERNEL_PASSES[kernel]:
            raise ValueError(f"{kernel} is measured in passes {KERNEL_PASSES[kernel]}, got {p!r}")
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
        raise ValueError(f"rounds must be a positive int, got {rounds!r}")
    chosen = implementations(kernel, impls)
    shapes = sweep_shapes(tokens, width, width_sweep, width_sweep_tokens)
    if ceilings is None and runtime.MODE == "gpu":
        ceilings = measure_ceilings()

    from .progress import progress_bar as tqdm

    rows: list[dict] = []
    bar = tqdm(total=len(shapes) * rounds * len(chosen), desc=kernel, disable=not progress, leave=True)
    try:
        for n_tokens, n_width in shapes:
            if runtime.MODE == "gpu" and any(i.compiled for i in chosen):
                # compile afresh per shape: dynamic=False, and no recompile limit to hit
                torch._dynamo.reset()
            case = CASES[kernel](n_tokens, n_width, dtype=dtype, seed=seed)
            bar.set_postfix_str(f"{n_tokens}×{n_width}")
            rows += measure_shape(case, chosen, passes, warmup, rep, rounds, bar)
            del case
            _free_device_memory()
    finally:
        bar.close()
    add_rates(rows, ceilings)
    return _results_dict(kernel, rows, chosen, ceilings, shapes, dict(
        tokens=[int(t) for t in tokens], width=int(width), width_sweep=[int(w) for w in width_sweep],
        width_sweep_tokens=width_sweep_tokens, dtype=str(dtype).removeprefix("torch."), passes=list(passes),
        warmup_ms=warmup, rep_ms=rep, seed=seed, rounds=rounds,
    ))


def _results_dict(kernel, rows, chosen, ceilings, shapes, settings) -> dict:
    skipped = {r["impl"]: r["note"] for r in rows if r["status"] == "skipped"}
    return {
        "schema": SCHEMA_VERSION,
        "kernel": kernel,
        "width_name": WIDTH_NAMES[kernel],
        "mode": runtime.MODE,
        "device": runtime.device_name(),
        "device_slug": device_slug(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {**runtime.versions(), "liger_kernel": _liger_version()},
        "git_commit": _git_commit(),
        "ceilings": ceilings,
        "settings": settings,
        "time_basis": _time_basis(),
        "implementations": {
            i.key: {"label": i.label, "role": i.role, "skipped": skipped.get(i.key)} for i in chosen
        },
        "shapes": [list(s) for s in shapes],
        "rows": rows,
    }



def _time_basis() -> dict:
    if runtime.MODE == "gpu":
        return {
            "eager_ms": "do_bench median of the plain call: host (Python, autograd, launch) overhead included; "
                        "the median over the rounds",
            "device_ms": "do_bench median of CUDA-graph replays of the same call: GPU time only; the median over "
                         "the rounds",
        }
    return {
        "eager_ms": "wall-clock median of the CPU interpreter: meaningless as a GPU time",
        "device_ms": "not measured: no GPU",
    }


def _liger_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("liger-kernel")
    except Exception:  # noqa: BLE001  (not installed)
        return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ASSETS.parent, capture_output=True, text=True,
                             timeout=10, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ASSETS.parent,
                               capture_output=True, text=True, timeout=10, check=True)
    except Exception:  # noqa: BLE001  (not a git checkout, or no git)
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")




def results_table(results: dict) -> Table:
    """``format_table``'s figures as a ``Table`` that reads at a laptop's width (``display`` it in a
    notebook).

    One section per shape and pass, one row per implementation under it; ``ours×`` is that row's
    time over ours' at the same shape and pass (above 1: ours is faster). ``print`` gives the same
    table as text.

    Chapters 04 and 07 display it.

    Args:
        results: a sweep's results dict.

    Returns:
        the ``Table``.
    """
    ours = {basis: {(e["tokens"], e["width"], e["pass"]): e["ours_ms"] for e in speedups(results, basis)}
            for basis in ("device", "eager")}
    gpu = results["mode"] == "gpu"
    sections: dict[tuple, list] = {}
    for row in results["rows"]:
        key = (row["tokens"], row["width"], row["pass"])
        x_dev = _ratio(row["device_ms"], ours["device"].get(key))
        x_eag = _ratio(row["eager_ms"], ours["eager"].get(key))
        status = row["status"] if row["status"] != "ok" else (
            "ok" if row["device_note"] is None or not gpu else "no graph")
        same = row.get("frac_same_bytes_copy")
        sections.setdefault((row["shape"], row["pass"]), []).append([
            row["label"], _fmt(row["eager_ms"], ".3f"), _fmt(row["device_ms"], ".3f"),
            _fmt(row["gbps"], ",.0f"),
            _fmt(row["frac_copy"] and 100 * row["frac_copy"], ".1f"), _fmt(same and 100 * same, ".1f"),
            _fmt(x_dev, ".3g"), _fmt(x_eag, ".3g"), _fmt(row["peak_extra_mib"], ",.1f"), status])
    rows: list = []
    for (shape, pass_), members in sections.items():
        rows += [Section(f"{shape} (tokens × {WIDTH_NAMES[results['kernel']]}), {pass_}"), *members]
    notes = ["ours× = this row's time / ours' time at the same shape and pass (above 1: ours is faster)",
             "% copy: of the copy bandwidth measured on gigabytes; % same: a copy of this row's bytes, timed the same "
             "way, over this row's device time (100: as fast as that copy)"]
    if not gpu:
        notes.insert(0, "* wall-clock of Triton's CPU interpreter: meaningless as GPU time; no device times "
                        "without a GPU")
    columns = ["implementation", "eager ms" if gpu else "wall ms*", "device ms", "GB/s", "% copy", "% same",
               "ours× device", "ours× eager", "peak MiB", "status"]
    caption = f"{results['kernel']} on {results['device']} ({results['mode']}), {results['date']}"
    return html_table(columns, rows, align="lrrrrrrrrl", caption=caption, notes=notes)


def _ratio(time_ms: float | None, ours_ms: float | None) -> float | None:
    return time_ms / ours_ms if (time_ms and ours_ms) else None


def _fmt(value, spec: str) -> str | None:
    return None if value is None else format(value, spec)


def default_sizes(kernel: str, quick: bool = False) -> dict:
    """The sweep's sizes for this mode: realistic on a GPU, tiny in the interpreter; ``quick`` trims them.

    Args:
        kernel: one of ``KERNELS``.
        quick: the quick sweep's sizes.

    Returns:
        the sizes (a copy).

    Raises:
        ValueError: when ``kernel`` is unknown.
    """
    check_kernel(kernel)
    table = (GPU_QUICK_SIZES if quick else GPU_SIZES) if runtime.MODE == "gpu" else (
        CPU_QUICK_SIZES if quick else CPU_SIZES)
    return dict(table[kernel])


def _sizes_or_none(text: str) -> tuple[int, ...]:
    """Positive sizes, or ``none`` for no sweep at all."""
    return () if text.strip().lower() == "none" else cli.positive_ints(text)


def _even(text: str) -> int:
    value = cli.positive_int(text)
    if value % 2:
        raise argparse.ArgumentTypeError(f"must be even (rotate_half pairs column d with d + head_dim/2), "
                                         f"got {text!r}")
    return value


def _all_impl_keys() -> tuple[str, ...]:
    return tuple(sorted({i.key for impls in IMPLEMENTATIONS.values() for i in impls}))


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m kernels.bench.sweep``.

    Returns:
        the parser.
    """
    keys = {k: ", ".join(i.key for i in v) for k, v in IMPLEMENTATIONS.items()}
    parser = argparse.ArgumentParser(
        prog="python -m kernels.bench.sweep",
        description=(
            "Check, then time, the fused RMSNorm, cross-entropy, SwiGLU and RoPE kernels against every peer "
            "(Hugging Face eager, torch.compile, PyTorch's native ops, Liger-Kernel where installed). Every time is "
            "given twice: eager (the plain call, host overhead included) and device (CUDA-graph replay: GPU time "
            "only). Writes <kernel>/<gpu>.json and .png under the results root and prints a table: by default "
            "the git-ignored runs folder, with --record the committed results the chapters read."
        ),
        epilog=(
            f"Implementation keys: rmsnorm: {keys['rmsnorm']}; cross_entropy: {keys['cross_entropy']}; "
            f"swiglu: {keys['swiglu']}; rope: {keys['rope']}. "
            f"GPU defaults: rmsnorm tokens {','.join(map(str, GPU_SIZES['rmsnorm']['tokens']))} at hidden 4096, "
            "hidden 1024,2048,4096,8192 at 16384 tokens; cross_entropy tokens "
            f"{','.join(map(str, GPU_SIZES['cross_entropy']['tokens']))} at vocab 128256; swiglu at intermediate "
            "14336 and rope at head_dim 128 (32 q heads, 8 kv heads), Llama-3.1-8B's shapes. Without a GPU the "
            "sizes are tiny and times are the interpreter's wall-clock (meaningless as GPU times)."
        ),
    )
    parser.add_argument("--kernel", choices=(*KERNELS, "all"), default="all",
                        help="which kernel to benchmark")
    parser.add_argument("--tokens", type=cli.positive_ints,
                        help="token counts of the token sweep, e.g. 1024,4096,16384")
    parser.add_argument("--hidden", type=cli.positive_int,
                        help="RMSNorm: hidden size of the token sweep (GPU default "
                                                                "4096)")
    parser.add_argument("--hidden-sweep", type=_sizes_or_none,
                        help="RMSNorm: hidden sizes swept at --hidden-sweep-tokens, e.g. 1024,8192 ('none' to skip)")
    parser.add_argument("--hidden-sweep-tokens", type=cli.positive_int,
                        help="RMSNorm: tokens of the hidden sweep (default 16384)")
    parser.add_argument("--vocab", type=cli.positive_int,
                        help="cross-entropy: vocabulary size (GPU default 128256)")
    parser.add_argument("--intermediate", type=cli.positive_int,
                        help="SwiGLU: intermediate size (GPU default 14336)")
    parser.add_argument("--head-dim", type=_even,
                        help="RoPE: head_dim, even (GPU default 128; 32 q heads, 8 kv heads)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    parser.add_argument("--impls", type=cli.names(_all_impl_keys()),
                        help="comma-separated implementation keys (default: all)")
    parser.add_argument("--passes", type=cli.names(("fwd", "fwd+bwd")),
                        help="RMSNorm, SwiGLU, RoPE: fwd, fwd+bwd (default both)")
    parser.add_argument("--quick", action="store_true", help="a few sizes only")
    parser.add_argument("--warmup", type=cli.positive_int, default=25,
                        help="do_bench warm-up, ms of GPU time (default 25)")
    parser.add_argument("--rep", type=cli.positive_int, default=50,
                        help="do_bench repetitions, ms of GPU time (default 50)")
    parser.add_argument("--rounds", type=cli.positive_int, default=runtime.pick(1, 3),
                        help="times every implementation is timed, in turn, at each shape; rows keep the median "
                             "(default 3 on a GPU, 1 in the interpreter)")
    parser.add_argument("--seed", type=cli.non_negative_int, default=0)
    cli.add_output_arguments(parser, "<kernel>/<gpu>.json and .png")
    parser.add_argument("--no-plots", action="store_true", help="write JSON only")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _sizes_from_args(kernel: str, args) -> dict:
    sizes = default_sizes(kernel, args.quick)
    if args.tokens:
        sizes["tokens"] = args.tokens
    if kernel == "rmsnorm":
        if args.hidden:
            sizes["hidden"] = args.hidden
        if args.hidden_sweep is not None:
            sizes["hidden_sweep"] = args.hidden_sweep
        if args.hidden_sweep_tokens:
            sizes["hidden_sweep_tokens"] = args.hidden_sweep_tokens
    for key, value in (("vocab", args.vocab), ("intermediate", args.intermediate),
                       ("head_dim", args.head_dim)):
        if value and key == WIDTH_NAMES[kernel]:
            sizes[key] = value
    return sizes


def _impls_for(kernel: str, keys) -> list[str] | None:
    if not keys:
        return None
    return [k for k in keys if k in {i.key for i in IMPLEMENTATIONS[kernel]}]


def _kernels_to_run(args) -> tuple[str, ...]:
    """The kernels this run measures: those of ``--kernel`` that one of ``--impls`` (if given) applies to."""
    chosen = KERNELS if args.kernel == "all" else (args.kernel,)
    return tuple(k for k in chosen if _impls_for(k, args.impls) != [])


def check_args(parser: argparse.ArgumentParser, args) -> tuple[str, ...]:
    """Every check that needs more than one flag, and the output files, before any work; returns the
    kernels to run.

    Args:
        parser: the parser (its ``error`` reports the problems and exits).
        args: the parsed flags.

    Returns:
        the kernels to run.
    """
    problems = []
    kernels_to_run = _kernels_to_run(args)
    if not kernels_to_run:
        problems.append(f"--impls {','.join(args.impls)}: none of them is an implementation of "
                        f"{'any kernel' if args.kernel == 'all' else args.kernel}")
    root = cli.output_root(args)
    targets = [results_file(k, device_slug(), root, suffix) for k in kernels_to_run
               for suffix in ((".json",) if args.no_plots else (".json", ".png"))]
    cli.check_outputs(parser, args, targets, problems)
    return kernels_to_run


def run_kernel_cli(kernel: str, args, ceilings: dict | None) -> dict:
    """One kernel's sweep at the sizes and implementations the flags choose.

    Args:
        kernel: one of ``KERNELS``.
        args: the parsed flags.
        ceilings: the GPU's ceilings (None: none).

    Returns:
        the results dict, or ``{}`` when none of the chosen implementations is the kernel's.
    """
    sizes = _sizes_from_args(kernel, args)
    passes = None
    if len(KERNEL_PASSES[kernel]) > 1 and args.passes:
        passes = args.passes
    impls = _impls_for(kernel, args.impls)
    if impls == []:
        print(f"{kernel}: none of the chosen implementations applies; skipped")
        return {}
    common = dict(impls=impls, passes=passes, dtype=DTYPES[args.dtype], warmup=args.warmup, rep=args.rep,
                  seed=args.seed, ceilings=ceilings, progress=not args.no_progress, rounds=args.rounds)
    if kernel == "rmsnorm":
        return run_benchmark("rmsnorm", sizes["tokens"], sizes["hidden"], width_sweep=sizes["hidden_sweep"],
                             width_sweep_tokens=sizes["hidden_sweep_tokens"], **common)
    return run_benchmark(kernel, sizes["tokens"], sizes[WIDTH_NAMES[kernel]], **common)


def main(argv=None) -> int:
    """Sweep the kernels from the command line, print the tables, write each kernel's JSON and PNG.

    Args:
        argv: the command line's arguments (None: ``sys.argv``'s).

    Returns:
        the exit status, 0 (a refused flag exits through ``argparse``).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    kernels_to_run = check_args(parser, args)
    root = cli.output_root(args)
    print(runtime.describe())
    print(runtime.timings_note())
    ceilings = None
    if runtime.MODE == "gpu":
        ceilings = measure_ceilings()
        print(f"measured ceilings: copy {ceilings['copy_gbps']:,.0f} GB/s, bf16 matmul "
              f"{ceilings['matmul_tflops']:,.0f} TFLOP/s")
    for kernel in kernels_to_run:
        results = run_kernel_cli(kernel, args, ceilings)
        if not results:
            continue
        path = results_file(kernel, results["device_slug"], root)
        print()
        print(format_table(results))
        print(summarize(results))
        if args.no_plots:
            print(f"wrote {cli.write_json(path, results)}")
        else:
            from .plots import summary_figure

            for written in cli.write_json_and_figure(path, results, summary_figure(results),
                                                     path.with_suffix(".png"),
                                                     dpi=110):
                print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    # Run through the package's module, not this __main__ copy, so there is one set of classes and
    # constants.
    from kernels.bench.sweep import main as _main

    raise SystemExit(_main())
