"""Benchmark (issue #33): two stage processes sharing 2 cores, with spinning and with passive OpenMP threads.

Each child process loads the model and samples the same rows (``generate``, 12 rows x 32 new tokens of HumanEval
prompts), once alone and then two at a time, under these settings:

* ``spinning, 2 threads``: ``OMP_WAIT_POLICY=ACTIVE``, one thread per core (threads spin while they wait);
* ``fixed, 2 threads``: ``num_threads: 2`` (``OMP_WAIT_POLICY`` unset: GNU OpenMP spins a while, then sleeps),
  what pbrl did on its own before it followed the load;
* ``follows the load``: pbrl's default (``num_threads`` unset): the CPUs the process owns, here 2, fewer while other
  processes keep some busy (``pbrl.models.threads.LoadFollower``), OpenMP's wait policy unset;
* ``spin 10k, 2 threads`` / ``spin 1k, 2 threads``: ``GOMP_SPINCOUNT`` 10,000 or 1,000 (GNU OpenMP, torch's on Linux:
  how many times a waiting thread polls before it sleeps; 300,000 when ``OMP_WAIT_POLICY`` is unset);
* ``passive, 2 threads``: ``OMP_WAIT_POLICY=PASSIVE`` in the environment (what the docs advise on a shared machine);
* ``passive, 1 thread``: what a process gets when it owns one CPU (a Ray shard or actor, or ``num_threads: 1``).

For every child: wall seconds of the sampling and the CPU seconds its threads burnt meanwhile
(``time.process_time``). The CPU of two concurrent children against one alone shows the spinning: with 2 cores and 2
processes of 2 threads, spinning
threads burn CPU while their partner is descheduled. Writes ``benchmarks/results/threads-<model>.json``.

``--work train`` times 4 MADPO steps of one LoRA agent instead (``threads-train-<model>.json``).

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
from pbrl.models.threads import configure_threads
from pbrl.tasks.humaneval import load_problems
from pbrl.tasks.humaneval_docs import explanation_prompt
configure_threads(None if sys.argv[2] == "auto" else int(sys.argv[2]))
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

# Training: 4 MADPO steps of one LoRA agent (r=8 on q/k/v/o) on 8 pairs of HumanEval prompts, batch 2, after one
# discarded step: the many small kernels of a LoRA step are where waiting threads matter most.
TRAIN_CHILD = """
import copy, sys, time
sys.path.insert(0, "benchmarks")
from benchkit import trained_lora
from peer_trl import make_pairs, run_madpo
from pbrl.models.loading import load_model, load_tokenizer
from pbrl.models.threads import configure_threads
configure_threads(None if sys.argv[2] == "auto" else int(sys.argv[2]))
base, tok = load_model(sys.argv[1]), load_tokenizer(sys.argv[1])
for p in base.parameters():
    p.requires_grad_(False)
base.train()
policy = trained_lora(base, seed=1)
pairs = make_pairs(tok, 8)
run_madpo(copy.deepcopy(policy), tok.pad_token_id, pairs[:2], 1)
start, cpu = time.perf_counter(), time.process_time()
run_madpo(policy, tok.pad_token_id, pairs, 1)
print(time.perf_counter() - start, time.process_time() - cpu)
"""

# (environment: None removes a variable; torch threads, "auto" = num_threads unset)
SETTINGS: dict[str, tuple[dict[str, str | None], int | str]] = {
    "spinning, 2 threads": ({"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": None}, 2),
    "fixed, 2 threads": ({"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None}, 2),
    "follows the load": ({"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None}, "auto"),
    "spin 10k, 2 threads": ({"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "10000"}, 2),
    "spin 1k, 2 threads": ({"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "1000"}, 2),
    "passive, 2 threads": ({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None}, 2),
    "passive, 1 thread": ({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None}, 1),
}


def run(
    model: str, changes: dict[str, str | None], threads: int | str, copies: int, work: str
) -> list[dict[str, float]]:
    """``copies`` children at once; each one's wall and CPU seconds (all its threads) of the work alone."""
    env = {k: v for k, v in {**os.environ, **changes}.items() if v is not None}
    code = CHILD if work == "sample" else TRAIN_CHILD
    children = [
        subprocess.Popen([sys.executable, "-c", code, model, str(threads)], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
        for _ in range(copies)
    ]  # fmt: skip
    out = []
    for child in children:
        text, _ = child.communicate()
        if child.returncode != 0:
            raise RuntimeError(f"a child failed (exit {child.returncode})")
        wall, cpu = (float(v) for v in text.strip().splitlines()[-1].split())
        out.append({"wall_s": round(wall, 2), "cpu_s": round(cpu, 2)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--work", default="sample", choices=["sample", "train"], help="what each child times")
    parser.add_argument("--result", default=None, help="result name (default threads / threads-train)")
    args = parser.parse_args()
    from pbrl.models.loading import resolve_model_source

    source = str(resolve_model_source(args.model))
    results = {}
    for name in args.settings:
        changes, threads = SETTINGS[name]
        alone = run(source, changes, threads, 1, args.work)[0]
        pair = run(source, changes, threads, 2, args.work)
        results[name] = {
            "alone": alone,
            "two_at_once": pair,
            "cpu_ratio_two_vs_alone": round(sum(p["cpu_s"] for p in pair) / (2 * alone["cpu_s"]), 2),
            "wall_ratio_two_vs_alone": round(max(p["wall_s"] for p in pair) / alone["wall_s"], 2),
        }
        print(
            f"[threads] {name:22s} alone {alone['wall_s']:6.1f} s wall {alone['cpu_s']:6.1f} s CPU; "
            f"two at once: wall x{results[name]['wall_ratio_two_vs_alone']}, CPU per process "
            f"x{results[name]['cpu_ratio_two_vs_alone']}",
            flush=True,
        )
    write_result(
        args.result or ("threads" if args.work == "sample" else "threads-train"),
        args.model,
        {
            "settings": results,
            "started": time.time(),
            "method": __doc__,
            "workload": "12 rows x 32 new tokens, 4 HumanEval prompts"
            if args.work == "sample"
            else "4 MADPO steps, one LoRA agent, 8 pairs of HumanEval prompts, batch 2",
        },
    )


if __name__ == "__main__":
    main()
