"""The judge in the round (issue #51): the stage judge-pairs, build-pairs from its verdicts, the trainers on judged
pairs, evaluation by win rate without a reward, and that no question is ever asked twice (rerun, ``--force``, a kill
in the middle of judging). Stages are called directly on the tiny model; the flow tests run them under Prefect."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pbrl.data.schema import PAIRS, VERDICTS
from pbrl.data.storage import RunPaths
from pbrl.data.tables import read_rows
from pbrl.errors import OracleError
from pbrl.run.folder import open_job, prepare_run
from pbrl.run.judging import round_stages
from stages import STAGE_MODULES
from tests.helpers import tiny_job

ROOT = Path(__file__).resolve().parents[3]
JUDGED = {"preference_source": "judge", "pair_selection": "all", "preference_pairs_per_sample": None}


def start(model_dir: Path, folder: Path, **overrides):
    """A new tiny run (madpo_iter on the toy task) and its stored job."""
    run_dir = prepare_run(tiny_job(model_dir, folder, **overrides), resume=False)
    return run_dir, open_job(run_dir)


def run_round(run_dir: Path, job, round_index: int, until: str | None = None) -> dict[str, object]:
    """The stages of one round in order (round 0: evaluate), up to and including ``until``; their manifests."""
    names = ("evaluate",) if round_index == 0 else round_stages(job, run_dir)
    done = {}
    for name in names:
        done[name] = STAGE_MODULES[name].run(run_dir, round_index, job)
        if name == until:
            break
    return done


def pair_set(run_dir: Path, round_index: int) -> set[tuple]:
    rows = read_rows(RunPaths(run_dir).pairs(round_index), PAIRS)
    return {(r["item_id"], r["winner_side"], r["winner_index"], r["loser_side"], r["loser_index"]) for r in rows}


def test_a_judge_without_noise_decides_the_pairs_the_rewards_decide(tiny_model_dir, tmp_path):
    scored_dir, scored = start(tiny_model_dir, tmp_path / "reward", pair_selection="all",
                               preference_pairs_per_sample=None)  # fmt: skip
    judged_dir, judged = start(tiny_model_dir, tmp_path / "judge", judge="reward_noisy", **JUDGED)
    first = ("sample-candidates", "score-with-oracle", "judge-pairs", "build-pairs")
    assert round_stages(judged, judged_dir)[:4] == first
    run_round(scored_dir, scored, 1, until="build-pairs")
    manifests = run_round(judged_dir, judged, 1, until="build-pairs")
    assert pair_set(judged_dir, 1) == pair_set(scored_dir, 1) and pair_set(judged_dir, 1)
    counts = manifests["judge-pairs"].counts
    assert counts["askings"] == 2 * counts["questions_asked"]  # both orders of every pair
    assert manifests["judge-pairs"].metrics["judge/reward_agreement"] == 1.0
    judged_pairs = read_rows(RunPaths(judged_dir).pairs(1), PAIRS)
    assert all(p["winner_reward"] > p["loser_reward"] for p in judged_pairs)  # the task's rewards, kept beside


def test_the_verdicts_record_every_asking_with_its_provenance(tiny_model_dir, tmp_path):
    run_dir, job = start(tiny_model_dir, tmp_path, judge="reward_noisy", judge_label_noise=0.3, **JUDGED)
    run_round(run_dir, job, 1, until="build-pairs")
    rows = pq.read_table(RunPaths(run_dir).verdicts(1)).to_pylist()
    assert pq.read_schema(RunPaths(run_dir).verdicts(1)).equals(VERDICTS)
    by_question: dict[str, list[dict]] = {}
    for row in rows:
        by_question.setdefault(row["question_id"], []).append(row)
    for asked in by_question.values():
        assert [r["shown_first"] for r in asked] == ["x", "y"] and len({r["preference"] for r in asked}) == 1
        assert all(r["judge"] == "reward_noisy(noise=0.3, tie_tolerance=1e-09, seed=0)" for r in asked)
        assert all(r["verdict"] in ("A", "B", "tie") and r["probability"] in (0.3, 0.7, 0.5) for r in asked)
    # the simulator's error belongs to the pair: both orders agree, so no pair ties from disagreement
    decided = [a[0]["preference"] for a in by_question.values()]
    assert set(decided) <= {"x", "y", "tie"} and decided.count("tie") == 0
    answers = (run_dir / "judge" / "answers.jsonl").read_text().splitlines()
    assert len(answers) == len(rows) and {json.loads(a)["key"] for a in answers} == {r["key"] for r in rows}


def test_a_rerun_and_a_forced_rerun_never_ask_the_judge_again(tiny_model_dir, tmp_path, monkeypatch):
    log = tmp_path / "asked.log"
    monkeypatch.setenv("PBRL_TEST_JUDGE_LOG", str(log))
    run_dir, job = start(tiny_model_dir, tmp_path, judge="tests.judges_ab:counted", **JUDGED)
    first = run_round(run_dir, job, 1, until="judge-pairs")["judge-pairs"]
    asked = log.read_text().count("\n")
    assert asked == first.counts["askings"] == first.counts["answers_asked"] > 0
    again = STAGE_MODULES["judge-pairs"].run(run_dir, 1, job)  # what `pbrl stage judge-pairs --force` runs
    assert log.read_text().count("\n") == asked  # nothing asked twice
    assert again.counts["answers_from_store"] == again.counts["askings"] and again.counts["answers_asked"] == 0
    assert pq.read_table(RunPaths(run_dir).verdicts(1)).equals(pq.read_table(RunPaths(run_dir).verdicts(1)))


def _verdicts_without_seconds(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "seconds"} for r in read_rows(RunPaths(run_dir).verdicts(1), VERDICTS)]


def test_a_kill_during_judging_resumes_to_the_uninterrupted_verdicts_and_pairs(tiny_model_dir, tmp_path, monkeypatch):
    options = {"judge": "tests.judges_ab:counted", **JUDGED}
    whole_dir, whole = start(tiny_model_dir, tmp_path / "whole", **options)
    run_round(whole_dir, whole, 1, until="build-pairs")
    killed_dir, killed = start(tiny_model_dir, tmp_path / "killed", **options)
    run_round(killed_dir, killed, 1, until="score-with-oracle")
    script = (
        "import sys; from pbrl.run.folder import open_job; from stages import STAGE_MODULES; "
        "STAGE_MODULES['judge-pairs'].run(sys.argv[1], 1, open_job(sys.argv[1]))"
    )
    env = {**os.environ, "PBRL_TEST_JUDGE_KILL_AFTER": "10", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", script, str(killed_dir)], env=env, capture_output=True, cwd=ROOT)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]  # the stage itself was killed
    stored = (killed_dir / "judge" / "answers.jsonl").read_text().count("\n")
    assert stored == 10 and not RunPaths(killed_dir).verdicts(1).exists()  # answers kept, no verdicts yet
    log = tmp_path / "asked.log"
    monkeypatch.setenv("PBRL_TEST_JUDGE_LOG", str(log))
    resumed = run_round(killed_dir, killed, 1, until="build-pairs")
    assert resumed["judge-pairs"].counts["answers_from_store"] == stored
    assert log.read_text().count("\n") == resumed["judge-pairs"].counts["askings"] - stored  # only the rest
    assert _verdicts_without_seconds(killed_dir) == _verdicts_without_seconds(whole_dir)
    assert RunPaths(killed_dir).pairs(1).read_bytes() == RunPaths(whole_dir).pairs(1).read_bytes()


def test_a_judge_that_raises_or_answers_junk_drops_those_pairs_and_too_many_stop_the_round(tiny_model_dir, tmp_path):
    run_dir, job = start(tiny_model_dir, tmp_path / "junk", judge="tests.judges_ab:junk", **JUDGED)
    manifests = run_round(run_dir, job, 1, until="build-pairs")
    counts = manifests["judge-pairs"].counts
    assert counts["no_verdict"] == counts["askings"] and counts["undecided"] == counts["questions_asked"]
    assert manifests["build-pairs"].counts["pairs"] == 0
    assert any("the judge returned {'winner': 'A'}" in m for m in manifests["judge-pairs"].messages)
    run_dir, job = start(tiny_model_dir, tmp_path / "raising", judge="tests.judges_ab:raising", **JUDGED)
    raised = r"the judge raised or failed on (\d+) of \1 askings .*oracle_max_failure_share=0.5"
    with pytest.raises(OracleError, match=raised):
        run_round(run_dir, job, 1, until="judge-pairs")


def test_position_swap_off_asks_one_order_drawn_per_pair(tiny_model_dir, tmp_path):
    run_dir, job = start(tiny_model_dir, tmp_path, judge="tests.judges_ab:always_tie", judge_position_swap=False,
                         judge_max_pairs=5, **JUDGED)  # fmt: skip
    manifests = run_round(run_dir, job, 1, until="build-pairs")
    rows = read_rows(RunPaths(run_dir).verdicts(1), VERDICTS)
    assert len(rows) == manifests["judge-pairs"].counts["questions_asked"] == 5  # the budget
    assert {r["shown_first"] for r in rows} == {"x", "y"}  # drawn, both occur
    assert manifests["build-pairs"].counts["pairs"] == 0 and manifests["build-pairs"].counts["judged_ties"] == 5


def test_a_task_without_a_reward_trains_on_judged_pairs_and_reports_a_win_rate(tiny_model_dir, tmp_path):
    items = tmp_path / "items.jsonl"
    items.write_text("".join(json.dumps({"item_id": f"i{k}", "topic": t}) + "\n" for k, t in enumerate(
        ["rivers", "bread", "stars", "maps"])))  # fmt: skip
    run_dir, job = start(
        tiny_model_dir, tmp_path, task=None, task_options={}, train_dataset=str(items),
        formatters=["tests.helpers:short_prompt", "tests.helpers:long_prompt"],
        judge="tests.judges_ab:longer_first_agent", **JUDGED,
    )  # fmt: skip
    assert "score-with-oracle" not in round_stages(job, run_dir)
    base = run_round(run_dir, job, 0)["evaluate"]
    assert base.counts["failed"] == 0 and "eval/win_rate" not in base.metrics  # round 0 is the baseline
    manifests = run_round(run_dir, job, 1)
    assert manifests["build-pairs"].counts["pairs"] > 0 and manifests["update-policies"].details["updated"]
    pairs = read_rows(RunPaths(run_dir).pairs(1), PAIRS)
    assert all(p["winner_reward"] is None for p in pairs)  # no reward to record
    metrics, counts = manifests["evaluate"].metrics, manifests["evaluate"].counts
    assert 0 <= metrics["eval/win_rate_ci_low"] <= metrics["eval/win_rate"] <= metrics["eval/win_rate_ci_high"] <= 1
    assert metrics["eval/win_rate_draws"] == 2 and counts["judge_askings"] == 4  # 2 draws, both orders
    assert "eval/reward_mean" not in metrics


def test_marlhf_fits_its_reward_model_on_the_judged_pairs(tiny_model_dir, tmp_path):
    run_dir, job = start(tiny_model_dir, tmp_path, trainer="marlhf_iter", judge="reward_noisy", judge_label_noise=0.1,
                         num_generations=2, rl_algorithm="magrpo", **JUDGED)  # fmt: skip
    manifests = run_round(run_dir, job, 1, until="update-policies")
    judged = manifests["build-pairs"].counts["pairs"]
    assert judged > 0 and manifests["fit-reward-model"].counts["pairs"] == judged
    assert manifests["fit-reward-model"].details["fitted"] and manifests["update-policies"].counts["steps"] > 0
