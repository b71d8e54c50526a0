"""Two oracle rewards for the reward A -> B -> A cache test, named by import path (``tests.rewards_ab:reward``).

The config names ``reward``; a test swaps it between :func:`reward_a` and :func:`reward_b`, as a user would
edit the function between two resumes: the config stays the same, the task's code changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def reward_a(*completions: Sequence[str], prompts: Any = None, batch_items: Any = None) -> list[float]:
    """Characters of agent 0's completion: ``"abc"`` -> 3.0."""
    return [float(len(text)) for text in completions[0]]


def reward_b(*completions: Sequence[str], prompts: Any = None, batch_items: Any = None) -> list[float]:
    """Minus :func:`reward_a`: ``"abc"`` -> -3.0."""
    return [-float(len(text)) for text in completions[0]]


reward = reward_a
