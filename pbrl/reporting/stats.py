"""Evaluation statistics: a mean with its bootstrap confidence interval, and the paired difference of two
evaluations made on the same draws (same items, same sample seeds), with its interval.

The resampling unit is the *item*: an evaluation of ``n`` items x ``s`` samples per item is summarised by each
item's mean over its samples, and the bootstrap resamples those ``n`` item means with replacement (a cluster
bootstrap; Efron & Tibshirani 1993, *An Introduction to the Bootstrap*, §13.3 percentile interval, and
Davison & Hinkley 1997 §3.8 for clustered data). Samples of one item share the item, so they are not
independent draws: resampling them one by one would give intervals that are too narrow. The question the
interval answers is "would the mean hold on other items like these".

The paired difference takes, per item, the mean over its samples of ``reward_now - reward_baseline`` for the
same (item, sample) draws, then the same bootstrap. Round r and round 0 share the items and the sampling seeds,
so the item-to-item spread cancels and the paired interval is much narrower than the two separate intervals.

Why not ``scipy.stats.bootstrap``: scipy is not a dependency of pbrl, and the percentile interval over item
means is a few lines of seeded numpy (``Generator.integers`` + ``numpy.quantile``); the cluster step (item
means first) would be ours either way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

CONFIDENCE = 0.95
NUM_RESAMPLES = 10_000

SampleKey = tuple[str, int]  # (item_id, sample index within the item)


@dataclass(frozen=True)
class Interval:
    """A mean with its percentile bootstrap interval; ``n`` = the number of items it rests on."""

    mean: float
    low: float
    high: float
    n: int


def bootstrap_mean(
    values: Sequence[float], *, seed: int, confidence: float = CONFIDENCE, num_resamples: int = NUM_RESAMPLES
) -> Interval:
    """Mean of ``values`` with its percentile bootstrap interval.

    ``num_resamples`` resamples of the n values with replacement (indices from
    ``numpy.random.default_rng(seed)``); the interval is the ``(1 - confidence) / 2`` and
    ``(1 + confidence) / 2`` quantiles (``numpy.quantile``, linear) of the resample means. One value gives the
    interval [v, v]; the same seed gives the same interval.

    Args:
        values: n finite floats (e.g. per-item mean rewards).
        seed: seed of the resampling generator (derive it with :func:`pbrl.data.seeds.derive_seed`).
        confidence: in (0, 1).
        num_resamples: >= 1.

    Raises:
        ValueError: no values, a non-finite value (its position named), or a bad confidence / num_resamples.
    """
    x = np.asarray(values, dtype=np.float64)  # (n,)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"bootstrap_mean: need a non-empty list of values, got shape {x.shape}")
    bad = np.flatnonzero(~np.isfinite(x))
    if bad.size:
        raise ValueError(f"bootstrap_mean: value {int(bad[0])} is not finite ({x[bad[0]]})")
    if not 0 < confidence < 1:
        raise ValueError(f"bootstrap_mean: confidence must be in (0, 1), got {confidence}")
    if num_resamples < 1:
        raise ValueError(f"bootstrap_mean: num_resamples must be >= 1, got {num_resamples}")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(num_resamples, x.size))  # (resamples, n)
    means = x[idx].mean(axis=1)  # (resamples,)
    tail = (1 - confidence) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return Interval(mean=float(x.mean()), low=float(low), high=float(high), n=int(x.size))


def item_means(rewards: Mapping[SampleKey, float]) -> dict[str, float]:
    """Each item's mean over its samples: ``{(item, s): r}`` -> ``{item: mean_s r}`` (items in first-seen order)."""
    sums: dict[str, list[float]] = {}
    for (item, _sample), r in rewards.items():
        sums.setdefault(item, []).append(float(r))
    return {item: sum(rs) / len(rs) for item, rs in sums.items()}


def mean_interval(
    rewards: Mapping[SampleKey, float], *, seed: int, confidence: float = CONFIDENCE, num_resamples: int = NUM_RESAMPLES
) -> Interval:
    """Mean reward of one evaluation with the item-level bootstrap interval (see the module docstring).

    The mean is the mean of the item means (equal to the plain mean when every item has the same number of
    samples). Raises ValueError on no rewards (see :func:`bootstrap_mean`).
    """
    return bootstrap_mean(
        list(item_means(rewards).values()), seed=seed, confidence=confidence, num_resamples=num_resamples
    )


def paired_difference(
    now: Mapping[SampleKey, float],
    baseline: Mapping[SampleKey, float],
    *,
    seed: int,
    confidence: float = CONFIDENCE,
    num_resamples: int = NUM_RESAMPLES,
) -> Interval:
    """Mean of ``now - baseline`` over the draws both evaluations scored, with the item-level interval.

    Per item: the mean over its shared samples of ``now[(item, s)] - baseline[(item, s)]``; then
    :func:`bootstrap_mean` over the items. Draws only one side has (a failed reward on one side) are left
    out; ``n`` of the result counts the items with at least one shared draw.

    Raises:
        ValueError: the two evaluations share no draw (e.g. different items or seeds), naming a key of each.
    """
    shared = [key for key in now if key in baseline]
    if not shared:
        raise ValueError(
            f"paired_difference: no (item, sample) draw in both evaluations (e.g. now has "
            f"{next(iter(now), None)}, baseline has {next(iter(baseline), None)})"
        )
    diffs = {key: float(now[key]) - float(baseline[key]) for key in shared}
    return mean_interval(diffs, seed=seed, confidence=confidence, num_resamples=num_resamples)
