"""The live log of an update publishes on the env-step axis the round's train log records (issue #56's review:
MARLHF's live log counted the job's environment_steps_per_pair, 2 by default, where its train log counts 1)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pbrl.config import load_job
from pbrl.run.round_checkpoint import LiveLog

CONFIGS = Path(__file__).resolve().parents[3] / "flows" / "configs"


class _Record:
    """The one method LiveLog calls on a stage record."""

    def __init__(self) -> None:
        self.lines: list[tuple[int, dict[str, float], Any]] = []

    def log(self, step: int, metrics: dict[str, float], *, env_step: Any) -> None:
        self.lines.append((step, metrics, env_step))


def _published(steps_per_pair: int, tmp_path: Path) -> list[Any]:
    job = load_job(CONFIGS / "tiny-madpo-iter.yaml", ["logging_steps=1"])  # the job's environment_steps_per_pair: 2
    record = _Record()
    live = LiveLog(record, job, tmp_path, steps_per_pair)  # tmp_path: an initial checkpoint, no trainer state
    for batch in (3, 4):
        live.step(batch, {"loss": 0.5, "nan": float("nan")})
    return record.lines


def test_the_live_log_counts_the_steps_per_pair_it_is_given_not_the_jobs(tmp_path):
    assert [env for _, _, env in _published(1, tmp_path)] == [3, 7]  # RL: one env step per joint response
    assert [env for _, _, env in _published(2, tmp_path)] == [6, 14]  # MADPO: the job's 2 per pair
    assert [(step, metrics) for step, metrics, _ in _published(1, tmp_path)] == [(1, {"loss": 0.5}), (2, {"loss": 0.5})]
