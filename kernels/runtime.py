"""Where the kernels run, and at what size.

This is the one module that decides:

* **mode** -- ``"gpu"`` when a CUDA device is present, otherwise ``"interpreter"``: Triton's interpreter runs the
  very same kernels on the CPU with NumPy, slowly but faithfully enough to test and to teach.
  Triton reads ``TRITON_INTERPRET`` when a kernel is *decorated* with ``@triton.jit``, so this module must be
  imported before any kernel is defined (``import kernels`` takes care of that). A value the user set wins.
* **profile** -- ``"tiny"`` (small shapes and a toy Llama that the interpreter gets through in seconds) or
  ``"full"`` (realistic Llama shapes). The default follows the mode; ``KERNELS_PROFILE=tiny|full`` overrides it.
"""

from __future__ import annotations

import os
import platform

import torch

PROFILES = ("tiny", "full")


def _decide_interpreter() -> bool:
    # Respect an explicit choice either way; otherwise interpret exactly when there is no CUDA device.
    if "TRITON_INTERPRET" not in os.environ:
        os.environ["TRITON_INTERPRET"] = "0" if torch.cuda.is_available() else "1"
    return os.environ["TRITON_INTERPRET"] == "1"


INTERPRET: bool = _decide_interpreter()
MODE: str = "interpreter" if INTERPRET else "gpu"


def _decide_profile() -> str:
    value = os.environ.get("KERNELS_PROFILE", "").strip().lower()
    if value and value not in PROFILES:
        raise ValueError(f"KERNELS_PROFILE must be one of {PROFILES}, got {value!r}")
    return value or ("tiny" if INTERPRET else "full")


PROFILE: str = _decide_profile()


def device() -> torch.device:
    """The device tensors should live on: the GPU in gpu mode, the CPU in the interpreter."""
    return torch.device("cuda") if MODE == "gpu" else torch.device("cpu")


def pick(tiny, full):
    """Return ``tiny`` or ``full`` according to the size profile: the one switch every size in the workbook uses."""
    return tiny if PROFILE == "tiny" else full


def num_sms() -> int:
    """Streaming multiprocessors of the current GPU (a nominal 4 in the interpreter, where it only sizes grids)."""
    if MODE == "gpu":
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return 4


def device_name() -> str:
    if MODE == "gpu":
        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()}) via the Triton interpreter"


def versions() -> dict[str, str]:
    import triton

    found = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__}
    try:
        import transformers

        found["transformers"] = transformers.__version__
    except ImportError:  # the kernels themselves do not need it
        found["transformers"] = "not installed"
    return found


def describe() -> str:
    """One line: where this runs, with which versions, at which size profile."""
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
    """What a reader should make of timings taken in this mode."""
    if MODE == "gpu":
        return f"Timings are GPU times on {device_name()}."
    return (
        "Timings here are wall-clock times of Triton's CPU interpreter: they say nothing about GPU speed. "
        "The committed outputs of this notebook carry numbers from a GPU run."
    )
