"""The browser tests' fixtures: one Prefect server with ``pbrl serve`` for the session, one Chromium per module
(:mod:`tests.browser.ui_kit`)."""

from __future__ import annotations

import pytest

from tests.browser.ui_kit import chromium_browser, serve_ui


@pytest.fixture(scope="session")
def ui(tmp_path_factory: pytest.TempPathFactory):
    """``prefect server start`` and ``pbrl serve`` for the browser tests, one for the session
    (:func:`tests.browser.ui_kit.serve_ui`)."""
    yield from serve_ui(tmp_path_factory)


@pytest.fixture(scope="module")
def browser():
    """Debian's Chromium for the browser tests, one per test module (:func:`tests.browser.ui_kit.chromium_browser`).

    Not one for the session: Playwright's sync API keeps an asyncio loop running in the main thread while it is
    open, and Prefect's sync-or-async calls (``State.result()``, clients) return coroutines beside a running loop,
    so the modules after the browser's failed with "'coroutine' object is not subscriptable"."""
    yield from chromium_browser()
