"""Seeded, batch-invariant sampling on the tiny model, and the pieces it is built from."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from pbrl.generation.sampling import Batching, SamplingSettings, encode_prompt, generate
from pbrl.generation.seeded_sampler import build_warpers, counter_uniforms, draw_inverse_cdf, splitmix64

EOS = 3
U64 = 2**64
SAMPLING = {"temperature": 0.9, "top_p": 0.95, "top_k": 50}


def sampled(max_new_tokens: int, batch_size: int, **overrides) -> SamplingSettings:
    """SAMPLING (overridable) with this row limit and batch size."""
    return SamplingSettings(max_new_tokens=max_new_tokens, batch_size=batch_size, **{**SAMPLING, **overrides})


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> LlamaForCausalLM:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@pytest.fixture(scope="module")
def eos_model(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """A copy whose EOS logit gets +2: on the near-flat random model (logit std 0.17) EOS then takes about
    e^2 / (e^2 + 49) = 13% of the top-50 mass, so 12-token rows end both ways."""
    boosted = copy.deepcopy(model)
    bias = torch.zeros(boosted.config.vocab_size)
    bias[EOS] = 2.0
    boosted.lm_head.bias = torch.nn.Parameter(bias)
    return boosted


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def tokenizer_pad_is_eos(tiny_model_dir: Path):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.pad_token = tok.eos_token  # as in SmolLM2
    assert tok.pad_token_id == tok.eos_token_id == EOS
    return tok


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    texts = [
        "the agent says",
        "a",
        "good policy helps the user and the model is not bad",
        "reward of the good answer is not bad",
    ]
    ids = [encode_prompt(tokenizer, t) for t in texts]
    assert len({len(p) for p in ids}) == 4  # four different prompt lengths
    return ids


def _reference_splitmix64(seed: int, step: int) -> int:
    """Vigna's splitmix64.c in Python integers: output number step + 1 of the generator seeded with seed."""
    z = (seed + (step + 1) * 0x9E3779B97F4A7C15) % U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % U64
    return z ^ (z >> 31)


def test_splitmix64_matches_the_reference() -> None:
    # The first three outputs of SplitMix64 seeded with 0, from the reference implementation.
    first_three = [splitmix64(torch.tensor([0]), step).item() % U64 for step in range(3)]
    assert first_three == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    rng = random.Random(0)
    seeds = [0, 1, 2**62, 2**63 - 1] + [rng.randrange(2**63) for _ in range(500)]
    for step in (0, 5, 255, 10**9):
        got = [x % U64 for x in splitmix64(torch.tensor(seeds), step).tolist()]
        assert got == [_reference_splitmix64(s, step) for s in seeds]  # int64 wrap-around == mod 2**64
        uniforms = counter_uniforms(torch.tensor(seeds), step)
        assert uniforms.dtype == torch.float64 and bool(((uniforms >= 0) & (uniforms < 1)).all())
        assert uniforms.tolist() == [(_reference_splitmix64(s, step) >> 11) / 2**53 for s in seeds]


def test_inverse_cdf_draw_by_hand() -> None:
    # probabilities 0.2, 0.3, 0.5 → CDF 0.2, 0.5, 1.0: u below 0.2 → 0, in [0.2, 0.5) → 1, else 2
    scores = torch.log(torch.tensor([0.2, 0.3, 0.5])).expand(5, 3)
    uniforms = torch.tensor([0.0, 0.19, 0.21, 0.49, 0.51], dtype=torch.float64)
    assert draw_inverse_cdf(scores, uniforms).tolist() == [0, 0, 1, 1, 2]
    # −inf tokens are never drawn, also when u is the largest value below 1
    masked = torch.tensor([[0.0, float("-inf"), 0.0, float("-inf")]]).expand(3, 4)
    top = torch.tensor([0.49, 0.51, 1 - 2**-53], dtype=torch.float64)
    assert draw_inverse_cdf(masked, top).tolist() == [0, 2, 2]


def test_draws_follow_the_warped_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5]])
    warpers = build_warpers(temperature=0.7, top_p=0.9, top_k=6)
    warped = warpers(torch.zeros(1, 1, dtype=torch.long), logits.clone())
    probs = torch.softmax(warped[0].double(), -1)
    # T = 0.7 gives 0.514, 0.123, 0.060, 0.030, 0.014, 0.007, 0.0004, 0.251; top-k 6 drops token 6;
    # top-p 0.9 keeps 0, 7, 1, 2 (cumulative 0.889 < 0.9 before token 2 is added): 4 tokens survive.
    assert (probs > 0).nonzero().flatten().tolist() == [0, 1, 2, 7]
    n = 20_000
    seeds = torch.arange(n, dtype=torch.int64) * 7919 + 12345
    drawn = torch.cat(
        [draw_inverse_cdf(warped.expand(n // 4, -1), counter_uniforms(chunk, 3)) for chunk in seeds.chunk(4)]
    )
    counts = torch.bincount(drawn, minlength=8).double()
    assert counts[[3, 4, 5, 6]].sum() == 0
    kept = probs > 0
    chi_square = float((((counts - n * probs) ** 2)[kept] / (n * probs[kept])).sum())
    # 3 degrees of freedom: the 99.9% quantile of chi-square(3) is 16.27.
    assert chi_square < 16.27, (chi_square, counts.tolist(), (n * probs).tolist())


def test_encode_prompt_applies_the_template_once(tokenizer, tiny_model_dir: Path) -> None:
    ids = encode_prompt(tokenizer, "the agent says")
    expected_text = "<|im_start|>user\nthe agent says<|im_end|>\n<|im_start|>assistant\n"
    assert ids == tokenizer(expected_text, add_special_tokens=False).input_ids
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 2  # user + assistant, no extra
    plain = AutoTokenizer.from_pretrained(tiny_model_dir)
    plain.chat_template = None
    assert encode_prompt(plain, "the agent says") == plain("the agent says").input_ids
    for empty in ("", "  \n"):
        with pytest.raises(ValueError, match="empty prompt"):
            encode_prompt(tokenizer, empty)


def test_same_seeds_same_tokens_different_seeds_different(model, tokenizer, prompts) -> None:
    rows = [prompts[0]] * 6
    first = generate(model, tokenizer, rows, list(range(6)), sampled(20, 6))
    again = generate(model, tokenizer, rows, list(range(6)), sampled(20, 6))
    assert [g.completion_ids for g in first] == [g.completion_ids for g in again]
    assert [g.seed for g in first] == list(range(6))
    # the same prompt with six seeds gives six different completions
    assert len({tuple(g.completion_ids) for g in first}) == 6


def test_a_row_does_not_depend_on_its_batch(model, tokenizer, prompts) -> None:
    # The logits of a row differ by ~1e-7 between batch layouts on this model (left padding changes the
    # kernels' shapes), which could only matter if a row's uniform fell within ~1e-7 of a CDF boundary.
    rows = [prompts[i % 4] for i in range(8)]
    seeds = [2**62 + 17 * i for i in range(8)]
    alone = [generate(model, tokenizer, [p], [s], sampled(16, 1))[0] for p, s in zip(rows, seeds, strict=False)]
    whole = generate(model, tokenizer, rows, seeds, sampled(16, 8))
    chunked = generate(model, tokenizer, rows[::-1], seeds[::-1], sampled(16, 3))[::-1]
    assert [g.completion_ids for g in whole] == [g.completion_ids for g in alone]
    assert [g.completion_ids for g in chunked] == [g.completion_ids for g in alone]


def test_tokens_are_exactly_the_seeded_draws(model, tokenizer, prompts) -> None:
    seed, settings = 4242, {"temperature": 0.8, "top_p": 0.9, "top_k": 20}
    generation = generate(model, tokenizer, [prompts[2]], [seed], sampled(12, 1, **settings))[0]
    warpers = build_warpers(**settings)
    ids, expected = list(prompts[2]), []
    with torch.no_grad():
        for step in range(12):  # no cache, no padding: one full forward per token
            scores = model(torch.tensor([ids])).logits[:, -1].float()
            token = int(
                draw_inverse_cdf(warpers(torch.tensor([ids]), scores), counter_uniforms(torch.tensor([seed]), step))
            )
            expected.append(token)
            ids.append(token)
            if token == EOS:
                break
    assert generation.completion_ids == expected


@pytest.mark.parametrize("pad_is_eos", [False, True])
def test_eos_is_kept_and_ends_the_completion(eos_model, tokenizer, tokenizer_pad_is_eos, prompts, pad_is_eos) -> None:
    tok = tokenizer_pad_is_eos if pad_is_eos else tokenizer
    rows = [prompts[i % 4] for i in range(24)]
    generations = generate(eos_model, tok, rows, list(range(24)), sampled(12, 8))
    reasons = [g.finish_reason for g in generations]
    assert "eos" in reasons and "length" in reasons  # these seeds give both kinds
    for g in generations:
        if g.finish_reason == "eos":
            assert g.completion_ids[-1] == EOS and EOS not in g.completion_ids[:-1]
            assert len(g.completion_ids) <= 12 and g.stop_token_id == EOS
        else:
            assert len(g.completion_ids) == 12 and EOS not in g.completion_ids and g.stop_token_id is None
        assert g.text == tok.decode(g.completion_ids, skip_special_tokens=True)
    if pad_is_eos:  # the pad id only fills: same tokens as with the distinct pad id
        plain = generate(eos_model, tokenizer, rows, list(range(24)), sampled(12, 8))
        assert [g.completion_ids for g in generations] == [g.completion_ids for g in plain]


def test_global_random_state_is_neither_read_nor_consumed(model, tokenizer, prompts) -> None:
    outputs = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        state = torch.get_rng_state()
        outputs.append(generate(model, tokenizer, prompts, [7, 8, 9, 10], sampled(16, 4)))
        assert torch.equal(torch.get_rng_state(), state)
    assert outputs[0] == outputs[1]


def test_top_k_one_and_low_temperature_give_the_argmax(model, tokenizer, prompts) -> None:
    greedy = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(
                torch.tensor([p]), do_sample=False, max_new_tokens=10, pad_token_id=0, eos_token_id=EOS
            )
            new = out[0, len(p) :].tolist()
            greedy.append(new[: new.index(EOS) + 1] if EOS in new else new)
    top1 = generate(model, tokenizer, prompts, [1, 2, 3, 4], sampled(10, 4, temperature=1.0, top_p=1.0, top_k=1))
    cold = generate(model, tokenizer, prompts, [5, 6, 7, 8], sampled(10, 4, temperature=1e-4, top_p=1.0, top_k=None))
    assert [g.completion_ids for g in top1] == greedy
    assert [g.completion_ids for g in cold] == greedy


def test_model_settings_do_not_interfere_and_modes_are_restored(model, tokenizer, prompts) -> None:
    plain = generate(model, tokenizer, prompts, [1, 2, 3, 4], sampled(12, 4))
    saved = model.generation_config
    model.generation_config = saved.__class__.from_dict(
        {
            **saved.to_dict(),
            "do_sample": True,
            "temperature": 0.05,
            "top_k": 2,
            "repetition_penalty": 5.0,
            "no_repeat_ngram_size": 1,
            "min_new_tokens": 8,
            "max_length": 3,
        }
    )
    model.train()
    try:
        steered = generate(model, tokenizer, prompts, [1, 2, 3, 4], sampled(12, 4))
        assert model.training and all(m.training for m in model.modules())
        model.generation_config.suppress_tokens = [5]
        with pytest.raises(ValueError, match="suppress_tokens"):
            generate(model, tokenizer, prompts, [1, 2, 3, 4], sampled(12, 4))
    finally:
        model.generation_config = saved
        model.eval()
    assert steered == plain


def test_bad_arguments_are_all_reported(model, tokenizer, prompts) -> None:
    with pytest.raises(ValueError) as error:
        generate(
            model,
            tokenizer,
            [prompts[0], []],
            [1, -1, 2**63],
            SamplingSettings(max_new_tokens=0, temperature=0.0, top_p=1.5, top_k=0, batch_size=0),
        )
    message = str(error.value)
    for part in (
        "2 rows but seeds has 3",
        "prompt_ids[1] is empty",
        "seeds[1]",
        "seeds[2]",
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "batch_size",
    ):
        assert part in message


# ---------------------------------------------------------------- issue #33: the cache and bfloat16
@pytest.mark.parametrize("share", [True, False])
def test_the_preallocated_cache_gives_the_same_tokens_as_transformers_cache(model, tokenizer, share, monkeypatch):
    """Float32: the same keys and values in a buffer written once, so bitwise the same tokens; also when a buffer
    is too small and has to grow mid-generation."""
    from pbrl.generation import kv_cache, sampling

    prompts = [encode_prompt(tokenizer, t) for t in ("the agent says", "a reward model of the policy is good", "q")]
    rows = [p for p in prompts for _ in range(3)] + [prompts[0]]
    seeds = list(range(100, 100 + len(rows)))
    settings = SamplingSettings(max_new_tokens=40, temperature=1.0, top_p=1.0, top_k=None, batch_size=4)
    plain = generate(model, tokenizer, rows, seeds, settings, batching=Batching(share_prompts=share, preallocate=False))
    fast = generate(model, tokenizer, rows, seeds, settings, batching=Batching(share_prompts=share, preallocate=True))
    assert [g.completion_ids for g in fast] == [g.completion_ids for g in plain]
    monkeypatch.setattr(sampling, "preallocated_cache", lambda m, capacity: kv_cache.preallocated_cache(m, 3))
    grown = generate(model, tokenizer, rows, seeds, settings, batching=Batching(share_prompts=share, preallocate=True))
    assert [g.completion_ids for g in grown] == [g.completion_ids for g in plain]


def test_bfloat16_sampling_is_reproducible_from_its_seeds(tiny_model_dir, tokenizer):
    """bfloat16 weights: the same seeds give the same tokens run after run (with the same batch layout: bfloat16's
    coarser rounding moves a CDF boundary far more often than float32's when rows are batched differently)."""
    bf16 = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval()
    prompts = [encode_prompt(tokenizer, t) for t in ("the agent says", "good policy", "q")]
    rows = [p for p in prompts for _ in range(2)]
    settings = SamplingSettings(max_new_tokens=16, temperature=1.0, top_p=0.9, top_k=50, batch_size=6)
    first = generate(bf16, tokenizer, rows, list(range(len(rows))), settings)
    again = generate(bf16, tokenizer, rows, list(range(len(rows))), settings)
    assert [g.completion_ids for g in first] == [g.completion_ids for g in again]
    assert len({tuple(g.completion_ids) for g in first}) > 1  # the rows really sampled (not all one sequence)
