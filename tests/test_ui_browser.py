"""The Prefect UI as a place to run and watch training (issues #13, #31), in a real browser: Debian's Chromium,
headless, driven by Playwright's Python API (nothing is downloaded), against ``prefect server start`` and ``pbrl
serve`` started here, in Prefect's default UI (V2).

A person opening the madpo-iter form sees ``task``, ``agent_model`` and ``num_iterations`` required and without
scrolling, with choices, and sections at their defaults; a run started from it logs each stage while it runs and
shows its round table and report on its own (top-level) run; ``continue`` adds a round to it by its name; a run
killed mid-round and then *Retry* completes with its finished stages Cached; a form that breaks two rules shows
both problems once. Runs are tiny (the tiny random model, the toy task, 1 to 3 rounds, 8 to 16 tokens).
Screenshots go to ``tests/artifacts/ui/``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
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
DEPLOYMENTS = {"madpo", "madpo-iter", "marlhf", "marlhf-iter", "config-file", "continue", "train"}
FIRST_SCREEN = {"width": 1280, "height": 800}
FINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
STAGES = ("sample-candidates", "score-with-oracle", "build-pairs", "store-round", "replay-select", "update-policies")

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


# ------------------------------------------------------------------------------------------------ helpers
def _page(browser, ui: dict, height: int = 1000):
    """A page that reaches only the Prefect server (the UI's links to fonts and prefect.io are refused)."""
    page = browser.new_page(viewport={"width": FIRST_SCREEN["width"], "height": height})
    page.set_default_timeout(90_000)
    page.route(
        "**/*", lambda route: route.continue_() if route.request.url.startswith((ui["url"], "data:")) else route.abort()
    )
    return page


def _open_form(browser, ui: dict, deployment: str, height: int = FIRST_SCREEN["height"]):
    page = _page(browser, ui, height)
    page.goto(f"{ui['url']}/v2/deployments/deployment/{ui['ids'][deployment]}/run")
    page.get_by_role("heading", name="Parameters").wait_for()
    return page


def _shot(page, name: str, full: bool = False) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=full)


def _field(page, label: str):
    """The block of one form field (its label, description and input): the outermost one labelled so."""
    return page.locator("div.group").filter(has=page.get_by_text(label, exact=True)).first


def _choose(page, label: str, choice: str, value: str) -> None:
    """Pick ``value`` in the drop-down of the tab ``choice`` of field ``label`` (task: registered, agent_model:
    packaged)."""
    _field(page, label).get_by_role("button", name=f"Select {choice}").click()
    page.get_by_role("option", name=value, exact=True).click()


def _change(page, section: str) -> None:
    """Open a section of the form (its ``change`` tab) to set its options."""
    _field(page, f"{section} (Optional)").get_by_role("tab", name="change").click()


def _select(page, option: str, value: str) -> None:
    page.get_by_role("button", name=f"Select {option}").click()
    page.get_by_role("option", name=value, exact=True).click()


def _submit(page) -> str:
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


def _run_name(page, name: str) -> None:
    page.get_by_label("Run Name").fill(name)


def _flow_run(ui: dict, run_id: str) -> dict:
    import httpx

    return httpx.get(f"{ui['api']}/flow_runs/{run_id}", timeout=10).json()


def _wait(ui: dict, run_id: str, states=FINAL, timeout: float = 600) -> dict:
    deadline = time.monotonic() + timeout
    while (run := _flow_run(ui, run_id))["state_type"] not in states:
        assert time.monotonic() < deadline, f"flow run {run['name']} still {run['state_type']}"
        time.sleep(1)
    return run


def _completed(ui: dict, run_id: str) -> dict:
    run = _wait(ui, run_id)
    assert run["state_type"] == "COMPLETED", (run["state"]["message"], (ui["cwd"] / "serve.log").read_text()[-3000:])
    return run


def _logs(ui: dict, run_id: str) -> list[dict]:
    """The flow run's log lines, oldest first."""
    import httpx

    body = {"logs": {"flow_run_id": {"any_": [run_id]}}, "sort": "TIMESTAMP_ASC", "limit": 200}
    out: list[dict] = []
    while page := httpx.post(f"{ui['api']}/logs/filter", json={**body, "offset": len(out)}, timeout=10).json():
        out += page
    return out


def _create_run(ui: dict, deployment: str, name: str, parameters: dict) -> str:
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


def _run_page(browser, ui: dict, run_id: str, height: int = 1000):
    page = _page(browser, ui, height)
    page.goto(f"{ui['url']}/v2/runs/flow-run/{run_id}")
    page.get_by_role("tab", name="Logs").wait_for()
    return page


# ------------------------------------------------------------------------------------------------ the forms
def test_the_form_shows_what_every_run_needs_on_the_first_screen(browser, ui):
    page = _open_form(browser, ui, "madpo-iter")
    try:
        for label in ("task", "agent_model", "num_iterations"):  # required: no "(Optional)", above the fold
            shown = page.get_by_text(label, exact=True).first
            box = shown.bounding_box()
            assert box is not None and box["y"] + box["height"] <= FIRST_SCREEN["height"], (label, box)
        assert page.get_by_text("num_iterations (Optional)", exact=True).count() == 0
        assert page.get_by_label("num_iterations").input_value() == "6"  # prefilled with its default
        _shot(page, "form-madpo-iter")  # the first screen, as a person sees it
        _field(page, "task").get_by_role("button", name="Select registered").click()
        assert [o.inner_text() for o in page.get_by_role("option").all()] == ["humaneval_coop", "humaneval_docs", "toy"]
        page.keyboard.press("Escape")
        _field(page, "agent_model").get_by_role("tab", name="folder or hub id").wait_for()  # any model too
        sections = ["run", "own_items", "agents", "devices", "collection", "comparator", "api_comparator"]
        sections += ["replay", "training", "evaluation"]
        for section in sections:  # real groups, each at its defaults until opened
            assert (
                _field(page, f"{section} (Optional)").get_by_role("tab", name="defaults").get_attribute("aria-selected")
                == "true"
            ), section
            _change(page, section)
        page.get_by_text("comparator_api_url (Optional)", exact=True).wait_for()
        for absent in ("num_turns", "discount", "advantage_mode", "reference_kl_enabled", "run_name"):
            assert page.get_by_text(f"{absent} (Optional)", exact=True).count() == 0, absent
        assert page.get_by_text('Property is type "None"').count() == 0
        _shot(page, "form-madpo-iter-open-full", full=True)
    finally:
        page.close()


@pytest.mark.parametrize(
    ("deployment", "present", "absent"),
    [
        ("marlhf-iter", ["rl_algorithm", "reward_model (Optional)", "rl (Optional)"], ["dpo_beta"]),
        ("madpo", ["dpo_beta", "collection (Optional)"], ["num_iterations", "replay (Optional)", "rl (Optional)"]),
        ("continue", ["run_name", "num_iterations (Optional)", "output_dir (Optional)"], []),
    ],
)
def test_each_form_has_what_its_trainer_uses(browser, ui, deployment, present, absent):
    page = _open_form(browser, ui, deployment)
    try:
        for label in present:
            page.get_by_text(label, exact=True).first.wait_for()
        for label in absent:
            assert page.get_by_text(label, exact=True).count() == 0, label
        assert page.get_by_text('Property is type "None"').count() == 0
        _shot(page, f"form-{deployment}")
    finally:
        page.close()


# ------------------------------------------------------------------------------------------------ a run
def test_a_run_from_the_form_shows_progress_while_it_runs_and_its_results_then_continues(browser, ui):
    import httpx

    page = _open_form(browser, ui, "madpo-iter", height=1000)
    try:
        _run_name(page, "ui-form-run")
        _choose(page, "task", "registered", "toy")
        _choose(page, "agent_model", "packaged", "tiny-random")
        for label, value in (("num_iterations", "2"), ("preference_num_candidates", "2"), ("max_new_tokens", "8")):
            page.get_by_label(label, exact=True).fill(value)
        _change(page, "evaluation")
        page.get_by_label("eval_num_samples (Optional)").fill("2")
        run_id = _submit(page)
    finally:
        page.close()
    page = _run_page(browser, ui, run_id)
    try:  # the run's own log shows the stages (that they arrived while it ran is checked below, from their times:
        # the tiny run may well end before this page finds its first line)
        page.get_by_text("round 1 sample-candidates: started").wait_for(timeout=300_000)
        _shot(page, "run-log")
    finally:
        page.close()
    run = _completed(ui, run_id)
    assert run["name"] == "ui-form-run" and run["parameters"]["num_iterations"] == 2
    ours = [log for log in _logs(ui, run_id) if log["name"] == "pbrl.flows.run_log"]
    started = {
        (r, stage): next(log for log in ours if log["message"] == f"round {r} {stage}: started")
        for r, stage in [(0, "evaluate"), *((r, s) for r in (1, 2) for s in (*STAGES, "evaluate"))]
    }
    # the lines reached the server while the run went on: Prefect sends its log in batches (every 0.25 s here), so
    # only the last batch may arrive with the run's end (round 2's lines did, in one CI run); rounds 0 and 1 before
    at = datetime.fromisoformat  # the API's times as datetimes (its strings drop a zero microsecond part)
    for (r, stage), line in started.items():
        assert r == 2 or at(line["created"]) < at(run["end_time"]), (r, stage)
    assert at(started[0, "evaluate"]["created"]) < at(started[2, "evaluate"]["timestamp"])
    assert any("update-policies step 1: madpo/loss" in log["message"] for log in ours)

    page = _run_page(browser, ui, run_id)
    try:  # the round table and the report on the run a person opens
        page.get_by_role("tab", name="Artifacts").click()
        for key in ("round-table-ui-form-run", "round-report-ui-form-run", "round-summary-ui-form-run"):
            page.get_by_text(key, exact=True).wait_for()
            assert page.get_by_text(key, exact=True).count() == 1, key  # one, updated after each round
        _shot(page, "run-artifacts")
        page.get_by_text("round-table-ui-form-run", exact=True).click()
        page.get_by_text("eval [95% CI]").first.wait_for()
        rows = page.get_by_role("row").all()
        assert [r.get_by_role("cell").first.inner_text() for r in rows[1:]] == ["0", "1", "2"]
        _shot(page, "run-round-table")
    finally:
        page.close()
    artifacts = {a["key"]: a for a in httpx.post(f"{ui['api']}/artifacts/filter", json={}, timeout=10).json()}
    page = _page(browser, ui)
    try:  # the report plot shows as an image
        page.goto(f"{ui['url']}/v2/artifacts/artifact/{artifacts['round-report-ui-form-run']['id']}")
        image = page.locator("img[alt=artifact-image]")
        image.wait_for()
        png = (ui["cwd"] / "storage" / "runs" / "ui-form-run" / "report.png").read_bytes()
        assert image.evaluate("img => img.complete && img.naturalWidth") == int.from_bytes(png[16:20], "big")
        _shot(page, "run-report-artifact")
    finally:
        page.close()
    summary = artifacts["round-summary-ui-form-run"]["data"]
    assert str(ui["cwd"] / "storage" / "runs" / "ui-form-run") in summary and "file://" not in summary

    page = _open_form(browser, ui, "continue")
    try:  # continue the run by its name: one more round
        page.get_by_label("run_name", exact=True).fill("ui-form-run")
        page.get_by_label("num_iterations (Optional)").fill("3")
        continued = _submit(page)
    finally:
        page.close()
    _completed(ui, continued)
    run_dir = ui["cwd"] / "storage" / "runs" / "ui-form-run"
    assert json.loads((run_dir / "run.json").read_text())["config"]["num_iterations"] == 3
    assert (run_dir / "rounds" / "0003" / "evaluate.manifest.json").is_file()
    lines = [log["message"] for log in _logs(ui, continued)]
    for r, stage in ((1, "update-policies"), (2, "update-policies"), (2, "evaluate")):
        assert any(line.startswith(f"round {r} {stage}: cached") for line in lines), (r, stage)
    assert any(line.startswith("round 3 update-policies: done in") for line in lines)


def test_retry_of_a_killed_run_resumes_it_with_its_finished_stages_cached(browser, ui):
    parameters = {
        "task": "toy",
        "agent_model": "tiny-random",
        "num_iterations": 2,
        "preference_num_candidates": 4,
        "max_new_tokens": 16,
        "evaluation": {"eval_num_samples": 4},
    }
    run_id = _create_run(ui, "madpo-iter", "ui-killed", parameters)
    run_dir = ui["cwd"] / "storage" / "runs" / "ui-killed"
    deadline = time.monotonic() + 300
    while not (run_dir / "rounds" / "0001" / "update-policies.manifest.json").is_file():
        assert time.monotonic() < deadline and _flow_run(ui, run_id)["state_type"] not in FINAL, "round 1 never trained"
        time.sleep(0.2)
    holder = json.loads((run_dir / ".pbrl-run.lock").read_text())["pid"]  # the flow run's process
    os.kill(holder, signal.SIGKILL)
    finished = {(int(p.parent.name), p.name.split(".")[0]) for p in run_dir.glob("rounds/*/*.manifest.json")}
    assert _wait(ui, run_id)["state_type"] == "CRASHED"

    page = _run_page(browser, ui, run_id)
    try:
        page.get_by_role("button", name="Open menu").first.click()
        page.get_by_role("menuitem", name="Retry").click()
        _shot(page, "retry-dialog")
        page.get_by_role("button", name="Retry", exact=True).last.click()
        _wait(ui, run_id, states=("SCHEDULED", "PENDING", "RUNNING", *FINAL), timeout=60)
    finally:
        page.close()
    run = _completed(ui, run_id)
    assert run["run_count"] == 2 and run["name"] == "ui-killed"
    lines = [log["message"] for log in _logs(ui, run_id)]
    retried = lines[max(i for i, line in enumerate(lines) if line.endswith(": started") and line.startswith("run "))]
    after = lines[lines.index(retried) :]
    for r, stage in sorted(finished):  # what was done before the kill comes back Cached
        assert any(line.startswith(f"round {r} {stage}: cached") for line in after), (r, stage, after)
    assert (run_dir / "rounds" / "0002" / "evaluate.manifest.json").is_file()


def test_a_form_that_breaks_two_rules_shows_both_problems_once(browser, ui):
    page = _open_form(browser, ui, "madpo-iter", height=1000)
    try:
        _run_name(page, "ui-broken")
        _choose(page, "task", "registered", "toy")
        _choose(page, "agent_model", "packaged", "tiny-random")
        _change(page, "collection")
        _select(page, "pair_selection", "all")
        _change(page, "replay")
        _select(page, "preference_replay_mode", "nearest_k")
        run_id = _submit(page)
    finally:
        page.close()
    assert _wait(ui, run_id)["state_type"] == "FAILED"
    assert not (ui["cwd"] / "storage" / "runs" / "ui-broken").exists()
    problems = (
        "preference_pairs_per_sample: got 4; must be None when pair_selection='all' (every pair is kept)",
        "preference_replay_k: got None; required (>= 1) with preference_replay_mode='nearest_k'",
    )
    page = _run_page(browser, ui, run_id)
    try:
        page.get_by_text("the run did not start (nothing was computed)").wait_for()
        text = " ".join(page.inner_text("main").split())
        for problem in problems:
            assert text.count(problem) == 1, (problem, text)
        assert "Traceback" not in text
        _shot(page, "run-broken-rules")
    finally:
        page.close()
    assert not [log for log in _logs(ui, run_id) if "Traceback" in log["message"]]
