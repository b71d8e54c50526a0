"""The core modules pinned where ``make mutate`` found behaviour no test checked
(docs/results/mutation.md#the-last-measured-run).

Each test names the kind of wrong version it kills; the expectations are worked out by hand in the test.
Wrong versions (mutmut ids of ``pbrl/*``) made to fail here, by family:

- replay: ``nearest_k`` with k = 1 (``k <= 1``/``k < 2``/``and``), ``lambda_decay`` ages shifted (only λ = 0
  tells), the default sample size (``> 1``, ``>= 0``, ``sizes[+1]``), unnormalised weights (``w * w.sum()``),
  each validation clause of ``allocate_draws`` and ``sample_within``, int64 results (``astype(None)``,
  ``dtype=None``), ``minlength`` dropped, and every field/value/message of ``replay_problems``.
- pairs: the loser named in a non-finite error, equal scores accepted (``>=``), booleans taken as scores, and
  the error texts that name the side and the fix.
- losses: accuracy summed over the wrong axis (``dim=-2``), the shape error text.
- scoring: token id 0 and vocab − 1 accepted, only the first 5 bad ids listed, an empty batch and all-empty
  completions (float64 zeros), the row-count error text.
- madpo: the joint margin summed over the whole batch (``sum(dim=None)``), an agent whose pairs are all
  identical stopping the loop (``break``) or reported skipped, a non-finite gradient reported as not skipped
  or stopping the other agents, gradients left behind (``set_to_none=False``), ``accuracy`` not reported;
  gradient accumulation (``micro_batch_size``): a parameter's missing (None) gradient multiplied or divided
  (``_AccumulatedGradients.backward``, ``allow_unused=False``), a micro-batch's gradient dropped, kept alone or
  subtracted, an identical-pair micro-batch stopping the loop (``break``) or, last, breaking the final sum,
  the clipping or the fp16 scaler left out of the accumulated step; the dropout seeds of micro-batches
  (``micro_seed`` values, ``None`` passed to the detached or the training pass); the choice of scorer under
  activation checkpointing (``_score``); ``has_dropout`` counting p = 0; the seeds error text.
- scoring: the (b, 0) float32 / bool shapes of all-empty completions, token log-probs not in eval mode by
  default (``dropout=True``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from pbrl.config.replay_rules import replay_problems
from pbrl.learning.logprobs import sequence_logprobs
from pbrl.learning.losses import madpo_agent_loss, preference_accuracy
from pbrl.learning.madpo import PairBatch
from pbrl.models.policies import TrainablePolicy
from pbrl.preference.pairs import CandidateRef, Pair, base_candidate_pairs, iterative_candidate_pairs
from pbrl.preference.replay import (
    ReplayDataset,
    allocate_draws,
    dataset_weights,
    default_sample_size,
    eligible_datasets,
    lambda_weights,
    sample_within,
)
from pbrl.preference.selection import select_pairs
from tests.helpers import lora_dropout_policy, madpo_step

MODES = "current, nearest_k, all_history, lambda_decay"


# ---------------------------------------------------------------- replay
def test_replay_dataset_error_names_the_round():
    with pytest.raises(ValueError, match=r"^round 3: num_pairs -1 must be >= 0$"):
        ReplayDataset(3, -1)


def test_nearest_k_with_k_one_is_the_newest_non_empty_round_and_k_below_one_is_refused():
    ds = [ReplayDataset(1, 4), ReplayDataset(2, 0), ReplayDataset(3, 2), ReplayDataset(4, 0)]
    assert eligible_datasets(ds, mode="nearest_k", current_round=4, k=1) == [ReplayDataset(3, 2)]
    assert eligible_datasets(ds, mode="nearest_k", current_round=4, k=2) == [ReplayDataset(1, 4), ReplayDataset(3, 2)]
    for k in (None, 0):
        with pytest.raises(ValueError, match=rf"^preference_replay_k: got {k!r}; nearest_k needs an integer >= 1$"):
            eligible_datasets(ds, mode="nearest_k", current_round=4, k=k)
    with pytest.raises(ValueError, match=rf"^preference_replay_mode: got 'td-lambda'; allowed: {MODES}$"):
        eligible_datasets(ds, mode="td-lambda", current_round=4, k=None)  # type: ignore[arg-type]


def test_lambda_weights_edge_cases():
    empty = lambda_weights([], 0.5)
    assert empty.shape == (0,) and empty.dtype == np.float64
    assert lambda_weights([0], 0.3).tolist() == [1.0]
    with pytest.raises(ValueError, match=r"^replay ages must be >= 0; got \[0, -1\]$"):
        lambda_weights([0, -1], 0.5)


def test_lambda_decay_with_lambda_zero_keeps_only_the_newest_round():
    eligible = [ReplayDataset(1, 3), ReplayDataset(2, 5), ReplayDataset(4, 1)]
    assert dataset_weights(eligible, mode="lambda_decay", lam=0.0).tolist() == [0.0, 0.0, 1.0]
    # λ = 0.5, ages 2, 1, 0 (oldest -> newest): 1/7, 2/7, 4/7.
    assert dataset_weights(eligible, mode="lambda_decay", lam=0.5).tolist() == pytest.approx([1 / 7, 2 / 7, 4 / 7])
    with pytest.raises(
        ValueError,
        match=r"^preference_replay_lambda: lambda_decay needs a value in \[0, 1\]; "
        r"got None$",
    ):
        dataset_weights(eligible, mode="lambda_decay", lam=None)
    with pytest.raises(ValueError, match=rf"^preference_replay_mode: got 'td'; allowed: {MODES}$"):
        dataset_weights(eligible, mode="td", lam=None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("current_pairs", "sizes", "expected"),
    [
        (1, [3], 1),  # the current round's pair count, even 1
        (0, [3, 5, 0], 5),  # else the newest non-empty dataset's size
        (0, [3, 1], 1),
        (0, [3, 4, 5], 5),
        (0, [], 0),
    ],
)
def test_default_sample_size(current_pairs, sizes, expected):
    eligible = [ReplayDataset(i + 1, n) for i, n in enumerate(sizes)]
    assert default_sample_size(sample_size=None, current_pairs=current_pairs, eligible=eligible) == expected
    assert default_sample_size(sample_size=7, current_pairs=current_pairs, eligible=eligible) == 7


def test_allocate_draws_normalises_weights_and_returns_one_int64_count_per_dataset():
    counts = allocate_draws(np.array([1.0, 3.0]), 4000, np.random.default_rng(0))  # unnormalised on purpose
    assert counts.dtype == np.int64 and counts.sum() == 4000
    assert abs(counts[0] / 4000 - 0.25) < 0.03  # 3 sigma of a binomial(4000, 1/4) share is 0.02
    zero_last = allocate_draws(np.array([1.0, 0.0]), 5, np.random.default_rng(0))
    assert zero_last.tolist() == [5, 0] and zero_last.dtype == np.int64
    none = allocate_draws(np.array([0.5, 0.5]), 0, np.random.default_rng(0))
    assert none.tolist() == [0, 0] and none.dtype == np.int64


@pytest.mark.parametrize("weights", [[-1.0, 2.0], [math.nan, 1.0], [0.0, 0.0], [], [math.inf, 1.0]])
def test_allocate_draws_refuses_weights_that_cannot_place_draws(weights):
    with pytest.raises(ValueError, match=r"^replay weights must be finite, >= 0 and not all 0 to place 3 draws"):
        allocate_draws(np.array(weights, dtype=np.float64), 3, np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"^replay sample size must be >= 0; got -1$"):
        allocate_draws(np.array([1.0]), -1, np.random.default_rng(0))


def test_sample_within_bounds_and_dtype():
    none = sample_within(4, 0, np.random.default_rng(0))
    assert none.shape == (0,) and none.dtype == np.int64
    some = sample_within(3, 7, np.random.default_rng(0))  # two full permutations, then one more
    assert some.dtype == np.int64 and sorted(some[:6].tolist()) == [0, 0, 1, 1, 2, 2]
    assert sorted(np.bincount(some, minlength=3).tolist()) == [2, 2, 3]
    with pytest.raises(ValueError, match=r"^cannot draw 2 pairs from a dataset of 0 pairs$"):
        sample_within(0, 2, np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"^replay draw count must be >= 0; got -2$"):
        sample_within(3, -2, np.random.default_rng(0))


def _problems(**kwargs) -> list[tuple[str, object, str]]:
    return [(p.field, p.value, p.message) for p in replay_problems(**kwargs)]


def test_replay_problems_name_every_field_value_and_rule():
    """One validator per rule: the config rules ask replay_problems (select_replay takes validated values)."""
    assert _problems(mode="td-lambda", k=None, lam=None, sample_size=None) == [
        ("preference_replay_mode", "td-lambda", f"allowed: {MODES}")
    ]
    assert _problems(mode="nearest_k", k=0, lam=0.5, sample_size=0) == [
        ("preference_replay_k", 0, "required (>= 1) with preference_replay_mode='nearest_k'"),
        ("preference_replay_lambda", 0.5, "allowed only with preference_replay_mode='lambda_decay'; set it to None"),
        ("preference_replay_sample_size", 0, "must be an integer >= 1 or None"),
    ]
    assert _problems(mode="current", k=2, lam=None, sample_size=3) == [
        ("preference_replay_k", 2, "must be None or 1 with preference_replay_mode='current'"),
        (
            "preference_replay_sample_size",
            3,
            "must be None with preference_replay_mode='current' (the round's pairs are used as they are)",
        ),
    ]
    assert _problems(mode="all_history", k=3, lam=None, sample_size=None) == [
        ("preference_replay_k", 3, "must be None with preference_replay_mode='all_history'")
    ]
    for lam in (None, 1.5, -0.1, True):
        assert _problems(mode="lambda_decay", k=None, lam=lam, sample_size=None) == [
            ("preference_replay_lambda", lam, "required, in [0, 1], with preference_replay_mode='lambda_decay'")
        ]
    assert _problems(mode="current", k=True, lam=None, sample_size=None)[0][0] == "preference_replay_k"
    # The boundaries are accepted.
    assert _problems(mode="nearest_k", k=1, lam=None, sample_size=1) == []
    assert _problems(mode="current", k=1, lam=None, sample_size=None) == []
    for lam in (0.0, 1.0, 0):
        assert _problems(mode="lambda_decay", k=None, lam=lam, sample_size=1) == []


# ---------------------------------------------------------------- pairs
def test_pair_errors_name_the_candidate_and_the_rule():
    with pytest.raises(
        ValueError,
        match=r"^comparator candidate 3: score nan is not a finite number; the oracle "
        r"must drop such candidates before pairs are built$",
    ):
        Pair(CandidateRef("target", 1), CandidateRef("comparator", 3), 1.0, math.nan)
    with pytest.raises(ValueError, match="must score higher"):
        Pair(CandidateRef("target", 1), CandidateRef("target", 2), 0.5, 0.5)
    with pytest.raises(ValueError, match=r"^target candidate 0: score True is not a finite number"):
        base_candidate_pairs({0: True, 1: 0.0}, tie_tolerance=0.0)
    with pytest.raises(ValueError, match=r"^target candidate 2: score inf"):
        iterative_candidate_pairs({2: math.inf}, {2: 0.0}, tie_tolerance=0.0)
    pairs = base_candidate_pairs({0: 1.0, 1: 0.0}, tie_tolerance=0.0)
    with pytest.raises(ValueError, match=r"pair target 0 > target 1 has no comparator side$"):
        select_pairs(pairs, pair_selection="comparator_reward", pairs_per_sample=None, rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"allowed: reward_gap, all, random, comparator_reward, counterfactual$"):
        select_pairs(pairs, pair_selection="best", pairs_per_sample=None, rng=np.random.default_rng(0))  # type: ignore
    with pytest.raises(ValueError, match=r"must be None when pair_selection='all' \(every pair is kept\)$"):
        select_pairs(pairs, pair_selection="all", pairs_per_sample=1, rng=np.random.default_rng(0))


# ---------------------------------------------------------------- losses
def test_accuracy_is_over_pairs_of_the_joint_margin():
    # Joint margins 2, 2, -5: two of three pairs right. (Summing over pairs instead gives -3, 2: one half.)
    margins = torch.tensor([[1.0, 1.0], [1.0, 1.0], [-5.0, 0.0]])
    assert float(preference_accuracy(margins)) == pytest.approx(2 / 3)


def test_agent_loss_shape_error_text():
    with pytest.raises(ValueError, match=r"^own_margin \(2,\) and other_margins \(3,\) must both have shape \(b,\)$"):
        madpo_agent_loss(torch.zeros(2), torch.zeros(3), 0.1)


# ---------------------------------------------------------------- scoring
@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def test_token_ids_at_both_ends_of_the_vocabulary_are_scored(tiny):
    vocab = tiny.get_input_embeddings().num_embeddings
    out = sequence_logprobs(tiny, [[0, 5], [vocab - 1]], [[0], [vocab - 1, 0]], pad_token_id=0)
    assert out.shape == (2,) and torch.isfinite(out).all() and (out < 0).all()


def test_out_of_vocabulary_ids_are_listed_first_five_with_the_row(tiny):
    vocab = tiny.get_input_embeddings().num_embeddings
    bad = list(range(vocab, vocab + 6))
    with pytest.raises(
        ValueError,
        match=rf"^completion_ids\[1\] holds token ids outside \[0, {vocab}\): "
        rf"\[{', '.join(str(i) for i in bad[:5])}\]$",
    ):
        sequence_logprobs(tiny, [[5], [6]], [[7], bad], pad_token_id=0)
    with pytest.raises(ValueError, match=rf"^prompt_ids\[0\] holds token ids outside \[0, {vocab}\): \[-1\]$"):
        sequence_logprobs(tiny, [[-1]], [[7]], pad_token_id=0)
    with pytest.raises(
        ValueError,
        match=r"^prompt_ids has 2 rows but completion_ids has 1; pass one completion "
        r"per prompt$",
    ):
        sequence_logprobs(tiny, [[5], [6]], [[7]], pad_token_id=0)


def test_empty_batch_and_empty_completions_score_float64_zeros(tiny):
    none = sequence_logprobs(tiny, [], [], pad_token_id=0)
    assert none.shape == (0,) and none.dtype == torch.float64
    empty = sequence_logprobs(tiny, [[5, 6], [7]], [[], []], pad_token_id=0)
    assert empty.dtype == torch.float64 and empty.tolist() == [0.0, 0.0]


# ---------------------------------------------------------------- madpo
PROMPTS = [[2, 40, 41, 42, 3, 2, 50], [2, 60, 61, 3, 2, 50]]
WINNERS = [[70, 71, 72, 3], [80, 81, 3]]
LOSERS = [[90, 91, 3], [100, 101, 102, 103, 104]]


def _policy(model_dir, seed: int, lr: float = 1.0) -> TrainablePolicy:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=gen))
    return TrainablePolicy(model, torch.optim.SGD(model.parameters(), lr=lr), pad_token_id=0)


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in model.parameters()]).double()


def _brute_margin_and_grad(model, prompt, winner, loser) -> tuple[float, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    margin = 0.0
    for sign, completion in ((1.0, winner), (-1.0, loser)):
        logp = torch.log_softmax(model(input_ids=torch.tensor([prompt + completion])).logits[0].double(), -1)
        margin = margin + sign * sum(logp[len(prompt) - 1 + j, t] for j, t in enumerate(completion))
    margin.backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters()]).double()
    model.zero_grad(set_to_none=True)
    return float(margin), grad


def test_each_pair_weighs_agent_gradients_by_its_own_joint_margin(tiny_model_dir):
    """Two pairs, SGD at lr 1: agent 0 moves by (β / b) Σ_j σ(−β Δ^j) ∇Δ_0^j, Δ^j = Δ_0^j + Δ_1^j per pair."""
    beta = 0.5
    agents = [_policy(tiny_model_dir, 30), _policy(tiny_model_dir, 31)]
    refs = [_policy(tiny_model_dir, 30).model, _policy(tiny_model_dir, 31).model]
    w1 = [[110, 111, 112, 113, 3], [120, 3]]  # agent 1: pair 0 strongly against, pair 1 for the winner
    l1 = [[130, 3], [140, 141, 142, 143, 3]]
    m0 = [_brute_margin_and_grad(refs[0], PROMPTS[j], WINNERS[j], LOSERS[j]) for j in range(2)]
    m1 = [_brute_margin_and_grad(refs[1], PROMPTS[j], w1[j], l1[j])[0] for j in range(2)]
    joint = [m0[j][0] + m1[j] for j in range(2)]
    expected = sum(beta / 2 / (1 + math.exp(beta * joint[j])) * m0[j][1] for j in range(2))

    before = _flat(agents[0].model)
    stats = madpo_step(
        agents, PairBatch([PROMPTS, PROMPTS], [WINNERS, w1], [LOSERS, l1]), beta=beta, max_grad_norm=None
    )
    assert torch.allclose(_flat(agents[0].model) - before, expected, rtol=1e-3, atol=5e-6)
    assert stats.accuracy == pytest.approx(sum(d > 0 for d in joint) / 2)
    assert stats.loss == pytest.approx(sum(math.log1p(math.exp(-beta * d)) for d in joint) / 2, rel=1e-5)
    assert all(p.grad is None for a in agents for p in a.model.parameters())  # no gradient left behind


def test_agent_with_only_identical_pairs_stays_and_the_next_agent_still_moves(tiny_model_dir):
    agents = [_policy(tiny_model_dir, 30, lr=1e-2), _policy(tiny_model_dir, 31, lr=1e-2)]
    before = [_flat(a.model) for a in agents]
    stats = madpo_step(
        agents, PairBatch([PROMPTS, PROMPTS], [WINNERS, WINNERS], [WINNERS, LOSERS]), beta=0.1, max_grad_norm=1.0
    )
    assert stats.skipped == (False, False)  # nothing to learn is not a skipped (failed) step
    assert torch.equal(_flat(agents[0].model), before[0])
    assert not torch.equal(_flat(agents[1].model), before[1])


def test_non_finite_gradient_skips_only_that_agent(tiny_model_dir):
    agents = [_policy(tiny_model_dir, 30, lr=1e-2), _policy(tiny_model_dir, 31, lr=1e-2)]
    before = [_flat(a.model) for a in agents]
    # Agent 0's loss is finite, but one of its gradients becomes infinite.
    next(agents[0].model.parameters()).register_hook(lambda g: g * math.inf)
    stats = madpo_step(
        agents, PairBatch([PROMPTS, PROMPTS], [WINNERS, WINNERS], [LOSERS, LOSERS]), beta=0.1, max_grad_norm=1.0
    )
    assert stats.skipped == (True, False)
    assert torch.equal(_flat(agents[0].model), before[0])
    assert not torch.equal(_flat(agents[1].model), before[1])
    assert all(p.grad is None for a in agents for p in a.model.parameters())


def test_micro_batches_accumulate_past_a_trainable_parameter_the_loss_never_reaches(tiny_model_dir):
    """One agent, two pairs in micro-batches of one, SGD at lr 1: it moves by (β / b) Σ_j σ(−β Δ^j) ∇Δ^j (the
    whole-batch step), though one trainable parameter is outside the forward (its gradient is None in every
    micro-batch: it must stay None, not break the accumulation)."""
    beta = 0.5
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(30)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=gen))
    model.register_parameter("unused", torch.nn.Parameter(torch.ones(3)))
    agent = TrainablePolicy(model, torch.optim.SGD(model.parameters(), lr=1.0), pad_token_id=0)
    ref = _policy(tiny_model_dir, 30).model
    brute = [_brute_margin_and_grad(ref, PROMPTS[j], WINNERS[j], LOSERS[j]) for j in range(2)]
    expected = sum(beta / 2 / (1 + math.exp(beta * m)) * g for m, g in brute)

    def used() -> torch.Tensor:
        return torch.cat([p.detach().flatten().clone() for n, p in model.named_parameters() if n != "unused"]).double()

    before = used()
    stats = madpo_step(
        [agent], PairBatch([PROMPTS], [WINNERS], [LOSERS]), beta=beta, max_grad_norm=None, micro_batch_size=1
    )
    assert stats.skipped == (False,)
    assert torch.allclose(used() - before, expected, rtol=1e-3, atol=5e-6)
    assert torch.equal(model.unused.detach(), torch.ones(3)) and model.unused.grad is None


def test_micro_seed_hand_values():
    from pbrl.learning.madpo import micro_seed

    assert micro_seed(None, 0) is None and micro_seed(None, 3) is None
    assert micro_seed(5, 0) == 5  # micro-batch 0 keeps the agent's seed
    assert (micro_seed(5, 1), micro_seed(5, 2)) == (5_000_016, 5_000_017)  # 5 · 1 000 003 + index
    assert micro_seed(2**62, 3) == 2**62 + 3  # (2^62 · odd) mod 2^63 = 2^62: kept below 2^63


def test_has_dropout_needs_a_positive_rate():
    from pbrl.models.forward import has_dropout

    assert not has_dropout(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.0)))
    assert has_dropout(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1)))


def test_scorer_choice_follows_activation_checkpointing(tiny_model_dir):
    from pbrl.learning.logprobs import shared_prompt_logprobs
    from pbrl.learning.madpo import _score

    class Old:  # transformers < 5 names it is_gradient_checkpointing only
        is_gradient_checkpointing = True

    class Plain:
        pass

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert _score(model) is shared_prompt_logprobs
    model.gradient_checkpointing_enable()
    assert _score(model) is sequence_logprobs  # the KV cache is off under checkpointing
    assert _score(Old()) is sequence_logprobs and _score(Plain()) is shared_prompt_logprobs


def test_micro_batch_margins_use_each_micro_batchs_dropout_seed(tiny_model_dir, tmp_path):
    """Dropout on, micro-batches of one pair: the reported margins are those of the training forwards with
    micro-batch k's seed (micro_seed(seed, k)), for two agents (the detached pass) and for one (its own pass)."""
    from pbrl.learning.madpo import agent_margins, micro_seed

    agents = [lora_dropout_policy(tiny_model_dir, tmp_path, s) for s in (0, 1)]  # SGD at lr 0: nothing moves
    seeds = [7, 11]

    def expected(policy, seed):
        with torch.no_grad():
            return torch.cat(
                [
                    agent_margins(
                        policy, PROMPTS[k : k + 1], WINNERS[k : k + 1], LOSERS[k : k + 1], micro_seed(seed, k)
                    )
                    for k in range(2)
                ]
            )

    want = [expected(a, s) for a, s in zip(agents, seeds, strict=True)]
    with torch.no_grad():
        evaluated = agent_margins(agents[0], PROMPTS, WINNERS, LOSERS)
    assert not torch.allclose(want[0].float(), evaluated.float(), atol=1e-3)  # the dropout masks matter
    batch = PairBatch([PROMPTS, PROMPTS], [WINNERS, WINNERS], [LOSERS, LOSERS])
    stats = madpo_step(agents, batch, beta=0.1, max_grad_norm=1.0, seeds=seeds, micro_batch_size=1)
    assert torch.allclose(stats.margins, torch.stack(want, dim=1).float(), atol=1e-5)
    one = madpo_step(
        agents[:1],
        PairBatch([PROMPTS], [WINNERS], [LOSERS]),
        beta=0.1,
        max_grad_norm=1.0,
        seeds=seeds[:1],
        micro_batch_size=1,
    )
    assert torch.allclose(one.margins[:, 0], want[0].float(), atol=1e-5)
    with pytest.raises(ValueError) as info:
        madpo_step(agents, batch, beta=0.1, max_grad_norm=1.0)
    assert str(info.value) == (
        "seeds: a policy has dropout (lora_dropout > 0), so its training forwards need one dropout seed per agent"
    )


def test_accumulation_sums_every_micro_batch_skips_identical_pairs_and_clips(tiny_model_dir):
    """Four pairs in micro-batches of one, SGD at lr 1: pairs 0 and 3 are identical (no gradient, first and
    last), pairs 1 and 2 carry the step, (β / 4) Σ_j σ(−β Δ^j) ∇Δ^j, accumulated past a trainable parameter the
    loss never reaches. Then the same with the gradient norm clipped to a tenth of its norm."""
    beta = 0.5
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]]
    winners = [WINNERS[0], WINNERS[0], WINNERS[1], LOSERS[1]]
    losers = [WINNERS[0], LOSERS[0], LOSERS[1], LOSERS[1]]
    ref = _policy(tiny_model_dir, 30).model
    brute = [_brute_margin_and_grad(ref, prompts[j], winners[j], losers[j]) for j in (1, 2)]
    expected = sum(beta / 4 / (1 + math.exp(beta * m)) * g for m, g in brute)

    def agent():
        policy = _policy(tiny_model_dir, 30)
        policy.model.register_parameter("unused", torch.nn.Parameter(torch.ones(3)))
        policy.optimizer = torch.optim.SGD(policy.model.parameters(), lr=1.0)
        return policy

    def used(model) -> torch.Tensor:
        return torch.cat([p.detach().flatten().clone() for n, p in model.named_parameters() if n != "unused"]).double()

    norm = float(expected.norm())
    for max_grad_norm in (None, norm / 10):
        policy = agent()
        before = used(policy.model)
        stats = madpo_step(
            [policy],
            PairBatch([prompts], [winners], [losers]),
            beta=beta,
            max_grad_norm=max_grad_norm,
            micro_batch_size=1,
        )
        moved = used(policy.model) - before
        assert stats.skipped == (False,) and policy.model.unused.grad is None
        scale = 1.0 if max_grad_norm is None else max_grad_norm / (norm + 1e-6)  # clip_grad_norm_'s factor
        assert torch.allclose(moved, scale * expected, rtol=1e-3, atol=5e-6 * scale)


def test_fp16_accumulated_step_goes_through_the_loss_scaler(tiny_model_dir):
    """fp16, micro-batches of one, scale 2^120: the float16 gradients overflow, so the step is skipped, the
    weights stay and the scale halves (the scaler is the agent's, not a fresh unscaled backward)."""
    from pbrl.models.precision import make_precision

    policy = _policy(tiny_model_dir, 30, lr=1e-2)
    policy.precision = make_precision("fp16", "cpu")
    policy.precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**120)
    before = _flat(policy.model)
    stats = madpo_step(
        [policy], PairBatch([PROMPTS], [WINNERS], [LOSERS]), beta=0.1, max_grad_norm=1.0, micro_batch_size=1
    )
    assert stats.skipped == (True,) and policy.precision.scaler.get_scale() == 2.0**119
    assert torch.equal(_flat(policy.model), before)


def test_token_logprobs_of_all_empty_completions_have_zero_columns(tiny):
    from pbrl.learning.logprobs import completion_token_logprobs

    logps, mask = completion_token_logprobs(tiny, [[2, 40], [2]], [[], []], pad_token_id=0)
    assert logps.shape == (2, 0) and logps.dtype == torch.float32
    assert mask.shape == (2, 0) and mask.dtype == torch.bool


def test_token_logprobs_run_in_eval_mode_unless_asked(tiny_model_dir, tmp_path):
    """A model left in train mode with LoRA dropout 0.5: the default call is deterministic (eval mode) and
    gives the eval values; dropout=True keeps train mode, so the masks change the values."""
    from pbrl.learning.logprobs import completion_token_logprobs

    model = lora_dropout_policy(tiny_model_dir, tmp_path).model
    model.train()
    first = completion_token_logprobs(model, PROMPTS, WINNERS, pad_token_id=0)[0]
    assert torch.equal(first, completion_token_logprobs(model, PROMPTS, WINNERS, pad_token_id=0)[0])
    model.eval()
    assert torch.equal(first, completion_token_logprobs(model, PROMPTS, WINNERS, pad_token_id=0)[0])
    model.train()
    torch.manual_seed(0)
    noisy = completion_token_logprobs(model, PROMPTS, WINNERS, pad_token_id=0, dropout=True)[0]
    assert not torch.allclose(noisy, first, atol=1e-4) and model.training


def test_margins_under_activation_checkpointing_score_rows_in_one_padded_pass(tiny_model_dir):
    """With gradient checkpointing on, a training forward has no KV cache, so agent_margins must score with
    sequence_logprobs: its margins are then sequence_logprobs' winner minus loser values."""
    from pbrl.learning.madpo import agent_margins

    policy = _policy(tiny_model_dir, 30)
    policy.model.gradient_checkpointing_enable()
    got = agent_margins(policy, PROMPTS, WINNERS, LOSERS, seed=0)
    with torch.no_grad():
        want = sequence_logprobs(policy.model, PROMPTS, WINNERS, pad_token_id=0) - sequence_logprobs(
            policy.model, PROMPTS, LOSERS, pad_token_id=0
        )
    assert torch.allclose(got.detach().double(), want, atol=1e-5)


def test_a_non_finite_earlier_micro_batch_skips_the_whole_step(tiny_model_dir, monkeypatch):
    """Micro-batch 0's margin is NaN, micro-batch 1's is finite: the batch loss is NaN, so the agent's step is
    skipped and nothing moves (not a step on the finite micro-batches alone)."""
    import pbrl.learning.madpo as madpo

    real = madpo.agent_margins

    def poisoned(policy, prompt_ids, winner_ids, loser_ids, seed=None):
        out = real(policy, prompt_ids, winner_ids, loser_ids, seed)
        return out * math.nan if list(winner_ids[0]) == WINNERS[0] else out

    monkeypatch.setattr(madpo, "agent_margins", poisoned)
    policy = _policy(tiny_model_dir, 30, lr=1e-2)
    before = _flat(policy.model)
    stats = madpo_step(
        [policy], PairBatch([PROMPTS], [WINNERS], [LOSERS]), beta=0.1, max_grad_norm=1.0, micro_batch_size=1
    )
    assert stats.skipped == (True,) and torch.equal(_flat(policy.model), before)


def test_fp16_accumulation_unscales_each_earlier_micro_batch_once(tiny_model_dir):
    """fp16 (loss scale 2^16), two pairs in micro-batches of one, SGD at lr 1: the step is the float32 one,
    (β / 2) Σ_j σ(−β Δ^j) ∇Δ^j, to float16 rounding. Micro-batch 0's gradient is taken on the scaled loss and
    divided by the scale once; divided twice or multiplied instead, it would be off by a factor 2^±32."""
    from pbrl.models.precision import make_precision

    beta = 0.5
    ref = _policy(tiny_model_dir, 30).model
    brute = [_brute_margin_and_grad(ref, PROMPTS[j], WINNERS[j], LOSERS[j]) for j in range(2)]
    expected = sum(beta / 2 / (1 + math.exp(beta * m)) * g for m, g in brute)
    policy = _policy(tiny_model_dir, 30)
    policy.precision = make_precision("fp16", "cpu")
    before = _flat(policy.model)
    stats = madpo_step(
        [policy], PairBatch([PROMPTS], [WINNERS], [LOSERS]), beta=beta, max_grad_norm=None, micro_batch_size=1
    )
    moved = _flat(policy.model) - before
    assert stats.skipped == (False,)
    scale = float(expected.abs().max())
    assert float((moved - expected).abs().max()) < 0.02 * scale


def test_training_forward_margins_run_under_the_policys_autocast(tiny_model_dir):
    """With a dropout seed (a training forward), agent_margins runs under the policy's autocast too: bfloat16
    margins differ from the float32 ones by more than float32 rounding, yet stay close."""
    from pbrl.learning.madpo import agent_margins
    from pbrl.models.precision import make_precision

    policy = _policy(tiny_model_dir, 30)
    full = agent_margins(policy, PROMPTS, WINNERS, LOSERS, seed=0).detach()
    policy.precision = make_precision("bf16", "cpu")
    half = agent_margins(policy, PROMPTS, WINNERS, LOSERS, seed=0).detach()
    assert not torch.equal(half, full) and torch.allclose(half, full, atol=0.05)


def test_shared_prompt_scoring_of_an_empty_batch(tiny):
    from pbrl.learning.logprobs import shared_prompt_logprobs

    out = shared_prompt_logprobs(tiny, [], [], pad_token_id=0)
    assert out.shape == (0,) and out.dtype == torch.float64
