"""Issue #53.2: callbacks and trackers that cannot corrupt or stall a run. Events handed to user code are read-only; a
failing callback is reported once by name and ``sys.exit`` in one does not end the run; a tracker that cannot start
fails before training with one line that holds no credential; a damaged tracking record and a junk ``WANDB_MODE`` are
named instead of silently turning tracking off or printing a traceback."""

from __future__ import annotations

import logging
import threading
import uuid
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from pbrl.data.storage import write_json
from pbrl.errors import ArtifactError, RemoteServiceError
from pbrl.reporting.tracker_tools import hide_secrets, tracker_problems
from pbrl.reporting.trackers import RunTracker
from pbrl.run.progress import Event, listening, publish
from pbrl.trainers.callbacks import TrainerCallback


def _fake_run(folder: Path, report_to: list[str]) -> Path:
    folder.mkdir(parents=True)
    config = {"trainer": "madpo_iter", "seed": 0, "num_iterations": 2, "report_to": report_to}
    write_json(folder / "run.json", {"run_id": str(uuid.uuid4()), "config": config})
    return folder


# ------------------------------------------------------------------------------------------------ callbacks
class Tamperer(TrainerCallback):
    """Rewrites the eval reward it is handed (issue #53.2: TensorBoard then logged 999.0)."""

    def on_round_end(self, event):
        event.metrics["eval_reward"] = 999.0


class Recorder(TrainerCallback):
    def __init__(self):
        self.seen = []

    def on_round_end(self, event):
        self.seen.append(dict(event.metrics))


def test_a_callback_cannot_change_the_event_the_others_and_the_trackers_see(tmp_path, caplog):
    recorder = Recorder()
    event = Event("round_end", str(tmp_path), 1, metrics={"eval_reward": 0.25})
    with listening(tmp_path, [Tamperer(), recorder]), caplog.at_level(logging.ERROR):
        publish(event)
    assert recorder.seen == [{"eval_reward": 0.25}] and event.metrics["eval_reward"] == 0.25
    assert "callback Tamperer.on_round_end raised TypeError" in caplog.text


def test_an_event_keeps_its_values_when_the_publisher_changes_its_dict_later(tmp_path):
    metrics = {"madpo/loss": 0.5}
    event = Event("log", str(tmp_path), 1, "update-policies", step=1, metrics=metrics)
    metrics["madpo/loss"] = 7.0
    assert event.metrics == {"madpo/loss": 0.5}


class Failing(TrainerCallback):
    def on_progress(self, event):
        raise ValueError("broken hook")


class Exiting(TrainerCallback):
    def on_stage_end(self, event):
        raise SystemExit(0)


def test_a_failing_callback_is_reported_once_by_name_and_sys_exit_does_not_end_the_run(tmp_path, caplog):
    """57 tracebacks for one tiny round before; and sys.exit(0) in a hook ended the run with exit status 0."""
    where = str(tmp_path)
    recorder = Recorder()
    with listening(tmp_path, [Failing(), Exiting(), recorder]), caplog.at_level(logging.ERROR):
        for done in range(20):
            publish(Event("progress", where, 1, "sample-candidates", done=done, total=20, unit="rows"))
        publish(Event("stage_end", where, 1, "sample-candidates", state="Completed"))
        publish(Event("stage_end", where, 1, "score-with-oracle", state="Completed"))
        publish(Event("round_end", where, 1, metrics={"eval_reward": 0.5}))  # the run went on
        publish(Event("run_end", where, state="Completed"))
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [
        "callback Failing.on_progress raised ValueError: broken hook on a progress event; the run goes on, and its "
        "later failures are counted, not shown",
        "callback Exiting.on_stage_end called sys.exit(0) on a stage_end event; the run goes on, and its later "
        "failures are counted, not shown",
        "callback Failing.on_progress failed on 20 events in this run (the first is reported above)",
        "callback Exiting.on_stage_end failed on 2 events in this run (the first is reported above)",
    ]
    assert recorder.seen == [{"eval_reward": 0.5}] and all(r.exc_info is None for r in caplog.records)


# ------------------------------------------------------------------------------------------------- trackers
class _Silent(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):
        self.send_response(self.status)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


def _serve(status: int):
    handler = type("Handler", (_Silent,), {"status": status})
    server = HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _closed_port() -> int:
    server = HTTPServer(("127.0.0.1", 0), _Silent)
    port = server.server_address[1]
    server.server_close()
    return port


def test_an_unreachable_mlflow_server_is_one_problem_before_the_run_without_its_password(monkeypatch):
    """Issue #53.2: the run stalled ~4 min before round 0, printed 5 tracebacks and the URI's user:password."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://alice:s3cret-pass@127.0.0.1:{_closed_port()}")
    (problem,) = tracker_problems(["mlflow"])
    text = str(problem)
    assert "does not answer (ConnectError)" in text and "http://***@127.0.0.1" in text
    assert "s3cret" not in text and "alice" not in text


def test_an_mlflow_server_that_refuses_the_credentials_is_named_and_one_that_answers_passes(monkeypatch):
    refusing, answering = _serve(401), _serve(404)
    try:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://bob:pw123456@127.0.0.1:{refusing.server_address[1]}")
        (problem,) = tracker_problems(["mlflow"])
        assert "refused the credentials (HTTP 401)" in str(problem) and "pw123456" not in str(problem)
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{answering.server_address[1]}")
        assert tracker_problems(["mlflow"]) == []
    finally:
        refusing.shutdown()
        answering.shutdown()


def test_a_tracker_that_cannot_start_fails_with_one_line_and_no_credential(tmp_path, monkeypatch):
    run_dir = _fake_run(tmp_path / "run", ["mlflow"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://carol:hunter2-long@127.0.0.1:{_closed_port()}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setattr("pbrl.reporting.trackers.require_trackers", lambda names: None)  # past the preflight probe
    with pytest.raises(RemoteServiceError) as caught:
        RunTracker(run_dir).open()
    message = str(caught.value)
    assert message.startswith("report_to mlflow: the tracker could not start (") and "hunter2" not in message
    assert caught.value.__cause__ is None and caught.value.__suppress_context__  # no chained traceback to print


def test_a_damaged_tracking_record_is_named_instead_of_turning_tracking_off(tmp_path):
    run_dir = _fake_run(tmp_path / "run", ["tensorboard"])
    (run_dir / "tracking.json").write_text('{"trackers": {"tensorboard": ')
    with pytest.raises(ArtifactError, match=r"tracking.json: malformed JSON .* restore it, or move it away"):
        RunTracker(run_dir).open()
    (run_dir / "tracking.json").write_text('["not", "a", "record"]')
    with pytest.raises(ArtifactError, match="not a tracking record"):
        RunTracker(run_dir).open()


@pytest.mark.parametrize("mode", ["junk", "ONLINE ", "off"])
def test_a_junk_wandb_mode_is_one_problem(monkeypatch, mode):
    """Issue #53.2: a 61-line traceback."""
    monkeypatch.setenv("WANDB_MODE", mode)
    (problem,) = tracker_problems(["wandb"])
    assert f"WANDB_MODE={mode!r} is not a W&B mode" in str(problem)


def test_hide_secrets_hides_url_userinfo_and_the_tools_secret_variables(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "tok-0123456789")
    text = "GET https://u:p@host/x failed; header Bearer tok-0123456789; mlflow+http://a@b"
    assert hide_secrets(text) == "GET https://***@host/x failed; header Bearer <hidden>; mlflow+http://***@b"


def test_pbrl_train_with_an_unreachable_mlflow_server_is_one_line_before_prefect_starts(
    tiny_model_dir, tmp_path, monkeypatch
):
    from typer.testing import CliRunner

    from pbrl import orchestration
    from pbrl.cli.commands import app

    started: list[str] = []
    monkeypatch.setattr(orchestration, "_api_after_imports", lambda: started.append("prefect"))
    env = {"MLFLOW_TRACKING_URI": f"http://dave:correct-horse@127.0.0.1:{_closed_port()}"}
    config = Path(__file__).resolve().parents[3] / "flows" / "configs" / "tiny-madpo-iter.yaml"
    args = ["--set", "report_to=mlflow", "--set", f"agent_model={tiny_model_dir}", "--set", f"output_dir={tmp_path}"]
    result = CliRunner().invoke(app, ["train", str(config), *args], env=env)
    assert result.exit_code == 2, result.output
    assert result.output.count("error:") == 1 and "does not answer (ConnectError)" in result.output
    assert "correct-horse" not in result.output and "Traceback" not in result.output and started == []
