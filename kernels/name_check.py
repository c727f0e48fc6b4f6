"""Is ``import kernels`` this workbook's package? A check written with the standard library alone.

Hugging Face's Kernel Hub is also a PyPI distribution named ``kernels``. Installed next to this
workbook, it wins ``import kernels`` (the editable install's finder comes after the normal path
finder), also from ``notebooks/``, and pip warns about none of it. Every chapter would then fail
with an error that says nothing of the cause.

A check inside the package cannot catch that, since the other package's code runs instead of ours.
So this file imports nothing of the package and can be loaded by its path: ``tests/conftest.py`` and
chapter 00's first cell do so, and ``kernels/__init__.py`` runs it too, for the case where ours wins
but the other distribution is installed beside it (transformers then reads that one's version for
its own ``kernels`` support).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from pathlib import Path

OUR_DISTRIBUTION = "llm-kernel-workbook"
PACKAGE_DIR = Path(__file__).resolve().parent

FIX = ("Fix: work in a fresh virtual environment made for the workbook (python3 -m venv .venv && . .venv/bin/activate "
       "&& pip install -r requirements.txt -e .), or remove the other package: pip uninstall kernels")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def other_distributions() -> list[tuple[str, str]]:
    """List the installed distributions besides this workbook's that ship a top-level ``kernels``.

    Returns:
        ``(name, version)`` for each, sorted by name; the version is ``"unknown version"`` where
        the metadata lacks one. Empty when the name is ours alone.
    """
    owners = importlib.metadata.packages_distributions().get("kernels", [])
    found = []
    for name in sorted(set(owners)):
        if _canonical(name) == _canonical(OUR_DISTRIBUTION):
            continue
        try:
            found.append((name, importlib.metadata.version(name)))
        except importlib.metadata.PackageNotFoundError:
            found.append((name, "unknown version"))
    return found


def problem(package_dir: Path = PACKAGE_DIR) -> str | None:
    """Say what is wrong with the name ``kernels`` here, in words with the fix.

    Args:
        package_dir: the folder this workbook's package lives in; ``import kernels`` must resolve
            to its ``__init__.py``.

    Returns:
        The problem and its fix, or None when ``import kernels`` gives ``package_dir`` and no other
        distribution installs a ``kernels`` package.
    """
    spec = importlib.util.find_spec("kernels")
    origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
    others = ", ".join(f"{name} {version}" for name, version in other_distributions())
    if origin != package_dir / "__init__.py":
        where = origin.parent if origin else "nowhere"
        owner = f" (installed by {others})" if others else ""
        return (f"`import kernels` gives the package at {where}{owner}, not this workbook's ({package_dir}). "
                f"Another distribution named kernels, such as Hugging Face's Kernel Hub, takes the name. {FIX}")
    if others:
        return (f"another distribution also installs a package named `kernels`: {others}. It can take "
                f"`import kernels` from this workbook, and transformers reads its version. {FIX}")
    return None


def require_ours(package_dir: Path = PACKAGE_DIR) -> None:
    """Stop unless ``import kernels`` is this workbook's alone (chapter 00's first cell runs it).

    Args:
        package_dir: the folder this workbook's package lives in (see ``problem``).

    Raises:
        ImportError: with the problem and its fix, when ``problem`` finds one.
    """
    message = problem(package_dir)
    if message is not None:
        raise ImportError(message)
