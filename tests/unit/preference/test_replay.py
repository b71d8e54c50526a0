"""Replay buffer selection (docs/design/algorithms.md#replay-buffer): eligibility, weights, sample sizes, sampling and
argument checks."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from pbrl.config import MADPOIterConfig
from pbrl.data.seeds import numpy_rng
from pbrl.errors import ConfigError
from pbrl.preference.replay import (
    ReplayDataset,
    ReplayDraw,
    allocate_draws,
    dataset_weights,
    default_sample_size,
    eligible_datasets,
    lambda_weights,
    sample_within,
    select_replay,
)

D = ReplayDataset

# Share tolerance for many-draw checks: with N = 50_000 draws a dataset's share is binomial with standard
# deviation sqrt(p(1-p)/N) <= sqrt(0.25/50_000) ~= 0.0022, so 0.01 absolute is at least 4.4 sigma. The seeds
# are fixed, so the checks are deterministic; the margin says a correct sampler passes for any seed.
MANY = 50_000
SHARE_TOL = 0.01


def rng(seed: int = 0) -> np.random.Generator:
    return numpy_rng(seed, round_index=4, stage="replay")


def shares(draws: list[ReplayDraw], rounds: list[int]) -> np.ndarray:
    counts = Counter(d.source_round for d in draws)
    return np.array([counts[r] for r in rounds]) / len(draws)


# ---- eligibility ---------------------------------------------------------------------------------------

HISTORY = [D(1, 3), D(2, 10), D(3, 0), D(4, 1)]  # round 3 produced no pairs


def test_empty_round_is_not_a_dataset():
    rounds = {
        mode: [d.round_index for d in eligible_datasets(HISTORY, mode=mode, current_round=4, k=k)]
        for mode, k in [("current", None), ("nearest_k", 2), ("all_history", None), ("lambda_decay", None)]
    }
    # nearest_k=2 reaches back past the empty round 3 to round 2.
    assert rounds == {
        "current": [4],
        "nearest_k": [2, 4],
        "all_history": [1, 2, 4],
        "lambda_decay": [1, 2, 4],
    }


def test_eligible_is_oldest_to_newest_whatever_the_input_order():
    eligible = eligible_datasets(HISTORY[::-1], mode="all_history", current_round=4, k=None)
    assert [d.round_index for d in eligible] == [1, 2, 4]


def test_current_mode_with_an_empty_current_round_is_empty():
    assert eligible_datasets([D(1, 5), D(2, 0)], mode="current", current_round=2, k=None) == []


def test_nearest_k_larger_than_history_takes_everything_non_empty():
    eligible = eligible_datasets(HISTORY, mode="nearest_k", current_round=4, k=10)
    assert [d.round_index for d in eligible] == [1, 2, 4]


@pytest.mark.parametrize(
    "datasets, match",
    [
        ([D(1, 3), D(2, 3), D(5, 1)], r"rounds \[5\] are newer than the current round 2"),
        ([D(1, 3), D(1, 4), D(2, 1)], r"rounds \[1\] more than once"),
        ([D(1, 3)], "round 2: its dataset must be stored"),
    ],
)
def test_inconsistent_history_raises(datasets, match):
    with pytest.raises(ValueError, match=match):
        eligible_datasets(datasets, mode="all_history", current_round=2, k=None)


# ---- weights -------------------------------------------------------------------------------------------


def test_lambda_half_over_three_datasets():
    # ages 0, 1, 2 (newest first): 1, 1/2, 1/4, normalised by 7/4 -> 4/7, 2/7, 1/7.
    np.testing.assert_allclose(lambda_weights([0, 1, 2], 0.5), [4 / 7, 2 / 7, 1 / 7], rtol=0, atol=1e-15)


def test_lambda_zero_keeps_only_the_newest_and_one_is_uniform():
    np.testing.assert_array_equal(lambda_weights([2, 1, 0], 0.0), [0.0, 0.0, 1.0])  # 0**0 == 1
    np.testing.assert_allclose(lambda_weights([2, 1, 0], 1.0), [1 / 3, 1 / 3, 1 / 3], rtol=0, atol=1e-15)
    # The reference's worked example: two datasets at 0.8 -> newest 1/1.8 = 0.5556, older 0.8/1.8 = 0.4444.
    np.testing.assert_allclose(lambda_weights([1, 0], 0.8), [0.8 / 1.8, 1 / 1.8], rtol=0, atol=1e-15)


def test_lambda_weights_errors():
    with pytest.raises(ValueError, match="preference_replay_lambda"):
        lambda_weights([0, 1], 1.5)
    with pytest.raises(ValueError, match="zero weight"):
        lambda_weights([1, 2], 0.0)


def test_lambda_decay_ages_skip_empty_rounds():
    # Rounds 1, 3, 4 hold pairs; round 2 is empty, so round 1 is age 2 (weight 1/7), not age 3.
    history = [D(1, 3), D(2, 0), D(3, 5), D(4, 2)]
    eligible = eligible_datasets(history, mode="lambda_decay", current_round=4, k=None)
    weights = dataset_weights(eligible, mode="lambda_decay", lam=0.5)
    np.testing.assert_allclose(weights, [1 / 7, 2 / 7, 4 / 7], rtol=0, atol=1e-15)


def test_nearest_k_and_all_history_weigh_datasets_equally_whatever_their_sizes():
    eligible = eligible_datasets(HISTORY, mode="nearest_k", current_round=4, k=2)  # sizes 10 and 1
    np.testing.assert_array_equal(dataset_weights(eligible, mode="nearest_k", lam=None), [0.5, 0.5])
    eligible = eligible_datasets(HISTORY, mode="all_history", current_round=4, k=None)  # sizes 3, 10, 1
    np.testing.assert_allclose(dataset_weights(eligible, mode="all_history", lam=None), [1 / 3] * 3)


def test_dataset_weights_reject_an_empty_dataset():
    with pytest.raises(ValueError, match=r"empty round datasets \[3\]"):
        dataset_weights([D(2, 4), D(3, 0)], mode="all_history", lam=None)


# ---- sample size ---------------------------------------------------------------------------------------


def test_default_sample_size_fallbacks():
    eligible = [D(1, 4), D(2, 6)]
    assert default_sample_size(sample_size=9, current_pairs=5, eligible=eligible) == 9
    assert default_sample_size(sample_size=None, current_pairs=5, eligible=eligible) == 5
    assert default_sample_size(sample_size=None, current_pairs=0, eligible=eligible) == 6  # newest non-empty
    assert default_sample_size(sample_size=None, current_pairs=0, eligible=[]) == 0


def test_empty_current_round_samples_the_newest_non_empty_size():
    history = [D(1, 4), D(2, 6), D(3, 0)]
    selection = select_replay(
        history, mode="all_history", current_round=3, k=None, lam=None, sample_size=None, rng=rng()
    )
    assert selection.sample_size == 6 and len(selection.draws) == 6
    assert selection.eligible_rounds == [1, 2]


def test_nothing_stored_gives_an_empty_selection():
    selection = select_replay(
        [D(1, 0), D(2, 0)], mode="all_history", current_round=2, k=None, lam=None, sample_size=8, rng=rng()
    )
    assert (selection.draws, selection.eligible_rounds, selection.weights, selection.sample_size) == ([], [], [], 0)


# ---- sampling ------------------------------------------------------------------------------------------


def test_counts_within_size_are_distinct_pairs():
    for count in (0, 1, 4, 10):
        picked = sample_within(10, count, rng(count))
        assert len(picked) == count and len(set(picked.tolist())) == count
        assert set(picked.tolist()) <= set(range(10))


def test_count_above_size_uses_every_pair_floor_or_ceil_times():
    picked = sample_within(4, 10, rng()).tolist()  # 10 = 2 full passes of 4 + 2 more
    uses = Counter(picked)
    assert sorted(uses) == [0, 1, 2, 3]
    assert sorted(uses.values()) == [2, 2, 3, 3]
    assert sorted(picked[:4]) == sorted(picked[4:8]) == [0, 1, 2, 3]  # each pass is a full permutation
    assert len(set(picked[8:])) == 2


def test_allocate_draws_counts_sum_to_n():
    counts = allocate_draws(np.array([0.25, 0.0, 0.75]), 1000, rng())
    assert counts.sum() == 1000 and counts[1] == 0
    np.testing.assert_array_equal(allocate_draws(np.array([0.5, 0.5]), 0, rng()), [0, 0])
    with pytest.raises(ValueError, match="to place 3 draws"):
        allocate_draws(np.zeros(0), 3, rng())


def test_current_mode_is_the_current_round_in_stored_order():
    selection = select_replay(HISTORY, mode="current", current_round=4, k=None, lam=None, sample_size=None, rng=rng())
    assert selection.draws == [ReplayDraw(4, 0)]
    history = [D(1, 3), D(2, 5)]
    selection = select_replay(history, mode="current", current_round=2, k=1, lam=None, sample_size=None, rng=rng())
    assert selection.draws == [ReplayDraw(2, i) for i in range(5)]
    assert (selection.eligible_rounds, selection.weights, selection.sample_size) == ([2], [1.0], 5)


@pytest.mark.parametrize("history", [[D(1, 6)], [D(1, 0), D(2, 6)]])
def test_all_history_after_a_single_round_selects_the_same_set_as_current(history):
    current_round = history[-1].round_index
    kwargs = {"current_round": current_round, "k": None, "lam": None, "sample_size": None}
    current = select_replay(history, mode="current", rng=rng(), **kwargs)
    replayed = select_replay(history, mode="all_history", rng=rng(), **kwargs)
    assert len(replayed.draws) == len(current.draws) == 6
    assert set(replayed.draws) == set(current.draws)


def test_same_seed_same_selection_other_seed_other_selection():
    kwargs = {"mode": "lambda_decay", "current_round": 4, "k": None, "lam": 0.5, "sample_size": 40}
    first = select_replay(HISTORY, rng=rng(1), **kwargs)
    assert first == select_replay(HISTORY, rng=rng(1), **kwargs)
    assert first.draws != select_replay(HISTORY, rng=rng(2), **kwargs).draws


def test_combined_draws_are_shuffled_across_datasets():
    selection = select_replay(
        [D(1, 50), D(2, 50)], mode="all_history", current_round=2, k=None, lam=None, sample_size=60, rng=rng()
    )
    sources = [d.source_round for d in selection.draws]
    assert sources != sorted(sources)  # not grouped by dataset (fixed seed: 60 draws, not a flaky check)


def test_lambda_decay_shares_match_weights_over_many_draws():
    history = [D(1, 3), D(2, 50), D(3, 0), D(4, 7)]  # sizes differ on purpose; round 3 is empty
    selection = select_replay(
        history, mode="lambda_decay", current_round=4, k=None, lam=0.5, sample_size=MANY, rng=rng()
    )
    assert selection.eligible_rounds == [1, 2, 4]
    np.testing.assert_allclose(selection.weights, [1 / 7, 2 / 7, 4 / 7], rtol=0, atol=1e-15)
    np.testing.assert_allclose(shares(selection.draws, [1, 2, 4]), [1 / 7, 2 / 7, 4 / 7], rtol=0, atol=SHARE_TOL)
    # Inside each dataset every pair is used floor(c/n) or ceil(c/n) times.
    for source, size in [(1, 3), (2, 50), (4, 7)]:
        uses = Counter(d.pair_index for d in selection.draws if d.source_round == source)
        count = sum(uses.values())
        assert len(uses) == size and set(uses.values()) <= {count // size, -(-count // size)}


def test_nearest_k_shares_are_equal_whatever_the_sizes():
    selection = select_replay(HISTORY, mode="nearest_k", current_round=4, k=2, lam=None, sample_size=MANY, rng=rng())
    assert selection.eligible_rounds == [2, 4]  # sizes 10 and 1
    np.testing.assert_allclose(shares(selection.draws, [2, 4]), [0.5, 0.5], rtol=0, atol=SHARE_TOL)


def test_lambda_one_equals_all_history_in_distribution():
    kwargs = {"current_round": 4, "k": None, "sample_size": MANY}
    decay = select_replay(HISTORY, mode="lambda_decay", lam=1.0, rng=rng(1), **kwargs)
    uniform = select_replay(HISTORY, mode="all_history", lam=None, rng=rng(2), **kwargs)
    assert decay.eligible_rounds == uniform.eligible_rounds == [1, 2, 4]
    np.testing.assert_allclose(decay.weights, uniform.weights, rtol=0, atol=1e-15)
    for selection in (decay, uniform):
        np.testing.assert_allclose(shares(selection.draws, [1, 2, 4]), [1 / 3] * 3, rtol=0, atol=SHARE_TOL)


# ---- argument validation -------------------------------------------------------------------------------


# The replay options' rules are the config's (pbrl.config.replay_rules): a job that breaks one never loads, so a
# user sees a ConfigError naming the field; select_replay takes a valid job's values and raises a ValueError (naming
# the field) only where its own arithmetic needs a value (mode, k of nearest_k, lam of lambda_decay).
INVALID_OPTIONS = [
    ("td-lambda", None, None, None, "preference_replay_mode"),
    ("current", 2, None, None, "preference_replay_k"),
    ("current", None, 0.5, None, "preference_replay_lambda"),
    ("current", None, None, 8, "preference_replay_sample_size"),
    ("nearest_k", None, None, None, "preference_replay_k"),
    ("nearest_k", 0, None, None, "preference_replay_k"),
    ("all_history", 2, None, None, "preference_replay_k"),
    ("all_history", None, None, 0, "preference_replay_sample_size"),
    ("lambda_decay", None, None, None, "preference_replay_lambda"),
    ("lambda_decay", None, 1.5, None, "preference_replay_lambda"),
    ("lambda_decay", None, -0.1, None, "preference_replay_lambda"),
    ("lambda_decay", 3, 0.5, None, "preference_replay_k"),
]


def _replay_config(mode, k, lam, sample_size) -> MADPOIterConfig:
    return MADPOIterConfig(
        preference_replay_mode=mode,
        preference_replay_k=k,
        preference_replay_lambda=lam,
        preference_replay_sample_size=sample_size,
    )


@pytest.mark.parametrize("mode, k, lam, sample_size, field", INVALID_OPTIONS)
def test_invalid_options_are_refused_naming_the_field(mode, k, lam, sample_size, field):
    with pytest.raises(ConfigError, match=field) as info:
        _replay_config(mode, k, lam, sample_size)
    assert field in [p.field for p in info.value.problems]


@pytest.mark.parametrize(
    "mode, k, lam, sample_size, field",
    [
        case
        for case in INVALID_OPTIONS
        if case[4] == "preference_replay_mode"
        or (case[0], case[4]) in {("nearest_k", "preference_replay_k"), ("lambda_decay", "preference_replay_lambda")}
    ],
)
def test_invalid_arguments_raise_naming_the_field(mode, k, lam, sample_size, field):
    with pytest.raises(ValueError, match=field):
        select_replay(HISTORY, mode=mode, current_round=4, k=k, lam=lam, sample_size=sample_size, rng=rng())


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        _replay_config("nearest_k", None, 0.5, 0)
    fields = [p.field for p in info.value.problems]
    assert fields == ["preference_replay_k", "preference_replay_lambda", "preference_replay_sample_size"]
