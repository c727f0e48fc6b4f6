"""AdamW: the kernel against float64 and against torch.optim.AdamW; groups, schedulers, state dicts, bad input."""

import json
import math

import pytest
import torch

from kernels.adamw import TritonAdamW, adamw_step_op
from kernels.reference import adamw_reference, relative_error
from kernels.tolerances import RELATIVE_ERROR_TOL as TOL

# 70,001 values: more than one interpreter program (65,536 values) and a ragged last block on a GPU.
SHAPES = [(37, 19), (5,), (70_001,), (0, 3)]


def _fresh(shape, dtype, device, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(device, dtype).requires_grad_()


def within_one_spacing(ours, theirs, start) -> bool:
    """Every value of ``ours`` within one bf16 spacing of ``theirs``, the spacing taken at the larger of the value
    and its ``start``: where an update nearly cancels a value, float32 arithmetic is exact only to that scale."""
    scale = torch.maximum(theirs.abs(), start.abs()).clamp_min(2**-126)
    return bool(((ours - theirs).abs() <= scale * 2**-7).all())


def _steps(optimizer, params, grads_per_step):
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizer.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64_after_several_steps(dtype, device, gen):
    params = [_fresh(s, dtype, device, gen) for s in SHAPES]
    start = [p.detach().clone() for p in params]
    grads = [[torch.randn(p.shape, generator=gen).to(device, dtype) for p in params] for _ in range(4)]
    lr, wd = 0.2, 0.1
    _steps(TritonAdamW(params, lr=lr, weight_decay=wd), params, grads)
    refs = [adamw_reference(p0, [g[i] for g in grads], lr, weight_decay=wd) for i, p0 in enumerate(start)]
    for p, ref in zip(params, refs):
        if p.numel() == 0:
            continue
        assert p.dtype == dtype
        assert relative_error(p.detach(), ref) < TOL[dtype]
    # The steps moved the parameters far more than the tolerance, so an optimizer that did nothing would fail. Judged
    # over all values at once: a tensor of 5 values can move little (four random-sign steps may nearly cancel).
    assert relative_error(_flat(start), _flat(refs)) > 10 * TOL[dtype]


def _flat(tensors):
    return torch.cat([t.detach().double().reshape(-1).cpu() for t in tensors])


def test_bf16_step_matches_torch_fused_adamw_to_the_last_bit_or_one(device, gen):
    params = [_fresh((64, 33), torch.bfloat16, device, gen)]
    start = params[0].detach().float().clone()
    twin = [params[0].detach().clone().requires_grad_()]
    grads = [[torch.randn(64, 33, generator=gen).to(device, torch.bfloat16)]]
    # One step: after that the moments (stored in bf16) may differ by a spacing, and later steps compound it.
    _steps(TritonAdamW(params, lr=1e-2), params, grads)
    _steps(torch.optim.AdamW(twin, lr=1e-2, fused=True), twin, grads)
    ours, theirs = params[0].detach().float(), twin[0].detach().float()
    # The same arithmetic in the same order, but not the same instructions (PyTorch's CUDA kernel takes some scalars
    # in float64; compilers contract multiply-adds differently): at most one bf16 spacing apart at the scale of the
    # operands, mostly the same bits.
    assert within_one_spacing(ours, theirs, start)
    assert (ours == theirs).float().mean() > 0.9
    assert (ours != start).float().mean() > 0.5  # the step moved the values


def test_groups_scheduler_and_missing_grads_like_torch(device, gen):
    def build(opt_cls):
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4), torch.nn.Linear(4, 4)).to(device)
        groups = [{"params": model[0].parameters(), "lr": 3e-2, "weight_decay": 0.0},
                  {"params": model[1].parameters(), "betas": (0.8, 0.99)},
                  {"params": model[2].parameters()}]  # never gets a gradient: skipped, no state
        opt = opt_cls(groups, lr=1e-2, weight_decay=0.05)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))

    x = torch.randn(32, 8, generator=gen).to(device)
    results = []
    for opt_cls in (TritonAdamW, torch.optim.AdamW):
        model, opt, sched = build(opt_cls)
        for _ in range(4):
            opt.zero_grad()
            model[1](model[0](x)).square().mean().backward()
            opt.step()
            sched.step()
        assert model[2].weight not in opt.state
        results.append([p.detach().clone() for p in model.parameters()])
    for ours, theirs in zip(*results):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_state_dict_loads_both_ways(device, gen):
    def run(first, second):
        torch.manual_seed(2)
        layer = torch.nn.Linear(6, 5).to(device)
        x = torch.randn(9, 6, generator=torch.Generator().manual_seed(3)).to(device)
        opt = first(layer.parameters(), lr=1e-2)
        for step in range(4):
            if step == 2:  # hand the state over half way
                state = opt.state_dict()
                opt = second(layer.parameters(), lr=1e-2)
                opt.load_state_dict(state)
            opt.zero_grad()
            layer(x).square().mean().backward()
            opt.step()
        return [p.detach() for p in layer.parameters()], opt.state_dict()

    reference, _ = run(torch.optim.AdamW, torch.optim.AdamW)
    for first, second in ((torch.optim.AdamW, TritonAdamW), (TritonAdamW, torch.optim.AdamW)):
        params, state = run(first, second)
        for ours, theirs in zip(params, reference):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
        assert float(state["state"][0]["step"]) == 4.0


def test_closure_returns_its_loss(device):
    w = torch.nn.Parameter(torch.ones(3, device=device))
    opt = TritonAdamW([w], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (w * 2).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == 6.0
    assert (w.detach() < 1).all()


def test_opcheck(device, gen):
    p, g, m, v = (torch.randn(40, generator=gen).to(device) for _ in range(4))
    torch.library.opcheck(adamw_step_op, (p, g, m, v.abs(), 1e-3, 0.9, 0.999, 1e-8, 0.01, 1.0))


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda w: TritonAdamW([w], amsgrad=True), TypeError, "amsgrad=True is not supported"),
        (lambda w: TritonAdamW([w], capturable=True), TypeError, "capturable=True is not supported"),
        (lambda w: TritonAdamW([w], nesterov=True), TypeError, "does not take nesterov"),
        (lambda w: TritonAdamW([w], lr=torch.tensor(1e-3)), ValueError, "lr must be a non-negative number"),
        (lambda w: TritonAdamW([w], betas=(0.9, 1.0)), ValueError, "betas must be two numbers"),
        (lambda w: TritonAdamW([w], eps=-1.0), ValueError, "eps must be"),
        (lambda w: TritonAdamW([w], weight_decay=-0.1), ValueError, "weight_decay must be"),
    ],
)
def test_bad_arguments_are_refused(make, error, message, device):
    with pytest.raises(error, match=message):
        make(torch.nn.Parameter(torch.ones(2, device=device)))


@pytest.mark.parametrize("name", ["lr", "eps", "weight_decay", "betas"])
def test_nan_hyperparameters_are_refused_like_torch(name, device):
    # NaN compares false with everything: a `< 0` check lets it through, and one step turns every weight into NaN.
    value = (float("nan"), 0.999) if name == "betas" else float("nan")
    w = torch.nn.Parameter(torch.ones(2, device=device))
    with pytest.raises(ValueError):
        torch.optim.AdamW([w], **{name: value})
    with pytest.raises(ValueError, match=name):
        TritonAdamW([w], **{name: value})


def test_bad_parameters_are_refused(device):
    w = torch.nn.Parameter(torch.ones(4, 6, device=device).t())  # a transposed view: not one flat array
    w.grad = torch.ones_like(w)
    with pytest.raises(ValueError, match="contiguous parameters"):
        TritonAdamW([w]).step()
    c = torch.nn.Parameter(torch.ones(3, dtype=torch.complex64, device=device))
    c.grad = torch.ones_like(c)
    with pytest.raises(TypeError, match="complex"):
        TritonAdamW([c]).step()
    s = torch.nn.Parameter(torch.ones(3, device=device))
    s.grad = torch.ones(3, device=device).to_sparse()
    with pytest.raises(TypeError, match="sparse"):
        TritonAdamW([s]).step()


@pytest.mark.gpu
def test_gpu_8b_sized_tensor_matches_torch_fused(gen):
    # An MLP projection of the 8B shape (58.7M values): every block of the grid written, as torch's fused step does.
    # One step: in later ones a one-spacing difference of the moments (stored in bf16) can tip later roundings.
    p = (torch.randn(14336, 4096, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
    start = p.detach().float().clone()
    twin = p.detach().clone().requires_grad_()
    g = (torch.randn(14336, 4096, device="cuda") * 1e-3).to(torch.bfloat16)
    p.grad, twin.grad = g, g.clone()
    TritonAdamW([p], lr=1e-3).step()
    torch.optim.AdamW([twin], lr=1e-3, fused=True).step()
    ours, theirs = p.detach().float(), twin.detach().float()
    assert within_one_spacing(ours, theirs, start)
    assert (ours == theirs).float().mean() > 0.99
    assert (ours != start).float().mean() > 0.9  # the step moved the values


@pytest.mark.parametrize("preset", ["tiny", "llama-3.2-1b", "llama-3.1-8b"])
def test_benchmark_shapes_are_the_models_parameters(preset):
    from kernels.bench.adamw import parameter_shapes
    from kernels.training.models import count_parameters, llama_config

    assert sum(math.prod(s) for s in parameter_shapes(preset)) == count_parameters(llama_config(preset))


def test_benchmark_runs_and_writes_json(tmp_path, capsys):
    from kernels.bench.adamw import main

    assert main(["--preset", "tiny", "--reps", "1", "--out", str(tmp_path)]) == 0
    result = json.loads(next((tmp_path / "adamw").glob("*.json")).read_text())
    assert [r["impl"] for r in result["rows"]] == ["foreach", "fused", "ours"]
    assert result["check_max_spacings"] <= 1
    assert "ours: TritonAdamW" in capsys.readouterr().out
