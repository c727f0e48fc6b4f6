"""The edges of ``cross_entropy`` and ``TritonCrossEntropyLoss``: every input a caller can pass gives
``F.cross_entropy``'s answer (in float64) or a clear TypeError/ValueError.

The property test draws shapes (0, 1 and odd sizes), dtypes, memory layouts of the logits, the targets and the
incoming gradient, every integer dtype of targets, ignored targets, reductions, normalizers and the in-place
backward; it checks the loss and the gradient. What it found is kept below as plain regression tests.
"""

import math

import pytest
import strategies
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from kernels.cross_entropy import (
    TARGET_DTYPES,
    TritonCrossEntropyLoss,
    cross_entropy,
    cross_entropy_fwd_op,
)
from kernels.reference import relative_error
from kernels.tolerances import RELATIVE_ERROR_TOL as TOL

FP32_TOL = TOL[torch.float32]  # the loss is float32 whatever the logits' dtype


def scaled_error(actual: torch.Tensor, expected: torch.Tensor, *scales: float) -> float:
    """‖actual − expected‖ relative to the largest of ‖expected‖ and ``scales``, the norms of the terms the value
    is a difference of. NaN must sit where the reference has NaN (a mean over no targets), and nowhere else.

    A loss is logsumexp − x[target] and a gradient softmax − onehot: for a confident row both differences cancel
    to almost nothing, which float32 gets right only to a fraction of the terms (the reference is float64). For
    rows that are not near-certain the terms are about as large as the result and this is the relative error; an
    all-zero result still fails it."""
    nan = expected.isnan()
    assert torch.equal(actual.isnan().cpu(), nan.cpu()), "NaN where the reference has none, or none where it has"
    actual, expected = actual.detach().double().cpu()[~nan.cpu()], expected.detach().double().cpu()[~nan.cpu()]
    if not torch.isfinite(actual).all():
        return math.inf
    return (actual - expected).norm().item() / max(expected.norm().item(), *scales, 1e-300)


def loss_terms(rows: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str, divisor,
               grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In float64, for logits ``rows`` [N, V]: per row |logsumexp| + |x[target]|, reduced as the loss is (the
    scale of the loss), and per element (softmax + onehot) · |row factor| (the scale of its gradient)."""
    t = target.reshape(-1).long()
    counted = t != ignore_index
    safe = torch.where(counted, t, 0)
    lse = torch.logsumexp(rows, dim=-1)
    terms = (lse.abs() + rows.gather(1, safe[:, None])[:, 0].abs()) * counted
    factor = counted.double() * grad_output.detach().double().reshape(-1).abs().expand(t.shape)
    if reduction == "mean":
        loss_scale, factor = terms.sum() / counted.sum(), factor / counted.sum()
    elif reduction == "sum":
        loss_scale, factor = terms.sum() / divisor, factor / divisor
    else:
        loss_scale = terms
    onehot = F.one_hot(safe, rows.shape[-1]).double() if t.numel() else torch.zeros_like(rows)
    return loss_scale, (torch.softmax(rows, -1) + onehot) * factor[:, None]


def reference_terms(logits64: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str, divisor,
                    grad_output: torch.Tensor):
    """The norms of what the loss and its gradient are differences of (``scaled_error``), in float64
    (``loss_terms``)."""
    rows = logits64.detach().reshape(-1, logits64.shape[-1])
    loss_scale, grad_terms = loss_terms(rows, target, ignore_index, reduction, divisor, grad_output)
    return loss_scale.norm().item(), grad_terms.norm().item()


def representable(value: int, dtype: torch.dtype) -> bool:
    info = torch.iinfo(dtype)
    return info.min <= value <= info.max


@st.composite
def ce_cases(draw):
    lead = draw(strategies.leading_dims())
    vocab = draw(strategies.sizes(70, allow_zero=False))
    reduction = draw(st.sampled_from(["mean", "sum", "none"]))
    return dict(
        lead=lead, vocab=vocab, dtype=draw(strategies.kernel_dtypes()),
        logits_layout=draw(strategies.layouts()),
        target_layout=draw(strategies.layouts()) if lead else "contiguous",
        flat_target=draw(st.booleans()) and len(lead) == 2,
        target_dtype=draw(st.sampled_from(strategies.INTEGER_DTYPES)),
        ignore_index=draw(st.sampled_from([-100, 0, vocab - 1, 255])),
        n_ignored=draw(st.sampled_from([0, 1, 3, 1000])),
        reduction=reduction,
        normalizer=draw(st.sampled_from([None, "number", "tensor"])) if reduction == "sum" else None,
        inplace=draw(st.booleans()), requires_grad=draw(st.booleans()),
        grad_output=draw(st.sampled_from(["one", "random", "expanded"])),
        scale=draw(st.sampled_from([0.1, 1.0, 4.0])), seed=draw(st.integers(0, 2**31 - 1)),
    )


def make_targets(case, gen, device):
    n_rows = math.prod(case["lead"])
    target = torch.randint(0, case["vocab"], (n_rows,), generator=gen)
    if representable(case["ignore_index"], case["target_dtype"]) and n_rows:
        target[torch.randperm(n_rows, generator=gen)[:case["n_ignored"]]] = case["ignore_index"]
    target = target.to(device, case["target_dtype"])
    if not case["flat_target"]:
        target = target.view(case["lead"])
    return strategies.laid_out(target, case["target_layout"]) if target.dim() else target


def check_against_float64(case, device):
    """Run the case through ``cross_entropy`` and ``F.cross_entropy`` in float64; assert the loss and the gradient
    match (the logits' memory may hold the gradient afterwards: the reference runs first)."""
    gen = torch.Generator().manual_seed(case["seed"])
    shape = (*case["lead"], case["vocab"])
    values = (torch.randn(shape, generator=gen) * case["scale"]).to(device, case["dtype"])
    target = make_targets(case, gen, device)
    ignore_index, reduction = case["ignore_index"], case["reduction"]
    normalizer = {None: None, "number": 7.5, "tensor": torch.tensor([3.0], device=device)}[case["normalizer"]]
    divisor = 1.0 if normalizer is None else float(normalizer)

    leaf64, view64 = strategies.shaped_leaf(values.double(), case["logits_layout"])
    view64.retain_grad()
    loss64 = F.cross_entropy(view64.reshape(-1, case["vocab"]), target.reshape(-1).long(),
                             ignore_index=ignore_index, reduction=reduction) / divisor
    if reduction == "none":
        loss64 = loss64.view(case["lead"])
    go = {"one": torch.ones(loss64.shape), "random": torch.randn(loss64.shape, generator=gen) + 0.5,
          "expanded": torch.full((1,) * loss64.dim(), 0.75).expand(loss64.shape)}[case["grad_output"]]
    go = go.to(device)
    loss64.backward(go.double())
    loss_scale, grad_scale = reference_terms(view64, target, ignore_index, reduction, divisor, go)

    if case["requires_grad"]:
        leaf, logits = strategies.shaped_leaf(values, case["logits_layout"])
    else:
        leaf, logits = None, strategies.shaped_leaf(values, case["logits_layout"])[1].detach()
    loss = cross_entropy(logits, target, ignore_index, reduction, normalizer=normalizer,
                         inplace_backward=case["inplace"])
    assert loss.dtype == torch.float32 and loss.shape == loss64.shape
    err = scaled_error(loss, loss64, loss_scale)
    assert err < FP32_TOL, ("loss", err)
    if leaf is not None:
        loss.backward(go)
        assert leaf.grad is not None and leaf.grad.shape == leaf.shape and leaf.grad.dtype == leaf.dtype
        err = scaled_error(leaf.grad, leaf64.grad, grad_scale, view64.grad.norm().item())
        assert err < TOL[case["dtype"]], ("grad", err)


@given(case=ce_cases())
def test_every_shape_dtype_layout_and_target_matches_float64(case, device):
    check_against_float64(case, device)


# --------------------------------------------------------------------------------------------------------------------
# Regression tests: the cases that were silently wrong
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("target_dtype", strategies.INTEGER_DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_every_integer_target_dtype_gives_the_int64_loss(device, gen, target_dtype, reduction):
    # uint8 targets: the mean divided by the padded block size (the setup kernel's padding, -100 stored as uint8,
    # counted as a target): 2.08 where F.cross_entropy gives 2.77.
    logits = torch.randn(7, 11, generator=gen).to(device)
    target = torch.randint(0, 11, (7,), generator=gen)
    if target_dtype != torch.uint8:
        target[2] = -100
    expected = F.cross_entropy(logits.double(), target.to(device), reduction=reduction)
    xk = logits.clone().requires_grad_()
    loss = cross_entropy(xk, target.to(device, target_dtype), reduction=reduction)
    assert relative_error(loss, expected) < FP32_TOL
    x64 = logits.double().requires_grad_()
    F.cross_entropy(x64, target.to(device), reduction=reduction).sum().backward()
    loss.sum().backward()
    assert relative_error(xk.grad, x64.grad) < FP32_TOL


def test_uint8_targets_mean_over_rows_not_the_block(device, gen):
    logits = torch.randn(7, 11, generator=gen).to(device)
    target = torch.randint(0, 11, (7,), generator=gen).to(device)
    ours = cross_entropy(logits, target.to(torch.uint8))
    assert relative_error(ours, F.cross_entropy(logits.double(), target)) < FP32_TOL


def test_uint8_class_that_wraps_to_ignore_index_is_checked(device):
    # 156 is -100 as a uint8: compared in uint8 it passed the range check as "ignored" although it is a class
    # outside the vocabulary.
    logits = torch.randn(2, 100, device=device)
    target = torch.tensor([156, 3], dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="outside \\[0, 100\\)"):
        cross_entropy(logits, target)


@pytest.mark.parametrize("target_dtype", [torch.uint8, torch.int8])
def test_small_integer_targets_with_ignore_index_they_hold(device, gen, target_dtype):
    logits = torch.randn(9, 30, generator=gen).to(device)
    target = torch.randint(0, 30, (9,), generator=gen)
    target[[1, 4]] = 17
    expected = F.cross_entropy(logits.double(), target.to(device), ignore_index=17)
    ours = cross_entropy(logits, target.to(device, target_dtype), ignore_index=17)
    assert relative_error(ours, expected) < FP32_TOL


@pytest.mark.parametrize("target_dtype", strategies.INTEGER_DTYPES)
def test_out_of_range_targets_of_every_dtype(device, gen, target_dtype):
    # Checked: a ValueError naming the position. Unchecked (no host synchronisation): that row's loss is NaN.
    logits = torch.randn(4, 9, generator=gen).to(device)
    bad = 200 if target_dtype == torch.uint8 else (-5 if target_dtype == torch.int8 else 1000)
    target = torch.tensor([1, bad, 2, 3], device=device).to(target_dtype)
    with pytest.raises(ValueError, match=f"target\\[1\\] = {bad}"):
        cross_entropy(logits, target)
    rows = cross_entropy(logits, target, reduction="none", check_targets=False)
    assert rows[1].isnan() and rows[[0, 2, 3]].isfinite().all()


@pytest.mark.parametrize("shape", [(1,), (3, 1)])
def test_one_class_with_a_strided_last_dimension(device, shape):
    # Found by the property test: .contiguous() keeps the stride of a size-1 dimension, so a copy did not make the
    # rows addressable and the launch got no layout (an AttributeError). Loss and gradient of one class are 0.
    wide = torch.randn(*shape[:-1], 2, device=device)
    logits = wide[..., ::2].requires_grad_()
    target = torch.zeros(shape[:-1], dtype=torch.int64, device=device)
    for inplace in (False, True):
        loss = cross_entropy(logits, target, reduction="sum", inplace_backward=inplace)
        loss.backward()
        assert loss.item() == 0.0 and torch.equal(logits.grad, torch.zeros_like(logits.grad))
        logits.grad = None


def test_overlapping_rows_are_not_written_in_place(device, gen):
    # logits.unfold(...) makes rows that share memory: the in-place backward wrote one row's gradient over the
    # logits of the next before the kernel had read them (a gradient wrong by O(1)).
    base = torch.randn(40, generator=gen).to(device)
    leaf = base.clone().requires_grad_()
    logits = (leaf * 1.0).unfold(0, 8, 2)  # 17 rows of 8, each starting 2 after the previous
    target = torch.randint(0, 8, (logits.shape[0],), generator=gen).to(device)
    base64 = base.double().requires_grad_()
    expected = F.cross_entropy(base64.unfold(0, 8, 2), target)
    expected.backward()
    loss = cross_entropy(logits, target, inplace_backward=True)
    loss.backward()
    assert relative_error(loss, expected) < FP32_TOL
    assert relative_error(leaf.grad, base64.grad) < FP32_TOL


@pytest.mark.parametrize("inplace", [False, True])
def test_permuted_leading_dimensions(device, gen, inplace):
    # [seq, batch, V] read as [batch, seq, V]: two strided levels in the opposite order of memory.
    base = torch.randn(5, 3, 29, generator=gen).to(device)
    target = torch.randint(0, 29, (3, 5), generator=gen).to(device)
    leaf = base.clone().requires_grad_()
    base64 = base.double().requires_grad_()
    expected = F.cross_entropy(base64.permute(1, 0, 2).reshape(-1, 29), target.reshape(-1), reduction="sum")
    expected.backward()
    loss = cross_entropy((leaf * 1.0).permute(1, 0, 2), target, reduction="sum", inplace_backward=inplace)
    loss.backward()
    assert relative_error(loss, expected) < FP32_TOL and relative_error(leaf.grad, base64.grad) < FP32_TOL


def test_shifted_logits_stay_in_place(device, gen):
    # The overlap check must not push the causal LM's shifted view off the in-place path.
    base = torch.randn(2, 5, 33, generator=gen).to(device)
    logits = base.clone().requires_grad_()
    shifted = logits[:, :-1, :]
    target = torch.randint(0, 33, (2, 4), generator=gen).to(device)
    cross_entropy(shifted, target, inplace_backward=True)
    assert not torch.equal(logits.detach()[:, :-1], base[:, :-1])  # the gradient went over the logits


# --------------------------------------------------------------------------------------------------------------------
# Clear errors
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool, torch.complex64, torch.uint16,
                                   torch.uint32, torch.uint64])
def test_targets_that_are_not_class_indices_are_refused(device, dtype):
    assert dtype not in TARGET_DTYPES
    logits = torch.randn(3, 5, device=device)
    with pytest.raises(TypeError, match="^target must hold integer class indices"):
        cross_entropy(logits, torch.ones(3).to(dtype).to(device))


@pytest.mark.parametrize("target_shape", [(4, 3), (12, 1), (11,), (13,), (), (3, 4, 1)])
def test_target_shape_must_match_the_rows(device, target_shape):
    logits = torch.randn(3, 4, 5, device=device)
    with pytest.raises(ValueError, match="^target must have shape \\(3, 4\\)"):
        cross_entropy(logits, torch.zeros(target_shape, dtype=torch.int64, device=device))


def test_float64_logits_are_refused_saying_what_to_do(device):
    with pytest.raises(TypeError, match=r"^logits must be float32, bfloat16 or float16.*\.float\(\)"):
        cross_entropy(torch.randn(3, 5, dtype=torch.float64, device=device), torch.zeros(3, dtype=torch.int64,
                                                                                         device=device))


@pytest.mark.parametrize("kwargs, error, match", [
    ({"reduction": "batchmean"}, ValueError, "reduction"),
    ({"reduction": None}, ValueError, "reduction"),
    ({"ignore_index": -100.0}, TypeError, "ignore_index"),
    ({"ignore_index": True}, TypeError, "ignore_index"),
    ({"normalizer": 4.0}, ValueError, "normalizer"),
    ({"reduction": "none", "normalizer": 4.0}, ValueError, "normalizer"),
    ({"reduction": "sum", "normalizer": torch.ones(2)}, TypeError, "normalizer"),
    ({"reduction": "sum", "normalizer": torch.tensor(True)}, TypeError, "normalizer"),
    ({"reduction": "sum", "normalizer": torch.tensor(2 + 1j)}, TypeError, "normalizer"),
    ({"reduction": "sum", "normalizer": torch.tensor(2.0, requires_grad=True)}, ValueError, "normalizer"),
    ({"ignore_index": 2**64}, ValueError, "ignore_index"),
    ({"inplace_backward": "False"}, TypeError, "inplace_backward"),
    ({"check_targets": 0}, TypeError, "check_targets"),
    ({"label_smoothing": 0.1}, TypeError, "label_smoothing"),
    ({"weight": torch.ones(5)}, TypeError, "weight"),
])
def test_flags_the_op_does_not_implement_are_refused(device, kwargs, error, match):
    logits = torch.randn(3, 5, device=device)
    with pytest.raises(error, match=match):
        cross_entropy(logits, torch.zeros(3, dtype=torch.int64, device=device), **kwargs)


@pytest.mark.parametrize("name, value", [("label_smoothing", 0.1), ("weight", torch.ones(5)),
                                         ("size_average", False), ("reduce", False)])
def test_module_refuses_options_however_set(device, name, value):
    module = TritonCrossEntropyLoss()
    setattr(module, name, value)  # set after construction, as nn.CrossEntropyLoss's attribute of that name
    logits = torch.randn(3, 5, device=device)
    with pytest.raises(ValueError, match=name):
        module(logits, torch.zeros(3, dtype=torch.int64, device=device))
    with pytest.raises(TypeError):
        TritonCrossEntropyLoss(**{name: value})


def test_module_checks_attributes_changed_after_construction(device):
    module = TritonCrossEntropyLoss()
    logits = torch.randn(3, 5, device=device)
    target = torch.zeros(3, dtype=torch.int64, device=device)
    module.reduction = "batchmean"
    with pytest.raises(ValueError, match="reduction"):
        module(logits, target)
    module.reduction, module.ignore_index = "mean", None
    with pytest.raises(TypeError, match="ignore_index"):
        module(logits, target)
    module.ignore_index, module.label_smoothing = -100, 0  # the off values, however written
    assert torch.isfinite(module(logits, target))


# --------------------------------------------------------------------------------------------------------------------
# Zero sizes, meta tensors, FakeTensor
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("lead", [(0,), (2, 0), (0, 3)])
def test_no_rows_give_what_pytorch_gives(device, reduction, lead):
    logits = torch.randn(*lead, 6, device=device, requires_grad=True)
    target = torch.zeros(lead, dtype=torch.int64, device=device)
    expected = F.cross_entropy(logits.detach().double().reshape(-1, 6), target.reshape(-1), reduction=reduction)
    loss = cross_entropy(logits, target, reduction=reduction)
    assert loss.shape == (lead if reduction == "none" else ())
    if reduction == "mean":
        assert loss.isnan() and expected.isnan()
    else:
        assert torch.equal(loss.double().reshape(-1), expected.reshape(-1))
    loss.sum().backward()
    assert logits.grad.shape == logits.shape


def test_no_classes_is_refused(device):
    with pytest.raises(ValueError, match="at least one class"):
        cross_entropy(torch.randn(3, 0, device=device), torch.zeros(3, dtype=torch.int64, device=device))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("inplace", [False, True])
def test_meta_tensors_give_shapes_and_dtypes(reduction, inplace):
    logits = torch.randn(2, 5, 16, device="meta", dtype=torch.bfloat16, requires_grad=True)
    target = torch.zeros(2, 5, dtype=torch.int64, device="meta")
    for check_targets in (True, False):  # nothing to range-check without values
        loss = cross_entropy(logits, target, reduction=reduction, inplace_backward=inplace,
                             check_targets=check_targets)
        assert loss.is_meta and loss.dtype == torch.float32 and loss.shape == ((2, 5) if reduction == "none" else ())
    loss.sum().backward()
    assert logits.grad.is_meta and logits.grad.shape == logits.shape and logits.grad.dtype == logits.dtype
    assert TritonCrossEntropyLoss(reduction=reduction)(logits, target).is_meta


def test_fake_tensor_mode_gives_shapes_and_dtypes(device):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        logits = torch.randn(4, 3, 9, device=device, dtype=torch.float16, requires_grad=True)
        target = torch.zeros(4, 3, dtype=torch.int32, device=device)
        loss = cross_entropy(logits, target, reduction="none")  # check_targets=True: no values to check
        loss.sum().backward()
        assert loss.shape == (4, 3) and loss.dtype == torch.float32
        assert logits.grad.shape == logits.shape and logits.grad.dtype == torch.float16


@pytest.mark.parametrize("target_dtype", strategies.INTEGER_DTYPES)
def test_operator_fake_agrees_with_the_kernel(device, gen, target_dtype):
    logits = torch.randn(3, 7, generator=gen).to(device)
    target = torch.randint(0, 7, (3,), generator=gen).to(device, target_dtype)
    torch.library.opcheck(cross_entropy_fwd_op, (logits, target, -100, "mean", None, None, True),
                          test_utils=("test_schema", "test_faketensor"))
