"""A round's policy checkpoint, ``checkpoints/round_<r>/``, as update-policies writes it
(docs/design/stages.md#update-policies).

Round r starts from the policy (and each agent's AdamW state) after round r-1 and writes, per agent, the weights
(or LoRA adapter) and optimizer state; with ``rl_algorithm: maac | iac`` the critics in ``critic_<k>/``
(:func:`pbrl.learning.critics.save_critic`); then ``trainer_state.json`` last. The folder is assembled under a
temporary name and renamed, so a process killed mid-update leaves no checkpoint that a later stage would read.

``trainer_state.json`` carries the reference's env-step axis and its ``logging_steps`` gate across rounds
(:mod:`pbrl.learning.env_steps`): :func:`save_round` writes it, :class:`LiveLog` publishes each step's metrics on
the steps that gate logs. A checkpoint no manifest names is removed (:func:`remove_stale`), and the policy after a
round is also copied to ``policy_checkpoint_dir`` (:func:`export_round`, :mod:`pbrl.run.export`).
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pbrl.config import JobConfig
from pbrl.data.replay_store import run_identity, stored_rounds
from pbrl.data.storage import RunPaths, atomic_dir, write_json
from pbrl.learning.critics import Critic, save_critic
from pbrl.learning.env_steps import NEVER_LOGGED, env_step_axis, train_log
from pbrl.models.policies import TRAINER_STATE, TrainablePolicy, read_trainer_state, write_agent
from pbrl.run.export import export_policy_checkpoint
from pbrl.run.folder import job_replay_dir
from pbrl.run.settings import run_outputs
from pbrl.run.stage_record import StageRecord


@dataclass(frozen=True)
class RoundSteps:
    """A round's update steps as :func:`save_round` records them: each step's batch size (pairs, or joint
    responses in RL), each step's metrics, and the env steps one pair counts for on the reference's axis
    (``environment_steps_per_pair``; 1 for MARLHF's RL)."""

    batch_sizes: list[int]
    metrics: list[dict[str, float]]
    environment_steps_per_pair: int


def save_round(
    paths: RunPaths,
    job: JobConfig,
    round_index: int,
    start: Path,
    write_agents: Callable[[Path], None],
    steps: RoundSteps,
    *,
    critics: list[Critic] | None = None,
) -> tuple[Path, list[int], list[dict[str, float]]]:
    """Write ``checkpoints/round_<r>/`` (``write_agents(folder)``: every agent's weights and optimizer state; the
    critics of maac/iac in ``critic_<k>/``; trainer_state.json last) and return it with the env-step axis and the
    logged train rows (the reference's axis and logging_steps gate, carried across rounds in
    trainer_state.json)."""
    previous = read_trainer_state(start)
    axis = env_step_axis(
        steps.batch_sizes,
        start=previous.get("env_step", 0),
        environment_steps_per_pair=steps.environment_steps_per_pair,
        use_environment_step=job.use_environment_step,
    )
    log = train_log(
        steps.metrics,
        axis,
        logging_steps=job.logging_steps,
        last_logged=previous.get("last_logged_env_step", NEVER_LOGGED),
    )
    last_logged = int(log[-1]["env_step"]) if log else previous.get("last_logged_env_step", NEVER_LOGGED)
    checkpoint = paths.round_checkpoint(round_index)
    with atomic_dir(checkpoint) as tmp:
        write_agents(tmp)  # agent_<i>/: weights, optimizer.pt (+ grad_scaler.pt with fp16)
        for k, critic in enumerate(critics or []):
            save_critic(critic, tmp / f"critic_{k}")  # trainable weights, optimizer.pt, critic.json
        directory = job_replay_dir(paths, job)
        write_json(
            tmp / TRAINER_STATE,
            {
                "round": round_index,
                "started_from": paths.rel(start),
                "optimizer_steps": previous.get("optimizer_steps", 0) + len(steps.batch_sizes),
                "env_step": axis[-1] if axis else previous.get("env_step", 0),
                "last_logged_env_step": last_logged,
                "replay_index": stored_rounds(directory, run_identity(paths), round_index),
            },
        )
    return checkpoint, axis, log


class LiveLog:
    """Publishes each update step's metrics as it ends, on the steps the reference's ``logging_steps`` gate
    logs (the same rows as the manifest's ``train_log``: ``environment_steps_per_pair`` is the one the round's
    :class:`RoundSteps` records, the job's for MADPO, 1 for MARLHF's RL)."""

    def __init__(self, record: StageRecord, job: JobConfig, start: Path, environment_steps_per_pair: int) -> None:
        self.record, self.job, self.steps_per_pair = record, job, environment_steps_per_pair
        self.previous = read_trainer_state(start)
        self.batch_sizes: list[int] = []
        self.metrics: list[dict[str, float]] = []

    def step(self, batch_size: int, metrics: dict[str, float]) -> None:
        self.batch_sizes.append(batch_size)
        self.metrics.append(metrics)
        axis = env_step_axis(
            self.batch_sizes,
            start=self.previous.get("env_step", 0),
            environment_steps_per_pair=self.steps_per_pair,
            use_environment_step=self.job.use_environment_step,
        )
        logged = train_log(
            self.metrics,
            axis,
            logging_steps=self.job.logging_steps,
            last_logged=self.previous.get("last_logged_env_step", NEVER_LOGGED),
        )
        if logged and int(logged[-1]["env_step"]) == axis[-1]:  # this step is one the gate logs
            finite = {k: v for k, v in metrics.items() if math.isfinite(v)}
            self.record.log(len(self.metrics), finite, env_step=axis[-1])


def write_policies(policies: list[TrainablePolicy], folder: Path) -> None:
    for agent, policy in enumerate(policies):
        write_agent(policy, folder / f"agent_{agent}")


def remove_stale(checkpoint: Path) -> None:
    """Delete a checkpoint folder no manifest names: renamed aside first, so it vanishes at once."""
    if checkpoint.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".old-{checkpoint.name}.", dir=checkpoint.parent))
        os.replace(checkpoint, trash / "old")
        shutil.rmtree(trash, ignore_errors=True)


def export_round(job: JobConfig, checkpoint: Path, round_index: int) -> None:
    """Also copy the policy after this round to ``policy_checkpoint_dir`` (iterative trainers), in the
    reference's layout (:mod:`pbrl.run.export`)."""
    directory = run_outputs(job).policy_checkpoint_dir
    if directory:
        export_policy_checkpoint(checkpoint, directory, round_index, job.num_agents)
