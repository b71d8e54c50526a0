"""Configuration models and rules (SPEC §2): defaults, every rule, all problems at once, YAML + overrides."""

from __future__ import annotations

import hashlib
import itertools
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from pbrl.config import (
    JOB_CLASSES,
    RUN_FIELDS,
    TRAINER_CONFIGS,
    MADPOConfig,
    MADPOIterConfig,
    MADPOIterJob,
    MADPOJob,
    MARLHFConfig,
    MARLHFIterConfig,
    MARLHFIterJob,
    MARLHFJob,
    RunConfig,
    config_hash,
    is_iterative,
    job_adapter,
    load_job,
    make_job,
    parse_config,
    parse_job,
    parse_override,
    split_job,
)
from pbrl.errors import ConfigError, Problem

TRAINERS = ("madpo", "marlhf", "madpo_iter", "marlhf_iter")
ITERATIVE = ("madpo_iter", "marlhf_iter")
MARLHF = ("marlhf", "marlhf_iter")
SECRET = "sk-test-0123456789abcdef"


def minimal(trainer: str) -> dict[str, Any]:
    return {"trainer": trainer, "task": "toy", "agent_model": "some/path"}


def problems_of(data: dict[str, Any]) -> list[Problem]:
    with pytest.raises(ConfigError) as info:
        parse_job(data)
    return info.value.problems


# --------------------------------------------------------------------------- defaults
COMMON_DEFAULTS = {
    "num_agents": 2, "num_turns": 1, "joint_mode": "aligned", "dpo_beta": 0.1, "agent_learning_rate": 5e-6,
    "train_batch_size": 2, "max_new_tokens": 256, "temperature": 0.6, "top_p": 0.6, "top_k": 50,
    "eval_interval": 1, "eval_num_samples": 4, "max_grad_norm": 1.0, "reward_func": None,
    "reward_processor": None, "reference_kl_enabled": False, "reference_kl_coef": 0.1, "reference_devices": None,
}
ITERATIVE_DEFAULTS = {
    "num_iterations": 6, "comparator_policy": "current", "comparator_history_k": None,
    "comparator_model_name": None, "comparator_agents": None, "comparator_devices": None,
    "comparator_num_candidates": None, "comparator_generation_mode": "decentralized",
    "comparator_centralized_agent_index": 0, "comparator_api_format": "generic", "comparator_api_url": None,
    "comparator_api_model": None, "comparator_api_key_env": None, "comparator_api_response_field": "completions",
    "comparator_api_timeout": 120.0, "comparator_api_max_concurrency": 4, "preference_replay_mode": "current",
    "preference_replay_k": None, "preference_replay_lambda": None, "preference_replay_sample_size": None,
    "preference_replay_dir": None,
}
MARLHF_DEFAULTS = {
    "reward_model_name": None, "reward_learning_rate": 1e-5, "reward_train_batch_size": 1,
    "reward_max_length": None, "reward_freeze_backbone": False, "rl_algorithm": "magrpo", "num_generations": 4,
    "critic_model_name": None, "critic_learning_rate": None, "value_loss_coef": 0.6, "value_clip_range": 0.2,
}
SPECIFIC_DEFAULTS = [
    ("madpo", "preference_num_candidates", 80), ("madpo", "pair_selection", "reward_gap"),
    ("madpo", "preference_pairs_per_sample", 16), ("madpo", "num_train_epochs", 20),
    ("marlhf", "preference_num_candidates", 80), ("marlhf", "pair_selection", "reward_gap"),
    ("marlhf", "preference_pairs_per_sample", 16), ("marlhf", "num_train_epochs", 1),
    ("marlhf", "reward_num_train_epochs", 1),
    ("madpo_iter", "preference_num_candidates", 20), ("madpo_iter", "pair_selection", "comparator_reward"),
    ("madpo_iter", "preference_pairs_per_sample", 4), ("madpo_iter", "num_train_epochs", 1),
    ("marlhf_iter", "preference_num_candidates", 20), ("marlhf_iter", "pair_selection", "comparator_reward"),
    ("marlhf_iter", "preference_pairs_per_sample", 4), ("marlhf_iter", "num_train_epochs", 2),
    ("marlhf_iter", "reward_num_train_epochs", 2), ("marlhf_iter", "preference_scoring_reward", "task"),
]
DEFAULTS = (
    [(t, f, v) for t in TRAINERS for f, v in COMMON_DEFAULTS.items()]
    + [(t, f, v) for t in ITERATIVE for f, v in ITERATIVE_DEFAULTS.items()]
    + [(t, f, v) for t in MARLHF for f, v in MARLHF_DEFAULTS.items()]
    + SPECIFIC_DEFAULTS
)
RUN_DEFAULTS = {
    "seed": 0, "run_name": None, "output_dir": "storage/runs", "task_options": {}, "train_dataset": None,
    "eval_dataset": None, "formatters": None, "max_train_items": None, "agents": None, "lora_r": None,
    "lora_alpha": 16, "lora_dropout": 0.0, "lora_target_modules": None, "agent_devices": None,
    "tie_tolerance": 1e-9, "oracle_max_failure_share": 0.5, "generation_batch_size": 64, "torch_dtype": "float32",
}


@pytest.mark.parametrize(("trainer", "field", "expected"), DEFAULTS)
def test_trainer_default(trainer: str, field: str, expected: Any) -> None:
    assert getattr(TRAINER_CONFIGS[trainer](), field) == expected
    assert getattr(parse_job(minimal(trainer)), field) == expected


@pytest.mark.parametrize(("trainer", "field"), itertools.product(TRAINERS, RUN_DEFAULTS))
def test_run_default(trainer: str, field: str) -> None:
    assert getattr(parse_job(minimal(trainer)), field) == RUN_DEFAULTS[field]


@pytest.mark.parametrize(
    ("trainer", "field", "present"),
    [("madpo", "num_iterations", False), ("madpo", "comparator_policy", False), ("madpo", "rl_algorithm", False),
     ("madpo", "reward_model_name", False), ("marlhf", "comparator_policy", False),
     ("marlhf", "preference_scoring_reward", False), ("madpo_iter", "rl_algorithm", False),
     ("madpo_iter", "preference_scoring_reward", False), ("marlhf_iter", "preference_scoring_reward", True),
     ("marlhf_iter", "critic_model_name", True), ("madpo_iter", "preference_replay_mode", True),
     ("madpo", "dpo_beta", True), ("marlhf", "dpo_beta", True)],
)
def test_field_sets(trainer: str, field: str, present: bool) -> None:
    assert (field in TRAINER_CONFIGS[trainer].model_fields) is present
    assert (field in JOB_CLASSES[trainer].model_fields) is present


@pytest.mark.parametrize("trainer", TRAINERS)
def test_job_fields_are_run_fields_plus_trainer_fields(trainer: str) -> None:
    trainer_fields = set(TRAINER_CONFIGS[trainer].model_fields)
    assert not trainer_fields & RUN_FIELDS
    assert set(JOB_CLASSES[trainer].model_fields) == trainer_fields | RUN_FIELDS


# --------------------------------------------------------------------------- one bad value, one problem
BAD = [
    ("madpo", {"num_agents": 0}, "num_agents"),
    ("madpo", {"num_agents": "two"}, "num_agents"),
    ("madpo", {"num_turns": 2}, "num_turns"),
    ("madpo_iter", {"joint_mode": "align"}, "joint_mode"),
    ("madpo", {"preference_num_candidates": 1}, "preference_num_candidates"),
    ("madpo_iter", {"preference_num_candidates": 0}, "preference_num_candidates"),
    ("madpo", {"pair_selection": "comparator_reward"}, "pair_selection"),
    ("marlhf_iter", {"pair_selection": "gap"}, "pair_selection"),
    ("madpo", {"preference_pairs_per_sample": 0}, "preference_pairs_per_sample"),
    ("madpo", {"pair_selection": "all"}, "preference_pairs_per_sample"),
    ("madpo_iter", {"pair_selection": "all", "preference_pairs_per_sample": 3}, "preference_pairs_per_sample"),
    ("madpo", {"dpo_beta": 0}, "dpo_beta"),
    ("madpo", {"dpo_beta": -1.0}, "dpo_beta"),
    ("madpo", {"dpo_beta": float("nan")}, "dpo_beta"),
    ("madpo", {"dpo_beta": "abc"}, "dpo_beta"),
    ("madpo", {"num_train_epochs": 0}, "num_train_epochs"),
    ("madpo_iter", {"num_iterations": 0}, "num_iterations"),
    ("madpo", {"agent_learning_rate": 0}, "agent_learning_rate"),
    ("madpo", {"train_batch_size": 0}, "train_batch_size"),
    ("madpo", {"max_new_tokens": 0}, "max_new_tokens"),
    ("madpo", {"temperature": 0}, "temperature"),
    ("madpo", {"top_p": 0}, "top_p"),
    ("madpo", {"top_p": 1.5}, "top_p"),
    ("madpo", {"top_k": 0}, "top_k"),
    ("madpo", {"eval_interval": -1}, "eval_interval"),
    ("madpo", {"eval_num_samples": -1}, "eval_num_samples"),
    ("madpo", {"max_grad_norm": 0}, "max_grad_norm"),
    ("madpo", {"reward_func": "pkg.module.fn"}, "reward_func"),
    ("madpo", {"reward_processor": "pkg:not a name"}, "reward_processor"),
    ("madpo", {"reference_kl_enabled": "maybe"}, "reference_kl_enabled"),
    ("marlhf", {"reference_kl_coef": -0.1}, "reference_kl_coef"),
    ("marlhf", {"reference_devices": "gpu0"}, "reference_devices"),
    ("marlhf", {"reference_devices": ["cpu", "cpu", "cpu"]}, "reference_devices"),
    # comparator
    ("madpo_iter", {"comparator_policy": "self"}, "comparator_policy"),
    ("madpo_iter", {"comparator_policy": "history", "comparator_history_k": 0}, "comparator_history_k"),
    ("madpo_iter", {"comparator_history_k": 2}, "comparator_history_k"),
    ("madpo_iter", {"comparator_policy": "model"}, "comparator_model_name"),
    ("madpo_iter", {"comparator_model_name": "m"}, "comparator_model_name"),
    ("madpo_iter", {"comparator_policy": "history", "comparator_agents": ["a", "b"]}, "comparator_agents"),
    ("madpo_iter", {"comparator_policy": "model", "comparator_model_name": "m", "comparator_agents": ["a", "b"]},
     "comparator_agents"),
    ("madpo_iter", {"comparator_policy": "model", "comparator_agents": ["a", "b", "c"]}, "comparator_agents"),
    ("madpo_iter", {"comparator_policy": "model", "comparator_agents": []}, "comparator_agents"),
    ("madpo_iter", {"comparator_num_candidates": 0}, "comparator_num_candidates"),
    ("madpo_iter", {"comparator_generation_mode": "centralised"}, "comparator_generation_mode"),
    ("madpo_iter", {"comparator_centralized_agent_index": 2}, "comparator_centralized_agent_index"),
    ("madpo_iter", {"comparator_centralized_agent_index": -1}, "comparator_centralized_agent_index"),
    ("madpo_iter", {"comparator_devices": ["cpu", "cpu", "cpu"]}, "comparator_devices"),
    ("madpo_iter", {"comparator_policy": "api"}, "comparator_api_url"),
    ("madpo_iter", {"comparator_policy": "api", "comparator_api_url": "ftp://host/x"}, "comparator_api_url"),
    ("madpo_iter", {"comparator_api_url": "https://host/x"}, "comparator_api_url"),
    ("madpo_iter", {"comparator_api_model": "gpt"}, "comparator_api_model"),
    ("madpo_iter", {"comparator_api_key_env": "OPENAI_API_KEY"}, "comparator_api_key_env"),
    ("madpo_iter", {"comparator_policy": "api", "comparator_api_url": "https://h", "comparator_api_key_env": SECRET},
     "comparator_api_key_env"),
    ("madpo_iter", {"comparator_api_format": "openai_chat"}, "comparator_api_format"),
    ("madpo_iter", {"comparator_api_timeout": 0}, "comparator_api_timeout"),
    ("madpo_iter", {"comparator_api_max_concurrency": 0}, "comparator_api_max_concurrency"),
    # replay
    ("madpo_iter", {"preference_replay_mode": "td-lambda"}, "preference_replay_mode"),
    ("madpo_iter", {"preference_replay_mode": "nearest_k"}, "preference_replay_k"),
    ("madpo_iter", {"preference_replay_mode": "nearest_k", "preference_replay_k": 0}, "preference_replay_k"),
    ("madpo_iter", {"preference_replay_k": 2}, "preference_replay_k"),
    ("madpo_iter", {"preference_replay_mode": "all_history", "preference_replay_k": 1}, "preference_replay_k"),
    ("madpo_iter", {"preference_replay_mode": "lambda_decay", "preference_replay_lambda": 0.5,
                    "preference_replay_k": 1}, "preference_replay_k"),
    ("madpo_iter", {"preference_replay_mode": "lambda_decay"}, "preference_replay_lambda"),
    ("madpo_iter", {"preference_replay_mode": "lambda_decay", "preference_replay_lambda": 1.5},
     "preference_replay_lambda"),
    ("madpo_iter", {"preference_replay_lambda": 0.5}, "preference_replay_lambda"),
    ("madpo_iter", {"preference_replay_mode": "all_history", "preference_replay_lambda": 0.5},
     "preference_replay_lambda"),
    ("madpo_iter", {"preference_replay_sample_size": 8}, "preference_replay_sample_size"),
    ("madpo_iter", {"preference_replay_mode": "all_history", "preference_replay_sample_size": 0},
     "preference_replay_sample_size"),
    # MARLHF
    ("marlhf", {"reward_learning_rate": 0}, "reward_learning_rate"),
    ("marlhf", {"reward_num_train_epochs": 0}, "reward_num_train_epochs"),
    ("marlhf", {"reward_train_batch_size": 0}, "reward_train_batch_size"),
    ("marlhf", {"reward_max_length": 0}, "reward_max_length"),
    ("marlhf", {"rl_algorithm": "mareforce"}, "rl_algorithm"),
    ("marlhf", {"num_generations": 1}, "num_generations"),
    ("marlhf", {"rl_algorithm": "maremax", "num_generations": 1}, "num_generations"),
    ("marlhf", {"rl_algorithm": "maac", "num_generations": 0}, "num_generations"),
    ("marlhf", {"critic_model_name": "c"}, "critic_model_name"),
    ("marlhf", {"critic_learning_rate": 1e-4}, "critic_learning_rate"),
    ("marlhf", {"rl_algorithm": "iac", "critic_learning_rate": 0}, "critic_learning_rate"),
    ("marlhf", {"value_loss_coef": 0}, "value_loss_coef"),
    ("marlhf", {"value_clip_range": 0}, "value_clip_range"),
    ("marlhf_iter", {"preference_scoring_reward": "model"}, "preference_scoring_reward"),
    # run level
    ("madpo", {"seed": -1}, "seed"),
    ("madpo", {"run_name": "a/b"}, "run_name"),
    ("madpo", {"run_name": ".."}, "run_name"),
    ("madpo", {"output_dir": ""}, "output_dir"),
    ("madpo", {"task": ""}, "task"),
    ("madpo", {"agents": ["a", "b"]}, "agents"),
    ("madpo", {"agent_model": None}, "agent_model"),
    ("madpo", {"agent_model": None, "agents": ["a"]}, "agents"),
    ("madpo", {"agent_model": None, "agents": ["a", ""]}, "agents"),
    ("madpo", {"agents": "a"}, "agents"),
    ("madpo", {"formatters": ["m:f"]}, "formatters"),
    ("madpo", {"formatters": ["m:f", "m.g"]}, "formatters"),
    ("madpo", {"max_train_items": 0}, "max_train_items"),
    ("madpo", {"lora_r": 0}, "lora_r"),
    ("madpo", {"lora_alpha": 0}, "lora_alpha"),
    ("madpo", {"lora_dropout": 1.0}, "lora_dropout"),
    ("madpo", {"lora_dropout": -0.1}, "lora_dropout"),
    ("madpo", {"lora_target_modules": ["q_proj"]}, "lora_target_modules"),
    ("madpo", {"lora_r": 8, "lora_target_modules": []}, "lora_target_modules"),
    ("madpo", {"agent_devices": "gpu"}, "agent_devices"),
    ("madpo", {"agent_devices": ["cpu", "cpu", "cpu"]}, "agent_devices"),
    ("madpo", {"tie_tolerance": -1e-9}, "tie_tolerance"),
    ("madpo", {"oracle_max_failure_share": 1.5}, "oracle_max_failure_share"),
    ("madpo", {"generation_batch_size": 0}, "generation_batch_size"),
    ("madpo", {"torch_dtype": "float16"}, "torch_dtype"),
    ("madpo", {"train_dataset": "items.csv"}, "train_dataset"),
    ("madpo", {"eval_dataset": "items.json"}, "eval_dataset"),
    ("madpo", {"task_options": []}, "task_options"),
    ("madpo", {"task": None, "train_dataset": "a.jsonl", "formatters": ["m:f", "m:g"], "reward_func": "m:r",
               "task_options": {"n": 1}}, "task_options"),
    ("madpo", {"task": None}, "task"),
    ("madpo", {"rl_algorithm": "magrpo"}, "rl_algorithm"),
    ("madpo", {"comparator_policy": "current"}, "comparator_policy"),
    ("madpo", {"dpo_betta": 0.1}, "dpo_betta"),
]


@pytest.mark.parametrize(("trainer", "overrides", "field"), BAD)
def test_bad_value_gives_one_problem_naming_the_field(trainer: str, overrides: dict, field: str) -> None:
    problems = problems_of({**minimal(trainer), **overrides})
    assert [p.field for p in problems] == [field]


@pytest.mark.parametrize(
    ("overrides", "rendered"),
    [({"preference_replay_mode": "td-lambda"},
      "preference_replay_mode: got 'td-lambda'; allowed: current, nearest_k, all_history, lambda_decay"),
     ({"dpo_beta": 0}, "dpo_beta: got 0; must be > 0"),
     ({"top_p": 1.5}, "top_p: got 1.5; must be in (0, 1]"),
     ({"lora_dropout": 1.0}, "lora_dropout: got 1.0; must be in [0, 1)"),
     ({"preference_pairs_per_sample": 0}, "preference_pairs_per_sample: got 0; must be >= 1 or None"),
     ({"num_agents": "two"}, "num_agents: got 'two'; must be an integer"),
     ({"agent_devices": 1.5}, "agent_devices: got '1.5'; devices look like 'cpu', 'cuda', 'cuda:1' or 'mps'"),
     ({"agents": "a", "agent_model": None}, "agents: got 'a'; must be a list of strings or None"),
     ({"comparator_centralized_agent_index": 2},
      "comparator_centralized_agent_index: got 2; must be in [0, num_agents) = [0, 2)"),
     ({"dpo_betta": 0.1}, "dpo_betta: got 0.1; unknown option; did you mean 'dpo_beta'?"),
     ({"rl_algorithm": "maac"},
      "rl_algorithm: got 'maac'; not an option of trainer 'madpo_iter'; it belongs to trainer(s) marlhf, marlhf_iter"),
     ],
)
def test_problem_wording(overrides: dict, rendered: str) -> None:
    assert [str(p) for p in problems_of({**minimal("madpo_iter"), **overrides})] == [rendered]


def test_task_source_names_each_missing_part() -> None:
    problems = problems_of({**minimal("madpo"), "task": None, "train_dataset": "items.jsonl"})
    assert [p.field for p in problems] == ["formatters", "reward_func"]


# --------------------------------------------------------------------------- allowed combinations
ALLOWED = [
    ("madpo", {"pair_selection": "all", "preference_pairs_per_sample": None}),
    ("madpo", {"pair_selection": "random", "top_k": None, "max_grad_norm": None, "eval_interval": 0}),
    ("madpo", {"num_agents": 1, "agent_model": None, "agents": ["m"]}),
    ("madpo", {"agent_model": None, "agents": ["m1", "m2"], "agent_devices": ["cpu", "cuda:1"]}),
    ("madpo", {"task": None, "train_dataset": "d.jsonl", "eval_dataset": "e.parquet", "formatters": ["m:f", "m:g"],
               "reward_func": "pkg.mod:reward", "reward_processor": "pkg.mod:shift"}),
    ("madpo", {"task_options": {"n_items": 4}, "max_train_items": 3, "run_name": "run-1_a.b", "seed": 7}),
    ("madpo", {"lora_r": 8, "lora_alpha": 32, "lora_dropout": 0.05, "lora_target_modules": ["q_proj"]}),
    ("madpo", {"agent_devices": "cuda:1", "torch_dtype": "bfloat16", "tie_tolerance": 0.0}),
    ("madpo", {"agent_devices": ["cpu"], "oracle_max_failure_share": 1.0, "generation_batch_size": 1}),
    ("madpo_iter", {"comparator_policy": "current_copy", "comparator_devices": ["cpu", "cpu"]}),
    ("madpo_iter", {"comparator_policy": "model", "comparator_model_name": "m"}),
    ("madpo_iter", {"comparator_policy": "model", "comparator_agents": ["a", "b"]}),
    ("madpo_iter", {"comparator_policy": "history"}),
    ("madpo_iter", {"comparator_policy": "history", "comparator_history_k": 3}),
    ("madpo_iter", {"comparator_policy": "api", "comparator_api_url": "https://api.anthropic.com/v1/messages",
                    "comparator_api_format": "anthropic", "comparator_api_model": "claude",
                    "comparator_api_key_env": "ANTHROPIC_API_KEY", "comparator_api_timeout": 5}),
    ("madpo_iter", {"comparator_generation_mode": "centralized", "comparator_centralized_agent_index": 1,
                    "comparator_num_candidates": 3, "preference_num_candidates": 1}),
    ("madpo_iter", {"preference_replay_k": 1}),
    ("madpo_iter", {"preference_replay_mode": "nearest_k", "preference_replay_k": 2,
                    "preference_replay_sample_size": 8}),
    ("madpo_iter", {"preference_replay_mode": "all_history", "preference_replay_dir": "elsewhere/replay"}),
    ("madpo_iter", {"preference_replay_mode": "lambda_decay", "preference_replay_lambda": 0.0}),
    ("madpo_iter", {"preference_replay_mode": "lambda_decay", "preference_replay_lambda": 1,
                    "preference_replay_sample_size": 1}),
    ("marlhf", {"rl_algorithm": "maac", "num_generations": 1, "critic_model_name": "c",
                "critic_learning_rate": 1e-4}),
    ("marlhf", {"rl_algorithm": "iac", "value_clip_range": None, "reward_max_length": 512}),
    ("marlhf", {"rl_algorithm": "marloo", "num_generations": 2, "reward_freeze_backbone": True}),
    ("marlhf", {"reference_kl_enabled": True, "reference_kl_coef": 0.0, "reference_devices": ["cpu", "cpu"]}),
    ("marlhf_iter", {"preference_scoring_reward": "reward_model", "comparator_policy": "history"}),
]


@pytest.mark.parametrize(("trainer", "overrides"), ALLOWED)
def test_allowed_combination_constructs_and_round_trips(trainer: str, overrides: dict) -> None:
    job = parse_job({**minimal(trainer), **overrides})
    assert type(job) is JOB_CLASSES[trainer]
    for key, value in overrides.items():
        assert getattr(job, key) == value
    run, trainer_config = split_job(job)
    assert type(trainer_config) is TRAINER_CONFIGS[trainer] and run.trainer == trainer
    assert make_job(run, trainer_config) == job


# --------------------------------------------------------------------------- all problems at once
def test_three_mistakes_give_exactly_three_problems() -> None:
    data = {**minimal("madpo_iter"), "dpo_beta": 0, "preference_replay_mode": "td-lambda", "num_agents": "two"}
    assert sorted(p.field for p in problems_of(data)) == ["dpo_beta", "num_agents", "preference_replay_mode"]


def test_type_error_rule_error_and_unknown_key_reported_together() -> None:
    data = {**minimal("marlhf"), "dpo_beta": "abc", "num_turns": 2, "top_kk": 5}
    problems = problems_of(data)
    assert sorted(p.field for p in problems) == ["dpo_beta", "num_turns", "top_kk"]
    assert "did you mean 'top_k'" in str(next(p for p in problems if p.field == "top_kk"))


@pytest.mark.parametrize("data", [{"task": "toy"}, {"trainer": "dpo", "dpo_beta": 0}, {"trainer": None}])
def test_missing_or_unknown_trainer_is_one_problem(data: dict) -> None:
    problems = problems_of(data)
    assert len(problems) == 1 and problems[0].field == "trainer"
    assert problems[0].message.endswith("allowed: madpo, marlhf, madpo_iter, marlhf_iter")


def test_not_a_mapping() -> None:
    with pytest.raises(ConfigError, match="must be a mapping"):
        parse_job(["trainer", "madpo"])  # type: ignore[arg-type]


# --------------------------------------------------------------------------- no aliases
ALIASES = [
    ("comparator_policy", a) for a in ("self", "online", "copy", "external", "reference", "checkpoint", "previous",
                                       "http", "endpoint", "Current")
] + [
    ("preference_replay_mode", a) for a in ("latest", "recent_k", "k", "lambda", "td_lambda", "LAMBDA_DECAY")
] + [
    ("pair_selection", " reward_gap"), ("pair_selection", "Reward_Gap"),
    ("comparator_generation_mode", "multi_agent"), ("comparator_api_format", "chat"),
    ("comparator_api_format", "responses"), ("comparator_api_format", "messages"),
]


@pytest.mark.parametrize(("field", "alias"), ALIASES)
def test_reference_aliases_are_errors(field: str, alias: str) -> None:
    (problem,) = problems_of({**minimal("madpo_iter"), field: alias})
    assert (problem.field, problem.value) == (field, alias)
    assert problem.message.startswith("allowed: ")


@pytest.mark.parametrize(("field", "alias"), [("rl_algorithm", "mareforce"), ("rl_algorithm", "MAGRPO"),
                                              ("preference_scoring_reward", "oracle"),
                                              ("preference_scoring_reward", "learned")])
def test_marlhf_aliases_are_errors(field: str, alias: str) -> None:
    (problem,) = problems_of({**minimal("marlhf_iter"), field: alias})
    assert problem.field == field and problem.message.startswith("allowed: ")


# --------------------------------------------------------------------------- secrets
def test_api_key_in_config_is_refused_without_echoing_it() -> None:
    data = {**minimal("madpo_iter"), "comparator_policy": "api", "comparator_api_url": "https://h",
            "comparator_api_key": SECRET}
    with pytest.raises(ConfigError) as info:
        parse_job(data)
    (problem,) = info.value.problems
    assert problem.field == "comparator_api_key"
    assert "environment variable" in problem.message and "comparator_api_key_env" in problem.message
    assert SECRET not in str(info.value)


def test_api_key_refused_on_direct_construction_without_echoing_it() -> None:
    with pytest.raises(ValidationError) as info:
        MADPOIterConfig(comparator_api_key=SECRET)
    assert "comparator_api_key_env" in str(info.value) and SECRET not in str(info.value)


def test_key_pasted_into_key_env_is_not_echoed() -> None:
    data = {**minimal("madpo_iter"), "comparator_policy": "api", "comparator_api_url": "https://h",
            "comparator_api_key_env": SECRET}
    with pytest.raises(ConfigError) as info:
        parse_job(data)
    assert SECRET not in str(info.value)


# --------------------------------------------------------------------------- YAML and overrides
def write_yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_load_job_with_overrides(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "trainer: madpo_iter\ntask: toy\nagent_model: some/path\ndpo_beta: 0.2\n")
    job = load_job(path, ["dpo_beta=0.5", "preference_replay_mode=nearest_k", "preference_replay_k=2",
                          "run_name=2024", "top_k=", "agent_learning_rate=1e-5", "agents=[a, b]", "agent_model=null"])
    assert type(job) is MADPOIterJob
    assert (job.dpo_beta, job.preference_replay_mode, job.preference_replay_k) == (0.5, "nearest_k", 2)
    assert (job.run_name, job.top_k, job.agent_learning_rate) == ("2024", None, 1e-5)
    assert (job.agents, job.agent_model) == (["a", "b"], None)


def test_override_can_switch_trainer(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "trainer: madpo\ntask: toy\nagent_model: m\n")
    assert type(load_job(path, ["trainer=marlhf"])) is MARLHFJob


def test_override_of_unknown_key(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "trainer: madpo\ntask: toy\nagent_model: m\ndpo_beta: 0\n")
    with pytest.raises(ConfigError) as info:
        load_job(path, ["dpo_betta=0.3", "no-equals-sign"])
    fields = [p.field for p in info.value.problems]
    assert sorted(fields) == ["dpo_beta", "dpo_betta", "override"]
    assert "did you mean 'dpo_beta'?" in str(info.value)


@pytest.mark.parametrize(
    ("text", "content", "message"),
    [("missing", None, "cannot be read"), ("bad", "trainer: [madpo\n", "is not valid YAML (line 2"),
     ("list", "- trainer\n", "must hold a mapping")],
)
def test_unusable_yaml_file_names_the_file(tmp_path: Path, text: str, content: str | None, message: str) -> None:
    path = tmp_path / f"{text}.yaml"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_job(path)
    (problem,) = info.value.problems
    assert problem.value == str(path) and problem.message.startswith(message)


def test_empty_yaml_file_asks_for_trainer(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="trainer: got None; missing"):
        load_job(write_yaml(tmp_path, ""))


@pytest.mark.parametrize(
    ("text", "expected"),
    [("a=1", ("a", 1)), ("a=", ("a", None)), ("a=x=y", ("a", "x=y")), ("a=[1, 2]", ("a", [1, 2])),
     (" a = true", ("a", True)), ("a=1e-5", ("a", "1e-5")), ("a={n: 2}", ("a", {"n": 2}))],
)
def test_parse_override(text: str, expected: tuple[str, Any]) -> None:
    assert parse_override(text) == expected


@pytest.mark.parametrize("text", ["novalue", "=3", "a=[1"])
def test_parse_override_errors(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_override(text)


# --------------------------------------------------------------------------- schema (Prefect UI form)
@pytest.mark.parametrize("cls", [*JOB_CLASSES.values(), *TRAINER_CONFIGS.values(), RunConfig])
def test_every_property_has_a_description(cls: type) -> None:
    properties = cls.model_json_schema()["properties"]
    assert properties and all(p.get("description", "").strip() for p in properties.values())


def test_job_adapter_discriminates_on_trainer() -> None:
    schema = job_adapter.json_schema()
    assert schema["discriminator"]["propertyName"] == "trainer"
    assert sorted(schema["discriminator"]["mapping"]) == sorted(TRAINERS)
    for trainer in TRAINERS:
        assert type(job_adapter.validate_python(minimal(trainer))) is JOB_CLASSES[trainer]
        assert json.dumps(job_adapter.json_schema())  # serialisable as a Prefect parameter schema


# --------------------------------------------------------------------------- config_hash
def test_config_hash_is_sha256_of_sorted_json_without_location() -> None:
    job = parse_job(minimal("madpo"))
    data = job.model_dump(mode="json")
    del data["run_name"], data["output_dir"]
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    assert config_hash(job) == hashlib.sha256(text.encode()).hexdigest()


def test_config_hash_changes_with_options_but_not_with_location() -> None:
    base = config_hash(parse_job(minimal("madpo_iter")))
    reordered = dict(reversed(list(minimal("madpo_iter").items())))
    assert config_hash(parse_job(reordered)) == base
    assert config_hash(parse_job({**minimal("madpo_iter"), "run_name": "x", "output_dir": "/elsewhere"})) == base
    assert config_hash(parse_job({**minimal("madpo_iter"), "dpo_beta": 0.2})) != base
    assert config_hash(parse_job({**minimal("madpo_iter"), "seed": 1})) != base


# --------------------------------------------------------------------------- frozen, warnings, helpers
def test_models_are_frozen() -> None:
    job = parse_job(minimal("madpo"))
    with pytest.raises(ValidationError):
        job.dpo_beta = 0.5  # type: ignore[misc]
    with pytest.raises(ValidationError):
        MARLHFConfig().rl_algorithm = "iac"  # type: ignore[misc]


@pytest.mark.parametrize("trainer", ["madpo", "madpo_iter"])
def test_madpo_reference_kl_warns_once(trainer: str) -> None:
    with pytest.warns(UserWarning, match="reference-free") as record:
        job = parse_job({**minimal(trainer), "reference_kl_enabled": True})
    assert len(record) == 1 and job.reference_kl_enabled is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_job(*split_job(job))  # recombining a valid job does not warn again


def test_madpo_config_direct_construction_warns() -> None:
    with pytest.warns(UserWarning, match="reference-free"):
        MADPOConfig(reference_kl_enabled=True)


@pytest.mark.parametrize("trainer", MARLHF)
def test_marlhf_reference_kl_does_not_warn(trainer: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parse_job({**minimal(trainer), "reference_kl_enabled": True})


def test_direct_construction_checks_rules() -> None:
    with pytest.raises(ValidationError, match="num_turns: got 2; must be 1"):
        MARLHFIterConfig(num_turns=2)
    with pytest.raises(ConfigError) as info:
        parse_config(MARLHFIterConfig, {"num_turns": 2, "dpo_beta": 0})
    assert [p.field for p in info.value.problems] == ["num_turns", "dpo_beta"]


def test_run_config_alone() -> None:
    run = RunConfig(trainer="marlhf", agents=["a", "b", "c"], task="toy")
    assert run.agents == ["a", "b", "c"]
    with pytest.raises(ConfigError) as info:
        parse_config(RunConfig, {"trainer": "marlhf", "task": "toy", "dpo_beta": 0.1})
    assert sorted(p.field for p in info.value.problems) == ["agent_model", "dpo_beta"]


def test_make_job_checks_the_combination() -> None:
    run = RunConfig(trainer="madpo", agents=["a", "b", "c"], task="toy")
    with pytest.raises(ConfigError) as info:
        make_job(run, MADPOConfig(num_agents=2))
    assert [p.field for p in info.value.problems] == ["agents"]
    assert make_job(run, MADPOConfig(num_agents=3)).agents == ["a", "b", "c"]


def test_make_job_refuses_mismatch_and_trainer_options() -> None:
    with pytest.raises(ConfigError, match="does not match the trainer config MARLHFConfig"):
        make_job(RunConfig(trainer="madpo", agent_model="m", task="toy"), MARLHFConfig())
    with pytest.raises(ConfigError, match="dpo_beta: got 0.2; not a run-level option"):
        make_job({"agent_model": "m", "task": "toy", "dpo_beta": 0.2}, MADPOConfig())
    assert type(make_job({"agent_model": "m", "task": "toy"}, MARLHFIterConfig())) is MARLHFIterJob
    assert type(make_job({"agent_model": "m", "task": "toy"}, MADPOConfig())) is MADPOJob


@pytest.mark.parametrize(("trainer", "expected"), [("madpo", False), ("marlhf", False), ("madpo_iter", True),
                                                   ("marlhf_iter", True)])
def test_is_iterative(trainer: str, expected: bool) -> None:
    assert is_iterative(trainer) is expected


def test_is_iterative_unknown_name() -> None:
    with pytest.raises(ConfigError, match="allowed: madpo, marlhf, madpo_iter, marlhf_iter"):
        is_iterative("madpo-iter")


def test_registries() -> None:
    assert TRAINER_CONFIGS == {"madpo": MADPOConfig, "marlhf": MARLHFConfig, "madpo_iter": MADPOIterConfig,
                               "marlhf_iter": MARLHFIterConfig}
    assert JOB_CLASSES == {"madpo": MADPOJob, "marlhf": MARLHFJob, "madpo_iter": MADPOIterJob,
                           "marlhf_iter": MARLHFIterJob}
    assert {"trainer", "seed", "agent_model", "agent_devices", "torch_dtype"} <= RUN_FIELDS
