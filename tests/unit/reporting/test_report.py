"""report.png and the round table behind it."""

from __future__ import annotations

import statistics
import warnings

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest

from pbrl.data.schema import EVAL
from pbrl.data.storage import RunPaths, read_manifest
from pbrl.data.tables import read_rows
from pbrl.reporting.metrics import write_run_metrics
from pbrl.reporting.report import report_figure, title_of, write_report_png
from pbrl.tasks.reward_parts import REWARD_PARTS
from stages import STAGE_MODULES
from tests.helpers import new_run
from tests.unit.front_doors.test_terminal import fake_run


def test_a_run_without_any_training_round_draws_without_warnings(tmp_path):
    """Issue #29: a legend warning ("No artists with labels") when no round trained."""
    table = pd.DataFrame(
        {"eval_reward": [0.5], "eval_lo": [0.4], "eval_hi": [0.6], "loss": [np.nan], "accuracy": [np.nan]}, index=[0]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = write_report_png(tmp_path, table)
    assert out.is_file() and out.stat().st_size > 0


# ---------------------------------------------------------------------------------------- issue #35: a figure to keep
def _axes(fig, title: str):
    found = [ax for ax in fig.axes if ax.get_title().startswith(title)]
    assert len(found) == 1, [ax.get_title() for ax in fig.axes]
    return found[0]


def _zero_line(ax) -> bool:
    return any(list(line.get_ydata()) == [0, 0] for line in ax.get_lines())


def test_the_title_names_run_trainer_task_model_and_seed(tmp_path):
    config = {"trainer": "madpo_iter", "task": "humaneval_docs", "agent_model": "smollm2-135m-instruct", "seed": 7}
    assert title_of(tmp_path / "demo", config) == (
        "demo — madpo_iter, task humaneval_docs, model smollm2-135m-instruct, seed 7"
    )
    two = {**config, "agents": ["/m/a", "/m/b"], "task": None}
    assert title_of(tmp_path / "demo", two) == "demo — madpo_iter, task custom, model a, b, seed 7"


def test_the_paired_gain_has_its_own_panel_against_zero_and_the_eval_panel_only_the_reward(tmp_path):
    """The old figure drew "round 0 + paired gain" on the eval axis, where it sat on top of the eval reward."""
    run = fake_run(tmp_path, "madpo_iter")
    fig = report_figure(run)
    try:
        gain = _axes(fig, "Paired gain vs round 0")
        assert _zero_line(gain)
        assert gain.get_title().endswith("round 3: +0.44 [+0.20, +0.65]")
        centres = sorted(round(float(y), 2) for c in gain.containers for y in c.lines[0].get_ydata())
        assert centres == [0.10, 0.26, 0.44]
        evaluation = _axes(fig, "Evaluation reward")
        shown = {round(float(y), 2) for line in evaluation.get_lines() for y in line.get_ydata()}
        assert {2.16, 2.26, 2.42, 2.60} <= shown
        assert not [t for t in evaluation.get_legend().get_texts() if "gain" in t.get_text()]
        assert fig.get_suptitle().startswith("fake-madpo_iter — madpo_iter, task toy, model smollm2-135m-instruct")
    finally:
        plt.close(fig)


def test_training_is_drawn_per_logged_step_with_the_round_boundaries(tmp_path):
    run = fake_run(tmp_path, "madpo_iter", steps_per_round=4)
    fig = report_figure(run)
    try:
        steps = _axes(fig, "Training per step")
        loss = [line for line in steps.get_lines() if line.get_label().startswith("loss")]
        assert len(loss) == 1 and list(loss[0].get_xdata()) == [4.0 * k for k in range(1, 13)]
        assert list(loss[0].get_ydata())[:2] == [0.784, 0.794]
        boundaries = sorted(float(line.get_xdata()[0]) for line in steps.get_lines() if line.get_linestyle() == ":")
        assert boundaries == [16.0, 32.0, 48.0]  # train/env_step at the end of rounds 1, 2, 3
        accuracy = [ax for ax in fig.axes if ax is not steps and ax.bbox.bounds == steps.bbox.bounds]
        assert accuracy and accuracy[0].get_ylabel() == "pair accuracy"
        margins = _axes(fig, "MADPO margin per round")
        assert {line.get_label() for line in margins.get_lines()} >= {"agent 0", "agent 1", "joint (sum over agents)"}
    finally:
        plt.close(fig)


def test_marlhf_adds_the_reward_models_heldout_accuracy_and_rl_reward_and_kl(tmp_path):
    run = fake_run(tmp_path, "marlhf_iter")
    fig = report_figure(run)
    try:
        per_round = _axes(fig, "Reward model and RL per round")
        labels = {line.get_label(): list(line.get_ydata()) for ax in fig.axes for line in ax.get_lines()}
        assert labels["reward model: held-out pairs"] == [0.75, 0.67, 1.0]
        assert labels["RL: KL to reference"] == [0.012, 0.048, 0.103]
        assert per_round.get_ylabel() == "pair accuracy"
        steps = _axes(fig, "Training per step")
        assert [line.get_label() for line in steps.get_lines() if "logged" in line.get_label()] == [
            "RL reward, logged steps"
        ]
        assert not [ax for ax in fig.axes if ax.get_title().startswith("MADPO")]
    finally:
        plt.close(fig)


def test_no_legend_covers_data(tmp_path):
    run = fake_run(tmp_path, "marlhf_iter")
    fig = report_figure(run)
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        for ax in fig.axes:
            legend = ax.get_legend()
            if legend is not None and ax.get_visible():
                assert legend.get_window_extent(renderer).y1 <= ax.get_window_extent(renderer).y0, ax.get_title()
    finally:
        plt.close(fig)


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """A real run of one round on the tiny model (every step logged), evaluated before and after."""
    run_dir, job = new_run(tiny_model_dir, tmp_path_factory.mktemp("runs"), num_iterations=1, logging_steps=1)
    STAGE_MODULES["evaluate"].run(run_dir, 0, job)
    for name in ("sample-candidates", "score-with-oracle", "build-pairs", "store-round", "replay-select"):
        STAGE_MODULES[name].run(run_dir, 1, job)
    STAGE_MODULES["update-policies"].run(run_dir, 1, job)
    STAGE_MODULES["evaluate"].run(run_dir, 1, job)
    write_run_metrics(run_dir)
    return run_dir, job


def test_completions_show_the_mean_length_per_agent_and_the_share_cut_at_max_new_tokens(trained):
    run_dir, job = trained
    rows = {r: read_rows(RunPaths(run_dir).eval(r), EVAL) for r in (0, 1)}
    fig = report_figure(run_dir)
    try:
        lines = {line.get_label(): list(line.get_ydata()) for ax in fig.axes for line in ax.get_lines()}
        for agent in range(job.num_agents):
            tokens = [sum(len(d["completion_ids"][agent]) for d in rows[r]) / len(rows[r]) for r in (0, 1)]
            cut = [sum(d["finish_reasons"][agent] == "length" for d in rows[r]) / len(rows[r]) for r in (0, 1)]
            assert lines[f"agent {agent}: mean tokens"] == pytest.approx(tokens)
            assert lines[f"agent {agent}: cut"] == pytest.approx(cut)
        assert f"max_new_tokens = {job.max_new_tokens}" in _axes(fig, "Completions").get_xlabel()
        steps = read_manifest(RunPaths(run_dir), 1, "update-policies").details["train_log"]
        assert len(steps) == lines["loss (nats), logged steps"].__len__() > 1
    finally:
        plt.close(fig)


def test_the_reward_parts_a_task_declares_are_drawn_per_round(trained, monkeypatch):
    run_dir, _ = trained
    monkeypatch.setitem(REWARD_PARTS, "toy", lambda completions, item: {"chars": float(len(completions[0]))})
    fig = report_figure(run_dir)
    try:
        parts = _axes(fig, "Reward parts")
        means = [
            statistics.mean(len(d["completions"][0]) for d in read_rows(RunPaths(run_dir).eval(r), EVAL))
            for r in (0, 1)
        ]
        assert list(parts.get_lines()[0].get_ydata()) == pytest.approx(means)
    finally:
        plt.close(fig)
    monkeypatch.delitem(REWARD_PARTS, "toy")
    fig = report_figure(run_dir)
    try:
        assert not [ax for ax in fig.axes if ax.get_title().startswith("Reward parts")]  # the toy task declares none
    finally:
        plt.close(fig)


def test_humaneval_docs_declares_its_three_reward_parts():
    from pbrl.tasks.humaneval_docs import docs_terms

    item = {"item_id": "x", "entry_point": "add", "prompt": "def add(a, b):\n    pass\n"}
    summary, explanation = "Adds two numbers.", "The function add takes a and b and returns their sum a + b."
    assert REWARD_PARTS["humaneval_docs"]([summary, explanation], item) == docs_terms(summary, explanation, item)
    assert set(REWARD_PARTS["humaneval_docs"]([summary, explanation], item)) == {"lengths", "ratio", "coverage"}
