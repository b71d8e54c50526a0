"""Run the benchmarks (generation, scoring, orchestration, peer_trl, round, scale_out) in order, each in its own
process, and print a table of their ratios with the targets of docs/results/benchmarks.md#performance-targets and
issue #14, and whether each was met.
``peer_trl`` needs the ``bench`` extra (TRL); ``round`` runs one demo round (minutes on SmolLM2); ``scale_out``
starts a local Ray (the ``ray`` extra, part of ``dev``).

Each benchmark writes ``benchmarks/results/<benchmark>-<model>.json``; this script adds
``benchmarks/results/summary-<model>.json``. Missed targets do not fail the run (the numbers come from
a shared, noisy machine); a benchmark that crashes does (exit status 1). Its stderr (library logs,
progress bars) goes to ``benchmarks/results/<benchmark>-<model>.log`` and is shown when it fails.

Run: ``make bench`` or ``.venv/bin/python benchmarks/run_all.py --model smollm2-135m-instruct``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchkit import REPO_ROOT, RESULTS_DIR, result_path, verdict_of

BENCHMARKS = ("generation", "scoring", "orchestration", "peer_trl", "round", "scale_out")
HERE = Path(__file__).resolve().parent


def run_one(name: str, model: str) -> tuple[int, float, Path]:
    """Run ``benchmarks/<name>.py --model <model>``: stdout streams through, stderr goes to a log."""
    log = RESULTS_DIR / f"{name}-{Path(model).name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log, "w") as err:
        code = subprocess.run(
            [sys.executable, str(HERE / f"{name}.py"), "--model", model], cwd=REPO_ROOT, stderr=err, check=False
        ).returncode
    return code, time.perf_counter() - start, log


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "0" if value == 0 else f"{value:.3g}" if abs(value) < 1e-3 else f"{value:.3f}"
    return str(value)


def table(rows: list[dict[str, Any]]) -> str:
    """A plain-text table: check, value, target, verdict."""
    header = ("check", "value", "target", "verdict")
    lines = [
        (
            r["name"],
            _fmt(r["value"]),
            "-" if r["target"] is None else f"{r['direction']} {_fmt(r['target'])}",
            verdict_of(r),
        )
        for r in rows
    ]
    widths = [max(len(x[i]) for x in [header, *lines]) for i in range(4)]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=False)), "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=False)) for line in lines]
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="tiny-random", help="packaged alias (tiny-random, smollm2-135m-instruct) or a model folder"
    )
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS, help="run only these benchmarks")
    args = parser.parse_args()
    names = [n for n in BENCHMARKS if not args.only or n in args.only]
    checks: list[dict[str, Any]] = []
    runs: dict[str, Any] = {}
    failed = []
    for name in names:
        print(f"=== {name} ({args.model})", flush=True)
        path = result_path(name, args.model)
        path.unlink(missing_ok=True)  # never summarise a stale result
        code, seconds, log = run_one(name, args.model)
        runs[name] = {"exit_code": code, "seconds": round(seconds, 1), "log": str(log.relative_to(REPO_ROOT))}
        if code != 0 or not path.is_file():
            failed.append(name)
            print(f"[{name}] FAILED (exit {code}); last lines of {log}:")
            print("\n".join(log.read_text(errors="replace").splitlines()[-30:]))
            continue
        result = json.loads(path.read_text())
        checks += [{**c, "benchmark": name} for c in result["checks"]]
        runs[name]["result"] = str(path.relative_to(REPO_ROOT))
    summary_path = RESULTS_DIR / f"summary-{Path(args.model).name}.json"
    summary_path.write_text(
        json.dumps({"model": args.model, "runs": runs, "checks": checks, "failed": failed}, indent=2) + "\n"
    )
    total = sum(r["seconds"] for r in runs.values())
    print(f"\n=== summary ({args.model}; {total:.0f} s; shared machine, numbers are noisy)")
    print(table(checks))
    failures = f"; FAILED: {', '.join(failed)}" if failed else ""
    print(f"results: {summary_path.relative_to(REPO_ROOT)}{failures}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
