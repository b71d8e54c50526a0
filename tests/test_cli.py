"""The command line: help, validate (every problem at once, exit code 2), models, bad inputs."""

from __future__ import annotations

import subprocess
import sys

from typer.testing import CliRunner

from pbrl.cli import app

runner = CliRunner()


def test_help_lists_every_command():
    out = runner.invoke(app, ["--help"])
    assert out.exit_code == 0
    for command in ("train", "validate", "stage", "status", "serve", "models", "report"):
        assert command in out.output


def test_help_does_not_import_torch_or_prefect():
    code = "import sys; from pbrl.cli import app; print('torch' in sys.modules, 'prefect' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_validate_ok(tmp_path):
    cfg = tmp_path / "ok.yaml"
    cfg.write_text("trainer: madpo_iter\ntask: toy\nagent_model: tiny-random\n")
    out = runner.invoke(app, ["validate", str(cfg)])
    assert out.exit_code == 0 and "OK" in out.output


def test_validate_prints_all_three_mistakes_and_exits_2(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(
        "trainer: madpo_iter\ntask: toy\nagent_model: tiny-random\n"
        "preference_replay_mode: td-lambda\n"  # an alias the reference accepts; we do not
        "dpo_beta: 0\n"
        "num_turns: 2\n"
    )
    out = runner.invoke(app, ["validate", str(cfg)])
    assert out.exit_code == 2
    text = out.output
    for field in ("preference_replay_mode", "dpo_beta", "num_turns"):
        assert field in text, field
    assert "3 configuration problem" in text


def test_validate_set_override_is_checked_too(tmp_path):
    cfg = tmp_path / "ok.yaml"
    cfg.write_text("trainer: madpo_iter\ntask: toy\nagent_model: tiny-random\n")
    out = runner.invoke(app, ["validate", str(cfg), "--set", "top_p=1.5", "--set", "no_such_option=1"])
    assert out.exit_code == 2 and "top_p" in out.output and "no_such_option" in out.output


def test_train_without_config_or_run_is_a_clear_error():
    out = runner.invoke(app, ["train"])
    assert out.exit_code == 2 and "CONFIG" in out.output


def test_stage_rejects_unknown_stage_and_non_run_folder(tmp_path):
    out = runner.invoke(app, ["stage", "no-such-stage", "--run", str(tmp_path), "--round", "1"])
    assert out.exit_code == 2 and "unknown stage" in out.output
    out = runner.invoke(app, ["stage", "build-pairs", "--run", str(tmp_path), "--round", "1"])
    assert out.exit_code == 2 and "not a run folder" in out.output


def test_models_list_names_the_packaged_models():
    out = runner.invoke(app, ["models", "list"])
    assert out.exit_code == 0 and "smollm2-135m-instruct" in out.output and "tiny-random" in out.output


def test_validate_checks_what_training_needs(tmp_path):
    cfg = tmp_path / "paths.yaml"
    cfg.write_text(
        "trainer: madpo_iter\nagent_model: /no/such/model\n"
        f"train_dataset: {tmp_path / 'missing.jsonl'}\n"
        "formatters: ['tests.helpers:short_prompt', 'tests.helpers:long_prompt']\n"
        "reward_func: 'no_such_module:reward'\n"
    )
    out = runner.invoke(app, ["validate", str(cfg)])
    assert out.exit_code == 2
    for field in ("agent_model", "train_dataset", "reward_func"):
        assert field in out.output, field


def test_stage_round_must_exist(tiny_model_dir, tmp_path):
    from tests.helpers import new_run

    run_dir, _ = new_run(tiny_model_dir, tmp_path)  # 2 rounds
    for bad in ("5", "-1", "0"):
        out = runner.invoke(app, ["stage", "build-pairs", "--run", str(run_dir), "--round", bad])
        assert out.exit_code == 2 and "--round" in out.output, bad
    assert not (run_dir / "rounds").exists()
