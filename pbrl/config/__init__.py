"""The pbrl configuration (docs/reference/options.md#options-reference): import every configuration name from here.

One frozen pydantic model per trainer (``MADPOConfig``, ``MARLHFConfig``, ``MADPOIterConfig``,
``MARLHFIterConfig``), the run-level ``RunConfig``, and flat job models (run fields + one trainer's
fields) that YAML files and the Prefect flow parameter use. Option names and defaults are the reference
library's (CoMLRL ``comlrl.trainers.preference``) except the ★ changes of docs/reference/options.md#options-reference.
There are no aliases,
no normalisation and no type coercion: ``'td-lambda'`` is an error, not ``'lambda_decay'``, and ``true`` is
not 1. Every entry (:func:`parse_job`, :func:`load_job`, :func:`make_job`, direct construction such as
``MADPOConfig(dpo_beta=0)``) raises one :class:`~pbrl.errors.ConfigError` listing every problem at once.

The code is split along its seams:

* :mod:`pbrl.config.fields` — the fields: types, defaults, ranges, descriptions (the Prefect UI form),
  per trainer (iterative ones in :mod:`pbrl.config.iterative_fields`) and per run (:mod:`pbrl.config.run_fields`);
* :mod:`pbrl.config.rules` — the cross-field rules;
* :mod:`pbrl.config.notices` — warnings about valid options (no effect in pbrl) and options derived from others;
* :mod:`pbrl.config.messages` — pydantic's errors in pbrl's wording;
* :mod:`pbrl.config.models` — the models, their registries, the job groups that narrow a job to its trainer's
  options (``isinstance(job, IterativeJob)``) and :func:`collect_problems`;
* :mod:`pbrl.config.loading` — mappings, YAML files and overrides to jobs; jobs to run + trainer; hashing.
"""

from __future__ import annotations

from pbrl.config.loading import (
    apply_overrides,
    config_hash,
    load_job,
    make_job,
    parse_config,
    parse_job,
    parse_override,
    read_yaml,
    split_job,
    stage_config_hash,
)
from pbrl.config.models import (
    ALL_FIELDS,
    JOB_CLASSES,
    RUN_FIELDS,
    TRAINER_CONFIGS,
    IterativeJob,
    JobConfig,
    MADPOConfig,
    MADPOIterConfig,
    MADPOIterJob,
    MADPOJob,
    MARLHFConfig,
    MARLHFIterConfig,
    MARLHFIterJob,
    MARLHFJob,
    RewardModelJob,
    RunConfig,
    TrainerConfig,
    actor_job,
    collect_problems,
    is_centralized,
    is_iterative,
    is_marlhf,
    job_adapter,
    num_actors,
    num_rounds,
)
from pbrl.config.notices import ConfigNotice

__all__ = [
    "ALL_FIELDS",
    "JOB_CLASSES",
    "RUN_FIELDS",
    "TRAINER_CONFIGS",
    "JobConfig",
    "IterativeJob",
    "RewardModelJob",
    "TrainerConfig",
    "RunConfig",
    "job_adapter",
    "MADPOConfig",
    "MARLHFConfig",
    "MADPOIterConfig",
    "MARLHFIterConfig",
    "MADPOJob",
    "MARLHFJob",
    "MADPOIterJob",
    "MARLHFIterJob",
    "ConfigNotice",
    "apply_overrides",
    "collect_problems",
    "config_hash",
    "actor_job",
    "is_centralized",
    "is_iterative",
    "is_marlhf",
    "load_job",
    "num_actors",
    "num_rounds",
    "make_job",
    "parse_config",
    "parse_job",
    "parse_override",
    "read_yaml",
    "split_job",
    "stage_config_hash",
]
