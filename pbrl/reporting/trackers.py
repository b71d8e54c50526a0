"""One run's experiment trackers (docs/guides/tracking-and-export.md#experiment-tracking): :class:`RunTracker` holds
the tools named by the run's ``report_to`` (their adapters: :mod:`pbrl.reporting.tracker_tools`) and is a callback of
the run (:class:`pbrl.trainers.TrainerCallback`'s hooks, by shape: it imports nothing of the front doors): it opens
the tools at ``run_start``, logs each ``log`` event's step metrics under ``train/<name>`` against
``train/global_step`` (the count of logged training steps of the run), each ``round_end`` row of the round table
under ``round/<name>`` against the round with ``report.png`` beside it, and ends the tracked run at ``run_end``. The
config of ``run.json`` is logged as hyper-parameters.

``<run>/tracking.json`` keeps each tool's tracked-run id and what was logged (the highest step of each stage of each
round, a hash of each round's row), written after every logged event: a resumed run (after a crash or a kill, or a
rerun that comes back Cached) continues the same tracked run and logs each step and round once.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import threading
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pbrl.data.storage import RunPaths, read_json, write_json
from pbrl.errors import ArtifactError, RemoteServiceError
from pbrl.reporting.tracker_tools import (
    ROUND_AXIS,
    TRACKER_CLASSES,
    TRAIN_AXIS,
    RunInfo,
    hide_secrets,
    require_trackers,
    tracker_names,
)

log = logging.getLogger(__name__)

STATE_FILE = "tracking.json"  # in the run folder: the tracked-run ids and what was logged
REPORT = "report.png"


# ---------------------------------------------------------------------------------------------- one run's trackers
_REGISTRY: weakref.WeakValueDictionary[str, RunTracker] = weakref.WeakValueDictionary()
_REGISTRY_LOCK = threading.Lock()


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str | int | float | bool]:
    """A config as flat hyper-parameters: nested mappings become ``a.b`` keys, lists and None their text."""
    out: dict[str, str | int | float | bool] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out |= flat_params(value, f"{name}.")
        elif isinstance(value, (bool, int, float, str)):
            out[name] = value
        else:
            out[name] = json.dumps(value, default=str)
    return out


def _digest(metrics: Mapping[str, float]) -> str:
    return hashlib.sha256(json.dumps(sorted(metrics.items())).encode()).hexdigest()[:16]


def _said(name: str, call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)``, with what the tool prints to stdout logged as pbrl's lines (the run's log), not printed: a
    line of trackio's printed at the run's end reached a redirected output after the final round table."""
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        try:
            return call(*args)
        finally:
            for line in printed.getvalue().splitlines():
                if line.strip():
                    log.info("report_to %s: %s", name, hide_secrets(line.strip()))


class RunTracker:
    """The trackers of one run (its ``report_to``), as a callback of its events (hooks ``on_run_start``, ``on_log``,
    ``on_round_end``, ``on_run_end``; the events are :class:`pbrl.run.progress.Event`).

    Args:
        run_dir: the run folder (run.json must exist by ``run_start``).
        names: the tools; None = the ``report_to`` of the run's run.json, read when it opens.

    A tool that fails while logging is logged as an error and the run goes on; :meth:`open` raises when a tool cannot
    start (the trainer opens the tools before the flow starts, so that error stops the run at once).
    """

    def __init__(self, run_dir: str | Path, names: Sequence[str] | None = None) -> None:
        self.paths = RunPaths(run_dir)
        self.names = None if names is None else tracker_names(names)
        self.tools: dict[str, Any] = {}
        self.state: dict[str, Any] = {}
        self.opened = False
        self._lock = threading.RLock()

    @classmethod
    def for_run(cls, run_dir: str | Path, names: Sequence[str] | None = None) -> RunTracker:
        """The tracker of the run in ``run_dir`` in this process: the one already made for it while it lives, else a
        new one. Two front ends that both wire ``report_to`` (the trainer and the training flow, say) then share
        one tracker, and an event heard twice is logged once."""
        key = str(Path(run_dir).resolve())
        with _REGISTRY_LOCK:
            tracker = _REGISTRY.get(key)
            wanted = None if names is None else tracker_names(names)
            if tracker is None or (not tracker.opened and wanted is not None and tracker.names != wanted):
                tracker = _REGISTRY[key] = cls(run_dir, names)
            return tracker

    @property
    def state_file(self) -> Path:
        return self.paths.root / STATE_FILE

    def open(self) -> None:
        """Start (or reopen) every tool's tracked run and log the config; idempotent.

        Raises:
            ConfigError: a tool's package is missing (:func:`~pbrl.reporting.tracker_tools.tracker_problems`).
            ArtifactError: run.json is missing or malformed.
            Exception: what a tool raised when it could not start (e.g. an unreachable tracking server).
        """
        with self._lock:
            if self.opened:
                return
            stored = read_json(self.paths.run_json)
            config = stored.get("config", {})
            names = self.names if self.names is not None else tracker_names(config.get("report_to"))
            require_trackers(names)
            self.state = self._stored_state()
            info = RunInfo(
                self.paths.root,
                self.paths.root.resolve().name,
                str(stored.get("run_id") or uuid.uuid4()),
                str(config.get("trainer", "")),
            )
            params = flat_params(config)
            name = ""
            try:
                for name in names:
                    tool = TRACKER_CLASSES[name]()
                    self.state["trackers"][name] = _said(name, tool.start, info, self.state["trackers"].get(name, {}))
                    self.tools[name] = tool
                    write_json(self.state_file, self.state)  # the id first: a kill from here on resumes this run
            except Exception as exc:
                self._finish_all(failed=True)
                # One line, without the tool's traceback and chain: their messages may hold a URL's password.
                raise RemoteServiceError(
                    f"report_to {name}: the tracker could not start ({type(exc).__name__}: "
                    f"{hide_secrets(str(exc))[:300]}); fix its settings (its environment variables) or leave it out "
                    "of report_to"
                ) from None
            except BaseException:
                self._finish_all(failed=True)
                raise
            self.opened = True
            self._each("log_params", params)

    def _stored_state(self) -> dict[str, Any]:
        """tracking.json, or a fresh record for a run never tracked.

        Raises:
            ArtifactError: tracking.json is damaged: the tracked runs it names cannot be continued, and starting
                new ones silently would split the run's history (the fix is named).
        """
        if not self.state_file.is_file():
            return {"trackers": {}}
        try:
            state = read_json(self.state_file)
            if not isinstance(state, dict) or not isinstance(state.setdefault("trackers", {}), dict):
                raise ArtifactError(f"{self.state_file}: not a tracking record")
        except ArtifactError as exc:
            raise ArtifactError(
                f"{exc}; the tracked runs it names cannot be continued: restore it, or move it away to start new "
                "tracked runs"
            ) from None
        return state

    # -------------------------------------------------------------------------------- hooks
    def on_run_start(self, event: Any) -> None:
        try:
            self.open()  # the front ends open it before run_start; here for a listener wired on its own
        except Exception as exc:
            log.error("report_to: this run is not tracked: %s", hide_secrets(str(exc)))

    def on_log(self, event: Any) -> None:
        """A training step: ``train/<metric>`` (and ``train/env_step``, ``train/round``) at the run's next
        ``train/global_step``, unless this stage's step of this round was logged before (a resume reruns it)."""
        with self._lock:
            if not self.tools or event.step is None:
                return
            key = f"{event.round}/{event.stage}"
            steps = self.state.setdefault("steps", {})
            if event.step <= steps.get(key, 0):
                return
            steps[key] = event.step
            self.state["global_step"] = step = int(self.state.get("global_step", 0)) + 1
            metrics = {(k if k.startswith("train/") else f"train/{k}"): float(v) for k, v in event.metrics.items()}
            metrics["train/round"] = float(event.round or 0)
            if event.env_step is not None:
                metrics["train/env_step"] = float(event.env_step)
            self._each("log_metrics", metrics, step, TRAIN_AXIS)
            write_json(self.state_file, self.state)

    def on_round_end(self, event: Any) -> None:
        """A round's row of the round table as ``round/<column>`` at step = the round, with ``report.png``; a row
        logged before with the same values (a resumed run's Cached rounds) is not logged again."""
        with self._lock:
            if not self.tools or event.round is None:
                return
            metrics = {f"round/{k}": float(v) for k, v in event.metrics.items()}
            rounds = self.state.setdefault("rounds", {})
            if rounds.get(str(event.round)) == _digest(metrics):
                return
            self._each("log_metrics", metrics, event.round, ROUND_AXIS)
            report = self.paths.root / REPORT
            if report.is_file():
                self._each("log_image", "report", report, event.round, ROUND_AXIS)
            rounds[str(event.round)] = _digest(metrics)
            write_json(self.state_file, self.state)

    def on_run_end(self, event: Any) -> None:
        self.close(failed=event.state != "Completed")  # Failed, or Cancelled by a person: not a finished run

    def close(self, failed: bool = False) -> None:
        """End every tool's tracked run (FAILED when ``failed``); idempotent. A resume reopens them."""
        with self._lock:
            self._finish_all(failed)

    def _finish_all(self, failed: bool) -> None:
        tools, self.tools, self.opened = self.tools, {}, False
        for name, tool in tools.items():
            try:
                _said(name, tool.finish, failed)
            except Exception as exc:
                log.error("report_to %s: could not end the tracked run: %s", name, hide_secrets(str(exc)))

    def _each(self, method: str, *args: Any) -> None:
        for name, tool in self.tools.items():
            try:
                _said(name, getattr(tool, method), *args)
            except Exception as exc:  # a tracker's hiccup must not stop training; one line, no secret in it
                log.error("report_to %s: %s failed: %s: %s", name, method, type(exc).__name__, hide_secrets(str(exc)))
