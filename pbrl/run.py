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


def attach_task(run_dir: Path, task: Task) -> None:
    """Make a Python-object task (callables) available to the stages of the run in this process."""
    _ATTACHED_TASKS[str(Path(run_dir).resolve())] = task


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
    if run_dir is not None and (task := _ATTACHED_TASKS.get(str(Path(run_dir).resolve()))):
        return task
    problems: list[Problem] = []
    base: Task | None = None
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
    """Items from a list of dicts, a JSONL / Parquet path, or a ``datasets.Dataset``.

    Raises:
        ConfigError: the path is missing or of an unknown kind, or an item is not a dict (named by index).
    """
    if isinstance(source, (str, Path)):
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
            raise ConfigError([Problem(field, str(source), "expected a .jsonl or .parquet file")])
    else:
        items = [dict(x) if isinstance(x, Mapping) else x for x in source]  # datasets.Dataset iterates dicts
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ConfigError([Problem(f"{field}[{i}]", item, "each item must be a mapping")])
    return items


def _with_ids(items: list[dict], prefix: str, field: str) -> list[tuple[str, dict]]:
    out, seen = [], set()
    for i, item in enumerate(items):
        item_id = str(item.get("item_id", f"{prefix}-{i:05d}"))
        if item_id in seen:
            raise ConfigError([Problem(f"{field}[{i}].item_id", item_id, "item_id values must be unique")])
        seen.add(item_id)
        out.append((item_id, item))
    return out


def write_items(paths: RunPaths, train: list[dict], eval_: list[dict]) -> None:
    """Store the run's items with stable ``item_id`` values (the item's own, else ``item-00000`` …)."""
    rows = []
    for split, items, prefix in (("train", train, "item"), ("eval", eval_, "eval")):
        for pos, (item_id, item) in enumerate(_with_ids(items, prefix, f"{split}_dataset")):
            try:
                data = json.dumps(item, sort_keys=True, default=_json_default)
            except TypeError as exc:
                problem = Problem(f"{split}_dataset[{pos}]", item_id, f"not JSON-serialisable: {exc}")
                raise ConfigError([problem]) from exc
            rows.append({"item_id": item_id, "split": split, "position": pos, "data": data})
    write_table(paths.items, rows, ITEMS)


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
    """The job stored in ``run.json``. Raises ArtifactError when missing or invalid."""
    data = read_json(RunPaths(run_dir).run_json)
    try:
        return parse_job(data["config"])
    except (KeyError, ConfigError) as exc:
        raise ArtifactError(f"{RunPaths(run_dir).run_json}: invalid stored config ({exc})") from exc


def write_run_json(paths: RunPaths, job: JobConfig) -> None:
    """run.json: the resolved config (it holds no secret: API keys live only in environment variables)."""
    created = datetime.now(UTC).isoformat(timespec="seconds")
    if paths.run_json.is_file():
        created = read_json(paths.run_json).get("created_at", created)
    write_json(
        paths.run_json,
        {
            "config": job.model_dump(mode="json"),
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
def preflight(job: JobConfig, *, task: Task | None = None, prepare_models: bool = True) -> Task:
    """Check what a config cannot check on its own, before any run folder is touched or Prefect started:
    the trainer is available, the task and its import paths resolve, every model source exists offline
    (a packaged model is converted here, once), and the comparator policy is available.

    Returns:
        The resolved task.

    Raises:
        ConfigError: every problem found, at once.
    """
    from pbrl.comparators import COMPARATORS
    from pbrl.models import resolve_model_source
    from pbrl.packaged import PACKAGED_MODELS, locate_packaged_file
    from pbrl.policies import agent_sources

    problems: list[Problem] = []
    if job.trainer not in ("madpo", "madpo_iter"):
        problems.append(Problem("trainer", job.trainer, "MARLHF reward-model fitting and RL policy learning are "
                                "not available in this version; available trainers: madpo, madpo_iter"))
    if is_iterative(job.trainer) and job.comparator_policy not in COMPARATORS:
        problems.append(Problem("comparator_policy", job.comparator_policy,
                                f"not available in this version; available: {', '.join(COMPARATORS)}"))
    if is_iterative(job.trainer) and job.comparator_generation_mode != "decentralized":
        problems.append(Problem("comparator_generation_mode", job.comparator_generation_mode,
                                "not available in this version; available: decentralized"))
    try:
        task = task or resolve_task(job)
    except ConfigError as exc:
        problems += exc.problems
    for name in ("train_dataset", "eval_dataset"):
        path = getattr(job, name)
        if path and not Path(path).is_file():
            problems.append(Problem(name, path, "file not found"))
    field = "agents" if job.agents else "agent_model"
    for source in dict.fromkeys(agent_sources(job)):
        try:
            if not prepare_models and source in PACKAGED_MODELS:
                locate_packaged_file(source)  # the packaged file is there; conversion waits for training
            else:
                resolve_model_source(source, field=field)
        except ConfigError as exc:
            problems += exc.problems
        except ArtifactError as exc:
            problems.append(Problem(field, source, str(exc)))
    if problems:
        raise ConfigError(problems)
    return task  # type: ignore[return-value]


def prepare_run(
    job: JobConfig,
    *,
    resume: bool,
    task: Task | None = None,
    train_items: Any = None,
    eval_items: Any = None,
) -> Path:
    """Create (or, with ``resume``, reopen) the run folder: run.json, items.parquet, initial checkpoints.

    Items come from ``train_items``/``eval_items`` (Python API: list of dicts, JSONL/Parquet path or a
    ``datasets.Dataset``), else ``train_dataset``/``eval_dataset`` in the config, else the task's own.
    Evaluation falls back to the train items when none are given.

    Raises:
        ConfigError: the run exists and ``resume`` is false, the stored config differs, the task or items
            are invalid, or the replay folder holds another run's files.
    """
    from pbrl.policies import write_initial_checkpoints
    from pbrl.replay_store import check_owned, replay_dir, run_identity

    run_dir = run_dir_for(job)
    paths = RunPaths(run_dir)
    if paths.run_json.is_file():
        if not resume:
            raise ConfigError([Problem("run_name", job.run_name, f"run folder {run_dir} already exists; continue "
                                       "it with --resume (CLI) or resume=True (Python API), or choose another "
                                       "run name")])
        check_resumable(paths, job)
    task = preflight(job, task=task)  # nothing is written before the whole job checks out
    attach_task(run_dir, task)
    if not paths.items.is_file():
        train = load_item_source(train_items if train_items is not None else (job.train_dataset or task.train_items),
                                 field="train_dataset")
        if job.max_train_items is not None:
            train = train[: job.max_train_items]
        if not train:
            raise ConfigError([Problem("train_dataset", job.train_dataset or job.task, "no train items")])
        evals = eval_items if eval_items is not None else (job.eval_dataset or task.eval_items or train)
        write_items(paths, train, load_item_source(evals, field="eval_dataset"))
    write_run_json(paths, job)
    check_owned(replay_dir(paths, job), run_identity(paths))
    write_initial_checkpoints(paths, job)
    return run_dir
