"""Cross-entropy: loss and gradient against float64 F.cross_entropy; reductions, ignored targets, views, in-place
gradients, bad input; the online-softmax reference and the exercise checks; V = 128,256 on a GPU."""

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F

from kernels import runtime
from kernels.cross_entropy import (
    CrossEntropyConfig,
    TritonCrossEntropyLoss,
    cross_entropy,
    cross_entropy_forward,
    forward_config,
)
from kernels.memory import loss_memory_bytes
from kernels.reference import cross_entropy_hf, online_logsumexp, online_softmax_steps, relative_error
from kernels.tolerances import RELATIVE_ERROR_TOL as TOL

# Relative-error bounds against float64: float32 arithmetic lands near 1e-7; bf16 storage rounds by up to 2**-8.


def make_case(shape, dtype, device, gen, scale=3.0, n_ignored=2, ignore_index=-100):
    """Random logits (spread enough that the softmax is far from uniform) and targets with some rows ignored."""
    if torch.device(device).type == "cuda":  # GPU-sized cases (up to 10 GB of logits) are drawn on the GPU
        cuda_gen = torch.Generator(device=device).manual_seed(int(torch.randint(2**62, (), generator=gen)))
        logits = torch.empty(shape, dtype=dtype, device=device).normal_(generator=cuda_gen).mul_(scale)
    else:
        logits = (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(device)
    target = torch.randint(0, shape[-1], shape[:-1], generator=gen)
    flat = target.view(-1)
    flat[torch.randperm(flat.numel(), generator=gen)[:n_ignored]] = ignore_index
    return logits, target.to(device)


def reference(logits, target, ignore_index=-100, reduction="mean", grad_output=None):
    """float64 F.cross_entropy loss and gradient for the same (already rounded) logits."""
    x64 = logits.detach().double().requires_grad_()
    loss = cross_entropy_hf(x64, target, ignore_index, reduction)
    loss.backward(grad_output.double() if grad_output is not None else torch.ones_like(loss))
    return loss.detach(), x64.grad


def run_kernel(logits, target, grad_output=None, **kwargs):
    """The kernel's loss and gradient (on a fresh leaf copy of the logits, so the caller's tensor survives)."""
    xk = logits.detach().clone().requires_grad_()
    loss = cross_entropy(xk, target, **kwargs)
    loss.backward(grad_output if grad_output is not None else torch.ones_like(loss))
    return loss.detach(), xk.grad


def assert_matches(logits, target, grad_output=None, tol=None, **kwargs):
    reduction = kwargs.get("reduction", "mean")
    loss, grad = run_kernel(logits, target, grad_output, **kwargs)
    loss64, grad64 = reference(logits, target, kwargs.get("ignore_index", -100), reduction, grad_output)
    assert loss.dtype == torch.float32 and grad.dtype == logits.dtype and grad.shape == logits.shape
    tol = tol or TOL[logits.dtype]
    errors = relative_error(loss, loss64), relative_error(grad, grad64)
    assert errors[0] < TOL[torch.float32] and errors[1] < tol, f"relative errors loss, grad = {errors}"


@contextlib.contextmanager
def count_large_allocations(threshold):
    """Record the sizes of tensors of at least ``threshold`` elements created through torch's Python factories."""
    sizes = []
    factories = {name: getattr(torch, name) for name in ("empty", "empty_like", "zeros", "zeros_like", "full")}

    def wrap(factory):
        def recorded(*args, **kwargs):
            out = factory(*args, **kwargs)
            if out.numel() >= threshold:
                sizes.append(out.numel())
            return out
        return recorded

    for name, factory in factories.items():
        setattr(torch, name, wrap(factory))
    try:
        yield sizes
    finally:
        for name, factory in factories.items():
            setattr(torch, name, factory)


# ---------------------------------------------------------------------------------------------------------------------
# Loss and gradient against float64
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("vocab", [1000, 4097, 32003])
def test_matches_float64_reference(vocab, reduction, dtype, device, gen):
    logits, target = make_case((5, vocab), dtype, device, gen)
    grad_output = torch.randn(5, generator=gen).to(device) if reduction == "none" else None
    assert_matches(logits, target, grad_output, reduction=reduction)


@pytest.mark.parametrize("block_v, rows", [(128, 4), (256, 1), (64, 16)])
def test_many_chunks_and_partial_programs(block_v, rows, device, gen):
    # Small explicit chunks: each row spans many chunks, the last one partial; 13 rows leave a partial program.
    logits, target = make_case((13, 1000), torch.float32, device, gen, n_ignored=3)
    config = CrossEntropyConfig(block_v=block_v, rows=rows, num_warps=4)
    loss, lse, grad = cross_entropy_forward(logits, target, reduction="none", config=config)
    loss64, grad64 = reference(logits, target, reduction="none")
    assert relative_error(loss, loss64) < 1e-6
    assert relative_error(lse, torch.logsumexp(logits.double(), dim=-1)) < 1e-6
    assert relative_error(grad, grad64) < TOL[torch.float32]


def test_leading_dimensions(device, gen):
    logits, target = make_case((2, 5, 777), torch.float32, device, gen)
    grad_output = torch.randn(2, 5, generator=gen).to(device)
    assert run_kernel(logits, target, grad_output, reduction="none")[0].shape == (2, 5)
    assert_matches(logits, target, grad_output, reduction="none")
    assert_matches(logits, target.view(-1))  # a flat target for [B, S, V] logits is accepted too


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_huge_logits_are_stable(dtype, device, gen):
    # ±1e4: exp would overflow without the running max; near-one-hot softmax; losses up to ~1e4.
    logits, target = make_case((6, 1500), dtype, device, gen, scale=1e4)
    assert_matches(logits, target)
    assert_matches(logits, target, reduction="none", grad_output=torch.randn(6, generator=gen).to(device))


@pytest.mark.parametrize("ignore_index", [0, 7, -1])
def test_custom_ignore_index(ignore_index, device, gen):
    logits, target = make_case((9, 300), torch.float32, device, gen, n_ignored=3, ignore_index=ignore_index)
    for reduction in ("mean", "sum"):
        assert_matches(logits, target, ignore_index=ignore_index, reduction=reduction)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_targets_ignored(reduction, device, gen):
    # F.cross_entropy: mean over zero counted targets is 0/0 = NaN, sum is 0, none is all zeros; the gradient is
    # all zeros in every case. The kernel must match, and still write the zero gradient rows.
    logits, _ = make_case((4, 500), torch.float32, device, gen)
    target = torch.full((4,), -100, device=device)
    loss, grad = run_kernel(logits, target, reduction=reduction)
    loss64, grad64 = reference(logits, target, reduction=reduction)
    assert torch.equal(loss.isnan(), loss64.isnan()) and (loss.isnan().all() == (reduction == "mean"))
    assert torch.equal(grad, torch.zeros_like(grad)) and torch.equal(grad64, torch.zeros_like(grad64))


def test_single_row(device, gen):
    logits, target = make_case((1, 2049), torch.float32, device, gen, n_ignored=0)
    assert_matches(logits, target)
    # A 1-D row of logits with a 0-d target, as F.cross_entropy accepts.
    assert_matches(logits[0], target[0])


def test_empty_batch(device):
    logits = torch.randn(0, 50, device=device, requires_grad=True)
    target = torch.zeros(0, dtype=torch.int64, device=device)
    assert cross_entropy(logits, target).isnan()  # mean of nothing, as F.cross_entropy
    loss = cross_entropy(logits, target, reduction="sum")
    loss.backward()
    assert loss.item() == 0 and logits.grad.shape == (0, 50)


def test_integer_target_dtypes(device, gen):
    logits, target = make_case((6, 400), torch.float32, device, gen)
    expected = cross_entropy(logits, target)
    assert cross_entropy(logits, target.to(torch.int32)).item() == pytest.approx(expected.item(), rel=1e-6)


def test_loss_is_float32_for_bf16_logits(device, gen):
    logits, target = make_case((3, 333), torch.bfloat16, device, gen)
    assert cross_entropy(logits, target).dtype == torch.float32
    assert cross_entropy(logits, target, reduction="none").dtype == torch.float32


# ---------------------------------------------------------------------------------------------------------------------
# Reductions, normalizer, grad_output ≠ 1
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("as_tensor", [False, True], ids=["number", "tensor"])
def test_normalizer_divides_the_sum(as_tensor, device, gen):
    logits, target = make_case((7, 600), torch.float32, device, gen)
    normalizer = torch.tensor(11.0, device=device) if as_tensor else 11
    loss, grad = run_kernel(logits, target, reduction="sum", normalizer=normalizer)
    loss64, grad64 = reference(logits, target, reduction="sum")
    assert relative_error(loss, loss64 / 11) < 1e-6
    assert relative_error(grad, grad64 / 11) < TOL[torch.float32]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_scaled_loss_backward(reduction, dtype, device, gen):
    # (3 · loss).backward(): the backward kernel must multiply the stored gradient by 3, not skip it.
    logits, target = make_case((6, 900), dtype, device, gen)
    xk = logits.clone().requires_grad_()
    (cross_entropy(xk, target, reduction=reduction) * 3.0).backward()
    _, grad64 = reference(logits, target, reduction=reduction, grad_output=torch.tensor(3.0))
    assert relative_error(xk.grad, grad64) < TOL[dtype]


def test_reduction_none_with_expanded_grad_output(device, gen):
    # loss.sum().backward() hands backward a stride-0 (expanded) gradient of ones; loss.mean() one of 1/N.
    logits, target = make_case((2, 4, 300), torch.float32, device, gen)
    for combine, factor in ((torch.sum, 1.0), (torch.mean, 1 / 8)):
        xk = logits.clone().requires_grad_()
        combine(cross_entropy(xk, target, reduction="none")).backward()
        _, grad64 = reference(logits, target, reduction="sum")
        assert relative_error(xk.grad, grad64 * factor) < TOL[torch.float32]


def test_second_backward_raises(device, gen):
    logits, target = make_case((3, 100), torch.float32, device, gen)
    loss = cross_entropy(logits.clone().requires_grad_(), target)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


# ---------------------------------------------------------------------------------------------------------------------
# Memory layout: in-place gradients, views, copies
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_inplace_backward_writes_into_the_logits(dtype, device, gen):
    logits, target = make_case((10, 2000), dtype, device, gen)
    _, grad64 = reference(logits, target)
    xk = logits.clone().requires_grad_()
    ptr = xk.data_ptr()
    with count_large_allocations(10 * 2000) as big:
        loss = cross_entropy(xk, target, inplace_backward=True)
        loss.backward()
    assert big == [], f"allocated [N, V]-sized tensors: {big}"
    assert xk.grad.data_ptr() == ptr  # the gradient lives in the logits' memory ...
    assert relative_error(xk.detach(), grad64) < TOL[dtype]  # ... and the logits now hold it
    assert relative_error(xk.grad, grad64) < TOL[dtype]


def test_without_inplace_the_logits_survive(device, gen):
    logits, target = make_case((4, 700), torch.float32, device, gen)
    xk = logits.clone().requires_grad_()
    cross_entropy(xk, target).backward()
    assert torch.equal(xk.detach(), logits) and xk.grad.data_ptr() != xk.data_ptr()


def test_shifted_view_without_inplace(device, gen):
    # logits[:, :-1, :] is read in place; the separate, contiguous gradient must still get every row in its place.
    base = (torch.randn(3, 9, 500, generator=gen) * 3).to(device)
    labels = torch.randint(0, 500, (3, 9), generator=gen).to(device)
    leaf = base.clone().requires_grad_()
    loss = cross_entropy(leaf[:, :-1, :], labels[:, 1:])  # a strided view, as a causal LM's shifted logits
    loss.backward()
    loss64, grad64 = reference(base[:, :-1, :], labels[:, 1:])
    assert relative_error(loss, loss64) < 1e-6
    assert relative_error(leaf.grad[:, :-1], grad64) < TOL[torch.float32]
    assert torch.equal(leaf.grad[:, -1], torch.zeros_like(leaf.grad[:, -1]))


def test_shifted_view_inplace_without_copy(device, gen):
    # A causal LM scores token s with the logits at s-1: logits[:, :-1, :] is a view whose rows are not evenly
    # spaced across the batch dimension. It must be used in place, and the gradient must land in the view's memory.
    batch, seq, vocab = 3, 9, 500
    base = (torch.randn(batch, seq, vocab, generator=gen) * 3).to(device)
    labels = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
    labels[0, 3] = -100
    original = base.clone()
    base.requires_grad_()
    shifted = base[:, :-1, :]
    _, grad64 = reference(shifted, labels[:, 1:])
    loss = cross_entropy(shifted, labels[:, 1:], inplace_backward=True)
    loss64, _ = reference(original[:, :-1, :], labels[:, 1:])
    assert relative_error(loss, loss64) < 1e-6
    assert relative_error(base.detach()[:, :-1], grad64) < TOL[torch.float32]  # gradient written in place
    assert torch.equal(base.detach()[:, -1], original[:, -1])  # the last position was not touched
    (loss * 2.0).backward()  # the backward kernel scales the strided in-place gradient
    assert relative_error(base.grad[:, :-1], 2.0 * grad64) < TOL[torch.float32]
    assert torch.equal(base.grad[:, -1], torch.zeros_like(base.grad[:, -1]))


def test_views_that_need_a_copy(device, gen):
    # A transposed last dimension, three unmergeable leading dims and expanded (overlapping) rows are copied:
    # results stay right, and with inplace_backward the caller's logits are left alone (the copy holds the grad).
    wide = (torch.randn(2, 3, 5, 120, generator=gen) * 3).to(device)
    views = {
        "last-dim stride 2": wide[..., ::2],
        "three strided leading dims": wide[:, :2, :-1, :],
        "expanded rows": wide[0, 0, :1, :].expand(4, 120),
    }
    for name, view in views.items():
        target = torch.randint(0, view.shape[-1], view.shape[:-1], generator=gen).to(device)
        before = view.clone()
        loss64, grad64 = reference(view, target)
        for inplace in (False, True):
            xk = view.detach().requires_grad_()  # same memory and strides as the view
            loss = cross_entropy(xk, target, inplace_backward=inplace)
            loss.backward()
            assert relative_error(loss, loss64) < 1e-6 and relative_error(xk.grad, grad64) < TOL[torch.float32], name
            assert torch.equal(xk.detach(), before), name


def test_eval_reads_only_and_allocates_no_gradient(device, gen):
    logits, target = make_case((8, 1200), torch.float32, device, gen)
    before = logits.clone()
    loss64, _ = reference(logits, target)
    with count_large_allocations(8 * 1200) as big, torch.no_grad():
        loss = cross_entropy(logits.requires_grad_(), target, inplace_backward=True)
    assert big == [] and torch.equal(logits.detach(), before)  # nothing written, even with inplace_backward
    assert relative_error(loss, loss64) < 1e-6 and loss.grad_fn is None
    assert cross_entropy_forward(logits.detach(), target, compute_grad=False)[2] is None


def test_module(device, gen):
    logits, target = make_case((5, 321), torch.float32, device, gen)
    for reduction in ("mean", "sum", "none"):
        ours = TritonCrossEntropyLoss(reduction=reduction)(logits, target)
        theirs = torch.nn.CrossEntropyLoss(reduction=reduction)(logits.double(), target)
        assert relative_error(ours, theirs) < 1e-6
    module = TritonCrossEntropyLoss(ignore_index=3, reduction="sum", inplace_backward=True)
    assert repr(module) == "TritonCrossEntropyLoss(ignore_index=3, reduction='sum', inplace_backward=True)"


# ---------------------------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, kwargs, error, message",
    [
        (lambda d: (torch.randn(4, 8, device=d), torch.rand(4, device=d)), {}, TypeError, "target must hold integer"),
        (lambda d: (torch.randn(4, 8, device=d), torch.ones(4, dtype=torch.bool, device=d)), {}, TypeError,
         "torch.bool"),
        (lambda d: (torch.ones(4, 8, dtype=torch.int64, device=d), torch.ones(4, dtype=torch.int64, device=d)), {},
         TypeError, "logits must be a floating-point tensor, got dtype torch.int64"),
        (lambda d: (torch.randn(4, 8, dtype=torch.float64, device=d), torch.ones(4, dtype=torch.int64, device=d)),
         {}, TypeError, "float32, bfloat16 or float16, got dtype torch.float64"),
        (lambda d: (torch.randn(4, 8, device=d), torch.ones(5, dtype=torch.int64, device=d)), {}, ValueError,
         r"target must have shape \(4,\)"),
        (lambda d: (torch.randn(2, 3, 8, device=d), torch.ones(3, 2, dtype=torch.int64, device=d)), {}, ValueError,
         r"or be 1-D with 6 entries, got shape \(3, 2\)"),
        (lambda d: (torch.randn(4, 0, device=d), torch.ones(4, dtype=torch.int64, device=d)), {}, ValueError,
         "at least one class"),
        (lambda d: (torch.randn(4, 8, device=d), torch.ones(4, dtype=torch.int64, device="meta")), {}, ValueError,
         "same device"),
        (lambda d: (torch.randn(4, 8, device=d), torch.ones(4, dtype=torch.int64, device=d)), {"reduction": "avg"},
         ValueError, "reduction must be one of"),
        (lambda d: (torch.randn(4, 8, device=d), torch.ones(4, dtype=torch.int64, device=d)), {"normalizer": 3},
         ValueError, 'with reduction="sum", not \'mean\''),
        (lambda d: (torch.randn(4, 8, device=d), torch.ones(4, dtype=torch.int64, device=d)),
         {"normalizer": "3", "reduction": "sum"}, TypeError, "normalizer must be a number"),
        (lambda d: (torch.randn(4, 8, device=d), torch.ones(4, dtype=torch.int64, device=d)),
         {"ignore_index": -100.0}, TypeError, "ignore_index must be an int"),
        (lambda d: (torch.randn(4, 8, device=d), torch.tensor([1, 8, 2, -100], device=d)), {}, ValueError,
         r"outside \[0, 8\) that is not ignore_index=-100: target\[1\] = 8"),
        (lambda d: (torch.randn(4, 8, device=d), torch.tensor([1, 2, -1, 3], device=d)), {}, ValueError,
         r"target\[2\] = -1"),
    ],
    ids=["float-target", "bool-target", "int-logits", "float64-logits", "row-count", "target-shape", "no-classes",
         "device-mismatch", "bad-reduction", "normalizer-with-mean", "normalizer-type", "float-ignore-index",
         "target-too-large", "target-negative"],
)
def test_bad_input_raises_clear_errors(make, kwargs, error, message, device):
    logits, target = make(device)
    with pytest.raises(error, match=message):
        cross_entropy(logits, target, **kwargs)


def test_unchecked_out_of_range_target_gives_nan_not_a_wrong_number(device, gen):
    # check_targets=False (no host sync): the kernel must not read outside the row, and the bad row shows as NaN.
    logits, target = make_case((5, 256), torch.float32, device, gen, n_ignored=1)
    target[target != -100] = torch.tensor([3, 256, 10_000_000, -5], device=device)
    loss64, grad64 = reference(logits, torch.where((target >= 256) | (target == -5), -100, target), reduction="none")
    xk = logits.clone().requires_grad_()
    loss = cross_entropy(xk, target, reduction="none", check_targets=False)
    bad = (target >= 256) | (target == -5)
    assert loss[bad].isnan().all() and relative_error(loss[~bad], loss64[~bad]) < 1e-6
    loss.sum().backward()
    assert xk.grad[bad].isnan().all() and relative_error(xk.grad[~bad], grad64[~bad]) < TOL[torch.float32]
    assert cross_entropy(logits, target, check_targets=False).isnan()


# ---------------------------------------------------------------------------------------------------------------------
# Launch configuration, memory model
# ---------------------------------------------------------------------------------------------------------------------


def test_forward_config_in_the_interpreter():
    cfg = forward_config(37, 32003, runtime.INTERPRETER)
    assert cfg.block_v == 4096 and cfg.rows * cfg.block_v <= 1 << 18 and cfg.rows >= 37  # one program
    # (GPU configurations, for several chips, are checked in tests/kernels/test_launch_config.py.)


def test_loss_memory_bytes():
    sizes = loss_memory_bytes(16384, 128256)
    assert sizes["bf16 logits"] == 2 * 16384 * 128256 and sizes["fp32 upcast of the logits"] == 4 * 16384 * 128256


# ---------------------------------------------------------------------------------------------------------------------
# The online-softmax reference (chapter 05)
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000, 5000])
def test_online_logsumexp_equals_two_pass(chunk, gen):
    row = torch.randn(1000, generator=gen, dtype=torch.float64) * 20
    assert abs(online_logsumexp(row, chunk).item() - torch.logsumexp(row, 0).item()) < 1e-12
    row32 = row.float() * 10  # up to ~±600: exp would overflow float32 without the running max
    assert math.isfinite(online_logsumexp(row32, chunk).item())
    assert relative_error(online_logsumexp(row32, chunk), torch.logsumexp(row32.double(), 0)) < 1e-6


def test_online_softmax_steps_states(gen):
    row = torch.randn(50, generator=gen, dtype=torch.float64) * 4
    steps = online_softmax_steps(row, 16)
    assert [(s.chunk, s.start, s.stop) for s in steps] == [(0, 0, 16), (1, 16, 32), (2, 32, 48), (3, 48, 50)]
    assert steps[0].max_before == -math.inf and steps[0].rescale == 0.0
    for prev, step in zip(steps, steps[1:]):
        assert step.max_before == prev.max_after
        assert step.max_after == max(prev.max_after, step.chunk_max)
        assert step.rescale == pytest.approx(math.exp(step.max_before - step.max_after), rel=1e-12)
    for step in steps:  # every state is the exact logsumexp of the prefix seen so far
        assert step.chunk_max == row[step.start:step.stop].max().item()
        assert step.logsumexp == pytest.approx(torch.logsumexp(row[: step.stop], 0).item(), rel=1e-12)
    with pytest.raises(ValueError, match="1-D"):
        online_softmax_steps(row.view(5, 10), 4)
    with pytest.raises(ValueError, match="positive"):
        online_softmax_steps(row, 0)


# ---------------------------------------------------------------------------------------------------------------------
# GPU: V = 128,256 (Llama 3), past the int32 offset limit, poisoned buffers, no host sync, real memory
# ---------------------------------------------------------------------------------------------------------------------

LLAMA3_VOCAB = 128_256


def rowwise_reference(logits, target, rows):
    """float64 loss and mean-reduction gradient numerator (softmax − onehot) for a few rows only."""
    x = logits[rows].double()
    t = target[rows]
    counted = t != -100
    p = torch.softmax(x, -1)
    onehot = F.one_hot(t.clamp(min=0), x.shape[-1]).double() * counted[:, None]
    loss = (torch.logsumexp(x, -1) - x.gather(1, t.clamp(min=0)[:, None])[:, 0]) * counted
    return loss, (p - onehot) * counted[:, None]


@pytest.mark.gpu
@pytest.mark.parametrize("n_rows", [16_384, 40_000])
def test_gpu_llama3_vocab_bf16(n_rows, gen):
    # 40,000 × 128,256 = 5.1e9 logits, past 2**31: row offsets must be int64. The bf16 logits alone are 10 GB, so
    # the float64 reference is computed for sampled rows only, including the last ones.
    logits, target = make_case((n_rows, LLAMA3_VOCAB), torch.bfloat16, "cuda", gen, n_ignored=n_rows // 10)
    rows = torch.tensor([0, 1, 8191, 16_743, 16_744, 16_745, n_rows - 3, n_rows - 2, n_rows - 1], device="cuda")
    rows = rows[rows < n_rows]
    n_valid = (target != -100).sum()
    loss_rows = cross_entropy(logits, target, reduction="none")
    loss64, gradnum64 = rowwise_reference(logits, target, rows)
    assert relative_error(loss_rows[rows], loss64) < 1e-5
    # The mean against a float64 sum over row blocks (the whole float64 matrix would not fit comfortably).
    total = sum(cross_entropy_hf(block.double(), t, reduction="sum") for block, t in
                zip(logits.split(2048), target.split(2048)))
    xk = logits.requires_grad_()
    loss = cross_entropy(xk, target, inplace_backward=True)  # the logits become the gradient: no second 10 GB
    assert relative_error(loss, total / n_valid) < 1e-5
    assert relative_error(xk.detach()[rows].double() * n_valid, gradnum64) < TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_gpu_every_gradient_element_written(reduction, gen, monkeypatch):
    # Poison: torch.empty hands out NaN-filled memory, so any element the kernel forgets (ignored rows included)
    # stays NaN. 4097 rows: not a multiple of anything.
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    logits, target = make_case((4097, LLAMA3_VOCAB), torch.bfloat16, "cuda", gen, n_ignored=500)
    monkeypatch.setattr(torch, "empty", poisoned_empty)
    xk = logits.clone().requires_grad_()
    loss = cross_entropy(xk, target, reduction=reduction)
    loss.backward(torch.ones_like(loss) * 2.0)
    monkeypatch.undo()
    assert torch.isfinite(loss).all() and torch.isfinite(xk.grad).all(), "unwritten (NaN) elements"
    rows = torch.tensor([0, 17, 4096], device="cuda")
    _, gradnum64 = rowwise_reference(logits, target, rows)
    scale = 2.0 / (target != -100).sum() if reduction == "mean" else 2.0
    assert relative_error(xk.grad[rows], gradnum64 * scale) < TOL[torch.bfloat16]


@pytest.mark.gpu
def test_gpu_no_host_sync_and_no_extra_memory(gen):
    # With check_targets=False the forward and backward must not synchronise with the host (CUDA graphs,
    # torch.compile); with inplace_backward the loss must need no [N, V] memory at all.
    logits, target = make_case((8192, LLAMA3_VOCAB), torch.bfloat16, "cuda", gen, n_ignored=100)
    cross_entropy(logits[:64].clone().requires_grad_(), target[:64], inplace_backward=True).backward()  # compile
    xk = logits.requires_grad_()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = cross_entropy(xk, target, inplace_backward=True, check_targets=False, normalizer=None)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert extra < 8 << 20, f"extra peak memory {extra / 2**20:.1f} MiB: an [N, V] buffer was allocated"
    assert xk.grad.data_ptr() == xk.data_ptr() and torch.isfinite(loss)
