"""What a flow run says in its Prefect log (flows/logs.py, issue #31): one line per run event as the CLI words it,
progress throttled per stage, notices as warnings, and a job that cannot start as one error line and a Failed state.

The lines reaching a real flow run's log, while it runs, are checked in ``tests/flow/test_ui.py`` and, in a browser,
in ``tests/browser/test_ui.py``.
"""

from __future__ import annotations

import logging
import warnings

import pytest

from flows.logs import REPORTED, DropReported, RunLog
from pbrl.config import ConfigNotice
from pbrl.errors import ConfigError, Problem
from pbrl.run.progress import Event


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def lines(caplog: pytest.LogCaptureFixture):
    logger = logging.getLogger("tests.run_log")
    logger.setLevel(logging.INFO)
    caplog.set_level(logging.INFO, logger="tests.run_log")
    return logger, caplog


def _said(caplog) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "tests.run_log"]


def test_each_event_is_the_line_the_cli_shows_and_stage_notes_follow_their_end(lines):
    logger, caplog = lines
    log = RunLog(logger)
    log(Event("run_start", "runs/a"))
    log(Event("stage_start", "runs/a", 1, "build-pairs"))
    log(Event("stage_end", "runs/a", 1, "build-pairs", state="Completed", seconds=0.5, counts={"pairs": 6},
              messages=("every comparison tied",)))  # fmt: skip
    log(Event("log", "runs/a", 1, "update-policies", step=2, metrics={"madpo/loss": 0.6931}))
    log(Event("stage_end", "runs/a", 1, "update-policies", state="Failed", seconds=3.0))
    log(Event("round_end", "runs/a", 1, seconds=12))
    assert _said(caplog) == [
        ("INFO", "run runs/a: started"),
        ("INFO", "round 1 build-pairs: started"),
        ("INFO", "round 1 build-pairs: done in 0.5 s (pairs 6)"),
        ("INFO", "round 1 build-pairs: note: every comparison tied"),
        ("INFO", "round 1 update-policies step 2: madpo/loss 0.6931"),
        ("ERROR", "round 1 update-policies: failed after 3.0 s"),
        ("INFO", "round 1: done in 12 s"),
    ]
    assert log.started


def test_what_a_person_cancelled_is_a_warning_that_says_cancelled_not_an_error(lines):
    """Issue #54: a Cancel from the UI was logged as an ERROR "failed after 51 s"."""
    logger, caplog = lines
    log = RunLog(logger)
    log(Event("stage_end", "runs/a", 2, "sample-candidates", state="Cancelled", seconds=2.5))
    log(Event("run_end", "runs/a", state="Cancelled", seconds=51))
    assert _said(caplog) == [
        ("WARNING", "round 2 sample-candidates: cancelled after 2.5 s"),
        ("WARNING", "run runs/a: cancelled after 51 s"),
    ]


def test_only_a_termination_asked_for_by_a_cancel_ends_cancelled():
    from prefect.exceptions import TerminationSignal

    from flows.logs import end_state

    assert end_state(RuntimeError("a stage failed")) == "Failed"
    assert end_state(KeyboardInterrupt()) == "Failed"  # Ctrl-C: the CLI says how it stopped
    assert end_state(TerminationSignal(15)) == "Failed"  # outside a flow run nothing was cancelled


def test_progress_lines_come_every_tenth_or_every_ten_seconds_and_at_the_end(lines):
    logger, caplog = lines
    clock = Clock()
    log = RunLog(logger, clock=clock)
    log(Event("stage_start", "r", 1, "sample-candidates"))
    for done in range(1, 101):  # 100 rows, all within one second
        log(Event("progress", "r", 1, "sample-candidates", done=done, total=100, unit="rows"))
    shown = [m for _, m in _said(caplog) if "rows" in m]
    assert shown == [f"round 1 sample-candidates: {n}/100 rows" for n in range(10, 101, 10)]
    caplog.clear()
    log(Event("stage_start", "r", 1, "evaluate"))
    for done in range(1, 1001):  # 1000 rows over 50 s: the 10 % steps, and one line after each 10 s in between
        clock.now += 0.05
        log(Event("progress", "r", 1, "evaluate", done=done, total=1000, unit="rows"))
    shown = [m.split(": ")[1] for _, m in _said(caplog) if "rows" in m]
    assert shown == [f"{n}/1000 rows" for n in range(100, 1001, 100)]
    caplog.clear()
    clock.now = 0.0
    log(Event("stage_start", "r", 2, "update-policies"))
    for done in range(1, 41):  # no total: one line every 10 s
        clock.now += 1.0
        log(Event("progress", "r", 2, "update-policies", done=done, total=None, unit="steps"))
    assert [m.split(": ")[1] for _, m in _said(caplog) if "steps" in m] == [
        "10 steps",
        "20 steps",
        "30 steps",
        "40 steps",
    ]


def test_slow_stages_show_a_line_every_ten_seconds_between_the_tenths(lines):
    logger, caplog = lines
    clock = Clock()
    log = RunLog(logger, clock=clock)
    log(Event("stage_start", "r", 1, "sample-candidates"))
    for done in range(1, 6):  # 5 of 1000 rows, 11 s apart: each one after 10 s without a line
        clock.now += 11
        log(Event("progress", "r", 1, "sample-candidates", done=done, total=1000, unit="rows"))
    assert len([m for _, m in _said(caplog) if "rows" in m]) == 5


def test_events_of_another_run_in_the_same_process_are_not_this_runs(lines):
    logger, caplog = lines
    log = RunLog(logger)
    log(Event("run_start", "runs/a"))
    log(Event("stage_start", "runs/b", 1, "build-pairs"))
    log(Event("stage_start", "runs/a", 1, "build-pairs"))
    assert _said(caplog) == [("INFO", "run runs/a: started"), ("INFO", "round 1 build-pairs: started")]


def test_notices_are_warning_lines_and_other_warnings_pass_on(lines):
    logger, caplog = lines
    log = RunLog(logger)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn("discount=0.9 has no effect in pbrl", ConfigNotice, stacklevel=1)
    with pytest.warns(DeprecationWarning, match="old"):
        with warnings.catch_warnings(record=True) as other:
            warnings.simplefilter("always")
            warnings.warn("old", DeprecationWarning, stacklevel=1)
        log.notices(caught + other)
    assert _said(caplog) == [("WARNING", "warning: discount=0.9 has no effect in pbrl")]


def test_a_job_that_cannot_start_is_one_error_line_and_a_failed_state_that_carries_it(lines):
    logger, caplog = lines
    error = ConfigError([Problem("dpo_beta", 0, "must be > 0"), Problem("preference_replay_k", None, "required")])
    state = RunLog(logger).reject(error)
    assert _said(caplog) == [("ERROR", f"the run did not start (nothing was computed): {error}")]
    assert state.is_failed() and state.message == "the run did not start: ConfigError, see the run's log"
    assert str(error) not in state.message  # the problems are in the log once, not again in the final state line
    assert state.result(raise_on_failure=False) is error
    assert getattr(error, REPORTED)


def test_prefects_traceback_of_a_reported_error_is_left_out():
    error, other = ConfigError([Problem("a", 1, "bad")]), ValueError("a bug")
    setattr(error, REPORTED, True)

    def record(exc: BaseException) -> logging.LogRecord:
        return logging.LogRecord("prefect.flow_runs", logging.ERROR, __file__, 1, "Engine execution exited", (),
                                 (type(exc), exc, None))  # fmt: skip

    assert not DropReported().filter(record(error))
    assert DropReported().filter(record(other))  # a bug keeps its traceback
