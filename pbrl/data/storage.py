"""Run folders (docs/design/file-formats.md#the-run-folder): the layout, atomic writes, content hashes and stage
manifests written last."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pbrl.config import is_iterative
from pbrl.data.folders import FILE_MODE, make_folder, usual_modes
from pbrl.errors import ArtifactError, ConfigError

# The names of the stage manifests a round folder can hold (``rounds/<rrrr>/<stage>.manifest.json``), in pipeline
# order: part of the run folder's format (docs/design/file-formats.md#stage-manifests), so that the readers below
# the stages (metrics.parquet, pbrl status's damage check, the CLI) walk a round's manifests without importing
# ``stages`` (a layer above this one, which loads torch). ``stages.STAGE_MODULES`` lists the same names in the same
# order (tests/test_storage.py checks it); which of them a run's round calls: pbrl.run.stage_plan.trainer_stages.
STAGES = (
    "sample-candidates",
    "score-with-oracle",
    "judge-pairs",
    "build-pairs",
    "store-round",
    "replay-select",
    "fit-reward-model",
    "update-policies",
    "evaluate",
)


# ---------------------------------------------------------------------------------------------- atomic I/O
@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary file path beside ``path``; on success it is fsynced and renamed onto ``path``.

    A process killed at any moment leaves either the old file or the new one, never a partial file under
    the final name (the temporary name starts with ``.tmp-`` and is never read).
    """
    path = Path(path)
    make_folder(path.parent)
    with _disk_full_named(path):
        fd, tmp_name = tempfile.mkstemp(prefix=f".tmp-{path.name}.", dir=path.parent)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            yield tmp
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.chmod(tmp, FILE_MODE)  # mkstemp made it 0600
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_dir(path: Path) -> Iterator[Path]:
    """Yield a temporary folder beside ``path``; on success it replaces ``path`` (old contents removed)."""
    path = Path(path)
    make_folder(path.parent)
    with _disk_full_named(path):
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{path.name}.", dir=path.parent))
        try:
            yield tmp
            usual_modes(tmp)  # mkdtemp made it 0700; what was written in it keeps no private mode either
            replace_dir(tmp, path)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)


# Below this many free bytes a failed write is taken for a full disk, whatever the writer's own message says
# (pyarrow reports a short write as "unexpected pos 4928 vs 4820", torch and safetensors in their own words).
FULL_DISK_BYTES = 1 << 20


@contextlib.contextmanager
def _disk_full_named(path: Path) -> Iterator[None]:
    """Turn a write that failed on a full disk (ENOSPC or EDQUOT anywhere in the exception chain, or any error
    while less than :data:`FULL_DISK_BYTES` are free) into one :class:`ArtifactError` naming the file and the free
    space. Whatever was stored before stays as it was: the writers write a temporary name first."""
    try:
        yield
    except ArtifactError:
        raise
    except Exception as exc:
        free = _free_bytes(path.parent)
        full = any(getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) for e in _chain(exc))
        if full or (free is not None and free < FULL_DISK_BYTES):
            where = f"{free / 2**20:.1f} MiB free" if free is not None else "free space unknown"
            raise ArtifactError(
                f"{path}: no space left on device ({where} in {path.parent}); free some space "
                "or point output_dir elsewhere, then resume (what was stored before is intact)"
            ) from exc
        raise


def _free_bytes(folder: Path) -> int | None:
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def replace_dir(tmp: Path, dest: Path) -> None:
    """Rename folder ``tmp`` onto ``dest``; an existing ``dest`` is first moved aside, then deleted."""
    if dest.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".old-{dest.name}.", dir=dest.parent))
        os.replace(dest, trash / "old")
        os.replace(tmp, dest)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, dest)


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically (indent 2, keys in insertion order)."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False, allow_nan=False) + "\n")


def read_json(path: Path) -> Any:
    """Read JSON. Raises ArtifactError naming the file when it is missing or malformed."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ArtifactError(f"{path}: file not found") from exc
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{path}: malformed JSON ({exc})") from exc


# ---------------------------------------------------------------------------------------------- hashing
_HASH_MEMO: dict[tuple[str, int, int, int], str] = {}


def sha256_file(path: Path) -> str:
    """SHA-256 hex digest of a file's content (memoised on path, inode, size and mtime within a process)."""
    st = os.stat(path)
    key = (str(Path(path).resolve()), st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _HASH_MEMO:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        _HASH_MEMO[key] = h.hexdigest()
    return _HASH_MEMO[key]


def hash_path(path: Path) -> str:
    """Content hash of a file, or of a folder (its files' relative paths and contents, temp files skipped).

    Raises:
        ArtifactError: the path does not exist.
    """
    path = Path(path)
    if path.is_file():
        return sha256_file(path)
    if not path.is_dir():
        raise ArtifactError(f"{path}: not found")
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".tmp-")):
        h.update(f.relative_to(path).as_posix().encode() + b"\0" + sha256_file(f).encode() + b"\n")
    return h.hexdigest()


def remove_stale_temporaries(paths: RunPaths) -> list[str]:
    """Delete the ``.tmp-*`` files and folders (and ``.old-*`` folders of :func:`replace_dir`) anywhere in the
    run folder: a process killed between creating one and its rename leaves it behind, and nothing reads it.

    Call only when the run is reopened (no other process writes into it then).

    Returns:
        The run-relative paths removed, sorted.
    """
    removed = []
    for dirpath, dirnames, filenames in os.walk(paths.root):
        base = Path(dirpath)
        for name in [d for d in dirnames if d.startswith((".tmp-", ".old-"))]:
            shutil.rmtree(base / name, ignore_errors=True)
            dirnames.remove(name)  # not walked into: it is gone
            removed.append((base / name).relative_to(paths.root).as_posix())
        for name in filenames:
            if name.startswith(".tmp-"):
                (base / name).unlink(missing_ok=True)
                removed.append((base / name).relative_to(paths.root).as_posix())
    return sorted(removed)


# ---------------------------------------------------------------------------------------------- layout
class RunPaths:
    """The fixed layout of one run folder (docs/design/file-formats.md#the-run-folder). Paths only; nothing is read or
    created."""

    def __init__(self, run_dir: str | Path):
        self.root = Path(run_dir)

    run_json = property(lambda self: self.root / "run.json")
    items = property(lambda self: self.root / "items.parquet")
    metrics = property(lambda self: self.root / "metrics.parquet")
    checkpoints = property(lambda self: self.root / "checkpoints")
    initial = property(lambda self: self.root / "checkpoints" / "initial")

    def round_dir(self, round_index: int) -> Path:
        return self.root / "rounds" / f"{round_index:04d}"

    def candidates(self, r: int) -> Path:
        return self.round_dir(r) / "candidates.parquet"

    def scores(self, r: int) -> Path:
        return self.round_dir(r) / "scores.parquet"

    def verdicts(self, r: int) -> Path:
        return self.round_dir(r) / "verdicts.parquet"

    def pairs(self, r: int) -> Path:
        return self.round_dir(r) / "pairs.parquet"

    def selected_pairs(self, r: int) -> Path:
        return self.round_dir(r) / "selected_pairs.parquet"

    def eval(self, r: int) -> Path:
        return self.round_dir(r) / "eval.parquet"

    def manifest(self, r: int, stage: str) -> Path:
        return self.round_dir(r) / f"{stage}.manifest.json"

    def round_checkpoint(self, r: int) -> Path:
        return self.checkpoints / f"round_{r:04d}"

    def rel(self, path: Path) -> str:
        """A path relative to the run folder (manifests never store absolute path text)."""
        return Path(path).resolve().relative_to(self.root.resolve()).as_posix()

    def input_name(self, path: Path) -> str:
        """How a stage's input file is named in its manifest and cache key: its path in the run folder, or for a file
        outside it (a user's file, such as ``judge_prompt_template``) ``outside:<file name>``, so that neither names
        a place on this machine."""
        try:
            return self.rel(path)
        except ValueError:
            return f"outside:{Path(path).name}"


def read_run_id(paths: RunPaths) -> str:
    """The run's identity: the UUID in run.json (docs/design/file-formats.md#the-run-folder). A folder moved or copied
    keeps it; no path is
    part of it.

    Raises:
        ArtifactError: run.json is missing or malformed, or has no ``run_id`` (a resume writes one).
    """
    run_id = read_json(paths.run_json).get("run_id")
    if not isinstance(run_id, str) or not run_id:
        raise ArtifactError(f"{paths.run_json}: no run_id (resume the run once to give it one)")
    return run_id


# ---------------------------------------------------------------------------------------------- manifests
class StageManifest(BaseModel):
    """What a stage did: written last, so a stage folder without its manifest is incomplete."""

    model_config = ConfigDict(extra="forbid")

    stage: str
    round_index: int
    config_hash: str
    code_version: str = Field("", description="pbrl version + hash of the sources that stages run")
    cache_key: str = Field("", description="the stage run's cache key (flows/cache.py); empty: never valid")
    inputs: dict[str, str] = Field(default_factory=dict, description="run-relative path -> content hash")
    outputs: dict[str, str] = Field(default_factory=dict, description="run-relative path -> content hash")
    counts: dict[str, int] = Field(default_factory=dict)
    metrics: dict[str, float] = Field(default_factory=dict)
    details: dict[str, Any] = Field(default_factory=dict)
    messages: list[str] = Field(default_factory=list)
    seconds: float = 0.0
    finished_at: str = ""


def hash_files(paths: RunPaths, files: list[Path]) -> dict[str, str]:
    """``{run-relative path: content hash}`` for files or folders (:meth:`RunPaths.input_name`)."""
    return {paths.input_name(f): hash_path(f) for f in files}


def write_manifest(paths: RunPaths, manifest: StageManifest) -> StageManifest:
    """Write a stage manifest atomically, last. Returns it with ``finished_at`` set."""
    manifest = manifest.model_copy(update={"finished_at": datetime.now(UTC).isoformat(timespec="seconds")})
    write_json(paths.manifest(manifest.round_index, manifest.stage), manifest.model_dump(mode="json"))
    return manifest


def read_manifest(paths: RunPaths, round_index: int, stage: str) -> StageManifest | None:
    """The stage's manifest, or None when the stage has not completed. Malformed -> ArtifactError."""
    path = paths.manifest(round_index, stage)
    if not path.is_file():
        return None
    try:
        return StageManifest.model_validate(read_json(path))
    except ValueError as exc:
        raise ArtifactError(f"{path}: malformed manifest ({exc})") from exc


def outputs_intact(paths: RunPaths, manifest: StageManifest) -> bool:
    """True when every output listed in the manifest exists with the recorded content hash."""
    for rel, digest in manifest.outputs.items():
        p = paths.root / rel
        if not p.exists() or hash_path(p) != digest:
            return False
    return True


def record_state(run_dir: str | Path, round_index: int, stage: str, state: str, message: str | None) -> None:
    """Remember how a stage's last run ended (Completed / Cached / Failed) for ``pbrl status``."""
    path = RunPaths(run_dir).round_dir(round_index) / ".states.json"
    states = read_json(path) if path.is_file() else {}
    states[stage] = {"state": state, "message": message, "at": datetime.now(UTC).isoformat(timespec="seconds")}
    write_json(path, states)


def read_states(run_dir: str | Path, round_index: int) -> dict[str, Any]:
    path = RunPaths(run_dir).round_dir(round_index) / ".states.json"
    return read_json(path) if path.is_file() else {}


def existing_rounds(paths: RunPaths) -> list[int]:
    """Round numbers of this run that have a folder (complete or not): ``rounds/0000`` to the run's last round
    (:func:`last_round`; every numbered folder while run.json is unreadable). Another folder there is no round of
    the run (:func:`pbrl.data.run_health.round_folders` names it)."""
    base = paths.root / "rounds"
    if not base.is_dir():
        return []
    try:
        last = last_round(paths)
    except ArtifactError:
        last = None  # every numbered folder
    found = (int(p.name) for p in base.iterdir() if p.is_dir() and re.fullmatch(r"\d{4}", p.name))
    return sorted(r for r in found if last is None or r <= last)


def last_round(paths: RunPaths) -> int | None:
    """The run's last round by its stored config (``num_iterations`` of an iterative trainer, else 1; None when
    the stored config does not say).

    Raises:
        ArtifactError: run.json is missing or malformed.
    """
    data = read_json(paths.run_json)
    config = data.get("config", {}) if isinstance(data, dict) else {}
    try:
        if not is_iterative(str(config.get("trainer", ""))):
            return 1
        return int(config["num_iterations"]) if "num_iterations" in config else None
    except (ConfigError, TypeError, ValueError):
        raise ArtifactError(f"{paths.run_json}: no valid trainer and num_iterations in its config") from None
