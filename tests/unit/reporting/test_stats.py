"""pbrl.reporting.stats: the item-level bootstrap interval and the paired difference, against hand-worked values.

Percentile bootstrap with 10,000 resamples: where a resample mean has a probability well above 2.5 % at an
end of its range, that value *is* the interval's end (the 2.5 % quantile falls inside its block of equal
sorted means), so the ends below are exact, not approximate.
"""

from __future__ import annotations

import math

import pytest

from pbrl.reporting.stats import Interval, bootstrap_mean, item_means, mean_interval, paired_difference


def test_two_values_interval_spans_both() -> None:
    # Resample means of [0, 1] (n=2): 0 w.p. 1/4, 0.5 w.p. 1/2, 1 w.p. 1/4 -> 2.5 % quantile 0, 97.5 % quantile 1.
    assert bootstrap_mean([0.0, 1.0], seed=1) == Interval(mean=0.5, low=0.0, high=1.0, n=2)


def test_skewed_values_hand_worked_quantiles() -> None:
    # [0, 0, 0, 1]: resample mean = k/4 with k ~ Binomial(4, 1/4). P(k=0) = 81/256 = 31.6 % -> low = 0.
    # P(k >= 3) = 13/256 = 5.1 % > 2.5 % but P(k = 4) = 1/256 = 0.4 % < 2.5 % -> high = 3/4.
    ci = bootstrap_mean([0.0, 0.0, 0.0, 1.0], seed=7)
    assert (ci.mean, ci.low, ci.high, ci.n) == (0.25, 0.0, 0.75, 4)


def test_confidence_level_moves_the_ends() -> None:
    # At 80 %: 10 % and 90 % quantiles. P(k=0) = 31.6 % > 10 % -> low 0; P(k >= 2) = 67/256 = 26.2 % > 10 %,
    # P(k >= 3) = 5.1 % < 10 % -> high = 2/4.
    ci = bootstrap_mean([0.0, 0.0, 0.0, 1.0], seed=7, confidence=0.8)
    assert (ci.low, ci.high) == (0.0, 0.5)


def test_constant_and_single_values_have_zero_width() -> None:
    assert bootstrap_mean([2.0, 2.0, 2.0], seed=0) == Interval(2.0, 2.0, 2.0, 3)
    assert bootstrap_mean([1.5], seed=0) == Interval(1.5, 1.5, 1.5, 1)


def test_same_seed_same_interval_and_seed_is_used() -> None:
    values = [0.1, 0.9, 0.4, 0.7, 0.3, 0.8, 0.2]
    a, b = bootstrap_mean(values, seed=3), bootstrap_mean(values, seed=3)
    assert a == b
    others = {bootstrap_mean(values, seed=s, num_resamples=200).low for s in range(5)}
    assert len(others) > 1  # the seed drives the resampling
    assert a.low < a.mean < a.high


@pytest.mark.parametrize(
    ("values", "kwargs", "match"),
    [
        ([], {}, "non-empty"),
        ([1.0, math.nan], {}, "value 1 is not finite"),
        ([1.0], {"confidence": 1.0}, "confidence"),
        ([1.0], {"num_resamples": 0}, "num_resamples"),
    ],
)
def test_bad_input_is_refused(values, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        bootstrap_mean(values, seed=0, **kwargs)


def test_item_means() -> None:
    assert item_means({("a", 0): 3.0, ("b", 0): 2.0, ("a", 1): 1.0}) == {"a": 2.0, "b": 2.0}


def test_interval_resamples_items_not_samples() -> None:
    # Two items, 8 samples each: item a always 0, item b always 1. Item means [0, 1] -> interval [0, 1]. A
    # per-sample bootstrap of the 16 values would give about [0.25, 0.75] (P(all 16 draws equal) = 2**-15).
    rewards = {("a", s): 0.0 for s in range(8)} | {("b", s): 1.0 for s in range(8)}
    assert mean_interval(rewards, seed=5) == Interval(0.5, 0.0, 1.0, 2)


def test_mean_is_mean_of_item_means() -> None:
    # a: samples 3, 1 -> 2; b: one sample 5 (its other draw failed) -> 5; mean of items 3.5 (plain mean 3).
    ci = mean_interval({("a", 0): 3.0, ("a", 1): 1.0, ("b", 0): 5.0}, seed=0)
    assert (ci.mean, ci.n) == (3.5, 2)


def test_paired_difference_hand_worked() -> None:
    now = {("a", 0): 3.0, ("a", 1): 1.0, ("b", 0): 2.0, ("b", 1): 2.0}
    base = {("a", 0): 1.0, ("a", 1): 1.0, ("b", 0): 2.0, ("b", 1): 0.0}
    # per item: a = ((3-1) + (1-1)) / 2 = 1, b = ((2-2) + (2-0)) / 2 = 1 -> 1 with interval [1, 1]
    assert paired_difference(now, base, seed=0) == Interval(1.0, 1.0, 1.0, 2)
    # per item +1 and -1: mean 0, interval [-1, 1] (each end has probability 1/4)
    assert paired_difference({("a", 0): 2.0, ("b", 0): 0.0}, {("a", 0): 1.0, ("b", 0): 1.0}, seed=0) == Interval(
        0.0, -1.0, 1.0, 2
    )


def test_pairing_removes_the_item_spread() -> None:
    # Items differ a lot (0 .. 3) but every draw gains exactly 0.5: the separate intervals overlap, the
    # paired interval is [0.5, 0.5].
    base = {(f"i{k}", 0): float(k % 4) for k in range(12)}
    now = {key: r + 0.5 for key, r in base.items()}
    before, after = mean_interval(base, seed=1), mean_interval(now, seed=1)
    assert after.low < before.high  # unpaired: overlapping intervals
    assert paired_difference(now, base, seed=1) == Interval(0.5, 0.5, 0.5, 12)


def test_paired_difference_uses_shared_draws_only() -> None:
    # ("a", 1) failed in the baseline and ("b", 0) now: left out. a: 4 - 1 = 3; c: 0 - 2 = -2 -> mean 0.5.
    now = {("a", 0): 4.0, ("a", 1): 9.0, ("c", 0): 0.0}
    base = {("a", 0): 1.0, ("b", 0): 7.0, ("c", 0): 2.0}
    ci = paired_difference(now, base, seed=0)
    assert (ci.mean, ci.n, ci.low, ci.high) == (0.5, 2, -2.0, 3.0)


def test_paired_difference_without_shared_draws_is_refused() -> None:
    with pytest.raises(ValueError, match=r"no \(item, sample\) draw in both.*'a', 0.*'b', 0"):
        paired_difference({("a", 0): 1.0}, {("b", 0): 1.0}, seed=0)
