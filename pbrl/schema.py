"""Typed Parquet schemas of a run folder (SPEC §3), declared once, and their loud readers and atomic writers."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pbrl.errors import ArtifactError
from pbrl.storage import atomic_path

_ids = pa.list_(pa.int32())
_ids_per_agent = pa.list_(pa.list_(pa.int32()))
_texts = pa.list_(pa.string())

ITEMS = pa.schema(
    [
        ("item_id", pa.string()),
        ("split", pa.string()),  # "train" | "eval"
        ("position", pa.int32()),
        ("data", pa.string()),  # the item as JSON text (items are free-form dicts)
    ]
)

CANDIDATES = pa.schema(
    [
        ("item_id", pa.string()),
        ("side", pa.string()),  # "target" | "comparator"
        ("candidate_index", pa.int32()),
        ("agent_index", pa.int32()),
        ("prompt", pa.string()),
        ("prompt_ids", _ids),
        ("completion", pa.string()),
        ("completion_ids", _ids),  # exactly as generated, EOS included when generated
        ("finish_reason", pa.string()),  # "eos" | "length" | "api" ...
        ("seed", pa.int64()),
    ]
)

SCORES = pa.schema(
    [
        ("item_id", pa.string()),
        ("side", pa.string()),
        ("candidate_index", pa.int32()),
        ("raw_reward", pa.float64()),  # null when the oracle failed for this joint response
        ("reward", pa.float64()),  # after reward_processor; null when failed
        ("failure", pa.string()),  # null when scored
    ]
)

PAIRS = pa.schema(
    [
        ("pair_id", pa.string()),
        ("round_index", pa.int32()),
        ("pair_index", pa.int32()),  # position in this round's pair list (and in iteration_<r>.json)
        ("item_id", pa.string()),
        ("winner_side", pa.string()),
        ("winner_index", pa.int32()),
        ("loser_side", pa.string()),
        ("loser_index", pa.int32()),
        ("winner_reward", pa.float64()),
        ("loser_reward", pa.float64()),
        ("winner_raw_reward", pa.float64()),
        ("loser_raw_reward", pa.float64()),
        ("candidate_reward_mean", pa.float64()),
        ("target_raw_reward", pa.float64()),  # null in base trainers
        ("comparator_raw_reward", pa.float64()),  # null in base trainers
        ("prompts", _texts),  # one per agent
        ("prompt_ids", _ids_per_agent),
        ("winner_completions", _texts),
        ("winner_ids", _ids_per_agent),
        ("loser_completions", _texts),
        ("loser_ids", _ids_per_agent),
    ]
)

SELECTED_PAIRS = pa.schema(
    [
        ("draw_order", pa.int32()),
        ("pair_id", pa.string()),
        ("source_round", pa.int32()),
        ("pair_index", pa.int32()),
    ]
)

EVAL = pa.schema(
    [
        ("item_id", pa.string()),
        ("prompts", _texts),
        ("completions", _texts),
        ("completion_ids", _ids_per_agent),
        ("finish_reasons", _texts),
        ("raw_reward", pa.float64()),
        ("reward", pa.float64()),
        ("failure", pa.string()),
    ]
)

METRICS = pa.schema(
    [
        ("round_index", pa.int32()),
        ("stage", pa.string()),
        ("metric", pa.string()),
        ("value", pa.float64()),
    ]
)


def write_table(path: Path, rows: Iterable[Mapping[str, Any]] | pa.Table, schema: pa.Schema) -> None:
    """Write rows (dicts or a Table) as Parquet with exactly ``schema``, atomically (temp file + rename).

    Raises:
        ArtifactError: a row misses a field or has a value of the wrong type (the field is named).
    """
    try:
        table = rows.cast(schema) if isinstance(rows, pa.Table) else pa.Table.from_pylist(list(rows), schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, KeyError) as exc:
        raise ArtifactError(f"{path}: rows do not match the declared schema: {exc}") from exc
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def read_table(path: Path, schema: pa.Schema) -> pa.Table:
    """Read a Parquet table and check it against ``schema``.

    Raises:
        ArtifactError: the file is missing or unreadable, a column is missing, or a column has the wrong
            type; the message names the file and the field.
    """
    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"{path}: file not found")
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for corrupt files
        raise ArtifactError(f"{path}: not a readable Parquet file ({exc})") from exc
    for field in schema:
        if field.name not in table.schema.names:
            raise ArtifactError(f"{path}: missing column {field.name!r} (expected {field.type})")
        actual = table.schema.field(field.name).type
        if actual != field.type:
            raise ArtifactError(f"{path}: column {field.name!r} has type {actual}, expected {field.type}")
    return table.select(schema.names)


def read_rows(path: Path, schema: pa.Schema) -> list[dict[str, Any]]:
    """:func:`read_table` as a list of row dicts."""
    return read_table(path, schema).to_pylist()


def read_joint_responses(path: Path, num_agents: int) -> dict[tuple[str, str, int], list[dict[str, Any]]]:
    """Candidate rows grouped into joint responses keyed (item_id, side, candidate_index), agents in order.

    Raises:
        ArtifactError: a joint response misses an agent or has a duplicate one (file and key named).
    """
    joint: dict[tuple[str, str, int], list[dict[str, Any]]] = defaultdict(list)
    for row in read_rows(path, CANDIDATES):
        joint[(row["item_id"], row["side"], row["candidate_index"])].append(row)
    for key, group in joint.items():
        group.sort(key=lambda r: r["agent_index"])
        if [r["agent_index"] for r in group] != list(range(num_agents)):
            raise ArtifactError(
                f"{path}: joint response {key} has agents {[r['agent_index'] for r in group]}, "
                f"expected 0..{num_agents - 1}"
            )
    return dict(joint)
