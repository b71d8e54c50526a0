"""The Prefect UI as a place to run and watch training (issue #31), under the Prefect test harness: a run from a
trainer's form logs its events while it runs and shows its round table and report on its top-level flow run;
Prefect's Retry of that flow run resumes its run folder with every finished stage Cached; ``continue`` adds
rounds to a run named by its folder; a job that cannot start fails once, with every problem and no traceback.

One tiny two-round run (``trained``) serves the module; the tests that extend it run last, in file order. The
same behaviours through the real UI in a browser are ``tests/browser/test_ui.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from flows.artifacts import artifact_key
from flows.run_home import run_tag
from flows.training import RUN_ID_LABEL, continue_run, reopen, train_flow
from flows.ui import TRAINER_FLOWS
from flows.ui_form import form_defaults
from pbrl.data.storage import RunPaths, read_run_id
from pbrl.errors import ConfigError
from pbrl.reporting.table import round_table_rows

STAGES = ("sample-candidates", "score-with-oracle", "build-pairs", "store-round", "replay-select", "update-policies")
flow_test = [pytest.mark.flow, pytest.mark.usefixtures("prefect_api")]


def form_values(model_dir: Path, output_dir: Path, **changes: Any) -> dict[str, Any]:
    """The madpo-iter form filled in for a tiny run: toy task (4 items), 2 rounds, 3 candidates, 8 tokens."""
    return {
        **form_defaults("madpo_iter"),
        "task": "toy",
        "agent_model": str(model_dir),
        "num_iterations": 2,
        "preference_num_candidates": 3,
        "max_new_tokens": 8,
        "agent_learning_rate": 1e-3,
        "run": {"output_dir": str(output_dir), "task_options": {"num_items": 4}},
        "collection": {"temperature": 1.0, "top_p": 1.0, "preference_pairs_per_sample": 2},
        "training": {"train_batch_size": 2, "logging_steps": 1},
        "evaluation": {"eval_num_samples": 2},
        **changes,
    }


def run_logs(flow_run_id) -> list[Any]:
    """Every log line of a flow run, oldest first (after sending what is still queued)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all()
    logs: list[Any] = []
    with get_client(sync_client=True) as client:
        while True:
            page = client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])),
                sort=LogSort.TIMESTAMP_ASC,
                limit=200,
                offset=len(logs),
            )
            logs += page
            if len(page) < 200:
                return logs


def artifacts(key: str) -> list[Any]:
    """Every version of artifact ``key``, oldest first."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    return sorted(found, key=lambda a: a.created)


def read_flow_run(flow_run_id):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id)


@pytest.fixture(scope="module")
def trained(prefect_api, tiny_model_dir, tmp_path_factory):
    """A run of two rounds submitted as the madpo-iter form would submit it: ``{state, id, run_dir, name}``."""
    out = tmp_path_factory.mktemp("ui-flows")
    state = TRAINER_FLOWS["madpo_iter"](**form_values(tiny_model_dir, out), return_state=True)
    assert state.is_completed(), state.message
    run_dir = Path(state.result()["run_dir"])
    return SimpleNamespace(state=state, id=state.state_details.flow_run_id, run_dir=run_dir, name=run_dir.name, out=out)


@pytest.mark.flow
def test_the_run_log_shows_each_stage_the_training_steps_and_progress_while_it_runs(trained):
    logs = run_logs(trained.id)
    ours = [log for log in logs if log.name == "pbrl.flows.run_log"]
    lines = [log.message for log in ours]
    for stage in (*STAGES, "evaluate"):
        assert f"round 1 {stage}: started" in lines
        assert any(line.startswith(f"round 2 {stage}: done in ") for line in lines), stage
    assert any(line.startswith("round 1 update-policies step 1: madpo/loss ") for line in lines)
    assert "round 1 sample-candidates: 48/48 rows" in lines  # 2 agents x 4 items x 3 candidates x 2 sides
    assert lines[0] == f"run {trained.run_dir}: started" and lines[-1].startswith(f"run {trained.run_dir}: completed")
    end = read_flow_run(trained.id).end_time
    arrived = [log.created for log in ours if log.message.startswith("round 1 ")]
    assert arrived and max(arrived) < end  # sent while the run went on, not all at its end
    assert not [log for log in logs if "Traceback" in log.message]


@pytest.mark.flow
def test_the_round_table_and_the_report_are_on_the_top_level_run(trained):
    table, report, summary = (
        artifacts(artifact_key(k, trained.name)) for k in ("round-table", "round-report", "round-summary")
    )
    for versions in (table, report, summary):  # one version for the flow run, updated after every round
        assert [str(a.flow_run_id) for a in versions] == [str(trained.id)]
    headers, rows = round_table_rows(trained.run_dir)
    assert json.loads(table[0].data) == [dict(zip(headers, row, strict=True)) for row in rows]
    assert [r["round"] for r in json.loads(table[0].data)] == ["0", "1", "2"]
    assert table[0].description == f"{trained.name}: rounds 0-2 ({trained.run_dir.resolve()})"
    # shown in markdown: an image artifact's page prints its URL, ~100 kB of base64 across the page (issue #54)
    assert report[0].type == "markdown" and report[0].data.startswith("![report.png after round 2](data:image/png;")
    assert f"Run folder: `{trained.run_dir.resolve()}`" in summary[0].data and "file://" not in summary[0].data
    assert "| update-policies | Completed |" in summary[0].data
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with get_client(sync_client=True) as client:
        name = FlowRunFilterName(any_=[f"{trained.name}-round-2"])
        (round_2,) = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=name))
    for versions in (table, report, summary):  # replaced, not updated: a card's "Created" is when it last changed
        assert versions[0].created > round_2.start_time


@pytest.mark.flow
def test_every_flow_run_of_the_run_carries_its_tag_and_its_page_lists_them(trained):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    tag = run_tag(trained.name)
    with get_client(sync_client=True) as client:
        tagged = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[tag])))
    assert sorted(r.name for r in tagged) == sorted(
        [trained.name, f"{trained.name}-round-1", f"{trained.name}-round-2"]
    )
    (page,) = artifacts(artifact_key("run", trained.name))
    assert str(page.flow_run_id) == str(trained.id)
    for run in tagged:  # a link into the UI that shows the artifact, to each of them
        assert f"[{run.name}](../../runs/flow-run/{run.id})" in page.data
    assert f"| [{trained.name}](../../runs/flow-run/{trained.id}) | Completed |" in page.data
    assert "runs?tags=run%3A" in page.data and "2 of 2 rounds begun (num_iterations 2 is the total)" in page.data


@pytest.mark.flow
def test_a_retry_of_the_flow_run_resumes_its_run_with_every_finished_stage_cached(trained):
    """Prefect's Retry puts the flow run back to AwaitingRetry; a worker then runs the same flow run again (its
    run_count 2): the run folder it created is resumed, not refused as "already exists"."""
    from prefect.client.orchestration import get_client
    from prefect.flow_engine import run_flow
    from prefect.states import AwaitingRetry

    assert read_flow_run(trained.id).labels[RUN_ID_LABEL] == read_run_id(RunPaths(trained.run_dir))
    table_before = artifacts(artifact_key("round-table", trained.name))
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(trained.id, AwaitingRetry(), force=True)
        again = client.read_flow_run(trained.id)
    state = run_flow(TRAINER_FLOWS["madpo_iter"], flow_run=again, return_type="state")
    assert state.is_completed(), state.message
    assert read_flow_run(trained.id).run_count == 2
    states = {(s["round"], s["stage"]): s["state"] for s in state.result()["stages"]}
    assert len(states) == 15 and set(states.values()) == {"Cached"}
    after = artifacts(artifact_key("round-table", trained.name))
    assert [(a.id, a.updated) for a in after] == [(a.id, a.updated) for a in table_before]  # nothing new to show


@pytest.mark.flow
def test_another_flow_run_never_takes_over_an_existing_run(trained):
    from pbrl.config import parse_job

    job = parse_job(
        {"trainer": "madpo_iter", "task": "toy", "agent_model": "tiny-random", "run_name": trained.name,
         "output_dir": str(trained.out)}
    )  # fmt: skip
    state = train_flow(job, return_state=True)
    assert state.is_failed()
    error = state.result(raise_on_failure=False)
    assert isinstance(error, ConfigError) and "already exists" in str(error)
    with pytest.raises(ConfigError, match="already exists"):  # a Python caller gets the error itself
        train_flow(job)


@pytest.mark.flow
def test_continue_adds_rounds_to_a_run_named_by_its_folder(trained):
    state = continue_run(run_name=trained.name, output_dir=str(trained.out), num_iterations=3, return_state=True)
    assert state.is_completed(), state.message
    states = {(s["round"], s["stage"]): s["state"] for s in state.result()["stages"]}
    assert {k: v for k, v in states.items() if k[0] < 3} == {k: "Cached" for k in states if k[0] < 3}
    assert {v for k, v in states.items() if k[0] == 3} == {"Completed"} and len(states) == 22
    assert json.loads((trained.run_dir / "run.json").read_text())["config"]["num_iterations"] == 3
    table = artifacts(artifact_key("round-table", trained.name))
    assert [str(a.flow_run_id) for a in table] == [str(trained.id), str(state.state_details.flow_run_id)]
    assert [r["round"] for r in json.loads(table[-1].data)] == ["0", "1", "2", "3"]
    assert read_flow_run(state.state_details.flow_run_id).name == f"{trained.name}-continue"
    assert run_tag(trained.name) in read_flow_run(state.state_details.flow_run_id).tags


@pytest.mark.flow
def test_continue_says_num_iterations_is_the_total_when_it_is_below_the_rounds_begun(trained):
    state = continue_run(run_name=trained.name, output_dir=str(trained.out), num_iterations=1, return_state=True)
    assert state.is_failed()
    assert "has begun 3 rounds, and num_iterations is the run's total number of rounds, not how many more: give 4" in (
        str(state.result(raise_on_failure=False))
    )


@pytest.mark.flow
def test_the_nightly_flow_adds_one_round(trained):
    from flows.training import add_iteration_flow

    state = add_iteration_flow(run_name=trained.name, output_dir=str(trained.out), return_state=True)
    assert state.is_completed(), state.message
    states = {(s["round"], s["stage"]): s["state"] for s in state.result()["stages"]}
    assert {v for k, v in states.items() if k[0] < 4} == {"Cached"} and {v for k, v in states.items() if k[0] == 4} == {
        "Completed"
    }


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_api")
def test_continue_of_a_folder_that_is_no_run_fails_once_with_the_reason(tmp_path):
    (tmp_path / "runs" / "mine").mkdir(parents=True)
    (tmp_path / "runs" / "mine" / "run.json").write_text("{}")  # what the list looks for: a folder with run.json
    state = continue_run(run_name="mien", output_dir=str(tmp_path / "runs"), return_state=True)
    assert state.is_failed() and state.message == "the run did not start: ConfigError, see the run's log"
    error = state.result(raise_on_failure=False)
    assert (
        f"run_name: got 'mien'; no run of that name in {tmp_path / 'runs'}; the runs in {tmp_path / 'runs'}: mine"
        in (str(error))
    )
    logs = run_logs(state.state_details.flow_run_id)
    assert [log.message for log in logs if log.level >= 40] == [
        f"the run did not start (nothing was computed): {error}"
    ]
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["mine"]


def _base_run(model_dir: Path, output_dir: Path) -> Path:
    from pbrl.config import parse_job
    from pbrl.run.folder import prepare_run

    job = {"trainer": "madpo", "task": "toy", "task_options": {"num_items": 2}, "agent_model": str(model_dir)}
    return prepare_run(parse_job({**job, "run_name": "base", "output_dir": str(output_dir)}), resume=False)


def test_more_rounds_only_for_an_iterative_run(tiny_model_dir, tmp_path):
    run_dir = _base_run(tiny_model_dir, tmp_path)
    assert reopen(run_dir).trainer == "madpo"
    with pytest.raises(ConfigError, match="trains one round; only the iterative trainers"):
        reopen(run_dir, 3)


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_api")
def test_the_nightly_flow_refuses_a_run_of_one_round_once(tiny_model_dir, tmp_path):
    from flows.training import add_iteration_flow

    _base_run(tiny_model_dir, tmp_path)
    state = add_iteration_flow(run_name="base", output_dir=str(tmp_path), return_state=True)
    assert state.is_failed() and "only iterative runs take more iterations" in str(state.result(raise_on_failure=False))
