"""A round that waits for people's labels (``judge: human``, docs/guides/label-pairs.md) in Prefect.

- :func:`labels_pending` (the task ``labels-pending``) says how many pairs of the round still need a label, before
  judge-pairs runs: the round flow stops there while any does.
- :func:`await_labels` makes the training flow wait. A flow run from a deployment (the UI, ``pbrl serve``)
  **suspends**: Prefect ends its process and keeps it Suspended with a form of the next ``judge_label_batch_size``
  pairs (:func:`label_form`), and a person's Resume with the form filled in reschedules it; the flow then runs again
  from its start, finished stages come back Cached, and the labels are taken in first (:func:`take_submitted`).
  A flow run without a deployment (``pbrl train``) cannot suspend: it stops with :class:`~pbrl.errors.LabelsNeeded`.
- :func:`take_submitted` writes every submitted form of the run's flow runs into the run's answer store, each once
  (:mod:`pbrl.run.labelling`): the store, not Prefect, is the record, so a Retry, a Cancel and a continue keep
  every label.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterStateType
from prefect.client.schemas.objects import StateType
from prefect.client.schemas.responses import SetStateStatus
from prefect.context import FlowRunContext
from prefect.flow_runs import suspend_flow_run
from prefect.input import RunInput
from prefect.settings import PREFECT_UI_URL
from pydantic import Field, create_model

from flows.run_home import run_flow_runs
from pbrl.config import JobConfig
from pbrl.data.storage import RunPaths, read_json, write_json
from pbrl.errors import LabelError
from pbrl.judging.human import pair_markdown
from pbrl.run.askings import Asking
from pbrl.run.labelling import Waiting, key_of, labels_needed, timed_out, update_request, waiting_for, write_labels

log = logging.getLogger("pbrl.flows.labels")
FORM_KEY = "pbrl-labels"  # the start of every label form's pause key: r<round>-<id> follows
INPUT_PREFIX = f"suspended-{FORM_KEY}-"  # Prefect keeps a suspension's input under "suspended-<pause key>-..."
FIELD_PREFIX = "pair_"
DEADLINE_LABEL = "pbrl.labels_deadline"  # on a suspended flow run whose round goes on without labels at this time
CHECK_SECONDS = float(os.environ.get("PBRL_LABEL_DEADLINE_CHECK_SECONDS", "60"))
FORMS_DIR = Path("judge") / "forms"  # <run>/judge/forms/<pause key>.json: what each form showed, and its fate
Choice = Literal["later", "A", "B", "tie", "skip"]
CHOICE_HELP = (
    "A or B: that joint response is better as a whole; tie: as good as each other; skip: you cannot tell (the pair "
    "is not asked again and gives no preference); later: leave it for the next form."
)


@task(name="labels-pending", task_run_name="labels-pending-r{round_index}", cache_policy=NO_CACHE)
def labels_pending(run_dir: str, round_index: int, job: JobConfig) -> dict[str, Any]:
    """How many pairs of the round still need a label: ``{"missing", "total", "expired"}``. Past the round's
    deadline (``judge_label_timeout_hours``) under ``judge_label_timeout_policy: continue`` nothing is missing any
    more: judge-pairs goes on with the labels there are.

    Raises:
        LabelError: the deadline passed, pairs are missing and the policy is ``fail``.
    """
    waiting = waiting_for(RunPaths(run_dir), round_index, job)
    expired = bool(waiting.missing) and waiting.expired()
    if expired and job.judge_label_timeout_policy == "fail":
        raise timed_out(waiting, job)
    return {"missing": 0 if expired else len(waiting.missing), "total": waiting.total, "expired": expired}


def field_name(question_id: str) -> str:
    return FIELD_PREFIX + question_id.replace("-", "_")


def question_of(name: str) -> str:
    return name[len(FIELD_PREFIX) :].replace("_", "-")


def label_form(waiting: Waiting, batch: list[Asking], job: JobConfig) -> type[RunInput]:
    """The form of ``batch`` (the next pairs to label): one choice per pair (:data:`CHOICE_HELP`, ``later`` at
    first) and the labeller's name, under a description in Markdown with every pair (:func:`pair_markdown`)."""
    fields: dict[str, Any] = {}
    numbers = {a.question_id: i for i, a in enumerate(waiting.askings, start=1)}
    for asking in batch:
        title = f"Pair {numbers[asking.question_id]} ({asking.question_id}): which is better?"
        fields[field_name(asking.question_id)] = (Choice, Field("later", title=title, description=CHOICE_HELP))
    fields["labeller"] = (str, Field("", title="Your name", description="Kept with each label (optional)."))
    form = create_model("PairLabels", __base__=RunInput, **fields)
    form._description = form_description(waiting, batch, numbers, job)  # type: ignore[attr-defined]
    return form


def form_description(waiting: Waiting, batch: list[Asking], numbers: dict[str, int], job: JobConfig) -> str:
    """The Markdown above the form: which run and round, how many pairs are left, until when, then the pairs."""
    run, left = waiting.run_dir.name, len(waiting.missing)
    until = ""
    if waiting.deadline is not None:
        then = "the round fails" if job.judge_label_timeout_policy == "fail" else "the round trains on the labels given"
        until = f" The round waits until {waiting.deadline:%Y-%m-%d %H:%M} UTC; then {then}."
    head = [
        f"## Label pairs: run `{run}`, round {waiting.round_index}",
        "",
        f"{left} of {waiting.total} pairs wait for a label; this form has {len(batch)}.{until} For each pair, which "
        "joint response is better as a whole: does each agent do its part well, and do the parts fit together? "
        "The order of A and B is drawn for each pair. Labels are kept as soon as the run goes on; a pair labelled "
        f"here or with `pbrl label` is not asked again.",
        "",
    ]
    body = [pair_markdown(a.comparison, a.question_id, numbers[a.question_id], waiting.total) for a in batch]
    return "\n".join(head + body)


def await_labels(run_dir: str, round_index: int, job: JobConfig) -> None:
    """Wait for the labels of the round's next form (see the module docstring). Returns only when Prefect hands
    back a form submitted before (its labels are then written); usually it suspends the flow run.

    Raises:
        LabelsNeeded: not a flow run from a deployment: it cannot suspend.
        Pause: (Prefect's) the flow run is suspended; its process ends.
    """
    paths = RunPaths(run_dir)
    waiting = waiting_for(paths, round_index, job)
    context = FlowRunContext.get()
    if context is None or context.flow_run is None or context.flow_run.deployment_id is None:
        raise labels_needed(waiting)
    batch = waiting.missing[: job.judge_label_batch_size]
    key = f"{FORM_KEY}-r{round_index}-{uuid.uuid4().hex[:8]}"
    flow_run_id = str(context.flow_run.id)
    write_json(paths.root / FORMS_DIR / f"{key}.json", {
        "round": round_index, "flow_run": flow_run_id, "shown": {a.question_id: key_of(a) for a in batch},
        "made_at": datetime.now(UTC).isoformat(timespec="seconds"),
    })  # fmt: skip
    update_request(paths, round_index, form=form_link(flow_run_id), flow_run=flow_run_id)
    timeout = None
    if waiting.deadline is not None and job.judge_label_timeout_policy == "fail":  # Prefect fails it at the deadline
        timeout = max(1, int((waiting.deadline - datetime.now(UTC)).total_seconds()))
    elif waiting.deadline is not None:  # continue: `pbrl serve` resumes it at the deadline (keep_label_deadlines)
        with get_client(sync_client=True) as client:
            client.update_flow_run_labels(context.flow_run.id, {DEADLINE_LABEL: waiting.deadline.isoformat()})
    log.info("round %d waits for %d labels: form %s", round_index, len(waiting.missing), key)
    submitted = suspend_flow_run(wait_for_input=label_form(waiting, batch, job), key=key, timeout=timeout)
    take_form(paths, key, submitted.model_dump(), job)


def form_link(flow_run_id: str) -> str:
    """The flow run's page in the Prefect UI (where its Resume opens the form); a path when no UI URL is set."""
    base = PREFECT_UI_URL.value()
    return f"{base.rstrip('/')}/runs/flow-run/{flow_run_id}" if base else f"/runs/flow-run/{flow_run_id}"


def take_form(paths: RunPaths, key: str, values: dict[str, Any], job: JobConfig) -> str:
    """Write the labels of one submitted form (its ``values``) into the answer store, then record that it was
    taken (so a form is taken once; taking it again would write nothing anyway). A stale or wrong form is
    refused with its reason, recorded and logged, and nothing of it is written.

    Returns:
        what became of it, in words (for the run's log).
    """
    path = paths.root / FORMS_DIR / f"{key}.json"
    record = read_json(path) if path.is_file() else {}
    if "taken" in record:
        return record["taken"]
    labels = {question_of(k): str(v) for k, v in values.items() if k.startswith(FIELD_PREFIX)}
    round_index = int(record.get("round", _round_of(key)))
    labeller = str(values.get("labeller") or "").strip() or None
    try:
        waiting = waiting_for(paths, round_index, job)
        done = write_labels(waiting, labels, labeller=labeller, via="ui", shown_keys=record.get("shown"))
        words = (f"form {key}: {len(done.written)} label(s) written, {len(done.already)} pair(s) already labelled "
                 f"(their first label kept), {len(done.later)} left for later")  # fmt: skip
    except LabelError as exc:
        words = f"form {key}: {exc}"
        log.error(words)
    write_json(path, {**record, "taken": words, "taken_at": datetime.now(UTC).isoformat(timespec="seconds")})
    return words


def _round_of(key: str) -> int:
    return int(key[len(FORM_KEY) + 2 :].split("-")[0])


def take_submitted(run_dir: str | Path, job: JobConfig) -> list[str]:
    """Write the labels of every form submitted to any flow run of this run (the current one, an earlier one that
    was cancelled or crashed after a form came in) that was not taken yet, before anything else is done. Nothing
    to do without a Prefect API or outside a flow run.

    Returns:
        one line per form taken now (also written to the run's log).
    """
    paths = RunPaths(run_dir)
    if FlowRunContext.get() is None or not (paths.root / FORMS_DIR).is_dir():
        return []
    said = []
    with get_client(sync_client=True) as client:
        for run in run_flow_runs(client, paths.root.name):
            for got in client.filter_flow_run_input(run.id, INPUT_PREFIX, limit=1000, exclude_keys=set()):
                if not got.key.endswith("-response"):
                    continue
                key = got.key[len("suspended-") : -len("-response")]
                record = paths.root / FORMS_DIR / f"{key}.json"
                if record.is_file() and "taken" not in read_json(record):
                    said.append(take_form(paths, key, json.loads(got.value), job))
    for line in said:
        log.info(line)
    return said


def resume_past_deadlines(now: datetime | None = None) -> list[str]:
    """Resume, with an empty form, every suspended flow run whose round goes on without labels
    (``judge_label_timeout_policy: continue``) and whose deadline (its label ``pbrl.labels_deadline``) has passed:
    it runs again and trains on the labels given. Returns the ids of those the server resumed (one it refuses is
    logged)."""
    now = now or datetime.now(UTC)
    resumed = []
    with get_client(sync_client=True) as client:
        paused = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(state=dict(type=FlowRunFilterStateType(any_=[StateType.PAUSED]))),
            limit=200,
        )
        for run in paused:
            deadline = (run.labels or {}).get(DEADLINE_LABEL)
            if not deadline or datetime.fromisoformat(str(deadline)) > now:
                continue
            result = client.resume_flow_run(run.id, run_input={})
            if result.status == SetStateStatus.ACCEPT:
                resumed.append(str(run.id))
            else:
                reason = getattr(result.details, "reason", None) or result.status.value
                log.warning("could not resume flow run %s past its labelling time: %s", run.id, reason)
    return resumed


def keep_label_deadlines(stop: threading.Event, every: float = CHECK_SECONDS) -> threading.Thread:
    """A daemon thread of ``pbrl serve`` that calls :func:`resume_past_deadlines` every ``every`` seconds until
    ``stop`` is set (Prefect has no timer that resumes a suspended flow run without input)."""

    def keep() -> None:
        while not stop.wait(every):
            try:
                for run_id in resume_past_deadlines():
                    log.info("resumed flow run %s: its round's labelling time is over", run_id)
            except Exception as exc:  # the server may be restarting: try again next time
                log.warning("could not check the label deadlines: %s", exc)

    thread = threading.Thread(target=keep, name="pbrl-label-deadlines", daemon=True)
    thread.start()
    return thread
