"""The Prefect UI forms in a real browser (issue #13): Debian's Chromium, headless, driven by Playwright's
Python API (nothing is downloaded), against ``prefect server start`` and ``pbrl serve`` started here.

Each deployment's run form (Prefect's default UI, V2) must show the trainer's options as fields, labelled
with their group and name and described; a run submitted from the madpo-iter form (tiny model, toy task)
must complete, with its round artifacts keyed by its run name. Screenshots go to ``tests/artifacts/ui/``.
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

import pytest

ROOT = Path(__file__).resolve().parents[1]
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
DEPLOYMENTS = {"madpo", "madpo-iter", "marlhf", "marlhf-iter", "config-file", "train"}

pytestmark = [
    pytest.mark.flow,
    pytest.mark.skipif(
        not CHROMIUM.is_file(), reason="needs Debian's Chromium at /usr/bin/chromium (apt-get install -y chromium)"
    ),
]


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


@pytest.fixture(scope="module")
def ui(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """A Prefect server on a free loopback port and ``pbrl serve`` against it (working folder: a temporary
    folder, so runs land in its ``storage/runs``). Yields ``{"url", "api", "ids", "cwd"}``."""
    httpx = pytest.importorskip("httpx")
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
                [str(BIN / "pbrl"), "serve"],
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


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip(
        "playwright.sync_api",
        reason="needs the playwright Python package (pip install playwright; the browser is Debian's chromium)",
    )
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def _page(browser, ui: dict, height: int):
    """A page that reaches only the Prefect server (the UI's links to fonts and prefect.io are refused)."""
    page = browser.new_page(viewport={"width": 1280, "height": height})
    page.set_default_timeout(90_000)
    page.route(
        "**/*", lambda route: route.continue_() if route.request.url.startswith((ui["url"], "data:")) else route.abort()
    )
    return page


def _open_form(browser, ui: dict, deployment: str):
    page = _page(browser, ui, height=1400)
    page.goto(f"{ui['url']}/v2/deployments/deployment/{ui['ids'][deployment]}/run")
    page.get_by_role("heading", name="Parameters").wait_for()
    return page


def _shot(page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=name.endswith("-full"))


# (label, description) pairs each form must show; labels are "<group>: <option>", "(Optional)" when defaulted.
NUM_ITERATIONS = ("training: num_iterations (Optional)", "Rounds of collect -> store -> replay -> learn.")
REPLAY_MODE = (
    "replay: preference_replay_mode (Optional)",
    "Which stored rounds' pairs train a round: 'current' "
    "(this round's only), 'nearest_k' (last k non-empty rounds), 'all_history', or 'lambda_decay' "
    "(weights λ^age).",
)
DPO_BETA = (
    "training: dpo_beta (Optional)",
    "MADPO inverse temperature η in the loss -log σ(η Δ) on the joint "
    "log-prob margin Δ. Accepted but unused by MARLHF, as in the reference.",
)
RL_ALGORITHM = (
    "reward model and RL: rl_algorithm (Optional)",
    "RL backend against the learned reward: 'magrpo' "
    "(group-mean baseline), 'mareinforce' (no baseline), 'marloo' (leave-one-out), 'maremax' (group "
    "max), 'maac' (centralized critic), 'iac' (independent critics).",
)
AGENT_MODEL = (
    "agents: agent_model (Optional)",
    "One model for all agents: a local folder, a hub id already on "
    "disk, or a packaged alias like 'smollm2-135m-instruct'.",
)
CONFIG = ("config", "Path of a YAML config as the worker sees it")
OVERRIDES = (
    "overrides (Optional)",
    "Overrides key=value, applied in order, as `pbrl train CONFIG --set key=value` (e.g. num_iterations=3).",
)
FORMS = {
    "madpo": ([DPO_BETA, AGENT_MODEL], [NUM_ITERATIONS, REPLAY_MODE, RL_ALGORITHM]),
    "madpo-iter": ([NUM_ITERATIONS, REPLAY_MODE, DPO_BETA, AGENT_MODEL], [RL_ALGORITHM]),
    "marlhf": ([RL_ALGORITHM, AGENT_MODEL], [NUM_ITERATIONS, REPLAY_MODE]),
    "marlhf-iter": ([NUM_ITERATIONS, REPLAY_MODE, RL_ALGORITHM, AGENT_MODEL], []),
    "config-file": ([CONFIG, OVERRIDES], [NUM_ITERATIONS]),
}


@pytest.mark.parametrize("deployment", sorted(FORMS))
def test_form_shows_the_options_of_its_trainer_with_descriptions(browser, ui, deployment):
    present, absent = FORMS[deployment]
    page = _open_form(browser, ui, deployment)
    try:
        for label, description in present:
            field = _field(page, label)
            field.wait_for()
            assert description in field.inner_text(), (deployment, label)
        for label, _ in absent:
            assert page.get_by_text(label, exact=True).count() == 0, (deployment, label)
        _shot(page, f"form-{deployment}")
    finally:
        page.close()


def _field(page, label: str):
    """The block of one form field: its label, description and input."""
    return page.locator("div.group").filter(has=page.get_by_text(label, exact=True)).last


def _fill_text(page, label: str, text: str) -> None:
    """A nullable text option (tabs ``str | None``): choose ``str`` and type."""
    field = _field(page, label)
    field.get_by_role("tab", name="str").click()
    field.locator("textarea, input").first.fill(text)


def test_a_run_submitted_from_the_form_completes_with_its_own_artifacts(browser, ui):
    import httpx

    page = _open_form(browser, ui, "madpo-iter")
    try:
        _fill_text(page, "run: run_name (Optional)", "ui-form-run")
        _fill_text(page, "run: task (Optional)", "toy")
        _fill_text(page, "agents: agent_model (Optional)", "tiny-random")
        for label, value in (
            ("training: num_iterations (Optional)", "1"),
            ("collection: preference_num_candidates (Optional)", "2"),
            ("collection: max_new_tokens (Optional)", "8"),
            ("evaluation: eval_num_samples (Optional)", "2"),
        ):
            page.get_by_label(label).fill(value)
        _shot(page, "form-madpo-iter-filled")
        with page.expect_response(lambda r: r.url.endswith("/create_flow_run")) as created:
            page.get_by_role("button", name="Submit").click()
        assert created.value.status == 201, created.value.text()
        run_id = created.value.json()["id"]
    finally:
        page.close()
    api = ui["api"]
    deadline, state, run = time.monotonic() + 600, None, None
    while state not in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
        assert time.monotonic() < deadline, f"the run did not finish: {state}"
        time.sleep(2)
        run = httpx.get(f"{api}/flow_runs/{run_id}", timeout=10).json()
        state = run["state_type"]
    assert state == "COMPLETED", (run["state"]["message"], (ui["cwd"] / "serve.log").read_text()[-3000:])
    assert run["name"] == "ui-form-run" and run["parameters"]["num_iterations"] == 1
    run_dir = ui["cwd"] / "storage" / "runs" / "ui-form-run"
    assert (run_dir / "rounds" / "0001" / "update-policies.manifest.json").is_file()
    artifacts = {a["key"]: a for a in httpx.post(f"{api}/artifacts/filter", json={}, timeout=10).json()}
    assert {"round-metrics-ui-form-run", "round-summary-ui-form-run", "round-report-ui-form-run"} <= set(artifacts)
    assert "round-metrics" not in artifacts  # no artifact shared by every run
    page = _page(browser, ui, height=1000)
    try:  # the report plot shows as an image in the UI
        page.goto(f"{ui['url']}/v2/artifacts/artifact/{artifacts['round-report-ui-form-run']['id']}")
        image = page.locator("img[alt=artifact-image]")
        image.wait_for()
        assert image.evaluate("img => img.complete && img.naturalWidth") == 1000  # report.png: 10 in x 100 dpi
        _shot(page, "run-report-artifact")
    finally:
        page.close()
