"""The edges of ``linear_cross_entropy`` and ``TritonLinearCrossEntropyLoss``: every input a caller can pass gives
``F.cross_entropy(hidden @ weight.T)``'s answer (in float64) or a clear TypeError/ValueError.

The property test draws shapes (0, 1 and odd sizes, a hidden size of 0 too), dtypes, memory layouts of the hidden
states, the LM head's weight, the targets and the incoming gradient, every integer dtype of targets, ignored
targets, reductions, normalizers, both plans and which inputs require a gradient; it checks the loss and both
gradients. What it found is kept below as plain regression tests.
"""

import pytest
import strategies
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from test_edges_cross_entropy import loss_terms, make_targets, scaled_error

from kernels import runtime
from kernels.linear_cross_entropy import TritonLinearCrossEntropyLoss, linear_cross_entropy, plan_recompute
from kernels.tolerances import RELATIVE_ERROR_TOL as TOL


def reference_terms(h64, w64, target, ignore_index, reduction, divisor, grad_output):
    """The norms of what the loss and the gradients are sums or differences of (``scaled_error``), in float64:
    the loss as in the cross-entropy's test; d_hidden = G @ W and d_weight = Gᵀ @ H with |G| = (softmax + onehot)
    · |row factor| and |W|, |H| in place of G, W, H. A weight whose rows are all equal (expanded) makes d_hidden
    exactly 0 (each row of G sums to 0), which float32 gives only to a fraction of these terms."""
    h_rows = h64.detach().reshape(target.numel(), h64.shape[-1])
    w = w64.detach()
    loss_scale, g_abs = loss_terms(h_rows @ w.T, target, ignore_index, reduction, divisor, grad_output)
    return (loss_scale.norm().item(), (g_abs @ w.abs()).norm().item(), (g_abs.T @ h_rows.abs()).norm().item())


@st.composite
def lce_cases(draw):
    lead = draw(strategies.leading_dims())
    vocab = draw(strategies.sizes(70, allow_zero=False))
    reduction = draw(st.sampled_from(["mean", "sum", "none"]))
    return dict(
        lead=lead, hidden=draw(strategies.sizes(40)), vocab=vocab, dtype=draw(strategies.kernel_dtypes()),
        hidden_layout=draw(strategies.layouts()), weight_layout=draw(strategies.layouts()),
        target_layout=draw(strategies.layouts()) if lead else "contiguous",
        flat_target=draw(st.booleans()) and len(lead) == 2,
        target_dtype=draw(st.sampled_from(strategies.INTEGER_DTYPES)),
        ignore_index=draw(st.sampled_from([-100, 0, vocab - 1, 255])),
        n_ignored=draw(st.sampled_from([0, 1, 3, 1000])),
        reduction=reduction,
        normalizer=draw(st.sampled_from([None, "number", "tensor"])) if reduction == "sum" else None,
        strategy=draw(st.sampled_from(["auto", "recompute", "chunked"])), keep_logits=draw(st.booleans()),
        grads=draw(st.sampled_from(["both", "hidden", "weight", "none"])),
        grad_output=draw(st.sampled_from(["one", "random", "expanded"])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def make_input(values: torch.Tensor, layout: str, requires_grad: bool):
    """(leaf or None, what the op sees): ``strategies.shaped_leaf``'s view, detached when no gradient is wanted."""
    leaf, view = strategies.shaped_leaf(values, layout)
    return (leaf, view) if requires_grad else (None, view.detach())


def check_against_float64(case, device):
    """Run the case through ``linear_cross_entropy`` and float64 ``F.cross_entropy(h @ W.T)``; assert the loss and
    both gradients match."""
    gen = torch.Generator().manual_seed(case["seed"])
    hidden, vocab = case["hidden"], case["vocab"]
    h_values = torch.randn(*case["lead"], hidden, generator=gen).to(device, case["dtype"])
    w_values = (torch.randn(vocab, hidden, generator=gen) * (2.0 / max(hidden, 1) ** 0.5)).to(device, case["dtype"])
    target = make_targets(case, gen, device)
    ignore_index, reduction = case["ignore_index"], case["reduction"]
    normalizer = {None: None, "number": 7.5, "tensor": torch.tensor(3.0, device=device)}[case["normalizer"]]
    divisor = 1.0 if normalizer is None else float(normalizer)
    grad_h, grad_w = case["grads"] in ("both", "hidden"), case["grads"] in ("both", "weight")

    h_leaf, h = make_input(h_values, case["hidden_layout"], grad_h)
    w_leaf, w = make_input(w_values, case["weight_layout"], grad_w)
    h64_leaf, h64 = make_input(h_values.double(), case["hidden_layout"], True)
    w64_leaf, w64 = make_input(w_values.double(), case["weight_layout"], True)
    h64.retain_grad()
    w64.retain_grad()
    loss64 = F.cross_entropy((h64 @ w64.T).reshape(-1, vocab), target.reshape(-1).long(), ignore_index=ignore_index,
                             reduction=reduction) / divisor
    if reduction == "none":
        loss64 = loss64.view(case["lead"])
    go = {"one": torch.ones(loss64.shape), "random": torch.randn(loss64.shape, generator=gen) + 0.5,
          "expanded": torch.full((1,) * loss64.dim(), 0.75).expand(loss64.shape)}[case["grad_output"]]
    go = go.to(device)
    loss64.backward(go.double())
    loss_scale, dh_scale, dw_scale = reference_terms(h64, w64, target, ignore_index, reduction, divisor, go)

    loss = linear_cross_entropy(h, w, target, ignore_index, reduction, normalizer=normalizer,
                                strategy=case["strategy"], keep_logits=case["keep_logits"])
    assert loss.dtype == torch.float32 and loss.shape == loss64.shape
    tol = TOL[case["dtype"]]  # the logits are rounded to the inputs' dtype by the matmul
    err = scaled_error(loss, loss64, loss_scale)
    assert err < tol, ("loss", err)
    if not (grad_h or grad_w):
        assert loss.grad_fn is None
        return
    loss.backward(go)
    for name, leaf, leaf64, view64, scale in (("d_hidden", h_leaf, h64_leaf, h64, dh_scale),
                                              ("d_weight", w_leaf, w64_leaf, w64, dw_scale)):
        if leaf is None:
            continue
        assert leaf.grad is not None and leaf.grad.shape == leaf.shape and leaf.grad.dtype == leaf.dtype, name
        err = scaled_error(leaf.grad, leaf64.grad, scale, view64.grad.norm().item())
        assert err < tol, (name, err)


@given(case=lce_cases())
def test_every_shape_dtype_layout_and_target_matches_float64(case, device):
    check_against_float64(case, device)


# --------------------------------------------------------------------------------------------------------------------
# Regression tests
# --------------------------------------------------------------------------------------------------------------------


def regression_case(gen, **changes):
    case = dict(lead=(9,), hidden=6, vocab=13, dtype=torch.float32, hidden_layout="contiguous",
                weight_layout="contiguous", target_layout="contiguous", flat_target=False, target_dtype=torch.int64,
                ignore_index=-100, n_ignored=1, reduction="mean", normalizer=None, strategy="auto", keep_logits=True,
                grads="both", grad_output="random", seed=int(torch.randint(0, 2**31 - 1, (), generator=gen)))
    case.update(changes)
    return case


@pytest.mark.parametrize("strategy", ["recompute", "chunked"])
@pytest.mark.parametrize("target_dtype", strategies.INTEGER_DTYPES)
def test_every_integer_target_dtype_gives_the_int64_loss(device, gen, strategy, target_dtype):
    # uint8 targets: the mean divided by the padded block size (relative error 0.44 for loss and both gradients).
    ignore_index = 200 if target_dtype == torch.uint8 else -100
    check_against_float64(regression_case(gen, strategy=strategy, target_dtype=target_dtype,
                                          ignore_index=ignore_index, n_ignored=2), device)


@pytest.mark.parametrize("layout", ["transposed", "strided", "offset"])
def test_weight_layouts_where_d_weight_holds_kept_slices(device, gen, layout):
    # d_weight doubles as the buffer of the first slices' logits, addressed as one flat buffer. It was allocated
    # with the weight's strides (empty_like), so a transposed or strided LM head weight broke it.
    n, hidden, vocab = 64, 64, 1000
    assert plan_recompute(n, hidden, vocab, 4, runtime.device_props(), grad_buffer=True).in_grad > 0 or \
        runtime.MODE == "gpu"
    case = regression_case(gen, lead=(n,), hidden=hidden, vocab=vocab, weight_layout=layout, strategy="recompute",
                           grad_output="one")
    check_against_float64(case, device)


@pytest.mark.parametrize("layout", ["transposed", "expanded", "strided"])
@pytest.mark.parametrize("strategy", ["recompute", "chunked"])
def test_hidden_layouts(device, gen, layout, strategy):
    check_against_float64(regression_case(gen, lead=(4, 5), hidden_layout=layout, strategy=strategy), device)


def test_expanded_weight_rows_give_a_zero_hidden_gradient(device, gen):
    # Every row of the weight equal: every logit of a row is the same, d_hidden is exactly 0 and the loss log V.
    check_against_float64(regression_case(gen, weight_layout="expanded", vocab=17), device)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_hidden_size_zero(device, gen, reduction):
    # hidden @ weight.T is all zeros: every row's loss is log(vocab).
    check_against_float64(regression_case(gen, hidden=0, reduction=reduction), device)


@pytest.mark.parametrize("strategy", ["recompute", "chunked"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_no_tokens(device, gen, strategy, reduction):
    check_against_float64(regression_case(gen, lead=(0, 3), strategy=strategy, reduction=reduction), device)


# --------------------------------------------------------------------------------------------------------------------
# Clear errors
# --------------------------------------------------------------------------------------------------------------------


def _args(device, h_dtype=torch.float32, w_dtype=torch.float32, target=None):
    h = torch.randn(4, 8, device=device).to(h_dtype)
    w = torch.randn(10, 8, device=device).to(w_dtype)
    return h, w, (torch.zeros(4, dtype=torch.int64, device=device) if target is None else target)


@pytest.mark.parametrize("h_dtype, w_dtype, match", [
    (torch.float64, torch.float64, r"^hidden must be float32, bfloat16 or float16.*\.float\(\)"),
    (torch.float32, torch.float64, "same dtype"),
    (torch.bfloat16, torch.float32, "same dtype"),
    (torch.int64, torch.float32, "^hidden must be a floating-point tensor"),
])
def test_dtypes_are_checked(device, h_dtype, w_dtype, match):
    with pytest.raises(TypeError, match=match):
        linear_cross_entropy(*_args(device, h_dtype, w_dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool, torch.uint16, torch.uint64])
def test_targets_that_are_not_class_indices_are_refused(device, dtype):
    with pytest.raises(TypeError, match="^target must hold integer class indices"):
        linear_cross_entropy(*_args(device, target=torch.zeros(4).to(dtype).to(device)))


@pytest.mark.parametrize("shape", [(5,), (3,), (2, 2), (4, 1), ()])
def test_target_shape_must_match_the_tokens(device, shape):
    with pytest.raises(ValueError, match="^target must have shape \\(4,\\)"):
        linear_cross_entropy(*_args(device, target=torch.zeros(shape, dtype=torch.int64, device=device)))


def test_uint8_class_that_wraps_to_ignore_index_is_checked(device):
    h, w, _ = _args(device)
    with pytest.raises(ValueError, match="outside \\[0, 10\\)"):
        linear_cross_entropy(h, w, torch.tensor([156, 1, 2, 3], dtype=torch.uint8, device=device))


@pytest.mark.parametrize("kwargs, error, match", [
    ({"reduction": "batchmean"}, ValueError, "reduction"),
    ({"ignore_index": None}, TypeError, "ignore_index"),
    ({"normalizer": 2.0}, ValueError, "normalizer"),
    ({"strategy": "fastest"}, ValueError, "strategy"),
    ({"check_targets": "yes"}, TypeError, "check_targets"),
    ({"keep_logits": 1}, TypeError, "keep_logits"),
    ({"bias": None}, TypeError, "bias"),
    ({"label_smoothing": 0.1}, TypeError, "label_smoothing"),
])
def test_flags_the_op_does_not_implement_are_refused(device, kwargs, error, match):
    with pytest.raises(error, match=match):
        linear_cross_entropy(*_args(device), **kwargs)


@pytest.mark.parametrize("name, value", [("label_smoothing", 0.1), ("size_average", True), ("reduce", False)])
def test_module_refuses_options_however_set(device, name, value):
    module = TritonLinearCrossEntropyLoss()
    setattr(module, name, value)
    with pytest.raises(ValueError, match=name):
        module(*_args(device))


def test_module_checks_attributes_changed_after_construction(device):
    module = TritonLinearCrossEntropyLoss()
    module.strategy = "fastest"
    with pytest.raises(ValueError, match="strategy"):
        module(*_args(device))
    module.strategy, module.reduction = "auto", "batchmean"
    with pytest.raises(ValueError, match="reduction"):
        module(*_args(device))


# --------------------------------------------------------------------------------------------------------------------
# Meta tensors and FakeTensor
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["recompute", "chunked"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_meta_tensors_give_shapes_and_dtypes(strategy, reduction):
    h = torch.randn(2, 3, 8, device="meta", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(50, 8, device="meta", dtype=torch.bfloat16, requires_grad=True)
    target = torch.zeros(2, 3, dtype=torch.int32, device="meta")
    loss = linear_cross_entropy(h, w, target, reduction=reduction, strategy=strategy)  # check_targets: no values
    assert loss.is_meta and loss.dtype == torch.float32 and loss.shape == ((2, 3) if reduction == "none" else ())
    loss.sum().backward()
    assert h.grad.is_meta and h.grad.shape == h.shape and h.grad.dtype == h.dtype
    assert w.grad.is_meta and w.grad.shape == w.shape and w.grad.dtype == w.dtype


def test_fake_tensor_mode_gives_shapes_and_dtypes(device):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        h = torch.randn(5, 8, device=device, requires_grad=True)
        w = torch.randn(30, 8, device=device, requires_grad=True)
        target = torch.zeros(5, dtype=torch.uint8, device=device)
        loss = linear_cross_entropy(h, w, target)
        loss.backward()
        assert loss.shape == () and h.grad.shape == h.shape and w.grad.shape == w.shape
        assert TritonLinearCrossEntropyLoss(reduction="none")(h, w, target).shape == (5,)

