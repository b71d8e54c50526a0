"""Reward histograms of a round, for ``log_reward_distribution`` (iterative trainers).

As in the reference (CoMLRL ``MADPOIterTrainer`` reward-distribution logging; docs/design/stages.md#replay-select):
16 equal bins over the task's **declared** reward range (``reward_range`` of the task or reward function; it is
required, never guessed from the data), of the **raw** rewards (before ``reward_processor``) of every target
and comparator candidate of the round, and of the target and comparator sides of the pairs selected for
training. Values outside the range are clipped into its end bins; non-finite values are dropped. The record
keeps the reference's JSON shape (``reward_distributions/iteration_<k>.json``) and the metric names of its
wandb logs; :func:`plot_distribution` draws the bars as a PNG.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.pyplot as plt
import numpy as np

NUM_BINS = 16


def check_reward_range(reward_range: Any, *, source: str = "reward_func") -> tuple[float, float]:
    """``(low, high)`` from a declared reward range: two finite numbers with low < high.

    Raises:
        ValueError: naming ``source`` and ``log_reward_distribution`` when the range is missing or unusable.
    """
    hint = (
        f"log_reward_distribution=True needs the reward range of {source}: declare reward_range=(low, high) "
        "on the task (or set it on the reward function)"
    )
    if reward_range is None:
        raise ValueError(f"{hint}; it has none")
    try:
        low, high = (float(x) for x in reward_range)
    except (TypeError, ValueError):
        raise ValueError(f"{hint}; got {reward_range!r}, not two numbers") from None
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise ValueError(f"{hint}; got {reward_range!r}: both must be finite and low < high")
    return low, high


@dataclass(frozen=True)
class RewardHistogram:
    """Counts of one group of rewards: ``sample_count`` finite values, their ``mean`` (None if none), and
    ``counts`` per bin (sums to ``sample_count``); ``raw_rewards`` are the finite values as given."""

    sample_count: int
    mean: float | None
    counts: list[int]
    raw_rewards: list[float]

    def as_record(self) -> dict[str, Any]:
        return {
            "sample_count": self.sample_count,
            "mean": self.mean,
            "counts": self.counts,
            "raw_rewards": self.raw_rewards,
        }


def bin_edges(low: float, high: float, num_bins: int = NUM_BINS) -> list[float]:
    """``num_bins + 1`` equally spaced edges from ``low`` to ``high``."""
    return [float(x) for x in np.linspace(low, high, num_bins + 1)]


def reward_histogram(values: Sequence[float], low: float, high: float, num_bins: int = NUM_BINS) -> RewardHistogram:
    """Histogram of ``values`` over [low, high] in ``num_bins`` equal bins (the last bin includes ``high``).

    Non-finite values are dropped; the others are clipped into [low, high] for counting (the mean uses the
    values as given). Example: [0, 0.3, 4, 5, -1, nan] over [0, 4] -> 5 samples, mean 1.66, counts 2 in bin
    0 (0 and -1), 1 in bin 1 (0.3), 2 in bin 15 (4 and 5).
    """
    finite = [float(v) for v in values if math.isfinite(float(v))]
    counts, _ = (
        np.histogram(np.clip(finite, low, high), bins=num_bins, range=(low, high))
        if finite
        else (np.zeros(num_bins, dtype=int), None)
    )
    mean = sum(finite) / len(finite) if finite else None
    return RewardHistogram(len(finite), mean, [int(c) for c in counts], finite)


def distribution_record(
    iteration: int,
    low: float,
    high: float,
    *,
    target: Sequence[float],
    comparator: Sequence[float],
    selected_target: Sequence[float],
    selected_comparator: Sequence[float],
    num_bins: int = NUM_BINS,
) -> dict[str, Any]:
    """The reference's ``reward_distributions/iteration_<k>.json`` content for round ``iteration`` (1-based).

    ``target``/``comparator``: raw rewards of every candidate of each side; ``selected_*``: the raw rewards of
    the target and comparator side of each selected pair.
    """
    edges = bin_edges(low, high, num_bins)
    hist = lambda xs: reward_histogram(xs, low, high, num_bins).as_record()  # noqa: E731
    return {
        "iteration": iteration,
        "reward_min": low,
        "reward_max": high,
        "num_bins": num_bins,
        "bin_edges": edges,
        "bin_centers": [(a + b) / 2 for a, b in zip(edges, edges[1:], strict=False)],
        "candidate": {"target": hist(target), "comparator": hist(comparator)},
        "selected": {"target": hist(selected_target), "comparator": hist(selected_comparator)},
    }


def distribution_metrics(record: dict[str, Any]) -> dict[str, float]:
    """The reference's scalar metrics of a record (NaN for the mean of an empty group)."""
    out: dict[str, float] = {}
    for group, prefix in (("candidate", "iter/reward_distribution"), ("selected", "iter/selected_reward_distribution")):
        sides = record[group]
        out[f"{prefix}/current_iteration"] = float(record["iteration"])
        for side in ("target", "comparator"):
            out[f"{prefix}/{side}_sample_count"] = float(sides[side]["sample_count"])
            mean = sides[side]["mean"]
            out[f"{prefix}/{side}_mean"] = float("nan") if mean is None else float(mean)
    out["iter/selected_reward_distribution/pair_count"] = float(record["selected"]["target"]["sample_count"])
    return out


def plot_distribution(record: dict[str, Any], path: str | Path) -> Path:
    """Draw the record's four histograms (candidates and selected pairs, target vs comparator) as a PNG."""

    matplotlib.use("Agg")

    centers = record["bin_centers"]
    width = (record["reward_max"] - record["reward_min"]) / record["num_bins"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5), sharex=True)
    for ax, group, title in zip(axes, ("candidate", "selected"), ("all candidates", "selected pairs"), strict=True):
        for side, offset, color in (("target", -0.2, "tab:blue"), ("comparator", 0.2, "tab:orange")):
            ax.bar(
                [c + offset * width for c in centers],
                record[group][side]["counts"],
                width=0.4 * width,
                color=color,
                label=side,
            )
        ax.set(title=f"round {record['iteration']}: {title}", xlabel="raw reward", ylabel="count")
        ax.legend(loc="best")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
