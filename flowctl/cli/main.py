"""The console script's entry point (`flowctl = flowctl.cli.main:main`). It imports nothing heavy
at module level: the commands, and with them click, rich, numpy and the engine (about half a second
of importing), load inside `main`, so a Ctrl-C that comes while they load exits 130 quietly, as
one during a command does, instead of printing a KeyboardInterrupt traceback."""
from __future__ import annotations

import sys
from typing import Any

INTERRUPTED = 130  # 128 + SIGINT, the shell's convention (the group's documented exit code)


def main() -> None:
    try:
        from flowctl.cli.commands import cli
    except KeyboardInterrupt:
        sys.exit(INTERRUPTED)
    cli()


def __getattr__(name: str) -> Any:
    if name == "cli":  # `from flowctl.cli.main import cli`: the group, loaded on first use
        from flowctl.cli.commands import cli

        return cli
    raise AttributeError(f"module 'flowctl.cli.main' has no attribute '{name}'")


if __name__ == "__main__":
    main()
