"""Figures come from outputs: every measured number a chapter's prose states is printed by a cell of that chapter.

A *measured figure* is a number (``7,400``, ``1.126``, ``0.93``) followed, with at most one space, by a unit of
time, bandwidth, size, throughput, a percentage or a ratio (``µs ms s GB/s TB/s GiB MiB KiB GB MB KB bytes/token
tokens/s % × x``). Numbers in inline code and LaTeX count too; a number inside a link's target (a URL) does not.
A figure is *printed* when the same number, with or without thousands separators, appears in the text of any
output of any code cell of the same notebook (stream text, ``text/plain``, ``text/markdown``, ``text/html``).

``unprinted_figures(path)`` lists the figures of a notebook's markdown that no output prints. ``ALLOW_LIST`` holds
the few that are static facts of shapes and formulas, which may stay in prose, each with its reason (none is
needed today: a static size reads as its formula). This module reads the notebooks' JSON only: nothing is
executed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
import pytest

NOTEBOOK_DIR = Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = sorted(p.name for p in NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))

# A number: digits with optional thousands commas and decimals, not glued to a word, a dot or another number.
_NUMBER = r"(?<![\w.,])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\d])"
# The units, longest first. Alphabetic units end at a word boundary (so "5 seconds" or "3 steps" are not figures);
# a ratio sign is glued to its number and is not the "×" of a shape such as "16,384 × 4,096".
_UNIT = (r"(?:(?:GB/s|TB/s|bytes/token|tokens/s)(?![\w/])"
         r"|(?:GiB|MiB|KiB|GB|MB|KB|µs|μs|us|ms|s)(?![\w/])"
         r"|%"
         r"|(?<=\d)[×x](?!\s?\d)(?!\w))")
# A figure: one number or a range of two ("1.11–1.14×", "70-120 ms"), then an optional space or line break, a unit.
_FIGURE = re.compile(rf"(?P<num>{_NUMBER}(?:\s?[–-]\s?{_NUMBER})?)(?:[ \u00a0\u202f\n])?(?P<unit>{_UNIT})")
_NUMBER_RE = re.compile(_NUMBER)
_PLAIN_NUMBER_RE = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?![\d])")

# What is not prose: a link's target `](...)`, an HTML attribute holding an address, and bare URLs.
_LINK_TARGET = re.compile(r"\]\([^)]*\)|\b(?:href|src)\s*=\s*(?:\"[^\"]*\"|'[^']*')|<?https?://[^\s)>\]]+>?")

_OUTPUT_MIME_TYPES = ("text/plain", "text/markdown", "text/html")

# (notebook, figure as the prose writes it) -> why it may stay in prose: a fact of shapes, dtypes or formulas.
ALLOW_LIST: dict[tuple[str, str], str] = {
}


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else (value or "")


def _normalise(number: str) -> str:
    return number.replace(",", "")


def prose_figures(notebook: dict) -> list[tuple[int, str, list[str]]]:
    """Every figure of the notebook's markdown cells: (cell index, figure text, its numbers without commas)."""
    found = []
    for index, cell in enumerate(notebook.get("cells", [])):
        if cell.get("cell_type") != "markdown":
            continue
        source = _LINK_TARGET.sub(" ", _text(cell.get("source")))
        for match in _FIGURE.finditer(source):
            text = re.sub(r"\s+", " ", match.group(0))
            numbers = [_normalise(n) for n in _NUMBER_RE.findall(match.group("num"))]
            found.append((index, text, numbers))
    return found


def printed_numbers(notebook: dict) -> set[str]:
    """Every number the code cells' text outputs print, without thousands separators.

    Numbers are read both with thousands separators joined ("7,400" is 7400) and split at commas ("256,512" may be
    a list of two), so that a figure counts as printed however the output spells it.
    """
    numbers: set[str] = set()
    for cell in notebook.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        for output in cell.get("outputs", []):
            texts = [_text(output.get("text"))]
            data = output.get("data", {})
            texts += [_text(data.get(mime)) for mime in _OUTPUT_MIME_TYPES]
            for text in texts:
                numbers.update(_normalise(n) for n in _NUMBER_RE.findall(text))
                numbers.update(_PLAIN_NUMBER_RE.findall(text))
    return numbers


def unprinted_figures(notebook_path) -> list[tuple[int, str]]:
    """The figures in a notebook's markdown whose numbers no code cell's output prints: (cell index, figure text)."""
    notebook = json.loads(Path(notebook_path).read_text(encoding="utf-8"))
    printed = printed_numbers(notebook)
    return [(index, text) for index, text, numbers in prose_figures(notebook)
            if not all(n in printed for n in numbers)]


def _not_allowed(name: str, figures: list[tuple[int, str]]) -> list[tuple[int, str]]:
    return [(index, text) for index, text in figures if (name, text) not in ALLOW_LIST]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_prose_figures_are_printed(name):
    missing = _not_allowed(name, unprinted_figures(NOTEBOOK_DIR / name))
    lines = "\n".join(f"  cell {index}: {text}" for index, text in missing)
    assert not missing, (
        f"{name}: {len(missing)} figure(s) in the prose that no output of the notebook prints "
        f"(print them from a cell, or, for a static fact of shapes and formulas, add them to ALLOW_LIST):\n{lines}")


def test_notebooks_are_found():
    assert NOTEBOOKS, f"no chapter notebooks under {NOTEBOOK_DIR}"


def test_allow_list_entries_are_still_in_the_prose():
    stale = []
    for name, text in ALLOW_LIST:
        path = NOTEBOOK_DIR / name
        figures = prose_figures(json.loads(path.read_text(encoding="utf-8"))) if path.exists() else []
        if text not in {figure for _, figure, _ in figures}:
            stale.append((name, text))
    assert not stale, f"ALLOW_LIST entries whose figure is no longer in the notebook's prose: {stale}"


# The checker itself, on small synthetic notebooks.

def _write_notebook(tmp_path, markdown: list[str], outputs: list[str], mime: str | None = None) -> Path:
    """A notebook of the given markdown cells and one code cell whose outputs are the given texts."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(text) for text in markdown]
    if mime is None:
        cell_outputs = [nbformat.v4.new_output("stream", name="stdout", text=text) for text in outputs]
    else:
        cell_outputs = [nbformat.v4.new_output("execute_result", data={mime: text}, execution_count=1)
                        for text in outputs]
    nb.cells.append(nbformat.v4.new_code_cell("print(...)", outputs=cell_outputs))
    path = tmp_path / "99_synthetic.ipynb"
    nbformat.write(nb, path)
    return path


def test_a_printed_figure_passes(tmp_path):
    path = _write_notebook(tmp_path, ["The kernel took 173 µs and reached 3,912 GB/s."],
                           ["device time 173.0 µs ... 173 µs, 3912 GB/s"])
    assert unprinted_figures(path) == []


def test_a_figure_only_in_prose_is_reported(tmp_path):
    path = _write_notebook(tmp_path, ["# Title", "It ran at 7,400 tokens/s, 12% of the step."],
                           ["tokens/s 7,399"])
    assert unprinted_figures(path) == [(1, "7,400 tokens/s"), (1, "12%")]


@pytest.mark.parametrize("prose, printed", [
    ("7,400 tokens/s", "7400 tokens/s"),
    ("7400 tokens/s", "7,400 tokens/s"),
    ("1,583 KiB", "|  1583 |"),
])
def test_thousands_separators_are_optional_on_either_side(tmp_path, prose, printed):
    assert unprinted_figures(_write_notebook(tmp_path, [f"It measured {prose}."], [printed])) == []


def test_rounding_is_a_different_number(tmp_path):
    path = _write_notebook(tmp_path, ["The step was 1.126× faster, about 1.13x."], ["speed-up 1.13"])
    assert unprinted_figures(path) == [(0, "1.126×")]


def test_ratios_with_times_sign_and_x(tmp_path):
    path = _write_notebook(tmp_path, ["Ours is 1.27× and 2.3x faster; 16,384 × 4,096 is a shape, 4x4 a tile."],
                           ["nothing"])
    assert unprinted_figures(path) == [(0, "1.27×"), (0, "2.3x")]


def test_units_need_a_word_boundary(tmp_path):
    path = _write_notebook(tmp_path, ["In 3 steps of 2 sequences on H200s: 5 s, 2.5 ms, 4 us, 8 KB, 3 MiB per run."],
                           ["nothing"])
    assert unprinted_figures(path) == [(0, "5 s"), (0, "2.5 ms"), (0, "4 us"), (0, "8 KB"), (0, "3 MiB")]


def test_a_figure_in_a_url_is_ignored(tmp_path):
    markdown = ["See [the results](https://example.org/runs/12ms/1.5x?bw=90%25) and https://example.org/3GB/s, "
                "or <https://example.org/7.5ms>."]
    assert unprinted_figures(_write_notebook(tmp_path, markdown, ["nothing"])) == []


def test_inline_code_and_latex_count(tmp_path):
    path = _write_notebook(tmp_path, ["`--budget 896 MiB` and $t = 25 ms$"], ["896"])
    assert unprinted_figures(path) == [(0, "25 ms")]


def test_a_range_needs_both_ends_printed(tmp_path):
    path = _write_notebook(tmp_path, ["It gave 1.11–1.14× over runs and 70-120 ms per step."], ["1.11 1.14 70"])
    assert unprinted_figures(path) == [(0, "70-120 ms")]


def test_a_figure_broken_across_lines_is_one_figure(tmp_path):
    path = _write_notebook(tmp_path, ["RMSNorm and the loss gave 7,850\ntokens/s."], ["7,850"])
    assert unprinted_figures(path) == []


@pytest.mark.parametrize("mime", ["text/plain", "text/markdown", "text/html"])
def test_rich_outputs_count_as_printed(tmp_path, mime):
    path = _write_notebook(tmp_path, ["It used 852 MiB."], ["<td>852</td>"], mime=mime)
    assert unprinted_figures(path) == []


def test_figures_printed_only_in_markdown_are_not_printed(tmp_path):
    path = _write_notebook(tmp_path, ["It used 852 MiB.", "Again: 852 MiB."], ["851"])
    assert unprinted_figures(path) == [(0, "852 MiB"), (1, "852 MiB")]
