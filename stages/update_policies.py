"""Stage 7, update-policies: MADPO (docs/design/algorithms.md#madpo), ``num_train_epochs`` passes over the selected
pairs; or MARLHF policy learning (docs/design/algorithms.md#marlhf-policy-learning, :func:`pbrl.learning.rl.run_rl`):
``num_train_epochs`` passes over the round's train items (prompt ids as stored in this round's candidates),
rollouts scored by the round's fitted reward model and written to ``rounds/<r>/rollouts.parquet``. A MARLHF round
whose fit-reward-model fitted no model (no usable pairs) updates nothing, like a round without pairs.

Round r starts from the policy (and each agent's AdamW state) after round r-1 and writes
``checkpoints/round_<r>/`` (:mod:`pbrl.run.round_checkpoint`): per agent the weights (or LoRA adapter) and
optimizer state, then ``trainer_state.json`` last. The folder is assembled under a temporary name and renamed, so
a process killed mid-update leaves no checkpoint that a later stage would read. The manifest names the policy after
the round (``details.checkpoint``), and that is what later stages load
(:func:`pbrl.run.policy_records.policy_checkpoint`).

A round without pairs writes no checkpoint: its manifest names the previous policy, and a
``checkpoints/round_<r>/`` left by an earlier attempt of the round is deleted once that manifest is written
(a process killed in between leaves it unreferenced, so it is never loaded).

With ``rl_algorithm: maac | iac`` the critics (:mod:`pbrl.learning.critics`, built by
:mod:`pbrl.run.marlhf_setup`) are checkpointed beside the policies in ``checkpoints/round_<r>/critic_<k>/``
(trainable weights, AdamW state, ``critic.json``) and the next round restores them from there, exactly like the
agents; round 1 builds them fresh from the run seed.

Training forwards run with dropout on (``lora_dropout``); each agent's masks in each step come from their
own seed ``(seed, round, "update-policies", "dropout", agent, step)``, so a rerun is bitwise identical.
Trainable weights are float32 whatever ``torch_dtype`` is (see :func:`pbrl.models.loading.load_model`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pbrl.config import JobConfig, actor_job, is_marlhf
from pbrl.data.schema import ROLLOUTS, PairRow
from pbrl.data.seeds import derive_seed, numpy_rng
from pbrl.data.storage import RunPaths, StageManifest
from pbrl.data.tables import read_selected_pairs, write_table
from pbrl.distributed.ray_agents import gather, remote_agents, write_agents
from pbrl.learning.advantages import ACTOR_CRITIC
from pbrl.learning.critics import Critic
from pbrl.learning.madpo import LocalAgent, PairBatch, StepAgent, madpo_agents_step
from pbrl.learning.madpo_tally import MadpoTally
from pbrl.learning.rl import RLResult, rl_metrics, rollouts_path, run_rl
from pbrl.models.policies import TrainablePolicy, trainable_agent
from pbrl.run.marlhf_setup import (
    reference_policies,
    reward_model_fitted,
    reward_scorer,
    rl_hooks,
    rl_settings,
    rollout_generator,
    round_critics,
    round_prompts,
)
from pbrl.run.policy_records import policy_checkpoint
from pbrl.run.reward_records import reward_model_dir
from pbrl.run.round_checkpoint import LiveLog, RoundSteps, export_round, remove_stale, save_round, write_policies
from pbrl.run.selection_records import selected_source_rounds
from pbrl.run.settings import agent_training, ray_settings
from pbrl.run.stage_record import StageRecord

NAME = "update-policies"
RL_STEPS_PER_PAIR = 1  # MARLHF's RL counts each joint response once on the env-step axis (live log and train log)


def input_files(paths: RunPaths, round_index: int, job: JobConfig) -> list[Path]:
    files = [
        paths.selected_pairs(round_index),
        *(paths.pairs(r) for r in selected_source_rounds(paths, round_index)),
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


def run(run_dir: str | Path, round_index: int, job: JobConfig) -> StageManifest:
    record = StageRecord(NAME, run_dir, round_index, job)
    job = actor_job(job)  # centralized collaboration: one policy (agent_0), trained on the joint completions
    paths = record.paths
    pairs = selected_pairs(paths, round_index)
    start = policy_checkpoint(paths, round_index - 1)
    if pairs and is_marlhf(job.trainer) and not reward_model_fitted(paths, round_index):
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
        remove_stale(paths.round_checkpoint(round_index))
        export_round(job, start, round_index)
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
        write=lambda folder: write_policies(policies, folder),
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
    ``gather``, ``concurrent``); ``write(folder)`` writes every ``agent_<i>/`` into the checkpoint's temporary
    folder."""
    round_index, a = record.round_index, job.num_agents
    rng = numpy_rng(job.seed, round_index=round_index, stage=NAME)
    tally = MadpoTally(a)
    progress = record.progress(job.num_train_epochs * -(-len(pairs) // job.train_batch_size), "steps")
    live = LiveLog(record, job, start, job.environment_steps_per_pair)
    for _ in range(job.num_train_epochs):
        order = item_grouped_order(pairs, rng.permutation(len(pairs)))
        for begin in range(0, len(pairs), job.train_batch_size):
            chunk = [pairs[j] for j in order[begin : begin + job.train_batch_size]]
            stats = madpo_agents_step(
                agents,
                _batch(chunk, a),
                beta=job.dpo_beta,
                max_grad_norm=job.max_grad_norm,
                seeds=[_seed(job, round_index, "dropout", agent=i, index=tally.steps) for i in range(a)],
                gather=gather,
                concurrent=concurrent,
                micro_batch_size=-(-job.train_batch_size // job.gradient_accumulation_steps),
            )
            tally.add(stats, len(chunk))
            live.step(len(chunk), tally.step_metrics[-1])
            progress.advance()
    skipped = sum(tally.skipped)
    record.counts = {
        "pairs": len(pairs),
        "epochs": job.num_train_epochs,
        "steps": tally.steps,
        "skipped_steps": skipped,
    }
    if skipped:
        record.say(f"{skipped} agent step(s) skipped: non-finite loss or gradient")
    metrics = tally.metrics(_pairs_reward_mean(pairs))
    trained = _Trained(write, RoundSteps(tally.batch_sizes, tally.step_metrics, job.environment_steps_per_pair))
    return _record_update(record, job, start, trained, lambda env_step: {**metrics, "train/env_step": env_step})


def _load_policies(job: JobConfig, start: Path) -> tuple[list[TrainablePolicy], list]:
    """Every agent's policy at ``start``, trainable, with its AdamW (and the state stored beside it)."""
    loaded = [trainable_agent(agent_training(job), start, agent) for agent in range(job.num_agents)]
    return [policy for policy, _ in loaded], [tokenizer for _, tokenizer in loaded]


def _run_marlhf(
    record: StageRecord,
    job: JobConfig,
    pairs: list[PairRow],
    start: Path,
    policies: list[TrainablePolicy],
    tokenizers: list,
) -> StageManifest:
    """MARLHF policy learning (docs/design/algorithms.md#marlhf-policy-learning, :func:`pbrl.learning.rl.run_rl`)
    against this round's fitted reward model, on every train item, with the prompt ids stored in this round's
    candidates. The rollouts are generated in process, or with ``runner: ray`` in shards on Ray workers
    (:func:`pbrl.run.marlhf_setup.rollout_generator`): the same tokens, every row having its own seed."""
    paths, round_index, a = record.paths, record.round_index, job.num_agents
    scorer = reward_scorer(job, paths, round_index)
    prompts = round_prompts(paths, round_index, a)
    item_ids = list(prompts)
    generator = rollout_generator(job, start, policies, tokenizers, len(item_ids))
    references = reference_policies(job, paths, policies) if job.reference_kl_enabled else None
    rl = rl_settings(job)
    critics = round_critics(job, paths, start, policies) if job.rl_algorithm in ACTOR_CRITIC else None
    with generator as (generate_rows, rollout_details):
        live = LiveLog(record, job, start, RL_STEPS_PER_PAIR)
        result = run_rl(
            policies,
            [[prompts[item][i] for item in item_ids] for i in range(a)],
            item_ids,
            rl,
            rl_hooks(record, live, rl, job.seed, generate_rows, scorer.score, len(item_ids)),
            references=references,
            critics=critics,
        )
    rollouts = rollouts_path(paths.round_dir(round_index))
    write_table(rollouts, result.rollouts, ROLLOUTS)
    _count_rl(record, job, pairs, result, len(item_ids))
    trained = _Trained(
        lambda folder: write_policies(policies, folder),
        RoundSteps(result.batch_sizes, result.step_metrics, RL_STEPS_PER_PAIR),
        critics=critics.critics if critics is not None else None,
        details={"rl_algorithm": job.rl_algorithm, **rollout_details},
        outputs=(rollouts,),
    )
    reward_mean = _pairs_reward_mean(pairs)
    return _record_update(
        record,
        job,
        start,
        trained,
        lambda env_step: {
            **rl_metrics(result, a),
            **(critics.metrics() if critics is not None else {}),
            "train/env_step": env_step,
            "turn_1/reward_mean": reward_mean,
            "turn_1/expected_return": reward_mean,
        },
    )


def _seed(job: JobConfig, round_index: int, side: str, agent: int = -1, item: str = "", index: int = -1) -> int:
    """The seed ``(seed, round, "update-policies", side, agent, item, index)`` (:func:`pbrl.data.seeds.derive_seed`)."""
    return derive_seed(job.seed, round_index=round_index, stage=NAME, side=side, agent=agent, item=item, index=index)


def _count_rl(record: StageRecord, job: JobConfig, pairs: list[PairRow], result: RLResult, num_items: int) -> None:
    """The RL pass's counts and its messages (skipped agent steps, item groups left out) in ``record``."""
    record.counts = {
        "pairs": len(pairs),
        "items": num_items,
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


@dataclass(frozen=True)
class _Trained:
    """What an update path trained, for :func:`_record_update`: ``write(folder)`` writes every ``agent_<i>/`` of the
    checkpoint, its steps (each one's row count and metrics, the env steps per pair), the critics (maac/iac), the
    path's own manifest details and the files it wrote besides the checkpoint."""

    write: Callable[[Path], None]
    steps: RoundSteps
    critics: list[Critic] | None = None
    details: dict[str, Any] = field(default_factory=dict)
    outputs: tuple[Path, ...] = ()


def _record_update(
    record: StageRecord,
    job: JobConfig,
    start: Path,
    trained: _Trained,
    metrics: Callable[[float], dict[str, float]],
) -> StageManifest:
    """The recording both update paths share: the round checkpoint with its train log
    (:func:`pbrl.run.round_checkpoint.save_round`), the round's metrics (``metrics(env_step)``: the path's own, in
    its order, given the env step of the last update; NaN for none), the manifest's details (``checkpoint``,
    ``updated``, the path's details, ``train_log``), the manifest, the export (``policy_checkpoint_dir``)."""
    paths, round_index = record.paths, record.round_index
    checkpoint, axis, log = save_round(
        paths, job, round_index, start, trained.write, trained.steps, critics=trained.critics
    )
    record.metrics = metrics(float(axis[-1]) if axis else float("nan"))
    record.details = {
        **record.details,
        "checkpoint": paths.rel(checkpoint),
        "updated": True,
        **trained.details,
        "train_log": [{k: v for k, v in row.items() if math.isfinite(v)} for row in log],
    }
    manifest = record.finish(input_files(paths, round_index, job), [checkpoint, *trained.outputs])
    export_round(job, checkpoint, round_index)
    return manifest


def _pairs_reward_mean(pairs: list) -> float:
    """The mean task reward of the pairs' items' candidates (the reference's ``turn_1/reward_mean``); NaN for judged
    pairs of a task without a reward (nothing to average)."""
    means = [p["candidate_reward_mean"] for p in pairs if p["candidate_reward_mean"] is not None]
    return sum(means) / len(means) if means else float("nan")
