"""People label a round's pairs in the Prefect UI (issue #52), in a real browser: a run with ``judge: human`` started
from the UI's deployment suspends at judge-pairs with no process left running; the form of its Resume shows the
pairs role by role; two forms (A and a tie, then B and a skip) are labelled, the run is cancelled between them and
continued, and the round trains on exactly the four labels given, each stored once. The server, ``pbrl serve`` and
the browser are shared with the other browser tests (``tests/browser/ui_kit.py``); screenshots go to tests/artifacts/ui/
(docs/guides/label-pairs.md shows them).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from tests.browser.ui_kit import completed, create_run, flow_run, flow_run_logs, shot, v1_field, v1_run_page, wait

pytestmark = [pytest.mark.flow]
RUN = "ui-labels"
PARAMS = {
    "task": "toy",
    "agent_model": "tiny-random",
    "num_iterations": 1,
    "preference_num_candidates": 2,
    "max_new_tokens": 8,
    "judge": {"preference_source": "judge", "judge": "human", "judge_label_batch_size": 2, "judge_max_pairs": 6},
    "collection": {"pair_selection": "all", "preference_pairs_per_sample": None},
    "evaluation": {"eval_num_samples": 2},
}


def suspended(ui: dict, run_id: str, other_than: str | None = None) -> str:
    """Wait until the flow run is suspended for a form (another than ``other_than``); its pause key."""
    for _ in range(3):
        run = wait(ui, run_id, states=("PAUSED", "COMPLETED", "FAILED", "CRASHED", "CANCELLED"))
        errors = [log["message"] for log in flow_run_logs(ui, run_id) if log["level"] >= 40]
        assert run["state_type"] == "PAUSED", (run["state"]["message"], errors[-3:])
        key = run["state"]["state_details"]["pause_key"]
        if key != other_than:
            return key
    raise AssertionError(f"flow run {run_id} still waits for form {other_than}")


def no_process_left(run_id: str, timeout: float = 60) -> None:
    """Within ``timeout`` seconds of its suspension, no process runs the flow run ``run_id`` any more."""
    deadline = time.monotonic() + timeout
    while left := processes_of(run_id):
        assert time.monotonic() < deadline, f"processes {left} still run the suspended flow run {run_id}"
        time.sleep(1)


def processes_of(run_id: str) -> list[int]:
    """The processes that run the flow run ``run_id`` (Prefect starts each with PREFECT__FLOW_RUN_ID in its
    environment)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and f"PREFECT__FLOW_RUN_ID={run_id}".encode() in (proc / "environ").read_bytes():
                found.append(int(proc.name))
        except OSError:  # ended meanwhile, or another user's
            continue
    return found


def label_in_the_form(browser, ui: dict, run_id: str, choices: list[str], name: str, screenshot: str) -> list[str]:
    """Open the flow run's Resume form in the UI that Prefect's links open (V1), pick ``choices`` for its pairs in
    order, give ``name`` and submit; the question ids of its pairs."""
    page = v1_run_page(browser, ui, run_id, height=1400)
    try:
        page.get_by_role("button", name="Resume").first.click()
        page.get_by_text("Label pairs: run").wait_for()
        titles = [label.inner_text().strip() for label in page.get_by_text("which is better?").all()]
        questions = [title.split("(")[1].split(")")[0] for title in titles]
        assert len(questions) == len(choices), questions
        shot(page, screenshot)
        for title, choice in zip(titles, choices, strict=True):
            block = v1_field(page, title)
            block.get_by_role("button", name="later").click()
            page.keyboard.press("ArrowDown")  # V1's select opens its options from the keyboard
            page.get_by_role("option", name=choice, exact=True).click()
        page.locator(".schema-form-property").filter(has=page.get_by_text("Your name", exact=False)).locator(
            "input, textarea"
        ).first.fill(name)
        shot(page, f"{screenshot}-filled")
        with page.expect_response(lambda r: "/resume" in r.url) as resumed:
            page.get_by_role("button", name="Submit").click()
        assert resumed.value.status in (200, 201), resumed.value.text()
    finally:
        page.close()
    return questions


def test_a_round_labelled_in_the_ui_trains_on_exactly_those_labels_and_a_cancel_keeps_them(browser, ui):
    run_id = create_run(ui, "madpo-iter", RUN, PARAMS)
    form = suspended(ui, run_id)
    no_process_left(run_id)  # suspended: Prefect ended its process; nothing holds a worker
    run_dir = ui["cwd"] / "storage" / "runs" / RUN
    request = json.loads((run_dir / "rounds" / "0001" / "labels.json").read_text())
    assert request["form"].endswith(f"/runs/flow-run/{run_id}") and len(request["keys"]) == 6
    first = label_in_the_form(browser, ui, run_id, ["A", "tie"], "ada", "labels-form")
    suspended(ui, run_id, other_than=form)  # resumed from the form's input, it took the labels and asks the next
    no_process_left(run_id)
    second = label_in_the_form(browser, ui, run_id, ["B", "skip"], "bo", "labels-form-2")
    # Cancel right after the submission, before or while the run goes on: the labels are kept either way
    body = {"state": {"type": "CANCELLED", "name": "Cancelled"}, "force": True}
    httpx.post(f"{ui['api']}/flow_runs/{run_id}/set_state", json=body, timeout=10)
    assert wait(ui, run_id)["state_type"] == "CANCELLED"
    no_process_left(run_id)
    continued = create_run(ui, "continue", f"{RUN}-continue", {"run_name": RUN})
    suspended(ui, continued)
    no_process_left(continued)
    third = label_in_the_form(browser, ui, continued, ["A", "B"], "ada", "labels-form-3")
    assert len(set(first + second + third)) == 6  # a labelled pair is never shown again
    completed(ui, continued)  # resumed from the UI's input, it trained on the labels
    answers = [json.loads(line) for line in (run_dir / "judge" / "answers.jsonl").read_text().splitlines()]
    people = ["ada", "ada", "bo", "bo", "ada", "ada"]
    choices = ["A", "tie", "B", "skip", "A", "B"]
    given = {q: (c, who) for q, c, who in zip(first + second + third, choices, people, strict=True)}
    assert sorted(a["question_id"] for a in answers) == sorted(given)  # each label stored once
    assert {a["question_id"]: (a["verdict"] or "skip", a["labeller"]) for a in answers} == given
    assert {a["via"] for a in answers} == {"ui"}
    import pyarrow.parquet as pq

    verdicts = pq.read_table(run_dir / "rounds" / "0001" / "verdicts.parquet").to_pylist()
    assert {v["question_id"]: v["verdict"] or "skip" for v in verdicts} == {q: c for q, (c, _) in given.items()}
    pairs = pq.read_table(run_dir / "rounds" / "0001" / "pairs.parquet").to_pylist()
    decided = [v for v in verdicts if v["verdict"] in ("A", "B")]
    # each A and B gives a pair, the tie and the skip none
    assert sorted(p["item_id"] for p in pairs) == sorted(v["item_id"] for v in decided) and len(pairs) == 4
    for v in decided:  # the preferred joint response is the one the person chose (A: the one shown first)
        assert v["preference"] == (v["shown_first"] if v["verdict"] == "A" else {"x": "y", "y": "x"}[v["shown_first"]])
    update = json.loads((run_dir / "rounds" / "0001" / "update-policies.manifest.json").read_text())
    assert update["counts"]["pairs"] == 4, update["counts"]
    assert flow_run(ui, continued)["state_type"] == "COMPLETED"
