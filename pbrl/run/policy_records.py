"""Which policy checkpoint a round's manifests name (docs/design/file-formats.md#checkpoints): the run-folder
knowledge behind every "the policy after round r". Library code (:mod:`pbrl.models.policies`,
:mod:`pbrl.generation`) takes the resolved checkpoint folder as a plain path; the stages and :mod:`pbrl.run`
resolve it here.
"""

from __future__ import annotations

from pathlib import Path

from pbrl.data.storage import RunPaths, read_manifest
from pbrl.errors import ArtifactError
from pbrl.models.policies import TRAINER_STATE

UPDATE_STAGE = "update-policies"  # the stage whose manifest names the policy after its round


def policy_checkpoint(paths: RunPaths, round_index: int) -> Path:
    """The policy after round ``round_index``, as the manifests record it.

    Round 0 (and below): ``checkpoints/initial``. Round r ≥ 1: the checkpoint named by round r's
    update-policies manifest (``details.checkpoint``): ``checkpoints/round_<r>`` when that round updated,
    the previous policy when it had no pairs. A ``checkpoints/round_<r>`` folder that the manifest does not
    name (left by an earlier attempt of the round) is never used.

    Raises:
        ArtifactError: round r's update-policies manifest is missing (that stage has not finished) or
            malformed, or the checkpoint it names is missing or incomplete.
    """
    if round_index <= 0:
        return paths.initial
    manifest_path = paths.manifest(round_index, UPDATE_STAGE)
    manifest = read_manifest(paths, round_index, UPDATE_STAGE)
    if manifest is None:
        raise ArtifactError(
            f"{manifest_path}: missing; the policy after round {round_index} is known once "
            f"{UPDATE_STAGE} of round {round_index} has finished: run it first"
        )
    rel = manifest.details.get("checkpoint")
    if not isinstance(rel, str) or not rel:
        raise ArtifactError(f"{manifest_path}: details.checkpoint missing; rerun {UPDATE_STAGE} of round {round_index}")
    checkpoint = paths.root / rel
    complete = checkpoint.is_dir() if checkpoint == paths.initial else (checkpoint / TRAINER_STATE).is_file()
    if not complete:
        raise ArtifactError(
            f"{manifest_path}: names checkpoint {rel}, which is missing or incomplete; rerun "
            f"{UPDATE_STAGE} of round {round_index}"
        )
    return checkpoint
