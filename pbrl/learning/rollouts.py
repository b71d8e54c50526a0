"""The rollouts of one MARLHF RL step (docs/design/algorithms.md#marlhf-policy-learning): every agent's samples of
the step's rows, scored by the reward model as joint responses (:func:`collect_rollouts`), kept as one typed record
(:class:`StepRollouts`) and written out as ``rollouts.parquet`` rows (:func:`rollout_records`).

Row r of a step of b items is generation r mod g of item r // g (each item's prompt repeated g =
``num_generations`` times, its rows adjacent); joint response r is every agent's row r.

Shape legend: b items in a batch, g generations per item, n = b·g rows, a agents.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pbrl.data.schema import RolloutRow

Sampler = Callable[[int, list[list[int]], list[str], int], list[Any]]  # (agent, prompt rows, item ids, epoch)
Scorer = Callable[[list[list[list[int]]], list[list[list[int]]]], list[tuple[float | None, list[int] | None]]]


@dataclass(frozen=True)
class StepRollouts:
    """One step's rollouts: n rows, each every agent's sample of one item's prompt and their joint score."""

    epoch: int
    item_ids: list[str]  # (n,): the item of each row
    prompts: list[list[list[int]]]  # [a][n] stored prompt ids
    generations: list[list[Any]]  # [a][n] pbrl.generation.sampling.Generation
    completions: list[list[list[int]]]  # [a][n] completion ids (each generation's)
    scored: list[tuple[float | None, list[int] | None]]  # (n,): R or None (not scored), the joint input ids or None
    ok: torch.Tensor  # (b,) bool: every joint response of the item's group was scored
    rewards: torch.Tensor  # (b, g) float64: R, 0 where not scored

    @property
    def num_generations(self) -> int:
        return self.rewards.shape[1]


def step_rows(
    prompt_ids: Sequence[Sequence[list[int]]],
    item_ids: list[str],
    chunk: list[int],
    num_generations: int,
    num_agents: int,
) -> tuple[list[list[list[int]]], list[str]]:
    """The rows of a step over the items ``chunk`` (indexes into ``item_ids``): each item's prompt repeated
    ``num_generations`` times. ``prompt_ids`` [agent][item] → (prompts [a][n], the item id of each row (n,))."""
    items = [item_ids[j] for j in chunk for _ in range(num_generations)]
    prompts = [[prompt_ids[i][j] for j in chunk for _ in range(num_generations)] for i in range(num_agents)]  # [a][n]
    return prompts, items


def collect_rollouts(
    sample: Sampler,
    score: Scorer,
    prompts: list[list[list[int]]],
    item_ids: list[str],
    *,
    epoch: int,
    num_generations: int,
) -> StepRollouts:
    """Every agent's samples of the rows (``sample(agent, prompts[agent], item_ids, epoch)``, agent 0 first), then
    one ``score`` call over the n joint responses (prompts and completions, each [joint][agent]).

    Args:
        prompts: [a][n] prompt ids of each agent's rows (:func:`step_rows`).
        item_ids: (n,) the item of each row.
    """
    a, n, g = len(prompts), len(item_ids), num_generations
    generations = [sample(i, prompts[i], item_ids, epoch) for i in range(a)]  # [a][n]
    completions = [[x.completion_ids for x in generations[i]] for i in range(a)]  # [a][n]
    scored = score(
        [[prompts[i][r] for i in range(a)] for r in range(n)],
        [[completions[i][r] for i in range(a)] for r in range(n)],
    )
    ok = torch.tensor([s[0] is not None for s in scored]).view(n // g, g).all(dim=-1)  # (b,)
    rewards = torch.tensor([s[0] if s[0] is not None else 0.0 for s in scored], dtype=torch.float64)
    return StepRollouts(epoch, item_ids, prompts, generations, completions, scored, ok, rewards.view(n // g, g))


@dataclass(frozen=True)
class StepOutcome:
    """What a step made of its rollouts, per agent and row: (a, n) float64 ``kl`` and ``advantages``, ``values``
    (a, n) the critics' rollout-time V (None without critics), ``valid`` (n,) bool rows kept in the update."""

    kl: torch.Tensor
    advantages: torch.Tensor
    values: torch.Tensor | None
    valid: torch.Tensor


def rollout_records(rollouts: StepRollouts, step: int, outcome: StepOutcome) -> list[RolloutRow]:
    """The ``rollouts.parquet`` rows of a step (:data:`pbrl.data.schema.ROLLOUTS`): row-major, every agent of row 0
    first; ``advantage`` and ``value`` None on rows left out of the update."""
    g = rollouts.num_generations
    records: list[RolloutRow] = []
    for r, item_id in enumerate(rollouts.item_ids):
        valid = bool(outcome.valid[r])
        for i, generations in enumerate(rollouts.generations):
            x = generations[r]
            records.append(
                {
                    "epoch": rollouts.epoch,
                    "step": step,
                    "item_id": item_id,
                    "generation_index": r % g,
                    "agent_index": i,
                    "prompt_ids": list(rollouts.prompts[i][r]),
                    "completion_ids": list(x.completion_ids),
                    "completion": x.text,
                    "finish_reason": x.finish_reason,
                    "seed": x.seed,
                    "joint_ids": rollouts.scored[r][1],
                    "reward": rollouts.scored[r][0],
                    "kl": float(outcome.kl[i, r]),
                    "advantage": float(outcome.advantages[i, r]) if valid else None,
                    "value": float(outcome.values[i, r]) if outcome.values is not None and valid else None,
                }
            )
    return records
