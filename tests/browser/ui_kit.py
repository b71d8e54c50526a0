"""A Prefect UI in a real browser for the browser tests (``tests/browser/test_*.py``): ``prefect server start`` and
``pbrl serve`` (with a nightly deployment) on a free loopback port, Debian's Chromium driven by Playwright's Python
API (nothing is downloaded), and what a person does there: open a form in either UI, fill it in, submit it, open
a run. ``tests/browser/conftest.py`` makes the server and the browser fixtures (``ui``, ``browser``), so every
browser test file shares one of each. Screenshots go to ``tests/artifacts/ui/``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
CHROMIUM = Path("/usr/bin/chromium")
SHOTS = ROOT / "tests" / "artifacts" / "ui"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
DEPLOYMENTS = {"madpo", "madpo-iter", "marlhf", "marlhf-iter", "config-file", "continue", "train", "nightly"}
NIGHTLY_RUN = "ui-v1-run"  # the run the nightly deployment extends (tests/browser/test_ui_runs.py makes it)
FIRST_SCREEN = {"width": 1280, "height": 800}
FINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
STAGES = ("sample-candidates", "score-with-oracle", "build-pairs", "store-round", "replay-select", "update-policies")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in reversed(procs):
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for proc in reversed(procs):
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def serve_ui(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """A Prefect server on a free loopback port and ``pbrl serve --nightly-run NIGHTLY_RUN`` against it (working
    folder: a temporary folder, so runs land in its ``storage/runs``). Yields ``{"url", "api", "ids", "cwd"}``."""
    import httpx

    cwd = tmp_path_factory.mktemp("ui")
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(
        PREFECT_HOME=str(cwd / "prefect-home"),
        PBRL_STORAGE=str(cwd / "storage"),
        PYTHONPATH=str(ROOT),
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        PREFECT_UI_API_URL=api,
        PREFECT_RUNNER_POLL_FREQUENCY="1",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_LOGGING_LEVEL="INFO",
        # the log goes to the server every 0.25 s instead of 2 s: a tiny round takes about 2 s, and the progress
        # test checks that a round's lines arrived before the run ended
        PREFECT_LOGGING_TO_API_BATCH_INTERVAL="0.25",
        DO_NOT_TRACK="1",
    )
    procs = [
        subprocess.Popen(
            [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            cwd=cwd,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    ]
    try:
        deadline = time.monotonic() + 240
        while not _healthy(httpx, api):
            if time.monotonic() > deadline:
                pytest.fail("prefect server did not start")
            time.sleep(1)
        log = open(cwd / "serve.log", "w")  # noqa: SIM115 (closed with the process)
        procs.append(
            subprocess.Popen(
                [str(BIN / "pbrl"), "serve", "--nightly-run", NIGHTLY_RUN],
                cwd=cwd,
                env={**env, "PREFECT_API_URL": api},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        ids: dict[str, str] = {}
        while set(ids) < DEPLOYMENTS:
            if time.monotonic() > deadline:
                pytest.fail(f"pbrl serve registered only {sorted(ids)}: {(cwd / 'serve.log').read_text()[-2000:]}")
            time.sleep(1)
            ids = {d["name"]: d["id"] for d in httpx.post(f"{api}/deployments/filter", json={}, timeout=10).json()}
        yield {"url": f"http://127.0.0.1:{port}", "api": api, "ids": ids, "cwd": cwd}
    finally:
        _stop(procs)


def _healthy(httpx, api: str) -> bool:
    try:
        return httpx.get(f"{api}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


NO_CHROMIUM = (
    "the browser tests need Debian's Chromium at /usr/bin/chromium: `sudo apt-get install -y chromium` (`make test` "
    "installs it where it may: as root with apt-get; .ci/run too)"
)


def chromium_browser() -> Iterator[Any]:
    """Debian's Chromium, headless, launched by Playwright. A missing Chromium or playwright package fails the
    browser tests (never a silent skip): ``make test`` installs both."""
    if not CHROMIUM.is_file():
        pytest.fail(NO_CHROMIUM)
    try:
        from playwright import sync_api
    except ImportError:
        pytest.fail("the browser tests need the playwright Python package: `pip install -e '.[dev]'` (make install)")
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


# ------------------------------------------------------------------------------------------------ helpers
def new_page(browser, ui: dict, height: int = 1000):
    """A page that reaches only the Prefect server (the UI's links to fonts and prefect.io are refused)."""
    page = browser.new_page(viewport={"width": FIRST_SCREEN["width"], "height": height})
    page.set_default_timeout(90_000)
    page.route(
        "**/*", lambda route: route.continue_() if route.request.url.startswith((ui["url"], "data:")) else route.abort()
    )
    return page


def open_form(browser, ui: dict, deployment: str, height: int = FIRST_SCREEN["height"]):
    page = new_page(browser, ui, height)
    page.goto(f"{ui['url']}/v2/deployments/deployment/{ui['ids'][deployment]}/run")
    page.get_by_role("heading", name="Parameters").wait_for()
    return page


def shot(page, name: str, full: bool = False) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=full)


def field(page, label: str):
    """The block of one form field (its label, description and input): the outermost one labelled so."""
    return page.locator("div.group").filter(has=page.get_by_text(label, exact=True)).first


def choose(page, label: str, choice: str, value: str) -> None:
    """Pick ``value`` in the drop-down of the tab ``choice`` of field ``label`` (task: registered, agent_model:
    packaged)."""
    field(page, label).get_by_role("button", name=f"Select {choice}").click()
    page.get_by_role("option", name=value, exact=True).click()


def change(page, section: str) -> None:
    """Open a section of the form (its ``change`` tab) to set its options."""
    field(page, f"{section} (Optional)").get_by_role("tab", name="change").click()


def select(page, option: str, value: str) -> None:
    page.get_by_role("button", name=f"Select {option}").click()
    page.get_by_role("option", name=value, exact=True).click()


def submit(page) -> str:
    """Submit the form; the new flow run's id. A server too busy to answer (503, on a loaded machine) is asked
    again, as a person would click again."""
    for _ in range(3):
        with page.expect_response(lambda r: r.url.endswith("/create_flow_run")) as created:
            page.get_by_role("button", name="Submit").click()
        if created.value.status != 503:
            break
        time.sleep(2)
    assert created.value.status == 201, created.value.text()
    return created.value.json()["id"]


def run_name(page, name: str) -> None:
    page.get_by_label("Run Name").fill(name)


def flow_run(ui: dict, run_id: str) -> dict:
    import httpx

    return httpx.get(f"{ui['api']}/flow_runs/{run_id}", timeout=10).json()


def wait(ui: dict, run_id: str, states=FINAL, timeout: float = 600) -> dict:
    deadline = time.monotonic() + timeout
    while (run := flow_run(ui, run_id))["state_type"] not in states:
        assert time.monotonic() < deadline, f"flow run {run['name']} still {run['state_type']}"
        time.sleep(1)
    return run


def completed(ui: dict, run_id: str) -> dict:
    run = wait(ui, run_id)
    assert run["state_type"] == "COMPLETED", (run["state"]["message"], (ui["cwd"] / "serve.log").read_text()[-3000:])
    return run


def flow_run_logs(ui: dict, run_id: str) -> list[dict]:
    """The flow run's log lines, oldest first."""
    import httpx

    body = {"logs": {"flow_run_id": {"any_": [run_id]}}, "sort": "TIMESTAMP_ASC", "limit": 200}
    out: list[dict] = []
    while page := httpx.post(f"{ui['api']}/logs/filter", json={**body, "offset": len(out)}, timeout=10).json():
        out += page
    return out


def create_run(ui: dict, deployment: str, name: str, parameters: dict) -> str:
    """A flow run of ``deployment`` as the API (or a Quick run) creates one; its id."""
    import httpx

    url = f"{ui['api']}/deployments/{ui['ids'][deployment]}/create_flow_run"
    for _ in range(3):  # a server too busy to answer (503) is asked again
        response = httpx.post(url, json={"name": name, "parameters": parameters}, timeout=10)
        if response.status_code != 503:
            break
        time.sleep(2)
    assert response.status_code == 201, response.text
    return response.json()["id"]


def run_page(browser, ui: dict, run_id: str, height: int = 1000):
    page = new_page(browser, ui, height)
    page.goto(f"{ui['url']}/v2/runs/flow-run/{run_id}")
    page.get_by_role("tab", name="Logs").wait_for()
    return page


# ------------------------------------------------------------------------------------------------ the V1 UI
# Prefect serves its earlier UI (V1) beside V2: at every path but "/" and /v2/..., so the links that `pbrl serve` and
# Prefect's "View at ..." print open V1. Its fields are `.schema-form-property` blocks; tabs are buttons.
def open_v1_form(browser, ui: dict, deployment: str, height: int = 1000):
    page = new_page(browser, ui, height)
    page.goto(f"{ui['url']}/deployments/deployment/{ui['ids'][deployment]}/run")
    page.get_by_role("button", name="Submit").wait_for()
    return page


def v1_field(page, label: str):
    """The innermost V1 form block labelled ``label`` (its description, tabs and input)."""
    return page.locator(".schema-form-property").filter(has=page.get_by_text(label, exact=True)).last


def v1_fill(page, label: str, value: str) -> None:
    v1_field(page, label).locator("input, textarea").first.fill(value)


def v1_run_page(browser, ui: dict, run_id: str, height: int = 1000):
    page = new_page(browser, ui, height)
    page.goto(f"{ui['url']}/runs/flow-run/{run_id}")
    page.get_by_text("Logs", exact=True).first.wait_for()
    return page
