"""Training flows for runs started from the Prefect UI (docs/guides/prefect-ui.md#serve-the-deployments): a form per
trainer that a person reads in one screen, and a config file.

A trainer's form (its layout and JSON schema) is :mod:`flows.ui_form`. The run folder is named after the flow run
(the form's *Run Name*), so Prefect's *Retry* of it continues the same folder.

The form's values map back to one flat job (:func:`form_job`), validated by :func:`pbrl.config.parse_job` and run
exactly as ``pbrl train`` runs it (:func:`flows.training.start_training`): same messages, same run folder.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from prefect import Flow, flow
from prefect.runtime import flow_run
from pydantic import Field, WithJsonSchema

from flows.training import given_name, start_training
from flows.ui_form import OTHER, SECTION_NAMES, SECTIONS, form_layout, form_signature
from pbrl.config import JOB_CLASSES, load_job, parse_job
from pbrl.errors import ConfigError, Problem
from pbrl.run.folder import generated_run_name

CONFIGS_DIR = Path(__file__).resolve().parent / "configs"
DEPLOYMENT_NAMES = {"madpo": "madpo", "madpo_iter": "madpo-iter", "marlhf": "marlhf", "marlhf_iter": "marlhf-iter"}


def form_job(trainer: str, run_name: str | None, values: Mapping[str, Any]) -> dict[str, Any]:
    """The flat job (the mapping a YAML config holds) of a form's ``values``: ``trainer``, ``run_name``, and every
    option given, a section's options lifted to the top; an option equal to its default is left out, as a config
    file would leave it out. Unknown names stay in, for :func:`pbrl.config.parse_job` to report.

    Raises:
        ConfigError: a section that is not a mapping of option: value, or an option given twice.
    """
    fields = JOB_CLASSES[trainer].model_fields
    flat: dict[str, Any] = {}
    problems = []
    for name, value in values.items():
        if name in SECTION_NAMES:
            if value is None:
                continue
            if not isinstance(value, Mapping):
                problems.append(Problem(name, value, "a section is a mapping of option: value"))
                continue
            given = list(value.items())
        else:
            given = [(name, value)]
        for option, v in given:
            if option in flat:
                problems.append(Problem(option, v, "given twice (at the top and in a section, or in two sections)"))
            flat[option] = v
    if problems:
        raise ConfigError(problems)
    kept = {
        k: v
        for k, v in flat.items()
        if k not in fields
        or json.dumps(v, default=str) != json.dumps(fields[k].get_default(call_default_factory=True), default=str)
    }
    return {"trainer": trainer, "run_name": run_name, **kept}


def _named(trainer: str):
    def run_name() -> str:
        return given_name() or generated_run_name(trainer)

    return run_name


def trainer_flow(trainer: str) -> Flow[..., dict[str, Any]]:
    """The flow ``pbrl-train`` whose parameters are the form of ``trainer`` (see :func:`flows.ui_form.form_schema`).

    The run folder is named after the flow run (the form's Run Name, kept on a retry; from Python,
    ``<trainer>-<UTC time>``). The values are validated like a YAML file's (:func:`form_job`,
    :func:`pbrl.config.parse_job`): a job that breaks a rule fails before any work with every problem once
    (:func:`flows.training.start_training`). Prefect's own parameter validation is off: the server already checked
    the JSON schema, and pbrl's validation gives pbrl's messages.
    """

    def run(**values: Any) -> dict[str, Any]:
        return start_training(lambda: parse_job(form_job(trainer, flow_run.name, values)))  # type: ignore[return-value]

    run.__name__ = run.__qualname__ = trainer  # the deployment's entrypoint is flows/ui.py:<trainer>
    run.__module__ = __name__
    run.__doc__ = f"Train with trainer {trainer!r} from a form: the options every run needs, then " + ", ".join(
        s.name for s in (*SECTIONS, OTHER) if s.name in form_layout(trainer)
    )
    run.__signature__ = form_signature(trainer)  # type: ignore[attr-defined]
    return flow(run, name="pbrl-train", flow_run_name=_named(trainer), log_prints=True, validate_parameters=False)


madpo = trainer_flow("madpo")
madpo_iter = trainer_flow("madpo_iter")
marlhf = trainer_flow("marlhf")
marlhf_iter = trainer_flow("marlhf_iter")
TRAINER_FLOWS: dict[str, Flow[..., dict[str, Any]]] = {
    "madpo": madpo,
    "madpo_iter": madpo_iter,
    "marlhf": marlhf,
    "marlhf_iter": marlhf_iter,
}


def config_path(config: str) -> Path:
    """Where the config-file flow reads ``config``: the path as given (relative to the working folder of
    ``pbrl serve``, as ``pbrl train`` would read it), else relative to the pbrl checkout (so that
    ``flows/configs/tiny-madpo.yaml`` works wherever ``pbrl serve`` runs). A path found in neither is
    returned as given, for :func:`pbrl.config.load_job` to report."""
    given = Path(config).expanduser()
    if given.is_file() or given.is_absolute():
        return given
    in_checkout = CONFIGS_DIR.parent.parent / given
    return in_checkout if in_checkout.is_file() else given


def _file_run_name() -> str:
    return flow_run.parameters.get("run_name") or Path(str(flow_run.parameters.get("config", "run"))).stem


def _shipped_configs() -> str:
    return ", ".join(f"flows/configs/{p.name}" for p in sorted(CONFIGS_DIR.glob("*.yaml")))


RESUME_DESCRIPTION = (
    "Continue the run of this config from its last complete stage (completed stages come back Cached) instead "
    "of starting it. (Prefect's Retry of a failed run, and pbrl-train/continue, do this too.)"
)


@flow(name="pbrl-train", flow_run_name=_file_run_name, log_prints=True)
def config_file(
    config: str = Field(
        description="Path of a YAML config as the worker sees it (relative paths from the folder "
        "where `pbrl serve` runs, else from the pbrl checkout); shipped: " + _shipped_configs()
    ),
    overrides: list[str] = Field(
        [],
        description="Overrides key=value, applied in order, as "
        "`pbrl train CONFIG --set key=value` (e.g. num_iterations=3).",
    ),
    run_name: Annotated[str | None, WithJsonSchema({"type": "string", "minLength": 1})] = Field(
        None,
        description="Run folder name; empty = the config's run_name, else the config file's name "
        "(as `pbrl train --run-name`).",
    ),
    resume: bool = Field(False, description=RESUME_DESCRIPTION),
) -> dict[str, Any]:
    """Train the run a YAML config file describes, exactly as ``pbrl train CONFIG --set ... --run-name ...``:
    the same validation and messages as ``pbrl validate`` (a job that cannot start fails with them, once), the
    same run folder."""

    def job() -> Any:
        extra = [*overrides, *([f"run_name={run_name}"] if run_name else [])]
        loaded = load_job(config_path(config), extra)
        return loaded if loaded.run_name else loaded.model_copy(update={"run_name": Path(config).stem})

    return start_training(job, resume=resume)  # type: ignore[return-value]
