"""Shards of an item-parallel stage (docs/guides/ray.md#sharded-stages): the plan, the shard files and the gather.

A sharded stage (sample-candidates, score-with-oracle, evaluate) splits its items into contiguous shards of
``shard_size`` items. Each shard runs the stage's own per-item code over its items and writes its rows to
``rounds/<r>/shards/<stage>/<i>-of-<n>.parquet`` (the stage's table schema), then a small JSON record beside it
(last, so a record names a complete table): the stage's cache key, the shard, the table's content hash and the
shard's counts. A shard is *done* for a key when its record carries that key and its table still has the
recorded hash; a resumed stage recomputes only the shards that are not done. The gather reads the done shards
in order; the stage then writes its usual artifact from those rows. Because every row draws from its own
seed (:mod:`pbrl.data.seeds`), the gathered artifact is the unsharded one, byte for byte.

Nothing here imports Prefect or Ray: the flows map shards over a runner (``flows.ray_runner``).
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from pbrl.data.storage import RunPaths, read_json, sha256_file, write_json
from pbrl.data.tables import read_rows, write_table
from pbrl.errors import ArtifactError, ConfigError, Problem


@dataclass(frozen=True)
class RaySettings:
    """Where Ray work runs: ``address`` (``ray_address``; None = a Ray of the run's own) and ``shard_size`` (items
    per shard)."""

    address: str | None = None
    shard_size: int = 16


def require_ray_extra(runner: str) -> None:
    """Before a run with ``runner: ray`` starts: the 'ray' extra must be installed here.

    Raises:
        ConfigError: ``runner`` is 'ray' and ``ray`` or ``prefect_ray`` cannot be imported.
    """
    if runner != "ray":
        return
    missing = [m for m in ("ray", "prefect_ray") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(
            [
                Problem(
                    "runner",
                    "ray",
                    f"needs the 'ray' extra, which is not installed here (missing: "
                    f'{", ".join(missing)}); pip install -e ".[ray]" or use runner: local',
                )
            ]
        )


@dataclass(frozen=True)
class Shard:
    """Items ``[start, stop)`` of a stage's item list; shard ``index`` of ``count``."""

    index: int
    count: int
    start: int
    stop: int

    @property
    def name(self) -> str:
        """``<index>-of-<count>``, zero-padded to 4 digits (the shard's file stem)."""
        return f"{self.index:04d}-of-{self.count:04d}"


@dataclass(frozen=True)
class ShardSet:
    """The shards a stage gathers from, all written under the stage's cache ``key``."""

    key: str
    shards: tuple[Shard, ...]


def plan_shards(num_items: int, shard_size: int) -> list[Shard]:
    """Contiguous shards of ``shard_size`` items (the last one takes the rest); none for no items.

    Example: 10 items, shard_size 4 -> [0, 4), [4, 8), [8, 10).

    Raises:
        ValueError: ``shard_size`` < 1 or ``num_items`` < 0.
    """
    if shard_size < 1 or num_items < 0:
        raise ValueError(f"plan_shards: need shard_size >= 1 and num_items >= 0, got {shard_size}, {num_items}")
    starts = range(0, num_items, shard_size)
    return [Shard(i, len(starts), start, min(start + shard_size, num_items)) for i, start in enumerate(starts)]


def shard_dir(paths: RunPaths, round_index: int, stage: str) -> Path:
    """``rounds/<r>/shards/<stage>/``."""
    return paths.round_dir(round_index) / "shards" / stage


def shard_table(paths: RunPaths, round_index: int, stage: str, shard: Shard) -> Path:
    """The shard's rows: ``rounds/<r>/shards/<stage>/<i>-of-<n>.parquet``."""
    return shard_dir(paths, round_index, stage) / f"{shard.name}.parquet"


def shard_record(paths: RunPaths, round_index: int, stage: str, shard: Shard) -> Path:
    """The shard's record, written after its table: ``<i>-of-<n>.json``."""
    return shard_dir(paths, round_index, stage) / f"{shard.name}.json"


def write_shard(
    paths: RunPaths,
    round_index: int,
    stage: str,
    shard: Shard,
    key: str,
    rows: list[dict[str, Any]],
    schema: pa.Schema,
    counts: dict[str, int],
) -> Path:
    """Write the shard's table atomically, then its record (atomically, last). Returns the table path.

    Raises:
        ArtifactError: a row does not match ``schema``.
    """
    table = shard_table(paths, round_index, stage, shard)
    write_table(table, rows, schema)
    write_json(
        shard_record(paths, round_index, stage, shard),
        {
            "stage": stage,
            "round": round_index,
            "key": key,
            "shard": asdict(shard),
            "sha256": sha256_file(table),
            "rows": len(rows),
            "counts": dict(counts),
        },
    )
    return table


def shard_done(paths: RunPaths, round_index: int, stage: str, shard: Shard, key: str) -> bool:
    """Whether the shard was written under ``key`` for this same item range and its table is unchanged."""
    record, table = shard_record(paths, round_index, stage, shard), shard_table(paths, round_index, stage, shard)
    try:
        info = read_json(record)
        return (
            info.get("key") == key
            and info.get("shard") == asdict(shard)
            and table.is_file()
            and info.get("sha256") == sha256_file(table)
        )
    except (ArtifactError, OSError):
        return False


def gather_shards(
    paths: RunPaths, round_index: int, stage: str, shard_set: ShardSet, schema: pa.Schema
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The rows of every shard of ``shard_set``, in shard order, and their counts summed.

    Raises:
        ArtifactError: a shard is not done under ``key`` (named), or its table does not match ``schema``.
    """
    rows: list[dict[str, Any]] = []
    counts: Counter[str] = Counter()
    for shard in shard_set.shards:
        if not shard_done(paths, round_index, stage, shard, shard_set.key):
            raise ArtifactError(
                f"{stage} round {round_index}: shard {shard.name} "
                f"({shard_table(paths, round_index, stage, shard)}) is missing, changed or was "
                "written under another cache key; run the stage again"
            )
        rows += read_rows(shard_table(paths, round_index, stage, shard), schema)
        counts.update(read_json(shard_record(paths, round_index, stage, shard))["counts"])
    return rows, dict(counts)


def ray_init_kwargs(address: str | None) -> dict[str, Any]:
    """``ray.init`` keywords: ``address="local"`` for a Ray of its own when ``address`` (``ray_address``) is None (a
    plain ``ray.init()`` would join whatever cluster this machine last started with ``ray start``), else the
    address (``auto`` included)."""
    if address is None:
        return {"address": "local", "include_dashboard": False}
    return {"address": address}
