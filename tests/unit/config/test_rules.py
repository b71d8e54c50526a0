"""The configuration rules (docs/guides/configuration.md#configuration): one bad value gives one problem naming
its field, each missing part of a task source is named, and every allowed combination constructs."""

from __future__ import annotations

import pytest

from pbrl.config import JOB_CLASSES, TRAINER_CONFIGS, make_job, parse_job, split_job
from tests.unit.config.helpers import SECRET, minimal, problems_of

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


def test_task_source_names_each_missing_part() -> None:
    problems = problems_of({**minimal("madpo"), "task": None, "train_dataset": "items.jsonl"})
    assert [p.field for p in problems] == ["formatters", "reward_func"]


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
