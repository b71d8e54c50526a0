"""Benchmark: the LM head's product on a strided last-position view against the same rows made contiguous.

What ``pbrl.models.head_input`` is for (docs/results/benchmarks.md#the-lm-heads-strided-input-in-bfloat16): a prefill
asks for the last position's logits only, so the head gets ``hidden[:, -1:, :]`` (rows, 1, hidden), a strided view;
for a frozen bfloat16 weight torch's CPU matmul then copied the head once per row (pytorch/pytorch#151934). For each
dtype: the largest single allocation of the product (torch's profiler, in MiB: a count, not a timing) and its wall
time (median of interleaved repeats), strided and contiguous, and whether the two gave the same bits. The head is
random, of SmolLM2-135M's shape (49,152 x 576) unless ``--vocab``/``--hidden`` say otherwise; its weight does not
require grad, as a frozen policy's. Ratios only, strided over contiguous, measured in the same run.

Run: ``.venv/bin/python benchmarks/head_input.py`` (about 20 s on 2 cores).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from benchkit import check, interleaved, print_checks, ratio, summary, write_result
from torch.profiler import ProfilerActivity, profile

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def largest_allocation_mib(fn) -> float:
    """The largest single CPU allocation while ``fn()`` runs, in MiB (torch's profiler)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return round(max((e.cpu_memory_usage for e in prof.events()), default=0) / 2**20, 3)


def measure(dtype: torch.dtype, rows: int, vocab: int, hidden: int, repeats: int) -> dict:
    """Strided and contiguous products of one dtype: allocations, times, equal bits."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, hidden, generator=generator).to(dtype)  # (v, h), frozen
    states = torch.randn(rows, 8, hidden, generator=generator).to(dtype)  # (b, t, h)
    strided = states[:, -1:, :]  # (b, 1, h), as transformers slices for logits_to_keep=1
    contiguous = strided.contiguous()
    with torch.inference_mode():
        same = torch.equal(F.linear(strided, weight), F.linear(contiguous, weight))
        memory = {
            "strided": largest_allocation_mib(lambda: F.linear(strided, weight)),
            "contiguous": largest_allocation_mib(lambda: F.linear(contiguous, weight)),
        }
        times = interleaved(
            {"strided": lambda: F.linear(strided, weight), "contiguous": lambda: F.linear(contiguous, weight)},
            repeats,
        )
    return {
        "largest_allocation_mib": memory,
        "head_mib": round(weight.nbytes / 2**20, 3),
        "seconds": {name: summary(samples) for name, samples in times.items()},
        "time_ratio_strided_over_contiguous": ratio(
            statistics.median(times["strided"]), statistics.median(times["contiguous"])
        ),
        "same_bits": same,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16, help="rows of the product (a prefill's distinct prompts)")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtypes", nargs="*", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--result", default="head-input", help="result file name (one per machine)")
    args = parser.parse_args()
    results = {}
    for name in args.dtypes:
        results[name] = measure(DTYPES[name], args.rows, args.vocab, args.hidden, args.repeats)
        r = results[name]
        print(
            f"[head_input] {name:9s} largest allocation strided {r['largest_allocation_mib']['strided']:8.1f} MiB, "
            f"contiguous {r['largest_allocation_mib']['contiguous']:8.1f} MiB; "
            f"time x{r['time_ratio_strided_over_contiguous']}; same bits {r['same_bits']}",
            flush=True,
        )
    checks = [
        check(
            f"{name}: largest allocation, strided over contiguous",
            ratio(r["largest_allocation_mib"]["strided"], r["largest_allocation_mib"]["contiguous"]),
            None,
        )
        for name, r in results.items()
    ]
    path = write_result(
        args.result,
        f"head-{args.vocab}x{args.hidden}",
        {
            "workload": {"rows": args.rows, "vocab": args.vocab, "hidden": args.hidden, "weight": "frozen"},
            "dtypes": results,
            "checks": checks,
        },
    )
    print_checks("head_input", checks, Path(path))


if __name__ == "__main__":
    main()
