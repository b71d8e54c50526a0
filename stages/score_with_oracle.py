"""Stage 2, score-with-oracle: one shared score per joint response (SPEC §5.1).

Joint response = every agent's completion at the same (item, side, candidate index). The oracle is
called on batches; a failed reward drops that joint response with a counted reason, and more than
``oracle_max_failure_share`` failures stop the round with a report naming the items.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from pbrl.config import JobConfig
from pbrl.errors import OracleError
from pbrl.items import read_items
from pbrl.oracle import OracleScore, score_batch
from pbrl.reward_model import DROP_TOO_LONG, RewardScorer, newest_reward_model, reward_device
from pbrl.run import resolve_task
from pbrl.schema import SCORES, read_joint_responses, write_table
from pbrl.stagekit import StageRecord
from pbrl.storage import RunPaths, StageManifest

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


def run(run_dir: str | Path, round_index: int, job: JobConfig) -> StageManifest:
    record = StageRecord(NAME, run_dir, round_index, job)
    paths = record.paths
    task = resolve_task(job, paths.root)
    items = {item["item_id"]: item for item in read_items(paths, "train")}
    joint = read_joint_responses(paths.candidates(round_index), job.num_agents)
    keys = list(joint)

    model = scoring_model(paths, round_index, job)
    scorer = None
    if model is not None:  # the reward model's raw score, without reward_processor (as the reference)
        scorer = RewardScorer(model[1], job.num_agents,
                              device=reward_device(job.reward_model_device, job.agent_devices, job.num_agents))
    rows, reasons = [], Counter()
    failed_items: Counter[str] = Counter()
    for start in range(0, len(keys), BATCH):
        chunk = keys[start:start + BATCH]
        groups = [joint[k] for k in chunk]
        if scorer is not None:
            scored = scorer.score([[r["prompt_ids"] for r in g] for g in groups],
                                  [[r["completion_ids"] for r in g] for g in groups])
            scores = [OracleScore(x, x) if x is not None else OracleScore(None, None, DROP_TOO_LONG) for x, _ in scored]
        else:
            scores = score_batch(
                task.reward_func, task.reward_processor,
                [[g[a]["completion"] for g in groups] for a in range(job.num_agents)],
                prompts=[[r["prompt"] for r in g] for g in groups],
                batch_items=[items[k[0]] for k in chunk],
            )
        for (item_id, side, index), s in zip(chunk, scores, strict=True):
            rows.append({"item_id": item_id, "side": side, "candidate_index": index,
                         "raw_reward": s.raw, "reward": s.reward, "failure": s.failure})
            if not s.ok:
                reasons[s.failure.split(":")[0]] += 1
                failed_items[item_id] += 1

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
    for side in sorted({k[1] for k in keys}):
        vals = [r["reward"] for r in rows if r["side"] == side and r["reward"] is not None]
        if vals:
            record.metrics[f"oracle/{side}_reward_mean"] = sum(vals) / len(vals)
    record.details = {"failure_reasons": dict(reasons), "failed_items": dict(failed_items),
                      "scored_by": "reward_model" if model else "task"}
    if model is not None:
        record.details.update({"reward_model": paths.rel(model[1]), "reward_model_round": model[0]})
        record.say(f"scored by the reward model fitted in round {model[0]} (preference_scoring_reward)")
    return record.finish(input_files(paths, round_index, job), [paths.scores(round_index)])
