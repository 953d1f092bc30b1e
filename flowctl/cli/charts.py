"""Two runs' curves drawn for `flowctl runs compare`: a text chart for the terminal (no dependency)
and a PNG through matplotlib (the `plot` extra, imported only when a PNG is asked for)."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from flowctl.engine.errors import SpecError

NEEDS = "--png needs matplotlib: pip install 'flowctl[plot]'"
MARKS = ("*", "o")  # A, B; where both fall on one cell: '@'


def _label(x: float) -> str:
    return f"{x:.4g}"


def text_chart(title: str, series: Sequence[tuple[str, Sequence[tuple[int, float]]]], width: int = 64,
               height: int = 12) -> str:
    """`series` ((name, (step, value) points), at most two) on one grid: a column per span of steps
    holds each series' mean value there, so a long run reads as a line."""
    points = [p for _, pts in series for p in pts]
    if not points:
        return f"{title}: no values"
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    span_x, span_y = max(x1 - x0, 1), (y1 - y0) or 1.0
    grid = [[" "] * width for _ in range(height)]
    for mark, (_, pts) in zip(MARKS, series):
        columns: dict[int, list[float]] = {}
        for step, value in pts:
            columns.setdefault(round((step - x0) / span_x * (width - 1)), []).append(value)
        for col, values in columns.items():
            mean = sum(values) / len(values)
            row = height - 1 - round((mean - y0) / span_y * (height - 1))
            grid[row][col] = mark if grid[row][col] in (" ", mark) else "@"
    top, bottom = _label(y1), _label(y0)
    pad = max(len(top), len(bottom))
    lines = [f"{title}: " + "   ".join(f"{m} {name}" for m, (name, _) in zip(MARKS, series))]
    for i, row in enumerate(grid):
        label = top if i == 0 else bottom if i == height - 1 else ""
        lines.append(f"{label:>{pad}} │{''.join(row).rstrip()}")
    lines.append(" " * pad + " └" + "─" * width)
    left, right = str(x0), str(x1)
    lines.append(" " * (pad + 2) + left + " " * max(1, width - len(left) - len(right)) + right + "  step")
    return "\n".join(lines)


def write_png(path: Path, curves: dict[str, dict[str, list[tuple[int, float]]]]) -> Path:
    """One panel per metric, both runs' curves in each, by step."""
    try:
        import matplotlib
    except ImportError:
        raise SpecError(NEEDS) from None
    matplotlib.use("Agg")  # files only: no display is needed, nor opened
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(curves) or 1, 1, figsize=(8, 3.2 * max(len(curves), 1)), squeeze=False)
    for ax, (metric, runs) in zip(axes[:, 0], curves.items()):
        for name, pts in runs.items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, marker="." if len(pts) < 40 else None)
        ax.set_title(metric)
        ax.set_xlabel("step")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


__all__ = ["NEEDS", "text_chart", "write_png"]
