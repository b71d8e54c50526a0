"""Hugging Face datasets as item sources (issue #19 part 1): a save_to_disk folder, data files through
load_dataset and a cached hub dataset give the same items and ids as the equivalent list of dicts; a hub
dataset missing from the cache is one clear error before anything is written; items.parquet records where
the items came from. Nothing here downloads: the hub cache is built in the test."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import datasets
import datasets.config
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pbrl.config import parse_job
from pbrl.config.dataset_spec import DatasetSpec
from pbrl.data.items import load_item_source, load_run_items, read_items, write_items
from pbrl.data.storage import RunPaths
from pbrl.data.tables import read_items_sources
from pbrl.errors import ArtifactError, ConfigError
from pbrl.run.folder import prepare_run
from pbrl.run.task import resolve_task
from tests.helpers import tiny_job

# A source dataset whose column names differ from what the formatters read ("topic") and with an id column.
ROWS = [
    {"qid": "q7", "question": "rain", "level": 1},
    {"qid": "q3", "question": "bees", "level": 2},
    {"qid": "q9", "question": "tides", "level": 1},
]
RENAME = {"question": "topic"}
# The equivalent list of dicts, written out by hand: renamed column, id column copied into item_id.
EXPECTED = [
    {"qid": "q7", "topic": "rain", "level": 1, "item_id": "q7"},
    {"qid": "q3", "topic": "bees", "level": 2, "item_id": "q3"},
    {"qid": "q9", "topic": "tides", "level": 1, "item_id": "q9"},
]
HUB_ID = "pbrl-test/tiny_topics"


@pytest.fixture(autouse=True)
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face home for each test, offline. ``datasets`` reads its environment at import, so
    its config attributes are set as well as the variables."""
    home = tmp_path / "hf"
    cache = home / "datasets"
    for key, value in {
        "HF_HOME": home,
        "HF_DATASETS_CACHE": cache,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }.items():
        monkeypatch.setenv(key, str(value))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    return cache


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def cache_hub_dataset(cache: Path, repo_id: str, rows: list[dict], work: Path) -> None:
    """Leave in ``cache`` what an online ``datasets.load_dataset(repo_id)`` of a JSON-files hub repo leaves:
    ``<org>___<name>/default/0.0.0/<commit>/{dataset_info.json, <name>-train.arrow}``, made here offline by
    the same json builder that the hub path uses."""
    from datasets.packaged_modules.json.json import Json

    org, name = repo_id.split("/")
    source = write_jsonl(work / "hub-source.jsonl", rows)
    builder = Json(
        dataset_name=name,
        config_name="default",
        hash="0123abcd",
        data_files={"train": [str(source)]},
        cache_dir=str(work / "build"),
    )
    builder.download_and_prepare()
    shutil.copytree(builder.cache_dir, cache / f"{org}___{name}" / "default" / "0.0.0" / "0123abcd")


def stored(items: list[dict], run_dir: Path) -> list[dict]:
    """The train items as items.parquet stores them (ids assigned)."""
    write_items(RunPaths(run_dir), items, items)
    return read_items(RunPaths(run_dir), "train")


# --------------------------------------------------------------------------- same items and ids, every source
def test_save_to_disk_folders_give_the_list_of_dicts_items_and_ids(tmp_path):
    folder = tmp_path / "saved"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(folder))
    spec = DatasetSpec(path=str(folder), columns=RENAME, id_column="qid")
    assert load_item_source(spec, field="train_dataset") == EXPECTED
    assert stored(load_item_source(spec, field="train_dataset"), tmp_path / "a") == stored(EXPECTED, tmp_path / "b")
    assert [x["item_id"] for x in read_items(RunPaths(tmp_path / "a"), "train")] == ["q7", "q3", "q9"]
    # A DatasetDict folder: the split is chosen; the mapping form (YAML) is the same spec.
    dict_folder = tmp_path / "saved-dict"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS[:1]), "test": datasets.Dataset.from_list(ROWS)}
    ).save_to_disk(str(dict_folder))
    as_mapping = {"path": str(dict_folder), "split": "test", "columns": RENAME, "id_column": "qid"}
    assert load_item_source(as_mapping, field="eval_dataset") == EXPECTED


def test_jsonl_files_through_load_dataset_give_the_list_of_dicts_items_and_ids(tmp_path):
    jsonl = write_jsonl(tmp_path / "items.jsonl", ROWS)
    by_file = load_item_source(DatasetSpec(path=str(jsonl), columns=RENAME, id_column="qid"), field="train_dataset")
    by_builder = load_item_source(
        DatasetSpec(path="json", data_files=str(jsonl), columns=RENAME, id_column="qid"), field="train_dataset"
    )
    assert by_file == by_builder == EXPECTED
    assert stored(by_builder, tmp_path / "a") == stored(EXPECTED, tmp_path / "b")


def test_a_cached_hub_dataset_gives_the_list_of_dicts_items_and_ids(tmp_path, hf_cache):
    cache_hub_dataset(hf_cache, HUB_ID, ROWS, tmp_path)
    # The cache is one that datasets itself reads offline.
    assert datasets.load_dataset(HUB_ID, split="train").to_list() == ROWS
    spec = DatasetSpec(path=HUB_ID, split="train", columns=RENAME, id_column="qid")
    items = load_item_source(spec, field="train_dataset")
    assert items == EXPECTED
    assert stored(items, tmp_path / "a") == stored(EXPECTED, tmp_path / "b")
    with pytest.raises(ConfigError, match=r"configuration 'other'.*Available configs in the cache: \['default'\]"):
        load_item_source(DatasetSpec(path=HUB_ID, name="other"), field="train_dataset")


def test_without_an_id_column_every_source_gets_the_same_positional_ids(tmp_path):
    rows = [
        {"topic": "rain", "item_id": None},
        {"topic": "bees", "item_id": "custom-1"},
        {"topic": "rain", "item_id": None},
    ]
    listed = [{"topic": "rain"}, {"topic": "bees", "item_id": "custom-1"}, {"topic": "rain"}]
    folder = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(folder))
    parquet = tmp_path / "items.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    expected_ids = ["item-00000", "custom-1", "item-00002"]  # duplicate content, distinct ids; null id = no id
    for n, source in enumerate([listed, DatasetSpec(path=str(folder)), datasets.Dataset.from_list(rows), parquet]):
        items = stored(load_item_source(source, field="train_dataset"), tmp_path / f"run{n}")
        assert [x["item_id"] for x in items] == expected_ids
        assert [x["topic"] for x in items] == ["rain", "bees", "rain"]


# --------------------------------------------------------------------------- missing hub dataset
def test_a_hub_dataset_missing_from_the_cache_is_one_error_before_anything_is_written(tiny_model_dir, tmp_path):
    out = tmp_path / "runs"
    job = tiny_job(tiny_model_dir, out)
    with pytest.raises(ConfigError) as err:
        prepare_run(job, resume=False, train_items=DatasetSpec(path="pbrl-test/not-cached", split="train"))
    [problem] = err.value.problems
    assert problem.field == "train_dataset" and problem.value == "pbrl-test/not-cached"
    assert "hub dataset 'pbrl-test/not-cached' is not in the local Hugging Face datasets cache" in problem.message
    assert "never downloads" in problem.message
    assert not out.exists() or not any(out.iterdir())


def test_spec_errors_name_the_field_and_what_to_fix(tmp_path):
    folder = tmp_path / "saved"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS)}
    ).save_to_disk(str(folder))
    cases = [
        (DatasetSpec(path=str(folder)), r"train_dataset\.split: got None; give one of its splits: train, test"),
        (DatasetSpec(path=str(folder), split="dev"), r"train_dataset\.split: got 'dev'; no such split"),
        (
            DatasetSpec(path=str(folder), split="train", columns={"prompt": "topic"}),
            r"train_dataset\.columns: got \['prompt'\]; no such column .*qid, question, level",
        ),
        (DatasetSpec(path=str(folder), split="train", id_column="id"), r"train_dataset\.id_column: got 'id'"),
        (DatasetSpec(path="json"), r"train_dataset\.data_files: got None; required with the builder 'json'"),
        (DatasetSpec(path="json", data_files="hf://datasets/org/x/a.jsonl"), r"only local data files"),
        (DatasetSpec(path=str(tmp_path / "nope.jsonl")), r"train_dataset\.path: got .*nope\.jsonl'; no such file"),
        ({"path": "x", "token": "hf_secret"}, r"not a dataset spec"),
    ]
    for spec, match in cases:
        with pytest.raises(ConfigError, match=match) as err:
            load_item_source(spec, field="train_dataset")
        assert "hf_secret" not in str(err.value)  # a mistaken credential is never echoed
    empty_id = write_jsonl(tmp_path / "ids.jsonl", [{"qid": "a", "topic": "x"}, {"qid": "", "topic": "y"}])
    with pytest.raises(ConfigError, match=r"train_dataset\[1\]\.qid: got ''; id_column values must not be empty"):
        load_item_source(DatasetSpec(path=str(empty_id), id_column="qid"), field="train_dataset")
    repeated = write_jsonl(tmp_path / "rep.jsonl", [{"qid": 1, "topic": "x"}, {"qid": 1, "topic": "y"}])
    with pytest.raises(ConfigError, match=r"train_dataset\[1\]\.item_id: got '1'; item_id values must be unique"):
        stored(load_item_source(DatasetSpec(path=str(repeated), id_column="qid"), field="train_dataset"), tmp_path)


def test_a_dataset_dict_object_needs_a_single_split_or_an_explicit_one():
    one = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)})
    assert load_item_source(one, field="train_dataset") == ROWS
    two = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS)})
    with pytest.raises(ConfigError, match=r"give one of its splits: train, test"):
        load_item_source(two, field="train_dataset")
    assert load_item_source(two["test"], field="train_dataset") == ROWS


# --------------------------------------------------------------------------- provenance in items.parquet
def test_items_parquet_records_the_source_and_fingerprint_of_each_split(tmp_path):
    folder = tmp_path / "saved"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(folder))
    train = load_item_source({"path": str(folder), "columns": RENAME, "id_column": "qid"}, field="train_dataset")
    evals = [{"topic": "rain"}, {"topic": "bees", "item_id": "b"}]
    paths = RunPaths(tmp_path / "run")
    write_items(paths, train, evals)
    sources = read_items_sources(paths.items)
    assert sources["train"] == {
        "source": {
            "kind": "datasets",
            "loader": "load_from_disk",
            "spec": {"path": str(folder), "columns": {"question": "topic"}, "id_column": "qid"},
        },
        "fingerprint": "datasets:" + datasets.load_from_disk(str(folder))._fingerprint,
        "num_items": 3,
    }
    # Not loaded through datasets: sha256 of the stored JSON lines, worked out here from the literal text.
    lines = '{"topic": "rain"}\n{"item_id": "b", "topic": "bees"}\n'
    assert sources["eval"] == {
        "source": {"kind": "python"},
        "fingerprint": "sha256:" + hashlib.sha256(lines.encode()).hexdigest(),
        "num_items": 2,
    }
    # The rows are unchanged by the metadata.
    assert read_items(paths, "eval") == [{"topic": "rain", "item_id": "eval-00000"}, {"topic": "bees", "item_id": "b"}]


def test_task_items_file_items_and_the_eval_fallback_record_their_source(tiny_model_dir, tmp_path):
    job = tiny_job(tiny_model_dir, tmp_path, max_train_items=2)
    task = resolve_task(job)
    train, evals = load_run_items(job, task)
    paths = RunPaths(tmp_path / "run")
    write_items(paths, train, evals)
    sources = read_items_sources(paths.items)
    task_source = {"kind": "task", "task": "toy", "task_options": {"num_items": 4}}
    assert sources["train"]["source"] == sources["eval"]["source"] == task_source
    assert sources["train"]["num_items"] == 2
    jsonl = write_jsonl(tmp_path / "items.jsonl", [{"topic": "rain"}])
    train, evals = load_run_items(job, task, train_items=str(jsonl))
    write_items(paths, train, evals)
    sources = read_items_sources(paths.items)
    assert sources["train"]["source"] == {"kind": "file", "path": str(jsonl)}
    assert sources["eval"]["source"] == task_source  # the toy task has eval items of its own
    # A task without eval items: evaluation falls back to the train items, and so does their source.
    no_evals = dataclasses.replace(task, eval_items=())
    train, evals = load_run_items(job, no_evals, train_items=str(jsonl))
    write_items(paths, train, evals)
    sources = read_items_sources(paths.items)
    assert (
        sources["eval"]
        == sources["train"]
        == {
            "source": {"kind": "file", "path": str(jsonl)},
            "num_items": 1,
            "fingerprint": "sha256:" + hashlib.sha256(b'{"topic": "rain"}\n').hexdigest(),
        }
    )


def test_items_parquet_without_sources_is_named(tmp_path):
    path = tmp_path / "items.parquet"
    pq.write_table(pa.Table.from_pylist([{"item_id": "a", "split": "train", "position": 0, "data": "{}"}]), path)
    with pytest.raises(ArtifactError, match=r"items\.parquet: no pbrl\.items_sources metadata"):
        read_items_sources(path)


# --------------------------------------------------------------------------- the YAML form
def test_a_yaml_mapping_is_a_dataset_spec_through_the_whole_start(tiny_model_dir, tmp_path):
    jsonl = write_jsonl(tmp_path / "items.jsonl", ROWS)
    job = parse_job(
        {
            "trainer": "madpo_iter",
            "agent_model": str(tiny_model_dir),
            "run_name": "r",
            "output_dir": str(tmp_path / "runs"),
            "train_dataset": {"path": "json", "data_files": str(jsonl), "columns": RENAME, "id_column": "qid"},
            "formatters": ["tests.helpers:short_prompt", "tests.helpers:long_prompt"],
            "reward_func": "pbrl.tasks.toy:toy_reward",
        }
    )
    assert job.train_dataset == DatasetSpec(path="json", data_files=str(jsonl), columns=RENAME, id_column="qid")
    # run.json stores it as a mapping and reads it back as the same spec (resume compares them).
    assert parse_job(job.model_dump(mode="json")).train_dataset == job.train_dataset
    run_dir = prepare_run(job, resume=False)
    assert read_items(RunPaths(run_dir), "train") == EXPECTED
    assert read_items_sources(RunPaths(run_dir).items)["train"]["source"]["spec"]["path"] == "json"


def test_non_utf8_bytes_in_a_jsonl_dataset_are_one_clear_error(tmp_path):
    """Issue #29: a non-UTF-8 byte gave a UnicodeDecodeError traceback (as a dataset spec the same file gave a
    clean error)."""
    from pbrl.data.items import load_item_source

    bad = tmp_path / "items.jsonl"
    bad.write_bytes(b'{"item_id": "a", "topic": "ok"}\n{"item_id": "b", "topic": "caf\xe9"}\n')
    with pytest.raises(ConfigError) as info:
        load_item_source(bad, field="train_dataset")
    (problem,) = info.value.problems
    assert (problem.field, problem.value) == ("train_dataset", f"{bad}:2")
    assert "is not UTF-8 text (byte 31 of the line: b'\\xe9')" in problem.message
    corrupt = tmp_path / "items.parquet"
    corrupt.write_bytes(b"not parquet")
    with pytest.raises(ConfigError, match="not a readable Parquet file"):
        load_item_source(corrupt, field="eval_dataset")
