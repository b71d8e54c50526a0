"""The one bridge from the library to Prefect (docs/design/architecture.md#front-doors): imported lazily by the CLI
and the trainer API,
so that ``import pbrl`` never imports Prefect."""

from __future__ import annotations

import atexit
import ctypes
import functools
import logging
import os
import signal
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from rich.console import Console
from rich.text import Text

from pbrl.config import ConfigNotice, JobConfig
from pbrl.errors import expected_error, in_chain

Verbosity = Literal["quiet", "normal", "verbose"]
VERBOSITIES: tuple[Verbosity, ...] = ("quiet", "normal", "verbose")


def quiet_libraries() -> None:
    """Keep the output of a run to what a person reads: no per-model-load "Loading weights" / "Writing model
    shards" bars (transformers' tqdm, on by default) and no transformers/peft deprecation FutureWarning on
    every model load (they concern our pinned versions, not the user). Progress is the CLI's own bar and
    Prefect's one line per stage. When stderr is not a terminal (``make demo > log``) every tqdm bar is off
    too (e.g. the one-time GGUF conversion), since a log keeps each redraw. Call it before transformers or
    tqdm is imported (both read these variables at import); idempotent. ``HF_HUB_DISABLE_PROGRESS_BARS=0``
    keeps the bars."""
    if not sys.stderr.isatty():
        os.environ.setdefault("TQDM_DISABLE", "1")
    if os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1").lower() not in ("0", "false", "no", "off"):
        from transformers.utils import logging as hf_logging  # deferred: reads the variable only at first import

        hf_logging.disable_progress_bar()
    for module in ("transformers", "peft"):
        warnings.filterwarnings("ignore", category=FutureWarning, module=rf"{module}(\.|$)")


class QuietExpectedErrors(logging.Filter):
    """Console filter: drops Prefect's records whose exception is an expected pbrl error (``EXPECTED_ERRORS``)
    or a Ctrl-C. The front end shows those as one line (``error: …`` / ``stopped; resume …``), so Prefect's
    logged tracebacks of the same exception (task, each enclosing flow, the engine) would only bury it. The
    Prefect UI keeps them: its API log handler sits on the run loggers, not on the console."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return exc is None or not (expected_error(exc) is not None or interrupted(exc))


class PrefectNoise(logging.Filter):
    """Console filter: Prefect's lines that pbrl says better, or that say nothing to a pbrl user.

    * "Starting temporary server on URL" keeps its first line only: the hint after it ("See … for more
      information on running a dedicated Prefect server") came with every command;
    * "Stopping temporary server on URL" (at exit) is dropped;
    * "Crash detected! Execution was aborted by an interrupt signal." and "Finished in state Crashed('Execution
      was aborted by an interrupt signal.')" are dropped: a Ctrl-C logs them for the task and for each flow around
      it, as errors, before the front end's own "stopped; resume with …".

    Everything else passes; the Prefect UI keeps every record (its API handler sits on the run loggers)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("Starting temporary server on "):
            record.msg, record.args = message.split("\n", 1)[0], ()
            return True
        if message.startswith("Stopping temporary server on "):
            return False
        crash = message.startswith("Crash detected!") or "Finished in state Crashed(" in message
        return not (crash and (_SIGINT_SEEN.is_set() or "interrupt signal" in message))


class ConsoleLevel(logging.Filter):
    """Console filter: what a console shows at a verbosity.

    * ``quiet``: errors only;
    * ``normal``: warnings and errors, and the one line naming Prefect's temporary server; a front end shows the
      run itself from its events (:mod:`pbrl.run.progress`), so Prefect's INFO lines (task and flow states) and
      pbrl's own INFO lines (a stage's messages, said again after the stage) stay off the console;
    * ``verbose``: every record.

    Raises:
        ValueError: ``verbosity`` is not one of :data:`VERBOSITIES`.
    """

    def __init__(self, verbosity: Verbosity) -> None:
        super().__init__()
        if verbosity not in VERBOSITIES:
            raise ValueError(f"verbosity: got {verbosity!r}; allowed: {', '.join(VERBOSITIES)}")
        self.verbosity = verbosity

    def filter(self, record: logging.LogRecord) -> bool:
        if self.verbosity == "verbose":
            return True
        if self.verbosity == "quiet":
            return record.levelno >= logging.ERROR
        return record.levelno >= logging.WARNING or record.getMessage().startswith("Starting temporary server on ")


class ConsoleLines(logging.Handler):
    """A console handler that prints each record as one line through a rich :class:`~rich.console.Console`: the
    console a progress display runs on, so that a log line lands above the bar and never through it. (Prefect's
    own handler writes to the stream it was given when logging was set up, behind the display's back, which left
    a stale copy of the bar at every line.)"""

    def __init__(self, console: Console) -> None:
        super().__init__()
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.console.print(Text(self.format(record)), soft_wrap=True, highlight=False)
        except RecursionError:  # as logging.StreamHandler.emit
            raise
        except Exception:
            self.handleError(record)


_SIGINT_SEEN = threading.Event()


def mark_interrupts() -> None:
    """Record that Ctrl-C was pressed, then interrupt as usual. A KeyboardInterrupt raised inside a library
    can surface as another exception (pydantic-core turns one raised while it builds a schema into a
    SchemaError); once SIGINT was seen, whatever ends the run is the stop, not an error."""
    previous = signal.getsignal(signal.SIGINT)

    def handler(signum: int, frame: Any) -> None:
        _SIGINT_SEEN.set()
        if callable(previous):
            previous(signum, frame)
        else:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)


def interrupted(exc: BaseException | None) -> bool:
    """``exc`` is (or follows) a Ctrl-C."""
    return _SIGINT_SEEN.is_set() or in_chain(exc, KeyboardInterrupt) is not None


def prepare_prefect() -> None:
    """Prefect's logging set up and its ephemeral server launched, not awaited (:func:`_launch_ephemeral_api`)."""
    _configure_logging()
    _launch_ephemeral_api()


@contextmanager
def _api_after_imports() -> Iterator[None]:
    """Around the flows' imports: the server is launched before them and awaited after (both go on at once)."""
    prepare_prefect()
    yield
    _start_ephemeral_api()


def _configure_logging() -> None:
    """Prefect's logging, set up once with pbrl's console filters; the temporary server is not started yet."""
    # Set before Prefect is first imported (it reads settings at import). Stage code logs with the stdlib
    # under "pbrl"; Prefect forwards it to the run's logs (docs/guides/prefect-ui.md#what-a-run-shows).
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "pbrl")
    # pbrl lines logged before a flow run exists (a fresh storage's model conversion) go to the console, unwarned.
    os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
    # The ephemeral server's default 20 s start-up limit is too short on a busy 2-core machine (13.5 s
    # measured cold, more under load).
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    # Nothing leaves the machine by default: no SDK analytics, no server telemetry (which also logs an
    # ERROR on every start when offline).
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    logging.getLogger("pbrl").setLevel(logging.INFO)
    quiet_libraries()
    from prefect.logging.configuration import (
        ensure_logging_setup,  # deferred: Prefect reads its settings at first import, after prepare_prefect sets them
    )

    ensure_logging_setup()  # Prefect's console handler is on the root logger; its API handler on the run loggers
    for _, handler in _console_handlers():
        for kind in (QuietExpectedErrors, PrefectNoise):
            if not any(isinstance(f, kind) for f in handler.filters):
                handler.addFilter(kind())


def _console_handlers() -> list[tuple[logging.Logger, logging.Handler]]:
    """(logger, handler) for each console handler of Prefect's logging set-up (root, uvicorn, fastapi) and each
    :class:`ConsoleLines` that stands in for one."""
    from prefect.logging.handlers import PrefectConsoleHandler  # deferred: Prefect (seconds)

    loggers = [
        logging.getLogger(),
        *(v for v in logging.root.manager.loggerDict.values() if isinstance(v, logging.Logger)),
    ]
    return [
        (logger, handler)
        for logger in loggers
        for handler in logger.handlers
        if isinstance(handler, PrefectConsoleHandler | ConsoleLines)
    ]


@contextmanager
def console_logging(console: Console, verbosity: Verbosity = "normal") -> Iterator[None]:
    """Within the block, every log record that would reach Prefect's console prints through ``console`` instead
    (:class:`ConsoleLines`: above a progress display on that console, never through it), as ``verbosity`` says
    (:class:`ConsoleLevel`), with the same format and filters. Sets up Prefect's logging first and starts the
    temporary server inside, so that its start line follows the same rule. Prefect's handlers come back after.

    Raises:
        ValueError: ``verbosity`` is not one of :data:`VERBOSITIES`.
    """
    level = ConsoleLevel(verbosity)
    _configure_logging()
    swapped: list[tuple[logging.Logger, logging.Handler, logging.Handler]] = []
    for logger, handler in _console_handlers():
        lines = ConsoleLines(console)
        lines.setLevel(handler.level)
        lines.setFormatter(handler.formatter)
        for f in handler.filters:
            if not isinstance(f, ConsoleLevel):
                lines.addFilter(f)
        lines.addFilter(level)
        logger.removeHandler(handler)
        logger.addHandler(lines)
        swapped.append((logger, handler, lines))
    try:
        _launch_ephemeral_api()  # the run's first use of the API waits for it, inside this block
        yield
    finally:
        for logger, handler, lines in swapped:
            logger.removeHandler(lines)
            logger.addHandler(handler)


def _launch_ephemeral_api() -> None:
    """Start Prefect's ephemeral API server process (no PREFECT_API_URL set) without waiting: the caller's imports
    (torch, the flows: ~15 s on 2 cores) overlap the server's start (~12 s). The first use of the API
    (:func:`_start_ephemeral_api` or Prefect's client) waits with Prefect's own loop. Idempotent."""
    server = _ephemeral_server()
    # A plain server object Prefect's client made first (Python that used the API before pbrl) is only started.
    if hasattr(server, "launch"):
        server.launch()


def _start_ephemeral_api() -> None:
    """Start (or take the launched) ephemeral API server and wait until it answers; no-op with PREFECT_API_URL."""
    if (server := _ephemeral_server()) is not None:
        server.start()


def _ephemeral_server() -> Any:
    """Prefect's ephemeral server object (one per process), started in a session of its own; ``None`` when a
    PREFECT_API_URL is set or the ephemeral server is off.

    Prefect starts it lazily in the terminal's foreground process group, so Ctrl-C reached the server as well
    as pbrl: the server died at once and the client, recording the interrupted run, retried a dead server for
    minutes. In its own session the server sees only the SIGTERM of Prefect's exit hook, after pbrl has
    recorded the run as crashed. On Linux it also dies with pbrl (parent-death signal), so a killed pbrl
    leaves no server holding the database. Prefect reuses this instance (one per port; ``None`` = any)."""
    # deferred: Prefect reads its settings at first import, after _configure_logging sets them
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return None
    return _own_session_server_class()()


@functools.cache
def _own_session_server_class() -> type:
    import prefect  # deferred: Prefect reads its settings at first import, after _configure_logging sets them
    from prefect.server.api.server import SubprocessASGIServer  # deferred, as above
    from prefect.settings import get_current_settings  # deferred, as above

    class OwnSessionServer(SubprocessASGIServer):
        _early: subprocess.Popen[Any] | None = None  # launched, not yet taken by Prefect's start()

        def launch(self) -> None:
            if self.running or self._early is not None:
                return
            if self.port is None:
                self.port = self.find_available_port()
            self._early = self._own_session_process()
            atexit.register(self.stop)  # when start() never comes (an error first): Prefect's stop ends it

        def _run_uvicorn_command(self) -> subprocess.Popen[Any]:
            early, self._early = self._early, None
            return early if early is not None else self._own_session_process()

        def stop(self) -> None:
            if self._early is not None:
                self.server_process, self._early = self._early, None
            super().stop()

        def _own_session_process(self) -> subprocess.Popen[Any]:
            # Prefect 3.9's command and environment (prefect/server/api/server.py), in a new session.
            return subprocess.Popen(
                args=[
                    sys.executable,
                    "-m",
                    "uvicorn",
                    "--app-dir",
                    str(prefect.__module_path__.parent),
                    "--factory",
                    "prefect.server.api.server:create_app",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--log-level",
                    "error",
                    "--lifespan",
                    "on",
                ],
                env={
                    **os.environ,
                    "PREFECT_UI_ENABLED": "0",
                    "PREFECT__SERVER_EPHEMERAL": "1",
                    "PREFECT__SERVER_FINAL": "1",
                    **get_current_settings().to_environment_variables(exclude_unset=True),
                },
                start_new_session=True,
                preexec_fn=_parent_death_signal(),
            )

    return OwnSessionServer


def _parent_death_signal() -> Any:
    """A ``preexec_fn`` that makes the child get SIGTERM when this process dies (Linux), else None. Only from
    the main thread: the signal fires when the *thread* that started the child ends."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: a forked child must not import
    pr_set_pdeathsig = 1
    return lambda: prctl(pr_set_pdeathsig, signal.SIGTERM)


def train(job: JobConfig, *, resume: bool = False, run_dir: Path | None = None) -> dict[str, Any]:
    """Run the training flow in ``run_dir`` (default ``<output_dir>/<run_name>``), held before Prefect starts."""
    from pbrl.run.folder import held_if_exists, run_dir_for  # deferred: imports torch

    with held_if_exists(Path(run_dir) if run_dir is not None else run_dir_for(job) if job.run_name else None):
        with _api_after_imports():
            from flows.training import train_flow  # deferred: flows import Prefect (reads settings at first import)
        with warnings.catch_warnings():
            # The job's notices were said once, when it was built (pbrl.config); Prefect validates the flow parameter
            # again for the run and for every round, which would say them once more each time.
            warnings.simplefilter("ignore", ConfigNotice)
            return train_flow(job, resume=resume, run_dir=None if run_dir is None else str(run_dir))


def rerun_stage(stage: str, run_dir: Path, round_index: int, *, force: bool = False) -> dict[str, Any]:
    """Run one stage as a one-task flow on an existing run folder, held before Prefect starts (see :func:`train`)."""
    from pbrl.run.folder import held_if_exists  # deferred: imports torch

    with held_if_exists(Path(run_dir)):
        with _api_after_imports():
            from flows.stage import stage_flow  # deferred: flows import Prefect, which reads settings at first import
        return stage_flow(stage, str(run_dir), round_index, force=force)


def run_stage_plain(stage: str, run_dir: Path, round_index: int) -> dict[str, Any]:
    """Run one stage's plain function: no Prefect, no cache, no retries."""
    quiet_libraries()
    from flows.cache import run_recorded  # deferred: flows import Prefect, which reads its settings at first import
    from pbrl.reporting.metrics import write_run_metrics  # deferred: imports torch (after quiet_libraries)
    from pbrl.run.folder import open_job, run_lock  # deferred: imports torch (after quiet_libraries)
    from pbrl.run.settings import configure_job_threads  # deferred: imports torch (after quiet_libraries)

    with run_lock(run_dir):
        job = open_job(run_dir)
        configure_job_threads(job)
        manifest = run_recorded(stage, run_dir, round_index, job)
        write_run_metrics(run_dir)
    state = "Completed (no Prefect)"
    return {"stage": stage, "round": round_index, "state": state, "manifest": manifest.model_dump(mode="json")}


def serve(**kwargs: Any) -> None:
    """Register the deployments against the running Prefect server and serve them."""
    with _api_after_imports():
        from flows.serve import serve_deployments  # deferred: flows import Prefect (reads settings at first import)
    serve_deployments(**kwargs)


def deploy(pool: str, **kwargs: Any) -> dict[str, Any]:
    """Register the deployments against the work pool ``pool`` on the running Prefect server (no serving)."""
    with _api_after_imports():
        from flows.serve import deploy_to_pool  # deferred: flows import Prefect, which reads settings at first import
    return deploy_to_pool(pool, **kwargs)
