"""``runner: ray`` (docs/guides/ray.md#sharded-stages): sharded stages on prefect-ray, byte-identical to the local run.

The tests that need Ray are skipped when the ``ray`` extra is not installed (the ``dev`` extra has it, so CI
runs them). The flow tests start one local Ray with 2 CPUs for the
module and run ``tiny-madpo-iter`` twice (local, then Ray with one item per shard: 8 train shards, 4 eval
shards per stage), with a reward function (:func:`reward_logged`, the toy reward) that logs every call and,
in a Ray worker, kills its worker process the first time it sees item ``toy-002``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
from collections import Counter
from pathlib import Path

import pytest

from pbrl.config.loading import config_hash, load_job
from pbrl.data.storage import read_json
from pbrl.distributed.shards import Shard, plan_shards
from pbrl.errors import ConfigError
from pbrl.run.settings import policy_source
from pbrl.tasks.toy import toy_reward
from tests.helpers import assert_same_artifacts, run_artifacts

RAY_MISSING = importlib.util.find_spec("ray") is None or importlib.util.find_spec("prefect_ray") is None
needs_ray = pytest.mark.skipif(RAY_MISSING, reason="the 'ray' extra is not installed (pip install -e '.[ray]')")

ROOT = Path(__file__).resolve().parents[3]
ITER_YAML = ROOT / "flows" / "configs" / "tiny-madpo-iter.yaml"
KILL_ITEM = "toy-002"
ARTIFACTS = ("rounds/*/*.parquet", "replay/iteration_*.json", "checkpoints/round_*/agent_*/*.safetensors")


def reward_logged(*completions, prompts=None, batch_items=None):
    """:func:`pbrl.tasks.toy.toy_reward`, plus a test fault. Where ``PBRL_TEST_CALL_LOG`` is set (the Ray
    workers of these tests), each call appends its item ids to that file; where ``PBRL_TEST_KILL_MARKER``
    is set, the first call that sees ``toy-002`` creates the marker and kills the Ray worker that runs the shard (a
    worker that dies in the middle of a shard). The reward runs in a process forked from that worker
    (:mod:`pbrl.preference.reward_worker`, where its own ``os._exit`` fails only its joint responses), so the worker
    is its parent; the reward's process dies with it."""
    ids = [item["item_id"] for item in batch_items or ()]
    if log := os.environ.get("PBRL_TEST_CALL_LOG"):
        with open(log, "a") as f:
            f.write(json.dumps(ids) + "\n")
    marker = os.environ.get("PBRL_TEST_KILL_MARKER")
    if marker and KILL_ITEM in ids and not os.path.exists(marker):
        Path(marker).write_text(str(os.getppid()))
        os.kill(os.getppid(), signal.SIGKILL)
        os._exit(1)
    return toy_reward(*completions, prompts=prompts, batch_items=batch_items)


# ---------------------------------------------------------------------------------------------- pure
def test_shards_are_contiguous_ranges_and_the_last_takes_the_rest():
    assert plan_shards(10, 4) == [Shard(0, 3, 0, 4), Shard(1, 3, 4, 8), Shard(2, 3, 8, 10)]
    assert plan_shards(3, 1) == [Shard(0, 3, 0, 1), Shard(1, 3, 1, 2), Shard(2, 3, 2, 3)]
    assert plan_shards(2, 16) == [Shard(0, 1, 0, 2)]
    assert plan_shards(0, 4) == []
    assert Shard(1, 12, 1, 2).name == "0001-of-0012"
    with pytest.raises(ValueError):
        plan_shards(4, 0)


def test_a_shard_is_done_only_under_its_key_with_its_table_unchanged(tmp_path):
    from pbrl.data.schema import SCORES
    from pbrl.data.storage import RunPaths
    from pbrl.distributed.shards import ShardSet, gather_shards, shard_done, shard_table, write_shard
    from pbrl.errors import ArtifactError

    paths = RunPaths(tmp_path)
    first, second = plan_shards(3, 2)
    row = {"item_id": "a", "side": "target", "candidate_index": 0, "raw_reward": 0.5, "reward": 0.5, "failure": None}
    write_shard(paths, 1, "score-with-oracle", first, "k1", [row, {**row, "item_id": "b"}], SCORES, {"n": 2})
    write_shard(paths, 1, "score-with-oracle", second, "k1", [{**row, "item_id": "c"}], SCORES, {"n": 1})
    assert shard_table(paths, 1, "score-with-oracle", first).name == "0000-of-0002.parquet"
    assert shard_done(paths, 1, "score-with-oracle", first, "k1")
    assert not shard_done(paths, 1, "score-with-oracle", first, "k2")  # another cache key
    assert not shard_done(paths, 1, "score-with-oracle", Shard(0, 2, 0, 1), "k1")  # another item range
    rows, counts = gather_shards(paths, 1, "score-with-oracle", ShardSet("k1", (first, second)), SCORES)
    assert [r["item_id"] for r in rows] == ["a", "b", "c"] and counts == {"n": 3}
    shard_table(paths, 1, "score-with-oracle", second).write_bytes(b"changed")
    assert not shard_done(paths, 1, "score-with-oracle", second, "k1")
    with pytest.raises(ArtifactError, match="0001-of-0002"):
        gather_shards(paths, 1, "score-with-oracle", ShardSet("k1", (first, second)), SCORES)


def test_train_refuses_an_unknown_runner_before_anything_runs(tmp_path):
    from typer.testing import CliRunner

    from pbrl.cli.commands import app

    out = CliRunner().invoke(app, ["train", str(ITER_YAML), "--runner", "dask", "--set", f"output_dir={tmp_path}"])
    assert out.exit_code == 2 and "runner: got 'dask'; allowed: local, ray" in out.output
    assert not any(tmp_path.iterdir())


def test_a_ray_run_without_the_extra_is_refused_with_the_install_command(monkeypatch):
    from pbrl.distributed import shards

    job = load_job(ITER_YAML, ["output_dir=/tmp/x", "runner=ray"])  # a stored Ray run still parses anywhere
    real = importlib.util.find_spec
    monkeypatch.setattr(shards.importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ConfigError) as err:
        shards.require_ray_extra(job.runner)
    assert [(p.field, p.value) for p in err.value.problems] == [("runner", "ray")]
    assert "missing: ray)" in str(err.value) and 'pip install -e ".[ray]"' in str(err.value)
    shards.require_ray_extra("local")  # nothing needed for local runs


def test_a_shard_asks_ray_for_one_gpu_per_distinct_cuda_device():
    from flows.ray_runner import shard_resources

    def job(**devices):
        return load_job(ITER_YAML, ["output_dir=/tmp/x", *(f"{k}={v}" for k, v in devices.items())])

    assert shard_resources(job()) == {"num_cpus": 1}  # no device named: CPU (Ray hides every GPU)
    assert shard_resources(job(agent_devices="cuda:0")) == {"num_cpus": 1, "num_gpus": 1}
    assert shard_resources(job(agent_devices="[cuda:0, cuda:1]")) == {"num_cpus": 1, "num_gpus": 2}
    assert shard_resources(job(agent_devices="[cuda:0, cuda:0]", comparator_devices="cuda:1")) == {
        "num_cpus": 1,
        "num_gpus": 2,
    }
    assert shard_resources(job(agent_devices="cpu")) == {"num_cpus": 1}


def test_an_agent_actor_asks_ray_for_its_own_gpu_or_a_share_of_one():
    from pbrl.distributed.ray_agents import agent_resources

    def job(devices=None):
        return policy_source(
            load_job(ITER_YAML, ["output_dir=/tmp/x", *([f"agent_devices={devices}"] if devices else [])])
        )

    assert agent_resources(job("cpu")) == [{"num_cpus": 1}, {"num_cpus": 1}]
    assert agent_resources(job("auto")) == [{"num_cpus": 1}, {"num_cpus": 1}]  # accelerate's placement: no GPU
    # parallel_training 'none' (the default) puts both agents on the first device, as the in-process run does
    assert agent_resources(job("[cuda:0, cuda:1]")) == [{"num_cpus": 1, "num_gpus": 0.5}] * 2
    assert (
        agent_resources(
            policy_source(
                load_job(ITER_YAML, ["output_dir=/tmp/x", "agent_devices=[cuda:0, cuda:1]", "parallel_training=mp"])
            )
        )
        == [{"num_cpus": 1, "num_gpus": 1}] * 2
    )
    assert agent_resources(job("cuda:0")) == [{"num_cpus": 1, "num_gpus": 0.5}] * 2  # both agents on one GPU
    assert agent_resources(job("[cuda, cuda:0]")) == [{"num_cpus": 1, "num_gpus": 0.5}] * 2


@needs_ray
def test_runner_options_are_validated_and_never_key_a_cache():
    local = load_job(ITER_YAML, ["output_dir=/tmp/x"])
    assert (local.runner, local.ray_address, local.shard_size) == ("local", None, 16)
    ray = load_job(ITER_YAML, ["output_dir=/tmp/x", "runner=ray", "ray_address=auto", "shard_size=3"])
    assert config_hash(ray) == config_hash(local)  # a run started locally resumes on Ray with every stage Cached
    with pytest.raises(ConfigError) as err:
        load_job(ITER_YAML, ["runner=dask", "shard_size=0"])
    assert {p.field for p in err.value.problems} == {"runner", "shard_size"}
    with pytest.raises(ConfigError) as err:
        load_job(ITER_YAML, ["ray_address=auto"])
    assert [(p.field, p.value) for p in err.value.problems] == [("ray_address", "auto")]


# ---------------------------------------------------------------------------------------------- flows
@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    """One local Ray (2 CPUs) for the module; its workers import ``tests`` and carry the fault variables."""
    import ray

    faults = tmp_path_factory.mktemp("faults")
    env = {
        "PYTHONPATH": str(ROOT),
        "PBRL_TEST_CALL_LOG": str(faults / "calls.jsonl"),
        "PBRL_TEST_KILL_MARKER": str(faults / "killed"),
    }
    ray.init(address="local", num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env})
    yield faults
    ray.shutdown()


def item_calls(log: Path) -> Counter:
    """How many reward calls saw each item (a call lists one item id per joint response)."""
    return Counter(i for line in log.read_text().splitlines() for i in set(json.loads(line)))


def common_options(folder: Path, model_dir: Path) -> list[str]:
    """The options of every run of these tests: ``tiny-madpo-iter`` on the tiny model with the logging reward, in
    the precision ``auto`` picks here (bfloat16 on a CPU with bfloat16 arithmetic)."""
    return [
        f"output_dir={folder}",
        f"agent_model={model_dir}",
        "reward_func=tests.unit.distributed.test_ray:reward_logged",
    ]


@pytest.fixture(scope="module")
def local_run(tiny_model_dir, tmp_path_factory, prefect_api) -> Path:
    """The local run every Ray run of this module is compared with."""
    from flows.training import train_flow

    folder = tmp_path_factory.mktemp("local")
    return Path(train_flow(load_job(ITER_YAML, [*common_options(folder, tiny_model_dir), "run_name=local"]))["run_dir"])


@needs_ray
@pytest.mark.flow
@pytest.mark.usefixtures("prefect_api")
def test_ray_run_is_byte_identical_to_local_and_a_killed_shard_alone_is_retried(
    tiny_model_dir, tmp_path, local_ray, local_run
):
    from flows.training import train_flow

    ray_job = load_job(
        ITER_YAML, [*common_options(tmp_path, tiny_model_dir), "run_name=ray", "runner=ray", "shard_size=1"]
    )
    sharded = train_flow(ray_job)
    local_dir, ray_dir = local_run, Path(ray_dir_ := sharded["run_dir"])

    # update-policies ran one Ray actor per agent (the local run in process), to the same weights and AdamW state
    # (run_artifacts compares every optimizer.pt tensor exactly; the files' zip names differ, by design)
    for r in (1, 2):
        assert (
            read_json(ray_dir / f"rounds/000{r}/update-policies.manifest.json")["details"]["agents_on"] == "ray_actors"
        )
        assert "agents_on" not in read_json(local_dir / f"rounds/000{r}/update-policies.manifest.json")["details"]
    assert len(list(ray_dir.glob("checkpoints/round_*/agent_*/optimizer.pt"))) == 4

    # every Parquet artifact, the replay files and the final adapter weights: the same bytes
    assert_same_artifacts(run_artifacts(ray_dir, ARTIFACTS), run_artifacts(local_dir, ARTIFACTS))
    assert len(list(ray_dir.glob("rounds/0002/shards/sample-candidates/*.parquet"))) == 8  # 8 items, 1 per shard
    assert len(list(ray_dir.glob("rounds/0002/shards/score-with-oracle/*.parquet"))) == 8
    assert len(list(ray_dir.glob("rounds/0002/shards/evaluate/*.parquet"))) == 4  # eval_num_samples: 4

    # The fault: the first shard with toy-002 (evaluate, round 0) lost its worker once. Reward calls per item,
    # one shard = one item = one call: eval items toy-000..003 in rounds 0, 1, 2 plus score-with-oracle of
    # all 8 items in rounds 1 and 2, so 5 calls for toy-000..003 and 2 for toy-004..007, and one more
    # (the retried shard, alone) for toy-002.
    assert (local_ray / "killed").is_file()
    expected = {f"toy-{i:03d}": 5 if i < 4 else 2 for i in range(8)}
    expected[KILL_ITEM] += 1
    assert item_calls(local_ray / "calls.jsonl") == expected

    # Resume after losing one shard file and the stage's outputs: only that shard is recomputed.
    shard_dir = ray_dir / "rounds/0001/shards/score-with-oracle"
    kept = {p.name: p.stat().st_ino for p in shard_dir.glob("*.parquet") if not p.name.startswith("0005")}
    (shard_dir / "0005-of-0008.parquet").unlink()
    (ray_dir / "rounds/0001/scores.parquet").unlink()
    (ray_dir / "rounds/0001/score-with-oracle.manifest.json").unlink()
    (local_ray / "calls.jsonl").unlink()
    again = train_flow(ray_job, resume=True, run_dir=ray_dir_)
    ran = {(s["stage"], s["round"]) for s in again["stages"] if s["state"] != "Cached"}
    assert ran == {("score-with-oracle", 1)}  # same scores: nothing downstream changed
    assert item_calls(local_ray / "calls.jsonl") == {"toy-005": 1}
    assert {p.name: p.stat().st_ino for p in shard_dir.glob("*.parquet") if not p.name.startswith("0005")} == kept
    assert_same_artifacts(run_artifacts(ray_dir, ARTIFACTS), run_artifacts(local_dir, ARTIFACTS))

    # `pbrl stage evaluate --round 0 --force`: every shard recomputed, the same bytes again.
    from flows.stage import stage_flow

    eval_shards = ray_dir / "rounds/0000/shards/evaluate"
    before = {p.name: p.stat().st_ino for p in eval_shards.glob("*.parquet")}
    assert stage_flow("evaluate", ray_dir_, 0, force=True)["state"] == "Completed"
    after = {p.name: p.stat().st_ino for p in eval_shards.glob("*.parquet")}
    assert after.keys() == before.keys() and all(after[n] != before[n] for n in before)
    assert_same_artifacts(run_artifacts(ray_dir, ARTIFACTS), run_artifacts(local_dir, ARTIFACTS))
    shutil.rmtree(tmp_path, ignore_errors=True)


@needs_ray
@pytest.mark.flow
@pytest.mark.usefixtures("prefect_api")
@pytest.mark.parametrize("shard_size", [2, 3])
def test_shards_that_pad_their_rows_otherwise_give_the_local_runs_bytes(
    tiny_model_dir, tmp_path, local_ray, local_run, shard_size
):
    """Shards of 2 and 3 items batch and pad each stage's rows otherwise than the local run (3 items: 2 shards of 3
    and one of 2 for the 8 training items). In bfloat16 that changed 6 of 128 candidates of round 1 (issue #50);
    every row is now computed as alone. One round (round 0's evaluation, round 1) against the local run's."""
    from flows.training import train_flow

    options = [*common_options(tmp_path, tiny_model_dir), "run_name=ray", "runner=ray", f"shard_size={shard_size}"]
    ray_dir = Path(train_flow(load_job(ITER_YAML, [*options, "num_iterations=1"]))["run_dir"])
    ray = run_artifacts(ray_dir, ARTIFACTS)
    later = ("rounds/0002/", "replay/iteration_0002.json", "checkpoints/round_0002/")  # the local run's round 2
    local = {k: v for k, v in run_artifacts(local_run, ARTIFACTS).items() if not k.startswith(later)}
    assert "rounds/0001/candidates.parquet" in ray and "checkpoints/round_0001/agent_1/optimizer.pt" in ray
    assert_same_artifacts(ray, local)
    shards = len(list(ray_dir.glob("rounds/0001/shards/sample-candidates/*.parquet")))
    assert shards == -(-8 // shard_size)
