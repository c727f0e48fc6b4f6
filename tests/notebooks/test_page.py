"""The page a learner opens: the README and chapter 00 describe every chapter there is, every link of the chapters
and docs resolves from where the README starts JupyterLab, committed outputs show no progress bar frozen at its
first state, and the tables the notebooks display read at a laptop's width."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kernels.bench import sweep
from kernels.bench.results import format_table, load_results
from kernels.bench.tables import Section, html_table

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
NUMBER_WORDS = {15: "Fifteen", 16: "Sixteen", 17: "Seventeen", 18: "Eighteen", 19: "Nineteen", 20: "Twenty"}
# A markdown link's target; inline code and fenced blocks are removed first (`kernel[grid](args)` is no link).
LINK = re.compile(r"\]\(([^()\s]+)\)")
# tqdm's text form: "desc:   0%|          | 0/30 [00:00<?, ?it/s]".
FROZEN_BAR = re.compile(r"(^|\s)0%\|")


def cells(path: Path, kind: str) -> list[dict]:
    return [c for c in json.loads(path.read_text(encoding="utf-8"))["cells"] if c["cell_type"] == kind]


def prose(path: Path) -> str:
    """The markdown of a chapter or a document, without fenced blocks and inline code."""
    if path.suffix == ".ipynb":
        text = "\n\n".join("".join(c["source"]) for c in cells(path, "markdown"))
    else:
        text = path.read_text(encoding="utf-8")
    text = re.sub(r"(?ms)^```.*?^```", "", text)
    return re.sub(r"`[^`\n]*`", "``", text)


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation and backticks dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file or a notebook's markdown cells (a repeated heading gets -1, -2, ...)."""
    text = "\n\n".join("".join(c["source"]) for c in cells(path, "markdown")) if path.suffix == ".ipynb" \
        else path.read_text(encoding="utf-8")
    text = re.sub(r"(?ms)^```.*?^```", "", text)
    found, seen = set(), {}
    for heading in re.findall(r"(?m)^#{1,6} +(.+?)\s*#*$", text):
        slug = github_anchor(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def route_table(text: str) -> list[str]:
    """The chapter numbers of a markdown table's rows, in order (the first cell names the chapter)."""
    return re.findall(r"(?m)^\| *(?:\*\*)?`?(\d\d)[ _]", text)


def test_the_readme_counts_and_lists_every_chapter():
    numbers = [p.stem[:2] for p in CHAPTERS]
    assert numbers == [f"{i:02d}" for i in range(len(CHAPTERS))], "chapters are numbered 00, 01, ... without gaps"
    text = README.read_text(encoding="utf-8")
    word = NUMBER_WORDS[len(CHAPTERS)]
    assert text.startswith("# ") and f"{word} Jupyter chapters (00–{numbers[-1]})" in text, \
        f"the README's first paragraph should say '{word} Jupyter chapters (00–{numbers[-1]})'"
    listed = re.findall(r"(?m)^\| `(\d\d_\w+)`", text)
    assert listed == [p.stem for p in CHAPTERS], "the README's route should list every notebook once, in order"
    intro = text.split("\n\n")[1]
    for n in numbers[9:]:
        assert f"({int(n)})" in intro or f"({n})" in intro, f"the README's first paragraph leaves out chapter {n}"


def test_chapter_00s_route_lists_every_chapter():
    setup = next(p for p in CHAPTERS if p.stem.startswith("00_"))
    text = "\n".join("".join(c["source"]) for c in cells(setup, "markdown"))
    assert route_table(text) == [p.stem[:2] for p in CHAPTERS]


def test_the_readme_starts_jupyterlab_where_the_links_resolve():
    """Given a folder or a notebook under notebooks/, JupyterLab serves from there: ../docs links answer 404."""
    text = README.read_text(encoding="utf-8")
    commands = [line for block in re.findall(r"(?ms)^```bash\n(.*?)^```", text)
                for line in block.splitlines() if line.startswith("jupyter lab")]
    assert commands, "the README should say how to start JupyterLab"
    for line in commands:
        args = line.split("#")[0]
        assert "notebooks/" not in args or "--notebook-dir=." in args, f"{line!r} serves from notebooks/"
    assert "--allow-root" in text, "the README should say what root needs"


def test_the_readme_tree_names_every_module_and_wing():
    tree = re.search(r"(?ms)^```\nkernels/ .*?^```", README.read_text(encoding="utf-8")).group(0)
    names = [p.name for p in (ROOT / "kernels").glob("*.py") if p.name != "__init__.py"]
    names += [p.name + "/" for p in (ROOT / "kernels").iterdir() if (p / "__init__.py").exists()]
    missing = sorted(n for n in names if not re.search(rf"(?<![\w/]){re.escape(n)}", tree))
    assert not missing, f"the README's tree of kernels/ leaves out {missing}"


@pytest.mark.parametrize("path", CHAPTERS + DOCS, ids=lambda p: p.name)
def test_every_relative_link_resolves(path):
    """Links are relative to the file, as JupyterLab started in the repository's root serves them (and GitHub)."""
    broken = []
    for target in LINK.findall(prose(path)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue
        file, _, fragment = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists() or ROOT not in (dest, *dest.parents):
            broken.append(f"{target}: no such file in the repository")
        elif fragment and dest.suffix in (".md", ".ipynb") and fragment not in anchors(dest):
            broken.append(f"{target}: {dest.name} has no heading with that anchor")
    assert not broken, f"{path.name}: " + "; ".join(broken)


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_no_committed_output_is_a_frozen_progress_bar(path):
    frozen = []
    for i, cell in enumerate(cells(path, "code")):
        for out in cell.get("outputs", []):
            text = "".join(out.get("text", "")) + "".join(out.get("data", {}).get("text/plain", ""))
            if FROZEN_BAR.search(text) or ("application/vnd.jupyter.widget-view+json" in out.get("data", {})
                                           and re.search(r"\d+%\|", text)):
                frozen.append(f"code cell {i}: {text.strip()[:60]!r}")
    assert not frozen, f"{path.name}: progress bars saved in their first state: {frozen}"


def test_html_table_escapes_aligns_and_keeps_a_text_form():
    table = html_table(["implementation", "ms", "speed-up"],
                       [Section("512×4096, fwd"), ["ours <fused>", "0.013", "1.00×"], ["peer", "1,204.5", None]],
                       caption="a caption", notes=["a note"])
    page = table._repr_html_()
    assert "ours &lt;fused&gt;" in page and "<fused>" not in page
    assert table.align == "lrr" and '<th colspan="3"' in page and "a note" in page
    text = str(table)
    assert repr(table) == text and text.splitlines()[0] == "a caption" and "—" in text
    with pytest.raises(ValueError, match="row 1 has 2 cells, expected 3"):
        html_table(["a", "b", "c"], [["1", "2", "3"], ["1", "2"]])
    with pytest.raises(ValueError, match="align"):
        html_table(["a", "b"], [["1", "2"]], align="lx")


def test_the_sweep_table_has_every_row_and_is_narrower_than_the_text_table():
    results = load_results("rmsnorm")
    if results is None:
        pytest.skip("no committed rmsnorm results")
    table = sweep.results_table(results)
    body = [r for r in table.rows if not isinstance(r, Section)]
    assert len(body) == len(results["rows"])
    assert {r[0] for r in body} == {r["label"] for r in results["rows"]}
    width = max(len(line) for line in str(table).splitlines()[:-3])
    assert width < max(len(line) for line in format_table(results).splitlines()[:-2])
    assert width <= 120


def test_a_progress_bar_is_saved_as_its_final_line_by_a_headless_run():
    """What nbmake or nbconvert executes and saves: the bar's last state as text, no widget left at 0%."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipywidgets")
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                           "language": "python"}})
    nb.cells = [nbformat.v4.new_code_cell(
        "from kernels.bench.progress import progress_bar\n"
        "for _ in progress_bar(range(4), desc='steps'):\n    pass\n"
        "bar = progress_bar(total=3, desc='by hand')\nbar.update(2)\nbar.close()\n"
        "for _ in progress_bar(range(2), desc='gone', leave=False):\n    pass")]
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    outputs = nb.cells[0].outputs
    assert all(set(o["data"]) == {"text/plain"} for o in outputs)
    texts = [o["data"]["text/plain"] for o in outputs]
    assert texts[0].startswith("steps: 100%|") and "4/4" in texts[0]
    assert texts[1].startswith("by hand:  67%|") and "2/3" in texts[1]
    assert texts[2] == ""


def test_a_progress_bar_in_a_terminal_is_tqdm():
    from tqdm.std import tqdm

    from kernels.bench.progress import progress_bar

    bar = progress_bar(range(2), disable=True)
    assert isinstance(bar, tqdm) and list(bar) == [0, 1]
