"""The evaluate stage: several draws per held-out item, the same seeds every round, intervals and the paired
difference to round 0 in the manifest, metrics.parquet and the round table (tiny model, toy task)."""

from __future__ import annotations

import json
import statistics

import pytest

import stages.evaluate as evaluate
from pbrl.data.schema import EVAL, METRICS
from pbrl.data.storage import RunPaths
from pbrl.data.tables import read_rows, read_table
from pbrl.reporting.metrics import round_table, write_run_metrics
from pbrl.tasks.humaneval_coop import humaneval_coop_task
from pbrl.tasks.humaneval_docs import humaneval_docs_task
from stages import STAGE_MODULES
from tests.helpers import new_run

ROUND = ["sample-candidates", "score-with-oracle", "build-pairs", "store-round", "replay-select", "update-policies"]
HELD_OUT = [{"topic": "glaciers"}, {"topic": "comets"}]  # the toy task's train items are other topics


@pytest.fixture(scope="module")
def evaluated(tiny_model_dir, tmp_path_factory):
    """Round 0 and round 1 evaluated with 2 held-out items x 3 samples; the seeds of every generate call."""
    out = tmp_path_factory.mktemp("eval")
    items = out / "held_out.jsonl"
    items.write_text("".join(json.dumps(x) + "\n" for x in HELD_OUT))
    run_dir, job = new_run(
        tiny_model_dir,
        out,
        eval_dataset=str(items),
        eval_samples_per_item=3,
        eval_batch_size=4,
        agent_learning_rate=5e-2,
    )
    calls: list[tuple[int, list[int]]] = []
    real = evaluate.generate
    mp = pytest.MonkeyPatch()

    def spy(model, tokenizer, prompt_ids, seeds, settings, **kw):
        calls.append((current[0], list(seeds)))
        return real(model, tokenizer, prompt_ids, seeds, settings, **kw)

    mp.setattr(evaluate, "generate", spy)
    current = [0]
    manifests = {0: evaluate.run(run_dir, 0, job)}
    current[0] = 1
    for name in ROUND:
        STAGE_MODULES[name].run(run_dir, 1, job)
    manifests[1] = evaluate.run(run_dir, 1, job)
    mp.undo()
    return run_dir, job, manifests, calls


def test_rows_are_items_times_samples_item_major(evaluated):
    run_dir, _, manifests, _ = evaluated
    rows = read_rows(RunPaths(run_dir).eval(0), EVAL)
    assert [r["item_id"] for r in rows] == ["eval-00000"] * 3 + ["eval-00001"] * 3
    assert all(len(r["completions"]) == 2 for r in rows)
    assert manifests[0].counts == {"items": 2, "samples": 6, "failed": 0, "items_seen_in_training": 0}


def test_eval_seeds_are_the_same_every_round_and_differ_per_draw(evaluated):
    *_, calls = evaluated
    by_round = {r: [seeds for rr, seeds in calls if rr == r] for r in (0, 1)}
    assert len(by_round[0]) == 2  # one generate call per agent (it batches inside)
    assert by_round[0] == by_round[1]
    every = [s for seeds in by_round[0] for s in seeds]
    assert len(every) == 12 and len(set(every)) == 12  # 2 agents x 2 items x 3 samples, all distinct


def test_same_seeds_same_policy_same_draws(evaluated, tmp_path):
    run_dir, job, _, _ = evaluated
    before = read_rows(RunPaths(run_dir).eval(0), EVAL)
    evaluate.run(run_dir, 0, job)  # round 0 again: the initial policy, the same seeds
    assert [r["completion_ids"] for r in read_rows(RunPaths(run_dir).eval(0), EVAL)] == [
        r["completion_ids"] for r in before
    ]


def _item_means(rows):
    by_item: dict[str, list[float]] = {}
    for r in rows:
        by_item.setdefault(r["item_id"], []).append(r["reward"])
    return {k: statistics.fmean(v) for k, v in by_item.items()}


def test_manifest_metrics_against_the_stored_rewards(evaluated):
    run_dir, _, manifests, _ = evaluated
    paths = RunPaths(run_dir)
    r0, r1 = (read_rows(paths.eval(r), EVAL) for r in (0, 1))
    m0, m1 = manifests[0].metrics, manifests[1].metrics
    for rows, m in ((r0, m0), (r1, m1)):
        mean = statistics.fmean(_item_means(rows).values())
        assert m["eval/reward_mean"] == pytest.approx(mean, abs=1e-12)
        assert m["eval/turn_1/reward_mean"] == pytest.approx(statistics.fmean(r["reward"] for r in rows), abs=1e-12)
        assert m["eval/reward_ci_low"] <= mean <= m["eval/reward_ci_high"]
    # Paired: per item, mean over its 3 draws of (round 1 - round 0), rows matched by position within the item.
    diffs = [
        statistics.fmean(b["reward"] - a["reward"] for a, b in zip(r0[i : i + 3], r1[i : i + 3], strict=True))
        for i in (0, 3)
    ]
    assert m1["eval/paired_diff_mean"] == pytest.approx(statistics.fmean(diffs), abs=1e-12)
    # Two items: the resampled means are d1, (d1+d2)/2, d2 -> the interval is [min, max] of the item diffs.
    assert m1["eval/paired_diff_ci_low"] == pytest.approx(min(diffs), abs=1e-12)
    assert m1["eval/paired_diff_ci_high"] == pytest.approx(max(diffs), abs=1e-12)
    assert m1["eval/paired_items"] == 2.0
    assert not any(k.startswith("eval/paired") for k in m0)  # round 0 is the baseline itself


def test_round_table_and_metrics_parquet_carry_the_intervals(evaluated):
    run_dir, _, manifests, _ = evaluated
    write_run_metrics(run_dir)
    names = {r["metric"] for r in read_table(RunPaths(run_dir).metrics, METRICS).to_pylist()}
    assert {
        "eval/reward_mean",
        "eval/reward_ci_low",
        "eval/reward_ci_high",
        "eval/paired_diff_mean",
        "eval/paired_diff_ci_low",
        "eval/paired_diff_ci_high",
        "eval/turn_1/reward_mean",
    } <= names
    table = round_table(run_dir)
    m1 = manifests[1].metrics
    assert table.loc[1, "paired"] == m1["eval/paired_diff_mean"]
    assert (table.loc[1, "paired_lo"], table.loc[1, "paired_hi"]) == (
        m1["eval/paired_diff_ci_low"],
        m1["eval/paired_diff_ci_high"],
    )
    assert (table.loc[0, "eval_lo"], table.loc[0, "eval_hi"]) == (
        manifests[0].metrics["eval/reward_ci_low"],
        manifests[0].metrics["eval/reward_ci_high"],
    )
    assert table.loc[1, "eval_vs_round0"] == pytest.approx(table.loc[1, "eval_reward"] - table.loc[0, "eval_reward"])


def test_evaluation_on_training_items_is_counted_and_said(tiny_model_dir, tmp_path):
    run_dir, job = new_run(tiny_model_dir, tmp_path, eval_num_samples=2)  # the toy task evaluates on its train items
    manifest = evaluate.run(run_dir, 0, job)
    assert manifest.counts["items_seen_in_training"] == 2
    assert any("not held out" in m for m in manifest.messages)


def test_sample_keys_and_seen_items_hand_worked():
    assert evaluate.sample_keys(["a", "a", "b", "a"]) == [("a", 0), ("a", 1), ("b", 0), ("a", 2)]
    train = [{"item_id": "item-00000", "topic": "rain"}, {"item_id": "x", "topic": "bees"}]
    evals = [{"item_id": "eval-00000", "topic": "rain"}, {"item_id": "x", "topic": "tides"}]
    assert evaluate.items_seen_in_training(evals, train) == ["eval-00000"]  # by content, not by id


@pytest.mark.parametrize("factory", [humaneval_docs_task, humaneval_coop_task])
def test_humaneval_eval_items_are_disjoint_from_train_items(factory):
    task = factory()
    train_ids = {x["item_id"] for x in task.train_items}
    eval_ids = {x["item_id"] for x in task.eval_items}
    assert len(eval_ids) == 16 and len(train_ids) == 148 and not train_ids & eval_ids
    assert not {x["prompt"] for x in task.train_items} & {x["prompt"] for x in task.eval_items}
    assert evaluate.items_seen_in_training(list(task.eval_items), list(task.train_items)) == []
