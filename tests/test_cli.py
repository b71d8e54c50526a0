"""The command line: help, validate (every problem at once, exit code 2), models, bad inputs, expected errors
as one ``error:`` line, quiet logs."""

from __future__ import annotations

import inspect
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pbrl import errors
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


# ------------------------------------------------------------------------------------------ expected errors


def test_expected_errors_are_every_error_class_of_pbrl_errors():
    defined = {
        obj
        for _, obj in inspect.getmembers(errors, inspect.isclass)
        if issubclass(obj, Exception) and obj.__module__ == errors.__name__
    }
    names = {c.__name__ for c in defined}
    assert {"ConfigError", "ArtifactError", "OracleError", "RewardContractError", "SamplingError"} <= names
    assert set(errors.EXPECTED_ERRORS) == defined  # a class added to pbrl/errors.py must be listed too


def test_expected_error_is_found_behind_a_wrapper():
    art = errors.ArtifactError("runs/x/run.json: file not found")
    try:
        try:
            raise art
        except errors.ArtifactError as inner:
            raise RuntimeError("Task run encountered an exception") from inner
    except RuntimeError as wrapped:
        assert errors.expected_error(wrapped) is art  # explicit cause
    try:
        try:
            raise errors.OracleError("3 of 4 joint responses could not be scored")
        except errors.OracleError:
            raise KeyError("while handling")  # noqa: B904  (implicit context, as in an except block)
    except KeyError as ctx:
        assert isinstance(errors.expected_error(ctx), errors.OracleError)
    assert errors.expected_error(ValueError("a bug")) is None  # ConfigError is a ValueError, not the reverse
    assert errors.expected_error(None) is None


def _record(exc: BaseException | None) -> logging.LogRecord:
    info = (type(exc), exc, None) if exc is not None else None
    return logging.LogRecord("prefect.task_runs", logging.ERROR, __file__, 1, "Task run failed", None, info)


def test_console_filter_drops_prefects_tracebacks_of_expected_errors_and_ctrl_c_only():
    from pbrl.orchestration import QuietExpectedErrors

    keep = QuietExpectedErrors().filter
    for cls in errors.EXPECTED_ERRORS:
        exc = cls([errors.Problem("dpo_beta", 0, "must be > 0")]) if cls is errors.ConfigError else cls("x")
        assert not keep(_record(exc)), cls.__name__
    assert not keep(_record(KeyboardInterrupt()))
    assert keep(_record(ZeroDivisionError("a bug keeps its traceback")))
    assert keep(_record(None))  # plain log lines ("Finished in state Completed()") stay


def test_status_names_a_malformed_manifest_in_one_error_line(tmp_path):
    (tmp_path / "run.json").write_text("{}")
    manifest = tmp_path / "rounds" / "0001" / "build-pairs.manifest.json"
    manifest.parent.mkdir(parents=True)
    manifest.write_text("{not json")
    out = runner.invoke(app, ["status", str(tmp_path)])
    assert out.exit_code == 2, out.output
    assert out.output.count("error:") == 1 and "build-pairs.manifest.json" in out.output
    assert "Traceback" not in out.output


@pytest.mark.parametrize("cron", ["61 2 * * *", "0 2 * *", "every night", "H 2 * * *"])
def test_serve_rejects_a_bad_cron_before_contacting_a_server(cron):
    out = runner.invoke(app, ["serve", "--nightly-run", "docs-1", "--cron", cron])
    assert out.exit_code == 2
    assert "--cron" in out.output and repr(cron) in out.output
    assert "PREFECT_API_URL" not in out.output  # checked before the server (not set in tests) is looked for


def test_serve_accepts_a_good_cron_and_then_needs_a_server():
    out = runner.invoke(app, ["serve", "--nightly-run", "docs-1", "--cron", "30 1 * * 1-5"])
    assert out.exit_code == 2 and "PREFECT_API_URL is not set" in out.output and "--cron" not in out.output


# ------------------------------------------------------------------------------ `pbrl train` in a subprocess

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "flows" / "configs" / "tiny-madpo-iter.yaml"
NOISE = ("Traceback", "Loading weights", "Writing model shards", "FutureWarning", "it/s]")


def one_value_short(*completions, **_):
    """A broken reward function: one value fewer than the joint responses it was given."""
    return [1.0] * (len(completions[0]) - 1)


def pbrl_env() -> dict[str, str]:
    """This session's isolated Prefect home (conftest) at Prefect's default log level; the quieting must
    come from pbrl itself, so no progress-bar or warning settings are inherited."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("HF_HUB_DISABLE_PROGRESS_BARS", "PYTHONWARNINGS", "TQDM_DISABLE")
    }
    env.update({"PREFECT_LOGGING_LEVEL": "INFO", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    return env


def run_pbrl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(Path(sys.executable).with_name("pbrl")), *args],
        cwd=ROOT,
        env=pbrl_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.flow
def test_reward_func_one_value_short_is_one_error_line_exit_1(tmp_path):
    out = run_pbrl(
        "train",
        str(TINY),
        "--set",
        f"output_dir={tmp_path}",
        "--run-name",
        "short",
        "--set",
        "reward_func=tests.test_cli:one_value_short",
    )
    assert out.returncode == 1, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, out.stderr
    got, wanted = map(int, re.search(r"one_value_short returned (\d+) values for (\d+) joint", lines[0]).groups())
    assert got == wanted - 1
    assert "Traceback" not in out.stderr, out.stderr


@pytest.mark.flow
def test_train_output_has_no_weight_bars_or_futurewarnings(tmp_path):
    # LoRA agents: peft's model wrapping is what triggered transformers' FutureWarning on every load.
    out = run_pbrl(
        "train",
        str(TINY),
        "--set",
        f"output_dir={tmp_path}",
        "--run-name",
        "quiet",
        "--set",
        "num_iterations=1",
        "--set",
        "lora_r=8",
        "--set",
        "lora_alpha=16",
    )
    assert out.returncode == 0, out.stderr
    assert "Finished in state Completed()" in out.stderr  # the log is there, only the noise is gone
    for noise in NOISE:
        assert noise not in out.stderr, (noise, out.stderr)
