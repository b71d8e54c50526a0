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
from pbrl.cli.commands import app

runner = CliRunner()


def test_help_lists_every_command():
    out = runner.invoke(app, ["--help"])
    assert out.exit_code == 0
    for command in ("train", "validate", "stage", "status", "serve", "models", "report"):
        assert command in out.output


def test_help_does_not_import_torch_or_prefect():
    code = "import sys; from pbrl.cli.commands import app; print('torch' in sys.modules, 'prefect' in sys.modules)"
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

ROOT = Path(__file__).resolve().parents[3]
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
        "reward_func=tests.unit.front_doors.test_cli:one_value_short",
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
    assert re.search(r"round 1 update-policies: done in [\d.]+ s", out.stderr)  # the log stays, the noise goes
    for noise in NOISE:
        assert noise not in out.stderr, (noise, out.stderr)


# ---------------------------------------------------------------- issue #29: resume options, run in use, messages
def test_resume_applies_the_set_options_a_resume_may_change_and_names_the_others(tiny_model_dir, tmp_path):
    """``pbrl train --run RUN --resume --set num_iterations=3`` used to ignore every --set (2 rounds, exit 0)."""
    from pbrl.run.folder import open_run
    from tests.helpers import new_run

    run_dir, _ = new_run(tiny_model_dir, tmp_path)
    assert open_run(run_dir, ["num_iterations=3"]).num_iterations == 3
    assert open_run(run_dir, ["runner=local", "shard_size=4"]).shard_size == 4
    out = runner.invoke(app, ["train", "--run", str(run_dir), "--resume", "--set", "dpo_beta=0.5", "--set", "seed=7"])
    assert out.exit_code == 2
    assert "dpo_beta: got 0.5; differs from the stored run (0.1)" in out.output and "seed: got 7" in out.output
    assert "temporary server" not in out.output  # refused before Prefect started


def test_a_run_argument_that_is_not_a_run_folder_is_one_error_line(tmp_path):
    afile = tmp_path / "a.txt"
    afile.write_text("x")
    for target, what in ((afile, "is not a folder"), (tmp_path, "is not a run folder (no run.json)")):
        out = runner.invoke(app, ["train", "--run", str(target), "--resume"])
        assert out.exit_code == 2 and what in out.output and "Traceback" not in out.output


def test_a_stage_of_another_trainer_is_named_as_such(tiny_model_dir, tmp_path):
    from tests.helpers import new_run

    run_dir, _ = new_run(tiny_model_dir, tmp_path)
    out = runner.invoke(app, ["stage", "fit-reward-model", "--run", str(run_dir), "--round", "1"])
    assert out.exit_code == 2
    assert out.output == (
        "error: fit-reward-model is not a stage of this run (madpo_iter); its stages: sample-candidates, "
        "score-with-oracle, build-pairs, store-round, replay-select, update-policies, evaluate\n"
    )


def test_an_existing_run_without_resume_is_refused_before_prefect_starts(tiny_model_dir, tmp_path):
    from tests.helpers import new_run

    run_dir, job = new_run(tiny_model_dir, tmp_path)
    config = tmp_path / "again.yaml"
    config.write_text(
        f"trainer: madpo_iter\ntask: toy\ntask_options: {{num_items: 4}}\nagent_model: {tiny_model_dir}\n"
        f"output_dir: {tmp_path}\nrun_name: run\n"
    )
    out = runner.invoke(app, ["train", str(config)])
    assert out.exit_code == 2 and "already exists" in out.output and "temporary server" not in out.output


def test_a_second_process_on_a_run_in_use_is_refused_with_the_holder(tiny_model_dir, tmp_path):
    """Issue #29: the second process waited for the stage lock, then recomputed the stage and replaced
    checkpoints/round_0001 under the first."""
    import time

    from tests.helpers import new_run

    run_dir, _ = new_run(tiny_model_dir, tmp_path)
    ready = tmp_path / "held"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import pathlib, time, sys\nfrom pbrl.run.folder import run_lock\n"
                f"with run_lock(pathlib.Path({str(run_dir)!r})):\n"
                f"    pathlib.Path({str(ready)!r}).touch()\n    time.sleep(60)\n"
            ),
        ],
        cwd=Path(__file__).parents[3],
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        for args in (
            ["train", "--run", str(run_dir), "--resume"],
            ["stage", "evaluate", "--run", str(run_dir), "--round", "0"],
        ):
            out = runner.invoke(app, args)
            assert out.exit_code == 2, out.output
            assert f"is in use by process {holder.pid} on host" in out.output
        from pbrl.errors import ConfigError
        from pbrl.run.folder import run_lock

        with pytest.raises(ConfigError, match=f"in use by process {holder.pid}"):
            with run_lock(run_dir):
                pass
    finally:
        holder.kill()
        holder.wait()
    from pbrl.run.folder import run_holder, run_lock

    assert run_holder(run_dir) is None  # the kernel released the dead holder's lock: nothing stale
    with run_lock(run_dir), run_lock(run_dir):  # re-entrant in one process
        assert run_holder(run_dir) is None


def test_resume_of_a_run_that_does_not_exist_yet_says_it_starts_one(tmp_path):
    """Issue #29: ``pbrl train CONFIG --resume`` with a missing run quietly started a new one (``--run X --resume``
    refuses): it now says so in one line (``make demo`` relies on starting with --resume)."""
    config = tmp_path / "new.yaml"
    config.write_text(f"trainer: madpo_iter\ntask: toy\nagent_model: {tmp_path / 'no-model'}\noutput_dir: {tmp_path}\n")
    out = runner.invoke(app, ["train", str(config), "--resume"])
    assert f"note: no run at {tmp_path / 'new'} yet: starting it" in " ".join(out.output.split())
    assert out.exit_code == 2  # then preflight names the missing model, before anything starts
