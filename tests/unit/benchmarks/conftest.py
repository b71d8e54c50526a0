"""The benchmarks' shared fixture: one stored MARLHF run that the refit scripts read (``reward_head.py``,
``replay_refit.py``), built once for the folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from pbrl import orchestration
from pbrl.config import load_job
from tests.flow.test_marlhf import ITER_YAML


@pytest.fixture(scope="package")
def frozen_marlhf_run(tmp_path_factory: pytest.TempPathFactory, prefect_api) -> Path:
    """A two-round tiny MARLHF run with a frozen reward-model backbone and ``all_history`` replay (read-only: a test
    that changes it works on a copy; ``replay_refit.py`` copies it itself)."""
    out = tmp_path_factory.mktemp("frozen-marlhf")
    settings = [
        "reward_freeze_backbone=true",
        "reward_pooling=segments",
        "reward_head_components=2",
        "preference_replay_mode=all_history",
    ]
    orchestration.train(load_job(ITER_YAML, [f"output_dir={out}", "run_name=run", *settings]))
    return out / "run"
