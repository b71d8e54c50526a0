"""Stored features of a frozen reward-model backbone (pbrl.learning.feature_store): a later round reads the
features of earlier rounds' joint responses instead of running the backbone on them again."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from pbrl.cli.commands import app
from pbrl.config import load_job
from pbrl.data.schema import PAIR_JOINT_IDS
from pbrl.data.storage import RunPaths
from pbrl.data.tables import read_rows
from pbrl.learning.feature_store import backbone_fingerprint, features_path, load_features, save_features
from pbrl.learning.joint_template import JointInput, JointTemplate, joint_input_ids
from pbrl.learning.reward_fit import pair_metrics
from pbrl.learning.reward_model import JointRewardModel, row_digest, row_features
from pbrl.learning.reward_model_build import RewardModelSpec, new_reward_model
from pbrl.models.loading import load_tokenizer
from tests.flow.test_marlhf import ITER_YAML

FROZEN = ["reward_freeze_backbone=true", "reward_pooling=segments", "preference_replay_mode=all_history"]


@pytest.fixture(scope="module")
def template(tiny_model_dir):
    return JointTemplate.build(load_tokenizer(tiny_model_dir), 2)


def _rows(template, n: int, seed: int) -> list[JointInput]:
    rng = np.random.default_rng(seed)
    return [
        joint_input_ids(
            template,
            [[int(x) for x in rng.integers(5, 300, 4)] for _ in range(2)],
            [[int(x) for x in rng.integers(5, 300, int(rng.integers(1, 6)))] for _ in range(2)],
            None,
        )
        for _ in range(n)
    ]


def _fingerprint(model: JointRewardModel, source: str, layers: int | None = None) -> str:
    return backbone_fingerprint(model.backbone, source=source, pooling="segments", backbone_layers=layers, num_agents=2)


def test_saved_features_load_back_only_under_the_same_fingerprint(tiny_model_dir, template, tmp_path):
    model = new_reward_model(
        RewardModelSpec(str(tiny_model_dir), freeze_backbone=True, pooling="segments", num_agents=2), seed=0
    )
    rows = _rows(template, 5, seed=1)
    features = {row_digest(r): f for r, f in zip(rows, row_features(model, rows), strict=True)}
    fingerprint = _fingerprint(model, str(tiny_model_dir))
    path = features_path(tmp_path / "rounds" / "0001")
    save_features(path, features, fingerprint)
    loaded = load_features(path, fingerprint)
    assert loaded.keys() == features.keys()
    assert all(torch.equal(loaded[d], features[d]) for d in features)
    with safe_open(str(path), framework="pt") as handle:  # the digests in the tensor's row order
        assert json.loads(handle.metadata()["store"])["rows"] == sorted(features)

    assert load_features(path, _fingerprint(model, str(tiny_model_dir), layers=1)) == {}  # another depth
    assert load_features(path, _fingerprint(model, "another-source")) == {}
    with torch.no_grad():  # a weight moved anywhere: another backbone
        next(model.backbone.parameters()).view(-1)[0] += 1e-3
    assert load_features(path, _fingerprint(model, str(tiny_model_dir))) == {}
    assert load_features(tmp_path / "missing.safetensors", fingerprint) == {}
    save_features(path, {}, fingerprint)  # nothing to store: an earlier attempt's file goes
    assert not path.exists()


def test_known_features_are_not_run_through_the_backbone_and_score_alike(tiny_model_dir, template):
    spec = RewardModelSpec(str(tiny_model_dir), freeze_backbone=True, pooling="segments", num_agents=2)
    rows = _rows(template, 6, seed=2)
    pairs = [(rows[0], rows[1]), (rows[2], rows[3]), (rows[4], rows[5])]
    first = new_reward_model(spec, seed=0)
    with first.remembered_features() as memory:
        expected = pair_metrics(first, pairs, 16)
        stored = {d: memory[d] for d in [row_digest(r) for r in rows[:4]]}
    second = new_reward_model(spec, seed=0)
    runs: list[int] = []
    compute = second._compute_features
    second._compute_features = lambda batch, *a, **k: runs.append(len(batch)) or compute(batch, *a, **k)
    with second.remembered_features(stored) as memory:
        got = pair_metrics(second, pairs, 16)
        assert set(memory) == {row_digest(r) for r in rows}
    assert runs == [2]  # only the two rows that were not stored
    assert got == expected


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_api")
def test_round_two_reads_round_ones_features_and_runs_the_backbone_on_its_own_rows(tmp_path, monkeypatch):
    result = CliRunner().invoke(
        app, ["train", str(ITER_YAML), "--set", f"output_dir={tmp_path}", *sum([["--set", s] for s in FROZEN], [])]
    )
    assert result.exit_code == 0, result.output
    run_dir = tmp_path / "tiny-marlhf-iter"
    paths = RunPaths(run_dir)

    def digests(round_index: int) -> set[str]:
        """The joint responses of the round's own pairs, as fit-reward-model rebuilds them."""
        with safe_open(str(features_path(paths.round_dir(round_index))), framework="pt") as handle:
            return set(json.loads(handle.metadata()["store"])["rows"])

    stored = {r: digests(r) for r in (1, 2)}
    for r in (1, 2):
        ids = read_rows(paths.round_dir(r) / "pair_joint_ids.parquet", PAIR_JOINT_IDS)
        assert len(stored[r]) <= 2 * len(ids) and stored[r]
    assert not stored[1] & stored[2]  # each round stores its own responses
    fit_2 = json.loads(paths.manifest(2, "fit-reward-model").read_text())
    assert "rounds/0001/reward_features.safetensors" in fit_2["inputs"]
    assert "rounds/0002/reward_features.safetensors" in fit_2["outputs"]
    model_2 = (paths.round_dir(2) / "reward_model" / "head.safetensors").read_bytes()

    # Rerun round 2's fit in process: the backbone runs on round 2's rows only, and the model is the same.
    import stages.fit_reward_model as fit

    runs: list[str] = []
    compute = JointRewardModel._compute_features

    def counted(self, rows, *args, **kwargs):
        runs.extend(row_digest(r) for r in rows)
        return compute(self, rows, *args, **kwargs)

    monkeypatch.setattr(JointRewardModel, "_compute_features", counted)
    # The selection is read once for the stage's input hashes and once for its pairs (a third read crept in once).
    import pbrl.data.tables as tables
    import pbrl.run.selection_records as selection_records

    reads: list[Path] = []
    read = tables.read_rows

    def counted_read(path, *args, **kwargs):
        reads.append(Path(path))
        return read(path, *args, **kwargs)

    monkeypatch.setattr(tables, "read_rows", counted_read)
    monkeypatch.setattr(fit, "read_rows", counted_read)
    monkeypatch.setattr(selection_records, "read_rows", counted_read)  # the stage's input hashes read it there
    job = load_job(ITER_YAML, [f"output_dir={tmp_path}", "run_name=tiny-marlhf-iter", *FROZEN])
    fit.run(run_dir, 2, job)
    assert set(runs) == stored[2] and len(runs) == len(stored[2])
    assert reads.count(paths.selected_pairs(2)) == 2
    assert (paths.round_dir(2) / "reward_model" / "head.safetensors").read_bytes() == model_2
