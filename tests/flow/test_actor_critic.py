"""The actor-critic MARLHF backends end to end on the tiny model: 2 rounds of ``marlhf_iter`` with ``maac`` (a
centralized critic) and ``iac`` (value heads on the policies), the critics checkpointed beside the policies, and
SIGKILL then ``--resume`` bitwise identical to an uninterrupted run, critics included."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pbrl import orchestration
from pbrl.config import load_job
from pbrl.data.storage import RunPaths
from pbrl.learning.joint_template import TEMPLATE_VERSION
from pbrl.reporting.metrics import metrics_frame
from tests.helpers import assert_same_artifacts, run_artifacts

pytestmark = [pytest.mark.flow, pytest.mark.usefixtures("prefect_api")]

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {
    "maac": ROOT / "flows" / "configs" / "tiny-marlhf-maac.yaml",
    "iac": ROOT / "flows" / "configs" / "tiny-marlhf-iac.yaml",
}
CRITICS = {"maac": 1, "iac": 2}
ARTIFACTS = (
    "rounds/*/rollouts.parquet",
    "rounds/*/eval.parquet",
    "rounds/*/reward_model/*.safetensors",
    "checkpoints/round_*/agent_*/*.safetensors",
    "checkpoints/round_*/critic_*/weights.safetensors",
    "checkpoints/round_*/critic_*/critic.json",
)


def _artifacts(run_dir: Path) -> dict[str, object]:
    """The run's artifacts (:func:`tests.helpers.run_artifacts`) and every critic's AdamW state as tensors."""
    out = run_artifacts(run_dir, ARTIFACTS, trainer_state=True)
    for f in sorted(run_dir.glob("checkpoints/round_*/critic_*/optimizer.pt")):
        state = torch.load(f, weights_only=True)
        out[f.relative_to(run_dir).as_posix()] = {(k, n): v for k, st in state["state"].items() for n, v in st.items()}
    return out


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> dict[str, Path]:
    """Each backend's uninterrupted 2-round run (run lazily, once per module)."""
    root = tmp_path_factory.mktemp("ac")

    class Runs(dict):
        def __missing__(self, backend: str) -> Path:
            orchestration.train(load_job(CONFIGS[backend], [f"output_dir={root}", f"run_name={backend}"]))
            self[backend] = root / backend
            return self[backend]

    return Runs()


@pytest.mark.parametrize("backend", ["maac", "iac"])
def test_two_rounds_complete_with_critics_checkpointed_and_metrics_recorded(finished, backend):
    run_dir = finished[backend]
    paths = RunPaths(run_dir)
    for r in (1, 2):
        manifest = json.loads(paths.manifest(r, "update-policies").read_text())
        assert manifest["details"]["updated"] and manifest["details"]["rl_algorithm"] == backend
        for k in range(CRITICS[backend]):
            folder = paths.round_checkpoint(r) / f"critic_{k}"
            assert {f.name for f in folder.iterdir()} == {"weights.safetensors", "optimizer.pt", "critic.json"}
        assert not (paths.round_checkpoint(r) / f"critic_{CRITICS[backend]}").exists()
    record = json.loads((paths.round_checkpoint(2) / "critic_0" / "critic.json").read_text())
    assert record["kind"] == ("separate" if backend == "maac" else "value_head")
    # maac reads the joint template, so its folder names the template's version; iac reads its own ids
    assert record.get("joint_template") == (TEMPLATE_VERSION if backend == "maac" else None)
    metrics = set(metrics_frame(run_dir)["metric"])
    suffixes = [""] if backend == "maac" else ["", "_agent_0", "_agent_1"]
    for name in ("critic/value_loss", "critic/explained_variance", "critic/value_mean"):
        for suffix in suffixes:
            assert name + suffix in metrics, name + suffix
    out = orchestration.train(
        load_job(CONFIGS[backend], [f"output_dir={run_dir.parent}", f"run_name={backend}"]), resume=True
    )
    assert {s["state"] for s in out["stages"]} == {"Cached"}


KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import stages.update_policies as update
    from pbrl import orchestration
    from pbrl.config import load_job

    real = update.save_round
    def save_then_die(paths, job, round_index, *args, **kw):
        out = real(paths, job, round_index, *args, **kw)
        if round_index == 2:
            os.kill(os.getpid(), signal.SIGKILL)   # round 2's checkpoint (critics included) written, manifest not
        return out
    update.save_round = save_then_die
    job = load_job(sys.argv[1], [f"output_dir={sys.argv[2]}", "run_name=killed"])
    orchestration.train(job)
""")


@pytest.mark.parametrize("backend", ["maac", "iac"])
def test_sigkill_in_round_two_update_then_resume_matches_the_uninterrupted_run(finished, tmp_path, backend):
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    script = tmp_path / "kill.py"
    script.write_text(KILL_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(CONFIGS[backend]), str(tmp_path)],
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
    assert paths.manifest(1, "update-policies").exists() and not paths.manifest(2, "update-policies").exists()
    out = orchestration.train(load_job(CONFIGS[backend], [f"output_dir={tmp_path}", "run_name=killed"]), resume=True)
    states = {(s["round"], s["stage"]): s["state"] for s in out["stages"]}
    assert states[(2, "fit-reward-model")] == "Cached" and states[(2, "update-policies")] == "Completed", states
    resumed = _artifacts(killed)
    assert f"checkpoints/round_0002/critic_{CRITICS[backend] - 1}/optimizer.pt" in resumed  # critics are compared
    assert_same_artifacts(resumed, _artifacts(finished[backend]))
