"""Benchmark (issue #33): the demo round with each speed lever alone and all together, interleaved.

Runs ``benchmarks/round.py`` (the demo's round 0 evaluation and round 1, stages called directly, one process) once
per setting, in rounds of all settings, so that a slow period of the machine hits every setting alike:

* ``before``: the settings of 2026-12-01 — float32 weights, no autocast, transformers' KV cache, the seeded sampler
  over the whole vocabulary, OpenMP threads spinning while they wait (``OMP_WAIT_POLICY=ACTIVE``);
* ``+preallocated cache``, ``+top-k sampler``, ``+passive OpenMP``, ``+bfloat16 weights`` (``torch_dtype:
  bfloat16``, whether or not this CPU computes bfloat16 natively): one lever each over ``before``;
* ``defaults, phase 1 for every agent``: today's defaults but every MADPO agent computes detached margins, as
  before ``pbrl.learning.madpo.phase_one_agents`` (2026-12-04);
* ``defaults, strided head input``: today's defaults but the LM head gets transformers' strided last-position view,
  as before ``pbrl.models.head_input`` (2026-12-05; in bfloat16 torch's CPU matmul copies the head once per row);
* ``defaults, batched bfloat16 rows``: today's defaults but bfloat16 rows sampled in padded batches, as before
  ``pbrl.models.row_invariance`` (2026-12-06; a row's tokens then depended on its batch): the cost of row invariance;
* ``defaults in float32``: today's defaults with ``torch_dtype: float32`` and ``mixed_precision: no``, what ``auto``
  resolves to on a CPU without bfloat16 arithmetic (the float32 figure the bfloat16 defaults are measured beside);
* ``defaults, bf16 autocast``: today's defaults with ``mixed_precision: bf16`` (autocast over the float32 adapters),
  which ``auto`` leaves off on CPUs;
* ``defaults``: today's defaults (``auto`` precision, resolved for this machine; the preallocated cache; the top-k
  sampler; OpenMP's own wait policy, ``OMP_WAIT_POLICY`` removed from the environment).

Writes ``benchmarks/results/round-levers-<model>.json`` with every run's stage seconds and peak RSS, the median round
seconds per setting and its ratio to ``before``. Run on an idle machine: ``.venv/bin/python benchmarks/round_levers.py
--repeats 2`` (about 10 runs of ~4 minutes on 2 cores with SmolLM2).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

from benchkit import RESULTS_DIR, write_result

HERE = Path(__file__).resolve().parent
BEFORE = ["--set", "torch_dtype=float32", "--set", "mixed_precision=no"]
OLD_PATH = ["--dynamic-cache", "--full-vocab-sampler"]
SPIN = {"OMP_WAIT_POLICY": "ACTIVE"}
# (round.py arguments, environment changes: None removes a variable)
SETTINGS: dict[str, tuple[list[str], dict[str, str | None]]] = {
    "before": ([*BEFORE, *OLD_PATH], SPIN),
    "+preallocated cache": ([*BEFORE, "--full-vocab-sampler"], SPIN),
    "+top-k sampler": ([*BEFORE, "--dynamic-cache"], SPIN),
    "+passive OpenMP": ([*BEFORE, *OLD_PATH], {"OMP_WAIT_POLICY": "PASSIVE"}),
    "+bfloat16 weights": (["--set", "torch_dtype=bfloat16", "--set", "mixed_precision=no", *OLD_PATH], SPIN),
    "defaults, phase 1 for every agent": (["--every-phase-one"], {"OMP_WAIT_POLICY": None}),
    "defaults, strided head input": (["--strided-head"], {"OMP_WAIT_POLICY": None}),
    "defaults, batched bfloat16 rows": (["--batched-rows"], {"OMP_WAIT_POLICY": None}),
    "defaults in float32": ([*BEFORE], {"OMP_WAIT_POLICY": None}),
    "defaults, bf16 autocast": (["--set", "mixed_precision=bf16"], {"OMP_WAIT_POLICY": None}),
    "defaults": ([], {"OMP_WAIT_POLICY": None}),
}


def run_once(name: str, model: str, repeat: int) -> dict:
    args, env = SETTINGS[name]
    result = f"round-lever-{re.sub(r'[^a-z0-9]+', '-', name).strip('-')}-{repeat}"
    cmd = [sys.executable, str(HERE / "round.py"), "--model", model, "--result", result, *args]
    environment = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
    out = subprocess.run(cmd, env=environment, capture_output=True, text=True, cwd=HERE.parent)
    if out.returncode != 0:
        raise RuntimeError(f"{name}: round.py failed:\n{out.stderr[-3000:]}")
    data = json.loads((RESULTS_DIR / f"{result}-{model}.json").read_text())
    return {
        "setting": name,
        "repeat": repeat,
        "round_1_seconds": data["round_1_seconds"],
        "peak_rss_gb": data["peak_rss_gb"],
        "stages": data["stages"],
        "workload": data["workload"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--result", default="round-levers", help="result name (one per machine: round-levers-avx2)")
    args = parser.parse_args()
    runs = []
    for repeat in range(args.repeats):
        order = args.settings if repeat % 2 == 0 else list(reversed(args.settings))  # alternate the order
        for name in order:
            runs.append(run_once(name, args.model, repeat))
            print(
                f"[levers] {name:22s} repeat {repeat}: round 1 {runs[-1]['round_1_seconds']:7.1f} s, "
                f"peak {runs[-1]['peak_rss_gb']:.2f} GiB",
                flush=True,
            )
    medians = {n: statistics.median(r["round_1_seconds"] for r in runs if r["setting"] == n) for n in args.settings}
    base = medians.get("before")
    summary = {
        n: {
            "median_round_1_seconds": round(m, 1),
            "speedup_vs_before": round(base / m, 3) if base else None,
            "peak_rss_gb": max(r["peak_rss_gb"] for r in runs if r["setting"] == n),
        }
        for n, m in medians.items()
    }
    for name, row in summary.items():
        ratio = f"  x{row['speedup_vs_before']} vs before" if row["speedup_vs_before"] else ""
        print(f"[levers] {name:22s} median {row['median_round_1_seconds']:7.1f} s{ratio}")
    write_result(args.result, args.model, {"summary": summary, "runs": runs, "method": __doc__})


if __name__ == "__main__":
    main()
