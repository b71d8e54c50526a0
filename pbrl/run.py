"""Creating and opening run folders: run.json, items.parquet, initial checkpoints, and the run's task."""

from __future__ import annotations

import hashlib
import inspect
import json
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

import pbrl
from pbrl.config import JobConfig, config_hash, is_iterative, parse_job
from pbrl.errors import ArtifactError, ConfigError, Problem
from pbrl.schema import ITEMS, read_rows, write_table
from pbrl.storage import RunPaths, read_json, write_json
from pbrl.tasks import Task, get_task, import_object

# Tasks given as Python objects through the trainer API, keyed by resolved run folder. Stages run in the
# same process as the trainer (Prefect's default thread runner), so they find them here.
_ATTACHED_TASKS: dict[str, Task] = {}


# The ``task`` label of a job whose task exists only as Python objects in the process that started it.
IN_PROCESS_TASK = "python"


def attach_task(run_dir: Path, task: Task) -> None:
    """Make a Python-object task (callables) available to the stages of the run in this process."""
    _ATTACHED_TASKS[str(Path(run_dir).resolve())] = task


def attached_task(run_dir: Path) -> Task | None:
    """The task attached to ``run_dir`` in this process, if any."""
    return _ATTACHED_TASKS.get(str(Path(run_dir).resolve()))


def generated_run_name(trainer: str, now: datetime | None = None) -> str:
    """The name of a run started without ``run_name`` (Python trainers, Prefect UI, deployments):
    ``<trainer>-<UTC time YYYYmmdd-HHMMSS>``."""
    return f"{trainer}-{(now or datetime.now(UTC)):%Y%m%d-%H%M%S}"


def with_run_name(job: JobConfig) -> JobConfig:
    """``job`` itself when it has a ``run_name``, else a copy with a generated one."""
    return job if job.run_name else job.model_copy(update={"run_name": generated_run_name(job.trainer)})


def run_dir_for(job: JobConfig) -> Path:
    """``<output_dir>/<run_name>``. Raises ConfigError when run_name is missing."""
    if not job.run_name:
        raise ConfigError([Problem("run_name", None, "a run needs a name (give --run-name or run_name)")])
    return Path(job.output_dir) / job.run_name


def stage_config_hash(job: JobConfig) -> str:
    """The config hash that keys stage caches: ``num_iterations`` is left out, since adding an iteration
    to a run (the nightly deployment) must not invalidate the rounds already done."""
    if is_iterative(job.trainer):
        job = job.model_copy(update={"num_iterations": 1})
    return config_hash(job)


# ---------------------------------------------------------------------------------------------- task
def resolve_task(job: JobConfig, run_dir: Path | None = None) -> Task:
    """The run's task: an attached Python task, else the registered task and/or import paths in the config.

    Raises:
        ConfigError: an import path cannot be imported, or the formatter count differs from num_agents.
    """
    if run_dir is not None and (task := attached_task(run_dir)):
        return task
    problems: list[Problem] = []
    base: Task | None = None
    if job.task == IN_PROCESS_TASK:
        raise ConfigError([Problem("task", job.task, "this run's task was given as Python objects (callables or "
                                   "in-memory items) to the trainer API and lives only in that process; give "
                                   "module-level functions and dataset files (recorded by import path and file "
                                   "name) to run its stages from the CLI or the UI")])
    if job.task:
        try:
            base = get_task(job.task, **job.task_options)
        except (KeyError, TypeError, ValueError) as exc:
            problems.append(Problem("task", job.task, str(exc).strip("'\"")))

    def _import(field: str, path: str) -> Any:
        try:
            return import_object(path)
        except ImportError as exc:
            problems.append(Problem(field, path, str(exc)))
            return None

    formatters = tuple(_import("formatters", p) for p in job.formatters) if job.formatters else None
    reward_func = _import("reward_func", job.reward_func) if job.reward_func else None
    processor = _import("reward_processor", job.reward_processor) if job.reward_processor else None
    if problems:
        raise ConfigError(problems)
    task = Task(
        name=job.task or "custom",
        formatters=formatters or (base.formatters if base else ()),
        reward_func=reward_func or (base.reward_func if base else None),  # type: ignore[arg-type]
        reward_processor=processor or (base.reward_processor if base else None),
        train_items=base.train_items if base else (),
        eval_items=base.eval_items if base else (),
        reward_range=base.reward_range if base else None,
    )
    if len(task.formatters) != job.num_agents:
        raise ConfigError(
            [Problem("formatters", len(task.formatters), f"need one formatter per agent ({job.num_agents})")]
        )
    return task


def task_fingerprint(task: Task) -> str:
    """A hash of the task's code identity (qualified names and sources) for cache keys."""
    h = hashlib.sha256()
    for fn in (*task.formatters, task.reward_func, task.reward_processor):
        if fn is None:
            continue
        h.update(f"{getattr(fn, '__module__', '')}:{getattr(fn, '__qualname__', repr(fn))}".encode())
        try:
            h.update(inspect.getsource(fn).encode())
        except (OSError, TypeError):
            pass
    return h.hexdigest()


def format_prompts(formatter, items: list[dict], agent: int) -> list[str]:
    """Agent ``agent``'s prompt for every item. Raises ConfigError naming the item on a bad formatter."""
    prompts = []
    for item in items:
        try:
            prompt = formatter(item)
        except Exception as exc:
            raise ConfigError([Problem(f"formatters[{agent}]", item["item_id"], f"raised {exc!r}")]) from exc
        if not isinstance(prompt, str) or not prompt:
            raise ConfigError([Problem(f"formatters[{agent}]", item["item_id"], "must return a non-empty str")])
        prompts.append(prompt)
    return prompts


# ---------------------------------------------------------------------------------------------- items
def load_item_source(source: str | Path | Sequence[Mapping[str, Any]] | Any, *, field: str) -> list[dict]:
    """Items from a list of dicts (or anything iterating dicts), a JSONL / Parquet path, a dataset spec
    (:class:`~pbrl.item_sources.DatasetSpec` or a mapping of its fields: a ``save_to_disk`` folder, data
    files through ``load_dataset``, or a hub id in the local cache), or a ``datasets.Dataset`` /
    single-split ``DatasetDict``. The result also records the source and, for ``datasets``, its fingerprint
    (:class:`~pbrl.item_sources.LoadedItems`), which :func:`write_items` stores in items.parquet.

    Raises:
        ConfigError: the path is missing or of an unknown kind, the spec is invalid or its dataset cannot be
            loaded offline (naming the dataset), or an item is not a dict (named by index).
    """
    from pydantic import ValidationError

    from pbrl.item_sources import (
        DatasetSpec,
        LoadedItems,
        is_datasets_object,
        load_dataset_object_items,
        load_spec_items,
    )

    if isinstance(source, LoadedItems):
        items: list[Any] = LoadedItems(source, source.source, source.fingerprint)
    elif is_datasets_object(source):  # before Mapping: a DatasetDict is a dict
        items = load_dataset_object_items(source, field=field)
    elif isinstance(source, Mapping):
        try:
            spec = DatasetSpec.model_validate(dict(source))
        except ValidationError as exc:  # the keys only: a value may be a secret given by mistake
            wrong = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise ConfigError([Problem(field, sorted(source), f"not a dataset spec ({wrong}); give path and "
                                       "optionally name, split, data_files, columns, id_column")]) from exc
        items = load_spec_items(spec, field=field)
    elif isinstance(source, DatasetSpec):
        items = load_spec_items(source, field=field)
    elif isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise ConfigError([Problem(field, str(source), "file not found")])
        if path.suffix == ".jsonl":
            items = []
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if line.strip():
                    try:
                        items.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise ConfigError([Problem(field, f"{path}:{n}", f"malformed JSON line ({exc})")]) from exc
        elif path.suffix == ".parquet":
            items = pq.read_table(path).to_pylist()
        else:
            raise ConfigError([Problem(field, str(source), "expected a .jsonl or .parquet file (other formats: "
                                       "give a dataset spec, e.g. {path: items.csv})")])
        items = LoadedItems(items, {"kind": "file", "path": str(source)})
    else:
        items = LoadedItems((dict(x) if isinstance(x, Mapping) else x for x in source), {"kind": "python"})
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ConfigError([Problem(f"{field}[{i}]", item, "each item must be a mapping")])
    return items


def load_run_items(job: JobConfig, task: Task, train_items: Any = None, eval_items: Any = None
                   ) -> tuple[list[dict], list[dict]]:
    """The run's train and eval items: ``train_items``/``eval_items`` (Python API), else the config's
    ``train_dataset``/``eval_dataset``, else the task's own; eval falls back to the train items.

    Raises:
        ConfigError: a source is missing or malformed, there is no train item, or an item cannot be
            formatted by an agent's formatter (e.g. a missing field), naming the item and the agent.
    """
    from pbrl.item_sources import LoadedItems, with_provenance

    from_task = {"kind": "task", "task": task.name, "task_options": job.task_options}  # where task items came from
    given = train_items if train_items is not None else job.train_dataset
    train = load_item_source(task.train_items if given is None else given, field="train_dataset")
    if given is None:
        train = LoadedItems(train, from_task)
    if job.max_train_items is not None:
        train = with_provenance(train[: job.max_train_items], train, from_task)
    if not train:
        raise ConfigError([Problem("train_dataset", job.train_dataset or job.task, "no train items")])
    given = eval_items if eval_items is not None else job.eval_dataset
    evals = load_item_source(given if given is not None else (task.eval_items or train), field="eval_dataset")
    if given is None and task.eval_items:
        evals = LoadedItems(evals, from_task)
    if not evals:
        raise ConfigError([Problem("eval_dataset", job.eval_dataset, "no evaluation items")])
    # Unique ids and formattable items, checked before anything is written.
    check_formatters(task, _with_ids(train, "item", "train_dataset"), "train_dataset")
    check_formatters(task, _with_ids(evals, "eval", "eval_dataset"), "eval_dataset")
    return train, evals


def check_formatters(task: Task, items: list[tuple[str, dict]], field: str, *, most: int = 10) -> None:
    """Format every ``(item_id, item)`` with every agent's formatter, as sample-candidates will.

    Raises:
        ConfigError: up to ``most`` problems, each naming the item (position and id) and the agent's formatter.
    """
    problems: list[Problem] = []
    for i, (item_id, item) in enumerate(items):
        for agent, formatter in enumerate(task.formatters):
            try:
                prompt = formatter(item)
            except Exception as exc:  # a formatter is user code: any error is a problem of this item
                detail = f"missing field {exc}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
                message = f"formatters[{agent}] cannot format this item ({detail})"[:300]
                problems.append(Problem(f"{field}[{i}]", item_id, message))
                continue
            if not isinstance(prompt, str) or not prompt:
                message = f"formatters[{agent}] must return a non-empty str, got {prompt!r}"[:300]
                problems.append(Problem(f"{field}[{i}]", item_id, message))
        if len(problems) >= most:
            break
    if problems:
        raise ConfigError(problems)


def _with_ids(items: list[dict], prefix: str, field: str) -> list[tuple[str, dict]]:
    """``(item_id, item)`` for every item, by one rule for every source (list of dicts, JSONL / Parquet,
    dataset spec, ``datasets`` object), so a dataset and the equivalent list of dicts get the same ids:

    - the item's own ``item_id`` field (as text) when present and not null; a dataset spec's ``id_column``
      fills it. Such ids are stable when items are reordered, filtered or added;
    - else ``<prefix>-<position:05d>`` (``item-00000`` train, ``eval-00000`` eval), stable only for the same
      items in the same order (give an id column for more).

    Ids are not content hashes: two items with the same content are still two items (positional ids keep
    them apart), and runs keep the ids they always had; the content is fingerprinted in items.parquet.

    Raises:
        ConfigError: two items have the same id (naming the second), e.g. a repeated id-column value.
    """
    out, seen = [], set()
    for i, item in enumerate(items):
        own = item.get("item_id")
        item_id = f"{prefix}-{i:05d}" if own is None else str(own)
        if item_id in seen:
            raise ConfigError([Problem(f"{field}[{i}].item_id", item_id, "item_id values must be unique")])
        seen.add(item_id)
        out.append((item_id, item))
    return out


def write_items(paths: RunPaths, train: list[dict], eval_: list[dict]) -> None:
    """Store the run's items with stable ``item_id`` values (see :func:`_with_ids`), and where each split came
    from as items.parquet metadata (read back with :func:`pbrl.schema.read_items_sources`): the source
    description (a dataset spec as given, a file path, ``python``, a task) and a fingerprint, ``datasets:<fp>``
    for items loaded through ``datasets`` (the dataset's own fingerprint) else ``sha256:<hex>`` of the stored
    items' JSON (one per line, in order).

    Raises:
        ConfigError: an item is not JSON-serialisable (naming it) or two items share an id.
    """
    from pbrl.schema import items_schema

    rows, sources = [], {}
    for split, items, prefix in (("train", train, "item"), ("eval", eval_, "eval")):
        content = hashlib.sha256()
        for pos, (item_id, item) in enumerate(_with_ids(items, prefix, f"{split}_dataset")):
            try:
                data = json.dumps(item, sort_keys=True, default=_json_default)
            except TypeError as exc:
                problem = Problem(f"{split}_dataset[{pos}]", item_id, f"not JSON-serialisable: {exc}")
                raise ConfigError([problem]) from exc
            content.update(data.encode() + b"\n")
            rows.append({"item_id": item_id, "split": split, "position": pos, "data": data})
        fingerprint = getattr(items, "fingerprint", None)
        sources[split] = {
            "source": getattr(items, "source", {"kind": "python"}),
            "fingerprint": f"datasets:{fingerprint}" if fingerprint else f"sha256:{content.hexdigest()}",
            "num_items": len(items),
        }
    write_table(paths.items, rows, items_schema(sources))


def _json_default(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")


def read_items(paths: RunPaths, split: str) -> list[dict]:
    """The stored items of a split, in order, each with its ``item_id``."""
    rows = [r for r in read_rows(paths.items, ITEMS) if r["split"] == split]
    rows.sort(key=lambda r: r["position"])
    return [{**json.loads(r["data"]), "item_id": r["item_id"]} for r in rows]


# ---------------------------------------------------------------------------------------------- run.json
def open_job(run_dir: Path) -> JobConfig:
    """The job stored in ``run.json``, placed where the folder is now: ``output_dir`` and ``run_name`` come
    from ``run_dir`` (the folder is the run; it may have been moved or copied), so
    ``run_dir_for(open_job(d))`` is ``d``.

    Raises:
        ArtifactError: run.json is missing or invalid.
    """
    folder = Path(run_dir)
    if folder.name in ("", ".", ".."):
        folder = folder.resolve()
    data = read_json(RunPaths(folder).run_json)
    try:
        return parse_job({**data["config"], "output_dir": str(folder.parent), "run_name": folder.name},
                         warn=False)  # its notices were shown when the run started
    except (KeyError, TypeError, ConfigError) as exc:
        raise ArtifactError(f"{RunPaths(run_dir).run_json}: invalid stored config ({exc})") from exc


def write_run_json(paths: RunPaths, job: JobConfig) -> None:
    """run.json: the run id (a UUID kept for the run's life), the resolved config (it holds no secret: API
    keys live only in environment variables) without ``output_dir`` (where the folder lives is not part of
    the run, which may move), the package version, seed and creation time.

    A run.json written before runs had ids gets one here, and the run's replay index is adopted by it.
    """
    import uuid

    from pbrl.replay_store import adopt_legacy_index
    from pbrl.stagekit import job_replay_dir

    created = datetime.now(UTC).isoformat(timespec="seconds")
    run_id = str(uuid.uuid4())
    if paths.run_json.is_file():
        stored = read_json(paths.run_json)
        created = stored.get("created_at", created)
        if stored.get("run_id"):
            run_id = stored["run_id"]
        else:
            adopt_legacy_index(job_replay_dir(paths, job), created, run_id)
    write_json(
        paths.run_json,
        {
            "run_id": run_id,
            "config": job.model_dump(mode="json", exclude={"output_dir"}),
            "config_hash": config_hash(job),
            "pbrl_version": pbrl.__version__,
            "seed": job.seed,
            "created_at": created,
        },
    )


def check_resumable(paths: RunPaths, job: JobConfig) -> None:
    """Refuse to continue a run folder made with another configuration (num_iterations may grow).

    Raises:
        ConfigError: naming every field whose value differs from the stored run.
    """
    stored = open_job(paths.root)
    if stage_config_hash(stored) == stage_config_hash(job):
        return
    a, b = stored.model_dump(mode="json"), job.model_dump(mode="json")
    diffs = [
        Problem(k, b.get(k), f"differs from the stored run ({a.get(k)!r}); start a new run_name instead")
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k) and k not in ("num_iterations", "run_name", "output_dir")
    ]
    raise ConfigError(diffs or [Problem("config", "?", "differs from the stored run")])


def existing_rounds(paths: RunPaths) -> list[int]:
    """Round numbers that have a folder (complete or not)."""
    base = paths.root / "rounds"
    if not base.is_dir():
        return []
    return sorted(int(p.name) for p in base.iterdir() if re.fullmatch(r"\d{4}", p.name))


# ---------------------------------------------------------------------------------------------- prepare
def preflight(job: JobConfig, *, task: Task | None = None, prepare_models: bool = True,
              train_items: Any = None, eval_items: Any = None, check_items: bool = True) -> Task:
    """Check what a config cannot check on its own, before any run folder is touched or Prefect started:
    the trainer is available, the task and its import paths resolve, the items load and every agent's
    formatter formats every item, every model source exists offline (a packaged model is converted here,
    once), ``lora_target_modules`` name modules of the model, and the comparator policy is available.
    ``check_items=False`` skips the items (a resumed run reads its stored ``items.parquet``).

    Returns:
        The resolved task.

    Raises:
        ConfigError: every problem found, at once.
    """
    from pbrl.comparators import preflight_problems as comparator_preflight_problems
    from pbrl.models import resolve_model_source
    from pbrl.packaged import PACKAGED_MODELS, locate_packaged_file
    from pbrl.policies import PolicySource

    problems: list[Problem] = []
    if job.trainer in ("marlhf", "marlhf_iter") and job.rl_algorithm in ("maac", "iac"):
        problems.append(Problem("rl_algorithm", job.rl_algorithm, "the actor-critic backends are not available "
                                "in this version; available: magrpo, mareinforce, marloo, maremax"))
    if is_iterative(job.trainer):
        problems += comparator_preflight_problems(
            job.comparator_policy, model_sources=job.comparator_agents or [job.comparator_model_name or ""],
            model_field="comparator_agents" if job.comparator_agents else "comparator_model_name",
            key_env=job.comparator_api_key_env, generation_mode=job.comparator_generation_mode,
            adapter_path=getattr(job, "comparator_centralized_adapter", None))
    try:
        task = task or resolve_task(job)
    except ConfigError as exc:
        problems += exc.problems
    if getattr(job, "log_reward_distribution", False) and task is not None:
        from pbrl.reward_hist import check_reward_range

        try:
            check_reward_range(getattr(task.reward_func, "reward_range", None) or task.reward_range,
                               source=task.name)
        except ValueError as exc:
            problems.append(Problem("log_reward_distribution", True, str(exc)))
    missing_files = False
    for name in ("train_dataset", "eval_dataset"):
        path = getattr(job, name)
        if isinstance(path, str) and not Path(path).is_file():  # a DatasetSpec is checked when loaded
            problems.append(Problem(name, path, "file not found"))
            missing_files = True
    if task is not None and check_items and not missing_files:
        try:
            load_run_items(job, task, train_items, eval_items)
        except ConfigError as exc:
            problems += exc.problems
    field = "agents" if job.agents else "agent_model"
    for source in dict.fromkeys(PolicySource.from_job(job).models):
        try:
            if not prepare_models and source in PACKAGED_MODELS:
                locate_packaged_file(source)  # the packaged file is there; conversion waits for training
            else:
                resolved = resolve_model_source(source, field=field)
                problems += _lora_target_problems(job, resolved)
        except ConfigError as exc:
            problems += exc.problems
        except ArtifactError as exc:
            problems.append(Problem(field, source, str(exc)))
    problems += _precision_and_placement_problems(job)
    if problems:
        raise ConfigError(list({str(p): p for p in problems}.values()))  # the same problem once
    return task  # type: ignore[return-value]


def _precision_and_placement_problems(job: JobConfig) -> list[Problem]:
    """``mixed_precision`` autocast available on every agent device type; ``agent_devices: auto`` without
    LoRA fits ``max_memory`` without offloading trainable weights (accelerate's device map, no weights read)."""
    import torch

    from pbrl.models import resolve_model_source
    from pbrl.placement import auto_device_map
    from pbrl.policies import PolicySource
    from pbrl.precision import autocast_problem

    source = PolicySource.from_job(job)
    devices = source.devices if isinstance(source.devices, tuple) else (source.devices,)
    default = "cuda" if torch.cuda.is_available() else "cpu"
    types = {default if d in (None, "auto") else str(d).split(":")[0] for d in devices}
    problems = [Problem("mixed_precision", job.mixed_precision, why) for t in sorted(types)
                if (why := autocast_problem(job.mixed_precision, t))]
    if source.devices == "auto" and job.lora_r is None:
        for model in dict.fromkeys(source.models):
            try:
                auto_device_map(Path(str(resolve_model_source(model))), dtype=torch.float32,
                                max_memory=job.max_memory, trainable=True, lora_targets=None)
            except ConfigError as exc:
                problems += exc.problems
    return problems


def _lora_target_problems(job: JobConfig, resolved: Any) -> list[Problem]:
    """``lora_target_modules`` entries that name no module of the model (LoRA only)."""
    if job.lora_r is None or not job.lora_target_modules:
        return []
    from pbrl.models import check_lora_target_modules

    unknown = check_lora_target_modules(resolved, list(job.lora_target_modules))
    if not unknown:
        return []
    return [Problem("lora_target_modules", unknown, f"no module of {resolved} is named so; check the model's "
                    "module names (e.g. q_proj, k_proj, v_proj, o_proj for Llama-style models)")]


def prepare_run(
    job: JobConfig,
    *,
    resume: bool,
    task: Task | None = None,
    train_items: Any = None,
    eval_items: Any = None,
    run_dir: Path | None = None,
) -> Path:
    """Create (or, with ``resume``, reopen) the run folder: run.json, items.parquet, initial checkpoints.

    Items come from ``train_items``/``eval_items`` (Python API: list of dicts, JSONL/Parquet path or a
    ``datasets.Dataset``), else ``train_dataset``/``eval_dataset`` in the config, else the task's own.
    Evaluation falls back to the train items when none are given. A new run is built in a temporary
    sibling folder and renamed into place only when complete, so a start that fails at any point leaves
    nothing that blocks the retry. ``run_dir`` (default ``<output_dir>/<run_name>``) is the folder used.

    Raises:
        ConfigError: the run exists and ``resume`` is false, the stored config differs, the task or items
            are invalid, the folder exists but is not a run, or the replay folder holds another run's files.
    """
    from pbrl.policies import PolicySource, write_initial_checkpoints
    from pbrl.replay_store import check_owned, run_identity
    from pbrl.stagekit import job_replay_dir
    from pbrl.storage import atomic_dir, remove_stale_temporaries

    run_dir = Path(run_dir) if run_dir is not None else run_dir_for(job)
    paths = RunPaths(run_dir)
    given = task or attached_task(run_dir)  # a task of Python objects; a config's task is resolved anew
    if paths.run_json.is_file():
        if not resume:
            raise ConfigError([Problem("run_name", job.run_name, f"run folder {run_dir} already exists; continue "
                                       "it with --resume (CLI) or resume=True (Python API), or choose another "
                                       "run name")])
        check_resumable(paths, job)
        remove_stale_temporaries(paths)  # what a killed write left behind (never read, but never cleaned)
        task = preflight(job, task=given, train_items=train_items, eval_items=eval_items,
                         check_items=not paths.items.is_file())
        if given is not None:
            attach_task(run_dir, given)
        if not paths.items.is_file():
            write_items(paths, *load_run_items(job, task, train_items, eval_items))
        write_run_json(paths, job)
        check_owned(job_replay_dir(paths, job), run_identity(paths))
        write_initial_checkpoints(paths, PolicySource.from_job(job), seed=job.seed)
        return run_dir
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError([Problem("run_name", job.run_name, f"{run_dir} exists and is not a run folder (no "
                                   "run.json); remove it or choose another run name")])
    task = preflight(job, task=given, train_items=train_items, eval_items=eval_items)
    train, evals = load_run_items(job, task, train_items, eval_items)
    with atomic_dir(run_dir) as tmp:  # renamed onto run_dir only when everything below succeeded
        new = RunPaths(tmp)
        write_items(new, train, evals)
        write_run_json(new, job)
        check_owned(job_replay_dir(new, job), run_identity(new))
        write_initial_checkpoints(new, PolicySource.from_job(job), seed=job.seed)
    if given is not None:
        attach_task(run_dir, given)
    if getattr(job, "policy_checkpoint_dir", None):
        from pbrl.export import export_policy_checkpoint

        export_policy_checkpoint(paths.initial, job.policy_checkpoint_dir, 0, job.num_agents)
    return run_dir
