"""Creating and opening run folders: run.json, items.parquet, initial checkpoints, and the run's task."""

from __future__ import annotations

import hashlib
import inspect
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pbrl
from pbrl.config import JobConfig, config_hash, is_iterative, parse_job
from pbrl.errors import ArtifactError, ConfigError, Problem
from pbrl.storage import RunPaths, read_json, write_json
from pbrl.tasks import Task, get_task, import_object

# Tasks given as Python objects through the trainer API, keyed by resolved run folder. Stages run in the
# same process as the trainer (Prefect's default thread runner), so they find them here.
_ATTACHED_TASKS: dict[str, Task] = {}


# The ``task`` label of a job whose task exists only as Python objects in the process that started it.
IN_PROCESS_TASK = "python"


def attach_task(run_dir: Path, task: Task) -> None:
    """Make a Python-object task (callables) available to the stages of the run in this process."""
    _ATTACHED_TASKS[str(Path(run_dir).resolve())] = task


def attached_task(run_dir: Path) -> Task | None:
    """The task attached to ``run_dir`` in this process, if any."""
    return _ATTACHED_TASKS.get(str(Path(run_dir).resolve()))


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


def stage_config_hash(job: JobConfig) -> str:
    """The config hash that keys stage caches: ``num_iterations`` is left out, since adding an iteration
    to a run (the nightly deployment) must not invalidate the rounds already done."""
    if is_iterative(job.trainer):
        job = job.model_copy(update={"num_iterations": 1})
    return config_hash(job)


# ---------------------------------------------------------------------------------------------- task
def resolve_task(job: JobConfig, run_dir: Path | None = None) -> Task:
    """The run's task: an attached Python task, else the registered task and/or import paths in the config.

    Raises:
        ConfigError: an import path cannot be imported, or the formatter count differs from num_agents.
    """
    if run_dir is not None and (task := attached_task(run_dir)):
        return task
    problems: list[Problem] = []
    base: Task | None = None
    if job.task == IN_PROCESS_TASK:
        raise ConfigError([Problem("task", job.task, "this run's task was given as Python objects (callables or "
                                   "in-memory items) to the trainer API and lives only in that process; give "
                                   "module-level functions and dataset files (recorded by import path and file "
                                   "name) to run its stages from the CLI or the UI")])
    if job.task:
        try:
            base = get_task(job.task, **job.task_options)
        except (KeyError, TypeError, ValueError) as exc:
            problems.append(Problem("task", job.task, str(exc).strip("'\"")))

    def _import(field: str, path: str) -> Any:
        try:
            return import_object(path)
        except ImportError as exc:
            problems.append(Problem(field, path, str(exc)))
            return None

    formatters = tuple(_import("formatters", p) for p in job.formatters) if job.formatters else None
    reward_func = _import("reward_func", job.reward_func) if job.reward_func else None
    processor = _import("reward_processor", job.reward_processor) if job.reward_processor else None
    if problems:
        raise ConfigError(problems)
    task = Task(
        name=job.task or "custom",
        formatters=formatters or (base.formatters if base else ()),
        reward_func=reward_func or (base.reward_func if base else None),  # type: ignore[arg-type]
        reward_processor=processor or (base.reward_processor if base else None),
        train_items=base.train_items if base else (),
        eval_items=base.eval_items if base else (),
        reward_range=base.reward_range if base else None,
    )
    if len(task.formatters) != job.num_agents:
        raise ConfigError(
            [Problem("formatters", len(task.formatters), f"need one formatter per agent ({job.num_agents})")]
        )
    return task


def task_fingerprint(task: Task) -> str:
    """A hash of the task's code identity (qualified names and sources) for cache keys."""
    h = hashlib.sha256()
    for fn in (*task.formatters, task.reward_func, task.reward_processor):
        if fn is None:
            continue
        h.update(f"{getattr(fn, '__module__', '')}:{getattr(fn, '__qualname__', repr(fn))}".encode())
        try:
            h.update(inspect.getsource(fn).encode())
        except (OSError, TypeError):
            pass
    return h.hexdigest()


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
        return parse_job({**data["config"], "output_dir": str(folder.parent), "run_name": folder.name},
                         warn=False)  # its notices were shown when the run started
    except (KeyError, TypeError, ConfigError) as exc:
        raise ArtifactError(f"{RunPaths(run_dir).run_json}: invalid stored config ({exc})") from exc


def write_run_json(paths: RunPaths, job: JobConfig) -> None:
    """run.json: the run id (a UUID kept for the run's life), the resolved config (it holds no secret: API
    keys live only in environment variables) without ``output_dir`` (where the folder lives is not part of
    the run, which may move), the package version, seed and creation time.

    A run.json written before runs had ids gets one here, and the run's replay index is adopted by it.
    """
    import uuid

    from pbrl.replay_store import adopt_legacy_index
    from pbrl.stagekit import job_replay_dir

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


def existing_rounds(paths: RunPaths) -> list[int]:
    """Round numbers that have a folder (complete or not)."""
    base = paths.root / "rounds"
    if not base.is_dir():
        return []
    return sorted(int(p.name) for p in base.iterdir() if re.fullmatch(r"\d{4}", p.name))


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
    from pbrl.items import load_run_items, write_items
    from pbrl.policies import PolicySource, write_initial_checkpoints
    from pbrl.preflight import preflight  # preflight resolves tasks with this module: imported when used
    from pbrl.replay_store import check_owned, run_identity
    from pbrl.stagekit import job_replay_dir
    from pbrl.storage import atomic_dir, remove_stale_temporaries

    run_dir = Path(run_dir) if run_dir is not None else run_dir_for(job)
    paths = RunPaths(run_dir)
    given = task or attached_task(run_dir)  # a task of Python objects; a config's task is resolved anew
    if paths.run_json.is_file():
        if not resume:
            raise ConfigError([Problem("run_name", job.run_name, f"run folder {run_dir} already exists; continue "
                                       "it with --resume (CLI) or resume=True (Python API), or choose another "
                                       "run name")])
        check_resumable(paths, job)
        remove_stale_temporaries(paths)  # what a killed write left behind (never read, but never cleaned)
        task = preflight(job, task=given, train_items=train_items, eval_items=eval_items,
                         check_items=not paths.items.is_file())
        if given is not None:
            attach_task(run_dir, given)
        if not paths.items.is_file():
            write_items(paths, *load_run_items(job, task, train_items, eval_items))
        write_run_json(paths, job)
        check_owned(job_replay_dir(paths, job), run_identity(paths))
        write_initial_checkpoints(paths, PolicySource.from_job(job), seed=job.seed)
        return run_dir
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError([Problem("run_name", job.run_name, f"{run_dir} exists and is not a run folder (no "
                                   "run.json); remove it or choose another run name")])
    task = preflight(job, task=given, train_items=train_items, eval_items=eval_items)
    train, evals = load_run_items(job, task, train_items, eval_items)
    with atomic_dir(run_dir) as tmp:  # renamed onto run_dir only when everything below succeeded
        new = RunPaths(tmp)
        write_items(new, train, evals)
        write_run_json(new, job)
        check_owned(job_replay_dir(new, job), run_identity(new))
        write_initial_checkpoints(new, PolicySource.from_job(job), seed=job.seed)
    if given is not None:
        attach_task(run_dir, given)
    if getattr(job, "policy_checkpoint_dir", None):
        from pbrl.export import export_policy_checkpoint

        export_policy_checkpoint(paths.initial, job.policy_checkpoint_dir, 0, PolicySource.from_job(job).num_agents)
    return run_dir
