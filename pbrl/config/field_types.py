"""The strict scalar types and the base model of every field group of the pbrl configuration
(:mod:`pbrl.config.fields`, :mod:`pbrl.config.iterative_fields`, :mod:`pbrl.config.run_fields`).

Scalars are strict: ``true`` is not the number 1 and ``2024`` is not the string ``'2024'`` (a YAML user
who writes ``num_iterations: true`` or ``run_name: 2024`` gets an error, not a silent conversion). The one
conversion kept is int -> float (``dpo_beta: 1`` is 1.0), which loses nothing.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, Strict

# Strict scalars (pydantic's StrictInt ... spelled out so the JSON schema and error types stay the plain ones).
StrictInt = Annotated[int, Strict()]
StrictFloat = Annotated[float, Strict()]  # strict float still takes an int (1 -> 1.0), never a bool or a string
StrictBool = Annotated[bool, Strict()]
StrictStr = Annotated[str, Strict()]
NonEmptyStr = Annotated[str, Strict(), Field(min_length=1)]
DeviceSpec = NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)] | None
NameList = Annotated[list[NonEmptyStr], Field(min_length=1)]
# The longest a time limit may be: a week. Beyond about 9.2e9 s Python's clocks and waits overflow (a judge_timeout of
# 1e10 failed every comparison with "timestamp too large"), and no stage step waits a week.
MAX_TIMEOUT_S = 7 * 24 * 3600
MAX_TIMEOUT_H = 365 * 24  # hours: a year (judge_label_timeout_hours)


class _Fields(BaseModel):
    # hide_input_in_errors: a raw pydantic error must never print a value that may be a secret.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, hide_input_in_errors=True)
