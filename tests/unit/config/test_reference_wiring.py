"""Reference options that act at run time (issue #17): the env-step axis and ``logging_steps`` gate carried
across rounds, ``policy_checkpoint_dir`` exports, ``parallel_training`` placement, and the reward range that
``log_reward_distribution`` needs. Values are worked out by hand from the options below."""

from __future__ import annotations

import json

import pytest

from pbrl.errors import ConfigError
from pbrl.run.preflight import preflight
from pbrl.run.settings import policy_source
from stages import STAGE_MODULES
from tests.helpers import new_run, tiny_job


def _round(run_dir, job, r):
    for stage in (
        "sample-candidates",
        "score-with-oracle",
        "build-pairs",
        "store-round",
        "replay-select",
        "update-policies",
    ):
        manifest = STAGE_MODULES[stage].run(run_dir, r, job)
    return manifest


def test_env_step_axis_and_logging_gate_carry_across_rounds(tiny_model_dir, tmp_path):
    run_dir, job = new_run(
        tiny_model_dir,
        tmp_path,
        train_batch_size=1,
        environment_steps_per_pair=3,
        logging_steps=5,
        num_iterations=2,
        policy_checkpoint_dir=str(tmp_path / "export"),
    )
    first = _round(run_dir, job, 1)
    pairs = first.counts["pairs"]
    assert pairs >= 2
    # train_batch_size 1: one pair per step, 3 env steps per pair -> axis 3, 6, 9, ...
    assert first.metrics["train/env_step"] == 3.0 * pairs * job.num_train_epochs
    logged = [row["env_step"] for row in first.details["train_log"]]
    expected, last = [], -1
    for step in range(1, pairs * job.num_train_epochs + 1):
        value = 3 * step
        if last < 0 or value - last >= 5:
            expected.append(float(value))
            last = value
    assert logged == expected
    state = json.loads((run_dir / "checkpoints/round_0001/trainer_state.json").read_text())
    assert state["env_step"] == 3 * pairs * job.num_train_epochs and state["last_logged_env_step"] == last
    second = _round(run_dir, job, 2)
    # Round 2 continues the axis from round 1's last value.
    assert second.metrics["train/env_step"] == state["env_step"] + 3.0 * second.counts["pairs"] * job.num_train_epochs
    assert second.details["train_log"][0]["env_step"] - last >= 5
    # policy_checkpoint_dir: the reference's layout, 0-based iteration folders.
    exported = sorted(p.relative_to(tmp_path / "export").as_posix() for p in (tmp_path / "export").glob("*/agent_*"))
    assert exported == [
        "initial/agent_0",
        "initial/agent_1",
        "iteration_0000/agent_0",
        "iteration_0000/agent_1",
        "iteration_0001/agent_0",
        "iteration_0001/agent_1",
    ]
    assert not list((tmp_path / "export").rglob("optimizer.pt"))


def test_parallel_training_places_agents_as_the_reference_does(tiny_model_dir, tmp_path):
    both = tiny_job(tiny_model_dir, tmp_path, agent_devices=["cpu", "cuda:1"], parallel_training="none")
    assert policy_source(both).devices == "cpu"
    mp = tiny_job(tiny_model_dir, tmp_path, agent_devices=["cpu", "cuda:1"], parallel_training="mp")
    assert policy_source(mp).devices == ("cpu", "cuda:1")


def test_reward_histograms_need_the_reward_range(tiny_model_dir, tmp_path):
    ok = tiny_job(tiny_model_dir, tmp_path, log_reward_distribution=True)
    preflight(ok)  # the toy task declares (0, 1)
    unranged = tiny_job(
        tiny_model_dir,
        tmp_path,
        task=None,
        task_options={},
        train_dataset=str(_items(tmp_path)),
        log_reward_distribution=True,
        formatters=["tests.helpers:short_prompt", "tests.helpers:long_prompt"],
        reward_func="pbrl.tasks.toy:toy_reward",
    )
    with pytest.raises(ConfigError, match=r"log_reward_distribution: got True; .*needs the reward range"):
        preflight(unranged)


def _items(tmp_path):
    path = tmp_path / "items.jsonl"
    path.write_text('{"topic": "rain"}\n{"topic": "bees"}\n')
    return path


def test_reward_distribution_of_a_round_through_replay_select(tiny_model_dir, tmp_path):
    from pbrl.data.schema import SCORES, SELECTED_PAIRS
    from pbrl.data.storage import RunPaths
    from pbrl.data.tables import read_rows

    run_dir, job = new_run(tiny_model_dir, tmp_path, log_reward_distribution=True)
    manifest = _round(run_dir, job, 1)
    paths = RunPaths(run_dir)
    record = json.loads((paths.round_dir(1) / "reward_distribution.json").read_text())
    assert (paths.round_dir(1) / "reward_distribution.png").stat().st_size > 0
    scores = read_rows(paths.scores(1), SCORES)
    targets = sorted(r["raw_reward"] for r in scores if r["side"] == "target")
    # 16 equal bins over the toy reward's range [0, 1]: bin k holds [k/16, (k+1)/16), the last includes 1.
    counts = [0] * 16
    for x in targets:
        counts[min(int(x * 16), 15)] += 1
    assert record["candidate"]["target"]["counts"] == counts
    assert record["candidate"]["target"]["sample_count"] == len(targets) == 4 * 3
    selected = read_rows(paths.selected_pairs(1), SELECTED_PAIRS)
    assert record["selected"]["target"]["sample_count"] == len(selected)
    replay = json.loads(next((run_dir / "rounds/0001").glob("replay-select.manifest.json")).read_text())
    assert replay["metrics"]["iter/selected_reward_distribution/pair_count"] == float(len(selected))
    assert replay["metrics"]["iter/reward_distribution/target_mean"] == pytest.approx(sum(targets) / len(targets))
    assert manifest.counts["pairs"] == len(selected)
