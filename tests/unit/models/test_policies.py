"""Which policy a stage loads: "the policy after round r" comes from the manifests, never from whichever
``checkpoints/round_<r>`` folder exists; and the plain :class:`PolicySource` the stages build from the job.

Issue #16 item 4: a rerun of round r that yields 0 pairs left an earlier ``checkpoints/round_r`` in place, and
round r+1 and evaluate r loaded it.
"""

from __future__ import annotations

import pytest
import torch

from pbrl.config import parse_job
from pbrl.data.schema import SELECTED_PAIRS
from pbrl.data.storage import RunPaths, StageManifest, read_manifest, write_json, write_manifest
from pbrl.data.tables import write_table
from pbrl.errors import ArtifactError
from pbrl.models.lora import LoraSettings
from pbrl.models.policies import PolicySource, load_agent, write_initial_checkpoints
from pbrl.run.policy_records import policy_checkpoint
from pbrl.run.settings import policy_source
from stages import STAGE_MODULES
from tests.helpers import new_run

ROUND = [
    "sample-candidates",
    "score-with-oracle",
    "build-pairs",
    "store-round",
    "replay-select",
    "update-policies",
    "evaluate",
]


def update_manifest(paths: RunPaths, round_index: int, checkpoint: str, updated: bool) -> None:
    write_manifest(
        paths,
        StageManifest(
            stage="update-policies",
            round_index=round_index,
            config_hash="h",
            code_version="v",
            details={"checkpoint": checkpoint, "updated": updated},
        ),
    )


def complete_checkpoint(paths: RunPaths, round_index: int) -> None:
    write_json(paths.round_checkpoint(round_index) / "trainer_state.json", {"round": round_index})


# --- policy_checkpoint: manifests decide ------------------------------------------------------------------


def test_round_without_pairs_points_to_the_previous_policy_not_to_a_stale_folder(tmp_path):
    paths = RunPaths(tmp_path)
    paths.initial.mkdir(parents=True)
    complete_checkpoint(paths, 1)  # left by an earlier attempt of round 1 that had pairs
    update_manifest(paths, 1, "checkpoints/initial", updated=False)  # this attempt: 0 pairs
    complete_checkpoint(paths, 2)
    update_manifest(paths, 2, "checkpoints/round_0002", updated=True)
    complete_checkpoint(paths, 4)  # a later round on disk is never used for an earlier one
    update_manifest(paths, 3, "checkpoints/round_0002", updated=False)

    assert policy_checkpoint(paths, 0) == paths.initial
    assert policy_checkpoint(paths, 1) == paths.initial
    assert policy_checkpoint(paths, 2) == paths.round_checkpoint(2)
    assert policy_checkpoint(paths, 3) == paths.round_checkpoint(2)


def test_missing_manifest_is_an_error_even_when_a_folder_exists(tmp_path):
    paths = RunPaths(tmp_path)
    complete_checkpoint(paths, 1)
    with pytest.raises(ArtifactError, match=r"0001/update-policies\.manifest\.json: missing.*run it first"):
        policy_checkpoint(paths, 1)


def test_manifest_naming_an_incomplete_checkpoint_is_an_error(tmp_path):
    paths = RunPaths(tmp_path)
    paths.round_checkpoint(1).mkdir(parents=True)  # no trainer_state.json: not complete
    update_manifest(paths, 1, "checkpoints/round_0001", updated=True)
    with pytest.raises(ArtifactError, match=r"names checkpoint checkpoints/round_0001, which is missing"):
        policy_checkpoint(paths, 1)


def test_rerun_of_a_round_with_zero_pairs_uses_the_previous_policy_everywhere(tiny_model_dir, tmp_path):
    """The issue's example through the stages: round 1 updates (checkpoints/round_0001), then a rerun of
    round 1 selects no pair. Its manifest, evaluate 1 and round 2 all use the initial policy, and the stale
    folder is gone."""
    run_dir, job = new_run(tiny_model_dir, tmp_path)
    paths = RunPaths(run_dir)
    for name in ROUND:
        STAGE_MODULES[name].run(run_dir, 1, job)
    first = read_manifest(paths, 1, "update-policies")
    assert (first.details["checkpoint"], first.details["updated"]) == ("checkpoints/round_0001", True)
    assert STAGE_MODULES["evaluate"].run(run_dir, 1, job).details["checkpoint"] == "checkpoints/round_0001"

    write_table(paths.selected_pairs(1), [], SELECTED_PAIRS)  # the rerun's replay-select found no pair
    rerun = STAGE_MODULES["update-policies"].run(run_dir, 1, job)
    assert rerun.details == {"checkpoint": "checkpoints/initial", "updated": False}
    assert rerun.counts["pairs"] == 0 and rerun.outputs == {}
    assert not paths.round_checkpoint(1).exists()
    assert [p.name for p in paths.checkpoints.iterdir()] == ["initial"]  # nothing half-deleted left either

    assert STAGE_MODULES["evaluate"].run(run_dir, 1, job).details["checkpoint"] == "checkpoints/initial"
    sampled = STAGE_MODULES["sample-candidates"].run(run_dir, 2, job)
    assert sampled.details["sides"] == {"target": "checkpoints/initial", "comparator": "checkpoints/initial"}
    assert policy_checkpoint(paths, 1) == paths.initial  # where round 2's update starts


# --- PolicySource: plain values from the job ----------------------------------------------------------------


def test_policy_source_from_job_reads_the_agent_fields(monkeypatch):
    job = parse_job(
        {
            "trainer": "madpo_iter",
            "task": "toy",
            "agents": ["m0", "m1", "m2"],
            "num_agents": 3,
            "lora_r": 4,
            "lora_alpha": 8,
            "lora_dropout": 0.1,
            "lora_target_modules": ["q_proj"],
            "torch_dtype": "bfloat16",
            "agent_devices": ["cpu"],
        }
    )
    assert policy_source(job) == PolicySource(
        models=("m0", "m1", "m2"),
        lora=LoraSettings(r=4, alpha=8, dropout=0.1, target_modules=("q_proj",)),
        dtype="bfloat16",
        devices="cpu",
    )  # parallel_training 'none' (default): every agent on the first device
    job = parse_job({"trainer": "madpo", "task": "toy", "agent_model": "m", "num_agents": 2})
    for bf16_cpu, dtype in (("0", "float32"), ("1", "bfloat16")):  # torch_dtype auto: what the CPU computes
        monkeypatch.setenv("PBRL_CPU_BF16", bf16_cpu)
        assert policy_source(job) == PolicySource(models=("m", "m"), lora=None, dtype=dtype, devices=None)


def test_load_agent_initial_is_the_base_and_a_round_checkpoint_its_weights(tiny_model_dir, tmp_path):
    from pbrl.models.loading import save_agent

    paths = RunPaths(tmp_path)
    source = PolicySource(models=(str(tiny_model_dir),), devices="cpu")
    write_initial_checkpoints(paths, source, seed=0)
    assert sorted(p.name for p in (paths.initial / "agent_0").iterdir()) == ["source.json"]
    initial = load_agent(source, 0, paths.initial, trainable=False)
    trained = load_agent(source, 0, paths.initial, trainable=True)
    with torch.no_grad():
        trained.model.model.norm.weight.add_(0.5)  # norm weights start at exactly 1.0
    save_agent(trained.model, paths.round_checkpoint(1) / "agent_0")
    again = load_agent(source, 0, paths.round_checkpoint(1), trainable=False)
    assert torch.equal(initial.model.model.norm.weight, torch.ones(64))
    assert torch.equal(again.model.model.norm.weight, torch.full((64,), 1.5))
    assert again.device == "cpu" and not again.model.training
    with pytest.raises(ArtifactError, match="config.json'?: missing"):
        load_agent(source, 0, paths.round_checkpoint(2), trainable=False)
