"""Evaluation without a reward: the judge's win rate of round r's policies against round 0's, on the same draws.

The evaluate stage samples every round's draws with the same seeds (common random numbers), so draw (item, s) of
round r and of round 0 answer the same item with the same uniforms, only the policies differ. The judge compares
them, in both orders when ``judge_position_swap`` (the answers combined as for pairs,
:func:`pbrl.judging.verdicts.preference_of`), else in one order drawn per draw. A draw scores 1 when round r's joint
response is preferred, 0 when round 0's is, 1/2 for a tie; a draw without a verdict is left out. The win rate is
their mean over items with the item-level bootstrap interval of the evaluation's rewards
(:func:`pbrl.reporting.stats.mean_interval`): 1/2 means no change, and an interval above 1/2 a gain. This is the
win rate of AlpacaEval and MT-Bench's pairwise mode, against the run's own starting point.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from pbrl.judging.asking import ask
from pbrl.judging.store import AnswerStore
from pbrl.judging.verdicts import Comparison, PairwiseJudge, preference_of

SampleKey = tuple[str, int]
WIN = {"x": 1.0, "tie": 0.5, "y": 0.0}  # x: round r's joint response, y: round 0's


def draw_comparisons(
    current: Mapping[SampleKey, dict],
    baseline: Mapping[SampleKey, dict],
    roles: tuple[str, ...],
    items: Mapping[str, dict],
    *,
    swap: bool,
    order_rng: Callable[[SampleKey], np.random.Generator],
) -> list[tuple[SampleKey, str, Comparison]]:
    """(draw, which was shown first, comparison) for every draw both evaluations have: round r's joint response is
    x, round 0's y; both orders with ``swap``, else one drawn from ``order_rng(draw)``."""
    out: list[tuple[SampleKey, str, Comparison]] = []
    for key, row in current.items():
        base = baseline.get(key)
        if base is None:
            continue
        x = Comparison(key[0], tuple(row["prompts"]), roles, tuple(row["completions"]), tuple(base["completions"]),
                       items.get(key[0], {}))  # fmt: skip
        orders = ["x", "y"] if swap else [["x", "y"][int(order_rng(key).integers(2))]]
        out += [(key, shown, x if shown == "x" else x.swapped()) for shown in orders]
    return out


def win_values(
    judge: PairwiseJudge,
    store: AnswerStore,
    askings: Sequence[tuple[SampleKey, str, Comparison]],
    *,
    disagreement: str,
    on_answers: Callable[[int], None] | None = None,
) -> tuple[dict[SampleKey, float], Counter[str]]:
    """Each draw's score (1 round r preferred, 1/2 tie, 0 round 0) and counts: ``askings``, ``answers_asked``,
    ``answers_from_store`` and ``draws_without_verdict``."""
    asked = ask(judge, [c for _, _, c in askings], store, on_answers=on_answers)
    by_draw: dict[SampleKey, list] = {}
    for (key, shown, _), got in zip(askings, asked, strict=True):
        by_draw.setdefault(key, []).append((got.answer, shown))
    values: dict[SampleKey, float] = {}
    counts: Counter[str] = Counter(askings=len(askings))
    for key, answers in by_draw.items():
        preference, _ = preference_of(answers, disagreement)
        if preference is None:
            counts["draws_without_verdict"] += 1
        else:
            values[key] = WIN[preference]
    counts["answers_from_store"] = sum(a.stored for a in asked)
    counts["answers_asked"] = len(asked) - counts["answers_from_store"]
    return values, counts
