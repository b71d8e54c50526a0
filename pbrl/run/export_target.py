"""Where ``pbrl export`` writes (:func:`pbrl.run.export.export_agents`): the target folder checked before anything is
loaded, and an earlier export replaced without touching what pbrl did not write there.

An export records every file it wrote in ``pbrl-export.json`` (``files``). A later export into the same folder
replaces exactly those (the ``agent_<i>/`` folders and the record); whatever else the folder holds (a ``.git``
folder, notes) stays. A file the user added *inside* an ``agent_<i>/`` folder would go with that folder: such an
export is refused, naming the files. The agent folders are replaced one by one, each by a rename, and the record is
renamed into place last, so an interrupted export leaves the earlier record, which names every folder it may find.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pbrl.data.folders import usual_modes
from pbrl.errors import ConfigError, Problem

EXPORT_FILE = "pbrl-export.json"  # in an export folder: what was exported (and that the folder is an export)
_TMP, _OLD = ".tmp-export-", ".old-export-"


def _refuse(out: Path, why: str) -> ConfigError:
    return ConfigError([Problem("out", str(out), why)])


def export_target(out: Path, run_dir: Path) -> dict[str, Any] | None:
    """Check the folder ``out`` an export of the run in ``run_dir`` goes to; return the record of the earlier export
    it holds (None: ``out`` is new or empty).

    Raises:
        ConfigError: naming ``out``: it is a file or lies under one, it is the run folder or inside it (or holds it),
            it is a non-empty folder that is not an earlier export, its record is damaged, or an ``agent_<i>/`` of
            the earlier export holds files pbrl did not write (named).
    """
    for part in (out, *out.parents):
        if part.exists() and not part.is_dir():
            raise _refuse(out, f"{part} is a file; give a folder")
    resolved, run = out.resolve(), run_dir.resolve()
    if resolved == run or resolved.is_relative_to(run) or run.is_relative_to(resolved):
        raise _refuse(out, f"is the run folder {run_dir}, inside it or around it; export outside the run folder")
    if not out.is_dir() or not any(out.iterdir()):
        return None
    record_file = out / EXPORT_FILE
    if not record_file.is_file():
        raise _refuse(out, "exists and is not an earlier export; give a new or empty folder")
    try:
        record = json.loads(record_file.read_text())
        agents = [str(a) for a in record["agents"]]
    except (OSError, ValueError, KeyError, TypeError):
        raise _refuse(out, f"{EXPORT_FILE} is damaged: which files are pbrl's is unknown; export elsewhere") from None
    if "files" in record:  # an export before issue #53 recorded no files: its agent folders are taken whole
        ours = set(record["files"])
        foreign = sorted(
            p.relative_to(out).as_posix()
            for agent in agents
            for p in (out / agent).rglob("*")
            if p.is_file() and p.relative_to(out).as_posix() not in ours
        )
        if foreign:
            shown = ", ".join(foreign[:5]) + (" …" if len(foreign) > 5 else "")
            raise _refuse(out, f"holds files pbrl did not write inside the agent folders ({shown}); move them out")
    return record


def replace_export(out: Path, earlier: dict[str, Any], write: Callable[[Path], None]) -> None:
    """Write a new export with ``write(folder)`` beside the earlier one in ``out``, then swap the earlier export's
    entries (its ``agent_<i>/`` folders and record) for the new ones; nothing else in ``out`` is touched."""
    for leftover in [*out.glob(f"{_TMP}*"), *out.glob(f"{_OLD}*")]:  # an interrupted export's, never the user's
        shutil.rmtree(leftover, ignore_errors=True)
    new = Path(tempfile.mkdtemp(prefix=_TMP, dir=out))
    old = Path(tempfile.mkdtemp(prefix=_OLD, dir=out))
    try:
        write(new)
        usual_modes(new)
        entries = sorted({str(a) for a in earlier["agents"]} | {p.name for p in new.iterdir()} - {EXPORT_FILE})
        for name in entries:
            if (out / name).exists():
                os.replace(out / name, old / name)
            if (new / name).exists():
                os.replace(new / name, out / name)
        os.replace(new / EXPORT_FILE, out / EXPORT_FILE)  # last: the record of what the folder holds now
    finally:
        shutil.rmtree(new, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
