"""AdamW in Triton: the optimizer step as one elementwise kernel per parameter tensor, and ``TritonAdamW``.

The optimizer step of a full fine-tuning is pure memory traffic. For every parameter, AdamW reads the parameter,
its gradient and its two moments, and writes the parameter and the moments back:

    p ← p − lr·wd·p                                   (decoupled weight decay)
    m ← β1·m + (1 − β1)·g                              (first moment)
    v ← β2·v + (1 − β2)·g²                             (second moment)
    p ← p − (lr / (1 − β1ᵗ)) · m / (√v / √(1 − β2ᵗ) + ε)

Seven tensors of the parameters' size move per step, 14 bytes per parameter in bf16: 112 GB at the Llama-3.1-8B
shape, 26.5 ms at an H200's copy bandwidth. ``torch.optim.AdamW``'s default (``foreach``) runs that as about ten
passes over the parameters; ``fused=True`` runs one kernel. Here too one kernel reads each value once, does the
arithmetic in float32 registers (the order above, which is PyTorch's fused kernel's; the scalars that depend only
on the hyperparameters, such as 1 − β2, are computed on the host in float64), and stores the results in the
tensors' own dtypes. ``assets/notes/adamw.md`` has the measurements.

``TritonAdamW`` is a ``torch.optim.Optimizer`` with ``torch.optim.AdamW``'s arguments and state (``step``,
``exp_avg``, ``exp_avg_sq``, the moments in the parameter's dtype), so a state dict saved by one loads into the
other, and learning-rate schedulers, ``zero_grad`` and step hooks work as with any optimizer. Sharded parameters
(FSDP2's ``DTensor``s) are stepped shard by shard: the update is elementwise, so each rank's kernel on its local
shard is the whole update. What it does not have is refused by name: ``amsgrad``, ``maximize``, sparse gradients,
complex or non-contiguous parameters, and partial (not yet reduced) gradients.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import ops, runtime
from .triton_utils import cast_to

# --------------------------------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------------------------------


@triton.jit
def _adamw_kernel(
    P, G, M, V, n,
    lr_weight_decay, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, bias_correction2_sqrt,
    BLOCK: tl.constexpr,
):
    # Each tensor as a flat array: BLOCK values per program. int64 offsets: an LM head has 525M values at the 8B shape.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    p = tl.load(P + offs, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=ok, other=0.0).to(tl.float32)
    m = tl.load(M + offs, mask=ok, other=0.0).to(tl.float32)
    v = tl.load(V + offs, mask=ok, other=0.0).to(tl.float32)
    # 1 − β comes from the host, computed in float64: 1 − β2 taken here from β2 = 0.999 rounded to float32 would be
    # 0.00099998713, 1.3e-5 off, and every second moment and update with it.
    p = p - lr_weight_decay * p
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * g * g
    # The update uses the float32 moments just computed, not their stored (rounded) values: one rounding per tensor.
    p = p - step_size * m / (tl.sqrt(v) / bias_correction2_sqrt + eps)
    tl.store(P + offs, cast_to(p, P.dtype.element_ty), mask=ok)
    tl.store(M + offs, cast_to(m, M.dtype.element_ty), mask=ok)
    tl.store(V + offs, cast_to(v, V.dtype.element_ty), mask=ok)


# Measured on an H200 (assets/notes/adamw.md): 1,024 values per program with 4 warps, and 2,048 with 8, both within
# 4% of the copy bandwidth over the 291 tensors of the 8B shape; 8,192 with 16 warps was 20% slower.
_BLOCK, _WARPS = 1024, 4
# The interpreter pays Python per program and runs each with NumPy: few, large programs.
_INTERPRETER_BLOCK = 1 << 16


def block_for(n: int) -> tuple[int, int]:
    """``(values per program, warps)`` of the kernel for a tensor of ``n`` values on this machine."""
    if runtime.INTERPRET:
        return min(triton.next_power_of_2(max(n, 1)), _INTERPRETER_BLOCK), 4
    return _BLOCK, _WARPS


# --------------------------------------------------------------------------------------------------------------------
# Host side: one tensor's step, as an operator
# --------------------------------------------------------------------------------------------------------------------


def _check_tensors(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
    for name, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a real floating-point tensor, got dtype {t.dtype}")
        if t.shape != param.shape:
            raise ValueError(f"{name} must have the parameter's shape {tuple(param.shape)}, got {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous: the kernel reads every tensor as one flat array")
        if t.device != param.device:
            raise ValueError(f"{name} is on {t.device}, the parameter on {param.device}")
    if not runtime.INTERPRET and param.device.type != "cuda":
        raise ValueError(f"in gpu mode the parameters must be CUDA tensors, got one on {param.device}")


def adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: float) -> None:
    """One AdamW step of one tensor, in place: ``param``, ``exp_avg`` and ``exp_avg_sq`` are overwritten.

    ``step`` is the step's number counting from 1, for the bias corrections 1 − β1ᵗ and 1 − β2ᵗ. All four tensors
    are contiguous, of one shape and on one device; each keeps its dtype.
    """
    _check_tensors(param, grad, exp_avg, exp_avg_sq)
    n = param.numel()
    if n == 0:
        return
    bias_correction1 = 1.0 - beta1 ** step
    bias_correction2 = 1.0 - beta2 ** step
    block, warps = block_for(n)
    _adamw_kernel[(triton.cdiv(n, block),)](
        param, grad, exp_avg, exp_avg_sq, n,
        lr * weight_decay, beta1, 1.0 - beta1, beta2, 1.0 - beta2, eps, lr / bias_correction1,
        math.sqrt(bias_correction2),
        BLOCK=block, num_warps=warps,
    )


adamw_step_op = ops.define(
    "adamw_step_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, float lr, float beta1, "
    "float beta2, float eps, float weight_decay, float step) -> ()",
    adamw_step, lambda *args: None,
)


# --------------------------------------------------------------------------------------------------------------------
# The optimizer
# --------------------------------------------------------------------------------------------------------------------


def _check_hyperparameters(lr, betas, eps, weight_decay) -> None:
    if isinstance(lr, torch.Tensor) or not isinstance(lr, (int, float)) or lr < 0:
        raise ValueError(f"lr must be a non-negative number (not a tensor), got {lr!r}")
    if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    if not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"eps must be a non-negative number, got {eps!r}")
    if not isinstance(weight_decay, (int, float)) or weight_decay < 0:
        raise ValueError(f"weight_decay must be a non-negative number, got {weight_decay!r}")


def _refuse_unsupported(options: dict) -> None:
    if options:
        names = ", ".join(sorted(options))
        raise TypeError(
            f"TritonAdamW does not take {names}: it implements torch.optim.AdamW's default algorithm (no amsgrad, "
            "no maximize) as one Triton kernel per tensor; use torch.optim.AdamW for the others"
        )


def _is_dtensor(t: torch.Tensor) -> bool:
    # By name: torch.distributed may be missing from a PyTorch build, and then there are no DTensors either.
    return type(t).__name__ == "DTensor"


def _local(t: torch.Tensor) -> torch.Tensor:
    """What the kernel steps: a DTensor's local shard (a view of its memory, so the update lands in the DTensor),
    else the tensor itself."""
    return t.to_local() if _is_dtensor(t) else t


def _check_parameter(p: torch.Tensor) -> None:
    if _is_dtensor(p):
        if not _is_dtensor(p.grad) or p.grad.placements != p.placements:
            raise TypeError(f"a DTensor parameter placed {p.placements} needs a gradient placed the same way, got "
                            f"{getattr(p.grad, 'placements', type(p.grad).__name__)}")
        if any(placement.is_partial() for placement in p.placements):
            raise TypeError("TritonAdamW steps reduced gradients, not partial sums: reduce them first")
    if p.grad.is_sparse:
        raise TypeError("TritonAdamW does not take sparse gradients")
    if torch.is_complex(p):
        raise TypeError("TritonAdamW does not take complex parameters")


class TritonAdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` (decoupled weight decay, no amsgrad) with its step as one Triton kernel per parameter.

    Same arguments, defaults, parameter groups and state as ``torch.optim.AdamW(params, lr, betas, eps,
    weight_decay)``; the moments are kept in each parameter's dtype, as PyTorch keeps them. Arithmetic is float32.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, **unsupported):
        _refuse_unsupported(unsupported)
        _check_hyperparameters(lr, betas, eps, weight_decay)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step of every parameter that has a gradient; returns ``closure()``'s loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            _check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                _check_parameter(p)
                state = self.state[p]
                if not state:
                    # As torch.optim.AdamW keeps it (not capturable, not fused): the step count as a CPU float32
                    # tensor, so reading it never waits for the GPU; the moments in the parameter's dtype.
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                elif state["step"].device.type != "cpu":
                    # A state dict saved by torch's fused AdamW keeps the count on the GPU: read there, every step
                    # would wait for the GPU.
                    state["step"] = state["step"].to("cpu", torch.float32)
                state["step"] += 1
                ops.call(adamw_step_op, _local(p), _local(p.grad), _local(state["exp_avg"]),
                         _local(state["exp_avg_sq"]), float(group["lr"]), float(beta1), float(beta2),
                         float(group["eps"]), float(group["weight_decay"]), float(state["step"]))
        return loss
