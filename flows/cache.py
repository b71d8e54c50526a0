"""Prefect tasks for the stages, and the one cache record of every stage run
(docs/design/architecture.md#caching-and-resume).

One key per stage run (:func:`stage_key`): the stage name, the round, the stage config hash, the code
version, the run id (the UUID in run.json, never a path), the task's fingerprint and the **content hashes**
of the stage's input files (each stage module declares them in ``input_files``). The key is stored in the
stage's manifest, and the manifest is the record: a stage is valid when its manifest's key is the current
key and its outputs are intact.

Prefect's cache follows that record, never the other way round. Its files live in the run folder, under
``.prefect/`` (``results/<key>``: the manifest as JSON; ``locks/<key>.lock``). Before a valid stage is
called, its Prefect result is made equal to the manifest (rewritten when missing, empty, truncated, or
different), and the call takes no lock, so no lock file of any kind can block or fail it: it comes back
Cached. A stage that is not valid runs with its cache refreshed, under Prefect's file lock with a hold
timeout (Prefect's own transactions take locks that never expire). Before it runs, a stale lock on its key
is removed: unreadable (empty, truncated), without an expiry, expired, or taken by a process that is gone
(every holder records its host and pid before it takes a lock); a live holder is waited for, briefly.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect import Task, task
from prefect.cache_policies import CachePolicy
from prefect.context import TaskRunContext
from prefect.filesystems import LocalFileSystem
from prefect.locking.filesystem import FileSystemLockManager
from prefect.results import ResultStore
from prefect.serializers import JSONSerializer
from prefect.states import State
from prefect.utilities.hashing import hash_objects

from flows.code_version import code_version
from flows.ray_runner import run_shards, sharded
from flows.retry import retry_options
from pbrl.config import JobConfig, stage_config_hash
from pbrl.data.folders import make_folder, run_folder_gone
from pbrl.data.storage import (
    RunPaths,
    StageManifest,
    hash_path,
    outputs_intact,
    read_manifest,
    read_run_id,
    write_json,
    write_manifest,
)
from pbrl.distributed.shards import ShardSet
from pbrl.errors import ArtifactError, ConfigError
from pbrl.models import thread_placement
from pbrl.run.task import resolve_task, task_fingerprint
from stages import STAGE_MODULES

log = logging.getLogger("pbrl.flows")

# A lock's life. A holder that died on this host is known at once by its pid; this bounds the rest (a
# holder on another host sharing the folder). A stage that outlives its lock still finishes and is kept.
LOCK_HOLD_SECONDS = 6 * 3600.0
LOCK_WAIT_SECONDS = 30.0  # how long a stage that must run waits for another process's lock on the same key


# ---------------------------------------------------------------------------------------------- the key
def stage_key(stage: str, run_dir: str | Path, round_index: int, job: JobConfig) -> str:
    """The content key of one stage run (a hex string). Nothing in it names a path of the run folder.

    Raises:
        ArtifactError: run.json has no run id, or an input file is missing.
        ConfigError: the run's task cannot be resolved.
    """
    paths = RunPaths(run_dir)
    files = STAGE_MODULES[stage].input_files(paths, round_index, job)
    return hash_objects(
        stage,
        round_index,
        stage_config_hash(job),
        code_version(),
        read_run_id(paths),
        task_fingerprint(resolve_task(job, paths.root)),
        {paths.input_name(f): hash_path(f) for f in files},
        raise_on_failure=True,
    )


def valid_record(stage: str, run_dir: str | Path, round_index: int, key: str | None) -> StageManifest | None:
    """The stage's manifest when it is the record of a run under ``key`` and its outputs are intact;
    None when the stage must run (no manifest, a malformed one, another key, a missing or changed output)."""
    if key is None:
        return None
    paths = RunPaths(run_dir)
    try:
        manifest = read_manifest(paths, round_index, stage)
    except ArtifactError:
        return None
    if manifest is None or manifest.cache_key != key or not outputs_intact(paths, manifest):
        return None
    return manifest


def run_recorded(
    stage: str,
    run_dir: str | Path,
    round_index: int,
    job: JobConfig,
    cache_key: str | None = None,
    shards: ShardSet | None = None,
) -> StageManifest:
    """Run the stage's plain function and record its run in its manifest: the code version and the cache
    key (computed from the inputs before the stage runs, when not given). The Prefect task and a run
    without Prefect both go through here, so either leaves a record a resume accepts. With ``shards``
    (``runner: ray``) the stage gathers the rows its shards wrote instead of computing them."""
    if cache_key is None:
        cache_key = _key_or_none(stage, run_dir, round_index, job)
    module = STAGE_MODULES[stage]
    try:
        with thread_placement.pinning():  # torch's threads a CPU each while they use every CPU owned, in the stage
            manifest = (
                module.run(run_dir, round_index, job)
                if shards is None
                else module.run(run_dir, round_index, job, shards=shards)
            )
    except Exception as exc:
        if (gone := run_folder_gone(run_dir)) is not None:  # the folder moved under the stage: say so, not what broke
            raise gone from exc
        raise
    return write_manifest(
        RunPaths(run_dir), manifest.model_copy(update={"code_version": code_version(), "cache_key": cache_key or ""})
    )


def _key_or_none(stage: str, run_dir: str | Path, round_index: int, job: JobConfig) -> str | None:
    # An input that does not exist yet (or a task that does not resolve) has no key: the stage then runs
    # uncached and reports the problem itself, with the file or field named.
    try:
        return stage_key(stage, run_dir, round_index, job)
    except (ArtifactError, ConfigError, OSError) as exc:
        log.info("%s round %d: no cache key (%s); running uncached", stage, round_index, exc)
        return None


# ---------------------------------------------------------------------------------------------- Prefect
@dataclass
class GivenKey(CachePolicy):
    """Cache policy whose key is the task's ``cache_key`` argument (:func:`stage_key`, computed once by the
    flow); None runs the task uncached."""

    def compute_key(
        self, task_ctx: TaskRunContext, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs: Any
    ) -> str | None:
        return inputs.get("cache_key")


class ExpiringFileLocks(FileSystemLockManager):
    """Prefect's file lock manager with Prefect's own lock settings filled in: every lock gets a hold timeout
    (it expires) and a wait for one is bounded (Prefect's transactions pass neither, so their locks never
    expire). Before a holder takes a lock, its host and process id are written to ``<holder>.owner``
    beside the locks, so a lock whose process is gone is known for stale (:func:`settle_lock`)."""

    def __init__(self, lock_files_directory: Path, *, hold_timeout: float, acquire_timeout: float) -> None:
        super().__init__(lock_files_directory)
        self.hold_timeout, self.acquire_timeout = hold_timeout, acquire_timeout

    def acquire_lock(
        self, key: str, holder: str, acquire_timeout: float | None = None, hold_timeout: float | None = None
    ) -> bool:
        write_owner(self.lock_files_directory, holder)
        return super().acquire_lock(
            key,
            holder,
            acquire_timeout if acquire_timeout is not None else self.acquire_timeout,
            hold_timeout or self.hold_timeout,
        )

    async def aacquire_lock(
        self, key: str, holder: str, acquire_timeout: float | None = None, hold_timeout: float | None = None
    ) -> bool:
        write_owner(self.lock_files_directory, holder)
        return await super().aacquire_lock(
            key,
            holder,
            acquire_timeout if acquire_timeout is not None else self.acquire_timeout,
            hold_timeout or self.hold_timeout,
        )

    def release_lock(self, key: str, holder: str) -> None:
        """Release ``holder``'s lock. A lock that expired while its stage still ran is already free (or
        another holder's now): nothing to release, and the stage that finished is not failed for it."""
        if self.is_lock_holder(key, holder):
            super().release_lock(key, holder)
        else:
            log.warning("lock %s.lock of %s expired before its stage finished", key, holder)
        (self.lock_files_directory / f"{holder}.owner").unlink(missing_ok=True)


def write_owner(lock_dir: Path, holder: str) -> None:
    """Record this process as ``holder`` (``{"host", "pid"}`` in ``<lock_dir>/<holder>.owner``)."""
    make_folder(lock_dir)  # not under a run folder that moved away (pbrl.data.storage.working_in)
    write_json(lock_dir / f"{holder}.owner", {"host": socket.gethostname(), "pid": os.getpid()})


def _lock_holder(lock_dir: Path, key: str) -> dict[str, Any] | None:
    """The live holder of ``key``'s lock (``{"holder", "host", "pid", "expiration"}``), or None when there is
    no lock or it is stale: unreadable (empty, truncated), without holder or expiry (Prefect's default lock,
    which never expires), expired, with no recorded owner (so not taken through :class:`ExpiringFileLocks`,
    which records it first), or owned by a process of this host that no longer exists."""
    try:
        info = json.loads((lock_dir / f"{key}.lock").read_text())
        holder, expiration = str(info["holder"]), datetime.fromisoformat(str(info["expiration"]))
        owner = json.loads((lock_dir / f"{holder}.owner").read_text())
        host, pid = str(owner["host"]), int(owner["pid"])
    except FileNotFoundError as exc:
        if not (lock_dir / f"{key}.lock").exists():
            return None
        log.warning("lock %s.lock has no recorded owner (%s): stale", key, exc)
        return {}
    except (ValueError, TypeError, KeyError) as exc:
        log.warning("lock %s.lock is unreadable (%s): stale", key, exc)
        return {}
    if expiration < datetime.now(UTC) or (host == socket.gethostname() and not _alive(pid)):
        return {}
    return {"holder": holder, "host": host, "pid": pid, "expiration": expiration.isoformat()}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def settle_lock(run_dir: str | Path, key: str, stage: str, round_index: int) -> None:
    """Before a stage runs under ``key``: remove its lock when stale (see :func:`_lock_holder`), and wait up to
    ``LOCK_WAIT_SECONDS`` for a live holder to finish.

    Raises:
        ArtifactError: another live process still runs this stage of this run (named by host and pid).
    """
    lock_dir = prefect_dir(run_dir) / "locks"
    waited = 0.0
    while (holder := _lock_holder(lock_dir, key)) is not None:
        if not holder:  # stale: nothing will ever release it
            (lock_dir / f"{key}.lock").unlink(missing_ok=True)
            return
        if waited >= LOCK_WAIT_SECONDS:
            raise ArtifactError(
                f"{stage} round {round_index} is being run by process {holder['pid']} on {holder['host']} "
                f"(lock {lock_dir / (key + '.lock')}, held until {holder['expiration']}); wait for it to "
                "finish or stop it, then resume"
            )
        time.sleep(0.2)
        waited += 0.2


def prefect_dir(run_dir: str | Path) -> Path:
    """``<run>/.prefect``: Prefect's results and locks for this run (derived data: the manifests rule)."""
    return Path(run_dir) / ".prefect"


def _result_store(run_dir: str | Path) -> ResultStore:
    # The same storage the stage tasks use (``result_storage=<run>/.prefect/results``, JSON serializer).
    storage = LocalFileSystem(basepath=str((prefect_dir(run_dir) / "results").resolve()))
    return ResultStore(result_storage=storage, serializer=JSONSerializer(), cache_result_in_memory=False)


def follow_record(run_dir: str | Path, key: str, manifest: StageManifest) -> bool:
    """Make Prefect's cached result for ``key`` equal to the manifest: rewritten when missing, unreadable
    (empty, truncated) or different. Returns whether it was rewritten."""
    store, record = _result_store(run_dir), manifest.model_dump(mode="json")
    try:
        if store.read(key).result == record:
            return False
    except Exception:  # any unreadable record is replaced: Prefect's files are derived data
        pass
    store.write(obj=record, key=key)
    return True


def _run(stage: str):
    def run_stage(
        run_dir: str, round_index: int, job: JobConfig, cache_key: str | None, shards: ShardSet | None = None
    ) -> dict[str, Any]:
        return run_recorded(stage, run_dir, round_index, job, cache_key, shards).model_dump(mode="json")

    run_stage.__name__ = stage.replace("-", "_")
    return run_stage


STAGE_TASKS: dict[str, Task] = {
    name: task(
        _run(name),
        name=name,
        task_run_name=f"{name}-r{{round_index}}",
        persist_result=True,
        result_serializer="json",
        cache_result_in_memory=False,
        **retry_options(name),
    )
    for name in STAGE_MODULES
}


def stage_task(stage: str, run_dir: str | Path, *, valid: bool) -> Task:
    """The stage's task bound to this run's Prefect folder. A valid stage reads its (just checked) cached
    result without a lock; any other runs with its cache refreshed, under an expiring lock."""
    cache = prefect_dir(run_dir)
    locks = ExpiringFileLocks(cache / "locks", hold_timeout=LOCK_HOLD_SECONDS, acquire_timeout=LOCK_WAIT_SECONDS)
    policy = GivenKey() if valid else GivenKey().configure(isolation_level="SERIALIZABLE", lock_manager=locks)
    return STAGE_TASKS[stage].with_options(
        cache_policy=policy, result_storage=cache / "results", refresh_cache=not valid
    )


def run_stage_task(stage: str, run_dir: str, round_index: int, job: JobConfig, *, force: bool = False) -> State:
    """Call the stage's task as the manifest decides: Cached when its record is valid (Prefect's cache made
    to follow it first), else run (always, when ``force``). With ``runner: ray`` an item-parallel stage that
    runs first runs its shards on Ray (:mod:`flows.ray_runner`; shards already written under the key are kept)
    and its task gathers them. Returns the task's final state."""

    key = _key_or_none(stage, run_dir, round_index, job)
    record = None if force else valid_record(stage, run_dir, round_index, key)
    shards = None
    if record is not None:
        follow_record(run_dir, key, record)  # type: ignore[arg-type]  (a valid record has a key)
    elif key is not None:
        settle_lock(run_dir, key, stage, round_index)
        if sharded(stage, job):
            shards = run_shards(stage, run_dir, round_index, job, key, refresh=force)
    call = stage_task(stage, run_dir, valid=record is not None)
    if shards is None:  # the task's parameters are those of every local run
        return call(run_dir, round_index, job, key, return_state=True)
    return call(run_dir, round_index, job, key, shards, return_state=True)
