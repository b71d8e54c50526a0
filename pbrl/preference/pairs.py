"""Pair construction: which joint responses of one item are compared, and in what order pairs are kept.

A candidate is a *joint response*: every agent's completion at one candidate index, so a winner (or loser)
always takes all of its agents' completions from the same index (docs/design/algorithms.md#pair-construction). Scores
are the processed oracle
scores; only their order matters. Two scores within ``tie_tolerance`` (absolute) are a tie and give no pair.

- Base trainers (MADPO, MARLHF): every unordered pair of one item's target candidates with different
  scores, the higher one winning (:func:`base_candidate_pairs`).
- Iterative trainers: only index-matched comparisons, target j against comparator j, for indices present
  on both sides; either side may win (:func:`iterative_candidate_pairs`).
- ``joint_mode: cross``: a joint response is any combination of the agents' candidates (:class:`CrossGrid`, at
  most ``max_joint_responses_per_item`` of them per item: :func:`cross_joint_responses`); base trainers pair any
  two, iterative trainers a target combination with the same combination after some agents' candidates were
  replaced by comparator ones (:func:`cross_candidate_pairs`;
  docs/design/algorithms.md#cross-joint-responses-and-counterfactual-pairs).

Pairs come in candidate order (by winner index, then loser index; for index-matched pairs, by candidate index);
which of them are kept, and in what order, is :mod:`pbrl.preference.selection`.
Source: CoMLRL ``MADPOTrainer._select_preference_pair_indices`` and
``MADPOIterTrainer._select_policy_comparison_pairs`` (docs/design/algorithms.md#pair-construction), with a tie tolerance
added.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import Literal

import numpy as np

Side = Literal["target", "comparator"]
TARGET: Side = "target"
COMPARATOR: Side = "comparator"


@dataclass(frozen=True)
class CandidateRef:
    """One joint response: every agent's completion at candidate ``index`` of ``side`` (``joint_mode: aligned``).

    With ``agents`` (``joint_mode: cross``) agent i's completion is its candidate ``agents[i]``, a (side,
    candidate index); ``index`` is then the combination's number in its item's :class:`CrossGrid`, and ``side``
    is ``target`` when every agent's candidate is a target one, else ``comparator``.
    """

    side: Side
    index: int
    agents: tuple[tuple[Side, int], ...] | None = None


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


@dataclass(frozen=True)
class JudgedPair:
    """A preference pair a judge decided (``preference_source: judge``): the preferred joint response wins, whatever
    the task's scores (null where the task has none)."""

    winner: CandidateRef
    loser: CandidateRef
    winner_score: float | None
    loser_score: float | None


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
    return sorted(pairs, key=candidate_order_key)


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


@dataclass(frozen=True)
class CrossGrid:
    """Every combination of one item's candidates (``joint_mode: cross``): each of the ``num_agents`` agents takes
    any entry of ``choices``, the same list for every agent: the item's target candidate indices in order, then
    (iterative trainers) its comparator ones. There are ``len(choices) ** num_agents`` combinations.

    A combination's number is ``m = sum_i pos_i * L ** (a - 1 - i)``, with ``pos_i`` the position of agent i's
    candidate in ``choices``, ``L = len(choices)`` and ``a = num_agents``: agent 0 varies slowest. Example: target
    candidates 0, 1, 2 and two agents give 9 combinations; (0, 0) is number 0, (0, 2) number 2, (1, 0) number 3,
    and the aligned joint response j = (j, j) is number 4j.
    """

    choices: tuple[tuple[Side, int], ...]
    num_agents: int

    @classmethod
    def of(cls, target: Iterable[int], comparator: Iterable[int] = (), *, num_agents: int) -> CrossGrid:
        """The grid of an item whose target (and comparator) candidates have these indices (each list sorted)."""
        choices = [(TARGET, int(i)) for i in sorted(target)] + [(COMPARATOR, int(i)) for i in sorted(comparator)]
        return cls(tuple(choices), num_agents)  # type: ignore[arg-type]

    @property
    def size(self) -> int:
        """The number of combinations, ``len(choices) ** num_agents`` (0 without candidates)."""
        return len(self.choices) ** self.num_agents if self.choices else 0

    def ref(self, number: int) -> CandidateRef:
        """Combination ``number`` (0 <= number < size) as a :class:`CandidateRef` with ``agents`` set.

        Raises:
            ValueError: ``number`` is outside the grid.
        """
        if not 0 <= number < self.size:
            raise ValueError(f"combination {number} is outside the grid of {self.size} combinations")
        width, rest, positions = len(self.choices), int(number), []
        for _ in range(self.num_agents):
            rest, pos = divmod(rest, width)
            positions.append(pos)
        agents = tuple(self.choices[pos] for pos in reversed(positions))  # agent 0 is the most significant digit
        side = TARGET if all(s == TARGET for s, _ in agents) else COMPARATOR
        return CandidateRef(side, int(number), agents)

    def number(self, agents: Sequence[tuple[Side, int]]) -> int:
        """The number of the combination that gives agent i the candidate ``agents[i]`` (inverse of :meth:`ref`).

        Raises:
            ValueError: a candidate is not in ``choices``, or not one per agent.
        """
        if len(agents) != self.num_agents:
            raise ValueError(f"got {len(agents)} candidates for {self.num_agents} agents")
        position = {choice: k for k, choice in enumerate(self.choices)}
        number = 0
        for agent, choice in enumerate(agents):
            if tuple(choice) not in position:
                raise ValueError(f"agent {agent}: {choice} is not a candidate of this item")
            number = number * len(self.choices) + position[tuple(choice)]  # type: ignore[index]
        return number


def cross_joint_responses(grid: CrossGrid, *, max_per_item: int, rng: np.random.Generator) -> list[CandidateRef]:
    """The combinations of one item that the oracle scores: all of them, or, when there are more than
    ``max_per_item``, ``max_per_item`` of them drawn without replacement from ``rng`` (uniformly over the
    combination numbers); in combination-number order either way.

    Args:
        grid: the item's :class:`CrossGrid`.
        max_per_item: the guard (config ``max_joint_responses_per_item``), >= 1.
        rng: the item's generator (``pbrl.data.seeds.numpy_rng`` with the run seed, round, stage and item); drawn
            from only when the guard is exceeded.

    Returns:
        ``min(grid.size, max_per_item)`` :class:`CandidateRef` s with ``agents`` set.

    Raises:
        ValueError: ``max_per_item`` below 1.
    """
    if isinstance(max_per_item, bool) or max_per_item < 1:
        raise ValueError(f"max_joint_responses_per_item: got {max_per_item!r}; must be >= 1")
    if grid.size <= max_per_item:
        numbers: Iterable[int] = range(grid.size)
    else:
        numbers = sorted(int(m) for m in rng.choice(grid.size, size=max_per_item, replace=False))
    return [grid.ref(m) for m in numbers]


def cross_candidate_pairs(scores: Mapping[CandidateRef, float], *, iterative: bool, tie_tolerance: float) -> list[Pair]:
    """The comparisons among one item's scored cross joint responses (``joint_mode: cross``).

    - Base trainers (``iterative`` False): every unordered pair of combinations whose scores do not tie, the
      higher one winning (at most M(M-1)/2 for M scored combinations).
    - Iterative trainers: a target combination x (every agent's candidate a target one) against a comparator
      combination y (at least one comparator candidate) that agrees with x on every agent where y has a target
      candidate; i.e. y is x with the candidates of a non-empty set of agents replaced by comparator candidates.
      On each agent the two sides then hold the same target candidate (margin 0) or a target candidate against a
      comparator candidate, as in the aligned comparison target j against comparator j: never two target
      candidates, never two comparator ones. Either side may win.

    Args:
        scores: :class:`CandidateRef` (with ``agents``) -> processed score, for the item's scored combinations.
        iterative: the trainer's kind.
        tie_tolerance: absolute tie tolerance (config ``tie_tolerance``), >= 0.

    Returns:
        Pairs in candidate order (winner number, then loser number).

    Raises:
        ValueError: a reference has no ``agents``, a score is not finite, or ``tie_tolerance`` is invalid.
    """
    _check_tolerance(tie_tolerance)
    for ref, score in scores.items():
        if ref.agents is None:
            raise ValueError(f"{ref.side} candidate {ref.index}: not a cross joint response (no agents' candidates)")
        _require_finite(score, ref)
    refs = sorted(scores, key=lambda r: r.index)
    pairs = []
    if not iterative:
        for a, b in combinations(refs, 2):
            pair = _ordered_pair(a, scores[a], b, scores[b], tie_tolerance)
            if pair is not None:
                pairs.append(pair)
    else:
        targets = [r for r in refs if r.side == TARGET]
        for y in (r for r in refs if r.side == COMPARATOR):
            for x in targets:
                if all(ya == xa or ya[0] == COMPARATOR for xa, ya in zip(x.agents, y.agents, strict=True)):  # type: ignore[arg-type]
                    pair = _ordered_pair(x, scores[x], y, scores[y], tie_tolerance)
                    if pair is not None:
                        pairs.append(pair)
    return sorted(pairs, key=candidate_order_key)


def changed_agents(pair: Pair) -> tuple[int, ...]:
    """The agents whose candidates differ between the winner and the loser of a cross pair (one agent: a
    counterfactual pair; the other agents' margins are then 0 by construction).

    Raises:
        ValueError: the pair is not made of cross joint responses.
    """
    w, lo = pair.winner.agents, pair.loser.agents
    if w is None or lo is None:
        raise ValueError(
            f"pair {pair.winner.side} {pair.winner.index} > {pair.loser.side} {pair.loser.index}: not a pair of "
            "cross joint responses (joint_mode: cross)"
        )
    return tuple(i for i, (a, b) in enumerate(zip(w, lo, strict=True)) if a != b)


def _ordered_pair(
    a: CandidateRef, score_a: float, b: CandidateRef, score_b: float, tie_tolerance: float
) -> Pair | None:
    """The pair of ``a`` and ``b`` with the higher score winning, or None when they tie."""
    if is_tie(score_a, score_b, tie_tolerance):
        return None
    if score_a > score_b:
        return Pair(winner=a, loser=b, winner_score=score_a, loser_score=score_b)
    return Pair(winner=b, loser=a, winner_score=score_b, loser_score=score_a)


def candidate_order_key(pair: Pair) -> tuple[int, int, str, str]:
    return (pair.winner.index, pair.loser.index, pair.winner.side, pair.loser.side)


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
