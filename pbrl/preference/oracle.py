"""The oracle (docs/design/algorithms.md#oracle): ``reward_func`` then the optional ``reward_processor``, called on
batches.

A reward that raises, does not return within ``reward_timeout`` seconds or is not a finite number drops that
joint response with a counted reason; a :class:`~pbrl.errors.TransientError` (or an httpx timeout / 429 / 5xx)
propagates so that the stage is retried as a whole. Every joint response gets its own deep copy of its item, so a
reward function that changes an item cannot change what the next joint response sees.

With a time limit the reward runs in a worker process (:mod:`pbrl.preference.reward_worker`) that is killed when a
call passes the limit: a reward that loops stops computing, and the joint responses of that call are scored again
one at a time, so that only those that time out on their own are dropped.
"""

from __future__ import annotations

import copy
import inspect
import math
import numbers
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import httpx
import numpy as np

from pbrl.errors import OracleError, RewardContractError, TransientError
from pbrl.models import thread_placement
from pbrl.preference.reward_worker import CallTimeout, ForkedWorker, RemoteError, WorkerDied, error_name

__all__ = [
    "Oracle", "OracleScore", "RewardContractError", "as_real", "call_reward_func",
    "is_transient", "score_batch",
]  # fmt: skip

# Timed-out joint responses of one item, when a timed-out call's responses are scored one at a time, after which the
# item's other responses of that call are given up: an item on which the reward hangs whatever the completion costs
# two limits, not one per joint response (an item has up to 2 x K of them, K^n with joint_mode cross).
MAX_TIMEOUTS_PER_ITEM = 2


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
    """Call ``reward_func`` once on n joint responses, in this process and without a time limit (:class:`Oracle`
    runs it in a worker process with one).

    Args:
        completions: a agents lists of n completions each (``completions[i][j]`` = agent i, response j).
        prompts: n lists of a prompts, passed as ``prompts=`` if the function accepts it.
        batch_items: the n task items, passed as ``batch_items=`` if accepted: each entry a deep copy of its
            own (the same item repeated for several joint responses gives several copies).

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
        kwargs["batch_items"] = [copy.deepcopy(item) for item in batch_items]
    out = reward_func(*[list(c) for c in completions], **kwargs)
    if hasattr(out, "tolist"):
        out = out.tolist()
    if not isinstance(out, (list, tuple)):
        out = [out]
    if len(out) != n:
        raise RewardContractError(
            f"reward_func {_name(reward_func)} returned {len(out)} values for {n} joint responses"
        )
    return list(out)


def _name(func: Callable[..., Any]) -> str:
    return getattr(func, "__qualname__", repr(func))


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


def _score_values(
    reward_func: Callable[..., Any],
    reward_processor: Callable[[float], float] | None,
    completions: Sequence[Sequence[str]],
    prompts: Sequence[Sequence[str]] | None,
    batch_items: Sequence[dict[str, Any]] | None,
) -> list[OracleScore]:
    """One call of the reward and the processor on each value: every line of user code of a call, so that the
    worker runs all of it (a processor or a return value's ``tolist`` can hang too)."""
    values = call_reward_func(reward_func, completions, prompts=prompts, batch_items=batch_items)
    return [_to_score(v, reward_processor) for v in values]


def _portable(exc: BaseException) -> BaseException:
    """An exception of the worker that does not pickle, as one that does: a transient one stays transient (the
    stage is retried), anything else keeps its class name (:class:`~pbrl.preference.reward_worker.RemoteError`)."""
    if is_transient(exc):
        return TransientError(f"{type(exc).__name__}: {exc}"[:500])
    return RemoteError(type(exc).__name__, str(exc))


class Oracle:
    """The task's reward on batches of joint responses (:func:`score_batch` for one batch).

    With ``timeout_s`` (``reward_timeout``) every call runs in a worker process forked from this one
    (:class:`~pbrl.preference.reward_worker.ForkedWorker`, kept between calls until :meth:`close`). A call past the
    limit is stopped by killing the worker; its joint responses are then scored one at a time, each within the
    limit, so only those that time out alone fail; after :data:`MAX_TIMEOUTS_PER_ITEM` timeouts of one item its
    other responses of that call are given up, each with a failure that says so. Without ``timeout_s`` the reward
    runs in this process.

    ``max_failures`` (the share ``oracle_max_failure_share`` allows) bounds the time a failing reward can cost: once
    more joint responses failed in this oracle's calls, scoring one at a time stops the stage at once with
    :class:`~pbrl.errors.OracleError` (a batch that returned is left to the stage's own check), its message led by
    ``where`` (the stage and round).

    Use as a context manager (or call :meth:`close`), so that the worker ends with the stage.
    """

    def __init__(
        self,
        reward_func: Callable[..., Any],
        reward_processor: Callable[[float], float] | None = None,
        timeout_s: float | None = None,
        max_failures: int | None = None,
        where: str = "",
    ):
        self.name = _name(reward_func)
        self.where = where
        self.timeout_s = timeout_s
        self.max_failures = max_failures
        self.failures: Counter[str] = Counter()  # failed joint responses so far, by reason
        self.failed_items: Counter[str] = Counter()  # ... and by item id
        self._score = partial(_score_values, reward_func, reward_processor)
        self._worker = ForkedWorker(self._score, _portable) if timeout_s is not None else None

    def close(self) -> None:
        """Stop the worker process, if one runs."""
        if self._worker is not None:
            self._worker.close()

    def __enter__(self) -> Oracle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def score(
        self,
        completions: Sequence[Sequence[str]],
        *,
        prompts: Sequence[Sequence[str]] | None = None,
        batch_items: Sequence[dict[str, Any]] | None = None,
    ) -> list[OracleScore]:
        """Score n joint responses with one batched call; isolate failures one by one if the call raises, dies or
        times out.

        Args:
            completions: a agents lists of n completions each (``completions[i][j]`` = agent i, response j).
            prompts: n lists of a prompts; batch_items: the n task items (see :func:`call_reward_func`).

        Returns:
            n :class:`OracleScore` in input order; a failed response has ``failure`` set and no reward.

        Raises:
            TransientError (or httpx errors judged transient): propagated for the caller's retry.
            RewardContractError: the function returned the wrong number of values.
            OracleError: more than ``max_failures`` joint responses failed in this oracle's calls, found while
                scoring a failed call's responses one at a time.
        """
        n = len(completions[0]) if completions else 0
        thread_placement.release()  # the reward's processes (forked worker, sandbox) must not inherit one CPU
        try:
            out = self._call(completions, prompts, batch_items)
        except RewardContractError:
            raise
        except Exception as exc:
            if is_transient(exc):
                raise
            out = [OracleScore(None, None, self._failure(exc))] if n == 1 else None
        if out is None:
            out = self._one_by_one(completions, prompts, batch_items)
        else:
            self._count(out, batch_items)
        return out

    def _call(
        self,
        completions: Sequence[Sequence[str]],
        prompts: Sequence[Sequence[str]] | None,
        batch_items: Sequence[dict[str, Any]] | None,
    ) -> list[OracleScore]:
        if self._worker is None or self.timeout_s is None:
            return self._score(completions, prompts, batch_items)
        lists = [list(c) for c in completions]
        prompt_lists = None if prompts is None else [list(p) for p in prompts]
        items = None if batch_items is None else list(batch_items)
        return self._worker.call((lists, prompt_lists, items), {}, self.timeout_s)

    def _failure(self, exc: BaseException) -> str:
        if isinstance(exc, CallTimeout):
            return (
                f"reward_func {self.name} did not return within reward_timeout={self.timeout_s:g} s "
                "(its worker process was stopped)"
            )
        if isinstance(exc, WorkerDied):
            return f"reward_func {self.name}: {exc}"
        return f"reward_func raised {error_name(exc)}"

    def _count(self, scores: Sequence[OracleScore], items: Sequence[dict[str, Any]] | None) -> None:
        """Count the failures by reason and item."""
        for j, score in enumerate(scores):
            if score.failure is not None:
                self.failures[score.failure.split(":")[0]] += 1
                self.failed_items[str(items[j].get("item_id", "?")) if items is not None else "?"] += 1

    def _check_budget(self) -> None:
        """Stop once more than ``max_failures`` failed: scoring one at a time costs up to a limit per response, and
        the round would stop at its end anyway."""
        total = sum(self.failures.values())
        if self.max_failures is not None and total > self.max_failures:
            listing = ", ".join(f"{i} ({n})" for i, n in self.failed_items.most_common(20))
            lead = f"{self.where}: " if self.where else ""
            raise OracleError(
                f"{lead}{total} joint responses could not be scored, more than oracle_max_failure_share allows "
                f"({self.max_failures}); stopped before scoring the rest; items: {listing}; "
                f"reasons: {dict(self.failures)}"
            )

    def _one_by_one(
        self,
        completions: Sequence[Sequence[str]],
        prompts: Sequence[Sequence[str]] | None,
        batch_items: Sequence[dict[str, Any]] | None,
    ) -> list[OracleScore]:
        """Each joint response of a failed call on its own; an item's responses after :data:`MAX_TIMEOUTS_PER_ITEM`
        of its own timed out are given up."""
        timed_out = self._failure(CallTimeout()) if self.timeout_s is not None else None
        per_item: Counter[str] = Counter()
        out: list[OracleScore] = []
        for j in range(len(completions[0])):
            item = str(batch_items[j].get("item_id", "")) if batch_items is not None else ""
            if per_item[item] >= MAX_TIMEOUTS_PER_ITEM:
                score = OracleScore(None, None, self._given_up(item, per_item[item]))
                self._count([score], None if batch_items is None else [batch_items[j]])
            else:
                (score,) = self.score(
                    [[c[j]] for c in completions],
                    prompts=None if prompts is None else [prompts[j]],
                    batch_items=None if batch_items is None else [batch_items[j]],
                )
            per_item[item] += score.failure == timed_out
            out.append(score)
            self._check_budget()
        return out

    def _given_up(self, item: str, timeouts: int) -> str:
        where = f"item {item!r}" if item else "this batch"
        return (
            f"reward_func {self.name} not called: {timeouts} joint responses of {where} timed out "
            f"(reward_timeout={self.timeout_s:g} s), so its others of the batch were given up"
        )


def score_batch(
    reward_func: Callable[..., Any],
    reward_processor: Callable[[float], float] | None,
    completions: Sequence[Sequence[str]],
    *,
    prompts: Sequence[Sequence[str]] | None = None,
    batch_items: Sequence[dict[str, Any]] | None = None,
    timeout_s: float | None = None,
) -> list[OracleScore]:
    """Score n joint responses with one batched call (:meth:`Oracle.score`, with a worker process of its own when
    ``timeout_s`` is given, stopped when it returns). Stages that score many batches keep one :class:`Oracle`.

    Returns:
        n :class:`OracleScore` in input order; a failed response has ``failure`` set and no reward.

    Raises:
        TransientError (or httpx errors judged transient): propagated for the caller's retry.
        RewardContractError: the function returned the wrong number of values.
    """
    with Oracle(reward_func, reward_processor, timeout_s) as oracle:
        return oracle.score(completions, prompts=prompts, batch_items=batch_items)
