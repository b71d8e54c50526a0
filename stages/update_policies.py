"""Stage 7, update-policies: MADPO (docs/design/algorithms.md#madpo), ``num_train_epochs`` passes over the selected
pairs; or
MARLHF policy learning (docs/design/algorithms.md#marlhf-policy-learning, :func:`pbrl.learning.rl.run_rl`):
``num_train_epochs`` passes over the round's
train items (prompt ids as stored in this round's candidates), rollouts scored by the round's fitted reward
model and written to ``rounds/<r>/rollouts.parquet``. A MARLHF round whose fit-reward-model fitted no model
(no usable pairs) updates nothing, like a round without pairs.

Round r starts from the policy (and each agent's AdamW state) after round r-1 and writes
``checkpoints/round_<r>/``: per agent the weights (or LoRA adapter) and optimizer state, then
``trainer_state.json`` last. The folder is assembled under a temporary name and renamed, so a process
killed mid-update leaves no checkpoint that a later stage would read. The manifest names the policy after
the round (``details.checkpoint``), and that is what later stages load (:func:`pbrl.models.policies.policy_checkpoint`).

A round without pairs writes no checkpoint: its manifest names the previous policy, and a
``checkpoints/round_<r>/`` left by an earlier attempt of the round is deleted once that manifest is written
(a process killed in between leaves it unreferenced, so it is never loaded).

With ``rl_algorithm: maac | iac`` the critics (:mod:`pbrl.learning.critics`) are checkpointed beside the policies in
``checkpoints/round_<r>/critic_<k>/`` (trainable weights, AdamW state, ``critic.json``) and the next round
restores them from there, exactly like the agents; round 1 builds them fresh from the run seed.

Training forwards run with dropout on (``lora_dropout``); each agent's masks in each step come from their
own seed ``(seed, round, "update-policies", "dropout", agent, step)``, so a rerun is bitwise identical.
Trainable weights are float32 whatever ``torch_dtype`` is (see :func:`pbrl.models.loading.load_model`).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pbrl.config import JobConfig, actor_job, is_marlhf
from pbrl.data.replay_store import run_identity, stored_rounds
from pbrl.data.schema import (
    ROLLOUTS,
    SELECTED_PAIRS,
    PairRow,
    read_joint_responses,
    read_rows,
    read_selected_pairs,
    write_table,
)
from pbrl.data.seeds import derive_seed, numpy_rng
from pbrl.data.storage import RunPaths, StageManifest, atomic_dir, read_manifest, write_json
from pbrl.distributed.ray_agents import gather, remote_agents, write_agents
from pbrl.distributed.ray_rollouts import ray_rollouts
from pbrl.errors import ArtifactError
from pbrl.generation.sampling import SamplingSettings, generate
from pbrl.learning.critics import ACTOR_CRITIC, Critic, CriticSet, CriticSpec, new_critic, restore_critic, save_critic
from pbrl.learning.env_steps import NEVER_LOGGED, env_step_axis, train_log
from pbrl.learning.joint_template import joint_template_for
from pbrl.learning.madpo import LocalAgent, PairBatch, StepAgent, madpo_agents_step
from pbrl.learning.reward_model import RewardScorer, reward_device, reward_model_dir
from pbrl.learning.rl import ReferencePolicy, RLSettings, rl_metrics, rollouts_path, run_rl
from pbrl.models.loading import resolve_devices
from pbrl.models.policies import (
    TRAINER_STATE,
    TrainablePolicy,
    load_agent,
    policy_checkpoint,
    read_trainer_state,
    trainable_agent,
    write_agent,
)
from pbrl.run.export import export_policy_checkpoint
from pbrl.run.folder import job_replay_dir
from pbrl.run.settings import agent_training, policy_source, ray_settings
from pbrl.run.stage_record import StageRecord

NAME = "update-policies"
FIT_STAGE = "fit-reward-model"


def _source_rounds(paths: RunPaths, round_index: int) -> list[int]:
    return sorted({r["source_round"] for r in read_rows(paths.selected_pairs(round_index), SELECTED_PAIRS)})


def input_files(paths: RunPaths, round_index: int, job: JobConfig) -> list[Path]:
    files = [
        paths.selected_pairs(round_index),
        *(paths.pairs(r) for r in _source_rounds(paths, round_index)),
        policy_checkpoint(paths, round_index - 1),
    ]
    if is_marlhf(job.trainer):  # the round's reward model (when one was fitted) and the stored prompt ids
        model_dir = reward_model_dir(paths.round_dir(round_index))
        files += [paths.candidates(round_index), *([model_dir] if model_dir.is_dir() else [])]
    return files


def selected_pairs(paths: RunPaths, round_index: int) -> list[PairRow]:
    """The selected pairs in draw order, with their stored token ids (never re-tokenized)."""
    return read_selected_pairs(paths.selected_pairs(round_index), paths.pairs)


def item_grouped_order(pairs: list[PairRow], permutation) -> list[int]:
    """The seeded shuffle ``permutation`` of the pair indices, regrouped so the pairs of one item are adjacent
    (items in the order their first pair appears in the shuffle; within an item, shuffle order). Batches then
    hold several pairs of one item, whose shared prompt is scored once (:func:`pbrl.learning.madpo.agent_margins`)."""
    rank: dict[str, int] = {}
    for j in permutation:
        rank.setdefault(pairs[int(j)]["item_id"], len(rank))
    return sorted((int(j) for j in permutation), key=lambda j: rank[pairs[j]["item_id"]])  # stable


def _batch(pairs: list[PairRow], num_agents: int) -> PairBatch:
    return PairBatch(
        prompt_ids=[[p["prompt_ids"][i] for p in pairs] for i in range(num_agents)],
        winner_ids=[[p["winner_ids"][i] for p in pairs] for i in range(num_agents)],
        loser_ids=[[p["loser_ids"][i] for p in pairs] for i in range(num_agents)],
    )


def _remove_stale(checkpoint: Path) -> None:
    """Delete a checkpoint folder no manifest names: renamed aside first, so it vanishes at once."""
    if checkpoint.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".old-{checkpoint.name}.", dir=checkpoint.parent))
        os.replace(checkpoint, trash / "old")
        shutil.rmtree(trash, ignore_errors=True)


def run(run_dir: str | Path, round_index: int, job: JobConfig) -> StageManifest:
    record = StageRecord(NAME, run_dir, round_index, job)
    job = actor_job(job)  # centralized collaboration: one policy (agent_0), trained on the joint completions
    paths = record.paths
    pairs = selected_pairs(paths, round_index)
    start = policy_checkpoint(paths, round_index - 1)
    if pairs and is_marlhf(job.trainer) and not _reward_model_fitted(paths, round_index):
        record.say("no reward model was fitted this round (no usable pairs): the policies are not updated")
        pairs = []
    if not pairs:
        if job.trainer in ("madpo", "marlhf"):
            record.say("no preference pairs: every comparison tied or was rejected, so the policies were not updated")
        else:
            record.say("no pairs selected: the policies are not updated this round")
        record.counts = {"pairs": 0, "steps": 0, "skipped_steps": 0}
        record.details = {"checkpoint": paths.rel(start), "updated": False}
        manifest = record.finish([paths.selected_pairs(round_index), start], [])
        _remove_stale(paths.round_checkpoint(round_index))
        _export(job, start, round_index)
        return manifest

    if is_marlhf(job.trainer):
        policies, tokenizers = _load_policies(job, start)
        return _run_marlhf(record, job, pairs, start, policies, tokenizers)
    if job.runner == "ray":  # one Ray actor per agent (pbrl.distributed.ray_agents); the same numbers as in process
        with remote_agents(agent_training(job), ray_settings(job), start) as agents:
            record.details = {"agents_on": "ray_actors"}
            return _run_madpo(
                record,
                job,
                pairs,
                start,
                agents,
                gather=gather,
                concurrent=True,
                write=lambda folder: write_agents(agents, folder),
            )
    policies, _ = _load_policies(job, start)
    return _run_madpo(
        record,
        job,
        pairs,
        start,
        [LocalAgent(p) for p in policies],
        gather=list,
        write=lambda folder: _write_agents(policies, folder),
    )


def _run_madpo(
    record: StageRecord,
    job: JobConfig,
    pairs: list[PairRow],
    start: Path,
    agents: list[StepAgent],
    *,
    gather: Callable[[list[Any]], list[Any]],
    write: Callable[[Path], None],
    concurrent: bool = False,
) -> StageManifest:
    """MADPO (docs/design/algorithms.md#madpo): ``num_train_epochs`` passes over ``pairs`` in batches, each a
    :func:`pbrl.learning.madpo.madpo_agents_step` over ``agents`` (in process, or Ray actors: results through
    ``gather``,
    ``concurrent``);
    ``write(folder)`` writes every ``agent_<i>/`` into the checkpoint's temporary folder."""
    paths, round_index = record.paths, record.round_index
    rng = numpy_rng(job.seed, round_index=round_index, stage=NAME)
    losses, accuracies, steps, skipped = [], [], 0, [0] * job.num_agents
    batch_sizes: list[int] = []
    margin_sums = torch.zeros(job.num_agents, dtype=torch.float64)
    n_margins = 0
    total_steps = job.num_train_epochs * -(-len(pairs) // job.train_batch_size)
    progress = record.progress(total_steps, "steps")
    live = _LiveLog(record, job, start)
    for _ in range(job.num_train_epochs):
        order = item_grouped_order(pairs, rng.permutation(len(pairs)))
        for begin in range(0, len(pairs), job.train_batch_size):
            chunk = [pairs[j] for j in order[begin : begin + job.train_batch_size]]
            seeds = [
                derive_seed(job.seed, round_index=round_index, stage=NAME, side="dropout", agent=i, index=steps)
                for i in range(job.num_agents)
            ]
            stats = madpo_agents_step(
                agents,
                _batch(chunk, job.num_agents),
                beta=job.dpo_beta,
                max_grad_norm=job.max_grad_norm,
                seeds=seeds,
                gather=gather,
                concurrent=concurrent,
                micro_batch_size=-(-job.train_batch_size // job.gradient_accumulation_steps),
            )
            steps += 1
            batch_sizes.append(len(chunk))
            losses.append(stats.loss)
            accuracies.append(stats.accuracy)
            finite = torch.isfinite(stats.margins).all(dim=1)
            margin_sums += stats.margins[finite].sum(dim=0).double()
            n_margins += int(finite.sum())
            for i, s in enumerate(stats.skipped):
                skipped[i] += int(s)
            live.step(len(chunk), {"madpo/loss": stats.loss, "madpo/accuracy": stats.accuracy})
            progress.advance()

    step_metrics = [{"madpo/loss": loss, "madpo/accuracy": acc} for loss, acc in zip(losses, accuracies, strict=True)]
    checkpoint, axis, log = _save_round(
        paths,
        job,
        round_index,
        start,
        write,
        batch_sizes,
        step_metrics,
        environment_steps_per_pair=job.environment_steps_per_pair,
    )

    finite_losses = [x for x in losses if math.isfinite(x)]
    reward_mean = sum(p["candidate_reward_mean"] for p in pairs) / len(pairs)
    record.metrics = {
        "madpo/loss": sum(finite_losses) / len(finite_losses) if finite_losses else float("nan"),
        "madpo/accuracy": sum(accuracies) / len(accuracies),
        "madpo/margin_mean": float(margin_sums.sum() / n_margins) if n_margins else float("nan"),
        "turn_1/reward_mean": reward_mean,
        "turn_1/expected_return": reward_mean,
    }
    for i in range(job.num_agents):
        record.metrics[f"madpo/margin_agent_{i}"] = float(margin_sums[i] / n_margins) if n_margins else float("nan")
        record.metrics[f"madpo/skipped_steps_agent_{i}"] = float(skipped[i])
    record.metrics["madpo/skipped_steps"] = float(sum(skipped))
    record.counts = {"pairs": len(pairs), "epochs": job.num_train_epochs, "steps": steps, "skipped_steps": sum(skipped)}
    if sum(skipped):
        record.say(f"{sum(skipped)} agent step(s) skipped: non-finite loss or gradient")
    record.metrics["train/env_step"] = float(axis[-1]) if axis else float("nan")
    record.details = {
        **record.details,
        "checkpoint": paths.rel(checkpoint),
        "updated": True,
        "train_log": [{k: v for k, v in row.items() if math.isfinite(v)} for row in log],
    }
    manifest = record.finish(input_files(paths, round_index, job), [checkpoint])
    _export(job, checkpoint, round_index)
    return manifest


def _load_policies(job: JobConfig, start: Path) -> tuple[list[TrainablePolicy], list]:
    """Every agent's policy at ``start``, trainable, with its AdamW (and the state stored beside it)."""
    loaded = [trainable_agent(agent_training(job), start, agent) for agent in range(job.num_agents)]
    return [policy for policy, _ in loaded], [tokenizer for _, tokenizer in loaded]


def _write_agents(policies: list[TrainablePolicy], folder: Path) -> None:
    for agent, policy in enumerate(policies):
        write_agent(policy, folder / f"agent_{agent}")


class _LiveLog:
    """Publishes each update step's metrics as it ends, on the steps the reference's ``logging_steps`` gate
    logs (the same rows as the manifest's ``train_log``)."""

    def __init__(self, record: StageRecord, job: JobConfig, start: Path) -> None:
        self.record, self.job = record, job
        self.previous = read_trainer_state(start)
        self.batch_sizes: list[int] = []
        self.metrics: list[dict[str, float]] = []

    def step(self, batch_size: int, metrics: dict[str, float]) -> None:
        self.batch_sizes.append(batch_size)
        self.metrics.append(metrics)
        axis = env_step_axis(
            self.batch_sizes,
            start=self.previous.get("env_step", 0),
            environment_steps_per_pair=self.job.environment_steps_per_pair,
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


def _save_round(
    paths: RunPaths,
    job: JobConfig,
    round_index: int,
    start: Path,
    write_agents: Callable[[Path], None],
    batch_sizes: list[int],
    step_metrics: list[dict[str, float]],
    *,
    environment_steps_per_pair: int,
    critics: list[Critic] | None = None,
) -> tuple[Path, list[int], list[dict[str, float]]]:
    """Write ``checkpoints/round_<r>/`` (``write_agents(folder)``: every agent's weights and optimizer state; the
    critics of maac/iac in ``critic_<k>/``; trainer_state.json last) and return it with the env-step axis and the
    logged train rows (the reference's axis and logging_steps gate, carried across rounds in
    trainer_state.json)."""
    previous = read_trainer_state(start)
    axis = env_step_axis(
        batch_sizes,
        start=previous.get("env_step", 0),
        environment_steps_per_pair=environment_steps_per_pair,
        use_environment_step=job.use_environment_step,
    )
    log = train_log(
        step_metrics,
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
                "optimizer_steps": previous.get("optimizer_steps", 0) + len(batch_sizes),
                "env_step": axis[-1] if axis else previous.get("env_step", 0),
                "last_logged_env_step": last_logged,
                "replay_index": stored_rounds(directory, run_identity(paths), round_index),
            },
        )
    return checkpoint, axis, log


def _reward_model_fitted(paths: RunPaths, round_index: int) -> bool:
    manifest = read_manifest(paths, round_index, FIT_STAGE)
    if manifest is None:
        raise ArtifactError(
            f"{paths.manifest(round_index, FIT_STAGE)}: missing; run {FIT_STAGE} of round {round_index} first"
        )
    return bool(manifest.details.get("fitted"))


# Over 60 lines: the stage's MARLHF branch reads as one recipe (load the reward model, references and critics,
# run RL on this process or Ray workers, write rollouts, checkpoint and manifest) over shared local state.
def _run_marlhf(
    record: StageRecord,
    job: JobConfig,
    pairs: list[PairRow],
    start: Path,
    policies: list[TrainablePolicy],
    tokenizers: list,
) -> StageManifest:
    """MARLHF policy learning (docs/design/algorithms.md#marlhf-policy-learning, :func:`pbrl.learning.rl.run_rl`)
    against this round's fitted reward model,
    on every train item, with the prompt ids stored in this round's candidates. The rollouts are generated in
    process, or with ``runner: ray`` in shards on Ray workers (:func:`pbrl.distributed.ray_rollouts.ray_rollouts`,
    docs/guides/ray.md#marlhf-rollouts-on-ray-workers):
    the same tokens, every row having its own seed."""
    paths, round_index, a, g = record.paths, record.round_index, job.num_agents, job.num_generations
    scorer = RewardScorer(
        reward_model_dir(paths.round_dir(round_index)),
        a,
        device=reward_device(job.reward_model_device, job.agent_devices, a),
    )
    prompts: dict[str, list[list[int]]] = {}
    for (item_id, side, _), group in read_joint_responses(paths.candidates(round_index), a).items():
        if side == "target":
            prompts.setdefault(item_id, [row["prompt_ids"] for row in group])
    item_ids = list(prompts)
    settings = SamplingSettings(
        max_new_tokens=job.max_new_tokens,
        temperature=job.temperature,
        top_p=job.top_p,
        top_k=job.top_k,
        batch_size=job.generation_batch_size,
    )

    def seed(side: str, agent: int = -1, item: str = "", index: int = -1) -> int:
        return derive_seed(
            job.seed, round_index=round_index, stage=NAME, side=side, agent=agent, item=item, index=index
        )

    def generate_here(agent: int, rows: list[list[int]], seeds: list[int], names: list[str]) -> list:
        return generate(policies[agent].model, tokenizers[agent], rows, seeds, settings, row_names=names)

    if job.runner == "ray":  # the step's rows in shards on Ray workers (pbrl.distributed.ray_rollouts); the same tokens
        generator = ray_rollouts(
            policy_source(job),
            ray_settings(job),
            start,
            policies,
            settings,
            items_per_step=min(job.train_batch_size, len(item_ids)),
            num_generations=job.num_generations,
        )
    else:
        generator = contextlib.nullcontext((generate_here, {}))

    references = None
    if job.reference_kl_enabled:
        source = policy_source(job)
        if source.lora is not None:  # the base weights: the agent's own model with its adapter disabled
            references = [ReferencePolicy(p.model, p.pad_token_id, disable_adapter=True) for p in policies]
        else:
            references = [
                ReferencePolicy(
                    load_agent(source, i, paths.initial, trainable=False, devices=job.reference_devices).model,
                    policies[i].pad_token_id,
                )
                for i in range(a)
            ]
    rl = RLSettings(
        epochs=job.num_train_epochs,
        batch_size=job.train_batch_size,
        num_generations=g,
        backend=job.rl_algorithm,
        normalize=job.advantage_normalization,
        kl_coef=job.reference_kl_coef if job.reference_kl_enabled else None,
        max_grad_norm=job.max_grad_norm,
    )
    critics = _critics(job, paths, start, policies) if job.rl_algorithm in ACTOR_CRITIC else None
    with generator as (generate_rows, rollout_details):

        def sample(agent: int, rows: list[list[int]], items: list[str], epoch: int) -> list:
            draws = list(zip(items, [epoch * g + r % g for r in range(len(rows))], strict=True))
            return generate_rows(
                agent,
                rows,
                [seed("rollout", agent, item, k) for item, k in draws],
                [f"agent {agent}, item {item!r}, rollout {k}" for item, k in draws],
            )

        progress = record.progress(rl.epochs * -(-len(item_ids) // rl.batch_size), "steps")
        live = _LiveLog(record, job, start)

        def on_step(items: int, metrics: dict[str, float]) -> None:
            live.step(items, metrics)
            progress.advance()

        result = run_rl(
            policies,
            [[prompts[item][i] for item in item_ids] for i in range(a)],
            item_ids,
            rl,
            sample=sample,
            score=scorer.score,
            references=references,
            order_seed=seed("order"),
            dropout_seed=lambda agent, step: seed("dropout", agent, index=step),
            critics=critics,
            on_step=on_step,
        )
    rollouts = rollouts_path(paths.round_dir(round_index))
    write_table(rollouts, result.rollouts, ROLLOUTS)
    checkpoint, axis, log = _save_round(
        paths,
        job,
        round_index,
        start,
        lambda folder: _write_agents(policies, folder),
        result.batch_sizes,
        result.step_metrics,
        environment_steps_per_pair=1,
        critics=critics.critics if critics is not None else None,
    )
    record.metrics = {
        **rl_metrics(result, a),
        **(critics.metrics() if critics is not None else {}),
        "train/env_step": float(axis[-1]) if axis else float("nan"),
    }
    reward_mean = sum(p["candidate_reward_mean"] for p in pairs) / len(pairs)
    record.metrics.update({"turn_1/reward_mean": reward_mean, "turn_1/expected_return": reward_mean})
    record.counts = {
        "pairs": len(pairs),
        "items": len(item_ids),
        "epochs": job.num_train_epochs,
        "steps": result.steps,
        "joint_responses": sum(result.batch_sizes),
        "skipped_steps": sum(result.skipped),
        "dropped_groups": result.dropped_groups,
    }
    if sum(result.skipped):
        record.say(f"{sum(result.skipped)} agent step(s) skipped: non-finite loss or gradient")
    if result.dropped_groups:
        record.say(
            f"{result.dropped_groups} item group(s) left out of their update: a joint response did not "
            f"fit reward_max_length={job.reward_max_length}"
        )
    record.details = {
        "checkpoint": paths.rel(checkpoint),
        "updated": True,
        "rl_algorithm": job.rl_algorithm,
        **rollout_details,
        "train_log": [{k: v for k, v in row.items() if math.isfinite(v)} for row in log],
    }
    manifest = record.finish(input_files(paths, round_index, job), [checkpoint, rollouts])
    _export(job, checkpoint, round_index)
    return manifest


def _critics(job: JobConfig, paths: RunPaths, start: Path, policies: list[TrainablePolicy]) -> CriticSet:
    """The maac/iac critics at ``start``: built fresh from the run seed (``start`` is the initial checkpoint),
    else restored from ``start/critic_<k>/`` (weights and AdamW state).

    Raises:
        ArtifactError: a round checkpoint without its critics, or with critics of another configuration.
    """
    source, a = policy_source(job), job.num_agents
    separate = job.rl_algorithm == "maac" or job.use_separate_critic
    count = 1 if job.rl_algorithm == "maac" else a
    sources = [job.critic_model_name or source.models[k] for k in range(count)]
    spec_devices = job.critic_devices if job.critic_devices is not None else job.agent_devices
    devices = resolve_devices(
        spec_devices if spec_devices is None or isinstance(spec_devices, str) else list(spec_devices),
        a,
        field="critic_devices",
    )
    critics = []
    for k in range(count):
        spec = (
            CriticSpec("separate", sources[k], source.lora, job.critic_value_head_hidden_dim)
            if separate
            else CriticSpec("value_head", None, None, job.value_head_hidden_dim)
        )
        critic = new_critic(
            spec,
            seed=derive_seed(job.seed, round_index=0, stage="init-critic", agent=k),
            learning_rate=job.critic_learning_rate or job.agent_learning_rate,
            device=_critic_device(devices[k], policies[k]) if separate else "cpu",
            policy=None if separate else policies[k].model,
            pad_token_id=policies[k].pad_token_id,
        )
        folder = start / f"critic_{k}"
        if folder.is_dir():
            restore_critic(critic, folder)
        elif start != paths.initial:
            raise ArtifactError(
                f"{folder}: missing; the checkpoint was written without the {job.rl_algorithm} "
                f"critics: rerun {NAME} of the round that wrote {paths.rel(start)}"
            )
        critics.append(critic)
    template = joint_template_for(sources[0], source.models)[0] if job.rl_algorithm == "maac" else None
    return CriticSet(
        job.rl_algorithm,
        job.critic_type,
        critics,
        template=template,
        max_length=job.reward_max_length,
        value_loss_coef=job.value_loss_coef,
        clip_range=job.value_clip_range,
        max_grad_norm=job.max_grad_norm,
    )


def _critic_device(device: str, policy: TrainablePolicy) -> str:
    """A separate critic's device: as configured, or (``auto`` placement) the device of its agent's inputs."""
    return str(policy.model.get_input_embeddings().weight.device) if device == "auto" else device


def _export(job: JobConfig, checkpoint: Path, round_index: int) -> None:
    """Also copy the policy after this round to ``policy_checkpoint_dir`` (iterative trainers), in the
    reference's layout (:mod:`pbrl.run.export`)."""
    directory = getattr(job, "policy_checkpoint_dir", None)
    if directory:
        export_policy_checkpoint(checkpoint, directory, round_index, job.num_agents)
