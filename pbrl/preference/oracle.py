"""The oracle (docs/design/algorithms.md#oracle): ``reward_func`` then the optional ``reward_processor``, called on
batches.

A reward that raises, does not return within ``reward_timeout`` seconds or is not a finite number drops that
joint response with a counted reason; a :class:`~pbrl.errors.TransientError` (or an httpx timeout / 429 / 5xx)
propagates so that the stage is retried as a whole. Every joint response gets its own deep copy of its item, so a
reward function that changes an item cannot change what the next joint response sees.
"""

from __future__ import annotations

import contextvars
import copy
import inspect
import math
import numbers
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from pbrl.errors import RewardContractError, TransientError

__all__ = [
    "OracleScore", "RewardContractError", "RewardTimeoutError", "as_real", "call_reward_func", "is_transient",
    "score_batch",
]  # fmt: skip


class RewardTimeoutError(RuntimeError):
    """reward_func did not return within its time limit; its joint responses are dropped and counted."""


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
    timeout_s: float | None = None,
) -> list[Any]:
    """Call ``reward_func`` once on n joint responses.

    Args:
        completions: a agents lists of n completions each (``completions[i][j]`` = agent i, response j).
        prompts: n lists of a prompts, passed as ``prompts=`` if the function accepts it.
        batch_items: the n task items, passed as ``batch_items=`` if accepted: each entry a deep copy of its
            own (the same item repeated for several joint responses gives several copies).
        timeout_s: seconds the call may take (None: no limit). The call runs in a thread of its own; past the
            limit it is abandoned (a Python thread cannot be stopped: it runs on in the background until the
            function returns) and :class:`RewardTimeoutError` is raised.

    Returns:
        The function's n return values, unchecked (see :func:`score_batch`).

    Raises:
        RewardContractError: the function returned a different number of values than n.
        RewardTimeoutError: it did not return within ``timeout_s``.
    """
    n = len(completions[0]) if completions else 0
    kwargs: dict[str, Any] = {}
    if prompts is not None and _accepts(reward_func, "prompts"):
        kwargs["prompts"] = [list(p) for p in prompts]
    if batch_items is not None and _accepts(reward_func, "batch_items"):
        kwargs["batch_items"] = [copy.deepcopy(item) for item in batch_items]
    out = _call(reward_func, [list(c) for c in completions], kwargs, timeout_s)
    if hasattr(out, "tolist"):
        out = out.tolist()
    if not isinstance(out, (list, tuple)):
        out = [out]
    if len(out) != n:
        name = getattr(reward_func, "__qualname__", repr(reward_func))
        raise RewardContractError(f"reward_func {name} returned {len(out)} values for {n} joint responses")
    return list(out)


def _call(func: Callable[..., Any], args: list[Any], kwargs: dict[str, Any], timeout_s: float | None) -> Any:
    """``func(*args, **kwargs)``, within ``timeout_s`` seconds when given (see :func:`call_reward_func`)."""
    if timeout_s is None:
        return func(*args, **kwargs)
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = func(*args, **kwargs)
        except BaseException as exc:  # re-raised in the caller's thread
            outcome["error"] = exc

    context = contextvars.copy_context()  # the caller's Prefect run context and loggers reach the function
    worker = threading.Thread(target=context.run, args=(target,), name="pbrl-reward", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        name = getattr(func, "__qualname__", repr(func))
        raise RewardTimeoutError(f"reward_func {name} did not return within reward_timeout={timeout_s:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def as_real(value: Any) -> float | None:
    """``value`` as a Python float when it is a real number, else None.

    Accepted: Python ``int``/``float``, every ``numbers.Real`` (numpy scalars such as ``np.float32(0.5)`` and
    ``np.int64(1)`` register there), and 0-d arrays or tensors holding one (``np.array(0.5)``,
    ``torch.tensor(0.5)``). Booleans (``True``, ``np.bool_``) are refused on purpose: a pass/fail verdict
    returned as a reward is usually a bug in the reward function; return ``float(passed)`` to mean 0/1.
    Complex numbers, strings, ``None`` and arrays with more than one element are refused.
    """
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()  # 0-d numpy array / torch tensor -> Python scalar
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    return None


def _not_a_number(what: str, value: Any) -> str:
    if isinstance(value, (bool, np.bool_)) or getattr(value, "dtype", None) == np.bool_:
        return f"{what} is a bool ({value!r}); return a number, e.g. float(passed)"
    return f"{what} is not a real number: {value!r}"[:200]


def _to_score(value: Any, processor: Callable[[float], float] | None) -> OracleScore:
    raw = as_real(value)
    if raw is None:
        return OracleScore(None, None, _not_a_number("reward", value))
    if not math.isfinite(raw):
        return OracleScore(None, None, f"reward is not finite: {raw!r}")
    if processor is None:
        return OracleScore(raw, raw)
    try:
        out = processor(raw)
    except Exception as exc:
        if is_transient(exc):
            raise
        # Only the exception type is stored: its message may quote data or secrets (files are shared).
        return OracleScore(raw, None, f"reward_processor raised {type(exc).__name__}")
    processed = as_real(out)
    if processed is None:
        return OracleScore(raw, None, _not_a_number("reward_processor result", out))
    if not math.isfinite(processed):
        return OracleScore(raw, None, f"reward_processor returned a non-finite value: {processed!r}")
    return OracleScore(raw, processed)


def score_batch(
    reward_func: Callable[..., Any],
    reward_processor: Callable[[float], float] | None,
    completions: Sequence[Sequence[str]],
    *,
    prompts: Sequence[Sequence[str]] | None = None,
    batch_items: Sequence[dict[str, Any]] | None = None,
    timeout_s: float | None = None,
) -> list[OracleScore]:
    """Score n joint responses with one batched call; isolate failures one by one if the batch call raises.
    A call that does not return within ``timeout_s`` (``reward_timeout``) fails every joint response of that
    call (none is retried: each would wait as long again).

    Returns:
        n :class:`OracleScore` in input order; a failed response has ``failure`` set and no reward.

    Raises:
        TransientError (or httpx errors judged transient): propagated for the caller's retry.
        RewardContractError: the function returned the wrong number of values.
    """
    n = len(completions[0]) if completions else 0
    try:
        values = call_reward_func(
            reward_func, completions, prompts=prompts, batch_items=batch_items, timeout_s=timeout_s
        )
    except RewardContractError:
        raise
    except RewardTimeoutError as exc:
        return [OracleScore(None, None, str(exc))] * n
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
                timeout_s=timeout_s,
            )
        )
    return out
