"""A CoMLRL preference config carries over (issue #17): every reference option is accepted with its meaning,
options without effect warn once, and each rule that differs from the reference is a decided, tested value.

The four YAMLs under ``tests/data/reference/`` hold every option of the reference's ``MADPOConfig``,
``MADPOIterConfig``, ``MARLHFConfig`` and ``MARLHFIterConfig`` (CoMLRL @85a6f8e, notes/reference-library.md §2)
at the reference's default, plus ``trainer``, ``task: toy`` and ``agent_model: tiny-random``.
"""

from __future__ import annotations

import math
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from pbrl.cli.commands import app
from pbrl.config import ConfigNotice, load_job, parse_job, read_yaml
from pbrl.data.storage import RunPaths
from pbrl.errors import ConfigError
from pbrl.learning.env_steps import env_step_axis, logged_steps, train_log
from pbrl.models.placement import placement_spec
from pbrl.preference.pairs import base_candidate_pairs, iterative_candidate_pairs
from pbrl.preference.selection import select_pairs
from pbrl.reporting.reward_hist import (
    check_reward_range,
    distribution_metrics,
    distribution_record,
    plot_distribution,
    reward_histogram,
)
from pbrl.run.export import export_policy_checkpoint, reference_label

DATA = Path(__file__).parents[2] / "data" / "reference"
RUN_KEYS = {"trainer", "task", "agent_model", "agent_devices"}  # agent_devices: a reference option, run-level here
runner = CliRunner()

# The reference's options, transcribed from its dataclasses (madpo.py, marlhf.py, iterative.py).
REFERENCE_MADPO = {
    "num_train_epochs",
    "agent_learning_rate",
    "logging_steps",
    "num_agents",
    "collaboration_mode",
    "parallel_training",
    "agent_devices",
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "num_turns",
    "discount",
    "joint_mode",
    "early_termination_threshold",
    "external_prompt_passthrough",
    "eval_interval",
    "eval_num_samples",
    "eval_batch_size",
    "rollout_buffer_size",
    "train_batch_size",
    "advantage_normalization",
    "advantage_mode",
    "reference_kl_enabled",
    "reference_kl_coef",
    "reference_devices",
    "preference_num_candidates",
    "preference_pairs_per_sample",
    "pair_selection",
    "dpo_beta",
    "use_environment_step",
    "environment_steps_per_pair",
}
REFERENCE_MARLHF = REFERENCE_MADPO | {
    "rl_algorithm",
    "num_generations",
    "reward_model_name",
    "reward_model_device",
    "reward_learning_rate",
    "reward_num_train_epochs",
    "reward_train_batch_size",
    "reward_max_length",
    "reward_freeze_backbone",
    "critic_model_name",
    "critic_learning_rate",
    "critic_devices",
    "use_separate_critic",
    "critic_type",
    "value_loss_coef",
    "value_clip_range",
    "critic_value_head_hidden_dim",
    "value_head_hidden_dim",
}
ITERATIVE = {
    "num_iterations",
    "preference_replay_mode",
    "preference_replay_k",
    "preference_replay_lambda",
    "preference_replay_sample_size",
    "preference_replay_dir",
    "log_reward_distribution",
    "policy_checkpoint_dir",
    "comparator_policy",
    "comparator_generation_mode",
    "comparator_centralized_agent_index",
    "comparator_model_name",
    "comparator_agents",
    "comparator_devices",
    "comparator_num_candidates",
    "comparator_history_k",
    "comparator_api_url",
    "comparator_api_format",
    "comparator_api_model",
    "comparator_api_max_n_per_request",
    "comparator_api_timeout",
    "comparator_api_headers",
    "comparator_api_key",
    "comparator_api_key_env",
    "comparator_api_key_header",
    "comparator_api_key_prefix",
    "comparator_api_response_field",
    "comparator_api_extra_body",
}
REFERENCE_OPTIONS = {
    "madpo": REFERENCE_MADPO,
    "madpo_iter": REFERENCE_MADPO | ITERATIVE,
    "marlhf": REFERENCE_MARLHF,
    "marlhf_iter": REFERENCE_MARLHF | ITERATIVE | {"preference_scoring_reward"},
}
# The options that change nothing in pbrl for that trainer (one warning each), and the eval_interval notice.
NO_EFFECT_MADPO = {
    "discount",
    "early_termination_threshold",
    "external_prompt_passthrough",
    "advantage_normalization",
    "advantage_mode",
}
NO_EFFECT_MARLHF = {"discount", "early_termination_threshold", "external_prompt_passthrough", "dpo_beta"}
NO_EFFECT = {
    "madpo": NO_EFFECT_MADPO,
    "madpo_iter": NO_EFFECT_MADPO,
    "marlhf": NO_EFFECT_MARLHF,
    "marlhf_iter": NO_EFFECT_MARLHF,
}
TRAINERS = tuple(REFERENCE_OPTIONS)


def minimal(trainer: str, **extra: Any) -> dict[str, Any]:
    return {"trainer": trainer, "task": "toy", "agent_model": "tiny-random", **extra}


def problems_of(data: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_job(data)
    return [p.field for p in info.value.problems]


def notices(data: dict[str, Any]) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parse_job(data)
    return [str(w.message) for w in caught if issubclass(w.category, ConfigNotice)]


def warned_options(messages: list[str]) -> set[str]:
    return {m.split("=", 1)[0] for m in messages if " has no effect in pbrl " in m}


# --------------------------------------------------------------------------- "Done when": the four YAMLs
@pytest.mark.parametrize("trainer", TRAINERS)
def test_reference_yaml_holds_every_reference_option_at_its_default(trainer: str) -> None:
    data = read_yaml((DATA / f"{trainer}.yaml").read_text())
    assert set(data) - {"trainer", "task", "agent_model"} == REFERENCE_OPTIONS[trainer]
    assert (data["eval_interval"], data["environment_steps_per_pair"], data["train_batch_size"]) == (16, 2, None)


@pytest.mark.parametrize("trainer", TRAINERS)
def test_reference_yaml_loads_with_one_warning_per_no_effect_option(trainer: str) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        job = load_job(DATA / f"{trainer}.yaml")
    messages = [str(w.message) for w in caught if issubclass(w.category, ConfigNotice)]
    assert warned_options(messages) == NO_EFFECT[trainer]
    assert sum(" has no effect in pbrl " in m for m in messages) == len(NO_EFFECT[trainer])  # once each
    assert sum(m.startswith("eval_interval=16 counts rounds") for m in messages) == 1
    assert len(messages) == len(NO_EFFECT[trainer]) + 1
    # the reference's meanings, as loaded
    assert job.train_batch_size == 2  # None -> rollout_buffer_size
    assert job.parallel_training == "none" and job.eval_batch_size == 1 and job.logging_steps == 50
    assert job.advantage_mode == "mean"


@pytest.mark.parametrize("trainer", ["madpo", "madpo_iter", "marlhf", "marlhf_iter"])
def test_pbrl_validate_says_ok_for_the_reference_yamls(trainer: str) -> None:
    """The MARLHF ones name the reference's ``reward_model_device: cuda:0``: without a CUDA device, ``train`` would
    fail on it, so ``validate`` refuses it, naming the option (issue #53.3), and says OK with it unset."""
    import torch

    needs_cuda = trainer.startswith("marlhf") and not torch.cuda.is_available()
    out = runner.invoke(app, ["validate", str(DATA / f"{trainer}.yaml")])
    if needs_cuda:
        assert out.exit_code == 2 and "reward_model_device: got 'cuda:0'" in out.output, out.output
        out = runner.invoke(app, ["validate", str(DATA / f"{trainer}.yaml"), "--set", "reward_model_device=null"])
    assert out.exit_code == 0, out.output
    assert "warning: " in out.output  # the no-effect options, as plain lines (not Python warnings)
    assert f"OK: {DATA / f'{trainer}.yaml'} ({trainer}, 2 agents)" in out.output.replace("\n", "")


def test_pbrl_validate_prints_the_warnings() -> None:
    # A real process: pytest's own warning capture would hide what a user sees.
    code = "import sys; from pbrl.cli.commands import app; sys.argv = ['pbrl', 'validate', sys.argv[1]]; app()"
    done = subprocess.run(
        [sys.executable, "-c", code, str(DATA / "madpo_iter.yaml")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parents[3],
    )
    assert done.returncode == 0, done.stderr
    assert "OK:" in done.stdout
    for name in NO_EFFECT_MADPO:
        assert f"{name}=" in done.stderr and "has no effect in pbrl" in done.stderr
    assert "eval_interval=16 counts rounds in pbrl" in done.stderr
    # each notice is one plain "warning:" line, not a Python warning pointing into pydantic
    assert "UserWarning" not in done.stderr and "ConfigNotice" not in done.stderr
    assert done.stderr.count("warning: ") >= len(NO_EFFECT_MADPO) + 1


# --------------------------------------------------------------------------- item 1: each option's meaning
def test_train_batch_size_defaults_to_rollout_buffer_size() -> None:
    assert parse_job(minimal("madpo")).train_batch_size == 2
    assert parse_job(minimal("madpo", rollout_buffer_size=5)).train_batch_size == 5
    assert parse_job(minimal("madpo", rollout_buffer_size=5, train_batch_size=3)).train_batch_size == 3
    assert parse_job(minimal("madpo_iter", rollout_buffer_size=7, train_batch_size=None)).train_batch_size == 7


def test_env_step_axis_counts_pairs_times_steps_per_pair() -> None:
    assert env_step_axis([2, 2, 1], environment_steps_per_pair=2) == [4, 8, 10]
    assert env_step_axis([2, 2, 1], start=10, environment_steps_per_pair=3) == [16, 22, 25]
    assert env_step_axis([2, 2, 1], start=10, use_environment_step=False) == [10, 10, 10]
    with pytest.raises(ValueError, match="batch_sizes: item 1 is 0"):
        env_step_axis([2, 0])


def test_logging_steps_gate_on_the_env_step_axis() -> None:
    axis = [4, 8, 10, 14, 60, 61]
    # first step always; then only once the axis moved >= 5 since the last logged step (4 -> 10 -> 60)
    assert logged_steps(axis, logging_steps=5) == [0, 2, 4]
    assert logged_steps(axis, logging_steps=1) == [0, 1, 2, 3, 4, 5]
    assert logged_steps([60, 61, 64], logging_steps=5, last_logged=58) == [2]  # carried over from a round
    rows = train_log([{"madpo/loss": 0.7}, {"madpo/loss": 0.6}, {"madpo/loss": 0.5}], [4, 8, 10], logging_steps=5)
    assert rows == [{"env_step": 4.0, "madpo/loss": 0.7}, {"env_step": 10.0, "madpo/loss": 0.5}]


def test_eval_batch_size_goes_to_the_evaluate_stage(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import stages.evaluate as evaluate
    from tests.helpers import new_run

    seen: list[int] = []
    real = evaluate.generate

    def spy(model, tokenizer, prompt_ids, seeds, settings, **kw):
        seen.append(settings.batch_size)
        return real(model, tokenizer, prompt_ids, seeds, settings, **kw)

    monkeypatch.setattr(evaluate, "generate", spy)
    completions = []
    for size in (1, 3):
        run_dir, job = new_run(tiny_model_dir, tmp_path / f"b{size}", eval_num_samples=3, eval_batch_size=size)
        evaluate.run(run_dir, 0, job)
        completions.append(pq.read_table(RunPaths(run_dir).eval(0)).column("completion_ids").to_pylist())
    assert seen == [1, 1, 3, 3]  # per agent, eval_batch_size items per model call
    assert len(completions[0]) == 3 and completions[0] == completions[1]  # the tokens do not depend on it


def test_parallel_training_places_agents_as_the_reference() -> None:
    assert placement_spec(["cuda:0", "cuda:1"], "none") == "cuda:0"
    assert placement_spec(["cuda:0", "cuda:1"], "mp") == ["cuda:0", "cuda:1"]
    assert placement_spec("cuda:1", "none") == "cuda:1" and placement_spec(None, "none") is None
    with pytest.raises(ValueError, match="required with parallel_training='mp'"):
        placement_spec(None, "mp")
    assert problems_of(minimal("madpo", parallel_training="mp")) == ["agent_devices"]
    assert parse_job(minimal("madpo", parallel_training="mp", agent_devices=["cpu", "cpu"])).parallel_training == "mp"


def test_reward_histogram_hand_worked() -> None:
    h = reward_histogram([0.0, 0.3, 4.0, 5.0, -1.0, math.nan], 0.0, 4.0)
    assert h.sample_count == 5 and h.mean == pytest.approx(1.66)
    assert h.counts == [2, 1] + [0] * 13 + [2]  # -1 clipped into bin 0, 5 into bin 15; NaN dropped
    empty = reward_histogram([], 0.0, 4.0)
    assert (empty.sample_count, empty.mean, sum(empty.counts)) == (0, None, 0)


def test_reward_distribution_record_metrics_and_plot(tmp_path: Path) -> None:
    record = distribution_record(
        2, 0.0, 1.0, target=[0.1, 0.9], comparator=[0.5], selected_target=[0.9], selected_comparator=[0.5]
    )
    assert record["num_bins"] == 16 and len(record["bin_edges"]) == 17 and record["bin_edges"][1] == 0.0625
    assert record["bin_centers"][0] == 0.03125
    assert record["candidate"]["target"]["counts"][1] == 1 and record["candidate"]["target"]["counts"][14] == 1
    metrics = distribution_metrics(record)
    assert metrics["iter/reward_distribution/target_mean"] == pytest.approx(0.5)
    assert metrics["iter/reward_distribution/comparator_sample_count"] == 1.0
    assert metrics["iter/selected_reward_distribution/pair_count"] == 1.0
    assert metrics["iter/selected_reward_distribution/current_iteration"] == 2.0
    png = plot_distribution(record, tmp_path / "dist.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("bad", [None, (1.0,), (0.0, math.inf), (2.0, 1.0), ("a", "b")])
def test_log_reward_distribution_needs_a_declared_range(bad: Any) -> None:
    with pytest.raises(ValueError, match="log_reward_distribution=True needs the reward range of task 'x'"):
        check_reward_range(bad, source="task 'x'")
    assert check_reward_range((0, 3)) == (0.0, 3.0)


def test_policy_checkpoint_dir_export_uses_the_reference_names(tmp_path: Path) -> None:
    assert [reference_label(r) for r in (0, 1, 2, 12)] == [
        "initial",
        "iteration_0000",
        "iteration_0001",
        "iteration_0011",
    ]
    source = tmp_path / "checkpoints" / "round_0002"
    for i in range(2):
        (source / f"agent_{i}").mkdir(parents=True)
        (source / f"agent_{i}" / "adapter_model.safetensors").write_bytes(b"w%d" % i)
        (source / f"agent_{i}" / "optimizer.pt").write_bytes(b"opt")
    dest = export_policy_checkpoint(source, tmp_path / "exports", 2, num_agents=2)
    assert dest == tmp_path / "exports" / "iteration_0001"
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()) == [
        "agent_0/adapter_model.safetensors",
        "agent_1/adapter_model.safetensors",
    ]  # no optimizer state
    assert (dest / "agent_1" / "adapter_model.safetensors").read_bytes() == b"w1"
    with pytest.raises(FileNotFoundError, match="agent_2"):
        export_policy_checkpoint(source, tmp_path / "exports", 2, num_agents=3)


def test_api_key_header_and_the_other_api_options_are_accepted() -> None:
    job = parse_job(
        minimal(
            "madpo_iter",
            comparator_policy="api",
            comparator_api_url="https://h/v1",
            comparator_api_key_env="MY_KEY",
            comparator_api_key_header="X-Api-Token",
            comparator_api_key_prefix="",
            comparator_api_max_n_per_request=2,
            comparator_api_headers={"X-Trace": "on"},
            comparator_api_extra_body={"seed": 1},
        )
    )
    assert (job.comparator_api_key_header, job.comparator_api_key_prefix) == ("X-Api-Token", "")
    assert parse_job(minimal("madpo_iter", comparator_api_key=None)).comparator_api_key_env is None  # null: no key
    assert problems_of(minimal("madpo_iter", comparator_api_key="sk-abc")) == ["comparator_api_key"]
    assert problems_of(minimal("madpo_iter", comparator_api_headers={"Authorization": "Bearer sk-abc"})) == [
        "comparator_api_headers"
    ]


@pytest.mark.parametrize(
    ("trainer", "option", "value"),
    [
        ("madpo", "discount", 0.9),
        ("madpo", "early_termination_threshold", 0.5),
        ("madpo", "external_prompt_passthrough", True),
        ("madpo", "advantage_normalization", False),
        ("madpo_iter", "advantage_mode", "rloo"),
        ("marlhf", "dpo_beta", 0.2),
        ("marlhf_iter", "discount", 1.0),
    ],
)
def test_no_effect_option_warns_once_saying_why(trainer: str, option: str, value: Any) -> None:
    messages = notices(minimal(trainer, **{option: value}))
    assert len(messages) == 1 and messages[0].startswith(f"{option}={value!r} has no effect in pbrl (")
    assert notices(minimal(trainer)) == []  # not given: no warning


@pytest.mark.parametrize(
    ("algorithm", "mode"), [("magrpo", "mean"), ("mareinforce", "raw"), ("maremax", "max"), ("marloo", "rloo")]
)
def test_marlhf_advantage_mode_is_set_from_rl_algorithm(algorithm: str, mode: str) -> None:
    assert parse_job(minimal("marlhf", rl_algorithm=algorithm)).advantage_mode == mode
    assert parse_job(minimal("marlhf_iter", rl_algorithm=algorithm, advantage_mode=mode)).advantage_mode == mode


def test_a_replaced_advantage_mode_warns_and_actor_critic_keeps_its_own() -> None:
    messages = notices(minimal("marlhf", rl_algorithm="marloo", advantage_mode="max"))
    assert messages == [
        "advantage_mode='max' is replaced by 'rloo': with rl_algorithm='marloo' the advantage mode "
        "follows the algorithm, as in the reference"
    ]
    assert parse_job(minimal("marlhf", rl_algorithm="iac", advantage_mode="max")).advantage_mode == "max"


# --------------------------------------------------------------------------- items 2-7: the decided rules
def test_item2_agent_model_and_agents_naming_the_same_model() -> None:
    job = parse_job(minimal("madpo", agents=["tiny-random", "tiny-random"]))
    assert job.agents == ["tiny-random", "tiny-random"]
    assert problems_of(minimal("madpo", agents=["tiny-random", "other"])) == ["agents"]


def test_item3_iterative_one_candidate_is_a_deliberate_difference() -> None:
    # ★ pbrl: one target vs one comparator candidate already make a pair; the base trainers keep >= 2.
    assert parse_job(minimal("madpo_iter", preference_num_candidates=1)).preference_num_candidates == 1
    assert parse_job(minimal("marlhf_iter", preference_num_candidates=1)).preference_num_candidates == 1
    assert problems_of(minimal("madpo", preference_num_candidates=1)) == ["preference_num_candidates"]


def test_item4_conditions_are_checked_where_they_apply() -> None:
    job = parse_job(minimal("madpo_iter", comparator_centralized_agent_index=5))  # decentralized: never read
    assert job.comparator_centralized_agent_index == 5
    assert problems_of(
        minimal("madpo_iter", comparator_centralized_agent_index=5, comparator_generation_mode="centralized")
    ) == ["comparator_centralized_agent_index"]
    assert parse_job(minimal("madpo", reference_devices=["cpu"] * 3)).reference_devices == ["cpu"] * 3
    assert problems_of(minimal("madpo", reference_devices=["cpu"] * 3, reference_kl_enabled=True)) == [
        "reference_devices"
    ]


def test_item5_eval_interval_counts_rounds_and_warns_when_it_skips_every_trained_round() -> None:
    assert parse_job(minimal("madpo_iter")).eval_interval == 1  # ★ rounds, default 1
    assert notices(minimal("madpo_iter", num_iterations=6, eval_interval=6)) == []
    (message,) = notices(minimal("madpo_iter", num_iterations=6, eval_interval=16))
    assert "only the round-0 baseline will be evaluated" in message
    (message,) = notices(minimal("madpo", eval_interval=2))
    assert "exceeds the 1 round(s)" in message
    assert notices(minimal("madpo", eval_interval=0)) == []


@pytest.mark.parametrize("mode", ["comparator_reward", "reward_gap"])
def test_item6_equal_keys_keep_candidate_order(mode: str) -> None:
    # target [2, 0] vs comparator [1, 1]: pair 0 (target 0 beats comparator 0) and pair 1 (comparator 1 beats
    # target 1) have the same comparator score (1) and gap (1); the reference's stable sort keeps pair 0.
    pairs = iterative_candidate_pairs({0: 2.0, 1: 0.0}, {0: 1.0, 1: 1.0}, tie_tolerance=1e-9)
    (kept,) = select_pairs(pairs[::-1], pair_selection=mode, pairs_per_sample=1, rng=np.random.default_rng(0))
    assert (kept.winner.side, kept.winner.index, kept.loser.side, kept.loser.index) == ("target", 0, "comparator", 0)


def test_item6_base_pairs_with_equal_gaps_keep_winner_then_loser_index_order() -> None:
    pairs = base_candidate_pairs({0: 1.0, 1: 0.0, 2: 1.0, 3: 0.0, 4: 0.5}, tie_tolerance=1e-9)
    chosen = select_pairs(pairs[::-1], pair_selection="reward_gap", pairs_per_sample=5, rng=np.random.default_rng(0))
    assert [(p.winner.index, p.loser.index) for p in chosen] == [(0, 1), (0, 3), (2, 1), (2, 3), (0, 4)]


@pytest.mark.parametrize("option", ["agent_learning_rate", "temperature", "max_new_tokens"])
def test_item7_zero_is_refused_deliberately(option: str) -> None:
    assert problems_of(minimal("madpo", **{option: 0})) == [option]
