"""The questions of a round judged by a judge (docs/design/stages.md#judge-pairs): the pairs that build-pairs would
form from scores (:mod:`pbrl.preference.questions`), ordered by ``pair_selection`` without scores,
``preference_pairs_per_sample`` per item, at most ``judge_max_pairs`` of the round, each asked in both orders
(``judge_position_swap``) or in one order drawn per question and recorded. The stage judge-pairs asks them; the
labelling of ``judge: human`` (:mod:`pbrl.run.labelling`) shows the same ones to people."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Literal

from pbrl.config import JobConfig, is_iterative
from pbrl.config.judge_fields import HUMAN_JUDGE
from pbrl.data.items import read_items
from pbrl.data.schema import CROSS_SCORES, SCORES
from pbrl.data.seeds import numpy_rng
from pbrl.data.storage import RunPaths
from pbrl.data.tables import read_joint_responses, read_rows
from pbrl.judging.verdicts import Comparison
from pbrl.preference.joint import JointKey, cross_refs, joint_rows
from pbrl.preference.questions import (
    Question,
    base_questions,
    cross_questions,
    iterative_questions,
    keep,
    least_sure,
    order_questions,
    within_budget,
)
from pbrl.run.pair_margins import question_margins

STAGE = "judge-pairs"  # the stage whose seeds draw the orders and the budget (the same draws as before the move)


def position_swap(job: JobConfig) -> bool:
    """Whether each question is asked in both orders: ``judge_position_swap``, or when unset, for every judge but a
    person (``judge: human`` labels each pair once)."""
    if job.judge_position_swap is not None:
        return job.judge_position_swap
    return job.judge != HUMAN_JUDGE


@dataclass(frozen=True)
class Asking:
    """One question in one order: shown_first is the joint response shown as A."""

    question_id: str
    item_id: str
    question: Question
    shown_first: Literal["x", "y"]
    comparison: Comparison


def _rewards(paths: RunPaths, round_index: int, job: JobConfig) -> dict[JointKey, float | None]:
    """Each joint response's processed task reward (None where the oracle dropped it); empty without scores."""
    if not paths.scores(round_index).is_file():
        return {}
    rows = read_rows(paths.scores(round_index), CROSS_SCORES if job.joint_mode == "cross" else SCORES)
    return {(r["item_id"], r["side"], r["candidate_index"]): r["reward"] for r in rows}


def _item_questions(job: JobConfig, keys: list[JointKey], refs: dict | None) -> list[Question]:
    """One item's questions (``keys``: its joint responses)."""
    if refs is not None:
        return cross_questions([refs[k] for k in keys], iterative=is_iterative(job.trainer))
    target = [k[2] for k in keys if k[1] == "target"]
    if is_iterative(job.trainer):
        return iterative_questions(target, [k[2] for k in keys if k[1] == "comparator"])
    return base_questions(target)


def round_askings(
    paths: RunPaths, round_index: int, job: JobConfig, roles: tuple[str, ...]
) -> tuple[list[Asking], Counter[str]]:
    """Every asking of the round, questions in item order then the order pair_selection keeps them, and the
    counts of how the questions were chosen (``roles``: the agents' role names, shown to the judge).

    Raises:
        ArtifactError: the round's candidates (or scores) are missing or malformed.
    """
    joint = read_joint_responses(paths.candidates(round_index), job.num_agents)
    refs = None
    if job.joint_mode == "cross":
        refs, _ = cross_refs(joint, num_agents=job.num_agents, max_per_item=job.max_joint_responses_per_item,
                             seed=job.seed, round_index=round_index)  # fmt: skip
    rows_of = joint_rows(joint, refs)
    rewards = _rewards(paths, round_index, job)
    items = {item["item_id"]: item for item in read_items(paths, "train")}
    by_item: dict[str, list[JointKey]] = {}
    for key in rows_of:
        by_item.setdefault(key[0], []).append(key)
    counts: Counter[str] = Counter()
    per_item: list[tuple[str, list[Question]]] = []
    for item_id, keys in by_item.items():
        questions = _item_questions(job, keys, refs)
        usable = [q for q in questions if not _has_empty(rows_of, item_id, q)]
        counts["rejected_empty"] += len(questions) - len(usable)
        rng = numpy_rng(job.seed, round_index=round_index, stage=STAGE, item=item_id)
        per_item.append(
            (item_id, keep(order_questions(usable, job.pair_selection, rng), job.preference_pairs_per_sample))
        )
    flat = [(item_id, q) for item_id, questions in per_item for q in questions]
    chosen = _choose(paths, round_index, job, rows_of, flat, [q for _, q in per_item], counts)
    counts["questions_kept"] = len(chosen)
    askings: list[Asking] = []
    for number, ((item_id, q), asked) in enumerate(zip(flat, chosen, strict=True)):
        if not asked:
            continue
        question_id = f"r{round_index:04d}-q{number:05d}"
        x, y = (rows_of[(item_id, ref.side, ref.index)] for ref in (q.x, q.y))
        reward_x, reward_y = (rewards.get((item_id, ref.side, ref.index)) for ref in (q.x, q.y))
        base = Comparison(item_id, tuple(r["prompt"] for r in x), roles, tuple(r["completion"] for r in x),
                          tuple(r["completion"] for r in y), items.get(item_id, {}),
                          None if reward_x is None or reward_y is None else (reward_x, reward_y))  # fmt: skip
        orders: list[Literal["x", "y"]] = ["x", "y"]
        if not position_swap(job):  # one order, drawn per question
            draw = numpy_rng(job.seed, round_index=round_index, stage=STAGE, item=item_id, index=number)
            orders = [orders[int(draw.integers(2))]]
        for shown in orders:
            comparison = base if shown == "x" else base.swapped()
            askings.append(Asking(question_id, item_id, q, shown, comparison))
    counts["questions_asked"] = len({a.question_id for a in askings})
    return askings, counts


def _choose(
    paths: RunPaths,
    round_index: int,
    job: JobConfig,
    rows_of: dict[JointKey, list[dict]],
    flat: list[tuple[str, Question]],
    per_item: list[list[Question]],
    counts: Counter[str],
) -> list[bool]:
    """Which questions fit the label budget (``judge_max_pairs``): drawn at random, or with ``judge_pair_choice:
    uncertain`` those the current model is least sure about (:mod:`pbrl.run.pair_margins`; at random while there
    is no model to ask). ``counts["questions_by_margin"]`` says which."""
    rng = numpy_rng(job.seed, round_index=round_index, stage=STAGE, side="budget")
    over = job.judge_max_pairs is not None and len(flat) > job.judge_max_pairs
    if job.judge_pair_choice == "uncertain" and over:
        margins = question_margins(paths, round_index, job, rows_of, flat)
        if margins is not None:
            counts["questions_by_margin"] = job.judge_max_pairs or 0
            return least_sure(margins, job.judge_max_pairs, rng)
    return within_budget(per_item, job.judge_max_pairs, rng)


def _has_empty(rows_of: dict[JointKey, list[dict]], item_id: str, q: Question) -> bool:
    return any(not row["completion"].strip() for ref in (q.x, q.y) for row in rows_of[(item_id, ref.side, ref.index)])
