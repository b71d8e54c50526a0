"""Benchmark: pbrl's seeded batched sampling vs one raw ``model.generate`` call, and vs item by item.

Three ways to sample the same P prompts x K candidates with the same sampling settings and the same
``max_new_tokens``:

- ``ours``: ``pbrl.generation.sampling.generate`` (what the sample-candidates stage calls) on all P x K rows in
  one left-padded batch; every row draws from its own counter-based stream through a logits processor.
- ``raw_batched``: one ``model.generate(do_sample=True)`` call on the same left-padded batch (the same
  rows, the same temperature / top-p / top-k, the same neutral generation settings), under
  ``torch.inference_mode`` like ours. The target is ours >= 0.9x its throughput.
- ``raw_per_item``: the reference library's way: one ``generate`` call per prompt (no padding) with
  ``num_return_sequences=K``.
- ``raw_batched_forced``: ``raw_batched`` with ``min_new_tokens=max_new_tokens`` (EOS suppressed), so
  that every row runs all ``max_new_tokens`` decode steps.

All of them stop a row at EOS and keep decoding the batch until every row stops (or reaches
``max_new_tokens``); a batch's cost is set by the number of decode steps the loop runs, not by the
tokens its rows keep. The sampled tokens differ between ours and raw (different random streams), so
the rows can stop at different lengths. The headline ratio therefore compares time per decode step
per row ("row-steps" = rows x decode steps of each call); the plain tokens-per-second ratio (tokens
kept up to and including EOS) and, when ours ran every step, the equal-work time ratio against
``raw_batched_forced`` are recorded beside it.

Shared-prompt sampling (issue #14): HumanEval prompts (``benchkit.humaneval_prompt_ids``) x 6 rows each (the
demo's 3 target + 3 comparator candidates of one agent and item, same weights), all in one chunk:
``shared`` is ``generate`` as the stage calls it (each distinct prompt prefilled once, its KV cache expanded to
its rows), ``unshared`` is ``generate(..., batching=Batching(share_prompts=False))`` (every row prefills its
prompt). Same seeds, so the same tokens are expected (the share of rows whose tokens agree is recorded). Target:
shared >= 1.3x.

Run: ``.venv/bin/python benchmarks/generation.py --model tiny-random``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from benchkit import (
    check,
    humaneval_prompt_ids,
    interleaved,
    print_checks,
    ratio,
    sizes_for,
    summary,
    write_result,
)
from transformers import GenerationConfig

from pbrl.data.seeds import derive_seed
from pbrl.generation.sampling import Batching, SamplingSettings, encode_prompt, generate
from pbrl.models.loading import load_model, load_tokenizer

TEMPERATURE, TOP_P, TOP_K = 0.7, 0.9, 50
TARGET_VS_RAW = 0.9
TARGET_SHARED = 1.3
PROMPTS = (
    "Write a short poem about rivers.",
    "Explain what a CPU does in one sentence.",
    "Give me three tips for staying healthy.",
    "What is the capital of France?",
    "Describe a train journey through the mountains.",
    "Why is the sky blue?",
    "Write a Python function that adds two numbers.",
    "Summarise the plot of a detective story in two sentences.",
)


@dataclass(frozen=True)
class Work:
    """What one call produced: rows, tokens kept (through EOS), decode steps run, row-steps."""

    rows: int
    tokens: int
    steps: int
    row_steps: int


def left_pad(rows: Sequence[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, t) ids and attention mask with every row right-aligned (the same layout ours builds)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row) :] = 1
    return ids, mask


def kept_tokens(new_tokens: torch.Tensor, eos_id: int) -> int:
    """Tokens of a (b, n) block of generated ids up to and including each row's first EOS."""
    total = 0
    for row in new_tokens.tolist():
        total += row.index(eos_id) + 1 if eos_id in row else len(row)
    return total


def raw_config(
    max_new_tokens: int, pad_id: int, eos_id: int, *, sequences: int = 1, forced: bool = False
) -> GenerationConfig:
    """Sampling with the benchmark's settings; every other processor-adding field neutral, as ours sets
    them (so the raw call does no extra work that ours skips)."""
    return GenerationConfig(
        do_sample=True,
        temperature=TEMPERATURE,
        top_p=TOP_P,
        top_k=TOP_K,
        num_beams=1,
        num_return_sequences=sequences,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens if forced else 0,
        repetition_penalty=1.0,
        encoder_repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        encoder_no_repeat_ngram_size=0,
        remove_invalid_values=False,
        renormalize_logits=False,
        guidance_scale=1.0,
        use_cache=True,
        output_scores=False,
        return_dict_in_generate=False,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
    )


def make_cases(
    model: Any, tokenizer: Any, prompt_ids: list[list[int]], k: int, new_tokens: int
) -> tuple[dict[str, Callable[[], Work]], dict[str, Work]]:
    """The four callables (each returns its Work) and a dict they record their last Work into."""
    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    rows = [p for p in prompt_ids for _ in range(k)]  # (P*K) rows, each prompt K times
    seeds = [
        derive_seed(0, round_index=1, stage="bench", item=i, index=c) for i in range(len(prompt_ids)) for c in range(k)
    ]
    ids, mask = left_pad(rows, pad_id)  # (b, t)
    last: dict[str, Work] = {}

    def ours() -> Work:
        settings = SamplingSettings(
            max_new_tokens=new_tokens, temperature=TEMPERATURE, top_p=TOP_P, top_k=TOP_K, batch_size=len(rows)
        )
        gens = generate(model, tokenizer, rows, seeds, settings)
        steps = max(len(g.completion_ids) for g in gens)
        last["ours"] = Work(len(rows), sum(len(g.completion_ids) for g in gens), steps, len(rows) * steps)
        return last["ours"]

    def raw(name: str, forced: bool) -> Callable[[], Work]:
        config = raw_config(new_tokens, pad_id, eos_id, forced=forced)

        def call() -> Work:
            torch.manual_seed(0)  # raw generate draws from the global generator
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)  # (b, t+n)
            new = out[:, ids.shape[1] :]
            last[name] = Work(len(rows), kept_tokens(new, eos_id), new.shape[1], len(rows) * new.shape[1])
            return last[name]

        return call

    def per_item() -> Work:
        config = raw_config(new_tokens, pad_id, eos_id, sequences=k)
        torch.manual_seed(0)
        tokens = steps = row_steps = 0
        with torch.inference_mode():
            for prompt in prompt_ids:
                one = torch.tensor([prompt], dtype=torch.long)  # (1, t), nothing to pad
                out = model.generate(
                    input_ids=one, attention_mask=torch.ones_like(one), generation_config=config
                )  # (K, t+n)
                new = out[:, one.shape[1] :]
                tokens += kept_tokens(new, eos_id)
                steps += new.shape[1]
                row_steps += k * new.shape[1]
        last["raw_per_item"] = Work(len(rows), tokens, steps, row_steps)
        return last["raw_per_item"]

    cases = {
        "ours": ours,
        "raw_batched": raw("raw_batched", False),
        "raw_batched_forced": raw("raw_batched_forced", True),
        "raw_per_item": per_item,
    }
    return cases, last


def rates(work: Work, seconds: float) -> dict[str, Any]:
    """The Work with tokens per second, row-steps per second and milliseconds per row-step."""
    return {
        **work.__dict__,
        "tokens_per_s": round(work.tokens / seconds, 2),
        "row_steps_per_s": round(work.row_steps / seconds, 2),
        "ms_per_row_step": round(1e3 * seconds / work.row_steps, 4),
    }


def shared_prompt_case(
    model: Any, tokenizer: Any, prompts: int, rows_per_prompt: int, new_tokens: int, repeats: int
) -> dict[str, Any]:
    """Time ``generate`` with and without shared prefills on HumanEval prompts x ``rows_per_prompt``."""
    prompt_ids = humaneval_prompt_ids(tokenizer, prompts)
    rows = [p for p in prompt_ids for _ in range(rows_per_prompt)]
    seeds = [
        derive_seed(0, round_index=1, stage="bench-shared", item=i, index=c)
        for i in range(len(prompt_ids))
        for c in range(rows_per_prompt)
    ]
    settings = SamplingSettings(
        max_new_tokens=new_tokens, temperature=TEMPERATURE, top_p=TOP_P, top_k=TOP_K, batch_size=len(rows)
    )
    got: dict[str, list[list[int]]] = {}

    def case(name: str, share: bool) -> Callable[[], None]:
        def call() -> None:
            got[name] = [
                g.completion_ids
                for g in generate(model, tokenizer, rows, seeds, settings, batching=Batching(share_prompts=share))
            ]

        return call

    times = interleaved({"shared": case("shared", True), "unshared": case("unshared", False)}, repeats)
    out = {name: summary(t) for name, t in times.items()}
    same = sum(a == b for a, b in zip(got["shared"], got["unshared"], strict=True))
    return {
        "workload": {
            "prompts": len(prompt_ids),
            "rows_per_prompt": rows_per_prompt,
            "rows": len(rows),
            "prompt_tokens": [len(p) for p in prompt_ids],
            "max_new_tokens": new_tokens,
        },
        "cases": out,
        "speedup": ratio(out["unshared"]["median_s"], out["shared"]["median_s"]),
        "rows_with_same_tokens": same,
        "rows_total": len(rows),
        "tokens": {"shared": sum(map(len, got["shared"])), "unshared": sum(map(len, got["unshared"]))},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-random", help="packaged alias or model folder")
    args = parser.parse_args()
    size = sizes_for(args.model)
    model = load_model(args.model)  # eval mode, no grad, float32
    tokenizer = load_tokenizer(args.model)
    prompt_ids = [encode_prompt(tokenizer, p) for p in PROMPTS[: size.gen_prompts]]
    cases, last = make_cases(model, tokenizer, prompt_ids, size.gen_candidates, size.gen_new_tokens)
    times = interleaved(cases, size.gen_repeats)
    med = {name: summary(t)["median_s"] for name, t in times.items()}
    out = {name: {**summary(times[name]), **rates(last[name], med[name])} for name in cases}

    ours, raw, forced, item = (out[n] for n in ("ours", "raw_batched", "raw_batched_forced", "raw_per_item"))
    equal_work = ours["steps"] == size.gen_new_tokens  # ours ran every step, as the forced raw call does
    ratios = {
        "ours_vs_raw_per_row_step": ratio(ours["row_steps_per_s"], raw["row_steps_per_s"]),
        "ours_vs_raw_tokens_per_s": ratio(ours["tokens_per_s"], raw["tokens_per_s"]),
        "ours_vs_raw_forced_equal_work": ratio(forced["median_s"], ours["median_s"]) if equal_work else None,
        "ours_vs_per_item_per_row_step": ratio(ours["row_steps_per_s"], item["row_steps_per_s"]),
        "ours_vs_per_item_tokens_per_s": ratio(ours["tokens_per_s"], item["tokens_per_s"]),
    }
    checks = [
        check("generation: ours / raw generate (per row-step)", ratios["ours_vs_raw_per_row_step"], TARGET_VS_RAW),
        check("generation: ours / raw generate (tokens/s)", ratios["ours_vs_raw_tokens_per_s"], None),
        check(
            "generation: ours / raw forced to max length (equal work)", ratios["ours_vs_raw_forced_equal_work"], None
        ),
        check("generation: ours / per-item generate (per row-step)", ratios["ours_vs_per_item_per_row_step"], None),
    ]
    shared = shared_prompt_case(
        model, tokenizer, size.shared_prompts, size.shared_rows, size.gen_new_tokens, size.shared_repeats
    )
    checks += [
        check(
            f"generation: shared-prompt prefill / unshared ({size.shared_rows} rows per prompt)",
            shared["speedup"],
            TARGET_SHARED,
        ),
        check(
            "generation: shared-prompt rows with the same tokens as unshared (share)",
            round(shared["rows_with_same_tokens"] / shared["rows_total"], 4),
            None,
        ),
    ]
    path = write_result(
        "generation",
        args.model,
        {
            "workload": {
                "prompts": len(prompt_ids),
                "candidates_per_prompt": size.gen_candidates,
                "rows": len(prompt_ids) * size.gen_candidates,
                "max_new_tokens": size.gen_new_tokens,
                "prompt_tokens": [len(p) for p in prompt_ids],
                "temperature": TEMPERATURE,
                "top_p": TOP_P,
                "top_k": TOP_K,
                "dtype": "float32",
            },
            "repeats": size.gen_repeats,
            "warmup_calls": 1,
            "timer": "time.perf_counter, median of repeats",
            "cases": out,
            "ratios": ratios,
            "shared_prompt": shared,
            "checks": checks,
            "method": (
                "All cases stop a row at EOS (ours: pbrl.generation.sampling.generate cuts each row after its first "
                "EOS; raw generate marks it finished and pads) and keep decoding until every row of the call "
                "is done. The headline ratio is throughput in row-steps per second (rows x decode steps the "
                "call ran; for raw_per_item summed over its calls), i.e. time per decode step per row: fair "
                "when ours and raw stop at different lengths, because the sampled tokens come from different "
                "random streams. tokens_per_s counts kept tokens through EOS. ours_vs_raw_forced_equal_work "
                "compares wall time with raw forced to run all max_new_tokens steps "
                "(min_new_tokens=max_new_tokens); it is given only when ours also ran all steps (equal work), "
                "and the forced raw call carries one extra logits processor (EOS suppression)."
            ),
        },
    )
    for name, row in out.items():
        print(
            f"[generation] {name:20s} {row['median_s']:.4f} s/call  {row['tokens_per_s']:9.1f} tok/s  "
            f"{row['ms_per_row_step']:.4f} ms/row-step  steps={row['steps']}"
        )
    print(f"[generation] ratios: {ratios}")
    print_checks("generation", checks, path)


if __name__ == "__main__":
    main()
