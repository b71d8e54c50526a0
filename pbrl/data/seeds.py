"""One helper derives every seed of a run, so that each random stream is independent and reproducible."""

from __future__ import annotations

import hashlib

import numpy as np

SEED_BITS = 63


def derive_seed(
    seed: int,
    *,
    round_index: int,
    stage: str,
    side: str = "",
    agent: int = -1,
    item: str | int = "",
    index: int = -1,
) -> int:
    """Derive a 63-bit seed from ``(seed, round, stage, side, agent, item, index)``.

    The tuple is hashed with SHA-256, so any change of any part gives an unrelated stream: the target
    and comparator sides of the same agent and item never share samples, and a resumed run derives
    exactly the same seeds. ``index`` distinguishes draws inside one item (a candidate index).

    Returns:
        An int in [0, 2**63).
    """
    key = f"{int(seed)}|{int(round_index)}|{stage}|{side}|{int(agent)}|{item}|{int(index)}"
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") >> (64 - SEED_BITS)


def numpy_rng(seed: int, **parts: object) -> np.random.Generator:
    """A numpy Generator seeded by :func:`derive_seed` (same keyword parts)."""
    return np.random.default_rng(derive_seed(seed, **parts))  # type: ignore[arg-type]
