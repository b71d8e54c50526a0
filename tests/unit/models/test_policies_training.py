"""Training forwards and weights of a policy being updated (issue #16 item 9).

- With ``torch_dtype: bfloat16``, no LoRA and lr 5e-6, 7.9 % of the weights and none of the norm weights
  moved after a round: an AdamW step of ~5e-6 is below half the bfloat16 spacing of any weight above
  ~1.3e-3 (spacing 2^-7 at 1.0). Trainable parameters are now float32 master weights.
- ``lora_dropout`` never took effect: every forward ran in eval mode. Training forwards now run in train mode,
  with masks drawn from an explicit seed.
"""

from __future__ import annotations

import pytest
import torch

from pbrl.learning.madpo import PairBatch, agent_margins
from pbrl.models.forward import training_forward
from pbrl.models.loading import init_lora_adapter, load_policy
from pbrl.models.lora import LoraSettings
from pbrl.models.policies import TrainablePolicy, trainable_parameters
from tests.helpers import madpo_step

PROMPTS = [[2, 40, 41, 42, 3, 2, 50], [2, 60, 61, 3, 2, 50]]
WINNERS = [[70, 71, 72, 3], [80, 81, 3]]
LOSERS = [[90, 91, 3], [100, 101, 102, 103, 104]]
BATCH = PairBatch(prompt_ids=[PROMPTS, PROMPTS], winner_ids=[WINNERS, WINNERS], loser_ids=[LOSERS, LOSERS])


def agents(
    model_dir, *, dtype: str, lr: float, lora: LoraSettings | None = None, adapter_root=None
) -> list[TrainablePolicy]:
    out = []
    for i in range(2):
        adapter = init_lora_adapter(model_dir, lora, adapter_root / f"agent_{i}", seed=i) if lora else None
        model = load_policy(model_dir, checkpoint_dir=adapter, lora=lora, dtype=dtype, trainable=True)
        optimizer = torch.optim.AdamW(trainable_parameters(model), lr=lr, weight_decay=0.0)
        out.append(TrainablePolicy(model, optimizer, pad_token_id=0))
    return out


def snapshot(policy: TrainablePolicy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in policy.model.named_parameters()}


# --- float32 master weights -------------------------------------------------------------------------------


def test_bf16_full_fine_tuning_moves_every_weight_incl_norms_at_lr_5e6(tiny_model_dir):
    policies = agents(tiny_model_dir, dtype="bfloat16", lr=5e-6)
    before = [snapshot(p) for p in policies]
    stats = madpo_step(policies, BATCH, beta=0.1, max_grad_norm=1.0)
    assert stats.skipped == (False, False)
    for policy, old in zip(policies, before, strict=True):
        params = dict(policy.model.named_parameters())
        norms = [n for n in params if n.endswith("norm.weight")]
        assert len(norms) == 5  # 2 layers x (input, post-attention) + the final norm
        for name, param in params.items():
            assert param.dtype == torch.float32, name
            assert not torch.equal(param, old[name]), f"{name} did not move"
        # Norm weights start at exactly 1.0. Adam's first step moves each element by lr·|g| / (|g| + ε) ≤ lr,
        # (= lr unless |g| is near ε = 1e-8), give or take float32's spacing near 1.0 (2^-23 ≈ 1.2e-7). Every
        # element moves; in bfloat16 (spacing 2^-7 ≈ 7.8e-3) none of them did.
        for name in norms:
            moved = (params[name] - old[name]).abs()
            assert bool((moved > 0).all()) and bool((moved <= 5e-6 + 1.2e-7).all()), name
            assert float(moved.median()) == pytest.approx(5e-6, abs=1.2e-7), name


def test_bf16_lora_keeps_the_base_in_bf16_and_trains_float32_adapters(tiny_model_dir, tmp_path):
    lora = LoraSettings(r=4, target_modules=("q_proj", "v_proj"))
    policies = agents(tiny_model_dir, dtype="bfloat16", lr=5e-6, lora=lora, adapter_root=tmp_path)
    before = [snapshot(p) for p in policies]
    # lora_B starts at zero, so lora_A's first gradient is zero: two steps move every adapter weight.
    madpo_step(policies, BATCH, beta=0.1, max_grad_norm=1.0)
    madpo_step(policies, BATCH, beta=0.1, max_grad_norm=1.0)
    for policy, old in zip(policies, before, strict=True):
        for name, param in policy.model.named_parameters():
            if param.requires_grad:
                assert "lora_" in name and param.dtype == torch.float32, name
                assert not torch.equal(param, old[name]), f"{name} did not move"
            else:
                assert param.dtype == torch.bfloat16 and torch.equal(param, old[name]), name


def test_frozen_bf16_policy_stays_bf16(tiny_model_dir):
    model = load_policy(tiny_model_dir, checkpoint_dir=None, lora=None, dtype="bfloat16", trainable=False)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not model.training


# --- dropout in training forwards ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_policies(tiny_model_dir, tmp_path_factory):
    """Agent 0 with lora_dropout 0.5 and with 0.0, same adapter weights (lora_B made non-zero, so the
    adapter path, where the dropout sits, changes the output)."""
    out = {}
    for dropout in (0.5, 0.0):
        lora = LoraSettings(r=4, dropout=dropout)
        adapter = init_lora_adapter(tiny_model_dir, lora, tmp_path_factory.mktemp(f"drop{dropout}"), seed=0)
        model = load_policy(tiny_model_dir, checkpoint_dir=adapter, lora=lora, trainable=True)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.fill_(0.1)
        out[dropout] = TrainablePolicy(model, torch.optim.SGD(trainable_parameters(model), lr=0.0), 0)
    return out


def test_lora_dropout_acts_in_training_forwards_drawn_from_the_seed(lora_policies):
    policy = lora_policies[0.5]
    rng = torch.get_rng_state()
    first = agent_margins(policy, PROMPTS, WINNERS, LOSERS, 1)
    same = agent_margins(policy, PROMPTS, WINNERS, LOSERS, 1)
    other = agent_margins(policy, PROMPTS, WINNERS, LOSERS, 2)
    with torch.no_grad():
        evaluated = agent_margins(policy, PROMPTS, WINNERS, LOSERS)
    assert first.requires_grad
    assert torch.equal(first, same)
    assert not torch.allclose(first, other, atol=1e-3) and not torch.allclose(first, evaluated, atol=1e-3)
    assert torch.equal(torch.get_rng_state(), rng)  # the global stream is neither read nor advanced
    assert policy.model.training  # each module's mode is as before


def test_without_dropout_a_training_forward_equals_the_eval_forward(lora_policies):
    policy = lora_policies[0.0]
    trained = agent_margins(policy, PROMPTS, WINNERS, LOSERS, 1)
    with torch.no_grad():
        evaluated = agent_margins(policy, PROMPTS, WINNERS, LOSERS)
    assert torch.equal(trained.detach(), evaluated)
    # ... and equals the dropout model's eval forward: same weights, dropout off in eval mode.
    with torch.no_grad():
        assert torch.equal(agent_margins(lora_policies[0.5], PROMPTS, WINNERS, LOSERS), evaluated)


def test_training_forward_sets_train_mode_inside_and_restores_modes(lora_policies):
    model = lora_policies[0.5].model
    model.eval()
    seen = []
    handle = model.register_forward_hook(lambda module, args, out: seen.append(module.training))
    try:
        with training_forward(model, seed=3), torch.no_grad():
            model(input_ids=torch.tensor([[5, 6, 7]]))
    finally:
        handle.remove()
        modes = {m.training for m in model.modules()}
        model.train()
    assert seen == [True] and modes == {False}


def test_madpo_step_requires_dropout_seeds_one_per_agent(lora_policies):
    policies = [lora_policies[0.5], lora_policies[0.0]]
    with pytest.raises(ValueError, match="seeds: a policy has dropout"):
        madpo_step(policies, BATCH, beta=0.1, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="seeds: got 1 for 2 agents"):
        madpo_step(policies, BATCH, beta=0.1, max_grad_norm=1.0, seeds=[1])


def test_madpo_step_with_dropout_is_repeatable_from_its_seeds(tiny_model_dir, tmp_path):
    """Same seeds -> bitwise the same update (a resumed round equals an uninterrupted one); other seeds ->
    other dropout masks, so another update."""
    lora = LoraSettings(r=4, dropout=0.5, target_modules=("q_proj", "v_proj"))
    results = []
    for seeds in ([11, 12], [11, 12], [21, 22]):
        root = tmp_path / str(len(results))
        policies = agents(tiny_model_dir, dtype="float32", lr=1e-2, lora=lora, adapter_root=root)
        madpo_step(policies, BATCH, beta=0.1, max_grad_norm=1.0, seeds=seeds)
        stats = madpo_step(policies, BATCH, beta=0.1, max_grad_norm=1.0, seeds=[s + 1 for s in seeds])
        results.append((stats.margins, snapshot(policies[0])))
    (m0, w0), (m1, w1), (m2, w2) = results
    assert torch.equal(m0, m1) and all(torch.equal(w0[n], w1[n]) for n in w0)
    assert not torch.equal(m0, m2)
    assert any(not torch.equal(w0[n], w2[n]) for n in w0 if "lora_" in n)


def test_lora_dropout_through_update_policies(tiny_model_dir, tmp_path):
    """The configured ``lora_dropout`` reaches the stage's training forwards: same pairs, other adapter
    than without dropout; and a rerun of the stage writes bitwise the same adapter (seeded masks)."""
    from safetensors.torch import load_file

    from pbrl.data.storage import RunPaths
    from stages import STAGE_MODULES
    from tests.helpers import new_run

    stages = [
        "sample-candidates",
        "score-with-oracle",
        "build-pairs",
        "store-round",
        "replay-select",
        "update-policies",
    ]
    adapters, pairs = {}, {}
    for dropout in (0.0, 0.5):
        run_dir, job = new_run(
            tiny_model_dir, tmp_path / str(dropout), lora_r=4, lora_dropout=dropout, agent_learning_rate=1e-2
        )
        for name in stages:
            STAGE_MODULES[name].run(run_dir, 1, job)
        paths = RunPaths(run_dir)
        pairs[dropout] = paths.pairs(1).read_bytes()
        adapters[dropout] = load_file(paths.round_checkpoint(1) / "agent_0" / "adapter_model.safetensors")
    assert pairs[0.0] == pairs[0.5]  # sampling runs in eval mode: dropout does not touch the candidates
    assert any(not torch.equal(adapters[0.0][k], adapters[0.5][k]) for k in adapters[0.0])

    STAGE_MODULES["update-policies"].run(run_dir, 1, job)  # the rerun of the dropout run's update
    again = load_file(paths.round_checkpoint(1) / "agent_0" / "adapter_model.safetensors")
    assert all(torch.equal(again[k], adapters[0.5][k]) for k in again)
