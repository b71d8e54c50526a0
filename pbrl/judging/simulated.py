"""``judge: reward_noisy``: the task's reward as a pairwise labeller that errs, to measure what noisy labels and a
labelling budget cost the learning without paying anybody (``benchmarks/judged_learning.py``).

The labeller prefers the joint response with the higher task reward (a tie within ``tie_tolerance``), then

- with ``judge_label_noise`` = ε, flips a decided preference with probability ε (ties stay ties): the symmetric
  label noise of the learning-from-noisy-labels literature (Natarajan et al. 2013, "Learning with Noisy Labels"),
  P(A) = 1 − ε for the better-rewarded A;
- or, with ``judge_bt_temperature`` = T, prefers A with the Bradley–Terry probability σ((r_A − r_B) / T)
  (Bradley and Terry 1952; the preference model of Christiano et al. 2017), which errs most where rewards are close.

Its errors belong to the pair, not to the order shown: the uniform number it draws is keyed by the run seed and the
unordered pair's content, so both orders of a position-swapped pair get the same preference, and so does the same
pair asked again. A joint response without a reward (the oracle dropped it) gets no verdict.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

from pbrl.judging.verdicts import Answer, Comparison


def _uniform(seed: int, comparison: Comparison) -> float:
    """A uniform number in [0, 1) of (seed, the unordered pair of joint responses of ``comparison``)."""
    texts = sorted(json.dumps(list(t), ensure_ascii=False) for t in (comparison.first, comparison.second))
    digest = hashlib.sha256(json.dumps([seed, comparison.item_id, *texts]).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _first_is_canonical(comparison: Comparison) -> bool:
    """Whether the joint response shown first is the pair's canonical x (the smaller of the two texts)."""
    a, b = (json.dumps(list(t), ensure_ascii=False) for t in (comparison.first, comparison.second))
    return a <= b


@dataclass(frozen=True)
class RewardLabelJudge:
    """The task reward as a noisy labeller (see the module docstring).

    Attributes:
        label_noise: ε in [0, 0.5], the share of decided preferences flipped.
        temperature: T > 0 for Bradley–Terry labels instead of flips; None for flips.
        tie_tolerance: rewards within this (absolute) are a tie (the run's ``tie_tolerance``).
        seed: the run seed.
    """

    label_noise: float = 0.0
    temperature: float | None = None
    tie_tolerance: float = 0.0
    seed: int = 0

    @property
    def name(self) -> str:
        how = f"bt_temperature={self.temperature}" if self.temperature is not None else f"noise={self.label_noise}"
        return f"reward_noisy({how}, tie_tolerance={self.tie_tolerance}, seed={self.seed})"

    def answer(self, comparisons: Sequence[Comparison]) -> list[Answer]:
        """One answer per comparison: P(A) and the verdict it gives with this comparison's pair-keyed draw."""
        return [self._one(c) for c in comparisons]

    def _one(self, comparison: Comparison) -> Answer:
        rewards = comparison.rewards
        if rewards is None or not all(isinstance(r, float) and math.isfinite(r) for r in rewards):
            return Answer(None, reason="no task reward for one of the joint responses (the oracle dropped it)")
        r_a, r_b = rewards
        u = _uniform(self.seed, comparison)
        if self.temperature is not None:
            p_a = 1.0 / (1.0 + math.exp(-(r_a - r_b) / self.temperature))
            p_canonical = p_a if _first_is_canonical(comparison) else 1.0 - p_a  # P(x wins), order-free
            canonical_wins = u < p_canonical
            verdict = "A" if canonical_wins == _first_is_canonical(comparison) else "B"
            return Answer(verdict, probability=p_a, raw=f"P(A)={p_a:.6g}")
        if abs(r_a - r_b) <= self.tie_tolerance:
            return Answer("tie", probability=0.5, raw="tie")
        better = "A" if r_a > r_b else "B"
        flipped = u < self.label_noise
        verdict = ("B" if better == "A" else "A") if flipped else better
        p_a = 1.0 - self.label_noise if better == "A" else self.label_noise
        return Answer(verdict, probability=p_a, raw=f"{better}{' flipped' if flipped else ''}")
