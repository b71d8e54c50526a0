"""The Prefect UI's last mile (issue #54), in a real browser, in both of the UIs that Prefect serves (V1 at the
paths that Prefect's printed links open, V2 under /v2/): a section's option set in the V1 form reaches the run;
``continue`` with ``num_iterations`` left empty finishes a run as stored, from either form; a run's page (the
artifact ``run-<run>``) and its tag lead to every Prefect run of it; a Run Name that exists and a mistyped run name
say what to do in the UI; a person's Cancel is recorded as cancelled, not as an error; the nightly schedule names its
time zone. The server, ``pbrl serve`` and the browser are shared with ``tests/browser/test_ui.py``
(``tests/browser/ui_kit.py``).
"""

from __future__ import annotations

import json
import re
import time

import pytest

from tests.browser.ui_kit import (
    FINAL,
    NIGHTLY_RUN,
    completed,
    create_run,
    flow_run,
    flow_run_logs,
    new_page,
    open_form,
    open_v1_form,
    run_page,
    shot,
    submit,
    v1_field,
    v1_fill,
    v1_run_page,
    wait,
)

pytestmark = [
    pytest.mark.flow,
]
RUN = NIGHTLY_RUN  # the run made from the V1 form below; the nightly deployment names it


def _our_lines(ui: dict, run_id: str, level: int = 0) -> list[str]:
    return [
        log["message"]
        for log in flow_run_logs(ui, run_id)
        if log["name"] == "pbrl.flows.run_log" and log["level"] >= level
    ]


@pytest.fixture(scope="module")
def v1_run(browser, ui) -> str:
    """A one-round run submitted from the V1 form, with an option of a section (evaluation) changed; its id."""
    page = open_v1_form(browser, ui, "madpo-iter")
    try:
        page.locator(".p-label").filter(has=page.get_by_text("Run Name", exact=True)).locator("input").first.fill(RUN)
        v1_field(page, "task").get_by_role("button", name="other").click()
        v1_fill(page, "task", "toy")
        v1_field(page, "agent_model").get_by_role("button", name="folder or hub id").click()
        v1_fill(page, "agent_model", "tiny-random")
        for label, value in (("num_iterations", "1"), ("preference_num_candidates", "2"), ("max_new_tokens", "8")):
            v1_fill(page, label, value)
        assert page.get_by_text("is a const and cannot be changed").count() == 0
        v1_field(page, "evaluation (Optional)").get_by_role("button", name="change").click()
        v1_fill(page, "eval_num_samples (Optional)", "2")
        shot(page, "v1-form-section-changed")
        run_id = submit(page)
    finally:
        page.close()
    completed(ui, run_id)
    return run_id


def test_an_option_of_a_section_set_in_the_v1_form_reaches_the_run(ui, v1_run):
    stored = json.loads((ui["cwd"] / "storage" / "runs" / RUN / "run.json").read_text())["config"]
    assert stored["eval_num_samples"] == 2 and stored["num_iterations"] == 1
    assert flow_run(ui, v1_run)["parameters"]["evaluation"]["eval_num_samples"] == 2


def test_continue_with_num_iterations_left_empty_finishes_the_run_as_stored_from_either_form(browser, ui, v1_run):
    """Issue #54: the empty field was sent as null and refused ("None is not of type 'integer'")."""
    continued = []
    for ui_version in ("v2", "v1"):
        page = (open_form if ui_version == "v2" else open_v1_form)(browser, ui, "continue")
        try:
            if ui_version == "v2":
                assert page.get_by_label("num_iterations (Optional)").input_value() == ""
                page.get_by_label("run_name", exact=True).fill(RUN)
            else:
                assert v1_field(page, "num_iterations (Optional)").locator("input").input_value() == ""
                v1_fill(page, "run_name", RUN)
            shot(page, f"{ui_version}-continue-empty-num-iterations")
            continued.append(submit(page))
        finally:
            page.close()
        completed(ui, continued[-1])
    for run_id in continued:
        assert flow_run(ui, run_id)["name"] == f"{RUN}-continue"
        lines = _our_lines(ui, run_id)
        assert "round 1 update-policies: cached" in " ".join(lines) and not _our_lines(ui, run_id, level=30)


def test_the_runs_page_and_its_tag_lead_to_every_prefect_run_of_it_in_both_uis(browser, ui, v1_run):
    import httpx

    runs = {"flow_runs": {"tags": {"all_": [f"run:{RUN}"]}}}
    versions = {"artifacts": {"key": {"any_": [f"run-{RUN}"]}}, "sort": "CREATED_DESC", "limit": 1}
    for _ in range(60):  # a run of an earlier test may still be writing its version (a fresh clone's suite saw one)
        tagged = httpx.post(f"{ui['api']}/flow_runs/filter", json=runs, timeout=10).json()
        (newest,) = httpx.post(f"{ui['api']}/artifacts/filter", json=versions, timeout=10).json()
        if all(r["id"] in str(newest.get("data")) for r in tagged):
            break
        time.sleep(1)
    names = sorted(r["name"] for r in tagged)
    assert names.count(RUN) == 1 and f"{RUN}-round-1" in names, names
    for base in ("", "/v2"):
        page = new_page(browser, ui)
        try:  # the artifact run-<run>, found by its key, lists each of them as a link into the same UI
            page.goto(f"{ui['url']}{base}/artifacts/key/run-{RUN}")  # one version per flow run, the newest first
            page.get_by_role("link", name=newest["id"][:8]).first.click()
            page.get_by_role("heading", name=f"Run {RUN}").wait_for()
            for run in tagged:
                link = page.get_by_role("link", name=run["name"], exact=True)
                expected = f"{ui['url']}{base}/runs/flow-run/{run['id']}"
                # V2 draws the heading before the rest of the markdown (a CI run saw no links), and may draw the
                # markdown again after its first links show (a suite run read none between the two): poll, 30 s
                for _ in range(120):
                    link.first.wait_for()
                    hrefs = [a.evaluate("a => a.href") for a in link.all()]
                    if expected in hrefs:
                        break
                    page.wait_for_timeout(250)
                assert expected in hrefs, (run["name"], hrefs)
            shot(page, f"run-page{base.replace('/', '-') or '-v1'}")
        finally:
            page.close()
    page = new_page(browser, ui)
    try:  # its link to the runs list filtered by the run's tag (V2 reads the tag from the address)
        page.goto(f"{ui['url']}/v2/artifacts/artifact/{newest['id']}")
        page.get_by_role("link", name="the runs list filtered by it").click()
        page.get_by_role("link", name=f"{RUN}-round-1").first.wait_for()
        for name in set(names):
            assert page.get_by_role("link", name=name, exact=True).count() == names.count(name), name
        shot(page, "runs-filtered-by-the-run-tag")
    finally:
        page.close()


def test_a_run_name_that_exists_or_is_mistyped_says_what_to_do_in_the_ui(browser, ui, v1_run):
    taken = create_run(ui, "madpo-iter", RUN, {"task": "toy", "agent_model": "tiny-random"})
    mistyped = create_run(ui, "continue", "mistyped", {"run_name": RUN[:-1]})
    for run_id in (taken, mistyped):
        assert wait(ui, run_id)["state_type"] == "FAILED"
    page = v1_run_page(browser, ui, taken)
    try:  # where Prefect's printed links lead: V1
        page.get_by_text("already exists").first.wait_for()
        text = " ".join(page.inner_text("body").split())
        assert f"continue it with the deployment pbrl-train/continue (run_name {RUN})" in text
        assert "Retry the flow run that started it" in text and "--resume" not in text
        assert "Copy to new run" in text
        shot(page, "v1-run-name-taken")
    finally:
        page.close()
    page = run_page(browser, ui, mistyped)
    try:
        page.get_by_text("no run of that name").wait_for()
        text = " ".join(page.inner_text("main").split())
        assert f"run_name: got '{RUN[:-1]}'; no run of that name in storage/runs; the runs in storage/runs:" in text
        assert RUN in text.split("the runs in storage/runs:", 1)[1] and "is not a folder" not in text
        shot(page, "run-name-mistyped")
    finally:
        page.close()


def test_a_cancel_from_the_ui_is_recorded_as_cancelled_not_as_an_error(browser, ui):
    parameters = {"task": "toy", "agent_model": "tiny-random", "num_iterations": 3, "max_new_tokens": 16}
    run_id = create_run(ui, "madpo-iter", "ui-cancelled", {**parameters, "preference_num_candidates": 4})
    deadline = time.monotonic() + 300
    while "round 1 sample-candidates: started" not in _our_lines(ui, run_id):
        assert time.monotonic() < deadline and flow_run(ui, run_id)["state_type"] not in FINAL, "round 1 never began"
        time.sleep(0.5)
    page = run_page(browser, ui, run_id)
    try:
        page.get_by_role("button", name="Open menu").first.click()
        page.get_by_role("menuitem", name="Cancel").click()
        page.get_by_role("button", name="Cancel Flow Run").click()
        assert wait(ui, run_id)["state_type"] == "CANCELLED"
    finally:
        page.close()
    lines = _our_lines(ui, run_id, level=30)
    assert lines[-1].startswith("run storage/runs/ui-cancelled: cancelled after "), lines
    assert not _our_lines(ui, run_id, level=40) and not [line for line in lines if "failed" in line]
    rounds = ui["cwd"] / "storage" / "runs" / "ui-cancelled" / "rounds"
    for line in lines:  # a stage it stopped (the Cancel may also land between two stages) is Cancelled in `pbrl status`
        if stopped := re.fullmatch(r"round (\d+) ([\w-]+): cancelled after .*", line):
            states = json.loads((rounds / f"{int(stopped[1]):04d}" / ".states.json").read_text())
            assert states[stopped[2]]["state"] == "Cancelled", states
    page = v1_run_page(browser, ui, run_id)
    try:  # the run's state badge, where Prefect's printed links lead
        page.get_by_text("Cancelled", exact=True).first.wait_for()
        shot(page, "v1-run-cancelled")
    finally:
        page.close()


def test_the_nightly_schedule_names_its_time_zone(browser, ui):
    page = new_page(browser, ui)
    try:  # V1's card shows the schedule's slug
        page.goto(f"{ui['url']}/deployments/deployment/{ui['ids']['nightly']}")
        page.get_by_text("every day at 02:00 UTC", exact=True).wait_for()
        shot(page, "v1-nightly-card")
        # V2's card shows the cron in words without a zone (Prefect's limit): the description says it
        page.goto(f"{ui['url']}/v2/deployments/deployment/{ui['ids']['nightly']}")
        page.get_by_role("tab", name="Description").click()
        page.get_by_text("every day at 02:00 UTC", exact=False).first.wait_for()
        shot(page, "v2-nightly-description")
    finally:
        page.close()
