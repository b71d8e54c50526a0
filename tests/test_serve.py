"""Deployments for the Prefect UI (issue #13): the per-trainer forms generated from the config models, the
config-file flow (same validation and run folder as ``pbrl train``) and run-keyed artifacts.

The browser side (the forms as the UI renders them, a run submitted from one) is ``test_ui_browser.py``.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.artifacts import artifact_key
from flows.ui import OTHER, TRAINER_FLOWS, config_file, form_signature, group_of
from pbrl.cli import app
from pbrl.config import JOB_CLASSES

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("option", "group"),
    [
        ("seed", "run"),
        ("reward_func", "run"),  # named exactly, before the reward_* pattern
        ("agent_model", "agents"),
        ("lora_r", "agents"),
        ("preference_num_candidates", "collection"),
        ("top_k", "collection"),
        ("comparator_api_url", "comparator"),
        ("preference_replay_lambda", "replay"),
        ("num_iterations", "training"),
        ("agent_learning_rate", "training"),
        ("reward_learning_rate", "reward model and RL"),
        ("critic_type", "reward model and RL"),
        ("eval_interval", "evaluation"),
        ("an_option_added_later", OTHER),
    ],
)
def test_every_option_has_a_form_section(option, group):
    assert group_of(option) == group


@pytest.mark.parametrize("trainer", sorted(JOB_CLASSES))
def test_form_has_every_option_of_its_trainer_once_in_a_named_section(trainer):
    params = form_signature(trainer).parameters
    options = set(JOB_CLASSES[trainer].model_fields) - {"trainer"}
    assert set(params) == options | {"resume"}
    assert [n for n in options if group_of(n) == OTHER] == [], "add these options to flows.ui.GROUPS"
    sections = [group_of(n) for n in params if n != "resume"]
    assert sections == sorted(
        sections,
        key=[
            "run",
            "agents",
            "collection",
            "comparator",
            "replay",
            "training",
            "reward model and RL",
            "evaluation",
        ].index,
    )  # one block each


def test_iterative_and_base_forms_differ_as_their_trainers_do():
    assert "num_iterations" in form_signature("madpo_iter").parameters
    assert "num_iterations" not in form_signature("madpo").parameters
    assert "rl_algorithm" in form_signature("marlhf_iter").parameters
    assert "rl_algorithm" not in form_signature("madpo_iter").parameters


def test_form_schema_renders_each_option_as_a_typed_field():
    from prefect.utilities.callables import parameter_schema

    schema = parameter_schema(TRAINER_FLOWS["madpo_iter"].fn).model_dump_for_openapi()
    props = schema["properties"]
    assert schema.get("required", []) == []  # every field has its default
    assert props["num_iterations"] == {
        "default": 6,
        "description": "Rounds of collect -> store -> replay -> learn.",
        "minimum": 1,
        "position": props["num_iterations"]["position"],
        "title": "training: num_iterations",
        "type": "integer",
    }
    assert props["preference_replay_mode"]["enum"] == ["current", "nearest_k", "all_history", "lambda_decay"]
    assert props["preference_replay_mode"]["default"] == "current"
    assert props["train_batch_size"]["anyOf"] == [{"minimum": 1, "type": "integer"}, {"type": "null"}]
    assert props["dpo_beta"]["exclusiveMinimum"] == 0 and props["dpo_beta"]["default"] == 0.1
    assert props["task_options"]["default"] == {} and props["task_options"]["type"] == "object"
    assert props["resume"]["default"] is False and props["resume"]["title"] == "run: resume"
    assert props["seed"]["position"] == 0  # the run section first
    assert props["seed"]["position"] < props["agent_model"]["position"] < props["comparator_policy"]["position"]


@pytest.mark.parametrize(
    ("kind", "run_name", "key"),
    [
        ("round-metrics", "demo", "round-metrics-demo"),
        ("round-summary", "tiny-madpo-iter", "round-summary-tiny-madpo-iter"),
        ("round-report", "Run_1", "round-report-run-1-f3a089d7"),  # sha256("Run_1")[:8]
        ("round-metrics", "tiny.v2", "round-metrics-tiny-v2-8d6910ff"),
    ],
)
def test_artifact_keys_name_the_run(kind, run_name, key):
    assert artifact_key(kind, run_name) == key


def test_artifact_keys_of_look_alike_runs_differ():
    assert artifact_key("round-metrics", "run-1") == "round-metrics-run-1"
    assert artifact_key("round-metrics", "Run_1") != "round-metrics-run-1"


def test_config_path_falls_back_to_the_checkout(tmp_path, monkeypatch):
    from flows.ui import config_path

    monkeypatch.chdir(tmp_path)
    assert config_path("flows/configs/tiny-madpo.yaml") == ROOT / "flows" / "configs" / "tiny-madpo.yaml"
    (tmp_path / "flows" / "configs").mkdir(parents=True)
    (tmp_path / "flows" / "configs" / "tiny-madpo.yaml").write_text("trainer: madpo\n")
    assert config_path("flows/configs/tiny-madpo.yaml") == Path("flows/configs/tiny-madpo.yaml")  # as given
    assert config_path("missing.yaml") == Path("missing.yaml")


# ------------------------------------------------------------------------------------------ with Prefect
flow_tests = pytest.mark.usefixtures("prefect_api")


@pytest.mark.flow
@flow_tests
def test_deployments_register_with_forms_that_the_server_enforces():
    from prefect.client.orchestration import get_client

    from tests.helpers import register_deployments

    ids = register_deployments()
    assert set(ids) == {
        "pbrl-train/madpo",
        "pbrl-train/madpo-iter",
        "pbrl-train/marlhf",
        "pbrl-train/marlhf-iter",
        "pbrl-train/config-file",
        "pbrl-train/train",
    }
    with get_client(sync_client=True) as client:
        form = client.read_deployment(ids["pbrl-train/madpo-iter"])
        assert form.entrypoint.endswith("flows/ui.py:madpo_iter")
        props = form.parameter_openapi_schema["properties"]
        assert props["num_iterations"]["description"] == "Rounds of collect -> store -> replay -> learn."
        client.create_flow_run_from_deployment(form.id, parameters={"num_iterations": 2, "task": "toy"})
        for bad in ({"num_iterations": 0}, {"preference_replay_mode": "td-lambda"}, {"dpo_beta": "high"}):
            with pytest.raises(Exception, match="(?i)validation"):
                client.create_flow_run_from_deployment(form.id, parameters=bad)
        file_form = client.read_deployment(ids["pbrl-train/config-file"])
        assert file_form.parameter_openapi_schema["required"] == ["config"]


def _validate_message(tmp_path: Path, config: Path, overrides: list[str]) -> str:
    args = ["validate", str(config)] + [a for o in overrides for a in ("--set", o)]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 2, out.output
    text = out.output.split("error: ", 1)[1].strip()
    assert "configuration problem" in text
    return text


@pytest.mark.flow
@flow_tests
def test_config_file_flow_rejects_a_config_with_the_messages_of_pbrl_validate(tmp_path):
    config = ROOT / "flows" / "configs" / "tiny-madpo-iter.yaml"
    overrides = ["preference_replay_mode=td-lambda", "dpo_beta=0", "dpo_betta=0.2"]
    expected = _validate_message(tmp_path, config, overrides)
    state = config_file(config=str(config), overrides=overrides, return_state=True)
    assert state.is_failed()
    assert expected in state.message, (expected, state.message)
    for line in ("preference_replay_mode: got 'td-lambda'", "dpo_beta", "did you mean 'dpo_beta'"):
        assert line in state.message


@pytest.mark.flow
@flow_tests
def test_trainer_form_rejects_broken_rules_with_the_messages_of_pbrl_validate(tmp_path):
    config = tmp_path / "form.yaml"
    config.write_text("trainer: madpo_iter\ntask: toy\npreference_replay_mode: nearest_k\n")
    expected = _validate_message(tmp_path, config, [])
    state = TRAINER_FLOWS["madpo_iter"](
        task="toy", preference_replay_mode="nearest_k", output_dir=str(tmp_path), return_state=True
    )
    assert state.is_failed()
    assert expected.splitlines()[1:] == [line for line in state.message.splitlines() if line.startswith("  - ")]
    assert list(tmp_path.iterdir()) == [config]  # nothing was created
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:  # no run_name: the run is named <trainer>-<UTC time>
        name = client.read_flow_run(state.state_details.flow_run_id).name
    assert re.fullmatch(r"madpo_iter-\d{8}-\d{6}", name), name


def _files(run_dir: Path) -> dict[str, str]:
    """sha256 of every data file of a run (Parquet tables and safetensors weights), by relative path; not
    metrics.parquet, which holds each stage's wall-clock seconds."""
    return {
        str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run_dir.rglob("*"))
        if p.suffix in (".parquet", ".safetensors") and p.name != "metrics.parquet"
    }


@pytest.mark.flow
@flow_tests
def test_config_file_flow_gives_the_run_folder_of_pbrl_train(tiny_model_dir, tmp_path):
    config = "flows/configs/tiny-madpo.yaml"  # as a user types it; found in the checkout
    small = [
        f"agent_model={tiny_model_dir}",
        "num_train_epochs=1",
        "max_new_tokens=6",
        "eval_num_samples=2",
        "preference_num_candidates=3",
        "task_options={num_items: 3}",
    ]
    out = CliRunner().invoke(
        app,
        [
            "train",
            str(ROOT / config),
            "--set",
            f"output_dir={tmp_path / 'cli'}",
            *[a for o in small for a in ("--set", o)],
        ],
    )
    assert out.exit_code == 0, out.output
    result = config_file(config=config, overrides=[*small, f"output_dir={tmp_path / 'ui'}"])
    cli_run, ui_run = tmp_path / "cli" / "tiny-madpo", tmp_path / "ui" / "tiny-madpo"
    assert Path(result["run_dir"]) == ui_run
    cli_json, ui_json = (json.loads((d / "run.json").read_text()) for d in (cli_run, ui_run))
    assert ui_json["config"] == cli_json["config"] and ui_json["config_hash"] == cli_json["config_hash"]
    assert ui_json["config"]["run_name"] == "tiny-madpo" and ui_json["config"]["num_train_epochs"] == 1
    assert _files(ui_run) == _files(cli_run) and "rounds/0001/pairs.parquet" in _files(ui_run)
