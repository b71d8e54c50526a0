"""Typed Parquet schemas of a run folder (docs/design/file-formats.md#parquet-tables), declared once, and the typed
records of their rows. Their loud readers and atomic writers are in :mod:`pbrl.data.tables`."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal, TypedDict

import pyarrow as pa

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

# rounds/<r>/verdicts.parquet (preference_source: judge; docs/design/file-formats.md#verdicts): one row per asking of
# a question (two with judge_position_swap), questions in the order they were kept, each question's preference on
# every one of its rows.
VERDICTS = pa.schema(
    [
        ("question_id", pa.string()),  # r<round>-q<index>
        ("item_id", pa.string()),
        ("x_side", pa.string()),  # the question's first joint response (candidate order)...
        ("x_index", pa.int32()),  # ...its candidate index (cross: the combination's number)
        ("y_side", pa.string()),
        ("y_index", pa.int32()),
        ("x_candidate_sides", _texts),  # cross: each agent's candidate of x and y; null when aligned
        ("x_candidate_indices", pa.list_(pa.int32())),
        ("y_candidate_sides", _texts),
        ("y_candidate_indices", pa.list_(pa.int32())),
        ("shown_first", pa.string()),  # "x" | "y": the joint response shown as A
        ("judge", pa.string()),  # the judge's name (model, template, settings)
        ("key", pa.string()),  # the asking's content key (pbrl.judging.verdicts.Comparison.key)
        ("verdict", pa.string()),  # "A" | "B" | "tie"; null: no usable answer (reason) or not asked
        ("probability", pa.float64()),  # P(A is better) when the judge gave one
        ("raw_answer", pa.string()),  # the answer as given
        ("tokens", pa.int64()),  # tokens the answer cost (0 when free)
        ("seconds", pa.float64()),  # wall seconds the answer took when it was asked
        ("reason", pa.string()),  # why there is no verdict; null otherwise
        ("preference", pa.string()),  # the question's: "x" | "y" | "tie"; null: none (preference_reason)
        ("preference_reason", pa.string()),
        ("labeller", pa.string()),  # judge 'human': who labelled the pair (the name given; null when none)
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
    id columns are None on disk and filled by :func:`pbrl.data.tables.read_pairs`."""

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
