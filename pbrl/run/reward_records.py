"""The joint reward model in a run folder (docs/design/file-formats.md#the-run-folder): where a round's fitted model
and its pairs' joint input ids live, and the newest model fitted before a round, read from the fit-reward-model
manifests. The model and its scorer take these paths as plain values (:mod:`pbrl.learning.reward_scoring`).
"""

from __future__ import annotations

from pathlib import Path

from pbrl.data.storage import RunPaths, read_manifest

PAIR_JOINT_IDS_FILE = "pair_joint_ids.parquet"  # rounds/<r>/: the pairs' joint input ids (build-pairs)
REWARD_MODEL_DIR = "reward_model"  # rounds/<r>/reward_model/: the fitted model (fit-reward-model)
FIT_STAGE = "fit-reward-model"  # the stage whose manifest says whether (and where) a round fitted a model


def reward_model_dir(round_dir: Path) -> Path:
    """``rounds/<r>/reward_model/``."""
    return Path(round_dir) / REWARD_MODEL_DIR


def pair_joint_ids_path(round_dir: Path) -> Path:
    """``rounds/<r>/pair_joint_ids.parquet``."""
    return Path(round_dir) / PAIR_JOINT_IDS_FILE


def newest_reward_model(paths: RunPaths, before_round: int) -> tuple[int, Path] | None:
    """The newest fitted reward model of a round < ``before_round``: (round, folder), from the
    fit-reward-model manifests (``details.fitted``); None when none exists yet.

    Raises:
        ArtifactError: a fit-reward-model manifest is malformed.
    """
    for r in range(before_round - 1, 0, -1):
        manifest = read_manifest(paths, r, FIT_STAGE)
        if manifest is not None and manifest.details.get("fitted"):
            return r, paths.root / manifest.details["reward_model"]
    return None
