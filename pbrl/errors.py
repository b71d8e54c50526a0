"""The exceptions pbrl raises on purpose. Each message names the field, file or item at fault."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One configuration problem: the field, the bad value and what would be accepted."""

    field: str
    value: object
    message: str

    def __str__(self) -> str:
        return f"{self.field}: got {self.value!r}; {self.message}"


class ConfigError(ValueError):
    """Every problem of a configuration at once (never only the first)."""

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} configuration problem(s):\n{lines}")


class ArtifactError(RuntimeError):
    """A stored file is missing, incomplete or malformed. The message names the file and the field."""


class OracleError(RuntimeError):
    """Too many joint responses could not be scored; the message names the items."""


class TransientError(RuntimeError):
    """A failure worth retrying (timeouts, rate limits, 5xx). Anything else is not retried."""
