"""Small builders shared by the stage, trainer and flow tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pbrl.config import JobConfig, parse_job
from pbrl.run import prepare_run


def tiny_job(model_dir: Path, output_dir: Path, **overrides: Any) -> JobConfig:
    """A small madpo_iter job on the toy task (4 items, 3 candidates, 8 new tokens)."""
    data: dict[str, Any] = {
        "trainer": "madpo_iter", "task": "toy", "task_options": {"num_items": 4},
        "agent_model": str(model_dir), "run_name": "run", "output_dir": str(output_dir),
        "num_iterations": 2, "preference_num_candidates": 3, "preference_pairs_per_sample": 2,
        "max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0, "agent_learning_rate": 1e-3,
        "eval_num_samples": 2, "train_batch_size": 2,
    }
    data.update(overrides)
    return parse_job(data)


def new_run(model_dir: Path, output_dir: Path, **overrides: Any) -> tuple[Path, JobConfig]:
    job = tiny_job(model_dir, output_dir, **overrides)
    return prepare_run(job, resume=False), job


def short_prompt(item: dict) -> str:
    """A formatter importable as ``tests.helpers:short_prompt`` (config import-path tests)."""
    return f"Say one word about {item['topic']}."


def long_prompt(item: dict) -> str:
    return f"Say two sentences about {item['topic']}."
