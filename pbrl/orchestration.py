"""The one bridge from the library to Prefect (docs/design/architecture.md#front-doors): imported lazily by the CLI
and the trainer API,
so that ``import pbrl`` never imports Prefect."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

from pbrl.config import JobConfig
from pbrl.errors import expected_error, in_chain


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


def _prepare_logging() -> None:
    # Set before Prefect is first imported (it reads settings at import). Stage code logs with the stdlib
    # under "pbrl"; Prefect forwards it to the run's logs (notes/prefect.md §7).
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "pbrl")
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
        ensure_logging_setup,  # deferred: Prefect reads its settings at first import, after _prepare_logging sets them
    )

    ensure_logging_setup()  # Prefect's console handler is on the root logger; its API handler on the run loggers
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, QuietExpectedErrors) for f in handler.filters):
            handler.addFilter(QuietExpectedErrors())
    _start_ephemeral_api()


def _start_ephemeral_api() -> None:
    """Start Prefect's ephemeral API server (when no PREFECT_API_URL is set) in a session of its own.

    Prefect starts it lazily in the terminal's foreground process group, so Ctrl-C reached the server as well
    as pbrl: the server died at once and the client, recording the interrupted run, retried a dead server for
    minutes. In its own session the server sees only the SIGTERM of Prefect's exit hook, after pbrl has
    recorded the run as crashed. On Linux it also dies with pbrl (parent-death signal), so a killed pbrl
    leaves no server holding the database. Prefect reuses this instance (one per port; ``None`` = any)."""
    # deferred: Prefect reads its settings at first import, after _prepare_logging sets them
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_SERVER_EPHEMERAL_ENABLED,
    )

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return
    import prefect  # deferred: Prefect reads its settings at first import, after _prepare_logging sets them
    from prefect.server.api.server import SubprocessASGIServer  # deferred, as above
    from prefect.settings import get_current_settings  # deferred, as above

    die_with_parent = _parent_death_signal()

    class OwnSessionServer(SubprocessASGIServer):
        def _run_uvicorn_command(self) -> subprocess.Popen[Any]:
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
                preexec_fn=die_with_parent,
            )

    OwnSessionServer().start()  # no-op when this process already runs one


def _parent_death_signal() -> Any:
    """A ``preexec_fn`` that makes the child get SIGTERM when this process dies (Linux), else None. Only from
    the main thread: the signal fires when the *thread* that started the child ends."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: a forked child must not import
    pr_set_pdeathsig = 1
    return lambda: prctl(pr_set_pdeathsig, signal.SIGTERM)


def train(job: JobConfig, *, resume: bool = False, run_dir: Path | None = None) -> dict[str, Any]:
    """Run the training flow (ephemeral API unless PREFECT_API_URL points at a server) in ``run_dir``
    (default ``<output_dir>/<run_name>``)."""
    _prepare_logging()
    from flows.training import train_flow  # deferred: flows import Prefect, which reads its settings at first import

    return train_flow(job, resume=resume, run_dir=None if run_dir is None else str(run_dir))


def rerun_stage(stage: str, run_dir: Path, round_index: int, *, force: bool = False) -> dict[str, Any]:
    """Run one stage as a one-task flow on an existing run folder."""
    _prepare_logging()
    from flows.stage import stage_flow  # deferred: flows import Prefect, which reads its settings at first import

    return stage_flow(stage, str(run_dir), round_index, force=force)


def run_stage_plain(stage: str, run_dir: Path, round_index: int) -> dict[str, Any]:
    """Run one stage's plain function: no Prefect, no cache, no retries."""
    quiet_libraries()
    from flows.cache import run_recorded  # deferred: flows import Prefect, which reads its settings at first import
    from pbrl.reporting.metrics import write_run_metrics  # deferred: imports torch (after quiet_libraries)
    from pbrl.run.folder import open_job, run_lock  # deferred: imports torch (after quiet_libraries)

    with run_lock(run_dir):
        manifest = run_recorded(stage, run_dir, round_index, open_job(run_dir))
        write_run_metrics(run_dir)
    return {
        "stage": stage,
        "round": round_index,
        "state": "Completed (no Prefect)",
        "manifest": manifest.model_dump(mode="json"),
    }


def serve(**kwargs: Any) -> None:
    """Register the deployments against the running Prefect server and serve them."""
    _prepare_logging()
    from flows.serve import (
        serve_deployments,  # deferred: flows import Prefect, which reads its settings at first import
    )

    serve_deployments(**kwargs)


def deploy(pool: str, **kwargs: Any) -> dict[str, Any]:
    """Register the deployments against the work pool ``pool`` on the running Prefect server (no serving)."""
    _prepare_logging()
    from flows.serve import deploy_to_pool  # deferred: flows import Prefect, which reads its settings at first import

    return deploy_to_pool(pool, **kwargs)
