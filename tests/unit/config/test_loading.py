"""Jobs from YAML files and overrides, from config objects (make_job, direct construction), their config_hash,
frozen models and the warnings a job gives once."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from pbrl.config import (
    MADPOConfig,
    MADPOIterJob,
    MADPOJob,
    MARLHFConfig,
    MARLHFIterConfig,
    MARLHFIterJob,
    MARLHFJob,
    RunConfig,
    config_hash,
    is_iterative,
    load_job,
    make_job,
    parse_config,
    parse_job,
    parse_override,
    split_job,
)
from pbrl.errors import ConfigError
from tests.unit.config.helpers import MARLHF, minimal


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
