"""Run storage: atomic writes, loud readers, manifests written last, content hashes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pbrl.data.schema import CANDIDATES, SCORES
from pbrl.data.storage import (
    STAGES,
    RunPaths,
    StageManifest,
    atomic_dir,
    atomic_path,
    hash_path,
    outputs_intact,
    read_manifest,
    write_json,
    write_manifest,
)
from pbrl.data.tables import read_rows, read_table, write_table
from pbrl.errors import ArtifactError
from stages import STAGE_MODULES

SCORE_ROW = {"item_id": "a", "side": "target", "candidate_index": 0, "raw_reward": 1.0, "reward": 0.5, "failure": None}


def test_interrupted_write_leaves_old_file_and_no_partial(tmp_path):
    path = tmp_path / "scores.parquet"
    write_table(path, [SCORE_ROW], SCORES)
    before = path.read_bytes()
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        tmp.write_bytes(b"PAR1 half a file")
        raise RuntimeError("killed mid-write")
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["scores.parquet"]


def test_process_killed_mid_write_leaves_no_readable_partial_file(tmp_path):
    """SIGKILL while the temporary file is being written: the final name never exists."""
    path = tmp_path / "big.json"
    code = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from pbrl.data.storage import atomic_path
        with atomic_path(Path({str(path)!r})) as tmp:
            tmp.write_text("{{" + "x" * 100000)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert proc.returncode == -9
    assert not path.exists()
    leftovers = list(tmp_path.iterdir())
    assert all(p.name.startswith(".tmp-") for p in leftovers)  # never read: not a valid name


def test_atomic_dir_replaces_whole_folder(tmp_path):
    target = tmp_path / "ckpt"
    with atomic_dir(target) as tmp:
        (tmp / "a.txt").write_text("1")
    with pytest.raises(ValueError), atomic_dir(target) as tmp:
        (tmp / "b.txt").write_text("half")
        raise ValueError
    assert sorted(p.name for p in target.iterdir()) == ["a.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_reader_names_missing_column(tmp_path):
    path = tmp_path / "scores.parquet"
    table = pa.Table.from_pylist([SCORE_ROW], SCORES).drop_columns(["reward"])
    pq.write_table(table, path)
    with pytest.raises(ArtifactError, match=r"scores.parquet: missing column 'reward'"):
        read_table(path, SCORES)


def test_reader_names_wrongly_typed_column(tmp_path):
    path = tmp_path / "candidates.parquet"
    row = {
        "item_id": "a",
        "side": "target",
        "candidate_index": 0,
        "agent_index": 0,
        "prompt": "p",
        "prompt_ids": [1, 2],
        "completion": "c",
        "completion_ids": [3],
        "finish_reason": "eos",
        "seed": 1,
    }
    schema = CANDIDATES.set(
        CANDIDATES.get_field_index("completion_ids"), pa.field("completion_ids", pa.list_(pa.string()))
    )
    pq.write_table(pa.Table.from_pylist([{**row, "completion_ids": ["3"]}], schema), path)
    with pytest.raises(ArtifactError, match=r"candidates.parquet: column 'completion_ids' has type"):
        read_rows(path, CANDIDATES)


def test_reader_rejects_missing_and_corrupt_files(tmp_path):
    with pytest.raises(ArtifactError, match="file not found"):
        read_table(tmp_path / "nope.parquet", SCORES)
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet")
    with pytest.raises(ArtifactError, match="not a readable Parquet file"):
        read_table(bad, SCORES)


def test_writer_names_bad_row(tmp_path):
    with pytest.raises(ArtifactError, match="do not match the declared schema"):
        write_table(tmp_path / "s.parquet", [{**SCORE_ROW, "candidate_index": "zero"}], SCORES)


def test_manifest_round_trip_and_output_check(tmp_path):
    paths = RunPaths(tmp_path)
    out = paths.scores(1)
    write_table(out, [SCORE_ROW], SCORES)
    m = write_manifest(
        paths,
        StageManifest(
            stage="score-with-oracle",
            round_index=1,
            config_hash="c",
            code_version="v",
            outputs={paths.rel(out): hash_path(out)},
        ),
    )
    assert read_manifest(paths, 1, "score-with-oracle") == m
    assert outputs_intact(paths, m)
    write_table(out, [{**SCORE_ROW, "reward": 0.7}], SCORES)
    assert not outputs_intact(paths, m)
    out.unlink()
    assert not outputs_intact(paths, m)
    assert read_manifest(paths, 2, "score-with-oracle") is None


def test_hash_path_covers_folder_contents_not_names_of_parent(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "w.bin").write_bytes(b"123")
    assert hash_path(a) == hash_path(b)
    (b / "w.bin").write_bytes(b"124")
    os.utime(b / "w.bin", ns=(1, 1))
    assert hash_path(a) != hash_path(b)


def test_write_json_refuses_nan(tmp_path):
    with pytest.raises(ValueError):
        write_json(tmp_path / "x.json", {"v": float("nan")})
    assert not (tmp_path / "x.json").exists()


def test_remove_stale_temporaries_removes_exactly_the_leftovers_of_killed_writes(tmp_path):
    """A SIGKILL between creating a temporary and its rename leaves it; a resume removes it (issue #16)."""
    from pbrl.data.storage import remove_stale_temporaries

    paths = RunPaths(tmp_path)
    keep = [
        paths.scores(1),
        paths.round_dir(1) / "tmp-not-a-leftover.txt",
        tmp_path / ".prefect" / "results" / "k",
        paths.round_checkpoint(1) / "agent_0" / "model.safetensors",
    ]
    leftovers = [
        paths.round_dir(1) / ".tmp-scores.parquet.x1",
        tmp_path / ".tmp-run.json.x2",
        paths.round_checkpoint(1) / ".tmp-agent_0.x3" / "model.safetensors",
        paths.round_checkpoint(1) / ".old-agent_1.x4" / "old" / "model.safetensors",
    ]
    for f in keep + leftovers:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"1")
    assert remove_stale_temporaries(paths) == [
        ".tmp-run.json.x2",
        "checkpoints/round_0001/.old-agent_1.x4",
        "checkpoints/round_0001/.tmp-agent_0.x3",
        "rounds/0001/.tmp-scores.parquet.x1",
    ]
    assert all(f.is_file() for f in keep)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()) == [
        ".prefect/results/k",
        "checkpoints/round_0001/agent_0/model.safetensors",
        "rounds/0001/scores.parquet",
        "rounds/0001/tmp-not-a-leftover.txt",
    ]
    assert remove_stale_temporaries(paths) == []


def test_every_table_has_a_typed_record_with_exactly_its_columns_in_order():
    import dataclasses
    import typing

    from pbrl.data.schema import ROW_TYPES

    for name, (schema, record) in ROW_TYPES.items():
        fields = (
            [f.name for f in dataclasses.fields(record)]
            if dataclasses.is_dataclass(record)
            else list(typing.get_type_hints(record))
        )
        assert fields == schema.names, name


def test_a_full_disk_is_named_as_such_with_the_path_and_nothing_stored_is_lost(tmp_path, monkeypatch):
    """Issue #29: a full disk showed "unexpected pos 4928 vs 4820" in 5 tracebacks, never "no space left"."""
    import errno

    import pyarrow as pa

    from pbrl.data import storage
    from pbrl.data.tables import write_table
    from pbrl.errors import ArtifactError

    schema = pa.schema([("x", pa.int32())])
    target = tmp_path / "t.parquet"
    write_table(target, [{"x": 1}], schema)
    before = target.read_bytes()

    def enospc(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("pyarrow.parquet.write_table", enospc)
    with pytest.raises(ArtifactError, match=r"t\.parquet: no space left on device \(.* MiB free in "):
        write_table(target, [{"x": 2}], schema)

    def short_write(*args, **kwargs):  # pyarrow's own wording when a write comes up short
        raise OSError("unexpected pos 4928 vs 4820")

    monkeypatch.setattr("pyarrow.parquet.write_table", short_write)
    monkeypatch.setattr(storage, "_free_bytes", lambda folder: 4096)  # the disk is (nearly) full
    with pytest.raises(ArtifactError, match="no space left on device"):
        write_table(target, [{"x": 2}], schema)
    monkeypatch.setattr(storage, "_free_bytes", lambda folder: 10 * 2**30)  # a full disk it is not: kept as is
    with pytest.raises(OSError, match="unexpected pos"):
        write_table(target, [{"x": 2}], schema)
    assert target.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["t.parquet"]
    with pytest.raises(ArtifactError, match="no space left"):
        with storage.atomic_dir(tmp_path / "ckpt"):
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
    assert not (tmp_path / "ckpt").exists()


def test_the_run_folders_manifest_names_are_the_stages_in_pipeline_order():
    """pbrl.data.storage.STAGES (the manifests a round folder can hold, walked by readers below the stages) and
    stages.STAGE_MODULES name the same stages in the same order."""
    assert tuple(STAGE_MODULES) == STAGES
