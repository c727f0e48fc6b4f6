"""Where the kernels run, and at what size.

This is the one module that decides:

* **mode** -- ``"gpu"`` when a CUDA device is present, otherwise ``"interpreter"``: Triton's
  interpreter runs the very same kernels on the CPU with NumPy, slowly but faithfully enough to test
  and to teach. Triton reads ``TRITON_INTERPRET`` when a kernel is *decorated* with ``@triton.jit``,
  so this module must be imported before any kernel is defined (``import kernels`` takes care of
  that). A value the user set wins.
* **profile** -- ``"tiny"`` (small shapes and a toy Llama that the interpreter gets through in
  seconds) or ``"full"`` (realistic Llama shapes). The default follows the mode;
  ``KERNELS_PROFILE=tiny|full`` overrides it.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

import torch

PROFILES = ("tiny", "full")


def _decide_interpreter() -> bool:
    # Respect an explicit choice either way; otherwise interpret exactly when there is no CUDA
    # device.
    if "TRITON_INTERPRET" not in os.environ:
        os.environ["TRITON_INTERPRET"] = "0" if torch.cuda.is_available() else "1"
    return os.environ["TRITON_INTERPRET"] == "1"


INTERPRET: bool = _decide_interpreter()
MODE: str = "interpreter" if INTERPRET else "gpu"
# torch.compile's backend for the workbook's compiled runs and tests: Inductor on a GPU; in the
# interpreter "aot_eager", which traces the same graphs (AOTAutograd, fake tensors, our kernels as
# single operators) and runs them eagerly, so that Triton's interpreter runs the kernels.
COMPILE_BACKEND: str = "aot_eager" if INTERPRET else "inductor"


def _decide_profile() -> str:
    value = os.environ.get("KERNELS_PROFILE", "").strip().lower()
    if value and value not in PROFILES:
        raise ValueError(f"KERNELS_PROFILE must be one of {PROFILES}, got {value!r}")
    return value or ("tiny" if INTERPRET else "full")


PROFILE: str = _decide_profile()


def device() -> torch.device:
    """Give the device tensors should live on (every chapter puts its tensors there).

    Returns:
        ``cuda`` in gpu mode, ``cpu`` in the interpreter.
    """
    return torch.device("cuda") if MODE == "gpu" else torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device``; nothing to wait for on the CPU.

    A timer reads the clock after this, or it measures the launches, not the work.

    Args:
        device: the device whose queued work to wait for (a CUDA device; any other returns at once).
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pick(tiny, full):
    """Choose ``tiny`` or ``full`` by the size profile: the one switch every size in the workbook uses.

    The chapters (00, 02 to 04, 08 to 11) size their inputs with it.

    Args:
        tiny: the value for the ``"tiny"`` profile (the interpreter's default).
        full: the value for the ``"full"`` profile (a GPU's default).

    Returns:
        ``tiny`` when ``PROFILE`` is ``"tiny"``, else ``full``.
    """
    return tiny if PROFILE == "tiny" else full


@dataclass(frozen=True)
class DeviceProps:
    """The properties of a device that launch configurations are derived from.

    Every kernel's configuration function takes one of these instead of reading the GPU itself, so
    that nothing tuned on one GPU model is hard-coded: the same rules give a different, fitting
    answer on another chip (a Blackwell GB300 has more SMs than an H200; a consumer GPU has less
    shared memory per block), and tests can check the choice for chips that are not in the machine.
    """

    name: str
    interpreter: bool  # Triton's CPU interpreter: programs run one after another, each costing milliseconds
    sm_count: int  # streaming multiprocessors: the size of a persistent grid
    shared_mem_per_block: int  # bytes one program may use (the opt-in maximum): bounds software pipelining
    regs_per_sm: int  # 32-bit registers per SM: bounds how many values a program can keep in flight
    capability: tuple[int, int] = (0, 0)  # compute capability: (9, 0) and up have Hopper's TMA


# In the interpreter the numbers only shape grids: four "SMs" keep persistent grids small, and
# programs are cheap to make large (NumPy runs a whole tile at once).
INTERPRETER = DeviceProps("Triton interpreter", True, 4, 1 << 30, 1 << 30)

_PROPS: dict[int, DeviceProps] = {}


def _read_props(index: int) -> DeviceProps:
    p = torch.cuda.get_device_properties(index)
    return DeviceProps(
        name=p.name,
        interpreter=False,
        sm_count=p.multi_processor_count,
        # Older PyTorch releases lack some fields: fall back to what every NVIDIA GPU since Volta
        # has.
        shared_mem_per_block=getattr(p, "shared_memory_per_block_optin", 96 * 1024),
        regs_per_sm=getattr(p, "regs_per_multiprocessor", 65536),
        capability=(p.major, p.minor),
    )


def device_props(device: torch.device | None = None) -> DeviceProps:
    """Read the ``DeviceProps`` of a GPU, once per device (chapter 12 reads them).

    Args:
        device: the CUDA device (default, or one without an index: the current GPU).

    Returns:
        Its ``DeviceProps``; ``INTERPRETER`` in the interpreter, whatever ``device`` is.
    """
    if INTERPRET:
        return INTERPRETER
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    props = _PROPS.get(index)
    if props is None:
        props = _PROPS[index] = _read_props(index)
    return props


def num_sms() -> int:
    """Count the streaming multiprocessors of the current GPU (chapter 03 sizes a grid by it).

    Returns:
        ``device_props().sm_count``: a nominal 4 in the interpreter, where it only sizes grids.
    """
    return device_props().sm_count


def device_name() -> str:
    """Name what the kernels run on, for a chapter's printed header.

    Returns:
        The GPU's name in gpu mode, else the CPU's with "via the Triton interpreter".
    """
    if MODE == "gpu":
        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()}) via the Triton interpreter"


def versions() -> dict[str, str]:
    """Collect the versions a recorded result depends on (the chapters print them beside results).

    Returns:
        ``python``, ``torch``, ``triton`` and ``transformers`` (``"not installed"`` when absent),
        each to its version string.
    """
    import triton

    found = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__}
    try:
        import transformers

        found["transformers"] = transformers.__version__
    except ImportError:  # the kernels themselves do not need it
        found["transformers"] = "not installed"
    return found


def describe() -> str:
    """One line: where this runs, with which versions, at which size profile.

    Returns:
        e.g. ``"mode=gpu | NVIDIA H200 (sm_90, 132 SMs) | torch ... | profile=..."``.
    """
    where = device_name()
    if MODE == "gpu":
        major, minor = torch.cuda.get_device_capability()
        where += f" (sm_{major}{minor}, {num_sms()} SMs)"
    v = versions()
    return (
        f"mode={MODE} | {where} | torch {v['torch']} | triton {v['triton']} | "
        f"transformers {v['transformers']} | profile={PROFILE}"
    )


def timings_note() -> str:
    """Say what a reader should make of timings taken in this mode (every timing chapter prints it).

    Returns:
        One or two sentences: GPU times on this GPU, or a warning that the interpreter's wall-clock
        times say nothing about GPU speed.
    """
    if MODE == "gpu":
        return f"Timings are GPU times on {device_name()}."
    return (
        "Timings here are wall-clock times of Triton's CPU interpreter: they say nothing about GPU speed. "
        "The committed outputs of this notebook carry numbers from a GPU run."
    )
