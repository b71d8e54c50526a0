"""The one-stage flow: rerun a single stage of a finished or failed round on the same run folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow

from flows.round import call_stage
from pbrl.reporting.metrics import write_run_metrics
from pbrl.run.folder import open_job, run_lock
from pbrl.run.settings import configure_job_threads


@flow(name="pbrl-stage", flow_run_name="{stage}-r{round_index}")
def stage_flow(stage: str, run_dir: str, round_index: int, force: bool = False) -> dict[str, Any]:
    """Run ``stage`` for ``round_index`` alone; Cached when its inputs and outputs are unchanged."""
    with run_lock(Path(run_dir)):  # another process working on the run is named, never computed under
        job = open_job(run_dir)
        configure_job_threads(job)
        result = call_stage(stage, run_dir, round_index, job, force=force)
        write_run_metrics(run_dir)
    return result
