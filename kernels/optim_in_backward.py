"""AdamW inside the backward pass: each parameter stepped as soon as its gradient is final, then freed.

After the backward of a full fine-tuning step, the optimizer reads every parameter, gradient and
moment once more: pure memory traffic, on a GPU that has nothing else to do. Yet a parameter's
gradient is final long before the backward ends: the LM head's is complete after the first node,
the last layer's soon after. ``OptimizerInBackward`` registers a post-accumulate-grad hook on every
parameter (``Tensor.register_post_accumulate_grad_hook``, which fires once per backward, after
every contribution to ``.grad`` has been summed, however many modules share the parameter) and
runs ``kernels.adamw.adamw_step`` there:

* **Overlap.** On a GPU the update runs on a side CUDA stream: the memory-bound step of one layer
  runs under the compute-bound GEMMs of the layers still in the backward. The side stream waits for
  the gradient's producer (an event recorded on the backward's stream), the gradient's memory is
  kept from reuse until the side stream has read it (``record_stream``), and at the end of the
  backward a callback makes the caller's stream wait for the side stream, so the next forward, a
  state dict or any read of the parameters sees the updated values. On the CPU (Triton's
  interpreter) there is no stream: the update runs inline, with the same results.
* **Memory.** The gradient is dropped right after its update (``p.grad = None``): the set of
  gradients that the usual step keeps until ``optimizer.step()`` never exists at once.

The arithmetic and the state are ``TritonAdamW``'s (``step``, ``exp_avg``, ``exp_avg_sq`` per
parameter, the parameter groups carrying ``torch.optim.AdamW``'s flags), so a state dict saved by
any of the three loads into the others.

A step in a loop:

    opt = OptimizerInBackward(model.parameters(), lr=1e-4)
    for micro_batch in step_batches[:-1]:
        with opt.accumulating():          # gradients accumulate in .grad, nothing is updated
            model(**micro_batch).loss.backward()
    model(**step_batches[-1]).loss.backward()   # the final backward updates and frees
    opt.step()                            # no arithmetic: closes the step and checks it
    scheduler.step()                      # any torch.optim.lr_scheduler works on it

What the design cannot do is refused by name rather than done wrong (``assets/notes/
optim_in_backward.md`` says why): global-norm gradient clipping (``clip_grad_norm_`` raises; a
per-parameter bound, ``max_grad_norm_per_param``, is built in), a second updating backward in one
step (``retain_graph`` reruns, forgotten ``accumulating()``), ``create_graph`` backward, parameters
that got no gradient in a step, sparse gradients, complex, float64, non-contiguous and sharded
(``DTensor``) parameters. Chapter 17 builds it.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch

from kernels import ops
from kernels.adamw import FLAG_DEFAULTS, adamw_step_op, advance_state, check_flags, check_hyperparameters

_NAME = "OptimizerInBackward"
# The clip's denominator is norm + this, as torch.nn.utils.clip_grad_norm_ computes it.
_CLIP_EPS = 1e-6


def _check_parameter(p: torch.Tensor) -> None:
    """The parameters the in-backward step can take, checked once, when they join."""
    if not isinstance(p, torch.Tensor) or not p.is_leaf:
        raise TypeError(f"{_NAME} steps leaf tensors (parameters), got {type(p).__name__}"
                        + ("" if not isinstance(p, torch.Tensor) else " that is not a leaf"))
    if type(p).__name__ == "DTensor" or type(getattr(p, "data", None)).__name__ == "DTensor":
        raise TypeError(f"{_NAME} does not step sharded (DTensor) parameters: under FSDP2 the gradient is "
                        "reduce-scattered after the hook would fire; use kernels.adamw.TritonAdamW there")
    if torch.is_complex(p):
        raise TypeError(f"{_NAME} does not take complex parameters: use torch.optim.AdamW for them")
    if p.dtype not in ops.KERNEL_DTYPES:
        raise TypeError(f"{_NAME} steps float32, bfloat16 and float16 parameters, got one of dtype "
                        f"{p.dtype}: cast the model to float32, or use torch.optim.AdamW")
    if not p.is_contiguous():
        raise ValueError(f"{_NAME} steps contiguous parameters (the kernel reads one flat array), got one "
                         f"of shape {tuple(p.shape)} with strides {p.stride()}: make it contiguous, or use "
                         "torch.optim.AdamW")
    if not p.requires_grad:
        raise ValueError(f"{_NAME} got a parameter of shape {tuple(p.shape)} that does not require grad: "
                         "its hook would never fire; leave frozen parameters out")


def _check_max_norm(value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
        raise ValueError(f"max_grad_norm_per_param must be a positive finite number or None, got {value!r}")


_GLOBAL_CLIP = (
    "global-norm gradient clipping needs every gradient before any update, and here each parameter is "
    "updated (and its gradient freed) as soon as its own gradient is final. Bound each parameter's "
    "gradient instead with OptimizerInBackward(..., max_grad_norm_per_param=C), or keep the global "
    "clip with kernels.adamw.TritonAdamW after the backward"
)


def _refuse_unknown(options: dict) -> None:
    if not options:
        return
    if any("clip" in name or name == "max_grad_norm" for name in options):
        raise TypeError(f"{_NAME}: {_GLOBAL_CLIP}")
    names = ", ".join(sorted(options))
    raise TypeError(f"{_NAME} does not take {names}: it takes params, lr, betas, eps, weight_decay and, "
                    "by keyword, maximize, side_stream and max_grad_norm_per_param")


class OptimizerInBackward(torch.optim.Optimizer):
    """AdamW applied inside the backward pass, one parameter at a time, on a side CUDA stream.

    Its parameter groups, state and arithmetic are ``kernels.adamw.TritonAdamW``'s; what differs is
    when the update runs (see the module docstring). The hooks are registered on construction;
    ``remove()`` (or leaving a ``with`` block over the optimizer) detaches them. Chapter 17
    introduces it.

    The step's other calls, as a ``torch.optim.Optimizer`` loop makes them:

    * ``step()`` does no arithmetic (the updates ran in the backward; only a parameter that the
      step's final backward did not reach, its gradient accumulated earlier, is updated there). It
      closes the step: it raises
      if no backward updated the parameters since the last ``step()``, if some parameter got no
      gradient, or if it is called inside ``accumulating()``. Calling it once per step is required:
      a second updating backward before it raises (a forgotten ``accumulating()`` would otherwise
      update on a partial gradient).
    * ``zero_grad()`` is ``torch.optim.Optimizer``'s: after an update there is no gradient left to
      zero; inside an accumulation it drops the gradients accumulated so far, as it would anywhere.
    * ``torch.optim.lr_scheduler`` schedulers work: they set ``param_groups[i]["lr"]``, which the
      next backward's updates read.
    * ``clip_grad_norm_`` raises, naming the alternatives (``max_grad_norm_per_param``, or
      ``TritonAdamW``).

    Args:
        params: parameters or parameter groups, as for ``torch.optim.AdamW``.
        lr: learning rate.
        betas: the decay rates of the first and second moments.
        eps: added to the second moment's square root.
        weight_decay: decoupled weight decay (multiplied by ``lr``).
        maximize: ascend instead of descend.
        side_stream: on a GPU, update on a side CUDA stream (True) or inline on the backward's stream.
        max_grad_norm_per_param: if set, each parameter's gradient is scaled to a norm of at most
            this value before its update (``clip_grad_norm_`` of that parameter alone).
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, maximize: bool = False,
                 side_stream: bool = True, max_grad_norm_per_param: float | None = None, **unknown):
        _refuse_unknown(unknown)
        check_hyperparameters(lr, betas, eps, weight_decay, _NAME)
        _check_max_norm(max_grad_norm_per_param)
        if not isinstance(side_stream, bool):
            raise TypeError(f"side_stream must be True or False, got {side_stream!r}")
        self.side_stream = side_stream
        self.max_grad_norm_per_param = max_grad_norm_per_param
        self._handles: list = []
        self._accumulating = 0
        self._updated: set[int] = set()  # ids of the parameters updated since the last step()
        # Groups whose flags and hyperparameters were checked since the last step(): once per group
        # and step, not in every parameter's hook (a scheduler edits them between steps).
        self._checked_groups: set[int] = set()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._joined_task = None  # the backward whose end will join the streams (its graph task id)
        # Parameters that got a gradient inside accumulating() this step: the final backward may not
        # reach them, and then their gradient is final only once it has ended (step() updates them).
        self._pending: dict[int, tuple[torch.Tensor, int]] = {}
        flags = dict(FLAG_DEFAULTS, maximize=bool(maximize))
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, **flags)
        super().__init__(params, defaults)

    # ----------------------------------------------------------------------------------------------
    # Parameters and hooks
    # ----------------------------------------------------------------------------------------------

    def add_param_group(self, param_group: dict) -> None:
        """``torch.optim.Optimizer.add_param_group``, its parameters and settings checked, then a hook
        registered on each of its parameters.

        Args:
            param_group: a dict with ``params`` and any of the hyperparameters.

        Raises:
            TypeError: a parameter is not a leaf tensor, is a DTensor, complex or of a dtype the
                kernel does not take, or the group sets a flag the kernel does not compute.
            ValueError: a parameter is not contiguous or does not require grad, or a hyperparameter
                is out of range.
        """
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for p in params:
            _check_parameter(p)
        super().add_param_group({**param_group, "params": params})
        group = self.param_groups[-1]
        check_flags(group, f"{_NAME}.add_param_group")
        check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"], _NAME)
        # The group by its index, read at each update: load_state_dict replaces the group dicts, and
        # a scheduler edits the current ones.
        index = len(self.param_groups) - 1
        for p in group["params"]:
            hook = functools.partial(_on_gradient, self, index)
            self._handles.append(p.register_post_accumulate_grad_hook(hook))

    def remove(self) -> None:
        """Detach every hook: later backwards leave the gradients in ``.grad`` and update nothing."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> OptimizerInBackward:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    @contextlib.contextmanager
    def accumulating(self):
        """Backwards inside this block accumulate gradients in ``.grad`` and update nothing: the
        micro-batches of a step but its last, whose backward (outside the block) updates with the
        sum."""
        self._accumulating += 1
        try:
            yield self
        finally:
            self._accumulating -= 1

    # ----------------------------------------------------------------------------------------------
    # The update, one parameter
    # ----------------------------------------------------------------------------------------------

    def _side(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _update(self, p: torch.Tensor, index: int) -> None:
        """Step ``p`` (of parameter group ``index``) with its final gradient, then free the gradient."""
        group = self.param_groups[index]
        self._pending.pop(id(p), None)
        grad = p.grad
        if grad.is_sparse:
            raise TypeError(f"{_NAME} does not take sparse gradients: use torch.optim.SparseAdam or a dense "
                            "embedding")
        if grad.requires_grad:
            raise RuntimeError(f"{_NAME} cannot update inside a create_graph backward (double backward): "
                               "the update would be recorded in the graph. Use kernels.adamw.TritonAdamW "
                               "after it")
        if id(p) in self._updated:
            raise RuntimeError(
                f"{_NAME}: a second backward would update a parameter already updated in this step. Run "
                "the backwards of all micro-batches but the last inside `with opt.accumulating():`, call "
                "opt.step() after each step's final backward, and do not backward twice through a graph "
                "(retain_graph)"
            )
        if index not in self._checked_groups:
            check_flags(group, f"{_NAME} (a parameter group)")
            check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"], _NAME)
            self._checked_groups.add(index)
        grad = grad if grad.is_contiguous() else grad.contiguous()
        state = self.state[p]
        # A new state's moments are made on the backward's stream, before the side stream's wait:
        # zeroed before the update reads them.
        advance_state(p, state)
        self._updated.add(id(p))
        in_backward = torch._C._current_graph_task_id() != -1
        if in_backward:
            self._queue_join()
        if p.device.type == "cuda" and self.side_stream:
            side = self._side(p.device)
            # After the gradient's producer and the moments' zeroing.
            side.wait_stream(torch.cuda.current_stream(p.device))
            with torch.cuda.stream(side):
                self._launch(p, grad, state, group)
            # The gradient was made on the backward's stream: keep its memory from reuse there until
            # the side stream has read it.
            grad.record_stream(side)
        else:
            self._launch(p, grad, state, group)
        p.grad = None
        if not in_backward:
            self.synchronize_streams()

    def _launch(self, p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
        if self.max_grad_norm_per_param is not None:
            norm = torch.linalg.vector_norm(grad, dtype=torch.float32)
            # No host synchronisation: the factor stays a device scalar, clamped to at most 1.
            grad.mul_((self.max_grad_norm_per_param / (norm + _CLIP_EPS)).clamp(max=1.0))
        beta1, beta2 = group["betas"]
        ops.call(adamw_step_op, p.detach(), grad, state["exp_avg"], state["exp_avg_sq"], float(group["lr"]),
                 float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]),
                 float(state["step"]), bool(group.get("maximize", False)))

    def _queue_join(self) -> None:
        """Once per updating backward: its end (``_join``) runs after every hook of it. Keyed by the
        backward's graph task, so that a backward that raised (and never ran its callbacks) leaves
        nothing stale behind."""
        task = torch._C._current_graph_task_id()
        if task != self._joined_task:
            self._joined_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._join)

    def _join(self) -> None:
        """The end of an updating backward: the caller's stream waits for the side streams.
        Autograd runs its final callbacks on the caller's stream."""
        self._joined_task = None
        self.synchronize_streams()

    def synchronize_streams(self) -> None:
        """Make the current stream of each device wait for the updates queued on its side stream
        (no host wait). The end of every updating backward does it, and ``state_dict`` too: call it
        before reading the parameters on another stream than the backward's caller."""
        for device, side in self._streams.items():
            torch.cuda.current_stream(device).wait_stream(side)

    # ----------------------------------------------------------------------------------------------
    # The optimizer's interface
    # ----------------------------------------------------------------------------------------------

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        """Close the step: the updates ran in the backward; check that every parameter got one.

        A parameter whose gradient came only from micro-batches inside ``accumulating()`` (the
        final backward did not reach it) is updated here, its gradient being final now.

        Args:
            closure: optional, as for any optimizer: called (with grad enabled) first, its backward
                doing the updates; its loss is returned.

        Returns:
            ``closure()``'s loss, or None.

        Raises:
            RuntimeError: called inside ``accumulating()``, or some parameter was not updated since
                the last step (no updating backward ran, or a parameter got no gradient).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._accumulating:
            raise RuntimeError(f"{_NAME}.step() inside accumulating(): the step's final backward runs "
                               "outside it, and step() after that")
        if self._updated:
            # The step's final backward ran: gradients accumulated earlier for parameters it did not
            # reach are final too.
            for p, index in list(self._pending.values()):
                if p.grad is not None and id(p) not in self._updated:
                    self._update(p, index)
            self._pending.clear()
        params = self._params()
        missed = [p for p in params if id(p) not in self._updated]
        self._updated.clear()
        self._checked_groups.clear()
        if not missed:
            return loss
        pending = [p for p in missed if p.grad is not None]
        if len(missed) == len(params):
            detail = (" Gradients were accumulated but the final backward ran inside accumulating()."
                      if pending else "")
            raise RuntimeError(f"{_NAME}.step(): no backward updated the parameters since the last step(). "
                               f"The update runs in the backward, outside accumulating().{detail}")
        shapes = ", ".join(str(tuple(p.shape)) for p in missed[:4]) + (" ..." if len(missed) > 4 else "")
        raise RuntimeError(
            f"{_NAME}.step(): {len(missed)} parameter(s) got no gradient in this step (shapes {shapes}), so "
            "were not updated (no weight decay, no moment decay either). Freeze them "
            "(requires_grad_(False)) and leave them out of the optimizer, or use kernels.adamw.TritonAdamW, "
            "which skips them"
        )

    def state_dict(self) -> dict:
        """``torch.optim.Optimizer.state_dict`` after the updates queued on the side streams.

        Returns:
            The state dict, loadable by this optimizer, ``TritonAdamW`` or ``torch.optim.AdamW``.
        """
        self.synchronize_streams()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of this optimizer, ``TritonAdamW`` or ``torch.optim.AdamW``.

        Args:
            state_dict: as ``state_dict()`` returns it.

        Raises:
            TypeError: a group sets a flag the kernel does not compute (e.g. ``amsgrad=True``); this
                optimizer is left as it was.
        """
        for group in state_dict.get("param_groups", ()):
            check_flags(group, f"{_NAME}.load_state_dict")
        self.synchronize_streams()
        super().load_state_dict(state_dict)
        self._checked_groups.clear()
        for group in self.param_groups:
            for name, default in FLAG_DEFAULTS.items():
                group.setdefault(name, default)

    def clip_grad_norm_(self, *args, **kwargs):
        """Refused: the gradients are freed before a global norm could be known.

        Bound each gradient instead with ``max_grad_norm_per_param``, or keep the global clip with
        ``TritonAdamW`` (chapter 17).

        Args:
            args, kwargs: whatever ``torch.nn.utils.clip_grad_norm_`` would take; ignored.

        Raises:
            RuntimeError: always, naming the alternatives.
        """
        raise RuntimeError(f"{_NAME}: {_GLOBAL_CLIP}")


def _on_gradient(optimizer: OptimizerInBackward, index: int, p: torch.Tensor) -> None:
    """The post-accumulate-grad hook of a parameter of group ``index``: ``p.grad`` is complete for
    this backward."""
    if optimizer._accumulating:
        optimizer._pending[id(p)] = (p, index)
        return
    optimizer._update(p, index)


__all__ = ["OptimizerInBackward"]
