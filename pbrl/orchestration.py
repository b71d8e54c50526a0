"""The one bridge from the library to Prefect (SPEC §1): imported lazily by the CLI and the trainer API,
so that ``import pbrl`` never imports Prefect."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from pbrl.config import JobConfig


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


def train(job: JobConfig, *, resume: bool = False) -> dict[str, Any]:
    """Run the training flow (ephemeral API unless PREFECT_API_URL points at a server)."""
    _prepare_logging()
    from flows.training import train_flow

    return train_flow(job, resume=resume)


def rerun_stage(stage: str, run_dir: Path, round_index: int, *, force: bool = False) -> dict[str, Any]:
    """Run one stage as a one-task flow on an existing run folder."""
    _prepare_logging()
    from flows.stage import stage_flow

    return stage_flow(stage, str(run_dir), round_index, force=force)


def run_stage_plain(stage: str, run_dir: Path, round_index: int) -> dict[str, Any]:
    """Run one stage's plain function: no Prefect, no cache, no retries."""
    from pbrl.metrics import write_run_metrics
    from pbrl.run import open_job
    from stages import STAGE_MODULES

    manifest = STAGE_MODULES[stage].run(run_dir, round_index, open_job(run_dir))
    write_run_metrics(run_dir)
    return {"stage": stage, "round": round_index, "state": "Completed (no Prefect)",
            "manifest": manifest.model_dump(mode="json")}


def serve(**kwargs: Any) -> None:
    """Register the deployments against the running Prefect server and serve them."""
    _prepare_logging()
    from flows.serve import serve_deployments

    serve_deployments(**kwargs)
