"""The advantage strategy of one RL pass (docs/design/algorithms.md#marlhf-policy-learning), chosen once before the
loop (:func:`choose_baseline`): the item's group (:class:`GroupBaseline`, the backends of
:data:`pbrl.learning.advantages.ADVANTAGE_BACKENDS`) or the critics (:class:`CriticBaseline`, ``maac``/``iac``,
docs/design/algorithms.md#critics).

Each step asks the strategy for its :class:`StepBaseline` (:meth:`Baseline.start`): which item groups it can serve,
each agent's advantages from its shaped rewards R − c·KL_i, and, after the agents' steps, its own update.

Shape legend: b items in a batch, g generations per item, n = b·g rows, a agents.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pbrl.learning.advantages import (
    ACTOR_CRITIC,
    AdvantageBackend,
    actor_critic_advantages,
    advantage_backend,
    normalize_batch,
    normalize_group,
)
from pbrl.learning.critic_set import CriticBatch, CriticSet
from pbrl.learning.rollouts import StepRollouts


class StepBaseline(Protocol):
    """A strategy's view of one step."""

    values: torch.Tensor | None  # (a, n) float64 rollout-time V of each row (None: no critic)

    def keep(self, ok: torch.Tensor) -> torch.Tensor:
        """(b,) bool item groups kept so far → those the baseline can serve too."""
        ...

    def advantages(self, agent: int, shaped: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
        """Agent ``agent``'s advantages (n,) from its shaped rewards (b, g); 0 on the groups ``ok`` (b,) leaves out."""
        ...

    def update(self, returns: torch.Tensor, valid: torch.Tensor) -> dict[str, float]:
        """After the agents' steps: the baseline's own step on the returns (a, n) of the ``valid`` (n,) rows; its
        step metrics."""
        ...


class Baseline(Protocol):
    def start(self, rollouts: StepRollouts) -> StepBaseline:
        """The baseline of the step over ``rollouts``."""
        ...


@dataclass(frozen=True)
class GroupBaseline:
    """Each item's group R_i1..R_iG becomes its advantages through ``backend``; divided by the group's std when
    ``normalize`` (:func:`pbrl.learning.advantages.normalize_group`). Nothing to update; no values."""

    backend: AdvantageBackend
    normalize: bool
    values: None = None

    def start(self, rollouts: StepRollouts) -> GroupBaseline:
        return self

    def keep(self, ok: torch.Tensor) -> torch.Tensor:
        return ok

    def advantages(self, agent: int, shaped: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
        adv = self.backend(shaped)
        adv = normalize_group(adv) if self.normalize else adv
        return torch.where(ok[:, None], adv, torch.zeros_like(adv)).reshape(-1)  # (n,)

    def update(self, returns: torch.Tensor, valid: torch.Tensor) -> dict[str, float]:
        return {}


@dataclass(frozen=True)
class CriticBaseline:
    """A = R − V with V the critics' value recorded at rollout time; normalised over the batch's valid rows when
    ``normalize`` (:func:`pbrl.learning.advantages.normalize_batch`). The critics (updated in place) take one step
    after the agents' steps, so a value head sees its moved backbone."""

    critics: CriticSet
    normalize: bool

    def start(self, rollouts: StepRollouts) -> _CriticStep:
        return _CriticStep(self.critics, self.normalize, self.critics.evaluate(rollouts.prompts, rollouts.completions))


@dataclass(frozen=True)
class _CriticStep:
    critics: CriticSet
    normalize: bool
    batch: CriticBatch

    @property
    def values(self) -> torch.Tensor:
        return self.batch.values

    def keep(self, ok: torch.Tensor) -> torch.Tensor:  # a critic input that does not fit leaves its item group out
        return ok & self.batch.ok.view(len(ok), -1).all(dim=-1)

    def advantages(self, agent: int, shaped: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
        valid = ok.repeat_interleave(shaped.shape[1])  # (n,)
        adv = actor_critic_advantages(shaped.reshape(-1), self.batch.values[agent])  # (n,)
        adv = normalize_batch(adv, valid) if self.normalize else adv
        return torch.where(valid, adv, torch.zeros_like(adv))

    def update(self, returns: torch.Tensor, valid: torch.Tensor) -> dict[str, float]:
        return self.critics.update(self.batch, returns, valid)


def choose_baseline(backend: str, normalize: bool, critics: CriticSet | None) -> Baseline:
    """The strategy of ``rl_algorithm`` = ``backend``: the critics of an actor-critic backend, else the group.

    Raises:
        ValueError: an actor-critic backend without critics, critics with a group backend, or an unknown backend.
    """
    if (backend in ACTOR_CRITIC) != (critics is not None):
        raise ValueError(f"rl_algorithm: {backend!r} " + ("needs critics" if critics is None else "takes no critics"))
    if critics is not None:
        return CriticBaseline(critics, normalize)
    return GroupBaseline(advantage_backend(backend), normalize)
