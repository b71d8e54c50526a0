"""What update-policies builds from the job for MARLHF policy learning
(docs/design/algorithms.md#marlhf-policy-learning, :func:`pbrl.learning.rl.run_rl`): the round's reward model, the
rollout sampler (in process or on Ray workers), the round's prompts, the RL loop's settings and hooks (sampler, seeds,
live log), the frozen references of the KL, and the critics of ``rl_algorithm: maac | iac``
(docs/design/algorithms.md#critics).

The critics are checkpointed beside the policies in ``checkpoints/round_<r>/critic_<k>/`` (trainable weights, AdamW
state, ``critic.json``; :mod:`pbrl.run.round_checkpoint`) and the next round restores them from there, exactly like
the agents; round 1 builds them fresh from the run seed.

A MARLHF round whose fit-reward-model fitted no model (:func:`reward_model_fitted`) updates nothing.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from pbrl.config import JobConfig
from pbrl.data.seeds import derive_seed
from pbrl.data.storage import RunPaths, read_manifest
from pbrl.data.tables import read_joint_responses
from pbrl.distributed.ray_rollouts import RolloutGenerator, ray_rollouts
from pbrl.errors import ArtifactError
from pbrl.generation.sampling import generate
from pbrl.learning.critic_set import CriticSet
from pbrl.learning.critics import Critic, CriticSpec, new_critic, restore_critic
from pbrl.learning.joint_template import TEMPLATE_VERSION, joint_template_for
from pbrl.learning.reward_scoring import RewardScorer, reward_device
from pbrl.learning.rl import ReferencePolicy, RLHooks, RLSettings
from pbrl.learning.rollouts import Scorer
from pbrl.models.loading import resolve_devices
from pbrl.models.policies import TrainablePolicy, load_agent
from pbrl.run.reward_records import reward_model_dir
from pbrl.run.round_checkpoint import LiveLog
from pbrl.run.settings import policy_source, ray_settings, sampling_settings
from pbrl.run.stage_record import StageRecord

FIT_STAGE = "fit-reward-model"


def reward_model_fitted(paths: RunPaths, round_index: int) -> bool:
    """Whether this round's fit-reward-model fitted a model (``details.fitted``; none without usable pairs).

    Raises:
        ArtifactError: fit-reward-model of the round has no manifest yet.
    """
    manifest = read_manifest(paths, round_index, FIT_STAGE)
    if manifest is None:
        raise ArtifactError(
            f"{paths.manifest(round_index, FIT_STAGE)}: missing; run {FIT_STAGE} of round {round_index} first"
        )
    return bool(manifest.details.get("fitted"))


def reward_scorer(job: JobConfig, paths: RunPaths, round_index: int) -> RewardScorer:
    """This round's fitted reward model, on ``reward_model_device`` (else the first agent's device)."""
    return RewardScorer(
        reward_model_dir(paths.round_dir(round_index)),
        job.num_agents,
        device=reward_device(job.reward_model_device, job.agent_devices, job.num_agents),
    )


def rollout_generator(
    job: JobConfig, start: Path, policies: list[TrainablePolicy], tokenizers: list, num_items: int
) -> AbstractContextManager[tuple[RolloutGenerator, dict[str, Any]]]:
    """The RL loop's sampler, a context yielding ``(generate_rows, details)``: ``generate_rows(agent, prompt rows,
    seeds, row names)`` generates in process, or with ``runner: ray`` in shards on Ray workers
    (:func:`pbrl.distributed.ray_rollouts.ray_rollouts`, docs/guides/ray.md#marlhf-rollouts-on-ray-workers): the same
    tokens, every row having its own seed. ``details`` (where rollouts ran) goes into the manifest."""
    settings = sampling_settings(job)

    def generate_here(agent: int, rows: list[list[int]], seeds: list[int], names: list[str]) -> list:
        return generate(policies[agent].model, tokenizers[agent], rows, seeds, settings, row_names=names)

    if job.runner == "ray":  # the step's rows in shards on Ray workers (pbrl.distributed.ray_rollouts); the same tokens
        return ray_rollouts(
            policy_source(job),
            ray_settings(job),
            start,
            policies,
            settings,
            items_per_step=min(job.train_batch_size, num_items),
            num_generations=job.num_generations,
        )
    return contextlib.nullcontext((generate_here, {}))


def rl_settings(job: JobConfig) -> RLSettings:
    """The RL loop's plain values: ``num_train_epochs``, ``train_batch_size``, ``num_generations``, ``rl_algorithm``,
    ``advantage_normalization``, ``reference_kl_coef`` (None unless ``reference_kl_enabled``), ``max_grad_norm``."""
    return RLSettings(
        epochs=job.num_train_epochs,
        batch_size=job.train_batch_size,
        num_generations=job.num_generations,
        backend=job.rl_algorithm,
        normalize=job.advantage_normalization,
        kl_coef=job.reference_kl_coef if job.reference_kl_enabled else None,
        max_grad_norm=job.max_grad_norm,
    )


def round_prompts(paths: RunPaths, round_index: int, num_agents: int) -> dict[str, list[list[int]]]:
    """Per train item (in the candidates' order), every agent's prompt ids as stored in this round's candidates."""
    prompts: dict[str, list[list[int]]] = {}
    for (item_id, side, _), group in read_joint_responses(paths.candidates(round_index), num_agents).items():
        if side == "target":
            prompts.setdefault(item_id, [row["prompt_ids"] for row in group])
    return prompts


def rl_hooks(
    record: StageRecord,
    live: LiveLog,
    settings: RLSettings,
    seed: int,
    generate_rows: RolloutGenerator,
    score: Scorer,
    num_items: int,
) -> RLHooks:
    """What the stage ``record`` writes plugs into :func:`pbrl.learning.rl.run_rl`: the sampler (``generate_rows``,
    each row seeded by ``(seed, round, stage, "rollout", agent, item, epoch·g + generation)``), the reward model's
    ``score``, the order and dropout seeds, and after every step its ``live`` log and the stage's progress
    (``num_items`` items in ``settings.batch_size`` items per step)."""
    g = settings.num_generations

    def seed_of(side: str, agent: int = -1, item: str = "", index: int = -1) -> int:
        return derive_seed(
            seed, round_index=record.round_index, stage=record.stage, side=side, agent=agent, item=item, index=index
        )

    def sample(agent: int, rows: list[list[int]], items: list[str], epoch: int) -> list:
        draws = list(zip(items, [epoch * g + r % g for r in range(len(rows))], strict=True))
        return generate_rows(
            agent,
            rows,
            [seed_of("rollout", agent, item, k) for item, k in draws],
            [f"agent {agent}, item {item!r}, rollout {k}" for item, k in draws],
        )

    progress = record.progress(settings.epochs * -(-num_items // settings.batch_size), "steps")

    def on_step(items: int, metrics: dict[str, float]) -> None:
        live.step(items, metrics)
        progress.advance()

    return RLHooks(
        sample=sample,
        score=score,
        order_seed=seed_of("order"),
        dropout_seed=lambda agent, step: seed_of("dropout", agent, index=step),
        on_step=on_step,
    )


def reference_policies(job: JobConfig, paths: RunPaths, policies: list[TrainablePolicy]) -> list[ReferencePolicy]:
    """The frozen reference of each agent's KL: with LoRA the agent's own model with its adapter disabled (the base
    weights, no second copy), else the agent's initial checkpoint loaded frozen on ``reference_devices``."""
    source = policy_source(job)
    if source.lora is not None:  # the base weights: the agent's own model with its adapter disabled
        return [ReferencePolicy(p.model, p.pad_token_id, disable_adapter=True) for p in policies]
    return [
        ReferencePolicy(
            load_agent(source, i, paths.initial, trainable=False, devices=job.reference_devices).model,
            policies[i].pad_token_id,
        )
        for i in range(job.num_agents)
    ]


def round_critics(job: JobConfig, paths: RunPaths, start: Path, policies: list[TrainablePolicy]) -> CriticSet:
    """The maac/iac critics at ``start``: built fresh from the run seed (``start`` is the initial checkpoint),
    else restored from ``start/critic_<k>/`` (weights and AdamW state).

    Raises:
        ArtifactError: a round checkpoint without its critics, or with critics of another configuration.
    """
    source, maac = policy_source(job), job.rl_algorithm == "maac"
    separate = maac or job.use_separate_critic
    count = 1 if maac else job.num_agents
    sources = [job.critic_model_name or source.models[k] for k in range(count)]
    devices = _critic_devices(job.critic_devices, job.agent_devices, job.num_agents)
    critics = []
    for k in range(count):
        spec = (
            CriticSpec(
                "separate",
                sources[k],
                source.lora,
                job.critic_value_head_hidden_dim,
                joint_template=TEMPLATE_VERSION if maac else None,
            )
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
        _restore_critic(critic, start / f"critic_{k}", job.rl_algorithm, paths, start)
        critics.append(critic)
    return CriticSet(
        job.rl_algorithm,
        job.critic_type,
        critics,
        template=joint_template_for(sources[0], source.models)[0] if maac else None,
        max_length=job.reward_max_length,
        value_loss_coef=job.value_loss_coef,
        clip_range=job.value_clip_range,
        max_grad_norm=job.max_grad_norm,
    )


def _critic_devices(critic_devices: Any, agent_devices: Any, num_agents: int) -> list[str]:
    """Each critic's configured device: ``critic_devices``, else ``agent_devices`` (:func:`resolve_devices`)."""
    devices = critic_devices if critic_devices is not None else agent_devices
    return resolve_devices(
        devices if devices is None or isinstance(devices, str) else list(devices), num_agents, field="critic_devices"
    )


def _restore_critic(critic: Critic, folder: Path, backend: str, paths: RunPaths, start: Path) -> None:
    """Restore ``critic`` from ``folder`` (weights and AdamW state); at the initial checkpoint ``start`` without
    one, the fresh critic stays as built.

    Raises:
        ArtifactError: ``folder`` is missing from a round checkpoint ``start``.
    """
    if folder.is_dir():
        restore_critic(critic, folder)
    elif start != paths.initial:
        raise ArtifactError(
            f"{folder}: missing; the checkpoint was written without the {backend} "
            f"critics: rerun update-policies of the round that wrote {paths.rel(start)}"
        )


def _critic_device(device: str, policy: TrainablePolicy) -> str:
    """A separate critic's device: as configured, or (``auto`` placement) the device of its agent's inputs."""
    return str(policy.model.get_input_embeddings().weight.device) if device == "auto" else device
