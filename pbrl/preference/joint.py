"""Which joint responses an item has: aligned (every agent's candidate at one index) or, with ``joint_mode: cross``,
combinations of the agents' candidates (docs/design/algorithms.md#cross-joint-responses-and-counterfactual-pairs).
The oracle scores them (stage score-with-oracle) and a judge compares them (stage judge-pairs): both take the same
combinations, drawn with the same seeds."""

from __future__ import annotations

from pbrl.data.seeds import numpy_rng
from pbrl.preference.pairs import CandidateRef, CrossGrid, cross_joint_responses

JointKey = tuple[str, str, int]  # (item_id, side, candidate index; with joint_mode cross, the combination's number)
CROSS_DRAW_STAGE = "score-with-oracle"  # the stage name in the seed of the combinations drawn past the guard


def cross_refs(
    joint: dict[JointKey, list[dict]], *, num_agents: int, max_per_item: int, seed: int, round_index: int
) -> tuple[dict[JointKey, CandidateRef], dict[str, int]]:
    """``joint_mode: cross``: the combinations of each item, in the aligned joint responses' item order and
    combination-number order within an item, and the counts a stage records: ``joint_combinations`` (every
    combination, before the guard) and ``items_capped`` (items with more than ``max_per_item``).

    Args:
        joint: the aligned joint responses (:func:`pbrl.data.tables.read_joint_responses`), whose candidate indices
            per item and side give each agent's choices (the same for every agent).
        num_agents: agents per joint response.
        max_per_item: the guard (``max_joint_responses_per_item``); an item with more combinations gets this many,
            drawn with the item's generator (run seed, round, :data:`CROSS_DRAW_STAGE`, item).
        seed, round_index: the run seed and the round.
    """
    indices: dict[str, dict[str, list[int]]] = {}
    for item_id, side, index in joint:
        indices.setdefault(item_id, {"target": [], "comparator": []})[side].append(index)
    refs: dict[JointKey, CandidateRef] = {}
    combinations = capped = 0
    for item_id, by_side in indices.items():
        grid = CrossGrid.of(by_side["target"], by_side["comparator"], num_agents=num_agents)
        combinations += grid.size
        capped += grid.size > max_per_item
        rng = numpy_rng(seed, round_index=round_index, stage=CROSS_DRAW_STAGE, item=item_id)
        for ref in cross_joint_responses(grid, max_per_item=max_per_item, rng=rng):
            refs[(item_id, ref.side, ref.index)] = ref
    return refs, {"joint_combinations": combinations, "items_capped": capped}


def joint_rows(
    joint: dict[JointKey, list[dict]], refs: dict[JointKey, CandidateRef] | None
) -> dict[JointKey, list[dict]]:
    """Each joint response's candidate row of every agent: ``joint`` itself when aligned (``refs`` None); with cross
    ``refs``, agent i's row of each combination taken from its own candidate."""
    if refs is None:
        return joint
    return {
        key: [joint[(key[0], side, index)][agent] for agent, (side, index) in enumerate(ref.agents or ())]
        for key, ref in refs.items()
    }
