"""A headless Chromium for the tests that look at a page in a real browser: Playwright's own where
it was downloaded, else one on the PATH (Debian's, which `.ci/run` installs). The tests
skip only when there is neither, or when the playwright package itself is missing."""
from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

ON_PATH = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


@contextmanager
def chromium() -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        try:
            browser = p.chromium.launch(args=["--no-sandbox"])
        except sync_api.Error as own:
            exe = next((found for name in ON_PATH if (found := shutil.which(name))), None)
            if exe is None:
                pytest.skip("no Chromium: neither Playwright's (python -m playwright install chromium) "
                            f"nor one on the PATH ({str(own).splitlines()[0]})")
            browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()
