"""Every public function and class of the package says how to call it.

A public function (no leading underscore) that takes parameters has an ``Args:`` section; one whose
annotated return is not None has a ``Returns:`` section (``Yields:`` for a generator). A public
class's methods count the same way (``__init__``'s parameters may be described in the class
docstring instead). Properties read as attributes and need no ``Returns:``.

Reads the source with ``ast``: no module is imported. The exercises' solutions are the learner's
answers, written as a learner would: they are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "kernels"
LEFT_OUT = "kernels/exercises/solutions/"

# Files not yet held to this standard, each skipped whole; the list only shrinks. A name may stand
# for a file that does not exist yet.
ALLOWED: frozenset[str] = frozenset()


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> list[str]:
    args = function.args
    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    if method and names and names[0] in ("self", "cls") and not _is_static(function):
        names = names[1:]
    names += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
    return names


def _decorators(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    names = set()
    for decorator in function.decorator_list:
        node = decorator.func if isinstance(decorator, ast.Call) else decorator
        names.add(node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", ""))
    return names


def _is_static(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return "staticmethod" in _decorators(function)


def _returns_value(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    returns = function.returns
    if returns is None or "property" in _decorators(function):
        return False
    return not (isinstance(returns, ast.Constant) and returns.value in (None, "None"))


def _missing(function: ast.FunctionDef | ast.AsyncFunctionDef, where: str, method: bool,
             class_doc: str = "") -> list[str]:
    doc = ast.get_docstring(function) or ""
    problems = []
    if _parameters(function, method):
        described = "Args:" in doc or (function.name == "__init__" and "Args:" in class_doc)
        if not described:
            problems.append(f"{where}: parameters but no Args:")
    if _returns_value(function) and "Returns:" not in doc and "Yields:" not in doc:
        problems.append(f"{where}: returns a value but no Returns:")
    return problems


def undocumented(source: str, rel: str) -> list[str]:
    """``file:line name: what is missing`` for each public function, method or class of ``source``."""
    problems = []
    for node in ast.parse(source).body:
        where = f"{rel}:{getattr(node, 'lineno', 0)} {getattr(node, 'name', '')}"
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            problems += _missing(node, where, method=False)
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            class_doc = ast.get_docstring(node) or ""
            for item in node.body:
                if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                if item.name.startswith("_") and item.name != "__init__":
                    continue
                problems += _missing(item, f"{rel}:{item.lineno} {node.name}.{item.name}", method=True,
                                     class_doc=class_doc)
    return problems


def _package_files() -> list[str]:
    files = (path.relative_to(ROOT).as_posix() for path in (ROOT / PACKAGE).rglob("*.py"))
    return sorted(f for f in files if not f.startswith(LEFT_OUT))


def test_the_check_finds_a_missing_section():
    source = '''
def scale(x: float, by: float = 2.0) -> float:
    """Multiply."""
    return x * by

def ready() -> bool:
    """Say so.

    Returns:
        always True.
    """
    return True

class Timer:
    """Times things."""

    def __init__(self, repeats: int):
        self.repeats = repeats

    def run(self, fn) -> float:
        """Run ``fn``.

        Args:
            fn: the function.
        """

    @property
    def mean(self) -> float:
        """The mean."""

def _private(x):
    return x
'''
    found = undocumented(source, "f.py")
    assert found == [
        "f.py:2 scale: parameters but no Args:",
        "f.py:2 scale: returns a value but no Returns:",
        "f.py:17 Timer.__init__: parameters but no Args:",
        "f.py:20 Timer.run: returns a value but no Returns:",
    ]


def test_args_in_the_class_docstring_cover_init():
    source = '''
class Timer:
    """Times things.

    Args:
        repeats: how many times.
    """

    def __init__(self, repeats: int) -> None:
        self.repeats = repeats
'''
    assert undocumented(source, "f.py") == []


def test_public_functions_of_the_package_have_args_and_returns():
    problems = [problem for rel in _package_files() if rel not in ALLOWED
                for problem in undocumented((ROOT / rel).read_text(), rel)]
    assert not problems, "\n".join(problems)
