"""How close to float64 is close enough: the bounds that tests, exercises and benchmark checks use.

A kernel's output and every gradient are compared with a float64 reference by the relative error
‖out − ref‖ / ‖ref‖ (``kernels.reference.relative_error``). The bound depends on the storage dtype:
float32 leaves a few rounding steps, a bfloat16 value carries 8 significant bits (a relative step of
2⁻⁸ ≈ 4e-3), float16 11. NaN never passes. A looser bound that would let an all-zero gradient
through is a defect, not a fix. Chapters 10 to 15 and 17 judge their kernels by these bounds.
"""

from __future__ import annotations

import torch

# Relative error against float64, by storage dtype.
RELATIVE_ERROR_TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2, torch.float16: 5e-3}

# Element by element, as (rtol, atol), for the exercises' diagnoses: |out − ref| ≤ rtol·|ref| +
# atol·max|ref|. float32 leaves a few ulps; a bfloat16 value has been rounded to 8 bits of mantissa
# once or twice (ulp 2**-7 relative at worst).
ELEMENT_TOL = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (2**-6, 2**-8)}
