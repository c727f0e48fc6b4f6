"""A class's ``forward`` behind transformers' decorators, rebuilt around another innermost function.

transformers wraps some ``forward`` methods in decorators (a renamed keyword argument, a deprecation
warning). Each wrapper made with ``functools.wraps`` keeps the function it wraps as ``__wrapped__``
and calls it from a cell of its closure. A patch that replaces the innermost function rebuilds the
chain around the replacement, so that what the decorators do still happens. The RoPE and the fused
add + RMSNorm switches use it (chapters 11 and 17).
"""

from __future__ import annotations

import types


def rebuilt_around(fn: types.FunctionType, inner: types.FunctionType, replacement: types.FunctionType,
                   refusal: str) -> types.FunctionType:
    """``fn``'s chain of ``functools.wraps``-style wrappers down to ``inner``, rebuilt around
    ``replacement``: the same code and closures, except the cell that held the next function down.

    Args:
        fn: the outermost function (a class's ``forward``).
        inner: the function the chain ends in (``inspect.unwrap(fn)``).
        replacement: what takes ``inner``'s place.
        refusal: the start of the error when a wrapper cannot be rebuilt, e.g. ``"cannot patch the
            rotary embedding of model.layers.0.self_attn"``; the error ends with what to do.

    Returns:
        The rebuilt outermost function; ``replacement`` itself when ``fn`` is ``inner``.

    Raises:
        ValueError: a wrapper that does not keep the function below it in exactly one cell of its
            closure (it could not call the rebuilt one).
    """
    if fn is inner:
        return replacement
    below = getattr(fn, "__wrapped__", None)
    cells = fn.__closure__ or ()
    holding = [i for i, cell in enumerate(cells) if _cell_holds(cell, below)] if below is not None else []
    if len(holding) != 1:
        raise ValueError(
            f"{refusal}: {fn.__qualname__} is wrapped by a decorator that does not keep the function it wraps in "
            "its closure, so it cannot be rebuilt around the patched function"
        )
    new_below = rebuilt_around(below, inner, replacement, refusal)
    closure = tuple(types.CellType(new_below) if i == holding[0] else cell for i, cell in enumerate(cells))
    rebuilt = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, closure)
    rebuilt.__dict__.update(fn.__dict__)
    rebuilt.__wrapped__ = new_below
    rebuilt.__kwdefaults__ = fn.__kwdefaults__
    rebuilt.__qualname__ = fn.__qualname__
    return rebuilt


def _cell_holds(cell, value) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False
