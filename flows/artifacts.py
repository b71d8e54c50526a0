"""Per-round Prefect artifacts of a run: a table of the round's metrics, a markdown summary and the report
plot as an image, each keyed by the run (``round-metrics-<run>``), so two runs never share an artifact:
the rounds of one run are the versions of its artifacts, and the UI shows the newest."""

from __future__ import annotations

import base64
import hashlib
import re
from pathlib import Path
from typing import Any

from prefect.artifacts import create_image_artifact, create_markdown_artifact, create_table_artifact

from pbrl.data.storage import RunPaths
from pbrl.reporting.metrics import round_rows, write_run_metrics
from pbrl.reporting.report import write_report_png


def artifact_key(kind: str, run_name: str) -> str:
    """``<kind>-<run>``: Prefect keys allow only lowercase letters, digits and dashes, so the run name is
    lowercased and every other character becomes a dash; a name that changed so gets 8 hex digits of its
    sha256 appended, so that ``Run_1`` and ``run-1`` keep apart. E.g. ``("round-metrics", "demo")`` ->
    ``round-metrics-demo``."""
    slug = re.sub(r"[^a-z0-9-]", "-", run_name.lower())
    if slug != run_name:
        slug += "-" + hashlib.sha256(run_name.encode("utf-8")).hexdigest()[:8]
    return f"{kind}-{slug}"


def publish_round(run_dir: str, round_index: int, stages: list[dict[str, Any]]) -> None:
    """Create the round's artifacts of the run in ``run_dir``: ``round-metrics-<run>`` (table),
    ``round-summary-<run>`` (markdown: stage states and seconds, key metrics, links to the run folder and
    ``report.png``) and ``round-report-<run>`` (``report.png`` with the rounds so far, as an image)."""
    paths = RunPaths(run_dir)
    rows = round_rows(paths, round_index)
    name = paths.root.name
    create_table_artifact(
        key=artifact_key("round-metrics", name), table=rows, description=f"{name}: metrics of round {round_index}"
    )
    write_run_metrics(run_dir)  # the rounds so far, for the plot
    report = write_report_png(run_dir)
    metric = {r["metric"]: r["value"] for r in rows}
    lines = [f"# {name}: round {round_index}", "", "| stage | state | seconds |", "|---|---|---|"]
    lines += [f"| {s['stage']} | {s['state']} | {s['manifest'].get('seconds', 0):.1f} |" for s in stages]
    lines += ["", "| metric | value |", "|---|---|"]
    for key in (
        "pairs/count",
        "iter/train_preference_pairs",
        "madpo/loss",
        "madpo/accuracy",
        "madpo/skipped_steps",
        "eval/turn_1/reward_mean",
    ):
        if key in metric:
            lines.append(f"| {key} | {metric[key]:.4g} |")
    root = Path(paths.root).resolve()
    lines += [
        "",
        f"Run folder: [{root}]({root.as_uri()}) · report: [{report.name}]({report.resolve().as_uri()}) "
        f"(also the artifact `{artifact_key('round-report', name)}`)",
    ]
    create_markdown_artifact(
        key=artifact_key("round-summary", name),
        markdown="\n".join(lines),
        description=f"{name}: summary of round {round_index}",
    )
    png = base64.b64encode(report.read_bytes()).decode("ascii")
    create_image_artifact(
        image_url=f"data:image/png;base64,{png}",
        key=artifact_key("round-report", name),
        description=f"{name}: report.png after round {round_index}",
    )
