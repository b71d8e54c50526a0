"""``benchmarks/learning.py`` (``make learn``): its held-out pairs by hand, and one whole run of the script on the
tiny model whose JSON is checked against the run's own files and a brute-force scorer.

docs/results/learning.md quotes this benchmark's tables; these tests keep the numbers behind them honest: the held-out
pairs
are each evaluation item's best and worst draw, the held-out pair accuracy is the sign of the implicit MADPO
margin of the round's policy against round 0's (computed here one row at a time with a plain forward, not with
:func:`pbrl.learning.logprobs.sequence_logprobs`), and the per-round figures are the evaluate stage's.
"""

from __future__ import annotations

import json
import math
import sys
from types import SimpleNamespace

import pytest

from pbrl.data.items import read_items
from pbrl.data.schema import EVAL
from pbrl.data.storage import RunPaths, read_manifest
from pbrl.data.tables import read_rows
from pbrl.generation.sampling import encode_prompt
from pbrl.models.policies import load_agent
from pbrl.run.folder import open_job
from pbrl.run.policy_records import policy_checkpoint
from pbrl.run.settings import policy_source
from tests.helpers import benchmark_script, logprob_alone


@pytest.fixture(scope="module")
def learning():
    with benchmark_script("learning") as module:
        yield module


@pytest.mark.parametrize("trainer", ["madpo_iter", "marlhf_iter"])
@pytest.mark.parametrize("scale", ["standard", "full", "quick"])
def test_every_trainer_and_scale_makes_a_valid_job(learning, trainer, scale):
    """Found starting ``make learn LEARN_ARGS="--trainer marlhf_iter"``: the scale capped the pairs per item,
    which marlhf-docs.yaml's ``pair_selection: all`` refuses, so the benchmark stopped before its first run."""
    overrides = [
        "agent_model=smollm2-135m-instruct",
        *learning.trainer_scale(trainer, learning.SCALES[scale], "humaneval_docs"),
    ]
    job = learning.load_job(learning.CONFIGS[trainer], overrides)
    assert job.trainer == trainer and job.num_iterations == learning.SCALES[scale].rounds
    if trainer == "marlhf_iter":
        assert job.pair_selection == "all" and job.preference_pairs_per_sample is None
    else:
        assert job.preference_pairs_per_sample == learning.SCALES[scale].pairs_per_item


def _row(item: str, reward: float, failure: str | None = None) -> dict:
    return {"item_id": item, "reward": reward, "failure": failure}


def test_held_out_pairs_are_each_items_best_and_worst_draw_outside_the_tie_tolerance(learning):
    rows = [
        _row("a", 1.0),
        _row("a", 2.5),
        _row("a", 2.0),  # best 2.5, worst 1.0: a pair
        _row("b", 1.00),
        _row("b", 1.04),  # 0.04 apart, within the tolerance 0.05: none
        _row("c", 0.2),
        _row("c", 3.0, failure="oracle"),  # the failed draw never counts: one draw, none
        _row("d", 0.5),
        _row("d", 0.0, failure="oracle"),
        _row("d", 0.7),
    ]
    pairs = learning.held_out_pairs(rows, tie_tolerance=0.05)
    assert [(w["item_id"], w["reward"], lo["reward"]) for w, lo in pairs] == [("a", 2.5, 1.0), ("d", 0.7, 0.5)]
    assert learning.held_out_pairs(rows, tie_tolerance=1.5) == []  # a: 1.5 apart is not more than 1.5


def test_a_run_of_the_script_on_the_tiny_model_reports_its_runs_numbers(learning, tmp_path, monkeypatch, capsys):
    import benchkit

    monkeypatch.setattr(benchkit, "RESULTS_DIR", tmp_path / "results")  # never over the committed results
    monkeypatch.setattr(learning, "RESULTS_DIR", tmp_path / "results")
    runs = tmp_path / "runs"  # the script's run folders (kept with --keep), inside the test's own folder
    runs.mkdir()
    monkeypatch.setattr(learning, "tempfile", SimpleNamespace(mkdtemp=lambda prefix: str(runs)))
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "learning.py",
            "--quick",
            "--model",
            "tiny-random",
            "--keep",
            "--set",
            "task_options={num_train_items: 4, num_eval_items: 4}",
            "--set",
            "eval_num_samples=4",
            "--set",
            "eval_samples_per_item=3",
            "--set",
            "eval_batch_size=12",
            "--set",
            "max_new_tokens=8",
            "--set",
            "num_iterations=1",
        ],
    )
    assert learning.main() == 0
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "results" / "learning-humaneval_docs-tiny-random-quick.json").read_text())
    assert (tmp_path / "results" / "learning-humaneval_docs-tiny-random-quick.png").stat().st_size > 0
    assert f"run folders: {runs}" in out
    run_dir = runs / "learning-seed0"
    paths, job = RunPaths(run_dir), open_job(run_dir)
    assert (job.seed, job.num_iterations, job.eval_samples_per_item, job.max_new_tokens) == (0, 1, 3, 8)

    (seed,) = result["results"]
    assert seed["seed"] == 0 and [x["round"] for x in seed["rounds"]] == [0, 1]
    train = {x["item_id"] for x in read_items(paths, "train")}
    evaluation = {x["item_id"] for x in read_items(paths, "eval")}
    assert len(train) == len(evaluation) == 4 and not train & evaluation  # held out

    for rec in seed["rounds"]:  # the evaluate stage's figures, and the drift indicators from its rows
        r = rec["round"]
        metrics = read_manifest(paths, r, "evaluate").metrics
        for key in ("eval/reward_mean", "eval/reward_ci_low", "eval/reward_ci_high"):
            assert rec[key] == metrics[key]
        rows = read_rows(paths.eval(r), EVAL)
        assert len(rows) == 4 * 3
        for a in range(2):
            lengths = [len(x["completion_ids"][a]) for x in rows]
            assert rec[f"agent_{a}/completion_tokens"] == pytest.approx(sum(lengths) / 12, abs=1e-12)
            cut = sum(x["finish_reasons"][a] == "length" for x in rows)
            assert rec[f"agent_{a}/cut_share"] == pytest.approx(cut / 12, abs=1e-12)
    later = seed["rounds"][1]
    assert later["eval/paired_diff_mean"] == read_manifest(paths, 1, "evaluate").metrics["eval/paired_diff_mean"]
    assert later["madpo/loss"] == read_manifest(paths, 1, "update-policies").metrics["madpo/loss"]
    assert later["round_seconds"] > 0
    excludes = later["eval/paired_diff_ci_low"] > 0
    assert seed["first_round_gain_excludes_0"] == (1 if excludes else None)
    assert result["paired_ci_excludes_0_by_round_2"] == [excludes]

    # Held-out pair accuracy: the share of round 0's (best, worst) draws whose implicit joint margin under the
    # round-1 policy, sum_agents [(log pi_1 - log pi_0)(best) - (log pi_1 - log pi_0)(worst)], is positive.
    pairs = learning.held_out_pairs(read_rows(paths.eval(0), EVAL), job.tie_tolerance)
    assert pairs and later["heldout_pairs"] == len(pairs)
    source, margins = policy_source(job), [0.0] * len(pairs)
    for agent in range(2):
        new = load_agent(source, agent, policy_checkpoint(paths, 1), trainable=False)
        old = load_agent(source, agent, policy_checkpoint(paths, 0), trainable=False)
        for k, (best, worst) in enumerate(pairs):
            for row, sign in ((best, 1.0), (worst, -1.0)):
                prompt, completion = encode_prompt(new.tokenizer, row["prompts"][agent]), row["completion_ids"][agent]
                ratio = logprob_alone(new.model, prompt, completion) - logprob_alone(old.model, prompt, completion)
                margins[k] += sign * ratio
    assert all(math.isfinite(m) and abs(m) > 1e-9 for m in margins)  # the update moved every pair's margin
    scripted = learning.pair_margins(paths, job, 1, pairs)  # rows scored alone: equal within float32 rounding
    assert scripted == pytest.approx(margins, abs=1e-4)
    assert later["heldout_pair_accuracy"] == pytest.approx(sum(m > 0 for m in scripted) / len(scripted), abs=1e-12)
    clear = [(m > 0, s > 0) for m, s in zip(margins, scripted, strict=True) if abs(m) > 1e-3]
    assert clear and all(a == b for a, b in clear)  # where the sign is not a rounding matter, both agree
    assert "seed 0: round | eval reward" in out and "excludes 0 by round 2" in out

    # --report summarises kept folders again, under --tag's name (it was ignored): the same numbers.
    monkeypatch.setattr(sys, "argv", ["learning.py", "--report", str(run_dir), "--tag", "again"])
    assert learning.main() == 0
    again = json.loads(
        (tmp_path / "results" / "learning-humaneval_docs-smollm2-135m-instruct-standard-report-again.json").read_text()
    )
    assert again["results"][0]["rounds"] == seed["rounds"]


def test_every_result_names_the_cpu_its_bfloat16_flags_and_auto_precision(learning, tmp_path, monkeypatch):
    """The machine facts that decide ``auto`` precision travel with every benchmark result: machines of one name
    differ between sessions (with and without AVX-512), and a timing means nothing without them."""
    import benchkit

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu avx2 avx512f avx512_bf16\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda f, *a, **k: real_open(cpuinfo if f == "/proc/cpuinfo" else f, *a, **k))
    monkeypatch.delenv("PBRL_CPU_BF16", raising=False)
    facts = benchkit.machine_facts()
    assert facts["cpu_model"] == "AMD EPYC 9R14"
    assert facts["cpu_bf16_flags"] == ["avx512_bf16"] and facts["torch_dtype_auto"] == "bfloat16"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2\n")  # no model name, no bfloat16 arithmetic
    facts = benchkit.machine_facts()
    assert facts["cpu_model"] is None and facts["cpu_bf16_flags"] == [] and facts["torch_dtype_auto"] == "float32"
    monkeypatch.setenv("PBRL_CPU_BF16", "1")  # auto decided as on another kind of CPU: the result says so
    facts = benchkit.machine_facts()
    assert facts["torch_dtype_auto"] == "bfloat16" and facts["PBRL_CPU_BF16"] == "1"


def test_drift_panel_draws_coinciding_seeds_as_one_labelled_line(learning):
    """Found in the MARLHF learning figure: agent 1 sat at the 48-token cap in every seed, so three lines drew
    on top of each other and the legend named three colours of which one showed."""

    def result(seed, agent_0, agent_1):
        rounds = [
            {"round": r, "agent_0/completion_tokens": a, "agent_1/completion_tokens": b}
            for r, (a, b) in enumerate(zip(agent_0, agent_1, strict=True))
        ]
        return {"seed": seed, "rounds": rounds}

    series = learning.drift_series(
        [result(0, [36, 30], [48, 48]), result(1, [38, 25], [48, 48]), result(2, [42, 31], [47, 48])]
    )
    assert series == {
        (0, (0, 1), (36, 30)): [0],
        (1, (0, 1), (48, 48)): [0, 1],
        (0, (0, 1), (38, 25)): [1],
        (0, (0, 1), (42, 31)): [2],
        (1, (0, 1), (47, 48)): [2],
    }
