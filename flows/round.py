"""The round flow: the stages of one round, in order, as cached Prefect tasks (docs/design/architecture.md#the-round,
docs/design/architecture.md#caching-and-resume)."""

from __future__ import annotations

import time
from typing import Any

from prefect import flow

from flows.artifacts import publish_round
from flows.cache import run_stage_task
from flows.labels import labels_pending
from flows.logs import end_state
from flows.run_home import publish_run_home
from pbrl.config import JobConfig
from pbrl.config.judge_fields import HUMAN_JUDGE
from pbrl.data.storage import record_state
from pbrl.run.judging import round_stages
from pbrl.run.progress import Event, publish

AWAITING_LABELS = "AwaitingLabels"  # the state of judge-pairs while its round waits for people's labels


def call_stage(stage: str, run_dir: str, round_index: int, job: JobConfig, *, force: bool = False) -> dict[str, Any]:
    """Run one stage task: Cached when its manifest records a run with the current key and its outputs are
    intact, else (or when forced) it runs.

    Returns:
        ``{"stage", "round", "state", "manifest"}`` where state is Prefect's ("Completed" or "Cached").
    """
    publish(Event("stage_start", run_dir, round_index, stage))
    started = time.monotonic()
    recorded = False
    try:
        state = run_stage_task(stage, run_dir, round_index, job, force=force)
        record_state(run_dir, round_index, stage, state.name, None if state.is_completed() else str(state.message))
        recorded = True
        manifest = state.result()  # re-raises the stage's error: the round fails, later stages do not run
    except BaseException as exc:
        ended = end_state(exc)  # Cancelled: a person cancelled the flow run while the stage ran
        if not recorded or ended == "Cancelled":  # a cancelled task may have come back Crashed
            why = "the flow run was cancelled" if ended == "Cancelled" else repr(exc)
            record_state(run_dir, round_index, stage, ended, why)
        publish(Event("stage_end", run_dir, round_index, stage, state=ended, seconds=time.monotonic() - started))
        raise
    publish(Event(
        "stage_end", run_dir, round_index, stage, state=state.name, seconds=time.monotonic() - started,
        metrics=manifest.get("metrics", {}), counts=manifest.get("counts", {}),
        messages=tuple(manifest.get("messages", [])),
    ))  # fmt: skip
    return {"stage": stage, "round": round_index, "state": state.name, "manifest": manifest}


def awaiting_labels(run_dir: str, round_index: int, waiting: dict[str, Any]) -> dict[str, Any]:
    """The round's entry for judge-pairs while pairs wait for labels (recorded for ``pbrl status`` and said)."""
    words = f"waiting for {waiting['missing']} labels (of {waiting['total']} pairs)"
    record_state(run_dir, round_index, "judge-pairs", AWAITING_LABELS, words)
    counts = {"labels_missing": waiting["missing"], "pairs": waiting["total"]}
    publish(Event("stage_end", run_dir, round_index, "judge-pairs", state=AWAITING_LABELS, counts=counts))
    return {"stage": "judge-pairs", "round": round_index, "state": AWAITING_LABELS, "manifest": {}, **waiting}


def evaluation_due(job: JobConfig, round_index: int) -> bool:
    """Round 0 is the baseline; then every ``eval_interval`` rounds (0 disables evaluation)."""
    return job.eval_interval > 0 and round_index % job.eval_interval == 0


@flow(name="pbrl-round", flow_run_name="{run_name}-round-{round_index}", log_prints=True)
def round_flow(run_dir: str, run_name: str, round_index: int, job: JobConfig) -> list[dict[str, Any]]:
    """Collect, store, select and learn: one round of preference-based training. A round whose pairs wait for
    people's labels (``judge: human``) stops before judge-pairs, its last entry ``{"state": "AwaitingLabels"}``."""
    publish(Event("round_start", run_dir, round_index))
    done = []
    # sample-candidates, score-with-oracle (a task with a reward), judge-pairs (a judge's preferences), build-pairs,
    # store-round, replay-select, fit-reward-model (MARLHF), update-policies: pbrl.run.judging.round_stages
    for stage in (s for s in round_stages(job, run_dir) if s != "evaluate"):
        if stage == "judge-pairs" and job.judge == HUMAN_JUDGE:
            waiting = labels_pending(run_dir, round_index, job)
            if waiting["missing"]:
                return [*done, awaiting_labels(run_dir, round_index, waiting)]
        done.append(call_stage(stage, run_dir, round_index, job))
    if evaluation_due(job, round_index):
        done.append(call_stage("evaluate", run_dir, round_index, job))
    if publish_round(run_dir, round_index, done):
        publish_run_home(run_dir)  # the run's page lists this round's subflow run
    return done
