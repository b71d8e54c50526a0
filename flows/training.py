"""The training flow: prepare or resume a run, the round-0 baseline, then one round flow per round."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow

from flows.round import call_stage, evaluation_due, round_flow
from pbrl.config import JobConfig, is_iterative
from pbrl.metrics import write_run_metrics
from pbrl.run import open_job, prepare_run


def num_rounds(job: JobConfig) -> int:
    """Base trainers collect once; iterative trainers run ``num_iterations`` rounds."""
    return job.num_iterations if is_iterative(job.trainer) else 1


@flow(name="pbrl-train", flow_run_name="{config.run_name}", log_prints=True)
def train_flow(config: JobConfig, resume: bool = False) -> dict[str, Any]:
    """Train cooperating agents from preferences between their joint responses (MADPO / MADPO-iterative).

    With ``resume`` an existing run continues: stages whose inputs and outputs are unchanged come back
    Cached and only what is missing or stale runs.
    """
    run_dir = str(prepare_run(config, resume=resume))
    stages: list[dict[str, Any]] = []
    if evaluation_due(config, 0):
        stages.append(call_stage("evaluate", run_dir, 0, config))
    for r in range(1, num_rounds(config) + 1):
        stages.extend(round_flow(run_dir, config.run_name, r, config))
        write_run_metrics(run_dir)
    write_run_metrics(run_dir)
    messages = [f"round {s['round']} {s['stage']}: {m}" for s in stages for m in s["manifest"].get("messages", [])]
    for m in messages:
        print(m)
    return {"run_dir": run_dir, "messages": messages,
            "stages": [{k: s[k] for k in ("stage", "round", "state")} for s in stages]}


@flow(name="pbrl-add-iteration", flow_run_name="{run_name}-add-iteration", log_prints=True)
def add_iteration_flow(run_name: str, output_dir: str = "storage/runs") -> dict[str, Any]:
    """Add one iteration to an existing iterative run and train it (the nightly deployment)."""
    job = open_job(Path(output_dir) / run_name)
    if not is_iterative(job.trainer):
        raise ValueError(f"run {run_name} uses trainer {job.trainer!r}; only iterative runs take more iterations")
    return train_flow(job.model_copy(update={"num_iterations": job.num_iterations + 1}), resume=True)
