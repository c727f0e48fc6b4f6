"""The patched model's loss at its edges: labels of every integer dtype, shape and layout, ignore_index,
num_items_in_batch, shift_labels, float64 logits.

``causal_lm_loss`` (what ``patch_llama`` installs as ``model.loss_function``) is compared with Hugging Face's
``ForCausalLMLoss`` computed in float64 from the same logits and the labels read as int64; labels whose shape does
not match the logits' leading dimensions, bool or floating labels and float64 logits raise a clear error.
"""

from __future__ import annotations

import math

import pytest
import strategies
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers.loss.loss_utils import ForCausalLMLoss

from kernels import patch_llama
from kernels.hf.patch import causal_lm_linear_loss, causal_lm_loss
from kernels.reference import relative_error
from kernels.tolerances import RELATIVE_ERROR_TOL as TOL


def _labels(shape, vocab, dtype, ignore_index, gen, device):
    """Random token ids below ``vocab`` (and what ``dtype`` holds), about a quarter of them ``ignore_index`` where the
    dtype can hold it."""
    high = min(vocab, torch.iinfo(dtype).max + 1)
    labels = torch.randint(0, high, shape, generator=gen)
    lo, hi = torch.iinfo(dtype).min, torch.iinfo(dtype).max
    if lo <= ignore_index <= hi:
        labels[torch.rand(shape, generator=gen) < 0.25] = ignore_index
    return labels.to(device, dtype)


def _assert_loss_matches(ours, ref, dtype):
    if math.isnan(ref.item()):
        assert math.isnan(ours.item())  # every label ignored: 0 / 0, as PyTorch
    elif math.isinf(ref.item()):
        assert ours.item() == ref.item()  # num_items_in_batch = 0
    else:
        assert relative_error(ours, ref) < TOL[dtype]


@given(
    batch=strategies.sizes(3, allow_zero=False), seq=strategies.sizes(9, allow_zero=False),
    vocab=st.integers(2, 300), dtype=strategies.kernel_dtypes(),
    label_dtype=st.sampled_from(strategies.INTEGER_DTYPES), ignore_index=st.sampled_from([-100, -1, 0, 5]),
    given_as=st.sampled_from(["labels", "shift_labels", "shift_labels_flat"]),
    label_layout=strategies.layouts(), logits_layout=st.sampled_from(["contiguous", "strided", "offset"]),
    num_items=st.sampled_from([None, "int", "tensor", "tensor1", "zero"]), seed=st.integers(0, 2**31 - 1),
)
def test_loss_and_gradient_match_hugging_face_in_float64(batch, seq, vocab, dtype, label_dtype, ignore_index,
                                                         given_as, label_layout, logits_layout, num_items, seed,
                                                         device):
    gen = torch.Generator().manual_seed(seed)
    logits_values = (torch.randn(batch, seq, vocab, generator=gen) * 3).to(device, dtype)
    leaf, logits = strategies.shaped_leaf(logits_values, logits_layout)
    labels = _labels((batch, seq), vocab, label_dtype, ignore_index, gen, device)
    counted = int((torch.nn.functional.pad(labels.long(), (0, 1), value=ignore_index)[..., 1:] != ignore_index).sum())
    n_items = {None: None, "int": counted + 3, "tensor": torch.tensor(counted + 3, device=device),
               "tensor1": torch.tensor([counted + 1.5], device=device), "zero": 0}[num_items]
    if given_as == "labels":
        kwargs = dict(labels=strategies.laid_out(labels, label_layout))
    else:
        shifted = torch.nn.functional.pad(labels.long(), (0, 1), value=ignore_index)[..., 1:]
        if not torch.iinfo(label_dtype).min <= ignore_index <= torch.iinfo(label_dtype).max:
            shifted[..., -1] = 1  # uint8 cannot say "ignored": a real target there instead
            counted = int((shifted != ignore_index).sum())
            n_items = n_items if n_items is None or num_items == "zero" else counted + 2
        shifted = shifted.to(label_dtype)
        shifted = shifted.reshape(-1) if given_as == "shift_labels_flat" else shifted
        kwargs = dict(labels=None, shift_labels=strategies.laid_out(shifted.contiguous(), label_layout))

    loss = causal_lm_loss(logits, vocab_size=vocab, num_items_in_batch=n_items, ignore_index=ignore_index, **kwargs)
    assert loss.dtype == torch.float32

    leaf64, logits64 = strategies.shaped_leaf(logits_values.double(), logits_layout)
    ref_kwargs = {k: (v.long().contiguous() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    ref = ForCausalLMLoss(logits64, vocab_size=vocab, num_items_in_batch=n_items, ignore_index=ignore_index,
                          **ref_kwargs)
    assert loss.shape == ref.shape  # a [1] num_items_in_batch gives a [1] loss, as Hugging Face's does
    _assert_loss_matches(loss, ref, dtype)
    if torch.isfinite(ref).all():
        loss.sum().backward()
        ref.sum().backward()
        # The gradient is (softmax − one_hot) / divisor: near a confident target the two nearly cancel, so the error
        # is measured against the size of both terms, ‖grad‖ + 2·‖one_hot‖ / divisor.
        divisor = float(n_items) if n_items is not None else max(counted, 1)
        scale = leaf64.grad.norm().item() + 2 * math.sqrt(counted) / divisor
        assert (leaf.grad.double() - leaf64.grad).norm().item() <= TOL[dtype] * scale


# ---- labels that used to pair tokens with the wrong positions, silently ------------------------------------------


@pytest.mark.parametrize("bad", ["transposed", "flattened", "one_longer", "extra_dim"])
def test_labels_of_another_shape_are_refused(bad, device, gen):
    # [seq, batch] labels and [batch * seq] labels have as many elements as [batch, seq]; Hugging Face's loss shifts
    # them along their own last dimension and flattens, pairing tokens with the wrong positions without a word.
    logits = torch.randn(2, 5, 11, generator=gen).to(device)
    labels = torch.randint(0, 11, (2, 5), generator=gen).to(device)
    wrong = {"transposed": labels.t().contiguous(), "flattened": labels.reshape(-1),
             "one_longer": torch.randint(0, 11, (2, 6), generator=gen).to(device),
             "extra_dim": labels.unsqueeze(0)}[bad]
    with pytest.raises(ValueError, match=r"labels must have the shape of the logits without their last dimension"):
        causal_lm_loss(logits, wrong, 11)
    with pytest.raises(ValueError, match=r"labels must have the shape of the logits without their last dimension"):
        causal_lm_linear_loss(torch.randn(2, 5, 4).to(device), torch.randn(11, 4).to(device), wrong)


def test_transposed_shift_labels_are_refused_and_flat_ones_accepted(device, gen):
    logits = torch.randn(2, 5, 11, generator=gen).to(device)
    shifted = torch.randint(0, 11, (2, 5), generator=gen).to(device)
    with pytest.raises(ValueError, match="shift_labels must have the shape"):
        causal_lm_loss(logits, None, 11, shift_labels=shifted.t().contiguous())
    flat = causal_lm_loss(logits, None, 11, shift_labels=shifted.reshape(-1))
    assert flat.item() == causal_lm_loss(logits, None, 11, shift_labels=shifted).item()


@pytest.mark.parametrize("label_dtype", strategies.INTEGER_DTYPES)
def test_every_integer_label_dtype_gives_the_int64_loss(label_dtype, device, gen):
    # uint8 labels used to fail inside the shift (-100 does not fit); int8/16/32 are read as the same ids.
    logits = torch.randn(2, 6, 50, generator=gen).to(device)
    labels = torch.randint(0, 50, (2, 6), generator=gen).to(device)
    if label_dtype != torch.uint8:
        labels[0, :2] = -100
    ours = causal_lm_loss(logits, labels.to(label_dtype), 50)
    ref = ForCausalLMLoss(logits.double(), labels.long(), 50)
    assert relative_error(ours, ref) < TOL[torch.float32]


@pytest.mark.parametrize("labels", [lambda t: t.float(), lambda t: t > 3, lambda t: t.tolist()])
def test_labels_that_are_not_integer_tensors_are_refused(labels, device, gen):
    ids = torch.randint(0, 11, (2, 5), generator=gen).to(device)
    with pytest.raises(TypeError, match="labels must"):
        causal_lm_loss(torch.randn(2, 5, 11).to(device), labels(ids), 11)


def test_a_non_integer_ignore_index_is_refused(device):
    with pytest.raises(TypeError, match="ignore_index must be an integer, got -100.0"):
        causal_lm_loss(torch.randn(2, 5, 11).to(device), torch.zeros(2, 5, dtype=torch.long, device=device), 11,
                       ignore_index=-100.0)


def test_float64_logits_are_refused_with_what_to_do(device):
    with pytest.raises(TypeError, match=r"logits must be float32.*model.float\(\).*cross_entropy=False"):
        causal_lm_loss(torch.randn(2, 5, 11, dtype=torch.float64).to(device),
                       torch.zeros(2, 5, dtype=torch.long, device=device), 11)
    with pytest.raises(TypeError, match=r"hidden must be float32.*linear_cross_entropy=False"):
        causal_lm_linear_loss(torch.randn(2, 5, 4, dtype=torch.float64).to(device), torch.randn(11, 4).to(device),
                              torch.zeros(2, 5, dtype=torch.long, device=device))


# ---- the patched model ---------------------------------------------------------------------------------------------


def _tiny_llama(device):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                         use_cache=False)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        return LlamaForCausalLM(config).train()


def test_patched_model_loss_with_int32_labels_and_num_items_matches_hugging_face(device, gen):
    model = _tiny_llama(device)
    ids = torch.randint(0, 61, (2, 7), generator=gen).to(device)
    labels = ids.clone()
    labels[:, :3] = -100
    expected = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(9, device=device)).loss
    with patch_llama(model, kernels=("cross_entropy",), inplace_logits=False):
        for dtype in (torch.int32, torch.int64):
            got = model(input_ids=ids, labels=labels.to(dtype), num_items_in_batch=torch.tensor(9, device=device)).loss
            assert relative_error(got, expected.double()) < TOL[torch.float32]
        with pytest.raises(ValueError, match="labels must have the shape"):
            model(input_ids=ids, labels=labels.t().contiguous())


def test_patched_float64_model_is_refused_not_approximated(device, gen):
    model = _tiny_llama(device).double()
    ids = torch.randint(0, 61, (1, 5), generator=gen).to(device)
    with patch_llama(model, kernels=("cross_entropy",)):
        with pytest.raises(TypeError, match="float64"):
            model(input_ids=ids, labels=ids)


def test_patched_loss_function_never_overwrites_a_callers_leaf_logits(device, gen):
    # In train mode the patched loss writes the logits' gradient over the logits (they exist for the loss alone in
    # a model's forward). Logits a caller hands to model.loss_function themselves, a leaf or a view of one, are theirs.
    model = _tiny_llama(device)
    labels = torch.randint(0, 61, (2, 5), generator=gen).to(device)
    with patch_llama(model, kernels=("cross_entropy",)):
        for make in (lambda t: t, lambda t: t.view(2, 5, 61)):
            leaf = torch.randn(10, 61, generator=gen).to(device).view(2, 5, 61).clone().requires_grad_()
            before = leaf.detach().clone()
            loss = model.loss_function(make(leaf), labels, 61)
            loss.backward()
            assert torch.equal(leaf.detach(), before)
            leaf64 = before.double().requires_grad_()
            ForCausalLMLoss(leaf64, labels, 61).backward()
            assert relative_error(leaf.grad, leaf64.grad) < TOL[torch.float32]
