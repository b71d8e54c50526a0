"""Stage 3, build-pairs: scores become (winner, loser) joint-response pairs
(docs/design/algorithms.md#pair-construction).

Base trainers pair an item's own target candidates; iterative trainers compare target j with
comparator j only. Ties (within ``tie_tolerance``) give no pair; a pair with an empty completion is
rejected and counted; every agent's completion of a winner comes from the same candidate index.

With ``joint_mode: cross`` the joint responses are the scored combinations of scores.parquet
(:data:`~pbrl.data.schema.CROSS_SCORES`) and the pairs are :func:`pbrl.preference.pairs.cross_candidate_pairs`; each
pair row names every agent's candidate on both sides, and its token ids stay in the round's candidates.parquet
(:data:`~pbrl.data.schema.CROSS_PAIRS`, read back with :func:`pbrl.data.tables.read_pairs`).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from pbrl.config import JobConfig, is_iterative, is_marlhf, num_actors
from pbrl.data.schema import CROSS_SCORES, PAIR_JOINT_IDS, PAIRS, SCORES, VERDICTS
from pbrl.data.seeds import numpy_rng
from pbrl.data.storage import RunPaths, StageManifest
from pbrl.data.tables import cross_pairs_schema, read_joint_responses, read_rows, write_table
from pbrl.learning.joint_template import joint_template_for, pair_joint_rows
from pbrl.preference.pairs import (
    CandidateRef,
    JudgedPair,
    Pair,
    base_candidate_pairs,
    changed_agents,
    cross_candidate_pairs,
    iterative_candidate_pairs,
)
from pbrl.preference.selection import select_pairs
from pbrl.run.reward_records import pair_joint_ids_path
from pbrl.run.settings import policy_source
from pbrl.run.stage_record import StageRecord

NAME = "build-pairs"


def input_files(paths: RunPaths, round_index: int, job: JobConfig) -> list[Path]:
    if job.preference_source == "judge":  # the verdicts decide; the scores, when the task has some, fill rewards
        scores = [paths.scores(round_index)] if paths.scores(round_index).is_file() else []
        return [paths.candidates(round_index), paths.verdicts(round_index), *scores]
    return [paths.candidates(round_index), paths.scores(round_index)]


def run(run_dir: str | Path, round_index: int, job: JobConfig) -> StageManifest:
    record = StageRecord(NAME, run_dir, round_index, job)
    paths = record.paths
    if job.preference_source == "judge":
        return _run_judged(record, round_index, job)
    if job.joint_mode == "cross":
        return _run_cross(record, round_index, job)
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
    return _finish(record, round_index, job, rows, rejected, no_pair_items, len(item_order))


def _finish(
    record: StageRecord,
    round_index: int,
    job: JobConfig,
    rows: list[dict],
    rejected: int,
    no_pair: int,
    items: int,
    extra: dict[str, int] | None = None,
) -> StageManifest:
    """Count (``extra``: more counts), write MARLHF's joint ids (``rows`` with their token ids), say what people
    should know, and finish."""
    paths = record.paths
    record.counts = {
        "pairs": len(rows),
        "rejected_empty": rejected,
        "items_without_pairs": no_pair,
        "items": items,
        **(extra or {}),
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


def _run_cross(record: StageRecord, round_index: int, job: JobConfig) -> StageManifest:
    """``joint_mode: cross``: the pairs among each item's scored combinations (base trainers: any two; iterative: a
    target combination against itself with some agents' candidates replaced by comparator ones), then
    ``pair_selection`` and the cap per item, as in the aligned modes."""
    paths = record.paths
    iterative = is_iterative(job.trainer)
    joint = read_joint_responses(paths.candidates(round_index), job.num_agents)
    scored: dict[str, dict[CandidateRef, tuple[float, float]]] = defaultdict(dict)
    for s in read_rows(paths.scores(round_index), CROSS_SCORES):
        if s["failure"] is None:
            agents = tuple(zip(s["candidate_sides"], s["candidate_indices"], strict=True))
            scored[s["item_id"]][CandidateRef(s["side"], s["candidate_index"], agents)] = (s["reward"], s["raw_reward"])
    item_order = list(dict.fromkeys(k[0] for k in joint))
    rows: list[dict] = []
    rejected = no_pair_items = 0
    for item_id in item_order:
        refs = scored.get(item_id, {})
        candidates = cross_candidate_pairs(
            {r: v[0] for r, v in refs.items()}, iterative=iterative, tie_tolerance=job.tie_tolerance
        )
        usable = [p for p in candidates if not _has_empty(joint, item_id, p)]
        rejected += len(candidates) - len(usable)
        rng = numpy_rng(job.seed, round_index=round_index, stage=NAME, item=item_id)
        chosen = select_pairs(
            usable, pair_selection=job.pair_selection, pairs_per_sample=job.preference_pairs_per_sample, rng=rng
        )
        no_pair_items += not chosen
        mean = sum(v[0] for v in refs.values()) / len(refs) if refs else 0.0
        raw = {r: v[1] for r, v in refs.items()}
        for p in chosen:
            rows.append(_cross_pair_row(round_index, len(rows), item_id, p, joint, raw, mean, iterative))
    # On disk the token ids stay in candidates.parquet, which the file names (with its hash): read_pairs fills them.
    on_disk = [{**r, "prompt_ids": None, "winner_ids": None, "loser_ids": None} for r in rows]
    write_table(paths.pairs(round_index), on_disk, cross_pairs_schema(paths.candidates(round_index)))
    counterfactual = sum(len(r["changed_agents"]) == 1 for r in rows)
    extra = {"counterfactual_pairs": counterfactual}
    return _finish(record, round_index, job, rows, rejected, no_pair_items, len(item_order), extra)


def _run_judged(record: StageRecord, round_index: int, job: JobConfig) -> StageManifest:
    """``preference_source: judge``: the questions judge-pairs decided (verdicts.parquet), in their order, each as a
    pair of its preferred joint response over the other; ties and undecided questions give no pair. Rewards are the
    task's where it has scores, else null."""
    paths = record.paths
    iterative, cross = is_iterative(job.trainer), job.joint_mode == "cross"
    joint = read_joint_responses(paths.candidates(round_index), job.num_agents)
    scored: dict[tuple[str, str, int], tuple[float | None, float | None]] = {}
    if paths.scores(round_index).is_file():
        for s in read_rows(paths.scores(round_index), CROSS_SCORES if cross else SCORES):
            scored[(s["item_id"], s["side"], s["candidate_index"])] = (s["reward"], s["raw_reward"])
    questions: dict[str, dict] = {}
    for v in read_rows(paths.verdicts(round_index), VERDICTS):
        questions.setdefault(v["question_id"], v)  # every row of a question carries its preference
    rows: list[dict] = []
    decided: dict[str, int] = defaultdict(int)
    for v in questions.values():
        if v["preference"] not in ("x", "y"):
            continue
        item_id = v["item_id"]
        x, y = (_judged_ref(v, side) for side in ("x", "y"))
        winner, loser = (x, y) if v["preference"] == "x" else (y, x)
        (w_reward, w_raw), (l_reward, l_raw) = (
            scored.get((item_id, r.side, r.index), (None, None)) for r in (winner, loser)
        )
        pair = JudgedPair(winner, loser, w_reward, l_reward)
        item_rewards = [r for (i, _, _), (r, _) in scored.items() if i == item_id and r is not None]
        mean = sum(item_rewards) / len(item_rewards) if item_rewards else None
        if cross:
            rows.append(_cross_pair_row(round_index, len(rows), item_id, pair, joint, {winner: w_raw, loser: l_raw},
                                        mean, iterative))  # fmt: skip
        else:
            sides = (joint[(item_id, winner.side, winner.index)], joint[(item_id, loser.side, loser.index)])
            rows.append(_row(round_index, len(rows), item_id, pair, sides, (w_raw, l_raw), mean, iterative))
        decided[item_id] += 1
    items = list(dict.fromkeys(k[0] for k in joint))
    if cross:
        on_disk = [{**r, "prompt_ids": None, "winner_ids": None, "loser_ids": None} for r in rows]
        write_table(paths.pairs(round_index), on_disk, cross_pairs_schema(paths.candidates(round_index)))
        extra = {"counterfactual_pairs": sum(len(r["changed_agents"]) == 1 for r in rows)}
    else:
        write_table(paths.pairs(round_index), rows, PAIRS)
        extra = {}
    ties = sum(v["preference"] == "tie" for v in questions.values())
    extra.update({"judged_ties": ties, "judged_undecided": sum(v["preference"] is None for v in questions.values())})
    return _finish(record, round_index, job, rows, 0, sum(1 for i in items if not decided[i]), len(items), extra)


def _judged_ref(verdict: dict, which: str) -> CandidateRef:
    """Joint response ``which`` ("x" or "y") of a verdicts.parquet row."""
    sides, indices = verdict[f"{which}_candidate_sides"], verdict[f"{which}_candidate_indices"]
    agents = None if sides is None else tuple(zip(sides, indices, strict=True))
    return CandidateRef(verdict[f"{which}_side"], verdict[f"{which}_index"], agents)  # type: ignore[arg-type]


def _write_joint_ids(paths: RunPaths, round_index: int, job: JobConfig, rows: list[dict], record: StageRecord) -> Path:
    source = policy_source(job)
    template, _ = joint_template_for(job.reward_model_name or source.models[0], source.models)
    joint = pair_joint_rows(rows, template, job.reward_max_length)
    path = pair_joint_ids_path(paths.round_dir(round_index))
    write_table(path, joint, PAIR_JOINT_IDS)
    record.counts["joint_ids_dropped_too_long"] = sum(j["dropped"] is not None for j in joint)
    record.counts["joint_prompt_tokens_cut"] = sum(j["prompt_tokens_cut"] for j in joint)
    return path


def _agent_rows(joint: dict, item_id: str, ref: CandidateRef) -> list[dict]:
    """Every agent's candidate row of joint response ``ref``: all at its index, or (cross) each at its own."""
    if ref.agents is None:
        return joint[(item_id, ref.side, ref.index)]
    return [joint[(item_id, side, index)][agent] for agent, (side, index) in enumerate(ref.agents)]


def _has_empty(joint: dict, item_id: str, pair: Pair) -> bool:
    return any(
        not row["completion"].strip() for ref in (pair.winner, pair.loser) for row in _agent_rows(joint, item_id, ref)
    )


def _pair_row(round_index, pair_index, item_id, p: Pair, joint, by_side, mean, iterative) -> dict:
    w = joint[(item_id, p.winner.side, p.winner.index)]
    lo = joint[(item_id, p.loser.side, p.loser.index)]
    raw = (by_side[p.winner.side][p.winner.index][1], by_side[p.loser.side][p.loser.index][1])
    return _row(round_index, pair_index, item_id, p, (w, lo), raw, mean, iterative)


def _row(round_index, pair_index, item_id, p: Pair, rows, raw, mean, iterative) -> dict:
    """The columns aligned and cross pairs share; ``rows`` = the (winner, loser) joint responses' agent rows and
    ``raw`` their raw rewards."""
    (w, lo), (raw_w, raw_l) = rows, raw
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


def _cross_pair_row(round_index, pair_index, item_id, p: Pair, joint, raw, mean, iterative) -> dict:
    """A :data:`~pbrl.data.schema.CROSS_PAIRS` row, token ids included (the caller drops them before writing)."""
    rows = (_agent_rows(joint, item_id, p.winner), _agent_rows(joint, item_id, p.loser))
    return {
        **_row(round_index, pair_index, item_id, p, rows, (raw[p.winner], raw[p.loser]), mean, iterative),
        "winner_candidate_sides": [side for side, _ in p.winner.agents or ()],
        "winner_candidate_indices": [index for _, index in p.winner.agents or ()],
        "loser_candidate_sides": [side for side, _ in p.loser.agents or ()],
        "loser_candidate_indices": [index for _, index in p.loser.agents or ()],
        "changed_agents": list(changed_agents(p)),
    }
