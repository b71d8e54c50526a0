"""The MADPO steps of a round tallied into its metrics (docs/design/algorithms.md#madpo): update-policies adds each
:func:`pbrl.learning.madpo.madpo_agents_step`'s :class:`pbrl.learning.madpo.StepStats` and reads the round's means.

Shape legend: b pairs in a batch, a agents.
"""

from __future__ import annotations

import math

import torch

from pbrl.learning.madpo import StepStats


class MadpoTally:
    """The MADPO steps of a round, tallied for its metrics: each step's loss, accuracy and row count, the per-agent
    margins of its finite pairs and skipped updates."""

    def __init__(self, num_agents: int) -> None:
        self.step_metrics: list[dict[str, float]] = []  # per step: madpo/loss, madpo/accuracy
        self.batch_sizes: list[int] = []
        self.skipped = [0] * num_agents
        self.margin_sums = torch.zeros(num_agents, dtype=torch.float64)
        self.margin_count = 0  # pairs whose every agent margin is finite

    @property
    def steps(self) -> int:
        return len(self.batch_sizes)

    def add(self, stats: StepStats, batch_size: int) -> None:
        """One step's statistics (:class:`pbrl.learning.madpo.StepStats`) over ``batch_size`` pairs."""
        self.batch_sizes.append(batch_size)
        self.step_metrics.append({"madpo/loss": stats.loss, "madpo/accuracy": stats.accuracy})
        finite = torch.isfinite(stats.margins).all(dim=1)
        self.margin_sums += stats.margins[finite].sum(dim=0).double()
        self.margin_count += int(finite.sum())
        for i, s in enumerate(stats.skipped):
            self.skipped[i] += int(s)

    def metrics(self, reward_mean: float) -> dict[str, float]:
        """The round's MADPO metrics: mean finite loss, mean accuracy, mean margin (overall and per agent, over
        the pairs with every margin finite), skipped steps (per agent and total); and ``turn_1/reward_mean``,
        ``turn_1/expected_return`` = ``reward_mean``. NaN where there is nothing to average."""
        losses = [m["madpo/loss"] for m in self.step_metrics if math.isfinite(m["madpo/loss"])]
        accuracies = [m["madpo/accuracy"] for m in self.step_metrics]
        n = self.margin_count
        out = {
            "madpo/loss": sum(losses) / len(losses) if losses else float("nan"),
            "madpo/accuracy": sum(accuracies) / len(accuracies),
            "madpo/margin_mean": float(self.margin_sums.sum() / n) if n else float("nan"),
            "turn_1/reward_mean": reward_mean,
            "turn_1/expected_return": reward_mean,
        }
        for i, skipped in enumerate(self.skipped):
            out[f"madpo/margin_agent_{i}"] = float(self.margin_sums[i] / n) if n else float("nan")
            out[f"madpo/skipped_steps_agent_{i}"] = float(skipped)
        out["madpo/skipped_steps"] = float(sum(self.skipped))
        return out
