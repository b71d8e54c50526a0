"""What the ``pbrl`` command shows: its two consoles (stdout for results, stderr for everything else), the
``error:`` and ``stopped`` lines with their exit codes, the round table with report.png, and the live display of
a training run (a line per stage, a progress bar in a terminal) fed by the run's events (:mod:`pbrl.run.progress`).

Imports that cost seconds (Prefect, pandas, matplotlib) happen inside the functions that need them, each saying
why, so that ``pbrl --help`` answers at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from pbrl.config import JobConfig
from pbrl.errors import LabelsNeeded, expected_error
from pbrl.run import progress

console = Console()
err = Console(stderr=True, soft_wrap=True)


# Exit codes: 2 = the input is wrong and nothing ran (config, options, run folder); 1 = a run failed; 3 = a run
# stopped to wait for people's labels (judge: human); 130 = stopped by Ctrl-C (128 + SIGINT, as shells report it).
WAITING_FOR_LABELS = 3
INTERRUPTED = 130


def _fail(exc: Exception, code: int = 2) -> typer.Exit:
    err.print(f"[bold red]error:[/] {escape(str(exc))}")
    return typer.Exit(code)


@contextmanager
def _expected_errors(code: int) -> Iterator[None]:
    """Every expected error (``pbrl.errors.EXPECTED_ERRORS``, also when Prefect re-raised or wrapped it)
    becomes one ``error:`` line and exit ``code``; a run that stopped to wait for labels, one ``waiting:`` line and
    exit 3; anything else is a bug and keeps its traceback."""
    try:
        yield
    except Exception as exc:
        found = expected_error(exc)
        if found is None:
            raise
        if isinstance(found, LabelsNeeded):
            err.print(f"[bold yellow]waiting:[/] {escape(str(found))}")
            raise typer.Exit(WAITING_FOR_LABELS) from None
        raise _fail(found, code) from None


def _stopped(hint: str) -> typer.Exit:
    err.print(f"stopped; {escape(hint)}")
    return typer.Exit(INTERRUPTED)


def _print_wide_enough(table: Table, fit: bool) -> None:
    """Print ``table`` on stdout. ``fit``: in a terminal, at its width (an interval wraps at its spaces, no number
    is cut); else, and in logs and pipes (Rich's default is 80 columns), at the table's full width."""
    needed = console.measure(table, options=console.options.update_width(10_000)).maximum
    out = console if (fit and console.is_terminal) or needed <= console.width else Console(width=needed)
    out.print(table)


def _print_rounds(run_dir: Path, *, wide: bool = False, every_metric: bool = False) -> None:
    """The round table (compact, or ``wide``), with ``every_metric`` every metric of every round too; then
    ``report.png``."""
    from pbrl.reporting.metrics import round_table, write_run_metrics  # deferred: pandas and pyarrow
    from pbrl.reporting.report import write_report_png  # deferred: matplotlib
    from pbrl.reporting.table import all_metrics_rich, round_table_rich, trainer_of  # deferred: pandas

    write_run_metrics(run_dir)  # rebuilt from the manifests: also right for an interrupted run
    table = round_table(run_dir)
    wide = wide or every_metric
    shown = round_table_rich(table, trainer_of(run_dir), title=f"{run_dir.name}: rounds", wide=wide)
    _print_wide_enough(shown, fit=not wide)
    if every_metric:
        _print_wide_enough(all_metrics_rich(run_dir), fit=False)
    console.print(f"report: {write_report_png(run_dir, table)}")
    if any((Path(run_dir) / "rounds").glob("*/labels.json")):
        from pbrl.data.storage import RunPaths
        from pbrl.run.labelling import waiting_words  # deferred: imports the run's task code (torch)

        for line in waiting_words(RunPaths(run_dir)):
            console.print(Text(line, style="yellow"), soft_wrap=True)


class RunDisplay:
    """What ``pbrl train`` shows while a run goes on, from its events (:mod:`pbrl.run.progress`), on ``out``
    (stderr): one line when a stage starts and one when it ends (:func:`~pbrl.run.progress.describe`: counts,
    seconds), the stage's messages as ``note:`` lines after it, and one line per round with its eval reward and
    paired gain.

    With ``bar`` (a terminal) the current stage also has a progress bar with its units, elapsed time and ETA, and
    the last logged step's metrics; without (a log file, a pipe) a progress line with its ETA is printed at most
    every ``every`` seconds of a stage. ``verbose`` adds a line per logged training step; ``quiet`` shows
    nothing. ``clock`` is the monotonic clock (seconds), replaceable in tests.
    """

    def __init__(
        self,
        out: Console,
        verbosity: str = "normal",
        bar: Progress | None = None,
        every: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.out, self.verbosity, self.bar, self.every, self.clock = out, verbosity, bar, every, clock
        self.task = bar.add_task("starting", total=None, units="", latest="") if bar is not None else None
        self.started = self.last_line = clock()

    def __call__(self, event: progress.Event) -> None:
        if self.verbosity == "quiet":
            return
        if event.kind == "stage_start":
            self.started = self.last_line = self.clock()
            if self.bar is not None:
                where = f"round {event.round} {event.stage}"
                self.bar.reset(self.task, total=None, description=where, units="", latest="")
        elif event.kind == "progress":
            self._progress(event)
            return
        elif event.kind == "log":
            if self.bar is not None:
                latest = "  ".join(f"{k.rsplit('/', 1)[-1]} {v:.3g}" for k, v in list(event.metrics.items())[:3])
                self.bar.update(self.task, latest=latest)
            if self.verbosity != "verbose":
                return
        if event.kind == "run_end" and event.state != "Completed":
            return  # the command itself says how the run ended: an `error:` line, or `stopped; resume with …`
        line = progress.describe(event)
        if line is not None:
            self._line(line, style="red" if event.state == "Failed" else None)
        if event.kind == "stage_end":
            for message in event.messages:
                self._line(f"note: round {event.round} {event.stage}: {message}", style="yellow")

    def _progress(self, event: progress.Event) -> None:
        done, total = event.done or 0, event.total
        if self.bar is not None:
            self.bar.update(self.task, total=total, completed=done, units=f"{done}/{total or '?'} {event.unit}")
            return
        now = self.clock()
        if now - self.last_line < self.every or (total is not None and done >= total):
            return  # the end line follows at once
        self.last_line = now
        line = progress.describe(event) or ""
        if total and done:
            left = (now - self.started) / done * (total - done)
            line += f" (about {_duration(left)} left)"
        self._line(line)

    def _line(self, text: str, style: str | None = None) -> None:
        stamp = datetime.now().strftime("%H:%M:%S")
        self.out.print(Text(f"{stamp} {text}", style=style or ""), soft_wrap=True, highlight=False)


def _duration(seconds: float) -> str:
    """``42 s``, ``3 min``, ``1.5 h``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _train_with_progress(job: JobConfig, resume: bool, verbosity: str) -> dict[str, Any]:
    """Run the training flow under :class:`RunDisplay`; log lines print through the same console, above the bar
    (:func:`pbrl.orchestration.console_logging`)."""

    from pbrl import orchestration  # deferred: Prefect reads settings that orchestration sets first

    show_bar = err.is_terminal and verbosity != "quiet"
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[units]}"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[latest]}"),
        console=err,
        transient=True,
        disable=not show_bar,
    )
    # report_to's trackers are attached by the training flow itself (flows/training.py), for every front end.
    with orchestration.console_logging(err, verbosity), bar:  # type: ignore[arg-type]
        unsubscribe = progress.subscribe(RunDisplay(err, verbosity, bar if show_bar else None))
        try:
            return orchestration.train(job, resume=resume)
        finally:
            unsubscribe()
