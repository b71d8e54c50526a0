"""oneMKL's mode in the manifests: a float32 job whose CPU matrix products ran outside MKL's strict reproducibility
mode (docs/results/benchmarks.md#two-stage-processes-on-2-cores) says so in every stage manifest, naming the cause."""

from __future__ import annotations

import pytest
import torch

from pbrl.data.storage import RunPaths, read_manifest
from pbrl.models import threads
from pbrl.run.folder import write_run_json
from pbrl.run.stage_record import StageRecord
from tests.helpers import tiny_job

NOTE = (
    "float32 matrix products ran outside oneMKL's strict reproducibility mode ({cause}): their last bits can differ "
    "from a run in strict mode and with the thread count"
)


def _messages(job, run_dir) -> list[str]:
    RunPaths(run_dir).round_dir(1).mkdir(parents=True)
    write_run_json(RunPaths(run_dir), job)  # a run folder (a stage refuses to write into a folder with no run.json)
    StageRecord("build-pairs", run_dir, 1, job).finish([], [])
    return read_manifest(RunPaths(run_dir), 1, "build-pairs").messages


@pytest.mark.parametrize(
    ("strict", "torch_dtype", "devices", "noted"),
    [
        (True, "float32", "cpu", False),
        (False, "float32", "cpu", True),
        (False, "bfloat16", "cpu", False),  # oneDNN's products: the mode does not govern them
        (False, "float32", "cuda:0", False),  # cuBLAS's
    ],
)
def test_a_float32_cpu_stage_outside_mkls_strict_mode_says_so_in_its_manifest(
    tiny_model_dir, tmp_path, monkeypatch, strict, torch_dtype, devices, noted
):
    """The mode is an input to float32 results (a matmul before ``import pbrl``, or the user's own ``MKL_CBWR``, leaves
    MKL in its default mode): a manifest whose bits owe something to it says so."""
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: True)
    monkeypatch.setattr(threads, "mkl_cbwr_mode", lambda: 0x10000 | 2 if strict else 2)  # AUTO, strict bit or not
    monkeypatch.setenv("MKL_CBWR", "AUTO")
    job = tiny_job(tiny_model_dir, tmp_path, torch_dtype=torch_dtype, agent_devices=devices)
    note = NOTE.format(cause="the environment sets MKL_CBWR=AUTO")
    assert (note in _messages(job, tmp_path / "run")) == noted


@pytest.mark.parametrize(
    ("setting", "mode", "cause"),
    [
        ("AUTO,STRICT", 2, "MKL ran before pbrl was imported"),
        ("COMPATIBLE", 1, "the environment sets MKL_CBWR=COMPATIBLE"),
        (None, 2, "MKL_CBWR is unset"),
        ("", 2, "MKL_CBWR is unset"),
        ("AUTO,STRICT", None, "pbrl could not read the mode of torch's MKL"),
    ],
)
def test_the_note_names_its_cause(monkeypatch, setting, mode, cause):
    """``import pbrl`` asks for AUTO,STRICT: when that is the setting and the mode is still not strict, MKL had already
    started (a matrix product before the import), and the note says that rather than blame the setting; a mode that
    cannot be read is not blamed on anything."""
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: True)
    monkeypatch.setattr(threads, "mkl_cbwr_mode", lambda: mode)  # 2: AUTO without the strict bit
    if setting is None:
        monkeypatch.delenv("MKL_CBWR", raising=False)
    else:
        monkeypatch.setenv("MKL_CBWR", setting)
    assert threads.mkl_mode_note() == NOTE.format(cause=cause)


def test_products_are_thread_independent_only_with_the_strict_bit(monkeypatch):
    for mode, strict in [(None, False), (2, False), (0x10000 | 2, True)]:
        monkeypatch.setattr(threads, "mkl_cbwr_mode", lambda mode=mode: mode)
        assert threads.gemm_independent_of_threads() is strict


def test_no_note_in_strict_mode_or_without_mkl(monkeypatch):
    monkeypatch.setattr(threads, "mkl_cbwr_mode", lambda: 0x10000 | 2)
    assert threads.mkl_mode_note() is None
    monkeypatch.setattr(threads, "mkl_cbwr_mode", lambda: 2)
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: False)
    assert threads.mkl_mode_note() is None


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch without oneMKL")
def test_this_process_runs_in_strict_mode_after_import_pbrl():
    assert threads.gemm_independent_of_threads() and threads.mkl_mode_note() is None
