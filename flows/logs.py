"""What a flow run says in its Prefect log while it runs (docs/guides/prefect-ui.md#what-a-run-shows).

While a training flow runs, :func:`run_log` listens to the run events of :mod:`pbrl.run.progress` and writes the line
:func:`pbrl.run.progress.describe` gives for each (the lines of the CLI) to the flow run's log in the Prefect API:
each stage's start and end with its counts and seconds, the training metrics of every logged step (the stages gate
them with ``logging_steps``), progress inside sampling, scoring, evaluation and training (rows done / total) at most
every 10 % or 10 s per stage, and each round's end. The lines go to the API only, not to the console: the command
line has its own display of the same events.

A job that cannot start (a broken rule, a missing task or model, a run folder in the way) ends as one clear failure,
:meth:`RunLog.reject`: every problem once, as ``pbrl validate`` words it, and no traceback.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.context import FlowRunContext
from prefect.exceptions import Pause, TerminationSignal
from prefect.logging.handlers import APILogHandler
from prefect.logging.loggers import PrefectLogAdapter
from prefect.runtime import flow_run
from prefect.states import Failed, State

from pbrl.config import ConfigNotice
from pbrl.errors import LabelsNeeded, in_chain
from pbrl.run.progress import Event, describe, subscribe

LOGGER_NAME = "pbrl.flows.run_log"  # API only: it does not propagate to pbrl's or the root's console handlers
EVERY_FRACTION = 0.1  # a progress line at most every 10 % of a stage's units ...
EVERY_SECONDS = 10.0  # ... or every 10 s, whichever comes first (and always at the last unit)


def _api_logger() -> logging.Logger:
    logger = logging.getLogger(LOGGER_NAME)
    if not any(isinstance(h, APILogHandler) for h in logger.handlers):
        logger.addHandler(APILogHandler())
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


class RunLog:
    """A :mod:`pbrl.run.progress` listener that writes one line per event to ``logger``.

    ``progress`` lines are throttled per stage: one when the next ``every_fraction`` of the stage's total is reached
    (10 %, 20 %, ...), or ``every_seconds`` (of ``clock``, in seconds) after the last line, and always the last
    unit; a progress event without a total is shown every ``every_seconds``. Stage failures are ERROR lines, a
    stage's messages follow its end line as notes. ``started`` turns true at ``run_start`` (the run folder is
    ready, work begins); from then on only the events of that run folder are written.
    """

    def __init__(
        self,
        logger: logging.Logger | logging.LoggerAdapter,
        *,
        every_fraction: float = EVERY_FRACTION,
        every_seconds: float = EVERY_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.logger, self.every_fraction, self.every_seconds, self.clock = logger, every_fraction, every_seconds, clock
        self.started, self.run_dir = False, None
        self._shown: dict[tuple[int | None, str | None], tuple[float, int]] = {}  # stage -> (time, step shown)

    def __call__(self, event: Event) -> None:
        if event.kind == "run_start" and not self.started:
            self.started, self.run_dir = True, event.run_dir
        elif self.run_dir is not None and event.run_dir not in (None, self.run_dir):
            return  # another run in this process (a thread of its own): its flow run logs it
        if event.kind == "stage_start":
            self._shown[(event.round, event.stage)] = (self.clock(), 0)
        if event.kind == "progress" and not self._due(event):
            return
        line = describe(event)
        if line is None:
            return
        level = {"Failed": logging.ERROR, "Cancelled": logging.WARNING, "AwaitingLabels": logging.WARNING}.get(
            event.state or "", logging.INFO
        )
        self.logger.log(level, line)
        for message in event.messages:
            self.logger.info(f"round {event.round} {event.stage}: note: {message}")

    def _due(self, event: Event) -> bool:
        now, key = self.clock(), (event.round, event.stage)
        shown_at, shown_step = self._shown.get(key, (float("-inf"), 0))
        steps = max(1, round(1 / self.every_fraction))  # whole steps: 3/10 of 100 rows is step 3, not 2.999...
        step = (event.done or 0) * steps // event.total if event.total else None
        due = now - shown_at >= self.every_seconds
        if step is not None:
            due = due or step > shown_step or (event.done or 0) >= event.total
        if due:
            self._shown[key] = (now, step if step is not None else shown_step)
        return due

    def notices(self, caught: list[warnings.WarningMessage]) -> None:
        """Write each :class:`~pbrl.config.ConfigNotice` of ``caught`` as a WARNING line (``pbrl validate`` prints
        them as ``warning:`` lines); re-issue any other warning."""
        for notice in caught:
            if issubclass(notice.category, ConfigNotice):
                self.logger.warning(f"warning: {notice.message}")
            else:
                warnings.warn_explicit(notice.message, notice.category, notice.filename, notice.lineno)

    def reject(self, exc: Exception) -> State[Any]:
        """The end of a job that could not start: its problems as one ERROR line (``exc``'s message: every problem,
        worded as ``pbrl validate`` words it) and a Failed state whose message only points there, so the run's log
        holds each problem once and no traceback. Returning the state from the flow fails the run; calling the flow
        from Python raises ``exc`` itself (the state carries it), and so does Prefect's engine in a deployment's
        process, whose logged traceback of it (:class:`DropReported`) is left out. A run started from a
        deployment's form says how to get the form back with its values (:data:`COPY_TO_NEW_RUN`)."""
        again = f"\n{COPY_TO_NEW_RUN}" if _from_deployment() else ""
        self.logger.error(f"the run did not start (nothing was computed): {exc}{again}")
        setattr(exc, REPORTED, True)
        engine_log = logging.getLogger("prefect.flow_runs")
        if not any(isinstance(f, DropReported) for f in engine_log.filters):
            engine_log.addFilter(DropReported())
        return Failed(message=f"the run did not start: {type(exc).__name__}, see the run's log", data=exc)


def _from_deployment() -> bool:
    context = FlowRunContext.get()
    return context is not None and context.flow_run is not None and context.flow_run.deployment_id is not None


def end_state(exc: BaseException) -> str:
    """How a flow run that ``exc`` stops ends, in the words of the run's log: ``Suspended`` when it waits for
    people's labels (Prefect's :class:`Pause`), ``AwaitingLabels`` when it stopped for them because it cannot suspend
    (:class:`~pbrl.errors.LabelsNeeded`), ``Cancelled`` when a person cancelled it (Prefect stops a cancelled run's
    process with SIGTERM, raised in it as :class:`TerminationSignal`, after the server has set the flow run, or the
    one above it, to Cancelling), else ``Failed``."""
    if isinstance(exc, Pause):
        return "Suspended"
    if in_chain(exc, LabelsNeeded) is not None:
        return "AwaitingLabels"
    if not isinstance(exc, TerminationSignal):
        return "Failed"
    ids = {i for i in (flow_run.get_id(), flow_run.get_root_flow_run_id()) if i}
    if not ids:  # not in a flow run: nothing a person could cancel
        return "Failed"
    try:
        with get_client(sync_client=True) as client:
            states = [client.read_flow_run(UUID(str(i))).state for i in ids]
    except Exception:  # the server is gone too: nothing says a person cancelled it
        return "Failed"
    return "Cancelled" if any(s is not None and (s.is_cancelling() or s.is_cancelled()) for s in states) else "Failed"


# Prefect checks a form only against its JSON schema before Submit; pbrl's rules across options, and whether a task,
# model or file exists, run in the flow run, after the form is gone. Prefect's own way back to it (both UIs):
COPY_TO_NEW_RUN = "Fix them in the form: this run's menu (⋮), Copy to new run, opens it with these values."
REPORTED = "_pbrl_reported"  # set on an exception RunLog.reject has written to the run's log


class DropReported(logging.Filter):
    """Drops a record of Prefect's flow-run logger that carries an exception :meth:`RunLog.reject` already wrote
    (in a deployment's process the engine re-raises a failed run's exception and logs it with its traceback as
    "Engine execution exited with unexpected exception"); every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not getattr(exc, REPORTED, False)


@contextlib.contextmanager
def run_log(**options: Any) -> Iterator[RunLog]:
    """Within a flow run: every run event published inside the block becomes a line of this flow run's log in the
    Prefect API (:class:`RunLog`, ``options`` passed to it). Outside a flow run the lines are dropped.

    Yields:
        the listener (``started``, ``notices``, ``reject``).
    """
    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        logger: logging.Logger | logging.LoggerAdapter = logging.getLogger(LOGGER_NAME + ".none")
        logger.addHandler(logging.NullHandler())
        logger.propagate = False
    else:
        run = context.flow_run
        logger = PrefectLogAdapter(
            _api_logger(),
            extra={
                "flow_run_id": str(run.id),
                "flow_run_name": run.name,
                "flow_name": context.flow.name if context.flow else "<unknown>",
            },
        )
    listener = RunLog(logger, **options)
    unsubscribe = subscribe(listener)
    try:
        yield listener
    finally:
        unsubscribe()
