"""One tiny round of the main job's configuration on the real SmolLM2 model and real HumanEval items."""

from __future__ import annotations

from pathlib import Path

import pytest

from pbrl import orchestration
from pbrl.config import load_job
from pbrl.data.items import read_items
from pbrl.data.schema import CANDIDATES, EVAL
from pbrl.data.storage import RunPaths
from pbrl.data.tables import read_rows
from pbrl.reporting.metrics import round_table
from pbrl.tasks.humaneval_docs import docs_reward

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_api")]

DEMO = Path(__file__).resolve().parents[2] / "flows" / "configs" / "demo.yaml"


def test_demo_config_runs_one_round_on_smollm2(tmp_path):
    job = load_job(
        DEMO,
        [
            f"output_dir={tmp_path}",
            "run_name=demo-smoke",
            "num_iterations=1",
            "preference_num_candidates=2",
            "max_new_tokens=12",
            "task_options={num_train_items: 2, num_eval_items: 2}",
            "eval_num_samples=2",
            "num_train_epochs=1",
        ],
    )
    out = orchestration.train(job)
    run_dir = Path(out["run_dir"])
    paths = RunPaths(run_dir)
    rows = read_rows(paths.candidates(1), CANDIDATES)
    assert {r["item_id"] for r in rows} == {"HumanEval/16", "HumanEval/17"}  # the first train problems
    assert len(rows) == 2 * (2 + 2) * 2  # items x (target + comparator candidates) x agents
    assert any(r["completion"].strip() for r in rows)  # a real model writes text
    table = round_table(run_dir)
    assert list(table.index) == [0, 1] and table["eval_reward"].notna().all()
    # The task's reward recomputed on the stored evaluation completions gives the reported means. With 12 new
    # tokens an explanation has at most 12 words, under the 15 the length term needs, so each reward is at
    # most 2 (ratio ≤ 1 + coverage ≤ 1) of the task's range [0, 3].
    items = {item["item_id"]: item for item in read_items(paths, "eval")}
    for r in (0, 1):
        ev = read_rows(paths.eval(r), EVAL)
        assert ev and all(x["failure"] is None for x in ev)
        rewards = docs_reward(
            [x["completions"][0] for x in ev],
            [x["completions"][1] for x in ev],
            batch_items=[items[x["item_id"]] for x in ev],
        )
        assert all(0.0 <= v <= 2.0 for v in rewards) and [x["reward"] for x in ev] == rewards
        assert table.loc[r, "eval_reward"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-12)
