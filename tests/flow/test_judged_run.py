"""A judged run under Prefect (issue #51): the round flow with judge-pairs, a resume and ``pbrl stage judge-pairs
--force`` that ask the judge nothing again, and the trainer API with a judge function on a task without a reward."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from pbrl.cli.commands import app
from pbrl.config import MADPOIterConfig
from pbrl.reporting.metrics import round_table
from pbrl.trainers import MADPOIterTrainer
from tests.helpers import tiny_job

pytestmark = [pytest.mark.flow, pytest.mark.usefixtures("prefect_api")]
JUDGED = {"preference_source": "judge", "pair_selection": "all", "preference_pairs_per_sample": None}


def test_a_judged_run_resumes_and_reruns_a_stage_without_asking_the_judge_again(tiny_model_dir, tmp_path, monkeypatch):
    from flows.training import train_flow

    log = tmp_path / "asked.log"
    monkeypatch.setenv("PBRL_TEST_JUDGE_LOG", str(log))
    job = tiny_job(tiny_model_dir, tmp_path, judge="tests.judges_ab:counted", **JUDGED)
    out = train_flow(job)
    stages = [(s["round"], s["stage"]) for s in out["stages"]]
    assert (1, "judge-pairs") in stages and stages.index((1, "judge-pairs")) < stages.index((1, "build-pairs"))
    asked = log.read_text().count("\n")
    table = round_table(out["run_dir"])
    assert asked > 0 and table.loc[1, "pairs"] > 0
    again = train_flow(job, resume=True, run_dir=out["run_dir"])
    assert {s["state"] for s in again["stages"]} == {"Cached"} and log.read_text().count("\n") == asked
    runner = CliRunner()
    forced = runner.invoke(app, ["stage", "judge-pairs", "--run", out["run_dir"], "--round", "2", "--force"])
    assert forced.exit_code == 0 and "recomputed" in forced.output, forced.output
    counts = json.loads(forced.output[forced.output.index("{") :].replace("\n", ""))  # the console wraps it
    assert counts["answers_asked"] == 0 and counts["answers_from_store"] == counts["askings"] > 0
    assert log.read_text().count("\n") == asked  # the rerun found every answer in the store


def test_the_trainer_api_takes_a_judge_function_and_reports_its_win_rate_without_a_reward(tiny_model_dir, tmp_path):
    def prefer_shorter(prompts, first, second):  # a judge that exists only in this process (and its forked worker)
        a, b = len(" ".join(first)), len(" ".join(second))
        return "A" if a < b else "B" if b < a else "tie"

    trainer = MADPOIterTrainer(
        MADPOIterConfig(num_iterations=1, preference_num_candidates=3, pair_selection="random",
                        preference_pairs_per_sample=2, max_new_tokens=8, train_batch_size=2, eval_num_samples=3),
        agent_model=str(tiny_model_dir),
        train_dataset=[{"item_id": f"i{k}", "topic": t} for k, t in enumerate(["rivers", "bread", "stars"])],
        formatters=[lambda item: f"One word on {item['topic']}.", lambda item: f"Two words on {item['topic']}."],
        judge=prefer_shorter,
        run_name="judged", output_dir=tmp_path,
    )  # fmt: skip
    assert trainer.args.preference_source == "judge"  # giving a judge says where preferences come from
    result = trainer.train()
    assert result.rounds.loc[1, "pairs"] > 0  # judged pairs: only the judge orders them
    assert 0 <= result.rounds.loc[1, "win_lo"] <= result.rounds.loc[1, "win"] <= result.rounds.loc[1, "win_hi"] <= 1
    stored = json.loads((result.run_dir / "run.json").read_text())["config"]
    assert stored["judge"] == "python" and stored["task"] == "python"  # both live in this process only
