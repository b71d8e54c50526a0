"""Stage 4, store-round: round r's pairs become ``replay/iteration_<rrrr>.json`` and enter the replay index.

The JSON file is the reference library's pair format (readable by its users' tools); the exact token
ids stay in ``rounds/<r>/pairs.parquet``, which the index points at and replay reads.
"""

from __future__ import annotations

from pathlib import Path

from pbrl.config import JobConfig
from pbrl.data.replay_store import run_identity, store_round
from pbrl.data.schema import PAIRS
from pbrl.data.storage import RunPaths, StageManifest, sha256_file
from pbrl.data.tables import read_rows
from pbrl.run.folder import job_replay_dir
from pbrl.run.stage_record import StageRecord

NAME = "store-round"


def input_files(paths: RunPaths, round_index: int, job: JobConfig) -> list[Path]:
    return [paths.pairs(round_index)]


def run(run_dir: str | Path, round_index: int, job: JobConfig) -> StageManifest:
    record = StageRecord(NAME, run_dir, round_index, job)
    paths = record.paths
    rows = read_rows(paths.pairs(round_index), PAIRS)
    directory = job_replay_dir(paths, job)
    path, messages = store_round(directory, run_identity(paths), round_index, rows, paths.pairs(round_index), paths)
    for m in messages:
        record.say(m)
    record.counts = {"pairs": len(rows)}
    inside = _inside(paths.root, directory)
    # A replay folder inside the run is named relative to it (the run folder may move); a configured one
    # outside it is named as configured.
    record.details = {"replay_dir": paths.rel(directory) if inside else str(directory), "file": path.name}
    # The pair file is this stage's output (hashed when inside the run folder). The index is shared by
    # every round's store-round, so it is not: replay-select checks each entry against its pairs file.
    outputs = [path] if inside else []
    record.details["file_sha256"] = sha256_file(path)
    return record.finish(input_files(paths, round_index, job), outputs)


def _inside(root: Path, path: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False
