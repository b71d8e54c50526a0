"""The Python trainers' keyword arguments as config values (docs/guides/python-api.md#the-python-api): each argument
that is not an option of the trainer named with where it belongs, ``args`` as the trainer's config, and callables,
paths and dataset specs as the values a run's config records. Module-level functions are recorded by import path so
that ``pbrl stage`` can rerun a stage later; in-memory items and other callables stay in this process.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pbrl.config import RUN_FIELDS, TRAINER_CONFIGS, TrainerConfig
from pbrl.config.dataset_spec import DatasetSpec
from pbrl.config.models import suggest
from pbrl.run.folder import generated_run_name


def _import_path(fn: Callable[..., Any]) -> str | None:
    """``"module:qualname"`` of a module-level function (None for lambdas, closures and __main__)."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "<" in qualname:
        return None
    return f"{module}:{qualname}"


def as_config_value(value: Any) -> Any:
    """A config value for ``value`` when it has one (a string, or an importable function), else None."""
    if isinstance(value, (str, Path)):
        return str(value)
    return _import_path(value) if callable(value) else None


def dataset_config_value(value: Any) -> Any:
    """The config value of a ``train_dataset`` / ``eval_dataset`` argument: a path as text, a dataset spec
    (:class:`~pbrl.config.dataset_spec.DatasetSpec` or a mapping of its fields, validated with the config), else
    None: in-memory items (a list of dicts, a ``datasets.Dataset``) stay in this process."""
    if isinstance(value, (str, Path)):
        return str(value)
    if isinstance(value, Mapping):
        return dict(value)
    return value if isinstance(value, DatasetSpec) else None


def argument_errors(trainer: str, cls_name: str, given: Mapping[str, Any], explicit: set[str]) -> list[str]:
    """One line per keyword argument that is not a run-level option of the trainer: a trainer option (set it on
    ``args``), an option of other trainers only, or unknown (with the closest names)."""
    config_cls = TRAINER_CONFIGS[trainer]
    accepted = (RUN_FIELDS - {"trainer"}) | explicit
    lines = []
    for name in given:
        if name in accepted:
            continue
        if name == "trainer":
            lines.append(f"'trainer' is set by the class ({cls_name} is '{trainer}')")
        elif name in config_cls.model_fields:
            lines.append(
                f"'{name}' is an option of {config_cls.__name__}: give it in args, e.g. "
                f"args={config_cls.__name__}({name}=...)"
            )
        elif owners := [c.__name__ for c in TRAINER_CONFIGS.values() if name in c.model_fields]:
            lines.append(f"'{name}' is not an option of {cls_name} (it belongs to {', '.join(owners)})")
        else:
            lines.append(f"unexpected argument '{name}'" + suggest(name, sorted(accepted)))
    return lines


def trainer_config(trainer: str, cls_name: str, args: Any) -> TrainerConfig:
    """``args`` as the trainer's config: None = the defaults; a mapping = its options.

    Raises:
        TypeError: naming ``args``, when it is another trainer's config or not a config at all.
        ConfigError: every problem of a mapping's options.
    """
    config_cls = TRAINER_CONFIGS[trainer]
    if args is None:
        return config_cls()
    if isinstance(args, config_cls):
        return args
    if isinstance(args, Mapping):
        return config_cls(**args)
    raise TypeError(
        f"{cls_name}: args got a {type(args).__name__}; give a {config_cls.__name__} (or a mapping of its options, "
        "or None for its defaults)"
    )


def path_text(value: Any) -> str | None:
    """A model source or folder argument as config text (None for None and for a model object)."""
    return str(value) if isinstance(value, (str, Path)) else None


def run_record(trainer: str, options: Mapping[str, Any], named: Mapping[str, Any]) -> dict[str, Any]:
    """The run-level config values of a trainer's arguments, None values left out: ``options`` (the run options
    and peft_config's LoRA options) and ``named`` (the trainer's named run arguments, by name: agents, agent_model,
    task, task_options, train_dataset, eval_dataset, report_to, run_name, output_dir, seed)."""
    agents, report_to = named["agents"], named["report_to"]
    run = {
        **options,
        "trainer": trainer,
        "run_name": named["run_name"] or generated_run_name(trainer),
        # model objects stand in as None here; the trainer names them by their saved folders
        "agents": [a if isinstance(a, str) else path_text(a) for a in agents] if agents else None,
        "agent_model": path_text(named["agent_model"]),
        "task": named["task"],
        "task_options": dict(named["task_options"]) if named["task_options"] else None,
        "train_dataset": dataset_config_value(named["train_dataset"]),
        "eval_dataset": dataset_config_value(named["eval_dataset"]),
        "report_to": report_to if report_to is None or isinstance(report_to, str) else list(report_to),
        "output_dir": path_text(named["output_dir"]),
        "seed": named["seed"],
    }
    return {k: v for k, v in run.items() if v is not None}
