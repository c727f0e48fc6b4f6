"""Check for the exercise of chapter 09: the fake implementation of the RMSNorm forward operator.

A fake implementation receives fake tensors (shape, dtype, device and strides, but no data) and must return fake
outputs that describe the real ones exactly: that is all ``torch.compile`` learns about an operator while it traces
a model. The check runs the reader's function under ``FakeTensorMode`` on inputs chosen to expose the usual
mistakes (a float32 weight with bfloat16 input promotes the output, 3-D input, a strided view, a single row) and
compares every output's shape, dtype and device with what ``torch.ops.kernels.rms_norm_fwd`` really returns. It
never raises because the reader's function is wrong: it prints its verdict and returns a ``Report``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from kernels import runtime
from kernels.rmsnorm import rms_norm_fwd_op

from .rmsnorm import Report, verdict


def _cases(device: torch.device) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)

    def rand(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    return [
        ("float32 input of 5 × 64", rand(5, 64), rand(64)),
        ("bfloat16 input of 2 × 3 × 40 (3-D)", rand(2, 3, 40, dtype=torch.bfloat16), rand(40, dtype=torch.bfloat16)),
        ("bfloat16 input with a float32 weight", rand(4, 32, dtype=torch.bfloat16), rand(32)),
        ("a strided view x[:, ::2] of a 6 × 96 tensor", rand(6, 96)[:, ::2], rand(48)),
        ("a single row of 16", rand(16), rand(16)),
    ]


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return f"a {type(t).__name__}"
    return f"shape {tuple(t.shape)}, dtype {str(t.dtype).removeprefix('torch.')}, device {t.device.type}"


def check_rms_norm_fake(fake: Callable, verbose: bool = True) -> Report:
    """Check ``fake(x, weight, eps) -> (y, rstd)``: fake outputs that match the real operator's, for every case."""
    device = runtime.device()
    for name, x, w in _cases(device):
        y_real, rstd_real = rms_norm_fwd_op(x, w, 1e-6)
        try:
            with FakeTensorMode(allow_non_fake_inputs=False) as mode:
                out = fake(mode.from_tensor(x), mode.from_tensor(w), 1e-6)
        except Exception as exc:  # noqa: BLE001  (the reader's code may raise anything)
            return verdict(False, f"on a {name}, your fake raised {type(exc).__name__}: {exc}. A fake may only "
                                  "look at shapes, dtypes and devices, never at values.", verbose)
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            return verdict(False, f"on a {name}, your fake returned {_describe(out)}; the operator returns two "
                                  "tensors, (y, rstd).", verbose)
        for what, got, real in (("y", out[0], y_real), ("rstd", out[1], rstd_real)):
            if not isinstance(got, torch.Tensor):
                return verdict(False, f"on a {name}, {what} is {_describe(got)}, not a tensor.", verbose)
            problems = [field for field, a, b in (("shape", tuple(got.shape), tuple(real.shape)),
                                                  ("dtype", got.dtype, real.dtype),
                                                  ("device", got.device.type, real.device.type)) if a != b]
            if problems:
                hint = ""
                if what == "y" and "dtype" in problems:
                    hint = (" Hint: the output's dtype is that of `weight * x` in PyTorch "
                            "(torch.promote_types(x.dtype, weight.dtype)).")
                elif what == "rstd" and "shape" in problems:
                    hint = " Hint: one rstd per row, and rows = all elements / the last dimension."
                elif what == "rstd" and "dtype" in problems:
                    hint = " Hint: rstd is kept in float32 whatever the input's dtype."
                return verdict(False, f"on a {name}, {what} has the wrong {' and '.join(problems)}: yours has "
                                      f"{_describe(got)}, the real operator gives {_describe(real)}.{hint}", verbose)
    return verdict(True, f"your fake describes the real outputs on all {len(_cases(device))} inputs.", verbose)
