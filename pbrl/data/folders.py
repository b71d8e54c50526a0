"""Folders of a run as this process writes them: a run folder that went away while a stage worked in it (moved or
deleted) is never created again under its old name, and what pbrl writes gets the modes of the process's umask, not
a temporary file's private ones (issue #53)."""

from __future__ import annotations

import os
from pathlib import Path

from pbrl.errors import ArtifactError

# Run folders a stage of this process works in (resolved): a write under one that has gone (moved or deleted while
# the stage ran) must not create its folders again under the old name (issue #53.5: a phantom run folder).
_RUN_ROOTS: set[Path] = set()


def working_in(run_dir: str | Path) -> None:
    """Declare that this process writes into the run folder ``run_dir`` (a stage starts); from then on a write
    under it fails, naming the folder, once the folder has no run.json (it was moved or deleted)."""
    _RUN_ROOTS.add(Path(run_dir).resolve())


def make_folder(folder: Path) -> None:
    """Create ``folder`` (and its parents) when missing, unless it lies in a run folder that has gone.

    Raises:
        ArtifactError: the run folder that holds ``folder`` was moved or deleted while this process wrote into it.
    """
    resolved = Path(folder).resolve()
    for root in _RUN_ROOTS:
        if resolved.is_relative_to(root) and (gone := run_folder_gone(root)) is not None:
            raise gone
    Path(folder).mkdir(parents=True, exist_ok=True)


def run_folder_gone(run_dir: str | Path) -> ArtifactError | None:
    """The error to raise when the run folder ``run_dir`` has no run.json any more (moved or deleted while a stage
    worked in it: whatever failed then failed because of that), else None."""
    root = Path(run_dir)
    if (root / "run.json").is_file():
        return None
    return ArtifactError(
        f"{root}: the run folder is gone (moved or deleted while a stage worked in it); nothing more was written "
        "there. Resume the run where it is now (pbrl train --resume --run <its new folder>)"
    )


def _process_umask() -> int:
    """The process's umask, read without changing it where Linux shows it (``/proc/self/status``); elsewhere set
    and restored once, at import (before any thread of pbrl's runs)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# Temporary files and folders are made private (0600 / 0700); what they become gets the modes any other file of the
# process gets (0644 / 0755 under the usual umask), so that no file differs from its neighbours (issue #53.6).
FILE_MODE = 0o666 & ~_process_umask()
FOLDER_MODE = 0o777 & ~_process_umask()


def usual_modes(path: Path) -> None:
    """Give ``path`` (a file, or a folder and everything in it) the modes the process's umask gives new files."""
    path = Path(path)
    if path.is_dir():
        os.chmod(path, FOLDER_MODE)
        for inner in path.rglob("*"):
            os.chmod(inner, FOLDER_MODE if inner.is_dir() else FILE_MODE)
    else:
        os.chmod(path, FILE_MODE)
