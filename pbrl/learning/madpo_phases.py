"""The two phases of one MADPO step (docs/design/algorithms.md#the-update-step) as the agents see them: which agents
are asked, in which order, against which "others" terms (:class:`Phases`, :func:`run_phases`); the arithmetic of each
agent's part is :mod:`pbrl.learning.madpo`'s.

Shape legend: b pairs in a batch, a agents.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Phases:
    """The two phases of one :func:`pbrl.learning.madpo.madpo_agents_step` over ``agents``, each writing or reading
    ``margins`` (b, a), whose column i is agent i's detached margins (0 until computed).

    An agent whose winner and loser ids are the same in every pair of the batch (``idle``,
    :func:`pbrl.learning.madpo.identical_sides`; with ``joint_mode: cross``, counterfactual pairs that change other
    agents) is not asked in either phase (no
    forward, no backward, no optimizer step, no round trip to a remote agent): its margins are exactly 0, its
    weights and optimizer state do not move, and ``StepStats.idle`` marks it. Within a batch, such pairs cost an
    agent nothing either (:func:`pbrl.learning.madpo.agent_margins` skips them).

    Agent i's others term is left out (0) on the pairs that do not change it (``changes``): its loss there has no
    gradient, and a term there (a NaN margin of another agent on a pair that changes only that agent) would skip its
    step for nothing, in one mode and not the other (phase 1 is not asked for those margins). So its step is skipped
    only when its loss on its own pairs is not finite, in every mode and agent order.
    """

    agents: Sequence[Any]  # pbrl.learning.madpo.StepAgent
    batch: Any  # pbrl.learning.madpo.PairBatch
    seeds: list[int | None]  # per agent: its dropout seed (None: no dropout)
    parts: list[slice]  # the micro-batches
    needed: list[bool]  # per agent: the others need its detached margins (phase_one_agents)
    idle: list[bool]  # per agent: identical sides in every pair
    changes: torch.Tensor  # (b, a) bool: pair r changes agent i
    gather: Callable[[list[Any]], list[Any]]
    beta: float
    max_grad_norm: float | None

    def detached(self, ids: list[int], margins: torch.Tensor) -> None:
        """Phase 1 for the agents ``ids`` that are ``needed``: their columns of ``margins``."""
        ids = [i for i in ids if self.needed[i]]
        if not ids:
            return
        asked = [self.agents[i].detached_margins(*self.batch.agent(i), self.seeds[i], self.parts) for i in ids]
        for i, m in zip(ids, self.gather(asked), strict=True):
            margins[:, i] = m

    def updates(self, ids: list[int], margins: torch.Tensor) -> list[tuple[torch.Tensor, bool]]:
        """Phase 2 for the agents ``ids`` that are not idle, each against the sum of the others' columns:
        per agent of ``ids``, its (b,) own margins and whether its step was skipped (an idle one: 0, False)."""
        asked = [i for i in ids if not self.idle[i]]
        got = self.gather([self._update(i, margins) for i in asked]) if asked else []
        by_agent = dict(zip(asked, got, strict=True))
        return [by_agent.get(i, (torch.zeros(self.batch.size), False)) for i in ids]

    def _update(self, i: int, margins: torch.Tensor) -> Any:
        others = margins[:, [j for j in range(len(self.agents)) if j != i]].sum(dim=1).where(self.changes[:, i], 0.0)
        return self.agents[i].update(
            *self.batch.agent(i), others, self.seeds[i], self.parts, beta=self.beta, max_grad_norm=self.max_grad_norm
        )


def run_phases(phases: Phases, concurrent: bool) -> tuple[torch.Tensor, list[tuple[torch.Tensor, bool]]]:
    """Both phases in the mode's order; returns the (b, a) margins the updates saw and each agent's update result.

    ``concurrent`` (remote agents, e.g. :mod:`pbrl.distributed.ray_agents`): every agent of a phase is asked before
    ``gather`` is called, so they work in parallel; every agent that :func:`pbrl.learning.madpo.phase_one_agents`
    names computes its detached margins in phase 1. In process (the default, agents one after another) agent 0
    skips phase 1: its update is asked first, and the margins its training forward computes before it steps (the
    same function on the same weights with the same dropout seeds, hence the same values, bitwise on CPU) are its
    "others" term for the agents after it. That saves one of the step's 3a forward-or-backward passes per
    micro-batch (a detached forward costs about half a forward and backward; measured on SmolLM2,
    docs/results/benchmarks.md#shared-prompts-and-memory) and gives the same step. An agent whose margins no other
    agent's gradient needs skips phase 1 too (a pair that changes only agent i moves nobody else): with
    counterfactual pairs, a step is one training forward and backward per agent and micro-batch.
    """
    n = len(phases.agents)
    margins = torch.zeros(phases.batch.size, n)  # (b, a)
    if concurrent and n > 1:
        phases.detached(list(range(n)), margins)
        return margins, phases.updates(list(range(n)), margins)
    # agents one after another (or a single agent: no others to wait for)
    phases.detached(list(range(1, n)), margins)
    results = phases.updates([0], margins)
    margins[:, 0] = results[0][0]  # agent 0's own margins, from its update's forward, for the later agents
    return margins, results + phases.updates(list(range(1, n)), margins)
