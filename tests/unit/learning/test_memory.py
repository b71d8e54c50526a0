"""Training memory of update-policies (issue #14): one agent's autograd graph at a time, micro-batches, the
memory options through the stage, and the peak RSS in the manifests and the round table.

Memory is measured as the bytes of the tensors autograd saves for backward that are alive at once (a
``saved_tensors_hooks`` counter): deterministic, unlike RSS, and it is what grows with the batch.
"""

from __future__ import annotations

import shutil
import sys
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from pbrl.data.storage import RunPaths
from pbrl.learning.madpo import PairBatch, micro_batches
from pbrl.models.policies import TrainablePolicy, trainable_parameters
from pbrl.reporting.metrics import round_table, write_run_metrics
from pbrl.run.stage_record import PEAK_RSS_METRIC
from stages import STAGE_MODULES
from tests.helpers import madpo_step, new_run

PAD = 0
PROMPTS = [[2, 40, 41, 42, 43, 44, 45, 3, 2, 50], [2, 60, 61, 62, 63, 3, 2, 50]] * 2
WINNERS = [[70, 71, 72, 73, 74, 75, 3], [80, 81, 82, 83, 3], [76, 77, 78, 3], [84, 85, 86, 87, 88, 3]]
LOSERS = [[90, 91, 92, 93, 3], [100, 101, 102, 103, 104, 105], [94, 95, 3], [106, 107, 3]]


class SavedTensorPeak:
    """Peak bytes of the activations autograd saves for backward alive at once inside the block: each storage
    counted once however often it is saved, the models' own weights (``exclude``) not counted."""

    def __init__(self, exclude: list[torch.nn.Parameter]) -> None:
        self.exclude = {p.untyped_storage().data_ptr() for p in exclude}
        self.refs: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def _pack(self, tensor: torch.Tensor):
        holder = type("Saved", (), {})()
        holder.tensor = tensor
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.exclude:
            return holder
        if self.refs.get(key, 0) == 0:
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self.refs[key] = self.refs.get(key, 0) + 1
        weakref.finalize(holder, self._release, key, storage.nbytes())
        return holder

    def _release(self, key: int, size: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.live -= size

    def __enter__(self) -> SavedTensorPeak:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda holder: holder.tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def _agents(model_dir: Path, n: int) -> list[TrainablePolicy]:
    out = []
    for _ in range(n):
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        out.append(TrainablePolicy(model, torch.optim.SGD(trainable_parameters(model), lr=1e-3), pad_token_id=PAD))
    return out


def _peak(model_dir: Path, agents: int, pairs: int, micro_batch_size: int | None = None) -> int:
    batch = PairBatch([PROMPTS[:pairs]] * agents, [WINNERS[:pairs]] * agents, [LOSERS[:pairs]] * agents)
    policies = _agents(model_dir, agents)
    with SavedTensorPeak([w for p in policies for w in p.model.parameters()]) as meter:
        madpo_step(policies, batch, beta=0.1, max_grad_norm=1.0, micro_batch_size=micro_batch_size)
    assert meter.live == 0  # every graph freed
    return meter.peak


def test_micro_batches_cover_the_batch_in_order() -> None:
    assert micro_batches(5, None) == [slice(0, 5)]
    assert micro_batches(5, 2) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    assert micro_batches(2, 8) == [slice(0, 2)]


def test_graph_memory_does_not_grow_with_the_number_of_agents(tiny_model_dir: Path) -> None:
    one, two, four = (_peak(tiny_model_dir, a, pairs=4) for a in (1, 2, 4))
    assert one > 0
    # one agent's graph alive at a time: the same peak (the old step held every agent's graph: 2x, 4x)
    assert two == one and four == one


def test_graph_memory_follows_the_micro_batch_not_the_batch(tiny_model_dir: Path) -> None:
    whole = _peak(tiny_model_dir, 2, pairs=4)
    micro = _peak(tiny_model_dir, 2, pairs=4, micro_batch_size=1)
    small_batch = _peak(tiny_model_dir, 2, pairs=1)
    assert micro < 0.5 * whole
    assert micro <= 1.25 * small_batch  # one pair's graph (padding to the batch's width aside)


# --- the options through the stage, and the peak RSS metric ----------------------------------------------


@pytest.fixture(scope="module")
def selected(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A run collected and replay-selected for round 1 (4 items, 3 candidates, train_batch_size 4)."""
    run_dir, job = new_run(tiny_model_dir, tmp_path_factory.mktemp("runs"), train_batch_size=4)
    for name in ("sample-candidates", "score-with-oracle", "build-pairs", "store-round", "replay-select"):
        STAGE_MODULES[name].run(run_dir, 1, job)
    return run_dir, job


def _update(run_dir: Path, job, tmp: Path, **options):
    copy = tmp / "run"
    shutil.copytree(run_dir, copy)
    manifest = STAGE_MODULES["update-policies"].run(copy, 1, job.model_copy(update=options))
    checkpoint = RunPaths(copy).round_checkpoint(1)
    weights = {a: load_file(checkpoint / f"agent_{a}" / "model.safetensors") for a in (0, 1)}
    return manifest, weights


def test_accumulation_and_checkpointing_give_the_same_update_through_the_stage(
    selected, tmp_path: Path, tiny_model_dir: Path
) -> None:
    run_dir, job = selected
    plain, plain_w = _update(run_dir, job, tmp_path / "plain")
    assert plain.counts["pairs"] >= 2 and plain.counts["steps"] >= 1
    options, options_w = _update(
        run_dir, job, tmp_path / "options", gradient_accumulation_steps=4, gradient_checkpointing=True
    )
    assert options.counts == plain.counts
    for name in ("madpo/loss", "madpo/margin_agent_0", "madpo/margin_agent_1"):
        assert options.metrics[name] == pytest.approx(plain.metrics[name], abs=1e-5), name
    base = load_file(tiny_model_dir / "model.safetensors")
    # Weights after 2 AdamW steps at lr = 1e-3 must agree to 1 % of lr per element. Adam's step
    # lr·m̂/(√v̂ + ε) is about lr·sign(g) for most elements, but where the two steps' gradients nearly cancel,
    # or |g| is near ε = 1e-8, it magnifies the float32 rounding of the recomputed (checkpointed) or
    # micro-batch-summed gradient: measured up to 3.7e-6 = 0.4 % of lr (transformers 5.24, torch 2.13).
    # A lost or doubled micro-batch gradient moves many elements by a sizeable share of lr.
    step_tolerance = 1e-2 * job.agent_learning_rate
    for a in (0, 1):
        assert any(not torch.equal(value, base[key]) for key, value in plain_w[a].items())  # it trained
        for key, value in plain_w[a].items():
            torch.testing.assert_close(options_w[a][key], value, atol=step_tolerance, rtol=0.0)


def test_every_manifest_records_the_peak_rss_and_the_round_table_shows_it(selected) -> None:
    run_dir, _ = selected
    manifest = STAGE_MODULES["replay-select"].run(run_dir, 1, selected[1])
    rss = manifest.metrics[PEAK_RSS_METRIC]
    assert 50 < rss < 64 * 1024  # MiB: a Python process with torch loaded, below the machine's memory
    write_run_metrics(run_dir)
    table = round_table(run_dir)
    assert table.loc[1, "peak_rss_gb"] >= rss / 1024 - 1e-9


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_a_stage_starts_by_handing_back_the_heap_the_previous_one_freed(tiny_model_dir: Path, tmp_path, monkeypatch):
    """Found measuring the demo round: the round-1 evaluation peaked ~800 MiB above the update before it, memory
    the update had freed but the C heap still held. 200 MiB of heap-sized blocks, 7 in 8 freed: the free pages
    are resident until released, then handed back; every stage releases them first."""
    import gc
    import os

    from pbrl.run import stage_record

    def rss() -> int:  # bytes resident now (/proc/self/statm's second field, in pages)
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    stage_record.release_free_memory()  # free pages left by earlier tests of this process would be reused unseen
    start = rss()
    blocks = [bytearray(64 * 1024) for _ in range(3200)]  # below glibc's mmap threshold: from the heap
    kept = blocks[::8]
    del blocks
    gc.collect()
    held = rss() - start
    stage_record.release_free_memory()
    after = rss() - start
    assert held > 150 * 2**20 and after < held - 100 * 2**20 and len(kept) == 400

    calls = []
    monkeypatch.setattr(stage_record, "release_free_memory", lambda: calls.append(1))
    run_dir, job = new_run(tiny_model_dir, tmp_path)
    STAGE_MODULES["evaluate"].run(run_dir, 0, job)
    assert calls == [1]
