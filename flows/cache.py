"""Prefect tasks for the stages: cached on content, not on path text (SPEC §6).

The cache key of a stage run is built from the stage name, the round, the stage config hash, the code
version, the run's identity and the **content hashes** of the stage's input files (each stage module
declares them in ``input_files``). Keys, results (small JSON manifests) and lock files live in the run
folder, under ``.prefect/``, so a resumed run or a one-stage rerun from another process shares them.
A manifest on disk whose outputs are missing or changed makes the flow refresh that stage's cache.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import Task, task
from prefect.cache_policies import CachePolicy
from prefect.context import TaskRunContext
from prefect.locking.filesystem import FileSystemLockManager
from prefect.utilities.hashing import hash_objects

from pbrl.config import JobConfig
from pbrl.oracle import is_transient
from pbrl.replay_store import run_identity
from pbrl.run import resolve_task, stage_config_hash, task_fingerprint
from pbrl.storage import RunPaths, code_version, hash_path, outputs_intact, read_manifest
from stages import STAGE_MODULES

RETRYING_STAGES = {"score-with-oracle"}  # I/O-bound (remote judges, API calls); training stages never retry


def stage_key(stage: str, run_dir: str, round_index: int, job: JobConfig) -> str:
    """The content key of one stage run."""
    paths = RunPaths(run_dir)
    files = STAGE_MODULES[stage].input_files(paths, round_index, job)
    return hash_objects(
        stage, round_index, stage_config_hash(job), code_version(), run_identity(paths),
        task_fingerprint(resolve_task(job, paths.root)),
        {paths.rel(f): hash_path(f) for f in files},
        raise_on_failure=True,
    )


@dataclass
class StageInputs(CachePolicy):
    """Cache policy keyed by :func:`stage_key` (never by the path text of the run folder)."""

    def compute_key(self, task_ctx: TaskRunContext, inputs: dict[str, Any], flow_parameters: dict[str, Any],
                    **kwargs: Any) -> str | None:
        return stage_key(task_ctx.task.name, inputs["run_dir"], inputs["round_index"], inputs["job"])


class RunFolderLockManager(FileSystemLockManager):
    """Prefect's file lock manager, plus one rule: a lock taken by a process of this host that no longer
    exists is stale and released. Prefect's locks never expire by default (and name their holder by a
    transaction id), so a run killed with SIGKILL while a stage held its lock would otherwise block every
    resume of that stage forever. Each lock file also records the owning host and process id."""

    def acquire_lock(self, key: str, holder: str, acquire_timeout: float | None = None,
                     hold_timeout: float | None = None) -> bool:
        if not super().acquire_lock(key, holder, acquire_timeout, hold_timeout):
            return False
        path = Path(self._lock_path_for_key(key))
        info = json.loads(path.read_text())
        path.write_text(json.dumps({**info, "host": socket.gethostname(), "pid": os.getpid()}))
        return True

    def is_locked(self, key: str, use_cache: bool = False) -> bool:
        if not super().is_locked(key, use_cache=use_cache):
            return False
        info = self._get_lock_info(key, use_cache=False) or {}
        pid = info.get("pid")
        if info.get("host") == socket.gethostname() and isinstance(pid, int) and not _alive(pid):
            Path(info["path"]).unlink(missing_ok=True)
            self._locks.pop(key, None)
            return False
        return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _retry_transient(task: Task, task_run: Any, state: Any) -> bool:
    try:
        state.result()
    except Exception as exc:
        return is_transient(exc)
    return False


def _run(stage: str):
    def run_stage(run_dir: str, round_index: int, job: JobConfig) -> dict[str, Any]:
        return STAGE_MODULES[stage].run(run_dir, round_index, job).model_dump(mode="json")

    run_stage.__name__ = stage.replace("-", "_")
    return run_stage


STAGE_TASKS: dict[str, Task] = {
    name: task(
        _run(name),
        name=name,
        task_run_name=f"{name}-r{{round_index}}",
        persist_result=True,
        result_serializer="json",
        retries=3 if name in RETRYING_STAGES else 0,
        retry_delay_seconds=[1, 4, 16] if name in RETRYING_STAGES else 0,
        retry_jitter_factor=0.2 if name in RETRYING_STAGES else None,
        retry_condition_fn=_retry_transient if name in RETRYING_STAGES else None,
    )
    for name in STAGE_MODULES
}


def on_disk_valid(stage: str, run_dir: str, round_index: int, job: JobConfig) -> bool:
    """The stage's manifest exists, was made from the current inputs, config and code, and its outputs
    are intact. Anything else means the stage must run again (its cache entry is refreshed)."""
    paths = RunPaths(run_dir)
    manifest = read_manifest(paths, round_index, stage)
    if manifest is None or not outputs_intact(paths, manifest):
        return False
    try:
        files = STAGE_MODULES[stage].input_files(paths, round_index, job)
    except Exception:
        return False
    current = {paths.rel(f): hash_path(f) for f in files}
    return (manifest.inputs == current and manifest.config_hash == stage_config_hash(job)
            and manifest.code_version == code_version())


def stage_task(stage: str, run_dir: str, *, force: bool = False) -> Task:
    """The stage's task bound to this run's cache folders; refreshed when forced or stale on disk."""
    cache = Path(run_dir) / ".prefect"
    policy = StageInputs().configure(
        key_storage=cache / "keys",
        isolation_level="SERIALIZABLE",
        lock_manager=RunFolderLockManager(lock_files_directory=cache / "locks"),
    )
    return STAGE_TASKS[stage].with_options(cache_policy=policy, result_storage=cache / "results",
                                           refresh_cache=force)
