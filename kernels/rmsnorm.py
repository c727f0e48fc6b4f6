"""Fused RMSNorm in Triton: forward and backward kernels, the autograd wrapper, the function and the module.

    y = w ⊙ round_to_input_dtype(x · rstd),    rstd = 1 / sqrt(mean(x²) + eps)

Forward reads x once, writes y once and keeps one float32 ``rstd`` per row for the backward pass.
Backward reads x, dy and rstd, writes dx, and reduces dW = Σ_rows dy ⊙ x̂ without a [rows, hidden] buffer: each
program of a persistent grid walks many rows and keeps its share of dW in float32 registers, stores it as one
float32 partial, and the last programs to finish sum the partials into dW in a fixed order, inside the same launch
(``_finish_dw``): backward is one kernel, deterministic, with no float atomics.

All arithmetic is float32 whatever the storage dtype; values are cast only when stored.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import runtime
from .triton_utils import cast_to, workspace_counters

# --------------------------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_fwd_kernel(
    X, W, Y, RSTD,
    n_rows, n_cols, stride_x, stride_y, eps,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Each program normalises ROWS consecutive rows, held as one [ROWS, BLOCK_N] tile.
    # int64 row indices: row * stride overflows int32 once rows × hidden passes 2**31.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    col_ok = cols < n_cols
    ok = row_ok[:, None] & col_ok[None, :]

    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)

    # Masked lanes loaded 0, so they add nothing to the sum; divide by the true width, not BLOCK_N.
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    # Hugging Face casts the normalised value to the input dtype before multiplying by the weight: do the same.
    x_hat = cast_to(x * rstd[:, None], X.dtype.element_ty).to(tl.float32)
    y = x_hat * w[None, :]

    tl.store(Y + rows[:, None] * stride_y + cols[None, :], cast_to(y, Y.dtype.element_ty), mask=ok)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def _rms_norm_bwd_kernel(
    X, W, DY, RSTD, DX, DW_PARTIAL, DW, COUNTERS,
    n_rows, n_cols, stride_x, stride_dy, stride_dx,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, COMPUTE_DW: tl.constexpr, STAGES: tl.constexpr,
    FINISHERS: tl.constexpr, FINISH_BLOCK: tl.constexpr, PARTIAL_BLOCK: tl.constexpr,
):
    # A persistent grid: program p handles row blocks p, p + P, p + 2P, ... and accumulates its part of dW in
    # registers, so dW costs one [P, hidden] float32 write at the end instead of a [rows, hidden] buffer.
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)

    n_blocks = tl.cdiv(n_rows, ROWS)
    # STAGES > 1 lets the compiler fetch the next block's x and dy while this one is being computed.
    for block in tl.range(pid, n_blocks, n_programs, num_stages=STAGES):
        rows = (block * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        row_ok = rows < n_rows
        ok = row_ok[:, None] & col_ok[None, :]

        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)

        x_hat = x * rstd[:, None]
        g = dy * w[None, :]  # gradient with respect to x_hat
        # dx = rstd · (g − x_hat · mean(g ⊙ x_hat)); the derivation is in notebook 03.
        c = tl.sum(g * x_hat, axis=1) / n_cols
        dx = rstd[:, None] * (g - x_hat * c[:, None])
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], cast_to(dx, DX.dtype.element_ty), mask=ok)

        if COMPUTE_DW:
            # The forward pass multiplied the weight by x_hat rounded to the input dtype: use the same value here.
            x_hat_stored = cast_to(x_hat, X.dtype.element_ty).to(tl.float32)
            dw_acc += tl.sum(dy * x_hat_stored, axis=0)

    if COMPUTE_DW:
        tl.store(DW_PARTIAL + pid.to(tl.int64) * n_cols + cols, dw_acc, mask=col_ok)
        _finish_dw(DW_PARTIAL, DW, COUNTERS, n_programs, n_cols, FINISHERS, FINISH_BLOCK, PARTIAL_BLOCK)


@triton.jit
def _finish_dw(PARTIAL, DW, COUNTERS, n_partials, n_cols,
               FINISHERS: tl.constexpr, FINISH_BLOCK: tl.constexpr, PARTIAL_BLOCK: tl.constexpr):
    # Sum the [P, hidden] float32 partials into dW inside the same launch, so backward is one kernel.
    # Every program takes a ticket once its partial is stored; the last FINISHERS tickets each sum a strided share of
    # the columns over all P partials in a fixed order, so the result is the same on every run (no float atomics).
    # At most FINISHERS programs ever wait, and they wait only for programs that are still working on rows; with a
    # grid no larger than the GPU holds at once (one program per SM) those are all running, so the wait ends.
    tl.debug_barrier()  # the whole program's partial is stored before the ticket publishes it
    ticket = tl.atomic_add(COUNTERS, 1, sem="acq_rel")
    slot = ticket - (n_partials - FINISHERS)
    if slot >= 0:
        arrived = tl.atomic_add(COUNTERS, 0, sem="acquire")
        while arrived < n_partials:
            arrived = tl.atomic_add(COUNTERS, 0, sem="acquire")
        parts = tl.arange(0, PARTIAL_BLOCK)
        for start in range(slot * FINISH_BLOCK, n_cols, FINISHERS * FINISH_BLOCK):
            cols = start + tl.arange(0, FINISH_BLOCK)
            col_ok = cols < n_cols
            acc = tl.zeros((FINISH_BLOCK,), dtype=tl.float32)
            for p0 in range(0, n_partials, PARTIAL_BLOCK):
                p = (p0 + parts).to(tl.int64)
                ok = (p < n_partials)[:, None] & col_ok[None, :]
                tile = tl.load(PARTIAL + p[:, None] * n_cols + cols[None, :], mask=ok, other=0.0, cache_modifier=".cg")
                acc += tl.sum(tile, axis=0)
            tl.store(DW + cols, cast_to(acc, DW.dtype.element_ty), mask=col_ok)
        # The last finisher to leave resets both counters, leaving the workspace ready for the next launch.
        left = tl.atomic_add(COUNTERS + 1, 1, sem="acq_rel")
        if left == FINISHERS - 1:
            tl.atomic_xchg(COUNTERS + 1, 0, sem="relaxed")
            tl.atomic_xchg(COUNTERS, 0, sem="release")


# --------------------------------------------------------------------------------------------------------------------
# Launch configuration: one function per kernel
# --------------------------------------------------------------------------------------------------------------------

# The interpreter pays ~1-3 ms of Python per program but runs each tile with NumPy, so it wants few, large programs.
_INTERPRETER_MAX_TILE = 1 << 18


@dataclass(frozen=True)
class ForwardConfig:
    rows: int  # rows per program
    num_warps: int


@dataclass(frozen=True)
class BackwardConfig:
    rows: int  # rows per loop iteration of a program
    programs: int  # size of the persistent grid
    num_warps: int
    stages: int = 1  # software-pipelining depth of the row loop
    finishers: int = 1  # programs that sum the dW partials at the end of the launch


def _block_n(n_cols: int) -> int:
    return triton.next_power_of_2(n_cols)


@functools.lru_cache(maxsize=512)
def forward_config(n_rows: int, n_cols: int) -> ForwardConfig:
    block_n = _block_n(n_cols)
    if runtime.INTERPRET:
        rows = min(triton.next_power_of_2(n_rows), max(1, _INTERPRETER_MAX_TILE // block_n))
        return ForwardConfig(rows=rows, num_warps=4)
    # ~8K elements (16 KB of bf16) per program keeps enough bytes in flight per SM; measured on an H200
    # (assets/notes/rmsnorm.md), tiles of 4K-16K elements with 4-16 warps all land within 3% of each other.
    rows = max(1, min(16, 8192 // block_n))
    tile = rows * block_n
    return ForwardConfig(rows=rows, num_warps=4 if tile <= 2048 else 8)


@functools.lru_cache(maxsize=512)
def backward_config(n_rows: int, n_cols: int) -> BackwardConfig:
    block_n = _block_n(n_cols)
    if runtime.INTERPRET:
        # The interpreter runs programs one after another, so exactly one finisher (the last program) sums dW.
        rows = min(triton.next_power_of_2(n_rows), max(1, _INTERPRETER_MAX_TILE // block_n))
        return BackwardConfig(rows=rows, programs=max(1, min(4, triton.cdiv(n_rows, rows))), num_warps=4)
    # One program per SM (persistent), 8K-element tiles of x and dy per iteration, and for narrow tiles a 3-stage
    # software pipeline so the next tiles' loads are in flight while this one is computed; the dW finish is spread
    # over up to 64 finishers. Measured on an H200 (assets/notes/rmsnorm.md): 107 µs at 16,384 × 4,096 bf16, 88%
    # of the copy bandwidth; 16K-element tiles without pipelining were 15% slower.
    rows = max(1, min(16, 8192 // block_n))
    num_warps = 8
    stages = 3 if rows <= 2 else 1
    programs = max(1, min(runtime.num_sms(), triton.cdiv(n_rows, rows)))
    return BackwardConfig(rows=rows, programs=programs, num_warps=num_warps, stages=stages, finishers=min(64, programs))


# --------------------------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------------------------


def _check_inputs(x: torch.Tensor, weight: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(f"x and weight must be tensors, got {type(x).__name__} and {type(weight).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got dtype {x.dtype}")
    if not weight.is_floating_point():
        raise TypeError(f"weight must be a floating-point tensor, got dtype {weight.dtype}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the hidden size), got a scalar")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"weight must have shape ({x.shape[-1]},) to match the last dimension of x {tuple(x.shape)}, "
            f"got {tuple(weight.shape)}"
        )
    if x.device != weight.device:
        raise ValueError(f"x and weight must be on the same device, got {x.device} and {weight.device}")
    if not runtime.INTERPRET and x.device.type != "cuda":
        raise ValueError(f"in gpu mode the inputs must be CUDA tensors, got a tensor on {x.device}")


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """View ``t`` as [rows, hidden] with unit stride along hidden; copies only when no such view exists."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:  # leading dimensions that cannot be merged without a copy
        return t.reshape(-1, t.shape[-1])


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, config: ForwardConfig | None = None):
    """Launch the forward kernel. Returns ``(y, rstd, x_rows)``: output, float32 rstd per row, the [rows, hidden] view."""
    x_rows = _as_rows(x)
    n_rows, n_cols = x_rows.shape
    out_dtype = torch.result_type(weight, x)  # what `weight * x_hat.to(x.dtype)` gives in PyTorch
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)  # contiguous: row r starts at r * n_cols
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows:
        cfg = config or forward_config(n_rows, n_cols)
        _rms_norm_fwd_kernel[(triton.cdiv(n_rows, cfg.rows),)](
            x_rows, weight, y, rstd, n_rows, n_cols, x_rows.stride(0), n_cols, eps,
            ROWS=cfg.rows, BLOCK_N=_block_n(n_cols), num_warps=cfg.num_warps,
        )
    return y, rstd, x_rows


def _finish_tiles(n_cols: int, programs: int, finishers: int) -> tuple[int, int]:
    """Tile of the dW finish: (columns per finisher step, partials per load), at most 16K float32 values.

    Each finisher should sum its columns over all partials with as few dependent loads as possible: the finish runs
    after the last row is done, so nothing hides its latency.
    """
    cols = triton.next_power_of_2(triton.cdiv(n_cols, finishers))
    parts = min(triton.next_power_of_2(programs), 256)
    cols = max(1, min(cols, (1 << 14) // parts))
    return cols, parts


def rms_norm_backward(
    dy: torch.Tensor, x_rows: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
    compute_dw: bool = True, config: BackwardConfig | None = None, dx_shape: torch.Size | None = None,
):
    """Launch the backward kernel. Returns ``(dx, dw or None)``; dx has ``dx_shape`` (default [rows, hidden])."""
    n_rows, n_cols = x_rows.shape
    dy_rows = _as_rows(dy)
    dx = torch.empty(dx_shape or (n_rows, n_cols), dtype=x_rows.dtype, device=x_rows.device)
    if n_rows == 0:
        return dx, (torch.zeros_like(weight) if compute_dw else None)
    cfg = config or backward_config(n_rows, n_cols)
    block_n = _block_n(n_cols)
    dw = partial = counters = dx  # placeholders: the kernel never touches them without COMPUTE_DW
    if compute_dw:
        partial = torch.empty((cfg.programs, n_cols), dtype=torch.float32, device=x_rows.device)
        dw = torch.empty_like(weight)
        counters = workspace_counters(x_rows.device)
    finishers = max(1, min(cfg.finishers, cfg.programs))
    finish_block, partial_block = _finish_tiles(n_cols, cfg.programs, finishers)
    _rms_norm_bwd_kernel[(cfg.programs,)](
        x_rows, weight, dy_rows, rstd, dx, partial, dw, counters,
        n_rows, n_cols, x_rows.stride(0), dy_rows.stride(0), n_cols,
        ROWS=cfg.rows, BLOCK_N=block_n, COMPUTE_DW=compute_dw, STAGES=cfg.stages,
        FINISHERS=finishers, FINISH_BLOCK=finish_block, PARTIAL_BLOCK=partial_block, num_warps=cfg.num_warps,
    )
    return dx, (dw if compute_dw else None)


class RMSNormFunction(torch.autograd.Function):
    """autograd glue: the forward saves x (a view, no copy), the weight and one float32 rstd per row."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd, x_rows = rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x_rows, weight, rstd)
        ctx.x_shape = x.shape
        return y

    @staticmethod
    def backward(ctx, dy):
        x_rows, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy, x_rows, weight, rstd, ctx.needs_input_grad[1], dx_shape=ctx.x_shape)
        return dx, dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Fused RMSNorm over the last dimension of ``x``, computing what Hugging Face's ``LlamaRMSNorm`` computes.

    ``x`` may have any number of leading dimensions and be a strided view; ``weight`` has shape ``(x.shape[-1],)``.
    The output's dtype is that of ``weight * x`` in PyTorch (bfloat16 for a bfloat16 model).
    """
    _check_inputs(x, weight)
    return RMSNormFunction.apply(x, weight, float(eps))


class TritonRMSNorm(torch.nn.Module):
    """Drop-in replacement for ``LlamaRMSNorm`` (and the identical norms of Mistral, Qwen2 and Qwen3)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps

    @classmethod
    def from_hf(cls, module: torch.nn.Module) -> "TritonRMSNorm":
        """A TritonRMSNorm that shares ``module``'s weight Parameter (no copy: optimisers and tying still see it)."""
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 1:
            raise TypeError(f"{type(module).__name__} has no 1-D weight Parameter to share")
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        if eps is None:
            raise TypeError(f"{type(module).__name__} has neither `variance_epsilon` nor `eps`")
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.weight = weight
        new.variance_epsilon = float(eps)
        return new

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}"
