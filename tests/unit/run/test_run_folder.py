"""Run folders: items from every source with stable ids, tasks from import paths, run.json, resume rules."""

from __future__ import annotations

import json
import re

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pbrl.config import parse_job
from pbrl.data.items import load_item_source, read_items
from pbrl.data.schema import SCORES
from pbrl.data.storage import RunPaths
from pbrl.data.tables import read_rows
from pbrl.errors import ConfigError
from pbrl.run.folder import prepare_run
from pbrl.run.task import resolve_task
from stages import STAGE_MODULES
from tests.helpers import tiny_job

ITEMS = [{"topic": "rain"}, {"topic": "bees", "item_id": "custom-1"}, {"topic": "tides"}]


def test_items_from_list_jsonl_parquet_and_dataset_agree(tmp_path):
    jsonl = tmp_path / "items.jsonl"
    jsonl.write_text("\n".join(json.dumps(x) for x in ITEMS) + "\n\n")
    parquet = tmp_path / "items.parquet"
    pq.write_table(pa.Table.from_pylist([{"topic": x["topic"], "item_id": x.get("item_id")} for x in ITEMS]), parquet)
    from_list = load_item_source(ITEMS, field="train_dataset")
    assert load_item_source(jsonl, field="train_dataset") == from_list
    assert load_item_source(
        datasets.Dataset.from_list([{"topic": x["topic"], "item_id": x.get("item_id")} for x in ITEMS]),
        field="train_dataset",
    ) == [{"topic": x["topic"], "item_id": x.get("item_id")} for x in ITEMS]
    assert [x["topic"] for x in load_item_source(parquet, field="train_dataset")] == ["rain", "bees", "tides"]


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ('{"topic": "a"}\n{not json\n', r"items.jsonl:2.*malformed JSON"),
        ('{"topic": "a"}\n[1, 2]\n', r"train_dataset\[1\].*mapping"),
    ],
)
def test_bad_item_files_name_the_line_or_item(tmp_path, content, match):
    path = tmp_path / "items.jsonl"
    path.write_text(content)
    with pytest.raises(ConfigError, match=match):
        load_item_source(path, field="train_dataset")


def test_missing_and_unknown_item_files(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_item_source(tmp_path / "nope.jsonl", field="train_dataset")
    (tmp_path / "items.csv").write_text("topic\nrain\n")
    with pytest.raises(ConfigError, match=r"\.jsonl or \.parquet"):
        load_item_source(tmp_path / "items.csv", field="train_dataset")


def test_stable_item_ids_and_duplicates(tiny_model_dir, tmp_path):
    path = tmp_path / "items.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in ITEMS))
    job = parse_job(
        {
            "trainer": "madpo_iter",
            "agent_model": str(tiny_model_dir),
            "run_name": "r",
            "output_dir": str(tmp_path),
            "train_dataset": str(path),
            "formatters": ["tests.helpers:short_prompt", "tests.helpers:long_prompt"],
            "reward_func": "pbrl.tasks.toy:toy_reward",
        }
    )
    run_dir = prepare_run(job, resume=False)
    assert [x["item_id"] for x in read_items(RunPaths(run_dir), "train")] == ["item-00000", "custom-1", "item-00002"]
    # No eval dataset: evaluation uses the train items under their own ids.
    assert [x["topic"] for x in read_items(RunPaths(run_dir), "eval")] == ["rain", "bees", "tides"]
    # The task from import paths samples and scores.
    STAGE_MODULES["sample-candidates"].run(
        run_dir, 1, job.model_copy(update={"preference_num_candidates": 2, "max_new_tokens": 4})
    )
    STAGE_MODULES["score-with-oracle"].run(run_dir, 1, job)
    assert len(read_rows(RunPaths(run_dir).scores(1), SCORES)) == 3 * 4
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"item_id": "x", "topic": "a"}\n{"item_id": "x", "topic": "b"}\n')
    with pytest.raises(ConfigError, match=r"train_dataset\[1\]\.item_id.*unique"):
        prepare_run(job.model_copy(update={"train_dataset": str(dup), "run_name": "dup"}), resume=False)


def test_bad_import_paths_are_config_errors(tiny_model_dir, tmp_path):
    job = tiny_job(
        tiny_model_dir,
        tmp_path,
        task=None,
        task_options={},
        train_dataset=str(tmp_path / "x.jsonl"),
        formatters=["tests.helpers:short_prompt", "tests.helpers:nope"],
        reward_func="no.such:module",
    )
    with pytest.raises(ConfigError) as err:
        resolve_task(job)
    text = str(err.value)
    assert "formatters" in text and "tests.helpers:nope" in text and "reward_func" in text


def test_run_json_holds_no_secret_and_resume_rules(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MY_JUDGE_KEY", "sk-very-secret")
    job = tiny_job(tiny_model_dir, tmp_path)
    run_dir = prepare_run(job, resume=False)
    assert "sk-very-secret" not in RunPaths(run_dir).run_json.read_text()
    with pytest.raises(ConfigError, match="already exists"):
        prepare_run(job, resume=False)
    assert prepare_run(job.model_copy(update={"num_iterations": 5}), resume=True) == run_dir  # may grow
    with pytest.raises(ConfigError, match="dpo_beta.*differs from the stored run"):
        prepare_run(job.model_copy(update={"dpo_beta": 0.5}), resume=True)


def test_preflight_reports_every_problem_before_anything_is_written(tiny_model_dir, tmp_path):
    job = tiny_job(
        tiny_model_dir,
        tmp_path,
        agent_model=str(tmp_path / "no-model"),
        comparator_policy="history",
        task="no_such_task",
        task_options={},
    )
    with pytest.raises(ConfigError) as err:
        prepare_run(job, resume=False)
    text = str(err.value)
    assert "agent_model" in text and "no such model folder" in text and "task" in text
    assert not (tmp_path / "run").exists()


def test_cli_train_with_a_bad_model_fails_fast_without_traceback(tmp_path):
    from typer.testing import CliRunner

    from pbrl.cli.commands import app

    out = CliRunner().invoke(
        app,
        [
            "train",
            "flows/configs/tiny-madpo-iter.yaml",
            "--set",
            f"output_dir={tmp_path}",
            "--set",
            "agent_model=/no/such/model",
        ],
    )
    assert out.exit_code == 2 and "agent_model" in out.output and "Traceback" not in out.output
    assert not any(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------- failed starts
def test_a_failed_start_leaves_nothing_that_blocks_the_retry(tiny_model_dir, tmp_path, monkeypatch):
    """Issue #16.6: a start that fails after preflight (here: writing the initial checkpoints) used to leave
    run.json and items.parquet behind, so the retry said "already exists" and --resume "differs"."""
    import pbrl.run.folder

    job = tiny_job(tiny_model_dir, tmp_path, lora_r=4)
    real = pbrl.run.folder.write_initial_checkpoints

    def broken(*args, **kwargs):
        raise RuntimeError("simulated failure while writing the initial checkpoints")

    monkeypatch.setattr(pbrl.run.folder, "write_initial_checkpoints", broken)
    with pytest.raises(RuntimeError, match="simulated"):
        prepare_run(job, resume=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no run folder, no temporary folder
    monkeypatch.setattr(pbrl.run.folder, "write_initial_checkpoints", real)
    run_dir = prepare_run(job, resume=False)  # the retry starts cleanly
    assert (run_dir / "run.json").is_file() and (run_dir / "checkpoints/initial/agent_1/source.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_folder_that_is_not_a_run_is_never_written_into(tiny_model_dir, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"exists and is not a run folder"):
        prepare_run(tiny_job(tiny_model_dir, tmp_path), resume=False)
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["notes.txt"]


# ---------------------------------------------------------------------------------------------- preflight
def test_preflight_reads_the_items_and_names_each_unformattable_one(tiny_model_dir, tmp_path):
    """Issue #16.13: an item missing a field the formatters need was reported only after Prefect started."""
    from pbrl.run.preflight import preflight

    path = tmp_path / "items.jsonl"
    path.write_text('{"topic": "rain"}\n{"subject": "bees"}\n{"topic": "tides", "item_id": "t"}\n')
    job = tiny_job(
        tiny_model_dir,
        tmp_path,
        task=None,
        task_options={},
        train_dataset=str(path),
        formatters=["tests.helpers:short_prompt", "tests.helpers:long_prompt"],
        reward_func="pbrl.tasks.toy:toy_reward",
    )
    with pytest.raises(ConfigError) as info:
        preflight(job)
    assert [str(p) for p in info.value.problems] == [
        "train_dataset[1]: got 'item-00001'; formatters[0] cannot format this item (missing field 'topic')",
        "train_dataset[1]: got 'item-00001'; formatters[1] cannot format this item (missing field 'topic')",
    ]
    assert not (tmp_path / "run").exists()


def test_preflight_refuses_an_empty_dataset(tiny_model_dir, tmp_path):
    from pbrl.run.preflight import preflight

    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    job = tiny_job(
        tiny_model_dir,
        tmp_path,
        task=None,
        task_options={},
        train_dataset=str(path),
        formatters=["tests.helpers:short_prompt", "tests.helpers:long_prompt"],
        reward_func="pbrl.tasks.toy:toy_reward",
    )
    with pytest.raises(ConfigError, match=r"train_dataset: got '.*empty.jsonl'; no train items"):
        preflight(job)


def test_validate_reports_bad_items_without_starting_anything(tiny_model_dir, tmp_path):
    from typer.testing import CliRunner

    from pbrl.cli.commands import app

    items = tmp_path / "items.jsonl"
    items.write_text('{"subject": "bees"}\n')
    config = tmp_path / "c.yaml"
    config.write_text(
        f"trainer: madpo_iter\nagent_model: {tiny_model_dir}\ntrain_dataset: {items}\n"
        "formatters: [tests.helpers:short_prompt, tests.helpers:long_prompt]\n"
        "reward_func: pbrl.tasks.toy:toy_reward\n"
    )
    out = CliRunner().invoke(app, ["validate", str(config)])
    assert out.exit_code == 2 and "train_dataset[0]" in out.output and "missing field 'topic'" in out.output


def test_in_process_task_label_explains_itself_outside_its_process(tiny_model_dir, tmp_path):
    job = tiny_job(tiny_model_dir, tmp_path, task="python")
    with pytest.raises(ConfigError, match=r"task: got 'python'; this run's task was given as Python objects"):
        resolve_task(job)


def test_a_run_without_a_name_gets_a_generated_one(tiny_model_dir, tmp_path):
    """Issue #16.12: a UI-started run without run_name must get '<trainer>-<UTC time>', as the field says."""
    from datetime import UTC, datetime

    from pbrl.run.folder import generated_run_name, with_run_name

    assert generated_run_name("madpo_iter", datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)) == "madpo_iter-20250102-030405"
    job = tiny_job(tiny_model_dir, tmp_path, run_name=None)
    named = with_run_name(job)
    assert re.fullmatch(r"madpo_iter-\d{8}-\d{6}", named.run_name) and job.run_name is None
    assert with_run_name(named) is named


def test_reward_backbone_layers_beyond_the_backbone_are_refused_before_anything_is_written(tiny_model_dir, tmp_path):
    job = tiny_job(tiny_model_dir, tmp_path, trainer="marlhf_iter", reward_backbone_layers=3)
    with pytest.raises(ConfigError, match=r"reward_backbone_layers: got 3; the reward model backbone .* has 2 layers"):
        prepare_run(job, resume=False)
    assert list(tmp_path.iterdir()) == []
    prepare_run(tiny_job(tiny_model_dir, tmp_path, trainer="marlhf_iter", reward_backbone_layers=2), resume=False)


@pytest.mark.parametrize("targets", [["q_projx"], ["q_proj", "q_projx"]])
def test_unknown_lora_target_modules_are_refused_before_anything_is_written(tiny_model_dir, tmp_path, targets):
    """Issue #16.6: [q_projx] crashed in peft after run.json was written; [q_proj, q_projx] silently adapted
    q_proj only. Both are one ConfigError naming the field and the unknown name, from validate and train."""
    from typer.testing import CliRunner

    from pbrl.cli.commands import app

    job = tiny_job(tiny_model_dir, tmp_path, lora_r=4, lora_target_modules=targets)
    with pytest.raises(ConfigError, match=r"lora_target_modules: got \['q_projx'\]; no module of"):
        prepare_run(job, resume=False)
    assert list(tmp_path.iterdir()) == []
    config = tmp_path / "c.yaml"
    config.write_text(
        f"trainer: madpo_iter\ntask: toy\nagent_model: {tiny_model_dir}\nlora_r: 4\n"
        f"lora_target_modules: {json.dumps(targets)}\noutput_dir: {tmp_path / 'runs'}\n"
    )
    for command in (["validate", str(config)], ["train", str(config)]):
        out = CliRunner().invoke(app, command)
        assert out.exit_code == 2 and "lora_target_modules: got ['q_projx']" in out.output, out.output
    assert not (tmp_path / "runs").exists()


def test_preflight_refuses_full_fine_tuning_that_would_be_offloaded(tiny_model_dir, tmp_path):
    """agent_devices: auto without LoRA whose max_memory forces disk offload: offloaded weights cannot be
    trained, so preflight says so (naming max_memory) before anything is written."""
    from pbrl.run.preflight import preflight

    job = tiny_job(tiny_model_dir, tmp_path, agent_devices="auto", max_memory={"cpu": "100KB"})
    with pytest.raises(ConfigError, match=r"max_memory"):
        preflight(job)
    preflight(tiny_job(tiny_model_dir, tmp_path, agent_devices="auto", max_memory={"cpu": "100KB"}, lora_r=4))
    assert not (tmp_path / "run").exists()


def test_task_option_errors_keep_their_quotes_and_name_the_options(tiny_model_dir, tmp_path):
    """Issue #29: a task_options error lost its closing quote (the message was stripped of quotes)."""
    from pbrl.errors import ConfigError
    from pbrl.run.task import resolve_task
    from tests.helpers import tiny_job

    with pytest.raises(ConfigError) as info:
        resolve_task(tiny_job(tiny_model_dir, tmp_path, task_options={"num_itemz": 3}))
    assert str(info.value.problems[0]) == (
        "task_options: got {'num_itemz': 3}; unknown option(s) 'num_itemz' of task "
        "'toy'; its options: num_agents, num_items"
    )
    with pytest.raises(ConfigError) as info:
        resolve_task(tiny_job(tiny_model_dir, tmp_path, task="toyy", task_options={}))
    assert str(info.value.problems[0]) == (
        "task: got 'toyy'; unknown task 'toyy'; registered: humaneval_coop, humaneval_docs, toy"
    )
