"""Rotary position embedding (RoPE) in Triton: q and k rotated in one launch, forward and backward.

Hugging Face's ``apply_rotary_pos_emb(q, k, cos, sin)`` computes, for x = q and x = k,

    x_embed = x · cos + rotate_half(x) · sin,      rotate_half([x1, x2]) = [−x2, x1]

with x1, x2 the two halves of head_dim D. Written per half, rotate_half is index arithmetic: column
d < D/2 takes its partner d + D/2 with a minus sign, column d ≥ D/2 takes d − D/2 with a plus sign:

    out1 = x1 · cos1 − x2 · sin1
    out2 = x2 · cos2 + x1 · sin2

(cos1, cos2 are the halves of cos; Llama's are equal, cat((f, f)), but the kernel does not assume
it.)

The backward is the transpose of that linear map. ⟨rotate_half(x), v⟩ = −x2·v1 + x1·v2, so
rotate_halfᵀ([v1, v2]) = [v2, −v1], and dx = dy · cos + rotate_halfᵀ(dy · sin):

    dx1 = dy1 · cos1 + dy2 · sin2
    dx2 = dy2 · cos2 − dy1 · sin1

which is the forward with (sin1, sin2) replaced by (−sin2, −sin1): the rotation by −θ. One kernel
does both directions (a ``constexpr`` flag), and nothing but cos and sin is kept for the backward.

Layout: q is [batch, heads, seq, D] and k [batch, kv_heads, seq, D] as Llama's attention makes them,
strided views ``proj(x).view(b, s, h, D).transpose(1, 2)``; they are read through their strides,
never copied. cos and sin are [batch or 1, seq, D]. One program takes a block of (batch, position)
rows, loads their cos and sin once, and rotates every head of q and then of k, as many heads per
step as fit a tile (all of a Llama's): cos and sin are read once per position, not once per head,
and q and k share one launch. The head counts are compile-time constants, so each model's shape gets
its own compiled kernel, with the loop over heads unrolled. The backward writes dq and dk in q's and
k's memory order (``seq_major``), so the gradients go back through the transposed views to the
projections without a copy. Two kernels do the same rotation: one reads any strides (26 runtime
arguments), the other takes dense tensors (Llama's q and k, attention's gradients, cos and sin as
Llama makes them) and derives every stride from the shape and three layout flags (8 runtime
arguments), because Triton's launcher inspects every argument on every call, and this launch runs
twice per attention layer and step.

Arithmetic is float32; outputs are stored in the dtype PyTorch's broadcasting gives Hugging Face's
formula, ``promote_types(q.dtype, cos.dtype)`` (bfloat16 in a bf16 Llama, whose cos and sin come in
the activation dtype).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import host_path, ops, runtime
from .triton_utils import cast_to

# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _head_tile(X, rows, stride_h, cols, HEADS: tl.constexpr):
    # Addresses of the first halves of HEADS heads at the program's rows, a [HEADS, ROWS, half]
    # tile; rows are the int64 offsets of each row's head 0. The second halves are the same tile +
    # half: rotate_half is a swap of two tiles, not a gather.
    heads = tl.arange(0, HEADS)
    return X + rows[None, :, None] + cols[None, None, :] + heads[:, None, None] * stride_h


@triton.jit
def _live(ok, first_head, N_HEADS: tl.constexpr, HEADS: tl.constexpr):
    # The tile's valid elements: rows and columns in range, and heads first_head.. below N_HEADS (a
    # compile-time constant, so a head count that fills the tile, e.g. Llama's 32 and 8, masks
    # nothing).
    return ok[None, :, :] & (first_head + tl.arange(0, HEADS) < N_HEADS)[:, None, None]


@triton.jit
def _load_halves(x_at, live, HALF: tl.constexpr):
    return (tl.load(x_at, mask=live, other=0.0).to(tl.float32),
            tl.load(x_at + HALF, mask=live, other=0.0).to(tl.float32))


@triton.jit
def _store_rotated(o_at, x1, x2, c1, c2, s1, s2, live, HALF: tl.constexpr):
    # out1 = x1·cos1 − x2·sin1, out2 = x2·cos2 + x1·sin2 (module docstring), rounded once to the
    # output's dtype.
    tl.store(o_at, cast_to(x1 * c1 - x2 * s1, o_at.dtype.element_ty), mask=live)
    tl.store(o_at + HALF, cast_to(x2 * c2 + x1 * s2, o_at.dtype.element_ty), mask=live)


@triton.jit
def _rotate_heads(x_at, o_at, stride_xh, stride_oh, c1, c2, s1, s2, ok,
                  N_HEADS: tl.constexpr, HALF: tl.constexpr, HEADS: tl.constexpr):
    # Every head of one tensor, HEADS per step: one step's loads are in flight together rather than
    # one head's after the last one's store. The head count is a compile-time constant, so the loop
    # is unrolled.
    for h in tl.static_range(0, N_HEADS, HEADS):
        live = _live(ok, h, N_HEADS, HEADS)
        x1, x2 = _load_halves(x_at, live, HALF)
        _store_rotated(o_at, x1, x2, c1, c2, s1, s2, live, HALF)
        # Step the 64-bit pointers to the next heads rather than compute head × stride, which is
        # int32 arithmetic on a GPU (a contiguous [B, H, T, D] has T·D elements per head).
        x_at += HEADS * stride_xh
        o_at += HEADS * stride_oh


@triton.jit
def _rotate_rows(Q, K, COS, SIN, QO, KO, rows, n_rows, q_row, k_row, qo_row, ko_row, c_row, s_row,
                 sq_h, sk_h, sqo_h, sko_h,
                 N_Q: tl.constexpr, N_K: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                 Q_HEADS: tl.constexpr, K_HEADS: tl.constexpr, BACKWARD: tl.constexpr):
    # One program's rows, given where each row's head 0 starts in every tensor (q_row ... s_row,
    # int64) and each tensor's head stride: both kernels below only differ in how they find those.
    cols = tl.arange(0, BLOCK_H)
    ok = (rows < n_rows)[:, None] & (cols < HALF)[None, :]

    c_at = COS + c_row[:, None] + cols[None, :]
    s_at = SIN + s_row[:, None] + cols[None, :]
    c1 = tl.load(c_at, mask=ok, other=0.0).to(tl.float32)[None, :, :]
    c2 = tl.load(c_at + HALF, mask=ok, other=0.0).to(tl.float32)[None, :, :]
    s1 = tl.load(s_at, mask=ok, other=0.0).to(tl.float32)[None, :, :]
    s2 = tl.load(s_at + HALF, mask=ok, other=0.0).to(tl.float32)[None, :, :]
    if BACKWARD:
        # The transpose: dx1 = dy1·cos1 + dy2·sin2, dx2 = dy2·cos2 − dy1·sin1 (module docstring).
        s1, s2 = -s2, -s1

    q_at = _head_tile(Q, q_row, sq_h, cols, Q_HEADS)
    k_at = _head_tile(K, k_row, sk_h, cols, K_HEADS)
    qo_at = _head_tile(QO, qo_row, sqo_h, cols, Q_HEADS)
    ko_at = _head_tile(KO, ko_row, sko_h, cols, K_HEADS)
    if N_Q <= Q_HEADS and N_K <= K_HEADS:
        # One step each (every Llama shape): all of q's and k's loads are issued before the first
        # store. The compiler cannot move a load above a store that might write the same memory, so
        # in two steps k's loads would wait for q's stores.
        q_live, k_live = _live(ok, 0, N_Q, Q_HEADS), _live(ok, 0, N_K, K_HEADS)
        q1, q2 = _load_halves(q_at, q_live, HALF)
        k1, k2 = _load_halves(k_at, k_live, HALF)
        _store_rotated(qo_at, q1, q2, c1, c2, s1, s2, q_live, HALF)
        _store_rotated(ko_at, k1, k2, c1, c2, s1, s2, k_live, HALF)
    else:
        _rotate_heads(q_at, qo_at, sq_h, sqo_h, c1, c2, s1, s2, ok, N_Q, HALF, Q_HEADS)
        _rotate_heads(k_at, ko_at, sk_h, sko_h, c1, c2, s1, s2, ok, N_K, HALF, K_HEADS)


@triton.jit
def _rope_kernel(
    Q, K, COS, SIN, QO, KO,
    n_rows, seq,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t,
    sqo_b, sqo_h, sqo_t, sko_b, sko_h, sko_t,
    sc_b, sc_t, ss_b, ss_t,
    N_Q: tl.constexpr, N_K: tl.constexpr, HALF: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_H: tl.constexpr, Q_HEADS: tl.constexpr, K_HEADS: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    # Any strides. Rows are (batch, position) pairs, b * seq + t, in int64: offsets of [batch,
    # heads, seq, D] tensors pass 2**31 at 8B shapes (32 heads × 128 × seq 2048 × batch 256).
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    b = rows // seq
    t = rows % seq
    _rotate_rows(Q, K, COS, SIN, QO, KO, rows, n_rows,
                 b * sq_b + t * sq_t, b * sk_b + t * sk_t, b * sqo_b + t * sqo_t, b * sko_b + t * sko_t,
                 b * sc_b + t * sc_t, b * ss_b + t * ss_t, sq_h, sk_h, sqo_h, sko_h,
                 N_Q, N_K, HALF, BLOCK_H, Q_HEADS, K_HEADS, BACKWARD)


@triton.jit
def _dense_rows(rows, seq, N_HEADS: tl.constexpr, D: tl.constexpr, SEQ_MAJOR: tl.constexpr):
    # Head 0 of each row, and the head stride, in a dense [batch, heads, seq, D] tensor: [batch,
    # seq, heads, D] memory seen through a transpose (SEQ_MAJOR, Llama's q and k) or contiguous.
    if SEQ_MAJOR:
        return rows * (N_HEADS * D), D
    else:
        return (rows // seq) * (N_HEADS * D) * seq + (rows % seq) * D, seq * D


@triton.jit
def _rope_dense_kernel(
    Q, K, COS, SIN, QO, KO,
    n_rows, seq,
    N_Q: tl.constexpr, N_K: tl.constexpr, HALF: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_H: tl.constexpr, Q_HEADS: tl.constexpr, K_HEADS: tl.constexpr,
    BACKWARD: tl.constexpr, X_SEQ_MAJOR: tl.constexpr, O_SEQ_MAJOR: tl.constexpr, TRIG_BATCHED: tl.constexpr,
):
    # The same rotation for dense tensors, whose strides follow from the shape and three layout
    # flags: 8 runtime arguments instead of 26. Triton's launcher inspects every argument on every
    # call (chapter 09), and this one runs twice per attention layer and step.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    q_row, sq_h = _dense_rows(rows, seq, N_Q, 2 * HALF, X_SEQ_MAJOR)
    k_row, sk_h = _dense_rows(rows, seq, N_K, 2 * HALF, X_SEQ_MAJOR)
    qo_row, sqo_h = _dense_rows(rows, seq, N_Q, 2 * HALF, O_SEQ_MAJOR)
    ko_row, sko_h = _dense_rows(rows, seq, N_K, 2 * HALF, O_SEQ_MAJOR)
    # cos and sin: [batch, seq, D] contiguous, or [1, seq, D] for every batch.
    trig_row = rows * (2 * HALF) if TRIG_BATCHED else (rows % seq) * (2 * HALF)
    _rotate_rows(Q, K, COS, SIN, QO, KO, rows, n_rows, q_row, k_row, qo_row, ko_row, trig_row, trig_row,
                 sq_h, sk_h, sqo_h, sko_h, N_Q, N_K, HALF, BLOCK_H, Q_HEADS, K_HEADS, BACKWARD)


# --------------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------------

_INTERPRETER_MAX_TILE = 1 << 16
# Values per half-tile of one step on a GPU: 32 heads of head_dim 128 (chosen by a sweep; see
# _rope_config).
_GPU_STEP_VALUES = 2048


@dataclass(frozen=True)
class Config:
    """A launch configuration of the RoPE kernels: the grid, rows per program, the half-tile's
    width, warps, and the heads of q and of k taken per step."""

    grid: tuple[int]  # programs, each a block of (batch, position) rows
    rows: int  # rows per program
    block_h: int  # head_dim / 2 rounded up to a power of two
    num_warps: int
    q_heads: int = 1  # q heads per step of a program's loop over q's heads
    k_heads: int = 1  # the same for k


def rope_config(n_rows: int, head_dim: int, n_q_heads: int, n_k_heads: int,
                props: runtime.DeviceProps | None = None) -> Config:
    """Launch configuration of the RoPE kernel (both directions) for ``n_rows`` = batch × seq
    positions of q with ``n_q_heads`` heads and k with ``n_k_heads``.

    Args:
        n_rows: batch × seq.
        head_dim: the heads' width.
        n_q_heads, n_k_heads: the heads of q and of k.
        props: the device's properties; None reads the current device's.

    Returns:
        the ``Config`` (cached per arguments).
    """
    return _rope_config(n_rows, head_dim, n_q_heads, n_k_heads, props or runtime.device_props())


def _heads_per_step(n_heads: int, values: int, block_h: int) -> int:
    # All of a tensor's heads in one step when they fit in ``values`` per half-tile, else the most
    # that do.
    return min(triton.next_power_of_2(max(n_heads, 1)), max(1, values // block_h))


@functools.lru_cache(maxsize=512)
def _rope_config(n_rows: int, head_dim: int, n_q_heads: int, n_k_heads: int,
                 props: runtime.DeviceProps) -> Config:
    block_h = triton.next_power_of_2(max(head_dim // 2, 1))
    if props.interpreter:
        q_heads = _heads_per_step(n_q_heads, _INTERPRETER_MAX_TILE, block_h)
        k_heads = _heads_per_step(n_k_heads, _INTERPRETER_MAX_TILE, block_h)
        rows = min(triton.next_power_of_2(max(n_rows, 1)),
                   max(1, _INTERPRETER_MAX_TILE // (block_h * q_heads)))
        return Config((triton.cdiv(n_rows, rows),), rows, block_h, 4, q_heads, k_heads)
    # Chosen by a sweep of 88 configurations at D = 128, 32 q and 8 kv heads
    # (assets/notes/swiglu_rope.md): one position per program. With several positions per program
    # and one head per step, each program's loop waits for one head's loads before issuing the next
    # head's. With the head counts as compile-time constants (the loop unrolled, no masked-off lanes
    # in k's step), all 32 q heads go in one step (a [32, 1, 64] tile per half, 2,048 values) with
    # four warps; k's loads are issued before q's stores when each fits one step. Wider heads keep
    # the tile at 2,048 values per half.
    q_heads = _heads_per_step(n_q_heads, _GPU_STEP_VALUES, block_h)
    k_heads = _heads_per_step(n_k_heads, _GPU_STEP_VALUES, block_h)
    one_step = q_heads >= n_q_heads and k_heads >= n_k_heads
    return Config((n_rows,), 1, block_h, 8 if one_step else 4, q_heads, k_heads)


# --------------------------------------------------------------------------------------------------
# Host side: checks and launches
# --------------------------------------------------------------------------------------------------


def _check_inputs(q, k, cos, sin) -> None:
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
        # The kernels store these dtypes and compute in float32; float64 is refused, as by every
        # kernel of the package: a float32 answer in a float64 tensor would look more precise than it is.
        ops.check_kernel_dtype(name, t, "cast to float32, or use Hugging Face's apply_rotary_pos_emb")
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(
            f"q and k must be 4-D [batch, heads, seq, head_dim], got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    batch, _, seq, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"head_dim must be even (rotate_half pairs column d with d + head_dim/2), got {head_dim}")
    if k.shape[0] != batch or k.shape[2] != seq or k.shape[3] != head_dim:
        raise ValueError(
            f"k must be [batch={batch}, kv_heads, seq={seq}, head_dim={head_dim}] like q {tuple(q.shape)}, "
            f"got {tuple(k.shape)}"
        )
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 3 or t.shape[0] not in (1, batch) or t.shape[1] != seq or t.shape[2] != head_dim:
            raise ValueError(
                f"{name} must be [batch={batch} (or 1), seq={seq}, head_dim={head_dim}], got {tuple(t.shape)}"
            )
    if q.dtype != k.dtype:
        raise TypeError(f"q and k must have the same dtype, got q {q.dtype} and k {k.dtype}")
    if cos.dtype != sin.dtype:
        raise TypeError(f"cos and sin must have the same dtype, got cos {cos.dtype} and sin {sin.dtype}")
    devices = {t.device for t in (q, k, cos, sin)}
    if len(devices) > 1:
        raise ValueError(
            f"q, k, cos and sin must be on one device, got {q.device}, {k.device}, {cos.device}, {sin.device}"
        )
    if not runtime.INTERPRET and q.device.type not in ("cuda", "meta"):  # meta: shapes only (the fakes)
        raise ValueError(f"in gpu mode q, k, cos and sin must be CUDA tensors, got tensors on {q.device}")


@functools.lru_cache(maxsize=64)
def out_dtype(x_dtype: torch.dtype, cos_dtype: torch.dtype) -> torch.dtype:
    """The dtype of ``x * cos + rotate_half(x) * sin`` in PyTorch: float32 cos and sin make a bf16
    output float32.

    Args:
        x_dtype: the dtype of q (or k); cos_dtype: that of cos and sin.

    Returns:
        ``torch.promote_types(x_dtype, cos_dtype)``.
    """
    return torch.promote_types(x_dtype, cos_dtype)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    # Columns must be adjacent (the kernel adds cols and half to a row offset); any other stride is
    # fine.
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _empty_like_layout(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # Same strides as t where t is dense (Llama's transposed q keeps its [batch, seq, heads, D]
    # memory order, as PyTorch's elementwise ops would), else contiguous.
    return torch.empty_like(t, dtype=dtype)


def _head_order(t: torch.Tensor) -> bool | None:
    # True: [batch, heads, seq, D] seen from dense [batch, seq, heads, D] memory (Llama's q and k);
    # False: contiguous [batch, heads, seq, D] (attention's gradients); None: any other layout.
    b, h, s, d = t.shape
    strides = t.stride()
    if strides == (s * h * d, d, h * d, 1):
        return True
    if strides == (h * s * d, s * d, d, 1):
        return False
    return None


def _trig_batched(t: torch.Tensor) -> bool | None:
    # True: contiguous [batch, seq, D]; False: one [seq, D] row block for every batch ([1, seq, D]);
    # None: other.
    n, s, d = t.shape
    strides = t.stride()
    if n == 1 and strides[1:] == (d, 1):
        return False
    return True if strides == (s * d, d, 1) else None


def _dense_flags(q, k, cos, sin, q_out, k_out) -> tuple[bool, bool, bool] | None:
    """The dense kernel's layout flags (inputs seq-major, outputs seq-major, cos and sin batched),
    or None when a tensor is laid out otherwise and the strided kernel must read it."""
    x, o, trig = _head_order(q), _head_order(q_out), _trig_batched(cos)
    if x is None or o is None or trig is None:
        return None
    if _head_order(k) is not x or _head_order(k_out) is not o or _trig_batched(sin) is not trig:
        return None
    return x, o, trig


def launch(q, k, cos, sin, q_out, k_out, backward: bool, config: Config | None,
           strided: bool = False) -> None:
    """One launch over q and k into q_out and k_out (``backward``: the rotation by −θ), allocated by
    the caller: the dense kernel when every tensor's layout allows it (always, for a Llama) and
    ``strided`` is False, else the kernel that reads any strides. ``rope_forward`` and
    ``rope_backward`` call it after allocating the outputs.

    Args:
        q, k: [batch, heads, seq, head_dim] and [batch, kv_heads, seq, head_dim], unit last stride
            (in the backward, the gradients of the outputs).
        cos, sin: [batch or 1, seq, head_dim], unit last stride.
        q_out, k_out: the outputs, of q's and k's shapes.
        backward: rotate by −θ instead of θ.
        config: a launch configuration; None picks ``rope_config``'s.
        strided: use the strided kernel even where the dense one could run.
    """
    batch, n_q_heads, seq, head_dim = q.shape
    n_rows = batch * seq
    if n_rows == 0 or head_dim == 0:
        return
    n_k_heads = k.shape[1]
    cfg = config or _rope_config(n_rows, head_dim, n_q_heads, n_k_heads, runtime.device_props(q.device))
    flags = None if strided else _dense_flags(q, k, cos, sin, q_out, k_out)
    if flags is not None:
        _rope_dense_kernel[cfg.grid](
            q, k, cos, sin, q_out, k_out, n_rows, seq,
            N_Q=n_q_heads, N_K=n_k_heads, HALF=head_dim // 2, ROWS=cfg.rows, BLOCK_H=cfg.block_h,
            Q_HEADS=cfg.q_heads, K_HEADS=cfg.k_heads, BACKWARD=backward, X_SEQ_MAJOR=flags[0],
            O_SEQ_MAJOR=flags[1],
            TRIG_BATCHED=flags[2], num_warps=cfg.num_warps,
        )
        return
    # stride 0 over a batch of 1
    cos, sin = cos.expand(batch, seq, head_dim), sin.expand(batch, seq, head_dim)
    _rope_kernel[cfg.grid](
        q, k, cos, sin, q_out, k_out,
        n_rows, seq,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        q_out.stride(0), q_out.stride(1), q_out.stride(2), k_out.stride(0), k_out.stride(1), k_out.stride(2),
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        N_Q=n_q_heads, N_K=n_k_heads, HALF=head_dim // 2, ROWS=cfg.rows, BLOCK_H=cfg.block_h,
        Q_HEADS=cfg.q_heads, K_HEADS=cfg.k_heads, BACKWARD=backward, num_warps=cfg.num_warps,
    )


def rope_forward(q, k, cos, sin, config: Config | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernel forward: ``(q_embed, k_embed)`` in q's and k's layout, dtype ``out_dtype(q,
    cos)``. The inputs are not checked here (``apply_rotary`` does it).

    Args:
        q, k, cos, sin: as ``apply_rotary``'s with ``unsqueeze_dim=1``.
        config: a launch configuration; None picks ``rope_config``'s.

    Returns:
        ``(q_embed, k_embed)``.
    """
    q, k, cos, sin = (_unit_last(t) for t in (q, k, cos, sin))
    dtype = out_dtype(q.dtype, cos.dtype)
    q_out, k_out = _empty_like_layout(q, dtype), _empty_like_layout(k, dtype)
    launch(q, k, cos, sin, q_out, k_out, False, config)
    return q_out, k_out


def _is_seq_major(t: torch.Tensor) -> bool:
    # [batch, heads, seq, D] viewed from [batch, seq, heads, D] memory, as Llama's q and k are.
    return t.dim() == 4 and t.transpose(1, 2).is_contiguous()


def _grad_buffer(like: torch.Tensor, dtype: torch.dtype, seq_major: bool) -> torch.Tensor:
    # The gradient of q in the memory order q had: Llama's q is a transposed view of a [batch, seq,
    # heads, D] projection, and a gradient in that order goes back through the transpose and the
    # view to q_proj's backward as it is. In dq_embed's order ([batch, heads, seq, D] from
    # attention) it would be copied on the way.
    if not seq_major:
        return _empty_like_layout(like, dtype)
    b, h, t, d = like.shape
    return torch.empty(b, t, h, d, dtype=dtype, device=like.device).transpose(1, 2)


def rope_backward(dq_embed, dk_embed, cos, sin, dtype: torch.dtype, seq_major: bool = False,
                  config: Config | None = None):
    """Launch the kernel backward (rotation by −θ): ``(dq, dk)`` in ``dtype``, the dtype of q and k;
    laid out as [batch, seq, heads, D] memory seen as [batch, heads, seq, D] when ``seq_major`` (q
    and k had that layout), else in the layout of dq_embed and dk_embed.

    Args:
        dq_embed, dk_embed: the gradients of the forward's outputs.
        cos, sin: the forward's.
        dtype: the dtype of q and k, that of the gradients returned.
        seq_major: lay the gradients out as [batch, seq, heads, D] memory.
        config: a launch configuration; None picks ``rope_config``'s.
    """
    dq_embed, dk_embed, cos, sin = (_unit_last(t) for t in (dq_embed, dk_embed, cos, sin))
    dq, dk = _grad_buffer(dq_embed, dtype, seq_major), _grad_buffer(dk_embed, dtype, seq_major)
    launch(dq_embed, dk_embed, cos, sin, dq, dk, True, config)
    return dq, dk


# --------------------------------------------------------------------------------------------------
# PyTorch operators: torch.ops.kernels.rope_fwd and rope_bwd
# --------------------------------------------------------------------------------------------------


def _forward_fake(q, k, cos, sin):
    dtype = out_dtype(q.dtype, cos.dtype)
    return _empty_like_layout(_unit_last(q), dtype), _empty_like_layout(_unit_last(k), dtype)


def _backward_fake(dq_embed, dk_embed, cos, sin, dtype, seq_major=False):
    return _grad_buffer(_unit_last(dq_embed), dtype, seq_major), _grad_buffer(_unit_last(dk_embed),
                                                                              dtype, seq_major)


rope_fwd_op = ops.define(
    "rope_fwd(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)", rope_forward, _forward_fake
)
rope_bwd_op = ops.define(
    "rope_bwd(Tensor dq_embed, Tensor dk_embed, Tensor cos, Tensor sin, ScalarType dtype, bool seq_major=False) "
    "-> (Tensor, Tensor)",
    rope_backward, _backward_fake,
)


# --------------------------------------------------------------------------------------------------
# The C++ host path (kernels.host_path): what it launches, and the Python path it falls back to
# --------------------------------------------------------------------------------------------------

# The host path launches the dense kernel by handle and, on a miss, runs this Python path. It
# imports no kernel family: each hands over what the host path needs when it is imported.
host_path.register_family(host_path.RopeFamily(
    forward=rope_forward, backward_op=rope_bwd_op, config=_rope_config, dense_flags=_dense_flags,
    dense_kernel=_rope_dense_kernel,
))


# --------------------------------------------------------------------------------------------------
# autograd, function
# --------------------------------------------------------------------------------------------------


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _cos_sin_grads(dq, dk, q, k, cos, sin, need_cos: bool, need_sin: bool):
    """Gradients of cos and sin (plain PyTorch: a model's cos and sin never need them, but a
    caller's may): ∂/∂cos = Σ_heads dy·x and ∂/∂sin = Σ_heads dy·rotate_half(x), summed to cos's
    shape (a broadcast batch)."""
    def reduce(a, b):
        return (a.float().sum(1) + b.float().sum(1)).sum_to_size(cos.shape).to(cos.dtype)

    d_cos = reduce(dq * q, dk * k) if need_cos else None
    d_sin = reduce(dq * _rotate_half(q), dk * _rotate_half(k)) if need_sin else None
    return d_cos, d_sin


class RotaryFunction(torch.autograd.Function):
    """autograd glue around the two operators (their implementations directly in a plain eager call,
    ``ops.call``): only cos and sin are saved (q and k too, when cos or sin need a gradient, which a
    Llama's never do)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        """Run the forward operator; save cos and sin (and q, k when cos or sin need a gradient).

        Args:
            ctx: autograd's context.
            q, k, cos, sin: as ``apply_rotary``'s with ``unsqueeze_dim=1``.
        """
        q_embed, k_embed = ops.call(rope_fwd_op, q, k, cos, sin)
        trig_grad = ctx.needs_input_grad[2] or ctx.needs_input_grad[3]
        ctx.save_for_backward(cos, sin, *((q, k) if trig_grad else ()))
        ctx.x_dtype = q.dtype
        ctx.seq_major = _is_seq_major(q) and _is_seq_major(k)
        return q_embed, k_embed

    @staticmethod
    def backward(ctx, dq_embed, dk_embed):
        """The gradients of q and k (the rotation by −θ), and of cos and sin where asked.

        Args:
            ctx: autograd's context.
            dq_embed, dk_embed: the gradients of the two outputs.
        """
        cos, sin, *qk = ctx.saved_tensors
        # An output that did not reach the loss arrives as zeros (autograd materialises it): its
        # rotation is zeros.
        dq, dk = ops.call(rope_bwd_op, dq_embed, dk_embed, cos, sin, ctx.x_dtype, ctx.seq_major)
        d_cos = d_sin = None
        if qk:
            d_cos, d_sin = _cos_sin_grads(dq_embed, dk_embed, *qk, cos, sin, *ctx.needs_input_grad[2:4])
        return dq, dk, d_cos, d_sin


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of q and k, exactly as Hugging Face's ``apply_rotary_pos_emb``.

    ``q`` [batch, heads, seq, head_dim] and ``k`` [batch, kv_heads, seq, head_dim] (any strides with
    a contiguous last dimension: Llama's transposed views are read in place; kv_heads may differ
    from heads, as in GQA); ``cos``, ``sin`` [batch or 1, seq, head_dim]. ``unsqueeze_dim=2`` takes
    q and k as [batch, seq, heads, head_dim] instead. Outputs have dtype ``promote_types(q.dtype,
    cos.dtype)``, as Hugging Face's broadcasting gives. Forward and backward are one Triton launch
    each (``torch.ops.kernels.rope_fwd``/``_bwd``); eagerly on a GPU, Llama's layouts go through a
    C++ autograd node that launches the same kernel (``kernels.host_path``). Chapter 11
    (notebooks/11_swiglu_rope.ipynb) derives it.

    Args:
        q: [batch, heads, seq, head_dim] (or [batch, seq, heads, head_dim] with ``unsqueeze_dim=2``).
        k: [batch, kv_heads, seq, head_dim], laid out as ``q``.
        cos: [batch or 1, seq, head_dim].
        sin: [batch or 1, seq, head_dim].
        unsqueeze_dim: the heads dimension of q and k (1 or 2).

    Returns:
        ``(q_embed, k_embed)``, of q's and k's shapes.

    Raises:
        TypeError: a non-tensor, an unsupported dtype, q and k (or cos and sin) of different dtypes.
        ValueError: ``unsqueeze_dim`` not 1 or 2, shapes that do not match, an odd head_dim,
            tensors on several devices, or non-CUDA tensors in gpu mode.
    """
    if unsqueeze_dim not in (1, 2):
        raise ValueError(f"unsqueeze_dim must be 1 ([batch, heads, seq, D]) or 2 ([batch, seq, heads, D]), "
                         f"got {unsqueeze_dim!r}")
    if unsqueeze_dim == 2:
        q_embed, k_embed = apply_rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin, 1)
        return q_embed.transpose(1, 2), k_embed.transpose(1, 2)
    _check_inputs(q, k, cos, sin)
    with_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, cos, sin))
    if host_path.takes_rope(q, k, cos, sin):
        # On a GPU, eagerly: the same kernel, with the autograd node and the launches in C++
        # (Llama's layouts).
        return host_path.rope(q, k, cos, sin, with_grad)
    if with_grad:
        return RotaryFunction.apply(q, k, cos, sin)
    return ops.call(rope_fwd_op, q, k, cos, sin)
