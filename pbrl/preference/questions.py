"""Which pairs of joint responses a judge is asked about (docs/design/algorithms.md#judges): the pairs that the
construction of :mod:`pbrl.preference.pairs` would form, before anything is known of which one is better.

- Base trainers: every unordered pair of an item's target joint responses.
- Iterative trainers: target j against comparator j, for the indices both sides have.
- ``joint_mode: cross``: among an item's combinations, any two (base trainers), or a target combination against
  the same combination with some agents' candidates replaced by comparator ones (iterative trainers).

A question's two joint responses are ``x`` (the lower candidate order) and ``y``; the judge decides which wins.
``pair_selection`` then orders an item's questions without scores (:func:`order_questions`): ``all`` keeps candidate
order, ``random`` draws a permutation, ``counterfactual`` puts the pairs that change one agent's candidate first,
the agents in turn (each agent's in a drawn order), then the others, fewer changed agents first; and
``preference_pairs_per_sample`` caps each item. The orderings by score (``reward_gap``, ``comparator_reward``) have
nothing to order by and are refused by the configuration.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations

import numpy as np

from pbrl.preference.pairs import COMPARATOR, TARGET, CandidateRef


@dataclass(frozen=True)
class Question:
    """Two joint responses of one item to compare: ``x`` first in candidate order, ``y`` second."""

    x: CandidateRef
    y: CandidateRef

    @property
    def changed_agents(self) -> tuple[int, ...]:
        """The agents whose candidates differ (cross joint responses); every agent for aligned ones."""
        if self.x.agents is None or self.y.agents is None:
            return ()
        return tuple(i for i, (a, b) in enumerate(zip(self.x.agents, self.y.agents, strict=True)) if a != b)


def base_questions(indices: Sequence[int]) -> list[Question]:
    """Every unordered pair {i, j}, i < j, of one item's target candidate indices."""
    return [Question(CandidateRef(TARGET, i), CandidateRef(TARGET, j)) for i, j in combinations(sorted(indices), 2)]


def iterative_questions(target: Sequence[int], comparator: Sequence[int]) -> list[Question]:
    """Target candidate j against comparator candidate j, for the indices on both sides, in index order."""
    return [
        Question(CandidateRef(TARGET, j), CandidateRef(COMPARATOR, j)) for j in sorted(set(target) & set(comparator))
    ]


def cross_questions(refs: Sequence[CandidateRef], *, iterative: bool) -> list[Question]:
    """The comparisons among one item's cross combinations (the same as
    :func:`pbrl.preference.pairs.cross_candidate_pairs` forms before scores decide them), in combination order.

    Raises:
        ValueError: a reference has no ``agents`` (not a cross joint response).
    """
    for ref in refs:
        if ref.agents is None:
            raise ValueError(f"{ref.side} candidate {ref.index}: not a cross joint response (no agents' candidates)")
    ordered = sorted(refs, key=lambda r: r.index)
    if not iterative:
        return [Question(a, b) for a, b in combinations(ordered, 2)]
    targets = [r for r in ordered if r.side == TARGET]
    questions = []
    for y in (r for r in ordered if r.side == COMPARATOR):
        for x in targets:
            if all(ya == xa or ya[0] == COMPARATOR for xa, ya in zip(x.agents, y.agents, strict=True)):  # type: ignore[arg-type]
                questions.append(Question(x, y))
    return sorted(questions, key=_candidate_order)


def _candidate_order(q: Question) -> tuple[int, int, str, str]:
    return (q.x.index, q.y.index, q.x.side, q.y.side)


def order_questions(questions: Sequence[Question], pair_selection: str, rng: np.random.Generator) -> list[Question]:
    """``questions`` of one item in the order ``pair_selection`` keeps them (see the module docstring).

    Raises:
        ValueError: an ordering that needs scores, or ``counterfactual`` for aligned joint responses.
    """
    ordered = sorted(questions, key=_candidate_order)
    if pair_selection == "all":
        return ordered
    if pair_selection == "random":
        return [ordered[i] for i in rng.permutation(len(ordered))]
    if pair_selection == "counterfactual":
        if any(q.x.agents is None for q in ordered):
            raise ValueError("pair_selection 'counterfactual' needs joint_mode='cross'")
        drawn = [ordered[i] for i in rng.permutation(len(ordered))]
        turns: dict[int, list[Question]] = {}
        for q in drawn:
            if len(q.changed_agents) == 1:
                turns.setdefault(q.changed_agents[0], []).append(q)
        queues = [turns[agent] for agent in sorted(turns)]
        first = [queue[k] for k in range(max(map(len, queues), default=0)) for queue in queues if k < len(queue)]
        rest = sorted((q for q in drawn if len(q.changed_agents) != 1), key=lambda q: len(q.changed_agents))
        return first + rest
    raise ValueError(
        f"pair_selection: got {pair_selection!r}; a judge gives no scores to order by: use all, random or "
        "counterfactual"
    )


def keep(questions: Sequence[Question], pairs_per_sample: int | None) -> list[Question]:
    """The first ``pairs_per_sample`` questions (all when None)."""
    return list(questions if pairs_per_sample is None else questions[:pairs_per_sample])


def within_budget(per_item: Sequence[Sequence[Question]], budget: int | None, rng: np.random.Generator) -> list[bool]:
    """Which questions of the round (items in order, each item's in order) are asked under a budget of ``budget``
    pairs: ``budget`` of them drawn without replacement from ``rng`` (every question when None or enough)."""
    total = sum(len(q) for q in per_item)
    if budget is None or total <= budget:
        return [True] * total
    chosen = set(int(i) for i in rng.choice(total, size=budget, replace=False))
    return [i in chosen for i in range(total)]


def least_sure(margins: Sequence[float | None], budget: int | None, rng: np.random.Generator) -> list[bool]:
    """Which questions are asked under a budget of ``budget`` pairs when the current model's ``margins`` (x over y,
    one per question in order; None: it could not tell) say how sure it is: the ``budget`` smallest |margin|, a
    question without a margin counting as the least sure of all; equal ones in an order drawn from ``rng``
    (every question when None or enough)."""
    total = len(margins)
    if budget is None or total <= budget:
        return [True] * total
    tiebreak = rng.permutation(total)
    order = sorted(range(total), key=lambda i: (-1.0 if margins[i] is None else abs(margins[i]), tiebreak[i]))  # type: ignore[arg-type]
    chosen = set(order[:budget])
    return [i in chosen for i in range(total)]
