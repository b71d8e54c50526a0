"""Benchmark: do the agents learn? Held-out evaluation reward per round with 95 % intervals, over seeds.

Per seed, one MADPO-iterative run of the demo job (``flows/configs/demo.yaml``: 2 SmolLM2-135M-Instruct agents
with LoRA on ``humaneval_docs``) at the sizes below, the stages called in ``round_flow``'s order without
Prefect (the same functions; the server would only add start-up time): the round-0 evaluation, then per round
collect -> store -> replay -> learn -> evaluate. Evaluation is on the task's held-out items (``humaneval``: the
first 16 problems, never trained on; the run refuses to report a run whose evaluation items overlap its
training items), ``eval_samples_per_item`` draws per item with the same seeds every round.

Per round it records (from the run's files, nothing re-derived by hand):
- the mean eval reward with its 95 % item-level bootstrap interval, and the paired difference to round 0
  on the same draws with its interval (``pbrl.reporting.stats``, via the evaluate stage's manifest);
- held-out pair accuracy: from round 0's evaluation draws, per held-out item its best and worst joint
  response (rewards differing by more than ``tie_tolerance``); the share of those pairs that the round-r
  policy ranks the right way by the MADPO implicit margin
  sum_agents [(log pi_r - log pi_0)(winner) - (log pi_r - log pi_0)(loser)] > 0 (undefined at round 0);
- drift without a KL term: each agent's mean completion length in tokens, and its share of completions cut
  at ``max_new_tokens``, on the evaluation draws;
- the MADPO training loss / accuracy and the seconds of each round (sum of its stages' own seconds);
- ``humaneval_docs``: the mean of each part of the reward (lengths in bounds, length ratio, identifier coverage);
  ``humaneval_coop``: the share of the problems' tests the joint code passes (pass rate).

At the end: a table per seed, and whether each seed's paired interval excludes 0 by round 2.
Writes ``benchmarks/results/learning-<task>-<model>[-<scale>].json`` and a ``.png`` next to it.

Run: ``make learn`` (the ``standard`` scale: the demo's sizes, 3 seeds, 2 rounds), ``--quick`` (one of those
seeds) or ``--scale full`` (the issue's larger sizes, 3 rounds; hours on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchkit import REPO_ROOT, RESULTS_DIR, write_result

from pbrl.config import JobConfig, load_job
from pbrl.data.items import read_items
from pbrl.data.storage import RunPaths, read_manifest
from pbrl.run.folder import prepare_run
from pbrl.run.settings import policy_source

CONFIG = REPO_ROOT / "flows" / "configs" / "demo.yaml"
ROUND_STAGES = (
    "sample-candidates",
    "score-with-oracle",
    "build-pairs",
    "store-round",
    "replay-select",
    "update-policies",
    "evaluate",
)


@dataclass(frozen=True)
class Scale:
    """Sizes of one benchmark run (per seed)."""

    seeds: tuple[int, ...]
    rounds: int
    train_items: int
    eval_items: int
    eval_samples_per_item: int
    candidates: int
    pairs_per_item: int
    max_new_tokens: int

    def overrides(self, task: str) -> list[str]:
        return [
            f"task={task}",
            f"task_options={{num_train_items: {self.train_items}, num_eval_items: {self.eval_items}}}",
            f"num_iterations={self.rounds}",
            f"eval_num_samples={self.eval_items}",
            f"eval_samples_per_item={self.eval_samples_per_item}",
            f"preference_num_candidates={self.candidates}",
            f"preference_pairs_per_sample={self.pairs_per_item}",
            f"max_new_tokens={self.max_new_tokens}",
            # Evaluation rows per generate call: batched like the candidates (the tokens do not depend on it);
            # one row per call made the round-0 evaluation alone take over 10 minutes on the shared 2 cores.
            f"eval_batch_size={self.eval_items * self.eval_samples_per_item}",
        ]


SCALES = {
    # The default (`make learn`): the demo's sizes (flows/configs/demo.yaml) over 3 seeds, 2 rounds each; about
    # 30 minutes on an idle 2-core machine.
    "standard": Scale(
        seeds=(0, 1, 2),
        rounds=2,
        train_items=16,
        eval_items=16,
        eval_samples_per_item=2,
        candidates=3,
        pairs_per_item=2,
        max_new_tokens=48,
    ),
    # The measurement, with 4 draws per held-out item instead of 1 and 3 seeds.
    "full": Scale(
        seeds=(0, 1, 2),
        rounds=3,
        train_items=16,
        eval_items=16,
        eval_samples_per_item=4,
        candidates=4,
        pairs_per_item=2,
        max_new_tokens=64,
    ),
    # One seed of `standard`: what a shared, busy 2-core machine runs in about half an hour.
    "quick": Scale(
        seeds=(0,),
        rounds=2,
        train_items=16,
        eval_items=16,
        eval_samples_per_item=2,
        candidates=3,
        pairs_per_item=2,
        max_new_tokens=48,
    ),
    # humaneval_coop "at a smaller scale" (sandboxed tests are slow; code needs more tokens).
    "coop": Scale(
        seeds=(0,),
        rounds=2,
        train_items=16,
        eval_items=8,
        eval_samples_per_item=2,
        candidates=4,
        pairs_per_item=2,
        max_new_tokens=96,
    ),
}


def run_seed(job: JobConfig) -> Path:
    """One run: round-0 evaluation then every round's stages, called directly in round_flow's order."""
    from stages import STAGE_MODULES

    run_dir = prepare_run(job, resume=False)
    STAGE_MODULES["evaluate"].run(run_dir, 0, job)
    for r in range(1, job.num_iterations + 1):
        started = time.perf_counter()
        for stage in ROUND_STAGES:
            STAGE_MODULES[stage].run(run_dir, r, job)
        print(f"  round {r}: {time.perf_counter() - started:.0f} s", flush=True)
    return run_dir


def held_out_pairs(rows: list[dict], tie_tolerance: float) -> list[tuple[dict, dict]]:
    """Per item of round 0's evaluation, (best, worst) draw when their rewards differ by > tie_tolerance."""
    by_item: dict[str, list[dict]] = {}
    for row in rows:
        if row["failure"] is None:
            by_item.setdefault(row["item_id"], []).append(row)
    pairs = []
    for draws in by_item.values():
        best, worst = max(draws, key=lambda d: d["reward"]), min(draws, key=lambda d: d["reward"])
        if best["reward"] - worst["reward"] > tie_tolerance:
            pairs.append((best, worst))
    return pairs


def pair_margins(paths: RunPaths, job: JobConfig, round_index: int, pairs: list[tuple[dict, dict]]) -> list[float]:
    """The implicit joint margin of each held-out pair under the round's policy vs the initial one (nats)."""
    import torch

    from pbrl.generation.sampling import encode_prompt
    from pbrl.learning.logprobs import sequence_logprobs
    from pbrl.models.policies import load_agent, policy_checkpoint

    source = policy_source(job)
    margins = torch.zeros(len(pairs), dtype=torch.float64)  # (p,)
    for agent in range(job.num_agents):
        rows = [w for w, _ in pairs] + [lo for _, lo in pairs]  # winners then losers: (2p,)
        logps = []
        for checkpoint in (policy_checkpoint(paths, round_index), policy_checkpoint(paths, 0)):
            policy = load_agent(source, agent, checkpoint, trainable=False)
            prompts = [encode_prompt(policy.tokenizer, r["prompts"][agent]) for r in rows]
            with torch.inference_mode():
                logps.append(
                    sequence_logprobs(
                        policy.model, prompts, [r["completion_ids"][agent] for r in rows], pad_token_id=0
                    ).cpu()
                )  # (2p,)
            del policy
        ratio = logps[0] - logps[1]  # log pi_r - log pi_0: (2p,)
        margins += ratio[: len(pairs)] - ratio[len(pairs) :]
    return margins.tolist()


def pass_rate(rows: list[dict], items: dict[str, dict]) -> float:
    """humaneval_coop: mean share of each problem's tests passed by the joint code of the evaluation draws."""
    from pbrl.tasks.humaneval_coop import coop_score

    shares = []
    for row in rows:
        score = coop_score(row["completions"][0], row["completions"][1], items[row["item_id"]])
        shares.append(score.tests_passed / score.tests_total if score.tests_total else 0.0)
    return statistics.fmean(shares)


def round_record(
    paths: RunPaths, job: JobConfig, r: int, pairs: list[tuple[dict, dict]], items: dict[str, dict]
) -> dict[str, Any]:
    from pbrl.data.schema import EVAL, read_rows

    ev = read_manifest(paths, r, "evaluate")
    rows = read_rows(paths.eval(r), EVAL)
    rec: dict[str, Any] = {
        "round": r,
        **{
            k: ev.metrics.get(k)
            for k in (
                "eval/reward_mean",
                "eval/reward_ci_low",
                "eval/reward_ci_high",
                "eval/paired_diff_mean",
                "eval/paired_diff_ci_low",
                "eval/paired_diff_ci_high",
            )
        },
    }
    for a in range(job.num_agents):
        rec[f"agent_{a}/completion_tokens"] = statistics.fmean(len(row["completion_ids"][a]) for row in rows)
        rec[f"agent_{a}/cut_share"] = statistics.fmean(row["finish_reasons"][a] == "length" for row in rows)
    if r > 0:
        margins = pair_margins(paths, job, r, pairs) if pairs else []
        rec["heldout_pairs"] = len(margins)
        rec["heldout_pair_accuracy"] = statistics.fmean(m > 0 for m in margins) if margins else None
        upd = read_manifest(paths, r, "update-policies")
        rec["madpo/loss"], rec["madpo/accuracy"] = upd.metrics.get("madpo/loss"), upd.metrics.get("madpo/accuracy")
        rec["round_seconds"] = round(sum(read_manifest(paths, r, s).seconds for s in ROUND_STAGES), 1)
    if job.task == "humaneval_coop":
        rec["pass_rate"] = pass_rate(rows, items)
    if job.task == "humaneval_docs":
        rec.update(docs_term_means(rows, items))
    return rec


def docs_term_means(rows: list[dict], items: dict[str, dict]) -> dict[str, float]:
    """``humaneval_docs``: the mean of each part of the reward over the evaluation draws (``terms/lengths``,
    ``terms/ratio``, ``terms/coverage``, each in [0, 1]; an empty text counts 0 for every part), to show which
    part of the reward the agents learn."""
    from pbrl.tasks.humaneval_docs import docs_terms

    parts = [docs_terms(row["completions"][0], row["completions"][1], items[row["item_id"]]) for row in rows]
    return {
        f"terms/{name}": statistics.fmean((p or {}).get(name, 0.0) for p in parts)
        for name in ("lengths", "ratio", "coverage")
    }


def seed_result(run_dir: Path, job: JobConfig) -> dict[str, Any]:
    from pbrl.data.schema import EVAL, read_rows

    paths = RunPaths(run_dir)
    seen = read_manifest(paths, 0, "evaluate").counts["items_seen_in_training"]
    if seen:
        raise SystemExit(
            f"{run_dir}: {seen} evaluation items are training items; this benchmark needs held-out evaluation"
        )
    pairs = held_out_pairs(read_rows(paths.eval(0), EVAL), job.tie_tolerance)
    done = [r for r in range(job.num_iterations + 1) if read_manifest(paths, r, "evaluate") is not None]
    items = {x["item_id"]: x for x in read_items(paths, "eval")}  # read once, used by every round
    rounds = [round_record(paths, job, r, pairs, items) for r in done]  # an interrupted run: its evaluated rounds
    first_excluding = next((x["round"] for x in rounds[1:] if (x["eval/paired_diff_ci_low"] or 0) > 0), None)
    return {"seed": job.seed, "rounds": rounds, "first_round_gain_excludes_0": first_excluding}


def fmt(v: Any, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def print_table(res: dict[str, Any], num_agents: int) -> None:
    print(
        f"seed {res['seed']}: round | eval reward [95 % CI] | paired gain vs round 0 [95 % CI] | held-out pair "
        "acc | tokens per agent (cut share) | s"
    )
    for x in res["rounds"]:
        tokens = " / ".join(
            f"{x[f'agent_{a}/completion_tokens']:.0f} ({x[f'agent_{a}/cut_share']:.0%})" for a in range(num_agents)
        )
        gain = (
            "-"
            if x["round"] == 0
            else (
                f"{fmt(x['eval/paired_diff_mean'], '+.2f')} "
                f"[{fmt(x['eval/paired_diff_ci_low'], '+.2f')}, "
                f"{fmt(x['eval/paired_diff_ci_high'], '+.2f')}]"
            )
        )
        extra = f" | pass {x['pass_rate']:.2f}" if "pass_rate" in x else ""
        if "terms/ratio" in x:
            extra += " | lengths/ratio/coverage " + "/".join(
                f"{x[f'terms/{t}']:.2f}" for t in ("lengths", "ratio", "coverage")
            )
        print(
            f"  {x['round']} | {fmt(x['eval/reward_mean'])} [{fmt(x['eval/reward_ci_low'])}, "
            f"{fmt(x['eval/reward_ci_high'])}] | {gain} | {fmt(x.get('heldout_pair_accuracy'))} | {tokens} | "
            f"{fmt(x.get('round_seconds'), '.0f')}{extra}"
        )


def plot(results: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for res in results:
        xs = [x["round"] for x in res["rounds"]]
        mean = [x["eval/reward_mean"] for x in res["rounds"]]
        err = [
            [m - x["eval/reward_ci_low"] for m, x in zip(mean, res["rounds"], strict=True)],
            [x["eval/reward_ci_high"] - m for m, x in zip(mean, res["rounds"], strict=True)],
        ]
        axes[0].errorbar(xs, mean, yerr=err, marker="o", capsize=3, label=f"seed {res['seed']}")
        later = res["rounds"][1:]
        d = [x["eval/paired_diff_mean"] for x in later]
        axes[1].errorbar(
            [x["round"] for x in later],
            d,
            capsize=3,
            marker="s",
            label=f"seed {res['seed']}",
            yerr=[
                [m - x["eval/paired_diff_ci_low"] for m, x in zip(d, later, strict=True)],
                [x["eval/paired_diff_ci_high"] - m for m, x in zip(d, later, strict=True)],
            ],
        )
        for a, style in ((0, "-"), (1, "--")):
            axes[2].plot(
                xs,
                [x[f"agent_{a}/completion_tokens"] for x in res["rounds"]],
                style,
                marker=".",
                label=f"seed {res['seed']} agent {a}",
            )
    axes[0].set(title="held-out eval reward (95 % CI)", xlabel="round", ylabel="reward")
    axes[1].axhline(0, color="grey", linestyle="--")
    axes[1].set(title="paired gain vs round 0 (95 % CI)", xlabel="round", ylabel="reward difference")
    axes[2].set(title="mean completion length (drift)", xlabel="round", ylabel="tokens")
    for ax in axes:
        ax.legend(fontsize=7)
        ax.xaxis.get_major_locator().set_params(integer=True)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(run_dirs: list[Path], args: argparse.Namespace) -> int:
    """The tables, JSON and plot of existing run folders (rounds evaluated so far)."""
    from pbrl.run.folder import open_job

    results = []
    for run_dir in run_dirs:
        job = open_job(run_dir)
        res = seed_result(run_dir, job)
        print_table(res, job.num_agents)
        results.append(res)
    finish(
        results,
        job.task or "task",
        f"{Path(args.model).name}-{args.scale}-report",
        [str(d) for d in run_dirs],
        args.scale,
        [r["seed"] for r in results],
        0.0,
    )
    return 0


def finish(
    results: list[dict[str, Any]],
    task: str,
    model_tag: str,
    overrides: list[str],
    scale: str,
    seeds: list[int],
    seconds: float,
) -> None:
    by_round2 = [
        r["first_round_gain_excludes_0"] is not None and r["first_round_gain_excludes_0"] <= 2 for r in results
    ]
    tag = f"{task}-{model_tag}"
    path = write_result(
        "learning",
        tag,
        {
            "config": str(CONFIG.relative_to(REPO_ROOT)),
            "overrides": overrides,
            "scale": scale,
            "seeds": seeds,
            "total_s": round(seconds, 1),
            "results": results,
            "paired_ci_excludes_0_by_round_2": by_round2,
            "method": __doc__.split("\n\n", 1)[1].split("\n\nRun:")[0],
        },
    )
    plot(results, RESULTS_DIR / f"learning-{tag}.png", f"learning: {tag} (seeds {', '.join(map(str, seeds))})")
    print(f"paired gain interval excludes 0 by round 2: {sum(by_round2)} of {len(by_round2)} seeds")
    print(f"result: {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=SCALES, default="standard")
    parser.add_argument("--quick", action="store_const", const="quick", dest="scale", help="= --scale quick")
    parser.add_argument("--task", choices=("humaneval_docs", "humaneval_coop"), default="humaneval_docs")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="packaged alias or model folder")
    parser.add_argument("--seeds", type=int, nargs="+", help="override the scale's seeds")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config overrides")
    parser.add_argument("--keep", action="store_true", help="keep the run folders (printed)")
    parser.add_argument(
        "--report",
        nargs="+",
        type=Path,
        metavar="RUN_DIR",
        help="summarise these run folders (e.g. kept with --keep, or interrupted) instead of running",
    )
    args = parser.parse_args()
    if args.report:
        return report(args.report, args)
    scale = SCALES[args.scale]
    seeds = tuple(args.seeds) if args.seeds else scale.seeds
    overrides = [f"agent_model={args.model}", *scale.overrides(args.task), *args.set]
    out = Path(tempfile.mkdtemp(prefix="pbrl-learning-"))
    results = []
    started = time.perf_counter()
    try:
        for seed in seeds:
            job = load_job(CONFIG, [*overrides, f"seed={seed}", f"run_name=learning-seed{seed}", f"output_dir={out}"])
            print(f"=== seed {seed} ({args.task}, {args.scale})", flush=True)
            res = seed_result(run_seed(job), job)
            print_table(res, job.num_agents)
            results.append(res)
    finally:
        if args.keep:
            print(f"run folders: {out}")
        else:
            shutil.rmtree(out, ignore_errors=True)
    model_tag = Path(args.model).name + ("" if args.scale == "standard" else f"-{args.scale}")
    finish(results, args.task, model_tag, overrides, args.scale, list(seeds), time.perf_counter() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
