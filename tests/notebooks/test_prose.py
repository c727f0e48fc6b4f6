"""The package's prose keeps measurements out and lines short (the rule for code prose).

Measured figures (timings, bandwidths, "measured on an H200: ...") live in ``assets/notes/`` beside the
result files they come from; a docstring or comment gives the reasoning and points there. Lines wrap at
about 100 characters, and at most ``MAX_LONG_SHARE`` of the package's lines reach ``LONG``.

Reads the source only: no kernel is imported or run.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kernels"
LONG = 110
MAX_LONG_SHARE = 0.03
POINTER = "assets/notes/"

# A number with a unit of time or rate, or "measured" with a place or a figure after it.
FIGURE = re.compile(
    r"\d[\d,.]*\s*(?:k?tok(?:en)?s/s|ms|µs|us|GB/s|TB/s)(?![\w/])"
    r"|\b[Mm]easured (?:on|at) (?:an? |two |\d|H\d|[A-Z]\d)"
    r"|\b[Mm]easured\b[^.;]*?\d[\d,.]*\s*(?:%|×|ms|µs|s\b|GiB|MiB)"
)

# The exercises (checks and solutions) count in the long-line share like the rest of the package. The
# figures check leaves them out: the one line it flags there is a unit conversion in a solution's comment
# ("a second is 1e6 µs"), not a measurement, and the pattern cannot tell the two apart.
EXERCISES = "kernels/exercises/"


def _files(exercises: bool = True) -> list[Path]:
    files = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not exercises and rel.startswith(EXERCISES):
            continue
        files.append(path)
    return files


def prose_lines(source: str) -> dict[int, str]:
    """Line number -> the comment or string-statement (docstring) text on that line."""
    lines = source.splitlines()
    found: dict[int, list[str]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            found.setdefault(tok.start[0], []).append(tok.string)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            for number in range(node.lineno, node.end_lineno + 1):
                found.setdefault(number, []).append(lines[number - 1])
    return {number: " ".join(parts) for number, parts in found.items()}


def figures(path: Path) -> list[str]:
    """``file:line: text`` of each prose line that carries a measured figure without a pointer."""
    rel = path.relative_to(ROOT).as_posix()
    return [f"{rel}:{number}: {text.strip()[:120]}"
            for number, text in sorted(prose_lines(path.read_text()).items())
            if FIGURE.search(text) and POINTER not in text]


def test_the_pattern_finds_figures():
    assert FIGURE.search("# 1.32 against 1.58 ms for the backward")
    assert FIGURE.search("reaches 4.1 TB/s counted as 6 bytes per logit")
    assert FIGURE.search("Measured on an H200 host")
    assert FIGURE.search("measured: 3 stages reach 88% of the copy bandwidth")
    assert not FIGURE.search("at the measured copy bandwidth")
    assert not FIGURE.search("32 layers × 2 bytes × seq²")


def test_no_measured_figures_in_code_prose():
    found = [line for path in _files(exercises=False) for line in figures(path)]
    assert not found, "measured figures belong in assets/notes/ (the code points there):\n" + "\n".join(found)


def test_long_lines_are_rare():
    total = long = 0
    offenders = []
    for path in _files():
        lines = path.read_text().splitlines()
        total += len(lines)
        n = sum(len(line) >= LONG for line in lines)
        long += n
        if n:
            offenders.append((n, path.relative_to(ROOT).as_posix()))
    share = long / total
    worst = ", ".join(f"{name} {n}" for n, name in sorted(offenders, reverse=True)[:5])
    assert share <= MAX_LONG_SHARE, f"{long} of {total} lines ≥ {LONG} characters ({share:.1%}); most in {worst}"
