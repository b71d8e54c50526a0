"""Which Prefect tasks retry, and when: only I/O-bound stages (remote judges; API comparators, whose stored
answers a retry reuses) and their shards, only on a transient error (:func:`pbrl.preference.oracle.is_transient`).
Training never retries: a failed update resumes from its manifests."""

from __future__ import annotations

from typing import Any

from pbrl.preference.oracle import is_transient

RETRYING_STAGES = frozenset({"score-with-oracle", "sample-candidates"})


def retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect's ``retry_condition_fn``: retry when the failed state's exception is transient."""
    try:
        state.result()
    except Exception as exc:
        return is_transient(exc)
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
