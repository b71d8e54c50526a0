"""Stage judge-pairs (``preference_source: judge``): a pairwise judge says which of two joint responses is better,
for the pairs that ``pair_selection`` keeps (docs/design/stages.md#judge-pairs, docs/guides/judges.md).

The questions are the pairs that build-pairs would form from scores (:mod:`pbrl.preference.questions`), ordered by
``pair_selection`` without scores, ``preference_pairs_per_sample`` per item, then at most ``judge_max_pairs`` of the
round drawn at random. Each is asked in both orders (``judge_position_swap``) or in one order drawn per question.
Answers come from the run's store when the same question was answered before (:mod:`pbrl.judging.store`): a rerun,
a resume or ``pbrl stage judge-pairs --force`` asks the judge nothing it has answered. The verdicts, one row per
asking with the judge's name, the order shown, the raw answer, its tokens and seconds, are written to
``verdicts.parquet``; build-pairs turns the decided questions into pairs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pbrl.config import JobConfig, is_iterative
from pbrl.data.items import read_items
from pbrl.data.schema import CROSS_SCORES, SCORES, VERDICTS
from pbrl.data.seeds import numpy_rng
from pbrl.data.storage import RunPaths, StageManifest
from pbrl.data.tables import read_joint_responses, read_rows, write_table
from pbrl.errors import OracleError
from pbrl.judging.asking import Asked, ask
from pbrl.judging.verdicts import Comparison, preference_of
from pbrl.preference.joint import JointKey, cross_refs, joint_rows
from pbrl.preference.questions import (
    Question,
    base_questions,
    cross_questions,
    iterative_questions,
    keep,
    order_questions,
    within_budget,
)
from pbrl.run.judging import answer_store, judge_for
from pbrl.run.stage_record import StageRecord
from pbrl.run.task import resolve_task

NAME = "judge-pairs"
BATCH = 32  # comparisons per call of the judge (and per write of the answer store)
JUDGE_RAISED = "the judge raised"  # the start of the reason of an answer whose judge raised (pbrl.judging)


@dataclass(frozen=True)
class Asking:
    """One question in one order: shown_first is the joint response shown as A."""

    question_id: str
    item_id: str
    question: Question
    shown_first: Literal["x", "y"]
    comparison: Comparison


def input_files(paths: RunPaths, round_index: int, job: JobConfig) -> list[Path]:
    scores = [paths.scores(round_index)] if paths.scores(round_index).is_file() else []
    template = [Path(job.judge_prompt_template)] if job.judge_prompt_template else []
    return [paths.items, paths.candidates(round_index), *scores, *template]


def run(run_dir: str | Path, round_index: int, job: JobConfig) -> StageManifest:
    record = StageRecord(NAME, run_dir, round_index, job)
    paths = record.paths
    task = resolve_task(job, paths.root)
    judge = judge_for(job, paths.root, task)
    askings, counts = _askings(paths, round_index, job, task.role_names(job.num_agents))
    progress = record.progress(len(askings), "answers")
    budget = job.judge_api_max_tokens_per_round if job.judge == "api" else None
    asked = ask(judge, [a.comparison for a in askings], answer_store(paths), batch_size=BATCH, token_budget=budget,
                on_answers=progress.advance)  # fmt: skip
    rows = _verdict_rows(askings, asked, judge.name, job.judge_swap_disagreement)
    _check_failures(rows, round_index, job.oracle_max_failure_share)
    write_table(paths.verdicts(round_index), rows, VERDICTS)
    _record(record, rows, asked, counts, judge.name)
    agreement = _reward_agreement(askings, rows, job.tie_tolerance)
    if agreement is not None:
        record.metrics["judge/reward_agreement"] = agreement
    return record.finish(input_files(paths, round_index, job), [paths.verdicts(round_index)])


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


def _askings(
    paths: RunPaths, round_index: int, job: JobConfig, roles: tuple[str, ...]
) -> tuple[list[Asking], Counter[str]]:
    """Every asking of the round, questions in item order then the order pair_selection keeps them, and the
    counts of how the questions were chosen."""
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
        rng = numpy_rng(job.seed, round_index=round_index, stage=NAME, item=item_id)
        per_item.append(
            (item_id, keep(order_questions(usable, job.pair_selection, rng), job.preference_pairs_per_sample))
        )
    chosen = within_budget([q for _, q in per_item], job.judge_max_pairs,
                           numpy_rng(job.seed, round_index=round_index, stage=NAME, side="budget"))  # fmt: skip
    counts["questions_kept"] = len(chosen)
    askings: list[Asking] = []
    flat = [(item_id, q) for item_id, questions in per_item for q in questions]
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
        if not job.judge_position_swap:  # one order, drawn per question
            draw = numpy_rng(job.seed, round_index=round_index, stage=NAME, item=item_id, index=number)
            orders = [orders[int(draw.integers(2))]]
        for shown in orders:
            comparison = base if shown == "x" else base.swapped()
            askings.append(Asking(question_id, item_id, q, shown, comparison))
    counts["questions_asked"] = len({a.question_id for a in askings})
    return askings, counts


def _has_empty(rows_of: dict[JointKey, list[dict]], item_id: str, q: Question) -> bool:
    return any(not row["completion"].strip() for ref in (q.x, q.y) for row in rows_of[(item_id, ref.side, ref.index)])


def _verdict_rows(askings: list[Asking], asked: list[Asked], judge: str, disagreement: str) -> list[dict]:
    """The rows of verdicts.parquet, each question's preference on every row of it."""
    answers: dict[str, list] = {}
    for a, got in zip(askings, asked, strict=True):
        answers.setdefault(a.question_id, []).append((got.answer, a.shown_first))
    preferences = {qid: preference_of(pairs, disagreement) for qid, pairs in answers.items()}
    rows = []
    for a, got in zip(askings, asked, strict=True):
        answer, (preference, why) = got.answer, preferences[a.question_id]
        x, y = a.question.x, a.question.y
        rows.append({
            "question_id": a.question_id, "item_id": a.item_id,
            "x_side": x.side, "x_index": x.index, "y_side": y.side, "y_index": y.index,
            "x_candidate_sides": None if x.agents is None else [s for s, _ in x.agents],
            "x_candidate_indices": None if x.agents is None else [i for _, i in x.agents],
            "y_candidate_sides": None if y.agents is None else [s for s, _ in y.agents],
            "y_candidate_indices": None if y.agents is None else [i for _, i in y.agents],
            "shown_first": a.shown_first, "judge": judge, "key": got.key, "verdict": answer.verdict,
            "probability": answer.probability, "raw_answer": answer.raw, "tokens": answer.tokens,
            "seconds": answer.seconds, "reason": answer.reason, "preference": preference, "preference_reason": why,
        })  # fmt: skip
    return rows


def _check_failures(rows: list[dict], round_index: int, max_share: float) -> None:
    """Stop the round when the judge raised on more than ``max_share`` (``oracle_max_failure_share``) of its askings.

    Raises:
        OracleError: naming the items and the first reasons.
    """
    raised = [r for r in rows if (r["reason"] or "").startswith(JUDGE_RAISED)]
    if rows and len(raised) / len(rows) > max_share:
        items = Counter(r["item_id"] for r in raised).most_common(20)
        reasons = Counter(r["reason"] for r in raised).most_common(3)
        raise OracleError(
            f"round {round_index}: the judge raised on {len(raised)} of {len(rows)} askings (more than "
            f"oracle_max_failure_share={max_share}); items: {', '.join(f'{i} ({n})' for i, n in items)}; "
            f"reasons: {', '.join(f'{r} ({n})' for r, n in reasons)}"
        )


def _reward_agreement(askings: list[Asking], rows: list[dict], tie_tolerance: float) -> float | None:
    """Among the decided questions whose joint responses both have task rewards that do not tie, the share where
    the judge prefers the better-rewarded one (the task reward as a yardstick of the judge); None without any."""
    agree = total = 0
    for a, row in zip(askings, rows, strict=True):
        if a.shown_first != "x" or row["preference"] not in ("x", "y") or a.comparison.rewards is None:
            continue
        reward_x, reward_y = a.comparison.rewards
        if abs(reward_x - reward_y) <= tie_tolerance:
            continue
        total += 1
        agree += (row["preference"] == "x") == (reward_x > reward_y)
    return agree / total if total else None


def _record(record: StageRecord, rows: list[dict], asked: list[Asked], counts: Counter[str], judge: str) -> None:
    """The manifest's counts, metrics and details, and what people should know."""
    questions = {r["question_id"]: r for r in rows}
    preferences = Counter(r["preference"] for r in questions.values())
    reasons = Counter(r["reason"] for r in rows if r["reason"])
    record.counts = {
        **counts,
        "askings": len(rows),
        "answers_from_store": sum(a.stored for a in asked),
        "answers_asked": sum(not a.stored for a in asked),
        "decided": preferences["x"] + preferences["y"],
        "ties": preferences["tie"],
        "undecided": preferences[None],
        "no_verdict": sum(r["verdict"] is None for r in rows),
    }
    record.metrics = {
        "judge/tokens": float(sum(a.answer.tokens for a in asked if not a.stored)),
        "judge/seconds": float(sum(a.answer.seconds for a in asked if not a.stored)),
    }
    if questions:
        record.metrics["judge/tie_share"] = preferences["tie"] / len(questions)
    record.details = {"judge": judge, "no_verdict_reasons": dict(reasons.most_common(20))}
    for reason, n in reasons.most_common(5):
        record.say(f"{n} asking(s) without a verdict: {reason}")
    if len(reasons) > 5:
        record.say(f"{sum(reasons.values()) - sum(n for _, n in reasons.most_common(5))} more without a verdict, "
                   f"for {len(reasons) - 5} other reasons (details.no_verdict_reasons)")  # fmt: skip
    if not preferences["x"] + preferences["y"]:
        record.say("no pair was decided this round: every question tied or had no verdict")
