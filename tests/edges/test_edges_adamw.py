"""TritonAdamW at its edges: every flag of torch.optim.AdamW, however it is set, is computed exactly or refused.

The step is compared, one step at a time, with ``torch.optim.AdamW`` run in float64 from the very same (stored)
parameter and moments: the kernel rounds once per tensor and step, so each value must lie within about one spacing
of the float64 step's value, and a wrong update (a sign, a decay, a bias correction) is many spacings away.
"""

from __future__ import annotations

import copy

import pytest
import strategies
import torch
from hypothesis import given
from hypothesis import strategies as st

from kernels.adamw import FLAG_DEFAULTS, TritonAdamW

# Flags TritonAdamW refuses, with the value that asks for what it does not compute.
REFUSED = {"amsgrad": True, "capturable": True, "differentiable": True, "decoupled_weight_decay": False}
_EPS32 = torch.finfo(torch.float32).eps


def _param(shape, dtype, device, gen, scale=1.0):
    return torch.nn.Parameter((torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(device, dtype))


def _float64_step(p_before, m_before, v_before, grad, step, group):
    """One step of torch.optim.AdamW in float64 from the given parameter, moments and step count (``step`` = this
    step's number, from 1). Returns the parameter and moments after it."""
    p = torch.nn.Parameter(p_before.detach().double().clone())
    opt = torch.optim.AdamW([p], lr=group["lr"], betas=group["betas"], eps=group["eps"],
                            weight_decay=group["weight_decay"], maximize=group["maximize"], foreach=False)
    if step > 1:
        opt.state[p] = {"step": torch.tensor(float(step - 1)),
                        "exp_avg": m_before.double().clone(), "exp_avg_sq": v_before.double().clone()}
    p.grad = grad.double()
    opt.step()
    state = opt.state[p]
    return p.detach(), state["exp_avg"], state["exp_avg_sq"]


def _assert_within_a_spacing(name, ours, ref, scale, dtype):
    """|ours − ref| ≤ one spacing of ``dtype`` at ``scale`` (≥ the final rounding, 0.5 spacing, plus float32
    arithmetic), and no NaN where the reference has none."""
    ours = ours.detach().double().cpu()
    ref, scale = ref.cpu(), scale.cpu()
    bound = torch.finfo(dtype).eps * scale + torch.finfo(dtype).tiny
    bad = ~((ours - ref).abs() <= bound)
    assert not bad.any(), (f"{name}: {int(bad.sum())} of {ref.numel()} values off, e.g. ours {ours[bad][:4].tolist()}"
                           f" against float64 {ref[bad][:4].tolist()}")


def _step_and_check(opt, params, grads_per_step):
    """Step ``opt`` once per entry of ``grads_per_step`` and check every step of every parameter against float64."""
    group = opt.param_groups[0]
    for t, grads in enumerate(grads_per_step, start=1):
        before = []
        for p, g in zip(params, grads):
            state = opt.state.get(p, {})
            zeros = torch.zeros_like(p, dtype=torch.float64)
            before.append((p.detach().clone(), state.get("exp_avg", zeros).clone(),
                           state.get("exp_avg_sq", zeros).clone()))
            p.grad = g.clone()
        opt.step()
        for p, g, (p0, m0, v0) in zip(params, grads, before):
            p_ref, m_ref, v_ref = _float64_step(p0, m0, v0, g, t, group)
            m_after, v_after = opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]
            assert p.dtype == m_after.dtype == v_after.dtype == g.dtype
            g64, beta1 = g.double().cpu(), group["betas"][0]
            fp32_in_dtype = _EPS32 / torch.finfo(p.dtype).eps  # float32 round-off, in spacings of the dtype
            # Scales: the moments' terms before they are added (they may cancel); the parameter before and after (two
            # roundings of values that size), plus float32 round-off of the update, which carries m's round-off: the
            # step a moment of m's terms' size would take, not only the step taken after their cancellation.
            m_terms = beta1 * m0.double().abs().cpu() + (1 - beta1) * g64.abs()
            update = (p_ref - p0.double()).abs().cpu()
            denom = v_ref.cpu().sqrt() / (1 - group["betas"][1] ** t) ** 0.5 + group["eps"]
            step_of_terms = torch.where(denom > 0, group["lr"] / (1 - beta1 ** t) * m_terms / denom, 0.0)
            p_scale = (torch.maximum(p_ref.abs(), p0.double().abs()).cpu()
                       + 64 * fp32_in_dtype * (update + step_of_terms))
            m_scale = m_ref.abs().cpu() + 8 * fp32_in_dtype * m_terms
            v_scale = v_ref.abs().cpu() * (1 + 8 * fp32_in_dtype)
            _assert_within_a_spacing(f"param after step {t}", p, p_ref, p_scale, p.dtype)
            _assert_within_a_spacing(f"exp_avg after step {t}", m_after, m_ref, m_scale, p.dtype)
            _assert_within_a_spacing(f"exp_avg_sq after step {t}", v_after, v_ref, v_scale, p.dtype)


# ---- what hypothesis draws ----------------------------------------------------------------------------------------


@given(
    shapes=st.lists(st.lists(strategies.sizes(40), min_size=1, max_size=2), min_size=1, max_size=2),
    dtype=strategies.kernel_dtypes(),
    lr=st.floats(1e-4, 0.3), beta1=st.floats(0.0, 0.99), beta2=st.floats(0.5, 0.9999),
    eps=st.sampled_from([0.0, 1e-8, 1e-3]), weight_decay=st.floats(0.0, 0.5),
    maximize=st.booleans(), amsgrad=st.booleans(), grad_scale=st.sampled_from([0.05, 1.0, 10.0]),
    steps=st.integers(1, 3), seed=st.integers(0, 2**31 - 1),
)
def test_steps_match_torch_adamw_in_float64(shapes, dtype, lr, beta1, beta2, eps, weight_decay, maximize, amsgrad,
                                            grad_scale, steps, seed, device):
    gen = torch.Generator().manual_seed(seed)
    params = [_param(tuple(s), dtype, device, gen) for s in shapes]
    kwargs = dict(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay, maximize=maximize)
    if amsgrad:
        with pytest.raises(TypeError, match="amsgrad=True is not supported"):
            TritonAdamW(params, amsgrad=True, **kwargs)
        return
    opt = TritonAdamW(params, **kwargs)
    grads = [[(torch.randn(p.shape, generator=gen, dtype=torch.float64) * grad_scale).to(device, dtype)
              for p in params] for _ in range(steps)]
    _step_and_check(opt, params, grads)


# ---- the flags: the silent case first -----------------------------------------------------------------------------


def test_maximize_set_on_a_group_after_construction_ascends(device, gen):
    # The case that used to run plain AdamW without a word: param_groups[0]["maximize"] = True after construction.
    w = _param((7, 5), torch.float32, device, gen)
    opt = TritonAdamW([w], lr=0.05, weight_decay=0.1)
    opt.param_groups[0]["maximize"] = True
    _step_and_check(opt, [w], [[torch.randn(7, 5, generator=gen).to(device)] for _ in range(3)])


def test_maximize_matches_torch_adamw_over_steps(device, gen):
    # Against torch.optim.AdamW(maximize=True) itself, in float32, over several steps: the two trajectories agree.
    w = _param((33,), torch.float32, device, gen)
    twin = torch.nn.Parameter(w.detach().clone())
    ours, theirs = TritonAdamW([w], lr=0.1, maximize=True), torch.optim.AdamW([twin], lr=0.1, maximize=True)
    for _ in range(4):
        g = torch.randn(33, generator=gen).to(device)
        w.grad, twin.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    torch.testing.assert_close(w.detach(), twin.detach(), rtol=1e-5, atol=1e-6)
    assert (w.detach() - twin.detach()).abs().max() < 1e-5 < 0.1  # and far from plain AdamW, which moves 0.1 a step


@pytest.mark.parametrize("flag", sorted(REFUSED))
@pytest.mark.parametrize("route", ["constructor", "group_edit", "add_param_group", "load_state_dict"])
def test_unsupported_flags_are_refused_however_set(flag, route, device, gen):
    value = REFUSED[flag]
    w = _param((4, 3), torch.float32, device, gen)
    w.grad = torch.randn(4, 3, generator=gen).to(device)
    before = w.detach().clone()
    message = f"{flag}={value!r} is not supported"
    if route == "constructor":
        if flag == "decoupled_weight_decay":  # not an argument of torch.optim.AdamW either
            with pytest.raises(TypeError, match="does not take decoupled_weight_decay"):
                TritonAdamW([w], decoupled_weight_decay=False)
            return
        with pytest.raises(TypeError, match=message):
            TritonAdamW([w], **{flag: value})
        return
    if route == "group_edit":
        opt = TritonAdamW([w], lr=0.1)
        opt.param_groups[0][flag] = value
        with pytest.raises(TypeError, match=message):
            opt.step()
    elif route == "add_param_group":
        v = _param((2,), torch.float32, device, gen)
        opt = TritonAdamW([w], lr=0.1)
        with pytest.raises(TypeError, match=message):
            opt.add_param_group({"params": [v], flag: value})
    else:
        # A state dict of torch.optim.AdamW (or any optimizer) whose group sets the flag.
        saved = torch.optim.AdamW([torch.nn.Parameter(w.detach().clone())], lr=0.1).state_dict()
        saved["param_groups"][0][flag] = value
        opt = TritonAdamW([w], lr=0.1)
        with pytest.raises(TypeError, match=message):
            opt.load_state_dict(saved)
        assert opt.param_groups[0].get(flag, FLAG_DEFAULTS[flag]) == FLAG_DEFAULTS[flag]  # left as it was
        opt.step()  # still usable
        return
    assert torch.equal(w.detach(), before)  # nothing moved


def test_a_refused_group_leaves_every_parameter_unmoved(device, gen):
    a, b = _param((5,), torch.float32, device, gen), _param((3,), torch.float32, device, gen)
    opt = TritonAdamW([{"params": [a]}, {"params": [b]}], lr=0.1)
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    opt.param_groups[1]["amsgrad"] = True
    start = a.detach().clone()
    with pytest.raises(TypeError, match="amsgrad"):
        opt.step()
    assert torch.equal(a.detach(), start)


@pytest.mark.parametrize("foreach", [None, False, True])
@pytest.mark.parametrize("fused", [None, False, True])
def test_foreach_and_fused_are_kept_and_change_nothing(foreach, fused, device, gen):
    w = _param((6,), torch.float32, device, gen)
    opt = TritonAdamW([w], lr=0.1, foreach=foreach, fused=fused)
    # The group has exactly torch.optim.AdamW's keys, so state dicts go both ways.
    torch_keys = set(torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))]).param_groups[0])
    assert set(opt.param_groups[0]) == torch_keys
    _step_and_check(opt, [w], [[torch.randn(6, generator=gen).to(device)] for _ in range(2)])


def test_state_dict_of_torch_adamw_with_maximize_loads_and_ascends(device, gen):
    w = _param((9,), torch.float32, device, gen)
    twin = torch.nn.Parameter(w.detach().clone())
    theirs = torch.optim.AdamW([twin], lr=0.05, maximize=True)
    for _ in range(2):
        twin.grad = torch.randn(9, generator=gen).to(device)
        theirs.step()
    with torch.no_grad():
        w.copy_(twin)
    ours = TritonAdamW([w], lr=0.05)
    # A copy, as from a checkpoint file: a live state dict shares its moment tensors with the optimizer it came from.
    ours.load_state_dict(copy.deepcopy(theirs.state_dict()))
    assert ours.param_groups[0]["maximize"] is True
    g = torch.randn(9, generator=gen).to(device)
    w.grad, twin.grad = g.clone(), g.clone()
    ours.step()
    theirs.step()
    torch.testing.assert_close(w.detach(), twin.detach(), rtol=1e-5, atol=1e-6)


# ---- parameters: dtypes, layouts ----------------------------------------------------------------------------------


def test_float64_parameters_are_refused_at_construction_and_at_step(device, gen):
    d = torch.nn.Parameter(torch.randn(3, generator=gen, dtype=torch.float64).to(device))
    with pytest.raises(TypeError, match="float64"):
        TritonAdamW([d])
    w = _param((3,), torch.float32, device, gen)
    opt = TritonAdamW([w])
    with pytest.raises(TypeError, match="float64"):
        opt.add_param_group({"params": [d]})
    # model.double() after the optimizer was made: the same Parameter, now float64.
    w.data = w.data.double()
    w.grad = torch.ones_like(w)
    with pytest.raises(TypeError, match="cast the model to float32, or use torch.optim.AdamW"):
        opt.step()


def test_complex_parameters_are_refused_at_construction(device):
    with pytest.raises(TypeError, match="complex"):
        TritonAdamW([torch.nn.Parameter(torch.ones(3, dtype=torch.complex64, device=device))])


def test_a_strided_gradient_gives_the_same_step(device, gen):
    w = _param((4, 6), torch.float32, device, gen)
    opt = TritonAdamW([w], lr=0.1, weight_decay=0.05)
    grads = [[torch.randn(6, 4, generator=gen).to(device).t()] for _ in range(2)]  # transposed views
    _step_and_check(opt, [w], grads)
