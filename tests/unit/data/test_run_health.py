"""Issue #53.5: damaged runs look damaged. ``pbrl status`` and ``pbrl report`` verify what they show (outputs
against their manifests' hashes, Parquet readable, only this run's rounds) and name each damage with its fix; a
run folder moved while a stage writes into it fails naming it, leaving nothing under the old name; a busy run is
refused before Prefect starts."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

import stages.sample_candidates as sample_candidates
from flows.cache import run_recorded
from pbrl.cli.commands import app
from pbrl.data.storage import RunPaths, existing_rounds
from pbrl.errors import ArtifactError, ConfigError
from stages import STAGE_MODULES
from tests.helpers import new_run

runner = CliRunner()


@pytest.fixture(scope="module")
def scored(tiny_model_dir, tmp_path_factory):
    """A tiny run (2 iterations) with round 1 sampled and scored; each test works on its own copy."""
    run_dir, job = new_run(tiny_model_dir, tmp_path_factory.mktemp("health"))
    for stage in ("sample-candidates", "score-with-oracle"):
        STAGE_MODULES[stage].run(run_dir, 1, job)
    return run_dir


@pytest.fixture
def run(scored, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(scored, copy)
    return copy


def _status(run: Path):
    out = runner.invoke(app, ["status", str(run)], env={"COLUMNS": "250"})
    rows = {tuple(line.split("│")[1:4]) for line in out.output.splitlines() if line.count("│") >= 5}
    return out, {(r.strip(), s.strip(), st.strip()) for r, s, st in rows}


def test_an_intact_run_is_done_and_exits_0(run):
    out, rows = _status(run)
    assert out.exit_code == 0, out.output
    assert ("1", "score-with-oracle", "done") in rows and "damaged" not in out.output


def test_a_truncated_parquet_file_is_damaged_with_the_command_that_writes_it_again(run):
    scores = RunPaths(run).scores(1)
    scores.write_bytes(scores.read_bytes()[:-100])
    out, rows = _status(run)
    assert out.exit_code == 1
    assert ("1", "score-with-oracle", "damaged") in rows and ("1", "sample-candidates", "done") in rows
    text = " ".join(out.output.split())
    assert "rounds/0001/scores.parquet: truncated or damaged: not a readable Parquet file" in text
    assert f"pbrl stage score-with-oracle --run {run} --round 1 --force" in text


def test_an_output_changed_since_its_manifest_is_damaged_though_it_still_reads(run):
    candidates = RunPaths(run).candidates(1)
    table = pq.read_table(candidates)
    pq.write_table(table, candidates, compression="gzip")  # the same rows, other bytes
    out, rows = _status(run)
    assert out.exit_code == 1 and ("1", "sample-candidates", "damaged") in rows
    text = " ".join(out.output.split())
    assert "rounds/0001/candidates.parquet: changed since its stage wrote it" in text and "truncated" not in text
    report = runner.invoke(app, ["report", str(run)], env={"COLUMNS": "250"})
    assert "damaged: rounds/0001/candidates.parquet" in " ".join(report.output.split())


def test_folders_that_are_no_round_of_the_run_are_not_listed_and_are_named(run):
    rounds = run / "rounds"
    shutil.copytree(rounds / "0001", rounds / "0099")  # past the run's 2 rounds
    shutil.copytree(rounds / "0001", rounds / "0001.bak")
    (rounds / "notes.txt").write_text("mine")
    shutil.copytree(rounds / "0001", rounds / "0002")  # a round of the run, holding round 1's manifests
    assert existing_rounds(RunPaths(run)) == [1, 2]
    out, rows = _status(run)
    assert out.exit_code == 1
    assert not any(r == "99" for r, _, _ in rows) and ("2", "sample-candidates", "damaged") in rows
    text = " ".join(out.output.split())
    for entry in ("rounds/0001.bak", "rounds/0099", "rounds/notes.txt"):
        assert f"{entry}: not a round of this run (rounds 0..2)" in text
    assert "rounds/0002/sample-candidates.manifest.json: records sample-candidates of round 1: copied" in text


def test_a_run_folder_moved_while_a_stage_writes_fails_naming_it_and_leaves_no_phantom(run, monkeypatch):
    """Issue #53.5: the stage failed with a misleading error and wrote a new folder under the old name."""
    from pbrl.run.folder import open_job

    job = open_job(run)
    moved = run.with_name("moved")
    real = sample_candidates.generate

    def move_then_generate(*args, **kwargs):
        if run.exists():
            run.rename(moved)
        return real(*args, **kwargs)

    monkeypatch.setattr(sample_candidates, "generate", move_then_generate)
    with pytest.raises(ArtifactError, match=f"{run}: the run folder is gone .*pbrl train --resume"):
        run_recorded("sample-candidates", run, 1, job)  # as every front end runs a stage
    assert not run.exists() and (moved / "run.json").is_file()


def test_a_busy_run_is_refused_before_prefect_starts(run, monkeypatch):
    """Issue #53.5: the second process was refused only after it had started its own Prefect server (20-40 s)."""
    from pbrl import orchestration
    from pbrl.run.folder import open_job
    from pbrl.trainers import trainer as trainers

    ready = run.parent / "held"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import pathlib, time\nfrom pbrl.run.folder import run_lock\n"
            f"with run_lock(pathlib.Path({str(run)!r})):\n"
            f"    pathlib.Path({str(ready)!r}).touch()\n    time.sleep(60)\n",
        ],
        cwd=Path(__file__).parents[3],
    )
    started: list[str] = []
    monkeypatch.setattr(orchestration, "_api_after_imports", lambda: started.append("prefect") or _no_block())
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        with pytest.raises(ConfigError, match=f"in use by process {holder.pid}"):
            orchestration.train(open_job(run), resume=True, run_dir=run)
        with pytest.raises(ConfigError, match=f"in use by process {holder.pid}"):
            orchestration.rerun_stage("evaluate", run, 0)
        prepared: list[Path] = []
        monkeypatch.setattr(trainers, "prepare_run", lambda *a, **k: prepared.append(a[0]))
        trainer = trainers.MADPOIterTrainer(
            agent_model=open_job(run).agent_model, task="toy", run_name=run.name, output_dir=run.parent, resume=True
        )
        with pytest.raises(ConfigError, match=f"in use by process {holder.pid}"):
            trainer.train()
        assert started == [] and prepared == []
    finally:
        holder.kill()
        holder.wait()


def _no_block():
    import contextlib

    return contextlib.nullcontext()
