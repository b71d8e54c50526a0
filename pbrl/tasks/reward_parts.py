"""The parts of a registered task's reward, for the report's "Reward parts" panel (:mod:`pbrl.reporting.report`):
task name -> ``f(completions, one per agent; item) -> {part: value}``, None when the joint response has no parts
(e.g. an empty completion). Each task declares its parts here, so the report names no task."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pbrl.tasks.humaneval_docs import docs_terms

RewardParts = Callable[[Sequence[str], Mapping[str, Any]], Mapping[str, float] | None]


def humaneval_docs_parts(completions: Sequence[str], item: Mapping[str, Any]) -> Mapping[str, float] | None:
    """``lengths``, ``ratio`` and ``coverage`` of a humaneval_docs joint response (:func:`docs_terms`, each in
    [0, 1]); None unless there are the reward's two roles, summary and explanation."""
    if len(completions) != 2:
        return None
    return docs_terms(completions[0], completions[1], dict(item))


REWARD_PARTS: dict[str, RewardParts] = {"humaneval_docs": humaneval_docs_parts}
