"""Two small Triton GEMMs for the LoRA layer: a matmul with a fused epilogue, and a split-K skinny matmul.

**The epilogue GEMM** computes ``c = a @ b + scale · (u @ v) + bias`` for ``a`` [M, K], ``b`` [K,
N], a low-rank pair ``u`` [M, R], ``v`` [R, N] (R small: the LoRA rank) and an optional ``bias``
[N]. Each program owns one [BLOCK_M, BLOCK_N] tile of ``c``: it runs the usual loop over K,
accumulating in float32 registers, and *before* the tile is stored it adds the low-rank term, one
more ``tl.dot`` over R, and the bias. The tile is written once. cuBLAS can only do the same with its
β-epilogue, ``addmm(c0, a, b)`` = ``c0 + a @ b``, where ``c0`` must already exist in memory: one
extra write and one extra read of an [M, N] tensor. Where Triton's GEMM loses is the main loop
itself: cuBLAS's hand-tuned kernels (and, on Hopper, its warp-specialised TMA pipelines) run the K
loop faster than a portable Triton loop does, so whether the saved round trip pays depends on the
shape (``kernels.bench.lora`` measures it).

**The split-K GEMM** computes ``out = scale · aᵀ @ b`` for ``a`` [T, M] and ``b`` [T, N], where T
(the tokens) is long and M, N are short (LoRA's ``dA = dxaᵀ @ x`` has M = the rank). Such a product
has few output tiles (r × 4,096 is one row of tiles), so a grid of one program per tile leaves most
SMs idle while each program walks all T tokens. Split-K cuts T into ``splits`` chunks, one program
per (tile, chunk), each writing a float32 partial sum; the partials are then summed. It reads ``a``
and ``b`` in their own dtype (bfloat16 x is never copied to float32) and accumulates in float32, so
a float32 adapter's gradient keeps float32 precision.

Both are PyTorch operators (``torch.ops.kernels.gemm_epilogue``, ``torch.ops.kernels.splitk_mm``).
In Triton's interpreter the tiles are upcast to float32 before ``tl.dot`` (a bfloat16 ``tl.dot``
computes garbage there); on a GPU the dot runs in the inputs' dtype with a float32 accumulator, and
in IEEE float32 for float32 inputs (no TF32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import ops, runtime
from .triton_utils import cast_to, grouped_tile

KERNEL_DTYPES = ops.KERNEL_DTYPES


# --------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def gemm_epilogue_kernel(
    A, B, U, V, BIAS, C, M, N, K, R, scale,
    stride_am, stride_ak, stride_bk, stride_bn, stride_um, stride_ur, stride_vr, stride_vn,
    stride_cm, stride_cn,
    HAS_LOWRANK: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of ``C = A @ B + scale · (U @ V) + BIAS``, stored once.

    Args:
        A, B, U, V, BIAS, C: pointers to ``a`` [M, K], ``b`` [K, N], ``u`` [M, R], ``v`` [R, N],
            ``bias`` [N] and the output [M, N] (U, V, BIAS unread without their flags).
        M, N, K, R: the sizes; scale: the low-rank term's factor.
        stride_*: each tensor's strides, in elements.
        HAS_LOWRANK, HAS_BIAS: whether the epilogue adds ``scale · U @ V``, ``BIAS``.
        UPCAST: load the tiles as float32 before ``tl.dot`` (the interpreter's case).
        PRECISION: ``tl.dot``'s ``input_precision``.
        BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_R: tile sizes (BLOCK_R ≥ R); GROUP_M: row-tiles per group
            of the grouped tile order.
    """
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ka = k0 + rk
        a = tl.load(A + rm[:, None] * stride_am + ka[None, :] * stride_ak,
                    mask=(rm[:, None] < M) & (ka[None, :] < K), other=0.0)
        b = tl.load(B + ka[:, None] * stride_bk + rn[None, :] * stride_bn,
                    mask=(ka[:, None] < K) & (rn[None, :] < N), other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    # The epilogue: everything below runs on the tile in registers, before its one store.
    if HAS_LOWRANK:
        rr = tl.arange(0, BLOCK_R)
        u = tl.load(U + rm[:, None] * stride_um + rr[None, :] * stride_ur,
                    mask=(rm[:, None] < M) & (rr[None, :] < R), other=0.0)
        v = tl.load(V + rr[:, None] * stride_vr + rn[None, :] * stride_vn,
                    mask=(rr[:, None] < R) & (rn[None, :] < N), other=0.0)
        if UPCAST:
            u, v = u.to(tl.float32), v.to(tl.float32)
        acc += scale * tl.dot(u, v, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(C + rm[:, None] * stride_cm + rn[None, :] * stride_cn, cast_to(acc, C.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def splitk_kernel(
    A, B, P, T, M, N, chunk, stride_at, stride_am, stride_bt, stride_bn, stride_ps, stride_pm,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """One split's float32 partial sum of ``aᵀ @ b`` for one [BLOCK_M, BLOCK_N] tile.

    Args:
        A, B, P: pointers to ``a`` [T, M], ``b`` [T, N] and the partials [splits, M, N] (float32,
            last dimension contiguous).
        T, M, N: the sizes; chunk: tokens per split (a multiple of BLOCK_T).
        stride_*: the strides, in elements.
        UPCAST: load the tiles as float32 before ``tl.dot``; PRECISION: its ``input_precision``.
        BLOCK_M, BLOCK_N, BLOCK_T: tile sizes.
    """
    # P[split, m, n] = Σ over this split's tokens t of A[t, m] · B[t, n]: aᵀ read as an [BLOCK_M,
    # BLOCK_T] tile.
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    start = split.to(tl.int64) * chunk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t0 in range(0, chunk, BLOCK_T):
        t = start + t0 + tl.arange(0, BLOCK_T)
        inside = (t < T) & (t < start + chunk)
        a = tl.load(A + t[None, :] * stride_at + rm[:, None] * stride_am,
                    mask=inside[None, :] & (rm[:, None] < M),
                    other=0.0)
        b = tl.load(B + t[:, None] * stride_bt + rn[None, :] * stride_bn,
                    mask=inside[:, None] & (rn[None, :] < N),
                    other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    tl.store(P + split * stride_ps + rm[:, None] * stride_pm + rn[None, :], acc,
             mask=(rm[:, None] < M) & (rn[None, :] < N))


# --------------------------------------------------------------------------------------------------
# Launch configurations
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GemmConfig:
    """A launch configuration of ``gemm_epilogue_kernel``: its tile sizes, ``GROUP_M``, warps and
    pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class SplitKConfig:
    """A launch configuration of ``splitk_kernel``: tile sizes, the number of splits and their
    length in tokens, warps and pipeline stages."""

    block_m: int
    block_n: int
    block_t: int
    splits: int
    chunk: int  # tokens per split, a multiple of block_t
    num_warps: int
    num_stages: int


def gemm_config(m: int, n: int, k: int, props: runtime.DeviceProps | None = None) -> GemmConfig:
    """Tiles of the epilogue GEMM. In the interpreter, large tiles (few programs, NumPy does a tile
    at once). On a GPU, 128 × 128 × 64 with 8 warps when the shared memory holds the pipeline's
    stages (Hopper and Blackwell), a smaller tile otherwise: the common choice for bf16 GEMMs of
    Llama's sizes.

    Args:
        m, n, k: the GEMM's sizes (unused: one tile fits Llama's shapes).
        props: the device's properties; None reads the current device's.

    Returns:
        the ``GemmConfig``.
    """
    props = props or runtime.device_props()
    if props.interpreter:
        return GemmConfig(64, 64, 64, 8, 4, 1)
    per_stage = (128 * 64 + 64 * 128) * 2  # bytes of one bf16 stage of A's and B's tiles
    if props.shared_mem_per_block >= 4 * per_stage:
        return GemmConfig(128, 128, 64, 8, 8, 4)
    return GemmConfig(64, 64, 32, 8, 4, 3)


def splitk_config(t: int, m: int, n: int, props: runtime.DeviceProps | None = None) -> SplitKConfig:
    """Split-K for ``aᵀ @ b`` over ``t`` tokens: as many splits as it takes for about two programs
    per SM, each chunk at least a few tiles of tokens long (else the partial sums cost more than the
    parallelism brings).

    Args:
        t: the tokens (the reduced length); m, n: the output's sizes.
        props: the device's properties; None reads the current device's.

    Returns:
        the ``SplitKConfig`` (``splits`` is at least 1, ``splits · chunk`` covers ``t``).
    """
    props = props or runtime.device_props()
    if props.interpreter:
        block_m, block_n, block_t, warps, stages = 32, 64, 64, 4, 1
    else:
        # A short side gets a short tile (LoRA's dB is [out, r]: r = 16 columns would waste most of
        # a 128-wide one).
        block_n = min(128, max(16, triton.next_power_of_2(n)))
        block_m = 32 if m <= 32 else (128 if block_n <= 32 else 64)
        block_t, warps, stages = 64, 4, 3
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    steps = triton.cdiv(t, block_t)
    min_steps = 2 if props.interpreter else 8
    splits = max(1, min(triton.cdiv(2 * props.sm_count, tiles), steps // min_steps))
    if props.interpreter:
        splits = min(splits, 4)
    chunk = triton.cdiv(steps, splits) * block_t
    splits = triton.cdiv(t, chunk) if t else 1
    return SplitKConfig(block_m, block_n, block_t, splits, chunk, warps, stages)


def _upcast_and_precision(dtype: torch.dtype) -> tuple[bool, str]:
    # The interpreter computes bf16 dots wrong: upcast there. On a GPU float32 inputs get IEEE
    # float32 (TF32 would cost float32 callers their precision), bf16/fp16 run on the tensor cores
    # with a float32 accumulator.
    if runtime.INTERPRET:
        return True, "ieee"
    return False, "ieee" if dtype == torch.float32 else "tf32"


# --------------------------------------------------------------------------------------------------
# Host launches
# --------------------------------------------------------------------------------------------------


def _check_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in KERNEL_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}: cast it to float32 "
                        "(or use torch.mm / torch.addmm)")


def _check_2d(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    _check_dtype(name, t)


def gemm_epilogue(a: torch.Tensor, b: torch.Tensor, u: torch.Tensor | None = None,
                  v: torch.Tensor | None = None,
                  scale: float = 1.0, bias: torch.Tensor | None = None, config: GemmConfig | None = None
                  ) -> torch.Tensor:
    """``a @ b + scale · (u @ v) + bias`` with the low-rank term and the bias added in the GEMM's epilogue.

    ``a`` [M, K], ``b`` [K, N] (any strides: a transposed weight ``w.t()`` is read in place), ``u``
    [M, R] and ``v`` [R, N] both given or both None, ``bias`` [N] or None. The output is a new
    contiguous [M, N] tensor in ``a``'s dtype; ``b``, ``u``, ``v`` must have ``a``'s dtype too (cast
    a small adapter first). Chapter 15 (notebooks/15_lora.ipynb) uses it for LoRA's forward.

    Args:
        a, b: the GEMM's operands, [M, K] and [K, N].
        u, v: the low-rank pair, [M, R] and [R, N], or both None.
        scale: the low-rank term's factor.
        bias: [N] or None.
        config: a launch configuration; None picks ``gemm_config``'s.

    Returns:
        the [M, N] product in ``a``'s dtype.

    Raises:
        TypeError: a non-tensor, a dtype other than float32/bfloat16/float16, or an operand whose
            dtype or device differs from ``a``'s.
        ValueError: an operand not 2-D, mismatched shapes, or only one of ``u``, ``v``.
    """
    for name, t in (("a", a), ("b", b)):
        _check_2d(name, t)
    if (u is None) != (v is None):
        raise ValueError("u and v are the low-rank pair: give both or neither")
    m, k = a.shape
    if b.shape[0] != k:
        raise ValueError(f"b must have {k} rows (a's columns), got shape {tuple(b.shape)}")
    n = b.shape[1]
    r = 0
    if u is not None:
        _check_2d("u", u)
        _check_2d("v", v)
        r = u.shape[1]
        if u.shape[0] != m or v.shape != (r, n):
            raise ValueError(f"u must be [{m}, R] and v [R, {n}], got {tuple(u.shape)} and {tuple(v.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    for name, t in (("b", b), ("u", u), ("v", v), ("bias", bias)):
        if t is not None and (t.dtype != a.dtype or t.device != a.device):
            raise TypeError(f"{name} must have a's dtype and device ({a.dtype}, {a.device}), got {t.dtype}, "
                            f"{t.device}")
    c = torch.empty((m, n), dtype=a.dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    cfg = config or gemm_config(m, n, k, runtime.device_props(a.device))
    upcast, precision = _upcast_and_precision(a.dtype)
    block_r = max(16, triton.next_power_of_2(max(r, 1)))
    uu, vv = (u, v) if u is not None else (a, b)  # placeholders, never read without HAS_LOWRANK
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    gemm_epilogue_kernel[grid](
        a, b, uu, vv, bias if bias is not None else c, c, m, n, k, r, float(scale),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), uu.stride(0), uu.stride(1),
        vv.stride(0), vv.stride(1),
        c.stride(0), c.stride(1),
        HAS_LOWRANK=u is not None, HAS_BIAS=bias is not None, UPCAST=upcast, PRECISION=precision,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_R=block_r, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return c


def splitk_mm(a: torch.Tensor, b: torch.Tensor, scale: float = 1.0, out_dtype: torch.dtype = torch.float32,
              config: SplitKConfig | None = None) -> torch.Tensor:
    """``scale · aᵀ @ b`` for ``a`` [T, M] and ``b`` [T, N] (T long, M and N short), reduced over T
    in float32 by split-K, returned as a new [M, N] tensor of ``out_dtype``. ``a`` and ``b`` may
    differ in dtype (the smaller is cast to the larger's dtype before the kernel) but not in device.
    Chapter 15 (notebooks/15_lora.ipynb) uses it for the adapters' gradients.

    Args:
        a, b: [T, M] and [T, N].
        scale: the product's factor.
        out_dtype: the result's dtype (float32, bfloat16 or float16).
        config: a launch configuration; None picks ``splitk_config``'s.

    Returns:
        the [M, N] tensor of ``out_dtype`` (zeros when T is 0).

    Raises:
        TypeError: a non-tensor or an unsupported dtype (of ``a``, ``b`` or ``out_dtype``).
        ValueError: ``a`` or ``b`` not 2-D, different row counts, or different devices.
    """
    _check_2d("a", a)
    _check_2d("b", b)
    if out_dtype not in KERNEL_DTYPES:
        raise TypeError(f"out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"a and b must have the same number of rows (tokens), got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    if a.device != b.device:
        raise ValueError(f"a and b must be on one device, got {a.device} and {b.device}")
    t, m = a.shape
    n = b.shape[1]
    if t == 0 or m == 0 or n == 0:
        return torch.zeros((m, n), dtype=out_dtype, device=a.device)
    cfg = config or splitk_config(t, m, n, runtime.device_props(a.device))
    # one dtype per dot: the short operand follows the long one's (cheap: it is small)
    if a.dtype != b.dtype:
        a, b = (a.to(b.dtype), b) if a.numel() < b.numel() else (a, b.to(a.dtype))
    upcast, precision = _upcast_and_precision(a.dtype)
    partial = torch.empty((cfg.splits, m, n), dtype=torch.float32, device=a.device)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), cfg.splits)
    splitk_kernel[grid](
        a, b, partial, t, m, n, cfg.chunk, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        partial.stride(0), partial.stride(1), UPCAST=upcast, PRECISION=precision,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_T=cfg.block_t, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    total = partial[0] if cfg.splits == 1 else partial.sum(0)
    if scale != 1.0:
        total = total.mul_(scale)
    return total.to(out_dtype)


# --------------------------------------------------------------------------------------------------
# Operators
# --------------------------------------------------------------------------------------------------


def _gemm_impl(a, b, u, v, scale, bias):
    return gemm_epilogue(a, b, u, v, scale, bias)


def _gemm_fake(a, b, u, v, scale, bias):
    return a.new_empty((a.shape[0], b.shape[1]))


def _splitk_impl(a, b, scale, out_dtype):
    return splitk_mm(a, b, scale, out_dtype)


def _splitk_fake(a, b, scale, out_dtype):
    return a.new_empty((a.shape[1], b.shape[1]), dtype=out_dtype)


gemm_epilogue_op = ops.define(
    "gemm_epilogue(Tensor a, Tensor b, Tensor? u, Tensor? v, float scale, Tensor? bias) -> Tensor",
    _gemm_impl, _gemm_fake)
splitk_mm_op = ops.define("splitk_mm(Tensor a, Tensor b, float scale, ScalarType out_dtype) -> Tensor",
                          _splitk_impl, _splitk_fake)
