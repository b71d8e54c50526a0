"""Putting a round's questions to a judge: the answers already in the store are reused, the others are asked in
batches, each batch stored before the next is asked (so a crash loses at most the batch in flight, and nothing
answered is ever asked again), within a round's token budget. A judge that raised, timed out or died gave no answer
(:attr:`~pbrl.judging.verdicts.Answer.judge_failed`): that is never stored, and a failure stored by an earlier
version is not reused, so a fixed judge is asked again on the resume or ``--force`` rerun."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pbrl.judging.store import AnswerStore
from pbrl.judging.verdicts import Answer, Comparison, PairwiseJudge

OVER_BUDGET = "not asked: the round's token budget (judge_api_max_tokens_per_round) was spent"


@dataclass(frozen=True)
class Asked:
    """What became of one asking: its content ``key``, the answer (None: not asked, over the budget), whether
    it came from the store (asked in an earlier attempt, round or stage run) and, for a person's label, who gave it
    (the labeller's name, or None when not given)."""

    key: str
    answer: Answer
    stored: bool
    by: str | None = None


def ask(
    judge: PairwiseJudge,
    comparisons: Sequence[Comparison],
    store: AnswerStore,
    *,
    batch_size: int = 32,
    token_budget: int | None = None,
    on_answers: Callable[[int], None] | None = None,
) -> list[Asked]:
    """One :class:`Asked` per comparison, in order (see the module docstring).

    Args:
        judge: the judge; its ``name`` keys the store.
        comparisons: the askings (a question in one order each).
        store: the run's answer store.
        batch_size: comparisons handed to ``judge.answer`` at once (and stored together).
        token_budget: once the answers asked by this call cost this many tokens, the rest are not asked (their
            answer has no verdict and the reason :data:`OVER_BUDGET`); None = no budget.
        on_answers: called with the number of comparisons done after each batch (progress).

    Raises:
        ValueError: the judge returned another number of answers than it was asked.
        Whatever the judge raises for a failure of its own (an unreachable API): what was answered before stays
        stored.
    """
    keys = [c.key(judge.name) for c in comparisons]
    stored = {i: store.get(key) for i, key in enumerate(keys)}
    done = {i: Asked(keys[i], a, True) for i, a in stored.items() if a is not None and not a.judge_failed}
    missing = [i for i in range(len(comparisons)) if i not in done]
    if on_answers is not None and done:
        on_answers(len(done))
    spent = 0
    for start in range(0, len(missing), batch_size):
        batch = missing[start : start + batch_size]
        if token_budget is not None and spent >= token_budget:
            for i in batch:
                done[i] = Asked(keys[i], Answer(None, reason=OVER_BUDGET), False)
            continue
        asked = [comparisons[i] for i in batch]
        if _takes_on_answer(judge):  # answers arrive one by one (an API): each stored as it arrives

            def arrived(k: int, answer: Answer, batch: list[int] = batch) -> None:
                if not answer.judge_failed:
                    store.put(keys[batch[k]], answer, judge=judge.name)

            answers = judge.answer(asked, on_answer=arrived)  # type: ignore[call-arg]
        else:
            answers = judge.answer(asked)
        if len(answers) != len(batch):
            raise ValueError(f"judge {judge.name!r} gave {len(answers)} answers to {len(batch)} comparisons")
        if not _takes_on_answer(judge):
            given = [(keys[i], a, {"judge": judge.name}) for i, a in zip(batch, answers, strict=True)]
            store.put_many([entry for entry in given if not entry[1].judge_failed])
        for i, answer in zip(batch, answers, strict=True):
            done[i] = Asked(keys[i], answer, False)
            spent += answer.tokens
        if on_answers is not None:
            on_answers(len(batch))
    return [done[i] for i in range(len(comparisons))]


def _takes_on_answer(judge: PairwiseJudge) -> bool:
    """Whether ``judge.answer`` hands each answer over as it arrives (``on_answer=``, the API judge)."""
    try:
        return "on_answer" in inspect.signature(judge.answer).parameters
    except (TypeError, ValueError):
        return False
