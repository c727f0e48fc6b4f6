"""The implementations a kernel is compared against, and ours: the registry the benchmark sweep runs.

For RMSNorm: Hugging Face's ``LlamaRMSNorm`` in eager mode, ``torch.compile`` of it, PyTorch's
native fused ``F.rms_norm``, Liger-Kernel's ``LigerRMSNorm`` and ours. For cross-entropy:
``F.cross_entropy`` on an fp32 upcast of the logits (what Hugging Face does) and without the upcast,
``torch.compile`` of the former, Liger-Kernel's in-place loss, ours with the gradient written in
place and ours with a gradient buffer. For SwiGLU: Hugging Face's ``act_fn(gate) * up`` in eager
mode, ``torch.compile`` of it, Liger-Kernel's ``LigerSiLUMulFunction`` and ours. For RoPE: Hugging
Face's ``apply_rotary_pos_emb`` in eager mode, ``torch.compile`` of it, Liger-Kernel's
``liger_rotary_pos_emb`` and ours. Each is an ``Impl`` that builds a callable for one case
(``kernels.bench.sweep``); one that cannot run here says why instead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import runtime

from .results import check_kernel, first_line


@dataclass(frozen=True)
class Impl:
    """One implementation in a sweep.

    ``build(case)`` returns ``(fn, params)``: for RMSNorm ``fn(x) -> y``, for cross-entropy
    ``fn(logits, target) -> loss``; ``params`` are the implementation's own weight Parameters (their
    gradients are reset between calls). ``role`` is ``"ours"`` (the one speed-ups are computed for),
    ``"peer"`` or ``"variant"`` (another setting of ours, shown but neither the reference nor a
    peer). ``unavailable()`` gives the reason it cannot run here, or None.
    """

    key: str
    label: str
    role: str
    build: Callable
    unavailable: Callable[[], str | None] = lambda: None
    compiled: bool = False


def _no_compile_in_interpreter() -> str | None:
    if runtime.MODE != "gpu":
        return "torch.compile is skipped in the interpreter (it would compile for the CPU, not run our comparison)"
    return None


def _hf_compile_missing() -> str | None:
    """Why ``torch.compile`` of a Hugging Face module or function cannot run here, or None."""
    return _transformers_missing() or _no_compile_in_interpreter()


def _build_plain(function):
    """An implementation that is a plain function with no parameters of its own."""
    def build(case):
        return function, []

    return build


def _build_compiled(function):
    """``torch.compile`` of a plain function (static shapes: each benchmarked shape compiles once)."""
    def build(case):
        return torch.compile(function, dynamic=False), []

    return build


# Liger-Kernel logs a warning, on its first call of each op, for every optional backend of other
# hardware it cannot import (CuTe DSL, Ascend): nothing a reader of a benchmark can act on, so only
# its errors are shown.
LIGER_BACKEND_LOGGER = "liger_kernel.backends.registry"


def _liger_missing(module: str) -> Callable[[], str | None]:
    def reason() -> str | None:
        logging.getLogger(LIGER_BACKEND_LOGGER).setLevel(logging.ERROR)
        try:
            __import__(module)
        except ImportError as exc:
            return f"Liger-Kernel is not installed here ({first_line(exc)}): `pip install liger-kernel` to compare"
        if runtime.MODE != "gpu":
            return "Liger-Kernel runs only on a GPU"
        return None

    return reason


def _transformers_missing() -> str | None:
    try:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: F401
    except ImportError as exc:
        return f"transformers is not installed ({first_line(exc)})"
    return None


def _hf_rmsnorm(case) -> torch.nn.Module:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    module = LlamaRMSNorm(case.hidden, eps=case.eps).to(device=case.device, dtype=case.dtype)
    with torch.no_grad():
        module.weight.copy_(case.weight)
    return module


def _build_ours_rmsnorm(case):
    from kernels.rmsnorm import TritonRMSNorm

    module = TritonRMSNorm.from_hf(_hf_rmsnorm(case))
    return module, [module.weight]


def _build_hf_rmsnorm(case):
    module = _hf_rmsnorm(case)
    return module, [module.weight]


def _build_compiled_rmsnorm(case):
    module = _hf_rmsnorm(case)
    return torch.compile(module, dynamic=False), [module.weight]


def _build_native_rmsnorm(case):
    weight = torch.nn.Parameter(case.weight.detach().clone())
    shape = (case.hidden,)

    def fn(x):
        return F.rms_norm(x, shape, weight, case.eps)

    return fn, [weight]


def _build_liger_rmsnorm(case):
    from liger_kernel.transformers.rms_norm import LigerRMSNorm

    module = LigerRMSNorm(case.hidden, eps=case.eps).to(device=case.device, dtype=case.dtype)
    with torch.no_grad():
        module.weight.copy_(case.weight)
    return module, [module.weight]


RMSNORM_IMPLS = (
    Impl("ours", "ours (Triton, fused)", "ours", _build_ours_rmsnorm),
    Impl("hf", "HF LlamaRMSNorm eager", "peer", _build_hf_rmsnorm, _transformers_missing),
    Impl("compile", "torch.compile(HF)", "peer", _build_compiled_rmsnorm, _hf_compile_missing,
         compiled=True),
    Impl("native", "F.rms_norm (native fused)", "peer", _build_native_rmsnorm),
    Impl("liger", "Liger RMSNorm", "peer", _build_liger_rmsnorm,
         _liger_missing("liger_kernel.transformers.rms_norm")),
)


def _ce_fp32_upcast(logits, target):
    # What a Hugging Face causal LM does: upcast the logits to float32, then F.cross_entropy.
    return F.cross_entropy(logits.float(), target)


def _ce_native(logits, target):
    return F.cross_entropy(logits, target)


def _build_ours_ce(inplace: bool):
    def build(case):
        from kernels.cross_entropy import cross_entropy

        # check_targets=False: the range check is a host synchronisation (it breaks CUDA-graph
        # capture); the correctness check before timing already ran on these targets.
        def fn(logits, target):
            return cross_entropy(logits, target, inplace_backward=inplace, check_targets=False)

        return fn, []

    return build


def _build_liger_ce(case):
    from liger_kernel.transformers.cross_entropy import LigerCrossEntropyLoss

    return LigerCrossEntropyLoss(), []


CROSS_ENTROPY_IMPLS = (
    Impl("ours", "ours (Triton, gradient in place)", "ours", _build_ours_ce(inplace=True)),
    Impl("ours-buffer", "ours, gradient buffer", "variant", _build_ours_ce(inplace=False)),
    Impl("fp32", "F.cross_entropy(logits.float()) (HF)", "peer", _build_plain(_ce_fp32_upcast)),
    Impl("bf16", "F.cross_entropy, no upcast", "peer", _build_plain(_ce_native)),
    Impl("compile", "torch.compile(fp32 upcast + F.cross_entropy)", "peer", _build_compiled(_ce_fp32_upcast),
         _no_compile_in_interpreter, compiled=True),
    Impl("liger", "Liger cross-entropy (in place)", "peer", _build_liger_ce,
         _liger_missing("liger_kernel.transformers.cross_entropy")),
)

# ---- SwiGLU: fn(gate, up) -> silu(gate) * up ----


def _swiglu_hf(gate, up):
    # LlamaMLP's act_fn(gate_proj(x)) * up_proj(x): two elementwise kernels and a saved silu(gate)
    # in eager mode.
    from transformers.activations import ACT2FN

    return ACT2FN["silu"](gate) * up


def _build_ours_swiglu(case):
    from kernels.swiglu import swiglu

    return swiglu, []


def _build_liger_swiglu(case):
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    # Liger's backward writes the gradients over its saved gate and up (the case refills them before
    # each check).
    return LigerSiLUMulFunction.apply, []


SWIGLU_IMPLS = (
    Impl("ours", "ours (Triton, fused)", "ours", _build_ours_swiglu),
    Impl("hf", "HF act_fn(gate) * up eager", "peer", _build_plain(_swiglu_hf), _transformers_missing),
    Impl("compile", "torch.compile(HF)", "peer", _build_compiled(_swiglu_hf), _hf_compile_missing,
         compiled=True),
    Impl("liger", "Liger SiLUMul", "peer", _build_liger_swiglu, _liger_missing("liger_kernel.ops.swiglu")),
)


# ---- RoPE: fn(q, k, cos, sin) -> (q_embed, k_embed) ----


def _rope_hf(q, k, cos, sin):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    return apply_rotary_pos_emb(q, k, cos, sin)


def _build_ours_rope(case):
    from kernels.rope import apply_rotary

    return apply_rotary, []


def _build_liger_rope(case):
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    def fn(q, k, cos, sin):
        return liger_rotary_pos_emb(q, k, cos, sin, None, 1)

    return fn, []


ROPE_IMPLS = (
    Impl("ours", "ours (Triton, q and k in one launch)", "ours", _build_ours_rope),
    Impl("hf", "HF apply_rotary_pos_emb eager", "peer", _build_plain(_rope_hf), _transformers_missing),
    Impl("compile", "torch.compile(HF)", "peer", _build_compiled(_rope_hf), _hf_compile_missing,
         compiled=True),
    Impl("liger", "Liger rotary_pos_emb", "peer", _build_liger_rope,
         _liger_missing("liger_kernel.transformers.rope")),
)

IMPLEMENTATIONS = {"rmsnorm": RMSNORM_IMPLS, "cross_entropy": CROSS_ENTROPY_IMPLS, "swiglu": SWIGLU_IMPLS,
                   "rope": ROPE_IMPLS}


def implementations(kernel: str, keys=None) -> list[Impl]:
    """The implementations of ``kernel`` (all, or those named in ``keys``; Impl objects pass through).

    Chapters 04 and 07 choose their peers with it.

    Args:
        kernel: one of ``KERNELS``.
        keys: implementation keys or ``Impl`` objects (None: every implementation of ``kernel``).

    Returns:
        the ``Impl`` objects, in the order asked.

    Raises:
        ValueError: when ``kernel`` is unknown or a key names no implementation of it.
    """
    check_kernel(kernel)
    known = {impl.key: impl for impl in IMPLEMENTATIONS[kernel]}
    if keys is None:
        return list(known.values())
    chosen = []
    for key in keys:
        if isinstance(key, Impl):
            chosen.append(key)
        elif key in known:
            chosen.append(known[key])
        else:
            raise ValueError(f"unknown implementation {key!r} for {kernel}; known: {', '.join(known)}")
    return chosen
