"""Linear cross-entropy: loss and both gradients against float64 ``F.cross_entropy(h @ W.T)`` for both plans;
reductions, ignored and bad targets, views, the normalizer; the operators (opcheck, compile); bad input; the
8B shape on a GPU."""

import sys

import pytest
import torch
import torch.nn.functional as F

from kernels import runtime
from kernels.linear_cross_entropy import (
    STRATEGIES,
    TritonLinearCrossEntropyLoss,
    choose_strategy,
    chunk_rows,
    linear_cross_entropy,
    plan_recompute,
    slice_width,
)
from kernels.reference import relative_error
from kernels.tolerances import RELATIVE_ERROR_TOL as TOL

PLANS = ["recompute", "chunked"]


def make_case(n_tokens, hidden, vocab, dtype, device, gen, n_ignored=3, lead=None):
    """Hidden states, an LM head's weight (scaled so the logits spread over a few units) and targets with some
    positions ignored."""
    shape = lead or (n_tokens,)
    h = torch.randn(*shape, hidden, generator=gen).to(device, dtype)
    w = (torch.randn(vocab, hidden, generator=gen) * (2.0 / hidden**0.5)).to(device, dtype)
    target = torch.randint(0, vocab, shape, generator=gen)
    flat = target.view(-1)
    flat[torch.randperm(flat.numel(), generator=gen)[:n_ignored]] = -100
    return h, w, target.to(device)


def reference(h, w, target, reduction="mean", grad_output=None, normalizer=None):
    """float64 loss and gradients for the same (already rounded) inputs."""
    h64 = h.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    logits = h64 @ w64.T
    loss = F.cross_entropy(logits.reshape(-1, w.shape[0]), target.reshape(-1), reduction=reduction)
    if reduction == "none":
        loss = loss.view(target.shape)
    if normalizer is not None:
        loss = loss / float(normalizer)
    loss.backward(grad_output.double() if grad_output is not None else torch.ones_like(loss))
    return loss.detach(), h64.grad, w64.grad


def run(h, w, target, grad_output=None, **kwargs):
    hk = h.detach().clone().requires_grad_()
    wk = w.detach().clone().requires_grad_()
    loss = linear_cross_entropy(hk, wk, target, **kwargs)
    loss.backward(grad_output if grad_output is not None else torch.ones_like(loss))
    return loss.detach(), hk.grad, wk.grad


def assert_matches(h, w, target, grad_output=None, **kwargs):
    reduction = kwargs.get("reduction", "mean")
    loss, dh, dw = run(h, w, target, grad_output, **kwargs)
    loss64, dh64, dw64 = reference(h, w, target, reduction, grad_output, kwargs.get("normalizer"))
    assert loss.dtype == torch.float32 and dh.dtype == h.dtype and dw.dtype == w.dtype
    assert dh.shape == h.shape and dw.shape == w.shape
    errors = relative_error(loss, loss64), relative_error(dh, dh64), relative_error(dw, dw64)
    tol = TOL[h.dtype]
    # The loss is float32 whatever the storage dtype; the gradients are stored in it.
    assert errors[0] < (TOL[torch.float32] if h.dtype == torch.float32 else 1e-3), errors
    assert errors[1] < tol and errors[2] < tol, f"relative errors loss, dh, dW = {errors}"


@pytest.mark.parametrize("strategy", PLANS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_matches_float64(device, gen, strategy, dtype, reduction):
    # 53 tokens × 40 wide × 1,037 classes: several slices of the vocabulary and several chunks of tokens, none full.
    h, w, target = make_case(53, 40, 1037, dtype, device, gen)
    assert_matches(h, w, target, reduction=reduction, strategy=strategy)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_reduction_none_with_a_gradient_per_row(device, gen, strategy):
    h, w, target = make_case(29, 24, 700, torch.float32, device, gen)
    go = torch.randn(target.shape, generator=gen).to(device)
    assert_matches(h, w, target, go, reduction="none", strategy=strategy)


@pytest.mark.parametrize("strategy", PLANS)
def test_scaled_loss_scales_both_gradients(device, gen, strategy):
    h, w, target = make_case(31, 32, 500, torch.float32, device, gen)
    assert_matches(h, w, target, torch.tensor(0.37, device=device), strategy=strategy)


def test_many_slices_and_chunks_are_exercised(device):
    # The sizes above must really split: otherwise the online merge across slices is never tested.
    props = runtime.device_props(device)
    assert slice_width(53, 1037, 2, props) < 1037 or not props.interpreter
    assert chunk_rows(53, 1037, 2, props) < 53 or not props.interpreter


@pytest.mark.parametrize("strategy", PLANS)
def test_three_dimensional_and_strided_hidden(device, gen, strategy):
    # A causal LM's h[:, :-1] against labels[:, 1:]: a strided view of [batch, seq, H].
    h, w, labels = make_case(0, 36, 600, torch.float32, device, gen, lead=(3, 11))
    assert_matches(h[:, :-1], w, labels[:, 1:].contiguous(), strategy=strategy)
    assert_matches(h, w, labels, strategy=strategy)


@pytest.mark.parametrize("strategy", PLANS)
def test_normalizer_as_number_and_tensor(device, gen, strategy):
    h, w, target = make_case(40, 16, 300, torch.float32, device, gen)
    assert_matches(h, w, target, reduction="sum", normalizer=23, strategy=strategy)
    assert_matches(h, w, target, reduction="sum", normalizer=torch.tensor(23.0, device=device), strategy=strategy)


@pytest.mark.parametrize("strategy", PLANS)
def test_every_target_ignored_gives_nan_mean_and_zero_gradients(device, gen, strategy):
    h, w, target = make_case(12, 16, 200, torch.float32, device, gen)
    target.fill_(-100)
    loss, dh, dw = run(h, w, target, strategy=strategy)
    assert torch.isnan(loss)
    assert torch.count_nonzero(dh) == 0 and torch.count_nonzero(dw) == 0
    loss, dh, dw = run(h, w, target, reduction="sum", strategy=strategy)
    assert loss.item() == 0.0 and torch.count_nonzero(dw) == 0


@pytest.mark.parametrize("strategy", PLANS)
def test_no_tokens(device, gen, strategy):
    h, w, target = make_case(0, 16, 100, torch.float32, device, gen, n_ignored=0)
    loss, dh, dw = run(h, w, target, strategy=strategy)
    assert torch.isnan(loss) and dh.shape == (0, 16) and torch.count_nonzero(dw) == 0


def test_out_of_range_target_without_check_makes_its_row_nan(device, gen):
    h, w, target = make_case(10, 16, 100, torch.float32, device, gen, n_ignored=0)
    target[4] = 100
    loss = linear_cross_entropy(h, w, target, reduction="none", check_targets=False)
    assert torch.isnan(loss[4]) and torch.isfinite(loss[torch.arange(10, device=device) != 4]).all()
    with pytest.raises(ValueError, match=r"outside \[0, 100\)"):
        linear_cross_entropy(h, w, target)


def test_frozen_weight_and_frozen_hidden(device, gen):
    # LoRA freezes the LM head: no dW is computed, and "auto" picks the chunked plan for it.
    h, w, target = make_case(33, 24, 400, torch.float32, device, gen)
    assert choose_strategy(weight_needs_grad=False, reduction="mean") == "chunked"
    assert choose_strategy(weight_needs_grad=True, reduction="mean") == "recompute"
    assert choose_strategy(weight_needs_grad=False, reduction="none") == "recompute"
    _, dh64, dw64 = reference(h, w, target)
    for strategy in STRATEGIES:
        hk = h.clone().requires_grad_()
        linear_cross_entropy(hk, w, target, strategy=strategy).backward()
        assert relative_error(hk.grad, dh64) < TOL[torch.float32]
        wk = w.clone().requires_grad_()
        linear_cross_entropy(h, wk, target, strategy=strategy).backward()
        assert relative_error(wk.grad, dw64) < TOL[torch.float32]


def test_no_grad_gives_the_loss(device, gen):
    h, w, target = make_case(21, 16, 250, torch.bfloat16, device, gen)
    loss64 = reference(h, w, target)[0]
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, target)
    assert relative_error(loss, loss64) < 1e-3


def test_tied_weight_gradient_adds_both_uses(device, gen):
    # An LM head tied to the embeddings: the shared weight's gradient is the sum of both uses.
    h, w, target = make_case(20, 16, 90, torch.float32, device, gen)
    ids = torch.randint(0, 90, (20,), generator=gen).to(device)
    wk = w.clone().requires_grad_()
    (linear_cross_entropy(h + wk[ids], wk, target)).backward()
    w64 = w.double().requires_grad_()
    F.cross_entropy((h.double() + w64[ids]) @ w64.T, target).backward()
    assert relative_error(wk.grad, w64.grad) < TOL[torch.float32]


def test_module(device, gen):
    h, w, target = make_case(15, 16, 120, torch.float32, device, gen)
    module = TritonLinearCrossEntropyLoss(reduction="sum", strategy="chunked")
    assert "chunked" in repr(module)
    expected = reference(h, w, target, "sum")[0]
    assert relative_error(module(h, w, target), expected) < TOL[torch.float32]
    with pytest.raises(ValueError, match="strategy must be one of"):
        TritonLinearCrossEntropyLoss(strategy="fused")


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda d: (torch.randn(4, 8, device=d), torch.randn(10, 9, device=d), torch.zeros(4, dtype=torch.long,
                                                                                           device=d)),
         ValueError, "must match weight's width 9"),
        (lambda d: (torch.randn(4, 8, device=d), torch.randn(10, 8, device=d, dtype=torch.bfloat16),
                    torch.zeros(4, dtype=torch.long, device=d)), TypeError, "same dtype"),
        (lambda d: (torch.randn(4, 8, device=d), torch.randn(8, device=d), torch.zeros(4, dtype=torch.long, device=d)),
         ValueError, r"\[vocab, hidden\]"),
        (lambda d: (torch.randn(4, 8, device=d), torch.randn(10, 8, device=d), torch.zeros(5, dtype=torch.long,
                                                                                          device=d)),
         ValueError, "one class index per row of hidden"),
        (lambda d: (torch.randn(4, 8, device=d), torch.randn(10, 8, device=d), torch.zeros(4, device=d)),
         TypeError, "integer class indices"),
        (lambda d: (torch.randint(0, 3, (4, 8), device=d), torch.randn(10, 8, device=d),
                    torch.zeros(4, dtype=torch.long, device=d)), TypeError, "floating-point"),
    ],
    ids=["width", "dtype", "weight-1d", "target-shape", "float-target", "int-hidden"],
)
def test_bad_input_is_named(device, make, error, match):
    with pytest.raises(error, match=match):
        linear_cross_entropy(*make(device))


def test_bad_arguments(device, gen):
    h, w, target = make_case(4, 8, 10, torch.float32, device, gen)
    with pytest.raises(ValueError, match="reduction must be one of"):
        linear_cross_entropy(h, w, target, reduction="avg")
    with pytest.raises(ValueError, match="strategy must be one of"):
        linear_cross_entropy(h, w, target, strategy="fused")
    with pytest.raises(ValueError, match="normalizer divides a summed loss"):
        linear_cross_entropy(h, w, target, normalizer=3)


# ---------------------------------------------------------------------------------------------------------------------
# The operators
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("keep, in_grad", [(0, 0), (2, 0), (0, 1), (2, 1)],
                         ids=["none-kept", "two-kept", "one-in-grad", "both"])
def test_opcheck(device, gen, reduction, keep, in_grad):
    # 300 classes in slices of 128: with keep=2 the last two (128 + 44 columns) come from the forward pass; with
    # in_grad=1 the first one, in d_weight's memory (19 × 128 logits past its 128 rows of 16).
    h, w, target = make_case(19, 16, 300, torch.float32, device, gen)
    width = 128
    fwd = torch.ops.kernels.linear_cross_entropy_fwd.default
    # With a slice kept in d_weight's memory, the rest of that buffer is uninitialised until the backward writes it
    # (it is torch.empty_like(weight)), so comparing two runs' outputs bit for bit (the AOT test) cannot apply.
    tests = ("test_schema", "test_autograd_registration", "test_faketensor") + (() if in_grad else
                                                                                ("test_aot_dispatch_dynamic",))
    torch.library.opcheck(fwd, (h, w, target, -100, reduction, None, None, width, keep, in_grad), test_utils=tests)
    loss, lse, scale, kept, grad_buffer = fwd(h, w, target, -100, reduction, None, None, width, keep, in_grad)
    assert kept.numel() == (19 * 172 if keep else 0) and grad_buffer.numel() == (300 * 16 if in_grad else 0)
    go = torch.rand(loss.shape, generator=gen).to(device)
    for need in ((True, True), (True, False), (False, True)):
        if in_grad and not need[1]:
            continue  # slices kept in d_weight's memory come with d_weight wanted
        torch.library.opcheck(torch.ops.kernels.linear_cross_entropy_bwd.default,
                              (go, h, w, target, lse, scale, kept.clone(), grad_buffer.clone(), -100, width, keep,
                               in_grad, *need))
    if reduction != "none":
        torch.library.opcheck(torch.ops.kernels.linear_cross_entropy_chunked.default,
                              (h, w, target, -100, reduction, None, 5.0 if reduction == "sum" else None, True, True,
                               7))


def test_slices_that_do_not_fit_in_d_weight_are_refused(device, gen):
    h, w, target = make_case(19, 16, 300, torch.float32, device, gen)
    fwd = torch.ops.kernels.linear_cross_entropy_fwd.default
    with pytest.raises(ValueError, match="in_grad=2: at most 1"):
        fwd(h, w, target, -100, "mean", None, None, 128, 0, 2)
    with pytest.raises(ValueError, match="in_grad=1: at most 0"):  # every slice is kept in the budget already
        fwd(h, w, target, -100, "mean", None, None, 128, 3, 1)


@pytest.mark.parametrize("strategy", PLANS)
def test_compiled_matches_eager_without_graph_break(device, gen, strategy):
    backend = runtime.COMPILE_BACKEND
    h0, w0, target = make_case(2 * 9, 32, 400, torch.float32, device, gen, lead=(2, 9))
    norm = torch.tensor(13.0, device=device)

    def step(h, w):
        return linear_cross_entropy(torch.tanh(h), w, target, reduction="sum", normalizer=norm, strategy=strategy,
                                    check_targets=False)

    def grads(fn):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss = fn(h, w)
        loss.backward()
        return loss.detach(), h.grad, w.grad

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(step)(h0, w0)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    for a, b in zip(grads(torch.compile(step, backend=backend, fullgraph=True)), grads(step)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------------------------------
# GPU: the Llama-3 vocabulary, memory
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", PLANS)
def test_gpu_llama3_vocabulary_bf16(gen, strategy):
    h, w, target = make_case(2048, 1024, 128_256, torch.bfloat16, "cuda", gen, n_ignored=300)
    assert_matches(h, w, target, strategy=strategy)


@pytest.mark.gpu
@pytest.mark.parametrize("keep_logits", [True, False])
def test_gpu_extra_memory_is_the_budget_not_the_logits(gen, keep_logits):
    from kernels.memory import RECOMPUTE_BUDGET_BYTES

    n, hidden, vocab = 8192, 1024, 128_256
    h, w, target = make_case(n, hidden, vocab, torch.bfloat16, "cuda", gen)
    h.requires_grad_()
    w.requires_grad_()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    linear_cross_entropy(h, w, target, strategy="recompute", keep_logits=keep_logits).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before - h.numel() * 2 - w.numel() * 2  # less the two gradients
    logits_bytes = n * vocab * 2
    # Kept: three of eight slices (760 MB) beside the float32 d_hidden; recomputed: one slice (256 MiB) beside it.
    bound = RECOMPUTE_BUDGET_BYTES + (1 << 20) if keep_logits else logits_bytes / 6
    assert extra < bound, f"{extra / 2**20:.0f} MiB beyond the gradients; the logits are {logits_bytes / 2**20:.0f} MiB"
    assert extra > (logits_bytes / 3 if keep_logits else 0)


def test_computed_extra_memory_of_each_plan():
    from kernels.linear_cross_entropy import linear_loss_extra_bytes
    from kernels.memory import LOGITS_BUFFER_BYTES, RECOMPUTE_BUDGET_BYTES

    n, h, v = 8192, 4096, 128_256
    extra = linear_loss_extra_bytes(n, h, v)
    assert extra["logits_in_place"] == n * v * 2
    assert extra["chunked"] == LOGITS_BUFFER_BYTES + v * h * 4  # the float32 dW accumulator dominates
    assert extra["recompute_all"] == LOGITS_BUFFER_BYTES + n * h * 4 + n * 4
    # Three slices kept: the last (13,568 columns) and two of 16,384, beside the float32 d_hidden.
    assert extra["recompute"] == n * (13_568 + 2 * 16_384) * 2 + n * h * 4 + n * 4
    assert extra["recompute_all"] < extra["recompute"] <= RECOMPUTE_BUDGET_BYTES < 1e9 < extra["chunked"] < extra["hf"]


def test_d_weight_holds_the_first_slices_past_the_rows_written_before_them():
    from kernels.linear_cross_entropy import recompute_layout

    budget, slice_bytes = 896 << 20, 256 << 20
    # The 8B head at 8,192 tokens: slices of 16,384 rows, the last three kept in the budget. Each slice's logits
    # (8,192 × 16,384) take twice its rows of d_weight (16,384 × 4,096); one after another, past the first slice's
    # rows, three fit: three of the five slices that the budget leaves.
    at_8k = recompute_layout(8192, 4096, 128_256, 2, slice_bytes, budget, grad_buffer=True)
    assert (at_8k.keep, at_8k.in_grad) == (3, 3)
    assert at_8k.grad_offsets == [16_384 * 4096 + i * 8192 * 16_384 for i in range(3)]
    end = at_8k.grad_offsets[-1] + 8192 * 16_384
    assert end <= 128_256 * 4096 < end + 8192 * 16_384  # a fourth would not fit
    for (_, stop), offset in zip(at_8k.slices, at_8k.grad_offsets):
        assert offset >= stop * 4096  # past the slice's own rows, which its gradient is written into
    # Shorter sequences need fewer elements per slice than d_weight has rows for it: all slices fit somewhere.
    at_2k = recompute_layout(2048, 4096, 128_256, 2, slice_bytes, 400 << 20, grad_buffer=True)
    assert at_2k.keep + at_2k.in_grad == len(at_2k.slices)
    assert recompute_layout(8192, 4096, 128_256, 2, slice_bytes, budget).in_grad == 0


def test_recompute_layout_spends_the_budget_on_whole_slices():
    from kernels.linear_cross_entropy import recompute_layout

    budget, slice_bytes = 896 << 20, 256 << 20
    at_8k = recompute_layout(8192, 4096, 128_256, 2, slice_bytes, budget)
    assert (at_8k.width, len(at_8k.slices), at_8k.keep, at_8k.kept_start) == (16_384, 8, 3, 128_256 - 46_336)
    at_2k = recompute_layout(2048, 4096, 128_256, 2, slice_bytes, budget)
    assert at_2k.keep == len(at_2k.slices) == 2 and at_2k.kept_start == 0  # every logit fits: 3 matmuls
    assert at_2k.buffer_numel == 2048 * 128_256
    # A budget the float32 d_hidden already fills keeps nothing, and the buffer is one slice.
    none = recompute_layout(8192, 4096, 128_256, 2, slice_bytes, 8192 * 4097 * 4)
    assert none.keep == 0 and none.kept_start == 128_256 and none.buffer_numel == 8192 * 16_384
    # One narrow last slice kept: the buffer still holds a whole slice, which the others pass through.
    narrow = recompute_layout(100, 8, 1000, 4, 100 * 256 * 4, 100 * 9 * 4 + 100 * 232 * 4)
    assert (narrow.keep, narrow.kept_start, narrow.buffer_numel) == (1, 768, 100 * 256)


def test_the_test_sizes_keep_some_slices_and_recompute_others(device):
    # Otherwise the kept and the recomputed paths are never tested together in the interpreter.
    props = runtime.device_props(device)
    for itemsize in (4, 2):
        layout = plan_recompute(53, 40, 1037, itemsize, props)
        assert 0 < layout.keep < len(layout.slices) or not props.interpreter
        assert plan_recompute(53, 40, 1037, itemsize, props, keep_logits=False).keep == 0
    # In float32 with d_weight wanted, the first slice is kept in d_weight's memory: all three places are tested.
    layout = plan_recompute(53, 40, 1037, 4, props, grad_buffer=True)
    assert layout.in_grad == 2 < len(layout.slices) - layout.keep or not props.interpreter
    assert plan_recompute(53, 40, 1037, 4, props, keep_logits=False, grad_buffer=True).in_grad == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_logits_give_the_recomputed_result(device, gen, dtype):
    h, w, target = make_case(53, 40, 1037, dtype, device, gen)
    loss_kept, dh_kept, dw_kept = run(h, w, target, strategy="recompute")
    loss_all, dh_all, dw_all = run(h, w, target, strategy="recompute", keep_logits=False)
    # The same logits either way: the loss and every row of dW are the same bits; dh adds its slices in another order.
    assert torch.equal(loss_kept, loss_all) and torch.equal(dw_kept, dw_all)
    torch.testing.assert_close(dh_kept, dh_all, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-6)


def test_the_weight_gradient_is_the_buffer_that_kept_slices(device, gen, monkeypatch):
    # d_weight is allocated by the forward pass (it holds kept slices until the backward writes it): autograd must
    # take that tensor as the weight's .grad, not a copy (another [V, H] at the peak). Only its address is recorded
    # here: a reference kept by the test would itself make autograd copy it.
    import kernels.linear_cross_entropy  # noqa: F401  (the module, not the function of that name)

    module = sys.modules["kernels.linear_cross_entropy"]
    buffers, forward = [], module.logsumexp_pass

    def recording(*args, **kwargs):
        out = forward(*args, **kwargs)
        buffers.append((out[3].data_ptr(), out[3].numel()))
        return out

    monkeypatch.setattr(module, "logsumexp_pass", recording)
    h, w, target = make_case(53, 40, 1037, torch.float32, device, gen)
    w.requires_grad_()
    linear_cross_entropy(h, w, target, strategy="recompute").backward()
    (address, numel), = buffers
    assert numel == w.numel() or not runtime.device_props(device).interpreter
    assert w.grad.data_ptr() == address or numel == 0


@pytest.mark.parametrize("vocab", [1037, 700], ids=["some-kept", "all-kept"])
def test_a_second_backward_through_kept_logits_is_refused(device, gen, vocab):
    # With every slice kept the backward recomputes nothing into the buffer: only the kernel writes over it.
    h, w, target = make_case(53 if vocab == 1037 else 29, 40 if vocab == 1037 else 24, vocab, torch.float32, device,
                             gen)
    props = runtime.device_props(device)
    layout = plan_recompute(h.shape[0], h.shape[1], vocab, 4, props)
    assert layout.keep == len(layout.slices) if vocab == 700 else (layout.keep < len(layout.slices)
                                                                  or not props.interpreter)
    h.requires_grad_()
    loss = linear_cross_entropy(h, w, target, strategy="recompute")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    loss = linear_cross_entropy(h, w, target, strategy="recompute", keep_logits=False)
    loss.backward(retain_graph=True)
    loss.backward()  # nothing kept, nothing written over: twice is fine
