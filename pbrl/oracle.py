"""The oracle (SPEC §5.1): ``reward_func`` then the optional ``reward_processor``, called on batches.

A reward that raises or is not a finite number drops that joint response with a counted reason; a
:class:`~pbrl.errors.TransientError` (or an httpx timeout / 429 / 5xx) propagates so that the stage is
retried as a whole.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from pbrl.errors import TransientError


class RewardContractError(ValueError):
    """reward_func broke its contract (wrong number of values): a bug in the task, never retried or dropped."""


@dataclass(frozen=True)
class OracleScore:
    """One joint response's score: ``raw`` from reward_func, ``reward`` after reward_processor."""

    raw: float | None
    reward: float | None
    failure: str | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None


def _accepts(func: Callable[..., Any], name: str) -> bool:
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def is_transient(exc: BaseException) -> bool:
    if isinstance(exc, (TransientError, httpx.TimeoutException, httpx.NetworkError)):
        return True
    if isinstance(exc, httpx.HTTPStatusError):
        return exc.response.status_code == 429 or exc.response.status_code >= 500
    return False


def call_reward_func(
    reward_func: Callable[..., Any],
    completions: Sequence[Sequence[str]],
    *,
    prompts: Sequence[Sequence[str]] | None = None,
    batch_items: Sequence[dict[str, Any]] | None = None,
) -> list[Any]:
    """Call ``reward_func`` once on n joint responses.

    Args:
        completions: a agents lists of n completions each (``completions[i][j]`` = agent i, response j).
        prompts: n lists of a prompts, passed as ``prompts=`` if the function accepts it.
        batch_items: the n task items, passed as ``batch_items=`` if accepted.

    Returns:
        The function's n return values, unchecked (see :func:`score_batch`).

    Raises:
        RewardContractError: the function returned a different number of values than n.
    """
    n = len(completions[0]) if completions else 0
    kwargs: dict[str, Any] = {}
    if prompts is not None and _accepts(reward_func, "prompts"):
        kwargs["prompts"] = [list(p) for p in prompts]
    if batch_items is not None and _accepts(reward_func, "batch_items"):
        kwargs["batch_items"] = list(batch_items)
    out = reward_func(*[list(c) for c in completions], **kwargs)
    if hasattr(out, "tolist"):
        out = out.tolist()
    if not isinstance(out, (list, tuple)):
        out = [out]
    if len(out) != n:
        name = getattr(reward_func, "__qualname__", repr(reward_func))
        raise RewardContractError(f"reward_func {name} returned {len(out)} values for {n} joint responses")
    return list(out)


def _to_score(value: Any, processor: Callable[[float], float] | None) -> OracleScore:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return OracleScore(None, None, f"reward is not a number: {value!r}"[:200])
    raw = float(value)
    if not math.isfinite(raw):
        return OracleScore(None, None, f"reward is not finite: {raw!r}")
    if processor is None:
        return OracleScore(raw, raw)
    try:
        processed = processor(raw)
    except Exception as exc:
        if is_transient(exc):
            raise
        # Only the exception type is stored: its message may quote data or secrets (files are shared).
        return OracleScore(raw, None, f"reward_processor raised {type(exc).__name__}")
    if isinstance(processed, bool) or not isinstance(processed, (int, float)) or not math.isfinite(processed):
        return OracleScore(raw, None, f"reward_processor returned {processed!r}"[:200])
    return OracleScore(raw, float(processed))


def score_batch(
    reward_func: Callable[..., Any],
    reward_processor: Callable[[float], float] | None,
    completions: Sequence[Sequence[str]],
    *,
    prompts: Sequence[Sequence[str]] | None = None,
    batch_items: Sequence[dict[str, Any]] | None = None,
) -> list[OracleScore]:
    """Score n joint responses with one batched call; isolate failures one by one if the batch call raises.

    Returns:
        n :class:`OracleScore` in input order; a failed response has ``failure`` set and no reward.

    Raises:
        TransientError (or httpx errors judged transient): propagated for the caller's retry.
        RewardContractError: the function returned the wrong number of values.
    """
    n = len(completions[0]) if completions else 0
    try:
        values = call_reward_func(reward_func, completions, prompts=prompts, batch_items=batch_items)
    except RewardContractError:
        raise
    except Exception as exc:
        if is_transient(exc):
            raise
        values = None
        batch_error: BaseException = exc
    if values is not None:
        return [_to_score(v, reward_processor) for v in values]
    if n == 1:
        return [OracleScore(None, None, f"reward_func raised {type(batch_error).__name__}")]
    # The batch call raised: call one joint response at a time to find which ones fail.
    out: list[OracleScore] = []
    for j in range(n):
        out.extend(
            score_batch(
                reward_func,
                reward_processor,
                [[c[j]] for c in completions],
                prompts=None if prompts is None else [prompts[j]],
                batch_items=None if batch_items is None else [batch_items[j]],
            )
        )
    return out
