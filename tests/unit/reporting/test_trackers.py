"""``report_to`` (issue #32): TensorBoard, MLflow, W&B (offline) and trackio follow a run; the values are read back with
the tools' own readers; a resumed run, killed or not, stays one tracked run and logs each step and round once."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from pbrl.data.storage import write_json
from pbrl.errors import ConfigError
from pbrl.reporting import tracker_tools
from pbrl.reporting.tracker_tools import tracker_problems
from pbrl.reporting.trackers import RunTracker, flat_params
from pbrl.run.progress import Event

ROOT = Path(__file__).resolve().parents[3]
TINY_ARGS = dict(
    num_iterations=2, preference_num_candidates=3, preference_pairs_per_sample=2, max_new_tokens=8, temperature=1.0,
    top_p=1.0, agent_learning_rate=1e-3, eval_num_samples=2, train_batch_size=2, logging_steps=1,
)  # fmt: skip


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of a TensorBoard log folder (all its event files), read with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def mlflow_runs(run_dir: Path):
    """The MLflow runs of the run folder's local store (experiment ``pbrl``), read with MLflow's client."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{(run_dir / 'mlruns' / 'mlflow.db').resolve()}")
    experiment = client.get_experiment_by_name("pbrl")
    return client, client.search_runs([experiment.experiment_id])


def fake_run(folder: Path, report_to: list[str]) -> Path:
    """A run folder holding only what trackers read: run.json (run id and config)."""
    folder.mkdir(parents=True)
    config = {"trainer": "madpo_iter", "seed": 0, "num_iterations": 2, "report_to": report_to, "task_options": {"n": 4}}
    write_json(folder / "run.json", {"run_id": str(uuid.uuid4()), "config": config})
    return folder


def replay(tracker: RunTracker, run_dir: Path, rounds: int = 2, steps: int = 3) -> None:
    """The events of a run with ``rounds`` rounds of ``steps`` logged update steps each."""
    where = str(run_dir)
    tracker.on_run_start(Event("run_start", where))
    tracker.on_round_end(Event("round_end", where, 0, metrics={"eval_reward": 0.25, "eval_lo": 0.1, "eval_hi": 0.4}))
    for r in range(1, rounds + 1):
        for step in range(1, steps + 1):
            metrics = {"madpo/loss": 1.0 / (r * 10 + step), "madpo/accuracy": 0.5}
            tracker.on_log(Event("log", where, r, "update-policies", step=step, env_step=4 * step, metrics=metrics))
        tracker.on_round_end(Event("round_end", where, r, metrics={"eval_reward": 0.25 + r / 10, "paired": r / 10}))
    tracker.on_run_end(Event("run_end", where, state="Completed"))


# ---------------------------------------------------------------------------------------------- checks at start
def test_a_missing_tracker_package_is_one_clear_problem(monkeypatch):
    real = tracker_tools.importlib.util.find_spec
    monkeypatch.setattr(
        tracker_tools.importlib.util, "find_spec", lambda name: None if name == "mlflow" else real(name)
    )
    problems = tracker_problems(["tensorboard", "mlflow", "mlflow"])
    assert len(problems) == 1 and problems[0].field == "report_to" and problems[0].value == "mlflow"
    assert "pip install 'pbrl[tracking]'" in problems[0].message and "mlflow-skinny==3.17.2" in problems[0].message
    with pytest.raises(ConfigError, match="report_to: got 'mlflow'; needs the mlflow package"):
        tracker_tools.require_trackers("mlflow")


def test_wandb_online_without_a_key_is_refused_and_offline_needs_none(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no W&B settings
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    (problem,) = tracker_problems("wandb")
    assert "WANDB_MODE=offline" in problem.message and "wandb login" in problem.message
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert tracker_problems("wandb") == []


def test_the_config_is_logged_as_flat_hyper_parameters():
    params = flat_params({"seed": 0, "task_options": {"n": 4, "split": "a"}, "agents": ["x", "y"], "lora_r": None})
    assert params == {
        "seed": 0,
        "task_options.n": 4,
        "task_options.split": "a",
        "agents": '["x", "y"]',
        "lora_r": "null",
    }


# ---------------------------------------------------------------------------------------------- without a flow
def test_a_resumed_tracker_logs_each_step_and_round_once(tmp_path):
    run_dir = fake_run(tmp_path / "run", ["tensorboard"])
    replay(RunTracker(run_dir), run_dir, rounds=1)
    replay(RunTracker(run_dir), run_dir, rounds=2)  # a resume: round 1 again (Cached), then round 2
    series = scalars(run_dir / "tensorboard")
    assert [s for s, _ in series["round/eval_reward"]] == [0, 1, 2]
    assert [s for s, _ in series["train/madpo/loss"]] == [1, 2, 3, 4, 5, 6]  # train/global_step: each step once
    assert [v for _, v in series["train/round"]] == [1, 1, 1, 2, 2, 2]
    state = json.loads((run_dir / "tracking.json").read_text())
    assert state["global_step"] == 6 and state["steps"] == {"1/update-policies": 3, "2/update-policies": 3}


def test_two_front_ends_wiring_one_run_share_its_tracker_and_log_once(tmp_path):
    run_dir = fake_run(tmp_path / "run", ["tensorboard"])
    first, second = RunTracker.for_run(run_dir), RunTracker.for_run(tmp_path / "run" / ".." / "run")
    assert first is second
    event = Event("log", str(run_dir), 1, "update-policies", step=1, metrics={"madpo/loss": 0.5})
    first.on_run_start(Event("run_start", str(run_dir)))
    first.on_log(event)
    second.on_log(event)  # the same event heard through a second subscription
    first.on_run_end(Event("run_end", str(run_dir), state="Completed"))
    assert scalars(run_dir / "tensorboard")["train/madpo/loss"] == [(1, 0.5)]


def test_wandb_offline_writes_its_run_files_and_a_resume_keeps_the_run_id(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    run_dir = fake_run(tmp_path / "run", ["wandb"])
    replay(RunTracker(run_dir), run_dir, rounds=1)
    run_id = json.loads((run_dir / "tracking.json").read_text())["trackers"]["wandb"]["id"]
    replay(RunTracker(run_dir), run_dir, rounds=2)
    folders = sorted((run_dir / "wandb").glob("offline-run-*"))
    # one W&B run, resumed; a resume in the same second as the start gets the folder name with "-1" added
    assert folders and all(re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?", f.name) for f in folders)
    assert all((f / f"run-{run_id}.wandb").stat().st_size > 0 for f in folders)


def test_trackio_keeps_one_run_with_every_round(tmp_path):
    """In a child process: trackio reads TRACKIO_DIR when it is imported."""
    pytest.importorskip("trackio")
    run_dir = fake_run(tmp_path / "run", ["trackio"])
    script = textwrap.dedent(f"""
        from pathlib import Path
        from tests.unit.reporting.test_trackers import replay
        from pbrl.reporting.trackers import RunTracker
        run_dir = Path({str(run_dir)!r})
        replay(RunTracker(run_dir), run_dir, rounds=1)
        replay(RunTracker(run_dir), run_dir, rounds=2)
        from trackio.sqlite_storage import SQLiteStorage
        print("RUNS", SQLiteStorage.get_runs("pbrl"))
        logs = SQLiteStorage.get_logs("pbrl", "run")
        print("ROUNDS", sorted(row["step"] for row in logs if "round/eval_reward" in row))
    """)
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    found = [line for line in out.stdout.splitlines() if line.startswith(("RUNS", "ROUNDS"))]
    assert found == ["RUNS ['run']", "ROUNDS [0, 1, 2]"], out.stdout


# ---------------------------------------------------------------------------------------------- through the flows
@pytest.fixture(scope="module")
def tracked_run(tiny_model_dir, tmp_path_factory, prefect_api):
    """A 2-round tiny run with report_to tensorboard and mlflow, and every log event it published."""
    from pbrl.run import progress
    from pbrl.trainers import MADPOIterConfig, MADPOIterTrainer

    heard: list[Event] = []
    stop = progress.subscribe(heard.append)
    try:
        result = MADPOIterTrainer(
            args=MADPOIterConfig(**TINY_ARGS), agent_model=str(tiny_model_dir), task="toy",
            task_options={"num_items": 4}, report_to=["tensorboard", "mlflow"], run_name="tracked",
            output_dir=tmp_path_factory.mktemp("tracked"),
        ).train()  # fmt: skip
    finally:
        stop()
    return result, [e for e in heard if e.kind == "log"]


@pytest.mark.flow
def test_tracked_values_read_back_with_tensorboard_and_mlflow(tracked_run):
    result, logs = tracked_run
    losses = [e for e in logs if "madpo/loss" in e.metrics]
    table = result.rounds
    assert list(table.index) == [0, 1, 2] and losses

    series = scalars(result.run_dir / "tensorboard")
    assert [s for s, _ in series["round/eval_reward"]] == [0, 1, 2]
    assert [v for _, v in series["round/eval_reward"]] == pytest.approx(list(table["eval_reward"]))
    assert [v for _, v in series["round/paired"]] == pytest.approx(list(table["paired"].dropna()))
    assert [v for _, v in series["train/madpo/loss"]] == pytest.approx([e.metrics["madpo/loss"] for e in losses])
    assert [s for s, _ in series["train/madpo/loss"]] == list(range(1, len(losses) + 1))

    client, runs = mlflow_runs(result.run_dir)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED" and runs[0].info.run_name == "tracked"
    run_id = runs[0].info.run_id
    history = client.get_metric_history(run_id, "round/eval_reward")
    history = sorted((m.step, m.value) for m in history)
    assert [s for s, _ in history] == [0, 1, 2]
    assert [v for _, v in history] == pytest.approx(list(table["eval_reward"]))
    assert len(client.get_metric_history(run_id, "train/madpo/loss")) == len(losses)
    assert runs[0].data.params["num_iterations"] == "2" and runs[0].data.params["lora_r"] == "null"
    assert "report.png" in [a.path for a in client.list_artifacts(run_id)]


@pytest.mark.flow
def test_a_cached_rerun_and_a_changed_report_to_stay_one_tracked_run(tracked_run, tiny_model_dir):
    from pbrl.trainers import MADPOIterConfig, MADPOIterTrainer

    result, logs = tracked_run
    before = scalars(result.run_dir / "tensorboard")
    again = MADPOIterTrainer(
        args=MADPOIterConfig(**TINY_ARGS), agent_model=str(tiny_model_dir), task="toy", task_options={"num_items": 4},
        report_to=["mlflow", "tensorboard"], run_name="tracked", output_dir=result.run_dir.parent, resume=True,
    ).train()  # fmt: skip
    assert {s["state"] for s in again.stages} == {"Cached"}  # report_to keys no cache (here its order changed)
    assert scalars(result.run_dir / "tensorboard") == before  # nothing logged twice
    _, runs = mlflow_runs(result.run_dir)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"


KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import pbrl.models.policies as up
    from pbrl.trainers import MADPOIterConfig, MADPOIterTrainer
    from tests.unit.reporting.test_trackers import TINY_ARGS

    real = up.save_training_state
    def save_then_die(policy, agent_dir):
        real(policy, agent_dir)
        if "round_0002" in str(agent_dir):  # the checkpoint's temporary folder .tmp-round_0002.*
            os.kill(os.getpid(), signal.SIGKILL)   # mid update-policies of round 2, after its steps were logged
    up.save_training_state = save_then_die
    MADPOIterTrainer(
        args=MADPOIterConfig(**TINY_ARGS), agent_model=sys.argv[1], task="toy", task_options={"num_items": 4},
        report_to=["tensorboard", "mlflow"], run_name="killed", output_dir=sys.argv[2],
    ).train()
""")


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_api")
def test_a_killed_and_resumed_run_is_one_tracked_run(tiny_model_dir, tmp_path):
    from prefect.settings import PREFECT_API_URL

    from pbrl.trainers import MADPOIterConfig, MADPOIterTrainer

    script = tmp_path / "kill.py"
    script.write_text(KILL_SCRIPT)
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(script), str(tiny_model_dir), str(tmp_path)],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert proc.returncode == -9, proc.stderr[-3000:]
    run_dir = tmp_path / "killed"
    state = json.loads((run_dir / "tracking.json").read_text())
    _, runs = mlflow_runs(run_dir)
    assert [r.info.run_id for r in runs] == [state["trackers"]["mlflow"]["run_id"]] and runs[0].info.status == "RUNNING"
    logged_before = state["steps"]["2/update-policies"]  # round 2's steps were logged before the kill

    result = MADPOIterTrainer(
        args=MADPOIterConfig(**TINY_ARGS), agent_model=str(tiny_model_dir), task="toy", task_options={"num_items": 4},
        report_to=["tensorboard", "mlflow"], run_name="killed", output_dir=tmp_path, resume=True,
    ).train()  # fmt: skip
    states = {(s["round"], s["stage"]): s["state"] for s in result.stages}
    assert states[(2, "update-policies")] == "Completed"  # the killed stage ran again
    client, runs = mlflow_runs(run_dir)
    assert len(runs) == 1 and runs[0].info.run_id == state["trackers"]["mlflow"]["run_id"]
    assert runs[0].info.status == "FINISHED"
    history = client.get_metric_history(runs[0].info.run_id, "round/eval_reward")
    assert sorted(m.step for m in history) == [0, 1, 2]  # every round once
    series = scalars(run_dir / "tensorboard")
    steps = [s for s, _ in series["train/madpo/loss"]]
    assert steps == list(range(1, len(steps) + 1)) and logged_before >= 1  # each step once, in order
    assert [s for s, _ in series["round/eval_reward"]] == [0, 1, 2]


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_api")
def test_a_run_started_as_the_ui_starts_it_is_tracked(tiny_model_dir, tmp_path):
    """A run from a deployment's form (the training flow called with the job as a mapping) follows report_to too:
    the flow itself attaches the run's trackers, not only the trainers and the CLI."""
    from flows.training import train_flow

    job = {
        "trainer": "madpo_iter", "task": "toy", "task_options": {"num_items": 4}, "agent_model": str(tiny_model_dir),
        **TINY_ARGS, "num_iterations": 1, "report_to": ["tensorboard"], "run_name": "from-ui",
        "output_dir": str(tmp_path),
    }  # fmt: skip
    out = train_flow(config=job)
    series = scalars(Path(out["run_dir"]) / "tensorboard")
    assert [s for s, _ in series["round/eval_reward"]] == [0, 1] and series["train/madpo/loss"]
    assert json.loads((tmp_path / "from-ui" / "tracking.json").read_text())["trackers"]["tensorboard"]
