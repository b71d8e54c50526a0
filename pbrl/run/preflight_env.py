"""Preflight checks of what the config asks of this machine: devices this torch has, folders the run can create,
a thread count the CPUs can run, a config Prefect can store, and a centralized adapter that keeps its contract.

Each check covers a kind of option, found by its name where the kind is in the name (``*_device``/``*_devices``,
``*_dir``), so that an option added later is checked with its kind (``tests/unit/run/test_validate_property.py``
derives the kinds from the options reference and checks that ``validate`` refuses every bad value ``train`` would).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from pbrl.config import JobConfig
from pbrl.errors import ConfigError, Problem
from pbrl.generation.centralized import ADAPTER_FIELD, CentralizedAdapter, parse_roles
from pbrl.models.packaged import storage_root
from pbrl.models.placement import AUTO

# Prefect's limit on a flow run's parameters, JSON-serialised (``PREFECT_SERVER_API_MAX_PARAMETER_SIZE``, default
# 512 KiB in Prefect 3): the training flow takes the job as a parameter. Read here without importing Prefect, which
# ``pbrl validate`` never imports.
PREFECT_PARAMETER_LIMIT_ENV = "PREFECT_SERVER_API_MAX_PARAMETER_SIZE"
PREFECT_PARAMETER_LIMIT_DEFAULT = 524_288

DEVICE_SUFFIXES = ("_device", "_devices")
FOLDER_SUFFIX = "_dir"


def options_named(job: JobConfig, suffixes: str | tuple[str, ...]) -> dict[str, Any]:
    """The job's options whose names end with ``suffixes`` (``*_device``/``*_devices``: devices, ``*_dir``: folders
    the run writes), with their values, in field order."""
    return job.model_dump(include={name for name in type(job).model_fields if name.endswith(suffixes)})


def unavailable_device(device: str) -> str | None:
    """Why this torch cannot place a model on ``device`` ('cpu', 'cuda:1', 'mps', ...), or None when it can.

    'meta' holds no data (a model there cannot compute); a CUDA, XPU or MPS device must exist with that index.
    """
    kind, _, index_text = device.partition(":")
    index = int(index_text) if index_text.isdigit() else 0
    if kind == "cpu":
        return None
    if kind == "meta":
        return "the meta device holds no weights: a model there cannot compute; give 'cpu' or a GPU"
    backends: dict[str, tuple[Any, Any]] = {
        "cuda": (torch.cuda.is_available, torch.cuda.device_count),
        "xpu": (_xpu_available, _xpu_count),
        "mps": (torch.backends.mps.is_available, lambda: 1),
    }
    if kind not in backends:
        return f"{kind!r} is not a device pbrl places models on ('cpu', 'cuda:N', 'xpu:N', 'mps')"
    available, count = backends[kind]
    if not available():
        return f"this torch ({torch.__version__}) has no {kind} device on this machine"
    if index >= count():
        return f"this machine has {count()} {kind} device(s) (indices 0..{count() - 1})"
    return None


def _xpu_available() -> bool:
    return bool(getattr(torch, "xpu", None) and torch.xpu.is_available())


def _xpu_count() -> int:
    return torch.xpu.device_count() if _xpu_available() else 0


def device_problems(job: JobConfig) -> list[Problem]:
    """Every device option naming a device this torch does not have on this machine; none with ``runner: ray``,
    whose devices are the cluster's (a CPU-only head node submits to GPU workers: docs/guides/ray.md)."""
    if job.runner == "ray":
        return []
    problems = []
    for name, spec in options_named(job, DEVICE_SUFFIXES).items():
        devices = [spec] if isinstance(spec, str) else list(spec or [])
        for device in dict.fromkeys(devices):
            if device != AUTO and (why := unavailable_device(device)):
                problems.append(Problem(name, spec, f"{device!r}: {why}"))
    return problems


def unwritable_folder(path: Path) -> str | None:
    """Why a folder cannot be created (or used) at ``path``: it, or a parent, is a file; or the nearest existing
    parent cannot be written. None when it can."""
    for part in (path, *path.parents):
        if part.exists() or part.is_symlink():
            if not part.is_dir():
                where = "is a file" if part == path else f"lies under {part}, which is a file"
                return f"{path} {where}, not a folder"
            if part != path and not os.access(part, os.W_OK | os.X_OK):
                return f"{path} cannot be created: {part} is not writable"
            return None
    return None


def folder_problems(job: JobConfig, *, packaged_models: bool) -> list[Problem]:
    """Folder options that name a file (or lie under one), and the models' storage (``PBRL_STORAGE``, where packaged
    models are converted and model objects saved) when ``packaged_models`` (the job stores a model there)."""
    problems = []
    for name, value in options_named(job, FOLDER_SUFFIX).items():
        if isinstance(value, str) and (why := unwritable_folder(Path(value).expanduser())):
            problems.append(Problem(name, value, why))
    if packaged_models and (why := unwritable_folder(storage_root() / "models")):
        problems.append(
            Problem("agent_model", "PBRL_STORAGE", f"pbrl stores models (packaged ones, model objects) there: {why}")
        )
    return problems


def thread_problems(job: JobConfig) -> list[Problem]:
    """``num_threads`` above the CPUs of this machine (its threads would only wait on each other, and OpenMP fails
    to start a pool of millions)."""
    threads = job.num_threads
    cpus = os.cpu_count() or 1
    if threads is None or threads <= cpus:
        return []
    return [Problem("num_threads", threads, f"this machine has {cpus} CPUs; give at most {cpus}, or None")]


def parameter_size_problems(job: JobConfig) -> list[Problem]:
    """The job larger than Prefect lets a flow run store as its parameters (the training flow's parameter)."""
    limit_text = os.environ.get(PREFECT_PARAMETER_LIMIT_ENV, "")
    limit = int(limit_text) if limit_text.isdigit() else PREFECT_PARAMETER_LIMIT_DEFAULT
    size = len(json.dumps(job.model_dump(mode="json")).encode())
    if not limit or size <= limit:
        return []
    values = dict(job)  # each option's value as the job holds it (a DatasetSpec as itself, as str() shows it)
    largest = max(values, key=lambda n: len(json.dumps(values[n], default=str)))
    return [
        Problem(
            largest,
            f"<{size:,} bytes of config>",
            f"the config is {size:,} bytes as JSON; Prefect stores at most {limit:,} bytes of a flow run's "
            f"parameters ({PREFECT_PARAMETER_LIMIT_ENV}); move large values into files (datasets, task_options)",
        )
    ]


ADAPTER_PROBES = ("", "<agent_1>a</agent_1><agent_2>b</agent_2>", "a\nb")


def adapter_problems(adapter: CentralizedAdapter, num_roles: int, item: dict[str, Any] | None) -> list[Problem]:
    """A centralized adapter's contract, tried on probe texts: ``build_prompt`` returns a string and
    ``parse_completion`` a list of ``num_roles`` strings or :class:`~pbrl.generation.centralized.CentralizedParseError`
    (anything else fails every joint response of a round)."""
    problems: list[Problem] = []
    name = type(adapter).__name__
    if item is not None:
        try:
            prompt = adapter.build_prompt(item, [f"prompt of role {i + 1}" for i in range(num_roles)])
        except Exception as exc:
            prompt = None
            problems.append(Problem(ADAPTER_FIELD, name, f"build_prompt raised {exc!r}"[:300]))
        else:
            if not isinstance(prompt, str):
                problems.append(Problem(ADAPTER_FIELD, name, f"build_prompt returned {type(prompt).__name__}"))
    for text in ADAPTER_PROBES:
        try:
            parse_roles(adapter, text, num_roles)
        except ConfigError as exc:
            return problems + exc.problems
        except Exception as exc:
            problems.append(Problem(ADAPTER_FIELD, name, f"parse_completion raised {exc!r}"[:300]))
            break
    return problems
