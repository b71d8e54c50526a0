"""Items from Hugging Face ``datasets`` sources: the dataset spec of ``train_dataset`` / ``eval_dataset``,
its offline loading, and where loaded items came from (recorded in ``items.parquet``).

A dataset spec (YAML mapping or :class:`DatasetSpec`) names one of:

- a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (``datasets.load_from_disk``);
- a data file (``.json``/``.jsonl``/``.csv``/``.parquet``), a folder of data files, or a builder name
  (``json``/``csv``/``parquet``) with ``data_files`` (``datasets.load_dataset``);
- a hub dataset id (``name`` or ``org/name``, with ``name`` = its configuration) that is already in the
  local Hugging Face datasets cache (``HF_DATASETS_CACHE``, by default ``$HF_HOME/datasets``).

Nothing is downloaded: a hub id is read with the ``cache`` builder that ``datasets.load_dataset`` itself
uses offline (``datasets.packaged_modules.cache``), whatever ``HF_HUB_OFFLINE`` says, and remote
``data_files`` (``hf://``, ``https://``) are refused. ``datasets`` is imported only when a spec is loaded.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pbrl.config.dataset_spec import DatasetSpec
from pbrl.errors import ConfigError, Problem

# load_dataset's builder for a data file, by suffix (the forms the issue names: json/jsonl/parquet/csv).
BUILDER_FOR_SUFFIX = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
DATA_FILE_BUILDERS = ("json", "csv", "parquet")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


class LoadedItems(list):
    """Items (dicts, in source order) that know where they came from.

    Attributes:
        source: a JSON-serialisable description of the source (no secrets): ``{"kind": "datasets", "spec":
            {...}, "loader": ...}``, ``{"kind": "file", "path": ...}``, ``{"kind": "python"}``, ...
        fingerprint: the ``datasets`` fingerprint of the loaded dataset (before column renaming), or None
            when the items were not loaded through ``datasets`` (items.parquet then stores a content hash).
    """

    def __init__(self, items: Iterable[dict[str, Any]], source: dict[str, Any], fingerprint: str | None = None):
        super().__init__(items)
        self.source = source
        self.fingerprint = fingerprint


def with_provenance(items: Iterable[dict[str, Any]], like: Any, source: dict[str, Any]) -> LoadedItems:
    """``items`` as LoadedItems with ``like``'s source and fingerprint when it has them, else ``source``."""
    if isinstance(like, LoadedItems):
        return LoadedItems(items, like.source, like.fingerprint)
    return LoadedItems(items, source)


def is_datasets_object(value: Any) -> bool:
    """True for a ``datasets.Dataset`` or ``datasets.DatasetDict`` (without importing ``datasets``)."""
    ds = sys.modules.get("datasets")
    return ds is not None and isinstance(value, (ds.Dataset, ds.DatasetDict))


# ---------------------------------------------------------------------------------------------- loading
def load_spec_items(spec: DatasetSpec, *, field: str) -> LoadedItems:
    """The items of a dataset spec, one dict per row in the dataset's order, with ``columns`` renamed and
    ``item_id`` set from ``id_column`` (its value as text) when given.

    Raises:
        ConfigError: naming ``field`` and the dataset: no such file or folder, a hub id that is not in the
            local cache (nothing is downloaded), remote data files, an unknown split or configuration, a
            renamed or id column that the dataset lacks, an empty id, or any error ``datasets`` raises.
    """
    from datasets.exceptions import DatasetsError  # deferred: datasets takes ~2 s to import; only specs need it

    try:
        dataset, loader = _load(spec, field)
        dataset = _one_split(dataset, spec.split, field, spec.path)
        fingerprint = dataset._fingerprint  # datasets' content/transform hash of the loaded table
        missing = [c for c in spec.columns if c not in dataset.column_names]
        if missing:
            raise ConfigError(
                [
                    Problem(
                        f"{field}.columns",
                        missing,
                        f"no such column in {spec.path!r}; its columns: {', '.join(dataset.column_names)}",
                    )
                ]
            )
        if spec.columns:
            dataset = dataset.rename_columns(dict(spec.columns))
        if spec.id_column is not None and spec.id_column not in dataset.column_names:
            raise ConfigError(
                [
                    Problem(
                        f"{field}.id_column",
                        spec.id_column,
                        f"no such column in {spec.path!r} "
                        f"(after renaming); its columns: {', '.join(dataset.column_names)}",
                    )
                ]
            )
        rows = dataset.to_list()
    except (OSError, ValueError, KeyError, TypeError, DatasetsError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(
            [Problem(field, spec.path, f"datasets could not load it: {type(exc).__name__}: {exc}"[:500])]
        ) from exc
    if spec.id_column is not None:
        rows = [_with_id_column(row, spec.id_column, field, i) for i, row in enumerate(rows)]
    source = {"kind": "datasets", "loader": loader, "spec": spec.model_dump(mode="json", exclude_none=True)}
    return LoadedItems(rows, source, fingerprint)


def load_dataset_object_items(dataset: Any, *, field: str) -> LoadedItems:
    """The rows of a ``datasets.Dataset`` (or of the only split of a ``DatasetDict``) as dicts.

    Raises:
        ConfigError: a DatasetDict with several splits (pass ``dataset['train']``) or none.
    """
    dataset = _one_split(dataset, None, field, "the DatasetDict")
    source = {"kind": "datasets.Dataset", "split": str(dataset.split) if dataset.split is not None else None}
    return LoadedItems(dataset.to_list(), source, dataset._fingerprint)


def _with_id_column(row: dict[str, Any], id_column: str, field: str, index: int) -> dict[str, Any]:
    value = row[id_column]
    if value is None or str(value) == "":
        raise ConfigError([Problem(f"{field}[{index}].{id_column}", value, "id_column values must not be empty")])
    return {**row, "item_id": str(value)}


def _load(spec: DatasetSpec, field: str) -> tuple[Any, str]:
    """(Dataset or DatasetDict, the loader used). Raises ConfigError for sources that are not there."""
    import datasets  # deferred: ~2 s to import; only dataset specs need it

    files = _local_data_files(spec.data_files, field)
    path = Path(spec.path).expanduser()
    options = {"name": spec.name} if spec.name else {}
    if spec.path in DATA_FILE_BUILDERS:
        if files is None:
            raise ConfigError(
                [
                    Problem(
                        f"{field}.data_files",
                        None,
                        f"required with the builder {spec.path!r} (e.g. data_files: items.jsonl)",
                    )
                ]
            )
        return datasets.load_dataset(spec.path, data_files=files, split=spec.split, **options), "load_dataset"
    if path.is_dir():
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():  # save_to_disk folders
            _refuse_data_files(files, field, "a save_to_disk folder")
            return datasets.load_from_disk(str(path)), "load_from_disk"
        return datasets.load_dataset(str(path), data_files=files, split=spec.split, **options), "load_dataset"
    if path.is_file():
        _refuse_data_files(files, field, "a data file")
        builder = BUILDER_FOR_SUFFIX.get(path.suffix.lower())
        if builder is None:
            raise ConfigError(
                [Problem(f"{field}.path", spec.path, f"a data file must end in {', '.join(BUILDER_FOR_SUFFIX)}")]
            )
        return datasets.load_dataset(builder, data_files=str(path), split=spec.split), "load_dataset"
    if not _HUB_ID.match(spec.path) or spec.path.startswith((".", "~")) or path.suffix.lower() in BUILDER_FOR_SUFFIX:
        raise ConfigError([Problem(f"{field}.path", spec.path, "no such file or folder")])
    _refuse_data_files(files, field, "a hub dataset id")
    return _load_cached_hub_dataset(spec, field), "hub_cache"


def _load_cached_hub_dataset(spec: DatasetSpec, field: str) -> Any:
    """A hub dataset from the local cache only, as ``load_dataset`` does offline (its ``cache`` builder
    finds ``<HF_DATASETS_CACHE>/<org>___<name>/<config>/<version>/<hash>``)."""
    import datasets.config  # deferred: ~2 s to import; only dataset specs need it
    from datasets.packaged_modules.cache.cache import Cache  # deferred, as above

    try:
        builder = Cache(
            repo_id=spec.path, dataset_name=spec.path.split("/")[-1], config_name=spec.name, version="auto", hash="auto"
        )
    except ValueError as exc:
        config = f" (configuration {spec.name!r})" if spec.name else ""
        detail = str(exc).partition("\n")[2].strip()  # "Available configs in the cache: [...]" when there are some
        cache = datasets.config.HF_DATASETS_CACHE
        raise ConfigError(
            [
                Problem(
                    field,
                    spec.path,
                    f"hub dataset {spec.path!r}{config} is not in the local Hugging "
                    f"Face datasets cache ({cache}) and is no local file or folder; pbrl never "
                    "downloads at run time: load it once online with datasets.load_dataset("
                    f"{spec.path!r}), or give a save_to_disk folder or data files" + (f". {detail}" if detail else ""),
                )
            ]
        ) from exc
    return builder.as_dataset(split=spec.split)


def _one_split(dataset: Any, split: str | None, field: str, where: str) -> Any:
    """``dataset`` itself (a Dataset), or the ``split`` of a DatasetDict (its only split when None)."""
    import datasets  # deferred: ~2 s to import; only dataset specs need it

    if isinstance(dataset, datasets.Dataset):
        if split is not None and dataset.split is not None and split != str(dataset.split):
            raise ConfigError(
                [
                    Problem(
                        f"{field}.split",
                        split,
                        f"{where} holds one dataset, split {str(dataset.split)!r}; leave split out",
                    )
                ]
            )
        return dataset
    names = list(dataset)
    if split is None and len(names) == 1:
        return dataset[names[0]]
    if split is None or split not in names:
        message = "give one of its splits" if split is None else "no such split"
        raise ConfigError([Problem(f"{field}.split", split, f"{message}: {', '.join(names) or '(none)'} ({where})")])
    return dataset[split]


def _local_data_files(data_files: Any, field: str) -> Any:
    """``data_files`` with every entry local (nothing is downloaded), as load_dataset takes it."""
    if data_files is None:
        return None
    values = data_files.values() if isinstance(data_files, dict) else [data_files]
    flat = [f for v in values for f in ([v] if isinstance(v, str) else v)]
    remote = [f for f in flat if "://" in f]
    if remote:
        raise ConfigError(
            [Problem(f"{field}.data_files", remote, "only local data files (pbrl never downloads at run time)")]
        )
    return data_files


def _refuse_data_files(files: Any, field: str, what: str) -> None:
    if files is not None:
        raise ConfigError(
            [
                Problem(
                    f"{field}.data_files",
                    files,
                    f"not used with {what}; give data_files with a "
                    "builder name (json, csv, parquet) or a folder of data files",
                )
            ]
        )
