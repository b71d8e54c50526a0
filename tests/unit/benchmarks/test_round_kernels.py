"""``benchmarks/round_kernels.py`` on the tiny model: every stage of the demo round is profiled, and the round's floor
is the sum of its stages' matrix-product and attention seconds (each within the stage's own operators and wall),
those of the stages that work per training problem scaled to the demo's 16."""

from __future__ import annotations

import json
import sys

import pytest

from tests.helpers import benchmark_script


@pytest.fixture(scope="module")
def round_kernels():
    with benchmark_script("round_kernels") as module:
        yield module


def test_the_floor_is_the_round_stages_kernel_seconds(round_kernels, tmp_path, monkeypatch):
    import benchkit

    monkeypatch.setattr(benchkit, "RESULTS_DIR", tmp_path)  # never over the committed results
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "round_kernels.py",
            "--model",
            "tiny-random",
            "--train-items",
            "2",
            "--set",
            "task_options={num_train_items: 16, num_eval_items: 2}",
            "--set",
            "eval_num_samples=2",
        ],
    )
    round_kernels.main()
    result = json.loads((tmp_path / "round-kernels-tiny-random.json").read_text())
    stages = [(s["round"], s["stage"]) for s in result["stages"]]
    assert stages == [
        (0, "evaluate"),
        *((1, name) for name in ("sample-candidates", "score-with-oracle", "build-pairs", "store-round")),
        *((1, name) for name in ("replay-select", "update-policies", "evaluate")),
    ]
    for s in result["stages"]:
        assert 0 <= s["products_s"] + s["attention_s"] <= s["operators_s"] <= s["wall_s"] * 1.05, s
    sampled = next(s for s in result["stages"] if s["stage"] == "sample-candidates")
    assert sampled["products_s"] > 0 and sampled["attention_s"] > 0  # the model ran, and was seen
    update = next(s for s in result["stages"] if s["stage"] == "update-policies")
    assert 0 < update["attention_backward_s"] < update["attention_s"]  # attention's backward is counted too
    # round 1's stages but its evaluation ran on 2 of the round's 16 training problems (--set): counted 8 times
    assert [s["scale"] for s in result["stages"]] == [1.0, 8.0, 8.0, 8.0, 8.0, 8.0, 8.0, 1.0]
    assert result["train_items"] == {"profiled": 2, "demo": 16}
    floor = sum((s["products_s"] + s["attention_s"]) * s["scale"] for s in result["stages"] if s["round"] == 1)
    assert result["round_1_kernels_s"] == pytest.approx(floor, abs=0.06)
    assert result["checks"][0]["value"] == result["round_1_kernels_s"] and result["checks"][0]["applies"] is False
