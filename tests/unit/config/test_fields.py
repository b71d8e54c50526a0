"""Which options each trainer has, their defaults and their descriptions (docs/guides/configuration.md#configuration):
the option table transcribed, and the schema the Prefect UI form is built from."""

from __future__ import annotations

import importlib
import itertools
import json
from typing import Any

import pytest

from pbrl.config import JOB_CLASSES, RUN_FIELDS, TRAINER_CONFIGS, MADPOJob, RunConfig, job_adapter, parse_job
from tests.unit.config.helpers import ITERATIVE, MARLHF, TRAINERS, minimal

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
    "reward_length_products": False,
    "reward_joint_overlap": False,
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
SPEC_MARLHF |= {"reward_head_components", "reward_prompt_overlap", "reward_length_products"}
# pbrl's own option (issue #55): the head reads the joint response's word overlap with its prompts.
SPEC_MARLHF |= {"reward_joint_overlap"}
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
