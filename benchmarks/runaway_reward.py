"""Benchmark: a reward that loops or sleeps on one item in round 1 does not slow the rounds after it (issue #53.1).

The tiny MADPO-iterative config (``flows/configs/tiny-madpo-iter.yaml``, toy task) with 3 rounds, run as plain
stage calls (no Prefect), ``reward_timeout`` 2 s, one torch thread. In round 1 the reward of every joint response of
item ``toy-001`` (in score-with-oracle and in evaluate) never returns: it loops (``looping``) or sleeps (``sleeping``);
every other call is the toy reward. ``baseline`` never hangs. ``looping, thread (before)`` runs the reward as pbrl
did before issue #53: in a thread abandoned at the limit, which computes on. Each setting runs in a process of its
own (an abandoned thread would slow the settings after it), in an order that rotates from repeat to repeat.

Measured per round and setting: the wall seconds, and the CPU seconds of the benchmark's process (every thread of it,
``getrusage``; a reward left computing in a thread counts there, a killed worker process does not). On a shared
machine the wall seconds follow the other jobs' load, while the CPU seconds count this process's work alone (with one
torch thread: two threads spun while waiting for a CPU, and a 0.8 s round then took 30 s of CPU). The checks are on
the CPU seconds of rounds 2-3, a setting's median over the baseline's, measured in the same run (target: at most
1.1 x for the looping and the sleeping reward); the wall ratios are information, and so is round 1, whose timed-out
calls take 2 x 2 s per stage at least.

Run: ``.venv/bin/python benchmarks/runaway_reward.py`` (a few minutes on 2 cores; the thread setting's rounds take
longest, so it runs ``--before-repeats`` times, once by default).
"""

from __future__ import annotations

import argparse
import contextvars
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from benchkit import REPO_ROOT, check, print_checks, ratio, summary, write_result

CONFIG = REPO_ROOT / "flows" / "configs" / "tiny-madpo-iter.yaml"
SETTINGS = ("baseline", "looping", "sleeping", "looping, thread (before)")
HANGING_ITEM = "toy-001"
HANGING_ROUND = 1
TIMEOUT_S = 2.0
TARGET = 1.1
CURRENT_ROUND = {"index": 0}  # read by the reward (the worker is forked at each stage, so it sees the round)


def runaway_reward(mode: str):
    """The toy reward, except in round 1 on ``toy-001``: loop or sleep forever (``mode``), else never."""
    from pbrl.tasks.toy import toy_reward

    def reward(*completions, batch_items=None):
        hangs = CURRENT_ROUND["index"] == HANGING_ROUND and any(i["item_id"] == HANGING_ITEM for i in batch_items)
        if hangs and mode == "sleeping":
            time.sleep(3600)
        elif hangs and mode != "baseline":
            while True:
                pass
        return toy_reward(*completions)

    return reward


def abandoned_thread_call(self, completions, prompts, batch_items):
    """``Oracle._call`` as before issue #53: the call in a thread, abandoned (computing on) at the limit."""
    from pbrl.preference.reward_worker import CallTimeout

    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = self._score(completions, prompts, batch_items)
        except BaseException as exc:
            outcome["error"] = exc

    worker = threading.Thread(target=contextvars.copy_context().run, args=(target,), daemon=True)
    worker.start()
    worker.join(self.timeout_s)
    if worker.is_alive():
        raise CallTimeout("abandoned")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def one_setting(setting: str, model: str) -> dict[str, Any]:
    """Run the 3 rounds of one setting in this process; seconds per round and the failures counted."""
    from pbrl.config import load_job
    from pbrl.preference.oracle import Oracle
    from pbrl.run.folder import open_job, prepare_run
    from pbrl.run.settings import configure_job_threads
    from pbrl.run.stage_plan import trainer_stages
    from pbrl.run.task import attach_task, resolve_task
    from stages import STAGE_MODULES

    if setting.endswith("(before)"):
        Oracle._call = abandoned_thread_call
    mode = setting.split(",")[0]
    seconds: dict[int, float] = {}
    cpu: dict[int, float] = {}
    failed: dict[int, int] = {}
    with tempfile.TemporaryDirectory() as out:
        overrides = [f"output_dir={out}", "run_name=bench", "num_iterations=3", f"agent_model={model}"]
        # One torch thread: an intra-op thread that spins while the other waits for a CPU would count other jobs'
        # load as this process's CPU seconds.
        extra = [f"reward_timeout={TIMEOUT_S}", "oracle_max_failure_share=0.6", "num_threads=1"]
        job = load_job(CONFIG, [*overrides, *extra])
        run_dir = prepare_run(job, resume=False)
        job = open_job(run_dir)
        configure_job_threads(job)
        toy = resolve_task(job, run_dir)
        attach_task(run_dir, type(toy)(name="toy", formatters=toy.formatters, reward_func=runaway_reward(mode)))
        for round_index in range(4):
            CURRENT_ROUND["index"] = round_index
            names = ("evaluate",) if round_index == 0 else trainer_stages(job.trainer)
            start, cpu_start = time.perf_counter(), _cpu_seconds()
            failed[round_index] = 0
            for name in names:
                manifest = STAGE_MODULES[name].run(run_dir, round_index, job)
                if name in ("score-with-oracle", "evaluate"):
                    failed[round_index] += manifest.counts.get("failed", 0)
            seconds[round_index] = round(time.perf_counter() - start, 3)
            cpu[round_index] = round(_cpu_seconds() - cpu_start, 3)
    return {"seconds": seconds, "cpu_seconds": cpu, "failed": failed}


def _cpu_seconds() -> float:
    """User and system CPU seconds of this process so far, every thread of it."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _sums(runs: dict[str, list[dict[str, Any]]], key: str, rounds: Callable[[int], bool]) -> dict[str, list[float]]:
    """Per setting, each run's ``key`` summed over the rounds ``rounds`` accepts (settings without runs left out)."""
    sums = {s: [sum(v for r, v in run[key].items() if rounds(int(r))) for run in runs[s]] for s in runs}
    return {s: v for s, v in sums.items() if v}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-random", help="packaged alias or model folder")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--before-repeats", type=int, default=1, help="repeats of the thread setting (its rounds take minutes)"
    )
    parser.add_argument("--one", choices=SETTINGS, help=argparse.SUPPRESS)  # a child: one setting, JSON on stdout
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_setting(args.one, args.model)))
        return
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SETTINGS}
    for r in range(args.repeats):
        for setting in SETTINGS[r % len(SETTINGS) :] + SETTINGS[: r % len(SETTINGS)]:
            if setting.endswith("(before)") and r >= args.before_repeats:
                continue
            child = subprocess.run(
                [sys.executable, __file__, "--one", setting, "--model", args.model],
                capture_output=True,
                text=True,
                check=True,
                cwd=REPO_ROOT,
            )
            runs[setting].append(json.loads(child.stdout.strip().splitlines()[-1]))
            done = runs[setting][-1]
            print(
                f"[runaway_reward] repeat {r} {setting}: wall {done['seconds']} cpu {done['cpu_seconds']}", flush=True
            )
    later = _sums(runs, "seconds", lambda r: r >= 2)
    later_cpu = _sums(runs, "cpu_seconds", lambda r: r >= 2)
    first = _sums(runs, "seconds", lambda r: r == 1)

    def median_ratio(values: dict[str, list[float]], setting: str) -> float:
        return ratio(statistics.median(values[setting]), statistics.median(values["baseline"]))

    checks = [
        check(f"rounds 2-3 CPU, {s} / baseline", median_ratio(later_cpu, s), TARGET, higher_is_better=False)
        for s in ("looping", "sleeping")
    ]
    checks.append(
        check("rounds 2-3 CPU, looping, thread (before) / baseline", median_ratio(later_cpu, SETTINGS[3]), None)
    )
    checks += [check(f"rounds 2-3 wall, {s} / baseline", median_ratio(later, s), None) for s in SETTINGS[1:]]
    checks += [check(f"round 1 wall, {s} / baseline", median_ratio(first, s), None) for s in SETTINGS[1:]]
    result = {
        "repeats": args.repeats,
        "reward_timeout_s": TIMEOUT_S,
        "rounds_2_3_seconds": {s: summary(v) for s, v in later.items()},
        "rounds_2_3_cpu_seconds": {s: summary(v) for s, v in later_cpu.items()},
        "round_1_seconds": {s: summary(v) for s, v in first.items()},
        "failed_per_round": {s: runs[s][0]["failed"] for s in SETTINGS},
        "runs": runs,
        "ratios": {c["name"]: c["value"] for c in checks},
        "checks": checks,
    }
    print_checks("runaway_reward", checks, write_result("runaway-reward", args.model, result))


if __name__ == "__main__":
    main()
