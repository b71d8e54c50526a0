"""Benchmark: batched padded ``sequence_logprobs`` vs scoring one sequence at a time.

16 (prompt, completion) rows of mixed lengths: chat-template prompts of a few questions and completions
cut from a fixed English text at lengths spread from 1 to 64 tokens, EOS appended to most of them (the
shape of the rows MADPO scores). ``batched`` scores all rows in one padded forward pass; ``one_by_one``
calls ``sequence_logprobs`` once per row (no padding); ``sorted_micro`` (information only, not what
pbrl does) calls it on length-sorted groups of 4 rows, to size a possible change. All run under
``torch.inference_mode`` (the reference-log-prob use; a training step scores with gradients, which this
does not time). The values
must agree within 1e-5 nats: the max absolute difference is recorded, next to a float32 floor (the
longest row repeated 16 times, no padding, vs alone: a difference there is rounding from the other
matrix shapes, not a padding error). Target: batched >= 3x faster than one-by-one.

Shared-prompt case (issue #14): HumanEval prompts (``benchkit.humaneval_prompt_ids``), 2 completions each
(64 and 40 tokens, the winner and loser of a pair), on the model with a LoRA adapter (r=8 on q/k/v/o, the demo's
policy): ``padded`` is today's batched ``sequence_logprobs`` (every row runs its prompt), ``shared`` is
``shared_prompt_logprobs`` (each prompt once, its KV cache reused), both with gradients and a backward pass (the
training use, which update-policies runs). Target: shared >= 1.5x padded; values within 1e-5 nats, gradients
within 1e-4 relative. The same two without gradients are recorded for information.

MADPO-step case (information): a 2-agent ``madpo_agents_step`` on the same HumanEval prompts, one pair per
prompt, one pair per micro-batch (the demo's ``gradient_accumulation_steps: 2``), LoRA r=8 agents. ``two_phase``
(``concurrent=True``, what Ray actors run) computes every agent's detached margins first; ``in_process`` (the
default) lets agent 0's update forward give its margins and skips its detached forward. Each case trains its own
copy of the agents from the same start, so the copies must stay bitwise equal step after step (checked).

Run: ``.venv/bin/python benchmarks/scoring.py --model tiny-random``.
"""

from __future__ import annotations

import argparse
import random
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
    trained_lora,
    write_result,
)

from pbrl.generation.sampling import encode_prompt
from pbrl.learning.logprobs import sequence_logprobs, shared_prompt_logprobs
from pbrl.models.loading import load_model, load_tokenizer

TARGET_SPEEDUP = 3.0
TARGET_SHARED = 1.5
GRAD_TOLERANCE = 1e-4
TOLERANCE = 1e-5
MICRO_BATCH = 4
QUESTIONS = (
    "What is a river?",
    "Explain how trains run on time.",
    "Tell me about bees and gardens.",
    "Why do stars shine at night?",
)
TEXT = (
    "A river is a natural stream of water that flows across the land towards an ocean, a lake or another "
    "river. Rain and melting snow feed it, and over thousands of years it carves valleys, carries sand and "
    "stones downstream, and builds wide plains where farms and towns grow. People have always settled near "
    "rivers because they give water for drinking and crops, fish for food, and a road for boats. Bees visit "
    "the flowers on the banks, and at night the stars shine on the quiet water."
)


def make_rows(tokenizer: Any, count: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """``count`` prompts and completions of mixed lengths (completion lengths spread over 1..64)."""
    rng = random.Random(seed)
    text_ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    prompts = [encode_prompt(tokenizer, QUESTIONS[i % len(QUESTIONS)]) for i in range(count)]
    lengths = [1 + (63 * i) // max(count - 1, 1) for i in range(count)]  # 1 .. 64, evenly spread
    rng.shuffle(lengths)
    completions = []
    for i, n in enumerate(lengths):
        start = rng.randrange(0, max(len(text_ids) - n, 1))
        body = text_ids[start : start + n]
        completions.append(body[:-1] + [tokenizer.eos_token_id] if i % 4 else body)  # 3 of 4 end in EOS
    return prompts, completions


def float32_floor(
    model: Any, prompts: list[list[int]], completions: list[list[int]], pad: int, alone: torch.Tensor
) -> float:
    """Max |value in a batch - value alone| for the longest row repeated len(prompts) times: no padding
    at all, so any difference is float32 rounding from the other matrix shapes (the floor that padded
    batching cannot beat)."""
    i = max(range(len(prompts)), key=lambda r: len(prompts[r]) + len(completions[r]))
    with torch.inference_mode():
        dup = sequence_logprobs(
            model, [prompts[i]] * len(prompts), [completions[i]] * len(prompts), pad_token_id=pad
        )  # (b,)
    return float((dup - alone[i]).abs().max())


def shared_prompt_case(model: Any, tokenizer: Any, prompts_count: int, repeats: int) -> dict[str, Any]:
    """Time padded vs shared-prompt scoring with a backward pass on HumanEval prompts x 2 completions."""
    policy = trained_lora(model, seed=0)
    prompt_ids = humaneval_prompt_ids(tokenizer, prompts_count)
    text_ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    prompts = [p for p in prompt_ids for _ in range(2)]  # (winner, loser) of each prompt
    completions = [
        text_ids[k * 7 : k * 7 + (63 if side == 0 else 39)] + [tokenizer.eos_token_id]
        for k in range(len(prompt_ids))
        for side in range(2)
    ]
    pad = tokenizer.pad_token_id
    params = [p for p in policy.parameters() if p.requires_grad]
    values: dict[str, torch.Tensor] = {}
    grads: dict[str, list[torch.Tensor]] = {}

    def with_grad(name: str, fn: Any) -> Any:
        def call() -> None:
            out = fn(policy, prompts, completions, pad_token_id=pad)  # (b,)
            grads[name] = list(torch.autograd.grad(out.sum(), params))
            values[name] = out.detach()

        return call

    def no_grad(name: str, fn: Any) -> Any:
        def call() -> None:
            with torch.inference_mode():
                values[name] = fn(policy, prompts, completions, pad_token_id=pad)

        return call

    times = interleaved(
        {
            "padded_grad": with_grad("padded_grad", sequence_logprobs),
            "shared_grad": with_grad("shared_grad", shared_prompt_logprobs),
            "padded_inference": no_grad("padded_inference", sequence_logprobs),
            "shared_inference": no_grad("shared_inference", shared_prompt_logprobs),
        },
        repeats,
    )
    out = {name: summary(t) for name, t in times.items()}
    grad_rel = max(
        float((a - b).norm() / b.norm().clamp(min=1e-30))
        for a, b in zip(grads["shared_grad"], grads["padded_grad"], strict=True)
    )
    policy.unload()  # the base model back without the adapter
    return {
        "workload": {
            "prompts": len(prompt_ids),
            "completions_per_prompt": 2,
            "prompt_tokens": [len(p) for p in prompt_ids],
            "completion_tokens": [len(c) for c in completions],
            "adapter": "LoRA r=8 q/k/v/o",
            "grad": "autograd.grad of the summed log-probs w.r.t. the adapter",
        },
        "cases": out,
        "speedup_grad": ratio(out["padded_grad"]["median_s"], out["shared_grad"]["median_s"]),
        "speedup_inference": ratio(out["padded_inference"]["median_s"], out["shared_inference"]["median_s"]),
        "max_abs_diff": float((values["shared_grad"] - values["padded_grad"]).abs().max()),
        "max_grad_rel_diff": grad_rel,
    }


def madpo_step_case(model: Any, tokenizer: Any, prompts_count: int, repeats: int) -> dict[str, Any]:
    """Time a 2-agent MADPO step with and without agent 0's detached forward (see the module docstring)."""
    import copy

    from pbrl.learning.madpo import LocalAgent, PairBatch, madpo_agents_step
    from pbrl.models.policies import TrainablePolicy, trainable_parameters

    prompts = humaneval_prompt_ids(tokenizer, prompts_count)
    text_ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    winners = [text_ids[k * 7 : k * 7 + 47] + [tokenizer.eos_token_id] for k in range(len(prompts))]
    losers = [text_ids[k * 5 + 3 : k * 5 + 30] + [tokenizer.eos_token_id] for k in range(len(prompts))]
    batch = PairBatch(prompt_ids=[prompts] * 2, winner_ids=[winners, losers], loser_ids=[losers, winners])
    start = [trained_lora(copy.deepcopy(model), seed=agent) for agent in range(2)]
    agents = {}
    for case in ("two_phase", "in_process"):
        models = [copy.deepcopy(m) for m in start]
        agents[case] = [
            LocalAgent(
                TrainablePolicy(
                    m,
                    torch.optim.AdamW(trainable_parameters(m), lr=5e-4, weight_decay=0.0),
                    pad_token_id=tokenizer.pad_token_id,
                )
            )
            for m in models
        ]
    del start
    stats: dict[str, list[Any]] = {"two_phase": [], "in_process": []}

    def step(case: str) -> Any:
        def call() -> None:
            stats[case].append(
                madpo_agents_step(
                    agents[case], batch, beta=0.1, max_grad_norm=1.0, micro_batch_size=1, concurrent=case == "two_phase"
                )
            )

        return call

    times = interleaved({case: step(case) for case in stats}, repeats)
    out = {name: summary(t) for name, t in times.items()}
    same_steps = all(
        a.loss == b.loss and torch.equal(a.margins, b.margins)
        for a, b in zip(stats["two_phase"], stats["in_process"], strict=True)
    )
    same_weights = all(
        torch.equal(p, q)
        for a, b in zip(agents["two_phase"], agents["in_process"], strict=True)
        for p, q in zip(trainable_parameters(a.policy.model), trainable_parameters(b.policy.model), strict=True)
    )
    return {
        "workload": {
            "agents": 2,
            "pairs": len(prompts),
            "micro_batch_pairs": 1,
            "prompt_tokens": [len(p) for p in prompts],
            "winner_tokens": [len(w) for w in winners],
            "loser_tokens": [len(x) for x in losers],
            "adapter": "LoRA r=8 q/k/v/o",
            "optimizer": "AdamW",
        },
        "cases": out,
        "steps_per_case": len(stats["in_process"]),
        "speedup": ratio(out["two_phase"]["median_s"], out["in_process"]["median_s"]),
        "bitwise_same_steps_and_weights": same_steps and same_weights,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-random", help="packaged alias or model folder")
    args = parser.parse_args()
    size = sizes_for(args.model)
    model = load_model(args.model)
    tokenizer = load_tokenizer(args.model)
    prompts, completions = make_rows(tokenizer, size.score_sequences)
    pad = tokenizer.pad_token_id
    values: dict[str, torch.Tensor] = {}

    def batched() -> None:
        with torch.inference_mode():
            values["batched"] = sequence_logprobs(model, prompts, completions, pad_token_id=pad)  # (b,)

    def one_by_one() -> None:
        with torch.inference_mode():
            values["one_by_one"] = torch.cat(
                [
                    sequence_logprobs(model, [p], [c], pad_token_id=pad)
                    for p, c in zip(prompts, completions, strict=False)
                ]
            )  # (b,)

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]) + len(completions[i]))

    def sorted_micro() -> None:
        # Not what pbrl does today: the same function on length-sorted groups of MICRO_BATCH rows
        # (less padding), recorded to size a possible change.
        got = torch.empty(len(prompts), dtype=torch.float64)
        with torch.inference_mode():
            for start in range(0, len(order), MICRO_BATCH):
                idx = order[start : start + MICRO_BATCH]
                got[idx] = sequence_logprobs(
                    model, [prompts[i] for i in idx], [completions[i] for i in idx], pad_token_id=pad
                )
        values["sorted_micro"] = got

    times = interleaved(
        {"batched": batched, "one_by_one": one_by_one, "sorted_micro": sorted_micro}, size.score_repeats
    )
    out = {name: summary(t) for name, t in times.items()}
    speedup = ratio(out["one_by_one"]["median_s"], out["batched"]["median_s"])
    diff = (values["batched"] - values["one_by_one"]).abs()
    max_diff = float(diff.max())
    floor = float32_floor(model, prompts, completions, pad, values["one_by_one"])
    checks = [
        check("scoring: batched speed-up over one-by-one", speedup, TARGET_SPEEDUP),
        check("scoring: max |batched - one-by-one| (nats)", max_diff, TOLERANCE, higher_is_better=False),
        check("scoring: float32 floor, unpadded duplicates (nats)", floor, None),
        check(
            f"scoring: sorted micro-batches of {MICRO_BATCH} speed-up over one-by-one",
            ratio(out["one_by_one"]["median_s"], out["sorted_micro"]["median_s"]),
            None,
        ),
    ]
    shared = shared_prompt_case(model, tokenizer, size.shared_prompts, size.shared_repeats)
    checks += [
        check(
            "scoring: shared-prompt speed-up over padded batch (with backward)", shared["speedup_grad"], TARGET_SHARED
        ),
        check("scoring: shared-prompt speed-up over padded batch (inference)", shared["speedup_inference"], None),
        check("scoring: max |shared - padded| (nats)", shared["max_abs_diff"], TOLERANCE, higher_is_better=False),
        check(
            "scoring: max relative gradient difference, shared vs padded",
            shared["max_grad_rel_diff"],
            GRAD_TOLERANCE,
            higher_is_better=False,
        ),
    ]
    step = madpo_step_case(model, tokenizer, size.shared_prompts, size.shared_repeats)
    checks += [
        check(
            "scoring: 2-agent MADPO step, in process over two-phase (agent 0's detached forward saved)",
            step["speedup"],
            None,
        ),
        check(
            "scoring: in-process and two-phase steps bitwise equal (1 = yes)",
            int(step["bitwise_same_steps_and_weights"]),
            1,
        ),
    ]
    tokens = [len(p) + len(c) for p, c in zip(prompts, completions, strict=False)]
    path = write_result(
        "scoring",
        args.model,
        {
            "workload": {
                "sequences": len(prompts),
                "prompt_tokens": [len(p) for p in prompts],
                "completion_tokens": [len(c) for c in completions],
                "total_tokens": sum(tokens),
                "padded_tokens": len(tokens) * max(tokens),
                "padding_side": "left",
                "grad": "off (torch.inference_mode)",
                "dtype": "float32",
            },
            "repeats": size.score_repeats,
            "warmup_calls": 1,
            "timer": "time.perf_counter, median of repeats",
            "cases": out,
            "speedup": speedup,
            "values": {
                "batched": values["batched"].tolist(),
                "one_by_one": values["one_by_one"].tolist(),
                "abs_diff": diff.tolist(),
                "max_abs_diff": max_diff,
                "tolerance": TOLERANCE,
                "max_rel_diff": float((diff / values["one_by_one"].abs().clamp(min=1e-12)).max()),
                "float32_floor_unpadded_duplicates": floor,
                "sorted_micro_max_abs_diff": float((values["sorted_micro"] - values["one_by_one"]).abs().max()),
            },
            "shared_prompt": shared,
            "madpo_step": step,
            "checks": checks,
        },
    )
    print(
        f"[scoring] shared-prompt {shared['cases']['shared_grad']['median_s']:.4f} s vs padded "
        f"{shared['cases']['padded_grad']['median_s']:.4f} s with backward: {shared['speedup_grad']}x"
    )
    print(
        f"[scoring] batched {out['batched']['median_s']:.4f} s, "
        f"one-by-one {out['one_by_one']['median_s']:.4f} s, "
        f"speed-up {speedup}x, max |diff| {max_diff:.3g}"
    )
    print_checks("scoring", checks, path)


if __name__ == "__main__":
    main()
