"""Shared-prompt scoring and sampling (issue #14): each distinct prompt runs once, the values do not change.

Scoring: :func:`pbrl.learning.logprobs.shared_prompt_logprobs` equals an unpadded forward per row (log-probs within
1e-5 nats) and :func:`pbrl.learning.logprobs.sequence_logprobs` (gradients within 1e-4 relative), with and without LoRA.
MADPO's step on top of it equals a step computed by hand from per-row scores. Sampling: ``generate`` with
shared prefills gives the same tokens as without, and prefills each distinct prompt once.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from pbrl.generation.sampling import Batching, SamplingSettings, generate, prompt_grouped_order
from pbrl.learning.logprobs import (
    completion_token_logprobs,
    sequence_logprobs,
    shared_prompt_logprobs,
    shared_prompt_token_logprobs,
    token_logprobs,
)
from pbrl.learning.losses import madpo_agent_loss
from pbrl.learning.madpo import PairBatch
from pbrl.models.forward import distinct_prompts
from pbrl.models.loading import init_lora_adapter, load_policy
from pbrl.models.lora import LoraSettings
from pbrl.models.policies import TrainablePolicy, trainable_parameters
from stages.update_policies import item_grouped_order
from tests.helpers import madpo_step

PAD, EOS, VOCAB = 0, 3, 320
ATOL = 1e-5
GRAD_RTOL = 1e-4


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> LlamaForCausalLM:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def _ids(rng: random.Random, low: int, high: int) -> list[int]:
    return [rng.randrange(4, VOCAB) for _ in range(rng.randint(low, high))]


def _rows(seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """3 prompts (one of a single token), 9 rows: each prompt continued by 3 completions, one empty, one of 1."""
    rng = random.Random(seed)
    prompts = [_ids(rng, 5, 12), [rng.randrange(4, VOCAB)], _ids(rng, 2, 6)]
    rows_p, rows_c = [], []
    for k in range(3):
        for prompt in prompts:
            rows_p.append(prompt)
            rows_c.append([] if (k, len(prompt)) == (0, 1) else _ids(rng, 1, 1 if k == 1 else 9) + [EOS])
    return rows_p, rows_c


def _alone(model: LlamaForCausalLM, prompt: list[int], completion: list[int]) -> float:
    """One unpadded, uncached forward of the row; log_softmax at each position predicting a completion token."""
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([prompt + completion])).logits[0].double(), -1)  # (t, v)
    return sum(float(logprobs[len(prompt) - 1 + j, token]) for j, token in enumerate(completion))


def test_distinct_prompts_in_first_seen_order() -> None:
    assert distinct_prompts([[5, 6], [7], [5, 6], [7], [8]]) == ([[5, 6], [7], [8]], [0, 1, 0, 1, 2])


def test_shared_prompt_logprobs_equal_each_row_scored_alone(model: LlamaForCausalLM) -> None:
    prompts, completions = _rows()
    with torch.no_grad():
        got = shared_prompt_logprobs(model, prompts, completions, pad_token_id=PAD)
    expected = torch.tensor(
        [_alone(model, p, c) for p, c in zip(prompts, completions, strict=True)], dtype=torch.float64
    )
    assert got.dtype == torch.float64 and got.shape == (9,)
    assert float(got[prompts.index(prompts[1])]) == 0.0  # the empty completion: exactly 0
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_shared_prompt_token_logprobs_equal_the_padded_rows_token_by_token(model: LlamaForCausalLM) -> None:
    prompts, completions = _rows(3)
    with torch.no_grad():
        got, got_mask = shared_prompt_token_logprobs(model, prompts, completions, pad_token_id=PAD)
        expected, mask = completion_token_logprobs(model, prompts, completions, pad_token_id=PAD)
    assert got.dtype == torch.float32 and got.shape == expected.shape == (9, max(len(c) for c in completions))
    assert torch.equal(got_mask, mask)
    assert got_mask.sum(-1).tolist() == [len(c) for c in completions]
    assert float(got[~got_mask].abs().sum()) == 0.0  # padding holds 0
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_token_logprobs_score_whole_padded_rows_under_activation_checkpointing(tiny_model_dir: Path) -> None:
    """transformers turns the KV cache off while activations are recomputed, so the shared prefill cannot run:
    each row is then one padded forward of prompt and completion."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    prompts, completions = _rows(4)
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable()
        seen: list[tuple[int, ...]] = []
        hook = model.model.embed_tokens.register_forward_hook(lambda m, i, o, seen=seen: seen.append(tuple(i[0].shape)))
        try:
            with torch.no_grad():
                got, _ = token_logprobs(model, prompts, completions, pad_token_id=PAD)
        finally:
            hook.remove()
        width = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
        assert (seen == [(9, width)]) is checkpointing
        expected, _ = completion_token_logprobs(model, prompts, completions, pad_token_id=PAD)
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_only_single_token_completions_skip_the_second_forward(model: LlamaForCausalLM) -> None:
    prompts, completions = [[5, 6, 7], [5, 6, 7], [9]], [[EOS], [11], [12]]
    with torch.no_grad():
        got = shared_prompt_logprobs(model, prompts, completions, pad_token_id=PAD)
    expected = [_alone(model, p, c) for p, c in zip(prompts, completions, strict=True)]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), atol=ATOL, rtol=0)


def test_each_distinct_prompt_is_run_once(model: LlamaForCausalLM) -> None:
    prompts, completions = _rows()
    seen: list[tuple[int, ...]] = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, i, o: seen.append(tuple(i[0].shape)))
    try:
        with torch.no_grad():
            shared_prompt_logprobs(model, prompts, completions, pad_token_id=PAD)
    finally:
        hook.remove()
    longest_prompt = max(len(p) for p in prompts)
    longest_completion = max(len(c) for c in completions)
    # prefill: 3 distinct prompts (not 9 rows); then 9 rows of completion tokens but the last
    assert seen == [(3, longest_prompt), (9, longest_completion - 1)]


def _grads(model: torch.nn.Module, values: torch.Tensor) -> list[torch.Tensor]:
    weights = torch.linspace(0.5, 1.5, len(values), dtype=torch.float64)  # rows weighted differently
    params = [p for p in model.parameters() if p.requires_grad]
    return list(torch.autograd.grad((values * weights).sum(), params))


def _assert_grads_close(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for g, e in zip(got, expected, strict=True):
        assert float((g - e).norm()) <= GRAD_RTOL * float(e.norm()) + 1e-12


def test_gradients_equal_those_of_sequence_logprobs(model: LlamaForCausalLM) -> None:
    prompts, completions = _rows(1)
    shared = shared_prompt_logprobs(model, prompts, completions, pad_token_id=PAD)
    padded = sequence_logprobs(model, prompts, completions, pad_token_id=PAD)
    torch.testing.assert_close(shared, padded, atol=ATOL, rtol=0)
    got, expected = _grads(model, shared), _grads(model, padded)
    assert sum(float(e.norm()) for e in expected) > 0
    _assert_grads_close(got, expected)


def test_lora_policy_scores_and_gradients_equal(tiny_model_dir: Path, tmp_path: Path) -> None:
    lora = LoraSettings(r=4, target_modules=("q_proj", "v_proj"))
    adapter = init_lora_adapter(tiny_model_dir, lora, tmp_path / "agent_0", seed=0)
    policy = load_policy(tiny_model_dir, checkpoint_dir=adapter, lora=lora, dtype="float32", trainable=True)
    with torch.no_grad():  # lora_B starts at 0: move it so that the adapter changes the scores
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
    prompts, completions = _rows(2)
    shared = shared_prompt_logprobs(policy, prompts, completions, pad_token_id=PAD)
    padded = sequence_logprobs(policy, prompts, completions, pad_token_id=PAD)
    torch.testing.assert_close(shared, padded, atol=ATOL, rtol=0)
    _assert_grads_close(_grads(policy, shared), _grads(policy, padded))


def test_train_mode_is_kept_with_dropout_and_restored_without(model: LlamaForCausalLM) -> None:
    model.train()
    try:
        shared_prompt_logprobs(model, [[5, 6]], [[7, EOS]], pad_token_id=PAD)
        assert all(m.training for m in model.modules())
    finally:
        model.eval()


# --- MADPO on shared-prompt scoring ------------------------------------------------------------------------

PROMPTS = [[2, 40, 41, 42, 3, 2, 50], [2, 60, 61, 3, 2, 50], [2, 40, 41, 42, 3, 2, 50]]
WINNERS = [[70, 71, 72, 3], [80, 81, 3], [75, 3]]
LOSERS = [[90, 91, 3], [100, 101, 102, 103, 104], [70, 71, 72, 3]]


def _sgd_agents(model_dir: Path, n: int) -> list[TrainablePolicy]:
    out = []
    for i in range(n):
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        with torch.no_grad():  # agents differ
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(10 + i)) * 0.02)
        out.append(TrainablePolicy(model, torch.optim.SGD(trainable_parameters(model), lr=1.0), pad_token_id=PAD))
    return out


def _hand_step_delta(policies: list[TrainablePolicy], beta: float) -> list[list[torch.Tensor]]:
    """−∇ of each agent's mean MADPO loss with the others' margins detached, from per-row padded scores."""
    margins = []
    for p in policies:
        lp = sequence_logprobs(p.model, PROMPTS * 2, WINNERS + LOSERS, pad_token_id=PAD)
        margins.append(lp[:3] - lp[3:])  # (b,)
    total = sum(m.detach() for m in margins)
    out = []
    for p, m in zip(policies, margins, strict=True):
        loss = madpo_agent_loss(m, total - m.detach(), beta).mean()
        out.append([-g for g in torch.autograd.grad(loss, trainable_parameters(p.model))])
    return out


@pytest.mark.parametrize("micro_batch_size", [None, 1, 2])
def test_madpo_step_equals_the_hand_computed_step(tiny_model_dir: Path, micro_batch_size: int | None) -> None:
    policies = _sgd_agents(tiny_model_dir, 2)
    expected = _hand_step_delta(policies, beta=0.5)
    before = [[p.detach().clone() for p in trainable_parameters(a.model)] for a in policies]
    batch = PairBatch([PROMPTS, PROMPTS], [WINNERS, WINNERS], [LOSERS, LOSERS])
    stats = madpo_step(policies, batch, beta=0.5, max_grad_norm=None, micro_batch_size=micro_batch_size)
    assert stats.skipped == (False, False) and stats.margins.shape == (3, 2)
    for agent, old, want in zip(policies, before, expected, strict=True):
        moved = [new.detach() - o for new, o in zip(trainable_parameters(agent.model), old, strict=True)]
        _assert_grads_close(moved, want)  # SGD, lr 1: the parameters moved by −gradient


def test_one_agent_step_equals_the_hand_computed_step(tiny_model_dir: Path) -> None:
    policies = _sgd_agents(tiny_model_dir, 1)
    expected = _hand_step_delta(policies, beta=0.5)[0]
    before = [p.detach().clone() for p in trainable_parameters(policies[0].model)]
    stats = madpo_step(
        policies, PairBatch([PROMPTS], [WINNERS], [LOSERS]), beta=0.5, max_grad_norm=None, micro_batch_size=2
    )
    assert stats.margins.shape == (3, 1) and bool(torch.isfinite(stats.margins).all())
    moved = [n.detach() - o for n, o in zip(trainable_parameters(policies[0].model), before, strict=True)]
    _assert_grads_close(moved, expected)


# --- pairs batched by item ---------------------------------------------------------------------------------


def test_item_grouped_order_keeps_the_shuffle_and_puts_an_items_pairs_together() -> None:
    pairs = [{"item_id": i} for i in ["a", "b", "a", "c", "b", "a"]]
    permutation = [4, 0, 3, 5, 1, 2]  # items in shuffle order: b, a, c, a, b, a
    assert item_grouped_order(pairs, permutation) == [4, 1, 0, 5, 2, 3]


# --- shared-prompt sampling --------------------------------------------------------------------------------


def test_prompt_grouped_order() -> None:
    assert prompt_grouped_order([[5], [6, 7], [5], [8], [6, 7]]) == [0, 2, 1, 4, 3]


@pytest.mark.parametrize("batch_size", [64, 5, 1])
def test_shared_prefill_samples_the_same_tokens(model: LlamaForCausalLM, tiny_model_dir: Path, batch_size: int) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rng = random.Random(3)
    distinct = [_ids(rng, 1, 12) for _ in range(4)] + [[7]]
    prompts = [distinct[r % 5] for r in range(30)]  # 6 rows per prompt, interleaved
    seeds = [1000 + r for r in range(30)]
    settings = SamplingSettings(max_new_tokens=24, temperature=1.0, top_p=0.95, top_k=None, batch_size=batch_size)
    shared = generate(model, tok, prompts, seeds, settings)
    plain = generate(model, tok, prompts, seeds, settings, batching=Batching(share_prompts=False))
    assert [g.completion_ids for g in shared] == [g.completion_ids for g in plain]
    assert [g.seed for g in shared] == seeds
    assert len({tuple(g.completion_ids) for g in shared}) > 20  # rows of one prompt still draw differently


def test_sampling_prefills_each_distinct_prompt_once(model: LlamaForCausalLM, tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [[5, 6, 7, 8], [9, 10], [5, 6, 7, 8], [9, 10], [5, 6, 7, 8], [9, 10]]
    seen: list[tuple[int, ...]] = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, i, o: seen.append(tuple(i[0].shape)))
    try:
        generate(model, tok, prompts, list(range(6)), SamplingSettings(3, 1.0, 1.0, None, 64))
    finally:
        hook.remove()
    # 2 distinct prompts prefilled over 3 of their 4 columns, then the 6 rows one column at a time
    assert seen[0] == (2, 3) and all(shape == (6, 1) for shape in seen[1:]) and len(seen) >= 2


# --- SmolLM2 (slow) ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_lora_shared_prompt_scores_and_gradients_equal() -> None:
    from peft import LoraConfig, get_peft_model

    from pbrl.generation.sampling import encode_prompt
    from pbrl.models.loading import load_model, load_tokenizer

    tok = load_tokenizer("smollm2-135m-instruct")
    base = load_model("smollm2-135m-instruct")
    for p in base.parameters():
        p.requires_grad_(False)
    policy = get_peft_model(
        base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    )
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(0)) * 0.01)
    questions = ["Write a docstring for a function that adds two numbers.", "Explain what a stack is."]
    prompts = [encode_prompt(tok, q) for q in questions for _ in range(2)]  # winner and loser of each prompt
    text = tok(
        "A function that returns the sum of its two arguments, which may be ints or floats.", add_special_tokens=False
    ).input_ids
    completions = [text[: 8 + 3 * k] + [tok.eos_token_id] for k in range(4)]
    shared = shared_prompt_logprobs(policy, prompts, completions, pad_token_id=tok.pad_token_id)
    padded = sequence_logprobs(policy, prompts, completions, pad_token_id=tok.pad_token_id)
    _assert_grads_close(_grads(policy, shared), _grads(policy, padded))
    # Over 30 float32 layers, today's padded batch and each row alone already differ by ~3e-5 nats (measured
    # 2.9e-5 here): 1e-5 is below SmolLM2's float32 floor. So the values are checked against float64 (each row
    # alone): shared-prompt scoring must be no further from it than today's padded scoring (or within 1e-5).
    with torch.no_grad():
        exact = torch.cat(
            [
                sequence_logprobs(policy.double(), [p], [c], pad_token_id=tok.pad_token_id)
                for p, c in zip(prompts, completions, strict=True)
            ]
        )
    shared_error = float((shared.detach() - exact).abs().max())
    padded_error = float((padded.detach() - exact).abs().max())
    # Both errors sit at that floor and move with thread count and load (4.5e-5 vs 2.0e-5 seen in one CI-like
    # run); the measured floor for SmolLM2 is 5.7e-5
    # (docs/results/benchmarks.md#generation-scoring-and-orchestration), so 1e-4 bounds "at the float32 floor".
    assert shared_error <= max(2 * padded_error, 1e-4), (shared_error, padded_error)
    assert float((shared - padded).abs().max()) <= 1e-4
