"""Stage 3, build-pairs: scores become (winner, loser) joint-response pairs
(docs/design/algorithms.md#pair-construction).

Base trainers pair an item's own target candidates; iterative trainers compare target j with
comparator j only. Ties (within ``tie_tolerance``) give no pair; a pair with an empty completion is
rejected and counted; every agent's completion of a winner comes from the same candidate index.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from pbrl.config import JobConfig, is_iterative, is_marlhf, num_actors
from pbrl.data.schema import PAIR_JOINT_IDS, PAIRS, SCORES, read_joint_responses, read_rows, write_table
from pbrl.data.seeds import numpy_rng
from pbrl.data.storage import RunPaths, StageManifest
from pbrl.learning.joint_template import joint_template_for, pair_joint_rows
from pbrl.learning.reward_model import pair_joint_ids_path
from pbrl.preference.pairs import Pair, base_candidate_pairs, iterative_candidate_pairs, select_pairs
from pbrl.run.settings import policy_source
from pbrl.run.stage_record import StageRecord

NAME = "build-pairs"


def input_files(paths: RunPaths, round_index: int, job: JobConfig) -> list[Path]:
    return [paths.candidates(round_index), paths.scores(round_index)]


def run(run_dir: str | Path, round_index: int, job: JobConfig) -> StageManifest:
    record = StageRecord(NAME, run_dir, round_index, job)
    paths = record.paths
    iterative = is_iterative(job.trainer)
    joint = read_joint_responses(paths.candidates(round_index), num_actors(job))  # one actor when centralized
    scores: dict[str, dict[str, dict[int, tuple[float, float]]]] = defaultdict(lambda: defaultdict(dict))
    for s in read_rows(paths.scores(round_index), SCORES):
        if s["failure"] is None:
            scores[s["item_id"]][s["side"]][s["candidate_index"]] = (s["reward"], s["raw_reward"])
    item_order = list(dict.fromkeys(k[0] for k in joint))

    rows: list[dict] = []
    rejected = no_pair_items = 0
    for item_id in item_order:
        by_side = scores.get(item_id, {})
        target = {k: v[0] for k, v in by_side.get("target", {}).items()}
        comparator = {k: v[0] for k, v in by_side.get("comparator", {}).items()}
        if iterative:
            candidates = iterative_candidate_pairs(target, comparator, tie_tolerance=job.tie_tolerance)
            compared = [*target.values(), *comparator.values()]
        else:
            candidates = base_candidate_pairs(target, tie_tolerance=job.tie_tolerance)
            compared = list(target.values())
        usable = [p for p in candidates if not _has_empty(joint, item_id, p)]
        rejected += len(candidates) - len(usable)
        rng = numpy_rng(job.seed, round_index=round_index, stage=NAME, item=item_id)
        chosen = select_pairs(
            usable, pair_selection=job.pair_selection, pairs_per_sample=job.preference_pairs_per_sample, rng=rng
        )
        if not chosen:
            no_pair_items += 1
        mean = sum(compared) / len(compared) if compared else 0.0
        for p in chosen:
            rows.append(_pair_row(round_index, len(rows), item_id, p, joint, by_side, mean, iterative))

    write_table(paths.pairs(round_index), rows, PAIRS)
    record.counts = {
        "pairs": len(rows),
        "rejected_empty": rejected,
        "items_without_pairs": no_pair_items,
        "items": len(item_order),
    }
    outputs = [paths.pairs(round_index)]
    if is_marlhf(
        job.trainer
    ):  # the reward model's joint input ids, stored with the pairs (docs/design/algorithms.md#joint-reward-model)
        outputs.append(_write_joint_ids(paths, round_index, job, rows, record))
    if rejected:
        record.say(f"{rejected} pair(s) rejected: a winner or loser has an empty completion")
    if not rows:
        record.say("no preference pairs this round: every comparison tied or was rejected")
    return record.finish(input_files(paths, round_index, job), outputs)


def _write_joint_ids(paths: RunPaths, round_index: int, job: JobConfig, rows: list[dict], record: StageRecord) -> Path:
    source = policy_source(job)
    template, _ = joint_template_for(job.reward_model_name or source.models[0], source.models)
    joint = pair_joint_rows(rows, template, job.reward_max_length)
    path = pair_joint_ids_path(paths.round_dir(round_index))
    write_table(path, joint, PAIR_JOINT_IDS)
    record.counts["joint_ids_dropped_too_long"] = sum(j["dropped"] is not None for j in joint)
    record.counts["joint_prompt_tokens_cut"] = sum(j["prompt_tokens_cut"] for j in joint)
    return path


def _has_empty(joint: dict, item_id: str, pair: Pair) -> bool:
    return any(
        not row["completion"].strip()
        for ref in (pair.winner, pair.loser)
        for row in joint[(item_id, ref.side, ref.index)]
    )


def _pair_row(round_index, pair_index, item_id, p: Pair, joint, by_side, mean, iterative) -> dict:
    w = joint[(item_id, p.winner.side, p.winner.index)]
    lo = joint[(item_id, p.loser.side, p.loser.index)]
    raw_w = by_side[p.winner.side][p.winner.index][1]
    raw_l = by_side[p.loser.side][p.loser.index][1]
    target_raw = comparator_raw = None
    if iterative:
        target_raw = raw_w if p.winner.side == "target" else raw_l
        comparator_raw = raw_w if p.winner.side == "comparator" else raw_l
    # The prompts are the target's (docs/design/file-formats.md#pairs); in every shipped comparator they are the same
    # text.
    prompt_rows = w if p.winner.side == "target" else lo
    return {
        "pair_id": f"r{round_index:04d}-p{pair_index:05d}",
        "round_index": round_index,
        "pair_index": pair_index,
        "item_id": item_id,
        "winner_side": p.winner.side,
        "winner_index": p.winner.index,
        "loser_side": p.loser.side,
        "loser_index": p.loser.index,
        "winner_reward": p.winner_score,
        "loser_reward": p.loser_score,
        "winner_raw_reward": raw_w,
        "loser_raw_reward": raw_l,
        "candidate_reward_mean": mean,
        "target_raw_reward": target_raw,
        "comparator_raw_reward": comparator_raw,
        "prompts": [r["prompt"] for r in prompt_rows],
        "prompt_ids": [r["prompt_ids"] for r in prompt_rows],
        "winner_completions": [r["completion"] for r in w],
        "winner_ids": [r["completion_ids"] for r in w],
        "loser_completions": [r["completion"] for r in lo],
        "loser_ids": [r["completion_ids"] for r in lo],
    }
