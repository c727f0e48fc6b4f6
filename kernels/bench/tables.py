"""Result tables that read at a laptop's width: HTML where a notebook shows them, aligned text in a terminal.

``html_table(columns, rows)`` returns a ``Table``. In a notebook, ``display(table)`` (or a table as
a cell's last value) renders it as an HTML table, which the browser lays out in the width it has;
``print(table)`` and the command lines write the same table as aligned text. A row may be a
``Section``: a heading that spans the columns, so that a column repeated on every row (a shape, a
pass) can be said once above its rows instead.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# A cell that reads as a number, possibly with a unit or a sign after it ("1.083×", "6,517",
# "-7.6%", "+0.00 GiB", "9.56e-03"): such columns are right-aligned so that their digits line up.
_NUMBER = re.compile(r"^[-+−]?[\d.,]+(e[-+]?\d+)?")
EMPTY = "—"


@dataclass(frozen=True)
class Section:
    """A heading row that spans every column of a ``Table``."""

    title: str


@dataclass(frozen=True)
class Table:
    """A table of strings with its column alignment, a caption above it and notes below it.

    Build one with ``html_table``. ``_repr_html_`` is what a notebook shows; ``str()`` is the text
    form.
    """

    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...] | Section, ...]
    align: str
    caption: str | None = None
    notes: tuple[str, ...] = ()

    def _repr_html_(self) -> str:
        def cell(tag: str, text: str, a: str) -> str:
            side = "left" if a == "l" else "right"
            return f'<{tag} style="text-align:{side}; white-space:nowrap">{html.escape(text)}</{tag}>'

        out = ["<div>", "<table>"]
        if self.caption:
            out.append(f'<caption style="text-align:left">{html.escape(self.caption)}</caption>')
        # Headers may wrap (they are words); cells may not (a number split over two lines misreads).
        head = "".join(
            f'<th style="text-align:{"left" if a == "l" else "right"}">{html.escape(c)}</th>'
            for c, a in zip(self.columns, self.align)
        )
        out += ["<thead>", f"<tr>{head}</tr>", "</thead>", "<tbody>"]
        for row in self.rows:
            if isinstance(row, Section):
                out.append(f'<tr><th colspan="{len(self.columns)}" style="text-align:left">'
                           f"{html.escape(row.title)}</th></tr>")
            else:
                out.append("<tr>" + "".join(cell("td", c, a) for c, a in zip(row, self.align)) + "</tr>")
        out += ["</tbody>", "</table>"]
        out += [f'<p style="font-size:smaller; margin:0.2em 0">{html.escape(n)}</p>' for n in self.notes]
        out.append("</div>")
        return "\n".join(out)

    def text(self) -> str:
        """The table as aligned text, one line per row, for a terminal or a log.

        Returns:
            the text, caption first and notes last.
        """
        cells = [r for r in self.rows if not isinstance(r, Section)]
        widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(self.columns)]

        def line(values: Sequence[str]) -> str:
            return "  ".join(v.ljust(w) if a == "l" else v.rjust(w)
                             for v, w, a in zip(values, widths, self.align)).rstrip()

        head = line(self.columns)
        lines = [self.caption] if self.caption else []
        lines += [head, "-" * len(head)]
        lines += [row.title if isinstance(row, Section) else line(row) for row in self.rows]
        lines += list(self.notes)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()

    # IPython puts repr() in the text/plain fallback of a displayed table: the text form, not the
    # dataclass.
    __repr__ = __str__


def html_table(
    columns: Sequence[str],
    rows: Iterable[Sequence[object] | Section],
    *,
    align: str | None = None,
    caption: str | None = None,
    notes: Sequence[str] = (),
) -> Table:
    """A ``Table`` of ``rows`` under ``columns``, shown as HTML in a notebook and as text by ``print``.

    Args:
        columns: the column headings.
        rows: one sequence of cells per row, as many as ``columns``, or a ``Section`` heading. A
            cell is shown as ``str(cell)``; ``None`` is shown as an em dash. Format numbers before
            passing them (``f"{x:,.1f}"``).
        align: one letter per column, ``"l"`` or ``"r"``. By default a column whose cells all read
            as numbers (units after them allowed) is right-aligned and any other left-aligned.
        caption: a line above the table.
        notes: lines below it, e.g. what a column means.

    Returns:
        The ``Table``; ``display`` it in a notebook, ``print`` it in a terminal.
    """
    columns = tuple(str(c) for c in columns)
    body: list[tuple[str, ...] | Section] = []
    for i, row in enumerate(rows):
        if isinstance(row, Section):
            body.append(row)
            continue
        values = tuple(EMPTY if v is None else str(v) for v in row)
        if len(values) != len(columns):
            raise ValueError(f"row {i} has {len(values)} cells, expected {len(columns)} (one per column): {values}")
        body.append(values)
    if align is None:
        align = "".join(_auto_align([r[i] for r in body if not isinstance(r,
                                                                          Section)]) for i in range(len(columns)))
    elif len(align) != len(columns) or set(align) - {"l", "r"}:
        raise ValueError(f"align must be one letter 'l' or 'r' per column ({len(columns)}), got {align!r}")
    return Table(columns, tuple(body), align, caption, tuple(str(n) for n in notes))


def _auto_align(cells: list[str]) -> str:
    filled = [c for c in cells if c not in ("", EMPTY)]
    return "r" if filled and all(_NUMBER.match(c) for c in filled) else "l"
