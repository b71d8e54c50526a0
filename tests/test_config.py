"""Configuration models and rules (docs/guides/configuration.md#configuration): defaults, every rule, all problems at
once, YAML + overrides."""

from __future__ import annotations

import importlib
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
    "num_agents": 2,
    "num_turns": 1,
    "joint_mode": "aligned",
    "dpo_beta": 0.1,
    "agent_learning_rate": 5e-6,
    "train_batch_size": 2,
    "max_new_tokens": 256,
    "temperature": 0.6,
    "top_p": 0.6,
    "top_k": 50,
    "eval_interval": 1,
    "eval_num_samples": 4,
    "max_grad_norm": 1.0,
    "reward_func": None,
    "reward_processor": None,
    "reference_kl_enabled": False,
    "reference_kl_coef": 0.1,
    "reference_devices": None,
    # the reference's other MADPOConfig options (notes/reference-library.md §2.0)
    "rollout_buffer_size": 2,
    "eval_batch_size": 1,
    "logging_steps": 50,
    "use_environment_step": True,
    "environment_steps_per_pair": 2,
    "collaboration_mode": "decentralized",
    "parallel_training": "none",
    "discount": 1.0,
    "early_termination_threshold": None,
    "external_prompt_passthrough": False,
    "advantage_normalization": True,
    "advantage_mode": "mean",
}
ITERATIVE_DEFAULTS = {
    "num_iterations": 6,
    "comparator_policy": "current",
    "comparator_history_k": None,
    "comparator_model_name": None,
    "comparator_agents": None,
    "comparator_devices": None,
    "comparator_num_candidates": None,
    "comparator_generation_mode": "decentralized",
    "comparator_centralized_agent_index": 0,
    "comparator_api_format": "generic",
    "comparator_api_url": None,
    "comparator_api_model": None,
    "comparator_api_key_env": None,
    "comparator_api_response_field": "completions",
    "comparator_api_timeout": 120.0,
    "comparator_api_max_concurrency": 4,
    "preference_replay_mode": "current",
    "preference_replay_k": None,
    "preference_replay_lambda": None,
    "preference_replay_sample_size": None,
    "preference_replay_dir": None,
    "log_reward_distribution": False,
    "policy_checkpoint_dir": None,
    "comparator_api_key_header": "Authorization",
    "comparator_api_key_prefix": "Bearer",
    "comparator_api_headers": None,
    "comparator_api_extra_body": None,
    "comparator_api_max_n_per_request": None,
}
MARLHF_DEFAULTS = {
    "reward_model_name": None,
    "reward_learning_rate": 1e-5,
    "reward_train_batch_size": 1,
    "reward_max_length": None,
    "reward_freeze_backbone": False,
    "reward_pooling": "segments",
    "reward_backbone_layers": None,
    "reward_head_components": None,
    "reward_prompt_overlap": False,
    "rl_algorithm": "magrpo",
    "num_generations": 4,
    "critic_model_name": None,
    "critic_learning_rate": None,
    "value_loss_coef": 0.6,
    "value_clip_range": 0.2,
    "reward_model_device": None,
    "critic_devices": None,
    "critic_type": "v",
    "use_separate_critic": True,
    "critic_value_head_hidden_dim": None,
    "value_head_hidden_dim": None,
}
SPECIFIC_DEFAULTS = [
    ("madpo", "preference_num_candidates", 80),
    ("madpo", "pair_selection", "reward_gap"),
    ("madpo", "preference_pairs_per_sample", 16),
    ("madpo", "num_train_epochs", 20),
    ("marlhf", "preference_num_candidates", 80),
    ("marlhf", "pair_selection", "reward_gap"),
    ("marlhf", "preference_pairs_per_sample", 16),
    ("marlhf", "num_train_epochs", 1),
    ("marlhf", "reward_num_train_epochs", 1),
    ("madpo_iter", "preference_num_candidates", 20),
    ("madpo_iter", "pair_selection", "comparator_reward"),
    ("madpo_iter", "preference_pairs_per_sample", 4),
    ("madpo_iter", "num_train_epochs", 1),
    ("marlhf_iter", "preference_num_candidates", 20),
    ("marlhf_iter", "pair_selection", "comparator_reward"),
    ("marlhf_iter", "preference_pairs_per_sample", 4),
    ("marlhf_iter", "num_train_epochs", 2),
    ("marlhf_iter", "reward_num_train_epochs", 2),
    ("marlhf_iter", "preference_scoring_reward", "task"),
]
DEFAULTS = (
    [(t, f, v) for t in TRAINERS for f, v in COMMON_DEFAULTS.items()]
    + [(t, f, v) for t in ITERATIVE for f, v in ITERATIVE_DEFAULTS.items()]
    + [(t, f, v) for t in MARLHF for f, v in MARLHF_DEFAULTS.items()]
    + SPECIFIC_DEFAULTS
)
RUN_DEFAULTS = {
    "seed": 0,
    "run_name": None,
    "output_dir": "storage/runs",
    "task_options": {},
    "train_dataset": None,
    "eval_dataset": None,
    "formatters": None,
    "max_train_items": None,
    "agents": None,
    "lora_r": None,
    "lora_alpha": 16,
    "lora_dropout": 0.0,
    "lora_target_modules": None,
    "agent_devices": None,
    "tie_tolerance": 1e-9,
    "oracle_max_failure_share": 0.5,
    "generation_batch_size": 64,
    "torch_dtype": "auto",  # ★ resolved per device when a run starts (tests/unit/models/test_precision.py)
    "eval_samples_per_item": 1,
    "mixed_precision": "auto",
    "num_threads": None,
    "reward_timeout": 600.0,
    "max_memory": None,
    "gradient_checkpointing": False,
    "gradient_accumulation_steps": 1,
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
    [
        ("madpo", "num_iterations", False),
        ("madpo", "comparator_policy", False),
        ("madpo", "rl_algorithm", False),
        ("madpo", "reward_model_name", False),
        ("marlhf", "comparator_policy", False),
        ("marlhf", "preference_scoring_reward", False),
        ("madpo_iter", "rl_algorithm", False),
        ("madpo_iter", "preference_scoring_reward", False),
        ("marlhf_iter", "preference_scoring_reward", True),
        ("marlhf_iter", "critic_model_name", True),
        ("madpo_iter", "preference_replay_mode", True),
        ("madpo", "dpo_beta", True),
        ("marlhf", "dpo_beta", True),
    ],
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
    ("madpo", {"temperature": 9e-5}, "temperature"),
    ("madpo", {"temperature": 100.5}, "temperature"),
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
    ("marlhf", {"reference_kl_enabled": True, "reference_devices": "gpu0"}, "reference_devices"),
    ("marlhf", {"reference_kl_enabled": True, "reference_devices": ["cpu", "cpu", "cpu"]}, "reference_devices"),
    ("madpo", {"reference_kl_enabled": True, "reference_devices": ["cpu", "cpu", "cpu"]}, "reference_devices"),
    ("madpo", {"rollout_buffer_size": 0}, "rollout_buffer_size"),
    ("madpo", {"rollout_buffer_size": 0, "train_batch_size": 3}, "rollout_buffer_size"),
    ("madpo", {"eval_batch_size": 0}, "eval_batch_size"),
    ("madpo", {"logging_steps": 0}, "logging_steps"),
    ("madpo", {"environment_steps_per_pair": 0}, "environment_steps_per_pair"),
    ("madpo", {"use_environment_step": 1}, "use_environment_step"),
    ("madpo", {"parallel_training": "auto"}, "parallel_training"),
    ("madpo", {"parallel_training": "null"}, "parallel_training"),
    ("madpo", {"parallel_training": "mp"}, "agent_devices"),
    ("madpo", {"collaboration_mode": "Centralized"}, "collaboration_mode"),  # exact values, no aliases
    ("marlhf", {"collaboration_mode": "centralized"}, "collaboration_mode"),  # not available with MARLHF
    ("madpo", {"advantage_mode": "baseline"}, "advantage_mode"),
    ("madpo", {"discount": float("inf")}, "discount"),
    ("madpo", {"early_termination_threshold": "high"}, "early_termination_threshold"),
    # comparator
    ("madpo_iter", {"comparator_policy": "self"}, "comparator_policy"),
    ("madpo_iter", {"comparator_policy": "history", "comparator_history_k": 0}, "comparator_history_k"),
    ("madpo_iter", {"comparator_history_k": 2}, "comparator_history_k"),
    ("madpo_iter", {"comparator_policy": "model"}, "comparator_model_name"),
    ("madpo_iter", {"comparator_model_name": "m"}, "comparator_model_name"),
    ("madpo_iter", {"comparator_policy": "history", "comparator_agents": ["a", "b"]}, "comparator_agents"),
    (
        "madpo_iter",
        {"comparator_policy": "model", "comparator_model_name": "m", "comparator_agents": ["a", "b"]},
        "comparator_agents",
    ),
    ("madpo_iter", {"comparator_policy": "model", "comparator_agents": ["a", "b", "c"]}, "comparator_agents"),
    ("madpo_iter", {"comparator_policy": "model", "comparator_agents": []}, "comparator_agents"),
    ("madpo_iter", {"comparator_num_candidates": 0}, "comparator_num_candidates"),
    ("madpo_iter", {"comparator_generation_mode": "centralised"}, "comparator_generation_mode"),
    (
        "madpo_iter",
        {"comparator_generation_mode": "centralized", "comparator_centralized_agent_index": 2},
        "comparator_centralized_agent_index",
    ),
    (
        "madpo_iter",
        {"comparator_generation_mode": "centralized", "comparator_centralized_agent_index": -1},
        "comparator_centralized_agent_index",
    ),
    (
        "madpo_iter",
        {"comparator_policy": "current_copy", "comparator_devices": ["cpu", "cpu", "cpu"]},
        "comparator_devices",
    ),
    ("madpo_iter", {"comparator_policy": "history", "comparator_devices": "gpu"}, "comparator_devices"),
    (
        "madpo_iter",
        {"comparator_policy": "model", "comparator_model_name": "m", "comparator_agents": ["m", "n"]},
        "comparator_agents",
    ),
    ("madpo_iter", {"comparator_api_headers": {"Authorization": SECRET}}, "comparator_api_headers"),
    ("madpo_iter", {"comparator_api_headers": {"X-Trace": 1}}, "comparator_api_headers"),
    ("madpo_iter", {"comparator_api_max_n_per_request": 0}, "comparator_api_max_n_per_request"),
    ("madpo_iter", {"comparator_api_key_header": ""}, "comparator_api_key_header"),
    ("madpo_iter", {"comparator_api_extra_body": ["n"]}, "comparator_api_extra_body"),
    ("madpo_iter", {"log_reward_distribution": "yes"}, "log_reward_distribution"),
    ("madpo_iter", {"policy_checkpoint_dir": ""}, "policy_checkpoint_dir"),
    ("madpo_iter", {"comparator_policy": "api"}, "comparator_api_url"),
    ("madpo_iter", {"comparator_policy": "api", "comparator_api_url": "ftp://host/x"}, "comparator_api_url"),
    ("madpo_iter", {"comparator_api_url": "https://host/x"}, "comparator_api_url"),
    ("madpo_iter", {"comparator_api_model": "gpt"}, "comparator_api_model"),
    ("madpo_iter", {"comparator_api_key_env": "OPENAI_API_KEY"}, "comparator_api_key_env"),
    (
        "madpo_iter",
        {"comparator_policy": "api", "comparator_api_url": "https://h", "comparator_api_key_env": SECRET},
        "comparator_api_key_env",
    ),
    ("madpo_iter", {"comparator_api_format": "openai_chat"}, "comparator_api_format"),
    ("madpo_iter", {"comparator_api_timeout": 0}, "comparator_api_timeout"),
    ("madpo_iter", {"comparator_api_max_concurrency": 0}, "comparator_api_max_concurrency"),
    # replay
    ("madpo_iter", {"preference_replay_mode": "td-lambda"}, "preference_replay_mode"),
    ("madpo_iter", {"preference_replay_mode": "nearest_k"}, "preference_replay_k"),
    ("madpo_iter", {"preference_replay_mode": "nearest_k", "preference_replay_k": 0}, "preference_replay_k"),
    ("madpo_iter", {"preference_replay_k": 2}, "preference_replay_k"),
    ("madpo_iter", {"preference_replay_mode": "all_history", "preference_replay_k": 1}, "preference_replay_k"),
    (
        "madpo_iter",
        {"preference_replay_mode": "lambda_decay", "preference_replay_lambda": 0.5, "preference_replay_k": 1},
        "preference_replay_k",
    ),
    ("madpo_iter", {"preference_replay_mode": "lambda_decay"}, "preference_replay_lambda"),
    (
        "madpo_iter",
        {"preference_replay_mode": "lambda_decay", "preference_replay_lambda": 1.5},
        "preference_replay_lambda",
    ),
    ("madpo_iter", {"preference_replay_lambda": 0.5}, "preference_replay_lambda"),
    (
        "madpo_iter",
        {"preference_replay_mode": "all_history", "preference_replay_lambda": 0.5},
        "preference_replay_lambda",
    ),
    ("madpo_iter", {"preference_replay_sample_size": 8}, "preference_replay_sample_size"),
    (
        "madpo_iter",
        {"preference_replay_mode": "all_history", "preference_replay_sample_size": 0},
        "preference_replay_sample_size",
    ),
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
    ("marlhf", {"reward_model_device": "gpu:0"}, "reward_model_device"),
    ("marlhf", {"critic_type": "V"}, "critic_type"),
    ("marlhf", {"rl_algorithm": "maac", "critic_devices": ["cpu", "cpu", "cpu"]}, "critic_devices"),
    ("marlhf", {"critic_value_head_hidden_dim": 0}, "critic_value_head_hidden_dim"),
    ("marlhf", {"value_head_hidden_dim": -1}, "value_head_hidden_dim"),
    # pbrl.learning.critics: maac's critic is always separate; a value head on the policy has no separate-critic
    # settings
    ("marlhf", {"rl_algorithm": "maac", "use_separate_critic": False}, "use_separate_critic"),
    ("madpo", {"runner": "ray", "agent_devices": "auto"}, "agent_devices"),  # Ray reserves named devices only
    ("marlhf", {"rl_algorithm": "iac", "use_separate_critic": False, "critic_model_name": "m"}, "critic_model_name"),
    ("marlhf", {"rl_algorithm": "iac", "value_head_hidden_dim": 8}, "value_head_hidden_dim"),
    ("marlhf", {"rl_algorithm": "iac", "advantage_mode": "rank"}, "advantage_mode"),
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
    ("madpo_iter", {"eval_samples_per_item": 0}, "eval_samples_per_item"),
    ("madpo", {"eval_samples_per_item": 1.5}, "eval_samples_per_item"),
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
    # issue #19: accelerate's mixed precision and device placement
    ("madpo", {"mixed_precision": "fp8"}, "mixed_precision"),
    ("madpo", {"mixed_precision": "bfloat16"}, "mixed_precision"),  # accelerate's names, not torch's
    ("madpo", {"mixed_precision": False}, "mixed_precision"),
    # issue #14: memory options of update-policies
    ("madpo", {"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
    ("madpo", {"gradient_accumulation_steps": 2.0}, "gradient_accumulation_steps"),
    ("madpo", {"gradient_checkpointing": "yes"}, "gradient_checkpointing"),
    ("madpo", {"max_memory": {"cpu": "2GiB"}}, "max_memory"),  # no device option is 'auto': it would do nothing
    ("madpo", {"agent_devices": "cpu", "max_memory": {"cpu": "2GiB"}}, "max_memory"),
    ("madpo", {"agent_devices": "auto", "max_memory": {"gpu0": "2GiB"}}, "max_memory"),
    ("madpo", {"agent_devices": "auto", "max_memory": {-1: "2GiB"}}, "max_memory"),
    ("madpo", {"agent_devices": "auto", "max_memory": {"cpu": "2 gigabytes"}}, "max_memory"),
    ("madpo", {"agent_devices": "auto", "max_memory": {"cpu": "GiB"}}, "max_memory"),
    ("madpo", {"agent_devices": "auto", "max_memory": {0: 0}}, "max_memory"),
    ("madpo", {"agent_devices": "auto", "max_memory": {"cpu": 2.5}}, "max_memory"),
    ("madpo", {"agent_devices": "auto", "max_memory": {"cpu": True}}, "max_memory"),
    ("madpo", {"agent_devices": "auto", "max_memory": ["cpu", "2GiB"]}, "max_memory"),
    ("madpo", {"agent_devices": ["auto", "cpu"]}, "agent_devices"),
    ("madpo", {"agent_devices": ["auto"]}, "agent_devices"),
    ("madpo", {"agent_devices": "Auto"}, "agent_devices"),
    ("madpo_iter", {"comparator_policy": "current_copy", "comparator_devices": ["cpu", "auto"]}, "comparator_devices"),
    ("marlhf", {"reference_kl_enabled": True, "reference_devices": ["auto", "auto"]}, "reference_devices"),
    ("madpo", {"train_dataset": "items.csv"}, "train_dataset"),
    ("madpo", {"eval_dataset": "items.json"}, "eval_dataset"),
    ("madpo", {"task_options": []}, "task_options"),
    (
        "madpo",
        {
            "task": None,
            "train_dataset": "a.jsonl",
            "formatters": ["m:f", "m:g"],
            "reward_func": "m:r",
            "task_options": {"n": 1},
        },
        "task_options",
    ),
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
    [
        (
            {"preference_replay_mode": "td-lambda"},
            "preference_replay_mode: got 'td-lambda'; allowed: current, nearest_k, all_history, lambda_decay",
        ),
        ({"dpo_beta": 0}, "dpo_beta: got 0; must be > 0"),
        ({"top_p": 1.5}, "top_p: got 1.5; must be in (0, 1]"),
        ({"lora_dropout": 1.0}, "lora_dropout: got 1.0; must be in [0, 1)"),
        ({"preference_pairs_per_sample": 0}, "preference_pairs_per_sample: got 0; must be >= 1 or None"),
        ({"num_agents": "two"}, "num_agents: got 'two'; must be an integer"),
        ({"agent_devices": "gpu"}, "agent_devices: got 'gpu'; devices look like 'cpu', 'cuda', 'cuda:1' or 'mps'"),
        (
            {"agent_devices": 1.5},
            "agent_devices: got 1.5; must be a string, a list of strings or None (a number is "
            'not text: write it in quotes in YAML, "1.5")',
        ),
        ({"num_iterations": True}, "num_iterations: got True; must be an integer (true/false is not a number)"),
        ({"dpo_beta": False}, "dpo_beta: got False; must be a number (true/false is not a number)"),
        (
            {"run_name": 2024},
            'run_name: got 2024; must be a string or None (a number is not text: write it in quotes in YAML, "2024")',
        ),
        ({"temperature": 0}, "temperature: got 0; must be in [0.0001, 100]"),
        ({"agents": "a", "agent_model": None}, "agents: got 'a'; must be a list of strings or None"),
        (
            {"comparator_generation_mode": "centralized", "comparator_centralized_agent_index": 2},
            "comparator_centralized_agent_index: got 2; must be in [0, num_agents) = [0, 2)",
        ),
        (
            {"agents": ["some/path", "other/path"]},
            "agents: got ['some/path', 'other/path']; conflicts with agent_model='some/path' (also names 'other/path'); "  # noqa: E501
            "give agent_model or agents, or list agent_model once per agent",
        ),
        (
            {"comparator_api_headers": {"x-api-key": SECRET}},
            "comparator_api_headers: got '<hidden>'; header(s) x-api-key would put an API key in the configuration; pbrl "  # noqa: E501
            "never takes an API key in the configuration (it would end up in run.json, logs and Prefect parameters); put "  # noqa: E501
            "the key in an environment variable and give that variable's name in comparator_api_key_env",
        ),
        (
            {"comparator_api_headers": {"X-Trace": 1}},
            "comparator_api_headers: got {'X-Trace': 1}; must be a mapping of names to strings or None",
        ),
        ({"dpo_betta": 0.1}, "dpo_betta: got 0.1; unknown option; did you mean 'dpo_beta'?"),
        (
            {"max_memory": {"cpu": "2GiB"}},
            "max_memory: got {'cpu': '2GiB'}; allowed only with a device option set to "
            "'auto' (agent_devices, comparator_devices, reference_devices or reward_model_device); set it to None",
        ),
        (
            {"agent_devices": "auto", "max_memory": {"gpu": "1GiB", "cpu": "1 GB"}},
            [
                "max_memory: got {'gpu': '1GiB', 'cpu': '1 GB'}; key(s) 'gpu': keys are a GPU index (0, 1, ...), 'cpu', "  # noqa: E501
                "'mps' or 'disk' (accelerate's max_memory)",
                "max_memory: got {'gpu': '1GiB', 'cpu': '1 GB'}; size(s) of 'cpu': sizes are bytes > 0 or a number with a "  # noqa: E501
                "unit: GiB, MiB, KiB, GB, MB, KB (e.g. '2GiB')",
            ],
        ),
        (
            {"agent_devices": ["auto", "cpu"]},
            "agent_devices: got ['auto', 'cpu']; 'auto' places every model with "
            "accelerate's device map: give it alone (agent_devices: auto), not in a list",
        ),
        (
            {"rl_algorithm": "maac"},
            "rl_algorithm: got 'maac'; not an option of trainer 'madpo_iter'; it belongs to trainer(s) marlhf, marlhf_iter",  # noqa: E501
        ),
    ],
)
def test_problem_wording(overrides: dict, rendered: str | list[str]) -> None:
    expected = [rendered] if isinstance(rendered, str) else rendered
    assert [str(p) for p in problems_of({**minimal("madpo_iter"), **overrides})] == expected


def test_task_source_names_each_missing_part() -> None:
    problems = problems_of({**minimal("madpo"), "task": None, "train_dataset": "items.jsonl"})
    assert [p.field for p in problems] == ["formatters", "reward_func"]


# --------------------------------------------------------------------------- strict types (no silent coercion)
COERCIONS = [
    # a boolean for a number (lax pydantic reads true as 1 and false as 0)
    ("madpo_iter", "num_iterations", True),
    ("madpo", "num_agents", True),
    ("madpo", "seed", False),
    ("madpo", "top_k", True),
    ("madpo", "max_train_items", True),
    ("madpo", "num_train_epochs", True),
    ("madpo_iter", "comparator_centralized_agent_index", False),
    ("madpo", "dpo_beta", True),
    ("madpo", "temperature", True),
    ("madpo", "max_grad_norm", True),
    ("madpo", "tie_tolerance", False),
    ("marlhf", "reference_kl_coef", False),
    # a number for text (pbrl used to turn 2024 into '2024')
    ("madpo", "run_name", 2024),
    ("madpo", "task", 1),
    ("madpo", "output_dir", 7),
    ("madpo", "agent_devices", 0),
    ("madpo", "reward_func", 1.5),
    ("madpo_iter", "preference_replay_dir", 3),
    ("madpo", "agent_model", 12),
    ("madpo", "lora_target_modules", [1]),
    # text or a float for an integer, text or a number for a boolean
    ("madpo", "num_agents", "2"),
    ("madpo", "dpo_beta", "0.1"),
    ("madpo_iter", "num_iterations", 2.0),
    ("madpo", "reference_kl_enabled", 1),
    ("madpo", "reference_kl_enabled", "true"),
]


@pytest.mark.parametrize(("trainer", "field", "value"), COERCIONS)
def test_no_silent_type_conversion(trainer: str, field: str, value: Any) -> None:
    data = {**minimal(trainer), field: value}
    if field == "lora_target_modules":
        data["lora_r"] = 8
    (problem,) = problems_of(data)
    assert (problem.field, problem.value) == (field, value) and problem.message.startswith("must be ")
    with pytest.raises(ValidationError):  # the Prefect parameter path is as strict
        job_adapter.validate_python(data)


def test_integer_for_a_float_option_is_kept_as_a_float() -> None:
    job = parse_job(
        {
            **minimal("madpo_iter"),
            "dpo_beta": 1,
            "agent_learning_rate": 1,
            "top_p": 1,
            "preference_replay_mode": "lambda_decay",
            "preference_replay_lambda": 0,
        }
    )
    values = (job.dpo_beta, job.agent_learning_rate, job.top_p, job.preference_replay_lambda)
    assert values == (1.0, 1.0, 1.0, 0.0) and all(type(v) is float for v in values)


DIRECT = [
    (
        MADPOConfig,
        {"dpo_beta": 0, "num_turns": True, "temperature": 0, "bogus": 1},
        ["num_turns", "dpo_beta", "temperature", "bogus"],
    ),
    (
        MADPOIterConfig,
        {"num_iterations": True, "preference_replay_mode": "td-lambda", "num_turns": 2},
        ["num_turns", "num_iterations", "preference_replay_mode"],
    ),
    (
        MARLHFIterConfig,
        {"num_turns": 2, "rl_algorithm": "iac", "critic_learning_rate": "1e-4"},
        ["num_turns", "critic_learning_rate"],
    ),
    (
        RunConfig,
        {"trainer": "madpo", "seed": True, "run_name": 2024, "task": "toy", "dpo_beta": 0.1},
        ["seed", "run_name", "agent_model", "dpo_beta"],
    ),
    (
        MADPOIterJob,
        {"task": "toy", "agents": ["a", "b", "c"], "dpo_beta": "x", "comparator_history_k": 2},
        ["dpo_beta", "comparator_history_k", "agents"],
    ),
    (MARLHFJob, {"trainer": "marlhf"}, ["agent_model", "task"]),
]


@pytest.mark.parametrize(("cls", "data", "fields"), DIRECT)
def test_direct_construction_raises_one_config_error_with_every_problem(
    cls: type, data: dict, fields: list[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        cls(**data)
    assert sorted(p.field for p in info.value.problems) == sorted(fields)


# --------------------------------------------------------------------------- allowed combinations
ALLOWED = [
    ("madpo", {"pair_selection": "all", "preference_pairs_per_sample": None}),
    ("madpo", {"temperature": 1e-4, "top_p": 1}),
    ("madpo", {"temperature": 100}),
    ("madpo", {"pair_selection": "random", "top_k": None, "max_grad_norm": None, "eval_interval": 0}),
    ("madpo", {"num_agents": 1, "agent_model": None, "agents": ["m"]}),
    ("madpo", {"agent_model": None, "agents": ["m1", "m2"], "agent_devices": ["cpu", "cuda:1"]}),
    (
        "madpo",
        {
            "task": None,
            "train_dataset": "d.jsonl",
            "eval_dataset": "e.parquet",
            "formatters": ["m:f", "m:g"],
            "reward_func": "pkg.mod:reward",
            "reward_processor": "pkg.mod:shift",
        },
    ),
    ("madpo", {"task_options": {"n_items": 4}, "max_train_items": 3, "run_name": "run-1_a.b", "seed": 7}),
    ("madpo", {"lora_r": 8, "lora_alpha": 32, "lora_dropout": 0.05, "lora_target_modules": ["q_proj"]}),
    ("madpo", {"agent_devices": "cuda:1", "torch_dtype": "bfloat16", "tie_tolerance": 0.0}),
    ("madpo", {"agent_devices": ["cpu"], "oracle_max_failure_share": 1.0, "generation_batch_size": 1}),
    ("madpo_iter", {"comparator_policy": "current_copy", "comparator_devices": ["cpu", "cpu"]}),
    ("madpo_iter", {"comparator_policy": "model", "comparator_model_name": "m"}),
    ("madpo_iter", {"comparator_policy": "model", "comparator_agents": ["a", "b"]}),
    ("madpo_iter", {"comparator_policy": "history"}),
    ("madpo_iter", {"comparator_policy": "history", "comparator_history_k": 3}),
    (
        "madpo_iter",
        {
            "comparator_policy": "api",
            "comparator_api_url": "https://api.anthropic.com/v1/messages",
            "comparator_api_format": "anthropic",
            "comparator_api_model": "claude",
            "comparator_api_key_env": "ANTHROPIC_API_KEY",
            "comparator_api_timeout": 5,
        },
    ),
    (
        "madpo_iter",
        {
            "comparator_generation_mode": "centralized",
            "comparator_centralized_agent_index": 1,
            "comparator_num_candidates": 3,
            "preference_num_candidates": 1,
        },
    ),
    ("madpo_iter", {"preference_replay_k": 1}),
    (
        "madpo_iter",
        {"preference_replay_mode": "nearest_k", "preference_replay_k": 2, "preference_replay_sample_size": 8},
    ),
    ("madpo_iter", {"preference_replay_mode": "all_history", "preference_replay_dir": "elsewhere/replay"}),
    ("madpo_iter", {"preference_replay_mode": "lambda_decay", "preference_replay_lambda": 0.0}),
    (
        "madpo_iter",
        {"preference_replay_mode": "lambda_decay", "preference_replay_lambda": 1, "preference_replay_sample_size": 1},
    ),
    ("marlhf", {"rl_algorithm": "maac", "num_generations": 1, "critic_model_name": "c", "critic_learning_rate": 1e-4}),
    ("marlhf", {"rl_algorithm": "iac", "value_clip_range": None, "reward_max_length": 512}),
    ("marlhf", {"rl_algorithm": "marloo", "num_generations": 2, "reward_freeze_backbone": True}),
    ("marlhf", {"reference_kl_enabled": True, "reference_kl_coef": 0.0, "reference_devices": ["cpu", "cpu"]}),
    ("marlhf_iter", {"preference_scoring_reward": "reward_model", "comparator_policy": "history"}),
    # issue #17: the reference accepts these, and so does pbrl
    ("madpo", {"agents": ["some/path", "some/path"]}),  # agent_model and agents naming the same model
    ("madpo_iter", {"comparator_centralized_agent_index": 5}),  # read only in centralized mode
    ("madpo_iter", {"comparator_centralized_agent_index": -1}),
    ("madpo", {"reference_devices": ["cpu", "cpu", "cpu"]}),  # read only with the KL on
    ("madpo_iter", {"comparator_devices": ["cpu", "cpu", "cpu"]}),  # 'current' loads no comparator copy
    ("madpo_iter", {"comparator_policy": "model", "comparator_model_name": "m", "comparator_agents": ["m", "m"]}),
    ("madpo_iter", {"preference_num_candidates": 1}),  # ★ pbrl: one target vs one comparator already pairs
    ("madpo", {"parallel_training": "mp", "agent_devices": ["cpu", "cpu"]}),
    (
        "madpo",
        {
            "rollout_buffer_size": 4,
            "train_batch_size": 3,
            "eval_batch_size": 8,
            "logging_steps": 1,
            "use_environment_step": False,
            "environment_steps_per_pair": 1,
        },
    ),
    (
        "marlhf",
        {
            "rl_algorithm": "maac",
            "num_generations": 1,
            "critic_devices": ["cpu", "cpu"],
            "critic_type": "q",
            "critic_value_head_hidden_dim": 64,
            "reward_model_device": "cuda:1",
        },
    ),
    ("marlhf", {"rl_algorithm": "iac", "use_separate_critic": False, "value_head_hidden_dim": 64}),
    ("marlhf", {"rl_algorithm": "iac", "advantage_mode": "max", "advantage_normalization": False}),
    # issue #19: 'auto' placement within max_memory (accelerate's format), mixed precision
    ("madpo", {"agent_devices": "auto"}),  # max_memory None = all free memory
    (
        "madpo",
        {
            "agent_devices": "auto",
            "max_memory": {0: "10GiB", 1: "12.5GB", "cpu": "30GiB", "disk": 10**12},
            "mixed_precision": "bf16",
        },
    ),
    ("madpo", {"agent_devices": "auto", "parallel_training": "mp", "max_memory": {"cpu": "512KiB", "mps": "8MB"}}),
    ("madpo", {"mixed_precision": "fp16", "torch_dtype": "bfloat16"}),
    ("madpo_iter", {"comparator_policy": "current_copy", "comparator_devices": "auto", "max_memory": {"cpu": "1GiB"}}),
    ("marlhf", {"reward_model_device": "auto", "max_memory": {"cpu": "500MB"}}),
    ("marlhf", {"reference_kl_enabled": True, "reference_devices": "auto", "max_memory": {"cpu": 2**30}}),
    ("marlhf", {"critic_devices": "nonsense"}),  # read only by 'maac'/'iac'
    (
        "madpo_iter",
        {
            "log_reward_distribution": True,
            "policy_checkpoint_dir": "exports/policies",
            "comparator_api_key_header": "X-Key",
            "comparator_api_key_prefix": "",
            "comparator_api_headers": {"X-Trace": "1"},
            "comparator_api_extra_body": {"seed": 3},
            "comparator_api_max_n_per_request": 2,
        },
    ),
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
ALIASES = (
    [
        ("comparator_policy", a)
        for a in (
            "self",
            "online",
            "copy",
            "external",
            "reference",
            "checkpoint",
            "previous",
            "http",
            "endpoint",
            "Current",
        )
    ]
    + [("preference_replay_mode", a) for a in ("latest", "recent_k", "k", "lambda", "td_lambda", "LAMBDA_DECAY")]
    + [
        ("pair_selection", " reward_gap"),
        ("pair_selection", "Reward_Gap"),
        ("comparator_generation_mode", "multi_agent"),
        ("comparator_api_format", "chat"),
        ("comparator_api_format", "responses"),
        ("comparator_api_format", "messages"),
    ]
)


@pytest.mark.parametrize(("field", "alias"), ALIASES)
def test_reference_aliases_are_errors(field: str, alias: str) -> None:
    (problem,) = problems_of({**minimal("madpo_iter"), field: alias})
    assert (problem.field, problem.value) == (field, alias)
    assert problem.message.startswith("allowed: ")


@pytest.mark.parametrize(
    ("field", "alias"),
    [
        ("rl_algorithm", "mareforce"),
        ("rl_algorithm", "MAGRPO"),
        ("preference_scoring_reward", "oracle"),
        ("preference_scoring_reward", "learned"),
    ],
)
def test_marlhf_aliases_are_errors(field: str, alias: str) -> None:
    (problem,) = problems_of({**minimal("marlhf_iter"), field: alias})
    assert problem.field == field and problem.message.startswith("allowed: ")


# --------------------------------------------------------------------------- secrets
def test_api_key_in_config_is_refused_without_echoing_it() -> None:
    data = {
        **minimal("madpo_iter"),
        "comparator_policy": "api",
        "comparator_api_url": "https://h",
        "comparator_api_key": SECRET,
    }
    with pytest.raises(ConfigError) as info:
        parse_job(data)
    (problem,) = info.value.problems
    assert problem.field == "comparator_api_key"
    assert "environment variable" in problem.message and "comparator_api_key_env" in problem.message
    assert SECRET not in str(info.value)


def test_api_key_refused_on_direct_construction_without_echoing_it() -> None:
    with pytest.raises(ConfigError) as info:
        MADPOIterConfig(comparator_api_key=SECRET, dpo_beta=0)
    assert sorted(p.field for p in info.value.problems) == ["comparator_api_key", "dpo_beta"]
    assert "comparator_api_key_env" in str(info.value) and SECRET not in str(info.value)
    with pytest.raises(ValidationError) as pydantic_info:  # Prefect's path
        job_adapter.validate_python({**minimal("madpo_iter"), "comparator_api_key": SECRET})
    assert SECRET not in str(pydantic_info.value)


def test_key_pasted_into_key_env_is_not_echoed() -> None:
    data = {
        **minimal("madpo_iter"),
        "comparator_policy": "api",
        "comparator_api_url": "https://h",
        "comparator_api_key_env": SECRET,
    }
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
    job = load_job(
        path,
        [
            "dpo_beta=0.5",
            "preference_replay_mode=nearest_k",
            "preference_replay_k=2",
            "run_name=2024",
            "top_k=",
            "agent_learning_rate=1e-5",
            "agents=[a, b]",
            "agent_model=null",
        ],
    )
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
    [
        ("missing", None, "cannot be read"),
        ("bad", "trainer: [madpo\n", "is not valid YAML (line 2"),
        ("list", "- trainer\n", "must hold a mapping"),
    ],
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
    [
        ("a=1", ("a", 1)),
        ("a=", ("a", None)),
        ("a=x=y", ("a", "x=y")),
        ("a=[1, 2]", ("a", [1, 2])),
        (" a = true", ("a", True)),
        ("a={n: 2}", ("a", {"n": 2})),
        # YAML 1.2 numbers: PyYAML alone reads these as strings
        ("a=1e-5", ("a", 0.00001)),
        ("a=2.5E3", ("a", 2500.0)),
        ("a=-1e2", ("a", -100.0)),
        ("a=1e", ("a", "1e")),
        # an option that takes text keeps the text as typed; other options keep YAML's value (checked later)
        ("run_name=2024", ("run_name", "2024")),
        ("run_name=1e5", ("run_name", "1e5")),
        ("task= true", ("task", "true")),
        ("agent_devices=0", ("agent_devices", "0")),
        ("seed=7", ("seed", 7)),
        ("dpo_beta=1", ("dpo_beta", 1)),
        ("num_iterations=true", ("num_iterations", True)),
        ("top_k=null", ("top_k", None)),
    ],
)
def test_parse_override(text: str, expected: tuple[str, Any]) -> None:
    key, value = parse_override(text)
    assert (key, value) == expected and type(value) is type(expected[1])


def test_yaml_numbers_and_strict_types_in_a_file(tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path,
        "trainer: madpo_iter\ntask: toy\nagent_model: m\nagent_learning_rate: 1e-5\ndpo_beta: 1\nrun_name: '2024'\n",
    )
    job = load_job(path, ["temperature=1E-2", "num_iterations=2"])
    assert (job.agent_learning_rate, job.dpo_beta, job.temperature) == (0.00001, 1.0, 0.01)
    assert (job.run_name, job.num_iterations) == ("2024", 2)


def test_booleans_and_numbers_in_a_file_or_override_are_refused(tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path, "trainer: madpo_iter\ntask: toy\nagent_model: m\nnum_iterations: true\nrun_name: 2024\n"
    )
    with pytest.raises(ConfigError) as info:
        load_job(path, ["seed=yes", "reference_kl_enabled=1"])
    problems = {p.field: p.value for p in info.value.problems}
    assert problems == {"seed": True, "num_iterations": True, "run_name": 2024, "reference_kl_enabled": 1}


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
def test_config_hash_is_one_sha256_hex_per_job_however_it_was_built(tmp_path: Path) -> None:
    data = {**minimal("madpo_iter"), "task_options": {"a": 1, "b": [1, 2]}, "dpo_beta": 0.2}
    base = config_hash(parse_job(data))
    assert len(base) == 64 and set(base) <= set("0123456789abcdef")
    reordered = {k: data[k] for k in reversed(list(data))} | {"task_options": {"b": [1, 2], "a": 1}}
    assert config_hash(parse_job(reordered)) == base  # key order, also inside task_options
    path = write_yaml(
        tmp_path,
        "dpo_beta: 0.2\ntask_options: {b: [1, 2], a: 1}\nagent_model: some/path\ntask: toy\ntrainer: madpo_iter\n",
    )
    assert config_hash(load_job(path)) == base
    assert config_hash(make_job(*split_job(parse_job(data)))) == base
    assert config_hash(parse_job({**data, "dpo_beta": 1})) == config_hash(parse_job({**data, "dpo_beta": 1.0}))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("dpo_beta", 0.25),
        ("seed", 1),
        ("temperature", 0.7),
        ("top_k", None),
        ("agent_model", "other/path"),
        ("task_options", {"a": 2, "b": [1, 2]}),
        ("task_options", {"a": 1, "b": [2, 1]}),
        ("preference_replay_mode", "all_history"),
        ("lora_r", 4),
        ("mixed_precision", "bf16"),
        ("gradient_checkpointing", True),
        ("gradient_accumulation_steps", 2),
        # config_hash covers num_iterations; pbrl.config.stage_config_hash is where a run may grow by iterations
        ("num_iterations", 7),
    ],
)
def test_config_hash_changes_with_any_option(field: str, value: Any) -> None:
    data = {**minimal("madpo_iter"), "task_options": {"a": 1, "b": [1, 2]}}
    assert config_hash(parse_job({**data, field: value})) != config_hash(parse_job(data))


def test_max_memory_gpu_indices_survive_the_json_round_trip_of_run_json() -> None:
    # JSON keys are strings: {0: "10GiB"} is stored as {"0": "10GiB"}; accelerate needs the GPU index 0 back.
    job = parse_job({**minimal("madpo"), "agent_devices": "auto", "max_memory": {0: "10GiB", "cpu": "30GiB"}})
    stored = json.loads(job.model_dump_json())
    assert stored["max_memory"] == {"0": "10GiB", "cpu": "30GiB"}
    again = parse_job(stored)
    assert again.max_memory == {0: "10GiB", "cpu": "30GiB"} and again == job
    assert config_hash(again) == config_hash(job)


def test_config_hash_ignores_where_the_run_lives() -> None:
    base = config_hash(parse_job(minimal("madpo_iter")))
    assert config_hash(parse_job({**minimal("madpo_iter"), "run_name": "x", "output_dir": "/elsewhere"})) == base


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


def test_a_stored_job_does_not_warn_about_options_it_holds() -> None:
    # run.json and Prefect parameters hold every option: the no-effect notices were given when the run started.
    with pytest.warns(UserWarning, match="discount=1.0 has no effect"):
        job = parse_job({**minimal("madpo_iter"), "discount": 1.0})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert parse_job(job.model_dump(mode="json")) == job
        assert MADPOIterJob.model_validate(job.model_dump(mode="json")) == job
        parse_job({**minimal("madpo_iter"), "discount": 1.0}, warn=False)


def test_madpo_config_direct_construction_warns() -> None:
    with pytest.warns(UserWarning, match="reference-free"):
        MADPOConfig(reference_kl_enabled=True)


@pytest.mark.parametrize("trainer", MARLHF)
def test_marlhf_reference_kl_does_not_warn(trainer: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parse_job({**minimal(trainer), "reference_kl_enabled": True})


def test_direct_construction_checks_rules() -> None:
    with pytest.raises(ConfigError, match="num_turns: got 2; must be 1"):
        MARLHFIterConfig(num_turns=2)
    with pytest.raises(ValidationError, match="num_turns: got 2; must be 1"):  # Prefect validates this way
        MARLHFIterConfig.model_validate({"num_turns": 2})
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


@pytest.mark.parametrize(
    ("trainer", "expected"), [("madpo", False), ("marlhf", False), ("madpo_iter", True), ("marlhf_iter", True)]
)
def test_is_iterative(trainer: str, expected: bool) -> None:
    assert is_iterative(trainer) is expected


def test_is_iterative_unknown_name() -> None:
    with pytest.raises(ConfigError, match="allowed: madpo, marlhf, madpo_iter, marlhf_iter"):
        is_iterative("madpo-iter")


# docs/guides/configuration.md#configuration's option table, transcribed: which trainers have each option.
SPEC_COMMON = {
    "num_agents",
    "num_turns",
    "joint_mode",
    "preference_num_candidates",
    "pair_selection",
    "preference_pairs_per_sample",
    "dpo_beta",
    "num_train_epochs",
    "agent_learning_rate",
    "train_batch_size",
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "eval_interval",
    "eval_num_samples",
    "max_grad_norm",
    "reward_func",
    "reward_processor",
    "reference_kl_enabled",
    "reference_kl_coef",
    "reference_devices",
}
SPEC_ITERATIVE = {
    "num_iterations",
    "comparator_policy",
    "comparator_history_k",
    "comparator_model_name",
    "comparator_agents",
    "comparator_devices",
    "comparator_num_candidates",
    "comparator_generation_mode",
    "comparator_centralized_agent_index",
    "comparator_api_format",
    "comparator_api_url",
    "comparator_api_model",
    "comparator_api_key_env",
    "comparator_api_response_field",
    "comparator_api_timeout",
    "comparator_api_max_concurrency",
    "preference_replay_mode",
    "preference_replay_k",
    "preference_replay_lambda",
    "preference_replay_sample_size",
    "preference_replay_dir",
}
SPEC_MARLHF = {
    "reward_model_name",
    "reward_learning_rate",
    "reward_num_train_epochs",
    "reward_train_batch_size",
    "reward_max_length",
    "reward_freeze_backbone",
    "rl_algorithm",
    "num_generations",
    "critic_model_name",
    "critic_learning_rate",
    "value_loss_coef",
    "value_clip_range",
}
# Issue #17: every other option of the reference's configs (notes/reference-library.md §2, CoMLRL 85a6f8e).
SPEC_COMMON |= {
    "logging_steps",
    "collaboration_mode",
    "parallel_training",
    "discount",
    "early_termination_threshold",
    "external_prompt_passthrough",
    "eval_batch_size",
    "rollout_buffer_size",
    "advantage_normalization",
    "advantage_mode",
    "use_environment_step",
    "environment_steps_per_pair",
}
SPEC_ITERATIVE |= {
    "log_reward_distribution",
    "policy_checkpoint_dir",
    "comparator_api_max_n_per_request",
    "comparator_api_headers",
    "comparator_api_key_header",
    "comparator_api_key_prefix",
    "comparator_api_extra_body",
}
# pbrl's own option (issue #12): the pluggable parser of centralized responses (comparator generation, and the
# one actor of collaboration_mode: centralized in every trainer).
SPEC_COMMON |= {"comparator_centralized_adapter"}
SPEC_MARLHF |= {
    "reward_model_device",
    "critic_devices",
    "use_separate_critic",
    "critic_type",
    "critic_value_head_hidden_dim",
    "value_head_hidden_dim",
}
# pbrl's own option (issue #30): what the reward model's head reads (the reference's is the last token).
SPEC_MARLHF |= {"reward_pooling"}
# pbrl's own option (issue #30): the reward model reads an intermediate layer at a fraction of the cost.
SPEC_MARLHF |= {"reward_backbone_layers"}
# pbrl's own option (issue #30): the head reads each agent's principal components, which carry to unseen items.
SPEC_MARLHF |= {"reward_head_components", "reward_prompt_overlap"}
# pbrl's own options (issue #51): preferences from a pairwise judge (pbrl/config/judge_fields.py), every trainer.
SPEC_COMMON |= {
    "preference_source", "judge", "judge_label_noise", "judge_bt_temperature", "judge_position_swap",
    "judge_swap_disagreement", "judge_tie_margin", "judge_timeout", "judge_max_pairs", "judge_pair_choice",
    "judge_label_batch_size",
    "judge_label_timeout_hours", "judge_label_timeout_policy", "judge_model", "judge_prompt_template",
    "judge_batch_size", "judge_api_format", "judge_api_url", "judge_api_key_env", "judge_api_key_header",
    "judge_api_key_prefix", "judge_api_headers", "judge_api_extra_body", "judge_api_response_field",
    "judge_api_max_tokens", "judge_api_timeout", "judge_api_max_concurrency", "judge_api_max_tokens_per_round",
}  # fmt: skip
SPEC_OPTIONS = {
    "madpo": SPEC_COMMON,
    "marlhf": SPEC_COMMON | SPEC_MARLHF,
    "madpo_iter": SPEC_COMMON | SPEC_ITERATIVE,
    "marlhf_iter": SPEC_COMMON | SPEC_ITERATIVE | SPEC_MARLHF | {"preference_scoring_reward"},
}
SPEC_RUN_FIELDS = {
    "trainer",
    "seed",
    "run_name",
    "output_dir",
    "task",
    "train_dataset",
    "formatters",
    "agent_model",
    "agents",
    "lora_r",
    "lora_alpha",
    "lora_target_modules",
    "agent_devices",
}


@pytest.mark.parametrize("trainer", TRAINERS)
def test_trainer_options_are_spec_section_2s(trainer: str) -> None:
    assert set(TRAINER_CONFIGS[trainer].model_fields) == SPEC_OPTIONS[trainer]
    job = parse_job(minimal(trainer))
    assert type(job) is JOB_CLASSES[trainer] and job.trainer == trainer
    assert set(type(job).model_fields) == SPEC_OPTIONS[trainer] | RUN_FIELDS


def test_run_fields_cover_spec_section_2() -> None:
    assert SPEC_RUN_FIELDS <= RUN_FIELDS
    assert not RUN_FIELDS & set().union(*SPEC_OPTIONS.values())
    trainers = importlib.import_module(
        "pbrl.trainers"
    )  # docs/guides/configuration.md#configuration: the configs are importable from pbrl.trainers
    assert {t: getattr(trainers, c.__name__) for t, c in TRAINER_CONFIGS.items()} == TRAINER_CONFIGS


def test_field_descriptions_say_what_none_and_the_range_mean() -> None:
    schema = MADPOJob.model_json_schema()["properties"]
    assert "<trainer>-<UTC time YYYYmmdd-HHMMSS>" in schema["run_name"]["description"]
    assert (schema["temperature"]["minimum"], schema["temperature"]["maximum"]) == (0.0001, 100)
    assert "[1e-4, 100]" in schema["temperature"]["description"]


def test_a_key_given_twice_is_an_error_not_the_last_one_winning(tmp_path):
    """Issue #29: duplicate YAML keys were accepted, the last one winning."""
    path = tmp_path / "dup.yaml"
    path.write_text("trainer: madpo_iter\ntask: toy\nagent_model: m\ndpo_beta: 0.1\ndpo_beta: 0.5\n")
    with pytest.raises(ConfigError, match=r"line 5, column 1: found duplicate key 'dpo_beta' \(first at line 4\)"):
        load_job(path)
    nested = tmp_path / "nested.yaml"
    nested.write_text("trainer: madpo_iter\ntask: toy\nagent_model: m\ntask_options: {num_items: 2, num_items: 3}\n")
    with pytest.raises(ConfigError, match="duplicate key 'num_items'"):
        load_job(nested)
    ok = tmp_path / "ok.yaml"
    ok.write_text("trainer: madpo_iter\ntask: toy\nagent_model: m\n")
    with pytest.raises(ConfigError, match="duplicate key 'a'"):
        load_job(ok, ["task_options={a: 1, a: 2}"])
