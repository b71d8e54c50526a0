"""End-to-end training runs on the tiny model: the CLI, the Python API, resume after SIGKILL, replay."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from pbrl import orchestration
from pbrl.cli.commands import app
from pbrl.config import load_job, split_job
from pbrl.data.storage import RunPaths
from pbrl.reporting.metrics import metrics_frame
from pbrl.trainers import MADPOIterTrainer, MADPOTrainer
from tests.helpers import assert_same_artifacts, constant_reward, run_artifacts

pytestmark = [pytest.mark.flow, pytest.mark.usefixtures("prefect_api")]

ROOT = Path(__file__).resolve().parents[2]
ITER_YAML = ROOT / "flows" / "configs" / "tiny-madpo-iter.yaml"
ROUND_STAGES = [
    "sample-candidates",
    "score-with-oracle",
    "build-pairs",
    "store-round",
    "replay-select",
    "update-policies",
    "evaluate",
]


def test_cli_train_leaves_complete_run_folder_and_api_matches(tmp_path):
    result = CliRunner().invoke(app, ["train", str(ITER_YAML), "--set", f"output_dir={tmp_path}"])
    assert result.exit_code == 0, result.output
    run_dir = tmp_path / "tiny-madpo-iter"
    paths = RunPaths(run_dir)
    assert "report:" in result.output and (run_dir / "report.png").stat().st_size > 0
    stored = json.loads(paths.run_json.read_text())
    assert stored["config"]["trainer"] == "madpo_iter" and stored["seed"] == 0
    assert pq.read_table(paths.items).num_rows > 0
    assert (paths.eval(0)).is_file() and paths.manifest(0, "evaluate").is_file()
    for r in (1, 2):
        for stage in ROUND_STAGES:
            assert paths.manifest(r, stage).is_file(), (r, stage)
        for f in (paths.candidates(r), paths.scores(r), paths.pairs(r), paths.selected_pairs(r), paths.eval(r)):
            assert f.is_file()
        assert (run_dir / "replay" / f"iteration_{r:04d}.json").is_file()
        assert (paths.round_checkpoint(r) / "trainer_state.json").is_file()
    assert sorted(p.name for p in paths.initial.iterdir()) == ["agent_0", "agent_1"]
    metrics = set(metrics_frame(run_dir)["metric"])
    for name in (
        "turn_1/reward_mean",
        "turn_1/expected_return",
        "madpo/loss",
        "madpo/accuracy",
        "madpo/margin_mean",
        "madpo/margin_agent_0",
        "madpo/skipped_steps",
        "pairs/count",
        "eval/turn_1/reward_mean",
        "iter/train_preference_pairs",
        "time/update-policies_seconds",
    ):
        assert name in metrics, name

    # The Python API on the same configuration gives the same run folder contents.
    run, trainer_config = split_job(load_job(ITER_YAML))
    api = MADPOIterTrainer(
        trainer_config, task=run.task, agent_model=run.agent_model, run_name="api", output_dir=str(tmp_path)
    ).train()
    assert api.run_dir == tmp_path / "api" and list(api.rounds.index) == [0, 1, 2]
    assert_same_artifacts(run_artifacts(run_dir), run_artifacts(api.run_dir))


def test_base_trainer_with_all_ties_ends_without_update(tmp_path):
    run, config = split_job(load_job(ROOT / "flows" / "configs" / "tiny-madpo.yaml"))
    result = MADPOTrainer(
        config,
        task="toy",
        reward_func=constant_reward,
        agent_model=run.agent_model,
        run_name="ties",
        output_dir=str(tmp_path),
    ).train()
    assert any("every comparison tied" in m for m in result.messages)
    assert not RunPaths(result.run_dir).round_checkpoint(1).exists()
    assert json.loads(RunPaths(result.run_dir).manifest(1, "build-pairs").read_text())["counts"]["pairs"] == 0


KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import pbrl.models.policies as up   # write_agent (weights, then optimizer state) lives there
    from pbrl import orchestration
    from pbrl.config import load_job

    real = up.save_training_state
    def save_then_die(policy, agent_dir):
        real(policy, agent_dir)
        if "agent_1" in str(agent_dir):
            os.kill(os.getpid(), signal.SIGKILL)   # mid update-policies of round 1: checkpoint half written
    up.save_training_state = save_then_die
    job = load_job(sys.argv[1], [f"output_dir={sys.argv[2]}", "run_name=killed", "num_iterations=2", *sys.argv[3:]])
    orchestration.train(job)
""")


@pytest.mark.parametrize("overrides", [[], ["lora_r=4", "lora_dropout=0.5"]], ids=["full", "lora-dropout"])
def test_sigkill_in_update_policies_then_resume_matches_uninterrupted_run(tmp_path, overrides):
    """Also with LoRA dropout on: its masks come from seeds, so the resumed update is bitwise the same."""
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    script = tmp_path / "kill.py"
    script.write_text(KILL_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(ITER_YAML), str(tmp_path), *overrides],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    killed = tmp_path / "killed"
    paths = RunPaths(killed)
    # Killed while saving round 1's agent 1 optimizer: no round-1 checkpoint or manifest under its final name.
    assert not paths.round_checkpoint(1).exists()
    assert not paths.manifest(1, "update-policies").exists()

    job = load_job(ITER_YAML, [f"output_dir={tmp_path}", "run_name=killed", *overrides])
    out = orchestration.train(job, resume=True)
    states = {(s["round"], s["stage"]): s["state"] for s in out["stages"]}
    assert states[(1, "sample-candidates")] == "Cached" and states[(1, "update-policies")] == "Completed"

    fresh = load_job(ITER_YAML, [f"output_dir={tmp_path}", "run_name=fresh", *overrides])
    orchestration.train(fresh)
    assert_same_artifacts(run_artifacts(killed), run_artifacts(tmp_path / "fresh"))
    if overrides:  # the adapters were trained and compared, not the (absent) full weights
        assert list(killed.glob("checkpoints/round_0002/agent_*/adapter_model.safetensors"))


def test_lambda_decay_three_rounds_and_resume_after_round_two(tmp_path):
    replay = ["preference_replay_mode=lambda_decay", "preference_replay_lambda=0.5", f"output_dir={tmp_path}"]
    full = load_job(ITER_YAML, [*replay, "run_name=full", "num_iterations=3"])
    orchestration.train(full)
    part = load_job(ITER_YAML, [*replay, "run_name=part", "num_iterations=2"])
    orchestration.train(part)
    assert not RunPaths(tmp_path / "part").round_dir(3).exists()
    out = orchestration.train(part.model_copy(update={"num_iterations": 3}), resume=True)
    ran = {(s["round"], s["stage"]) for s in out["stages"] if s["state"] != "Cached"}
    assert {r for r, _ in ran} == {3}  # rounds 1-2 came back from the cache
    a = pq.read_table(RunPaths(tmp_path / "full").selected_pairs(3)).to_pylist()
    b = pq.read_table(RunPaths(tmp_path / "part").selected_pairs(3)).to_pylist()
    assert a == b and {r["source_round"] for r in a} <= {1, 2, 3}
    manifest = json.loads(RunPaths(tmp_path / "full").manifest(3, "replay-select").read_text())
    assert manifest["details"]["eligible_rounds"] == [1, 2, 3]
    assert manifest["details"]["weights"] == pytest.approx([1 / 7, 2 / 7, 4 / 7])
