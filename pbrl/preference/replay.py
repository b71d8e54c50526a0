"""Replay buffer: which stored pairs of this and earlier rounds the policy update trains on
(docs/design/algorithms.md#replay-buffer).

Each round stores its pair set D(round) before selection, so the current round is eligible together with
earlier ones. Only **non-empty** round datasets count: an empty round is neither a "recent" dataset for
``nearest_k`` nor an age step for ``lambda_decay``.

- ``current``: exactly the current round's pairs in stored order, no sampling.
- ``nearest_k``: the last k non-empty datasets, equal weights.
- ``all_history``: every non-empty dataset, equal weights.
- ``lambda_decay``: every non-empty dataset, weight proportional to lambda**age (age 0 = newest non-empty).

Weights are per dataset, not per pair, so a small dataset's pairs are drawn more often than a large one's.
Sampling: each draw is assigned to a dataset by weight; within a dataset, pairs are drawn without
replacement while the assigned count fits, larger counts cycle through fresh random permutations; the
combined draws are shuffled. Source: CoMLRL ``_sample_replay_preferences`` and ``_lambda_decay_weights``
(docs/design/algorithms.md#replay-buffer), with a passed-in generator instead of the global ``random`` module.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

ReplayMode = Literal["current", "nearest_k", "all_history", "lambda_decay"]
REPLAY_MODES: tuple[str, ...] = get_args(ReplayMode)


@dataclass(frozen=True)
class ReplayDataset:
    """One round's stored pair set D(round): its round index and how many pairs it holds."""

    round_index: int
    num_pairs: int

    def __post_init__(self) -> None:
        if self.num_pairs < 0:
            raise ValueError(f"round {self.round_index}: num_pairs {self.num_pairs} must be >= 0")


@dataclass(frozen=True)
class ReplayDraw:
    """One selected pair: ``pair_index`` is its position in round ``source_round``'s stored pair list."""

    source_round: int
    pair_index: int


@dataclass(frozen=True)
class ReplaySelection:
    """The replay selection B of one round, in training order.

    ``eligible_rounds`` (oldest -> newest) and ``weights`` (same order, summing to 1) record how it was
    drawn; ``sample_size`` is the number of draws (the current round's pair count for ``current``).
    """

    draws: list[ReplayDraw]
    eligible_rounds: list[int]
    weights: list[float]
    sample_size: int


def eligible_datasets(
    datasets: Sequence[ReplayDataset], *, mode: ReplayMode, current_round: int, k: int | None
) -> list[ReplayDataset]:
    """The non-empty datasets ``mode`` may draw from, oldest -> newest.

    Args:
        datasets: the stored rounds <= ``current_round``, the current round included (any order).
        mode: the replay mode (config ``preference_replay_mode``).
        current_round: the round being trained.
        k: how many recent non-empty datasets ``nearest_k`` uses (config ``preference_replay_k``).

    Returns:
        ``current``: the current round if it is non-empty, else []. ``nearest_k``: the last k non-empty.
        ``all_history`` / ``lambda_decay``: every non-empty one.

    Raises:
        ValueError: a dataset is newer than ``current_round``, a round appears twice, the current round
            is missing, the mode is unknown, or ``nearest_k`` has no k >= 1.
    """
    history = _check_history(datasets, current_round)
    non_empty = [d for d in history if d.num_pairs > 0]
    if mode == "current":
        return [d for d in non_empty if d.round_index == current_round]
    if mode == "nearest_k":
        if k is None or k < 1:
            raise ValueError(f"preference_replay_k: got {k!r}; nearest_k needs an integer >= 1")
        return non_empty[-k:]
    if mode in ("all_history", "lambda_decay"):
        return non_empty
    raise ValueError(f"preference_replay_mode: got {mode!r}; allowed: {', '.join(REPLAY_MODES)}")


def lambda_weights(ages: Sequence[int], lam: float) -> np.ndarray:
    """Normalised weights proportional to ``lam ** age``.

    ``0 ** 0 == 1``, so ``lam = 0`` keeps only age 0; ``lam = 1`` is uniform. Three ages 0, 1, 2 at
    ``lam = 0.5`` give 4/7, 2/7, 1/7.

    Args:
        ages: one non-negative age per dataset (0 = newest non-empty).
        lam: the decay (config ``preference_replay_lambda``), in [0, 1].

    Returns:
        float64 array of shape (len(ages),) summing to 1 (empty for no ages).

    Raises:
        ValueError: ``lam`` outside [0, 1], a negative age, or every weight is 0 (lam = 0 without age 0).
    """
    if not (isinstance(lam, int | float) and 0.0 <= lam <= 1.0):
        raise ValueError(f"preference_replay_lambda: got {lam!r}; must be in [0, 1]")
    ages_arr = np.asarray(ages, dtype=np.int64)
    if ages_arr.size == 0:
        return np.zeros(0, dtype=np.float64)
    if (ages_arr < 0).any():
        raise ValueError(f"replay ages must be >= 0; got {list(ages)}")
    raw = np.power(float(lam), ages_arr.astype(np.float64))  # numpy: 0.0 ** 0.0 == 1.0
    total = raw.sum()
    if total <= 0:
        raise ValueError(f"preference_replay_lambda: {lam!r} gives zero weight to every age in {list(ages)}")
    return raw / total


def _uniform_weights(eligible: Sequence[ReplayDataset], lam: float | None) -> np.ndarray:
    n = len(eligible)
    return np.full(n, 1.0 / n) if n else np.zeros(0, dtype=np.float64)


def _lambda_decay_weights(eligible: Sequence[ReplayDataset], lam: float | None) -> np.ndarray:
    if lam is None:
        raise ValueError("preference_replay_lambda: lambda_decay needs a value in [0, 1]; got None")
    n = len(eligible)
    return lambda_weights([n - 1 - i for i in range(n)], lam)  # oldest -> newest: ages n-1 .. 0


WEIGHTINGS: dict[str, Callable[[Sequence[ReplayDataset], float | None], np.ndarray]] = {
    "current": _uniform_weights,
    "nearest_k": _uniform_weights,
    "all_history": _uniform_weights,
    "lambda_decay": _lambda_decay_weights,
}


def dataset_weights(eligible: Sequence[ReplayDataset], *, mode: ReplayMode, lam: float | None) -> np.ndarray:
    """Per-dataset draw weights, aligned with ``eligible`` (oldest -> newest).

    Equal weights for ``current``/``nearest_k``/``all_history`` whatever the dataset sizes; λ-weights for
    ``lambda_decay`` with age 0 = the newest (last) eligible dataset.

    Returns:
        float64 array of shape (len(eligible),) summing to 1 (empty when nothing is eligible).

    Raises:
        ValueError: an empty dataset among ``eligible``, an unknown mode, or a missing/invalid ``lam``.
    """
    empty = [d.round_index for d in eligible if d.num_pairs == 0]
    if empty:
        raise ValueError(f"empty round datasets {empty} are not eligible for replay")
    weighting = WEIGHTINGS.get(mode)
    if weighting is None:
        raise ValueError(f"preference_replay_mode: got {mode!r}; allowed: {', '.join(REPLAY_MODES)}")
    return weighting(eligible, lam)


def default_sample_size(*, sample_size: int | None, current_pairs: int, eligible: Sequence[ReplayDataset]) -> int:
    """The number of replay draws.

    ``sample_size`` (config ``preference_replay_sample_size``) if set; else the current round's pair count
    if > 0; else the newest non-empty eligible dataset's size; else 0.
    """
    if sample_size is not None:
        return sample_size
    if current_pairs > 0:
        return current_pairs
    sizes = [d.num_pairs for d in eligible if d.num_pairs > 0]
    return sizes[-1] if sizes else 0


def allocate_draws(weights: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """Assign each of ``n`` draws to a dataset with probability ``weights`` (a multinomial count).

    Args:
        weights: shape (d,), non-negative with a positive sum (normalised here).
        n: number of draws, >= 0.
        rng: the generator the draws come from.

    Returns:
        int64 array of shape (d,): draws per dataset, summing to ``n``.

    Raises:
        ValueError: ``n`` < 0, or ``n`` > 0 with no datasets or invalid weights.
    """
    w = np.asarray(weights, dtype=np.float64)
    if n < 0:
        raise ValueError(f"replay sample size must be >= 0; got {n}")
    if n == 0:
        return np.zeros(w.shape[0], dtype=np.int64)
    if w.size == 0 or not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"replay weights must be finite, >= 0 and not all 0 to place {n} draws; got {w.tolist()}")
    chosen = rng.choice(w.size, size=n, p=w / w.sum())  # (n,) dataset position of each draw
    return np.bincount(chosen, minlength=w.size).astype(np.int64)


def sample_within(num_pairs: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """Local pair indices for ``count`` draws from a dataset of ``num_pairs`` pairs.

    Without replacement while ``count <= num_pairs``; beyond that, ``count // num_pairs`` full fresh random
    permutations concatenated, then the remainder without replacement. So every pair is used
    floor(count / num_pairs) or ceil(count / num_pairs) times.

    Returns:
        int64 array of shape (count,) with values in [0, num_pairs).

    Raises:
        ValueError: ``count`` < 0, or ``count`` > 0 from an empty dataset.
    """
    if count < 0:
        raise ValueError(f"replay draw count must be >= 0; got {count}")
    if count == 0:
        return np.zeros(0, dtype=np.int64)
    if num_pairs <= 0:
        raise ValueError(f"cannot draw {count} pairs from a dataset of {num_pairs} pairs")
    passes, remainder = divmod(count, num_pairs)
    parts = [rng.permutation(num_pairs) for _ in range(passes)]
    parts.append(rng.choice(num_pairs, size=remainder, replace=False))
    return np.concatenate(parts).astype(np.int64)


def select_replay(
    datasets: Sequence[ReplayDataset],
    *,
    mode: ReplayMode,
    current_round: int,
    k: int | None,
    lam: float | None,
    sample_size: int | None,
    rng: np.random.Generator,
) -> ReplaySelection:
    """Select the pairs this round trains on.

    Args:
        datasets: the stored rounds <= ``current_round``, the current one included (stored first).
        mode: config ``preference_replay_mode``.
        current_round: the round being trained.
        k: config ``preference_replay_k``.
        lam: config ``preference_replay_lambda``.
        sample_size: config ``preference_replay_sample_size``.
        rng: the replay stream (``pbrl.data.seeds.numpy_rng(seed, round_index=r, stage="replay")``).

    Returns:
        ``current``: every pair of the current round in stored order. Other modes: the draws allocated by
        weight, sampled within each dataset and shuffled together; no draws when every eligible round is
        empty.

    The options are those of a validated job: their rules (an option the mode does not use is None, every
    problem at once) are the config's (:mod:`pbrl.config.replay_rules`), checked when the job loads.

    Raises:
        ValueError: an unknown mode, ``nearest_k`` without k >= 1, ``lambda_decay`` without a lam in [0, 1], a
            negative sample size, or inconsistent ``datasets`` (see :func:`eligible_datasets`).
    """
    eligible = eligible_datasets(datasets, mode=mode, current_round=current_round, k=k)
    weights = dataset_weights(eligible, mode=mode, lam=lam)
    current_pairs = next(d.num_pairs for d in datasets if d.round_index == current_round)
    if mode == "current":
        draws = [ReplayDraw(current_round, i) for i in range(current_pairs)]
        return ReplaySelection(draws, [d.round_index for d in eligible], weights.tolist(), current_pairs)
    # Nothing stored yet (every round so far empty): an empty selection, whatever sample_size asks for.
    n = default_sample_size(sample_size=sample_size, current_pairs=current_pairs, eligible=eligible)
    n = n if eligible else 0
    counts = allocate_draws(weights, n, rng)  # (d,)
    draws = [
        ReplayDraw(d.round_index, int(i))
        for d, c in zip(eligible, counts, strict=True)
        for i in sample_within(d.num_pairs, int(c), rng)
    ]
    draws = [draws[i] for i in rng.permutation(len(draws))]
    return ReplaySelection(draws, [d.round_index for d in eligible], weights.tolist(), n)


def _check_history(datasets: Sequence[ReplayDataset], current_round: int) -> list[ReplayDataset]:
    """The datasets sorted oldest -> newest, after checking they form this run's history up to now."""
    rounds = [d.round_index for d in datasets]
    newer = sorted(r for r in rounds if r > current_round)
    if newer:
        raise ValueError(f"replay datasets of rounds {newer} are newer than the current round {current_round}")
    duplicates = sorted(r for r, count in Counter(rounds).items() if count > 1)
    if duplicates:
        raise ValueError(f"replay datasets list rounds {duplicates} more than once")
    if current_round not in rounds:
        raise ValueError(
            f"round {current_round}: its dataset must be stored before replay selection (stored rounds: "
            f"{sorted(rounds)})"
        )
    return sorted(datasets, key=lambda d: d.round_index)
