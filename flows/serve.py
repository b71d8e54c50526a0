"""Deployments for a running Prefect server: the training flow (its parameter form is the config model)
and a nightly "one more iteration" deployment on a UTC cron schedule, at most one run at a time."""

from __future__ import annotations

from typing import Any

from prefect import serve
from prefect.schedules import Cron

from flows.training import add_iteration_flow, train_flow

DEFAULT_CRON = "0 2 * * *"  # 02:00 UTC every night (UTC avoids daylight-saving gaps)


def build_deployments(*, nightly_run: str | None = None, output_dir: str = "storage/runs",
                      cron: str = DEFAULT_CRON) -> list[Any]:
    """The deployments: ``pbrl-train/train`` always; ``pbrl-add-iteration/nightly`` when a run is named."""
    deployments = [train_flow.to_deployment(
        name="train", description="Train a run from a pbrl config (the form is the config model).",
        tags=["pbrl"], concurrency_limit=1)]
    if nightly_run:
        deployments.append(add_iteration_flow.to_deployment(
            name="nightly", description=f"Add one iteration to run {nightly_run!r} every night.",
            schedule=Cron(cron, timezone="UTC"), parameters={"run_name": nightly_run, "output_dir": output_dir},
            concurrency_limit=1, tags=["pbrl", "nightly"]))
    return deployments


def register_deployments(**kwargs: Any) -> list[Any]:
    """Create or update the deployments on the server named by PREFECT_API_URL; returns their ids."""
    return [d.apply() for d in build_deployments(**kwargs)]


def serve_deployments(**kwargs: Any) -> None:
    """Register the deployments and serve them until stopped (runs start as subprocesses of this one)."""
    serve(*build_deployments(**kwargs), pause_on_shutdown=False)
