"""Pair selection: in what order one item's candidate pairs (:mod:`pbrl.preference.pairs`) are kept.

:func:`select_pairs` orders the candidate pairs by a named strategy (:data:`PAIR_ORDERINGS`) and keeps the first
``preference_pairs_per_sample``; ``counterfactual`` (cross only) puts the pairs that differ in one agent's
candidate first (:func:`order_counterfactual`). Orderings are stable sorts of the pairs in candidate order (by
winner index, then loser index; for index-matched pairs, by candidate index), so pairs with equal sort keys keep
that order, exactly as the reference's stable ``list.sort`` of its index-ordered candidate list does.
Source: CoMLRL ``MADPOTrainer._select_preference_pair_indices`` and
``MADPOIterTrainer._select_policy_comparison_pairs`` (docs/design/algorithms.md#pair-construction), with the global
``random`` module replaced by a passed-in generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

import numpy as np

from pbrl.preference.pairs import Pair, candidate_order_key, changed_agents

PairSelection = Literal["reward_gap", "all", "random", "comparator_reward", "counterfactual"]


class PairOrdering(Protocol):
    """Orders every candidate pair of one item; :func:`select_pairs` then keeps a prefix."""

    def __call__(self, pairs: Sequence[Pair], rng: np.random.Generator) -> list[Pair]: ...


def order_by_reward_gap(pairs: Sequence[Pair], rng: np.random.Generator) -> list[Pair]:
    """Largest gap first; equal gaps keep candidate order (winner index, then loser index)."""
    return sorted(order_all(pairs, rng), key=lambda p: -p.gap)


def order_all(pairs: Sequence[Pair], rng: np.random.Generator) -> list[Pair]:
    """Candidate order: by winner index then loser index (for index-matched pairs: by candidate index)."""
    return sorted(pairs, key=candidate_order_key)


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


def order_counterfactual(pairs: Sequence[Pair], rng: np.random.Generator) -> list[Pair]:
    """Counterfactual pairs first (``joint_mode: cross``): the pairs whose joint responses differ in one agent's
    candidate only, taking the agents in turn (agent 0's largest gap, agent 1's largest gap, ..., then each
    agent's second largest, ...), so that a cap per item spreads the credit over the agents; then the other pairs,
    fewer changed agents first, then largest gap. Equal keys keep candidate order.

    Example: counterfactual pairs of agent 0 with gaps .5 and .25, of agent 1 with gap .75, and a pair changing
    both agents with gap 1: agent 0's .5, agent 1's .75, agent 0's .25, then the two-agent pair.

    Raises:
        ValueError: a pair is not made of cross joint responses.
    """
    by_gap = order_by_reward_gap(pairs, rng)
    changed = {id(p): changed_agents(p) for p in by_gap}
    turns: dict[int, list[Pair]] = {}
    for p in by_gap:
        if len(changed[id(p)]) == 1:
            turns.setdefault(changed[id(p)][0], []).append(p)
    queues = [turns[agent] for agent in sorted(turns)]
    first = [q[k] for k in range(max(map(len, queues), default=0)) for q in queues if k < len(q)]
    rest = sorted((p for p in by_gap if len(changed[id(p)]) != 1), key=lambda p: len(changed[id(p)]))
    return first + rest


PAIR_ORDERINGS: dict[str, PairOrdering] = {
    "reward_gap": order_by_reward_gap,
    "all": order_all,
    "random": order_random,
    "comparator_reward": order_by_comparator_reward,
    "counterfactual": order_counterfactual,
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
        pairs: the item's candidate pairs, from :func:`base_candidate_pairs`, :func:`iterative_candidate_pairs`
            or :func:`cross_candidate_pairs`.
        pair_selection: ``reward_gap`` | ``all`` | ``random`` | ``comparator_reward`` (iterative pairs only) |
            ``counterfactual`` (cross pairs only).
        pairs_per_sample: how many pairs to keep (config ``preference_pairs_per_sample``), >= 1, or None
            for all; must be None with ``all``.
        rng: the generator for ``random`` (derive it with ``pbrl.data.seeds.numpy_rng``); other modes do not
            draw from it.

    Returns:
        At most ``pairs_per_sample`` pairs, in selection order.

    Raises:
        ValueError: unknown ``pair_selection``; ``preference_pairs_per_sample`` below 1 or set with
            ``all``; ``comparator_reward`` on pairs without a comparator side; ``counterfactual`` on pairs that
            are not cross pairs.
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
