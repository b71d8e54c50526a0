"""The job read at the edge, typed: options only some trainers have are read after an isinstance check on the job
groups (IterativeJob, RewardModelJob), never by getattr, and give the base trainers' defaults."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flows.ray_runner import shard_devices
from pbrl.config import IterativeJob, RewardModelJob, parse_job, split_job
from pbrl.run.settings import RewardBackbone, RunOutputs, reward_backbone, run_outputs

ROOT = Path(__file__).resolve().parents[3]
BASE = {"task": "toy", "agent_model": "tiny-random", "run_name": "r", "output_dir": "/tmp/x"}


def _job(trainer: str, **options):
    return parse_job({**BASE, "trainer": trainer, **options}, warn=False)


@pytest.mark.parametrize(
    ("trainer", "iterative", "reward_model"),
    [("madpo", False, False), ("marlhf", False, True), ("madpo_iter", True, False), ("marlhf_iter", True, True)],
)
def test_the_job_groups_are_the_trainers_that_have_the_options(trainer, iterative, reward_model):
    job = _job(trainer)
    assert isinstance(job, IterativeJob) == iterative == ("preference_replay_dir" in type(job).model_fields)
    assert isinstance(job, RewardModelJob) == reward_model == ("reward_model_name" in type(job).model_fields)


def test_run_outputs_read_the_iterative_options_and_are_empty_for_the_base_trainers():
    job = _job("madpo_iter", preference_replay_dir="/tmp/replay", policy_checkpoint_dir="/tmp/export")
    assert run_outputs(job) == RunOutputs(replay_dir="/tmp/replay", policy_checkpoint_dir="/tmp/export")
    assert run_outputs(_job("madpo_iter")) == RunOutputs() == run_outputs(_job("marlhf"))


def test_reward_backbone_reads_marlhf_options_and_is_none_for_madpo():
    job = _job("marlhf", reward_backbone_layers=2, reward_max_length=64)
    assert reward_backbone(job) == RewardBackbone(model_name=None, backbone_layers=2, max_length=64)
    assert reward_backbone(_job("madpo_iter")) is None


def test_a_shard_reads_the_device_options_its_trainer_has():
    assert shard_devices(_job("madpo", agent_devices="cpu")) == ["cpu"]
    assert shard_devices(_job("madpo_iter", comparator_devices="cuda:1")) == [None, "cuda:1"]
    assert shard_devices(_job("marlhf_iter", reward_model_device="cpu")) == [None, None, "cpu"]


def test_split_job_keeps_every_value():
    job = _job("marlhf_iter", preference_replay_dir="/tmp/replay", reward_max_length=64)
    run, trainer = split_job(job)
    assert {**dict(run), **dict(trainer)} == dict(job)


def test_no_code_reads_the_job_by_getattr():
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for folder in ("pbrl", "flows")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"(getattr|hasattr)\(job\b", line)
    ]
    assert found == []
