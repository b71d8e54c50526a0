"""Stage 8, evaluate: the current policies on the first ``eval_num_samples`` evaluation items
(docs/design/stages.md#evaluate).

``eval_samples_per_item`` sampled completions per agent per item, each draw with its own seed from
``(run seed, stage, agent, item, sample)`` and *not* from the round, so every round samples with the same
seeds and round r is compared with round 0 on the same draws (common random numbers: the uniforms are
shared, only the policy differs). ``eval_batch_size`` rows per generate call, as the reference's eval
dataloader batch, which does not change the sampled tokens. Each joint response is scored with the task
reward (``reward_func`` + ``reward_processor``), never with a learned reward model. Round 0 is the baseline
of the initial policies; round r evaluates the policy after round r's update.

Rows of ``eval.parquet`` are item-major: the s-th row of an item is its sample s (:func:`sample_keys`).
Metrics (:mod:`pbrl.reporting.stats`, item-level bootstrap): ``eval/reward_mean`` with ``eval/reward_ci_low/high``, and
from round 1 on, when round 0 was evaluated, the paired difference to round 0 over the shared draws,
``eval/paired_diff_mean`` with ``eval/paired_diff_ci_low/high``. The manifest counts the evaluation items that
also occur among the training items (same content, ids aside): held-out evaluation needs 0. With
``collaboration_mode: centralized`` one actor writes each draw's joint response, split into roles for the task
reward (role texts in ``eval_roles.parquet``; an unparsable draw fails with ``centralized_parse``).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pbrl.config import JobConfig, actor_job, is_centralized
from pbrl.data.items import read_items
from pbrl.data.schema import EVAL, EvalRow, Item
from pbrl.data.seeds import derive_seed, numpy_rng
from pbrl.data.storage import RunPaths, StageManifest
from pbrl.data.tables import read_rows, write_table
from pbrl.distributed.shards import ShardSet, gather_shards
from pbrl.errors import OracleError
from pbrl.generation.collaboration import actor_prompts, is_parse_failure, score_joint, write_eval_roles
from pbrl.generation.sampling import encode_prompt, generate
from pbrl.judging.win_rate import SampleKey, draw_comparisons, win_values
from pbrl.models.policies import load_agent
from pbrl.preference.oracle import Oracle, OracleScore
from pbrl.reporting.stats import mean_interval, paired_difference
from pbrl.run.askings import position_swap
from pbrl.run.judging import answer_store, judge_for
from pbrl.run.policy_records import policy_checkpoint
from pbrl.run.progress import Progress
from pbrl.run.settings import centralized_adapter, policy_source, sampling_settings
from pbrl.run.stage_record import StageRecord
from pbrl.run.task import resolve_task

NAME = "evaluate"
BASELINE_ROUND = 0


def input_files(paths: RunPaths, round_index: int, job: JobConfig) -> list[Path]:
    files = [paths.items, policy_checkpoint(paths, round_index)]
    if round_index > BASELINE_ROUND and paths.eval(BASELINE_ROUND).is_file():  # the paired baseline
        files.append(paths.eval(BASELINE_ROUND))
    return files


def eval_seed(seed: int, agent: int, item_id: str, sample: int) -> int:
    """The sampling seed of one evaluation draw: the same in every round (round 0's key is used throughout)."""
    return derive_seed(
        seed, round_index=BASELINE_ROUND, stage=NAME, side="eval", agent=agent, item=item_id, index=sample
    )


def sample_keys(item_ids: Sequence[str]) -> list[SampleKey]:
    """``(item_id, s)`` of each row, s = how many earlier rows have the same item (rows are item-major)."""
    seen: dict[str, int] = {}
    keys = []
    for item_id in item_ids:
        keys.append((item_id, seen.get(item_id, 0)))
        seen[item_id] = seen.get(item_id, 0) + 1
    return keys


def items_seen_in_training(eval_items: Sequence[Item], train_items: Sequence[Item]) -> list[str]:
    """Ids of the evaluation items whose content (every field but ``item_id``) equals a training item's."""

    def content(item: dict) -> str:
        return json.dumps({k: v for k, v in item.items() if k != "item_id"}, sort_keys=True, default=str)

    train = {content(item) for item in train_items}
    return [item["item_id"] for item in eval_items if content(item) in train]


def rewards_by_draw(rows: Sequence[EvalRow]) -> dict[SampleKey, float]:
    """``{(item_id, s): reward}`` of an eval table's rows that have a reward (it did not fail; the task has one)."""
    keys = sample_keys([row["item_id"] for row in rows])
    return {
        key: row["reward"]
        for key, row in zip(keys, rows, strict=True)
        if row["failure"] is None and row["reward"] is not None
    }


def items_to_shard(paths: RunPaths, round_index: int, job: JobConfig) -> list[Item]:
    """The items this stage splits into shards (runner 'ray'): the first ``eval_num_samples`` evaluation items."""
    return read_items(paths, "eval")[: job.eval_num_samples]


# Over 60 lines: one pass reads top to bottom (each agent generates its rows, the task scores the joint rows,
# the rows are assembled); the eval row's fields, spelled out one per line, are a third of it.
def collect(
    paths: RunPaths, round_index: int, job: JobConfig, items: list[Item]
) -> tuple[list[EvalRow], dict[str, int]]:
    """The eval rows of ``items`` (all evaluated items, or one shard's), item-major; no counts.

    Each draw samples with its own seed and is scored on its own, so the rows of a subset are the same rows
    as in a run over all items.
    """
    task = resolve_task(job, paths.root)
    adapter = centralized_adapter(job)  # one actor (centralized): its joint responses split into roles
    job = actor_job(job)
    draws = [(item, s) for item in items for s in range(job.eval_samples_per_item)]  # item-major rows
    checkpoint = policy_checkpoint(paths, round_index)
    settings = sampling_settings(job, job.eval_batch_size)  # eval_batch_size rows per generate call
    prompts, completions = [], []
    progress = Progress(str(paths.root), round_index, NAME, job.num_agents * len(draws), "rows")
    for agent, agent_prompts in enumerate(actor_prompts(task, [item for item, _ in draws], adapter)):
        policy = load_agent(policy_source(job), agent, checkpoint, trainable=False)
        seeds = [eval_seed(job.seed, agent, item["item_id"], s) for item, s in draws]
        names = [f"agent {agent}, eval item {item['item_id']!r}, sample {s}" for item, s in draws]
        gens = generate(
            policy.model,
            policy.tokenizer,
            [encode_prompt(policy.tokenizer, p) for p in agent_prompts],
            seeds,
            settings,
            row_names=names,
            on_rows=progress.advance,
        )
        prompts.append(agent_prompts)
        completions.append(gens)
        del policy
    if task.reward_func is None:  # a task without a reward: the judge compares rounds (win_rate_metrics)
        return _rows(draws, prompts, completions, [OracleScore(None, None)] * len(draws), job.num_agents), {}
    every_draw = len(items_to_shard(paths, round_index, job)) * job.eval_samples_per_item  # of every shard's
    budget = int(job.oracle_max_failure_share * every_draw)  # more failures stop the round (check_failures)
    where = f"{NAME} round {round_index}"
    with Oracle(task.reward_func, task.reward_processor, job.reward_timeout, budget, where) as oracle:
        if adapter is not None:  # centralized collaboration: the task reward on the role texts
            texts = [g.text for g in completions[0]]
            scores, _ = score_joint(adapter, task, texts, [item for item, _ in draws], oracle) if draws else ([], [])
        else:
            scores = (
                oracle.score(
                    [[g.text for g in gens] for gens in completions],
                    prompts=[[prompts[a][j] for a in range(job.num_agents)] for j in range(len(draws))],
                    batch_items=[item for item, _ in draws],
                )
                if draws
                else []
            )
    return _rows(draws, prompts, completions, scores, job.num_agents), {}


def _rows(draws: list, prompts: list, completions: list, scores: list, num_agents: int) -> list[EvalRow]:
    """The eval rows of the draws, item-major: every agent's prompt and completion, and the draw's score."""
    return [
        {
            "item_id": item["item_id"],
            "prompts": [prompts[a][j] for a in range(num_agents)],
            "completions": [completions[a][j].text for a in range(num_agents)],
            "completion_ids": [completions[a][j].completion_ids for a in range(num_agents)],
            "finish_reasons": [completions[a][j].finish_reason for a in range(num_agents)],
            "stop_token_ids": [completions[a][j].stop_token_id for a in range(num_agents)],
            "raw_reward": s.raw,
            "reward": s.reward,
            "failure": s.failure,
        }
        for j, ((item, _), s) in enumerate(zip(draws, scores, strict=True))
    ]


def run(run_dir: str | Path, round_index: int, job: JobConfig, shards: ShardSet | None = None) -> StageManifest:
    """Evaluate the round's policies, or (``shards``) gather the rows the shards wrote (:mod:`pbrl.distributed.shards`,
    contiguous item ranges in order, so the rows stay item-major); the table written is the same either way."""
    record = StageRecord(NAME, run_dir, round_index, job)
    paths = record.paths
    items = items_to_shard(paths, round_index, job)
    checkpoint = policy_checkpoint(paths, round_index)
    if shards is None:
        rows, _ = collect(paths, round_index, job, items)
    else:
        rows, _ = gather_shards(paths, round_index, NAME, shards, EVAL)
    write_table(paths.eval(round_index), rows, EVAL)
    outputs = [paths.eval(round_index)]
    if is_centralized(job):  # the role texts of each draw (pbrl.generation.collaboration)
        outputs.append(write_eval_roles(rows, paths.round_dir(round_index), centralized_adapter(job), job.num_agents))
    seen = items_seen_in_training(items, read_items(paths, "train"))
    rewards = rewards_by_draw(rows)
    task = resolve_task(job, paths.root)
    record.counts = {
        "items": len(items),
        "samples": len(rows),
        "failed": sum(r["failure"] is not None for r in rows),
        "items_seen_in_training": len(seen),
    }
    # Said by the run's first evaluation only: the items are the same every round, and the count is recorded in
    # every round (eval/items_seen_in_training).
    if seen and not any(paths.eval(r).is_file() for r in range(round_index)):
        record.say(
            f"{len(seen)} of {len(items)} evaluation items are also training items (e.g. {seen[0]!r}): "
            "this evaluation is not held out; give eval_dataset or a task with its own eval items"
        )
    check_failures(record, rows, job.oracle_max_failure_share)
    record.metrics = summary_metrics(paths, round_index, job.seed, rewards)
    if judged_evaluation(job, task.reward_func is not None) and round_index > BASELINE_ROUND:
        record.metrics |= win_rate_metrics(record, rows, task.role_names(job.num_agents), items)
    record.details = {"checkpoint": paths.rel(checkpoint), "samples_per_item": job.eval_samples_per_item}
    return record.finish(input_files(paths, round_index, job), outputs)


def check_failures(record: StageRecord, rows: Sequence[EvalRow], max_share: float) -> None:
    """Say how many draws failed and why, and stop the round when the reward failed on every draw or on more than
    ``oracle_max_failure_share`` of them. Unparsable centralized responses never stop it (as in
    score-with-oracle); when they leave nothing measured, the note says so.

    Raises:
        OracleError: naming the round, the counts, the items and the reasons (eval.parquet, already written,
            holds each draw's failure).
    """
    reasons = Counter(str(row["failure"]).split(":")[0] for row in rows if row["failure"] is not None)
    failed = sum(reasons.values())
    if not failed:
        return
    nothing = failed == len(rows)
    lead = "measured nothing: " if nothing else ""
    record.say(f"{lead}{failed} of {len(rows)} evaluation draw(s) could not be scored: {dict(reasons)}")
    counted = Counter(
        row["item_id"] for row in rows if row["failure"] is not None and not is_parse_failure(row["failure"])
    )
    if counted and (nothing or counted.total() / len(rows) > max_share):
        listing = ", ".join(f"{i} ({n})" for i, n in counted.most_common(20))
        what = "every draw" if nothing else f"more than oracle_max_failure_share={max_share} of the draws"
        table = record.paths.rel(record.paths.eval(record.round_index))
        raise OracleError(
            f"evaluate round {record.round_index} measured nothing reliable: the reward failed on {what} "
            f"({failed} of {len(rows)} failed); items: {listing}; reasons: {dict(reasons)}; each draw's failure is "
            f"in {table}; fix the reward, then resume the run or rerun this stage "
            f"(pbrl stage evaluate --run {record.paths.root} --round {record.round_index})"
        )


def summary_metrics(paths: RunPaths, round_index: int, seed: int, rewards: dict[SampleKey, float]) -> dict[str, float]:
    """Mean reward with its interval, and the paired difference to round 0 from round 1 on ({} without rewards)."""
    if not rewards:
        return {}
    boot_seed = derive_seed(seed, round_index=round_index, stage=NAME, side="bootstrap")
    now = mean_interval(rewards, seed=boot_seed)
    plain = sum(rewards.values()) / len(rewards)
    # Single turn: the expected return equals the mean reward (the reference logs both; mean over draws).
    metrics = {
        "eval/turn_1/reward_mean": plain,
        "eval/turn_1/expected_return": plain,
        "eval/reward_mean": now.mean,
        "eval/reward_ci_low": now.low,
        "eval/reward_ci_high": now.high,
    }
    baseline_file = paths.eval(BASELINE_ROUND)
    if round_index > BASELINE_ROUND and baseline_file.is_file():
        baseline = rewards_by_draw(read_rows(baseline_file, EVAL))
        if any(key in baseline for key in rewards):  # else round 0 drew other items (e.g. fewer samples)
            diff = paired_difference(rewards, baseline, seed=boot_seed)
            metrics |= {
                "eval/paired_diff_mean": diff.mean,
                "eval/paired_diff_ci_low": diff.low,
                "eval/paired_diff_ci_high": diff.high,
                "eval/paired_items": float(diff.n),
            }
    return metrics


def judged_evaluation(job: JobConfig, scored: bool) -> bool:
    """Whether the judge evaluates (a judge's preferences and a task without a reward to score draws by)."""
    return job.preference_source == "judge" and not scored


def win_rate_metrics(record: StageRecord, rows: list[EvalRow], roles: tuple[str, ...], items: list[Item]) -> dict:
    """The judge's win rate of this round's draws against round 0's (:mod:`pbrl.judging.win_rate`): its mean over
    items with the item-level 95 % interval, and the counts of the askings (into ``record.counts``); {} when round 0
    was not evaluated or no draw got a verdict."""
    paths, job, round_index = record.paths, record.job, record.round_index
    if not paths.eval(BASELINE_ROUND).is_file():
        return {}
    current = dict(zip(sample_keys([r["item_id"] for r in rows]), rows, strict=True))
    base_rows = read_rows(paths.eval(BASELINE_ROUND), EVAL)
    baseline = dict(zip(sample_keys([r["item_id"] for r in base_rows]), base_rows, strict=True))
    judge = judge_for(job, paths.root, resolve_task(job, paths.root))

    def order_rng(key: SampleKey) -> np.random.Generator:
        return numpy_rng(job.seed, round_index=round_index, stage=NAME, side="judge", item=key[0], index=key[1])

    askings = draw_comparisons(current, baseline, roles, {i["item_id"]: i for i in items},
                               swap=position_swap(job), order_rng=order_rng)  # fmt: skip
    progress = record.progress(len(askings), "judged draws")
    values, counts = win_values(judge, answer_store(paths), askings, disagreement=job.judge_swap_disagreement,
                                on_answers=progress.advance)  # fmt: skip
    record.counts.update({f"judge_{k}": v for k, v in counts.items()})
    if not values:
        record.say("the judge decided no draw against round 0: no win rate this round")
        return {}
    interval = mean_interval(values, seed=derive_seed(job.seed, round_index=round_index, stage=NAME, side="win"))
    return {
        "eval/win_rate": interval.mean,
        "eval/win_rate_ci_low": interval.low,
        "eval/win_rate_ci_high": interval.high,
        "eval/win_rate_draws": float(len(values)),
    }
