"""Stage 2, score-with-oracle: one shared score per joint response (docs/design/algorithms.md#oracle).

Joint response = every agent's completion at the same (item, side, candidate index). The oracle is
called on batches; a failed reward drops that joint response with a counted reason, and more than
``oracle_max_failure_share`` failures stop the round with a report naming the items. With
``collaboration_mode: centralized`` each joint response is one actor's text, split into roles by the adapter
for the reward; the role texts go to ``roles.parquet``, and an unparsable response is dropped with the reason
``centralized_parse`` (counted, never stopping the round; :mod:`pbrl.generation.collaboration`).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from pbrl.config import JobConfig, actor_job, is_centralized, num_actors
from pbrl.data.items import read_items
from pbrl.data.schema import SCORES, Item, ScoreRow, read_joint_responses, write_table
from pbrl.data.storage import RunPaths, StageManifest
from pbrl.distributed.shards import ShardSet, gather_shards
from pbrl.errors import ArtifactError, OracleError
from pbrl.generation.collaboration import (
    PARSE_FAILURE,
    is_parse_failure,
    score_joint,
    write_candidate_roles,
)
from pbrl.learning.joint_template import DROP_TOO_LONG
from pbrl.learning.reward_model import RewardScorer, newest_reward_model, reward_device
from pbrl.preference.oracle import OracleScore, score_batch
from pbrl.run.progress import Progress
from pbrl.run.settings import centralized_adapter
from pbrl.run.stage_record import StageRecord
from pbrl.run.task import resolve_task

NAME = "score-with-oracle"
BATCH = 256  # joint responses per reward_func call


def scoring_model(paths: RunPaths, round_index: int, job: JobConfig) -> tuple[int, Path] | None:
    """With ``preference_scoring_reward: reward_model`` (MARLHF-iterative), the newest reward model fitted
    before this round, as (round, folder); None: the task reward scores (also until a model exists)."""
    if getattr(job, "preference_scoring_reward", "task") != "reward_model":
        return None
    return newest_reward_model(paths, round_index)


def input_files(paths: RunPaths, round_index: int, job: JobConfig) -> list[Path]:
    model = scoring_model(paths, round_index, job)
    return [paths.items, paths.candidates(round_index), *([model[1]] if model else [])]


def items_to_shard(paths: RunPaths, round_index: int, job: JobConfig) -> list[Item]:
    """The items this stage splits into shards (runner 'ray'): the train items."""
    return read_items(paths, "train")


def collect(
    paths: RunPaths, round_index: int, job: JobConfig, items: list[Item]
) -> tuple[list[ScoreRow], dict[str, int]]:
    """The score row of every joint response of ``items`` (all train items, or one shard's), in the order of
    candidates.parquet; no counts (the gather derives them from the rows)."""
    task = resolve_task(job, paths.root)
    adapter = centralized_adapter(job)  # one actor (centralized): its joint responses split into roles
    job = actor_job(job)
    wanted = {item["item_id"]: item for item in items}
    joint = read_joint_responses(paths.candidates(round_index), job.num_agents)
    keys = [k for k in joint if k[0] in wanted]

    model = scoring_model(paths, round_index, job)
    scorer = None
    if model is not None:  # the reward model's raw score, without reward_processor (as the reference)
        scorer = RewardScorer(
            model[1], job.num_agents, device=reward_device(job.reward_model_device, job.agent_devices, job.num_agents)
        )
    rows = []
    progress = Progress(str(paths.root), round_index, NAME, len(keys), "joint responses")
    for start in range(0, len(keys), BATCH):
        chunk = keys[start : start + BATCH]
        groups = [joint[k] for k in chunk]
        if scorer is not None:
            scored = scorer.score(
                [[r["prompt_ids"] for r in g] for g in groups], [[r["completion_ids"] for r in g] for g in groups]
            )
            scores = [OracleScore(x, x) if x is not None else OracleScore(None, None, DROP_TOO_LONG) for x, _ in scored]
        elif adapter is not None:
            scores, _ = score_joint(
                adapter, task, [g[0]["completion"] for g in groups], [wanted[k[0]] for k in chunk], job.reward_timeout
            )
        else:
            scores = score_batch(
                task.reward_func,
                task.reward_processor,
                [[g[a]["completion"] for g in groups] for a in range(job.num_agents)],
                prompts=[[r["prompt"] for r in g] for g in groups],
                batch_items=[wanted[k[0]] for k in chunk],
                timeout_s=job.reward_timeout,
            )
        rows += [
            {
                "item_id": item_id,
                "side": side,
                "candidate_index": index,
                "raw_reward": s.raw,
                "reward": s.reward,
                "failure": s.failure,
            }
            for (item_id, side, index), s in zip(chunk, scores, strict=True)
        ]
        progress.advance(len(chunk))
    return rows, {}


def run(run_dir: str | Path, round_index: int, job: JobConfig, shards: ShardSet | None = None) -> StageManifest:
    """Score every joint response, or (``shards``) gather the rows the shards wrote (:mod:`pbrl.distributed.shards`);
    the table written is the same either way."""
    record = StageRecord(NAME, run_dir, round_index, job)
    paths = record.paths
    keys = list(read_joint_responses(paths.candidates(round_index), num_actors(job)))
    model = scoring_model(paths, round_index, job)
    if shards is None:
        found, _ = collect(paths, round_index, job, read_items(paths, "train"))
    else:
        found, _ = gather_shards(paths, round_index, NAME, shards, SCORES)
    by_key = {(r["item_id"], r["side"], r["candidate_index"]): r for r in found}
    missing = [k for k in keys if k not in by_key]
    if missing:
        raise ArtifactError(f"{NAME} round {round_index}: no score for joint response(s) {missing[:5]}")
    rows = [by_key[k] for k in keys]  # candidates.parquet's order, however the rows were computed
    reasons: Counter[str] = Counter()
    failed_items: Counter[str] = Counter()
    for row in rows:
        if row["failure"] is not None:
            reasons[row["failure"].split(":")[0]] += 1
            if not is_parse_failure(row["failure"]):  # an unparsable joint response is dropped, never stops the round
                failed_items[row["item_id"]] += 1

    failed = sum(failed_items.values())
    for reason, n in reasons.items():
        record.say(f"{n} joint response(s) dropped: {reason}")
    if keys and failed / len(keys) > job.oracle_max_failure_share:
        listing = ", ".join(f"{i} ({n})" for i, n in failed_items.most_common(20))
        raise OracleError(
            f"round {round_index}: {failed} of {len(keys)} joint responses could not be scored "
            f"(more than oracle_max_failure_share={job.oracle_max_failure_share}); items: {listing}; "
            f"reasons: {dict(reasons)}"
        )
    write_table(paths.scores(round_index), rows, SCORES)
    record.counts = {"joint_responses": len(keys), "failed": failed}
    outputs = [paths.scores(round_index)]
    if is_centralized(job):  # the role texts of each joint response (pbrl.generation.collaboration)
        outputs.append(
            write_candidate_roles(
                paths.candidates(round_index), paths.round_dir(round_index), centralized_adapter(job), job.num_agents
            )
        )
        record.counts["centralized_parse_failures"] = reasons[PARSE_FAILURE]
    for side in sorted({k[1] for k in keys}):
        vals = [r["reward"] for r in rows if r["side"] == side and r["reward"] is not None]
        if vals:
            record.metrics[f"oracle/{side}_reward_mean"] = sum(vals) / len(vals)
    record.details = {
        "failure_reasons": dict(reasons),
        "failed_items": dict(failed_items),
        "scored_by": "reward_model" if model else "task",
    }
    if model is not None:
        record.details.update({"reward_model": paths.rel(model[1]), "reward_model_round": model[0]})
        record.say(f"scored by the reward model fitted in round {model[0]} (preference_scoring_reward)")
    return record.finish(input_files(paths, round_index, job), outputs)
