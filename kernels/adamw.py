"""AdamW in Triton: the optimizer step as one elementwise kernel per parameter tensor, and ``TritonAdamW``.

The optimizer step of a full fine-tuning is pure memory traffic. For every parameter, AdamW reads
the parameter, its gradient and its two moments, and writes the parameter and the moments back:

    p ← p − lr·wd·p                                   (decoupled weight decay)
    m ← β1·m + (1 − β1)·g                              (first moment)
    v ← β2·v + (1 − β2)·g²                             (second moment)
    p ← p − (lr / (1 − β1ᵗ)) · m / (√v / √(1 − β2ᵗ) + ε)

Seven tensors of the parameters' size move per step, 14 bytes per parameter in bf16: 112 GB at the
Llama-3.1-8B shape (its time at the copy bandwidth: assets/notes/adamw.md). ``torch.optim.AdamW``'s
default (``foreach``) runs that as about ten passes over the parameters; ``fused=True`` runs one
kernel. Here too one kernel reads each value once, does the arithmetic in float32 registers (the
order above, which is PyTorch's fused kernel's; the scalars that depend only on the hyperparameters,
such as 1 − β2, are computed on the host in float64), and stores the results in the tensors' own
dtypes. ``assets/notes/adamw.md`` has the measurements.

``TritonAdamW`` is a ``torch.optim.Optimizer`` with ``torch.optim.AdamW``'s arguments and state
(``step``, ``exp_avg``, ``exp_avg_sq``, the moments in the parameter's dtype), so a state dict saved
by one loads into the other, and learning-rate schedulers, ``zero_grad`` and step hooks work as with
any optimizer. Sharded parameters (FSDP2's ``DTensor``s) are stepped shard by shard: the update is
elementwise, so each rank's kernel on its local shard is the whole update. ``maximize`` is
implemented (the gradient's sign flipped as it is loaded). What it does not have is refused by name,
however it is set (the constructor, a group edited later, ``add_param_group``, ``load_state_dict``):
``amsgrad``, ``capturable``, ``differentiable``, ``decoupled_weight_decay=False`` (Adam's L2
penalty), sparse gradients, complex, float64 or non-contiguous parameters, and partial (not yet
reduced) gradients. ``foreach`` and ``fused`` choose among ``torch.optim.AdamW``'s implementations
of one and the same update; any value is kept in the group (a state dict goes both ways) and the
update is this kernel's.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import ops, runtime
from .triton_utils import cast_to

# --------------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------------


@triton.jit
def _adamw_kernel(
    P, G, M, V, n,
    lr_weight_decay, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, bias_correction2_sqrt,
    BLOCK: tl.constexpr, MAXIMIZE: tl.constexpr,
):
    # Each tensor as a flat array: BLOCK values per program. int64 offsets: an LM head has 525M
    # values at the 8B shape.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    p = tl.load(P + offs, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=ok, other=0.0).to(tl.float32)
    if MAXIMIZE:
        # Ascend: every use of the gradient below sees −g, as torch.optim.AdamW(maximize=True)
        # negates it first.
        g = -g
    m = tl.load(M + offs, mask=ok, other=0.0).to(tl.float32)
    v = tl.load(V + offs, mask=ok, other=0.0).to(tl.float32)
    # 1 − β comes from the host, computed in float64: 1 − β2 taken here from β2 = 0.999 rounded to
    # float32 would be 0.00099998713, 1.3e-5 off, and every second moment and update with it.
    p = p - lr_weight_decay * p
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * g * g
    # The update uses the float32 moments just computed, not their stored (rounded) values: one
    # rounding per tensor.
    p = p - step_size * m / (tl.sqrt(v) / bias_correction2_sqrt + eps)
    tl.store(P + offs, cast_to(p, P.dtype.element_ty), mask=ok)
    tl.store(M + offs, cast_to(m, M.dtype.element_ty), mask=ok)
    tl.store(V + offs, cast_to(v, V.dtype.element_ty), mask=ok)


# 1,024 values per program with 4 warps: the sweep over the 291 tensors of the 8B shape that chose
# it is in assets/notes/adamw.md.
_BLOCK, _WARPS = 1024, 4
# The interpreter pays Python per program and runs each with NumPy: few, large programs.
_INTERPRETER_BLOCK = 1 << 16


def block_for(n: int) -> tuple[int, int]:
    """The kernel's launch configuration for a tensor of ``n`` values on this machine.

    Args:
        n: the tensor's number of values.

    Returns:
        ``(values per program, warps)``: a fixed block on a GPU; in the interpreter, one power of
        two that covers ``n`` up to a cap, so that few programs run.
    """
    if runtime.INTERPRET:
        return min(triton.next_power_of_2(max(n, 1)), _INTERPRETER_BLOCK), 4
    return _BLOCK, _WARPS


# --------------------------------------------------------------------------------------------------
# Host side: one tensor's step, as an operator
# --------------------------------------------------------------------------------------------------


def _check_tensors(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                   exp_avg_sq: torch.Tensor) -> None:
    for name, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        ops.check_kernel_dtype(name, t, "cast the parameters to float32, or use torch.optim.AdamW")
        if t.shape != param.shape:
            raise ValueError(f"{name} must have the parameter's shape {tuple(param.shape)}, got {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous: the kernel reads every tensor as one flat array")
        if t.device != param.device:
            raise ValueError(f"{name} is on {t.device}, the parameter on {param.device}")
    if not runtime.INTERPRET and param.device.type != "cuda":
        raise ValueError(f"in gpu mode the parameters must be CUDA tensors, got one on {param.device}")


def adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: float,
               maximize: bool = False) -> None:
    """One AdamW step of one tensor, in place: ``param``, ``exp_avg`` and ``exp_avg_sq`` are overwritten.

    The implementation of the ``kernels::adamw_step_`` operator (``adamw_step_op``), which chapter 09
    lists among the package's operators. All four tensors are contiguous, of one shape and on one device;
    each keeps its dtype. An empty tensor launches nothing.

    Args:
        param: the parameter, updated in place.
        grad: its gradient.
        exp_avg, exp_avg_sq: the first and second moments, updated in place.
        lr, beta1, beta2, eps, weight_decay: AdamW's hyperparameters, as ``torch.optim.AdamW``
            takes them (``weight_decay`` is decoupled and multiplied by ``lr``).
        step: the step's number counting from 1, for the bias corrections 1 − β1ᵗ and 1 − β2ᵗ.
        maximize: step along +grad.

    Raises:
        TypeError: a tensor's dtype is not float32, bfloat16 or float16.
        ValueError: the tensors differ in shape or device, one is not contiguous, or (in gpu mode)
            they are not CUDA tensors.
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
        BLOCK=block, MAXIMIZE=bool(maximize), num_warps=warps,
    )


adamw_step_op = ops.define(
    "adamw_step_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, float lr, float beta1, "
    "float beta2, float eps, float weight_decay, float step, bool maximize=False) -> ()",
    adamw_step, lambda *args: None,
)


# --------------------------------------------------------------------------------------------------
# The optimizer
# --------------------------------------------------------------------------------------------------


def check_hyperparameters(lr, betas, eps, weight_decay, where: str = "") -> None:
    """Raise a ValueError naming the first of AdamW's hyperparameters that is out of range.

    Args:
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` takes them.
        where: the caller's name, put before the message when given.
    """
    prefix = f"{where}: " if where else ""
    # `not x >= 0` rather than `x < 0`: NaN compares false both ways, and torch.optim.AdamW refuses
    # it the same way.
    if isinstance(lr, (torch.Tensor, bool)) or not isinstance(lr, (int, float)) or not lr >= 0:
        raise ValueError(f"{prefix}lr must be a non-negative number (not a tensor), got {lr!r}")
    if (not isinstance(betas, (tuple, list)) or len(betas) != 2
            or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"{prefix}betas must be two numbers in [0, 1), got {betas!r}")
    if not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"{prefix}eps must be a non-negative number, got {eps!r}")
    if not isinstance(weight_decay, (int, float)) or not weight_decay >= 0:
        raise ValueError(f"{prefix}weight_decay must be a non-negative number, got {weight_decay!r}")


def advance_state(p: torch.Tensor, state: dict) -> float:
    """Count one more step in ``p``'s AdamW state, making the state first if it is empty.

    The state is ``torch.optim.AdamW``'s (not capturable, not fused): the step count as a CPU float32
    tensor, so that reading it never waits for the GPU, and the moments in the parameter's dtype.

    Args:
        p: the parameter.
        state: its entry of the optimizer's ``state`` (filled in here when empty).

    Returns:
        The step's number, counting from 1 (for the bias corrections).
    """
    if not state:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    elif not isinstance(state["step"], torch.Tensor) or state["step"].device.type != "cpu":
        # A state dict saved by torch's fused AdamW keeps the count on the GPU: read there, every
        # step would wait for the GPU. (An old one may hold a plain number.)
        state["step"] = torch.as_tensor(state["step"]).to("cpu", torch.float32)
    state["step"] += 1
    return float(state["step"])


# torch.optim.AdamW's flags beyond the hyperparameters, with their defaults (torch 2.11 to 2.13).
# Every group of a TritonAdamW carries them all, so that its state dict loads into torch.optim.AdamW
# and back.
FLAG_DEFAULTS = dict(amsgrad=False, maximize=False, foreach=None, capturable=False,
                     differentiable=False, fused=None,
                     decoupled_weight_decay=True)
# The values this optimizer computes exactly. maximize is implemented; foreach and fused choose
# among torch's implementations of the same update, so any value gives the update this kernel
# computes. Any other value of a flag is refused by name, wherever it came from.
_ACCEPTED = dict(amsgrad=(False,), maximize=(False, True), capturable=(False,), differentiable=(False,),
                 decoupled_weight_decay=(True,))
_WHY = dict(
    amsgrad="amsgrad keeps the running maximum of the second moment, which this kernel does not",
    capturable="capturable steps keep the step count on the GPU for CUDA graphs; here it is a host number baked into "
               "each launch, so a replayed graph would repeat one step's bias corrections",
    differentiable="differentiable steps are recorded by autograd; this step is a Triton kernel under no_grad",
    decoupled_weight_decay="decoupled_weight_decay=False is Adam's L2 penalty added to the gradient; this is AdamW's "
                           "decoupled decay",
)


def check_flags(group: dict, where: str = "TritonAdamW") -> None:
    """Refuse the first of ``torch.optim.AdamW``'s flags whose value TritonAdamW does not compute.

    Host-side dict reads only: ``step()`` runs it on every group, every step, since a group can be
    edited at any time. A flag missing from ``group`` counts as its default.

    Args:
        group: a parameter group, or the constructor's arguments.
        where: the caller's name, put before the message.

    Raises:
        TypeError: naming the flag, why it is not computed, and ``torch.optim.AdamW`` instead.
    """
    for name, accepted in _ACCEPTED.items():
        value = group.get(name, FLAG_DEFAULTS[name])
        if bool(value) not in accepted:  # read as torch.optim.AdamW reads them: by truth value
            raise TypeError(
                f"{where}: {name}={value!r} is not supported ({_WHY.get(name, 'not implemented')}); TritonAdamW "
                f"computes {name} in {list(accepted)}. Use torch.optim.AdamW for it"
            )


def _refuse_unknown(options: dict) -> None:
    if options:
        names = ", ".join(sorted(options))
        raise TypeError(
            f"TritonAdamW does not take {names}: it takes torch.optim.AdamW's arguments (params, lr, betas, eps, "
            f"weight_decay, {', '.join(FLAG_DEFAULTS)})"
        )


def _is_dtensor(t: torch.Tensor) -> bool:
    # By name: torch.distributed may be missing from a PyTorch build, and then there are no DTensors
    # either.
    return type(t).__name__ == "DTensor"


def _local(t: torch.Tensor) -> torch.Tensor:
    """What the kernel steps: a DTensor's local shard (a view of its memory, so the update lands in
    the DTensor), else the tensor itself."""
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
    _check_parameter_dtype(p)
    if not _local(p).is_contiguous():
        raise ValueError(
            f"TritonAdamW steps contiguous parameters (the kernel reads one flat array), got one of shape "
            f"{tuple(p.shape)} with strides {_local(p).stride()}: make it contiguous, or use torch.optim.AdamW"
        )


def _check_parameter_dtype(p: torch.Tensor) -> None:
    if torch.is_complex(p):
        raise TypeError("TritonAdamW does not take complex parameters: use torch.optim.AdamW for them")
    if p.dtype not in ops.KERNEL_DTYPES:
        raise TypeError(
            f"TritonAdamW steps float32, bfloat16 and float16 parameters, got a parameter of dtype {p.dtype}: cast the "
            "model to float32, or use torch.optim.AdamW"
        )


class TritonAdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` with its step as one Triton kernel per parameter tensor.

    Same arguments, defaults, parameter groups and state as ``torch.optim.AdamW``; the moments are
    kept in each parameter's dtype, as PyTorch keeps them. Arithmetic is float32. ``maximize=True``
    ascends, as PyTorch's does. ``amsgrad``, ``capturable``, ``differentiable`` and
    ``decoupled_weight_decay=False`` raise a TypeError whether given here, set in a group later, or
    loaded with a state dict (checked again at every ``step()``); ``foreach`` and ``fused`` are
    accepted and kept, and change nothing. Chapter 11 introduces it.

    Args:
        params: parameters or parameter groups, as for any ``torch.optim.Optimizer``.
        lr: learning rate.
        betas: the decay rates of the first and second moments.
        eps: added to the second moment's square root.
        weight_decay: decoupled weight decay (multiplied by ``lr``).
        amsgrad, capturable, differentiable: must stay False (refused by name otherwise).
        maximize: ascend instead of descend.
        foreach, fused: accepted for ``torch.optim.AdamW``'s signature; they change nothing.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, **unknown):
        _refuse_unknown(unknown)
        flags = dict(amsgrad=amsgrad, maximize=maximize, foreach=foreach, capturable=capturable,
                     differentiable=differentiable, fused=fused, decoupled_weight_decay=True)
        check_flags(flags)
        check_hyperparameters(lr, betas, eps, weight_decay)
        super().__init__(params,
                         dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, **flags))

    def add_param_group(self, param_group: dict) -> None:
        """``torch.optim.Optimizer.add_param_group``, then the group's flags, hyperparameters and
        dtypes checked.

        Args:
            param_group: a dict with ``params`` and any of the optimizer's options; the others are
                filled in from the defaults.

        Raises:
            TypeError: the group sets a flag this optimizer does not compute, or holds a parameter
                of a dtype the kernel does not take.
            ValueError: a hyperparameter is out of range.
        """
        super().add_param_group(param_group)
        _check_group(self.param_groups[-1])

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of TritonAdamW or ``torch.optim.AdamW``.

        A flag missing from a loaded group (a state dict of an older torch) takes its default.

        Args:
            state_dict: what ``state_dict()`` of either optimizer returned.

        Raises:
            TypeError: a group sets a flag this optimizer does not compute (e.g. from
                ``torch.optim.AdamW(amsgrad=True)``); this optimizer is left as it was.
        """
        for group in state_dict.get("param_groups", ()):
            check_flags(group, "TritonAdamW.load_state_dict")
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for name, default in FLAG_DEFAULTS.items():
                group.setdefault(name, default)  # a state dict of an older torch may lack a flag

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step of every parameter that has a gradient.

        Every group and parameter is checked before any tensor changes, so a refused one leaves the
        model as it was.

        Args:
            closure: optional; recomputes and returns the loss, run with gradients enabled before
                the step.

        Returns:
            ``closure()``'s loss, or None without a closure.

        Raises:
            TypeError: a group sets a flag this optimizer does not compute, or a parameter is
                complex, sparse, of an unsupported dtype, or a DTensor whose gradient is placed
                otherwise or is a partial sum.
            ValueError: a hyperparameter is out of range, or a parameter is not contiguous.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Everything checked before any tensor moves, so a refused group or parameter leaves the
        # model as it was. Groups can be edited at any time (group["maximize"] = True, a scheduler's
        # lr): read on every step.
        for group in self.param_groups:
            check_flags(group, "TritonAdamW.step")
            check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])
            for p in group["params"]:
                if p.grad is not None:
                    _check_parameter(p)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            maximize = bool(group.get("maximize", False))
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                step = advance_state(p, state)
                grad = _local(p.grad)
                # A gradient set by hand may be a strided view: the kernel reads flat arrays, so
                # read a dense copy.
                grad = grad if grad.is_contiguous() else grad.contiguous()
                ops.call(adamw_step_op, _local(p), grad, _local(state["exp_avg"]),
                         _local(state["exp_avg_sq"]), float(group["lr"]), float(beta1), float(beta2),
                         float(group["eps"]), float(group["weight_decay"]), step, maximize)
        return loss


def _check_group(group: dict) -> None:
    check_flags(group, "TritonAdamW.add_param_group")
    check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])
    for p in group["params"]:
        _check_parameter_dtype(p)
