"""Creating and opening run folders: run.json, items.parquet, initial checkpoints, and the run's task."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pbrl
from pbrl.config import JobConfig, config_hash, parse_job, stage_config_hash
from pbrl.data.items import load_run_items, write_items
from pbrl.data.replay_store import adopt_legacy_index, check_owned, replay_dir, run_identity
from pbrl.data.storage import RunPaths, atomic_dir, read_json, remove_stale_temporaries, write_json
from pbrl.errors import ArtifactError, ConfigError, Problem
from pbrl.models.policies import write_initial_checkpoints
from pbrl.run.export import export_policy_checkpoint
from pbrl.run.preflight import preflight
from pbrl.run.settings import policy_source
from pbrl.run.task import attach_task, attached_task
from pbrl.tasks.base import Task


def generated_run_name(trainer: str, now: datetime | None = None) -> str:
    """The name of a run started without ``run_name`` (Python trainers, Prefect UI, deployments):
    ``<trainer>-<UTC time YYYYmmdd-HHMMSS>``."""
    return f"{trainer}-{(now or datetime.now(UTC)):%Y%m%d-%H%M%S}"


def with_run_name(job: JobConfig) -> JobConfig:
    """``job`` itself when it has a ``run_name``, else a copy with a generated one."""
    return job if job.run_name else job.model_copy(update={"run_name": generated_run_name(job.trainer)})


def run_dir_for(job: JobConfig) -> Path:
    """``<output_dir>/<run_name>``. Raises ConfigError when run_name is missing."""
    if not job.run_name:
        raise ConfigError([Problem("run_name", None, "a run needs a name (give --run-name or run_name)")])
    return Path(job.output_dir) / job.run_name


def job_replay_dir(paths: RunPaths, job: JobConfig) -> Path:
    """The replay folder of ``job``'s run: ``preference_replay_dir`` (iterative trainers) or ``<run>/replay``."""
    return replay_dir(paths.root, getattr(job, "preference_replay_dir", None))  # base trainers lack the option


# ---------------------------------------------------------------------------------------------- run.json
def open_job(run_dir: Path) -> JobConfig:
    """The job stored in ``run.json``, placed where the folder is now: ``output_dir`` and ``run_name`` come
    from ``run_dir`` (the folder is the run; it may have been moved or copied), so
    ``run_dir_for(open_job(d))`` is ``d``.

    Raises:
        ArtifactError: run.json is missing or invalid.
    """
    folder = Path(run_dir)
    if folder.name in ("", ".", ".."):
        folder = folder.resolve()
    data = read_json(RunPaths(folder).run_json)
    try:
        return parse_job(
            {**data["config"], "output_dir": str(folder.parent), "run_name": folder.name}, warn=False
        )  # its notices were shown when the run started
    except (KeyError, TypeError, ConfigError) as exc:
        raise ArtifactError(f"{RunPaths(run_dir).run_json}: invalid stored config ({exc})") from exc


def write_run_json(paths: RunPaths, job: JobConfig) -> None:
    """run.json: the run id (a UUID kept for the run's life), the resolved config (it holds no secret: API
    keys live only in environment variables) without ``output_dir`` (where the folder lives is not part of
    the run, which may move), the package version, seed and creation time.

    A run.json written before runs had ids gets one here, and the run's replay index is adopted by it.
    """

    created = datetime.now(UTC).isoformat(timespec="seconds")
    run_id = str(uuid.uuid4())
    if paths.run_json.is_file():
        stored = read_json(paths.run_json)
        created = stored.get("created_at", created)
        if stored.get("run_id"):
            run_id = stored["run_id"]
        else:
            adopt_legacy_index(job_replay_dir(paths, job), created, run_id)
    write_json(
        paths.run_json,
        {
            "run_id": run_id,
            "config": job.model_dump(mode="json", exclude={"output_dir"}),
            "config_hash": config_hash(job),
            "pbrl_version": pbrl.__version__,
            "seed": job.seed,
            "created_at": created,
        },
    )


def check_resumable(paths: RunPaths, job: JobConfig) -> None:
    """Refuse to continue a run folder made with another configuration (num_iterations may grow).

    Raises:
        ConfigError: naming every field whose value differs from the stored run.
    """
    stored = open_job(paths.root)
    if stage_config_hash(stored) == stage_config_hash(job):
        return
    a, b = stored.model_dump(mode="json"), job.model_dump(mode="json")
    diffs = [
        Problem(k, b.get(k), f"differs from the stored run ({a.get(k)!r}); start a new run_name instead")
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k) and k not in ("num_iterations", "run_name", "output_dir")
    ]
    raise ConfigError(diffs or [Problem("config", "?", "differs from the stored run")])


# ---------------------------------------------------------------------------------------------- prepare
def prepare_run(
    job: JobConfig,
    *,
    resume: bool,
    task: Task | None = None,
    train_items: Any = None,
    eval_items: Any = None,
    run_dir: Path | None = None,
) -> Path:
    """Create (or, with ``resume``, reopen) the run folder: run.json, items.parquet, initial checkpoints.

    Items come from ``train_items``/``eval_items`` (Python API: list of dicts, JSONL/Parquet path or a
    ``datasets.Dataset``), else ``train_dataset``/``eval_dataset`` in the config, else the task's own.
    Evaluation falls back to the train items when none are given. A new run is built in a temporary
    sibling folder and renamed into place only when complete, so a start that fails at any point leaves
    nothing that blocks the retry. ``run_dir`` (default ``<output_dir>/<run_name>``) is the folder used.

    Raises:
        ConfigError: the run exists and ``resume`` is false, the stored config differs, the task or items
            are invalid, the folder exists but is not a run, or the replay folder holds another run's files.
    """

    run_dir = Path(run_dir) if run_dir is not None else run_dir_for(job)
    paths = RunPaths(run_dir)
    given = task or attached_task(run_dir)  # a task of Python objects; a config's task is resolved anew
    if paths.run_json.is_file():
        if not resume:
            raise ConfigError(
                [
                    Problem(
                        "run_name",
                        job.run_name,
                        f"run folder {run_dir} already exists; continue "
                        "it with --resume (CLI) or resume=True (Python API), or choose another "
                        "run name",
                    )
                ]
            )
        check_resumable(paths, job)
        remove_stale_temporaries(paths)  # what a killed write left behind (never read, but never cleaned)
        task = preflight(
            job, task=given, train_items=train_items, eval_items=eval_items, check_items=not paths.items.is_file()
        )
        if given is not None:
            attach_task(run_dir, given)
        if not paths.items.is_file():
            write_items(paths, *load_run_items(job, task, train_items, eval_items))
        write_run_json(paths, job)
        check_owned(job_replay_dir(paths, job), run_identity(paths))
        write_initial_checkpoints(paths, policy_source(job), seed=job.seed)
        return run_dir
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError(
            [
                Problem(
                    "run_name",
                    job.run_name,
                    f"{run_dir} exists and is not a run folder (no run.json); remove it or choose another run name",
                )
            ]
        )
    task = preflight(job, task=given, train_items=train_items, eval_items=eval_items)
    train, evals = load_run_items(job, task, train_items, eval_items)
    with atomic_dir(run_dir) as tmp:  # renamed onto run_dir only when everything below succeeded
        new = RunPaths(tmp)
        write_items(new, train, evals)
        write_run_json(new, job)
        check_owned(job_replay_dir(new, job), run_identity(new))
        write_initial_checkpoints(new, policy_source(job), seed=job.seed)
    if given is not None:
        attach_task(run_dir, given)
    if getattr(job, "policy_checkpoint_dir", None):
        export_policy_checkpoint(paths.initial, job.policy_checkpoint_dir, 0, policy_source(job).num_agents)
    return run_dir
