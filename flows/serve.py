"""Deployments for a running Prefect server (docs/guides/prefect-ui.md#serve-the-deployments): a form per trainer, a
config file, the JSON job, continuing a run by its name, and a nightly "one more iteration" deployment on a UTC cron
schedule; each at most one run at a time.

| deployment | parameters (the form in the Prefect UI) |
|---|---|
| ``pbrl-train/madpo``, ``madpo-iter``, ``marlhf``, ``marlhf-iter`` | the options every run needs, then sections |
| ``pbrl-train/config-file`` | a YAML config path, ``key=value`` overrides, run name, resume |
| ``pbrl-train/train`` | the whole job as one JSON object (for scripts and the API) |
| ``pbrl-train/continue`` | a run's name (and folder), optionally more ``num_iterations`` |
| ``pbrl-add-iteration/nightly`` | the run to extend (only with ``nightly_run``) |
"""

from __future__ import annotations

import threading
from typing import Any

from prefect import serve
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.deployments.runner import EntrypointType
from prefect.exceptions import ObjectAlreadyExists
from prefect.schedules import Cron

from flows.labels import keep_label_deadlines
from flows.training import add_iteration_flow, continue_run, train_flow
from flows.ui import DEPLOYMENT_NAMES, TRAINER_FLOWS, config_file
from flows.ui_form import form_defaults, form_layout

DEFAULT_CRON = "0 2 * * *"  # 02:00 UTC every night (UTC avoids daylight-saving gaps)


# The deployments whose parameters are the flow's own: (flow, name, description: what the Prefect UI shows).
_FIXED_DEPLOYMENTS = (
    (
        config_file,
        "config-file",
        "Train from a YAML config file plus key=value overrides, as `pbrl train CONFIG --set ...` (same validation, "
        "same run folder).",
    ),
    (
        continue_run,
        "continue",
        "Continue a run by its name from its last complete stage, every option read from its run.json (as `pbrl "
        "train --run RUN --resume`); num_iterations adds rounds to an iterative run.",
    ),
    (
        train_flow,
        "train",
        "Train a run from a whole pbrl job given as one JSON object (for scripts and the API; the forms are "
        "pbrl-train/madpo ... and pbrl-train/config-file).",
    ),
)


def build_deployments(
    *,
    nightly_run: str | None = None,
    output_dir: str = "storage/runs",
    cron: str = DEFAULT_CRON,
    pool: str | None = None,
) -> list[Any]:
    """The deployments of the table above; ``pbrl-add-iteration/nightly`` only when a run is named. With
    ``pool`` they are bound to that Prefect work pool and load their flows by module path (``flows.training
    .train_flow``), so a worker finds them wherever pbrl is installed, whatever its working directory."""
    kw: dict[str, Any] = {} if pool is None else {"work_pool_name": pool, "entrypoint_type": EntrypointType.MODULE_PATH}
    deployments = [_form_deployment(trainer, name, kw) for trainer, name in DEPLOYMENT_NAMES.items()]
    deployments += [
        flow.to_deployment(name=name, description=description, tags=["pbrl"], concurrency_limit=1, **kw)
        for flow, name, description in _FIXED_DEPLOYMENTS
    ]
    if nightly_run:
        deployments.append(_nightly_deployment(nightly_run, output_dir, cron, kw))
    return [_empty_is_none(d) for d in deployments]


def _form_deployment(trainer: str, name: str, kw: dict[str, Any]) -> Any:
    """``pbrl-train/<name>``: a form of the options of ``trainer`` (:mod:`flows.ui_form`), at their defaults."""
    return TRAINER_FLOWS[trainer].to_deployment(
        name=name,
        description=f"Train a {trainer!r} run from a form: the options every run needs, then the sections "
        + ", ".join(s for s in form_layout(trainer) if s != "main")
        + " (each at its defaults until changed). The run's folder is <output_dir>/<Run Name>; Retry of a "
        "failed run continues it.",
        parameters=form_defaults(trainer),
        tags=["pbrl", "form"],
        concurrency_limit=1,
        **kw,
    )


def _nightly_deployment(nightly_run: str, output_dir: str, cron: str, kw: dict[str, Any]) -> Any:
    """``pbrl-add-iteration/nightly``: one more iteration of the run ``nightly_run`` on the UTC ``cron`` schedule."""
    return add_iteration_flow.to_deployment(
        name="nightly",
        description=f"Add one iteration to run {nightly_run!r} {schedule_words(cron)} (cron {cron!r} in UTC: "
        "the schedule's card shows the time without its zone, the run lists in your browser's time).",
        schedule=Cron(cron, timezone="UTC", slug=schedule_words(cron)),
        parameters={"run_name": nightly_run, "output_dir": output_dir},
        concurrency_limit=1,
        tags=["pbrl", "nightly"],
        **kw,
    )


def schedule_words(cron: str) -> str:
    """``cron`` (in UTC) as the V1 UI's schedule card shows it, with its time zone (the card shows a schedule's slug
    when it has one; V2's card shows the cron in words without a zone): ``every day at 02:00 UTC`` for a daily
    ``M H * * *``, else ``cron '<cron>' in UTC``."""
    fields = cron.split()
    if len(fields) == 5 and fields[0].isdigit() and fields[1].isdigit() and fields[2:] == ["*", "*", "*"]:
        return f"every day at {int(fields[1]):02d}:{int(fields[0]):02d} UTC"
    return f"cron {cron!r} in UTC"


def _empty_is_none(deployment: Any) -> Any:
    """``deployment`` with no ``"default": null`` in its parameter schema, so that an optional parameter whose
    default is None (``continue``'s ``num_iterations``, the config file's ``run_name``) may be left empty in the
    form. Prefect writes that null default into the schema, the UI fills the field with it, and the server's own
    validation then refuses it ("None is not of type 'integer'"); without it, the server takes an optional field
    that is empty or null as leaving it out, and the flow gets its Python default. Prefect has no public way to
    leave a default out of the schema, so its private attribute is edited (tests/unit/flows/test_serve.py checks the
    registered schema)."""
    for field in deployment._parameter_openapi_schema.properties.values():
        if "default" in field and field["default"] is None:
            del field["default"]
    return deployment


def deploy_to_pool(pool: str, **kwargs: Any) -> dict[str, Any]:
    """Register the deployments (``build_deployments(**kwargs)``) against the Prefect work pool ``pool`` on the
    server at PREFECT_API_URL, creating it as a ``process`` pool when it does not exist. Runs then start on
    whichever machine runs ``prefect worker start --pool <pool>`` (pbrl installed there, run folders on storage
    it shares with the others).

    Returns:
        ``{"<flow>/<deployment>": deployment id}``.
    """

    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
        except ObjectAlreadyExists:
            pass  # an existing pool is used as it is (its type too: docker, kubernetes, ...)
    return {f"{d.flow_name}/{d.name}": d.apply() for d in build_deployments(pool=pool, **kwargs)}


def serve_deployments(**kwargs: Any) -> None:
    """Register the deployments and serve them until stopped (runs start as subprocesses of this one); meanwhile a
    thread resumes the runs whose labelling time is over (:func:`flows.labels.keep_label_deadlines`)."""
    stop = threading.Event()
    keep_label_deadlines(stop)
    try:
        serve(*build_deployments(**kwargs), pause_on_shutdown=False)
    finally:
        stop.set()
