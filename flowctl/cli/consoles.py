"""Where the CLI writes, as git, kubectl and pip do: a command's result (its tables, its summary
line, its JSON) on stdout, so that `flowctl inspect x.yaml | less` or `> file` gets it; progress,
per-step lines, warnings and errors on stderr, so that they reach the person without mixing into
the result.

With `--json` the JSON is the result: the tables a person reads then go to stderr, and stdout is
one JSON document. Piped or redirected, rich writes no colour codes, and takes its width from a
terminal on any standard stream (`| less` gets the terminal's), or COLUMNS, else 80; the tables
keep their names whole at any width (tables.py).
"""
from __future__ import annotations

from typing import Any

from rich.console import Console


def result(as_json: bool = False, **options: Any) -> Console:
    """The console for what the command answers: stdout, or stderr beside `--json` on stdout."""
    return Console(stderr=as_json, **options)


def progress(**options: Any) -> Console:
    """The console for how the work goes: progress bars, step lines, warnings (stderr)."""
    return Console(stderr=True, **options)


__all__ = ["progress", "result"]
