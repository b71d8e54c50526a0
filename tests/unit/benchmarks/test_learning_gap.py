"""``benchmarks/learning_gap.py``: the gap between two settings' paired gains, checked against hand-worked values and
on the files of a real tiny run (issue #33's bfloat16-against-float32 comparison reads them)."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from pbrl.data.schema import EVAL
from pbrl.data.storage import RunPaths
from pbrl.data.tables import read_rows, write_table
from tests.helpers import benchmark_script


@pytest.fixture(scope="module")
def gap():
    with benchmark_script("learning_gap") as module:
        yield module


def test_the_gap_is_the_mean_over_items_of_each_items_gain_difference(gap):
    # Item x: A gains (3-1 + 2-1)/2 = 1.5, B gains (1-1 + 2-1)/2 = 0.5 -> 1.0. Item y: A gains 0, B loses 1 -> 1.0.
    # Item z: one draw only in A's round 0, so it is left out. Mean over items x, y: 1.0; every resample gives 1.0.
    a_now = {("x", 0): 3.0, ("x", 1): 2.0, ("y", 0): 1.0, ("z", 0): 9.0}
    a_base = {("x", 0): 1.0, ("x", 1): 1.0, ("y", 0): 1.0}
    b_now = {("x", 0): 1.0, ("x", 1): 2.0, ("y", 0): 0.0, ("z", 0): 0.0}
    b_base = {("x", 0): 1.0, ("x", 1): 1.0, ("y", 0): 1.0, ("z", 0): 0.0}
    result = gap.gain_gap(a_now, a_base, b_now, b_base)
    assert (result.mean, result.low, result.high, result.n) == (1.0, 1.0, 1.0, 2)


def test_the_interval_resamples_items_not_draws(gap):
    # Item gaps -1, 0, 0, 0 (two draws each): mean -0.25. A resample's mean is -k/4 with k ~ Binomial(4, 1/4);
    # P(k >= 3) = 5.1 % and P(k = 4) = 0.4 %, so the 2.5 % quantile is -0.75; P(k = 0) = 32 %, so the 97.5 % is 0.
    base = {(item, s): 0.0 for item in "abcd" for s in (0, 1)}
    a_now = {key: (-1.0 if key[0] == "a" else 0.0) for key in base}
    result = gap.gain_gap(a_now, base, base, base)
    assert (result.mean, result.low, result.high, result.n) == (-0.25, -0.75, 0.0, 4)


def test_evaluations_with_no_draw_in_common_are_refused_with_their_sizes(gap):
    with pytest.raises(ValueError, match=r"share no \(item, sample\) draw \(they hold 1, 1, 1, 0\)"):
        gap.gain_gap({("x", 0): 1.0}, {("x", 0): 1.0}, {("x", 0): 1.0}, {})


@pytest.mark.flow
def test_a_tiny_run_against_its_copy_and_a_changed_copy(gap, tmp_path, monkeypatch, capsys):
    """One real tiny run: against a copy of itself the gap is exactly 0 and its gain lies within the copy's
    interval; against a copy whose round-1 rewards are all 0.5 higher, the gap is exactly -0.5."""
    import benchkit

    with benchmark_script("learning") as learning:
        overrides = [
            "agent_model=tiny-random",
            *learning.trainer_scale("madpo_iter", learning.SCALES["quick"], "humaneval_docs"),
            "task_options={num_train_items: 4, num_eval_items: 3}",
            "eval_num_samples=3",
            "eval_samples_per_item=2",
            "max_new_tokens=8",
            "num_iterations=1",
            "seed=5",
            f"output_dir={tmp_path}",
            "run_name=a",
        ]
        run_a = learning.run_seed(learning.load_job(learning.CONFIGS["madpo_iter"], overrides))
    same, raised = tmp_path / "same", tmp_path / "raised"
    shutil.copytree(run_a, same)
    shutil.copytree(run_a, raised)
    eval_1 = RunPaths(raised).eval(1)
    rows = read_rows(eval_1, EVAL)
    write_table(eval_1, [{**row, "reward": row["reward"] + 0.5} for row in rows], EVAL)

    result = gap.compare([run_a, run_a], [same, raised])
    (to_same,), (to_raised,) = (s["rounds"] for s in result["seeds"])
    assert to_same["gap"] == {"mean": 0.0, "ci_low": 0.0, "ci_high": 0.0, "items": 3}
    assert to_same["gain_a"] == to_same["gain_b"] and to_same["a_within_b_interval"]
    assert to_raised["gap"]["mean"] == pytest.approx(-0.5) and to_raised["gap"]["items"] == 3
    # Pooled: per item the mean over both pairs' draws (0 and -0.5; one seed, kept apart): -0.25 for every item.
    (pooled,) = result["pooled"]
    assert pooled["round"] == 1 and pooled["gap"]["mean"] == pytest.approx(-0.25) and pooled["gap"]["items"] == 3

    monkeypatch.setattr(benchkit, "RESULTS_DIR", tmp_path / "results")  # never over the committed results
    argv = ["learning_gap.py", "--a", str(run_a), "--b", str(same), "--names", "A", "B", "--result", "gap"]
    monkeypatch.setattr(sys, "argv", argv)
    gap.main()
    written = json.loads((tmp_path / "results" / "gap-humaneval_docs.json").read_text())
    assert written["names"] == {"a": "A", "b": "B"} and written["seeds"][0]["seed"] == 5
    assert "  5 | 1 |" in capsys.readouterr().out


def test_folders_of_other_seeds_are_refused(gap, tmp_path):
    with benchmark_script("learning") as learning:
        jobs = [
            learning.load_job(
                learning.CONFIGS["madpo_iter"],
                ["agent_model=tiny-random", f"seed={s}", f"output_dir={tmp_path}", f"run_name=s{s}"],
            )
            for s in (1, 2)
        ]
    dirs = [learning.prepare_run(job, resume=False) for job in jobs]
    with pytest.raises(ValueError, match="seed 1 and .* seed 2: pair the folders by seed"):
        gap.compare([dirs[0]], [dirs[1]])
    with pytest.raises(ValueError, match="--a has 1 run folders and --b 2"):
        gap.compare([dirs[0]], dirs)
    # across seeds the pair is taken, and the next thing missing is the round-0 evaluation these runs never made
    with pytest.raises(FileNotFoundError, match=r"round 0 was not evaluated .*0000/eval.parquet is missing"):
        gap.compare([dirs[0]], [dirs[1]], across_seeds=True)
