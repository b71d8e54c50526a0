"""Which Prefect tasks retry, and when: only I/O-bound stages (remote judges in score-with-oracle; sample-candidates,
whose stored API answers a retry would reuse) and their shards, only on a transient error
(:func:`pbrl.preference.oracle.is_transient`). Training never retries: a failed update resumes from its manifests.

One retry budget per request: the API comparator's client (:mod:`pbrl.generation.api_transport`) retries its own
requests (``max_attempts`` sends, backoff, ``Retry-After`` up to a cap) and, when that budget is spent, raises a
*non-transient* :class:`~pbrl.generation.api_errors.ApiComparatorError`, so these stage retries never multiply its
requests (before: 5 sends x 4 stage attempts = 20, reported as 5) and its message counts the requests really sent.
:func:`retry_transient` also declines any API comparator error explicitly, should one ever be made transient. The
stage retries below are thus the only retries of everything else (a reward function's remote judge raising
:class:`~pbrl.errors.TransientError`)."""

from __future__ import annotations

from typing import Any

from pbrl.errors import in_chain
from pbrl.generation.api_errors import ApiComparatorError
from pbrl.preference.oracle import is_transient

RETRYING_STAGES = frozenset({"score-with-oracle", "judge-pairs", "sample-candidates"})


def retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect's ``retry_condition_fn``: retry when the failed state's exception is transient, unless it is the API
    comparator's (its client already spent the request's one retry budget)."""
    try:
        state.result()
    except Exception as exc:
        return is_transient(exc) and in_chain(exc, ApiComparatorError) is None
    return False


# Prefect's retry settings for a retrying stage or shard: 3 retries after about 1, 4 and 16 s.
TRANSIENT_RETRIES: dict[str, Any] = {
    "retries": 3,
    "retry_delay_seconds": [1, 4, 16],
    "retry_jitter_factor": 0.2,
    "retry_condition_fn": retry_transient,
}


def retry_options(stage: str) -> dict[str, Any]:
    """The retry keyword arguments of ``stage``'s Prefect task (no retries for the other stages)."""
    return TRANSIENT_RETRIES if stage in RETRYING_STAGES else {"retries": 0}
