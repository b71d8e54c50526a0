"""Pair construction: which joint responses of one item are compared, and in what order pairs are kept.

A candidate is a *joint response*: every agent's completion at one candidate index, so a winner (or loser)
always takes all of its agents' completions from the same index (docs/design/algorithms.md#pair-construction). Scores
are the processed oracle
scores; only their order matters. Two scores within ``tie_tolerance`` (absolute) are a tie and give no pair.

- Base trainers (MADPO, MARLHF): every unordered pair of one item's target candidates with different
  scores, the higher one winning (:func:`base_candidate_pairs`).
- Iterative trainers: only index-matched comparisons, target j against comparator j, for indices present
  on both sides; either side may win (:func:`iterative_candidate_pairs`).

:func:`select_pairs` orders the candidate pairs by a named strategy and keeps the first
``preference_pairs_per_sample``. Orderings are stable sorts of the pairs in candidate order (by winner index,
then loser index; for index-matched pairs, by candidate index), so pairs with equal sort keys keep that order,
exactly as the reference's stable ``list.sort`` of its index-ordered candidate list does.
Source: CoMLRL ``MADPOTrainer._select_preference_pair_indices`` and
``MADPOIterTrainer._select_policy_comparison_pairs`` (notes/reference-library.md §2.3), with a tie tolerance
added and the global ``random`` module replaced by a passed-in generator.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import Literal, Protocol

import numpy as np

Side = Literal["target", "comparator"]
PairSelection = Literal["reward_gap", "all", "random", "comparator_reward"]


@dataclass(frozen=True)
class CandidateRef:
    """One joint response: every agent's completion at candidate ``index`` of ``side``."""

    side: Side
    index: int


@dataclass(frozen=True)
class Pair:
    """A preference pair of two joint responses with their processed scores (``winner_score`` is higher).

    Raises:
        ValueError: a score is not finite (names the candidate), or the winner does not score higher.
    """

    winner: CandidateRef
    loser: CandidateRef
    winner_score: float
    loser_score: float

    def __post_init__(self) -> None:
        _require_finite(self.winner_score, self.winner)
        _require_finite(self.loser_score, self.loser)
        if not self.winner_score > self.loser_score:
            raise ValueError(
                f"pair winner {self.winner.side} candidate {self.winner.index} (score {self.winner_score!r}) "
                f"must score higher than loser {self.loser.side} candidate {self.loser.index} "
                f"(score {self.loser_score!r})"
            )

    @property
    def gap(self) -> float:
        """``winner_score - loser_score``; always above the tie tolerance the pair was built with."""
        return self.winner_score - self.loser_score


def is_tie(a: float, b: float, tie_tolerance: float) -> bool:
    """True when ``|a - b| <= tie_tolerance`` (absolute): ``0.1 + 0.2`` and ``0.3`` tie at 1e-9."""
    return abs(a - b) <= tie_tolerance


def base_candidate_pairs(scores: Mapping[int, float], *, tie_tolerance: float) -> list[Pair]:
    """Every unordered pair {i, j} of one item's target joint responses whose scores do not tie.

    Args:
        scores: candidate index -> processed score, for the k target candidates that were scored (indices
            of candidates dropped by the oracle are simply absent).
        tie_tolerance: absolute tolerance under which two scores tie (config ``tie_tolerance``), >= 0.

    Returns:
        Pairs in candidate order: by winner index, then loser index. Both sides are ``"target"``. At most
        k(k-1)/2 pairs.

    Raises:
        ValueError: a score is not finite (names the candidate index), or ``tie_tolerance`` is invalid.
    """
    _check_tolerance(tie_tolerance)
    for index, score in scores.items():
        _require_finite(score, CandidateRef("target", index))
    pairs = []
    for i, j in combinations(sorted(scores), 2):
        pair = _ordered_pair(CandidateRef("target", i), scores[i], CandidateRef("target", j), scores[j], tie_tolerance)
        if pair is not None:
            pairs.append(pair)
    return sorted(pairs, key=_candidate_order_key)


def iterative_candidate_pairs(
    target: Mapping[int, float], comparator: Mapping[int, float], *, tie_tolerance: float
) -> list[Pair]:
    """Index-matched comparisons: target candidate j against comparator candidate j.

    Only indices present on both sides are compared, so the sides may have sampled different counts or
    lost different candidates to oracle failures. Either side may win; ties give no pair. No
    target-vs-target or comparator-vs-comparator pairs are formed.

    Args:
        target: candidate index -> processed score of the current policy's joint responses.
        comparator: candidate index -> processed score of the comparator's joint responses.
        tie_tolerance: absolute tie tolerance (config ``tie_tolerance``), >= 0.

    Returns:
        Pairs in candidate-index order, one at most per shared index.

    Raises:
        ValueError: a score on either side is not finite (names side and candidate index), or
            ``tie_tolerance`` is invalid.
    """
    _check_tolerance(tie_tolerance)
    for side, scores in (("target", target), ("comparator", comparator)):
        for index, score in scores.items():
            _require_finite(score, CandidateRef(side, index))
    pairs = []
    for j in sorted(set(target) & set(comparator)):
        pair = _ordered_pair(
            CandidateRef("target", j), target[j], CandidateRef("comparator", j), comparator[j], tie_tolerance
        )
        if pair is not None:
            pairs.append(pair)
    return pairs


class PairOrdering(Protocol):
    """Orders every candidate pair of one item; :func:`select_pairs` then keeps a prefix."""

    def __call__(self, pairs: Sequence[Pair], rng: np.random.Generator) -> list[Pair]: ...


def order_by_reward_gap(pairs: Sequence[Pair], rng: np.random.Generator) -> list[Pair]:
    """Largest gap first; equal gaps keep candidate order (winner index, then loser index)."""
    return sorted(order_all(pairs, rng), key=lambda p: -p.gap)


def order_all(pairs: Sequence[Pair], rng: np.random.Generator) -> list[Pair]:
    """Candidate order: by winner index then loser index (for index-matched pairs: by candidate index)."""
    return sorted(pairs, key=_candidate_order_key)


def order_random(pairs: Sequence[Pair], rng: np.random.Generator) -> list[Pair]:
    """A permutation drawn from ``rng`` of the pairs in candidate order (the input order does not matter)."""
    ordered = order_all(pairs, rng)
    return [ordered[i] for i in rng.permutation(len(ordered))]


def order_by_comparator_reward(pairs: Sequence[Pair], rng: np.random.Generator) -> list[Pair]:
    """Highest comparator-side score first, then largest gap; equal keys keep candidate order.

    The comparator side may be the winner or the loser: its score is used either way. Example: target
    scores [2, 0], comparator [1, 1] give two pairs with the same key (comparator score 1, gap 1); the one
    at candidate 0 (target 0 beats comparator 0) comes first.

    Raises:
        ValueError: a pair has no comparator side (base pairs); names the pair.
    """
    return sorted(order_all(pairs, rng), key=lambda p: (-_comparator_score(p), -p.gap))


PAIR_ORDERINGS: dict[str, PairOrdering] = {
    "reward_gap": order_by_reward_gap,
    "all": order_all,
    "random": order_random,
    "comparator_reward": order_by_comparator_reward,
}


def select_pairs(
    pairs: Sequence[Pair],
    *,
    pair_selection: PairSelection,
    pairs_per_sample: int | None,
    rng: np.random.Generator,
) -> list[Pair]:
    """Order one item's candidate pairs by ``pair_selection`` and keep the first ``pairs_per_sample``.

    Args:
        pairs: the item's candidate pairs, from :func:`base_candidate_pairs` or
            :func:`iterative_candidate_pairs`.
        pair_selection: ``reward_gap`` | ``all`` | ``random`` | ``comparator_reward`` (iterative pairs only).
        pairs_per_sample: how many pairs to keep (config ``preference_pairs_per_sample``), >= 1, or None
            for all; must be None with ``all``.
        rng: the generator for ``random`` (derive it with ``pbrl.data.seeds.numpy_rng``); other modes do not
            draw from it.

    Returns:
        At most ``pairs_per_sample`` pairs, in selection order.

    Raises:
        ValueError: unknown ``pair_selection``; ``preference_pairs_per_sample`` below 1 or set with
            ``all``; ``comparator_reward`` on pairs without a comparator side.
    """
    ordering = PAIR_ORDERINGS.get(pair_selection)
    if ordering is None:
        raise ValueError(f"pair_selection: got {pair_selection!r}; allowed: {', '.join(PAIR_ORDERINGS)}")
    if pairs_per_sample is not None and (isinstance(pairs_per_sample, bool) or pairs_per_sample < 1):
        raise ValueError(f"preference_pairs_per_sample: got {pairs_per_sample!r}; must be >= 1 or None")
    if pair_selection == "all" and pairs_per_sample is not None:
        raise ValueError(
            f"preference_pairs_per_sample: got {pairs_per_sample!r}; must be None when pair_selection='all' "
            "(every pair is kept)"
        )
    ordered = ordering(pairs, rng)
    return ordered if pairs_per_sample is None else ordered[:pairs_per_sample]


def _ordered_pair(
    a: CandidateRef, score_a: float, b: CandidateRef, score_b: float, tie_tolerance: float
) -> Pair | None:
    """The pair of ``a`` and ``b`` with the higher score winning, or None when they tie."""
    if is_tie(score_a, score_b, tie_tolerance):
        return None
    if score_a > score_b:
        return Pair(winner=a, loser=b, winner_score=score_a, loser_score=score_b)
    return Pair(winner=b, loser=a, winner_score=score_b, loser_score=score_a)


def _candidate_order_key(pair: Pair) -> tuple[int, int, str, str]:
    return (pair.winner.index, pair.loser.index, pair.winner.side, pair.loser.side)


def _comparator_score(pair: Pair) -> float:
    if pair.winner.side == "comparator":
        return pair.winner_score
    if pair.loser.side == "comparator":
        return pair.loser_score
    raise ValueError(
        f"pair_selection: 'comparator_reward' needs index-matched target/comparator pairs; pair "
        f"{pair.winner.side} {pair.winner.index} > {pair.loser.side} {pair.loser.index} has no comparator "
        "side"
    )


def _require_finite(score: float, ref: CandidateRef) -> None:
    if (
        isinstance(score, bool)
        or not isinstance(score, int | float | np.floating | np.integer)
        or not (math.isfinite(score))
    ):
        raise ValueError(
            f"{ref.side} candidate {ref.index}: score {score!r} is not a finite number; the oracle must drop "
            "such candidates before pairs are built"
        )


def _check_tolerance(tie_tolerance: float) -> None:
    if not (isinstance(tie_tolerance, int | float) and math.isfinite(tie_tolerance) and tie_tolerance >= 0):
        raise ValueError(f"tie_tolerance: got {tie_tolerance!r}; must be a finite number >= 0")
