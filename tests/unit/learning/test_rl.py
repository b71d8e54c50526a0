"""MARLHF policy learning (docs/design/algorithms.md#marlhf-policy-learning): advantage backends, reference KL, the
per-agent update and the RL loop."""

from __future__ import annotations

import math

import pytest
import torch

from pbrl.generation.sampling import Generation
from pbrl.learning.advantages import ADVANTAGE_BACKENDS, advantage_backend, normalize_group
from pbrl.learning.logprobs import sequence_logprobs
from pbrl.learning.losses import k3_kl
from pbrl.learning.rl import (
    ReferencePolicy,
    RLHooks,
    RLSettings,
    completion_token_logprobs,
    rl_agent_step,
    run_rl,
    training_token_logprobs,
)
from pbrl.models.loading import load_model
from pbrl.models.lora import LoraSettings
from pbrl.models.policies import TrainablePolicy, trainable_parameters

R = torch.tensor([[1.0, 2.0, 3.0, 6.0]], dtype=torch.float64)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("magrpo", [-2.0, -1.0, 0.0, 3.0]),  # mean 3
        ("mareinforce", [1.0, 2.0, 3.0, 6.0]),
        ("marloo", [1 - 11 / 3, 2 - 10 / 3, 3 - 9 / 3, 6 - 6 / 3]),  # minus the mean of the other three
        ("maremax", [-5.0, -4.0, -3.0, 0.0]),  # max 6
    ],
)
def test_advantages_hand_worked(name, expected):
    assert advantage_backend(name)(R)[0].tolist() == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("name", sorted(ADVANTAGE_BACKENDS))
def test_all_equal_rewards_give_no_nan(name):
    equal = torch.full((2, 4), 0.5, dtype=torch.float64)
    adv, norm = advantage_backend(name)(equal), normalize_group(advantage_backend(name)(equal))
    expected = 0.5 if name == "mareinforce" else 0.0
    assert adv.tolist() == [[expected] * 4] * 2
    assert torch.isfinite(norm).all() and norm.tolist() == [[expected / 1e-6] * 4] * 2  # std 0 clamps to 1e-6


@pytest.mark.parametrize("name", ["magrpo", "marloo", "maremax"])
def test_rewards_differing_by_1e_12_stay_tiny(name):
    close = torch.tensor([[1.0, 1.0 + 1e-12]], dtype=torch.float64)
    adv = advantage_backend(name)(close)
    norm = normalize_group(adv)
    assert torch.isfinite(norm).all()
    assert adv.abs().max() <= 2.1e-12 and norm.abs().max() <= 2.1e-6  # the clamp keeps 1e-12 from blowing up


def test_normalization_divides_by_the_group_population_std():
    adv = torch.tensor([[-2.0, -1.0, 0.0, 3.0]], dtype=torch.float64)
    std = math.sqrt((4 + 1 + 0 + 9) / 4)
    assert normalize_group(adv)[0].tolist() == pytest.approx([-2 / std, -1 / std, 0.0, 3 / std], abs=1e-12)


def test_backend_errors_name_the_field():
    with pytest.raises(ValueError, match="num_generations"):
        advantage_backend("marloo")(torch.ones((1, 1)))
    with pytest.raises(ValueError, match="rl_algorithm: got 'maac'"):
        advantage_backend("maac")


def test_k3_hand_values_and_mask():
    policy = torch.tensor([[-1.0, -2.0, -7.0]])
    reference = torch.tensor([[-1.5, -2.0, 99.0]])  # the masked third slot must not count
    mask = torch.tensor([[True, True, False]])
    # Δ = −0.5: e^−0.5 + 0.5 − 1 = 0.1065306597; Δ = 0: 0
    assert k3_kl(policy, reference, mask).tolist() == pytest.approx([0.1065306597], abs=1e-9)
    torch.manual_seed(0)
    a, b = torch.randn(50, 7), torch.randn(50, 7)
    assert (k3_kl(a, b, torch.ones(50, 7, dtype=torch.bool)) >= 0).all()
    assert k3_kl(a, a, torch.ones(50, 7, dtype=torch.bool)).abs().max() == 0


PROMPTS = [[2, 17, 40, 41, 5], [2, 17, 60, 61, 62, 63, 64, 65, 5]]
COMPLETIONS = [[70, 71, 3], [80, 3]]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir)


def test_token_logprobs_cover_completion_tokens_only_and_ignore_padding(tiny):
    logps, mask = completion_token_logprobs(tiny, PROMPTS, COMPLETIONS, pad_token_id=0)
    assert mask.tolist() == [[True, True, True], [True, True, False]]  # one column per completion token
    alone, _ = completion_token_logprobs(tiny, PROMPTS[1:], COMPLETIONS[1:], pad_token_id=0)
    assert torch.allclose(logps[1, :2], alone[0], atol=1e-6, rtol=0)  # extra padding changes nothing
    summed = sequence_logprobs(tiny, PROMPTS, COMPLETIONS, pad_token_id=0)
    assert torch.allclose(logps.sum(-1), summed.double().cpu(), atol=1e-6, rtol=0)  # same as MADPO's scorer


def test_kl_zero_for_the_same_policy_positive_otherwise_and_prompt_free(tiny, tiny_model_dir):
    ref = ReferencePolicy(load_model(tiny_model_dir), pad_token_id=0)
    pol, mask = completion_token_logprobs(tiny, PROMPTS, COMPLETIONS, pad_token_id=0)
    assert k3_kl(pol, ref.token_logprobs(PROMPTS, COMPLETIONS)[0], mask).abs().max() <= 1e-7
    moved = load_model(tiny_model_dir)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.05 * torch.randn_like(p))
    other = ReferencePolicy(moved, pad_token_id=0)
    kl = k3_kl(pol, other.token_logprobs(PROMPTS, COMPLETIONS)[0], mask)
    assert (kl > 0).all()
    empty = k3_kl(
        *completion_token_logprobs(tiny, PROMPTS[:1], [[]], pad_token_id=0)[:1],
        other.token_logprobs(PROMPTS[:1], [[]])[0],
        torch.zeros((1, 0), dtype=torch.bool),
    )
    assert empty.tolist() == [0.0]  # a prompt alone carries no KL, however different the models are


def test_lora_reference_is_the_base_with_the_adapter_disabled(tiny_model_dir):
    lora = load_model(tiny_model_dir, lora=LoraSettings(r=2), seed=0, trainable=True)
    with torch.no_grad():  # move the adapter away from its B = 0 init
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.add_(0.5)
    ref = ReferencePolicy(lora, pad_token_id=0, disable_adapter=True)
    base = completion_token_logprobs(load_model(tiny_model_dir), PROMPTS, COMPLETIONS, pad_token_id=0)[0]
    assert torch.allclose(ref.token_logprobs(PROMPTS, COMPLETIONS)[0], base, atol=1e-7, rtol=0)
    adapted = completion_token_logprobs(lora, PROMPTS, COMPLETIONS, pad_token_id=0)[0]
    assert not torch.allclose(adapted, base, atol=1e-4)


def test_an_items_generations_share_one_prompt_forward_with_the_padded_gradient(tiny_model_dir):
    """The training forward of a step runs each item's prompt once for its g rows (the KV cache is expanded to
    the rows, the gradient of every row flows back into it) and gives the log-probs and gradient of g padded
    rows; the reference and the KL's policy pass share the prompt the same way."""
    policy = _trainable(tiny_model_dir)
    prompts = [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3  # 2 items x g = 3
    completions = [[70, 71, 3], [80, 3], [90, 91, 92, 3], [70, 3], [81, 82, 3], [3]]
    seen: list[tuple[int, ...]] = []
    hook = policy.model.get_input_embeddings().register_forward_hook(lambda m, i, o: seen.append(tuple(i[0].shape)))
    try:
        shared, mask = training_token_logprobs(policy, prompts, completions, seed=None)
        ref = ReferencePolicy(policy.model, pad_token_id=0).token_logprobs(prompts, completions)[0]
    finally:
        hook.remove()
    width = max(len(p) for p in PROMPTS)
    assert seen == [(2, width), (6, 3)] * 2  # prefill of the 2 prompts, then the 6 rows' completions
    padded, padded_mask = completion_token_logprobs(policy.model, prompts, completions, pad_token_id=0)
    assert torch.equal(mask, padded_mask)
    assert torch.allclose(shared.detach().double(), padded, atol=1e-5, rtol=0)
    assert torch.allclose(ref, padded, atol=1e-5, rtol=0)
    params = trainable_parameters(policy.model)
    weights = torch.linspace(0.5, 1.5, 6)[:, None]
    got = torch.autograd.grad((shared * weights).sum(), params)
    alone = sequence_logprobs(policy.model, prompts, completions, pad_token_id=0)  # whole padded rows
    expected = torch.autograd.grad((alone * weights[:, 0].double()).sum(), params)
    for g, e in zip(got, expected, strict=True):
        assert float((g - e).norm()) <= 1e-4 * float(e.norm()) + 1e-12


def _trainable(model_dir, lr=1e-2):
    model = load_model(model_dir, trainable=True)
    return TrainablePolicy(model, torch.optim.AdamW(trainable_parameters(model), lr=lr, weight_decay=0.0), 0)


def test_policy_step_raises_the_positive_advantage_completion(tiny_model_dir):
    policy = _trainable(tiny_model_dir)
    prompts, completions = [PROMPTS[0]] * 2, COMPLETIONS
    before = sequence_logprobs(policy.model, prompts, completions, pad_token_id=0)
    for step in range(3):
        _, outcome = rl_agent_step(
            policy, prompts, completions, torch.tensor([1.0, -1.0]), max_grad_norm=1.0, seed=step
        )
        assert outcome == "updated"
    after = sequence_logprobs(policy.model, prompts, completions, pad_token_id=0)
    assert after[0] > before[0] and after[1] < before[1]


@pytest.mark.parametrize(("advantages", "outcome"), [([0.0, 0.0], "no_signal"), ([math.nan, 1.0], "skipped")])
def test_no_signal_or_non_finite_leaves_the_policy_untouched(tiny_model_dir, advantages, outcome):
    policy = _trainable(tiny_model_dir)
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    got = rl_agent_step(policy, [PROMPTS[0]] * 2, COMPLETIONS, torch.tensor(advantages), max_grad_norm=1.0, seed=0)
    assert got[1] == outcome
    assert all(torch.equal(v, before[k]) for k, v in policy.model.state_dict().items())
    assert not policy.optimizer.state


def test_rl_loop_builds_joint_responses_by_index_and_shares_advantages(tiny_model_dir):
    """Fake sampler and scorer: agent i's j-th sample of item x is token 100 + 10·i + j; the joint reward is
    agent 0's token + agent 1's token; item 'b' has a joint response that does not fit, so its group is left out."""
    policies = [_trainable(tiny_model_dir, lr=1e-3) for _ in range(2)]

    def sample(agent, rows, items, epoch):
        return [Generation([100 + 10 * agent + r % 2, 3], "", "eos", r, 3) for r in range(len(rows))]

    seen = []

    def score(prompts, completions):
        seen.extend(completions)
        return [
            (None, None) if p[0][1] == 99 and c[0][0] == 101 else (float(c[0][0] + c[1][0]), [1])
            for p, c in zip(prompts, completions, strict=True)
        ]

    settings = RLSettings(
        epochs=1, batch_size=2, num_generations=2, backend="magrpo", normalize=False, kl_coef=None, max_grad_norm=1.0
    )
    result = run_rl(
        policies,
        [[[2, 17], [2, 99]], [[2, 18], [2, 99]]],
        ["a", "b"],
        settings,
        RLHooks(sample=sample, score=score, order_seed=0, dropout_seed=lambda agent, step: step),
        references=None,
    )
    assert all(c[0][0] - 100 == c[1][0] - 110 for c in seen)  # joint j = every agent's j-th sample
    rows = {(r["item_id"], r["generation_index"], r["agent_index"]): r for r in result.rollouts}
    # item a: rewards 210, 212 (mean 211) -> advantages -1, +1 for both agents
    assert [rows[("a", j, i)]["advantage"] for j in (0, 1) for i in (0, 1)] == [-1.0, -1.0, 1.0, 1.0]
    assert all(rows[("b", j, i)]["advantage"] is None for j in (0, 1) for i in (0, 1))
    assert result.dropped_groups == 1 and result.steps == 1 and result.batch_sizes == [4]


def test_group_backends_pass_the_run_start(tiny_model_dir, tmp_path):
    """(maac/iac are accepted too: tests/unit/learning/test_critics.py checks their preflight.)"""
    from pbrl.run.folder import prepare_run
    from tests.helpers import tiny_job

    ok = prepare_run(
        tiny_job(tiny_model_dir, tmp_path, trainer="marlhf_iter", rl_algorithm="marloo", num_generations=2),
        resume=False,
    )
    assert (ok / "run.json").is_file()
