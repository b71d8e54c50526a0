"""Export of a run's policy checkpoints to ``policy_checkpoint_dir`` in the reference's layout.

The reference (CoMLRL ``MADPOIterTrainer._save_policy_checkpoint``, notes/reference-library.md §2.11) writes
``<policy_checkpoint_dir>/initial/agent_<i>/`` at the start and ``iteration_<idx:04d>/agent_<i>/`` after each
iteration, with a **0-based** index (``iteration_0000`` = after the first iteration). pbrl keeps its own
checkpoints in the run folder (``checkpoints/initial``, ``checkpoints/round_<rrrr>``, 1-based); with
``policy_checkpoint_dir`` set, each one is also copied there under the reference's name, so tools written for
the reference find them. The copy holds what the run's agent folder holds (full weights or the LoRA adapter,
tokenizer files when saved; for full fine-tuning ``initial/agent_<i>`` holds ``source.json`` naming the base
model), without the optimizer state (the reference exports none).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from pbrl.data.storage import atomic_dir

OPTIMIZER_FILE = "optimizer.pt"


def reference_label(round_index: int) -> str:
    """The reference's folder name of the policy after pbrl round ``round_index``: 0 -> ``initial``,
    r >= 1 -> ``iteration_<r-1:04d>`` (round 1 -> ``iteration_0000``).

    Raises:
        ValueError: a negative round.
    """
    if round_index < 0:
        raise ValueError(f"round_index: got {round_index}; must be >= 0")
    return "initial" if round_index == 0 else f"iteration_{round_index - 1:04d}"


def export_policy_checkpoint(checkpoint: str | Path, export_dir: str | Path, round_index: int, num_agents: int) -> Path:
    """Copy ``checkpoint/agent_<i>/`` (i < num_agents) to ``export_dir/<reference_label(round)>/agent_<i>/``.

    The folder is assembled under a temporary name and renamed, so an interrupted export leaves no partial
    folder under the final name; an existing export of the same round is replaced.

    Returns:
        The exported folder.

    Raises:
        FileNotFoundError: an agent folder is missing from ``checkpoint`` (names it).
    """
    checkpoint = Path(checkpoint)
    sources = [checkpoint / f"agent_{i}" for i in range(num_agents)]
    for source in sources:
        if not source.is_dir():
            raise FileNotFoundError(f"{source}: no such agent checkpoint folder to export")
    dest = Path(export_dir) / reference_label(round_index)
    with atomic_dir(dest) as tmp:
        for i, source in enumerate(sources):
            shutil.copytree(source, tmp / f"agent_{i}", ignore=shutil.ignore_patterns(OPTIMIZER_FILE))
    return dest
