"""The replay options' rules (``preference_replay_mode``, ``_k``, ``_lambda``, ``_sample_size``), one function
each, used by the iterative trainers' config rules (:data:`REPLAY_RULES`). The replay buffer
(pbrl.preference.replay.select_replay) takes the values of a job that passed them."""

from __future__ import annotations

from typing import Any

from pbrl.config.rules import Rule, Values, only_with, rule
from pbrl.errors import Problem

REPLAY_MODES: tuple[str, ...] = ("current", "nearest_k", "all_history", "lambda_decay")


def _int_at_least_one(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def replay_k_problems(mode: str, k: Any) -> list[Problem]:
    """``preference_replay_k``: required (>= 1) with ``nearest_k``; None or 1 with ``current``; None otherwise."""
    if mode == "nearest_k" and not _int_at_least_one(k):
        return [Problem("preference_replay_k", k, "required (>= 1) with preference_replay_mode='nearest_k'")]
    if mode == "current" and not (k is None or (_int_at_least_one(k) and k == 1)):
        return [Problem("preference_replay_k", k, "must be None or 1 with preference_replay_mode='current'")]
    if mode in ("all_history", "lambda_decay") and k is not None:
        return [Problem("preference_replay_k", k, f"must be None with preference_replay_mode='{mode}'")]
    return []


def replay_lambda_problems(mode: str, lam: Any) -> list[Problem]:
    """``preference_replay_lambda``: required in [0, 1] with ``lambda_decay``, None otherwise."""
    number = isinstance(lam, int | float) and not isinstance(lam, bool)
    if mode == "lambda_decay" and not (number and 0.0 <= lam <= 1.0):
        return [
            Problem("preference_replay_lambda", lam, "required, in [0, 1], with preference_replay_mode='lambda_decay'")
        ]
    if mode != "lambda_decay" and lam is not None:
        return [only_with("preference_replay_lambda", lam, "preference_replay_mode='lambda_decay'")]
    return []


def replay_sample_size_problems(mode: str, sample_size: Any) -> list[Problem]:
    """``preference_replay_sample_size``: None with ``current`` (no sampling), else None or an int >= 1."""
    if mode == "current" and sample_size is not None:
        return [
            Problem(
                "preference_replay_sample_size",
                sample_size,
                "must be None with preference_replay_mode='current' (the round's pairs are used as they are)",
            )
        ]
    if sample_size is not None and not _int_at_least_one(sample_size):
        return [Problem("preference_replay_sample_size", sample_size, "must be an integer >= 1 or None")]
    return []


def replay_problems(mode: str, k: Any, lam: Any, sample_size: Any) -> list[Problem]:
    """Every problem of the four replay options at once (an unknown mode is reported alone)."""
    if mode not in REPLAY_MODES:
        return [Problem("preference_replay_mode", mode, f"allowed: {', '.join(REPLAY_MODES)}")]
    return [
        *replay_k_problems(mode, k),
        *replay_lambda_problems(mode, lam),
        *replay_sample_size_problems(mode, sample_size),
    ]


REPLAY_RULES: list[Rule] = []


@rule(REPLAY_RULES, "preference_replay_mode", "preference_replay_k")
def _replay_k(v: Values) -> list[Problem]:
    return replay_k_problems(v["preference_replay_mode"], v["preference_replay_k"])


@rule(REPLAY_RULES, "preference_replay_mode", "preference_replay_lambda")
def _replay_lambda(v: Values) -> list[Problem]:
    return replay_lambda_problems(v["preference_replay_mode"], v["preference_replay_lambda"])


@rule(REPLAY_RULES, "preference_replay_mode", "preference_replay_sample_size")
def _replay_sample_size(v: Values) -> list[Problem]:
    return replay_sample_size_problems(v["preference_replay_mode"], v["preference_replay_sample_size"])
