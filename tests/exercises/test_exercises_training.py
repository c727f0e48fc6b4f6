"""The chapter 08 exercise check: it passes the solution, and names every planted mistake of a hand-made patch with
the sentence of ``MANUAL_PATCH_DIAGNOSES``, without raising."""

import copy

import pytest
import torch

from kernels import TritonRMSNorm, patch_llama
from kernels.exercises.solutions import load
from kernels.exercises.training import MANUAL_PATCH_DIAGNOSES, check_manual_patch
from kernels.rmsnorm import rms_norm
from kernels.training.models import build_model


def norms_of(model, keep=lambda name: True):
    """(parent, attribute, norm) for the model's LlamaRMSNorms whose attribute name ``keep`` accepts."""
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if type(child).__name__ == "LlamaRMSNorm" and keep(name)]


def shared(norm):
    new = TritonRMSNorm(norm.weight.shape[0], eps=norm.variance_epsilon)
    new.weight = norm.weight
    return new


class WithExtraBuffer(TritonRMSNorm):
    """A norm that also saves its eps as a buffer: one more state_dict key per norm."""

    def __init__(self, norm):
        super().__init__(norm.weight.shape[0], eps=norm.variance_epsilon)
        self.weight = norm.weight
        self.register_buffer("eps_value", torch.tensor(norm.variance_epsilon))


class WithoutWeight(TritonRMSNorm):
    """Right in every attribute, but its forward forgets to multiply by the weight."""

    def forward(self, hidden_states):
        return rms_norm(hidden_states, torch.ones_like(self.weight), self.variance_epsilon)


def attempt(mistake):
    def patch(model):
        if mistake == "stub":
            raise NotImplementedError("your turn")
        if mistake == "raised":
            raise AttributeError("'LlamaRMSNorm' object has no attribute 'eps'")
        if mistake == "copy":
            model = copy.deepcopy(model)
        if mistake == "one-phase":  # swapped inside the walk over each parent's children
            for parent in model.modules():
                for name, child in parent.named_children():
                    if type(child).__name__ == "LlamaRMSNorm":
                        setattr(parent, name, shared(child))
            return model
        if mistake == "one-phase-named-modules":  # swapped inside the walk of named_modules(), by the parent's path
            for path, module in model.named_modules():
                if type(module).__name__ == "LlamaRMSNorm":
                    parent_path, _, name = path.rpartition(".")
                    setattr(model.get_submodule(parent_path), name, shared(module))
            return model
        if mistake == "dotted-name":
            for path, module in list(model.named_modules()):
                if type(module).__name__ == "LlamaRMSNorm":
                    setattr(model, path, shared(module))
            return model
        if mistake == "nothing":
            for _name, module in model.named_modules():
                if type(module).__name__ == "LlamaRMSNorm":
                    module = shared(module)  # noqa: F841 (the mistake: a loop variable, not the model)
            return None
        keep = {"missed-final": lambda name: name != "norm",
                "missed-attention": lambda name: name != "input_layernorm"}.get(mistake, lambda name: True)
        for parent, name, norm in norms_of(model, keep):
            if mistake == "wrong-type":
                new = torch.nn.RMSNorm(norm.weight.shape[0], eps=norm.variance_epsilon)
            elif mistake == "weight-not-carried":
                new = TritonRMSNorm(norm.weight.shape[0], eps=norm.variance_epsilon)
            elif mistake == "weight-copied":
                new = TritonRMSNorm(norm.weight.shape[0], eps=norm.variance_epsilon).to(norm.weight.device)
                with torch.no_grad():
                    new.weight.copy_(norm.weight)
            elif mistake == "weight-rewrapped":
                new = TritonRMSNorm(norm.weight.shape[0], eps=norm.variance_epsilon)
                new.weight = torch.nn.Parameter(norm.weight)
            elif mistake == "eps":
                new = TritonRMSNorm(norm.weight.shape[0])
                new.weight = norm.weight
            elif mistake == "weight-tensor":
                new = TritonRMSNorm(norm.weight.shape[0], eps=norm.variance_epsilon)
                new.weight = norm.weight.data  # a plain tensor: torch refuses it as a parameter
            elif mistake == "eps-attribute":
                new = TritonRMSNorm(norm.weight.shape[0], eps=norm.eps)  # LlamaRMSNorm has no .eps
            elif mistake == "keys":
                new = WithExtraBuffer(norm)
            elif mistake == "gradients":
                new = WithoutWeight(norm.weight.shape[0], eps=norm.variance_epsilon)
                new.weight = norm.weight
            elif mistake == "from_hf":
                new = TritonRMSNorm.from_hf(norm)
            else:
                new = shared(norm)
            setattr(parent, name, new)
        return model
    return patch


MISTAKES = [
    ("stub", "stub"), ("raised", "raised"), ("copy", "copy"), ("nothing", "nothing"),
    ("missed-final", "missed"), ("missed-attention", "missed"), ("wrong-type", "wrong-type"),
    ("weight-not-carried", "weight-not-carried"), ("weight-copied", "weight-copied"),
    ("weight-rewrapped", "weight-rewrapped"), ("eps", "eps"), ("keys", "keys"), ("gradients", "gradients"),
    ("one-phase", "one-phase"), ("one-phase-named-modules", "one-phase"), ("dotted-name", "dotted-name"),
    ("weight-tensor", "weight-tensor"), ("eps-attribute", "eps-attribute"),
]


def test_every_diagnosis_has_a_case():
    assert {key for _, key in MISTAKES} == set(MANUAL_PATCH_DIAGNOSES)


@pytest.mark.parametrize("mistake, key", MISTAKES, ids=[m for m, _ in MISTAKES])
def test_every_mistake_is_named(mistake, key, capsys):
    assert not check_manual_patch(attempt(mistake))
    out = capsys.readouterr().out
    assert out.startswith("✗") and MANUAL_PATCH_DIAGNOSES[key] in out, out


def test_a_missed_norm_is_named_by_its_role(capsys):
    check_manual_patch(attempt("missed-final"))
    assert "the final norm (model.norm" in capsys.readouterr().out
    check_manual_patch(attempt("missed-attention"))
    out = capsys.readouterr().out
    assert "the attention norms" in out and "model.layers.0.input_layernorm" in out


def test_the_solution_and_a_right_answer_pass(capsys):
    assert check_manual_patch(load("patch_norms_by_hand"))
    assert check_manual_patch(attempt("right"))
    out = capsys.readouterr().out
    assert out.startswith("✓") and "✗" not in out and "all 9 LlamaRMSNorm" in out


def by_the_package(model):
    # The chapter's own patch, imported above the exercise, with the norms alone switched on.
    patch_llama(model, kernels=("rms_norm",))
    return model


def by_the_package_module(model):
    import kernels

    kernels.patch_llama(model, kernels=("rms_norm",))
    return model


def by_the_package_caught(model):
    try:
        patch_llama(model, kernels=("rms_norm",))
    except Exception:  # noqa: BLE001  (a learner hiding the refusal, then doing nothing: still refused)
        pass
    return model


@pytest.mark.parametrize("fn, name", [
    (attempt("from_hf"), "TritonRMSNorm.from_hf"),  # the package's replacement carries weight and eps for you
    (by_the_package, "patch_llama"),
    (by_the_package_module, "patch_llama"),
    (by_the_package_caught, "patch_llama"),
    (patch_llama, "patch_llama"),  # handed to the check itself
    (TritonRMSNorm.from_hf, "TritonRMSNorm.from_hf"),
])
def test_the_finished_surgery_is_refused_by_name(fn, name, capsys):
    assert not check_manual_patch(fn)
    out = capsys.readouterr().out
    assert out.startswith("✗") and name in out and "finished answer" in out, out
    assert not isinstance(vars(TritonRMSNorm)["from_hf"], type(lambda: 0))  # the classmethod is put back


def test_a_one_phase_swap_gives_the_right_model_but_is_named(capsys):
    # The prose asks for two phases. A swap inside the walk happens to work here, so only watching the walk shows it.
    model = attempt("one-phase")(build_model("tiny", dtype=torch.float32))
    assert all(type(m).__name__ != "LlamaRMSNorm" for m in model.modules())
    assert not check_manual_patch(attempt("one-phase"))
    out = capsys.readouterr().out
    assert MANUAL_PATCH_DIAGNOSES["one-phase"] in out and "was replaced during the walk" in out, out


def test_the_check_leaves_plain_children_behind():
    seen, solution = [], load("patch_norms_by_hand")

    def patch(model):
        seen.append(model)
        return solution(model)

    assert check_manual_patch(patch, verbose=False)
    assert all(type(m._modules) is dict for m in seen[0].modules())  # the watched children are gone


def test_a_quiet_check_prints_nothing(capsys):
    assert not check_manual_patch(attempt("eps"), verbose=False)
    assert capsys.readouterr().out == ""
