"""The critics of one actor-critic RL pass (docs/design/algorithms.md#critics): :class:`CriticSet` records a batch's
rollout-time values (:class:`CriticBatch`), steps every critic after the agents' policy steps
(:func:`pbrl.learning.critics.critic_step`) and reports the round's critic metrics (:func:`explained_variance`).

``maac``: one critic shared by every agent, its target the mean over agents of the agents' returns (R − c·KL_i);
``iac``: critic i for agent i, its target agent i's return. The "previous prediction" of the clipped value loss is
the value recorded at rollout time; the clip binds when the prediction at update time differs from it (a value
head whose backbone the policy step just moved).

Shape legend: n rows (joint responses of a batch), a agents.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pbrl.learning.advantages import ACTOR_CRITIC
from pbrl.learning.critics import Critic, critic_rows, critic_step, predict
from pbrl.learning.joint_template import JointTemplate


def explained_variance(values: Sequence[float] | torch.Tensor, returns: Sequence[float] | torch.Tensor) -> float:
    """1 − Var(R − V) / Var(R) (population variances): 1 a perfect critic, 0 no better than the mean return,
    negative worse. NaN with fewer than 2 rows or Var(R) = 0 (never a division by zero)."""
    v, r = np.asarray(values, dtype=np.float64), np.asarray(returns, dtype=np.float64)
    if r.size < 2 or float(r.var()) == 0.0:
        return float("nan")
    return float(1.0 - (r - v).var() / r.var())


@dataclass
class CriticBatch:
    """One batch's critic inputs and rollout-time values."""

    rows: list[list[list[int] | None]]  # [critic][n] input ids (None: did not fit)
    values: torch.Tensor  # (a, n) float64: agent i's baseline V for each joint response
    ok: torch.Tensor  # (n,) bool: every critic input of the joint response fit


@dataclass
class CriticSet:
    """The critics of one RL pass and what they saw: ``maac`` one critic shared by every agent, its target the
    mean over agents of the agents' returns (R − c·KL_i); ``iac`` critic i for agent i, target agent i's return."""

    backend: str
    critic_type: str
    critics: list[Critic]
    template: JointTemplate | None = None  # maac: the joint template in the critic's tokenizer
    max_length: int | None = None  # maac: reward_max_length
    value_loss_coef: float = 0.6
    clip_range: float | None = 0.2
    max_grad_norm: float | None = None

    def __post_init__(self) -> None:
        if self.backend not in ACTOR_CRITIC:
            raise ValueError(f"rl_algorithm: got {self.backend!r}; critics serve {', '.join(ACTOR_CRITIC)}")
        self.seen: list[tuple[int, float, float]] = []  # (critic, rollout-time value, target) of every valid row
        self.losses: list[list[float]] = [[] for _ in self.critics]
        self.skipped = [0] * len(self.critics)

    def suffix(self, k: int) -> str:
        """The metric-name suffix of critic k: none for maac's one critic, ``_agent_<k>`` for iac."""
        return "" if self.backend == "maac" else f"_agent_{k}"

    def evaluate(
        self, prompts: Sequence[Sequence[Sequence[int]]], completions: Sequence[Sequence[Sequence[int]]]
    ) -> CriticBatch:
        """Rollout-time values, no gradients. prompts/completions: [a][n] stored ids."""
        a, n = len(prompts), len(prompts[0])
        per_joint = [
            critic_rows(
                self.backend,
                self.critic_type,
                [prompts[i][r] for i in range(a)],
                [completions[i][r] for i in range(a)],
                template=self.template,
                max_length=self.max_length,
            )
            for r in range(n)
        ]  # [n][critic]
        rows = [[per_joint[r][k] for r in range(n)] for k in range(len(self.critics))]  # [critic][n]
        values = torch.stack([predict(c, rows[k]) for k, c in enumerate(self.critics)])  # (critics, n)
        ok = torch.tensor([all(rows[k][r] is not None for k in range(len(self.critics))) for r in range(n)])
        return CriticBatch(rows, values.expand(a, n).clone() if self.backend == "maac" else values, ok)

    def targets(self, returns: torch.Tensor) -> torch.Tensor:
        """(a, n) per-agent returns → (critics, n) critic targets."""
        return returns.mean(dim=0, keepdim=True) if self.backend == "maac" else returns

    def update(self, batch: CriticBatch, returns: torch.Tensor, valid: torch.Tensor) -> dict[str, float]:
        """One step per critic on the valid rows; returns its step metrics ``critic/value_loss<suffix>``."""
        targets, metrics = self.targets(returns), {}
        old = batch.values[:1] if self.backend == "maac" else batch.values  # (critics, n)
        index = [r for r in range(len(valid)) if bool(valid[r])]
        for k, critic in enumerate(self.critics):
            self.seen += [(k, float(old[k, r]), float(targets[k, r])) for r in index]
            loss, outcome = critic_step(
                critic,
                [batch.rows[k][r] for r in index],
                targets[k, index],
                old[k, index],
                value_loss_coef=self.value_loss_coef,
                clip_range=self.clip_range,
                max_grad_norm=self.max_grad_norm,
            )
            self.skipped[k] += outcome == "skipped"
            if outcome != "no_rows":
                self.losses[k].append(loss)
                metrics[f"critic/value_loss{self.suffix(k)}"] = loss
        return metrics

    def metrics(self) -> dict[str, float]:
        """Round metrics per critic: ``critic/value_loss`` (mean over steps of the unweighted clipped loss),
        ``critic/explained_variance`` and ``critic/value_mean`` (of the rollout-time values against their
        targets), ``critic/skipped_steps``; for iac with the suffix ``_agent_<k>`` and, unsuffixed, the mean over
        critics (explained variance and value mean over every critic's rows)."""
        out: dict[str, float] = {}
        for k in range(len(self.critics)):
            rows = [(v, t) for c, v, t in self.seen if c == k]
            losses = [x for x in self.losses[k] if np.isfinite(x)]
            out[f"critic/value_loss{self.suffix(k)}"] = float(np.mean(losses)) if losses else float("nan")
            out[f"critic/explained_variance{self.suffix(k)}"] = explained_variance(
                [v for v, _ in rows], [t for _, t in rows]
            )
            out[f"critic/value_mean{self.suffix(k)}"] = float(np.mean([v for v, _ in rows])) if rows else float("nan")
            out[f"critic/skipped_steps{self.suffix(k)}"] = float(self.skipped[k])
        if self.backend == "iac":
            losses = [x for k in range(len(self.critics)) for x in self.losses[k] if np.isfinite(x)]
            out["critic/value_loss"] = float(np.mean(losses)) if losses else float("nan")
            out["critic/explained_variance"] = explained_variance(
                [v for _, v, _ in self.seen], [t for _, _, t in self.seen]
            )
            out["critic/value_mean"] = float(np.mean([v for _, v, _ in self.seen])) if self.seen else float("nan")
            out["critic/skipped_steps"] = float(sum(self.skipped))
        return out
