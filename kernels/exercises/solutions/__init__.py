"""The exercises' solutions, one module each, hidden until asked for.

A chapter's exercise cell gives a stub to complete and a ``check_…`` call; ``solution("name")``
prints this folder's ``name.py`` when the reader asks for it, and ``load("name")`` returns the
function it defines, which is how the tests hold every solution to its own checker. A solution
module defines exactly one public function, named like the module.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

FOLDER = Path(__file__).resolve().parent


def names() -> list[str]:
    """The exercises that have a solution here."""
    return sorted(p.stem for p in FOLDER.glob("*.py") if p.stem != "__init__")


def source(name: str) -> str:
    """The text of solution ``name``; a ValueError lists the names there are."""
    path = FOLDER / f"{name}.py"
    if not path.is_file():
        raise ValueError(f"no solution named {name!r}; there are: {', '.join(names())}")
    return path.read_text()


def solution(name: str) -> None:
    """Print solution ``name``: call it only once you have tried the exercise."""
    print(source(name))


def load(name: str) -> Callable:
    """The function solution ``name`` defines (the module is loaded from its file, so it stays out
    of sight until asked for: nothing here imports it)."""
    source(name)  # the same error for an unknown name
    spec = importlib.util.spec_from_file_location(f"kernels.exercises.solutions.{name}",
                                                  FOLDER / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)
