"""The configuration models of pbrl (docs/reference/options.md#options-reference): one frozen pydantic model per
trainer, the run-level model,
and the flat job models (run fields + one trainer's fields) that YAML files and the Prefect flow use.

The fields are in :mod:`pbrl.config.fields` and :mod:`pbrl.config.run_fields`, the cross-field rules in
:mod:`pbrl.config.rules`; the only behaviour here is ``_Checked``, which runs the rules of the concrete class
after pydantic's field validation, and :func:`collect_problems`, which lists every problem of a mapping of
options at once. Import these names from :mod:`pbrl.config`.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Field, TypeAdapter, ValidationError, ValidationInfo, model_validator
from pydantic.fields import FieldInfo

from pbrl.config.field_types import _Fields
from pbrl.config.fields import _MADPOFields, _MADPOIterFields, _MARLHFFields, _MARLHFIterFields
from pbrl.config.messages import field_problems
from pbrl.config.notices import (
    ConfigNotice,
    Notice,
    derive_values,
    eval_interval_notice,
    madpo_kl_notice,
    madpo_no_effect_notice,
    marlhf_no_effect_notice,
)
from pbrl.config.rules import HIDDEN, SECRET_MESSAGE, Rule, run_rules
from pbrl.config.run_fields import _RunFields
from pbrl.config.run_rules import RUN_RULES, job_rules
from pbrl.config.trainer_rules import TRAINER_RULES
from pbrl.errors import ConfigError, Problem

SECRET_KEY = "comparator_api_key"
# Key of the pydantic validation context: "full" (rules + warnings, the default), "quiet" (rules only,
# for recombining a job that was already checked) or "fields" (types only, for collect_problems).
VALIDATION_MODE = "pbrl_validation"
MADPO_NOTICES: tuple[Notice, ...] = (madpo_kl_notice, madpo_no_effect_notice, eval_interval_notice)
MARLHF_NOTICES: tuple[Notice, ...] = (marlhf_no_effect_notice, eval_interval_notice)


class _Checked(_Fields):
    """Runs the cross-field rules of the concrete class after pydantic's field validation.

    Direct construction (``MADPOIterConfig(dpo_beta=0)``) raises one ConfigError listing every problem
    (types, ranges, rules, unknown options). ``model_validate`` (Prefect's parameter validation, and
    :mod:`pbrl.config.loading` after :func:`collect_problems` found nothing) keeps pydantic's
    ValidationError, in which a broken rule arrives as a value error wrapping a ConfigError.
    """

    _rules: ClassVar[tuple[Rule, ...]] = ()
    _notices: ClassVar[tuple[Notice, ...]] = ()

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as err:
            cls = type(self)
            raise ConfigError(collect_problems(cls, data) or field_problems(err, cls.model_fields, data)) from None

    # Tells pydantic this __init__ only validates, so model_validate does not call it: that path must keep
    # its validation context (VALIDATION_MODE) and pydantic's ValidationError, which Prefect reports.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    @model_validator(mode="before")
    @classmethod
    def _prepare(cls, data: Any, info: ValidationInfo) -> Any:
        """Refuse an API key (before pydantic echoes it in an "extra field" error; the reference's default
        ``comparator_api_key: null`` holds none and is dropped), then fill the options that follow from others
        (:func:`~pbrl.config.rules.derive_values`)."""
        if not isinstance(data, Mapping):
            return data
        if SECRET_KEY in data:
            if data[SECRET_KEY] is not None:
                raise ConfigError([Problem(SECRET_KEY, HIDDEN, SECRET_MESSAGE)])
            data = {k: v for k, v in data.items() if k != SECRET_KEY}
        data, notes = derive_values(data, cls.model_fields)
        if (info.context or {}).get(VALIDATION_MODE, "full") == "full":
            for text in notes:
                warnings.warn(text, ConfigNotice, stacklevel=2)
        return data

    @model_validator(mode="after")
    def _check_rules(self, info: ValidationInfo) -> _Checked:
        mode = (info.context or {}).get(VALIDATION_MODE, "full")
        if mode == "fields":
            return self
        values = dict(self)
        problems = run_rules(self._rules, values)
        if problems:
            raise ConfigError(problems)
        if mode == "full":
            given = frozenset(self.model_fields_set)
            if given >= set(type(self).model_fields):
                # Every option present: a stored job (run.json, a Prefect parameter, a recombined job) that was
                # checked when it was written; warn only about values, not about options that were given.
                given = frozenset()
            for notice in self._notices:
                for text in notice(values, given):
                    warnings.warn(text, ConfigNotice, stacklevel=2)
        return self


class MADPOConfig(_MADPOFields, _Checked):
    """MADPO (one collection, then training) trainer options."""

    _rules = TRAINER_RULES["madpo"]
    _notices = MADPO_NOTICES


class MARLHFConfig(_MARLHFFields, _Checked):
    """MARLHF (one collection, reward model, RL) trainer options."""

    _rules = TRAINER_RULES["marlhf"]
    _notices = MARLHF_NOTICES


class MADPOIterConfig(_MADPOIterFields, _Checked):
    """Iterative MADPO (rounds against a comparator, with replay) trainer options."""

    _rules = TRAINER_RULES["madpo_iter"]
    _notices = MADPO_NOTICES


class MARLHFIterConfig(_MARLHFIterFields, _Checked):
    """Iterative MARLHF trainer options."""

    _rules = TRAINER_RULES["marlhf_iter"]
    _notices = MARLHF_NOTICES


class RunConfig(_RunFields, _Checked):
    """Run-level options: trainer, seed, where the run lives, task, agents, LoRA, devices, oracle limits."""

    _rules = tuple(RUN_RULES)


class MADPOJob(_MADPOFields, _RunFields, _Checked):
    """A MADPO job: run-level and trainer options side by side (YAML files, Prefect flow parameter)."""

    trainer: Literal["madpo"] = Field("madpo", description="Trainer: 'madpo'.")
    _rules = job_rules("madpo")
    _notices = MADPO_NOTICES


class MARLHFJob(_MARLHFFields, _RunFields, _Checked):
    """A MARLHF job: run-level and trainer options side by side."""

    trainer: Literal["marlhf"] = Field("marlhf", description="Trainer: 'marlhf'.")
    _rules = job_rules("marlhf")
    _notices = MARLHF_NOTICES


class MADPOIterJob(_MADPOIterFields, _RunFields, _Checked):
    """An iterative MADPO job: run-level and trainer options side by side."""

    trainer: Literal["madpo_iter"] = Field("madpo_iter", description="Trainer: 'madpo_iter'.")
    _rules = job_rules("madpo_iter")
    _notices = MADPO_NOTICES


class MARLHFIterJob(_MARLHFIterFields, _RunFields, _Checked):
    """An iterative MARLHF job: run-level and trainer options side by side."""

    trainer: Literal["marlhf_iter"] = Field("marlhf_iter", description="Trainer: 'marlhf_iter'.")
    _rules = job_rules("marlhf_iter")
    _notices = MARLHF_NOTICES


TrainerConfig = MADPOConfig | MARLHFConfig | MADPOIterConfig | MARLHFIterConfig
JobConfig = Annotated[MADPOJob | MARLHFJob | MADPOIterJob | MARLHFIterJob, Field(discriminator="trainer")]
job_adapter: TypeAdapter[Any] = TypeAdapter(JobConfig)
# The jobs that hold a trainer's own options, for ``isinstance`` checks that narrow a job to the class that has the
# option, so that every read of it is written ``job.<option>``: the iterative trainers' rounds, comparator, replay and
# policy export (``num_iterations``, ``comparator_*``, ``preference_replay_*``, ``policy_checkpoint_dir``), and
# MARLHF's reward model and RL (``reward_*``, ``rl_algorithm``, ``critic_*``).
IterativeJob = MADPOIterJob | MARLHFIterJob
RewardModelJob = MARLHFJob | MARLHFIterJob

TRAINER_CONFIGS: dict[str, type] = {
    "madpo": MADPOConfig,
    "marlhf": MARLHFConfig,
    "madpo_iter": MADPOIterConfig,
    "marlhf_iter": MARLHFIterConfig,
}
JOB_CLASSES: dict[str, type] = {
    "madpo": MADPOJob,
    "marlhf": MARLHFJob,
    "madpo_iter": MADPOIterJob,
    "marlhf_iter": MARLHFIterJob,
}
RUN_FIELDS: frozenset[str] = frozenset(RunConfig.model_fields)
# Every option of every job by name (an option has the same type in every job that has it).
ALL_FIELDS: dict[str, FieldInfo] = {k: v for c in JOB_CLASSES.values() for k, v in c.model_fields.items()}
TRAINER_NAMES = ", ".join(JOB_CLASSES)


def is_iterative(trainer: str) -> bool:
    """True for the round-based trainers ('madpo_iter', 'marlhf_iter'). Raises ConfigError for unknown names."""
    if trainer not in JOB_CLASSES:
        raise ConfigError([Problem("trainer", trainer, f"allowed: {TRAINER_NAMES}")])
    return trainer.endswith("_iter")


MARLHF_TRAINERS = ("marlhf", "marlhf_iter")


def is_marlhf(trainer: str) -> bool:
    """Whether ``trainer`` fits a reward model and learns by RL (MARLHF, base or iterative)."""
    return trainer in MARLHF_TRAINERS


def num_rounds(job: Any) -> int:
    """Rounds of a run: base trainers collect once; iterative trainers run ``num_iterations`` rounds."""
    return job.num_iterations if is_iterative(job.trainer) else 1


def collect_problems(cls: type[BaseModel], data: Mapping[str, Any]) -> list[Problem]:
    """Every problem of ``data`` as options of ``cls`` (a config, RunConfig or job class).

    Pydantic's type/range errors (one per option), the rules of ``cls`` run on a best-effort set of values
    (the valid given ones plus defaults; a rule reading an invalid option is skipped, so one mistake gives
    one problem), and unknown options. Sorted by field order, unknown options last.
    """
    known = {k: v for k, v in data.items() if k in cls.model_fields}
    values, invalid, problems = _validate_fields(cls, known)
    problems += run_rules(getattr(cls, "_rules", ()), values, invalid) + _unknown_problems(data, cls)
    order = {name: i for i, name in enumerate(cls.model_fields)}
    return sorted(problems, key=lambda p: order.get(p.field, len(order)))


def _unknown_problems(data: Mapping[str, Any], cls: type[BaseModel]) -> list[Problem]:
    problems = []
    jobs = {c: f"trainer '{t}'" for t, c in JOB_CLASSES.items()}
    for key, value in data.items():
        if key in cls.model_fields or (key == SECRET_KEY and value is None):
            continue
        owners = [t for t, c in TRAINER_CONFIGS.items() if key in c.model_fields]
        if key == SECRET_KEY:
            problems.append(Problem(key, HIDDEN, SECRET_MESSAGE))
        elif key in RUN_FIELDS:
            problems.append(Problem(key, value, f"a run-level option (RunConfig), not an option of {cls.__name__}"))
        elif owners:
            problems.append(
                Problem(
                    key,
                    value,
                    f"not an option of {jobs.get(cls, cls.__name__)}; it belongs to trainer(s) " + ", ".join(owners),
                )
            )
        else:
            problems.append(Problem(str(key), value, "unknown option" + suggest(str(key), cls.model_fields)))
    return problems


def suggest(key: str, names: Iterable[str]) -> str:
    """``"; did you mean 'dpo_beta'?"`` for the closest option names, or ``""``."""
    close = difflib.get_close_matches(key, sorted(names), n=3)
    return "; did you mean " + " or ".join(repr(c) for c in close) + "?" if close else ""


def _validate_fields(cls: type[BaseModel], known: dict[str, Any]) -> tuple[dict[str, Any], frozenset[str], list]:
    """(validated values with defaults for the invalid options, the invalid options, their problems)."""
    fields_only = {VALIDATION_MODE: "fields"}
    try:
        return dict(cls.model_validate(known, context=fields_only)), frozenset(), []
    except ValidationError as err:
        problems = field_problems(err, cls.model_fields, known)
    invalid = frozenset(p.field for p in problems)
    try:
        rest = {k: v for k, v in known.items() if k not in invalid}
        return dict(cls.model_validate(rest, context=fields_only)), invalid, problems
    except ValidationError:  # e.g. a required option is missing: no best-effort values, so no rule can run
        return {}, frozenset(cls.model_fields), problems


def is_centralized(job: Any) -> bool:
    """Whether one actor writes every role (``collaboration_mode: centralized``)."""
    return job.collaboration_mode == "centralized"


def num_actors(job: Any) -> int:
    """The number of policies of the job: 1 in centralized collaboration, else ``num_agents``."""
    return 1 if is_centralized(job) else job.num_agents


def actor_job(job: Any) -> Any:
    """The job as the stages that load, sample, pair and train policies see it: ``num_agents`` = the actors.

    Decentralized: ``job`` itself. Centralized: a copy with ``num_agents=1`` (the roles are then
    ``len(task.formatters)``; resolve the task with the job itself, before this view).
    """
    return job.model_copy(update={"num_agents": 1}) if is_centralized(job) and job.num_agents != 1 else job
