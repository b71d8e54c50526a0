"""``benchmarks/replay_refit.py``: the stages rerun in a copy of a run with the job's own replay sample size
reproduce what fit-reward-model recorded, another size draws that many pairs, the run itself is never written; its
summary by hand."""

from __future__ import annotations

import json

import pytest

from pbrl.data.storage import RunPaths
from tests.helpers import benchmark_script


@pytest.fixture(scope="module")
def replay_refit():
    with benchmark_script("replay_refit") as module:
        yield module


def test_summary_by_hand(replay_refit):
    rows = [
        {"sample_size": "run", "heldout_accuracy": 0.8},
        {"sample_size": "run", "heldout_accuracy": 0.6},
        {"sample_size": "run", "heldout_accuracy": None},  # a round without held-out pairs: not a round measured
        {"sample_size": 1000, "heldout_accuracy": 0.75},
    ]
    assert replay_refit.summary(rows) == [
        {"sample_size": "run", "mean": 0.7, "worst": 0.6, "rounds_at_075": 1, "rounds": 2},
        {"sample_size": 1000, "mean": 0.75, "worst": 0.75, "rounds_at_075": 1, "rounds": 1},
    ]


@pytest.mark.parametrize("size", [0, -3, "all", 2.5])
def test_a_sample_size_that_is_not_a_count_is_refused_by_name(replay_refit, tmp_path, size):
    with pytest.raises(ValueError, match="sample size: got"):
        replay_refit.refit_run(tmp_path, size)


@pytest.mark.flow
def test_the_runs_own_size_reproduces_its_manifests_and_another_draws_that_many(replay_refit, frozen_marlhf_run):
    paths = RunPaths(frozen_marlhf_run)
    stored = {r: paths.manifest(r, "fit-reward-model").read_bytes() for r in (1, 2)}
    own = replay_refit.refit_run(frozen_marlhf_run, "run")
    assert [row["round"] for row in own] == [1, 2]
    for row in own:
        manifest = json.loads(stored[row["round"]])
        counts, metrics = manifest["counts"], manifest["metrics"]
        assert (row["pairs"], row["train_pairs"], row["heldout_pairs"]) == (
            counts["pairs"],
            counts["train_pairs"],
            counts["heldout_pairs"],
        )
        assert row["heldout_accuracy"] == round(metrics["rm/heldout_accuracy"], 4)
        assert row["heldout_low"] == round(metrics["rm/heldout_accuracy_lo"], 4)

    drawn = replay_refit.refit_run(frozen_marlhf_run, 7)
    assert [(row["round"], row["sample_size"], row["pairs"]) for row in drawn] == [(1, 7, 7), (2, 7, 7)]
    assert all(row["train_pairs"] + row["heldout_pairs"] == 7 for row in drawn)  # no pair is too long here
    assert {r: paths.manifest(r, "fit-reward-model").read_bytes() for r in (1, 2)} == stored  # the run is untouched
