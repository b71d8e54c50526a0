"""Benchmark (issue #57): the demo round beside other processes on the same cores.

Runs ``benchmarks/round.py`` (the demo's round 0 evaluation and round 1, stages called directly, one process) beside
each neighbour, one after the other:

* ``none``: the round alone;
* ``niced busy loop``: one process that computes without pause at ``nice 10``;
* ``busy loop``: the same at the round's priority (it takes one of two cores for the whole round);
* ``bursty``: a process that computes 2 s and sleeps 2 s, at the round's priority (test runs, tiny trainings
  starting and stopping);
* ``another round``: a second ``round.py`` started at the same time (two users' demo rounds).

and, with ``--before``, each neighbour again with the thread count of before issue #57 in bfloat16: the owned count
throughout (``round.py --pinned-threads``; the load follower then ran only in float32 jobs). Each run's round seconds
are compared with the same setting's run alone (``vs_alone``). Targets (issue #57): beside a busy loop <= 2.2x,
beside a niced one <= 1.1x, beside a bursty one <= 2.5x.

Writes ``benchmarks/results/neighbours-<model>.json``. Run on an otherwise idle machine: ``.venv/bin/python
benchmarks/neighbours.py --before`` (10 rounds, about an hour on 2 cores with SmolLM2).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

from benchkit import RESULTS_DIR, write_result

HERE = Path(__file__).resolve().parent
BUSY = "while True: pass"
BURSTY = """import time
while True:
    end = time.monotonic() + 2
    while time.monotonic() < end:
        pass
    time.sleep(2)
"""
NEIGHBOURS = ("none", "niced busy loop", "busy loop", "bursty", "another round")
TARGETS = {"niced busy loop": 1.1, "busy loop": 2.2, "bursty": 2.5}


def round_command(model: str, result: str, pinned: bool) -> list[str]:
    return [sys.executable, str(HERE / "round.py"), "--model", model, "--result", result] + (
        ["--pinned-threads"] if pinned else []
    )


def neighbour(name: str, model: str, pinned: bool) -> subprocess.Popen | None:
    """Start the neighbour process (None for ``none``)."""
    if name == "none":
        return None
    if name == "another round":
        cmd = round_command(model, "neighbour-round", pinned)
    else:
        cmd = [sys.executable, "-c", BURSTY if name == "bursty" else BUSY]
        if name == "niced busy loop":
            cmd = ["nice", "-n", "10", *cmd]
    return subprocess.Popen(cmd, cwd=HERE.parent, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run_once(name: str, model: str, pinned: bool) -> dict:
    result = f"neighbour-{re.sub(r'[^a-z0-9]+', '-', name)}{'-before' if pinned else ''}"
    other = neighbour(name, model, pinned)
    try:
        out = subprocess.run(round_command(model, result, pinned), capture_output=True, text=True, cwd=HERE.parent)
    finally:
        if other is not None:
            other.kill()
            other.wait()
    if out.returncode != 0:
        raise RuntimeError(f"{name}: round.py failed:\n{out.stderr[-3000:]}")
    data = json.loads((RESULTS_DIR / f"{result}-{model}.json").read_text())
    (RESULTS_DIR / f"{result}-{model}.json").unlink()  # kept in this benchmark's result
    stages = data["stages"]
    return {
        "neighbour": name,
        "threads": "owned count (before)" if pinned else "follows the load (today)",
        "round_1_seconds": data["round_1_seconds"],
        "round_0_evaluate_seconds": sum(s["seconds"] for s in stages if s["round"] == 0 and s["stage"] == "evaluate"),
        "peak_rss_gb": data["peak_rss_gb"],
        "stages": stages,
        "workload": data["workload"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--neighbours", nargs="*", default=list(NEIGHBOURS), choices=list(NEIGHBOURS))
    parser.add_argument("--before", action="store_true", help="also each neighbour with the threads of before")
    parser.add_argument("--result", default="neighbours", help="result name")
    args = parser.parse_args()
    names = args.neighbours if "none" in args.neighbours else ["none", *args.neighbours]
    runs = []
    for pinned in (False, True) if args.before else (False,):
        for name in names:
            runs.append(run_once(name, args.model, pinned))
            alone = next(r for r in runs if r["neighbour"] == "none" and r["threads"] == runs[-1]["threads"])
            runs[-1]["vs_alone"] = round(runs[-1]["round_1_seconds"] / alone["round_1_seconds"], 2)
            target = TARGETS.get(name) if not pinned else None
            runs[-1]["target"] = target
            print(
                f"[neighbours] {runs[-1]['threads']:26s} {name:16s} round 1 {runs[-1]['round_1_seconds']:7.1f} s "
                f"(x{runs[-1]['vs_alone']} vs alone{f', target x{target}' if target else ''})",
                flush=True,
            )
    write_result(args.result, args.model, {"runs": runs, "method": __doc__})


if __name__ == "__main__":
    main()
