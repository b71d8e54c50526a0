"""The ``pbrl`` commands that set things up rather than touch a run: ``serve`` and ``deploy`` (pbrl's
deployments on a Prefect server) and ``models`` (the packaged models). :mod:`pbrl.cli.commands` registers them on the
``pbrl`` command.

Imports that cost seconds (Prefect, torch, transformers) happen inside the commands that need them, each saying
why, so that ``pbrl --help`` answers at once.
"""

from __future__ import annotations

import os
from typing import Annotated

import typer
from rich.table import Table

from pbrl.cli.display import _fail, console

models_app = typer.Typer(help="Packaged models (converted once under storage/models/).", no_args_is_help=True)


def _check_schedule_and_server(cron: str) -> None:
    """Before any server is contacted: ``cron`` parses as the server would parse it (Prefect's vendored croniter),
    and ``PREFECT_API_URL`` is set. Exits with one error line otherwise."""
    from prefect.client.schemas.schedules import CronSchedule  # deferred: Prefect (seconds)

    try:
        CronSchedule(cron=cron, timezone="UTC")
    except ValueError:  # pydantic's ValidationError
        raise _fail(
            ValueError(
                f"--cron: got {cron!r}; expected a 5-field cron expression in UTC "
                "(minute hour day-of-month month day-of-week), e.g. '0 2 * * *'"
            )
        ) from None
    if not os.environ.get("PREFECT_API_URL"):
        raise _fail(
            ValueError(
                "PREFECT_API_URL is not set: start `prefect server start` and export "
                "PREFECT_API_URL=http://127.0.0.1:4200/api"
            )
        )


def serve(
    nightly_run: Annotated[str | None, typer.Option(help="Run name that the nightly deployment extends.")] = None,
    output_dir: Annotated[str, typer.Option(help="Where the nightly run lives.")] = "storage/runs",
    cron: Annotated[str, typer.Option(help="Nightly schedule, cron in UTC.")] = "0 2 * * *",
) -> None:
    """Register and serve the deployments on the Prefect server at PREFECT_API_URL: a run form per trainer
    (pbrl-train/madpo, madpo-iter, marlhf, marlhf-iter), pbrl-train/config-file (a YAML path + overrides),
    pbrl-train/train (the job as JSON) and, with --nightly-run, pbrl-add-iteration/nightly.

    Example: prefect server start & PREFECT_API_URL=http://127.0.0.1:4200/api pbrl serve --nightly-run docs-1
    """
    _check_schedule_and_server(cron)
    from pbrl import orchestration  # deferred: Prefect reads settings that orchestration sets first

    orchestration.serve(nightly_run=nightly_run, output_dir=output_dir, cron=cron)


def deploy(
    pool: Annotated[
        str, typer.Option(help="Prefect work pool to register against (created as a 'process' pool when missing).")
    ],
    nightly_run: Annotated[str | None, typer.Option(help="Run name that the nightly deployment extends.")] = None,
    output_dir: Annotated[str, typer.Option(help="Where the nightly run lives.")] = "storage/runs",
    cron: Annotated[str, typer.Option(help="Nightly schedule, cron in UTC.")] = "0 2 * * *",
) -> None:
    """Register the deployments of `pbrl serve` against a Prefect work pool instead of serving them here: runs
    start on the machines that run `prefect worker start --pool NAME` (pbrl installed there; run folders on a
    filesystem every worker shares).

    Example: PREFECT_API_URL=http://head:4200/api pbrl deploy --pool gpu-pool --nightly-run docs-1
    """
    _check_schedule_and_server(cron)
    from pbrl import orchestration  # deferred: Prefect reads settings that orchestration sets first

    ids = orchestration.deploy(pool, nightly_run=nightly_run, output_dir=output_dir, cron=cron)
    for name in ids:
        console.print(f"deployed {name} -> work pool {pool}")
    console.print(f"start a worker on each machine: prefect worker start --pool {pool}")


@models_app.command("list")
def models_list() -> None:
    """The packaged models and whether they are prepared."""
    from pbrl.models.packaged import list_packaged_models  # deferred: imports torch and transformers

    t = Table(title="packaged models")
    for col in ("name", "prepared", "folder"):
        t.add_column(col)
    for name, ready, folder in list_packaged_models():
        t.add_row(name, "yes" if ready else "no", str(folder))
    console.print(t)


@models_app.command("prepare")
def models_prepare(name: str) -> None:
    """Convert a packaged model once (GGUF -> safetensors under storage/models/)."""
    from pbrl.models.packaged import prepare_packaged_model  # deferred: imports torch and transformers

    try:
        console.print(f"ready: {prepare_packaged_model(name)}")
    except (KeyError, ImportError, FileNotFoundError, RuntimeError) as exc:
        raise _fail(exc) from None
