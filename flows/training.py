"""The training flow: prepare or resume a run, the round-0 baseline, then one round flow per round."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.runtime import flow_run

from flows.ray_runner import ray_session
from flows.round import call_stage, evaluation_due, round_flow
from pbrl.config import JobConfig, is_iterative, num_rounds
from pbrl.reporting.metrics import round_table, write_run_metrics
from pbrl.run.folder import open_job, prepare_run, run_dir_for, run_lock, with_run_name
from pbrl.run.progress import Event, publish


def _flow_run_name() -> str:
    config = flow_run.parameters.get("config")
    name = getattr(config, "run_name", None) or (config.get("run_name") if isinstance(config, dict) else None)
    return name or "unnamed-run"


@flow(name="pbrl-train", flow_run_name=_flow_run_name, log_prints=True)
def train_flow(config: JobConfig, resume: bool = False, run_dir: str | None = None) -> dict[str, Any]:
    """Train cooperating agents from preferences between their joint responses (MADPO or MARLHF, base or iterative).

    With ``resume`` an existing run continues: stages whose inputs and outputs are unchanged come back
    Cached and only what is missing or stale runs. A config without ``run_name`` (a run started from the
    UI) gets a generated one, ``<trainer>-<UTC time>``. ``run_dir`` is the run folder to use (a run that was
    moved or copied is resumed where it is now); by default ``<output_dir>/<run_name>``.
    """
    return run_training(config, resume=resume, run_dir=run_dir)


def run_training(config: JobConfig, *, resume: bool = False, run_dir: str | None = None) -> dict[str, Any]:
    """The body of every training flow (``pbrl-train/train``, the per-trainer forms and the config-file
    deployment of :mod:`flows.ui`): prepare or resume the run, the round-0 baseline, then the rounds.

    Returns:
        ``{"run_dir", "messages", "stages": [{"stage", "round", "state"}]}``.
    """
    config = with_run_name(config)
    folder = Path(run_dir) if run_dir else run_dir_for(config)
    with contextlib.ExitStack() as held:
        if (folder / "run.json").is_file():  # a run that exists is held before anything reads or writes it
            held.enter_context(run_lock(folder))
        run_dir = str(prepare_run(config, resume=resume, run_dir=folder))
        held.enter_context(run_lock(folder))  # re-entrant; a new run's folder exists from here on
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
                    stages.extend(round_flow(run_dir, config.run_name, r, config))
                    _round_end(run_dir, r, round_started)
            write_run_metrics(run_dir)
        except BaseException:
            publish(Event("run_end", run_dir, state="Failed", seconds=time.monotonic() - started))
            raise
        publish(Event("run_end", run_dir, state="Completed", seconds=time.monotonic() - started))
    messages = [f"round {s['round']} {s['stage']}: {m}" for s in stages for m in s["manifest"].get("messages", [])]
    for m in messages:
        print(m)
    return {
        "run_dir": run_dir,
        "messages": messages,
        "stages": [{k: s[k] for k in ("stage", "round", "state")} for s in stages],
    }


def _round_end(run_dir: str, round_index: int, started: float) -> None:
    """Rebuild metrics.parquet and publish the round's row of the round table (a ``round_end`` event)."""
    write_run_metrics(run_dir)
    table = round_table(run_dir)
    row = table.loc[round_index] if round_index in table.index else None
    metrics = {} if row is None else {k: float(v) for k, v in row.items() if v == v}  # NaN: not measured
    publish(Event("round_end", run_dir, round_index, metrics=metrics, seconds=time.monotonic() - started))


@flow(name="pbrl-add-iteration", flow_run_name="{run_name}-add-iteration", log_prints=True)
def add_iteration_flow(run_name: str, output_dir: str = "storage/runs") -> dict[str, Any]:
    """Add one iteration to an existing iterative run and train it (the nightly deployment)."""
    job = open_job(Path(output_dir) / run_name)
    if not is_iterative(job.trainer):
        raise ValueError(f"run {run_name} uses trainer {job.trainer!r}; only iterative runs take more iterations")
    return train_flow(job.model_copy(update={"num_iterations": job.num_iterations + 1}), resume=True)
