"""sequence_logprobs on the tiny model: brute force agreement, padding invariance, gradients, dropout."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from pbrl.learning.logprobs import sequence_logprobs
from pbrl.models.forward import eval_mode

PAD, EOS, VOCAB = 0, 3, 320
ATOL = 1e-5  # fp32 model; the sums are float64


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> LlamaForCausalLM:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def _random_ids(rng: random.Random, low: int, high: int) -> list[int]:
    return [rng.randrange(4, VOCAB) for _ in range(rng.randint(low, high))]


def _brute_force(model: LlamaForCausalLM, prompt: list[int], completion: list[int]) -> float:
    """One unpadded forward; log_softmax at each position predicting a completion token, summed."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].double()  # (t, v)
    logprobs = torch.log_softmax(logits, dim=-1)
    return sum(float(logprobs[len(prompt) - 1 + j, token]) for j, token in enumerate(completion))


def _score(model: LlamaForCausalLM, prompts: list[list[int]], completions: list[list[int]], **kw) -> torch.Tensor:
    with torch.no_grad():
        return sequence_logprobs(model, prompts, completions, **{"pad_token_id": PAD, **kw})


def test_equals_brute_force_per_token_sum(model: LlamaForCausalLM) -> None:
    rng = random.Random(0)
    prompts = [_random_ids(rng, 1, 10) for _ in range(6)]
    completions = [_random_ids(rng, 1, 10) + [EOS] for _ in range(6)]
    expected = torch.tensor(
        [_brute_force(model, p, c) for p, c in zip(prompts, completions, strict=False)], dtype=torch.float64
    )
    for side in ("left", "right"):
        got = _score(model, prompts, completions, padding_side=side)
        assert got.shape == (6,) and got.dtype == torch.float64
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_alone_left_and_right_padded_agree(model: LlamaForCausalLM) -> None:
    rng = random.Random(1)
    prompt, completion = _random_ids(rng, 5, 5), _random_ids(rng, 6, 6) + [EOS]
    # Neighbours: longer and shorter prompts and completions, so the row is padded on both layouts.
    prompts = [_random_ids(rng, 12, 12), prompt, [7], _random_ids(rng, 2, 2)]
    completions = [_random_ids(rng, 2, 2), completion, _random_ids(rng, 15, 15), []]
    alone = _score(model, [prompt], [completion])[0]
    for side in ("left", "right"):
        batched = _score(model, prompts, completions, padding_side=side)[1]
        torch.testing.assert_close(batched, alone, atol=ATOL, rtol=0)


def test_last_completion_token_counts(model: LlamaForCausalLM) -> None:
    prompt, completion = [10, 20, 30], [40, 50, EOS]
    changed = completion[:-1] + [60]
    values = _score(model, [prompt, prompt], [completion, changed])
    assert values[0] != values[1]
    # Only the last term differs: exactly log π(EOS | …) − log π(60 | …) at the same position.
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([prompt + completion[:-1]])).logits[0, -1].double(), -1)
    torch.testing.assert_close(values[0] - values[1], logprobs[EOS] - logprobs[60], atol=ATOL, rtol=0)


def test_extra_padding_changes_nothing_also_when_pad_is_eos(model: LlamaForCausalLM) -> None:
    prompts = [[11, 12, 13], [21, 22]]
    completions = [[31, EOS], [41, 42, EOS]]  # completions end in EOS, the id that pads when pad == eos
    plain = _score(model, prompts, completions)
    long_neighbour = ([list(range(100, 130))], [list(range(200, 220))])
    for pad in (PAD, EOS):
        for side in ("left", "right"):
            padded = _score(
                model,
                prompts + long_neighbour[0],
                completions + long_neighbour[1],
                pad_token_id=pad,
                padding_side=side,
            )[:2]
            torch.testing.assert_close(padded, plain, atol=ATOL, rtol=0)


def test_two_scorings_are_bitwise_equal(model: LlamaForCausalLM) -> None:
    rng = random.Random(2)
    prompts = [_random_ids(rng, 1, 12) for _ in range(5)]
    completions = [_random_ids(rng, 0, 12) for _ in range(5)]
    assert torch.equal(_score(model, prompts, completions), _score(model, prompts, completions))


def test_sixteen_mixed_length_rows_equal_one_at_a_time(model: LlamaForCausalLM) -> None:
    rng = random.Random(3)
    prompts = [_random_ids(rng, 1, 40) for _ in range(16)]
    completions = [_random_ids(rng, 0, 40) for _ in range(16)]
    batched = _score(model, prompts, completions)
    one_by_one = torch.cat([_score(model, [p], [c]) for p, c in zip(prompts, completions, strict=False)])
    torch.testing.assert_close(batched, one_by_one, atol=ATOL, rtol=0)


def test_empty_completion_scores_zero(model: LlamaForCausalLM) -> None:
    values = _score(model, [[5, 6], [7]], [[], [8, EOS]])
    assert values[0].item() == 0.0 and values[1].item() < 0.0
    assert _score(model, [[5], [6, 7]], [[], []]).tolist() == [0.0, 0.0]


def test_logits_only_at_completion_positions(model: LlamaForCausalLM) -> None:
    shapes: list[tuple[int, ...]] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: shapes.append(tuple(out.shape)))
    try:
        _score(model, [list(range(10, 40)), [9]], [[50, 51, EOS], [60]])
    finally:
        hook.remove()
    assert shapes == [(2, 3, VOCAB)]  # (b, longest completion, v): no logits over the 30-token prompt


def test_position_ids_and_mask_come_from_lengths(model: LlamaForCausalLM) -> None:
    # RoPE only sees relative positions, so wrong absolute positions would barely move the values on a
    # Llama model: check what the model receives instead. Rows of 3 and 5 tokens, pad id == eos id, and
    # the short row's completion ends in EOS, so comparing ids with the pad id would get the mask wrong.
    seen: dict[str, torch.Tensor] = {}

    def capture(_module: torch.nn.Module, _args: tuple, kwargs: dict) -> None:
        seen.update(attention_mask=kwargs["attention_mask"], position_ids=kwargs["position_ids"])

    hook = model.model.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        _score(model, [[5, 6], [7, 8, 9]], [[EOS], [10, EOS]], pad_token_id=EOS)
        assert seen["attention_mask"].tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
        assert seen["position_ids"].tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]
        _score(model, [[5, 6], [7, 8, 9]], [[EOS], [10, EOS]], pad_token_id=EOS, padding_side="right")
        assert seen["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
        assert seen["position_ids"].tolist() == [[0, 1, 2, 2, 2], [0, 1, 2, 3, 4]]
    finally:
        hook.remove()


def test_gradients_flow_with_grad_enabled(model: LlamaForCausalLM) -> None:
    model.zero_grad()
    values = sequence_logprobs(model, [[5, 6, 7], [8]], [[9, 10, EOS], [11, 12]], pad_token_id=PAD)
    assert values.requires_grad
    values.sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert all(g is not None and g.abs().sum() > 0 for g in grads.values()), [n for n, g in grads.items() if g is None]
    model.zero_grad()
    assert not _score(model, [[5]], [[6]]).requires_grad


def test_dropout_is_off_and_modes_are_restored(model: LlamaForCausalLM) -> None:
    config = model.config.__class__.from_dict({**model.config.to_dict(), "attention_dropout": 0.5})
    dropout_model = LlamaForCausalLM(config)
    dropout_model.load_state_dict(model.state_dict())
    dropout_model.train()
    dropout_model.model.layers[0].eval()  # a mixed state that must come back as it was
    modes = [m.training for m in dropout_model.modules()]
    prompts, completions = [[5, 6, 7, 8, 9, 10]], [[11, 12, 13, 14, EOS]]
    ids = torch.tensor([prompts[0] + completions[0]])
    with torch.no_grad():  # the test can fail: in train mode the raw forward is random
        assert not torch.equal(dropout_model(ids).logits, dropout_model(ids).logits)
    first = _score(dropout_model, prompts, completions)
    second = _score(dropout_model, prompts, completions)
    assert torch.equal(first, second)
    torch.testing.assert_close(first, _score(model, prompts, completions), atol=ATOL, rtol=0)
    assert [m.training for m in dropout_model.modules()] == modes


def test_eval_mode_restores_on_error(model: LlamaForCausalLM) -> None:
    model.train()
    with pytest.raises(RuntimeError), eval_mode(model):
        assert not model.training
        raise RuntimeError("boom")
    assert model.training and all(m.training for m in model.modules())
    model.eval()


def test_bad_inputs_name_the_row(model: LlamaForCausalLM) -> None:
    with pytest.raises(ValueError, match="2 rows but completion_ids has 1"):
        _score(model, [[1], [2]], [[3]])
    with pytest.raises(ValueError, match=r"prompt_ids\[1\] is empty"):
        _score(model, [[1], []], [[3], [4]])
    with pytest.raises(ValueError, match=r"completion_ids\[0\].*\[400\]"):
        _score(model, [[1]], [[400]])
    with pytest.raises(ValueError, match="padding_side"):
        _score(model, [[1]], [[2]], padding_side="middle")
