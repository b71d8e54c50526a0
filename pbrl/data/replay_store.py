"""The replay folder on disk: per-round pair files in the reference format and the replay index.

``<replay_dir>/iteration_<rrrr>.json`` holds round r's pairs as ``{"iteration", "num_pairs", "pairs"}``
(record keys in the order of docs/design/file-formats.md#replay-pair-files). ``index.json`` lists the rounds this run
stored, with content
hashes; it names its run by the run id (the UUID in run.json, never a path), so a folder holding another
run's files is never written into or read, while a run folder that was moved or copied still owns its own.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from pbrl.data.schema import CROSS_PAIRS, PairRow
from pbrl.data.storage import RunPaths, hash_path, read_json, read_run_id, sha256_file, write_json
from pbrl.data.tables import read_table
from pbrl.errors import ArtifactError, ConfigError, Problem

EXTRA_KEYS = ("pair_id", "item_id", "winner_side", "winner_index", "loser_side", "loser_index")
# joint_mode cross: each agent's candidate on both sides, after EXTRA_KEYS (columns of pbrl.data.schema.CROSS_PAIRS).
CROSS_KEYS = (
    "winner_candidate_sides",
    "winner_candidate_indices",
    "loser_candidate_sides",
    "loser_candidate_indices",
    "changed_agents",
)
_ROUND_FILE = re.compile(r"iteration_(\d{4})\.json")


def replay_dir(run_root: Path, configured: str | Path | None) -> Path:
    """``configured`` (a job's ``preference_replay_dir``) when set, else ``<run_root>/replay``."""
    return Path(configured) if configured else Path(run_root) / "replay"


def run_identity(paths: RunPaths) -> str:
    """Names this run in a replay index: the run id from run.json (a moved or copied folder keeps it).

    Raises:
        ArtifactError: run.json has no run id.
    """
    return read_run_id(paths)


def adopt_legacy_index(directory: Path, created_at: str, run_id: str) -> bool:
    """Rename the owner of an index written before runs had ids (owner ``<absolute folder>@<created_at>``)
    to ``run_id``, when its creation time is this run's. Returns whether the index was rewritten."""
    index = read_index(directory)
    owner = index["run"]
    if not (isinstance(owner, str) and created_at and owner.endswith(f"@{created_at}")):
        return False
    write_json(directory / "index.json", {**index, "run": run_id})
    return True


def round_file(directory: Path, round_index: int) -> Path:
    return directory / f"iteration_{round_index:04d}.json"


def read_index(directory: Path) -> dict[str, Any]:
    """The replay index, or an empty one. Malformed -> ArtifactError."""
    path = directory / "index.json"
    if not path.is_file():
        return {"run": None, "rounds": []}
    index = read_json(path)
    if not isinstance(index, dict) or not isinstance(index.get("rounds"), list):
        raise ArtifactError(f"{path}: malformed replay index (expected 'run' and a 'rounds' list)")
    return index


def check_owned(directory: Path, identity: str) -> dict[str, Any]:
    """The index of ``directory`` if this run may write there.

    Raises:
        ConfigError: the folder holds another run's index, or round files this run's index does not list.
    """
    index = read_index(directory)
    if index["run"] not in (None, identity):
        raise ConfigError(
            [
                Problem(
                    "preference_replay_dir",
                    str(directory),
                    f"holds the replay files of another run ({index['run']}); "
                    "they are never imported or overwritten: choose an empty folder",
                )
            ]
        )
    listed = {e["file"] for e in index["rounds"]}
    foreign = sorted(p.name for p in directory.glob("iteration_*.json") if p.name not in listed)
    if foreign:
        raise ConfigError(
            [
                Problem(
                    "preference_replay_dir",
                    str(directory),
                    f"already holds round files not written by this run ({', '.join(foreign[:5])}); "
                    "refusing to overwrite them: choose an empty folder",
                )
            ]
        )
    return index


def pair_record(row: PairRow) -> dict[str, Any]:
    """A pairs.parquet row as a reference-format record (docs/design/file-formats.md#replay-pair-files keys first,
    then pbrl's extras; a cross pair's :data:`CROSS_KEYS` last, when the row has them)."""
    record = {
        "prompts": row["prompts"],
        "winner_completions": row["winner_completions"],
        "loser_completions": row["loser_completions"],
        "winner_reward": row["winner_reward"],
        "loser_reward": row["loser_reward"],
        "candidate_reward_mean": row["candidate_reward_mean"],
        "raw_rewards": [row["winner_raw_reward"], row["loser_raw_reward"]],
        "target_raw_reward": row["target_raw_reward"],
        "comparator_raw_reward": row["comparator_raw_reward"],
    }
    record.update({k: row[k] for k in EXTRA_KEYS})
    record.update({k: row[k] for k in CROSS_KEYS if k in row})  # type: ignore[literal-required]
    return record


def _with_cross_columns(rows: list[PairRow], pairs_file: Path) -> list[PairRow]:
    """``rows`` (read as PAIRS) with the :data:`CROSS_KEYS` columns of a cross pairs file added; others as they are."""
    if CROSS_KEYS[-1] not in pq.read_schema(pairs_file).names:
        return rows
    extra = read_table(pairs_file, CROSS_PAIRS).select(list(CROSS_KEYS)).to_pylist()
    if len(extra) != len(rows):
        raise ArtifactError(f"{pairs_file}: {len(extra)} rows, but {len(rows)} pairs were given")
    return [{**row, **more} for row, more in zip(rows, extra, strict=True)]  # type: ignore[typeddict-item]


def store_round(
    directory: Path, identity: str, round_index: int, rows: list[PairRow], pairs_file: Path, run_paths: RunPaths
) -> tuple[Path, list[str]]:
    """Write round ``round_index``'s pair file, then the updated index (both atomic, index last).

    Returns:
        The pair file and messages for people (e.g. a file of an earlier attempt replaced).
    """
    index = check_owned(directory, identity)
    messages = []
    path = round_file(directory, round_index)
    if path.exists():
        messages.append(f"replaced {path.name} written by an earlier attempt at round {round_index}")
    records = [pair_record(r) for r in _with_cross_columns(rows, pairs_file)]
    write_json(path, {"iteration": round_index, "num_pairs": len(rows), "pairs": records})
    entries = [e for e in index["rounds"] if e["round"] != round_index]
    entries.append(
        {
            "round": round_index,
            "file": path.name,
            "sha256": sha256_file(path),
            "num_pairs": len(rows),
            "pairs_file": run_paths.rel(pairs_file),
            "pairs_sha256": hash_path(pairs_file),
        }
    )
    entries.sort(key=lambda e: e["round"])
    write_json(directory / "index.json", {"run": identity, "rounds": entries})
    return path, messages


def stored_rounds(directory: Path, identity: str, up_to: int) -> list[dict[str, Any]]:
    """Index entries of rounds <= ``up_to`` (later rounds on disk belong to a superseded attempt).

    Raises:
        ArtifactError: the index names another run, or a listed round's pairs file changed since stored.
    """
    index = read_index(directory)
    if index["run"] not in (None, identity):
        raise ArtifactError(f"{directory / 'index.json'}: belongs to another run ({index['run']})")
    return [e for e in index["rounds"] if e["round"] <= up_to]
