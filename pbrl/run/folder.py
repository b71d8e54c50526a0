"""Creating and opening run folders: run.json, items.parquet, initial checkpoints, and the run's task."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import uuid
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pbrl
from pbrl.config import JobConfig, apply_overrides, config_hash, parse_job, stage_config_hash
from pbrl.data.items import load_run_items, write_items
from pbrl.data.replay_store import adopt_legacy_index, check_owned, replay_dir, run_identity
from pbrl.data.storage import RunPaths, atomic_dir, read_json, remove_stale_temporaries, write_json
from pbrl.errors import ArtifactError, ConfigError, Problem
from pbrl.models.policies import write_initial_checkpoints
from pbrl.run.export import export_policy_checkpoint
from pbrl.run.preflight import preflight
from pbrl.run.settings import concrete_precision, describe_precision, policy_source, run_outputs
from pbrl.run.task import attach_task, attached_task
from pbrl.tasks.base import Task

log = logging.getLogger("pbrl.run")
RUN_LOCK = ".pbrl-run.lock"  # in the run folder: held (flock) by the process working on the run
# The options a resume may change: they key no stage's cache (pbrl.config.loading: stage_config_hash).
RESUMABLE_CHANGES = frozenset(
    {"num_iterations", "runner", "ray_address", "shard_size", "num_threads", "run_name", "output_dir", "report_to"}
)


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
    return replay_dir(paths.root, run_outputs(job).replay_dir)


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
    """Refuse to continue a run folder with a configuration that changes what its finished stages computed.

    A resume may change only the options that key no stage's cache (:func:`pbrl.config.stage_config_hash`):
    :data:`RESUMABLE_CHANGES` (``num_iterations`` for more rounds, where and how the stages run, the trackers,
    ``run_name`` and ``output_dir``).

    Raises:
        ConfigError: naming every other field whose value differs from the stored run.
    """
    stored = open_job(paths.root)
    job, _ = concrete_precision(job, stored)  # auto keeps the run's recorded choice
    if stage_config_hash(stored) == stage_config_hash(job):
        return
    a, b = stored.model_dump(mode="json"), job.model_dump(mode="json")
    diffs = [
        Problem(
            k,
            b.get(k),
            f"differs from the stored run ({a.get(k)!r}) and would change what its finished "
            "stages computed; a resume may change "
            + ", ".join(sorted(RESUMABLE_CHANGES - {"run_name", "output_dir"}))
            + " only; start a new run_name for other options",
        )
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k) and k not in RESUMABLE_CHANGES
    ]
    raise ConfigError(diffs or [Problem("config", "?", "differs from the stored run")])


def open_run(run_dir: Path, overrides: Sequence[str] = ()) -> JobConfig:
    """The job of the existing run ``run_dir`` (:func:`open_job`), with ``"key=value"`` overrides applied and
    checked as a resume may change it (:func:`check_resumable`): e.g. ``num_iterations=3`` adds rounds.

    Raises:
        ConfigError: ``run_dir`` is not a run folder (named), an override is invalid, or it changes an option
            that a resume may not change.
        ArtifactError: run.json is unreadable.
    """
    folder = Path(run_dir)
    if not folder.is_dir() or not RunPaths(folder).run_json.is_file():
        what = "is not a folder" if not folder.is_dir() else "is not a run folder (no run.json)"
        raise ConfigError(
            [
                Problem(
                    "run",
                    str(folder),
                    f"{what}; {runs_in(folder.parent)}; give a folder that pbrl train created, e.g. storage/runs/NAME",
                )
            ]
        )
    job = open_job(folder)
    if not overrides:
        return job
    data = job.model_dump(mode="json")
    changed = apply_overrides(data, overrides)
    check_resumable(RunPaths(folder), changed)
    return changed


def run_names(output_dir: Path) -> list[str]:
    """The names of the runs in ``output_dir`` (its folders with a run.json), the most recently changed first."""
    folder = Path(output_dir)
    found = [p for p in folder.iterdir() if RunPaths(p).run_json.is_file()] if folder.is_dir() else []
    return [p.name for p in sorted(found, key=lambda p: (-p.stat().st_mtime, p.name))]


def runs_in(output_dir: Path, most: int = 20) -> str:
    """``the runs in <output_dir>: a, b, …`` (:func:`run_names`, at most ``most`` of them, then how many more), or
    that it holds none: what an error about a run name that is not there lists."""
    names = run_names(output_dir)
    if not names:
        return f"{output_dir} holds no runs"
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return f"the runs in {output_dir}: {', '.join(names[:most])}{more}"


def start_problems(job: JobConfig, run_dir: Path, *, resume: bool) -> list[Problem]:
    """What stops ``job`` from starting (or, with ``resume``, continuing) in ``run_dir``, checked before any
    work or Prefect server starts: the folder exists and ``resume`` is off; it exists but is not a run; the stored
    run has another configuration; another process holds the run (:func:`run_lock`)."""
    paths = RunPaths(run_dir)
    if paths.run_json.is_file():
        if not resume:
            return [_exists(job.run_name, run_dir)]
        try:
            check_resumable(paths, job)
            holder = run_holder(run_dir)
        except ConfigError as exc:
            return exc.problems
        return [] if holder is None else [_in_use(run_dir, holder)]
    if Path(run_dir).exists() and any(Path(run_dir).iterdir()):
        return [_not_a_run(job.run_name, run_dir)]
    return []


def _exists(run_name: str | None, run_dir: Path) -> Problem:
    return Problem(
        "run_name",
        run_name,
        f"run folder {run_dir} already exists; continue it with "
        "--resume (CLI) or resume=True (Python API), or choose another run name",
    )


def _not_a_run(run_name: str | None, run_dir: Path) -> Problem:
    return Problem(
        "run_name",
        run_name,
        f"{run_dir} exists and is not a run folder (no run.json); remove it or choose another run name",
    )


# ---------------------------------------------------------------------------------------------- in use
# Held locks of this process (path -> depth): flock locks belong to an open file, so a process that takes its own
# run's lock again (the trainer API around the flow) must not open the file a second time.
_HELD: dict[str, tuple[int, int]] = {}


@contextlib.contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """Hold the run folder for this process: a second process (``pbrl train``, ``pbrl stage``, a UI run) on the
    same run is refused with the holder's pid and host instead of recomputing stages under it. The lock is an
    ``flock`` on ``<run>/.pbrl-run.lock`` (released by the kernel when the holder dies, so none is ever left
    stale); the file records the holder for the message. Re-entrant within a process.

    Raises:
        ConfigError: another process holds the run.
    """
    key = str(Path(run_dir).resolve())
    if key in _HELD:
        fd, depth = _HELD[key]
        _HELD[key] = (fd, depth + 1)
        try:
            yield
        finally:
            fd, depth = _HELD[key]
            _HELD[key] = (fd, depth - 1)
        return
    path = Path(run_dir) / RUN_LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = _read_holder(fd)
        os.close(fd)
        raise ConfigError([_in_use(run_dir, holder or {})]) from None
    os.ftruncate(fd, 0)
    os.pwrite(
        fd,
        json.dumps(
            {"pid": os.getpid(), "host": socket.gethostname(), "since": datetime.now(UTC).isoformat(timespec="seconds")}
        ).encode(),
        0,
    )
    _HELD[key] = (fd, 1)
    try:
        yield
    finally:
        _HELD.pop(key, None)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


@contextlib.contextmanager
def held_if_exists(run_dir: Path | None) -> Iterator[None]:
    """:func:`run_lock` on ``run_dir`` for the block when it is a run folder already (a new run's folder does not
    exist until the flow builds it, and the flow takes the lock then); nothing otherwise."""
    if run_dir is not None and RunPaths(run_dir).run_json.is_file():
        with run_lock(run_dir):
            yield
    else:
        yield


def run_holder(run_dir: Path) -> dict[str, object] | None:
    """The process holding ``run_dir`` (``{"pid", "host", "since"}``), or None when it is free or held by this
    process."""
    path = Path(run_dir) / RUN_LOCK
    if str(Path(run_dir).resolve()) in _HELD or not path.is_file():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return _read_holder(fd) or {}
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _read_holder(fd: int) -> dict[str, object] | None:
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"null")
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _in_use(run_dir: Path, holder: dict[str, object]) -> Problem:
    who = f"process {holder.get('pid', '?')} on host {holder.get('host', '?')}"
    since = f" since {holder['since']}" if holder.get("since") else ""
    return Problem("run", str(run_dir), f"is in use by {who}{since}; wait for it to end (or stop it) and resume then")


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
    given = task or attached_task(run_dir)  # a task of Python objects; a config's task is resolved anew
    if not RunPaths(run_dir).run_json.is_file():
        _create_run(job, run_dir, given, train_items, eval_items)
    elif resume:
        _reopen_run(job, run_dir, given, train_items, eval_items)
    else:
        raise ConfigError([_exists(job.run_name, run_dir)])
    return run_dir


def _reopen_run(job: JobConfig, run_dir: Path, given: Task | None, train_items: Any, eval_items: Any) -> None:
    """Continue the run in ``run_dir`` (:func:`prepare_run` with ``resume``): its config checked against the
    stored one, the run's ``auto`` precision kept, its items written only if a killed start left none, run.json
    rewritten (a run from before run ids gets one), and the initial checkpoints completed."""
    paths = RunPaths(run_dir)
    check_resumable(paths, job)
    job, _ = concrete_precision(job, open_job(paths.root))
    remove_stale_temporaries(paths)  # what a killed write left behind (never read, but never cleaned)
    stored_items = paths.items.is_file()
    task = preflight(job, task=given, train_items=train_items, eval_items=eval_items, check_items=not stored_items)
    if given is not None:
        attach_task(run_dir, given)
    if not stored_items:
        write_items(paths, *load_run_items(job, task, train_items, eval_items))
    write_run_json(paths, job)
    check_owned(job_replay_dir(paths, job), run_identity(paths))
    write_initial_checkpoints(paths, policy_source(job), seed=job.seed)


def _create_run(job: JobConfig, run_dir: Path, given: Task | None, train_items: Any, eval_items: Any) -> None:
    """Build a new run in ``run_dir`` (:func:`prepare_run`): ``auto`` precision made concrete for this machine,
    preflight, then items, run.json and initial checkpoints in a temporary sibling folder renamed into place when
    complete; the initial policy is exported to ``policy_checkpoint_dir`` when the job names one."""
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError([_not_a_run(job.run_name, run_dir)])
    job, choice = concrete_precision(job)  # auto made concrete for this machine, recorded in run.json
    if (line := describe_precision(choice, job.torch_dtype, job.mixed_precision)) is not None:
        log.info(line)
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
    if export_dir := run_outputs(job).policy_checkpoint_dir:
        export_policy_checkpoint(RunPaths(run_dir).initial, export_dir, 0, policy_source(job).num_agents)
