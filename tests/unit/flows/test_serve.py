"""Deployments for the Prefect UI (issue #13): the per-trainer forms generated from the config models, the
config-file flow (same validation and run folder as ``pbrl train``) and run-keyed artifacts.

The browser side (the forms as the UI renders them, a run submitted from one) is ``tests/browser/test_ui.py``.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.artifacts import artifact_key
from flows.ui import TRAINER_FLOWS, config_file, form_job
from flows.ui_form import (
    MAIN,
    OTHER,
    SECTIONS,
    TASK_NOTE,
    form_defaults,
    form_layout,
    form_schema,
    hidden_options,
    one_value,
)
from pbrl.cli.commands import app
from pbrl.config import JOB_CLASSES, load_job, parse_job
from pbrl.config.notices import NO_EFFECT_MADPO, NO_EFFECT_MARLHF
from pbrl.errors import ConfigError
from pbrl.models.packaged import PACKAGED_MODELS
from pbrl.tasks.registry import task_names

ROOT = Path(__file__).resolve().parents[3]
TRAINERS = sorted(JOB_CLASSES)


# ------------------------------------------------------------------------------------------ the forms
@pytest.mark.parametrize("trainer", TRAINERS)
def test_every_option_of_a_trainer_is_in_its_form_once_or_hidden_with_a_reason(trainer):
    layout, hidden = form_layout(trainer), hidden_options(trainer)
    placed = [n for options in layout.values() for n in options]
    assert OTHER.name not in layout, f"place {layout.get(OTHER.name)} in a section of flows.ui_form.SECTIONS"
    assert len(placed) == len(set(placed)) and not set(placed) & set(hidden)
    assert set(placed) | set(hidden) == set(JOB_CLASSES[trainer].model_fields)
    assert all(why for why in hidden.values())


@pytest.mark.parametrize("trainer", TRAINERS)
def test_a_form_has_no_option_that_cannot_change_or_changes_nothing(trainer):
    shown = {n for options in form_layout(trainer).values() for n in options}
    no_effect = NO_EFFECT_MARLHF if trainer.startswith("marlhf") else NO_EFFECT_MADPO
    never = {"num_turns", "advantage_mode", "trainer", "run_name"}
    fixed = {
        n for n, f in JOB_CLASSES[trainer].model_json_schema()["properties"].items() if len(f.get("enum", [])) == 1
    }
    assert not shown & (set(no_effect) | never | fixed)
    if trainer.startswith("madpo"):  # MADPO is reference-free and learns from pairs: no KL, no advantages
        assert not {n for n in shown if n.startswith(("reference_", "advantage_"))}
    else:  # MARLHF: only decentralized agents, and dpo_beta is MADPO's
        assert not shown & {"collaboration_mode", "dpo_beta"}


def test_an_option_of_one_value_is_not_offered():
    assert one_value({"enum": ["aligned"], "type": "string", "default": "aligned"})
    assert not one_value({"enum": ["aligned", "cross"], "type": "string"})
    assert not one_value({"anyOf": [{"enum": ["a"], "type": "string"}, {"type": "null"}]})  # a value or None
    assert not one_value({"type": "integer"})


def test_iterative_and_base_forms_differ_as_their_trainers_do():
    assert "num_iterations" in form_layout("madpo_iter")["main"]
    assert "num_iterations" not in form_layout("madpo")["main"]
    assert {"comparator", "api_comparator", "replay"} <= set(form_layout("marlhf_iter"))
    assert not {"comparator", "api_comparator", "replay", "reward_model", "rl"} & set(form_layout("madpo"))
    assert "rl_algorithm" in form_layout("marlhf_iter")["main"] and "dpo_beta" not in form_layout("marlhf_iter")["main"]
    assert form_layout("madpo_iter")["api_comparator"] == tuple(
        n for n in JOB_CLASSES["madpo_iter"].model_fields if n.startswith("comparator_api_")
    )  # the API comparator's options, all of them, in a group of their own


def test_the_options_every_run_needs_come_first_and_are_required():
    from prefect.utilities.callables import parameter_schema

    schema = parameter_schema(TRAINER_FLOWS["madpo_iter"].fn).model_dump_for_openapi()
    props = schema["properties"]
    main = ["task", "agent_model", "num_iterations", "preference_num_candidates", "max_new_tokens"]
    assert schema["required"][:5] == main and set(schema["required"]) == set(form_layout("madpo_iter")["main"])
    assert sorted(props, key=lambda n: props[n]["position"])[:5] == main
    assert props["task"]["anyOf"] == [
        {"type": "string", "enum": task_names(), "title": "registered"},
        {"type": "string", "minLength": 1, "title": "other"},
    ]
    assert props["task"]["description"] == TASK_NOTE
    assert (
        props["agent_model"]["anyOf"][0]["enum"] == sorted(PACKAGED_MODELS) == ["smollm2-135m-instruct", "tiny-random"]
    )
    assert props["agent_model"]["anyOf"][1] == {"type": "string", "minLength": 1, "title": "folder or hub id"}
    assert props["num_iterations"] == {
        "description": "Rounds of collect -> store -> replay -> learn.",
        "minimum": 1,
        "position": 2,
        "title": "num_iterations",
        "type": "integer",
    }
    assert form_defaults("madpo_iter") == {
        "num_iterations": 6,
        "preference_num_candidates": 20,
        "max_new_tokens": 256,
        "num_train_epochs": 1,
        "agent_learning_rate": 5e-6,
        "dpo_beta": 0.1,
    }  # the deployment's parameters: a new form shows them


def test_sections_are_groups_at_their_defaults_until_changed():
    schema = form_schema("madpo_iter")
    assert [n for n in schema if n not in MAIN] == [s.name for s in SECTIONS if s.name in form_layout("madpo_iter")]
    defaults, change = schema["replay"]["anyOf"]
    # no "const": the V1 UI shows a const section as "... is a const and cannot be changed", without its tabs
    assert defaults == {"type": "object", "properties": {}, "additionalProperties": False, "title": "defaults"}
    assert schema["replay"]["description"] == (
        "Which stored rounds' pairs train each round. "
        "At the defaults: preference_replay_mode current; the others empty."
    )
    listed = schema["collection"]["description"]  # every default, none cut off
    assert all(f"{n} " in listed for n in ("temperature", "pair_selection", "tie_tolerance")) and "..." not in listed
    assert change["title"] == "change" and list(change["properties"]) == list(form_layout("madpo_iter")["replay"])
    mode = change["properties"]["preference_replay_mode"]
    assert mode["enum"] == ["current", "nearest_k", "all_history", "lambda_decay"] and mode["default"] == "current"


def _schemas(value):
    if isinstance(value, dict):
        yield value
        for v in value.values():
            yield from _schemas(v)
    elif isinstance(value, list):
        for v in value:
            yield from _schemas(v)


@pytest.mark.parametrize("trainer", TRAINERS)
def test_no_field_offers_none_where_empty_means_the_default(trainer):
    """An option whose default is None is an empty field (the UI shows 'Property is type "None"' for a None
    choice); an option with another default keeps None as a choice where it means something (top_k: no cut)."""
    model = JOB_CLASSES[trainer]
    takes_none = {n for n, f in model.model_json_schema()["properties"].items() if '"null"' in json.dumps(f)}
    for section in form_schema(trainer).values():
        for branch in section.get("anyOf", []):
            for name, field in branch.get("properties", {}).items():
                offers_none = any(s.get("type") == "null" for s in _schemas(field))
                default = model.model_fields[name].get_default(call_default_factory=True)
                assert offers_none == (default is not None and name in takes_none), name
                assert field.get("default", "unset") is not None, name
    collection = form_schema(trainer)["collection"]["anyOf"][1]["properties"]
    assert {"type": "null"} in collection["top_k"]["anyOf"] and collection["top_k"]["default"] == 50


def test_descriptions_keep_their_placeholders_in_both_uis():
    replay = form_schema("madpo_iter")["replay"]["anyOf"][1]["properties"]
    assert replay["preference_replay_dir"]["description"].endswith("None = ‹run›/replay.")
    assert "<" not in json.dumps(form_schema("marlhf_iter")).replace("<=", "")


def _values(trainer: str, **given):
    return {**form_defaults(trainer), **given}


def test_a_form_maps_to_the_flat_job_a_config_file_holds(tmp_path):
    values = _values(
        "madpo_iter",
        task="toy",
        agent_model="tiny-random",
        num_iterations=3,
        run={"seed": 7, "task_options": {"num_items": 4}, "output_dir": "storage/runs"},
        collection={"temperature": 1.0, "top_k": None, "pair_selection": "comparator_reward"},
        replay={"preference_replay_mode": "lambda_decay", "preference_replay_lambda": 0.5},
        api_comparator={},
    )
    flat = form_job("madpo_iter", "form-run", values)
    assert flat == {
        "trainer": "madpo_iter",
        "run_name": "form-run",
        "task": "toy",
        "agent_model": "tiny-random",
        "num_iterations": 3,
        "seed": 7,
        "task_options": {"num_items": 4},
        "temperature": 1.0,
        "top_k": None,
        "preference_replay_mode": "lambda_decay",
        "preference_replay_lambda": 0.5,
    }  # values equal to their defaults are left out, as a config file leaves them out
    config = tmp_path / "same.yaml"
    config.write_text(
        "trainer: madpo_iter\nrun_name: form-run\ntask: toy\nagent_model: tiny-random\nnum_iterations: 3\n"
        "seed: 7\ntask_options: {num_items: 4}\ntemperature: 1.0\ntop_k: null\n"
        "preference_replay_mode: lambda_decay\npreference_replay_lambda: 0.5\n"
    )
    assert parse_job(flat) == load_job(config)
    assert form_job("madpo_iter", "x", {"task": "toy", "run": {"task_options": {}, "seed": 0}}) == {
        "trainer": "madpo_iter",
        "run_name": "x",
        "task": "toy",
    }


def test_a_form_with_a_misplaced_value_says_so():
    with pytest.raises(ConfigError) as err:
        form_job("madpo_iter", "x", {"task": "toy", "run": "seed=1", "replay": {"task": "toy"}})
    assert [p.field for p in err.value.problems] == ["run", "task"]
    flat = form_job("madpo_iter", "x", {"task": "toy", "training": {"logging_step": 5}})
    with pytest.raises(ConfigError, match="did you mean 'logging_steps'"):
        parse_job(flat)


@pytest.mark.parametrize(
    ("kind", "run_name", "key"),
    [
        ("round-table", "demo", "round-table-demo"),
        ("round-summary", "tiny-madpo-iter", "round-summary-tiny-madpo-iter"),
        ("round-report", "Run_1", "round-report-run-1-f3a089d7"),  # sha256("Run_1")[:8]
        ("round-table", "tiny.v2", "round-table-tiny-v2-8d6910ff"),
    ],
)
def test_artifact_keys_name_the_run(kind, run_name, key):
    assert artifact_key(kind, run_name) == key


def test_artifact_keys_of_look_alike_runs_differ():
    assert artifact_key("round-table", "run-1") == "round-table-run-1"
    assert artifact_key("round-table", "Run_1") != "round-table-run-1"


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
        "pbrl-train/continue",
        "pbrl-train/train",
    }
    with get_client(sync_client=True) as client:
        form = client.read_deployment(ids["pbrl-train/madpo-iter"])
        assert form.entrypoint.endswith("flows/ui.py:madpo_iter")
        assert form.parameters == form_defaults("madpo_iter")  # what a new form shows
        schema = form.parameter_openapi_schema
        assert schema["required"] == list(form_layout("madpo_iter")["main"])
        assert schema["properties"]["replay"]["anyOf"] == form_schema("madpo_iter")["replay"]["anyOf"]
        good = {"task": "toy", "agent_model": "tiny-random", "replay": {"preference_replay_mode": "nearest_k"}}
        client.create_flow_run_from_deployment(form.id, parameters=good)
        client.create_flow_run_from_deployment(form.id, parameters={**good, "agent_model": "/models/mine"})
        for bad in (
            {"task": "toy"},  # agent_model is required
            {**good, "num_iterations": 0},
            {**good, "replay": {"preference_replay_mode": "td-lambda"}},
            {**good, "dpo_beta": "high"},
            {**good, "collection": {"top_k": 0}},
        ):
            with pytest.raises(Exception, match="(?i)validation"):
                client.create_flow_run_from_deployment(form.id, parameters=bad)
        client.create_flow_run_from_deployment(form.id, parameters={**good, "run": {"seed": 3}})  # a changed section
        file_form = client.read_deployment(ids["pbrl-train/config-file"])
        assert file_form.parameter_openapi_schema["required"] == ["config"]
        again = client.read_deployment(ids["pbrl-train/continue"])
        assert again.parameter_openapi_schema["required"] == ["run_name"]
        rounds = again.parameter_openapi_schema["properties"]["num_iterations"]
        assert rounds["type"] == "integer" and "default" not in rounds  # a null default the form would submit
        # an optional field left empty: the form sends null, which the server takes (issue #54: it refused it)
        client.create_flow_run_from_deployment(again.id, parameters={"run_name": "r", "num_iterations": None})
        client.create_flow_run_from_deployment(file_form.id, parameters={"config": "c.yaml", "run_name": None})
        with pytest.raises(Exception, match="(?i)validation"):
            client.create_flow_run_from_deployment(again.id, parameters={"run_name": "r", "num_iterations": 0})


def test_the_nightly_schedule_names_its_time_zone():
    from flows.serve import build_deployments, schedule_words

    assert schedule_words("0 2 * * *") == "every day at 02:00 UTC"
    assert schedule_words("30 23 * * *") == "every day at 23:30 UTC"
    assert schedule_words("0 2 * * 1") == "cron '0 2 * * 1' in UTC"
    nightly = {d.name: d for d in build_deployments(nightly_run="demo")}["nightly"]
    schedule = nightly.schedules[0]
    assert schedule.slug == "every day at 02:00 UTC" and schedule.schedule.timezone == "UTC"  # the V1 card shows it
    assert "every day at 02:00 UTC" in nightly.description  # V2's card shows no zone: its Description tab does


def _validate_message(tmp_path: Path, config: Path, overrides: list[str]) -> str:
    args = ["validate", str(config)] + [a for o in overrides for a in ("--set", o)]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 2, out.output
    text = out.output.split("error: ", 1)[1].strip()
    assert "configuration problem" in text
    return text


def _error_lines(state) -> list[str]:
    from tests.flow.test_ui import run_logs

    return [log.message for log in run_logs(state.state_details.flow_run_id) if log.level >= 40]


@pytest.mark.flow
@flow_tests
def test_config_file_flow_rejects_a_config_with_the_messages_of_pbrl_validate(tmp_path):
    config = ROOT / "flows" / "configs" / "tiny-madpo-iter.yaml"
    overrides = ["preference_replay_mode=td-lambda", "dpo_beta=0", "dpo_betta=0.2"]
    expected = _validate_message(tmp_path, config, overrides)
    state = config_file(config=str(config), overrides=overrides, return_state=True)
    assert state.is_failed() and state.message == "the run did not start: ConfigError, see the run's log"
    assert str(state.result(raise_on_failure=False)) == expected
    assert _error_lines(state) == [f"the run did not start (nothing was computed): {expected}"]  # once, no traceback
    for line in ("preference_replay_mode: got 'td-lambda'", "dpo_beta", "did you mean 'dpo_beta'"):
        assert line in expected


@pytest.mark.flow
@flow_tests
def test_trainer_form_rejects_broken_rules_with_every_message_of_pbrl_validate_once(tmp_path):
    config = tmp_path / "form.yaml"
    config.write_text(
        "trainer: madpo_iter\ntask: toy\nagent_model: tiny-random\n"
        "pair_selection: all\npreference_replay_mode: nearest_k\n"
    )
    expected = _validate_message(tmp_path, config, [])
    assert expected.count("\n  - ") == 2
    state = TRAINER_FLOWS["madpo_iter"](
        **form_defaults("madpo_iter"),
        task="toy",
        agent_model="tiny-random",
        run={"output_dir": str(tmp_path)},
        collection={"pair_selection": "all"},
        replay={"preference_replay_mode": "nearest_k"},
        return_state=True,
    )
    assert state.is_failed()
    assert _error_lines(state) == [f"the run did not start (nothing was computed): {expected}"]
    from tests.flow.test_ui import run_logs

    assert not [log for log in run_logs(state.state_details.flow_run_id) if "Traceback" in log.message]
    assert list(tmp_path.iterdir()) == [config]  # nothing was created
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:  # called from Python: the run is named <trainer>-<UTC time>
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
