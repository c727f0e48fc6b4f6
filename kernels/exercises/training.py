"""The check for the exercise of chapter 08: putting ``TritonRMSNorm`` into a Hugging Face Llama by hand.

``check_manual_patch(fn)`` builds a tiny float32 Llama, keeps an untouched copy of it, calls
``fn(model)`` and then looks at what changed: which norms were replaced and by what, whether each
replacement holds the very weight Parameter of the norm it replaces and its eps, whether the
``state_dict`` kept its keys. Last, it runs one forward and backward pass through both models on the
same batch and compares the loss and every gradient. It prints what is wrong in words (the sentences
are in ``MANUAL_PATCH_DIAGNOSES``) and never raises because the reader's function is wrong or
unfinished. The reader's function runs with the finished surgery out of reach (``patch_llama`` and
``TritonRMSNorm.from_hf``, ``reach.FORBIDDEN["patch_norms_by_hand"]``): calling either is refused by
name.

The chapter asks for two phases, collect every norm, then swap. While the reader's function runs,
every module's children sit in a dict that notices being changed while something is walking it
(``_WatchedChildren``), so a swap made inside the walk is seen and named, even where it happens to
give the right model.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import contextmanager

import torch

from kernels import runtime
from kernels.reference import relative_error
from kernels.rmsnorm import TritonRMSNorm
from kernels.tolerances import RELATIVE_ERROR_TOL
from kernels.training.models import build_model

from .reach import FinishedCodeCalled, Forbid, Tripwire, call_learner, out_of_reach, resolve, run_watched, targets

_OK = "✓ "
_WRONG = "✗ "

MANUAL_PATCH_DIAGNOSES = {
    "stub": "the function is still the stub (it raises NotImplementedError)",
    "raised": "your function raised an exception",
    "copy": ("the norms were replaced in a copy of the model, not in the model passed in: the "
             "model you train is unchanged; replace the modules inside the model itself"),
    "nothing": ("no norm of the model was replaced: a new module bound to a loop variable (module "
                "= ...) or put into a copy never reaches the model; put it into its parent with "
                "setattr(parent, name, new_module)"),
    "missed": "some norms were missed",
    "wrong-type": "a norm was replaced by something other than a kernels.TritonRMSNorm",
    "weight-not-carried": ("the weight was not carried over: the new norm has its own freshly "
                           "initialised weight (all ones) instead of the model's values, so the "
                           "model computes something else"),
    "weight-copied": ("the weight was copied instead of shared: the new norm holds another "
                      "Parameter with the same values, so an optimizer built before the patch "
                      "updates the old Parameter, which the model no longer uses, and the norm "
                      "never learns; give the new norm the same Parameter object (new.weight = "
                      "old.weight)"),
    "weight-rewrapped": ("the weight was wrapped in a new Parameter (nn.Parameter(old.weight)): it "
                         "shares the memory, but the gradient goes to the new Parameter's .grad, "
                         "which an optimizer built before the patch never reads; give the new norm "
                         "the same Parameter object (new.weight = old.weight)"),
    "eps": "eps was not carried over: each norm keeps its own in `variance_epsilon` (the model's "
           "config.rms_norm_eps), and TritonRMSNorm's default differs; pass eps=old.variance_epsilon",
    "keys": "the state_dict keys changed: checkpoints would no longer load into the patched model",
    "gradients": "the loss or the gradients differ from Hugging Face's model",
    "one-phase": ("the norms were swapped while the module tree was still being walked (setattr "
                  "inside the loop over named_modules() or named_children()): work in two phases, "
                  "first collect every (parent, name, norm) into a list, then swap in a second "
                  "loop. Replacing children during the walk changes the structure being iterated: "
                  "here it happened to work, but a replacement that holds the old norm is walked "
                  "into again, and adding or removing a child stops the walk with an error"),
    "dotted-name": ("a new module was set under a dotted name (setattr(model, "
                    "'model.layers.0.input_layernorm', new) adds an attribute with dots in its "
                    "name; it does not reach the norm): split the name and set it on the parent, "
                    "parent = model.get_submodule(path); setattr(parent, attribute, new)"),
    "weight-tensor": ("the weight must be the Parameter itself: new.weight = old.weight (a plain "
                      "tensor such as old.weight.data or old.weight.detach() cannot be a module's "
                      "parameter)"),
    "eps-attribute": ("a LlamaRMSNorm keeps its eps in the attribute variance_epsilon: "
                      "eps=old.variance_epsilon"),
}

EXERCISE = "patch_norms_by_hand"
# A classmethod is looked up anew on every access, so it cannot be a row of reach.FORBIDDEN (whose
# targets are compared by identity): the check wires it itself, beside the row's targets.
FROM_HF = Forbid("kernels.rmsnorm:TritonRMSNorm.from_hf",
                 "the package's finished replacement of one norm, which carries the weight and eps for you")


@contextmanager
def _finished_out_of_reach(fn):
    """The exercise's row of ``reach.FORBIDDEN`` out of reach of ``fn``, and
    ``TritonRMSNorm.from_hf`` too."""
    with out_of_reach(EXERCISE, fn) as tripwire:
        stored = vars(TritonRMSNorm)["from_hf"]
        TritonRMSNorm.from_hf = tripwire.wire(FROM_HF, TritonRMSNorm.from_hf)
        try:
            yield tripwire
        finally:
            TritonRMSNorm.from_hf = stored


def _call(fn, model):
    """``fn(model)`` with the finished surgery out of reach; raises ``FinishedCodeCalled`` when
    ``fn`` is one or called one (even if it caught the error)."""
    if fn is TritonRMSNorm.from_hf or getattr(fn, "__func__",
                                              None) is vars(TritonRMSNorm)["from_hf"].__func__:
        raise FinishedCodeCalled(Tripwire(EXERCISE,
                                          [(FROM_HF.target.replace(":", "."), FROM_HF.what)]).message)
    if any(fn is resolve(forbid.target)[2] for forbid in targets(EXERCISE)):
        return call_learner(EXERCISE, fn, model)  # refused before the call, by name
    with _finished_out_of_reach(fn) as tripwire:
        return run_watched(tripwire, fn, model)


# What each norm of a Llama decoder does, to say which ones were missed.
_NORM_ROLES = {
    "input_layernorm": "the attention norms (input_layernorm, before each attention)",
    "post_attention_layernorm": "the MLP norms (post_attention_layernorm, before each MLP)",
    "norm": "the final norm (model.norm, before the LM head)",
}


class _WatchedChildren(dict):
    """A module's children (its ``_modules``) that record a change made while something walks them:
    every walk that ``named_modules``, ``named_children``, ``modules`` or ``children`` makes goes
    through ``items``/``values``/ ``keys``/``__iter__`` here, and ``setattr(parent, name, new)``
    goes through ``__setitem__``."""

    def __init__(self, children: dict, changed: list):
        super().__init__(children)
        self.walks = 0
        self.changed = changed

    def _walk(self, iterator):
        self.walks += 1
        try:
            yield from iterator
        finally:  # also when the walk is abandoned (a break): the generator is closed then
            self.walks -= 1

    def items(self):
        return self._walk(super().items())

    def values(self):
        return self._walk(super().values())

    def keys(self):
        return self._walk(super().keys())

    def __iter__(self):
        return self._walk(super().__iter__())

    def __setitem__(self, key, value):
        if getattr(self, "walks", 0):
            self.changed.append(key)
        super().__setitem__(key, value)


def _watch(model: torch.nn.Module) -> list:
    """Give every module of ``model`` watched children; returns the list the changes made during a
    walk go to."""
    changed: list = []
    for module in list(model.modules()):
        module.__dict__["_modules"] = _WatchedChildren(module.__dict__["_modules"], changed)
    return changed


def _unwatch(model: torch.nn.Module) -> None:
    """Plain dicts again, wherever watched ones are (the modules the reader put in have plain ones
    already)."""
    stack = [model]
    while stack:
        module = stack.pop()
        children = module.__dict__.get("_modules", {})
        if isinstance(children, _WatchedChildren):
            children = dict(dict.items(children))
            module.__dict__["_modules"] = children
        stack.extend(child for child in children.values() if child is not None)


def _raised(exc: Exception) -> str:
    """What the reader's exception says, with the usual cause where there is one."""
    text = f"{MANUAL_PATCH_DIAGNOSES['raised']}: {type(exc).__name__}: {exc}"
    if isinstance(exc, TypeError) and "cannot assign" in str(exc) and "parameter" in str(exc):
        return f"{text}; {MANUAL_PATCH_DIAGNOSES['weight-tensor']}"
    if isinstance(exc, AttributeError) and "eps" in str(exc) and "variance_epsilon" not in str(exc):
        return f"{text}; {MANUAL_PATCH_DIAGNOSES['eps-attribute']}"
    return text


def _report(problem: str | None, success: str, verbose: bool) -> bool:
    if verbose:
        print(_WRONG + problem if problem else _OK + success)
    return problem is None


def _norms(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {name: module for name,
            module in model.named_modules() if type(module).__name__ == "LlamaRMSNorm"}


def _missed(names: list[str]) -> str:
    roles = sorted({_NORM_ROLES.get(name.rsplit(".", 1)[-1], name) for name in names})
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return f"{MANUAL_PATCH_DIAGNOSES['missed']}: {'; '.join(roles)} are still LlamaRMSNorm ({shown})"


def _structure(model, returned, norms_before, reference_keys) -> str | None:
    """What is wrong with the modules of the patched model, or None."""
    now = {name: model.get_submodule(name) for name in norms_before}
    untouched = [name for name, module in now.items() if module is norms_before[name]]
    dotted = [name for module in model.modules() for name in module._modules if "." in name]
    if dotted:
        return f"{MANUAL_PATCH_DIAGNOSES['dotted-name']} (e.g. {dotted[0]!r})"
    if len(untouched) == len(now):
        if isinstance(returned, torch.nn.Module) and returned is not model and not _norms(returned):
            return MANUAL_PATCH_DIAGNOSES["copy"]
        return MANUAL_PATCH_DIAGNOSES["nothing"]
    if untouched:
        return _missed(untouched)
    for name, module in now.items():
        old = norms_before[name]
        if not isinstance(module, TritonRMSNorm):
            return f"{MANUAL_PATCH_DIAGNOSES['wrong-type']}: {name} is a {type(module).__name__}"
        weight = getattr(module, "weight", None)
        if weight is not old.weight:
            if not isinstance(weight, torch.Tensor) or weight.shape != old.weight.shape:
                return f"{MANUAL_PATCH_DIAGNOSES['weight-not-carried']} ({name})"
            if weight.data_ptr() == old.weight.data_ptr():
                return f"{MANUAL_PATCH_DIAGNOSES['weight-rewrapped']} ({name})"
            if torch.equal(weight.detach().to(old.weight.device), old.weight.detach()):
                return f"{MANUAL_PATCH_DIAGNOSES['weight-copied']} ({name})"
            return f"{MANUAL_PATCH_DIAGNOSES['weight-not-carried']} ({name})"
        eps = getattr(module, "variance_epsilon", None)
        if eps != old.variance_epsilon:
            return f"{MANUAL_PATCH_DIAGNOSES['eps']} ({name}: {eps!r} instead of {old.variance_epsilon!r})"
    keys = list(model.state_dict())
    if keys != reference_keys:
        changed = sorted(set(keys) ^ set(reference_keys))[:3]
        return f"{MANUAL_PATCH_DIAGNOSES['keys']} (e.g. {changed})"
    return None


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def check_manual_patch(fn: Callable, verbose: bool = True, seed: int = 0) -> bool:
    """Check the reader's hand-made patch that puts ``kernels.TritonRMSNorm`` into a Llama.

    ``fn(model)`` must replace, inside ``model`` (a Hugging Face ``LlamaForCausalLM``), every
    ``LlamaRMSNorm`` by a ``kernels.TritonRMSNorm`` that holds the same weight Parameter and the
    same eps. Runs on a tiny float32 Llama (``build_model("tiny", dtype=torch.float32)``) on
    ``runtime.device()``, with ``patch_llama`` and ``TritonRMSNorm.from_hf`` out of reach, then
    compares the loss and every gradient with an untouched copy. Chapter:
    ``notebooks/08_training_loop.ipynb``.

    Args:
        fn: the reader's ``fn(model)``, which patches ``model`` in place (what it returns is
            looked at too).
        verbose: print the verdict, what is wrong in words or what is right (False: only return).
        seed: seed of the tiny model's weights and of the batch.

    Returns:
        True when the patch is right and the loss and every gradient match; False otherwise. It
        never raises because ``fn`` is wrong or unfinished.
    """
    device = runtime.device()
    model = build_model("tiny", dtype=torch.float32, device=device, seed=seed)
    reference = copy.deepcopy(model)  # Hugging Face's model, untouched: the same weights
    norms_before = _norms(model)
    changed_during_walk = _watch(model)
    try:
        returned = _call(fn, model)
    except FinishedCodeCalled as called:
        return _report(str(called), "", verbose)
    except NotImplementedError:
        return _report(MANUAL_PATCH_DIAGNOSES["stub"], "", verbose)
    except Exception as exc:  # the reader's code may fail in any way: say how
        return _report(_raised(exc), "", verbose)
    finally:
        _unwatch(model)
    problem = _structure(model, returned, norms_before, list(reference.state_dict()))
    if problem:
        return _report(problem, "", verbose)
    if changed_during_walk:
        return _report(f"{MANUAL_PATCH_DIAGNOSES['one-phase']} (e.g. {changed_during_walk[0]!r} "
                       "was replaced during the walk)", "", verbose)

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=gen).to(device)
    labels = ids.clone()
    labels[:, :3] = -100  # a masked prompt, as in fine-tuning
    batch = {"input_ids": ids, "labels": labels}
    loss, grads = _loss_and_grads(model, batch)
    ref_loss, ref_grads = _loss_and_grads(reference, batch)
    tol = RELATIVE_ERROR_TOL[torch.float32]
    errors = {name: relative_error(grads[name], ref_grads[name]) if grads[name] is not None else float("inf")
              for name in ref_grads}
    loss_error = relative_error(loss, ref_loss)
    worst = max(errors, key=errors.get)
    if loss_error > tol or errors[worst] > tol:
        return _report(f"{MANUAL_PATCH_DIAGNOSES['gradients']}: loss {loss.item():.6f} against "
                       f"{ref_loss.item():.6f}; the largest gradient error is {errors[worst]:.1e} "
                       f"in {worst}", "", verbose)
    return _report(None, (f"all {len(norms_before)} LlamaRMSNorm replaced by TritonRMSNorm, each "
                          "holding the same weight Parameter and eps; the loss and the gradients "
                          f"of all {len(errors)} parameters match Hugging Face's model (largest "
                          f"relative error {errors[worst]:.1e})"), verbose)
