"""Benchmark: one agent trained with MADPO (pbrl) and with TRL's ``DPOTrainer`` on the same pairs, side by side.

MADPO with one agent is reference-free DPO: the loss of a pair is −log σ(β Δ) with Δ = log π(a^w|h) − log π(a^l|h)
(docs/design/algorithms.md#madpo with no other agents). TRL 1.16 has no ``reference_free`` switch, so its reference
log-probs are made
exactly 0: ``precompute_ref_log_probs=True`` with the precompute pass replaced by zero columns (no reference
forward is run or timed). Both sides get the same pairs as the same token ids (TRL's tokenization is skipped: the
dataset holds ``prompt_ids`` / ``chosen_ids`` / ``rejected_ids``), in the same order (no shuffling: TRL's sampler is
sequential, pairs of one item adjacent, as update-policies batches them), the same batch size, β, AdamW (lr
constant, no weight decay, no warm-up), gradient clipping at 1.0, float32, no activation checkpointing, and the same
initial LoRA adapter (r=8 on q/k/v/o, dropout 0).

``--torch-dtype bfloat16`` runs both sides in the same lower precision (issue #33): the frozen base in bfloat16
under float32 LoRA adapters (peft keeps adapters float32), what ``torch_dtype: auto`` picks for training where the
device computes bfloat16, with no autocast on either side. The two sides then round differently (MADPO computes each
shared prompt once, TRL each sequence whole), so their losses are compared for information only; the result is
``peer_trl-bfloat16-<model>.json``.

Recorded: each step's loss on both sides (they must agree within 1e-5: the same function of the same parameters),
and pairs per second over the whole training (MADPO ``madpo_agents_step`` loop vs ``trainer.train()``), as a ratio
measured in one run (target >= 1.0x; MADPO scores each shared prompt once). TRL is a benchmark-only extra
(``pip install -e '.[bench]'``).

Run: ``.venv/bin/python benchmarks/peer_trl.py --model tiny-random``.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from typing import Any

import torch
from benchkit import check, humaneval_prompt_ids, print_checks, ratio, sizes_for, trained_lora, write_result

from pbrl.learning.madpo import LocalAgent, PairBatch, madpo_agents_step
from pbrl.models.loading import load_model, load_tokenizer
from pbrl.models.policies import TrainablePolicy, trainable_parameters

BETA = 0.1
LEARNING_RATE = 5e-4
BATCH_SIZE = 2
LOSS_TOLERANCE = 1e-5
TARGET_SPEED = 1.0
TEXT = (
    "The function walks over the list once and keeps a running total. It returns the total when the list ends, "
    "or zero for an empty list. Each element must be a number; strings raise a TypeError. The docstring shows "
    "two examples and the edge cases the tests check, including negative numbers and very long inputs."
)


def make_pairs(tokenizer: Any, count: int) -> list[dict[str, list[int]]]:
    """``count`` pairs, two per HumanEval prompt: winner and loser completions of 10..64 tokens ending in EOS."""
    prompts = humaneval_prompt_ids(tokenizer, (count + 1) // 2)
    text = tokenizer(TEXT, add_special_tokens=False).input_ids
    pairs = []
    for n in range(count):
        a, b = 10 + (17 * n) % 54, 10 + (29 * n + 11) % 54  # lengths in 10..63
        pairs.append(
            {
                "prompt_ids": prompts[n // 2],
                "chosen_ids": text[n % 5 : n % 5 + a] + [tokenizer.eos_token_id],
                "rejected_ids": text[(n + 3) % 7 : (n + 3) % 7 + b] + [tokenizer.eos_token_id],
            }
        )
    return pairs


def run_madpo(policy: Any, pad: int, pairs: list[dict[str, list[int]]], epochs: int) -> tuple[list[float], float]:
    """Per-step losses and wall seconds of the MADPO loop (one agent)."""
    optimizer = torch.optim.AdamW(trainable_parameters(policy), lr=LEARNING_RATE, weight_decay=0.0)
    agent = TrainablePolicy(policy, optimizer, pad_token_id=pad)
    losses = []
    start = time.perf_counter()
    for _ in range(epochs):
        for begin in range(0, len(pairs), BATCH_SIZE):
            chunk = pairs[begin : begin + BATCH_SIZE]
            batch = PairBatch(
                [[p["prompt_ids"] for p in chunk]],
                [[p["chosen_ids"] for p in chunk]],
                [[p["rejected_ids"] for p in chunk]],
            )
            losses.append(madpo_agents_step([LocalAgent(agent)], batch, beta=BETA, max_grad_norm=1.0).loss)
    return losses, time.perf_counter() - start


def run_trl(
    policy: Any, tokenizer: Any, pairs: list[dict[str, list[int]]], epochs: int
) -> tuple[list[float], float, float]:
    """Per-step losses, wall seconds of ``DPOTrainer.train()`` with zero reference log-probs, and TRL's own
    ``train_runtime`` (its training loop without the set-up inside ``train``)."""
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from trl import DPOConfig, DPOTrainer

    class ReferenceFreeDPOTrainer(DPOTrainer):
        """DPOTrainer with reference log-probs 0 (reference-free), pre-tokenized pairs and a fixed order."""

        losses: list[float] = []

        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):  # noqa: ANN001, ANN202
            return dataset  # already token ids, EOS included: nothing to tokenize, nothing to add

        def _precompute_ref_logps(self, dataset, name, batch_size):  # noqa: ANN001, ANN202
            zeros = [0.0] * len(dataset)
            return dataset.add_column("ref_chosen_logps", zeros).add_column("ref_rejected_logps", zeros)

        def _get_train_sampler(self, train_dataset=None):  # noqa: ANN001, ANN202
            return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # noqa: ANN001, ANN202
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            self.losses.append(float((loss[0] if return_outputs else loss).detach()))
            return loss

    with tempfile.TemporaryDirectory() as out:
        args = DPOConfig(
            output_dir=out,
            per_device_train_batch_size=BATCH_SIZE,
            num_train_epochs=epochs,
            learning_rate=LEARNING_RATE,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            max_grad_norm=1.0,
            beta=BETA,
            loss_type=["sigmoid"],
            precompute_ref_log_probs=True,
            max_length=None,
            use_cpu=True,
            bf16=False,
            gradient_checkpointing=False,
            report_to=[],
            save_strategy="no",
            logging_steps=1,
            seed=0,
            dataloader_num_workers=0,
            optim="adamw_torch",
            disable_tqdm=True,
        )
        trainer = ReferenceFreeDPOTrainer(
            model=policy, args=args, processing_class=tokenizer, train_dataset=Dataset.from_list(pairs)
        )
        trainer.losses = []
        start = time.perf_counter()
        output = trainer.train()
        seconds = time.perf_counter() - start
    return trainer.losses, seconds, float(output.metrics["train_runtime"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-random", help="packaged alias or model folder")
    parser.add_argument("--torch-dtype", default="float32", choices=["float32", "bfloat16"], help="frozen base dtype")
    parser.add_argument(
        "--result", default=None, help="result name (default peer_trl, or peer_trl-<dtype>; one per machine kind)"
    )
    args = parser.parse_args()
    size = sizes_for(args.model)
    tokenizer = load_tokenizer(args.model)
    base = load_model(args.model, dtype=args.torch_dtype)
    for p in base.parameters():
        p.requires_grad_(False)
    base.train()
    torch.manual_seed(0)
    initial = trained_lora(base, seed=1)  # a non-zero adapter, so the first steps already move the margins
    pairs = make_pairs(tokenizer, size.peer_pairs)
    pad = tokenizer.pad_token_id
    # Warm-up (discarded): the first training steps of a process are slow (page faults, allocator, thread pools;
    # up to 10x on the shared VM), and whichever side ran first would pay for them.
    run_madpo(copy.deepcopy(initial), pad, pairs[:BATCH_SIZE], 1)
    madpo_losses, madpo_s = run_madpo(copy.deepcopy(initial), pad, pairs, size.peer_epochs)
    trl_losses, trl_s, trl_runtime = run_trl(copy.deepcopy(initial), tokenizer, pairs, size.peer_epochs)
    steps = min(len(madpo_losses), len(trl_losses))
    diffs = [abs(a - b) for a, b in zip(madpo_losses[:steps], trl_losses[:steps], strict=True)]
    trained = len(pairs) * size.peer_epochs
    speed = ratio(trained / madpo_s, trained / trl_s)
    float32 = args.torch_dtype == "float32"  # in bfloat16 the two sides' rounding differs: the losses are information
    checks = [
        check(
            "peer: max |MADPO loss - TRL DPO loss| per step (nats)",
            max(diffs),
            LOSS_TOLERANCE if float32 else None,
            higher_is_better=False,
        ),
        check("peer: MADPO / TRL DPOTrainer pairs per second", speed, TARGET_SPEED),
    ]
    path = write_result(
        args.result or ("peer_trl" if float32 else f"peer_trl-{args.torch_dtype}"),
        args.model,
        {
            "workload": {
                "torch_dtype": args.torch_dtype,
                "adapter_dtype": str(next(p.dtype for n, p in initial.named_parameters() if "lora_" in n)),
                "pairs": len(pairs),
                "epochs": size.peer_epochs,
                "batch_size": BATCH_SIZE,
                "beta": BETA,
                "learning_rate": LEARNING_RATE,
                "adapter": "LoRA r=8 alpha 16 q/k/v/o, dropout 0",
                "prompt_tokens": [len(p["prompt_ids"]) for p in pairs],
                "completion_tokens": [[len(p["chosen_ids"]), len(p["rejected_ids"])] for p in pairs],
            },
            "steps": {"madpo": len(madpo_losses), "trl": len(trl_losses)},
            "losses": {"madpo": madpo_losses, "trl": trl_losses, "abs_diff": diffs},
            "seconds": {"madpo": round(madpo_s, 3), "trl": round(trl_s, 3), "trl_train_runtime": round(trl_runtime, 3)},
            "speed_ratio_vs_trl_train_runtime": ratio(trl_runtime, madpo_s),
            "pairs_per_s": {"madpo": round(trained / madpo_s, 3), "trl": round(trained / trl_s, 3)},
            "speed_ratio": speed,
            "method": "One warm-up MADPO step (discarded), then one run of each, MADPO first (not interleaved: each "
            "trains its own copy from the same start); "
            "TRL's time includes its Trainer loop overhead, MADPO's the madpo_agents_step loop.",
            "checks": checks,
        },
    )
    print(
        f"[peer_trl] MADPO {madpo_s:.2f} s, TRL {trl_s:.2f} s for {trained} pairs: {speed}x; "
        f"steps {len(madpo_losses)}/{len(trl_losses)}, max |loss diff| {max(diffs):.3g}"
    )
    print_checks("peer_trl", checks, path)


if __name__ == "__main__":
    main()
