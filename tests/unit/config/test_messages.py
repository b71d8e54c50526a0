"""What a configuration error tells the user: the wording of each problem, no silent type conversion, every
problem at once, no aliases of the reference's option names, and no secret echoed back."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from pbrl.config import (
    MADPOConfig,
    MADPOIterConfig,
    MADPOIterJob,
    MARLHFIterConfig,
    MARLHFJob,
    RunConfig,
    job_adapter,
    parse_job,
)
from pbrl.errors import ConfigError
from tests.unit.config.helpers import SECRET, minimal, problems_of


# --------------------------------------------------------------------------- problem wording
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
