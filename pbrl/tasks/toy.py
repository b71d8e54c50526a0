"""The ``toy`` task, for smoke runs and tests on the tiny random model: a graded length reward.

Items are ``{"item_id": "toy-000", "topic": "<word>"}`` from a fixed word list; agent i (1-based) is asked
"Agent i: say something short about <topic>."
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pbrl.errors import ConfigError, Problem
from pbrl.tasks.base import Formatter, RewardFunc, Task

TOPICS = (
    "apples", "rivers", "robots", "music", "winter", "bridges", "coffee", "stars",
    "maps", "gardens", "trains", "clouds", "books", "oceans", "bees", "lamps",
)  # fmt: skip
LENGTH_WEIGHT = 0.8
VARIETY_WEIGHT = 0.2
VARIETY_CHARS = 20
SINGLE_AGENT_TARGET_CHARS = 20


def toy_items(num_items: int = 8) -> tuple[dict[str, Any], ...]:
    """``num_items`` items ``{"item_id": "toy-<nnn>", "topic": TOPICS[i % 16]}``, always the same."""
    return tuple({"item_id": f"toy-{i:03d}", "topic": TOPICS[i % len(TOPICS)]} for i in range(num_items))


def toy_formatter(agent_index: int) -> Formatter:
    """The prompt of agent ``agent_index`` (0-based; the prompt says ``agent_index + 1``)."""

    def format_prompt(item: dict[str, Any]) -> str:
        return f"Agent {agent_index + 1}: say something short about {item['topic']}."

    return format_prompt


def closeness(length: int, target: int) -> float:
    """``min(length, target) / max(length, target)``, and 0.0 when either is 0. In [0, 1]."""
    if length <= 0 or target <= 0:
        return 0.0
    return min(length, target) / max(length, target)


def toy_reward(
    *completions: Sequence[str],
    prompts: Sequence[Sequence[str]] | None = None,
    batch_items: Sequence[dict[str, Any]] | None = None,
) -> list[float]:
    """Length-based reward: each agent should write about twice as many characters as the one before.

    For one joint response with completions c_1..c_a (a agents) and character lengths L_i:

        length  = mean over i = 2..a of closeness(L_i, 2 * L_{i-1})     (a >= 2)
                = closeness(L_1, 20)                                     (a == 1)
        variety = min(number of distinct characters in c_1 + ... + c_a, 20) / 20
        reward  = 0.8 * length + 0.2 * variety                           in [0, 1]

    with ``closeness(x, t) = min(x, t) / max(x, t)`` (0 when either is 0). Example: "abc" and "abcdef"
    give length = closeness(6, 6) = 1, variety = 6 / 20, reward = 0.8 + 0.06 = 0.86. Random tokens give
    varied values, so pairs are rarely ties. ``prompts`` and ``batch_items`` are accepted and unused.

    Args:
        completions: one list of n completions per agent (a lists).

    Returns:
        n rewards, one per joint response.

    Raises:
        ValueError: no agent lists, or lists of different lengths.
    """
    n = _batch_size(completions)
    rewards = []
    for j in range(n):
        texts = [agent[j] for agent in completions]
        lengths = [len(t) for t in texts]
        if len(lengths) == 1:
            length = closeness(lengths[0], SINGLE_AGENT_TARGET_CHARS)
        else:
            pairs = [closeness(lengths[i], 2 * lengths[i - 1]) for i in range(1, len(lengths))]
            length = sum(pairs) / len(pairs)
        variety = min(len(set("".join(texts))), VARIETY_CHARS) / VARIETY_CHARS
        rewards.append(LENGTH_WEIGHT * length + VARIETY_WEIGHT * variety)
    return rewards


def _batch_size(completions: Sequence[Sequence[str]]) -> int:
    if not completions:
        raise ValueError("reward_func: got no completions; expected one list per agent")
    sizes = [len(agent) for agent in completions]
    if len(set(sizes)) != 1:
        raise ValueError(f"reward_func: the agents' completion lists differ in length: {sizes}")
    return sizes[0]


def _build(name: str, reward_func: RewardFunc, num_agents: int, num_items: int) -> Task:
    problems = []
    if isinstance(num_agents, bool) or not isinstance(num_agents, int) or num_agents < 1:
        problems.append(Problem("num_agents", num_agents, "must be an int >= 1"))
    if isinstance(num_items, bool) or not isinstance(num_items, int) or num_items < 1:
        problems.append(Problem("num_items", num_items, "must be an int >= 1"))
    if problems:
        raise ConfigError(problems)
    items = toy_items(num_items)
    return Task(
        name=name,
        formatters=tuple(toy_formatter(i) for i in range(num_agents)),
        reward_func=reward_func,
        train_items=items,
        eval_items=items,
        reward_range=(0.0, 1.0),
    )


def toy_task(num_agents: int = 2, num_items: int = 8) -> Task:
    """The ``toy`` task: :func:`toy_reward`, ``num_items`` items used for training and evaluation."""
    return _build("toy", toy_reward, num_agents, num_items)
