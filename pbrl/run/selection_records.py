"""A round's replay selection in a run folder (``rounds/<r>/selected_pairs.parquet``, written by replay-select):
the rounds its pairs come from, which fit-reward-model and update-policies read their pairs from."""

from __future__ import annotations

from pbrl.data.schema import SELECTED_PAIRS
from pbrl.data.storage import RunPaths
from pbrl.data.tables import read_rows


def selected_source_rounds(paths: RunPaths, round_index: int) -> list[int]:
    """The source rounds of round ``round_index``'s selected pairs, ascending, each once.

    Raises:
        ArtifactError: ``selected_pairs.parquet`` is missing or does not have its schema.
    """
    return sorted({r["source_round"] for r in read_rows(paths.selected_pairs(round_index), SELECTED_PAIRS)})
