"""Issue #53.8, the small ones: Hugging Face's ``report_to`` spellings, no Prefect warning for pbrl's lines logged
before a flow run exists (a fresh storage's first run), and no tracker line printed after the final report."""

from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from pbrl.config import load_job
from pbrl.data.storage import write_json
from pbrl.reporting import trackers
from pbrl.reporting.tracker_tools import TOOLS, tracker_names, tracker_problems
from pbrl.reporting.trackers import RunTracker
from pbrl.run.progress import Event

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "flows" / "configs" / "tiny-madpo-iter.yaml"


@pytest.mark.parametrize(("given", "stored", "names"), [
    ("none", None, ()),
    ("[none]", None, ()),
    ("all", "all", tuple(n for n, t in TOOLS.items() if importlib.util.find_spec(t.module))),
    ("[tensorboard, all]", None, None),  # 'all' goes alone, as in transformers
])  # fmt: skip
def test_report_to_takes_hugging_faces_none_and_all(given, stored, names):
    if names is None:
        with pytest.raises(Exception, match="report_to"):
            load_job(TINY, [f"report_to={given}"])
        return
    job = load_job(TINY, [f"report_to={given}"])
    assert job.report_to == stored and tracker_names(job.report_to) == names
    assert tracker_problems("none") == []


def test_a_pbrl_line_logged_before_a_flow_run_exists_gives_no_prefect_warning():
    """A fresh storage's first run converts its packaged model in the preflight, before the flow: Prefect's API log
    handler warned "attempted to send logs to the API without a flow run id"."""
    code = (
        "import logging, warnings\nwarnings.simplefilter('error')\nfrom pbrl import orchestration\n"
        "orchestration._configure_logging()\n"
        "logging.getLogger('pbrl.models.packaged').info('converting x -> y (once)')\nprint('quiet')\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "quiet", done.stderr[-2000:]
    assert "without a flow run id" not in done.stderr


class Chatty:
    """A tool that prints, as trackio's finish does ("* Run finished. Uploading logs ...")."""

    def start(self, run, stored):
        print("* Trackio project initialized")
        return {}

    def log_params(self, params):
        pass

    def log_metrics(self, metrics, step, axis):
        pass

    def log_image(self, key, path, step, axis):
        pass

    def finish(self, failed):
        print("* Run finished. Uploading logs to Trackio (please wait...)")


def test_what_a_tracker_prints_goes_to_the_run_log_not_after_the_report(tmp_path, monkeypatch, capsys, caplog):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = {"trainer": "madpo_iter", "num_iterations": 1, "report_to": ["tensorboard"]}
    write_json(run_dir / "run.json", {"run_id": str(uuid.uuid4()), "config": config})
    monkeypatch.setitem(trackers.TRACKER_CLASSES, "tensorboard", Chatty)
    tracker = RunTracker(run_dir)
    with caplog.at_level(logging.INFO, logger="pbrl.reporting.trackers"):
        tracker.open()
        tracker.on_run_end(Event("run_end", str(run_dir), state="Completed"))
    assert capsys.readouterr().out == ""
    assert [r.getMessage() for r in caplog.records] == [
        "report_to tensorboard: * Trackio project initialized",
        "report_to tensorboard: * Run finished. Uploading logs to Trackio (please wait...)",
    ]
