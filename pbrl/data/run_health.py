"""What ``pbrl status`` and ``pbrl report`` verify before they show a run: that every output a stage's manifest
lists is still there with the recorded content hash and, for Parquet tables, still readable; and that ``rounds/``
holds only the rounds of this run. Each damage is named with its fix (``pbrl stage … --force`` reruns the stage
that wrote it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from pbrl.data.storage import STAGES, RunPaths, StageManifest, hash_path, last_round, read_manifest
from pbrl.errors import ArtifactError

ROUND_FOLDER = re.compile(r"\d{4}")


@dataclass(frozen=True)
class Damage:
    """One output of a stage that cannot be trusted: ``path`` (run-relative) and ``why``."""

    stage: str
    round_index: int
    path: str
    why: str

    def advice(self, run_dir: Path) -> str:
        """The line ``pbrl status`` prints: what is wrong, where, and the command that writes it again."""
        return (
            f"{self.path}: {self.why}; write it again with `pbrl stage {self.stage} --run {run_dir} "
            f"--round {self.round_index} --force` (or `pbrl train --resume`, which reruns what follows too)"
        )


def damaged_outputs(paths: RunPaths, manifest: StageManifest, round_index: int, stage: str) -> list[Damage]:
    """What cannot be trusted of the manifest found as ``stage`` of round ``round_index``: the manifest itself when
    it records another stage or round (copied there), and the outputs it lists that are missing, changed since the
    stage wrote them (another content hash: an edit, a truncation, a copy gone wrong) or, for ``.parquet`` files, no
    longer readable as Parquet."""
    if (manifest.round_index, manifest.stage) != (round_index, stage):
        where = paths.rel(paths.manifest(round_index, stage))
        why = f"records {manifest.stage} of round {manifest.round_index}: copied from elsewhere, not this round's"
        return [Damage(stage, round_index, where, why)]
    found = []
    for rel, digest in manifest.outputs.items():
        path = paths.root / rel
        if not path.exists():
            why = "missing"
        elif hash_path(path) != digest:
            why = "changed since its stage wrote it (its content hash differs from the manifest's)"
            if path.suffix == ".parquet" and not _readable_parquet(path):
                why = "truncated or damaged: not a readable Parquet file, and " + why
        else:
            continue
        found.append(Damage(manifest.stage, manifest.round_index, rel, why))
    return found


def _readable_parquet(path: Path) -> bool:
    import pyarrow as pa  # deferred: `pbrl --help` and `pbrl validate` answer without it
    import pyarrow.parquet as pq

    try:
        pq.read_metadata(path)
    except (OSError, pa.ArrowException):
        return False
    return True


def round_folders(paths: RunPaths, last_round: int | None) -> tuple[list[int], list[str]]:
    """``rounds/``'s entries as (the rounds of this run: ``0000`` to ``last_round`` (None: every number), in order;
    every other entry, run-relative: a round past the run's last, a name that is no round number, a file)."""
    base = paths.root / "rounds"
    if not base.is_dir():
        return [], []
    rounds, unexpected = [], []
    for entry in sorted(base.iterdir()):
        if (
            entry.is_dir()
            and ROUND_FOLDER.fullmatch(entry.name)
            and (last_round is None or int(entry.name) <= last_round)
        ):
            rounds.append(int(entry.name))
        else:
            unexpected.append(paths.rel(entry))
    return rounds, unexpected


def damage_lines(paths: RunPaths) -> list[str]:
    """Every damage of the run as ``pbrl status`` and ``pbrl report`` print it: each stage output that cannot be
    trusted with its fix, then each entry of ``rounds/`` that is not a round of this run.

    Raises:
        ArtifactError: run.json or a manifest is malformed (named).
    """
    try:
        last: int | None = last_round(paths)
    except ArtifactError:
        last = None  # a damaged run.json: every numbered folder is taken for a round
    rounds, unexpected = round_folders(paths, last)
    lines = [
        damage.advice(paths.root)
        for r in rounds
        for stage in STAGES
        if (manifest := read_manifest(paths, r, stage)) is not None
        for damage in damaged_outputs(paths, manifest, r, stage)
    ]
    lines += [
        f"{entry}: not a round of this run (rounds 0..{last}); pbrl neither reads nor shows it: move it out of rounds/"
        for entry in unexpected
    ]
    return lines
