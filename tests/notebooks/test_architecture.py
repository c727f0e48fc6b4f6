"""The package's shape, kept so: wings above the kernels, no import cycle, no module reaching into another's private
names, a top level a reader can take in, and the name ``kernels`` ours alone.

The layers themselves (which wing may import which) are import-linter contracts in ``pyproject.toml``, checked by
``lint-imports`` in CI; these tests check what import-linter does not: private names, and the counts."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kernels"
WINGS = {"hf", "bench", "training", "distributed", "exercises"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _names_our_module(call: ast.Call) -> bool:
    """An ``import_module`` of one of our modules by a literal name: the way a cycle is dodged. (Optional
    transformers model families are looked up this way too, from a table; those are not ours.)"""
    arg = call.args[0] if call.args else None
    if isinstance(arg, ast.JoinedStr) and arg.values:
        arg = arg.values[0]
    return isinstance(arg, ast.Constant) and str(arg.value).startswith("kernels")


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names, relative levels resolved against ``module``."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_and_private_uses(modules: dict[str, Path]):
    """Each module's imports of other package modules, and each use of another module's private name:
    ``from x import _y``, ``x._y`` on an imported module, and ``import_module`` of one of our modules."""
    edges: dict[str, set[str]] = {m: set() for m in modules}
    private: list[str] = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = _resolve(name, path, node)
                if not target.startswith("kernels"):
                    continue
                for alias in node.names:
                    full = f"{target}.{alias.name}"
                    if full in modules:
                        edges[name].add(full)
                        aliases[alias.asname or alias.name] = full
                    else:
                        edges[name].add(target)
                        if _is_private(alias.name) and target != name:
                            private.append(f"{name}: from {target} import {alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("kernels"):
                        edges[name].add(alias.name)
                        aliases[alias.asname or alias.name] = alias.name
            elif isinstance(node, ast.Call):
                func = node.func
                called = getattr(func, "attr", None) or getattr(func, "id", None)
                if called == "import_module" and _names_our_module(node):
                    private.append(f"{name}: import_module(...) at line {node.lineno}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and _is_private(node.attr) and isinstance(node.value, ast.Name)
                    and aliases.get(node.value.id, name) != name):
                private.append(f"{name}: {aliases[node.value.id]}.{node.attr} at line {node.lineno}")
    edges = {m: {t for t in targets if t in modules and t != m} for m, targets in edges.items()}
    return edges, private


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_the_package_has_no_import_cycle():
    edges, _ = imports_and_private_uses(package_modules())
    assert import_cycles(edges) == []


def test_no_module_uses_another_modules_private_name():
    _, private = imports_and_private_uses(package_modules())
    assert private == [], "make the name public in the module that owns it:\n" + "\n".join(private)


def test_the_checker_sees_cycles_and_reach_ins(tmp_path, monkeypatch):
    # The two checks above pass on the package; on a package that breaks both rules they must fail.
    pkg = tmp_path / "kernels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import _helper\n")
    (pkg / "b.py").write_text("from . import a\nimport importlib\nimportlib.import_module('kernels.a')\n")
    (pkg / "c.py").write_text("from kernels import a\nx = a._hidden\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    modules = {module_name(p): p for p in sorted(pkg.rglob("*.py"))}
    edges, private = imports_and_private_uses(modules)
    assert import_cycles(edges) == [["kernels.a", "kernels.b"]]
    assert len(private) == 3 and any("_helper" in p for p in private) and any("_hidden" in p for p in private)


def test_the_top_level_holds_the_kernels_and_the_wings():
    top_modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    # 16, + prebuild.py, lora.py and gemm.py (15), attention.py (16), add_rmsnorm.py and optim_in_backward.py (17)
    # + fp8.py (18): FP8 is a kernel family of its own (the quantiser and the scaled GEMM)
    # + rmsnorm_fp8.py (18): the RMSNorm that stores its output in FP8, a kernel of its own
    # + fp8_linear.py (18): the frozen base linear stored in FP8, with its input-gradient GEMM
    # + lora_fp8.py (18): the fused LoRA node over an FP8 base
    assert len(top_modules) <= 26, top_modules
    assert packages == WINGS


def test_no_other_distribution_owns_the_name():
    from kernels import name_check

    assert name_check.problem() is None


def test_the_name_check_names_the_other_distribution_and_the_fix(monkeypatch):
    from kernels import name_check

    monkeypatch.setattr(importlib.metadata, "packages_distributions",
                        lambda: {"kernels": ["llm-kernel-workbook", "kernels"]})
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.17.2")
    message = name_check.problem()
    assert "kernels 0.17.2" in message and "pip uninstall kernels" in message and "virtual environment" in message
    with pytest.raises(ImportError, match="kernels 0.17.2"):
        name_check.require_ours()


def test_the_name_check_sees_another_package_answer_import_kernels(tmp_path):
    from kernels import name_check

    other = tmp_path / "kernels"
    other.mkdir()
    message = name_check.problem(other)  # as if this checkout's package lived elsewhere
    assert f"not this workbook's ({other})" in message and "pip uninstall kernels" in message


def test_transformers_does_not_take_our_package_for_its_kernel_hub():
    # transformers reads the version of whatever distribution ships `kernels`; inside its accepted range it would
    # import the Hub's API from our package and fail. Ours stays below that range.
    from packaging.version import Version
    from transformers.utils import import_utils

    ours = Version(re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1))
    low = Version(import_utils.KERNELS_MIN_VERSION)
    high = Version(import_utils.KERNELS_MAX_VERSION)
    assert not low <= ours < high
    assert ours < low
    assert import_utils.is_kernels_available() is False
