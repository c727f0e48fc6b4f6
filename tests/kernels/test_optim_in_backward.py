"""OptimizerInBackward: AdamW stepped inside the backward, against float64 torch.optim.AdamW and TritonAdamW.

The updates are compared as changes from the initial weights (p − p₀), so a step that did nothing
fails. Gradients for the float64 reference are the very float32 gradients our backward computed
(taken by ``torch.autograd.grad`` on the same graph first), so the comparison is of the optimizers.
"""

from __future__ import annotations

import copy

import pytest
import strategies
import torch
from hypothesis import given
from hypothesis import strategies as st

from kernels import runtime
from kernels.adamw import TritonAdamW
from kernels.optim_in_backward import OptimizerInBackward
from kernels.reference import relative_error
from kernels.tolerances import RELATIVE_ERROR_TOL

DEVICE = runtime.device()


def _params(gen, dtype=torch.float32):
    """Three leaves of odd shapes: two in a group with its own lr and weight decay."""
    shapes = [(7, 5), (7,), (3, 7)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64).to(DEVICE, dtype))
            for s in shapes]


def _loss(params, x):
    w1, b1, w2 = params
    return (torch.tanh(x @ w1.T + b1) @ w2.T).square().sum()


def _groups(params, split: bool):
    if not split:
        return [{"params": params}]
    return [{"params": params[:2]}, {"params": params[2:], "lr": 3e-2, "weight_decay": 0.2}]


def _reference(params, split: bool, **hyper):
    ref = [torch.nn.Parameter(p.detach().to(torch.float64).clone()) for p in params]
    return ref, torch.optim.AdamW(_groups(ref, split), foreach=False, **hyper)


def _check_updates(params, ref, start, dtype=torch.float32):
    for p, r, p0 in zip(params, ref, start):
        err = relative_error(p.detach() - p0, r.detach() - p0.to(torch.float64))
        assert err < RELATIVE_ERROR_TOL[dtype] * 10, err  # a few steps compound the float32 roundings


@pytest.mark.parametrize("split", [False, True], ids=["one group", "two groups"])
@pytest.mark.parametrize("maximize", [False, True], ids=["descend", "maximize"])
def test_steps_equal_float64_adamw(gen, split, maximize):
    params = _params(gen)
    hyper = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, maximize=maximize)
    ref, ref_opt = _reference(params, split, **hyper)
    opt = OptimizerInBackward(_groups(params, split), **hyper)
    start = [p.detach().clone() for p in params]
    for _ in range(4):
        x = torch.randn(6, 5, generator=gen).to(DEVICE)
        grads = torch.autograd.grad(_loss(params, x), params)
        _loss(params, x).backward()
        assert all(p.grad is None for p in params), "the gradients are freed after their update"
        opt.step()
        for r, g in zip(ref, grads):
            r.grad = g.to(torch.float64)
        ref_opt.step()
    _check_updates(params, ref, start)
    assert all(float(opt.state[p]["step"]) == 4 for p in params)


@given(shapes=st.lists(st.tuples(strategies.leading_dims(), strategies.sizes()), min_size=1, max_size=3),
       dtype=strategies.kernel_dtypes(), seed=st.integers(0, 2**31 - 1))
def test_any_shapes_and_dtypes_step_as_triton_adamw_does(shapes, dtype, seed):
    """Odd, empty and 3-D parameters in every kernel dtype: the very values TritonAdamW gives for the
    same gradients, and in float32 the float64 reference's."""
    gen = torch.Generator().manual_seed(seed)
    values = [torch.randn(*lead, last, generator=gen, dtype=torch.float64) for lead, last in shapes]
    ours = [torch.nn.Parameter(v.to(DEVICE, dtype)) for v in values]
    twins = [torch.nn.Parameter(v.to(DEVICE, dtype)) for v in values]
    ref = [torch.nn.Parameter(p.detach().double()) for p in ours]
    opt, twin_opt = OptimizerInBackward(ours, lr=1e-2), TritonAdamW(twins, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, foreach=False)
    coefficients = [torch.randn(v.shape, generator=gen).to(DEVICE, dtype) for v in values]
    for _ in range(2):
        grads = [c + p.detach() for c, p in zip(coefficients, ours)]  # d/dp of Σ c·p + p²/2
        sum(((c * p).sum() + p.square().sum() / 2) for c, p in zip(coefficients, ours)).backward()
        opt.step()
        for t, r, g in zip(twins, ref, grads):
            t.grad, r.grad = g.clone(), g.double()
        twin_opt.step()
        ref_opt.step()
    for p, t, r, v in zip(ours, twins, ref, values):
        assert torch.equal(p, t)
        if dtype == torch.float32 and p.numel():
            moved = v.to(p.device)
            assert relative_error(p.detach() - moved.float(), r.detach() - moved) < 10 * RELATIVE_ERROR_TOL[dtype]


def test_accumulation_updates_on_the_last_micro_batch_only(gen):
    params = _params(gen)
    ref, ref_opt = _reference(params, True, lr=1e-2)
    opt = OptimizerInBackward(_groups(params, True), lr=1e-2)
    start = [p.detach().clone() for p in params]
    xs = [torch.randn(4, 5, generator=gen).to(DEVICE) for _ in range(3)]
    total = [torch.zeros_like(p) for p in params]
    for x in xs:
        for t, g in zip(total, torch.autograd.grad(_loss(params, x), params)):
            t += g
    for i, x in enumerate(xs[:2]):
        with opt.accumulating():
            _loss(params, x).backward()
        assert all(torch.equal(p, p0) for p, p0 in zip(params, start)), f"micro-batch {i} updated"
        assert all(p.grad is not None for p in params)
        assert not opt.state
    _loss(params, xs[2]).backward()
    assert all(p.grad is None for p in params)
    opt.step()
    for r, g in zip(ref, total):
        r.grad = g.to(torch.float64)
    ref_opt.step()
    _check_updates(params, ref, start)


def test_a_parameter_only_earlier_micro_batches_reach_is_updated_by_step(gen):
    """A gradient accumulated inside accumulating() is final once the step's last backward ends,
    even if that backward does not reach its parameter: step() updates it."""
    a, b = _params(gen)[:2]
    ref, ref_opt = _reference([a, b], False)
    opt = OptimizerInBackward([a, b])
    start = [a.detach().clone(), b.detach().clone()]
    with opt.accumulating():
        (a.sum() * b.square().sum()).backward()
    grads = [a.grad.clone(), b.grad + 2 * b.detach()]  # the last loss's d/db, at b before its update
    (b.square().sum()).backward()  # reaches b only
    assert a.grad is not None and b.grad is None
    opt.step()
    assert a.grad is None
    for r, g in zip(ref, grads):
        r.grad = g.to(torch.float64)
    ref_opt.step()
    _check_updates([a, b], ref, start)


def test_state_dict_round_trip_resumes_exactly(gen):
    params = _params(gen)
    xs = [torch.randn(4, 5, generator=gen).to(DEVICE) for _ in range(4)]
    opt = OptimizerInBackward(_groups(params, True), lr=1e-2)

    def train(ps, optimizer, batches):
        for x in batches:
            _loss(ps, x).backward()
            optimizer.step()

    train(params, opt, xs[:2])
    saved = copy.deepcopy(opt.state_dict())
    weights = [p.detach().clone() for p in params]
    train(params, opt, xs[2:])

    for resume in (OptimizerInBackward, TritonAdamW, torch.optim.AdamW):
        again = [torch.nn.Parameter(w.clone()) for w in weights]
        other = resume(_groups(again, True), lr=1e-2)
        other.load_state_dict(copy.deepcopy(saved))
        if resume is OptimizerInBackward:
            train(again, other, xs[2:])
        else:
            for x in xs[2:]:
                _loss(again, x).backward()
                other.step()
                other.zero_grad()
        exact = resume is not torch.optim.AdamW  # the same kernel, the same arithmetic
        for p, q, w in zip(params, again, weights):
            if exact:
                assert torch.equal(p, q), resume.__name__
            else:
                assert relative_error(q.detach() - w, p.detach() - w) < 10 * RELATIVE_ERROR_TOL[torch.float32]
    # and this optimizer resumes from the state dicts of the others
    other = TritonAdamW(_groups([torch.nn.Parameter(w.clone()) for w in weights], True), lr=1e-2)
    other.load_state_dict(copy.deepcopy(saved))
    back = OptimizerInBackward(_groups([torch.nn.Parameter(w.clone()) for w in weights], True), lr=1e-2)
    back.load_state_dict(other.state_dict())
    assert back.param_groups[1]["lr"] == 3e-2 and float(back.state[back.param_groups[0]["params"][0]]["step"]) == 2


def test_lr_scheduler_sets_the_next_backwards_lr(gen):
    params = _params(gen)
    ref, ref_opt = _reference(params, True, lr=1e-2)
    opt = OptimizerInBackward(_groups(params, True), lr=1e-2)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    ref_schedule = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 0.5 ** s)
    start = [p.detach().clone() for p in params]
    for _ in range(3):
        x = torch.randn(4, 5, generator=gen).to(DEVICE)
        grads = torch.autograd.grad(_loss(params, x), params)
        _loss(params, x).backward()
        opt.step()
        schedule.step()
        for r, g in zip(ref, grads):
            r.grad = g.to(torch.float64)
        ref_opt.step()
        ref_schedule.step()
    assert opt.param_groups[1]["lr"] == pytest.approx(3e-2 / 8)
    _check_updates(params, ref, start)


def test_shared_parameter_is_updated_once_with_the_summed_gradient(gen):
    w = torch.nn.Parameter(torch.randn(5, 5, generator=gen).to(DEVICE))
    ref, ref_opt = _reference([w], False)
    opt = OptimizerInBackward([w])
    calls = []
    w.register_post_accumulate_grad_hook(lambda p: calls.append(1))
    x = torch.randn(3, 5, generator=gen).to(DEVICE)
    (grad,) = torch.autograd.grad(torch.tanh(x @ w) @ w.T, w, torch.ones(3, 5, device=DEVICE))
    start = w.detach().clone()
    (torch.tanh(x @ w) @ w.T).sum().backward()
    opt.step()
    assert len(calls) == 1
    ref[0].grad = grad.to(torch.float64)
    ref_opt.step()
    _check_updates([w], ref, [start])


def test_per_parameter_clipping_equals_clip_grad_norm_of_each(gen):
    params = _params(gen)
    ref, ref_opt = _reference(params, False)
    opt = OptimizerInBackward(params, max_grad_norm_per_param=0.5)
    start = [p.detach().clone() for p in params]
    x = 3 * torch.randn(6, 5, generator=gen).to(DEVICE)
    grads = [g.to(torch.float64) for g in torch.autograd.grad(_loss(params, x), params)]
    assert all(float(g.norm()) > 0.5 for g in grads), "the test needs gradients that the bound clips"
    _loss(params, x).backward()
    opt.step()
    for r, g in zip(ref, grads):
        r.grad = g
        torch.nn.utils.clip_grad_norm_([r], 0.5)
    ref_opt.step()
    _check_updates(params, ref, start)


def test_remove_detaches_the_hooks(gen):
    params = _params(gen)
    x = torch.randn(4, 5, generator=gen).to(DEVICE)
    with OptimizerInBackward(params) as opt:
        _loss(params, x).backward()
        opt.step()
    before = [p.detach().clone() for p in params]
    _loss(params, x).backward()
    assert all(p.grad is not None for p in params)
    assert all(torch.equal(p, b) for p, b in zip(params, before))


def test_zero_grad_inside_accumulation_drops_the_accumulated_gradients(gen):
    params = _params(gen)
    opt = OptimizerInBackward(params)
    with opt.accumulating():
        _loss(params, torch.randn(4, 5, generator=gen).to(DEVICE)).backward()
        opt.zero_grad()
    assert all(p.grad is None for p in params)


# --------------------------------------------------------------------------------------------------
# What it refuses
# --------------------------------------------------------------------------------------------------


def test_a_second_updating_backward_in_one_step_is_refused(gen):
    params = _params(gen)
    opt = OptimizerInBackward(params)
    x = torch.randn(4, 5, generator=gen).to(DEVICE)
    _loss(params, x).backward()
    after_first = [p.detach().clone() for p in params]
    with pytest.raises(RuntimeError, match="accumulating"):
        _loss(params, x).backward()  # a micro-batch that forgot accumulating()
    assert all(torch.equal(p, a) for p, a in zip(params, after_first))
    loss = _loss(params, x)
    opt.zero_grad()
    opt.step()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()


def test_step_is_refused_without_an_update(gen):
    params = _params(gen)
    opt = OptimizerInBackward(params)
    with pytest.raises(RuntimeError, match="no backward updated"):
        opt.step()
    with opt.accumulating():
        _loss(params, torch.randn(4, 5, generator=gen).to(DEVICE)).backward()
        with pytest.raises(RuntimeError, match="inside accumulating"):
            opt.step()
    with pytest.raises(RuntimeError, match="final backward ran inside accumulating"):
        opt.step()


def test_a_parameter_without_gradient_is_refused_at_step(gen):
    params = _params(gen)
    unused = torch.nn.Parameter(torch.randn(2, generator=gen).to(DEVICE))
    opt = OptimizerInBackward(params + [unused])
    _loss(params, torch.randn(4, 5, generator=gen).to(DEVICE)).backward()
    with pytest.raises(RuntimeError, match=r"1 parameter\(s\) got no gradient.*\(2,\).*requires_grad_\(False\)"):
        opt.step()


def test_global_clipping_is_refused_with_the_alternatives(gen):
    params = _params(gen)
    with pytest.raises(TypeError, match="max_grad_norm_per_param"):
        OptimizerInBackward(params, max_grad_norm=1.0)
    with pytest.raises(RuntimeError, match="TritonAdamW"):
        OptimizerInBackward(params).clip_grad_norm_(1.0)
    for bad in (0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="max_grad_norm_per_param"):
            OptimizerInBackward(params, max_grad_norm_per_param=bad)


def test_double_backward_is_refused(gen):
    params = _params(gen)
    OptimizerInBackward(params)
    with pytest.raises(RuntimeError, match="create_graph"):
        _loss(params, torch.randn(4, 5, generator=gen).to(DEVICE)).backward(create_graph=True)


def test_sparse_gradients_are_refused(gen):
    emb = torch.nn.Embedding(11, 4, sparse=True).to(DEVICE)
    OptimizerInBackward(emb.parameters())
    with pytest.raises(TypeError, match="sparse"):
        emb(torch.tensor([1, 3], device=DEVICE)).sum().backward()


@pytest.mark.parametrize("make, error, match", [
    (lambda: torch.zeros(3, dtype=torch.float64, requires_grad=True), TypeError, "float64"),
    (lambda: torch.zeros(3, dtype=torch.complex64, requires_grad=True), TypeError, "complex"),
    (lambda: torch.zeros(4, 3).t().requires_grad_(), ValueError, "contiguous"),
    (lambda: torch.zeros(3), ValueError, "does not require grad"),
    (lambda: torch.zeros(3, requires_grad=True) * 2, TypeError, "not a leaf"),
])
def test_parameters_it_cannot_step_are_refused(make, error, match):
    with pytest.raises(error, match=match):
        OptimizerInBackward([make()])


def test_bad_settings_are_refused(gen):
    params = _params(gen)
    for kwargs, match in ((dict(lr=-1.0), "lr"), (dict(betas=(0.9, 1.0)), "betas"), (dict(eps=float("nan")), "eps"),
                          (dict(weight_decay=-0.1), "weight_decay"), (dict(amsgrad=True), "amsgrad"),
                          (dict(side_stream=1), "side_stream")):
        with pytest.raises((TypeError, ValueError), match=match):
            OptimizerInBackward(params, **kwargs)
    opt = OptimizerInBackward(params)
    state = torch.optim.AdamW(params, amsgrad=True).state_dict()
    with pytest.raises(TypeError, match="amsgrad"):
        opt.load_state_dict(state)
    opt.param_groups[0]["amsgrad"] = True  # edited after construction: refused at the next update
    with pytest.raises(TypeError, match="amsgrad"):
        _loss(params, torch.randn(4, 5, generator=gen).to(DEVICE)).backward()


# --------------------------------------------------------------------------------------------------
# A tiny Llama
# --------------------------------------------------------------------------------------------------


def _tiny_llama_steps(model, optimizer_class, batches):
    opt = optimizer_class(model.parameters(), lr=1e-3)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach() - start[n] for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied+checkpointed"])
def test_tiny_llama_trains_as_with_triton_adamw_in_bf16(seed, gen, tied):
    """In bf16 (float32 runs through the loop in the test of ``train`` below). Tied embeddings are
    one parameter used by two modules (its hook fires once, after the LM head's and the
    embedding's gradients are summed); checkpointing recomputes each layer in the backward, which
    must see the weights before their update."""
    from kernels.training.loop import enable_checkpointing
    from kernels.training.models import build_model, llama_config

    # The tiny preset with two layers and a smaller vocabulary: every kind of parameter, and few
    # launches in the interpreter.
    config = llama_config("tiny", num_hidden_layers=2, vocab_size=512, tie_word_embeddings=tied)
    model = build_model(config, dtype=torch.bfloat16, seed=seed)
    if tied:
        enable_checkpointing(model)
    batches = [torch.randint(0, config.vocab_size, (1, 24), generator=gen).to(DEVICE) for _ in range(2)]
    ours, ours_updates = _tiny_llama_steps(copy.deepcopy(model), OptimizerInBackward, batches)
    theirs, their_updates = _tiny_llama_steps(model, TritonAdamW, batches)
    assert ours == pytest.approx(theirs, rel=1e-2)
    for name, update in ours_updates.items():
        assert relative_error(update, their_updates[name]) < RELATIVE_ERROR_TOL[torch.bfloat16], name


# --------------------------------------------------------------------------------------------------
# GPU: the side stream and the memory it saves
# --------------------------------------------------------------------------------------------------


def _gpu_model(seed):
    from kernels.training.models import build_model, llama_config

    # Weights large against the activations of a short sequence, so that a set of gradients shows
    # in the peak; no parameter holds more than a few per cent of them.
    config = llama_config("tiny", hidden_size=1024, intermediate_size=2816, num_attention_heads=8,
                          num_key_value_heads=4, head_dim=128, vocab_size=4096)
    return build_model(config, dtype=torch.bfloat16, device="cuda", seed=seed)


def _gpu_steps(seed, batches, make_opt):
    """The updates of a few steps, and the peak of the last one above what existed before it."""
    model = _gpu_model(seed)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = make_opt(model.parameters())
    for ids in batches:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        # The math attention: flash attention's backward may sum in a varying order, and the
        # three runs are compared parameter by parameter.
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    updates = {n: p.detach() - start[n] for n, p in model.named_parameters()}
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model, opt, start
    torch.cuda.empty_cache()
    return updates, peak, grad_bytes


@pytest.mark.gpu
def test_gpu_side_stream_equals_inline_and_saves_a_set_of_gradients(seed, gen):
    batches = [torch.randint(0, 4096, (1, 32), generator=gen).cuda() for _ in range(3)]
    side, side_peak, grad_bytes = _gpu_steps(seed, batches, lambda ps: OptimizerInBackward(ps, lr=1e-3))
    inline, inline_peak, _ = _gpu_steps(seed, batches, lambda ps: OptimizerInBackward(ps, lr=1e-3,
                                                                                     side_stream=False))
    after, after_peak, _ = _gpu_steps(seed, batches, lambda ps: TritonAdamW(ps, lr=1e-3))
    for name in side:
        # a race between the streams would leave a parameter's update wrong, far beyond rounding
        assert relative_error(side[name], inline[name]) < RELATIVE_ERROR_TOL[torch.bfloat16], name
        assert relative_error(side[name], after[name]) < RELATIVE_ERROR_TOL[torch.bfloat16], name
    for peak in (side_peak, inline_peak):
        saved = after_peak - peak
        # The in-backward peak still holds the activations and the few gradients alive at once.
        assert 0.6 * grad_bytes <= saved <= 1.1 * grad_bytes, (saved, grad_bytes, after_peak, peak)



# --------------------------------------------------------------------------------------------------
# The training loop and the command line
# --------------------------------------------------------------------------------------------------


def _micro_batches(gen, vocab, count):
    ids = [torch.randint(0, vocab, (1, 20), generator=gen) for _ in range(count)]
    return [dict(input_ids=i, attention_mask=torch.ones_like(i), labels=i.clone()) for i in ids]


def test_train_with_accumulation_equals_triton_adamw_and_leaves_no_hooks(seed, gen):
    from kernels.training.loop import train
    from kernels.training.models import build_model, llama_config

    config = llama_config("tiny", num_hidden_layers=1, vocab_size=256)
    model = build_model(config, dtype=torch.float32, seed=seed)
    twin = copy.deepcopy(model)
    start = [p.detach().clone() for p in model.parameters()]
    batches = _micro_batches(gen, config.vocab_size, 6)  # 2 steps of 3 micro-batches
    ours = train(model, batches, grad_accum=3, lr=1e-3, adamw="triton", optimizer_in_backward=True,
                 progress=False)
    theirs = train(twin, batches, grad_accum=3, lr=1e-3, adamw="triton", progress=False)
    assert ours.losses == pytest.approx(theirs.losses, rel=1e-5)
    for (name, p), q, p0 in zip(model.named_parameters(), twin.parameters(), start):
        if runtime.MODE == "gpu":  # attention's backward may sum in another order from run to run
            assert relative_error(p.detach() - p0, q.detach() - p0) < RELATIVE_ERROR_TOL[torch.float32], name
        else:
            assert torch.equal(p, q), name  # the same gradients summed, the same kernel
    assert ours.what_ran["optimizer_in_backward"] and "OptimizerInBackward" in ours.what_ran["optimizer"]
    model(**{k: v.to(DEVICE) for k, v in batches[0].items()}).loss.backward()
    assert all(p.grad is not None for p in model.parameters()), "the run's hooks were removed at its end"


def test_train_refuses_what_the_in_backward_step_cannot_do():
    from kernels.training.loop import make_adamw, train

    layer = torch.nn.Linear(3, 2).to(DEVICE)
    with pytest.raises(ValueError, match="adamw must be 'triton'"):
        make_adamw(layer, 1e-3, "fused", in_backward=True)
    batch = dict(input_ids=torch.zeros(1, 4, dtype=torch.long), attention_mask=torch.ones(1, 4, dtype=torch.long),
                 labels=torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="after_backward"):
        train(layer, [batch], adamw="triton", optimizer_in_backward=True, after_backward=lambda step, m: None)
    frozen = torch.nn.Linear(3, 2).to(DEVICE)
    frozen.bias.requires_grad_(False)
    assert [tuple(p.shape) for p in make_adamw(frozen, 1e-3, "triton", in_backward=True).param_groups[0]["params"]] \
        == [(2, 3)]


def test_command_line_flag(tmp_path, capsys):
    import json

    from kernels.training.finetune import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--preset", "tiny", "--optimizer-in-backward", "--patched-adamw", "fused", "--out", str(tmp_path)])
    assert exit_info.value.code == 2 and "--optimizer-in-backward runs the Triton" in capsys.readouterr().err
    assert main(["--preset", "tiny", "--steps", "2", "--seq-len", "48", "--batch-size", "1", "--grad-accum", "2",
                 "--kernels", "cross_entropy", "--optimizer-in-backward", "--out", str(tmp_path), "--no-progress"]) == 0
    data = json.loads((tmp_path / "finetune" / "tiny_patched.json").read_text())
    assert data["settings"]["optimizer_in_backward"] is True and data["settings"]["patched_adamw"] == "triton"
    assert data["patched"]["what_ran"]["optimizer_in_backward"] is True
    assert len(data["patched"]["steps"]) == 2 and "peak_memory_bytes" in data["patched"]


def test_command_line_flag_is_refused_under_torchrun(monkeypatch):
    from kernels.training.finetune import build_parser, flag_problems

    args = build_parser().parse_args(["--optimizer-in-backward"])
    assert flag_problems(args) == []
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")  # what torchrun sets in every process it starts
    assert any("under torchrun" in line for line in flag_problems(args))
