"""Launch configurations are derived from the device's properties, never from one GPU model's numbers.

The configuration functions are plain arithmetic on a ``DeviceProps``, so the choice for chips that are not in this
machine (a Blackwell GB300 as on a DGX Station, a consumer GPU with less shared memory) can be checked anywhere.
"""

import pytest
import triton

from kernels import rmsnorm
from kernels.cross_entropy import backward_config as ce_backward_config
from kernels.cross_entropy import forward_config as ce_forward_config
from kernels.runtime import INTERPRETER, DeviceProps

KiB = 1024
H200 = DeviceProps("NVIDIA H200", False, sm_count=132, shared_mem_per_block=227 * KiB, regs_per_sm=65536)
# Figures as the vendor publishes them for these parts: a Blackwell with more SMs, and a consumer Ada GPU with
# 99 KB of shared memory per block.
BLACKWELL = DeviceProps("Blackwell (GB300-like)", False, sm_count=160, shared_mem_per_block=227 * KiB,
                        regs_per_sm=65536)
CONSUMER = DeviceProps("consumer (AD102-like)", False, sm_count=128, shared_mem_per_block=99 * KiB,
                       regs_per_sm=65536)
GPUS = [H200, BLACKWELL, CONSUMER]


@pytest.mark.parametrize("props", GPUS, ids=lambda p: p.name)
def test_rmsnorm_backward_grid_is_one_program_per_sm(props):
    cfg = rmsnorm.backward_config(16384, 4096, 2, props)
    assert cfg.grid == (props.sm_count,)
    # Few rows: never more programs than row blocks.
    few = rmsnorm.backward_config(3, 4096, 2, props)
    assert few.grid == (triton.cdiv(3, few.rows),)


def test_rmsnorm_pipeline_depth_follows_shared_memory():
    # Narrow tiles (2 rows of 4,096) are pipelined as deep as one program's shared memory allows: three stages of
    # x and dy (32 KiB each in bf16) fit in 227 KiB, only two in 99 KiB once the values are float32 (64 KiB each).
    assert rmsnorm.backward_config(16384, 4096, 2, H200).stages == 3
    assert rmsnorm.backward_config(16384, 4096, 2, CONSUMER).stages == 3
    assert rmsnorm.backward_config(16384, 4096, 4, H200).stages == 3
    assert rmsnorm.backward_config(16384, 4096, 4, CONSUMER).stages == 1
    # Wide tiles are not pipelined at all.
    assert rmsnorm.backward_config(16384, 512, 2, H200).stages == 1


@pytest.mark.parametrize("props", GPUS, ids=lambda p: p.name)
@pytest.mark.parametrize("hidden", [64, 1000, 4096, 8192, 16384])
def test_rmsnorm_tiles_fit_the_register_file(props, hidden):
    fwd = rmsnorm.forward_config(16384, hidden, props)
    bwd = rmsnorm.backward_config(16384, hidden, 2, props)
    budget = props.regs_per_sm // 8
    for cfg in (fwd, bwd):
        assert cfg.block_n == triton.next_power_of_2(hidden)
        assert cfg.rows * cfg.block_n <= max(budget, cfg.block_n)  # one row always fits, however wide
    assert fwd.grid == (triton.cdiv(16384, fwd.rows),)
    # The dW sum covers every column with about one program per SM.
    assert bwd.dw_grid[0] * bwd.dw_block_c >= hidden and bwd.dw_block_p >= 1


def test_fewer_registers_give_smaller_tiles():
    small = DeviceProps("half the registers", False, 132, 227 * KiB, 32768)
    assert rmsnorm.forward_config(16384, 4096, small).rows < rmsnorm.forward_config(16384, 4096, H200).rows
    assert ce_forward_config(16384, 128256, small).block_v < ce_forward_config(16384, 128256, H200).block_v


@pytest.mark.parametrize("props", GPUS, ids=lambda p: p.name)
def test_cross_entropy_chunks(props):
    cfg = ce_forward_config(16384, 128256, props)
    assert (cfg.block_v, cfg.rows, cfg.num_warps) == (4096, 1, 8)  # 16 float32 values per thread over 8 warps
    assert ce_forward_config(8, 1000, props).block_v == 1024  # never wider than the row
    assert ce_backward_config(16384, 128256, props).block_v == 8192


def test_interpreter_uses_few_large_programs():
    cfg = rmsnorm.forward_config(300, 96, INTERPRETER)
    assert cfg.grid == (1,)
    bwd = rmsnorm.backward_config(300, 96, 2, INTERPRETER)
    assert bwd.grid[0] <= INTERPRETER.sm_count and bwd.stages == 1
