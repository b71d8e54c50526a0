"""The Prefect UI as a place to run and watch training (issues #13, #31), in a real browser: Debian's Chromium,
headless, driven by Playwright's Python API (nothing is downloaded), against ``prefect server start`` and ``pbrl
serve`` started here, in Prefect's default UI (V2).

A person opening the madpo-iter form sees ``task``, ``agent_model`` and ``num_iterations`` required and without
scrolling, with choices, and sections at their defaults; a run started from it logs each stage while it runs and
shows its round table and report on its own (top-level) run; ``continue`` adds a round to it by its name; a run
killed mid-round and then *Retry* completes with its finished stages Cached; a form that breaks two rules shows
both problems once and how to get the form back. Runs are tiny (the tiny random model, the toy task, 1 to 3
rounds, 8 to 16 tokens). The V1 UI, a run's own page, messages and Cancel are ``tests/browser/test_ui_runs.py``; the
server, ``pbrl serve`` and the browser are shared (``tests/browser/ui_kit.py``).
"""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import datetime

import pytest

from tests.browser.ui_kit import (
    FINAL,
    FIRST_SCREEN,
    STAGES,
    change,
    choose,
    completed,
    create_run,
    field,
    flow_run,
    flow_run_logs,
    new_page,
    open_form,
    run_name,
    run_page,
    select,
    shot,
    submit,
    wait,
)

pytestmark = [
    pytest.mark.flow,
]


# ------------------------------------------------------------------------------------------------ the forms
def test_the_form_shows_what_every_run_needs_on_the_first_screen(browser, ui):
    page = open_form(browser, ui, "madpo-iter")
    try:
        for label in ("task", "agent_model", "num_iterations"):  # required: no "(Optional)", above the fold
            shown = page.get_by_text(label, exact=True).first
            box = shown.bounding_box()
            assert box is not None and box["y"] + box["height"] <= FIRST_SCREEN["height"], (label, box)
        assert page.get_by_text("num_iterations (Optional)", exact=True).count() == 0
        assert page.get_by_label("num_iterations").input_value() == "6"  # prefilled with its default
        shot(page, "form-madpo-iter")  # the first screen, as a person sees it
        field(page, "task").get_by_role("button", name="Select registered").click()
        assert [o.inner_text() for o in page.get_by_role("option").all()] == ["humaneval_coop", "humaneval_docs", "toy"]
        page.keyboard.press("Escape")
        field(page, "agent_model").get_by_role("tab", name="folder or hub id").wait_for()  # any model too
        sections = ["run", "own_items", "agents", "devices", "collection", "comparator", "api_comparator"]
        sections += ["replay", "training", "evaluation"]
        for section in sections:  # real groups, each at its defaults until opened
            assert (
                field(page, f"{section} (Optional)").get_by_role("tab", name="defaults").get_attribute("aria-selected")
                == "true"
            ), section
            change(page, section)
        page.get_by_text("comparator_api_url (Optional)", exact=True).wait_for()
        for absent in ("num_turns", "discount", "advantage_mode", "reference_kl_enabled", "run_name"):
            assert page.get_by_text(f"{absent} (Optional)", exact=True).count() == 0, absent
        assert page.get_by_text('Property is type "None"').count() == 0
        shot(page, "form-madpo-iter-open-full", full=True)
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
    page = open_form(browser, ui, deployment)
    try:
        for label in present:
            page.get_by_text(label, exact=True).first.wait_for()
        for label in absent:
            assert page.get_by_text(label, exact=True).count() == 0, label
        assert page.get_by_text('Property is type "None"').count() == 0
        shot(page, f"form-{deployment}")
    finally:
        page.close()


# ------------------------------------------------------------------------------------------------ a run
def test_a_run_from_the_form_shows_progress_while_it_runs_and_its_results_then_continues(browser, ui):
    import httpx

    page = open_form(browser, ui, "madpo-iter", height=1000)
    try:
        run_name(page, "ui-form-run")
        choose(page, "task", "registered", "toy")
        choose(page, "agent_model", "packaged", "tiny-random")
        for label, value in (("num_iterations", "2"), ("preference_num_candidates", "2"), ("max_new_tokens", "8")):
            page.get_by_label(label, exact=True).fill(value)
        change(page, "evaluation")
        page.get_by_label("eval_num_samples (Optional)").fill("2")
        run_id = submit(page)
    finally:
        page.close()
    page = run_page(browser, ui, run_id)
    try:  # the run's own log shows the stages (that they arrived while it ran is checked below, from their times:
        # the tiny run may well end before this page finds its first line)
        page.get_by_text("round 1 sample-candidates: started").wait_for(timeout=300_000)
        shot(page, "run-log")
    finally:
        page.close()
    run = completed(ui, run_id)
    assert run["name"] == "ui-form-run" and run["parameters"]["num_iterations"] == 2
    ours = [log for log in flow_run_logs(ui, run_id) if log["name"] == "pbrl.flows.run_log"]
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

    page = run_page(browser, ui, run_id)
    try:  # the round table and the report on the run a person opens
        page.get_by_role("tab", name="Artifacts").click()
        for key in ("round-table-ui-form-run", "round-report-ui-form-run", "round-summary-ui-form-run"):
            page.get_by_text(key, exact=True).wait_for()
            assert page.get_by_text(key, exact=True).count() == 1, key  # one, updated after each round
        shot(page, "run-artifacts")
        page.get_by_text("round-table-ui-form-run", exact=True).click()
        page.get_by_text("eval [95% CI]").first.wait_for()
        rows = page.get_by_role("row").all()
        assert [r.get_by_role("cell").first.inner_text() for r in rows[1:]] == ["0", "1", "2"]
        shot(page, "run-round-table")
    finally:
        page.close()
    artifacts = {a["key"]: a for a in httpx.post(f"{ui['api']}/artifacts/filter", json={}, timeout=10).json()}
    page = new_page(browser, ui)
    try:  # the report plot shows as an image, without its URL (100 kB of base64) across the page
        page.goto(f"{ui['url']}/v2/artifacts/artifact/{artifacts['round-report-ui-form-run']['id']}")
        image = page.get_by_role("img", name="report.png after round 2")
        image.wait_for()
        png = (ui["cwd"] / "storage" / "runs" / "ui-form-run" / "report.png").read_bytes()
        assert image.evaluate("img => img.complete && img.naturalWidth") == int.from_bytes(png[16:20], "big")
        assert "base64" not in page.inner_text("main") and page.get_by_text("Image URL").count() == 0
        shot(page, "run-report-artifact")
    finally:
        page.close()
    summary = artifacts["round-summary-ui-form-run"]["data"]
    assert str(ui["cwd"] / "storage" / "runs" / "ui-form-run") in summary and "file://" not in summary

    page = open_form(browser, ui, "continue")
    try:  # continue the run by its name: one more round
        page.get_by_label("run_name", exact=True).fill("ui-form-run")
        page.get_by_label("num_iterations (Optional)").fill("3")
        continued = submit(page)
    finally:
        page.close()
    completed(ui, continued)
    run_dir = ui["cwd"] / "storage" / "runs" / "ui-form-run"
    assert json.loads((run_dir / "run.json").read_text())["config"]["num_iterations"] == 3
    assert (run_dir / "rounds" / "0003" / "evaluate.manifest.json").is_file()
    lines = [log["message"] for log in flow_run_logs(ui, continued)]
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
    run_id = create_run(ui, "madpo-iter", "ui-killed", parameters)
    run_dir = ui["cwd"] / "storage" / "runs" / "ui-killed"
    deadline = time.monotonic() + 300
    while not (run_dir / "rounds" / "0001" / "update-policies.manifest.json").is_file():
        assert time.monotonic() < deadline and flow_run(ui, run_id)["state_type"] not in FINAL, "round 1 never trained"
        time.sleep(0.2)
    holder = json.loads((run_dir / ".pbrl-run.lock").read_text())["pid"]  # the flow run's process
    os.kill(holder, signal.SIGKILL)
    finished = {(int(p.parent.name), p.name.split(".")[0]) for p in run_dir.glob("rounds/*/*.manifest.json")}
    assert wait(ui, run_id)["state_type"] == "CRASHED"

    page = run_page(browser, ui, run_id)
    try:
        page.get_by_role("button", name="Open menu").first.click()
        page.get_by_role("menuitem", name="Retry").click()
        shot(page, "retry-dialog")
        page.get_by_role("button", name="Retry", exact=True).last.click()
        wait(ui, run_id, states=("SCHEDULED", "PENDING", "RUNNING", *FINAL), timeout=60)
    finally:
        page.close()
    run = completed(ui, run_id)
    assert run["run_count"] == 2 and run["name"] == "ui-killed"
    lines = [log["message"] for log in flow_run_logs(ui, run_id)]
    retried = lines[max(i for i, line in enumerate(lines) if line.endswith(": started") and line.startswith("run "))]
    after = lines[lines.index(retried) :]
    for r, stage in sorted(finished):  # what was done before the kill comes back Cached
        assert any(line.startswith(f"round {r} {stage}: cached") for line in after), (r, stage, after)
    assert (run_dir / "rounds" / "0002" / "evaluate.manifest.json").is_file()


def test_a_form_that_breaks_two_rules_shows_both_problems_once(browser, ui):
    from playwright.sync_api import expect

    page = open_form(browser, ui, "madpo-iter", height=1000)
    try:
        run_name(page, "ui-broken")
        choose(page, "task", "registered", "toy")
        choose(page, "agent_model", "packaged", "tiny-random")
        change(page, "collection")
        select(page, "pair_selection", "all")
        change(page, "replay")
        select(page, "preference_replay_mode", "nearest_k")
        run_id = submit(page)
    finally:
        page.close()
    assert wait(ui, run_id)["state_type"] == "FAILED"
    assert not (ui["cwd"] / "storage" / "runs" / "ui-broken").exists()
    problems = (
        "preference_pairs_per_sample: got 4; must be None when pair_selection='all' (every pair is kept)",
        "preference_replay_k: got None; required (>= 1) with preference_replay_mode='nearest_k'",
    )
    page = run_page(browser, ui, run_id)
    try:
        page.get_by_text("the run did not start (nothing was computed)").wait_for()
        text = " ".join(page.inner_text("main").split())
        for problem in problems:
            assert text.count(problem) == 1, (problem, text)
        assert "Traceback" not in text
        # Prefect checks a form only against its JSON schema before Submit (pbrl's rules run in the flow run); the
        # next best thing: the log says how to get the form back with these values, Prefect's "Copy to new run"
        assert "Fix them in the form: this run's menu (⋮), Copy to new run, opens it with these values." in text
        shot(page, "run-broken-rules")
        page.get_by_role("button", name="Open menu").first.click()
        page.get_by_role("menuitem", name="Copy to new run").click()
        page.get_by_role("heading", name="Parameters").wait_for()
        for option, value in (("preference_replay_mode", "nearest_k"), ("pair_selection", "all")):  # as submitted
            expect(page.get_by_role("button", name=f"Select {option}")).to_have_text(value, timeout=90_000)
        shot(page, "run-broken-rules-copied")
    finally:
        page.close()
    assert not [log for log in flow_run_logs(ui, run_id) if "Traceback" in log["message"]]
