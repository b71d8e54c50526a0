"""The loud readers and atomic writers of the Parquet tables of a run folder
(docs/design/file-formats.md#parquet-tables), whose schemas and row records are declared once in
:mod:`pbrl.data.schema`: a table is written with exactly its schema and read back checked against it, the file
and the field named when they differ. Also the readers that join tables: joint responses from candidate rows, a
replay selection's pairs, and a cross pairs file's token ids from its candidates file.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pbrl.data.schema import (
    CANDIDATES,
    CROSS_CANDIDATES_KEY,
    CROSS_PAIRS,
    ITEMS_SOURCES_KEY,
    PAIRS,
    SELECTED_PAIRS,
    PairRow,
)
from pbrl.data.storage import atomic_path, sha256_file
from pbrl.errors import ArtifactError


def _schema_metadata(path: Path) -> dict[bytes, bytes]:
    """The key-value metadata of a Parquet file's schema (empty when it has none).

    Raises:
        ArtifactError: the file is missing or unreadable (named).
    """
    try:
        return pq.read_schema(path).metadata or {}
    except Exception as exc:  # pyarrow raises several types for missing and corrupt files
        raise ArtifactError(f"{path}: not a readable Parquet file ({exc})") from exc


def read_items_sources(path: Path) -> dict[str, Any]:
    """Where the items of an items.parquet came from: ``{split: {"source", "fingerprint", "num_items"}}``.

    Raises:
        ArtifactError: the file is missing or unreadable, or has no (valid) sources metadata (written by a
            pbrl that did not record them); the file is named.
    """
    path = Path(path)
    metadata = _schema_metadata(path)
    if ITEMS_SOURCES_KEY not in metadata:
        raise ArtifactError(
            f"{path}: no {ITEMS_SOURCES_KEY.decode()} metadata (items stored before their sources were recorded)"
        )
    try:
        return json.loads(metadata[ITEMS_SOURCES_KEY])
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{path}: malformed {ITEMS_SOURCES_KEY.decode()} metadata ({exc})") from exc


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


def read_selected_pairs(selected: Path, pairs_file: Callable[[int], Path]) -> list[PairRow]:
    """The pairs of a replay selection (``selected_pairs.parquet``) in draw order, read from their stored
    round files (``pairs_file(source_round)``), token ids as stored (never re-tokenized).

    Raises:
        ArtifactError: a selected pair is not at its recorded place in its round's pairs file.
    """
    selection = read_rows(selected, SELECTED_PAIRS)
    by_round = {r: read_pairs(pairs_file(r)) for r in sorted({s["source_round"] for s in selection})}
    out = []
    for s in selection:
        rows = by_round[s["source_round"]]
        if not 0 <= s["pair_index"] < len(rows) or rows[s["pair_index"]]["pair_id"] != s["pair_id"]:
            raise ArtifactError(f"{selected}: pair {s['pair_id']} not found in {pairs_file(s['source_round'])}")
        out.append(rows[s["pair_index"]])
    return out


def cross_pairs_schema(candidates: Path) -> pa.Schema:
    """:data:`CROSS_PAIRS` naming ``candidates`` (the round's candidates.parquet, beside the pairs file) and its
    content hash in the schema metadata, for :func:`read_pairs`."""
    ref = {"file": Path(candidates).name, "sha256": sha256_file(candidates)}
    return CROSS_PAIRS.with_metadata({CROSS_CANDIDATES_KEY: json.dumps(ref, sort_keys=True)})


def read_pairs(path: Path) -> list[PairRow]:
    """The rows of a pairs.parquet with every token id: as stored (``joint_mode: aligned``), or, for a cross
    pairs file (:data:`CROSS_PAIRS`, whose rows keep their extra columns), ``prompt_ids``, ``winner_ids`` and
    ``loser_ids`` taken from the candidate rows each agent's candidate names (the prompt ids are the
    target-side joint response's, as in aligned pairs).

    Raises:
        ArtifactError: the pairs file is unreadable; the candidates file it names is missing or changed since
            the pairs were built (its hash differs); or a named candidate row is missing (file and key named).
    """
    path = Path(path)
    metadata = _schema_metadata(path)
    if CROSS_CANDIDATES_KEY not in metadata:
        return read_rows(path, PAIRS)  # type: ignore[return-value]
    ref = json.loads(metadata[CROSS_CANDIDATES_KEY])
    candidates = path.parent / ref["file"]
    if not candidates.is_file() or sha256_file(candidates) != ref["sha256"]:
        raise ArtifactError(
            f"{path}: its token ids are the rows of {candidates}, which is missing or changed since the pairs were "
            "built; run build-pairs again"
        )
    rows: dict[tuple[str, str, int, int], dict[str, Any]] = {
        (r["item_id"], r["side"], r["candidate_index"], r["agent_index"]): r for r in read_rows(candidates, CANDIDATES)
    }

    def ids(item: str, sides: list[str], indices: list[int], column: str) -> list[list[int]]:
        out = []
        for agent, (side, index) in enumerate(zip(sides, indices, strict=True)):
            row = rows.get((item, side, index, agent))
            if row is None:
                raise ArtifactError(
                    f"{path}: item {item!r} agent {agent} {side} candidate {index} is not in {candidates}"
                )
            out.append(row[column])
        return out

    out = []
    for p in read_rows(path, CROSS_PAIRS):
        w = (p["winner_candidate_sides"], p["winner_candidate_indices"])
        lo = (p["loser_candidate_sides"], p["loser_candidate_indices"])
        target = w if p["winner_side"] == "target" else lo
        p["prompt_ids"] = ids(p["item_id"], *target, "prompt_ids")
        p["winner_ids"] = ids(p["item_id"], *w, "completion_ids")
        p["loser_ids"] = ids(p["item_id"], *lo, "completion_ids")
        out.append(p)
    return out  # type: ignore[return-value]
