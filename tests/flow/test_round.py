"""Prefect orchestration on the tiny model: caching on content, retries, one-stage reruns, deployments.

All tests share one Prefect test server (the session fixture ``prefect_api``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file, save_file

from flows.round import call_stage, round_flow
from pbrl.data.storage import RunPaths
from pbrl.errors import OracleError, TransientError
from stages import STAGE_MODULES
from tests.helpers import CONSTANT_REWARD, new_run

pytestmark = [pytest.mark.flow, pytest.mark.usefixtures("prefect_api")]


def executed(states: list[dict]) -> set[str]:
    return {s["stage"] for s in states if s["state"] != "Cached"}


def test_round_caching_follows_file_contents(tiny_model_dir, tmp_path):
    run_dir, job = new_run(tiny_model_dir, tmp_path)
    paths = RunPaths(run_dir)
    first = round_flow(str(run_dir), "run", 1, job)
    assert executed(first) == {
        "sample-candidates",
        "score-with-oracle",
        "build-pairs",
        "store-round",
        "replay-select",
        "update-policies",
        "evaluate",
    }
    _assert_round_artifacts(run_dir, round_index=1)
    # Same round again: nothing executes.
    assert executed(round_flow(str(run_dir), "run", 1, job)) == set()
    # A deleted output reruns its stage; the rebuilt file is identical, so nothing downstream runs.
    paths.pairs(1).unlink()
    assert executed(round_flow(str(run_dir), "run", 1, job)) == {"build-pairs"}
    # A changed (tampered) output reruns its stage, which restores it.
    scores = pq.read_table(paths.scores(1))
    import pyarrow.compute as pc

    pq.write_table(scores.set_column(4, "reward", pc.add(scores.column("reward"), 1.0)), paths.scores(1))
    assert executed(round_flow(str(run_dir), "run", 1, job)) == {"score-with-oracle"}
    # Round 2 samples from round 1's checkpoint; a changed checkpoint at the same path reruns sampling.
    round_flow(str(run_dir), "run", 2, job)
    weights = paths.round_checkpoint(1) / "agent_0" / "model.safetensors"
    tensors = load_file(weights)
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 0.5
    save_file(tensors, weights, metadata={"format": "pt"})
    again = round_flow(str(run_dir), "run", 2, job)
    assert "sample-candidates" in executed(again)


def _assert_round_artifacts(run_dir: Path, round_index: int) -> None:
    """The run's round table (as ``pbrl train`` prints it), report and summary, keyed by the run's name
    (flows/artifacts.py); other tests' runs named "run" share the keys, so this run's are told by its folder."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        by_key = {
            key: client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
            for key in ("round-table-run", "round-summary-run", "round-report-run")
        }  # keys carry the run's name
    root = str(Path(run_dir).resolve())
    table = [a for a in by_key["round-table-run"] if root in a.description]
    summary = [a for a in by_key["round-summary-run"] if root in a.data]
    assert table and table[-1].type == "table" and f"run: round {round_index} " in table[-1].description
    rows = json.loads(table[-1].data) if isinstance(table[-1].data, str) else table[-1].data
    assert rows[-1]["round"] == str(round_index) and len(rows[-1]) > 3
    assert summary and "update-policies" in summary[-1].data
    report = [a for a in by_key["round-report-run"] if root in a.data]
    assert report and report[-1].data.startswith(f"![report.png after round {round_index}](data:image/png;base64,")


def test_changed_train_item_reruns_every_downstream_stage(tiny_model_dir, tmp_path):
    run_dir, job = new_run(tiny_model_dir, tmp_path)
    paths = RunPaths(run_dir)
    round_flow(str(run_dir), "run", 1, job)
    items = pq.read_table(paths.items).to_pylist()
    items[0]["data"] = json.dumps({**json.loads(items[0]["data"]), "topic": "a brand new topic"})
    pq.write_table(pq.read_table(paths.items).from_pylist(items, pq.read_table(paths.items).schema), paths.items)
    assert executed(round_flow(str(run_dir), "run", 1, job)) == {
        "sample-candidates",
        "score-with-oracle",
        "build-pairs",
        "store-round",
        "replay-select",
        "update-policies",
        "evaluate",
    }


def test_transient_oracle_failure_is_retried(tiny_model_dir, tmp_path, monkeypatch):
    run_dir, job = new_run(tiny_model_dir, tmp_path)
    call_stage("sample-candidates", str(run_dir), 1, job)
    module = STAGE_MODULES["score-with-oracle"]
    real, calls = module.run, []

    def flaky(*args):
        calls.append(1)
        if len(calls) == 1:
            raise TransientError("judge timed out")
        return real(*args)

    monkeypatch.setattr(module, "run", flaky)
    out = call_stage("score-with-oracle", str(run_dir), 1, job)
    assert out["state"] == "Completed" and len(calls) == 2


def test_non_transient_oracle_failure_is_not_retried(tiny_model_dir, tmp_path, monkeypatch):
    run_dir, job = new_run(tiny_model_dir, tmp_path)
    call_stage("sample-candidates", str(run_dir), 1, job)
    module = STAGE_MODULES["score-with-oracle"]
    calls = []

    def broken(*args):
        calls.append(1)
        raise OracleError("items: toy-000 (3)")

    monkeypatch.setattr(module, "run", broken)
    with pytest.raises(OracleError):
        call_stage("score-with-oracle", str(run_dir), 1, job)
    assert len(calls) == 1
    states = json.loads((RunPaths(run_dir).round_dir(1) / ".states.json").read_text())
    assert states["score-with-oracle"]["state"] == "Failed"


def test_stage_command_reports_cached_then_recomputed(tiny_model_dir, tmp_path):
    from typer.testing import CliRunner

    from pbrl.cli.commands import app

    run_dir, job = new_run(tiny_model_dir, tmp_path)
    round_flow(str(run_dir), "run", 1, job)
    runner = CliRunner()
    out = runner.invoke(app, ["stage", "score-with-oracle", "--run", str(run_dir), "--round", "1"])
    assert out.exit_code == 0, out.output
    assert "Cached" in out.output
    out = runner.invoke(app, ["stage", "score-with-oracle", "--run", str(run_dir), "--round", "1", "--force"])
    assert out.exit_code == 0 and "recomputed" in out.output
    out = runner.invoke(app, ["stage", "build-pairs", "--run", str(run_dir), "--round", "1", "--no-prefect"])
    assert out.exit_code == 0 and "no Prefect" in out.output
    out = runner.invoke(app, ["status", str(run_dir)])
    assert out.exit_code == 0 and "update-policies" in out.output


def test_deployments_register_with_utc_cron_and_typed_parameters():
    from prefect.client.orchestration import get_client

    from tests.helpers import register_deployments

    ids = register_deployments(nightly_run="docs-1", cron="30 3 * * *")
    train_id, nightly_id = ids["pbrl-train/train"], ids["pbrl-add-iteration/nightly"]
    with get_client(sync_client=True) as client:
        nightly = client.read_deployment(nightly_id)
        schedule = nightly.schedules[0].schedule
        assert schedule.cron == "30 3 * * *" and schedule.timezone == "UTC"
        assert nightly.parameters == {"run_name": "docs-1", "output_dir": "storage/runs"}
        assert nightly.global_concurrency_limit.limit == 1
        train = client.read_deployment(train_id)
        schema = train.parameter_openapi_schema
        assert "config" in schema["properties"]
        text = json.dumps(schema)
        assert "preference_replay_mode" in text and "dpo_beta" in text
        client.create_flow_run_from_deployment(
            train_id,
            parameters={
                "config": {"trainer": "madpo_iter", "task": "toy", "agent_model": "tiny-random", "run_name": "ok"}
            },
        )
        with pytest.raises(Exception, match="(?i)validation"):
            client.create_flow_run_from_deployment(
                train_id,
                parameters={
                    "config": {"trainer": "madpo_iter", "task": "toy", "agent_model": "tiny-random", "dpo_beta": "high"}
                },
            )


def test_round_without_pairs_skips_update(tiny_model_dir, tmp_path):
    run_dir, job = new_run(tiny_model_dir, tmp_path, reward_func=CONSTANT_REWARD, task_options={})
    states = round_flow(str(run_dir), "run", 1, job)
    update = next(s for s in states if s["stage"] == "update-policies")
    assert update["manifest"]["counts"]["pairs"] == 0
    assert not RunPaths(run_dir).round_checkpoint(1).exists()
    shutil.rmtree(run_dir)
