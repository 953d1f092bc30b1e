"""Golden error cases: each broken spec in tests/cases/ must fail `flowctl validate` with exit code
2, a `file:line:col` and the expected message (by substring), and never a traceback.

A case's header comments say what to expect: `# expect-at: LINE:COL` and one or more
`# expect: TEXT` (`{file}` stands for the case's path)."""
from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from flowctl.cli.main import cli

CASES = sorted((Path(__file__).parent / "cases").glob("*.yaml"))


def _expectations(path: Path) -> tuple[str, list[str]]:
    at, texts = "", []
    for line in path.read_text().splitlines():
        if line.startswith("# expect-at:"):
            at = line.split(":", 1)[1].strip()
        elif line.startswith("# expect:"):
            texts.append(line.split(":", 1)[1].strip().replace("{file}", str(path)))
    return at, texts


def test_there_are_enough_cases():
    assert len(CASES) >= 15


@pytest.mark.parametrize("case", CASES, ids=[c.stem for c in CASES])
def test_golden_error_case(case: Path):
    at, texts = _expectations(case)
    assert at and texts, f"{case.name} has no expectations"
    result = CliRunner().invoke(cli, ["validate", "--no-build", str(case)])
    out = result.output
    assert result.exit_code == 2, out
    assert "Traceback" not in out, out
    assert isinstance(result.exception, SystemExit), result.exception  # a clean exit, not a crash
    assert f"{case}:{at}:" in out, out
    for text in texts:
        assert text in out, out
