"""Stage judge-pairs (``preference_source: judge``): a pairwise judge says which of two joint responses is better,
for the pairs that ``pair_selection`` keeps (docs/design/stages.md#judge-pairs, docs/guides/judges.md).

The questions are the pairs that build-pairs would form from scores (:mod:`pbrl.run.askings`), ordered by
``pair_selection`` without scores, ``preference_pairs_per_sample`` per item, then at most ``judge_max_pairs`` of the
round (``judge_pair_choice``). Each is asked in both orders (``judge_position_swap``) or in one order drawn per
question. With ``judge: human`` people label them (:mod:`pbrl.run.labelling`): the stage reads their labels from the
store and stops with :class:`~pbrl.errors.LabelsNeeded` while any is missing.
Answers come from the run's store when the same question was answered before (:mod:`pbrl.judging.store`): a rerun,
a resume or ``pbrl stage judge-pairs --force`` asks the judge nothing it has answered. The verdicts, one row per
asking with the judge's name, the order shown, the raw answer, its tokens and seconds, are written to
``verdicts.parquet``; build-pairs turns the decided questions into pairs.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from pbrl.config import JobConfig
from pbrl.config.judge_fields import HUMAN_JUDGE
from pbrl.data.schema import VERDICTS
from pbrl.data.storage import RunPaths, StageManifest
from pbrl.data.tables import write_table
from pbrl.errors import OracleError
from pbrl.judging.asking import Asked, ask
from pbrl.judging.verdicts import JUDGE_FAILED, JUDGE_RAISED, preference_of
from pbrl.run.askings import Asking, round_askings
from pbrl.run.judging import answer_store, judge_for
from pbrl.run.labelling import labelled_answers
from pbrl.run.stage_record import StageRecord
from pbrl.run.task import resolve_task

NAME = "judge-pairs"
BATCH = 32  # comparisons per call of the judge (and per write of the answer store)


def input_files(paths: RunPaths, round_index: int, job: JobConfig) -> list[Path]:
    scores = [paths.scores(round_index)] if paths.scores(round_index).is_file() else []
    template = [Path(job.judge_prompt_template)] if job.judge_prompt_template else []
    return [paths.items, paths.candidates(round_index), *scores, *template]


def run(run_dir: str | Path, round_index: int, job: JobConfig) -> StageManifest:
    record = StageRecord(NAME, run_dir, round_index, job)
    paths = record.paths
    task = resolve_task(job, paths.root)
    judge = judge_for(job, paths.root, task)  # judge 'human': its name only (the labels are in the store)
    askings, counts = round_askings(paths, round_index, job, task.role_names(job.num_agents))
    progress = record.progress(len(askings), "answers")
    budget = job.judge_api_max_tokens_per_round if job.judge == "api" else None
    if job.judge == HUMAN_JUDGE:  # people's labels, from the store; raises LabelsNeeded while some are missing
        asked = labelled_answers(paths, round_index, job, askings)
    else:
        asked = ask(judge, [a.comparison for a in askings], answer_store(paths), batch_size=BATCH,
                    token_budget=budget, on_answers=progress.advance)  # fmt: skip
    rows = _verdict_rows(askings, asked, judge.name, job.judge_swap_disagreement)
    _check_failures(rows, round_index, job.oracle_max_failure_share)
    write_table(paths.verdicts(round_index), rows, VERDICTS)
    _record(record, rows, asked, counts, judge.name)
    agreement = _reward_agreement(askings, rows, job.tie_tolerance)
    if agreement is not None:
        record.metrics["judge/reward_agreement"] = agreement
    return record.finish(input_files(paths, round_index, job), [paths.verdicts(round_index)])


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
            "labeller": got.by,
        })  # fmt: skip
    return rows


def _check_failures(rows: list[dict], round_index: int, max_share: float) -> None:
    """Stop the round when the judge raised or failed (timed out, its process died: ``JUDGE_FAILED``) on more than
    ``max_share`` (``oracle_max_failure_share``) of its askings.

    Raises:
        OracleError: naming the items and the first reasons.
    """
    raised = [r for r in rows if (r["reason"] or "").startswith((JUDGE_RAISED, JUDGE_FAILED))]
    if rows and len(raised) / len(rows) > max_share:
        items = Counter(r["item_id"] for r in raised).most_common(20)
        reasons = Counter(r["reason"] for r in raised).most_common(3)
        raise OracleError(
            f"round {round_index}: the judge raised or failed on {len(raised)} of {len(rows)} askings (more than "
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
