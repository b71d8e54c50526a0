"""One pbrl run, one place in the Prefect UI (docs/guides/prefect-ui.md#one-run-one-place).

A pbrl run is worked on by many Prefect flow runs: the one that started it, a *Retry* of it (the same flow run
again), ``<run>-continue`` and ``<run>-add-iteration`` runs, one subflow run per round in each of them, and runs
refused before they started (a Run Name that exists). Every one of them carries the tag ``run:<run>``
(:func:`run_tag`), so the runs list filtered by that tag shows them all, and the artifact ``run-<run>``
(:func:`publish_run_home`), on the flow run working on the run, lists them: each flow run with its state, and the
round subflow runs per round, each a link into whichever UI shows the artifact.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import quote

from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
from prefect.client.schemas.objects import FlowRun
from prefect.client.schemas.sorting import FlowRunSort
from prefect.context import FlowRunContext

from flows.artifacts import artifact_key, put_artifact, top_flow_run_id
from pbrl.config import num_rounds
from pbrl.data.storage import RunPaths, existing_rounds
from pbrl.run.folder import open_job

TAG_PREFIX = "run:"
# Links in an artifact are relative: both UIs show an artifact's markdown on pages three levels below their base
# (/runs/flow-run/<id>, /artifacts/artifact/<id>, /artifacts/key/<key>, under / or /v2/), so ../../ is the UI's base
# and a link stays in the UI a person is using.
UI_BASE = "../../"


def run_tag(run_name: str) -> str:
    """The tag on every Prefect flow run of the run ``run_name``: ``run:<run_name>``."""
    return TAG_PREFIX + run_name


def tag_flow_run(run_name: str) -> None:
    """Add :func:`run_tag` to the current flow run's tags (a no-op outside a flow run or when it has it)."""
    context = FlowRunContext.get()
    if context is None or context.flow_run is None or run_tag(run_name) in context.flow_run.tags:
        return
    tags = [*context.flow_run.tags, run_tag(run_name)]
    with get_client(sync_client=True) as client:
        client.update_flow_run(context.flow_run.id, tags=tags)
    context.flow_run.tags = tags


def _flow_runs(client: SyncPrefectClient, tag: str) -> list[FlowRun]:
    found: list[FlowRun] = []
    while True:
        page = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[tag])),
            sort=FlowRunSort.EXPECTED_START_TIME_ASC,
            limit=200,
            offset=len(found),
        )
        found += page
        if len(page) < 200:
            return sorted(found, key=lambda r: r.created or datetime.min.replace(tzinfo=UTC))


def run_flow_runs(client: SyncPrefectClient, run_name: str) -> list[FlowRun]:
    """The top-level flow runs of the run ``run_name`` (tagged :func:`run_tag`), oldest first."""
    return [r for r in _flow_runs(client, run_tag(run_name)) if r.parent_task_run_id is None]


def _link(run: FlowRun) -> str:
    return f"[{run.name}]({UI_BASE}runs/flow-run/{run.id})"


def _state(run: FlowRun, current: str | None, ending: str | None) -> str:
    """The flow run's state as Prefect has it; ``ending`` for the flow run writing the artifact as it ends (its own
    state turns final only after it returns)."""
    if ending is not None and str(run.id) == current:
        return ending
    return run.state.name if run.state is not None else "?"


def _when(run: FlowRun) -> str:
    at = run.start_time or run.expected_start_time
    return f"{at.astimezone(UTC):%Y-%m-%d %H:%M} UTC" if at else "–"


def home_markdown(run_dir: str | Path, runs: list[FlowRun], current: str | None, ending: str | None = None) -> str:
    """The text of the artifact ``run-<run>``: the run folder, its job and rounds, the filter that finds its flow
    runs, a table of its top-level flow runs and one of its rounds' subflow runs (``runs``: every flow run tagged
    :func:`run_tag`)."""
    paths = RunPaths(run_dir)
    name, job = paths.root.name, open_job(paths.root)
    rounds = [r for r in existing_rounds(paths) if r > 0]
    planned = num_rounds(job)
    tag = run_tag(name)
    lines = [
        f"# Run {name}",
        "",
        f"Folder: `{Path(paths.root).resolve()}`  ",
        f"Trainer {job.trainer}, task {job.task or '(own items)'}; {len(rounds)} of {planned} rounds begun "
        f"(num_iterations {planned} is the total).  ",
        f"Every Prefect run of it carries the tag `{tag}`: [the runs list filtered by it]"
        f"({UI_BASE}runs?tags={quote(tag)}) (in the V1 UI pick the tag in the list's Tags filter).",
        "",
        "## Flow runs",
        "",
        "| flow run | state | started | tries |",
        "|---|---|---|---|",
    ]
    by_round: dict[int, list[FlowRun]] = defaultdict(list)
    for run in runs:
        if run.parent_task_run_id is None:
            lines.append(f"| {_link(run)} | {_state(run, current, ending)} | {_when(run)} | {max(run.run_count, 1)} |")
        elif isinstance(run.parameters.get("round_index"), int):
            by_round[run.parameters["round_index"]].append(run)
    lines += ["", "## Rounds", "", "| round | subflow runs (state) |", "|---|---|"]
    for r in sorted(by_round):
        lines.append(f"| {r} | " + ", ".join(f"{_link(s)} ({_state(s, None, None)})" for s in by_round[r]) + " |")
    lines += ["", f"As of {datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC; the runs list shows the states as they change."]
    return "\n".join(lines)


def publish_run_home(run_dir: str | Path, ending: str | None = None) -> None:
    """Show the artifact ``run-<run>`` (:func:`home_markdown`) on the current top-level flow run, one version per
    flow run, replaced when anything changes. ``ending``: the state the current flow run ends in, when it ends."""
    name = RunPaths(run_dir).root.name
    top = top_flow_run_id()
    with get_client(sync_client=True) as client:
        text = home_markdown(run_dir, _flow_runs(client, run_tag(name)), top, ending)
        put_artifact(client, artifact_key("run", name), "markdown", text, f"{name}: its Prefect runs and rounds", top)
