"""Tables that keep their names whole at any terminal width.

rich shrinks an over-wide table by narrowing its widest wrappable columns and then every column
evenly, ellipsising what no longer fits, so at 80 columns a node or layer name is the first thing
cut to a few characters. A table here names its key column (the node, layer or placement names)
and is laid out by `fit`: the key column keeps its longest name on one line, the other columns
give up their width (wrapping, or folding a word that is longer than the column), numbers keep
theirs; a table that cannot fit that way is printed as records instead (the name on a line of its
own, the other columns as `header: value` under it). Only a name longer than the whole line is
shortened, in its middle, where path-like names differ least.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

from rich.cells import cell_len
from rich.console import Group, RenderableType
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

Justify = Literal["left", "right", "center"]
NARROWEST = 6  # a wrapping column gets no narrower than this


@dataclass(frozen=True)
class Col:
    header: str
    justify: Justify = "left"
    number: bool = False  # never wrapped nor folded: a number cut in two is misread


def abbreviate(name: str, width: int) -> str:
    """`name` in at most `width` cells, its middle replaced by an ellipsis when it is longer."""
    if cell_len(name) <= width:
        return name
    if width <= 1:
        return "…"[:width]
    head = (width - 1) // 2
    tail = width - 1 - head
    return f"{name[:head]}…{name[len(name) - tail:]}"


def _natural(texts: Sequence[str]) -> int:
    return max((cell_len(line) for t in texts for line in t.splitlines() or [""]), default=0)


def _longest_word(texts: Sequence[str]) -> int:
    return max((cell_len(w) for t in texts for w in t.split()), default=0)


def _widths(columns: Sequence[Col], rows: Sequence[Sequence[str]], key: int, room: int) -> list[int] | None:
    """Content widths summing to at most `room` with the key column whole, or None if none do."""
    natural = [_natural([c.header, *(r[i] for r in rows)]) for i, c in enumerate(columns)]
    least = []
    for i, c in enumerate(columns):
        word = max(map(cell_len, c.header.split()), default=1)  # headers wrap between words, never inside one
        if i == key:
            least.append(natural[i])
        elif c.number:
            least.append(max(_natural([r[i] for r in rows]), word))
        else:
            least.append(min(natural[i], max(NARROWEST, word)))
    if sum(least) > room:
        return None
    if sum(natural) <= room:
        return natural
    widths = list(least)
    # Cheapest first, while the room allows: a column gets all its cells on one line each (its
    # header may still wrap), or at least its longest word, so that no word is folded. What is
    # left goes to every column in proportion to its shortfall.
    cells = [max(m, _natural([r[i] for r in rows])) for i, m in enumerate(least)]
    words = [max(m, _longest_word([r[i] for r in rows])) for i, m in enumerate(least)]
    goals = sorted(((g[i] - least[i], i, g[i]) for g in (cells, words) for i in range(len(least))))
    for _, i, goal in goals:
        if widths[i] < goal and sum(widths) + goal - widths[i] <= room:
            widths[i] = goal
    spare = room - sum(widths)
    want = [n - w for n, w in zip(natural, widths)]
    total = sum(want)
    widths = [w + (x * spare) // total for w, x in zip(widths, want)]
    for i in sorted(range(len(widths)), key=lambda i: -want[i]):  # the rounding's remainder to the neediest
        if sum(widths) >= room:
            break
        if widths[i] < natural[i]:
            widths[i] += 1
    return widths


def fit(title: str, columns: Sequence[Col], rows: Sequence[Sequence[str]], width: int,
        key: int = 0, title_justify: Justify = "center") -> RenderableType:
    """`rows` under `columns` in `width` cells, the names in column `key` whole (see the module)."""
    room = width - (3 * len(columns) + 1)  # a rule either side of each column and one space of padding
    widths = _widths(columns, rows, key, room)
    if widths is None:
        return _records(title, columns, rows, width, key, title_justify)
    # Every width fixed: rich then shrinks nothing, and wraps (or folds) only within a column.
    t = Table(title=title, title_justify=title_justify)
    for i, (c, w) in enumerate(zip(columns, widths)):
        t.add_column(c.header, justify=c.justify, width=w, no_wrap=i == key, overflow="fold")
    for r in rows:
        t.add_row(*r)
    return t


def _records(title: str, columns: Sequence[Col], rows: Sequence[Sequence[str]], width: int,
             key: int, title_justify: Justify) -> RenderableType:
    parts: list[RenderableType] = [Text(title, style="italic", justify=title_justify)]
    for r in rows:
        parts.append(Text(abbreviate(r[key], width), style="bold"))
        detail = "; ".join(f"{c.header}: {' '.join(r[i].split())}" for i, c in enumerate(columns)
                           if i != key and r[i].strip())
        parts.append(Padding(Text(detail), (0, 0, 0, 2)))
    return Group(*parts)


__all__ = ["Col", "abbreviate", "fit"]
