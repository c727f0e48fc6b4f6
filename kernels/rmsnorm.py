"""Fused RMSNorm in Triton: forward and backward kernels, the autograd wrapper, the function and the module.

    y = w ⊙ round_to_input_dtype(x · rstd),    rstd = 1 / sqrt(mean(x²) + eps)

Forward reads x once, writes y once and keeps one float32 ``rstd`` per row for the backward pass.
Backward reads x, dy and rstd, writes dx, and reduces dW = Σ_rows dy ⊙ x̂ without a [rows, hidden]
buffer: each program of a persistent grid walks many rows and keeps its share of dW in float32
registers, then writes it as one row of a [programs, hidden] float32 buffer; a second, small kernel
sums those partials in a fixed order.

Both passes are PyTorch operators (``torch.ops.kernels.rms_norm_fwd`` and ``rms_norm_bwd``,
kernels/ops.py), tied together for autograd by ``RMSNormFunction``; ``torch.compile`` and CUDA
graphs see each as one node.

All arithmetic is float32 whatever the storage dtype; values are cast only when stored.
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import host_path, ops, runtime
from .reference import relative_error, rms_norm_reference
from .triton_utils import cast_to

# The storage dtypes of x and weight the kernels read (they compute in float32 whatever these are).

# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def rms_norm_fwd_kernel(
    X, W, Y, RSTD,
    n_rows, n_cols, stride_x, stride_y, eps,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The forward pass: y and one float32 rstd per row, ROWS rows per program (chapter 02).

    ``rms_norm_forward`` launches it, one program per ROWS rows.

    Args:
        X, W, Y, RSTD: pointers to x [n_rows, n_cols] (any row stride), the weight [n_cols], y and
            the float32 rstd [n_rows].
        n_rows, n_cols: the rows and their width.
        stride_x, stride_y: the row strides of x and y (unit stride along a row).
        eps: added to the mean of squares.
        ROWS, BLOCK_N: the tile, rows by ``n_cols`` rounded up to a power of two.
    """
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
    # Hugging Face casts the normalised value to the input dtype before multiplying by the weight:
    # do the same.
    x_hat = cast_to(x * rstd[:, None], X.dtype.element_ty).to(tl.float32)
    y = x_hat * w[None, :]

    tl.store(Y + rows[:, None] * stride_y + cols[None, :], cast_to(y, Y.dtype.element_ty), mask=ok)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def rms_norm_bwd_kernel(
    X, W, DY, RSTD, DX, DW_PARTIAL,
    n_rows, n_cols, stride_x, stride_dy, stride_dx,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, COMPUTE_DW: tl.constexpr, STAGES: tl.constexpr,
):
    """The backward pass: dx, and with COMPUTE_DW one row of float32 dW partials per program.

    ``rms_norm_backward`` launches it on a persistent grid (chapter 03 derives it).

    Args:
        X, W, DY, RSTD: pointers to x [n_rows, n_cols], the weight, dy and the forward's rstd.
        DX, DW_PARTIAL: pointers to dx and to the [programs, n_cols] float32 partials of dW.
        n_rows, n_cols: the rows and their width.
        stride_x, stride_dy, stride_dx: the row strides (unit stride along a row).
        ROWS, BLOCK_N: the tile of one loop iteration.
        COMPUTE_DW: write the dW partials (False: a frozen weight, DW_PARTIAL unused).
        STAGES: the software-pipelining depth of the row loop.
    """
    # A persistent grid: program p handles row blocks p, p + P, p + 2P, ... and accumulates its part
    # of dW in registers, so dW costs one [P, hidden] float32 write at the end instead of a [rows,
    # hidden] buffer.
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
            # The forward pass multiplied the weight by x_hat rounded to the input dtype: use the
            # same value here.
            x_hat_stored = cast_to(x_hat, X.dtype.element_ty).to(tl.float32)
            dw_acc += tl.sum(dy * x_hat_stored, axis=0)

    if COMPUTE_DW:
        tl.store(DW_PARTIAL + pid.to(tl.int64) * n_cols + cols, dw_acc, mask=col_ok)


@triton.jit
def rms_norm_dw_kernel(PARTIAL, DW, n_partials, n_cols, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """dW from the backward kernel's partials, summed in a fixed order (chapter 03).

    ``rms_norm_backward`` launches it after ``rms_norm_bwd_kernel``.

    Args:
        PARTIAL, DW: pointers to the [n_partials, n_cols] float32 partials and to dW [n_cols].
        n_partials, n_cols: the partials' shape.
        BLOCK_P, BLOCK_C: partials per load, and columns per program.
    """
    # dW = the column sums of the [P, hidden] float32 partials. Each program owns BLOCK_C columns
    # and adds the P partials in the same order on every run, so dW is deterministic (no float
    # atomics).
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < n_cols
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for start in range(0, n_partials, BLOCK_P):
        parts = (start + tl.arange(0, BLOCK_P)).to(tl.int64)
        ok = (parts < n_partials)[:, None] & col_ok[None, :]
        acc += tl.sum(tl.load(PARTIAL + parts[:, None] * n_cols + cols[None, :], mask=ok, other=0.0), axis=0)
    tl.store(DW + cols, cast_to(acc, DW.dtype.element_ty), mask=col_ok)


# --------------------------------------------------------------------------------------------------
# Launch configuration: one function per kernel, from the shape and the device's properties
# --------------------------------------------------------------------------------------------------

# The interpreter pays Python per program but runs each tile with NumPy, so it wants few, large
# programs.
_INTERPRETER_MAX_TILE = 1 << 18


@dataclass(frozen=True)
class ForwardConfig:
    """The forward kernel's launch configuration, as ``forward_config`` chooses it (chapter 02)."""

    grid: tuple[int]  # programs
    rows: int  # rows per program
    block_n: int  # the hidden size rounded up to a power of two: one row of the tile
    num_warps: int


@dataclass(frozen=True)
class BackwardConfig:
    """The backward kernels' launch configuration, as ``backward_config`` chooses it (chapter 03)."""

    grid: tuple[int]  # the persistent grid: one program per SM at most
    rows: int  # rows per loop iteration of a program
    block_n: int
    num_warps: int
    stages: int  # software-pipelining depth of the row loop
    dw_grid: tuple[int]  # programs of the dW sum
    dw_block_p: int  # partials per load in the dW sum
    dw_block_c: int  # columns per program in the dW sum


def tile_width(n_cols: int) -> int:
    """The width of the kernels' tiles for rows of ``n_cols``.

    Args:
        n_cols: the row width (the hidden size).

    Returns:
        ``n_cols`` rounded up to a power of two, as the sides of a Triton tile must be.
    """
    return triton.next_power_of_2(n_cols)


def tile_elements(props: runtime.DeviceProps) -> int:
    """How many values one program's tile may hold on ``props``: a program takes as many rows as fit.

    Args:
        props: the device's properties (its registers per SM decide).

    Returns:
        ``regs_per_sm // 8``, at least 1024.
    """
    # A program of 8 warps keeps its tile in float32 registers. With two programs resident per SM
    # and two live tiles (x and dy in the backward), regs_per_sm / 8 values per tile leaves half of
    # each program's registers for addresses and temporaries: 8,192 on every NVIDIA GPU since Volta
    # (65,536 registers per SM). The sweep of tile sizes and warps around it is in
    # assets/notes/rmsnorm.md.
    return max(1024, props.regs_per_sm // 8)


def forward_config(n_rows: int, n_cols: int, props: runtime.DeviceProps | None = None) -> ForwardConfig:
    """Launch configuration of the forward kernel on ``props`` (chapter 02 explains it).

    Args:
        n_rows, n_cols: the rows of x and their width.
        props: the device's properties (default: this machine's device).

    Returns:
        The ``ForwardConfig``: grid, rows per program, tile width and warps.
    """
    return cached_forward_config(n_rows, n_cols, props or runtime.device_props())


@functools.lru_cache(maxsize=512)
def cached_forward_config(n_rows: int, n_cols: int, props: runtime.DeviceProps) -> ForwardConfig:
    """``forward_config`` for given ``props``, cached: what the launches ask for on every call.

    Args:
        n_rows, n_cols: the rows of x and their width.
        props: the device's properties.

    Returns:
        The ``ForwardConfig`` (the same object for the same arguments).
    """
    block_n = tile_width(n_cols)
    if props.interpreter:
        rows = min(triton.next_power_of_2(max(n_rows, 1)), max(1, _INTERPRETER_MAX_TILE // block_n))
        return ForwardConfig(grid=(triton.cdiv(n_rows, rows),), rows=rows, block_n=block_n, num_warps=4)
    rows = max(1, min(16, tile_elements(props) // block_n))
    num_warps = 4 if rows * block_n <= 2048 else 8
    return ForwardConfig(grid=(triton.cdiv(n_rows, rows),), rows=rows, block_n=block_n, num_warps=num_warps)


def dw_tiles(n_cols: int, programs: int, props: runtime.DeviceProps) -> tuple[tuple[int], int, int]:
    """Grid and tile of the dW sum: about one program per SM, each summing all partials of its columns.

    Args:
        n_cols: the hidden size.
        programs: how many partials the backward kernel writes (its grid).
        props: the device's properties.

    Returns:
        ``(grid, block_p, block_c)``: the dW kernel's grid, partials per load, columns per program.
    """
    if props.interpreter:
        block_c = min(tile_width(n_cols), 4096)
        return (triton.cdiv(n_cols, block_c),), triton.next_power_of_2(programs), block_c
    block_c = max(16, min(256, triton.next_power_of_2(triton.cdiv(n_cols, props.sm_count))))
    block_p = min(triton.next_power_of_2(programs), max(1, 8192 // block_c))
    return (triton.cdiv(n_cols, block_c),), block_p, block_c


def backward_config(
    n_rows: int, n_cols: int, itemsize: int = 2, props: runtime.DeviceProps | None = None
) -> BackwardConfig:
    """Launch configuration of the backward kernels on ``props`` (chapters 03, 12 and 13 read it).

    Args:
        n_rows, n_cols: the rows of x and their width.
        itemsize: bytes per element of x and dy, which sets how many pipeline stages fit in shared
            memory.
        props: the device's properties (default: this machine's device).

    Returns:
        The ``BackwardConfig``: the persistent grid, its tile, warps and stages, and the dW sum's
        grid and tile.
    """
    return cached_backward_config(n_rows, n_cols, itemsize, props or runtime.device_props())


@functools.lru_cache(maxsize=512)
def cached_backward_config(n_rows: int, n_cols: int, itemsize: int,
                           props: runtime.DeviceProps) -> BackwardConfig:
    """``backward_config`` for given ``props``, cached: what the launches ask for on every call.

    Args:
        n_rows, n_cols, itemsize: as ``backward_config`` takes them.
        props: the device's properties.

    Returns:
        The ``BackwardConfig`` (the same object for the same arguments).
    """
    block_n = tile_width(n_cols)
    if props.interpreter:
        rows = min(triton.next_power_of_2(max(n_rows, 1)), max(1, _INTERPRETER_MAX_TILE // block_n))
        programs = max(1, min(props.sm_count, triton.cdiv(n_rows, rows)))
        dw_grid, dw_block_p, dw_block_c = dw_tiles(n_cols, programs, props)
        return BackwardConfig((programs,), rows, block_n, 4, 1, dw_grid, dw_block_p, dw_block_c)
    # One program per SM (persistent), tiles of x and dy as large as the registers allow, and for
    # narrow tiles a software pipeline so the next tiles' loads are in flight while this one is
    # computed: as many stages (up to
    # 3) as the shared memory of one program holds, each stage one tile of x and one of dy. The
    #    timings with and
    # without pipelining are in assets/notes/rmsnorm.md.
    rows = max(1, min(16, tile_elements(props) // block_n))
    stage_bytes = 2 * rows * block_n * itemsize
    stages = max(1, min(3, props.shared_mem_per_block // stage_bytes)) if rows <= 2 else 1
    programs = max(1, min(props.sm_count, triton.cdiv(n_rows, rows)))
    dw_grid, dw_block_p, dw_block_c = dw_tiles(n_cols, programs, props)
    return BackwardConfig((programs,), rows, block_n, 8, stages, dw_grid, dw_block_p, dw_block_c)


# --------------------------------------------------------------------------------------------------
# Host side: checks and launches
# --------------------------------------------------------------------------------------------------


def check_tensors(x: torch.Tensor, weight: torch.Tensor) -> None:
    """Check types, dtypes, shapes and one device for x and weight, whatever that device is.

    The checks every RMSNorm entry point makes, the C++ ones of ``kernels.cuda_rmsnorm`` too.

    Args:
        x: the input, ``[..., hidden]``.
        weight: the scale, ``(hidden,)``.

    Raises:
        TypeError: when either is not a tensor, or not of a dtype the kernels take (float32,
            bfloat16, float16).
        ValueError: when x is a scalar, the weight's shape is not ``(x.shape[-1],)``, or the two
            are on different devices.
    """
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(f"x and weight must be tensors, got {type(x).__name__} and {type(weight).__name__}")
    for name, t in (("x", x), ("weight", weight)):
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
        ops.check_kernel_dtype(name, t,
                               f"cast with .float(), or use kernels.reference.rms_norm_reference for {t.dtype}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the hidden size), got a scalar")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"weight must have shape ({x.shape[-1]},) to match the last dimension of x {tuple(x.shape)}, "
            f"got {tuple(weight.shape)}"
        )
    if x.device != weight.device:
        raise ValueError(f"x and weight must be on the same device, got {x.device} and {weight.device}")


def _check_inputs(x: torch.Tensor, weight: torch.Tensor) -> None:
    """``check_tensors``, and CUDA tensors in gpu mode (the Triton kernels run where the mode says)."""
    check_tensors(x, weight)
    # meta: shapes only, by the fake operators
    if not runtime.INTERPRET and x.device.type not in ("cuda", "meta"):
        raise ValueError(f"in gpu mode the inputs must be CUDA tensors, got a tensor on {x.device}")


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """View ``t`` as [rows, hidden] with unit stride along hidden; copies only when no such view exists.

    Rows as the row kernels read them, with any row stride (``kernels.swiglu`` reads its strided
    inputs so too; chapter 12 uses it). The row count is explicit: with a hidden size of 0, ``-1``
    would not say how many empty rows there are.

    Args:
        t: a tensor of at least one dimension.

    Returns:
        ``[prod(t.shape[:-1]), t.shape[-1]]``: a view of ``t`` where one exists, else a copy.
    """
    if t.stride(-1) != 1:
        t = t.contiguous()
    shape = (math.prod(t.shape[:-1]), t.shape[-1])
    try:
        return t.view(shape)
    except RuntimeError:  # leading dimensions that cannot be merged without a copy
        return t.reshape(shape)


@functools.lru_cache(maxsize=64)
def out_dtype(x_dtype: torch.dtype, w_dtype: torch.dtype) -> torch.dtype:
    """The dtype of ``weight * x_hat.to(x.dtype)`` in PyTorch, that of RMSNorm's output.

    A float32 weight makes a bfloat16 model's output float32.

    Args:
        x_dtype, w_dtype: the dtypes of x and the weight.

    Returns:
        ``torch.promote_types(x_dtype, w_dtype)``.
    """
    return torch.promote_types(x_dtype, w_dtype)


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                     config: ForwardConfig | None = None):
    """Launch the forward kernel: the implementation of ``torch.ops.kernels.rms_norm_fwd`` (chapter 02).

    The kernels read the weight with unit stride: a strided or expanded weight (``w[::2]``, a
    Parameter cut from a larger buffer) is copied first, ``hidden`` values. Rows of x may have any
    row stride (``as_rows``). Inputs are not checked here (``rms_norm`` does).

    Args:
        x: the input, ``[..., hidden]``.
        weight: the scale, ``(hidden,)``.
        eps: added to the mean of squares.
        config: a launch configuration to use instead of ``cached_forward_config``'s.

    Returns:
        ``(y, rstd)``: the output (x's shape, ``out_dtype``) and a float32 rstd per row (empty
        when the hidden size is 0).
    """
    weight = weight.contiguous()
    x_rows = as_rows(x)
    n_rows, n_cols = x_rows.shape
    y = torch.empty(x.shape, dtype=out_dtype(x.dtype, weight.dtype), device=x.device)  # row r at r * n_cols
    # No columns: y is empty, and so is rstd (rows of nothing have none), as in the fake and the C++
    # operators.
    rstd = torch.empty(n_rows if n_cols else 0, dtype=torch.float32, device=x.device)
    if n_rows and n_cols:
        cfg = config or cached_forward_config(n_rows, n_cols, runtime.device_props(x.device))
        rms_norm_fwd_kernel[cfg.grid](
            x_rows, weight, y, rstd, n_rows, n_cols, x_rows.stride(0), n_cols, eps,
            ROWS=cfg.rows, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
        )
    return y, rstd


def rms_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, compute_dw: bool = True,
    config: BackwardConfig | None = None,
):
    """Launch the backward kernels: the implementation of ``torch.ops.kernels.rms_norm_bwd`` (chapter 03).

    Args:
        dy: the gradient of the output, of x's shape.
        x: the forward's input.
        weight: the forward's weight.
        rstd: the forward's float32 rstd, one per row.
        compute_dw: reduce dW too; False (a frozen weight) skips the dW reduction entirely.
        config: a launch configuration to use instead of ``cached_backward_config``'s.

    Returns:
        ``(dx, dw)``: dx in x's shape and dtype; dw in weight's shape and dtype, contiguous (zeros
        when x has no rows), or empty, shape [0], when ``compute_dw`` is false.
    """
    weight = weight.contiguous()  # as in the forward: the kernels read it with unit stride
    x_rows = as_rows(x)
    dy_rows = as_rows(dy)
    n_rows, n_cols = x_rows.shape
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if n_rows == 0 or n_cols == 0:  # no rows: dW is a sum over nothing; no columns: nothing to compute
        return dx, (torch.zeros_like(weight) if compute_dw else weight.new_empty(0))
    dw = torch.empty_like(weight) if compute_dw else weight.new_empty(0)
    cfg = config or cached_backward_config(n_rows, n_cols, x.element_size(), runtime.device_props(x.device))
    partial = torch.empty((cfg.grid[0], n_cols), dtype=torch.float32, device=x.device) if compute_dw else dx
    rms_norm_bwd_kernel[cfg.grid](
        x_rows, weight, dy_rows, rstd, dx, partial,
        n_rows, n_cols, x_rows.stride(0), dy_rows.stride(0), n_cols,
        ROWS=cfg.rows, BLOCK_N=cfg.block_n, COMPUTE_DW=compute_dw, STAGES=cfg.stages,
        num_warps=cfg.num_warps,
    )
    if compute_dw:
        rms_norm_dw_kernel[cfg.dw_grid](
            partial, dw, cfg.grid[0], n_cols, BLOCK_P=cfg.dw_block_p, BLOCK_C=cfg.dw_block_c, num_warps=4,
        )
    return dx, dw


# --------------------------------------------------------------------------------------------------
# PyTorch operators: torch.ops.kernels.rms_norm_fwd and rms_norm_bwd (see kernels/ops.py)
# --------------------------------------------------------------------------------------------------


def rms_norm_fwd_fake(x, weight, eps):
    """The fake implementation of ``rms_norm_fwd``: what ``torch.compile`` traces with (chapter 09).

    ``kernels.cuda_rmsnorm`` registers it for its C++ operators of the same schema.

    Args:
        x, weight, eps: as ``rms_norm_forward`` takes them.

    Returns:
        ``(y, rstd)`` as empty tensors of the right shapes and dtypes.
    """
    n_rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    y = torch.empty(x.shape, dtype=out_dtype(x.dtype, weight.dtype), device=x.device)
    return y, torch.empty(n_rows, dtype=torch.float32, device=x.device)


def rms_norm_bwd_fake(dy, x, weight, rstd, compute_dw):
    """The fake implementation of ``rms_norm_bwd``: what ``torch.compile`` traces with.

    ``kernels.cuda_rmsnorm`` registers it for its C++ operator of the same schema.

    Args:
        dy, x, weight, rstd, compute_dw: as ``rms_norm_backward`` takes them.

    Returns:
        ``(dx, dw)`` as empty tensors (dw empty, shape [0], without ``compute_dw``).
    """
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return dx, (torch.empty(weight.shape, dtype=weight.dtype, device=weight.device) if compute_dw
                else weight.new_empty(0))


rms_norm_fwd_op = ops.define(
    "rms_norm_fwd(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)", rms_norm_forward,
    rms_norm_fwd_fake
)
rms_norm_bwd_op = ops.define(
    "rms_norm_bwd(Tensor dy, Tensor x, Tensor weight, Tensor rstd, bool compute_dw) -> (Tensor, Tensor)",
    rms_norm_backward, rms_norm_bwd_fake,
)


# --------------------------------------------------------------------------------------------------
# The C++ host path (kernels.host_path): what it launches, and the Python path it falls back to
# --------------------------------------------------------------------------------------------------

# The host path launches these kernels by handle and, on a miss, runs this Python path. It imports
# no kernel family: each hands over what the host path needs when it is imported.
host_path.register_family(host_path.RMSNormFamily(
    forward=rms_norm_forward, backward_op=rms_norm_bwd_op, forward_config=cached_forward_config,
    backward_config=cached_backward_config, forward_kernel=rms_norm_fwd_kernel,
    backward_kernel=rms_norm_bwd_kernel,
    dw_kernel=rms_norm_dw_kernel,
))


# --------------------------------------------------------------------------------------------------
# autograd, function, module
# --------------------------------------------------------------------------------------------------


class RMSNormFunction(torch.autograd.Function):
    """autograd glue around the two operators: the forward saves x (no copy), the weight and one
    float32 rstd per row; the backward computes dW only when the weight needs a gradient. A plain
    eager call runs the operators' implementations directly (``ops.call``): the dispatcher's trip
    costs host time and is needed only by tracers. Chapter 03 builds it; chapter 09 makes its
    passes operators."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        """Run ``rms_norm_fwd`` and save what the backward needs.

        Args:
            ctx: autograd's context.
            x, weight, eps: as ``rms_norm`` takes them, already checked.

        Returns:
            The normalised output.
        """
        y, rstd = ops.call(rms_norm_fwd_op, x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        """Run ``rms_norm_bwd``; the dW reduction only when the weight needs a gradient.

        Args:
            ctx: autograd's context, holding x, the weight and rstd.
            dy: the gradient of the output.

        Returns:
            ``(dx, dw, None)``: dw is None when the weight needs no gradient; eps has none.
        """
        x, weight, rstd = ctx.saved_tensors
        compute_dw = ctx.needs_input_grad[1]
        dx, dw = ops.call(rms_norm_bwd_op, dy, x, weight, rstd, compute_dw)
        return dx, (dw if compute_dw else None), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Fused RMSNorm over the last dimension of ``x``, as Hugging Face's ``LlamaRMSNorm``.

    ``x`` may have any number of leading dimensions and be a strided view; ``weight`` has shape
    ``(x.shape[-1],)``. The output's dtype is that of ``weight * x`` in PyTorch (bfloat16 for a
    bfloat16 model). Works under ``torch.compile`` and CUDA graphs: the kernels are the operators
    ``torch.ops.kernels.rms_norm_fwd``/``_bwd``. Eager calls on a GPU with contiguous ``x`` and
    ``weight`` go through a C++ autograd node that launches the same kernels
    (``kernels.host_path``): same bits, a fraction of the host time. Chapters 02 and 03 derive the
    forward and the backward.

    Args:
        x: the input, [..., hidden], any leading dimensions, possibly a strided view.
        weight: the scale, ``(x.shape[-1],)``.
        eps: added to the mean of squares before the square root.

    Returns:
        ``weight * x / sqrt(mean(x²) + eps)``, of ``x``'s shape and ``weight * x``'s dtype.
    """
    _check_inputs(x, weight)
    with_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if host_path.takes_rms_norm(x, weight):
        return host_path.rms_norm(x, weight, float(eps), with_grad)
    if with_grad:
        return RMSNormFunction.apply(x, weight, float(eps))
    # no autograd: skip the Function and its bookkeeping
    return ops.call(rms_norm_fwd_op, x, weight, float(eps))[0]


def check_llama_formula(module: torch.nn.Module, eps: float) -> None:
    """Refuse ``module`` unless it computes ``LlamaRMSNorm``'s weight · (x / sqrt(mean(x²) + eps)).

    Checked by running a float32 CPU copy of it with a random weight on two random rows: one shifted
    off zero (a LayerNorm subtracts the mean), one of magnitude sqrt(eps) (where an eps other than
    ``eps`` shows). The module itself is not touched, and its weight is not copied (a fresh one
    stands in), so a weight on the meta device or sharded by FSDP2 is no obstacle.

    Args:
        module: a norm module with a 1-D ``weight`` (``TritonRMSNorm.from_hf`` calls this).
        eps: the epsilon it is expected to use.

    Raises:
        TypeError: for a LayerNorm or GroupNorm, a norm with a bias, a copy that cannot be run, or
            one whose output differs from the formula (Gemma's 1 + weight, another eps).
    """
    name = type(module).__name__
    if isinstance(module, (torch.nn.LayerNorm, torch.nn.GroupNorm)):
        raise TypeError(f"{name} subtracts the mean: it is not an RMSNorm, and TritonRMSNorm cannot replace it")
    if getattr(module, "bias", None) is not None:
        raise TypeError(f"{name} has a bias; TritonRMSNorm computes weight · x / rms(x) without one")
    gen = torch.Generator().manual_seed(0)
    hidden = module.weight.shape[0]
    x = torch.randn(2, hidden, generator=gen)
    x[0] += 0.5
    x[1] *= max(eps, 1e-12) ** 0.5
    try:
        # The copy gets a plain float32 CPU weight of its own (deepcopy's memo swaps it in),
        # whatever the module's weight is: on the meta device, on a GPU, or a DTensor shard under
        # FSDP2.
        fresh = torch.nn.Parameter(torch.empty(hidden, dtype=torch.float32), requires_grad=False)
        probe = copy.deepcopy(module, {id(module.weight): fresh})
        probe = probe.to_empty(device="cpu") if any(t.is_meta for t in probe.buffers()) else probe.to("cpu")
        probe = probe.float()
        with torch.no_grad():
            probe.weight.copy_(torch.randn(hidden, generator=gen))
            got = probe(x)
    except Exception as err:  # whatever stops the check, the conversion is refused with its cause
        raise TypeError(f"could not run a copy of {name} to check that it computes LlamaRMSNorm's formula: "
                        f"{type(err).__name__}: {err}") from err
    expected = rms_norm_reference(x.double(), probe.weight.detach().double(), eps)
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape or relative_error(got,
                                                                                          expected) > 1e-4:
        raise TypeError(
            f"{name} does not compute LlamaRMSNorm's weight · x / sqrt(mean(x²) + eps) with eps={eps} (e.g. "
            "Gemma's norms multiply by 1 + weight): TritonRMSNorm cannot replace it"
        )


class TritonRMSNorm(torch.nn.Module):
    """Drop-in replacement for ``LlamaRMSNorm`` (and the identical norms of Mistral, Qwen2 and Qwen3).

    Args:
        hidden_size: the normalised (last) dimension.
        eps: added to the mean of squares (stored as ``variance_epsilon``, as Hugging Face names it).
        device: where the weight is created.
        dtype: the weight's dtype.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps

    @classmethod
    def from_hf(cls, module: torch.nn.Module) -> "TritonRMSNorm":
        """A TritonRMSNorm that shares ``module``'s weight Parameter (no copy: optimisers and tying
        still see it). Chapter 03 introduces it; chapters 04 and 08 swap a model's norms with it.

        ``module`` must compute what ``LlamaRMSNorm`` computes, weight · (x / rms(x)), with its
        ``variance_epsilon`` (or ``eps``): any other kind is refused, never silently converted to
        the wrong formula. ``check_llama_formula`` runs a copy of it to make sure (not needed when
        ``module`` is already a TritonRMSNorm).

        Args:
            module: the norm to replace, e.g. a ``LlamaRMSNorm``.

        Returns:
            The new module, with ``module``'s weight and eps.

        Raises:
            TypeError: when ``module`` has no 1-D weight Parameter or no number ``variance_epsilon``
                or ``eps``, or does not compute the formula (a LayerNorm, a norm with a bias,
                Gemma's (1 + weight)).
        """
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 1:
            raise TypeError(f"{type(module).__name__} has no 1-D weight Parameter to share")
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        if isinstance(eps, bool) or not isinstance(eps, (int, float)):
            raise TypeError(f"{type(module).__name__} has no number `variance_epsilon` or `eps`, got {eps!r}")
        if type(module) is not cls:
            check_llama_formula(module, float(eps))
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.weight = weight
        new.variance_epsilon = float(eps)
        return new

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Normalise ``hidden_states`` with ``rms_norm``.

        Args:
            hidden_states: ``[..., hidden_size]``.

        Returns:
            The normalised states, of the input's shape and ``weight * hidden_states``'s dtype.
        """
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        """What ``print(module)`` shows inside the parentheses.

        Returns:
            The hidden size and eps, e.g. ``"4096, eps=1e-06"``.
        """
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}"
