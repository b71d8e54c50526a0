"""The dataset spec of ``train_dataset`` / ``eval_dataset``: where items come from when they are loaded with the
``datasets`` library (:mod:`pbrl.data.item_sources` loads them)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, Strict

_Name = Annotated[str, Strict(), Field(min_length=1)]
DataFiles = _Name | Annotated[list[_Name], Field(min_length=1)] | dict[_Name, _Name | list[_Name]]


class DatasetSpec(BaseModel):
    """Where ``train_dataset`` / ``eval_dataset`` items come from when they are loaded with ``datasets``.

    It holds no credentials (unknown keys such as ``token`` are refused), so it is stored as given in
    run.json and in the ``items.parquet`` metadata.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    path: _Name = Field(
        description="A save_to_disk folder, a .json/.jsonl/.csv/.parquet file, a folder of data "
        "files, a builder name (json, csv, parquet) with data_files, or a hub dataset id already "
        "in the local Hugging Face datasets cache."
    )
    name: _Name | None = Field(
        None, description="Configuration name of a hub dataset (datasets' `name`); None = the one in the cache."
    )
    split: _Name | None = Field(
        None,
        description="Split to use (e.g. 'train'; data files and hub datasets also "
        "take slices such as 'test[:100]'); None = the only split (an error when there are "
        "several).",
    )
    data_files: DataFiles | None = Field(
        None,
        description="Local data files for a builder name or a folder: a "
        "path or glob, a list, or a mapping split -> paths.",
    )
    columns: dict[_Name, _Name] = Field(
        default_factory=dict,
        description="Column renaming, source column -> field the formatters read (e.g. {question: prompt}).",
    )
    id_column: _Name | None = Field(
        None,
        description="Column whose values (as text) become each item's "
        "item_id; None = the item's own item_id field, else its position.",
    )
