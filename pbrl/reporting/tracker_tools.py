"""The experiment-tracking tools of ``report_to`` (docs/guides/tracking-and-export.md#experiment-tracking):
TensorBoard, MLflow, Weights & Biases and trackio, each behind one adapter (:class:`Tracker`) that
:class:`pbrl.reporting.trackers.RunTracker` drives from a run's events.

The tools find their projects and credentials in their own environment variables (``WANDB_PROJECT``,
``WANDB_API_KEY``, ``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME``, ``TRACKIO_PROJECT`` ...); nothing secret is
written. Each tool is an optional dependency, imported when a run uses it (so a run without ``report_to`` never
pays for it): :func:`tracker_problems` names a missing one before a run starts.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

from pbrl.errors import ConfigError, Problem
from pbrl.generation.redaction import Redactor

log = logging.getLogger(__name__)

DEFAULT_PROJECT = "pbrl"  # the experiment / project name when the tool's environment names none
TRAIN_AXIS = "train/global_step"
ROUND_AXIS = "round"
EXTRA = "pip install 'pbrl[tracking]'"


@dataclass(frozen=True)
class ToolSpec:
    """A tracker's package: ``module`` (found without importing it) and the pinned requirement of its extra."""

    module: str
    requirement: str


TOOLS: dict[str, ToolSpec] = {
    "tensorboard": ToolSpec("tensorboard", "tensorboard==2.21.0"),
    "mlflow": ToolSpec("mlflow", "mlflow-skinny==3.17.2"),
    "wandb": ToolSpec("wandb", "wandb==0.31.0"),
    "trackio": ToolSpec("trackio", "trackio==0.43.0"),
}
_OFFLINE_WANDB = ("offline", "dryrun", "disabled")
WANDB_MODES = ("online", "offline", "dryrun", "disabled", "run", "shared")  # what W&B's own settings accept
# Environment variables whose values are secrets of a tool: hidden from every message pbrl writes about it.
SECRET_ENV = ("MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "WANDB_API_KEY", "HF_TOKEN")
PROBE_TIMEOUT_S = 5.0  # an MLflow tracking server that does not answer within this is taken for unreachable
_USERINFO = re.compile(r"(?<=://)[^/@\s]+@")


def hide_secrets(text: str) -> str:
    """``text`` with the user and password of every URL (``https://user:pass@host`` -> ``https://***@host``) and the
    values of the tools' secret environment variables (:data:`SECRET_ENV`) hidden."""
    text = _USERINFO.sub("***@", text)
    for name in SECRET_ENV:
        secret = os.environ.get(name, "")
        if len(secret) >= 4:
            text = Redactor(secret)(text)
    return text


def tracker_names(report_to: str | Sequence[str] | None) -> tuple[str, ...]:
    """The ``report_to`` option as names, each once, in the given order (None or ``'none'`` -> none; ``'all'`` -> every
    tool whose package is installed, as transformers reads it)."""
    if report_to is None or report_to == "none":
        return ()
    names = [report_to] if isinstance(report_to, str) else list(report_to)
    if "all" in names:
        names = [n for n in TOOLS if importlib.util.find_spec(TOOLS[n].module) is not None]
    return tuple(dict.fromkeys(names))


def tracker_problems(report_to: str | Sequence[str] | None) -> list[Problem]:
    """What stops ``report_to`` from tracking a run, checked before it starts: an unknown name, a tool whose package
    is not installed (the extra to install is named), W&B online (``WANDB_MODE`` unset) without an API key."""
    problems = []
    for name in tracker_names(report_to):
        spec = TOOLS.get(name)
        if spec is None:
            problems.append(Problem("report_to", name, f"unknown tracker; allowed: {', '.join(TOOLS)}"))
        elif importlib.util.find_spec(spec.module) is None:
            problems.append(
                Problem("report_to", name, f"needs the {spec.module} package, which is not installed: {EXTRA} (or "
                        f"pip install {spec.requirement})")
            )  # fmt: skip
        elif name == "wandb" and os.environ.get("WANDB_MODE", "online") not in WANDB_MODES:
            shown = os.environ["WANDB_MODE"][:40]
            problems.append(
                Problem("report_to", name, f"WANDB_MODE={shown!r} is not a W&B mode; set one of "
                        f"{', '.join(WANDB_MODES)}, or unset it (online)")
            )  # fmt: skip
        elif name == "mlflow" and (why := mlflow_server_problem()):
            problems.append(Problem("report_to", name, why))
        elif name == "wandb" and os.environ.get("WANDB_MODE", "online") not in _OFFLINE_WANDB and not _wandb_key():
            problems.append(
                Problem("report_to", name, "W&B is online (WANDB_MODE is not offline) but no API key is found: run "
                        "`wandb login`, set WANDB_API_KEY, or set WANDB_MODE=offline to write the run files without a "
                        "network (`wandb sync` uploads them later)")
            )  # fmt: skip
    return problems


def mlflow_server_problem() -> str | None:
    """Why the MLflow tracking server of ``MLFLOW_TRACKING_URI`` (an ``http(s)://`` one) cannot take a run: it does not
    answer within :data:`PROBE_TIMEOUT_S` (one try, where MLflow's client retries for minutes) or refuses the
    credentials; None when it answers, or the URI is no server (a local store, unset, Databricks). The URI is shown
    without its user and password."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if not uri.startswith(("http://", "https://")):
        return None
    shown = hide_secrets(uri)
    probe = uri.rstrip("/") + "/api/2.0/mlflow/experiments/get-by-name?experiment_name=" + DEFAULT_PROJECT
    try:
        status = httpx.get(probe, timeout=PROBE_TIMEOUT_S).status_code
    except httpx.HTTPError as exc:
        return (
            f"the MLflow tracking server {shown} (MLFLOW_TRACKING_URI) does not answer ({type(exc).__name__}); start "
            "it, fix MLFLOW_TRACKING_URI (unset: a local store in the run folder) or leave mlflow out of report_to"
        )
    if status in (401, 403):
        return f"the MLflow tracking server {shown} refused the credentials (HTTP {status}): check them"
    return None


def require_trackers(report_to: str | Sequence[str] | None) -> None:
    """Raises ConfigError naming ``report_to`` when :func:`tracker_problems` finds any."""
    problems = tracker_problems(report_to)
    if problems:
        raise ConfigError(problems)


def _wandb_key() -> bool:
    import wandb  # deferred: an optional dependency, imported only when a run reports to W&B

    return bool(wandb.login(prompt=False, verify=False))  # the key from WANDB_API_KEY or `wandb login`, not checked


# ---------------------------------------------------------------------------------------------- the tools
@dataclass(frozen=True)
class RunInfo:
    """What a tool names its tracked run by: the run folder, its name (the folder's), pbrl's run id and trainer."""

    run_dir: Path
    name: str
    run_id: str
    trainer: str


class Tracker(Protocol):
    """One experiment-tracking tool. ``start`` opens (or, with the ``stored`` state of an earlier start, reopens) the
    tracked run and returns the state to keep in tracking.json; ``axis`` names the x-axis a metric is logged against
    (``train/global_step`` or ``round``)."""

    def start(self, run: RunInfo, stored: Mapping[str, Any]) -> dict[str, Any]: ...

    def log_params(self, params: Mapping[str, str | int | float | bool]) -> None: ...

    def log_metrics(self, metrics: Mapping[str, float], step: int, axis: str) -> None: ...

    def log_image(self, key: str, path: Path, step: int, axis: str) -> None: ...

    def finish(self, failed: bool) -> None: ...


class TensorBoardTracker:
    """Event files in ``<run>/tensorboard/`` (torch's ``SummaryWriter``); a resumed run writes another event file
    into the same folder, which TensorBoard reads as the same run. The config: an hparams summary and a text."""

    def start(self, run: RunInfo, stored: Mapping[str, Any]) -> dict[str, Any]:
        from torch.utils.tensorboard import SummaryWriter  # deferred: needs the optional tensorboard package

        self.writer = SummaryWriter(log_dir=str(run.run_dir / "tensorboard"))
        return {"log_dir": "tensorboard"}

    def log_params(self, params: Mapping[str, str | int | float | bool]) -> None:
        from torch.utils.tensorboard.summary import hparams  # deferred: needs the optional tensorboard package

        for summary in hparams(dict(params), {}):  # into this writer's file (add_hparams would open a sub-run)
            self.writer.file_writer.add_summary(summary)
        lines = ["| option | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in params.items())]
        self.writer.add_text("config", "\n".join(lines))
        self.writer.flush()

    def log_metrics(self, metrics: Mapping[str, float], step: int, axis: str) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def log_image(self, key: str, path: Path, step: int, axis: str) -> None:
        import matplotlib.image  # deferred: matplotlib is slow to import and only needed for the report

        pixels = matplotlib.image.imread(path)[..., :3]  # (h, w, 3) floats in [0, 1], alpha dropped
        self.writer.add_image(key, pixels, global_step=step, dataformats="HWC")
        self.writer.flush()

    def finish(self, failed: bool) -> None:
        self.writer.close()


class MLflowTracker:
    """An MLflow run: the tracking server of ``MLFLOW_TRACKING_URI``, else a local store in ``<run>/mlruns/``
    (``mlflow.db``, SQLite, and ``artifacts/``), in the experiment ``MLFLOW_EXPERIMENT_NAME`` (default ``pbrl``).
    The MLflow run id is kept, so a resumed run logs into the same MLflow run. MLflow keeps the first value of a
    parameter: an option a resume changed (``num_iterations`` ...) is recorded as the tag ``resumed.<option>``."""

    def start(self, run: RunInfo, stored: Mapping[str, Any]) -> dict[str, Any]:
        from mlflow.tracking import MlflowClient  # deferred: an optional dependency

        # MLflow's client retries a request 7 times with a doubling backoff (minutes against a server that went away
        # after the start's probe); a few tries are enough for a hiccup. The user's own settings win.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
        for name in ("mlflow.store", "alembic"):  # "Creating initial MLflow database tables..." in a run's output
            logging.getLogger(name).setLevel(logging.WARNING)
        store = run.run_dir / "mlruns"
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        artifacts = None
        if not uri:
            store.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{(store / 'mlflow.db').resolve()}"
            artifacts = (store / "artifacts").resolve().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", DEFAULT_PROJECT)
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = (
            experiment.experiment_id if experiment else self.client.create_experiment(name, artifact_location=artifacts)
        )
        self.run_id = self._reopen(stored.get("run_id"))
        if self.run_id is None:
            tags = {"pbrl.run_id": run.run_id, "pbrl.trainer": run.trainer}
            self.run_id = self.client.create_run(experiment_id, run_name=run.name, tags=tags).info.run_id
        return {"run_id": self.run_id, "experiment_id": experiment_id}

    def _reopen(self, run_id: Any) -> str | None:
        if not isinstance(run_id, str):
            return None
        try:
            self.client.update_run(run_id, status="RUNNING")
        except Exception as exc:  # another tracking server than before: the run is not there
            log.warning("mlflow: run %s not found on this tracking server (%s); starting a new MLflow run", run_id, exc)
            return None
        return run_id

    def log_params(self, params: Mapping[str, str | int | float | bool]) -> None:
        from mlflow.entities import Param, RunTag  # deferred: an optional dependency

        logged = self.client.get_run(self.run_id).data.params
        values = {k: str(v)[:6000] for k, v in params.items()}  # MLflow's limit on a parameter's value
        new = [Param(k, v) for k, v in values.items() if k not in logged]
        changed = [RunTag(f"resumed.{k}", v[:5000]) for k, v in values.items() if logged.get(k, v) != v]
        for start in range(0, len(new), 100):  # MLflow takes at most 100 parameters per batch
            self.client.log_batch(self.run_id, params=new[start : start + 100])
        if changed:
            self.client.log_batch(self.run_id, tags=changed)

    def log_metrics(self, metrics: Mapping[str, float], step: int, axis: str) -> None:
        from mlflow.entities import Metric  # deferred: an optional dependency

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def log_image(self, key: str, path: Path, step: int, axis: str) -> None:
        self.client.log_artifact(self.run_id, str(path))  # the newest report.png replaces the previous one

    def finish(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


class WandbTracker:
    """A W&B run in the project ``WANDB_PROJECT`` (default ``pbrl``; entity, host and key from W&B's own environment),
    writing its files under ``<run>/wandb/``: online when logged in, without a network with ``WANDB_MODE=offline``
    (``wandb sync <run>/wandb/offline-run-*`` uploads them). The W&B run id is kept and the run resumed with it, so
    a resumed pbrl run continues the same W&B run. ``train/*`` metrics use ``train/global_step`` as their x-axis and
    ``round/*`` the round (``define_metric``)."""

    def start(self, run: RunInfo, stored: Mapping[str, Any]) -> dict[str, Any]:
        import wandb  # deferred: an optional dependency

        run_id = stored.get("id") if isinstance(stored.get("id"), str) else uuid.uuid4().hex[:12]
        settings = wandb.Settings(console="off", save_code=False, x_disable_stats=True, silent=True)
        # WANDB_MODE as it is now (W&B's process-wide setup may have read the environment earlier)
        mode = {"offline": "offline", "dryrun": "offline", "disabled": "disabled"}.get(os.environ.get("WANDB_MODE", ""))
        self.run = wandb.init(
            mode=mode,  # type: ignore[arg-type]
            project=os.environ.get("WANDB_PROJECT", DEFAULT_PROJECT),
            name=run.name,
            id=run_id,
            resume="allow",
            dir=str(run.run_dir.resolve()),
            tags=["pbrl", run.trainer],
            reinit="create_new",
            settings=settings,
        )
        self.run.define_metric(TRAIN_AXIS)
        self.run.define_metric("train/*", step_metric=TRAIN_AXIS)
        self.run.define_metric(ROUND_AXIS)
        self.run.define_metric("round/*", step_metric=ROUND_AXIS)
        return {"id": run_id}

    def log_params(self, params: Mapping[str, str | int | float | bool]) -> None:
        self.run.config.update(dict(params), allow_val_change=True)

    def log_metrics(self, metrics: Mapping[str, float], step: int, axis: str) -> None:
        self.run.log({**metrics, axis: step})

    def log_image(self, key: str, path: Path, step: int, axis: str) -> None:
        import wandb  # deferred: an optional dependency

        self.run.log({f"round/{key}": wandb.Image(str(path)), axis: step})

    def finish(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class TrackioTracker:
    """A trackio run named after the pbrl run in the project ``TRACKIO_PROJECT`` (default ``pbrl``), stored where
    trackio keeps its projects (``TRACKIO_DIR``, local by default); a resumed run resumes the trackio run by name."""

    def start(self, run: RunInfo, stored: Mapping[str, Any]) -> dict[str, Any]:
        import trackio  # deferred: an optional dependency

        project = os.environ.get("TRACKIO_PROJECT", DEFAULT_PROJECT)
        self.run_name, self.project = run.name, project
        self.run: Any = None
        self.config: dict[str, Any] = {"pbrl.run_id": run.run_id, "pbrl.trainer": run.trainer}
        self._trackio = trackio
        return {"project": project, "name": run.name}

    def _open(self) -> Any:
        if self.run is None:  # trackio takes the config at init only: opened with the first log
            self.run = self._trackio.init(
                project=self.project, name=self.run_name, config=self.config, resume="allow", embed=False,
                auto_log_gpu=False, auto_log_cpu=False,
            )  # fmt: skip
        return self.run

    def log_params(self, params: Mapping[str, str | int | float | bool]) -> None:
        self.config.update(params)
        self._open()

    def log_metrics(self, metrics: Mapping[str, float], step: int, axis: str) -> None:
        self._open().log({**metrics, axis: step}, step=step)  # each metric against its own axis, as in TensorBoard

    def log_image(self, key: str, path: Path, step: int, axis: str) -> None:
        self._open().log({f"round/{key}": self._trackio.Image(str(path)), axis: step}, step=step)

    def finish(self, failed: bool) -> None:
        if self.run is not None:
            self.run.finish()


TRACKER_CLASSES: dict[str, type] = {
    "tensorboard": TensorBoardTracker,
    "mlflow": MLflowTracker,
    "wandb": WandbTracker,
    "trackio": TrackioTracker,
}
