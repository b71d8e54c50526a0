"""A run's results as Prefect artifacts on the flow run a person opens (docs/guides/prefect-ui.md#what-a-run-shows).

Three artifacts keyed by the run (one key per kind and run, so two runs never share one), attached to the
**top-level** flow run (the training flow run, not the round's subflow run) and replaced after every round (one
version per flow run, created anew so that its card shows when it changed: a continued run's flow run gets a
version of its own; the UI shows the newest):

* ``round-table-<run>``: the round table across all rounds so far, rounded as ``pbrl train`` prints it;
* ``round-report-<run>``: ``report.png``, shown in markdown (:func:`report_markdown`);
* ``round-summary-<run>``: the run folder's path (as text), the round's stages with their states and seconds.

A round that leaves the round table as it was (every stage Cached: a resumed or continued run, a retry) changes
nothing. The run's own page, ``run-<run>``, is :mod:`flows.run_home`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from pathlib import Path
from typing import Any

from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.actions import ArtifactCreate
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
from prefect.client.schemas.objects import Artifact
from prefect.client.schemas.sorting import ArtifactSort
from prefect.context import FlowRunContext
from prefect.runtime import flow_run

from pbrl.data.storage import RunPaths
from pbrl.reporting.metrics import write_run_metrics
from pbrl.reporting.report import write_report_png
from pbrl.reporting.table import round_table_rows


def artifact_key(kind: str, run_name: str) -> str:
    """``<kind>-<run>``: Prefect keys allow only lowercase letters, digits and dashes, so the run name is
    lowercased and every other character becomes a dash; a name that changed so gets 8 hex digits of its
    sha256 appended, so that ``Run_1`` and ``run-1`` keep apart. E.g. ``("round-table", "demo")`` ->
    ``round-table-demo``."""
    slug = re.sub(r"[^a-z0-9-]", "-", run_name.lower())
    if slug != run_name:
        slug += "-" + hashlib.sha256(run_name.encode("utf-8")).hexdigest()[:8]
    return f"{kind}-{slug}"


def table_rows(run_dir: str | Path) -> list[dict[str, str]]:
    """The round table of the run in ``run_dir`` as ``pbrl train`` prints it (:mod:`pbrl.reporting.table`: the
    compact columns of the run's trainer, intervals in their cells, ``–`` where a value was not measured), one
    ``{header: cell}`` per round. Reads metrics.parquet (rebuild it first) and run.json."""
    headers, rows = round_table_rows(run_dir)
    return [dict(zip(headers, row, strict=True)) for row in rows]


def top_flow_run_id() -> str | None:
    """The id of the top-level flow run above the current one (itself when it is the top); None outside a flow."""
    return flow_run.get_root_flow_run_id() if FlowRunContext.get() is not None else None


def _latest(client: SyncPrefectClient, key: str) -> Artifact | None:
    found = client.read_artifacts(
        artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])), sort=ArtifactSort.CREATED_DESC, limit=1
    )
    return found[0] if found else None


def put_artifact(client: SyncPrefectClient, key: str, kind: str, data: str, description: str, top: str | None) -> None:
    """The artifact ``key`` of the flow run ``top`` now shows ``data``: a new version attached to ``top``, which
    replaces the one ``top`` showed before (deleted after the new one exists), so that a flow run keeps one version
    of each key and the UI's artifact cards, which show a version's creation time, show when it last changed."""
    latest = _latest(client, key)
    client.create_artifact(
        ArtifactCreate(key=key, type=kind, data=data, description=description, flow_run_id=top, task_run_id=None)
    )
    if latest is not None and top is not None and str(latest.flow_run_id) == top:
        client.delete_artifact(latest.id)


def report_markdown(png: Path, round_index: int) -> str:
    """``png`` (report.png) as markdown that shows it, embedded as a data URL. (Not an ``image`` artifact: both UIs
    print an image artifact's URL under it, here some 100 kB of base64 running across the page.)"""
    data = base64.b64encode(png.read_bytes()).decode("ascii")
    return f"![report.png after round {round_index}](data:image/png;base64,{data})\n\n`{png.resolve()}`\n"


def publish_round(run_dir: str, round_index: int, stages: list[dict[str, Any]]) -> bool:
    """After round ``round_index`` of the run in ``run_dir``: rebuild metrics.parquet and report.png and show them
    on the top-level flow run, in the run's three artifacts (:func:`put_artifact`), unless the round table is the
    one its newest version already shows (nothing new: every stage came back Cached). A flow run gets one version
    of each key, replaced after every round; a later flow run of the same run (a continue) gets its own.
    ``stages`` are the round's ``{"stage", "state", "manifest"}`` (:func:`flows.round.call_stage`).

    Returns:
        whether the artifacts changed.
    """
    paths = RunPaths(run_dir)
    name, root = paths.root.name, Path(paths.root).resolve()
    write_run_metrics(run_dir)  # the rounds so far, for the table and the plot
    rows = table_rows(run_dir)
    last = rows[-1]["round"] if rows else str(round_index)  # the table holds every round done, cached ones too
    rounds = f"{name}: rounds {rows[0]['round']}-{last}" if len(rows) > 1 else f"{name}: round {last}"
    description = f"{rounds} ({root})"  # the folder too: runs of one name in two places keep apart
    keys = {kind: artifact_key(kind, name) for kind in ("round-table", "round-report", "round-summary")}
    top = top_flow_run_id()
    with get_client(sync_client=True) as client:
        shown = _latest(client, keys["round-table"])
        data = None if shown is None else json.loads(shown.data) if isinstance(shown.data, str) else shown.data
        if shown is not None and (data, shown.description) == (rows, description):
            return False
        put_artifact(client, keys["round-table"], "table", json.dumps(rows), description, top)
        report = write_report_png(run_dir)
        put_artifact(
            client, keys["round-report"], "markdown", report_markdown(report, round_index),
            f"{name}: report.png after round {round_index}", top,
        )  # fmt: skip
        summary = [
            f"# {name}: round {round_index}",
            "",
            f"Run folder: `{root}` (the round table and report.png: the artifacts `{keys['round-table']}` and "
            f"`{keys['round-report']}`)",
            "",
            "| stage | state | seconds |",
            "|---|---|---|",
            *(f"| {s['stage']} | {s['state']} | {s['manifest'].get('seconds', 0):.1f} |" for s in stages),
        ]
        put_artifact(client, keys["round-summary"], "markdown", "\n".join(summary), f"{name}: round {round_index}", top)
    return True
