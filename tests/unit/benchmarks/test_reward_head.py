"""``benchmarks/reward_head.py``: the refit of a frozen reward model's head on a run's stored rounds reproduces what
fit-reward-model recorded, never runs the backbone, and refuses rounds whose features are not stored; a round fitted
on every stored pair (``--history``) takes each once; its summary, folds and cross-validated choice by hand."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from pbrl.data.storage import RunPaths
from pbrl.learning.feature_store import features_path
from pbrl.learning.reward_model import JointRewardModel
from tests.helpers import benchmark_script


@pytest.fixture(scope="module")
def reward_head():
    with benchmark_script("reward_head") as module:
        yield module


def _row(round_index, split, components, squares, accuracy, products=False):
    return {
        "round": round_index,
        "split": split,
        "components": components,
        "length_squares": squares,
        "length_products": products,
        "heldout_pair_accuracy": accuracy,
    }


def test_summary_by_hand(reward_head):
    rows = [
        _row(1, 0, 8, True, 0.8),
        _row(2, 0, 8, True, 0.7),
        _row(1, 1, 8, True, 0.9),
        _row(1, 0, 8, False, 0.6),
        _row(2, 1, 8, False, 0.5),
        _row(1, 0, 8, True, 0.9, products=True),
    ]
    assert reward_head.summary(rows) == [
        {
            "components": 8,
            "length_squares": True,
            "length_products": False,
            "split0_mean": 0.75,
            "split0_min": 0.7,
            "all_splits_mean": 0.8,
            "all_splits_min": 0.7,
            "rounds": 2,
            "by_margin": [],
        },
        {
            "components": 8,
            "length_squares": False,
            "length_products": False,
            "split0_mean": 0.6,
            "split0_min": 0.6,
            "all_splits_mean": 0.55,
            "all_splits_min": 0.5,
            "rounds": 1,
            "by_margin": [],
        },
        {
            "components": 8,
            "length_squares": True,
            "length_products": True,
            "split0_mean": 0.9,
            "split0_min": 0.9,
            "all_splits_mean": 0.9,
            "all_splits_min": 0.9,
            "rounds": 1,
            "by_margin": [],
        },
    ]


def test_a_round_that_orders_no_unseen_pair_right_is_the_worst_not_left_out(reward_head):
    """An accuracy of 0.0 is a measurement (the summary once dropped it as falsy); None (no unseen pairs) is not."""
    rows = [_row(1, 0, "cv", True, 0.0), _row(2, 0, "cv", True, 0.8), _row(3, 0, "cv", True, None)]
    (entry,) = reward_head.summary(rows)
    assert (entry["split0_mean"], entry["split0_min"], entry["rounds"]) == (0.4, 0.0, 2)


def test_accuracy_by_margin_by_hand(reward_head):
    """Margins 0.05 (wrong), 0.2 (right), 0.3 and 2.0 (right, wrong): bands (0, 0.1], (0.1, 0.25], (0.25, 0.5],
    (0.5, inf); a margin of 0 (a tie) falls in none. Two rows pool band by band."""
    one = reward_head.by_margin([False, True, True, False, True], [0.05, 0.2, 0.3, 2.0, 0.0])
    assert one == [
        {"band": [0.0, 0.1], "pairs": 1, "correct": 0},
        {"band": [0.1, 0.25], "pairs": 1, "correct": 1},
        {"band": [0.25, 0.5], "pairs": 1, "correct": 1},
        {"band": [0.5, math.inf], "pairs": 1, "correct": 0},
    ]
    two = reward_head.by_margin([True, True], [0.5, 0.01])
    assert reward_head.pooled_margins([one, two]) == [
        {"band": [0.0, 0.1], "pairs": 2, "accuracy": 0.5},
        {"band": [0.1, 0.25], "pairs": 1, "accuracy": 1.0},
        {"band": [0.25, 0.5], "pairs": 2, "accuracy": 1.0},
        {"band": [0.5, math.inf], "pairs": 1, "accuracy": 0.0},
    ]
    assert reward_head.pooled_margins([]) == []


def test_items_are_dealt_into_folds_in_a_seeded_order(reward_head):
    """Five distinct items (first-seen order a, b, c, d, e; repeats ignored) into 2 folds. Seed 7's permutation of 5
    is [2, 0, 4, 1, 3]: its even places (2, 4, 3: c, e, d) go to fold 0, its odd places (0, 1: a, b) to fold 1;
    more folds than items leave no empty fold."""
    assert reward_head.item_folds(["a", "b", "a", "c", "d", "e", "e"], 2, 7) == [{"c", "d", "e"}, {"a", "b"}]
    folds = reward_head.item_folds(["a", "b"], 3, 0)
    assert len(folds) == 2 and set().union(*folds) == {"a", "b"}


def test_the_cross_validation_chooses_the_best_and_a_tie_the_larger_head(reward_head):
    four, eight, every = (4, True, False), (8, True, False), (None, True, False)
    assert reward_head.cv_choice({four: 0.9, eight: 0.8}) == four
    assert reward_head.cv_choice({four: 0.8, eight: 0.8}) == eight
    assert reward_head.cv_choice({every: 0.8, eight: 0.8, four: 0.7}) == every


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_api")
def test_the_stages_own_variant_reproduces_its_manifest_from_stored_features(
    reward_head, frozen_marlhf_run, tmp_path, monkeypatch
):
    run_dir = tmp_path / "run"
    shutil.copytree(frozen_marlhf_run, run_dir)  # the end of this test removes stored features
    paths = RunPaths(run_dir)
    assert reward_head.fitted_rounds(run_dir) == [1, 2]

    def no_backbone(self, rows, *args, **kwargs):
        raise AssertionError("the backbone ran")

    with monkeypatch.context() as patch:
        patch.setattr(JointRewardModel, "_compute_features", no_backbone)
        variants = [(2, True, False), (2, False, False), (None, True, False), (2, True, True)]
        rows = reward_head.refit_round(run_dir, 2, variants, splits=2)
    assert [(r["split"], r["components"], r["length_squares"], r["length_products"]) for r in rows] == [
        (split, *variant) for split in (0, 1) for variant in variants
    ]
    metrics = json.loads(paths.manifest(2, "fit-reward-model").read_text())["metrics"]
    counts = json.loads(paths.manifest(2, "fit-reward-model").read_text())["counts"]
    own = rows[0]  # split 0 with the job's own head: what the stage fitted and measured
    assert own["train_pairs"] == counts["train_pairs"] and own["heldout_pairs"] == counts["heldout_pairs"]
    assert own["train_accuracy"] == round(metrics["rm/accuracy"], 4)
    assert own["heldout_pair_accuracy"] == round(metrics["rm/heldout_accuracy"], 4)
    assert own["heldout_low"] == round(metrics["rm/heldout_accuracy_lo"], 4)
    assert rows[4]["heldout_pairs"] + rows[4]["train_pairs"] == own["heldout_pairs"] + own["train_pairs"]
    assert not any(r["prompt_overlap"] for r in rows)  # as the job: no overlap
    bands = own["heldout_by_margin"]  # every held-out pair has a positive task-reward margin: each is in one band
    assert sum(b["pairs"] for b in bands) == own["heldout_pairs"]
    assert sum(b["correct"] for b in bands) == round(own["heldout_pair_accuracy"] * own["heldout_pairs"])
    with monkeypatch.context() as patch:
        patch.setattr(JointRewardModel, "_compute_features", no_backbone)
        (read,) = reward_head.refit_round(run_dir, 2, [(2, True, False)], splits=1, overlap=True)
        (joint,) = reward_head.refit_round(run_dir, 2, [(2, True, False)], splits=1, joint_overlap=True)
    assert read["prompt_overlap"] and read["train_pairs"] == own["train_pairs"]
    assert joint["joint_overlap"] and not joint["prompt_overlap"] and not own["joint_overlap"]

    # One variant as an ensemble is that variant; a cross-validation between two chooses one of them and reports
    # that one's unseen-item accuracy, with each variant's accuracy over the folds of the training items.
    with monkeypatch.context() as patch:
        patch.setattr(JointRewardModel, "_compute_features", no_backbone)
        alone, together = reward_head.refit_round(run_dir, 2, [(2, True, False)], splits=1, ensemble=True)
        two = [(2, True, False), (None, True, False)]
        *each, chosen = reward_head.refit_round(run_dir, 2, two, splits=1, cv_folds=2)
    assert together["components"] == "ensemble" and together["length_squares"] is True
    assert {k: together[k] for k in ("heldout_pair_accuracy", "heldout_low", "heldout_high", "heldout_by_margin")} == {
        k: alone[k] for k in ("heldout_pair_accuracy", "heldout_low", "heldout_high", "heldout_by_margin")
    }
    assert each[0]["heldout_pair_accuracy"] == own["heldout_pair_accuracy"]
    assert chosen["components"] == "cv" and set(chosen["cv_accuracy"]) == {"2", "None"}
    picked = 0 if chosen["chosen_components"] == 2 else 1
    assert chosen["chosen_components"] == reward_head.cv_choice({v: chosen["cv_accuracy"][str(v[0])] for v in two})[0]
    assert chosen["heldout_pair_accuracy"] == each[picked]["heldout_pair_accuracy"]

    features_path(paths.round_dir(1)).unlink()  # round 2 replays round 1's pairs: their features are gone
    with pytest.raises(RuntimeError, match="round 2: .* joint responses have no stored features"):
        reward_head.refit_round(run_dir, 2, [(2, True, False)], splits=1)


@pytest.mark.flow
def test_history_fits_every_stored_pair_once_and_reports_the_rounds_own(reward_head, frozen_marlhf_run, monkeypatch):
    import stages.fit_reward_model as fit
    from pbrl.data.seeds import derive_seed
    from pbrl.run.folder import open_job

    job, paths = open_job(frozen_marlhf_run), RunPaths(frozen_marlhf_run)
    selected = {r: [p["pair_id"] for p in fit.usable_pairs(paths, r, job)[0]] for r in (1, 2)}
    assert [p["pair_id"] for p in reward_head.history_pairs(frozen_marlhf_run, 1)[0]] == list(
        dict.fromkeys(selected[1])
    )
    pairs, kept, usable = reward_head.history_pairs(frozen_marlhf_run, 2)
    assert [p["pair_id"] for p in pairs] == list(dict.fromkeys(selected[1] + selected[2]))  # each once, round 1 first
    assert len(kept) == len(usable) == len(pairs)  # no pair of the tiny run is too long

    def no_backbone(self, rows, *args, **kwargs):
        raise AssertionError("the backbone ran")

    with monkeypatch.context() as patch:
        patch.setattr(JointRewardModel, "_compute_features", no_backbone)
        (row,) = reward_head.refit_round(frozen_marlhf_run, 2, [(2, True, False)], splits=1, history=True)
        (plain,) = reward_head.refit_round(frozen_marlhf_run, 2, [(2, True, False)], splits=1)
    assert row["history"] and not plain["history"]
    assert row["train_pairs"] + row["heldout_pairs"] == len(kept)
    _, held_idx = fit.heldout_split(
        [p["item_id"] for p in kept],
        fit.HELDOUT_SHARE,
        derive_seed(job.seed, round_index=2, stage=fit.NAME, side="heldout"),
    )
    assert row["heldout_own_pairs"] == sum(kept[i]["round_index"] == 2 for i in held_idx)
    own_plain = fit.usable_pairs(paths, 2, job)[1]
    assert plain["heldout_own_pairs"] <= plain["heldout_pairs"] <= len(own_plain)


@pytest.mark.flow
def test_all_pairs_fits_every_pair_the_rounds_built_once_and_may_run_the_backbone(reward_head, frozen_marlhf_run):
    from pbrl.data.tables import read_pairs

    paths = RunPaths(frozen_marlhf_run)
    built = [p["pair_id"] for r in (1, 2) for p in read_pairs(paths.pairs(r))]
    pairs, kept, usable = reward_head.history_pairs(frozen_marlhf_run, 2, every_built=True)
    assert [p["pair_id"] for p in pairs] == list(dict.fromkeys(built)) and len(kept) == len(usable) == len(pairs)
    (row,) = reward_head.refit_round(frozen_marlhf_run, 2, [(2, True, False)], splits=1, all_pairs=True)
    assert row["history"] == "all" and row["train_pairs"] + row["heldout_pairs"] == len(kept)
