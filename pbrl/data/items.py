"""The run's items: loading every supported source, stable ids, formatter checks, items.parquet.

Sources: a list of dicts, a JSONL/Parquet path, a ``datasets`` object or a dataset spec
(:mod:`pbrl.data.item_sources`). An item keeps its own ``item_id``, else gets ``item-00000`` … by position.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from pydantic import ValidationError

from pbrl.config import JobConfig
from pbrl.config.dataset_spec import DatasetSpec
from pbrl.data.item_sources import (
    LoadedItems,
    is_datasets_object,
    load_dataset_object_items,
    load_spec_items,
    with_provenance,
)
from pbrl.data.schema import ITEMS, Item, items_schema
from pbrl.data.storage import RunPaths
from pbrl.data.tables import read_rows, write_table
from pbrl.errors import ConfigError, Problem
from pbrl.tasks.base import Task


def format_prompts(formatter, items: list[Item], agent: int) -> list[str]:
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


def _file_items(source: str | Path, *, field: str) -> LoadedItems:
    """The items of a .jsonl or .parquet file, recorded with its path (for :func:`load_item_source`).

    Raises:
        ConfigError: the file is missing, of another kind, not UTF-8, or holds a malformed JSON line or an
            unreadable Parquet table (file and line named).
    """
    path = Path(source)
    if not path.is_file():
        raise ConfigError([Problem(field, str(source), "file not found")])
    items: list[Any]
    if path.suffix == ".jsonl":
        items = []
        for n, raw in enumerate(path.read_bytes().splitlines(), 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigError(
                    [
                        Problem(
                            field,
                            f"{path}:{n}",
                            f"is not UTF-8 text (byte {exc.start + 1} of "
                            f"the line: {raw[exc.start : exc.start + 1]!r}); save the file as UTF-8",
                        )
                    ]
                ) from None
            if line.strip():
                try:
                    items.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ConfigError([Problem(field, f"{path}:{n}", f"malformed JSON line ({exc})")]) from exc
                except RecursionError:  # json's parser recurses once per level: '[[[[…' raises this, not a JSON error
                    raise ConfigError([Problem(field, f"{path}:{n}", "nested too deeply to be an item")]) from None
    elif path.suffix == ".parquet":
        _check_unpacked_size(path, field)
        try:
            items = pq.read_table(path).to_pylist()
        except Exception as exc:  # pyarrow raises several types for corrupt or non-Parquet files
            raise ConfigError([Problem(field, str(path), f"not a readable Parquet file ({exc})")]) from None
    else:
        raise ConfigError(
            [
                Problem(
                    field,
                    str(source),
                    "expected a .jsonl or .parquet file (other formats: give a dataset spec, e.g. {path: items.csv})",
                )
            ]
        )
    return LoadedItems(items, {"kind": "file", "path": str(source)})


# A Parquet file's values are compressed (dictionary, run-length, zstd): a file of a few kB may hold millions of
# repeated values, gigabytes once read (issue #53.4: no input under 100 kB may make validate use more than 200 MB).
# Items are texts, each taking bytes on disk, so a table with more values than MAX_VALUES_PER_BYTE per byte of the
# file (beyond a floor any small table passes) is refused from its footer, before a value is read. The footer's
# uncompressed sizes do not tell: dictionary pages store one copy of a value repeated millions of times.
MAX_VALUES_PER_BYTE = 4
VALUES_FLOOR = 2_000_000


def _check_unpacked_size(path: Path, field: str) -> None:
    """Refuse a Parquet file with more values (rows x columns) than :data:`MAX_VALUES_PER_BYTE` per byte of the file
    and more than :data:`VALUES_FLOOR`, read from its footer alone."""
    try:
        meta = pq.read_metadata(path)
    except Exception as exc:  # pyarrow raises several types for corrupt or non-Parquet files
        raise ConfigError([Problem(field, str(path), f"not a readable Parquet file ({exc})")]) from None
    values, size = meta.num_rows * meta.num_columns, path.stat().st_size
    if values > max(VALUES_FLOOR, MAX_VALUES_PER_BYTE * size):
        raise ConfigError(
            [
                Problem(
                    field,
                    str(path),
                    f"its {meta.num_rows:,} rows x {meta.num_columns} columns in {size:,} bytes are more values than "
                    f"{MAX_VALUES_PER_BYTE} per byte of the file: repetition, not items",
                )
            ]
        )


def load_item_source(source: str | Path | Sequence[Mapping[str, Any]] | Any, *, field: str) -> list[Item]:
    """Items from a list of dicts (or anything iterating dicts), a JSONL / Parquet path, a dataset spec
    (:class:`~pbrl.config.dataset_spec.DatasetSpec` or a mapping of its fields: a ``save_to_disk`` folder, data
    files through ``load_dataset``, or a hub id in the local cache), or a ``datasets.Dataset`` /
    single-split ``DatasetDict``. The result also records the source and, for ``datasets``, its fingerprint
    (:class:`~pbrl.data.item_sources.LoadedItems`), which :func:`write_items` stores in items.parquet.

    Raises:
        ConfigError: the path is missing or of an unknown kind, the spec is invalid or its dataset cannot be
            loaded offline (naming the dataset), or an item is not a dict (named by index).
    """

    if isinstance(source, LoadedItems):
        items: list[Any] = LoadedItems(source, source.source, source.fingerprint)
    elif is_datasets_object(source):  # before Mapping: a DatasetDict is a dict
        items = load_dataset_object_items(source, field=field)
    elif isinstance(source, Mapping):
        try:
            spec = DatasetSpec.model_validate(dict(source))
        except ValidationError as exc:  # the keys only: a value may be a secret given by mistake
            wrong = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise ConfigError(
                [
                    Problem(
                        field,
                        sorted(source),
                        f"not a dataset spec ({wrong}); give path and "
                        "optionally name, split, data_files, columns, id_column",
                    )
                ]
            ) from exc
        items = load_spec_items(spec, field=field)
    elif isinstance(source, DatasetSpec):
        items = load_spec_items(source, field=field)
    elif isinstance(source, (str, Path)):
        items = _file_items(source, field=field)
    else:
        items = LoadedItems((dict(x) if isinstance(x, Mapping) else x for x in source), {"kind": "python"})
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ConfigError([Problem(f"{field}[{i}]", item, "each item must be a mapping")])
    return items


def load_run_items(
    job: JobConfig, task: Task, train_items: Any = None, eval_items: Any = None
) -> tuple[list[Item], list[Item]]:
    """The run's train and eval items: ``train_items``/``eval_items`` (Python API), else the config's
    ``train_dataset``/``eval_dataset``, else the task's own; eval falls back to the train items.

    Raises:
        ConfigError: a source is missing or malformed, there is no train item, or an item cannot be
            formatted by an agent's formatter (e.g. a missing field), naming the item and the agent.
    """

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
    check_formatters(task, with_item_ids(train, "item", "train_dataset"), "train_dataset")
    check_formatters(task, with_item_ids(evals, "eval", "eval_dataset"), "eval_dataset")
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


def with_item_ids(items: list[Item], prefix: str, field: str) -> list[tuple[str, dict]]:
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


def write_items(paths: RunPaths, train: list[Item], eval_: list[Item]) -> None:
    """Store the run's items with stable ``item_id`` values (see :func:`with_item_ids`), and where each split came
    from as items.parquet metadata (read back with :func:`pbrl.data.tables.read_items_sources`): the source
    description (a dataset spec as given, a file path, ``python``, a task) and a fingerprint, ``datasets:<fp>``
    for items loaded through ``datasets`` (the dataset's own fingerprint) else ``sha256:<hex>`` of the stored
    items' JSON (one per line, in order).

    Raises:
        ConfigError: an item is not JSON-serialisable (naming it) or two items share an id.
    """

    rows, sources = [], {}
    for split, items, prefix in (("train", train, "item"), ("eval", eval_, "eval")):
        content = hashlib.sha256()
        for pos, (item_id, item) in enumerate(with_item_ids(items, prefix, f"{split}_dataset")):
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


def read_items(paths: RunPaths, split: str) -> list[Item]:
    """The stored items of a split, in order, each with its ``item_id``."""
    rows = [r for r in read_rows(paths.items, ITEMS) if r["split"] == split]
    rows.sort(key=lambda r: r["position"])
    return [{**json.loads(r["data"]), "item_id": r["item_id"]} for r in rows]
