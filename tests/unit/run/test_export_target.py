"""Issue #53.6: an export never deletes what it did not write, refuses what it cannot take with one line, reports a
damaged checkpoint by name, and gives every file the same modes."""

from __future__ import annotations

import json
import stat

import pytest
from typer.testing import CliRunner

from pbrl.cli.commands import app
from pbrl.data.folders import FILE_MODE, FOLDER_MODE
from pbrl.errors import ArtifactError, ConfigError
from pbrl.run.export import EXPORT_FILE, export_agents
from tests.helpers import new_run

runner = CliRunner()


@pytest.fixture
def run_dir(tiny_model_dir, tmp_path):
    return new_run(tiny_model_dir, tmp_path / "runs", num_iterations=1, lora_r=4)[0]


def _files(folder):
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def test_a_re_export_replaces_only_its_own_files_and_keeps_the_users(run_dir, tmp_path):
    """Issue #53.6: re-exporting deleted the .git folder and the notes the user had put beside the export."""
    out = tmp_path / "out"
    export_agents(run_dir, out)
    record = json.loads((out / EXPORT_FILE).read_text())
    assert sorted(record["files"]) == _files(out)  # every file it wrote, the record included
    (out / ".git").mkdir()
    (out / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (out / "notes.md").write_text("my notes")
    (out / "agent_0" / "adapter_model.safetensors").write_bytes(b"stale")  # one of ours, changed: replaced
    export_agents(run_dir, out)
    assert (out / ".git" / "HEAD").read_text() == "ref: refs/heads/main\n" and (
        out / "notes.md"
    ).read_text() == "my notes"
    assert (out / "agent_0" / "adapter_model.safetensors").read_bytes() != b"stale"
    assert not [p for p in out.iterdir() if p.name.startswith((".tmp-export-", ".old-export-"))]


def test_a_file_of_the_users_inside_an_agent_folder_is_refused_and_left_alone(run_dir, tmp_path):
    out = tmp_path / "out"
    export_agents(run_dir, out)
    (out / "agent_1" / "eval-notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"files pbrl did not write inside the agent folders \(agent_1/eval-notes"):
        export_agents(run_dir, out)
    assert (out / "agent_1" / "eval-notes.txt").read_text() == "mine"


def test_an_export_of_before_issue_53_is_still_replaced_keeping_what_lies_beside_it(run_dir, tmp_path):
    out = tmp_path / "out"
    export_agents(run_dir, out)
    record = json.loads((out / EXPORT_FILE).read_text())
    del record["files"]
    (out / EXPORT_FILE).write_text(json.dumps(record))
    (out / "notes.md").write_text("my notes")
    export_agents(run_dir, out)
    assert (out / "notes.md").read_text() == "my notes" and "files" in json.loads((out / EXPORT_FILE).read_text())


def test_every_exported_file_and_folder_has_the_modes_of_the_umask(run_dir, tmp_path):
    """Issue #53.6: pbrl-export.json was 0600 (a temporary file's mode) beside 0644 files."""
    out = tmp_path / "out"
    export_agents(run_dir, out)
    modes = {p.relative_to(out).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in [out, *out.rglob("*")]}
    assert {m for p, m in modes.items() if (out / p).is_file()} == {FILE_MODE}, modes
    assert {m for p, m in modes.items() if (out / p).is_dir()} == {FOLDER_MODE}, modes


@pytest.mark.parametrize("target", ["a file", "under a file", "the run folder", "inside the run", "a damaged record"])
def test_a_target_that_cannot_take_the_export_is_one_error_line(run_dir, tmp_path, target):
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    out = {
        "a file": a_file,
        "under a file": a_file / "out",
        "the run folder": run_dir,
        "inside the run": run_dir / "exported",
        "a damaged record": tmp_path / "earlier",
    }[target]
    if target == "a damaged record":
        out.mkdir()
        (out / EXPORT_FILE).write_text("{broken")
    result = runner.invoke(app, ["export", str(run_dir), str(out)])
    assert result.exit_code == 2, result.output
    assert result.output.count("error:") == 1 and "Traceback" not in result.output and "out: got" in result.output
    assert not (run_dir / "exported").exists()


def test_a_damaged_checkpoint_is_named_with_its_fix_not_a_loader_traceback(run_dir, tmp_path):
    weights = run_dir / "checkpoints" / "initial" / "agent_1" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ArtifactError, match=r"agent_1: cannot be loaded \(.*\); the checkpoint is damaged"):
        export_agents(run_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-written under the final name
    result = runner.invoke(app, ["export", str(run_dir), str(tmp_path / "out")])
    assert result.exit_code == 2 and result.output.count("error:") == 1 and "Traceback" not in result.output


def test_a_run_of_model_objects_names_no_absolute_path_and_follows_a_moved_storage(
    tiny_model_dir, tmp_path, monkeypatch
):
    """Issue #53.7: run.json held the saved object's absolute folder, so moving the storage broke resume and export."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pbrl.data.storage import RunPaths, read_json
    from pbrl.run.folder import prepare_run
    from pbrl.trainers.model_objects import save_model_object
    from tests.helpers import tiny_job

    monkeypatch.setenv("PBRL_STORAGE", str(tmp_path / "storage"))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    name = save_model_object(model, AutoTokenizer.from_pretrained(tiny_model_dir))
    run_dir = prepare_run(tiny_job(name, tmp_path / "runs", num_iterations=1), resume=False)
    text = RunPaths(run_dir).run_json.read_text()
    assert str(tmp_path) not in text and read_json(RunPaths(run_dir).run_json)["config"]["agent_model"] == name
    (tmp_path / "storage").rename(tmp_path / "moved-storage")
    with pytest.raises(ConfigError, match="no such saved model object .* point PBRL_STORAGE at the storage"):
        export_agents(run_dir, tmp_path / "out")
    monkeypatch.setenv("PBRL_STORAGE", str(tmp_path / "moved-storage"))
    folders = export_agents(run_dir, tmp_path / "out")
    assert (folders[0] / "config.json").is_file()
    assert prepare_run(tiny_job(name, tmp_path / "runs", num_iterations=1), resume=True) == run_dir  # resumes
