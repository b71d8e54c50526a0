"""Centralized collaboration (``collaboration_mode: centralized``,
docs/design/algorithms.md#centralized-collaboration): one actor writes every role.

In the default, ``decentralized`` collaboration, agent i is a policy of its own that answers its own prompt h_i.
In ``centralized`` collaboration (the reference's option, CoMLRL ``preference/collaboration.py``) there is **one
actor**, a single policy, and ``num_agents`` counts the *roles* it plays:

* its prompt for an item is the centralized adapter's prompt built from every role's prompt
  (:func:`actor_prompts`; the adapter is ``comparator_centralized_adapter``, default ``<agent_i>`` sections,
  :mod:`pbrl.generation.centralized`), and one sampled completion is one **joint response**;
* the oracle splits each joint response into role texts with the same adapter and calls the task reward on
  them as on decentralized rows (:func:`score_joint`: every role's completion list, the role prompts,
  the items). A joint response the adapter cannot parse, or one with an empty role, is **dropped with a
  counted reason** (``centralized_parse: …`` in the scores / eval tables); it never stops the round;
* MADPO learns from the joint completion as one sequence of the one policy
(docs/design/algorithms.md#centralized-collaboration): with one actor the
  joint margin is that sequence's log-prob margin, every completion token scored, EOS included;
* iterative trainers compare with comparator joint responses written by the same kind of one actor on the
  same joint prompt: ``comparator_generation_mode`` is ``centralized`` (set so by the configuration, as the
  reference does) with ``comparator_centralized_agent_index`` 0.

The run folder of a centralized run holds **one policy**, ``agent_0``, everywhere a decentralized run holds one
per agent: ``checkpoints/initial/agent_0``, ``checkpoints/round_<r>/agent_0``; candidates.parquet has one row per
joint response (``agent_index`` 0: the joint prompt, its ids, the joint completion and its ids exactly as
sampled), and pairs, replay files and eval.parquet one entry per actor (the joint text and ids). The parsed role
texts are stored beside them: ``rounds/<r>/roles.parquet`` (written by score-with-oracle, one row per joint
response) and ``rounds/<r>/eval_roles.parquet`` (written by evaluate, one row per draw). Stages see the job
through :func:`actor_job` (``num_agents`` = the actors), so caching and resume are the decentralized ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa

from pbrl.data.items import format_prompts
from pbrl.data.schema import EvalRow, Item
from pbrl.data.tables import read_joint_responses, write_table
from pbrl.errors import ConfigError, Problem
from pbrl.generation.centralized import ADAPTER_FIELD, CentralizedAdapter, parse_roles
from pbrl.preference.oracle import Oracle, OracleScore

if TYPE_CHECKING:
    from pbrl.tasks.base import Task

CENTRALIZED = "centralized"
PARSE_FAILURE = "centralized_parse"  # the failure reason (before ':') of a joint response the adapter cannot split
ROLES_FILE = "roles.parquet"  # rounds/<r>/: the role texts of each candidate joint response (score-with-oracle)
EVAL_ROLES_FILE = "eval_roles.parquet"  # rounds/<r>/: the role texts of each evaluation draw (evaluate)

ROLES = pa.schema(
    [
        ("item_id", pa.string()),
        ("side", pa.string()),  # "target" | "comparator"; "eval" in eval_roles.parquet
        ("candidate_index", pa.int32()),  # the candidate index; in eval_roles.parquet the item's sample s
        ("roles", pa.list_(pa.string())),  # one text per role, in role order; null when not parsed
        ("failure", pa.string()),  # null when parsed; else "centralized_parse: <why>"
    ]
)


def actor_prompts(task: Task, items: Sequence[Item], adapter: CentralizedAdapter | None) -> list[list[str]]:
    """Each actor's prompt for every item, ``[actor][item]``.

    Decentralized (``adapter`` None): agent i's formatter. Centralized: one actor whose prompt is the adapter's
    centralized prompt built from every role's prompt (``adapter.build_prompt(item, [formatter_i(item) for each
    role])``).

    Raises:
        ConfigError: a formatter fails or returns no text (named ``formatters[i]``), or the adapter's
            ``build_prompt`` does not return a non-empty str.
    """
    roles = [format_prompts(f, list(items), i) for i, f in enumerate(task.formatters)]
    if adapter is None:
        return roles
    joint = []
    for n, item in enumerate(items):
        prompt = adapter.build_prompt(item, [roles[i][n] for i in range(len(roles))])
        if not isinstance(prompt, str) or not prompt:
            raise ConfigError(
                [
                    Problem(
                        ADAPTER_FIELD,
                        item.get("item_id"),
                        f"build_prompt must return a non-empty str, got {prompt!r}"[:200],
                    )
                ]
            )
        joint.append(prompt)
    return [joint]


@dataclass(frozen=True)
class ParsedJoint:
    """One joint response split into roles: ``roles`` (one text per role) or ``failure`` (why not)."""

    roles: list[str] | None
    failure: str | None


def parse_joint(adapter: CentralizedAdapter, text: str, num_roles: int) -> ParsedJoint:
    """Split one joint response into ``num_roles`` role texts. Unparsable, or a role left empty (a decentralized
    pair with an empty completion is rejected too), gives ``failure = "centralized_parse: <why>"``.

    Raises:
        ValueError: the adapter returned something other than ``num_roles`` strings (a bug in the adapter).
    """
    roles, why = parse_roles(adapter, text, num_roles)
    if roles is None:
        return ParsedJoint(None, f"{PARSE_FAILURE}: {why}")
    empty = [str(i + 1) for i, r in enumerate(roles) if not r.strip()]
    if empty:
        return ParsedJoint(None, f"{PARSE_FAILURE}: empty role(s) {', '.join(empty)}")
    return ParsedJoint(roles, None)


def score_joint(
    adapter: CentralizedAdapter, task: Task, texts: Sequence[str], items: Sequence[Item], oracle: Oracle
) -> tuple[list[OracleScore], list[ParsedJoint]]:
    """Score n joint responses with the task reward on their role texts (docs/design/algorithms.md#oracle, one batched
    call).

    The reward sees exactly what it sees for decentralized rows: one list of completions per role
    (``len(task.formatters)`` roles), ``prompts=`` each response's role prompts and ``batch_items=`` the items.
    An unparsable response gets no reward and the failure ``centralized_parse: <why>``.

    Args:
        texts: the n joint completions (actor 0's text).
        items: the n task items, in the same order.
        oracle: the task reward (``task.reward_func`` and ``reward_processor``) with its ``reward_timeout``
            (:class:`pbrl.preference.oracle.Oracle`).

    Returns:
        (n scores, n parses), in input order.

    Raises:
        As :meth:`pbrl.preference.oracle.Oracle.score`; ValueError from a faulty adapter (:func:`parse_joint`).
    """
    num_roles = len(task.formatters)
    parsed = [parse_joint(adapter, t, num_roles) for t in texts]
    scores: list[OracleScore] = [OracleScore(None, None, p.failure) for p in parsed]
    ok = [j for j, p in enumerate(parsed) if p.roles is not None]
    if ok:
        ok_items = [items[j] for j in ok]
        role_prompts = [format_prompts(f, ok_items, i) for i, f in enumerate(task.formatters)]
        got = oracle.score(
            [[parsed[j].roles[i] for j in ok] for i in range(num_roles)],  # type: ignore[index]
            prompts=[[role_prompts[i][n] for i in range(num_roles)] for n in range(len(ok))],
            batch_items=ok_items,
        )
        for j, s in zip(ok, got, strict=True):
            scores[j] = s
    return scores, parsed


def is_parse_failure(failure: str | None) -> bool:
    """Whether a score's failure is an unparsable joint response (dropped; it never stops the round)."""
    return failure is not None and failure.split(":")[0] == PARSE_FAILURE


def roles_path(round_dir: Path, *, eval_draws: bool = False) -> Path:
    """``rounds/<r>/roles.parquet`` (candidates) or ``rounds/<r>/eval_roles.parquet`` (evaluation draws)."""
    return Path(round_dir) / (EVAL_ROLES_FILE if eval_draws else ROLES_FILE)


def write_roles(path: Path, keys: Sequence[tuple[str, str, int]], parsed: Sequence[ParsedJoint]) -> None:
    """Write the role texts of the joint responses ``keys`` = (item_id, side, index), one row each (ROLES)."""
    write_table(
        path,
        [
            {"item_id": k[0], "side": k[1], "candidate_index": k[2], "roles": p.roles, "failure": p.failure}
            for k, p in zip(keys, parsed, strict=True)
        ],
        ROLES,
    )


def write_candidate_roles(candidates: Path, round_dir: Path, adapter: CentralizedAdapter, num_roles: int) -> Path:
    """``rounds/<r>/roles.parquet``: the role texts of every joint response of ``candidates`` (one actor row
    each), split with ``adapter`` into ``num_roles`` roles, in candidates.parquet's order.

    Raises:
        ArtifactError: candidates.parquet is unreadable or a joint response lacks its actor row.
    """
    joint = read_joint_responses(candidates, 1)
    keys = list(joint)
    path = roles_path(round_dir)
    write_roles(path, keys, [parse_joint(adapter, joint[k][0]["completion"], num_roles) for k in keys])
    return path


def write_eval_roles(rows: Sequence[EvalRow], round_dir: Path, adapter: CentralizedAdapter, num_roles: int) -> Path:
    """``rounds/<r>/eval_roles.parquet``: the role texts of every evaluation draw (rows of eval.parquet, item-major,
    the actor's joint text first in ``completions``), keyed (item_id, ``"eval"``, sample s of that item)."""
    seen: dict[str, int] = {}
    keys = []
    for row in rows:
        keys.append((row["item_id"], "eval", seen.get(row["item_id"], 0)))
        seen[row["item_id"]] = seen.get(row["item_id"], 0) + 1
    path = roles_path(round_dir, eval_draws=True)
    write_roles(path, keys, [parse_joint(adapter, row["completions"][0], num_roles) for row in rows])
    return path
