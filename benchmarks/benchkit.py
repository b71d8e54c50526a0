"""Shared pieces of the benchmark scripts: timing, machine facts, the result file, the size presets.

Every benchmark measures ratios inside one process (the two sides see the same machine load), times
with ``time.perf_counter``, warms up once and reports the median of several repeats. Nothing here
asserts on time: the scripts record and print; ``run_all.py`` compares the ratios with their targets.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parent.parent
NOISE_NOTE = (
    "Measured on a shared machine where other jobs may run at the same time: single numbers are noisy "
    "(30-50 % swings seen on the 2-core VM); the two sides of each ratio are interleaved within every "
    "repeat so that slow periods hit both, and the median of the repeats is reported."
)


@dataclass(frozen=True)
class Sizes:
    """Workload sizes for one model: small enough for the tiny model (< 2 min in all) and for SmolLM2
    on 2 CPU cores (a few minutes)."""

    gen_prompts: int  # distinct prompts
    gen_candidates: int  # sequences per prompt (K); rows = prompts x K
    gen_new_tokens: int
    gen_repeats: int
    score_sequences: int
    score_repeats: int
    round_repeats: int  # fresh rounds through Prefect and directly (each)
    cached_repeats: int
    shared_prompts: int = 4  # HumanEval prompts of the shared-prompt cases (scoring, generation)
    shared_rows: int = 6  # sampled rows per prompt in shared-prompt generation (3 target + 3 comparator)
    shared_repeats: int = 5
    peer_pairs: int = 8  # pairs of the TRL side-by-side (peer_trl.py)
    peer_epochs: int = 2


SIZES: dict[str, Sizes] = {
    "tiny-random": Sizes(8, 4, 32, 7, 16, 15, 3, 3, shared_repeats=7),
    # 2 prompts x 4 = 8 sequences x 32 new tokens: one generate call is a few seconds on 2 cores.
    "smollm2-135m-instruct": Sizes(
        2, 4, 32, 3, 16, 3, 1, 2, shared_prompts=4, shared_repeats=3, peer_pairs=8, peer_epochs=1
    ),
}


def sizes_for(model: str) -> Sizes:
    """The preset of a packaged model name; any other model (a folder, a hub id) gets SmolLM2's."""
    return SIZES.get(model, SIZES["smollm2-135m-instruct"])


def humaneval_prompt_ids(tokenizer: Any, count: int, max_tokens: int = 240) -> list[list[int]]:
    """Chat-encoded prompts of the first ``count`` HumanEval problems (the demo's workload: about 150-300
    SmolLM2 tokens each), each cut to its first ``max_tokens`` ids (the tiny model's byte-level vocabulary
    makes them longer than its 256 positions)."""
    from pbrl.generation.sampling import encode_prompt
    from pbrl.tasks.humaneval import load_problems

    problems = load_problems()[:count]
    return [encode_prompt(tokenizer, p["prompt"])[:max_tokens] for p in problems]


def trained_lora(model: Any, seed: int) -> Any:
    """``model`` (changed in place, as peft does) with the demo's LoRA adapter (r=8, alpha 16, no dropout, on
    q/k/v/o) whose B weights are N(0, 0.01²) from ``seed``: a trained-looking adapter (B is 0 at init, which would
    make the first gradients trivial). The A weights come from torch's global generator, as peft draws them."""
    import torch
    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    )
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(seed)) * 0.01)
    return policy


def peak_rss_mb() -> float:
    """This process's peak RSS so far in MiB (``ru_maxrss``, a lifetime high-water mark)."""
    from pbrl.run.stage_record import peak_rss_mb as peak

    return round(peak(), 1)


def time_call(fn: Callable[[], Any]) -> float:
    """Wall time of one call of ``fn`` in seconds (``time.perf_counter``)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved(cases: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Time every case once as a warm-up (discarded), then ``repeats`` rounds of one call per case.

    The order of the cases rotates from round to round so that no case always runs first (first calls
    after another case can pay for cold caches). Returns each case's ``repeats`` times in seconds.
    """
    names = list(cases)
    for name in names:
        cases[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(time_call(cases[name]))
    return times


def summary(samples: Sequence[float]) -> dict[str, Any]:
    """Median, min, max and every sample (seconds, rounded to the microsecond)."""
    return {
        "median_s": round(statistics.median(samples), 6),
        "min_s": round(min(samples), 6),
        "max_s": round(max(samples), 6),
        "samples_s": [round(s, 6) for s in samples],
    }


def machine_facts() -> dict[str, Any]:
    """CPU model and its bfloat16 flags, what ``torch_dtype: auto`` resolves to here (the precision of a run that
    does not choose; a result compares only with one of the same CPU and precision), CPU count (logical and
    usable), torch threads and versions, Python, platform, UTC date."""
    import torch
    import transformers

    from pbrl.models.precision import BF16_CPU_FLAGS, CPU_BF16_ENV, cpu_flags, cpu_model, resolve_precision

    facts: dict[str, Any] = {
        "date_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_bf16_flags": sorted(cpu_flags().intersection(BF16_CPU_FLAGS)),
        "torch_dtype_auto": resolve_precision("auto", "auto", "cpu").torch_dtype,
    }
    if os.environ.get(CPU_BF16_ENV):
        facts[CPU_BF16_ENV] = os.environ[CPU_BF16_ENV]  # auto decided as on another kind of CPU
    if "prefect" in sys.modules:
        facts["prefect_version"] = sys.modules["prefect"].__version__
    try:
        facts["load_average_1m"] = round(os.getloadavg()[0], 2)
    except OSError:
        pass
    return facts


def result_path(bench: str, model: str) -> Path:
    """``benchmarks/results/<bench>-<model>.json`` (the model is part of the name so runs on both
    models sit side by side; a folder path is reduced to its last component)."""
    tag = Path(model).name or "model"
    return RESULTS_DIR / f"{bench}-{tag}.json"


def write_result(bench: str, model: str, result: dict[str, Any]) -> Path:
    """Write the JSON result (machine facts added) and return its path."""
    path = result_path(bench, model)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"benchmark": bench, "model": model, "machine": machine_facts(), "noise": NOISE_NOTE, **result}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(body, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def write_runs_result(bench: str, runs: Sequence[Path], tag: str, result: dict[str, Any]) -> Path:
    """:func:`write_result` for a script that reads kept run folders: named after the first run's agent model (and
    ``tag``), with the folders listed under ``runs``."""
    from pbrl.run.folder import open_job
    from pbrl.run.settings import policy_source

    model = Path(str(policy_source(open_job(runs[0])).models[0])).name + (f"-{tag}" if tag else "")
    return write_result(bench, model, {"runs": [str(r) for r in runs], **result})


def ratio(numerator: float, denominator: float) -> float:
    """``numerator / denominator`` rounded to 3 decimals (inf when the denominator is 0)."""
    return round(numerator / denominator, 3) if denominator else float("inf")


def check(name: str, value: Any, target: float | None, higher_is_better: bool = True) -> dict[str, Any]:
    """A ratio with its target and whether it was met (for the JSON and the summary table); a ratio
    without a target (``target=None``) is shown for information."""
    met = None
    if target is not None and value is not None:
        met = value >= target if higher_is_better else value <= target
    return {"name": name, "value": value, "target": target, "direction": ">=" if higher_is_better else "<=", "met": met}


def verdict_of(c: dict[str, Any]) -> str:
    """ "met", "MISSED"; "info" without a target; "met/missed (info only)" where the target does not apply
    to this model."""
    if c["target"] is None:
        return "info"
    if not c.get("applies", True):
        return "met (info only)" if c["met"] else "missed (info only)"
    return "met" if c["met"] else "MISSED"


def print_checks(bench: str, checks: Sequence[dict[str, Any]], path: Path) -> None:
    """One line per ratio: value, target, met or missed; then the result file."""
    for c in checks:
        verdict = verdict_of(c)
        target = "no target" if c["target"] is None else f"target {c['direction']} {c['target']}"
        print(f"[{bench}] {c['name']}: {c['value']} ({target}: {verdict})")
    print(f"[{bench}] result: {path}")
