"""Benchmark (issue #33): two stage processes sharing 2 cores, with spinning and with passive OpenMP threads.

Each child process loads the model and samples the same rows (``generate``, 12 rows x 32 new tokens of HumanEval
prompts), once alone and then two at a time, under three settings:

* ``spinning, 2 threads``: torch's default before issue #33 (``OMP_WAIT_POLICY=ACTIVE``, one thread per core);
* ``passive, 2 threads``: ``OMP_WAIT_POLICY=PASSIVE`` in the environment (what the docs advise on a shared machine);
* ``passive, 1 thread``: what a process gets when it owns one CPU (a Ray shard or actor, or ``num_threads: 1``).

For every child: wall seconds of the sampling and the CPU seconds its threads burnt meanwhile
(``time.process_time``). The CPU of two concurrent children against one alone shows the spinning: with 2 cores and 2
processes of 2 threads, spinning
threads burn CPU while their partner is descheduled. Writes ``benchmarks/results/threads-<model>.json``.

Run: ``.venv/bin/python benchmarks/threads.py --model smollm2-135m-instruct`` on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from benchkit import write_result

CHILD = """
import sys, time, torch
from pbrl.generation.sampling import SamplingSettings, encode_prompt, generate
from pbrl.models.loading import load_model, load_tokenizer
from pbrl.run.threads import configure_threads
from pbrl.tasks.humaneval import load_problems
from pbrl.tasks.humaneval_docs import explanation_prompt
configure_threads(int(sys.argv[2]))
model, tok = load_model(sys.argv[1]), load_tokenizer(sys.argv[1])
prompts = [encode_prompt(tok, explanation_prompt(p)) for p in load_problems()[20:24]]
rows = [p for p in prompts for _ in range(3)]
settings = SamplingSettings(max_new_tokens=32, temperature=0.6, top_p=0.6, top_k=50, batch_size=64)
warm = SamplingSettings(max_new_tokens=2, temperature=0.6, top_p=0.6, top_k=50, batch_size=1)
generate(model, tok, rows[:1], [0], warm)
start, cpu = time.perf_counter(), time.process_time()
generate(model, tok, rows, list(range(len(rows))), settings)
print(time.perf_counter() - start, time.process_time() - cpu)
"""

SETTINGS = {
    "spinning, 2 threads": ("ACTIVE", 2),
    "passive, 2 threads": ("PASSIVE", 2),
    "passive, 1 thread": ("PASSIVE", 1),
}


def run(model: str, policy: str, threads: int, copies: int) -> list[dict[str, float]]:
    """``copies`` children at once; each one's wall and CPU seconds (all its threads) of the sampling alone."""
    env = {**os.environ, "OMP_WAIT_POLICY": policy}
    children = [
        subprocess.Popen([sys.executable, "-c", CHILD, model, str(threads)], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
        for _ in range(copies)
    ]  # fmt: skip
    out = []
    for child in children:
        text, _ = child.communicate()
        if child.returncode != 0:
            raise RuntimeError(f"a child failed (exit {child.returncode})")
        wall, cpu = (float(v) for v in text.strip().splitlines()[-1].split())
        out.append({"sampling_wall_s": round(wall, 2), "cpu_s": round(cpu, 2)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    args = parser.parse_args()
    from pbrl.models.loading import resolve_model_source

    source = str(resolve_model_source(args.model))
    results = {}
    for name, (policy, threads) in SETTINGS.items():
        alone = run(source, policy, threads, 1)[0]
        pair = run(source, policy, threads, 2)
        results[name] = {
            "alone": alone,
            "two_at_once": pair,
            "cpu_ratio_two_vs_alone": round(sum(p["cpu_s"] for p in pair) / (2 * alone["cpu_s"]), 2),
            "wall_ratio_two_vs_alone": round(max(p["sampling_wall_s"] for p in pair) / alone["sampling_wall_s"], 2),
        }
        print(
            f"[threads] {name:22s} alone {alone['sampling_wall_s']:6.1f} s wall {alone['cpu_s']:6.1f} s CPU; "
            f"two at once: wall x{results[name]['wall_ratio_two_vs_alone']}, CPU per process "
            f"x{results[name]['cpu_ratio_two_vs_alone']}",
            flush=True,
        )
    write_result(
        "threads",
        args.model,
        {
            "settings": results,
            "started": time.time(),
            "method": __doc__,
            "workload": "12 rows x 32 new tokens, 4 HumanEval prompts",
        },
    )


if __name__ == "__main__":
    main()
