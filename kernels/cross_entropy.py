"""Fused cross-entropy in Triton: one kernel gives the loss, the logsumexp and the gradient, without
ever holding the softmax in memory.

For one row of logits x (length V, e.g. V = 128,256 for Llama 3) and its target class t:

    loss = logsumexp(x) − x[t]              grad = (softmax(x) − onehot(t)) · scale

The forward kernel streams the row in chunks of ``BLOCK_V`` logits and keeps only two float32
numbers per row, the running max m and the running sum s of exp(x − m) (the online softmax, Milakov
& Gimelshein 2018):

    m' = max(m, max(chunk))        s' = s · exp(m − m') + Σ exp(chunk − m')        logsumexp = m + log(s)

Once the logsumexp is known, a second sweep over the same row computes the gradient chunk by chunk
and writes it, *during the forward pass*. The backward pass then only has to multiply by the
incoming gradient, and it skips even that, on the device, when the incoming gradient is 1.0 (a loss
that is not scaled further).

Memory. With ``inplace_backward=True`` the gradient overwrites the logits: no [rows, V] buffer is
allocated at all. Otherwise a gradient buffer in the logits' dtype is allocated. When the logits do
not require a gradient (evaluation) the gradient sweep is compiled out and the kernel reads the
logits exactly once.

All arithmetic is float32 whatever the storage dtype; the loss is returned in float32, as Hugging
Face's (which upcasts the logits to float32 before ``F.cross_entropy``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from numbers import Real

import torch
import triton
import triton.language as tl

from . import ops, runtime
from .triton_utils import cast_to

REDUCTIONS = ("mean", "sum", "none")
# Class indices: every signed integer dtype and uint8. The kernels widen each index to int64 as they
# load it, so every one of these gives the loss of ``F.cross_entropy(logits, target.long())``
# (PyTorch itself takes int64 and uint8 only). The unsigned 16-64-bit dtypes, which most PyTorch
# operations do not support, are refused.
TARGET_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)

# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _row_offsets(rows, inner_rows, stride_outer, stride_inner):
    # The rows may come from a two-level view such as logits[:, :-1, :] (shape [B, S-1, V], strides
    # [S·V, V, 1]), which no single row stride describes. Row r is element (r // inner_rows, r %
    # inner_rows) of the leading dims. ``rows`` is int64, so offsets never wrap past 2**31.
    return (rows // inner_rows) * stride_outer + (rows % inner_rows) * stride_inner


@triton.jit
def cross_entropy_fwd_kernel(
    LOGITS, TARGET, LOSS, LSE, GRAD, SCALE,
    n_rows, n_cols, inner_rows, stride_outer, stride_inner, grad_stride_outer, grad_stride_inner,
    ignore_index,
    ROWS: tl.constexpr, BLOCK_V: tl.constexpr, COMPUTE_GRAD: tl.constexpr,
):
    """The forward pass: each row's loss and logsumexp and, with COMPUTE_GRAD, its gradient
    (``launch_forward``). Chapter 06 builds it.

    Args:
        LOGITS, TARGET: pointers to the logits and the row's class indices (any integer dtype).
        LOSS, LSE: pointers to the float32 per-row loss and logsumexp, written.
        GRAD: pointer to the gradient, written with COMPUTE_GRAD (may be LOGITS itself).
        SCALE: pointer to [gradient factor, divisor] (``gradient_scale``).
        n_rows, n_cols: rows and logits per row.
        inner_rows, stride_outer, stride_inner: the logits' row layout (``RowLayout``).
        grad_stride_outer, grad_stride_inner: the gradient's, with the same ``inner_rows``.
        ignore_index: the target value whose row counts for nothing.
        ROWS, BLOCK_V: rows per program, logits per chunk of a row.
        COMPUTE_GRAD: write the gradient; off, the sweep is compiled out.
    """
    # Row r of the logits is element (r // inner_rows, r % inner_rows) of two strided levels; the
    # gradient buffer uses the same decomposition with its own strides.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    # Lanes past the last row re-read the last row instead of loading nothing: every lane then sees
    # real logits and the running max never stays at -inf (exp(-inf − (-inf)) would be NaN). Their
    # results are never stored.
    rows_in = tl.minimum(rows, n_rows - 1)
    row_start = _row_offsets(rows_in, inner_rows, stride_outer, stride_inner)

    target = tl.load(TARGET + rows_in).to(tl.int64)
    counted = target != ignore_index
    in_range = (target >= 0) & (target < n_cols)
    # A counted target outside [0, V) is an error that nothing may have caught
    # (check_targets=False). Never read outside the row; make that row's loss and gradient NaN
    # instead, so the error shows.
    bad = counted & ((target < 0) | (target >= n_cols))
    target_logit = tl.load(LOGITS + row_start + target, mask=counted & in_range, other=0.0).to(tl.float32)

    # Sweep 1: running max and rescaled running sum, chunk by chunk.
    m = tl.full((ROWS,), float("-inf"), tl.float32)
    s = tl.zeros((ROWS,), tl.float32)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        # evict_last: ask the L2 to keep this row for the second sweep
        # (assets/notes/cross_entropy.md).
        x = tl.load(
            LOGITS + row_start[:, None] + cols[None, :], mask=(cols < n_cols)[None, :], other=float("-inf"),
            eviction_policy="evict_last",
        ).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=1))
        # exp(m − m_new) is 0 on the first chunk (m = -inf) and ≤ 1 after; padding lanes (-inf) add
        # exp(-inf) = 0.
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new[:, None]), axis=1)
        m = m_new
    log_s = tl.log(s)

    # loss = logsumexp − x[t] = (m − x[t]) + log(s): subtracting the large numbers first keeps
    # float32 exact for logits of size 1e4, where m + log(s) alone would round to a multiple of
    # 2**-10.
    loss = tl.where(counted, (m - target_logit) + log_s, 0.0)
    loss = tl.where(bad, float("nan"), loss)
    tl.store(LOSS + rows, loss, mask=row_ok)
    tl.store(LSE + rows, m + log_s, mask=row_ok)

    if COMPUTE_GRAD:
        # Sweep 2: grad = (softmax − onehot) · scale, with scale = 1 / n_valid (mean), 1 /
        # normalizer or 1 (sum, none), read from device memory so the host never has to know
        # n_valid. Ignored rows get scale 0: a zero gradient row, written like any other (the buffer
        # may be the logits themselves, which must not survive).
        scale = tl.load(SCALE).to(tl.float32)
        row_scale = tl.where(counted, scale, 0.0)
        row_scale = tl.where(bad, float("nan"), row_scale)
        grad_start = _row_offsets(rows_in, inner_rows, grad_stride_outer, grad_stride_inner)
        for start in range(0, n_cols, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            col_ok = cols < n_cols
            x = tl.load(LOGITS + row_start[:, None] + cols[None, :], mask=col_ok[None, :], other=0.0,
                        eviction_policy="evict_first").to(tl.float32)  # last use of this chunk
            p = tl.exp((x - m[:, None]) - log_s[:, None])  # softmax; (x − m) first, for the reason above
            onehot = tl.where(cols[None, :] == target[:, None], 1.0, 0.0)
            g = (p - onehot) * row_scale[:, None]
            tl.store(
                GRAD + grad_start[:, None] + cols[None, :], cast_to(g, GRAD.dtype.element_ty),
                mask=row_ok[:, None] & col_ok[None, :],
            )


@triton.jit
def reduce_loss_kernel(LOSS, SCALE, OUT, n_rows, BLOCK_R: tl.constexpr):
    """The reduced loss: the per-row losses summed and divided by SCALE[1], in one program
    (``launch_forward``, and ``kernels.linear_cross_entropy``'s passes).

    Args:
        LOSS: pointer to the float32 per-row losses.
        SCALE: pointer to [gradient factor, divisor].
        OUT: pointer to the float32 scalar loss, written.
        n_rows: number of per-row losses.
        BLOCK_R: losses read per iteration.
    """
    # One program sums the per-row losses in a fixed order (the same loss on every run) and divides
    # by SCALE[1]: n_valid for "mean" (0 when every target is ignored: 0 / 0 = NaN, as
    # F.cross_entropy), the normalizer, or 1. (Finishing inside the main kernel instead, with a
    # ticket per program, put 16K atomics on one address.)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for start in range(0, n_rows, BLOCK_R):
        idx = start + tl.arange(0, BLOCK_R)
        acc += tl.load(LOSS + idx, mask=idx < n_rows, other=0.0)
    tl.store(OUT, tl.sum(acc, axis=0) / tl.load(SCALE + 1))


@triton.jit
def cross_entropy_setup_kernel(TARGET, NORMALIZER, SCALE, n_rows, ignore_index, normalizer_value,
                               MODE: tl.constexpr, BLOCK: tl.constexpr):
    """SCALE = [gradient factor, divisor] of a reduction, in one program (``gradient_scale`` launches it).

    Args:
        TARGET: pointer to the class indices (counted for MODE 0).
        NORMALIZER: pointer to the divisor (MODE 1).
        SCALE: pointer to the two float32 values, written.
        n_rows: number of targets.
        ignore_index: the target value that is not counted.
        normalizer_value: the divisor as a number (MODE 2).
        MODE: 0 mean, 1 tensor normalizer, 2 numeric normalizer, 3 no divisor.
        BLOCK: targets counted per iteration.
    """
    # One program writes SCALE = [gradient factor, divisor] on the device, so the host never needs
    # n_valid. MODE 0: mean (divisor = number of targets that are not ignored); 1: divisor read from
    # NORMALIZER (a tensor); 2: divisor = normalizer_value (a number); 3: no divisor.
    if MODE == 0:
        count = tl.zeros((BLOCK,), dtype=tl.int32)
        for start in range(0, n_rows, BLOCK):
            idx = start + tl.arange(0, BLOCK)
            in_rows = idx < n_rows
            # Widen to int64 before comparing: a uint8 or int8 index compared with ignore_index in
            # its own dtype would wrap (-100 is 156 as uint8), and so would a padding value standing
            # in for ignore_index.
            t = tl.load(TARGET + idx, mask=in_rows, other=0).to(tl.int64)
            count += tl.where(in_rows & (t != ignore_index), 1, 0)
        divisor = tl.sum(count, axis=0).to(tl.float32)
    elif MODE == 1:
        divisor = tl.load(NORMALIZER).to(tl.float32)
    elif MODE == 2:
        divisor = normalizer_value + 0.0  # a float32 argument on the GPU, a Python float in the interpreter
    else:
        divisor = 1.0
    # 1 / 0 = inf for an all-ignored mean is harmless: every row is ignored, and ignored rows get
    # factor 0.
    tl.store(SCALE, 1.0 / divisor)
    tl.store(SCALE + 1, divisor)


@triton.jit
def scale_grad_kernel(
    GRAD, GRAD_OUT, n_rows, n_cols, inner_rows, stride_outer, stride_inner, stride_go,
    ROWS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """The backward pass: the gradient the forward wrote, times grad_output, in place
    (``scale_gradient_``).

    Args:
        GRAD: pointer to the gradient, read and written.
        GRAD_OUT: pointer to grad_output, a scalar or one value per row.
        n_rows, n_cols: rows and values per row of the gradient.
        inner_rows, stride_outer, stride_inner: the gradient's row layout (``RowLayout``).
        stride_go: grad_output's row stride (0 for a scalar).
        ROWS, BLOCK_V: rows per program, values per chunk of a row.
    """
    # grad *= grad_output, in place. grad_output is a scalar (stride_go = 0: every row reads the
    # same element) or one value per row (reduction="none"). Programs whose factors are all exactly
    # 1.0 return without touching the gradient: the common case (loss.backward() on an unscaled
    # loss) costs one 4-byte load per program.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    go = tl.load(GRAD_OUT + rows * stride_go, mask=row_ok, other=1.0).to(tl.float32)
    n_to_scale = tl.sum(tl.where(go != 1.0, 1, 0))  # NaN != 1.0, so a NaN factor is applied too
    if n_to_scale > 0:
        row_start = _row_offsets(tl.minimum(rows, n_rows - 1), inner_rows, stride_outer, stride_inner)
        for start in range(0, n_cols, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            ok = row_ok[:, None] & (cols < n_cols)[None, :]
            ptrs = GRAD + row_start[:, None] + cols[None, :]
            g = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
            tl.store(ptrs, cast_to(g * go[:, None], GRAD.dtype.element_ty), mask=ok)


# --------------------------------------------------------------------------------------------------
# Launch configuration: one function per kernel
# --------------------------------------------------------------------------------------------------

# The interpreter pays Python per program but runs each tile as NumPy: few programs with big tiles.
_INTERPRETER_MAX_TILE = 1 << 18
_INTERPRETER_BLOCK_V = 4096  # small enough that a row of a few thousand logits still spans several chunks


@dataclass(frozen=True)
class CrossEntropyConfig:
    """How a cross-entropy kernel is launched."""

    block_v: int  # logits per chunk of a row
    rows: int  # rows per program
    num_warps: int


def forward_config(n_rows: int, n_cols: int, props: runtime.DeviceProps | None = None) -> CrossEntropyConfig:
    """Launch configuration of the forward kernel; chapter 06 reads how it is chosen.

    Args:
        n_rows, n_cols: rows of the logits and logits per row.
        props: the device's properties (default: this machine's device).

    Returns:
        The configuration: on a GPU one row per program, in the interpreter few large tiles.
    """
    return _forward_config(n_rows, n_cols, props or runtime.device_props())


@functools.lru_cache(maxsize=512)
def _forward_config(n_rows: int, n_cols: int, props: runtime.DeviceProps) -> CrossEntropyConfig:
    if props.interpreter:
        block_v = min(triton.next_power_of_2(n_cols), _INTERPRETER_BLOCK_V)
        rows = min(triton.next_power_of_2(max(n_rows, 1)), max(1, _INTERPRETER_MAX_TILE // block_v))
        return CrossEntropyConfig(block_v=block_v, rows=rows, num_warps=4)
    # GPU: one row per program, chunks of 16 float32 values per thread over 8 warps, i.e.
    # regs_per_sm / 16 logits (4,096 on every NVIDIA GPU since Volta), so that many programs stay
    # resident per SM. A step moves 6 bytes per logit (two reads, one write); the sweep of chunks
    # and warps is in assets/notes/cross_entropy.md.
    block_v = min(triton.next_power_of_2(n_cols), max(1024, props.regs_per_sm // 16))
    num_warps = 8 if block_v >= 4096 else 4
    return CrossEntropyConfig(block_v=block_v, rows=1, num_warps=num_warps)


def backward_config(n_rows: int, n_cols: int,
                    props: runtime.DeviceProps | None = None) -> CrossEntropyConfig:
    """Launch configuration of the backward scaling kernel.

    Args:
        n_rows, n_cols: rows of the gradient and values per row.
        props: the device's properties (default: this machine's device).

    Returns:
        The configuration: one row per program on a GPU, the forward's in the interpreter.
    """
    return _backward_config(n_rows, n_cols, props or runtime.device_props())


@functools.lru_cache(maxsize=512)
def _backward_config(n_rows: int, n_cols: int, props: runtime.DeviceProps) -> CrossEntropyConfig:
    if props.interpreter:
        return _forward_config(n_rows, n_cols, props)
    # One row per program, as in the forward: when grad_output is 1.0 each program is a single load,
    # then exits.
    block_v = min(triton.next_power_of_2(n_cols), max(1024, props.regs_per_sm // 8))
    return CrossEntropyConfig(block_v=block_v, rows=1, num_warps=8 if block_v >= 4096 else 4)


# --------------------------------------------------------------------------------------------------
# Host side: checks, row layout, launches
# --------------------------------------------------------------------------------------------------


def check_scores(name: str, scores) -> None:
    """Check the tensor of scores a loss reads (logits, or a linear layer's input).

    It must be a float32/bf16/fp16 tensor, on the device the kernels run on (or on the meta device,
    where only shapes are computed).

    Args:
        name: the argument's name, for the messages.
        scores: the object to check.

    Raises:
        TypeError: not a tensor, or not of a dtype the kernels take.
        ValueError: in gpu mode, a tensor that is neither on a CUDA device nor on meta.
    """
    if not isinstance(scores, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(scores).__name__}")
    if not scores.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {scores.dtype}")
    ops.check_kernel_dtype(name, scores,
                           f"cast with .float(), or use torch.nn.functional.cross_entropy for {scores.dtype}")
    if not runtime.INTERPRET and scores.device.type not in ("cuda", "meta"):
        raise ValueError(f"in gpu mode the inputs must be CUDA tensors, got {name} on {scores.device}")


def check_loss_args(target, rows_of: str, lead: tuple, device, ignore_index, reduction, normalizer) -> None:
    """Checks shared by the losses (this module's and ``kernels.linear_cross_entropy``'s).

    ``target`` must hold one integer class per row of the scores, and the reduction,
    ``ignore_index`` and ``normalizer`` must be ones the kernels know.

    Args:
        target: the class indices; shape ``lead``, or 1-D with one entry per row.
        rows_of: what the rows belong to, e.g. ``"logits (4, 7, 32)"``, for the messages (its first
            word names the tensor).
        lead: the scores' leading shape.
        device: the scores' device, which ``target`` must share.
        ignore_index, reduction, normalizer: as ``cross_entropy`` takes them.

    Raises:
        TypeError: ``target`` is not a tensor of one of ``TARGET_DTYPES``, ``ignore_index`` is not
            an int, or ``normalizer`` is neither a real number nor a one-element real tensor.
        ValueError: a wrong shape or device, an ``ignore_index`` beyond int64, an unknown
            reduction, a ``normalizer`` without ``reduction="sum"``, or one that requires grad.
    """
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a tensor, got {type(target).__name__}")
    if target.dtype not in TARGET_DTYPES:
        raise TypeError(
            f"target must hold integer class indices of dtype int64, int32, int16, int8 or uint8, got dtype "
            f"{target.dtype}" + ("" if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool
                                 else ": cast it with .long()")
        )
    n_rows = math.prod(lead)
    if tuple(target.shape) != lead and not (target.dim() == 1 and target.numel() == n_rows):
        raise ValueError(
            f"target must have shape {lead} (one class index per row of {rows_of}) "
            f"or be 1-D with {n_rows} entries, got shape {tuple(target.shape)}"
        )
    if target.device != device:
        name = rows_of.split(" ")[0]
        raise ValueError(f"{name} and target must be on the same device, got {device} and {target.device}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if not -2**63 <= ignore_index < 2**63:  # compared with int64 class indices
        raise ValueError(f"ignore_index must fit in int64, got {ignore_index}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if normalizer is not None:
        if reduction != "sum":
            raise ValueError(f'normalizer divides a summed loss: use it with reduction="sum", not {reduction!r}')
        is_number = isinstance(normalizer, Real) and not isinstance(normalizer, bool)
        is_scalar_tensor = (isinstance(normalizer,
                                       torch.Tensor) and normalizer.numel() == 1 and normalizer.dim() <= 1
                            and not normalizer.is_complex() and normalizer.dtype != torch.bool)
        if not (is_number or is_scalar_tensor):
            raise TypeError(f"normalizer must be a number or a one-element tensor of real values, got {normalizer!r}")
        if isinstance(normalizer, torch.Tensor) and normalizer.requires_grad:
            # The kernels treat it as a count (Hugging Face's num_items_in_batch): no gradient would
            # reach it.
            raise ValueError("normalizer must not require a gradient: it is a count the loss is divided by; pass "
                             "normalizer.detach(), or divide the summed loss yourself")


# nn.CrossEntropyLoss's options that the kernels do not implement, each with the one value that
# means "off". A module of this package refuses any other value at every call, however it was set
# (the attribute may be assigned after construction): ignoring it would give a different loss
# without a word.
OFF_OPTIONS = {"weight": None, "label_smoothing": 0.0, "size_average": None, "reduce": None}


def check_options_off(module: torch.nn.Module, names=tuple(OFF_OPTIONS)) -> None:
    """Refuse an ``nn.CrossEntropyLoss`` option that the kernels do not implement.

    Args:
        module: the loss module, whose attributes are read (a missing one counts as off).
        names: the options to check, keys of ``OFF_OPTIONS``.

    Raises:
        ValueError: naming the first option set to anything but its off value.
    """
    for name in names:
        value, off = getattr(module, name, OFF_OPTIONS[name]), OFF_OPTIONS[name]
        is_off = value is None if off is None else (
            isinstance(value, Real) and not isinstance(value, bool) and value == off)
        if not is_off:
            raise ValueError(
                f"{type(module).__name__} does not implement {name}={value!r} (only {name}={off!r}): use "
                "torch.nn.CrossEntropyLoss for it"
            )


def check_flags(**flags) -> None:
    """Each keyword must be a bool: a string such as "False" is truthy, and would turn a switch on
    silently.

    Args:
        flags: the switches, by name.

    Raises:
        TypeError: naming the first one that is not True or False.
    """
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")


def _check_inputs(logits, target, ignore_index, reduction, normalizer) -> None:
    if not isinstance(logits, torch.Tensor) or not isinstance(target, torch.Tensor):
        raise TypeError(f"logits and target must be tensors, got {type(logits).__name__} and {type(target).__name__}")
    check_scores("logits", logits)
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have a last dimension of at least one class, got shape {tuple(logits.shape)}")
    check_loss_args(target, f"logits {tuple(logits.shape)}", tuple(logits.shape[:-1]),
                    logits.device, ignore_index,
                    reduction, normalizer)


def has_data(t: torch.Tensor) -> bool:
    """Whether ``t`` holds values that can be read: not a meta tensor, not a FakeTensor (shapes
    only). Decided from metadata alone, outside ``torch.compile`` (which traces with fake tensors
    and keeps what a real call does).

    Args:
        t: the tensor.

    Returns:
        True for a tensor with data, and always while ``torch.compile`` traces.
    """
    if torch.compiler.is_compiling():
        return True
    return t.device.type != "meta" and not torch._subclasses.fake_tensor.is_fake(t)


def check_target_range(target: torch.Tensor, n_classes: int, ignore_index: int) -> None:
    """Refuse a target outside [0, ``n_classes``) that is not ``ignore_index``.

    What ``check_targets=True`` asks of the losses of this module and of
    ``kernels.linear_cross_entropy``: one device-to-host synchronisation. Targets without values
    (meta, FakeTensor) have nothing to check.

    Args:
        target: the class indices.
        n_classes: the vocabulary size V.
        ignore_index: the target value that is allowed outside the range.

    Raises:
        ValueError: naming the first such target and its position.
    """
    # One device-to-host transfer: the price of a clear error for a bad label. Callers under CUDA
    # graphs or torch.compile pass check_targets=False; the kernel then makes such rows NaN instead
    # of reading out of bounds.
    if not has_data(target):
        return
    # Compared as int64, as the kernels do: uint8 and int8 would wrap ignore_index (-100 == 156 as
    # uint8).
    target = target.long()
    bad = (target != ignore_index) & ((target < 0) | (target >= n_classes))
    if bad.any().item():
        position = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"target holds a class index outside [0, {n_classes}) that is not ignore_index={ignore_index}: "
            f"target{list(position)} = {int(target[position])}"
        )


@dataclass(frozen=True)
class RowLayout:
    """Where row r of ``tensor`` lives: (r // inner_rows) · stride_outer + (r % inner_rows) ·
    stride_inner, the row arguments the kernels take (``row_layout``)."""

    # what the kernel reads (and writes): the caller's tensor, or a contiguous copy of it
    tensor: torch.Tensor
    n_rows: int
    n_cols: int
    inner_rows: int
    stride_outer: int
    stride_inner: int


def _merged_leading_dims(shape: tuple[int, ...], strides: tuple[int, ...]) -> list[tuple[int, int]]:
    """(size, stride) of the leading dimensions, merging neighbours that a single stride can walk."""
    merged: list[tuple[int, int]] = []
    for size, stride in zip(reversed(shape[:-1]), reversed(strides[:-1])):
        if size == 1:
            continue
        if merged and stride == merged[-1][0] * merged[-1][1]:
            merged[-1] = (merged[-1][0] * size, merged[-1][1])
        else:
            merged.append((size, stride))
    return merged[::-1]


def _overlapping(n_cols: int, dims: list[tuple[int, int]]) -> bool:
    """Whether two rows may share memory: a stride of 0 (``expand``), or rows closer than a row's extent
    (``unfold``, ``as_strided``). Sorted by stride, each level must step past everything inside it."""
    if any(size == 0 for size, _ in dims):  # no rows at all
        return False
    extent = n_cols  # elements spanned by one element of the level below (a row, then a block of rows)
    for size, stride in sorted(dims, key=lambda d: d[1]):
        if stride < extent:
            return True
        extent = stride * (size - 1) + extent
    return False


@functools.lru_cache(maxsize=1024)
def _row_decomposition(shape: tuple[int, ...], strides: tuple[int, ...], for_writing: bool):
    """(n_rows, n_cols, inner_rows, stride_outer, stride_inner), or None when the kernels cannot
    address the rows.

    Addressable: a contiguous last dimension and leading dimensions that collapse to at most two
    strided levels (any contiguous tensor, and sliced views such as ``logits[:, :-1, :]``). Rows
    that overlap in memory (a stride of 0, from ``expand``; windows from ``unfold``) can be read but
    not written: two rows' gradients would land in the same place.
    """
    dims = _merged_leading_dims(shape, strides)
    # A last dimension of size 1 has a stride that nothing reads (and .contiguous() keeps it):
    # column 0 only.
    if (strides[-1] != 1 and shape[-1] != 1) or len(dims) > 2 or (for_writing and _overlapping(shape[-1], dims)):
        return None
    n_cols = shape[-1]
    n_rows = math.prod(shape[:-1])
    if len(dims) == 0:
        return n_rows, n_cols, max(n_rows, 1), 0, n_cols
    if len(dims) == 1:
        return n_rows, n_cols, dims[0][0], 0, dims[0][1]
    (_, stride_outer), (inner, stride_inner) = dims
    return n_rows, n_cols, inner, stride_outer, stride_inner


def _in_place_addressable(t: torch.Tensor) -> bool:
    """Whether the kernel can write a gradient over ``t``'s rows (uncached: sizes may be symbolic
    under compile)."""
    return _row_decomposition.__wrapped__(tuple(t.shape), tuple(t.stride()), True) is not None


def _rows_in_place(t: torch.Tensor, for_writing: bool) -> RowLayout | None:
    """The kernels' view of the rows of ``t``, or None when they cannot address them without a copy."""
    found = _row_decomposition(tuple(t.shape), t.stride(), for_writing)
    return None if found is None else RowLayout(t, *found)


def row_layout(t: torch.Tensor, for_writing: bool) -> RowLayout:
    """The rows of ``t`` in place when possible, else those of a contiguous copy (``layout.tensor``).

    Args:
        t: a [..., V] tensor.
        for_writing: a gradient will be written over ``t``: rows that overlap in memory then count
            as not addressable.

    Returns:
        The kernels' row arguments for ``t`` or for its copy.
    """
    return _rows_in_place(t, for_writing) or _rows_in_place(t.contiguous(), for_writing)


def gradient_scale(target_rows, ignore_index, reduction, normalizer, device) -> torch.Tensor:
    """[gradient factor, divisor] as a float32 tensor on ``device``, computed by one small kernel:
    no host sync.

    mean → divisor n_valid, the number of targets that are not ignored; sum → the normalizer, if
    any; else 1. The forward kernel scales the gradient by the factor and ``reduce_loss_kernel``
    divides by the divisor, here and in ``kernels.linear_cross_entropy``.

    Args:
        target_rows: the class indices, 1-D and contiguous.
        ignore_index, reduction, normalizer: as ``cross_entropy`` takes them (checked already).
        device: where the kernels run.

    Returns:
        The two-element float32 tensor; the factor is 1 / divisor.
    """
    scale = torch.empty(2, dtype=torch.float32, device=device)
    norm_ptr, norm_value, mode = scale, 1.0, 3
    if reduction == "mean":
        mode = 0
    elif reduction == "sum" and isinstance(normalizer, torch.Tensor):
        # A tensor is read where it lives (a CPU tensor with GPU logits costs a small copy: keep it
        # on the GPU).
        norm_ptr, mode = normalizer.detach().reshape(1).to(device=device, dtype=torch.float32), 1
    elif reduction == "sum" and normalizer is not None:
        norm_value, mode = float(normalizer), 2
    block = min(triton.next_power_of_2(max(target_rows.numel(), 1)), 4096)
    cross_entropy_setup_kernel[(1,)](target_rows, norm_ptr, scale, target_rows.numel(),
                                     ignore_index, norm_value,
                                     MODE=mode, BLOCK=block)
    return scale


def launch_forward(layout, target_rows, loss_rows, lse, grad_layout, scale, out, ignore_index, cfg):
    """The forward kernel over ``layout``'s rows into the caller's buffers, then, when ``out`` is
    given, the reduction of the loss into it.

    Args:
        layout: the logits' rows (``row_layout``); at least one row.
        target_rows: the class indices, 1-D and contiguous.
        loss_rows, lse: float32 buffers of one value per row, written.
        grad_layout: where the gradient goes (may be ``layout`` itself), or None for no gradient.
        scale: ``gradient_scale``'s tensor.
        out: a float32 scalar for the reduced loss, or None ("none").
        ignore_index: the target value that counts for nothing.
        cfg: the launch configuration (``forward_config``).
    """
    compute_grad = grad_layout is not None
    if not compute_grad:  # the pointers are never dereferenced: COMPUTE_GRAD compiles the gradient sweep out
        grad_layout = layout
    cross_entropy_fwd_kernel[(triton.cdiv(layout.n_rows, cfg.rows),)](
        layout.tensor, target_rows, loss_rows, lse, grad_layout.tensor, scale,
        layout.n_rows, layout.n_cols, layout.inner_rows, layout.stride_outer, layout.stride_inner,
        grad_layout.stride_outer, grad_layout.stride_inner, ignore_index,
        ROWS=cfg.rows, BLOCK_V=cfg.block_v, COMPUTE_GRAD=compute_grad, num_warps=cfg.num_warps,
    )
    if out is not None:
        reduce_loss_kernel[(1,)](loss_rows, scale, out, layout.n_rows,
                                 BLOCK_R=min(triton.next_power_of_2(layout.n_rows), 4096), num_warps=8)


def cross_entropy_forward(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    normalizer=None,
    compute_grad: bool = True,
    inplace: bool = False,
    config: CrossEntropyConfig | None = None,
):
    """Run the forward kernel on already-checked inputs (chapters 06 and 10 call it).

    Args:
        logits: [..., V] scores.
        target: class indices, one per row.
        ignore_index, reduction, normalizer: as ``cross_entropy`` takes them.
        compute_grad: also compute d(loss)/d(logits).
        inplace: write that gradient over the logits' memory.
        config: a launch configuration, instead of ``forward_config``'s.

    Returns:
        ``(loss, lse, grad)``: ``loss`` reduced as asked (float32); ``lse`` the float32 logsumexp
        of every row, shape ``[rows]``; ``grad`` d(loss)/d(logits) in the shape and dtype of
        ``logits``, or None when ``compute_grad`` is false. With ``inplace``, ``grad`` is
        ``logits`` itself (or, when the logits had to be copied, see ``row_layout``, that copy).
    """
    layout = row_layout(logits, for_writing=compute_grad and inplace)
    device = logits.device
    target_rows = target.reshape(-1)
    if target_rows.stride(0) != 1:
        target_rows = target_rows.contiguous()
    loss_rows = torch.empty(layout.n_rows, dtype=torch.float32, device=device)
    lse = torch.empty(layout.n_rows, dtype=torch.float32, device=device)
    grad_layout = None
    if compute_grad:
        if inplace:
            grad_layout = layout
        # a contiguous buffer, addressed with the logits' row decomposition (the kernel has one
        # inner_rows)
        else:
            grad = torch.empty(logits.shape, dtype=logits.dtype, device=device)
            grad_layout = RowLayout(grad, layout.n_rows, layout.n_cols, layout.inner_rows,
                                    layout.inner_rows * layout.n_cols, layout.n_cols)
    reduce = reduction != "none"
    out = torch.empty((), dtype=torch.float32, device=device) if reduce else None
    if layout.n_rows:
        scale = gradient_scale(target_rows, ignore_index, reduction, normalizer, device)
        cfg = config or _forward_config(layout.n_rows, layout.n_cols, runtime.device_props(device))
        launch_forward(layout, target_rows, loss_rows, lse, grad_layout, scale, out, ignore_index, cfg)
    elif reduce:  # no rows: the sum is 0, and a mean over no targets is 0 / 0
        out.fill_(float("nan") if reduction == "mean" else 0.0)
    loss = out if reduce else loss_rows.view(logits.shape[:-1])
    return loss, lse, (grad_layout.tensor if compute_grad else None)


def scale_gradient_(grad: torch.Tensor, grad_output: torch.Tensor, config: CrossEntropyConfig | None = None):
    """Multiply ``grad`` ([..., V], written by the forward kernel) in place by ``grad_output`` and return it.

    Rows whose factor is exactly 1.0 are skipped on the device: no host sync, and no pass over the
    gradient in the common case.

    Args:
        grad: the gradient the forward kernel wrote.
        grad_output: a scalar (reductions "mean" and "sum") or one value per row ("none").
        config: a launch configuration, instead of ``backward_config``'s.

    Returns:
        ``grad`` itself, scaled.

    Raises:
        ValueError: ``grad``'s rows cannot be addressed in place, or ``grad_output`` is neither a
            scalar nor one value per row.
    """
    if grad.numel() == 0:  # no rows (or no columns): nothing to scale
        return grad
    layout = _rows_in_place(grad, for_writing=True)
    if layout is None:  # never the case for a buffer the forward kernel wrote
        raise ValueError("scale_gradient_ needs a gradient whose rows the kernel can address in place")
    if layout.n_rows == 0:
        return grad
    go = grad_output.detach().reshape(-1)
    if go.numel() not in (1, layout.n_rows):
        raise ValueError(f"grad_output must be a scalar or have one value per row ({layout.n_rows}), got {go.numel()}")
    # an expanded gradient (loss.sum() of "none") has stride 0
    stride_go = 0 if go.numel() == 1 else go.stride(0)
    cfg = config or _backward_config(layout.n_rows, layout.n_cols, runtime.device_props(grad.device))
    scale_grad_kernel[(triton.cdiv(layout.n_rows, cfg.rows),)](
        grad, go, layout.n_rows, layout.n_cols, layout.inner_rows, layout.stride_outer, layout.stride_inner,
        stride_go, ROWS=cfg.rows, BLOCK_V=cfg.block_v, num_warps=cfg.num_warps,
    )
    return grad


# --------------------------------------------------------------------------------------------------
# PyTorch operators: torch.ops.kernels.cross_entropy_fwd, cross_entropy_fwd_inplace,
# cross_entropy_scale_grad_
# --------------------------------------------------------------------------------------------------
# A normalizer reaches the operators as a tensor (``normalizer``) or a number
# (``normalizer_value``): a schema types each argument. The in-place forward declares that it writes
# ``logits`` (``Tensor(a!)``); an operator may not return a view of its input, so it returns the
# loss and the logsumexp, and the caller knows the gradient is in ``logits``.


def normalizer_arg(normalizer, normalizer_value):
    """The normalizer an operator was given, as one argument again (``split_normalizer`` splits it).

    Args:
        normalizer: the tensor normalizer, or None.
        normalizer_value: the numeric one, or None.

    Returns:
        The tensor, else the number (or None).
    """
    return normalizer if normalizer is not None else normalizer_value


def _forward_op_impl(logits, target, ignore_index, reduction, normalizer, normalizer_value, compute_grad):
    loss, lse, grad = cross_entropy_forward(
        logits, target, ignore_index, reduction, normalizer_arg(normalizer, normalizer_value), compute_grad
    )
    return loss, lse, (grad if grad is not None else logits.new_empty(0))


def _forward_inplace_op_impl(logits, target, ignore_index, reduction, normalizer, normalizer_value):
    loss, lse, grad = cross_entropy_forward(
        logits, target, ignore_index, reduction, normalizer_arg(normalizer, normalizer_value), True, True
    )
    if grad is not logits:  # CrossEntropyFunction only asks for rows the kernel can write in place
        raise ValueError("cross_entropy_fwd_inplace needs logits whose rows the kernel can address in place")
    # A Triton store is invisible to autograd: bump the version counter by hand, as PyTorch's own
    # in-place ops do.
    torch.autograd.graph.increment_version(logits)
    return loss, lse


def _loss_and_lse_fake(logits, reduction):
    n_rows = logits.numel() // logits.shape[-1]
    loss_shape = logits.shape[:-1] if reduction == "none" else ()
    return (torch.empty(loss_shape, dtype=torch.float32, device=logits.device),
            torch.empty(n_rows, dtype=torch.float32, device=logits.device))


def _forward_op_fake(logits, target, ignore_index, reduction, normalizer, normalizer_value, compute_grad):
    grad = torch.empty(logits.shape, dtype=logits.dtype,
                       device=logits.device) if compute_grad else logits.new_empty(0)
    return (*_loss_and_lse_fake(logits, reduction), grad)


def _forward_inplace_op_fake(logits, target, ignore_index, reduction, normalizer, normalizer_value):
    return _loss_and_lse_fake(logits, reduction)


def _scale_grad_op_impl(grad, grad_output):
    scale_gradient_(grad, grad_output)
    torch.autograd.graph.increment_version(grad)


cross_entropy_fwd_op = ops.define(
    "cross_entropy_fwd(Tensor logits, Tensor target, int ignore_index, str reduction, Tensor? normalizer, "
    "float? normalizer_value, bool compute_grad) -> (Tensor, Tensor, Tensor)",
    _forward_op_impl, _forward_op_fake,
)
cross_entropy_fwd_inplace_op = ops.define(
    "cross_entropy_fwd_inplace(Tensor(a!) logits, Tensor target, int ignore_index, str reduction, "
    "Tensor? normalizer, float? normalizer_value) -> (Tensor, Tensor)",
    _forward_inplace_op_impl, _forward_inplace_op_fake,
)
cross_entropy_scale_grad_op = ops.define(
    "cross_entropy_scale_grad_(Tensor(a!) grad, Tensor grad_output) -> ()", _scale_grad_op_impl,
    lambda g, go: None,
)


# --------------------------------------------------------------------------------------------------
# autograd, function, module
# --------------------------------------------------------------------------------------------------


class CrossEntropyFunction(torch.autograd.Function):
    """autograd glue. The forward computes the gradient already; backward multiplies it by
    grad_output. A plain eager call runs the operators' implementations directly (``ops.call``).

    Nothing but the gradient is saved (the logsumexp is not needed again). The gradient is scaled in
    place, so backward may run only once per forward (``retain_graph=True`` and a second backward
    raise).
    """

    @staticmethod
    def forward(ctx, logits, target, ignore_index, reduction, normalizer, normalizer_value,
                inplace_backward):
        """The loss, with its gradient computed and saved for ``backward``.

        Args:
            ctx: autograd's context.
            logits, target, ignore_index, reduction: as ``cross_entropy`` takes them (checked).
            normalizer, normalizer_value: the normalizer split by ``split_normalizer``.
            inplace_backward: write the gradient over ``logits`` when their rows allow it.

        Returns:
            The float32 loss.
        """
        # Rows the kernel cannot write in place (a strided last dimension, overlapping expanded
        # rows) are copied by the out-of-place operator, whose gradient goes into a new buffer: the
        # caller's logits stay untouched.
        if inplace_backward and _in_place_addressable(logits):
            # The operator writes the gradient over the logits and, declaring that write, bumps
            # their version counter: any autograd node that saved the logits for its own backward
            # then fails loudly ("modified by an inplace operation") instead of using the gradient
            # as logits.
            loss, _ = ops.call(cross_entropy_fwd_inplace_op, logits, target, ignore_index,
                               reduction, normalizer,
                               normalizer_value)
            # the same memory, without autograd history: what backward hands on as the gradient
            grad = logits.detach()
        else:
            loss, _, grad = ops.call(cross_entropy_fwd_op, logits, target, ignore_index, reduction,
                                     normalizer,
                                     normalizer_value, True)
        ctx.save_for_backward(grad)
        ctx.backward_done = False
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        """The saved gradient times ``grad_output``, scaled in place.

        Args:
            ctx: autograd's context.
            grad_output: the loss's incoming gradient.

        Returns:
            The logits' gradient, and None for every other input.

        Raises:
            RuntimeError: a second backward through the same forward.
        """
        if ctx.backward_done:
            raise RuntimeError(
                "cross_entropy's gradient was computed in the forward pass and scaled in place by the first backward; "
                "a second backward through the same loss is not supported: compute the loss again"
            )
        ctx.backward_done = True
        (grad,) = ctx.saved_tensors
        ops.call(cross_entropy_scale_grad_op, grad, grad_output)
        return grad, None, None, None, None, None, None


def split_normalizer(normalizer, device: torch.device):
    """(tensor, number): the operators take a tensor normalizer and a numeric one as separate arguments
    (``normalizer_arg`` joins them again).

    Under ``torch.compile`` a number becomes a tensor: the compiler treats a Python float as a
    constant, so a count that changes every step (Hugging Face's ``num_items_in_batch``) would
    recompile the model at every step.

    Args:
        normalizer: None, a number or a one-element tensor.
        device: where a number becomes a tensor under ``torch.compile``.

    Returns:
        ``(tensor or None, float or None)``, at most one of them set; a tensor is detached and 0-D.
    """
    if normalizer is None:
        return None, None
    if isinstance(normalizer, torch.Tensor):
        return normalizer.detach().reshape(()), None
    if torch.compiler.is_compiling():
        return torch.scalar_tensor(normalizer, dtype=torch.float32, device=device), None
    return None, float(normalizer)


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    *,
    normalizer=None,
    inplace_backward: bool = False,
    check_targets: bool = True,
) -> torch.Tensor:
    """Cross-entropy of ``logits`` ([..., V]) against class indices ``target``, as ``F.cross_entropy``.

    Returns a float32 loss (like Hugging Face, which upcasts the logits): a scalar for
    ``reduction="mean"`` or ``"sum"``, shape ``logits.shape[:-1]`` for ``"none"``. Targets equal to
    ``ignore_index`` contribute 0 to the loss and a zero gradient row; ``"mean"`` divides by the
    number of targets that are not ignored, so a batch in which every target is ignored gives NaN (0
    / 0), exactly like ``F.cross_entropy``, and an all-zero gradient.

    ``normalizer`` (``reduction="sum"`` only; a number or a one-element tensor, which may live on
    the GPU): the loss is ``sum / normalizer`` and the gradient is scaled inside the kernel. This is
    Hugging Face's ``num_items_in_batch`` under gradient accumulation, and it keeps the backward
    pass at grad_output == 1.

    ``inplace_backward=True`` — READ THIS: the caller promises not to use ``logits`` after this
    call. The gradient is computed during the forward pass and written over the logits' memory, so
    no [rows, V] buffer is allocated. **After the call, the logits tensor holds the gradient, not
    the logits.** A training loop that only needs the logits for the loss (the usual case) saves
    rows × V × itemsize bytes of peak memory. When the logits need a copy first (last-dimension
    stride ≠ 1, see below) the gradient goes into a new buffer and the logits are left as they were.

    Layout: any leading dimensions; rows may be strided (e.g. ``logits[:, :-1, :]`` of a causal LM
    is read and, in place, written without a copy). A last dimension with stride ≠ 1 is copied
    first. (Shifting the *labels*, as Hugging Face does, is still better than slicing the logits:
    autograd's backward of a slice allocates a full zero gradient for the unsliced tensor.)

    ``check_targets`` (default True): raise a ValueError for a target outside [0, V) that is not
    ``ignore_index``. That check costs one device-to-host synchronisation per call (a ``.item()``:
    some microseconds, and it stalls the CPU until the GPU has caught up); code under CUDA graphs or
    ``torch.compile`` must pass ``check_targets=False``. Without the check the kernel still never
    reads out of bounds: such a row's loss (and gradient) is NaN, so the error shows in the loss
    instead of being silently wrong.

    When the logits do not require a gradient, or autograd is off, the gradient is not computed at
    all and the kernel reads the logits once. The kernels are PyTorch operators
    (``torch.ops.kernels.cross_entropy_*``), so ``torch.compile`` and CUDA graphs see each launch as
    one node. Chapter 05 derives the online softmax it uses, chapter 06 the kernel.

    Args:
        logits: [..., V] scores, any leading dimensions; rows may be strided.
        target: class indices, ``logits.shape[:-1]``.
        ignore_index: the target value that contributes nothing.
        reduction: "mean", "sum" or "none".
        normalizer: with "sum" only, divides the sum (a number or a one-element tensor).
        inplace_backward: write the gradient over ``logits`` (see above: the logits are lost).
        check_targets: raise for a target outside [0, V) (one host synchronisation).

    Returns:
        The float32 loss: a scalar, or ``logits.shape[:-1]`` for "none".

    Raises:
        TypeError: inputs that are not tensors, a dtype the kernels do not take, a switch that is
            not a bool (see ``check_scores``, ``check_loss_args``, ``check_flags``).
        ValueError: shapes or devices that do not match, an unknown reduction, a misused
            normalizer, or, with ``check_targets``, a target out of range.
    """
    _check_inputs(logits, target, ignore_index, reduction, normalizer)
    check_flags(inplace_backward=inplace_backward, check_targets=check_targets)
    if check_targets:
        check_target_range(target, logits.shape[-1], ignore_index)
    norm_tensor, norm_value = split_normalizer(normalizer, logits.device)
    if torch.is_grad_enabled() and logits.requires_grad:
        return CrossEntropyFunction.apply(
            logits, target, ignore_index, reduction, norm_tensor, norm_value, inplace_backward
        )
    return ops.call(cross_entropy_fwd_op, logits, target, ignore_index, reduction, norm_tensor,
                    norm_value, False)[0]


class TritonCrossEntropyLoss(torch.nn.Module):
    """``nn.CrossEntropyLoss`` for [..., V] logits and [...] class indices, computed by the fused kernel.

    See ``cross_entropy`` for the semantics, and for what ``inplace_backward=True`` does to the
    logits you pass. ``nn.CrossEntropyLoss``'s ``weight``, ``label_smoothing``, ``size_average`` and
    ``reduce`` are not implemented: set to anything but their defaults (attributes of the same
    names), every call raises a ValueError.

    Args:
        ignore_index, reduction, inplace_backward, check_targets: as for ``cross_entropy``;
            ``forward(logits, target, normalizer=None)`` passes them on.

    Raises:
        ValueError: an unknown ``reduction`` (at construction).
    """

    # The off values of the options the kernels do not implement (``check_options_off`` reads them
    # at every call).
    weight, label_smoothing, size_average, reduce = None, 0.0, None, None

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", inplace_backward: bool = False,
                 check_targets: bool = True):
        super().__init__()
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.inplace_backward = inplace_backward
        self.check_targets = check_targets

    def forward(self, logits: torch.Tensor, target: torch.Tensor, normalizer=None) -> torch.Tensor:
        """``cross_entropy`` with the module's settings.

        Args:
            logits: [..., V] scores (overwritten by their gradient with ``inplace_backward``).
            target: class indices, ``logits.shape[:-1]``.
            normalizer: with ``reduction="sum"`` only, divides the sum.

        Returns:
            The float32 loss: a scalar, or ``logits.shape[:-1]`` for "none".

        Raises:
            ValueError: an unimplemented option is set (``OFF_OPTIONS``), or as ``cross_entropy``.
            TypeError: as ``cross_entropy``.
        """
        check_options_off(self)
        return cross_entropy(
            logits, target, self.ignore_index, self.reduction, normalizer=normalizer,
            inplace_backward=self.inplace_backward, check_targets=self.check_targets,
        )

    def extra_repr(self) -> str:
        """The module's settings, for its ``repr``.

        Returns:
            ``ignore_index``, ``reduction`` and ``inplace_backward`` as ``name=value`` pairs.
        """
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"inplace_backward={self.inplace_backward}")
