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

``--joint-mode cross`` runs the same job with cross joint responses and counterfactual pairs first
(``joint_mode: cross``, ``pair_selection: counterfactual``;
docs/design/algorithms.md#cross-joint-responses-and-counterfactual-pairs), ``--joint-mode aligned`` with aligned
ones (``pair_selection: comparator_reward``); without it, the config's own mode (the demo's: cross).
``--compare-joint-modes`` measures aligned against cross (issue #34): per seed, one run of
each at the same K (the same candidates: same seeds, same sampling options, so the same sampled tokens in round
1), and the same number of optimizer steps (each round trains on exactly ``train items x pairs per item`` draws
from its own pairs: ``preference_replay_mode: nearest_k`` with k = 1 and that ``preference_replay_sample_size``, in
both modes). Per round and mode it reports the paired gain over round 0 with its interval, the gain per CPU-minute
(the process CPU time of the training stages, evaluation excluded, summed over rounds 1..r), the held-out pair
accuracy, the pairs built per sampled completion token, and the optimizer steps; then, per round, the means over
seeds and the ratio cross / aligned of the mean gain per CPU-minute (the issue's criterion: >= 1.3 at round 2).
Writes ``benchmarks/results/learning-joint-modes-<task>-<model>[-<scale>].json``.

``--trainer marlhf_iter`` measures MARLHF-iterative (``flows/configs/marlhf-docs.yaml``, its reward-model and RL
settings) at the same sizes; each round then also records the reward model's accuracy on pairs of items it never
saw (with its interval and pair count), the RL reward and KL, and every round records each stage's seconds.
Writes ``benchmarks/results/learning-<task>-<model>[-<scale>]-marlhf.json``. ``--tag NAME`` adds ``-NAME`` to a
result's name, so that an experiment (``--set ...``) keeps the plain result.

Run: ``make learn`` (the ``standard`` scale: the demo's sizes, 3 seeds, 2 rounds), ``--quick`` (one of those
seeds) or ``--scale full`` (the issue's larger sizes, 3 rounds; hours on 2 CPU cores); add
``--compare-joint-modes`` for aligned against cross (twice the runs).
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

from pbrl.config import JobConfig, is_marlhf, load_job
from pbrl.data.items import read_items
from pbrl.data.storage import RunPaths, read_manifest
from pbrl.run.folder import prepare_run
from pbrl.run.judging import round_stages
from pbrl.run.settings import policy_source
from pbrl.tasks.humaneval_docs import ALL_TERMS, docs_terms

CONFIG = REPO_ROOT / "flows" / "configs" / "demo.yaml"
# --trainer: the job each trainer is measured with (MARLHF's config holds its reward-model and RL settings).
CONFIGS = {"madpo_iter": CONFIG, "marlhf_iter": REPO_ROOT / "flows" / "configs" / "marlhf-docs.yaml"}


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

    def overrides(self, task: str, *, cap_pairs: bool = True) -> list[str]:
        """The scale's options; ``cap_pairs=False`` leaves ``preference_pairs_per_sample`` to the config (one
        with ``pair_selection: all`` keeps every pair and refuses a cap)."""
        cap = [f"preference_pairs_per_sample={self.pairs_per_item}"] if cap_pairs else []
        return [
            f"task={task}",
            f"task_options={{num_train_items: {self.train_items}, num_eval_items: {self.eval_items}}}",
            f"num_iterations={self.rounds}",
            f"eval_num_samples={self.eval_items}",
            f"eval_samples_per_item={self.eval_samples_per_item}",
            f"preference_num_candidates={self.candidates}",
            *cap,
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
    # The issue's measurement, with 4 draws per held-out item instead of 1 and 3 seeds.
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


def run_seed(job: JobConfig, cpu_seconds: dict[int, float] | None = None) -> Path:
    """One run: round-0 evaluation then every round's stages, called directly in round_flow's order. With
    ``cpu_seconds``, each round's process CPU time (every thread) of its training stages, evaluate excluded, is
    stored there by round."""
    from stages import STAGE_MODULES

    run_dir = prepare_run(job, resume=False)
    STAGE_MODULES["evaluate"].run(run_dir, 0, job)
    for r in range(1, job.num_iterations + 1):
        started, cpu = time.perf_counter(), 0.0
        for stage in round_stages(job, run_dir):
            before = time.process_time()
            STAGE_MODULES[stage].run(run_dir, r, job)
            cpu += time.process_time() - before if stage != "evaluate" else 0.0
        if cpu_seconds is not None:
            cpu_seconds[r] = cpu
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
    """The implicit joint margin of each held-out pair under the round's policy vs the initial one (nats), each row
    scored as if alone (``rows_alone``: in bfloat16 a batched score moves by about 1e-2 nats with its batch)."""
    import torch

    from pbrl.generation.sampling import encode_prompt
    from pbrl.learning.logprobs import sequence_logprobs
    from pbrl.models.policies import load_agent
    from pbrl.run.policy_records import policy_checkpoint

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
                        policy.model,
                        prompts,
                        [r["completion_ids"][agent] for r in rows],
                        pad_token_id=0,
                        rows_alone=True,
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
    from pbrl.data.schema import EVAL
    from pbrl.data.tables import read_rows

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
        rec["stage_seconds"] = {s: round(read_manifest(paths, r, s).seconds, 1) for s in round_stages(job, paths.root)}
        rec["round_seconds"] = round(sum(rec["stage_seconds"].values()), 1)
        if is_marlhf(job.trainer):  # the reward model on pairs of items it never saw, and what RL saw
            fit = read_manifest(paths, r, "fit-reward-model")
            for key in ("rm/accuracy", "rm/heldout_accuracy", "rm/heldout_accuracy_lo", "rm/heldout_accuracy_hi"):
                rec[key] = fit.metrics.get(key)
            rec["rm/train_pairs"], rec["rm/heldout_pairs"] = fit.counts["train_pairs"], fit.counts["heldout_pairs"]
            for key in ("rl/reward_mean", "rl/kl_mean", "rl/advantage_std"):
                rec[key] = upd.metrics.get(key)
    if job.task == "humaneval_coop":
        rec["pass_rate"] = pass_rate(rows, items)
    if job.task == "humaneval_docs":
        rec.update(docs_term_means(rows, items))
    return rec


def docs_term_means(rows: list[dict], items: dict[str, dict]) -> dict[str, float]:
    """``humaneval_docs``: the mean of each part of the reward over the evaluation draws (``terms/lengths``,
    ``terms/ratio``, ``terms/coverage``, ``terms/docstring``, each in [0, 1]; an empty text counts 0 for every part),
    to show which part of the reward the agents learn, whichever parts the run's reward sums."""
    parts = [docs_terms(*row["completions"][:2], items[row["item_id"]], ALL_TERMS) for row in rows]
    return {f"terms/{name}": statistics.fmean((p or {}).get(name, 0.0) for p in parts) for name in ALL_TERMS}


def seed_result(run_dir: Path, job: JobConfig) -> dict[str, Any]:
    from pbrl.data.schema import EVAL
    from pbrl.data.tables import read_rows

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
        if x.get("rm/heldout_accuracy") is not None:
            extra += (
                f" | rm held-out {x['rm/heldout_accuracy']:.2f} [{fmt(x.get('rm/heldout_accuracy_lo'))}, "
                f"{fmt(x.get('rm/heldout_accuracy_hi'))}] on {x['rm/heldout_pairs']} pairs"
            )
        terms = [name for name in ALL_TERMS if f"terms/{name}" in x]
        if terms:  # results written before the docstring part have three
            extra += f" | {'/'.join(terms)} " + "/".join(f"{x[f'terms/{t}']:.2f}" for t in terms)
        print(
            f"  {x['round']} | {fmt(x['eval/reward_mean'])} [{fmt(x['eval/reward_ci_low'])}, "
            f"{fmt(x['eval/reward_ci_high'])}] | {gain} | {fmt(x.get('heldout_pair_accuracy'))} | {tokens} | "
            f"{fmt(x.get('round_seconds'), '.0f')}{extra}"
        )


def drift_series(results: list[dict[str, Any]]) -> dict[tuple, list[int]]:
    """Each agent's mean completion length per round, one entry per distinct line: ``(agent, rounds, lengths)`` ->
    the seeds that drew it."""
    series: dict[tuple, list[int]] = {}
    for res in results:
        if not res["rounds"]:
            continue
        xs = tuple(x["round"] for x in res["rounds"])
        agents = sum(1 for key in res["rounds"][0] if key.startswith("agent_") and key.endswith("/completion_tokens"))
        for a in range(agents):
            lengths = tuple(x[f"agent_{a}/completion_tokens"] for x in res["rounds"])
            series.setdefault((a, xs, lengths), []).append(res["seed"])
    return series


def plot(results: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    colour = {res["seed"]: f"C{i}" for i, res in enumerate(results)}
    for res in results:
        xs = [x["round"] for x in res["rounds"]]
        mean = [x["eval/reward_mean"] for x in res["rounds"]]
        err = [
            [m - x["eval/reward_ci_low"] for m, x in zip(mean, res["rounds"], strict=True)],
            [x["eval/reward_ci_high"] - m for m, x in zip(mean, res["rounds"], strict=True)],
        ]
        axes[0].errorbar(
            xs, mean, yerr=err, marker="o", capsize=3, color=colour[res["seed"]], label=f"seed {res['seed']}"
        )
        later = res["rounds"][1:]
        d = [x["eval/paired_diff_mean"] for x in later]
        axes[1].errorbar(
            [x["round"] for x in later],
            d,
            capsize=3,
            marker="s",
            color=colour[res["seed"]],
            label=f"seed {res['seed']}",
            yerr=[
                [m - x["eval/paired_diff_ci_low"] for m, x in zip(d, later, strict=True)],
                [x["eval/paired_diff_ci_high"] - m for m, x in zip(d, later, strict=True)],
            ],
        )
    for (a, xs, lengths), seeds in drift_series(results).items():
        # Seeds whose lines coincide (an agent held at the token cap in every round) share one labelled line.
        axes[2].plot(
            xs,
            lengths,
            "-" if a == 0 else "--",
            marker=".",
            color=colour[seeds[0]] if len(seeds) == 1 else "black",
            label=f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))} agent {a}",
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
        f"{Path(args.model).name}-{args.scale}-report" + (f"-{args.tag}" if args.tag else ""),
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
    config: Path = CONFIG,
) -> None:
    by_round2 = [
        r["first_round_gain_excludes_0"] is not None and r["first_round_gain_excludes_0"] <= 2 for r in results
    ]
    tag = f"{task}-{model_tag}"
    path = write_result(
        "learning",
        tag,
        {
            "config": str(config.relative_to(REPO_ROOT)),
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


JOINT_MODES = ("aligned", "cross")


MODE_OVERRIDES = {
    "aligned": ["joint_mode=aligned", "pair_selection=comparator_reward"],  # the reference's iterative pairs
    "cross": ["joint_mode=cross", "pair_selection=counterfactual"],
}


def joint_mode_overrides(mode: str | None) -> list[str]:
    """The config overrides of one joint mode: aligned joint responses with the iterative trainers' comparator-reward
    pairs, cross joint responses with counterfactual pairs first, or (None) nothing: the config's own mode."""
    return [] if mode is None else list(MODE_OVERRIDES[mode])


def equal_steps_overrides(job: JobConfig) -> list[str]:
    """Both modes train on exactly ``train items x pairs per item`` draws per round from that round's own pairs
    (``nearest_k``, k = 1: cycling through them when there are fewer), so they take the same optimizer steps."""
    items = job.task_options.get("num_train_items")
    if not isinstance(items, int):
        raise SystemExit("--compare-joint-modes needs task_options.num_train_items (the draws per round follow it)")
    draws = min(items, job.max_train_items or items) * job.preference_pairs_per_sample
    return ["preference_replay_mode=nearest_k", "preference_replay_k=1", f"preference_replay_sample_size={draws}"]


def sampled_tokens(paths: RunPaths, r: int) -> int:
    """Completion tokens sampled in round r (every candidate row: both sides, every agent)."""
    import pyarrow.parquet as pq

    return sum(len(ids) for ids in pq.read_table(paths.candidates(r), columns=["completion_ids"]).column(0).to_pylist())


def mode_rounds(run_dir: Path, job: JobConfig, cpu_seconds: dict[int, float]) -> dict[str, Any]:
    """:func:`seed_result` with, per trained round, the cost and yield figures of the joint-mode comparison."""
    res = seed_result(run_dir, job)
    paths, cpu = RunPaths(run_dir), 0.0
    for rec in res["rounds"][1:]:
        r = rec["round"]
        cpu += cpu_seconds.get(r, 0.0)
        pairs = read_manifest(paths, r, "build-pairs").counts["pairs"]
        tokens = sampled_tokens(paths, r)
        gain = rec["eval/paired_diff_mean"]
        rec.update(
            {
                "cpu_minutes": cpu / 60,
                "gain_per_cpu_minute": None if gain is None or cpu <= 0 else gain / (cpu / 60),
                "pairs_built": pairs,
                "sampled_tokens": tokens,
                "pairs_per_sampled_token": pairs / tokens if tokens else None,
                "optimizer_steps": read_manifest(paths, r, "update-policies").counts["steps"],
            }
        )
    return res


def _mean(values: list[Any]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.fmean(kept) if kept else None


def compare_summary(results: dict[str, list[dict[str, Any]]], rounds: int) -> list[dict[str, Any]]:
    """Per round: each mode's means over seeds, and cross / aligned of the mean gain per CPU-minute (None when
    aligned's mean is not positive: a ratio to a loss or to nothing says nothing)."""
    keys = ("eval/paired_diff_mean", "gain_per_cpu_minute", "heldout_pair_accuracy", "pairs_per_sampled_token",
            "cpu_minutes", "optimizer_steps")  # fmt: skip
    table = []
    for r in range(1, rounds + 1):
        row: dict[str, Any] = {"round": r}
        for mode, seeds in results.items():
            recs = [x for res in seeds for x in res["rounds"] if x["round"] == r]
            row.update({f"{mode}/{k}": _mean([x.get(k) for x in recs]) for k in keys})
        aligned, cross = row.get("aligned/gain_per_cpu_minute"), row.get("cross/gain_per_cpu_minute")
        row["cross_over_aligned_gain_per_cpu_minute"] = (
            cross / aligned if aligned and aligned > 0 and cross is not None else None
        )
        table.append(row)
    return table


def print_comparison(summary: list[dict[str, Any]]) -> None:
    print("round | mode | paired gain | gain per CPU-minute | held-out pair acc | pairs per sampled token | steps")
    for row in summary:
        for mode in JOINT_MODES:
            print(
                f"  {row['round']} | {mode} | {fmt(row[f'{mode}/eval/paired_diff_mean'], '+.3f')} | "
                f"{fmt(row[f'{mode}/gain_per_cpu_minute'], '+.4f')} | {fmt(row[f'{mode}/heldout_pair_accuracy'])} | "
                f"{fmt(row[f'{mode}/pairs_per_sampled_token'], '.4f')} | {fmt(row[f'{mode}/optimizer_steps'], '.0f')}"
            )
        ratio = row["cross_over_aligned_gain_per_cpu_minute"]
        print(f"  {row['round']} | cross / aligned gain per CPU-minute: {fmt(ratio)}")


def compare_joint_modes(args: argparse.Namespace, seeds: tuple[int, ...], overrides: list[str]) -> int:
    """Aligned against cross joint responses, seed by seed (see the module docstring)."""
    out = Path(tempfile.mkdtemp(prefix="pbrl-learning-"))
    results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in JOINT_MODES}
    started = time.perf_counter()
    rounds = 0
    try:
        for seed in seeds:
            for mode in JOINT_MODES:
                where = [f"seed={seed}", f"run_name=learning-{mode}-seed{seed}", f"output_dir={out}"]
                first = load_job(CONFIG, [*overrides, *args.set, *where])
                # The user's --set comes last: it wins over the equalizing and the mode's overrides.
                mode_set = [*equal_steps_overrides(first), *joint_mode_overrides(mode), *args.set]
                job = load_job(CONFIG, [*overrides, *mode_set, *where])
                print(f"=== seed {seed}, {mode} ({args.task}, {args.scale})", flush=True)
                cpu: dict[int, float] = {}
                res = mode_rounds(run_seed(job, cpu), job, cpu)
                print_table(res, job.num_agents)
                results[mode].append(res)
                rounds = job.num_iterations
    finally:
        if args.keep:
            print(f"run folders: {out}")
        else:
            shutil.rmtree(out, ignore_errors=True)
    summary = compare_summary(results, rounds)
    print_comparison(summary)
    last = summary[-1]["cross_over_aligned_gain_per_cpu_minute"] if summary else None
    round_2 = next((row for row in summary if row["round"] == 2), None)
    model_tag = Path(args.model).name + ("" if args.scale == "standard" else f"-{args.scale}")
    model_tag += f"-{args.tag}" if args.tag else ""
    path = write_result(
        "learning",
        f"joint-modes-{args.task}-{model_tag}",
        {
            "config": str(CONFIG.relative_to(REPO_ROOT)),
            "overrides": overrides + list(args.set),
            "scale": args.scale,
            "seeds": list(seeds),
            "total_s": round(time.perf_counter() - started, 1),
            "results": results,
            "summary": summary,
            "cross_gains_1_3x_per_cpu_minute_at_round_2": None
            if round_2 is None or round_2["cross_over_aligned_gain_per_cpu_minute"] is None
            else round_2["cross_over_aligned_gain_per_cpu_minute"] >= 1.3,
            "method": __doc__.split("\n\n", 1)[1].split("\n\nRun:")[0],
        },
    )
    print(f"cross / aligned gain per CPU-minute in the last round: {fmt(last)}")
    print(f"result: {path}")
    return 0


def trainer_scale(trainer: str, scale: Scale, task: str) -> list[str]:
    """The scale's options for ``trainer``'s config: a config that keeps every pair of an item
    (``pair_selection: all``, as marlhf-docs.yaml does for its reward model) keeps it, with no per-item cap."""
    keeps_all = load_job(CONFIGS[trainer]).pair_selection == "all"
    return scale.overrides(task, cap_pairs=not keeps_all)


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
        "--tag", default="", help="a suffix of the result files' names, for an experiment's --set (e.g. all-history)"
    )
    parser.add_argument(
        "--trainer",
        choices=CONFIGS,
        default="madpo_iter",
        help="marlhf_iter: flows/configs/marlhf-docs.yaml at the same sizes (the reward model's held-out accuracy too)",
    )
    parser.add_argument(
        "--joint-mode",
        choices=JOINT_MODES,
        default=None,
        help="the config's own mode unless given; cross: joint_mode cross, counterfactual pairs first",
    )
    parser.add_argument(
        "--compare-joint-modes",
        action="store_true",
        help="aligned against cross per seed: same K, same samples, same optimizer steps (issue #34)",
    )
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
    if args.compare_joint_modes:
        return compare_joint_modes(args, seeds, [f"agent_model={args.model}", *scale.overrides(args.task)])
    mode = joint_mode_overrides(args.joint_mode)
    overrides = [f"agent_model={args.model}", *trainer_scale(args.trainer, scale, args.task), *mode, *args.set]
    out = Path(tempfile.mkdtemp(prefix="pbrl-learning-"))
    results = []
    started = time.perf_counter()
    try:
        for seed in seeds:
            where = [f"seed={seed}", f"run_name=learning-seed{seed}", f"output_dir={out}"]
            job = load_job(CONFIGS[args.trainer], [*overrides, *where])
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
    model_tag += f"-{args.joint_mode}" if args.joint_mode else ""
    model_tag += "-marlhf" if args.trainer == "marlhf_iter" else ""
    model_tag += f"-{args.tag}" if args.tag else ""
    seconds = time.perf_counter() - started
    finish(results, args.task, model_tag, overrides, args.scale, list(seeds), seconds, CONFIGS[args.trainer])
    return 0


if __name__ == "__main__":
    sys.exit(main())
