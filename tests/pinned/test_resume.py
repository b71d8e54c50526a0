"""A run killed after round 2's update resumes in a new process and ends exactly like an uninterrupted run.

The killed process has written round 2's checkpoint (weights, AdamW state, trainer state); the resumed process
must read that state from disk to train round 3. A test that kills in round 1, before any checkpoint exists,
cannot tell a resume that restores it from one that does not.

The runs use an "EOS-heavy" variant of the tiny model (about a third of the completions are empty), with the
``history`` comparator (k = 1), so the same runs also pin the empty-completion rule and the comparator's
checkpoint through a whole training run.

Wrong versions these tests make fail (re-check by applying each to a copy of the repository):

5. A resume that skips restoring only the checkpoint it resumes from, e.g. update-policies loading the AdamW
   state (or weights) only from checkpoints written by the current process:
   ``test_kill_after_round_two_update_then_resume_matches_uninterrupted_run`` fails (round 3's weights, AdamW
   state and eval differ).
6a. build-pairs keeping pairs with an empty completion (``usable = candidates``):
   ``test_run_rejects_empty_completions_and_history_compares_with_older_policy`` fails.
6b. the ``history`` comparator sampling the current weights instead of C_max(0, r-1-k):
   ``test_run_rejects_empty_completions_and_history_compares_with_older_policy`` fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pbrl import orchestration
from pbrl.config import load_job
from pbrl.data.schema import CANDIDATES, PAIRS, SCORES
from pbrl.data.storage import RunPaths, read_json
from pbrl.data.tables import read_rows
from tests.helpers import assert_same_artifacts, run_artifacts

pytestmark = [pytest.mark.flow, pytest.mark.usefixtures("prefect_api")]

ROOT = Path(__file__).resolve().parents[2]
ITER_YAML = ROOT / "flows" / "configs" / "tiny-madpo-iter.yaml"
EOS_ID = 3  # <|im_end|> of the tiny tokenizer


@pytest.fixture(scope="module")
def eos_heavy_model(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model made a near-bigram model whose next token is EOS with probability about 0.12.

    Every layer's output projections are zeroed (the residual stream is the token embedding), embedding
    column 0 is set to 1 for every token, so the normed final state has a large positive coordinate 0
    (≈ 8), and EOS's (tied) embedding gets +0.47 there: its logit leads every other token's by ≈ 8·0.47 ≈ 3.8,
    i.e. p(EOS) ≈ e^3.8 / (e^3.8 + 319) ≈ 0.12 at every step; the other tokens stay near-uniform.
    """
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("eos-heavy")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.get_input_embeddings().weight
        emb[:, 0] = 1.0
        emb[EOS_ID, 0] += 0.47
    model.save_pretrained(out)
    for f in tiny_model_dir.iterdir():
        if "token" in f.name or f.name.endswith(".jinja"):
            shutil.copy(f, out / f.name)
    return out


def overrides(tmp_path: Path, model: Path, run_name: str) -> list[str]:
    return [
        f"output_dir={tmp_path}",
        f"run_name={run_name}",
        f"agent_model={model}",
        "num_iterations=3",
        "comparator_policy=history",
        "comparator_history_k=1",
        "max_new_tokens=6",
    ]


KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import stages.evaluate as ev
    from pbrl import orchestration
    from pbrl.config import load_job

    real = ev.run
    def die_in_round_two(run_dir, round_index, job):
        if round_index == 2:
            os.kill(os.getpid(), signal.SIGKILL)   # round 2's update is complete; its evaluation never runs
        return real(run_dir, round_index, job)
    ev.run = die_in_round_two
    orchestration.train(load_job(sys.argv[1], sys.argv[2:]))
""")


@pytest.fixture(scope="module")
def fresh_run(eos_heavy_model, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("fresh")
    orchestration.train(load_job(ITER_YAML, overrides(tmp, eos_heavy_model, "fresh")))
    return tmp / "fresh"


def test_kill_after_round_two_update_then_resume_matches_uninterrupted_run(eos_heavy_model, fresh_run, tmp_path):
    from prefect.settings import PREFECT_API_URL

    script = tmp_path / "kill.py"
    script.write_text(KILL_SCRIPT)
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    proc = subprocess.run(
        [sys.executable, str(script), str(ITER_YAML), *overrides(tmp_path, eos_heavy_model, "killed")],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == -9, proc.stderr[-3000:]
    paths = RunPaths(tmp_path / "killed")
    # Killed after round 2's update: its checkpoint and AdamW state are on disk, round 3 is not.
    assert (paths.round_checkpoint(2) / "trainer_state.json").is_file()
    assert paths.manifest(2, "update-policies").is_file()
    assert not paths.eval(2).exists() and not paths.round_dir(3).exists()

    job = load_job(ITER_YAML, overrides(tmp_path, eos_heavy_model, "killed"))
    out = orchestration.train(job, resume=True)
    ran = {(s["round"], s["stage"]) for s in out["stages"] if s["state"] != "Cached"}
    assert (2, "update-policies") not in ran and (3, "update-policies") in ran and (2, "evaluate") in ran
    assert {r for r, _ in ran} == {2, 3}

    killed, fresh = (
        run_artifacts(tmp_path / "killed", trainer_state=True),
        run_artifacts(fresh_run, trainer_state=True),
    )
    assert "checkpoints/round_0003/agent_1/optimizer.pt" in killed and "rounds/0003/eval.parquet" in killed
    assert_same_artifacts(killed, fresh)
    # AdamW step counts run on across the kill: round 3's state counts every step of rounds 1-3.
    steps = [read_json(RunPaths(fresh_run).manifest(r, "update-policies"))["counts"]["steps"] for r in (1, 2, 3)]
    state = torch.load(paths.round_checkpoint(3) / "agent_0" / "optimizer.pt", weights_only=True)
    assert {float(s["step"]) for s in state["state"].values()} == {float(sum(steps))}
    assert killed["checkpoints/round_0003/trainer_state.json"] == (3, sum(steps))


def test_run_rejects_empty_completions_and_history_compares_with_older_policy(fresh_run):
    paths = RunPaths(fresh_run)
    total_rejected = 0
    for r in (1, 2, 3):
        cands = read_rows(paths.candidates(r), CANDIDATES)
        blank = {(c["item_id"], c["side"], c["candidate_index"]) for c in cands if not c["completion"].strip()}
        scores = {
            (s["item_id"], s["side"], s["candidate_index"]): s["reward"]
            for s in read_rows(paths.scores(r), SCORES)
            if s["failure"] is None
        }
        # By hand: index-matched comparisons whose scores differ and that involve a blank joint response.
        expected = sum(
            1
            for (item, side, k), v in scores.items()
            if side == "target"
            and (item, "comparator", k) in scores
            and abs(v - scores[(item, "comparator", k)]) > 1e-9
            and ((item, "target", k) in blank or (item, "comparator", k) in blank)
        )
        manifest = read_json(paths.manifest(r, "build-pairs"))
        assert manifest["counts"]["rejected_empty"] == expected, r
        total_rejected += expected
        for p in read_rows(paths.pairs(r), PAIRS):
            assert all(c.strip() for c in p["winner_completions"] + p["loser_completions"]), p["pair_id"]
            assert EOS_ID not in [ids[0] for ids in p["winner_ids"] + p["loser_ids"] if ids]
    assert total_rejected >= 3  # the model writes empty completions often enough to pin the rule
    # history, k = 1: round r compares with C_max(0, r-2): the initial policy in rounds 1-2, C_1 in round 3.
    sides = {r: read_json(paths.manifest(r, "sample-candidates"))["details"]["sides"] for r in (1, 2, 3)}
    assert sides == {
        1: {"target": "checkpoints/initial", "comparator": "checkpoints/initial"},
        2: {"target": "checkpoints/round_0001", "comparator": "checkpoints/initial"},
        3: {"target": "checkpoints/round_0002", "comparator": "checkpoints/round_0001"},
    }
