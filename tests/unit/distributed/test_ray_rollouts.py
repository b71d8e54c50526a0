"""``runner: ray`` for MARLHF's rollouts (:mod:`pbrl.distributed.ray_rollouts`): shards of a step's rows on Ray workers,
byte-identical to the in-process rollouts.

The flow test reuses :mod:`tests.unit.distributed.test_ray`'s module Ray (2 CPUs; its workers import ``tests`` and
carry the fault variables) and runs ``tiny-marlhf-iter`` with LoRA twice, locally and on Ray with one item per shard,
the Ray run's workers being :class:`DyingOnce`: the first shard it gets for agent 1 kills its process.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest

from pbrl.config.loading import load_job
from pbrl.data.storage import read_json
from pbrl.distributed.ray_rollouts import RolloutWorker, pool_size, rollout_shards, worker_devices
from pbrl.run.settings import policy_source
from tests.helpers import assert_same_artifacts, run_artifacts
from tests.unit.distributed.test_ray import local_ray, needs_ray  # noqa: F401  (local_ray: the module's Ray, a fixture)

ROOT = Path(__file__).resolve().parents[3]
MARLHF_YAML = ROOT / "flows" / "configs" / "tiny-marlhf-iter.yaml"
ARTIFACTS = ("rounds/*/*.parquet", "replay/iteration_*.json", "checkpoints/round_*/agent_*/*.safetensors")


# ---------------------------------------------------------------------------------------------- pure
def test_a_step_splits_into_whole_items_and_the_last_shard_takes_the_rest():
    # 5 items of 2 rows each, 2 items per shard: rows [0, 4), [4, 8), [8, 10)
    assert rollout_shards(10, 2, 2) == [(0, 4), (4, 8), (8, 10)]
    assert rollout_shards(6, 3, 1) == [(0, 3), (3, 6)]
    assert rollout_shards(8, 2, 16) == [(0, 8)]
    assert rollout_shards(0, 2, 4) == []
    rows = ["a0", "a1", "b0", "b1", "c0", "c1", "d0", "d1", "e0", "e1"]  # item letter, generation index
    parts = [rows[start:stop] for start, stop in rollout_shards(len(rows), 2, 2)]
    assert parts == [["a0", "a1", "b0", "b1"], ["c0", "c1", "d0", "d1"], ["e0", "e1"]]  # no item split
    assert [r for part in parts for r in part] == rows  # gathered in shard order: the input order
    with pytest.raises(ValueError, match="not whole items"):
        rollout_shards(5, 2, 1)  # half an item
    with pytest.raises(ValueError):
        rollout_shards(4, 2, 0)


def test_a_worker_holds_every_agent_and_asks_for_one_gpu_per_distinct_cuda_device():
    def job(devices=None, **over):
        return load_job(
            MARLHF_YAML,
            [
                "output_dir=/tmp/x",
                *([f"agent_devices={devices}"] if devices else []),
                *(f"{k}={v}" for k, v in over.items()),
            ],
        )

    assert worker_devices(policy_source(job("cpu"))) == (["cpu", "cpu"], 0)
    assert worker_devices(policy_source(job("cuda:2"))) == (["cuda:0", "cuda:0"], 1)  # the worker's first (only) GPU
    assert worker_devices(policy_source(job("[cuda:3, cuda:1]", parallel_training="mp"))) == (
        ["cuda:1", "cuda:0"],
        2,
    )  # by name
    assert worker_devices(policy_source(job("[cuda:3, cuda:1]"))) == (["cuda:0", "cuda:0"], 1)  # 'none': both on cuda:3
    # train_batch_size 4: the largest step has 4 items, so 4 shards of 1 (2 of 2); capped by what Ray has free
    assert pool_size(policy_source(job("cpu")), min(4, 8), 1, {"CPU": 2.0}) == 2
    assert pool_size(policy_source(job("cpu")), min(4, 8), 1, {"CPU": 16.0}) == 4
    assert pool_size(policy_source(job("cpu")), min(4, 8), 2, {"CPU": 16.0}) == 2
    assert pool_size(policy_source(job("cpu")), min(4, 3), 1, {"CPU": 16.0}) == 3  # fewer items than a batch
    assert (
        pool_size(
            policy_source(job("[cuda:0, cuda:1]", parallel_training="mp")), min(4, 8), 1, {"CPU": 16.0, "GPU": 5.0}
        )
        == 2
    )  # 2 GPUs each: 2 workers fit in 5
    assert pool_size(policy_source(job("cpu")), min(4, 8), 1, {}) == 1  # nothing free now: one worker, which waits


@pytest.mark.parametrize("lora", [True, False], ids=["lora-adapter", "full-state-dict"])
def test_pushed_weights_make_a_fresh_copy_generate_the_moved_policys_tokens(tiny_model_dir, tmp_path, lora):
    """The driver's policy after a step (weights moved) and a copy loaded from the start checkpoint that then
    takes the pushed weights generate the same tokens; without the push they differ (the push matters)."""
    import torch

    from pbrl.distributed.ray_rollouts import _load_weights, trainable_weights
    from pbrl.generation.sampling import SamplingSettings, generate
    from pbrl.models.loading import init_lora_adapter, load_policy, load_tokenizer
    from pbrl.models.lora import LoraSettings
    from pbrl.models.policies import TrainablePolicy, trainable_parameters

    settings = LoraSettings(r=4) if lora else None
    adapter = init_lora_adapter(tiny_model_dir, settings, tmp_path / "agent_0", seed=1) if lora else None

    def load():
        return load_policy(tiny_model_dir, checkpoint_dir=adapter, lora=settings, trainable=True)

    moved, fresh = load(), load()
    with torch.no_grad():  # a large step on every trainable weight: the tokens must change
        for p in trainable_parameters(moved):
            p.add_(torch.linspace(-0.5, 0.5, p.numel()).view_as(p))
    _load_weights(fresh, trainable_weights(TrainablePolicy(moved, None, 0)))

    tokenizer, prompts, seeds = load_tokenizer(tiny_model_dir), [[2, 40, 41, 3]] * 4, [11, 12, 13, 14]
    sample = SamplingSettings(max_new_tokens=12, temperature=1.0, top_p=1.0, top_k=None, batch_size=4)
    tokens = [
        [g.completion_ids for g in generate(m, tokenizer, prompts, seeds, sample)] for m in (moved, fresh, load())
    ]
    assert tokens[0] == tokens[1]
    assert tokens[0] != tokens[2]


# ---------------------------------------------------------------------------------------------- flows
class DyingOnce(RolloutWorker):
    """A rollout worker that logs every shard it starts (its first row's name and seed) to ``PBRL_TEST_CALL_LOG``
    and, the first time it is handed a shard of agent 1 (while no ``PBRL_TEST_KILL_MARKER`` file exists),
    creates the marker and kills its own process, mid-step: agent 0's rows of that step are done."""

    def generate(self, agent, weights, prompt_ids, seeds, row_names):
        with open(os.environ["PBRL_TEST_CALL_LOG"], "a") as f:
            f.write(json.dumps([row_names[0], seeds[0]]) + "\n")
        if agent == 1 and not os.path.exists(marker := os.environ["PBRL_TEST_KILL_MARKER"]):
            try:  # O_EXCL: of two workers starting agent 1's shards at once, one dies
                fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return super().generate(agent, weights, prompt_ids, seeds, row_names)
            os.write(fd, row_names[0].encode())
            os.close(fd)
            os._exit(1)
        return super().generate(agent, weights, prompt_ids, seeds, row_names)


@needs_ray
@pytest.mark.flow
@pytest.mark.usefixtures("prefect_api")
def test_ray_rollouts_are_byte_identical_to_local_and_a_killed_worker_redoes_its_shard(
    tiny_model_dir,
    tmp_path,
    local_ray,  # noqa: F811
    monkeypatch,
):
    from flows.training import train_flow
    from pbrl.distributed import ray_rollouts

    common = [
        f"output_dir={tmp_path}",
        f"agent_model={tiny_model_dir}",
        "lora_r=4",
        "task_options={num_items: 4}",
        "eval_num_samples=2",
        "num_train_epochs=2",
    ]
    local_dir = Path(train_flow(load_job(MARLHF_YAML, [*common, "run_name=local"]))["run_dir"])
    monkeypatch.setattr(ray_rollouts, "RolloutWorker", DyingOnce)
    ray_dir = Path(
        train_flow(load_job(MARLHF_YAML, [*common, "run_name=ray", "runner=ray", "shard_size=1"]))["run_dir"]
    )

    # 4 train items, train_batch_size 4, 2 epochs: 2 steps a round (the second one's rollouts need the weights
    # pushed after the first update), each 4 items = 4 shards of 1 item (2 rows) per agent, on 2 workers (the Ray
    # has 2 CPUs); the local run's manifest says nothing of Ray
    for r in (1, 2):
        details = read_json(ray_dir / f"rounds/000{r}/update-policies.manifest.json")["details"]
        assert (details["rollouts_on"], details["rollout_workers"], details["rollout_shards_per_step"]) == (
            "ray_workers",
            2,
            [4, 4],
        )
        assert "rollouts_on" not in read_json(local_dir / f"rounds/000{r}/update-policies.manifest.json")["details"]
    assert len(list(ray_dir.glob("rounds/000*/rollouts.parquet"))) == 2

    # rollouts, every other Parquet artifact, the replay files and the final adapter weights: the same bytes
    assert_same_artifacts(run_artifacts(ray_dir, ARTIFACTS), run_artifacts(local_dir, ARTIFACTS))
    assert len(list(ray_dir.glob("checkpoints/round_0002/agent_*/adapter_model.safetensors"))) == 2

    # The fault: 2 rounds x 2 steps x 2 agents x 4 shards = 32 shards, each started once, except the one whose
    # worker died (one of agent 1's first two shards of round 1), started again on the restarted worker.
    killed = (local_ray / "killed").read_text()
    assert killed.startswith("agent 1, item ")
    calls = Counter(tuple(json.loads(line)) for line in (local_ray / "calls.jsonl").read_text().splitlines())
    assert sum(calls.values()) == 33 and len(calls) == 32
    assert [name for (name, _), n in calls.items() if n == 2] == [killed]
