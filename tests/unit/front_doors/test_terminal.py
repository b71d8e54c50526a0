"""What a person sees in the terminal (issue #35): a round table that fits 80 columns with every essential value
uncut, a line when each stage starts and ends (also in redirected output), Prefect's noise off the console, log
lines above the progress bar, and warnings only where they mean something."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from pbrl import orchestration
from pbrl.cli.commands import app
from pbrl.cli.display import RunDisplay
from pbrl.data.storage import RunPaths, StageManifest, write_manifest
from pbrl.reporting.metrics import round_table, write_run_metrics
from pbrl.reporting.table import decimals_for, round_table_markdown, round_table_rich, round_table_rows
from pbrl.run.progress import Event

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "flows" / "configs" / "tiny-madpo-iter.yaml"

# The demo's measured rounds (docs/results/learning.md): eval and paired gain with their intervals, seconds.
EVAL = {0: (2.16, 1.98, 2.33), 1: (2.26, 2.10, 2.42), 2: (2.42, 2.23, 2.59), 3: (2.60, 2.44, 2.75)}
PAIRED = {1: (0.10, -0.10, 0.28), 2: (0.26, 0.04, 0.47), 3: (0.44, 0.20, 0.65)}
SECONDS = {0: 61.0, 1: 312.0, 2: 298.0, 3: 950.0}
MADPO = {1: (32, 0.784, 0.59), 2: (32, 0.565, 0.66), 3: (31, 0.750, 0.69)}  # pairs, loss, accuracy
MARLHF = {1: (24, 0.75, -0.33, 0.012), 2: (24, 0.67, 0.41, 0.048), 3: (23, 1.0, 1.25, 0.103)}  # pairs, RM, RL, KL


def fake_run(folder: Path, trainer: str, *, steps_per_round: int = 4) -> Path:
    """A run folder with run.json and the manifests of 3 rounds holding the demo's numbers (MARLHF's for MARLHF),
    each update-policies manifest with its logged training steps (``details.train_log``)."""
    marlhf = trainer.startswith("marlhf")
    run = folder / f"fake-{trainer}"
    run.mkdir(parents=True)
    config = {
        # A base trainer's run has one round (pbrl status and report show no other): the layout of three rounds is
        # that of its iterative trainer, which has the same columns.
        "trainer": trainer if trainer.endswith("_iter") else f"{trainer}_iter",
        "num_iterations": 3,
        "task": "toy",
        "agent_model": "smollm2-135m-instruct",
        "seed": 0,
        "max_new_tokens": 48,
    }
    (run / "run.json").write_text(json.dumps({"run_id": "x", "config": config}))
    paths = RunPaths(run)

    def manifest(r: int, stage: str, seconds: float, **fields) -> None:
        paths.round_dir(r).mkdir(parents=True, exist_ok=True)
        write_manifest(paths, StageManifest(stage=stage, round_index=r, config_hash="x", seconds=seconds, **fields))

    for r, (mean, lo, hi) in EVAL.items():
        metrics = {"eval/reward_mean": mean, "eval/reward_ci_low": lo, "eval/reward_ci_high": hi}
        if r in PAIRED:
            metrics |= dict(
                zip(
                    ("eval/paired_diff_mean", "eval/paired_diff_ci_low", "eval/paired_diff_ci_high"),
                    PAIRED[r],
                    strict=True,
                )
            )
        manifest(r, "evaluate", 40.0, metrics=metrics)
        if r == 0:
            continue
        env_steps = [4.0 * ((r - 1) * steps_per_round + k) for k in range(1, steps_per_round + 1)]
        if marlhf:
            pairs, rm, rl, kl = MARLHF[r]
            manifest(
                r, "fit-reward-model", 20.0, metrics={"rm/heldout_accuracy": rm, "rm/accuracy": 1.0, "rm/loss": 0.4}
            )
            metrics = {"rl/reward_mean": rl, "rl/kl_mean": kl, "train/env_step": env_steps[-1]}
            metrics |= {"critic/value_loss": 0.5 / r, "critic/explained_variance": 0.2 * r, "critic/value_mean": 1.0}
            log = [{"env_step": e, "rl/reward_mean": rl + 0.1 * k} for k, e in enumerate(env_steps)]
        else:
            pairs, loss, acc = MADPO[r]
            metrics = {"madpo/loss": loss, "madpo/accuracy": acc, "madpo/margin_mean": 0.3 * r}
            metrics |= {
                "madpo/margin_agent_0": 0.1 * r,
                "madpo/margin_agent_1": 0.2 * r,
                "train/env_step": env_steps[-1],
            }
            log = [
                {"env_step": e, "madpo/loss": loss + 0.01 * k, "madpo/accuracy": 0.5} for k, e in enumerate(env_steps)
            ]
        manifest(r, "build-pairs", 1.0, counts={"pairs": pairs})
        spent = SECONDS[r] - 41.0 - (20.0 if marlhf else 0.0)
        manifest(r, "update-policies", spent, metrics=metrics, details={"train_log": log})
    write_run_metrics(run)
    return run


def essential_cells(trainer: str) -> list[str]:
    cells = ["2.60 [2.44, 2.75]", "2.16 [1.98, 2.33]", "+0.44 [+0.20, +0.65]", "+0.10 [-0.10, +0.28]", "950", "40"]
    if trainer.startswith("marlhf"):
        return cells + ["0.75", "-0.33", "0.012", "1.25", "0.103", "23"]
    return cells + ["0.784", "0.59", "0.750", "0.69", "31"]


# ------------------------------------------------------------------------------------------------ the table
@pytest.mark.parametrize("trainer", ["madpo", "madpo_iter", "marlhf", "marlhf_iter"])
def test_the_round_table_fits_80_columns_with_every_essential_value_uncut(tmp_path, trainer):
    run = fake_run(tmp_path, trainer)
    out = runner.invoke(app, ["report", str(run)], env={"COLUMNS": "80"})
    assert out.exit_code == 0, out.output
    table = out.output.split("report:")[0]
    lines = table.splitlines()
    assert max(len(line) for line in lines) <= 80, table
    assert "…" not in table
    for cell in essential_cells(trainer):
        assert any(re.search(rf"(?<![\w.+-]){re.escape(cell)}(?![\w.])", line) for line in lines), (cell, table)
    # per trainer only the columns that apply
    assert ("RM" in table and "RL" in table and "loss" not in table) == trainer.startswith("marlhf"), table


@pytest.mark.parametrize("trainer", ["madpo_iter", "marlhf_iter"])
def test_in_a_narrow_terminal_an_interval_wraps_and_no_number_is_cut(tmp_path, trainer):
    run = fake_run(tmp_path, trainer)
    shown = Console(width=60, record=True, file=io.StringIO())
    shown.print(round_table_rich(round_table(run), trainer, title="rounds"))
    text = shown.export_text()
    assert "…" not in text
    for number in re.findall(r"[+-]?\d+\.\d+", " ".join(essential_cells(trainer))):
        assert re.search(rf"(?<![\w.]){re.escape(number)}(?![\w])", text), (number, text)


def test_wide_and_all_show_the_rest(tmp_path):
    run = fake_run(tmp_path, "madpo_iter")
    wide = runner.invoke(app, ["report", str(run), "--wide"], env={"COLUMNS": "80"})
    assert wide.exit_code == 0, wide.output
    assert all(word in wide.output for word in ("margin", "vs r0")) and "…" not in wide.output
    every = runner.invoke(app, ["report", str(run), "--all"], env={"COLUMNS": "80"})
    assert every.exit_code == 0, every.output
    assert "madpo/margin_mean" in every.output and "time/update-policies_seconds" in every.output
    assert "margin" not in runner.invoke(app, ["report", str(run)]).output


def test_rows_and_markdown_for_the_prefect_artifact(tmp_path):
    run = fake_run(tmp_path, "marlhf_iter")
    headers, rows = round_table_rows(run)
    assert headers == ["round", "pairs", "RM acc", "RL reward", "KL", "eval [95% CI]", "paired gain [95% CI]", "secs"]
    assert rows[3] == ["3", "23", "1.00", "1.25", "0.103", "2.60 [2.44, 2.75]", "+0.44 [+0.20, +0.65]", "950"]
    assert rows[0][1:5] == ["–"] * 4
    markdown = round_table_markdown(run).splitlines()
    assert markdown[0] == "| " + " | ".join(headers) + " |" and markdown[1].count("---:") == 8
    assert markdown[5] == "| " + " | ".join(rows[3]) + " |"
    wide_headers, _ = round_table_rows(run, wide=True)
    assert {"RM held-out acc", "RM loss", "vs r0", "critic loss", "expl var"} <= set(wide_headers)
    assert "peak GB" not in wide_headers  # a wide column that holds nothing in this run is left out


def test_quiet_and_verbose_together_are_refused_before_anything_runs():
    out = runner.invoke(app, ["train", str(TINY), "--quiet", "--verbose"])
    assert out.exit_code == 2 and "--quiet and --verbose" in out.output


def test_decimals_keep_about_three_significant_digits():
    assert [decimals_for(v) for v in ([2.75], [0.65], [0.012], [123.4], [12.3], [], [float("nan")])] == [
        2,
        2,
        3,
        0,
        1,
        2,
        2,
    ]


# ------------------------------------------------------------------------------------------------ run events
def _lines(events, verbosity="normal", times=None, **kwargs) -> list[str]:
    """The lines a RunDisplay prints for ``events`` (``times``: the clock at each event), without time stamps."""
    out, now = Console(file=io.StringIO(), width=200), [0.0]
    display = RunDisplay(out, verbosity, clock=lambda: now[0], **kwargs)
    for i, event in enumerate(events):
        now[0] = times[i] if times else 0.0
        display(event)
    return [line.split(" ", 1)[1] for line in out.file.getvalue().splitlines()]


EVENTS = [
    Event("stage_start", "r", 1, "update-policies"),
    Event("progress", "r", 1, "update-policies", done=1, total=4, unit="steps"),
    Event("log", "r", 1, "update-policies", step=1, metrics={"madpo/loss": 0.69}),
    Event("progress", "r", 1, "update-policies", done=3, total=4, unit="steps"),
    Event("progress", "r", 1, "update-policies", done=4, total=4, unit="steps"),
    Event(
        "stage_end",
        "r",
        1,
        "update-policies",
        state="Completed",
        seconds=12.0,
        counts={"steps": 4},
        messages=("a note",),
    ),  # fmt: skip
    Event("round_end", "r", 1, metrics={"eval_reward": 2.6, "eval_lo": 2.44, "eval_hi": 2.75}, seconds=30.0),
]


def test_a_log_gets_a_line_per_stage_start_and_end_its_notes_and_a_progress_line_with_eta_now_and_then():
    # started at 100 s; 1/4 at 110 s (too soon for a line); 3/4 at 169 s (a line: 59 s for 3 steps, 20 s left)
    lines = _lines(EVENTS, every=60.0, times=[100.0, 110.0, 111.0, 169.0, 170.0, 171.0, 172.0])
    assert lines == [
        "round 1 update-policies: started",
        "round 1 update-policies: 3/4 steps (about 23 s left)",
        "round 1 update-policies: done in 12.0 s (steps 4)",
        "note: round 1 update-policies: a note",
        "round 1: done in 30 s — eval 2.6 [2.44, 2.75]",
    ]


def test_a_run_that_ends_otherwise_than_completed_is_said_by_the_command_not_by_the_display():
    assert _lines([Event("run_end", "runs/r", state="Failed", seconds=3.0)]) == []
    assert _lines([Event("run_end", "runs/r", state="Completed", seconds=3.0)]) == ["run runs/r: completed after 3 s"]


def test_quiet_shows_no_event_and_verbose_shows_every_logged_step():
    assert _lines(EVENTS, "quiet") == []
    assert "round 1 update-policies step 1: madpo/loss 0.69" in _lines(EVENTS, "verbose")


# ------------------------------------------------------------------------------------------------ logging
def _record(name: str, level: int, message: str) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, message, None, None)


def test_prefects_server_hint_stop_line_and_ctrl_c_crash_lines_are_dropped():
    noise = orchestration.PrefectNoise()
    start = _record(
        "prefect", logging.INFO, "Starting temporary server on http://127.0.0.1:8000\nSee https://www.prefect.io/"
        "docs/v3/concepts/server#how-to-guides for more information on running a dedicated Prefect server."
    )  # fmt: skip
    assert noise.filter(start) and start.getMessage() == "Starting temporary server on http://127.0.0.1:8000"
    assert not noise.filter(_record("prefect", logging.INFO, "Stopping temporary server on http://127.0.0.1:8000"))
    crash = "Crash detected! Execution was aborted by an interrupt signal."
    assert not noise.filter(_record("prefect.flow_runs", logging.ERROR, crash))
    crashed = "Finished in state Crashed('Execution was aborted by an interrupt signal.')"
    assert not noise.filter(_record("prefect.task_runs", logging.ERROR, crashed))
    assert noise.filter(_record("prefect.flow_runs", logging.ERROR, "Crash detected! Request failed: a real crash"))
    assert noise.filter(_record("prefect.task_runs", logging.INFO, "Finished in state Completed()"))


def test_each_verbosity_shows_what_it_says():
    records = {
        "prefect info": _record("prefect.task_runs", logging.INFO, "Finished in state Completed()"),
        "pbrl info": _record("pbrl.stages", logging.INFO, "[evaluate round 0] a note"),
        "server": _record("prefect", logging.INFO, "Starting temporary server on http://127.0.0.1:8000"),
        "warning": _record("pbrl.flows", logging.WARNING, "lock expired"),
        "error": _record("prefect.flow_runs", logging.ERROR, "Finished in state Failed"),
    }
    shown = {
        v: {k for k, r in records.items() if orchestration.ConsoleLevel(v).filter(r)}
        for v in ("quiet", "normal", "verbose")
    }
    assert shown == {
        "quiet": {"error"},
        "normal": {"server", "warning", "error"},
        "verbose": set(records),
    }
    with pytest.raises(ValueError, match="verbosity: got 'loud'"):
        orchestration.ConsoleLevel("loud")  # type: ignore[arg-type]


def test_log_lines_print_through_the_progress_console_and_prefects_handlers_come_back(monkeypatch):
    from prefect.logging.handlers import PrefectConsoleHandler

    monkeypatch.setattr(orchestration, "_configure_logging", lambda: None)
    monkeypatch.setattr(orchestration, "_launch_ephemeral_api", lambda: None)
    logger = logging.getLogger("pbrl-test-console")
    logger.propagate = False
    behind_the_bar = io.StringIO()
    prefects = PrefectConsoleHandler(stream=behind_the_bar)
    logger.addHandler(prefects)
    console = Console(file=io.StringIO(), width=200)
    try:
        with orchestration.console_logging(console, "normal"):
            assert prefects not in logger.handlers
            logger.warning("a warning")
            logger.info("an info line")  # Prefect's INFO lines stay off the console by default
        logger.warning("after")
    finally:
        logger.removeHandler(prefects)
    assert console.file.getvalue().strip().endswith("a warning") and "an info" not in console.file.getvalue()
    assert behind_the_bar.getvalue().strip().endswith("after") and "a warning" not in behind_the_bar.getvalue()


# ------------------------------------------------------------------------------------------------ warnings
def test_a_lora_adapter_wraps_a_model_without_transformers_futurewarning(tiny_model_dir):
    """peft reads transformers' deprecated ``is_gradient_checkpointing``: 51 FutureWarnings in ``make test``."""
    import warnings

    from transformers import AutoModelForCausalLM

    from pbrl.models.lora import LoraSettings, with_lora

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with_lora(model, LoraSettings(r=4), None, trainable=True, seed=0)
    assert not [w for w in caught if issubclass(w.category, FutureWarning)], [str(w.message) for w in caught]


def test_the_evaluation_note_is_said_by_the_first_evaluation_of_a_run_only(tiny_model_dir, tmp_path):
    """It was said 3 times per evaluation: once by each round's stage, then again for each round at the end."""
    import stages.evaluate as evaluate
    from stages import STAGE_MODULES
    from tests.helpers import new_run

    run_dir, job = new_run(tiny_model_dir, tmp_path, num_iterations=1, eval_num_samples=2)
    first = evaluate.run(run_dir, 0, job)
    for name in ("sample-candidates", "score-with-oracle", "build-pairs", "store-round", "replay-select"):
        STAGE_MODULES[name].run(run_dir, 1, job)
    STAGE_MODULES["update-policies"].run(run_dir, 1, job)
    later = evaluate.run(run_dir, 1, job)
    assert [m for m in first.messages if "not held out" in m] and not later.messages
    assert first.counts["items_seen_in_training"] == later.counts["items_seen_in_training"] == 2


def _env(tmp_path: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("HF_HUB_DISABLE_PROGRESS_BARS", "PYTHONWARNINGS", "TQDM_DISABLE")
        and not k.startswith("PREFECT_API")
    }
    env.update(
        PREFECT_HOME=str(tmp_path / "prefect-home"),
        PREFECT_LOGGING_LEVEL="INFO",
        PBRL_STORAGE=str(tmp_path / "storage"),
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
    )
    return env


@pytest.mark.flow
def test_a_redirected_train_has_a_start_and_an_end_line_for_every_stage(tmp_path):
    log = tmp_path / "train.log"
    with log.open("w") as out:
        done = subprocess.run(
            [str(Path(sys.executable).with_name("pbrl")), "train", str(TINY), "--set", "num_iterations=1",
             "--set", f"output_dir={tmp_path / 'runs'}"],
            cwd=ROOT, env=_env(tmp_path), stdout=out, stderr=subprocess.STDOUT, timeout=600,
        )  # fmt: skip
    text = log.read_text()
    assert done.returncode == 0, text
    stages = [("0", "evaluate")] + [
        ("1", s)
        for s in ("sample-candidates", "score-with-oracle", "build-pairs", "store-round", "replay-select")
        + ("update-policies", "evaluate")
    ]
    for r, stage in stages:
        assert re.search(rf"^\d\d:\d\d:\d\d round {r} {stage}: started$", text, re.M), (r, stage, text)
        assert re.search(rf"^\d\d:\d\d:\d\d round {r} {stage}: done in [\d.]+ s", text, re.M), (r, stage, text)
    assert text.count("not held out") == 1  # the toy task evaluates on its training items: said once
    assert "dedicated Prefect server" not in text and "Finished in state" not in text  # Prefect's INFO lines
    table = text[text.index("tiny-madpo-iter: rounds") :].split("report:")[0]
    assert max(len(line) for line in table.splitlines()) <= 80 and "…" not in table
    assert "+0." in table or "-0." in table  # the paired gain, with its sign

    quiet = subprocess.run(
        [str(Path(sys.executable).with_name("pbrl")), "train", str(TINY), "--set", "num_iterations=1",
         "--set", f"output_dir={tmp_path / 'runs'}", "--resume", "--quiet"],
        cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr.strip() == "" and "tiny-madpo-iter: rounds" in quiet.stdout, quiet.stderr
