"""Stage 7, update-policies: MADPO (docs/design/algorithms.md#madpo), ``num_train_epochs`` passes over the selected
pairs; or MARLHF policy learning (docs/design/algorithms.md#marlhf-policy-learning, :func:`pbrl.learning.rl.run_rl`):
``num_train_epochs`` passes over the round's train items (prompt ids as stored in this round's candidates),
rollouts scored by the round's fitted reward model and written to ``rounds/<r>/rollouts.parquet``. A MARLHF round
whose fit-reward-model fitted no model (no usable pairs) updates nothing, like a round without pairs.

Round r starts from the policy (and each agent's AdamW state) after round r-1 and writes
``checkpoints/round_<r>/`` (:mod:`pbrl.run.round_checkpoint`): per agent the weights (or LoRA adapter) and
optimizer state, then ``trainer_state.json`` last. The folder is assembled under a temporary name and renamed, so
a process killed mid-update leaves no checkpoint that a later stage would read. The manifest names the policy after
the round (``details.checkpoint``), and that is what later stages load (:func:`pbrl.models.policies.policy_checkpoint`).

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
from pathlib import Path
from typing import Any

import torch

from pbrl.config import JobConfig, actor_job, is_marlhf
from pbrl.data.schema import ROLLOUTS, SELECTED_PAIRS, PairRow
from pbrl.data.seeds import derive_seed, numpy_rng
from pbrl.data.storage import RunPaths, StageManifest
from pbrl.data.tables import read_joint_responses, read_rows, read_selected_pairs, write_table
from pbrl.distributed.ray_agents import gather, remote_agents, write_agents
from pbrl.learning.advantages import ACTOR_CRITIC
from pbrl.learning.madpo import LocalAgent, PairBatch, StepAgent, madpo_agents_step
from pbrl.learning.reward_scoring import reward_model_dir
from pbrl.learning.rl import rl_metrics, rollouts_path, run_rl
from pbrl.models.policies import TrainablePolicy, trainable_agent
from pbrl.run.marlhf_setup import (
    reference_policies,
    reward_model_fitted,
    reward_scorer,
    rl_settings,
    rollout_generator,
    round_critics,
)
from pbrl.run.policy_records import policy_checkpoint
from pbrl.run.round_checkpoint import LiveLog, export_round, remove_stale, save_round, write_policies
from pbrl.run.settings import agent_training, ray_settings
from pbrl.run.stage_record import StageRecord

NAME = "update-policies"


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


# Over 60 lines: the stage's MADPO branch reads as one recipe (seeded item-grouped batches through
# madpo_agents_step, the per-agent tallies, checkpoint, metrics and manifest) over shared local state.
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
    paths, round_index = record.paths, record.round_index
    rng = numpy_rng(job.seed, round_index=round_index, stage=NAME)
    losses, accuracies, steps, skipped = [], [], 0, [0] * job.num_agents
    batch_sizes: list[int] = []
    margin_sums = torch.zeros(job.num_agents, dtype=torch.float64)
    n_margins = 0
    total_steps = job.num_train_epochs * -(-len(pairs) // job.train_batch_size)
    progress = record.progress(total_steps, "steps")
    live = LiveLog(record, job, start)
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
    checkpoint, axis, log = save_round(
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
    reward_mean = _pairs_reward_mean(pairs)
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
    export_round(job, checkpoint, round_index)
    return manifest


def _load_policies(job: JobConfig, start: Path) -> tuple[list[TrainablePolicy], list]:
    """Every agent's policy at ``start``, trainable, with its AdamW (and the state stored beside it)."""
    loaded = [trainable_agent(agent_training(job), start, agent) for agent in range(job.num_agents)]
    return [policy for policy, _ in loaded], [tokenizer for _, tokenizer in loaded]


# Over 60 lines: the stage's MARLHF branch reads as one recipe (the round's prompts, reward model, references and
# critics, RL with its seeds and live log, rollouts, checkpoint, metrics and manifest) over shared local state.
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
    paths, round_index, a, g = record.paths, record.round_index, job.num_agents, job.num_generations
    scorer = reward_scorer(job, paths, round_index)
    prompts: dict[str, list[list[int]]] = {}
    for (item_id, side, _), group in read_joint_responses(paths.candidates(round_index), a).items():
        if side == "target":
            prompts.setdefault(item_id, [row["prompt_ids"] for row in group])
    item_ids = list(prompts)

    def seed(side: str, agent: int = -1, item: str = "", index: int = -1) -> int:
        return derive_seed(
            job.seed, round_index=round_index, stage=NAME, side=side, agent=agent, item=item, index=index
        )

    generator = rollout_generator(job, start, policies, tokenizers, len(item_ids))
    references = reference_policies(job, paths, policies) if job.reference_kl_enabled else None
    rl = rl_settings(job)
    critics = round_critics(job, paths, start, policies) if job.rl_algorithm in ACTOR_CRITIC else None
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
        live = LiveLog(record, job, start)

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
    checkpoint, axis, log = save_round(
        paths,
        job,
        round_index,
        start,
        lambda folder: write_policies(policies, folder),
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
    reward_mean = _pairs_reward_mean(pairs)
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
    export_round(job, checkpoint, round_index)
    return manifest


def _pairs_reward_mean(pairs: list) -> float:
    """The mean task reward of the pairs' items' candidates (the reference's ``turn_1/reward_mean``); NaN for judged
    pairs of a task without a reward (nothing to average)."""
    means = [p["candidate_reward_mean"] for p in pairs if p["candidate_reward_mean"] is not None]
    return sum(means) / len(means) if means else float("nan")
