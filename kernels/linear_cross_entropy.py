"""The loss without the logits: cross-entropy of ``hidden @ weight.T`` that never holds a [tokens,
vocab] tensor.

A causal LM's last layer multiplies each token's hidden state h (width H) by the output embedding W
([V, H]) to get V logits, and the loss only wants, per token, logsumexp(h · Wᵀ) − h · W[t]. At Llama
3's V = 128,256 those logits are the largest activation of a fine-tuning step (8,192 tokens: 2.1 GB
in bf16, before any float32 copy or gradient).

Two ways to get the loss and both gradients without them, both here:

**"recompute"** (vocabulary slices; the default whenever ``weight`` needs a gradient). The forward
pass walks W in slices of ``slice_width`` rows: one matmul gives the logits of every token for that
slice ([tokens, slice]), and a Triton kernel folds them into each token's running max and rescaled
sum, the online softmax of chapter 05 with a whole matmul per step instead of a chunk of a row. It
keeps one float32 logsumexp per token. The backward pass walks the slices again: the matmul
recomputes the slice's logits, a Triton kernel overwrites them with the gradient (softmax − onehot)
· scale, and two matmuls turn that into this slice's rows of dW (float32 accumulation over every
token inside one matmul, rounded once) and its share of dh (accumulated in a float32 [tokens, H]
buffer). Recomputing everything costs 4 matmuls of 2·tokens·V·H FLOP where the unfused loss does 3,
for one slice of logits and the float32 dh of memory. So the plan spends a fixed budget instead
(``RECOMPUTE_BUDGET_BYTES``, 896 MiB on a GPU): beside the float32 dh it keeps as many slices from
the forward pass as fit, and the backward recomputes only the others. It also keeps the first slices
in the memory of d_weight, which the step holds anyway and the backward pass writes one slice of
rows at a time (``RecomputeLayout``). At 2,048 and 4,096 tokens of Llama 3's head nothing is
recomputed (3 matmuls); at 8,192, two slices of eight (3.26 matmuls).

**"chunked"** (token chunks, the gradient during the forward; the default when ``weight`` is frozen,
e.g. LoRA). For each chunk of tokens, one matmul makes its full rows of logits, the package's
cross-entropy kernel writes their gradient over them, and one matmul gives that chunk's dh. When dW
is needed it is accumulated over the chunks in a float32 [V, H] buffer (2.1 GB at the 8B shape):
that buffer, not the logits, is then the memory cost, so with a trainable weight "recompute" is the
better plan unless tokens ≫ 2·H. With a frozen weight "chunked" needs 2 matmuls to "recompute"'s 3
and no buffer beyond a chunk of logits.

Both follow ``kernels.cross_entropy``'s semantics exactly (reductions, ``ignore_index``, NaN for a
mean over no targets, ``normalizer`` for gradient accumulation, NaN rows for out-of-range targets
when unchecked), return a float32 loss, and never synchronise with the host unless ``check_targets``
asks for it. The launches are PyTorch operators (``torch.ops.kernels.linear_cross_entropy_*``), so
``torch.compile`` sees each as one node.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import ops, runtime
from .cross_entropy import (
    check_flags,
    check_loss_args,
    check_options_off,
    check_scores,
    check_target_range,
    cross_entropy_forward,
    gradient_scale,
    normalizer_arg,
    reduce_loss_kernel,
    split_normalizer,
)
from .memory import FP32, LOGITS_BUFFER_BYTES, RECOMPUTE_BUDGET_BYTES, hf_loss_buffers, hf_loss_peak
from .triton_utils import cast_to

STRATEGIES = ("auto", "recompute", "chunked")

# --------------------------------------------------------------------------------------------------
# Kernels: one slice of logits at a time ([rows, n_cols] contiguous, columns col_start ... col_start
# + n_cols of V)
# --------------------------------------------------------------------------------------------------


@triton.jit
def _lse_slice_kernel(
    LOGITS, TARGET, M, S, TARGET_LOGIT, LOSS, LSE,
    n_rows, n_cols, col_start, vocab, ignore_index,
    ROWS: tl.constexpr, BLOCK_V: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr,
):
    # Fold one slice of every row's logits into the row's running max m and rescaled sum s (float32,
    # [rows]); after the last slice, write loss = logsumexp − x[target] and the logsumexp. Slices
    # are separate launches that run in order on one stream, so each row's m and s are read and
    # written by one program at a time.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    # lanes past the end re-read the last row; nothing of theirs is stored
    rows_in = tl.minimum(rows, n_rows - 1)
    if FIRST:
        m = tl.full((ROWS,), float("-inf"), tl.float32)
        s = tl.zeros((ROWS,), tl.float32)
    else:
        m = tl.load(M + rows_in)
        s = tl.load(S + rows_in)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(LOGITS + rows_in[:, None] * n_cols + cols[None, :], mask=(cols < n_cols)[None, :],
                    other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=1))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new[:, None]), axis=1)
        m = m_new

    # The target's logit lives in exactly one slice: the program that sees it there stores it.
    target = tl.load(TARGET + rows_in).to(tl.int64)
    local = target - col_start
    here = (local >= 0) & (local < n_cols)
    x_t = tl.load(LOGITS + rows_in * n_cols + local, mask=here, other=0.0).to(tl.float32)
    tl.store(TARGET_LOGIT + rows, x_t, mask=row_ok & here)

    if LAST:
        counted = target != ignore_index
        bad = counted & ((target < 0) | (target >= vocab))  # never read: its loss (and gradient) is NaN
        # A target in this last slice is in registers; one in an earlier slice was stored by an
        # earlier launch.
        x_t = tl.where(here, x_t, tl.load(TARGET_LOGIT + rows_in, mask=counted & ~bad & ~here, other=0.0))
        log_s = tl.log(s)
        # (m − x_t) + log(s): the large numbers cancel first, as in the cross-entropy kernel.
        loss = tl.where(counted, (m - x_t) + log_s, 0.0)
        tl.store(LOSS + rows, tl.where(bad, float("nan"), loss), mask=row_ok)
        tl.store(LSE + rows, m + log_s, mask=row_ok)
    else:
        tl.store(M + rows, m, mask=row_ok)
        tl.store(S + rows, s, mask=row_ok)


@triton.jit
def _grad_slice_kernel(
    LOGITS, TARGET, LSE, SCALE, GRAD_OUT,
    n_rows, n_cols, col_start, vocab, ignore_index, stride_go,
    ROWS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # Overwrite one slice of logits with d(loss)/d(logits) = (softmax − onehot) · grad_output ·
    # SCALE[0]: the logsumexp of each row is already known, so every element is computed from its
    # own logit alone.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    rows_in = tl.minimum(rows, n_rows - 1)
    target = tl.load(TARGET + rows_in).to(tl.int64)
    counted = target != ignore_index
    bad = counted & ((target < 0) | (target >= vocab))
    go = tl.load(GRAD_OUT + rows_in * stride_go).to(tl.float32)  # stride 0: one scalar for every row
    row_scale = tl.where(counted, go * tl.load(SCALE), 0.0)
    row_scale = tl.where(bad, float("nan"), row_scale)
    lse = tl.load(LSE + rows_in)
    local = target - col_start
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        ok = row_ok[:, None] & (cols < n_cols)[None, :]
        ptrs = LOGITS + rows_in[:, None] * n_cols + cols[None, :]
        x = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
        p = tl.exp(x - lse[:, None])
        onehot = tl.where(cols[None, :] == local[:, None], 1.0, 0.0)
        tl.store(ptrs, cast_to((p - onehot) * row_scale[:, None], LOGITS.dtype.element_ty), mask=ok)


# --------------------------------------------------------------------------------------------------
# Launch configuration: how wide a slice (or how long a chunk) is, and how the slice kernels are
# launched
# --------------------------------------------------------------------------------------------------

# The largest [tokens, slice] (or [chunk, V]) buffer of logits, in bytes, on a GPU: 256 MiB keeps
# the matmuls large (8,192 tokens: slices of 16,384 rows of W) and the extra memory a small share of
# the logits' (2 GB there).
GPU_SLICE_BYTES = LOGITS_BUFFER_BYTES
# What "recompute" may keep beyond its inputs and gradients (memory.RECOMPUTE_BUDGET_BYTES on a
# GPU).
GPU_RECOMPUTE_BYTES = RECOMPUTE_BUDGET_BYTES
# In the interpreter shapes are tiny: a few slices per row still show the online merge at work, and
# the budget keeps some of them and recomputes the others.
INTERPRETER_SLICE_BYTES = 64 << 10
INTERPRETER_RECOMPUTE_BYTES = 96 << 10
_INTERPRETER_MAX_TILE = 1 << 16


@dataclass(frozen=True)
class SliceConfig:
    """How the slice kernels are launched on a [rows, width] slice of logits."""

    rows: int  # rows per program
    block_v: int  # logits per chunk of a row
    num_warps: int


def _slice_bytes(props: runtime.DeviceProps) -> int:
    return INTERPRETER_SLICE_BYTES if props.interpreter else GPU_SLICE_BYTES


def _width_within(n_rows: int, vocab: int, itemsize: int, slice_bytes: int) -> int:
    width = slice_bytes // max(n_rows * itemsize, 1)
    return max(1, min(vocab, max(256, width // 256 * 256)))


def slice_width(n_rows: int, vocab: int, itemsize: int, props: runtime.DeviceProps | None = None) -> int:
    """Columns of W per slice ("recompute") so that a [n_rows, width] slice of logits stays within
    the budget. Chapter 10 prints it.

    Args:
        n_rows: tokens.
        vocab: rows of W, the vocabulary size.
        itemsize: bytes per logit (the model's dtype).
        props: the device's properties (default: this machine's device), which set the budget.

    Returns:
        The width: a multiple of 256 (whole tensor-core tiles), at least 256, at most ``vocab``
        (which may be less than 256).
    """
    props = props or runtime.device_props()
    return _width_within(n_rows, vocab, itemsize, _slice_bytes(props))


@dataclass(frozen=True)
class RecomputeLayout:
    """How "recompute" walks the vocabulary: slices of ``width`` rows of W, of which the last
    ``keep`` are kept from the forward pass for the backward, side by side in one buffer. The buffer
    holds at least one slice: the slices that are not kept pass through its front, in the forward
    pass before the kept ones are made and in the backward pass after they are used.

    The first ``in_grad`` slices are kept too, in the memory of d_weight ([vocab, hidden]), which
    the forward pass then allocates. The backward pass uses them first, in order, and writes
    d_weight's rows slice by slice, so each of these slices' logits must lie past the rows written
    before it is used (``grad_offsets``)."""

    n_rows: int
    vocab: int
    width: int
    keep: int
    hidden: int = 0
    in_grad: int = 0

    # Cached: the passes ask for them once per slice.
    @functools.cached_property
    def slices(self) -> list[tuple[int, int]]:
        """(start, stop) of each slice of the vocabulary, in order.

        Returns:
            The slices, each ``width`` columns but the last.
        """
        return _slices(self.vocab, self.width)

    @functools.cached_property
    def kept_start(self) -> int:
        """The first column of the kept slices.

        Returns:
            That column, or ``vocab`` when none is kept.
        """
        return _kept_start(self.slices, self.keep, self.vocab)

    @property
    def buffer_numel(self) -> int:
        """Elements of the buffer of logits: the kept slices side by side, and at least one slice."""
        return self.n_rows * max(min(self.width, self.vocab), self.vocab - self.kept_start)

    @functools.cached_property
    def grad_offsets(self) -> list[int]:
        """Where each of the first ``in_grad`` slices' logits starts in the flat d_weight buffer.

        Returns:
            One element offset per slice: past the slice's own rows of d_weight and past the
            slice before it.
        """
        return _grad_offsets(self.n_rows, self.hidden, self.slices[:self.in_grad])


def _grad_offsets(n_rows: int, hidden: int, slices) -> list[int]:
    # The backward pass starts with these slices, from the first, writing each one's rows of
    # d_weight once its logits are used. So slice i's logits may sit anywhere past its own rows,
    # stop_i × hidden, and past the slice before it: every row written before slice i is used is
    # then below them.
    offsets, end = [], 0
    for start, stop in slices:
        offsets.append(max(stop * hidden, end))
        end = offsets[-1] + n_rows * (stop - start)
    return offsets


def _kept_start(slices, keep: int, vocab: int) -> int:
    # Also called outside the cached property: under torch.compile Dynamo cannot enter a
    # cached_property's lock.
    return slices[len(slices) - keep][0] if keep else vocab


def _slices_in_grad(n_rows: int, hidden: int, slices, kept_start: int) -> int:
    """How many of the first slices (before the kept ones) fit in d_weight's memory (``RecomputeLayout``)."""
    candidates = [(start, stop) for start, stop in slices if stop <= kept_start]
    size = slices[-1][1] * hidden if slices else 0  # d_weight's elements
    count = 0
    for (start, stop), offset in zip(candidates, _grad_offsets(n_rows, hidden, candidates)):
        if offset + n_rows * (stop - start) > size:
            break
        count += 1
    return count


def recompute_layout(n_rows: int, hidden: int, vocab: int, itemsize: int, slice_bytes: int,
                     budget_bytes: int, grad_buffer: bool = False) -> RecomputeLayout:
    """Slices of at most ``slice_bytes`` of logits each, and as many of the last ones kept as fit in
    ``budget_bytes`` beside the float32 d_hidden and logsumexp (possibly all, possibly none). With
    ``grad_buffer`` (d_weight is wanted, in the logits' dtype) the first slices are kept in
    d_weight's memory as well, as many as fit there. Chapter 10 reads its plans at Llama 3's shape.

    Args:
        n_rows, hidden, vocab: tokens, H and V.
        itemsize: bytes per logit (the model's dtype).
        slice_bytes: the most bytes of logits in one slice.
        budget_bytes: what the kept slices, d_hidden and the logsumexp may take together.
        grad_buffer: also keep the first slices in d_weight's memory.

    Returns:
        The layout; no slices at all when ``n_rows`` is 0.
    """
    width = _width_within(n_rows, vocab, itemsize, slice_bytes)
    slices = _slices(vocab, width) if n_rows else []
    room = budget_bytes - n_rows * (hidden + 1) * 4
    keep = 0
    for start, stop in reversed(slices):
        room -= n_rows * (stop - start) * itemsize
        if room < 0:
            break
        keep += 1
    in_grad = _slices_in_grad(n_rows, hidden, slices, _kept_start(slices, keep, vocab)) if grad_buffer else 0
    return RecomputeLayout(n_rows, vocab, width, keep, hidden, in_grad)


def plan_recompute(n_rows: int, hidden: int, vocab: int, itemsize: int,
                   props: runtime.DeviceProps | None = None,
                   keep_logits: bool = True, grad_buffer: bool = False) -> RecomputeLayout:
    """The layout "recompute" runs with on ``props``: the GPU's budgets or the interpreter's small
    ones.

    Args:
        n_rows, hidden, vocab: tokens, H and V.
        itemsize: bytes per logit (the model's dtype).
        props: the device's properties (default: this machine's device).
        keep_logits: keep slices for the backward pass; False keeps none (and none in d_weight).
        grad_buffer: the weight needs its gradient: keep the first slices in d_weight's memory.

    Returns:
        The layout (``recompute_layout`` with the device's budgets).
    """
    props = props or runtime.device_props()
    budget = INTERPRETER_RECOMPUTE_BYTES if props.interpreter else GPU_RECOMPUTE_BYTES
    if not keep_logits:
        return RecomputeLayout(n_rows, vocab,
                               _width_within(n_rows, vocab, itemsize, _slice_bytes(props)), 0, hidden)
    return recompute_layout(n_rows, hidden, vocab, itemsize, _slice_bytes(props), budget, grad_buffer)


def chunk_rows(n_rows: int, vocab: int, itemsize: int, props: runtime.DeviceProps | None = None) -> int:
    """Tokens per chunk ("chunked") so that a [chunk, vocab] block of logits stays within the same budget.

    Args:
        n_rows: tokens.
        vocab: the vocabulary size.
        itemsize: bytes per logit.
        props: the device's properties (default: this machine's device).

    Returns:
        The chunk, between 1 and ``n_rows`` (1 when ``n_rows`` is 0).
    """
    props = props or runtime.device_props()
    return max(1, min(n_rows, _slice_bytes(props) // max(vocab * itemsize, 1)))


def linear_loss_extra_bytes(tokens: int, hidden: int, vocab: int, itemsize: int = 2,
                            buffer_bytes: int = LOGITS_BUFFER_BYTES,
                            budget_bytes: int = RECOMPUTE_BUDGET_BYTES) -> dict[str, int]:
    """Computed peak bytes each way of computing an LM head's loss adds beyond its inputs (hidden,
    weight) and the two gradients every way writes (d_hidden, d_weight), for a trainable weight:

    * ``hf``: the logits and Hugging Face's loss buffers (``kernels.memory.hf_loss_peak``);
    * ``logits_in_place``: the logits, which receive their own gradient (``kernels.cross_entropy``
      in place);
    * ``chunked``: a chunk of logits and the float32 [V, H] accumulator of d_weight;
    * ``recompute_all``: a slice of logits, the float32 [tokens, H] accumulator of d_hidden and one
      float32 logsumexp per token;
    * ``recompute``: the same with the slices kept for the backward pass within ``budget_bytes``
      (``recompute_layout``), what the package runs.

    Chapter 10 and ``kernels.training.long_context`` tabulate it.

    Args:
        tokens, hidden, vocab: the head's shape.
        itemsize: bytes per element of the model's dtype (2: bf16, else float32 for Hugging Face's
            loss).
        buffer_bytes: the most bytes of logits in one slice or chunk.
        budget_bytes: "recompute"'s budget.

    Returns:
        The five entries above, in bytes.
    """
    logits = tokens * vocab * itemsize
    buffer = min(logits, buffer_bytes)
    hf = hf_loss_buffers(tokens, vocab, torch.bfloat16 if itemsize == 2 else torch.float32)
    accumulators = tokens * hidden * FP32 + tokens * FP32
    layout = recompute_layout(tokens, hidden, vocab, itemsize, buffer_bytes, budget_bytes)
    return {
        "hf": hf_loss_peak(**hf),
        "logits_in_place": logits,
        "chunked": buffer + vocab * hidden * FP32,
        "recompute_all": buffer + accumulators,
        "recompute": layout.buffer_numel * itemsize + accumulators,
    }


@functools.lru_cache(maxsize=512)
def slice_config(n_rows: int, width: int, props: runtime.DeviceProps) -> SliceConfig:
    """Launch configuration of both slice kernels for a [n_rows, width] slice.

    Args:
        n_rows, width: the slice's shape.
        props: the device's properties.

    Returns:
        One row per program on a GPU; few large tiles in the interpreter.
    """
    if props.interpreter:  # few programs with big tiles: each program costs milliseconds of Python
        block_v = min(triton.next_power_of_2(width), 4096)
        rows = min(triton.next_power_of_2(max(n_rows, 1)), max(1, _INTERPRETER_MAX_TILE // block_v))
        return SliceConfig(rows=rows, block_v=block_v, num_warps=4)
    # One row per program streaming its slice in chunks of regs_per_sm / 16 values, as the
    # cross-entropy kernel.
    block_v = min(triton.next_power_of_2(width), max(1024, props.regs_per_sm // 16))
    return SliceConfig(rows=1, block_v=block_v, num_warps=8 if block_v >= 4096 else 4)


# --------------------------------------------------------------------------------------------------
# Host side: checks, the two passes of "recompute", the chunked forward
# --------------------------------------------------------------------------------------------------


def _check_inputs(hidden, weight, target, ignore_index, reduction, normalizer, strategy) -> None:
    check_scores("hidden", hidden)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a tensor, got {type(weight).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be [vocab, hidden] as nn.Linear stores it, got shape {tuple(weight.shape)}")
    if hidden.dim() == 0 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden's last dimension must match weight's width {weight.shape[1]} (weight {tuple(weight.shape)}), "
            f"got hidden of shape {tuple(hidden.shape)}"
        )
    if weight.shape[0] == 0:
        raise ValueError("weight must have at least one row (one class)")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"hidden and weight must have the same dtype, got {hidden.dtype} and {weight.dtype}")
    if weight.device != hidden.device:
        raise ValueError(f"hidden and weight must be on the same device, got {hidden.device} and {weight.device}")
    check_loss_args(target, f"hidden {tuple(hidden.shape)}", tuple(hidden.shape[:-1]),
                    hidden.device, ignore_index,
                    reduction, normalizer)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")


def _dense_like(t: torch.Tensor) -> torch.Tensor:
    """An empty contiguous tensor of ``t``'s shape, dtype and device. Gradients and the buffers that
    become them are contiguous whatever the layout of the input (a transposed or strided LM head
    weight): the passes address d_weight as one flat buffer, and autograd accepts a gradient of any
    strides."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


def _slices(vocab: int, width: int):
    """(start, stop) of each slice of the vocabulary."""
    return [(start, min(start + width, vocab)) for start in range(0, vocab, width)]


def _logits_into(buffer: torch.Tensor, hidden: torch.Tensor, weight_rows: torch.Tensor) -> torch.Tensor:
    """hidden @ weight_rows.T written into the front of ``buffer`` (flat), returned as a contiguous
    [rows, width]."""
    out = buffer[: hidden.shape[0] * weight_rows.shape[0]].view(hidden.shape[0], weight_rows.shape[0])
    return torch.mm(hidden, weight_rows.t(), out=out)


# Whether ``addmm(..., out_dtype=torch.float32)`` multiplies bf16/fp16 matrices into a float32
# accumulator on this device (recent PyTorch releases, CUDA only). Decided by the first call that
# tries; no host synchronisation.
_FP32_OUT_MATMUL: dict[str, bool] = {}


def _accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (float32) += a @ b for a and b in the model's dtype, without rounding a @ b to that dtype
    where possible."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
        return
    device = acc.device.type
    if _FP32_OUT_MATMUL.get(device, device == "cuda"):
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            _FP32_OUT_MATMUL[device] = True
            return
        except (RuntimeError, TypeError, NotImplementedError):
            _FP32_OUT_MATMUL[device] = False
    acc.add_(torch.mm(a, b))  # a @ b rounded once to a's dtype, then summed in float32


def _slice_launch(kernel, n_rows: int, width: int, device, *args, **constexprs):
    cfg = slice_config(n_rows, width, runtime.device_props(device))
    kernel[(triton.cdiv(n_rows, cfg.rows),)](*args, ROWS=cfg.rows, BLOCK_V=cfg.block_v,
                                             num_warps=cfg.num_warps,
                                            **constexprs)


def _kept_slice(buffer: torch.Tensor, layout: RecomputeLayout, start: int, stop: int) -> torch.Tensor:
    """Where the kept slice of columns start ... stop lives in the buffer: slices side by side, each
    [rows, width]."""
    offset = layout.n_rows * (start - layout.kept_start)
    return buffer[offset:offset + layout.n_rows * (stop - start)]


def _layout(n_rows: int, vocab: int, width: int, keep: int, hidden: int, in_grad: int) -> RecomputeLayout:
    """The layout of one call, refusing an ``in_grad`` whose slices would not fit in d_weight's
    memory (or would be written over by the backward pass before it has used them)."""
    layout = RecomputeLayout(n_rows, vocab, width, keep, hidden, in_grad)
    fits = _slices_in_grad(n_rows, hidden, layout.slices, layout.kept_start) if in_grad else 0
    if not 0 <= in_grad <= fits:
        raise ValueError(f"in_grad={in_grad}: at most {fits} slices of {width} fit in d_weight's memory here")
    return layout


def _in_grad_slice(grad_buffer: torch.Tensor, layout: RecomputeLayout, i: int) -> torch.Tensor:
    """Where slice i (one of the first ``in_grad``) keeps its logits: a stretch of the flat d_weight
    buffer."""
    start, stop = layout.slices[i]
    offset = layout.grad_offsets[i]
    return grad_buffer.view(-1)[offset:offset + layout.n_rows * (stop - start)]


def logsumexp_pass(hidden, weight, target, ignore_index: int, width: int, keep: int = 0, in_grad: int = 0):
    """The forward pass of "recompute": per-row loss (0 for ignored rows, NaN for bad targets) and
    logsumexp, both float32 [rows], from one matmul per slice of ``width`` rows of W; the buffer
    holding the last ``keep`` slices' logits for the backward pass (empty when ``keep`` is 0); and
    d_weight's memory, allocated here, holding the first ``in_grad`` slices' logits (empty when
    ``in_grad`` is 0).

    Args:
        hidden: [rows, H].
        weight: [V, H].
        target: [rows] class indices, contiguous.
        ignore_index: the target value whose row counts for nothing.
        width: columns of W per slice.
        keep: how many of the last slices to keep.
        in_grad: how many of the first slices to keep in d_weight's memory.

    Returns:
        ``(loss_rows, lse, kept, grad_buffer)``, as above.

    Raises:
        ValueError: ``in_grad`` slices do not fit in d_weight's memory.
    """
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    device = hidden.device
    loss = torch.empty(n_rows, dtype=torch.float32, device=device)
    lse = torch.empty(n_rows, dtype=torch.float32, device=device)
    m = torch.empty(n_rows, dtype=torch.float32, device=device)
    s = torch.empty(n_rows, dtype=torch.float32, device=device)
    target_logit = torch.empty(n_rows, dtype=torch.float32, device=device)
    if n_rows == 0:
        return loss, lse, hidden.new_empty(0), weight.new_empty(0)
    layout = _layout(n_rows, vocab, width, keep, hidden.shape[1], in_grad)
    buffer = torch.empty(layout.buffer_numel, dtype=hidden.dtype, device=device)
    grad_buffer = _dense_like(weight) if in_grad else weight.new_empty(0)
    slices = layout.slices
    for i, (start, stop) in enumerate(slices):
        # The slices that are not kept come first, through the buffer's front; each kept one then
        # gets its own place.
        if i < in_grad:
            place = _in_grad_slice(grad_buffer, layout, i)
        else:
            place = _kept_slice(buffer, layout, start, stop) if start >= layout.kept_start else buffer
        logits = _logits_into(place, hidden, weight[start:stop])
        _slice_launch(_lse_slice_kernel, n_rows, stop - start, device,
                      logits, target, m, s, target_logit, loss, lse, n_rows, stop - start, start,
                      vocab, ignore_index,
                      FIRST=i == 0, LAST=i == len(slices) - 1)
    return loss, lse, buffer if keep else hidden.new_empty(0), grad_buffer


def gradient_pass(hidden, weight, target, lse, scale, grad_output, ignore_index: int, width: int,
                  need_hidden: bool, need_weight: bool, kept=None, keep: int = 0, grad_buffer=None,
                  in_grad: int = 0):
    """The backward pass of "recompute": ``(d_hidden, d_weight)`` (an empty tensor for the one not needed).

    Per slice: the logits (kept by the forward pass in ``kept`` for its last ``keep`` slices and in
    ``grad_buffer`` for its first ``in_grad``, recomputed for the others), overwritten with their
    gradient; then d_weight[slice] = G_sliceᵀ @ hidden (one matmul over every token: float32
    accumulation, one rounding) and d_hidden += G_slice @ W[slice] (float32). The slices kept in
    ``grad_buffer`` go first, in order, then those in ``kept``, then the recomputed ones (through
    ``kept``'s front). Both buffers are used up: ``grad_buffer`` becomes d_weight. Chapter 10
    walks it.

    Args:
        hidden, weight, target, lse: the forward pass's inputs and its logsumexp.
        scale: ``gradient_scale``'s [factor, divisor].
        grad_output: the loss's incoming gradient, a scalar or one value per row.
        ignore_index, width: as for ``logsumexp_pass``.
        need_hidden, need_weight: which gradients to compute.
        kept, keep: the forward pass's buffer and how many slices it holds.
        grad_buffer, in_grad: the forward pass's d_weight and how many slices it holds.

    Returns:
        ``(d_hidden, d_weight)`` in the inputs' dtypes; an empty tensor for one not needed.

    Raises:
        ValueError: ``kept`` or ``grad_buffer`` is not what the forward pass made for ``keep``
            and ``in_grad``.
    """
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    device = hidden.device
    layout = _layout(n_rows, vocab, width, keep, hidden.shape[1], in_grad)
    if in_grad:
        if not need_weight or grad_buffer is None or grad_buffer.shape != weight.shape \
                or grad_buffer.dtype != weight.dtype:
            raise ValueError(f"grad_buffer must be the forward pass's d_weight, holding its first {in_grad} slices")
        d_weight = grad_buffer
    else:
        d_weight = _dense_like(weight) if need_weight else weight.new_empty(0)
    d_hidden_acc = torch.zeros(hidden.shape, dtype=torch.float32, device=device) if need_hidden else None
    if n_rows == 0:  # a sum over no tokens
        return (hidden.new_zeros(hidden.shape) if need_hidden else hidden.new_empty(0),
                d_weight.zero_() if need_weight else d_weight)
    go = grad_output.detach().reshape(-1)
    stride_go = 0 if go.numel() == 1 else go.stride(0)
    if keep:
        if kept is None or kept.numel() < layout.buffer_numel or kept.dtype != hidden.dtype:
            raise ValueError(f"kept must hold the forward pass's last {keep} slices: {layout.buffer_numel} values of "
                             f"{hidden.dtype}")
        buffer = kept
    else:
        buffer = torch.empty(layout.buffer_numel, dtype=hidden.dtype, device=device)
    slices = layout.slices
    order = [*range(in_grad), *range(len(slices) - keep, len(slices)), *range(in_grad, len(slices) - keep)]
    for i in order:
        start, stop = slices[i]
        w = weight[start:stop]
        if start >= layout.kept_start:
            grad = _kept_slice(buffer, layout, start, stop).view(n_rows, stop - start)
        elif i < in_grad:
            grad = _in_grad_slice(d_weight, layout, i).view(n_rows, stop - start)
        else:
            grad = _logits_into(buffer, hidden, w)
        _slice_launch(_grad_slice_kernel, n_rows, stop - start, device,
                      grad, target, lse, scale, go, n_rows, stop - start, start, vocab,
                      ignore_index, stride_go)
        if need_weight:
            torch.mm(grad.t(), hidden, out=d_weight[start:stop])
        if need_hidden:
            _accumulate_mm(d_hidden_acc, grad, w)
    # A Triton store is invisible to autograd: bump the version counters by hand, as in-place ops
    # do.
    torch.autograd.graph.increment_version(tuple(t for t, n in ((kept, keep), (grad_buffer, in_grad)) if n))
    d_hidden = d_hidden_acc.to(hidden.dtype) if need_hidden else hidden.new_empty(0)
    return d_hidden, d_weight


def _reduce(loss_rows: torch.Tensor, scale: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return loss_rows
    out = torch.empty((), dtype=torch.float32, device=loss_rows.device)
    if loss_rows.numel() == 0:  # a sum over nothing is 0, a mean over nothing 0 / 0
        return out.fill_(float("nan") if reduction == "mean" else 0.0)
    reduce_loss_kernel[(1,)](loss_rows, scale, out, loss_rows.numel(),
                             BLOCK_R=min(triton.next_power_of_2(loss_rows.numel()), 4096), num_warps=8)
    return out


def chunked_forward(hidden, weight, target, ignore_index: int, reduction: str, normalizer, need_hidden: bool,
                    need_weight: bool, chunk: int):
    """The "chunked" plan, all in the forward pass.

    Args:
        hidden: [rows, H].
        weight: [V, H].
        target: [rows] class indices, contiguous.
        ignore_index: the target value whose row counts for nothing.
        reduction: "mean" or "sum".
        normalizer: with "sum", divides it.
        need_hidden, need_weight: which gradients to compute.
        chunk: tokens per chunk (``chunk_rows``).

    Returns:
        ``(loss, d_hidden, d_weight)``: the float32 loss, and the gradients of that loss (the
        caller multiplies by grad_output); an empty tensor for a gradient not needed.
    """
    n_rows = hidden.shape[0]
    device = hidden.device
    # The divisor of the whole batch, on the device: each chunk's sum is divided by it, so chunks
    # add up to the loss.
    scale = gradient_scale(target, ignore_index, reduction, normalizer, device)
    divisor = scale[1:]
    loss = torch.zeros((), dtype=torch.float32, device=device)
    d_hidden = _dense_like(hidden) if need_hidden else hidden.new_empty(0)
    d_weight_acc = torch.zeros(weight.shape, dtype=torch.float32, device=device) if need_weight else None
    buffer = torch.empty(min(chunk, max(n_rows, 1)) * weight.shape[0], dtype=hidden.dtype, device=device)
    for start in range(0, n_rows, chunk):
        h = hidden[start:start + chunk]
        logits = _logits_into(buffer, h, weight)
        part, _, grad = cross_entropy_forward(logits, target[start:start + chunk], ignore_index,
                                              "sum", divisor,
                                              compute_grad=need_hidden or need_weight, inplace=True)
        loss += part
        if need_hidden:
            torch.mm(grad, weight, out=d_hidden[start:start + chunk])
        if need_weight:
            _accumulate_mm(d_weight_acc, grad.t(), h)
    if n_rows == 0 and reduction == "mean":
        loss.fill_(float("nan"))
    d_weight = d_weight_acc.to(weight.dtype) if need_weight else weight.new_empty(0)
    return loss, d_hidden, d_weight


# --------------------------------------------------------------------------------------------------
# PyTorch operators: torch.ops.kernels.linear_cross_entropy_fwd, _bwd, _chunked
# --------------------------------------------------------------------------------------------------
# Every operator takes 2-D hidden [rows, H] and 1-D target [rows]; the function below flattens. A
# normalizer comes as a tensor or a number, as in kernels.cross_entropy.


def _fwd_impl(hidden, weight, target, ignore_index, reduction, normalizer, normalizer_value, width,
              keep, in_grad):
    loss_rows, lse, kept, grad_buffer = logsumexp_pass(hidden, weight, target, ignore_index, width,
                                                       keep, in_grad)
    scale = gradient_scale(target, ignore_index, reduction, normalizer_arg(normalizer, normalizer_value),
                            hidden.device)
    return _reduce(loss_rows, scale, reduction), lse, scale, kept, grad_buffer


def _fwd_fake(hidden, weight, target, ignore_index, reduction, normalizer, normalizer_value, width,
              keep, in_grad):
    n_rows = hidden.shape[0]
    loss = hidden.new_empty((n_rows,) if reduction == "none" else (), dtype=torch.float32)
    kept = RecomputeLayout(n_rows, weight.shape[0], width, keep).buffer_numel if keep and n_rows else 0
    return (loss, hidden.new_empty(n_rows, dtype=torch.float32), hidden.new_empty(2, dtype=torch.float32),
            hidden.new_empty(kept), _dense_like(weight) if in_grad and n_rows else weight.new_empty(0))


def _bwd_impl(grad_output, hidden, weight, target, lse, scale, kept, grad_buffer, ignore_index,
              width, keep, in_grad,
              need_hidden, need_weight):
    d_hidden, d_weight = gradient_pass(hidden, weight, target, lse, scale, grad_output, ignore_index, width,
                                       need_hidden, need_weight, kept, keep, grad_buffer, in_grad)
    # With slices kept in it, d_weight is grad_buffer itself, which the operator writes (its schema
    # says so) and must not also return: the caller takes grad_buffer as the gradient.
    return d_hidden, weight.new_empty(0) if in_grad else d_weight


def _grads_fake(hidden, weight, need_hidden, need_weight):
    return (_dense_like(hidden) if need_hidden else hidden.new_empty(0),
            _dense_like(weight) if need_weight else weight.new_empty(0))


def _chunked_impl(hidden, weight, target, ignore_index, reduction, normalizer, normalizer_value, need_hidden,
                  need_weight, chunk):
    return chunked_forward(hidden, weight, target, ignore_index, reduction,
                           normalizer_arg(normalizer, normalizer_value), need_hidden, need_weight, chunk)


def _chunked_fake(hidden, weight, target, ignore_index, reduction, normalizer, normalizer_value, need_hidden,
                  need_weight, chunk):
    return (hidden.new_empty((), dtype=torch.float32),
            *_grads_fake(hidden, weight, need_hidden, need_weight))


linear_cross_entropy_fwd_op = ops.define(
    "linear_cross_entropy_fwd(Tensor hidden, Tensor weight, Tensor target, int ignore_index, str reduction, "
    "Tensor? normalizer, float? normalizer_value, int width, int keep, int in_grad) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    _fwd_impl, _fwd_fake,
)


def _bwd_fake(go, hidden, weight, target, lse, scale, kept, grad_buffer, ii, width, keep, in_grad, nh, nw):
    d_hidden, d_weight = _grads_fake(hidden, weight, nh, nw)
    return d_hidden, weight.new_empty(0) if in_grad else d_weight


# The backward writes the gradient of the kept logits over them, and d_weight into grad_buffer: the
# schema says so (Tensor(a!) kept, Tensor(b!) grad_buffer), and the implementation bumps their
# version counters, so a second backward through the same graph fails loudly.
linear_cross_entropy_bwd_op = ops.define(
    "linear_cross_entropy_bwd(Tensor grad_output, Tensor hidden, Tensor weight, Tensor target, Tensor lse, "
    "Tensor scale, Tensor(a!) kept, Tensor(b!) grad_buffer, int ignore_index, int width, int keep, int in_grad, "
    "bool need_hidden, bool need_weight) -> (Tensor, Tensor)",
    _bwd_impl, _bwd_fake,
)
linear_cross_entropy_chunked_op = ops.define(
    "linear_cross_entropy_chunked(Tensor hidden, Tensor weight, Tensor target, int ignore_index, str reduction, "
    "Tensor? normalizer, float? normalizer_value, bool need_hidden, bool need_weight, int chunk) "
    "-> (Tensor, Tensor, Tensor)",
    _chunked_impl, _chunked_fake,
)


# --------------------------------------------------------------------------------------------------
# autograd, function, module
# --------------------------------------------------------------------------------------------------


class RecomputeFunction(torch.autograd.Function):
    """"recompute": the forward keeps one float32 logsumexp per row and the logits of the last
    ``keep`` slices (and of the first ``in_grad``, in d_weight's memory); the backward recomputes
    the other slices and writes every slice's gradient over its logits. Works for every reduction (a
    per-row grad_output for "none" scales each row's gradient). With slices kept, the graph can be
    run backward once only: a second run (``retain_graph=True``) raises PyTorch's in-place error."""

    @staticmethod
    def forward(ctx, hidden, weight, target, ignore_index, reduction, normalizer, normalizer_value,
                width, keep,
                in_grad):
        """The loss, keeping what the backward pass needs.

        Args:
            ctx: autograd's context.
            hidden, weight, target, ignore_index, reduction: flattened and checked.
            normalizer, normalizer_value: the normalizer split by ``split_normalizer``.
            width, keep, in_grad: the layout (``plan_recompute``).

        Returns:
            The float32 loss.
        """
        loss, lse, scale, kept, grad_buffer = linear_cross_entropy_fwd_op(
            hidden, weight, target, ignore_index, reduction, normalizer, normalizer_value, width,
            keep, in_grad)
        ctx.save_for_backward(hidden, weight, target, lse, scale, kept, grad_buffer)
        ctx.ignore_index, ctx.width, ctx.keep, ctx.in_grad = ignore_index, width, keep, in_grad
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        """The gradients by ``gradient_pass``.

        Args:
            ctx: autograd's context.
            grad_output: the loss's incoming gradient.

        Returns:
            d_hidden and d_weight (None where not needed), then None for every other input.
        """
        hidden, weight, target, lse, scale, kept, grad_buffer = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        d_hidden, d_weight = linear_cross_entropy_bwd_op(grad_output, hidden, weight, target, lse,
                                                         scale, kept,
                                                         grad_buffer, ctx.ignore_index, ctx.width, ctx.keep,
                                                         ctx.in_grad, need_hidden, need_weight)
        if ctx.in_grad:
            d_weight = grad_buffer
        return (d_hidden if need_hidden else None, d_weight if need_weight else None,
                None, None, None, None, None, None, None, None)


class ChunkedFunction(torch.autograd.Function):
    """"chunked": the forward computes the loss and both gradients; the backward multiplies them by
    grad_output (a scalar: reductions "mean" and "sum")."""

    @staticmethod
    def forward(ctx, hidden, weight, target, ignore_index, reduction, normalizer, normalizer_value, chunk):
        """The loss, with both gradients computed and saved.

        Args:
            ctx: autograd's context.
            hidden, weight, target, ignore_index, reduction: flattened and checked.
            normalizer, normalizer_value: the normalizer split by ``split_normalizer``.
            chunk: tokens per chunk (``chunk_rows``).

        Returns:
            The float32 loss.
        """
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss, d_hidden, d_weight = linear_cross_entropy_chunked_op(
            hidden, weight, target, ignore_index, reduction, normalizer, normalizer_value,
            need_hidden, need_weight,
            chunk,
        )
        ctx.save_for_backward(d_hidden, d_weight)
        ctx.need = (need_hidden, need_weight)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        """The saved gradients times ``grad_output``.

        Args:
            ctx: autograd's context.
            grad_output: the loss's incoming gradient, a scalar.

        Returns:
            d_hidden and d_weight (None where not needed), then None for every other input.
        """
        d_hidden, d_weight = ctx.saved_tensors
        need_hidden, need_weight = ctx.need
        return (d_hidden * grad_output if need_hidden else None,
                d_weight * grad_output if need_weight else None,
                None, None, None, None, None, None)


def choose_strategy(weight_needs_grad: bool, reduction: str) -> str:
    """What ``strategy="auto"`` picks (chapter 10 compares the two).

    "chunked" for a frozen weight (2 matmuls to "recompute"'s 3, no float32 dW buffer),
    "recompute" otherwise, and always for ``reduction="none"`` (the chunked plan's backward
    multiplies by a scalar grad_output only).

    Args:
        weight_needs_grad: whether the weight's gradient is wanted.
        reduction: "mean", "sum" or "none".

    Returns:
        "chunked" or "recompute".
    """
    return "chunked" if not weight_needs_grad and reduction != "none" else "recompute"


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    *,
    normalizer=None,
    strategy: str = "auto",
    check_targets: bool = True,
    keep_logits: bool = True,
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against ``target``, without a [tokens, vocab] tensor in memory.

    ``hidden`` is [..., H] (any leading dimensions; strided views such as ``h[:, :-1]`` are copied
    to rows first, which costs [tokens, H], not [tokens, V]); ``weight`` is [V, H] as ``nn.Linear``
    stores it (an LM head's weight, tied to the embeddings or not), in ``hidden``'s dtype;
    ``target`` holds one class index per token (shape ``hidden.shape[:-1]`` or flat). Semantics are
    those of ``kernels.cross_entropy``: ``reduction`` "mean" (over targets that are not
    ``ignore_index``; NaN when there are none), "sum" or "none"; ``normalizer`` (``reduction="sum"``
    only) divides the sum, as Hugging Face's ``num_items_in_batch`` under gradient accumulation; a
    float32 loss; gradients for ``hidden`` and ``weight`` as they require them.

    ``strategy``: "recompute", "chunked" or "auto" (the default: ``choose_strategy``); the module
    docstring says what each costs. ``check_targets`` as in ``kernels.cross_entropy`` (one host
    synchronisation; pass False under CUDA graphs or ``torch.compile``: an out-of-range target then
    gives a NaN loss). ``keep_logits``: whether "recompute" keeps slices of logits for the backward
    pass within its memory budget (``plan_recompute``); it keeps none under ``torch.compile``, where
    a backward that writes over a saved tensor is not traced. Chapter 10 derives it.

    Args:
        hidden: [..., H] hidden states (strided views are copied to rows first).
        weight: [V, H], the LM head's weight, in ``hidden``'s dtype.
        target: one class index per token, ``hidden.shape[:-1]`` or flat.
        ignore_index: the target value that contributes nothing.
        reduction: "mean", "sum" or "none".
        normalizer: with "sum" only, divides the sum.
        strategy: "recompute", "chunked" or "auto".
        check_targets: raise for a target outside [0, V) (one host synchronisation).
        keep_logits: let "recompute" keep slices of logits for the backward, within its budget.

    Returns:
        The float32 loss: a scalar, or one value per token for "none".

    Raises:
        TypeError: inputs that are not tensors, dtypes the kernels do not take or that differ, a
            switch that is not a bool.
        ValueError: shapes or devices that do not match, an unknown reduction or strategy, a
            misused normalizer, or, with ``check_targets``, a target out of range.
    """
    _check_inputs(hidden, weight, target, ignore_index, reduction, normalizer, strategy)
    check_flags(check_targets=check_targets, keep_logits=keep_logits)
    vocab = weight.shape[0]
    if check_targets:
        check_target_range(target, vocab, ignore_index)
    # -1 is ambiguous at a hidden size of 0
    rows = hidden.reshape(math.prod(hidden.shape[:-1]), hidden.shape[-1])
    target_rows = target.reshape(-1)
    if target_rows.stride(0) != 1:
        target_rows = target_rows.contiguous()
    norm_tensor, norm_value = split_normalizer(normalizer, hidden.device)
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if strategy == "auto":
        strategy = choose_strategy(needs_grad and weight.requires_grad, reduction)
    props = runtime.device_props(hidden.device)
    if strategy == "chunked" and reduction != "none" and needs_grad:
        chunk = chunk_rows(rows.shape[0], vocab, hidden.element_size(), props)
        loss = ChunkedFunction.apply(rows, weight, target_rows, ignore_index, reduction,
                                     norm_tensor, norm_value, chunk)
        return loss
    keep = needs_grad and keep_logits and not torch.compiler.is_compiling()
    layout = plan_recompute(rows.shape[0], rows.shape[1], vocab, hidden.element_size(), props, keep,
                            grad_buffer=needs_grad and weight.requires_grad)
    if needs_grad:
        loss = RecomputeFunction.apply(rows, weight, target_rows, ignore_index, reduction,
                                       norm_tensor, norm_value,
                                       layout.width, layout.keep, layout.in_grad)
    else:
        loss = linear_cross_entropy_fwd_op(rows, weight, target_rows, ignore_index, reduction, norm_tensor,
                                           norm_value, layout.width, 0, 0)[0]
    return loss.view(hidden.shape[:-1]) if reduction == "none" else loss


class TritonLinearCrossEntropyLoss(torch.nn.Module):
    """The loss of an LM head without its logits: ``forward(hidden, weight, target)``; see
    ``linear_cross_entropy``. ``label_smoothing``, ``size_average`` and ``reduce``
    (``nn.CrossEntropyLoss``'s) are not implemented: set to anything but their defaults, every call
    raises a ValueError.

    Args:
        ignore_index, reduction, strategy, check_targets, keep_logits: as for
            ``linear_cross_entropy``; ``forward(hidden, weight, target, normalizer=None)`` passes
            them on.

    Raises:
        ValueError: an unknown ``strategy`` (at construction).
    """

    # off (``check_options_off`` reads them at every call)
    label_smoothing, size_average, reduce = 0.0, None, None

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", strategy: str = "auto",
                 check_targets: bool = True, keep_logits: bool = True):
        super().__init__()
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        self.ignore_index, self.reduction, self.strategy, self.check_targets = (ignore_index,
                                                                                reduction, strategy,
                                                                                check_targets)
        self.keep_logits = keep_logits

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, normalizer=None):
        """``linear_cross_entropy`` with the module's settings.

        Args:
            hidden: [..., H] hidden states.
            weight: [V, H], the LM head's weight.
            target: one class index per token.
            normalizer: with ``reduction="sum"`` only, divides the sum.

        Returns:
            The float32 loss: a scalar, or one value per token for "none".

        Raises:
            ValueError: an unimplemented option is set, or as ``linear_cross_entropy``.
            TypeError: as ``linear_cross_entropy``.
        """
        check_options_off(self, ("label_smoothing", "size_average", "reduce"))
        return linear_cross_entropy(hidden, weight, target, self.ignore_index, self.reduction,
                                    normalizer=normalizer,
                                    strategy=self.strategy, check_targets=self.check_targets,
                                    keep_logits=self.keep_logits)

    def extra_repr(self) -> str:
        """The module's settings, for its ``repr``.

        Returns:
            ``ignore_index``, ``reduction`` and ``strategy`` as ``name=value`` pairs.
        """
        return f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, strategy={self.strategy!r}"
