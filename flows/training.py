"""The training flow: prepare or resume a run, the round-0 baseline, then one round flow per round; and the ways to
continue a run (docs/guides/prefect-ui.md#retry-and-continue): Prefect's *Retry* of a flow run resumes the run
folder that flow run created, the ``continue`` flow resumes a run named by its folder, and the nightly flow adds an
iteration.

Every entry goes through :func:`start_training`, so while a run trains its flow run's log shows the run's events
(:mod:`flows.logs`) and a job that cannot start fails once, cleanly, with every problem.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

from prefect import flow, tags
from prefect.client.orchestration import get_client
from prefect.context import FlowRunContext
from prefect.runtime import flow_run
from prefect.states import State
from pydantic import BaseModel, Field, WithJsonSchema

from flows.labels import await_labels, take_submitted
from flows.logs import end_state, run_log
from flows.ray_runner import ray_session
from flows.round import AWAITING_LABELS, call_stage, evaluation_due, round_flow
from flows.run_home import publish_run_home, run_tag, tag_flow_run
from pbrl.config import ConfigNotice, JobConfig, is_iterative, num_rounds, parse_job
from pbrl.data.storage import RunPaths, existing_rounds, read_run_id
from pbrl.errors import ArtifactError, ConfigError, Problem, expected_error
from pbrl.reporting.metrics import round_table, write_run_metrics
from pbrl.reporting.trackers import RunTracker
from pbrl.run.folder import (
    generated_run_name,
    open_job,
    open_run,
    prepare_run,
    run_dir_for,
    run_lock,
    runs_in,
    with_run_name,
)
from pbrl.run.progress import Event, listening, publish
from pbrl.run.settings import configure_job_threads

# The label on a flow run that names the run it created (the UUID in run.json): a retry of that flow run resumes it.
RUN_ID_LABEL = "pbrl.run_id"


def given_name() -> str | None:
    """The name the current flow run already has when it came from a deployment (the UI's Run Name, or the name the
    API or Prefect gave it) or ran before (a retry): a flow-run-name function keeps it, so the run folder named
    after it is the same on every retry. None for a first run called from Python."""
    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return None
    run = context.flow_run
    return run.name if run.deployment_id is not None or run.run_count > 0 else None


def _flow_run_name() -> str:
    config = flow_run.parameters.get("config")
    name = getattr(config, "run_name", None) or (config.get("run_name") if isinstance(config, dict) else None)
    trainer = getattr(config, "trainer", None) or (config.get("trainer") if isinstance(config, dict) else None)
    return name or given_name() or generated_run_name(str(trainer or "run"))


@flow(name="pbrl-train", flow_run_name=_flow_run_name, log_prints=True, validate_parameters=False)
def train_flow(config: JobConfig, resume: bool = False, run_dir: str | None = None) -> dict[str, Any]:
    """Train cooperating agents from preferences between their joint responses (MADPO or MARLHF, base or iterative).

    With ``resume`` an existing run continues: stages whose inputs and outputs are unchanged come back
    Cached and only what is missing or stale runs. A config without ``run_name`` (a run started from the
    UI) is named after its flow run, by default ``<trainer>-<UTC time>``, so a retry of the flow run finds the
    same folder. ``run_dir`` is the run folder to use (a run that was moved or copied is resumed where it is now);
    by default ``<output_dir>/<run_name>``. ``config`` may also be the job as a mapping (a deployment's JSON
    parameter): it is validated as a YAML file's is (:func:`pbrl.config.parse_job`), with every problem at once.

    Returns:
        see :func:`run_training`; a job that cannot start returns a Failed state (:func:`start_training`), and a
        Python call then raises its error (e.g. :class:`~pbrl.errors.ConfigError`).
    """

    def job() -> JobConfig:
        parsed = config if isinstance(config, BaseModel) else parse_job(config)
        return parsed if parsed.run_name else parsed.model_copy(update={"run_name": flow_run.name})

    return start_training(job, resume=resume, run_dir=run_dir)  # type: ignore[return-value]


def start_training(
    job: Callable[[], JobConfig], *, resume: bool = False, run_dir: str | None = None
) -> dict[str, Any] | State[Any]:
    """The body of every training flow: ``job()`` builds and validates the job (its
    :class:`~pbrl.config.ConfigNotice` s become WARNING lines of the run's log), then :func:`run_training`, with
    the run's events as lines of the flow run's log (:func:`flows.logs.run_log`).

    Returns:
        :func:`run_training`'s result; or, when the job cannot start (an expected pbrl error, e.g. a
        :class:`~pbrl.errors.ConfigError` with every problem, before any stage ran), a Failed state that logged
        the problems once, without a traceback (:meth:`flows.logs.RunLog.reject`).

    Raises:
        Exception: whatever stops the run after it started (a failed stage), as it is.
    """
    with run_log() as log:
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", ConfigNotice)
                built = job()
            log.notices(caught)
            return run_training(built, resume=resume, run_dir=run_dir)
        except Exception as exc:
            found = expected_error(exc)
            if found is None or log.started:
                raise
            return log.reject(found)


def run_training(config: JobConfig, *, resume: bool = False, run_dir: str | None = None) -> dict[str, Any]:
    """Prepare or resume the run, the round-0 baseline, then the rounds (what every training flow runs).

    A flow run that Prefect runs again (its *Retry*, ``run_count`` > 1) resumes the run folder it created
    (:func:`resumes_on_retry`), as ``resume`` does.

    Returns:
        ``{"run_dir", "messages", "stages": [{"stage", "round", "state"}]}``.
    """
    config = with_run_name(config)
    folder = Path(run_dir) if run_dir else run_dir_for(config)
    resume = resume or resumes_on_retry(folder)
    tag_flow_run(folder.name)  # even a flow run refused below belongs to the run's list of flow runs
    _refuse_taking_over(folder, resume)
    with contextlib.ExitStack() as held:
        if (folder / "run.json").is_file():  # a run that exists is held before anything reads or writes it
            held.enter_context(run_lock(folder))
        run_dir = str(prepare_run(config, resume=resume, run_dir=folder))
        held.enter_context(run_lock(folder))  # re-entrant; a new run's folder exists from here on
        config = open_job(folder)  # as stored: torch_dtype/mixed_precision 'auto' made concrete when it started
        configure_job_threads(config)  # the CPUs this process owns (pbrl/models/threads.py)
        _label_flow_run(folder)
        take_submitted(folder, config)  # labels of forms submitted since this run last ran: stored before all else
        held.enter_context(tags(run_tag(folder.name)))  # the rounds' subflow runs carry the run's tag too
        _show_home(folder)
        trackers = [RunTracker.for_run(folder)] if config.report_to else []
        for tracker in trackers:  # before round 0: a tracker that cannot start stops the run with one line
            tracker.open()
        held.enter_context(listening(folder, trackers))
        stages: list[dict[str, Any]] = []
        started = time.monotonic()
        publish(Event("run_start", run_dir))
        try:
            with ray_session(config):  # runner 'ray': one Ray connection for the whole run; nothing for 'local'
                if evaluation_due(config, 0):
                    publish(Event("round_start", run_dir, 0))
                    stages.append(call_stage("evaluate", run_dir, 0, config))
                    _round_end(run_dir, 0, started)
                for r in range(1, num_rounds(config) + 1):
                    round_started = time.monotonic()
                    stages.extend(labelled_round(run_dir, r, config))
                    _round_end(run_dir, r, round_started)
            write_run_metrics(run_dir)
        except BaseException as exc:
            ended = end_state(exc)  # Cancelled: a person cancelled the flow run
            publish(Event("run_end", run_dir, state=ended, seconds=time.monotonic() - started))
            _show_home(folder, ended)
            raise
        publish(Event("run_end", run_dir, state="Completed", seconds=time.monotonic() - started))
        _show_home(folder, "Completed")
    messages = [f"round {s['round']} {s['stage']}: {m}" for s in stages for m in s["manifest"].get("messages", [])]
    return {
        "run_dir": run_dir,
        "messages": messages,
        "stages": [{k: s[k] for k in ("stage", "round", "state")} for s in stages],
    }


def labelled_round(run_dir: str, round_index: int, config: JobConfig) -> list[dict[str, Any]]:
    """The round flow of round ``round_index``; while its pairs wait for people's labels (``judge: human``), the
    flow run waits for them (:func:`flows.labels.await_labels`: it suspends, or stops a run that cannot) and the
    round flow runs again once they came (its finished stages Cached)."""
    while True:
        done = round_flow(run_dir, config.run_name, round_index, config)
        if not done or done[-1]["state"] != AWAITING_LABELS:
            return done
        await_labels(run_dir, round_index, config)


def _refuse_taking_over(folder: Path, resume: bool) -> None:
    """A flow run started from a deployment (a form, the API) that names an existing run, and is not its Retry,
    stops here with what to do in the UI (elsewhere :func:`pbrl.run.folder.prepare_run` words it for the CLI).

    Raises:
        ConfigError: the run exists and ``resume`` is off.
    """
    context = FlowRunContext.get()
    if resume or not RunPaths(folder).run_json.is_file() or context is None or context.flow_run is None:
        return
    if context.flow_run.deployment_id is None:
        return
    how = (
        f"run {folder.name} already exists in {folder.parent}; continue it with the deployment pbrl-train/continue "
        f"(run_name {folder.name}), Retry the flow run that started it when that one failed or crashed (its menu, "
        f"Retry), or choose another name (the runs list filtered by the tag {run_tag(folder.name)} shows its flow runs)"
    )
    raise ConfigError([Problem("run_name", folder.name, how)])


def _show_home(folder: Path, ended: str | None = None) -> None:
    """The run's page (:func:`flows.run_home.publish_run_home`) as this flow run starts, or ends ``ended``; a server
    that cannot take it is logged, never raised over the run and how it ended."""
    try:
        publish_run_home(folder, ending=ended)
    except Exception as exc:  # the run and its own outcome (its result or error) matter more than its page
        logging.getLogger(__name__).warning("could not update the artifact run-%s: %s", folder.name, exc)


def resumes_on_retry(folder: Path) -> bool:
    """Whether the current flow run runs again (its *Retry* in the UI, ``prefect flow-run retry``, or its Resume after
    it suspended to wait for labels) and ``folder`` holds the run it created before: the run id it recorded as its
    own label ``pbrl.run_id`` (set once the folder is made, so a first run has none); then it resumes that run
    instead of failing with "already exists". Not ``run_count``: Prefect does not count a resume after a suspension,
    and clears its ``resuming`` flag before the flow runs. False outside a flow run, for a first run, and for a folder
    of another run."""
    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return False
    recorded = context.flow_run.labels.get(RUN_ID_LABEL)
    if recorded is None or not RunPaths(folder).run_json.is_file():
        return False
    try:
        return read_run_id(RunPaths(folder)) == recorded
    except ArtifactError:  # run.json without a run id: not a run this flow run created
        return False


def _label_flow_run(folder: Path) -> None:
    """Record the run's id on the current flow run (label ``pbrl.run_id``), so that a retry finds its run."""
    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return
    run_id = read_run_id(RunPaths(folder))
    if context.flow_run.labels.get(RUN_ID_LABEL) == run_id:
        return
    with get_client(sync_client=True) as client:
        client.update_flow_run_labels(context.flow_run.id, {RUN_ID_LABEL: run_id})
    context.flow_run.labels[RUN_ID_LABEL] = run_id


def _round_end(run_dir: str, round_index: int, started: float) -> None:
    """Rebuild metrics.parquet and publish the round's row of the round table (a ``round_end`` event)."""
    write_run_metrics(run_dir)
    table = round_table(run_dir)
    row = table.loc[round_index] if round_index in table.index else None
    metrics = {} if row is None else {k: float(v) for k, v in row.items() if v == v}  # NaN: not measured
    publish(Event("round_end", run_dir, round_index, metrics=metrics, seconds=time.monotonic() - started))


def reopen(folder: Path, num_iterations: int | None = None) -> JobConfig:
    """The job stored in the run ``folder``, with ``num_iterations`` (the total number of rounds) changed when given.
    Worded for the forms that name a run (``continue``, the nightly run): the field is ``run_name``.

    Raises:
        ConfigError: no run ``folder`` (the runs beside it listed); ``num_iterations`` is given for a base trainer
            (one round) or is below the rounds the run has begun; the stored run is not readable as a job.
    """
    if not RunPaths(folder).run_json.is_file():
        there = runs_in(folder.parent)
        raise ConfigError(
            [Problem("run_name", folder.name, f"no run of that name in {folder.parent}; {there}; give one of them")]
        )
    job = open_run(folder)
    if num_iterations is None:
        return job
    begun = max((r for r in existing_rounds(RunPaths(folder)) if r > 0), default=0)
    if not is_iterative(job.trainer):
        why = (
            f"run {folder.name} uses trainer {job.trainer!r}, which trains one round; only the iterative "
            "trainers (madpo_iter, marlhf_iter) take more rounds"
        )
        raise ConfigError([Problem("num_iterations", num_iterations, why)])
    if num_iterations < begun:
        why = (
            f"run {folder.name} has begun {begun} rounds, and num_iterations is the run's total number of rounds, "
            f"not how many more: give {begun + 1} or more to add rounds, or leave it empty to finish it as stored"
        )
        raise ConfigError([Problem("num_iterations", num_iterations, why)])
    return open_run(folder, [f"num_iterations={num_iterations}"])


OptionalRounds = Annotated[int | None, WithJsonSchema({"type": "integer", "minimum": 1})]


@flow(name="pbrl-train", flow_run_name="{run_name}-continue", log_prints=True)
def continue_run(
    run_name: str = Field(description="The run to continue: the name of its folder under output_dir."),
    output_dir: str = Field("storage/runs", description="Folder that holds the run's folder (as the worker sees it)."),
    num_iterations: OptionalRounds = Field(
        None,
        description="The run's TOTAL number of rounds after continuing, not how many more: more than it has adds "
        "rounds (iterative trainers). Empty: as stored, which finishes a run that stopped.",
    ),
) -> dict[str, Any]:
    """Continue the run ``<output_dir>/<run_name>`` from its last complete stage, reading every option from its
    run.json (as ``pbrl train --run RUN --resume [--set num_iterations=N]``): finished stages come back Cached,
    the rest runs. Returns :func:`run_training`'s result, or a Failed state when the run cannot continue (not a
    run, in use, a ``num_iterations`` it cannot take)."""
    folder = Path(output_dir) / run_name
    return start_training(lambda: reopen(folder, num_iterations), resume=True, run_dir=str(folder))  # type: ignore[return-value]


@flow(name="pbrl-add-iteration", flow_run_name="{run_name}-add-iteration", log_prints=True)
def add_iteration_flow(run_name: str, output_dir: str = "storage/runs") -> dict[str, Any]:
    """Add one iteration to an existing iterative run and train it (the nightly deployment)."""
    folder = Path(output_dir) / run_name

    def job() -> JobConfig:
        stored = reopen(folder)
        if not is_iterative(stored.trainer):
            raise ConfigError(
                [Problem("run", run_name, f"uses trainer {stored.trainer!r}; only iterative runs take more iterations")]
            )
        return reopen(folder, stored.num_iterations + 1)

    return start_training(job, resume=True, run_dir=str(folder))  # type: ignore[return-value]
