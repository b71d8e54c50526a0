"""MARLHF end to end on the tiny model: the CLI, the fit-reward-model task, resume after SIGKILL, caching."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pbrl import orchestration
from pbrl.cli.commands import app
from pbrl.config import load_job, split_job
from pbrl.data.storage import RunPaths
from pbrl.reporting.metrics import metrics_frame
from pbrl.trainers import MARLHFTrainer
from tests.helpers import assert_same_artifacts, run_artifacts

pytestmark = [pytest.mark.flow, pytest.mark.usefixtures("prefect_api")]

ROOT = Path(__file__).resolve().parents[2]
ITER_YAML = ROOT / "flows" / "configs" / "tiny-marlhf-iter.yaml"
BASE_YAML = ROOT / "flows" / "configs" / "tiny-marlhf.yaml"
ROUND_STAGES = [
    "sample-candidates",
    "score-with-oracle",
    "build-pairs",
    "store-round",
    "replay-select",
    "fit-reward-model",
    "update-policies",
    "evaluate",
]


MARLHF_ARTIFACTS = (
    "rounds/*/*.parquet",
    "replay/iteration_*.json",
    "rounds/*/reward_model/**/*.safetensors",
    "rounds/*/reward_model/reward_model.json",
    "checkpoints/round_*/agent_*/*.safetensors",
)


def test_cli_trains_two_rounds_with_a_complete_run_folder_then_reruns_cached(tmp_path):
    result = CliRunner().invoke(app, ["train", str(ITER_YAML), "--set", f"output_dir={tmp_path}"])
    assert result.exit_code == 0, result.output
    run_dir = tmp_path / "tiny-marlhf-iter"
    paths = RunPaths(run_dir)
    for r in (1, 2):
        for stage in ROUND_STAGES:
            assert paths.manifest(r, stage).is_file(), (r, stage)
        rd = paths.round_dir(r)
        for name in (
            "candidates.parquet",
            "scores.parquet",
            "pairs.parquet",
            "pair_joint_ids.parquet",
            "selected_pairs.parquet",
            "rollouts.parquet",
            "eval.parquet",
            "reward_model/head.safetensors",
        ):
            assert (rd / name).is_file(), (r, name)
        assert (paths.round_checkpoint(r) / "trainer_state.json").is_file()
    metrics = set(metrics_frame(run_dir)["metric"])
    for name in (
        "rm/loss",
        "rm/accuracy",
        "rm/margin_mean",
        "rm/heldout_accuracy",
        "rl/reward_mean",
        "rl/advantage_std",
        "rl/kl_mean",
        "eval/turn_1/reward_mean",
        "time/fit-reward-model_seconds",
    ):
        assert name in metrics, name
    evaluate = json.loads(paths.manifest(2, "evaluate").read_text())
    assert "reward_model" not in json.dumps(evaluate["inputs"])  # evaluation scores with the task reward

    job = load_job(ITER_YAML, [f"output_dir={tmp_path}", "run_name=tiny-marlhf-iter"])
    out = orchestration.train(job, resume=True)
    assert {s["state"] for s in out["stages"]} == {"Cached"}
    again = CliRunner().invoke(app, ["stage", "fit-reward-model", "--run", str(run_dir), "--round", "1"])
    assert again.exit_code == 0 and "Cached" in again.output, again.output


KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import stages.fit_reward_model as fit
    from pbrl import orchestration
    from pbrl.config import load_job

    real = fit.save_reward_model
    def save_then_die(model, spec, out, **kw):
        real(model, spec, out, **kw)
        if "0002" in str(out):
            os.kill(os.getpid(), signal.SIGKILL)   # round 2's model written, its manifest not yet
    fit.save_reward_model = save_then_die
    job = load_job(sys.argv[1], [f"output_dir={sys.argv[2]}", "run_name=killed"])
    orchestration.train(job)
""")


def test_sigkill_in_fit_reward_model_then_resume_matches_uninterrupted_run(tmp_path):
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    script = tmp_path / "kill.py"
    script.write_text(KILL_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(ITER_YAML), str(tmp_path)],
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
    assert not paths.manifest(2, "fit-reward-model").exists() and paths.manifest(1, "update-policies").exists()

    out = orchestration.train(load_job(ITER_YAML, [f"output_dir={tmp_path}", "run_name=killed"]), resume=True)
    states = {(s["round"], s["stage"]): s["state"] for s in out["stages"]}
    assert states[(2, "replay-select")] == "Cached" and states[(2, "fit-reward-model")] == "Completed", states
    orchestration.train(load_job(ITER_YAML, [f"output_dir={tmp_path}", "run_name=fresh"]))
    assert_same_artifacts(run_artifacts(killed, MARLHF_ARTIFACTS), run_artifacts(tmp_path / "fresh", MARLHF_ARTIFACTS))


def test_base_trainer_api_with_reference_kl(tmp_path):
    run, config = split_job(load_job(BASE_YAML))
    result = MARLHFTrainer(
        config, task=run.task, agent_model=run.agent_model, run_name="base", output_dir=str(tmp_path)
    ).train()
    paths = RunPaths(result.run_dir)
    update = json.loads(paths.manifest(1, "update-policies").read_text())
    assert update["details"]["updated"] and update["metrics"]["rl/kl_mean"] >= 0
    assert "rl/kl_mean_agent_1" in update["metrics"] and list(result.rounds.index) == [0, 1]
    assert json.loads(paths.manifest(1, "fit-reward-model").read_text())["details"]["fitted"]
