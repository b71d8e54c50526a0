"""Shared by the config tests: the trainer names, a minimal job of each, and the problems a job gives."""

from __future__ import annotations

from typing import Any

import pytest

from pbrl.config import parse_job
from pbrl.errors import ConfigError, Problem

TRAINERS = ("madpo", "marlhf", "madpo_iter", "marlhf_iter")
ITERATIVE = ("madpo_iter", "marlhf_iter")
MARLHF = ("marlhf", "marlhf_iter")
SECRET = "sk-test-0123456789abcdef"


def minimal(trainer: str) -> dict[str, Any]:
    return {"trainer": trainer, "task": "toy", "agent_model": "some/path"}


def problems_of(data: dict[str, Any]) -> list[Problem]:
    with pytest.raises(ConfigError) as info:
        parse_job(data)
    return info.value.problems
