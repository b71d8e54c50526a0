"""``benchmarks/gpu_check.py``, the GPU check of issue #33, run on the CPU with the tiny model: the command a person
with a GPU runs must not be first tried there. Also its resume comparison by hand: it must see a changed result and
ignore only the metrics that measure the machine."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

from tests.helpers import BENCHMARKS, benchmark_script

MADPO_STAGES = [
    "sample-candidates", "score-with-oracle", "build-pairs", "store-round", "replay-select", "update-policies",
    "evaluate",
]  # fmt: skip


@pytest.fixture(scope="module")
def gpu_check():
    with benchmark_script("gpu_check") as module:
        yield module


def _metrics(folder: Path, rows: list[tuple[int, str, str, float]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows, columns=["round_index", "stage", "metric", "value"]).to_parquet(folder / "metrics.parquet")


def test_the_resume_comparison_ignores_only_the_machines_measurements(gpu_check, tmp_path):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    learned = (1, "update-policies", "madpo/loss", 0.69)
    _metrics(
        whole, [learned, (1, "evaluate", "time/evaluate_seconds", 3.0), (1, "evaluate", "resource/peak_rss_mb", 621.9)]
    )
    _metrics(
        resumed,
        [learned, (1, "evaluate", "time/evaluate_seconds", 4.5), (1, "evaluate", "resource/peak_rss_mb", 666.3)],
    )
    for run in (whole, resumed):
        (run / "checkpoints" / "round_0001").mkdir(parents=True)
        (run / "checkpoints" / "round_0001" / "adapter_model.safetensors").write_bytes(b"weights")
        (run / ".prefect").mkdir()
        (run / ".prefect" / "state.parquet").write_bytes(run.name.encode())  # Prefect's own: not a result
    assert gpu_check.differing_files(whole, resumed) == []

    _metrics(resumed, [(1, "update-policies", "madpo/loss", 0.70), (1, "evaluate", "time/evaluate_seconds", 3.0)])
    (resumed / "checkpoints" / "round_0001" / "adapter_model.safetensors").write_bytes(b"other weights")
    (resumed / "checkpoints" / "round_0001" / "optimizer.pt").write_bytes(b"only in one run")
    assert gpu_check.differing_files(whole, resumed) == [
        "checkpoints/round_0001/adapter_model.safetensors",
        "checkpoints/round_0001/optimizer.pt",
        "metrics.parquet",
    ]


def test_a_resume_is_bitwise_only_when_some_files_were_compared_and_none_differs(gpu_check, tmp_path):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    whole.mkdir(), resumed.mkdir()
    assert gpu_check.compare_runs(whole, resumed)["bitwise"] is False  # nothing stored: nothing shown
    _metrics(whole, [(1, "update-policies", "madpo/loss", 0.69)])
    _metrics(resumed, [(1, "update-policies", "madpo/loss", 0.69)])
    assert gpu_check.compare_runs(whole, resumed) | {"kinds": None} == {
        "files_compared": 1, "kinds": None, "differing": [], "bitwise": True,
    }  # fmt: skip
    _metrics(resumed, [(1, "update-policies", "madpo/loss", 0.70)])
    assert gpu_check.compare_runs(whole, resumed)["differing"] == ["metrics.parquet"]


def test_the_check_exits_1_and_names_the_files_when_the_resume_differs(gpu_check, tmp_path, monkeypatch, capsys):
    import benchkit

    monkeypatch.setattr(benchkit, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--device", "cpu", "--models", "tiny-random"])
    monkeypatch.setattr(gpu_check, "one_round", lambda *args: {"stages": []})
    monkeypatch.setattr(gpu_check, "ray_actors", lambda device, out: {"skipped": "test"})
    differs = {"files_compared": 21, "kinds": "", "differing": ["metrics.parquet"], "bitwise": False}
    monkeypatch.setattr(gpu_check, "resume_is_bitwise", lambda device, out: differs)
    assert gpu_check.main() == 1
    assert "differs from the uninterrupted one in: metrics.parquet (21 files compared)" in capsys.readouterr().out
    assert json.loads((tmp_path / "gpu-check-cpu.json").read_text())["resume"] == differs


def test_the_marlhf_config_is_fitted_to_a_reward_backbone_with_fewer_layers(gpu_check, tiny_model_dir, tmp_path):
    marlhf = BENCHMARKS.parent / "flows" / "configs" / "marlhf-docs.yaml"  # reads layer 10
    deep = tmp_path / "deep"  # only its config is read: 30 layers, as SmolLM2's
    deep.mkdir()
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (deep / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 30}))
    assert gpu_check.fitted_job(marlhf, [f"agent_model={tiny_model_dir}"]).reward_backbone_layers is None  # 2 layers
    assert gpu_check.fitted_job(marlhf, [f"agent_model={deep}"]).reward_backbone_layers == 10
    # the backbone is reward_model_name where set, not the agents' model; the user's overrides count
    both = [f"agent_model={deep}", f"reward_model_name={tiny_model_dir}"]
    assert gpu_check.fitted_job(marlhf, both).reward_backbone_layers is None
    assert (
        gpu_check.fitted_job(
            marlhf, [f"agent_model={tiny_model_dir}", "reward_backbone_layers=2"]
        ).reward_backbone_layers
        == 2
    )
    demo = BENCHMARKS.parent / "flows" / "configs" / "demo.yaml"  # MADPO: no reward model
    assert gpu_check.fitted_job(demo, [f"agent_model={tiny_model_dir}"]).trainer == "madpo_iter"


def test_each_training_stage_reports_what_it_trained_on_per_second(gpu_check):
    job = SimpleNamespace(num_train_epochs=2, reward_num_train_epochs=3)
    rate = functools.partial(gpu_check.trained_per_second, job=job, seconds=4.0)
    assert rate("madpo_iter", "update-policies", {"pairs": 16, "epochs": 2}) == {"pairs_per_s": 8.0}  # 16 x 2 / 4
    # MARLHF's joint responses are already every epoch's rollouts; the reward model's 236 round pairs are not its own
    assert rate("marlhf_iter", "update-policies", {"pairs": 236, "joint_responses": 64}) == {
        "joint_responses_per_s": 16.0
    }
    assert rate("marlhf_iter", "fit-reward-model", {"pairs": 236, "train_pairs": 182}) == {"train_pairs_per_s": 136.5}
    assert rate("marlhf_iter", "update-policies", {"pairs": 0, "steps": 0}) == {"joint_responses_per_s": 0.0}  # skipped
    assert rate("madpo_iter", "evaluate", {"items": 4}) == {}


def test_the_resume_comparison_leaves_out_prefects_folder_inside_the_run_only(gpu_check, tmp_path):
    run = tmp_path / ".prefect" / "runs" / "whole"  # a run folder below some other .prefect folder still counts
    _metrics(run, [(1, "update-policies", "madpo/loss", 0.69)])
    (run / ".prefect").mkdir()
    (run / ".prefect" / "results.parquet").write_bytes(b"prefect's")
    assert gpu_check.stored_results(run) == {"metrics.parquet"}


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_api")
def test_the_check_runs_on_the_cpu_and_finds_the_resume_bitwise(gpu_check, tmp_path, monkeypatch, capsys):
    import benchkit

    monkeypatch.setattr(benchkit, "RESULTS_DIR", tmp_path)  # never over the committed results
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--device", "cpu", "--models", "tiny-random"])
    assert gpu_check.main() == 0
    result = json.loads((tmp_path / "gpu-check-cpu.json").read_text())
    assert [(r["trainer"], r["model"]) for r in result["rounds"]] == [
        ("madpo_iter", "tiny-random"),
        ("marlhf_iter", "tiny-random"),
    ]
    for r in result["rounds"]:
        stages = [(s["round"], s["stage"]) for s in r["stages"]]
        expected = (
            MADPO_STAGES if r["trainer"] == "madpo_iter" else [*MADPO_STAGES[:5], "fit-reward-model", *MADPO_STAGES[5:]]
        )
        assert stages == [(0, "evaluate"), *((1, name) for name in expected)]
        assert all(s["tokens_per_s"] > 0 for s in r["stages"] if s["stage"] in ("sample-candidates", "evaluate"))
    rates = {(r["trainer"], s["stage"]): s for r in result["rounds"] for s in r["stages"] if s["round"] == 1}
    assert rates["madpo_iter", "update-policies"]["pairs_per_s"] > 0
    assert rates["marlhf_iter", "update-policies"]["joint_responses_per_s"] > 0
    assert rates["marlhf_iter", "fit-reward-model"]["train_pairs_per_s"] > 0
    actors = result["ray_actors"]
    if importlib.util.find_spec("ray") is None:
        assert actors == {"skipped": "the 'ray' extra is not installed"}
    else:
        assert [s["stage"] for s in actors["round"]["stages"]][-2:] == ["update-policies", "evaluate"]
    assert result["resume"]["files_compared"] >= 10  # the rounds' tables, the adapters, the optimizer states
    assert result["resume"] | {"files_compared": None} == {
        "files_compared": None,
        "kinds": "parquet (metrics without time/, resource/), safetensors, pt",
        "differing": [],
        "bitwise": True,
    }
    assert "resume bitwise: True" in capsys.readouterr().out


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_api")
def test_a_resume_in_the_bfloat16_defaults_is_bitwise(gpu_check, tmp_path, monkeypatch):
    """Issue #33: the new defaults where the CPU computes bfloat16 (``auto`` -> bfloat16 frozen weights, float32
    LoRA adapters and AdamW), with the demo's LoRA and cross pairs: a run stopped after round 1 and resumed stores
    the same bytes as one that ran through."""
    from pbrl.models import precision
    from pbrl.run.folder import open_job

    monkeypatch.setenv(precision.CPU_BF16_ENV, "1")  # as on a CPU with avx512_bf16, whatever this one has
    demo_shape = ("lora_r=4", "lora_alpha=8", "joint_mode=cross", "pair_selection=counterfactual")
    verdict = gpu_check.resume_is_bitwise("cpu", tmp_path, demo_shape)
    job = open_job(tmp_path / "resumed")
    assert (job.torch_dtype, job.mixed_precision, job.lora_r, job.joint_mode) == ("bfloat16", "no", 4, "cross")
    assert verdict["bitwise"] and verdict["differing"] == []
    adapters = [
        name for name in gpu_check.stored_results(tmp_path / "whole") if name.endswith("adapter_model.safetensors")
    ]
    assert verdict["files_compared"] >= 10 and len(adapters) == 6  # 2 agents x initial, rounds 1 and 2
