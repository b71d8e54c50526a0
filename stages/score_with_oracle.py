"""Stage 2, score-with-oracle: one shared score per joint response (docs/design/algorithms.md#oracle).

Joint response = every agent's completion at the same (item, side, candidate index). The oracle is
called on batches; a failed reward drops that joint response with a counted reason, and more than
``oracle_max_failure_share`` failures stop the round with a report naming the items. With
``collaboration_mode: centralized`` each joint response is one actor's text, split into roles by the adapter
for the reward; the role texts go to ``roles.parquet``, and an unparsable response is dropped with the reason
``centralized_parse`` (counted, never stopping the round; :mod:`pbrl.generation.collaboration`).

With ``joint_mode: cross`` a joint response is a combination of the agents' candidates (every combination of an
item, or ``max_joint_responses_per_item`` of them drawn with the item's seed when there are more:
:func:`cross_joint_responses`), scored the same way in the same batches, and ``scores.parquet`` has the
:data:`~pbrl.data.schema.CROSS_SCORES` columns: each row names its combination's candidate of every agent
(docs/design/algorithms.md#cross-joint-responses-and-counterfactual-pairs).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from pbrl.config import JobConfig, MARLHFIterJob, actor_job, is_centralized, num_actors
from pbrl.data.items import read_items
from pbrl.data.schema import CROSS_SCORES, SCORES, Item, ScoreRow
from pbrl.data.storage import RunPaths, StageManifest
from pbrl.data.tables import read_joint_responses, write_table
from pbrl.distributed.shards import ShardSet, gather_shards
from pbrl.errors import ArtifactError, OracleError
from pbrl.generation.centralized import CentralizedAdapter
from pbrl.generation.collaboration import (
    PARSE_FAILURE,
    is_parse_failure,
    score_joint,
    write_candidate_roles,
)
from pbrl.learning.joint_template import DROP_TOO_LONG
from pbrl.learning.reward_scoring import RewardScorer, reward_device
from pbrl.preference.joint import JointKey, joint_rows
from pbrl.preference.joint import cross_refs as joint_cross_refs
from pbrl.preference.oracle import Oracle, OracleScore
from pbrl.preference.pairs import CandidateRef
from pbrl.run.progress import Progress
from pbrl.run.reward_records import newest_reward_model
from pbrl.run.settings import centralized_adapter
from pbrl.run.stage_record import StageRecord
from pbrl.run.task import resolve_task
from pbrl.tasks.base import Task

NAME = "score-with-oracle"
BATCH = 256  # joint responses per reward_func call


def scoring_model(paths: RunPaths, round_index: int, job: JobConfig) -> tuple[int, Path] | None:
    """With ``preference_scoring_reward: reward_model`` (MARLHF-iterative), the newest reward model fitted
    before this round, as (round, folder); None: the task reward scores (also until a model exists)."""
    if not (isinstance(job, MARLHFIterJob) and job.preference_scoring_reward == "reward_model"):
        return None  # the task scores; only MARLHF-iterative has the option
    return newest_reward_model(paths, round_index)


def cross_refs(joint: dict[JointKey, list[dict]], job: JobConfig, round_index: int):
    """:func:`pbrl.preference.joint.cross_refs` with the job's options."""
    return joint_cross_refs(
        joint,
        num_agents=job.num_agents,
        max_per_item=job.max_joint_responses_per_item,
        seed=job.seed,
        round_index=round_index,
    )


def joint_responses(joint: dict[JointKey, list[dict]], job: JobConfig, round_index: int) -> dict[JointKey, list[dict]]:
    """What the oracle scores: key -> the candidate row of every agent, in scoring order (aligned: ``joint`` itself;
    cross: the combinations of :func:`cross_refs`)."""
    return joint_rows(joint, cross_refs(joint, job, round_index)[0] if job.joint_mode == "cross" else None)


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
    joint = joint_responses(read_joint_responses(paths.candidates(round_index), job.num_agents), job, round_index)
    keys = [k for k in joint if k[0] in wanted]

    model = scoring_model(paths, round_index, job)
    scorer = None
    if model is not None:  # the reward model's raw score, without reward_processor (as the reference)
        scorer = RewardScorer(
            model[1], job.num_agents, device=reward_device(job.reward_model_device, job.agent_devices, job.num_agents)
        )
    rows = []
    progress = Progress(str(paths.root), round_index, NAME, len(keys), "joint responses")
    budget = int(job.oracle_max_failure_share * len(joint))  # of every shard's: more failures stop the round
    where = f"{NAME} round {round_index}"
    with Oracle(task.reward_func, task.reward_processor, job.reward_timeout, budget, where) as oracle:  # one worker
        for start in range(0, len(keys), BATCH):
            chunk = keys[start : start + BATCH]
            rows += _score_rows(chunk, [joint[k] for k in chunk], wanted, scorer, adapter, task, oracle, job)
            progress.advance(len(chunk))
    return rows, {}


def _score_rows(
    chunk: list[JointKey],
    groups: list[list[dict]],
    wanted: dict[str, Item],
    scorer: RewardScorer | None,
    adapter: CentralizedAdapter | None,
    task: Task,
    oracle: Oracle,
    job: JobConfig,
) -> list[ScoreRow]:
    """The score rows of one batch of joint responses: by the reward model, the centralized roles or the task."""
    if scorer is not None:
        scored = scorer.score(
            [[r["prompt_ids"] for r in g] for g in groups], [[r["completion_ids"] for r in g] for g in groups]
        )
        scores = [OracleScore(x, x) if x is not None else OracleScore(None, None, DROP_TOO_LONG) for x, _ in scored]
    elif adapter is not None:
        scores, _ = score_joint(
            adapter, task, [g[0]["completion"] for g in groups], [wanted[k[0]] for k in chunk], oracle
        )
    else:
        scores = oracle.score(
            [[g[a]["completion"] for g in groups] for a in range(job.num_agents)],
            prompts=[[r["prompt"] for r in g] for g in groups],
            batch_items=[wanted[k[0]] for k in chunk],
        )
    return [
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


def run(run_dir: str | Path, round_index: int, job: JobConfig, shards: ShardSet | None = None) -> StageManifest:
    """Score every joint response, or (``shards``) gather the rows the shards wrote (:mod:`pbrl.distributed.shards`);
    the table written is the same either way."""
    record = StageRecord(NAME, run_dir, round_index, job)
    paths = record.paths
    joint = read_joint_responses(paths.candidates(round_index), num_actors(job))
    cross = cross_refs(joint, job, round_index) if job.joint_mode == "cross" else None
    keys = list(cross[0] if cross else joint)
    model = scoring_model(paths, round_index, job)
    if shards is None:
        found, _ = collect(paths, round_index, job, read_items(paths, "train"))
    else:
        found, _ = gather_shards(paths, round_index, NAME, shards, SCORES)
    rows = _in_order(found, keys, round_index)
    reasons, failed_items = _failures(rows)
    _check_failures(record, keys, reasons, failed_items)
    if cross is None:
        write_table(paths.scores(round_index), rows, SCORES)
    else:
        rows = _write_cross(paths.scores(round_index), rows, keys, cross, job, record)
    outputs = [paths.scores(round_index)]
    if is_centralized(job):  # the role texts of each joint response (pbrl.generation.collaboration)
        outputs.append(
            write_candidate_roles(
                paths.candidates(round_index), paths.round_dir(round_index), centralized_adapter(job), job.num_agents
            )
        )
        record.counts["centralized_parse_failures"] = reasons[PARSE_FAILURE]
    _record_side_means(record, rows, keys)
    record.details = {
        "failure_reasons": dict(reasons),
        "failed_items": dict(failed_items),
        "scored_by": "reward_model" if model else "task",
    }
    if cross is not None:
        record.details.update({"joint_mode": "cross", "max_joint_responses_per_item": job.max_joint_responses_per_item})
    if model is not None:
        record.details.update({"reward_model": paths.rel(model[1]), "reward_model_round": model[0]})
        record.say(f"scored by the reward model fitted in round {model[0]} (preference_scoring_reward)")
    return record.finish(input_files(paths, round_index, job), outputs)


def _in_order(found: list[ScoreRow], keys: list[JointKey], round_index: int) -> list[ScoreRow]:
    """The score rows of ``keys``, in that order (candidates.parquet's; cross: cross_refs'), however they were
    computed.

    Raises:
        ArtifactError: a joint response of ``keys`` has no score row (names the first five).
    """
    by_key = {(r["item_id"], r["side"], r["candidate_index"]): r for r in found}
    missing = [k for k in keys if k not in by_key]
    if missing:
        raise ArtifactError(f"{NAME} round {round_index}: no score for joint response(s) {missing[:5]}")
    return [by_key[k] for k in keys]


def _check_failures(
    record: StageRecord, keys: list[JointKey], reasons: Counter[str], failed_items: Counter[str]
) -> None:
    """Say how many joint responses each reason dropped, and count the failures in the manifest.

    Raises:
        OracleError: more than ``oracle_max_failure_share`` of the joint responses failed (names the items and
            the reasons).
    """
    share = record.job.oracle_max_failure_share
    failed = sum(failed_items.values())
    for reason, n in reasons.items():
        record.say(f"{n} joint response(s) dropped: {reason}")
    if keys and failed / len(keys) > share:
        listing = ", ".join(f"{i} ({n})" for i, n in failed_items.most_common(20))
        raise OracleError(
            f"round {record.round_index}: {failed} of {len(keys)} joint responses could not be scored "
            f"(more than oracle_max_failure_share={share}); items: {listing}; "
            f"reasons: {dict(reasons)}"
        )
    record.counts = {"joint_responses": len(keys), "failed": failed}


def _record_side_means(record: StageRecord, rows: list[ScoreRow], keys: list[JointKey]) -> None:
    """The mean reward of each side's scored joint responses (``oracle/<side>_reward_mean``)."""
    for side in sorted({k[1] for k in keys}):
        vals = [r["reward"] for r in rows if r["side"] == side and r["reward"] is not None]
        if vals:
            record.metrics[f"oracle/{side}_reward_mean"] = sum(vals) / len(vals)


def _failures(rows: list[ScoreRow]) -> tuple[Counter[str], Counter[str]]:
    """The rows' failures by reason, and per item the failures that count toward ``oracle_max_failure_share``."""
    reasons: Counter[str] = Counter()
    failed_items: Counter[str] = Counter()
    for row in rows:
        if row["failure"] is not None:
            reasons[row["failure"].split(":")[0]] += 1
            if not is_parse_failure(row["failure"]):  # an unparsable joint response is dropped, never stops the round
                failed_items[row["item_id"]] += 1
    return reasons, failed_items


def _write_cross(
    path: Path,
    rows: list[ScoreRow],
    keys: list[JointKey],
    cross: tuple[dict[JointKey, CandidateRef], dict[str, int]],
    job: JobConfig,
    record: StageRecord,
) -> list[ScoreRow]:
    """Write the cross scores (:data:`~pbrl.data.schema.CROSS_SCORES`: each row names its combination's candidate
    of every agent) and count the combinations in the manifest; returns the rows written."""
    refs, counts = cross
    out = []
    for row, key in zip(rows, keys, strict=True):
        chosen = refs[key].agents or ()
        out.append({**row, "candidate_sides": [a[0] for a in chosen], "candidate_indices": [a[1] for a in chosen]})
    write_table(path, out, CROSS_SCORES)
    record.counts.update(counts)
    if counts["items_capped"]:
        limit = job.max_joint_responses_per_item
        record.say(
            f"{counts['items_capped']} item(s) have more than max_joint_responses_per_item={limit} combinations: "
            f"{len(keys)} of {counts['joint_combinations']} scored, drawn with each item's seed"
        )
    return out  # type: ignore[return-value]
