"""Typed Parquet schemas of a run folder (docs/design/file-formats.md#parquet-tables), declared once, and their loud
readers and atomic writers."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, TypedDict

import pyarrow as pa
import pyarrow.parquet as pq

from pbrl.data.storage import atomic_path, sha256_file
from pbrl.errors import ArtifactError

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
# ITEMS schema metadata: JSON {split: {"source": {...}, "fingerprint": "datasets:<fp>" | "sha256:<hex>",
# "num_items": int}}, where each split's items came from (pbrl.data.items.write_items).
ITEMS_SOURCES_KEY = b"pbrl.items_sources"


def items_schema(sources: Mapping[str, Any]) -> pa.Schema:
    """ITEMS carrying ``sources`` (where each split's items came from) as schema metadata."""
    return ITEMS.with_metadata({ITEMS_SOURCES_KEY: json.dumps(sources, sort_keys=True, default=str)})


def read_items_sources(path: Path) -> dict[str, Any]:
    """Where the items of an items.parquet came from: ``{split: {"source", "fingerprint", "num_items"}}``.

    Raises:
        ArtifactError: the file is missing or unreadable, or has no (valid) sources metadata (written by a
            pbrl that did not record them); the file is named.
    """
    path = Path(path)
    try:
        metadata = pq.read_schema(path).metadata or {}
    except Exception as exc:  # pyarrow raises several types for missing and corrupt files
        raise ArtifactError(f"{path}: not a readable Parquet file ({exc})") from exc
    if ITEMS_SOURCES_KEY not in metadata:
        raise ArtifactError(
            f"{path}: no {ITEMS_SOURCES_KEY.decode()} metadata (items stored before their sources were recorded)"
        )
    try:
        return json.loads(metadata[ITEMS_SOURCES_KEY])
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{path}: malformed {ITEMS_SOURCES_KEY.decode()} metadata ({exc})") from exc


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
        ("stop_token_id", pa.int32()),  # the stop id that ended an "eos" row (EOS or another stop id); else null
        ("seed", pa.int64()),  # null for API answers (no seed is sent)
        # "generated": the ids were sampled in this vocabulary; "encoded_from_text": text that entered from a
        # comparator with another tokenizer, an API or a centralized response, encoded once with the target's.
        ("ids_source", pa.string()),
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

# joint_mode: cross (docs/design/algorithms.md#cross-joint-responses-and-counterfactual-pairs): a joint response is any
# combination of the agents' candidates, so its rows name each agent's candidate. The tables keep every column of
# the aligned ones (a reader of SCORES or PAIRS reads them unchanged) and add these.
CROSS_SCORES = pa.schema(
    [
        *SCORES,  # candidate_index: the combination's number (pbrl.preference.pairs.CrossGrid)
        ("candidate_sides", _texts),  # one per agent: the side of the agent's candidate
        ("candidate_indices", pa.list_(pa.int32())),  # one per agent: the agent's candidate index
    ]
)

CROSS_PAIRS = pa.schema(
    [
        *PAIRS,  # prompt_ids, winner_ids and loser_ids are null: read_pairs fills them from the candidate rows
        ("winner_candidate_sides", _texts),
        ("winner_candidate_indices", pa.list_(pa.int32())),
        ("loser_candidate_sides", _texts),
        ("loser_candidate_indices", pa.list_(pa.int32())),
        ("changed_agents", pa.list_(pa.int32())),  # the agents whose candidates differ (one: a counterfactual pair)
    ]
)
# CROSS_PAIRS schema metadata: JSON {"file": "candidates.parquet", "sha256": <hex>}, the candidates file (beside the
# pairs file) whose rows hold the pairs' token ids, and its content hash (a changed file is refused when read, and
# the pairs file's own hash, which keys the stages that read it, changes with it).
CROSS_CANDIDATES_KEY = b"pbrl.candidates"

SELECTED_PAIRS = pa.schema(
    [
        ("draw_order", pa.int32()),
        ("pair_id", pa.string()),
        ("source_round", pa.int32()),
        ("pair_index", pa.int32()),
    ]
)

PAIR_JOINT_IDS = pa.schema(  # rounds/<r>/pair_joint_ids.parquet (MARLHF): the pairs' joint reward-model inputs
    [
        ("pair_id", pa.string()),
        ("winner_joint_ids", _ids),  # null when dropped
        ("loser_joint_ids", _ids),  # null when dropped
        ("prompt_tokens_cut", pa.int32()),  # prompt tokens cut to fit reward_max_length (winner + loser)
        ("dropped", pa.string()),  # null when kept; else the reason (pbrl.learning.joint_template.DROP_TOO_LONG)
    ]
)

ROLLOUTS = pa.schema(  # rounds/<r>/rollouts.parquet (MARLHF): one row per (step, item, generation, agent)
    [
        ("epoch", pa.int32()),
        ("step", pa.int32()),
        ("item_id", pa.string()),
        ("generation_index", pa.int32()),
        ("agent_index", pa.int32()),
        ("prompt_ids", _ids),
        ("completion_ids", _ids),  # exactly as generated, EOS included when generated
        ("completion", pa.string()),
        ("finish_reason", pa.string()),
        ("seed", pa.int64()),
        ("joint_ids", _ids),  # the reward model's input for this joint response; null when it did not fit
        ("reward", pa.float64()),  # the reward model's score of the joint response; null when not scored
        ("kl", pa.float64()),  # this agent's k3 KL to its reference, nats (0 without reference KL)
        ("advantage", pa.float64()),  # this agent's advantage; null when the item's group was left out
        ("value", pa.float64()),  # maac/iac: this agent's critic value V at rollout time; null otherwise
    ]
)

EVAL = pa.schema(
    [
        ("item_id", pa.string()),
        ("prompts", _texts),
        ("completions", _texts),
        ("completion_ids", _ids_per_agent),
        ("finish_reasons", _texts),
        ("stop_token_ids", pa.list_(pa.int32())),  # one per agent: its stop id, null where it ran to length
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


# ---------------------------------------------------------------------------------------------- typed rows
# The records that cross modules, one per table, with exactly its columns in order (tested against the schemas).
# Rows are read and written as these dicts (``pyarrow``'s ``to_pylist`` / ``from_pylist``), so a TypedDict types
# them at no cost. A task item is free-form user data: :data:`Item`.
Item = dict[str, Any]


@dataclass(frozen=True)
class CandidateRow:
    """One row of candidates.parquet (:data:`CANDIDATES`)."""

    item_id: str
    side: str  # "target" | "comparator"
    candidate_index: int
    agent_index: int
    prompt: str
    prompt_ids: list[int]
    completion: str
    completion_ids: list[int]
    finish_reason: str  # "eos" | "length" | "api"
    stop_token_id: int | None
    seed: int | None  # None for API answers (no seed is sent)
    ids_source: Literal["generated", "encoded_from_text"]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class ScoreRow(TypedDict):
    """One row of scores.parquet (:data:`SCORES`): a joint response's score, or why it has none."""

    item_id: str
    side: str
    candidate_index: int
    raw_reward: float | None
    reward: float | None
    failure: str | None


class PairRow(TypedDict):
    """One row of pairs.parquet (:data:`PAIRS`): a preference pair with every agent's exact token ids."""

    pair_id: str
    round_index: int
    pair_index: int
    item_id: str
    winner_side: str
    winner_index: int
    loser_side: str
    loser_index: int
    winner_reward: float
    loser_reward: float
    winner_raw_reward: float
    loser_raw_reward: float
    candidate_reward_mean: float
    target_raw_reward: float | None
    comparator_raw_reward: float | None
    prompts: list[str]
    prompt_ids: list[list[int]]
    winner_completions: list[str]
    winner_ids: list[list[int]]
    loser_completions: list[str]
    loser_ids: list[list[int]]


class CrossScoreRow(ScoreRow):
    """One row of a cross scores.parquet (:data:`CROSS_SCORES`): a combination of the agents' candidates."""

    candidate_sides: list[str]
    candidate_indices: list[int]


class CrossPairRow(PairRow):
    """One row of a cross pairs.parquet (:data:`CROSS_PAIRS`): each agent's candidate on both sides; the token
    id columns are None on disk and filled by :func:`read_pairs`."""

    winner_candidate_sides: list[str]
    winner_candidate_indices: list[int]
    loser_candidate_sides: list[str]
    loser_candidate_indices: list[int]
    changed_agents: list[int]


class SelectedPairRow(TypedDict):
    """One row of selected_pairs.parquet (:data:`SELECTED_PAIRS`): a replay draw."""

    draw_order: int
    pair_id: str
    source_round: int
    pair_index: int


class PairJointIdsRow(TypedDict):
    """One row of pair_joint_ids.parquet (:data:`PAIR_JOINT_IDS`): a pair's reward-model inputs."""

    pair_id: str
    winner_joint_ids: list[int] | None
    loser_joint_ids: list[int] | None
    prompt_tokens_cut: int
    dropped: str | None


class RolloutRow(TypedDict):
    """One row of rollouts.parquet (:data:`ROLLOUTS`): one agent's sample of one RL joint response."""

    epoch: int
    step: int
    item_id: str
    generation_index: int
    agent_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    completion: str
    finish_reason: str
    seed: int
    joint_ids: list[int] | None
    reward: float | None
    kl: float
    advantage: float | None
    value: float | None


class EvalRow(TypedDict):
    """One row of eval.parquet (:data:`EVAL`): one evaluation draw of every agent and its task reward."""

    item_id: str
    prompts: list[str]
    completions: list[str]
    completion_ids: list[list[int]]
    finish_reasons: list[str]
    stop_token_ids: list[int | None]
    raw_reward: float | None
    reward: float | None
    failure: str | None


class MetricRow(TypedDict):
    """One row of metrics.parquet (:data:`METRICS`)."""

    round_index: int
    stage: str
    metric: str
    value: float


# Each table's typed record (its keys are the table's columns, in order).
ROW_TYPES: dict[str, tuple[pa.Schema, type]] = {
    "candidates": (CANDIDATES, CandidateRow),
    "scores": (SCORES, ScoreRow),
    "pairs": (PAIRS, PairRow),
    "cross_scores": (CROSS_SCORES, CrossScoreRow),
    "cross_pairs": (CROSS_PAIRS, CrossPairRow),
    "selected_pairs": (SELECTED_PAIRS, SelectedPairRow),
    "pair_joint_ids": (PAIR_JOINT_IDS, PairJointIdsRow),
    "rollouts": (ROLLOUTS, RolloutRow),
    "eval": (EVAL, EvalRow),
    "metrics": (METRICS, MetricRow),
}


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
    try:
        metadata = pq.read_schema(path).metadata or {}
    except Exception as exc:  # pyarrow raises several types for missing and corrupt files
        raise ArtifactError(f"{path}: not a readable Parquet file ({exc})") from exc
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
