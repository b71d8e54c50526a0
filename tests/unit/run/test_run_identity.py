"""A run is its folder (issue #16, item 5): its identity is the UUID in run.json, never a path, so a run
folder that is copied or moved resumes where it is, with every finished stage Cached.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pbrl.cli.commands import app
from pbrl.data.replay_store import check_owned
from pbrl.data.storage import RunPaths, read_states
from pbrl.errors import ConfigError
from pbrl.run.folder import open_job, run_dir_for, write_run_json
from tests.helpers import new_run, tiny_job

ROUND_STAGES = (
    "sample-candidates",
    "score-with-oracle",
    "build-pairs",
    "store-round",
    "replay-select",
    "update-policies",
    "evaluate",
)


def manifest_bytes(run_dir: Path) -> dict[str, bytes]:
    return {p.relative_to(run_dir).as_posix(): p.read_bytes() for p in sorted(run_dir.rglob("*.manifest.json"))}


# ---------------------------------------------------------------------------------------------- run.json
def test_run_json_holds_a_run_id_and_no_path_of_the_run(tiny_model_dir, tmp_path):
    run_dir, _ = new_run(tiny_model_dir, tmp_path)
    text = RunPaths(run_dir).run_json.read_text()
    assert uuid.UUID(json.loads(text)["run_id"]).version == 4
    assert str(tmp_path) not in text  # neither the folder nor output_dir (absolute here) is stored


def test_open_job_places_the_job_where_the_folder_is_now(tiny_model_dir, tmp_path):
    run_dir, job = new_run(tiny_model_dir, tmp_path / "a")
    moved = tmp_path / "b" / "renamed"
    shutil.copytree(run_dir, moved)
    opened = open_job(moved)
    assert (opened.output_dir, opened.run_name) == (str(tmp_path / "b"), "renamed")
    assert run_dir_for(opened) == moved
    assert opened.model_dump(exclude={"output_dir", "run_name"}) == job.model_dump(exclude={"output_dir", "run_name"})


def test_run_json_without_an_id_gets_one_and_keeps_its_replay_index(tiny_model_dir, tmp_path):
    """Runs made before run ids named their replay index ``<absolute folder>@<created_at>``."""
    run_dir, job = new_run(tiny_model_dir, tmp_path)
    paths = RunPaths(run_dir)
    stored = json.loads(paths.run_json.read_text())
    del stored["run_id"]
    paths.run_json.write_text(json.dumps(stored))
    replay = run_dir / "replay"
    replay.mkdir(exist_ok=True)
    (replay / "index.json").write_text(json.dumps({"run": f"/old/place/run@{stored['created_at']}", "rounds": []}))
    write_run_json(paths, job)  # what a resume does
    run_id = json.loads(paths.run_json.read_text())["run_id"]
    assert uuid.UUID(run_id)
    assert json.loads((replay / "index.json").read_text())["run"] == run_id
    assert check_owned(replay, run_id) == {"run": run_id, "rounds": []}
    write_run_json(paths, job)  # and the id stays
    assert json.loads(paths.run_json.read_text())["run_id"] == run_id


def test_replay_index_of_another_run_is_not_adopted(tiny_model_dir, tmp_path):
    run_dir, job = new_run(tiny_model_dir, tmp_path)
    paths = RunPaths(run_dir)
    stored = json.loads(paths.run_json.read_text())
    del stored["run_id"]
    paths.run_json.write_text(json.dumps(stored))
    replay = run_dir / "replay"
    replay.mkdir(exist_ok=True)
    (replay / "index.json").write_text(json.dumps({"run": "/elsewhere/other@2020-01-01T00:00:00+00:00", "rounds": []}))
    write_run_json(paths, job)
    with pytest.raises(ConfigError, match="holds the replay files of another run"):
        check_owned(replay, json.loads(paths.run_json.read_text())["run_id"])


# ---------------------------------------------------------------------------------------------- moved runs
@pytest.fixture(scope="module")
def finished_run(tiny_model_dir, tmp_path_factory, prefect_api) -> Path:
    """A finished one-iteration run: round-0 evaluation and round 1."""
    from flows.training import train_flow

    job = tiny_job(tiny_model_dir, tmp_path_factory.mktemp("finished"), num_iterations=1)
    return Path(train_flow(job)["run_dir"])


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_api")
def test_moved_run_resumes_where_it_is_with_every_stage_cached(finished_run, tmp_path):
    """Before the fix, ``--run <moved> --resume`` built a brand-new run at the old output_dir/run_name."""
    shutil.copytree(finished_run, tmp_path / "a" / "run")
    shutil.move(tmp_path / "a" / "run", tmp_path / "b" / "moved")
    moved = tmp_path / "b" / "moved"
    before, run_json = manifest_bytes(moved), json.loads((moved / "run.json").read_text())
    out = CliRunner().invoke(app, ["train", "--run", str(moved), "--resume"])
    assert out.exit_code == 0, out.output
    assert not (tmp_path / "a" / "run").exists()  # nothing built at the old place
    assert {s: v["state"] for s, v in read_states(moved, 0).items()} == {"evaluate": "Cached"}
    assert {s: v["state"] for s, v in read_states(moved, 1).items()} == dict.fromkeys(ROUND_STAGES, "Cached")
    assert manifest_bytes(moved) == before  # nothing recomputed
    assert json.loads((moved / "run.json").read_text())["run_id"] == run_json["run_id"]


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_api")
def test_copied_run_takes_stage_commands(finished_run, tmp_path):
    """Before the fix, ``pbrl stage ... --run <copy>`` said the copy held the replay files of another run."""
    copy = tmp_path / "copy"
    shutil.copytree(finished_run, copy)
    original_index = (finished_run / "replay" / "index.json").read_bytes()
    runner = CliRunner()
    out = runner.invoke(app, ["stage", "score-with-oracle", "--run", str(copy), "--round", "1"])
    assert out.exit_code == 0, out.output
    assert "Cached" in out.output
    out = runner.invoke(app, ["stage", "store-round", "--run", str(copy), "--round", "1", "--force"])
    assert out.exit_code == 0, out.output
    assert "recomputed" in out.output
    run_id = json.loads((copy / "run.json").read_text())["run_id"]
    assert json.loads((copy / "replay" / "index.json").read_text())["run"] == run_id
    assert (finished_run / "replay" / "index.json").read_bytes() == original_index  # the original is untouched
