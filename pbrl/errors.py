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


class RewardContractError(ValueError):
    """reward_func broke its contract (e.g. a wrong number of values): a bug in the task, never retried or dropped."""


class SamplingError(RuntimeError):
    """Sampling cannot go on (non-finite logits or probabilities); the message names the agent and item rows."""


class RemoteServiceError(RuntimeError):
    """A remote service (the API comparator) refused, redirected or malformed a request, or kept failing until
    its retry budget was spent; the message names the status, the URL (without credentials) and what to change."""


class IsolationError(RuntimeError):
    """Untrusted code would have to run without operating-system isolation; the message says why and how to fix."""


class LabelsNeeded(RuntimeError):
    """A round judged by people (``judge: human``) has pairs without a label: the run stops (or its flow run
    suspends) until they are labelled. The message says how many, and how to label them and go on."""

    def __init__(self, message: str, *, run: str = "", round_index: int = 0, missing: int = 0) -> None:
        super().__init__(message)
        self.run, self.round_index, self.missing = run, round_index, missing


class LabelError(ValueError):
    """A submission of labels that cannot be taken (pair ids that are not asked in the round, an unknown choice),
    or a round whose labelling time ran out; the message names the pairs or the option and what to do."""


# Every error above, in one place: the front ends (CLI, Prefect log filter) show these as one `error:` line
# with no traceback, because their message already says what, where and how to fix. A class added to this
# module belongs here too; anything else is a bug and keeps its traceback.
EXPECTED_ERRORS: tuple[type[Exception], ...] = (
    ConfigError,
    ArtifactError,
    OracleError,
    TransientError,
    RewardContractError,
    SamplingError,
    RemoteServiceError,
    IsolationError,
    LabelsNeeded,
    LabelError,
)


def in_chain(exc: BaseException | None, types: type | tuple[type, ...]) -> BaseException | None:
    """``exc`` itself when it is one of ``types``, else the nearest such exception in its
    ``__cause__``/``__context__`` chain (Prefect may re-raise or wrap what a task raised); None when none."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, types):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def expected_error(exc: BaseException | None) -> Exception | None:
    """The expected error (one of ``EXPECTED_ERRORS``) behind ``exc``, or None."""
    return in_chain(exc, EXPECTED_ERRORS)  # type: ignore[return-value]
