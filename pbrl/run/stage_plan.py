"""Which stages a round of a run calls, in order (docs/design/stages.md): pipeline knowledge, kept out of the
storage layer, which knows only the names of the manifests a round folder can hold
(:data:`pbrl.data.storage.STAGES`)."""

from __future__ import annotations

from pbrl.config import is_marlhf
from pbrl.data.storage import STAGES


def trainer_stages(trainer: str, *, judged: bool = False, scored: bool = True) -> tuple[str, ...]:
    """The stages of a round of ``trainer``: fit-reward-model belongs to the MARLHF trainers only, judge-pairs to
    runs whose preferences come from a judge (``judged``), score-with-oracle to runs whose task has a reward
    (``scored``)."""
    skipped = {
        "fit-reward-model": not is_marlhf(trainer),
        "judge-pairs": not judged,
        "score-with-oracle": not scored,
    }
    return tuple(s for s in STAGES if not skipped.get(s, False))
