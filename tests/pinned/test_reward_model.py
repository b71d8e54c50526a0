"""The joint reward model (``pbrl/learning/reward_model.py``, ``reward_fit.py``,
docs/design/algorithms.md#joint-reward-model) pinned where ``make mutate`` found behaviour no
fast test checked (docs/results/mutation.md#the-last-measured-run). The stage tests of
``tests/unit/learning/test_reward_model.py`` run a whole
MARLHF round in a module fixture, too slow to run once per mutant; these pin the same pieces without a round.
Expectations are worked out by hand (one-token templates, a one-parameter stand-in scorer whose AdamW step is
known in closed form), or come from the tokenizer itself, never from the function under test.

Wrong versions (mutmut ids of ``pbrl/learning/reward_model.py`` and ``reward_fit.py``) made to fail here, by family:

- ``pair_joint_rows``: ``max_length`` not passed for the winner or the loser, a pair kept when only one side
  does not fit (``reason = None``, ``and``), the cut counted as a difference or one side only, ids kept for a
  dropped pair, the pair id or a field name changed.
- ``joint_template_for``: the marker text or agent count, the vocabulary check skipped or naming no model,
  the field named in a missing-folder error (``field=None``).
- ``reward_device``: the configured device ignored, the first agent's device not the one taken.
- ``newest_reward_model``: an unfitted round taken, the newest round skipped (range bounds), the folder not
  under the run.
- ``score_joint`` / ``pair_metrics``: the batching (``batch_size`` slices), the margin sign, accuracy counting
  a zero margin, the NaN of no pairs.
- ``fit_bradley_terry``: the step count, a non-finite loss or gradient norm not skipped (or stepping, or
  stopping the pass), the skip count set instead of added, the gradient norm not clipped, the winner and loser
  halves swapped.
- ``RewardScorer.score``: a dropped joint response given a score, scores out of order, ``reward_max_length``
  not read from the saved record.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from pbrl.data.storage import RunPaths, StageManifest, write_manifest
from pbrl.errors import ConfigError
from pbrl.learning.joint_template import (
    DROP_TOO_LONG,
    JointTemplate,
    joint_input_ids,
    joint_template_for,
    pair_joint_rows,
)
from pbrl.learning.reward_fit import fit_bradley_terry, heldout_split, pair_metrics
from pbrl.learning.reward_model import score_joint
from pbrl.learning.reward_model_build import RewardModelSpec, new_reward_model, save_reward_model
from pbrl.learning.reward_scoring import RewardScorer, reward_device
from pbrl.models.loading import load_tokenizer
from pbrl.run.reward_records import newest_reward_model

# One-token template pieces: 6 fixed tokens for two agents (header, 2 prompt markers, 2 response markers, 1 sep).
T = JointTemplate(header=(1,), prompt_markers=((2,), (3,)), response_markers=((4,), (5,)), separator=(6,))
PROMPTS = [[10, 11, 12], [20, 21]]


def _softplus(x: float) -> float:
    return math.log1p(math.exp(x))


# ---------------------------------------------------------------------------------------------- pair rows
def test_pair_joint_rows_cut_both_sides_and_drop_a_pair_when_either_side_does_not_fit():
    pairs = [
        # winner 6 + 5 response + 5 prompt = 16 tokens (cut 4), loser 6 + 2 + 5 = 13 (cut 1)
        {"pair_id": "p-both", "prompt_ids": PROMPTS, "winner_ids": [[30, 31], [40, 41, 42]], "loser_ids": [[32], [43]]},
        # loser's markers and responses alone are 6 + 7 = 13 > 12: the pair goes, though the winner fits
        {
            "pair_id": "p-loser",
            "prompt_ids": PROMPTS,
            "winner_ids": [[30], [40]],
            "loser_ids": [[30, 31, 32, 33], [40, 41, 42]],
        },
        # the winner does not fit, the loser does
        {
            "pair_id": "p-winner",
            "prompt_ids": PROMPTS,
            "winner_ids": [[30, 31, 32, 33], [40, 41, 42]],
            "loser_ids": [[30], [40]],
        },
    ]
    rows = pair_joint_rows(pairs, T, 12)
    assert rows[0] == {
        "pair_id": "p-both",
        "winner_joint_ids": [1, 2, 6, 3, 21, 4, 30, 31, 5, 40, 41, 42],
        "loser_joint_ids": [1, 2, 11, 12, 6, 3, 20, 21, 4, 32, 5, 43],
        "prompt_tokens_cut": 4 + 1,
        "dropped": None,
    }
    # winner of p-loser: 6 + 2 + 5 = 13 tokens, one prompt token cut; a dropped side cuts nothing
    assert rows[1] == {
        "pair_id": "p-loser",
        "winner_joint_ids": None,
        "loser_joint_ids": None,
        "prompt_tokens_cut": 1,
        "dropped": DROP_TOO_LONG,
    }
    assert rows[2] == {
        "pair_id": "p-winner",
        "winner_joint_ids": None,
        "loser_joint_ids": None,
        "prompt_tokens_cut": 1,
        "dropped": DROP_TOO_LONG,
    }
    uncut = pair_joint_rows(pairs[:1], T, None)[0]
    assert uncut["winner_joint_ids"] == [1, 2, 10, 11, 12, 6, 3, 20, 21, 4, 30, 31, 5, 40, 41, 42]  # prompts first
    assert uncut["prompt_tokens_cut"] == 0 and uncut["dropped"] is None


# ---------------------------------------------------------------------------------------------- template
def test_joint_template_for_tokenizes_the_marker_text_once_per_agent(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)

    def enc(text: str) -> tuple[int, ...]:
        return tuple(tokenizer(text, add_special_tokens=False).input_ids)

    template, got_tokenizer = joint_template_for(str(tiny_model_dir), [str(tiny_model_dir)] * 3)
    assert template.header == enc("Joint multi-agent response\n")
    assert template.prompt_markers == tuple(enc(f"### Agent {k} prompt\n") for k in (1, 2, 3))
    assert template.response_markers == tuple(enc(f"\n### Agent {k} response\n") for k in (1, 2, 3))
    assert template.separator == enc("\n")
    assert got_tokenizer.get_vocab() == tokenizer.get_vocab()


def test_joint_template_for_refuses_another_vocabulary_and_names_the_field(tiny_model_dir, tmp_path):
    from pbrl.models.tiny import build_tiny_model

    other = str(build_tiny_model(tmp_path / "other", seed=5))
    with pytest.raises(ValueError) as info:
        joint_template_for(str(tiny_model_dir), [str(tiny_model_dir), other])
    assert str(info.value) == (
        f"reward_model_name: '{tiny_model_dir}' has another vocabulary than agent 1's model; "
        "the joint reward model reads the agents' token ids, so give a backbone with the "
        "agents' tokenizer"
    )
    with pytest.raises(ConfigError) as info:
        joint_template_for(str(tmp_path / "missing" / "rm"), [str(tiny_model_dir)])
    assert [p.field for p in info.value.problems] == ["reward_model_name"]
    with pytest.raises(ConfigError) as info:
        joint_template_for(str(tiny_model_dir), [str(tmp_path / "missing" / "agent")])
    assert [p.field for p in info.value.problems] == ["agent_model"]


class AddsBos:
    """A tokenizer that prepends a BOS id (7) unless told not to, as many do; text -> one id per character."""

    def __call__(self, text, add_special_tokens=True):
        class Out:
            input_ids = ([7] if add_special_tokens else []) + [ord(ch) % 50 + 100 for ch in text]

        return Out()


def test_template_markers_carry_no_special_tokens():
    template = JointTemplate.build(AddsBos(), 1)
    assert template.header == tuple(ord(ch) % 50 + 100 for ch in "Joint multi-agent response\n")
    assert template.separator == (ord("\n") % 50 + 100,)
    assert 7 not in template.prompt_markers[0] + template.response_markers[0]


def test_run_folder_paths():
    from pbrl.learning.rl import rollouts_path
    from pbrl.run.reward_records import pair_joint_ids_path, reward_model_dir

    assert reward_model_dir(tmp := Path("runs/x/rounds/0002")) == Path("runs/x/rounds/0002/reward_model")
    assert reward_model_dir(str(tmp)) == Path("runs/x/rounds/0002/reward_model")
    assert pair_joint_ids_path(str(tmp)) == Path("runs/x/rounds/0002/pair_joint_ids.parquet")
    assert rollouts_path(str(tmp)) == Path("runs/x/rounds/0002/rollouts.parquet")


# ---------------------------------------------------------------------------------------------- device
def test_reward_device_is_the_configured_one_else_the_first_agents():
    assert reward_device("meta", ["cpu", "cpu"], 2) == "meta"
    assert reward_device(None, ["meta", "cpu"], 2) == "meta"
    assert reward_device("", "meta", 3) == "meta"
    assert reward_device(None, None, 2) == ("cuda:0" if torch.cuda.is_available() else "cpu")


# ---------------------------------------------------------------------------------------------- newest
def test_newest_reward_model_is_the_newest_fitted_round_before(tmp_path):
    paths = RunPaths(tmp_path / "run")
    for r, fitted in ((1, True), (2, False), (3, True)):
        details = {"fitted": fitted, "reward_model": f"rounds/000{r}/reward_model"} if fitted else {"fitted": False}
        write_manifest(paths, StageManifest(stage="fit-reward-model", round_index=r, config_hash="h", details=details))
    assert newest_reward_model(paths, 1) is None
    assert newest_reward_model(paths, 2) == (1, tmp_path / "run" / "rounds/0001/reward_model")
    assert newest_reward_model(paths, 3) == (1, tmp_path / "run" / "rounds/0001/reward_model")  # round 2 unfitted
    assert newest_reward_model(paths, 4) == (3, tmp_path / "run" / "rounds/0003/reward_model")
    assert newest_reward_model(RunPaths(tmp_path / "empty"), 5) is None


# ---------------------------------------------------------------------------------------------- scoring
class TwoWeights(nn.Module):
    """R(row) = (a + b) · row[0], a = b = 0 at the start: every score is 0 (L = log 2 per pair) and
    dL/da = dL/db = −σ(0)·(x_w − x_l) = −(x_w − x_l)/2. With x_w = 3e38, x_l = −3e38 the loss is still log 2,
    but each gradient is −3e38 and their norm overflows float32 (inf); with a NaN token the loss is NaN."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.tensor(0.0))
        self.b = nn.Parameter(torch.tensor(0.0))

    def forward(self, rows):
        return (self.a + self.b) * torch.tensor([float(r[0]) for r in rows])


class Linear(nn.Module):
    """R(row) = row[0] · θ (θ init 0): with no reward, every margin is 0; dL/dθ is worked out by hand."""

    def __init__(self):
        super().__init__()
        self.theta = nn.Parameter(torch.tensor(0.0))
        self.calls: list[int] = []

    def forward(self, rows):
        self.calls.append(len(rows))
        return torch.tensor([float(r[0]) for r in rows]) * self.theta


class Fixed(nn.Module):
    """R(row) = row[0], no parameters."""

    def __init__(self):
        super().__init__()
        self.calls: list[int] = []

    def forward(self, rows):
        self.calls.append(len(rows))
        return torch.tensor([float(r[0]) for r in rows])


def test_score_joint_batches_rows_in_order():
    model = Fixed()
    assert score_joint(model, [[5], [4], [3], [2], [1]], batch_size=2) == [5.0, 4.0, 3.0, 2.0, 1.0]
    assert model.calls == [2, 2, 1]


def test_one_items_joint_responses_share_a_forward_up_to_four_batches():
    """An item's joint responses (the same header and prompts before agent 1's response) run in one forward, so
    their prompts run once: 3 rows of item A at batch_size 2, then item B's 2 rows; a group over 4 batches' rows
    (9 rows of item C at batch_size 2) is split at 8. Rows come back in their own order."""
    from pbrl.learning.reward_model import _prefix_batches

    def rows(prompt, n):
        return [joint_input_ids(T, [prompt, [20]], [[30 + k], [40]], None) for k in range(n)]

    a, b, c = rows([10], 3), rows([11], 2), rows([12], 9)
    assert _prefix_batches(b + a, batch_size=2) == [[2, 3, 4], [0, 1]]
    assert [len(x) for x in _prefix_batches(c, batch_size=2)] == [8, 1]
    assert _prefix_batches(a[:1] + b[:1], batch_size=2) == [[0, 1]]  # small groups share a batch

    class ByResponse(Fixed):  # scores a row by agent 1's response id
        def forward(self, rows):
            self.calls.append(len(rows))
            return torch.tensor([float(r.ids[r.response_spans[0][0]]) for r in rows])

    model = ByResponse()
    assert score_joint(model, b + a, batch_size=2) == [30.0, 31.0, 30.0, 31.0, 32.0] and model.calls == [3, 2]


def test_pair_metrics_hand_values():
    model = Fixed()
    got = pair_metrics(model, [([4], [1]), ([0], [2]), ([5], [5])], batch_size=2)  # margins 3, −2, 0
    assert got.loss == pytest.approx((_softplus(-3) + _softplus(2) + math.log(2)) / 3, abs=1e-12)
    assert got.accuracy == pytest.approx(1 / 3, abs=1e-12)  # a zero margin is not a right answer
    assert got.margin_mean == pytest.approx(1 / 3, abs=1e-12)
    assert model.calls == [2, 2, 1]  # the 5 distinct rows ([5] twice is once), two rows a forward
    empty = pair_metrics(model, [], batch_size=2)
    assert all(math.isnan(x) for x in (empty.loss, empty.accuracy, empty.margin_mean))


# ---------------------------------------------------------------------------------------------- fit
def test_fit_counts_steps_and_moves_the_winner_up_by_adams_first_step():
    """θ = 0: every margin is 0, L = log 2 per pair and dL/dθ = −σ(0)·(x_w − x_l) = −(x_w − x_l)/2 (mean over
    the batch). AdamW's first step: θ ← θ(1 − lr·0.01) − lr·g/(|g| + 1e-8) = +lr for any g < 0 well above 1e-8."""
    model = Linear()
    got = fit_bradley_terry(
        model,
        [([2], [1]), ([3], [1]), ([5], [2])],
        epochs=1,
        batch_size=3,
        learning_rate=0.1,
        seed=0,
        max_grad_norm=None,
    )
    assert got == {"steps": 1, "skipped_steps": 0}
    assert model.theta.item() == pytest.approx(0.1, rel=1e-6)
    assert model.calls == [6]  # winners and losers of a batch in one forward
    swapped = Linear()  # the same pairs with winner and loser exchanged move θ the other way
    fit_bradley_terry(
        swapped,
        [([1], [2]), ([1], [3]), ([2], [5])],
        epochs=1,
        batch_size=3,
        learning_rate=0.1,
        seed=0,
        max_grad_norm=None,
    )
    assert swapped.theta.item() == pytest.approx(-0.1, rel=1e-6)
    counted = Linear()
    got = fit_bradley_terry(
        counted, [([2], [1])] * 5, epochs=3, batch_size=2, learning_rate=0.1, seed=0, max_grad_norm=None
    )
    assert got == {"steps": 3 * 3, "skipped_steps": 0} and counted.calls == [4, 4, 2] * 3


def test_fit_clips_the_gradient_norm():
    """|g| = 0.5 clipped to 1e-9: Adam's first step is lr·|g|/(|g| + 1e-8) = lr · 1e-9 / 1.1e-8 (clip_grad_norm_
    scales by max_norm / (norm + 1e-6), a relative 2e-6 more)."""
    model = Linear()
    fit_bradley_terry(model, [([2], [1])], epochs=1, batch_size=1, learning_rate=0.1, seed=0, max_grad_norm=1e-9)
    assert model.theta.item() == pytest.approx(0.1 * 1e-9 / (1e-9 + 1e-8), rel=1e-4)


def test_fit_skips_a_non_finite_loss_and_a_non_finite_gradient_and_goes_on():
    """Seed 0 visits the pairs in the order 2, 0, 1 (one pair a step): the NaN pair, the infinite-gradient pair,
    then the one finite pair, whose step is AdamW's first (a and b rise by lr·0.5/(0.5 + 1e-8); the decay of 0
    is 0). Had a skipped step touched the parameters or Adam's moments, a and b would not be exactly that."""
    model = TwoWeights()
    pairs = [([3e38], [-3e38]), ([2.0], [1.0]), ([math.nan], [0.0])]
    got = fit_bradley_terry(model, pairs, epochs=1, batch_size=1, learning_rate=0.1, seed=0, max_grad_norm=None)
    assert got == {"steps": 3, "skipped_steps": 2}
    step = 0.1 * 0.5 / (0.5 + 1e-8)
    assert (model.a.item(), model.b.item()) == (pytest.approx(step, rel=1e-6), pytest.approx(step, rel=1e-6))
    clipped = TwoWeights()  # the clipping path finds the same infinite norm
    got = fit_bradley_terry(clipped, pairs, epochs=1, batch_size=1, learning_rate=0.1, seed=0, max_grad_norm=1.0)
    assert got == {"steps": 3, "skipped_steps": 2}
    assert clipped.a.item() == pytest.approx(step, rel=1e-6)

    twice = TwoWeights()  # two non-finite losses in a row: each is counted (the count adds, it is not set)
    got = fit_bradley_terry(
        twice,
        [([math.nan], [0.0]), ([0.0], [math.nan])],
        epochs=1,
        batch_size=1,
        learning_rate=0.1,
        seed=0,
        max_grad_norm=None,
    )
    assert got == {"steps": 2, "skipped_steps": 2} and (twice.a.item(), twice.b.item()) == (0.0, 0.0)


# ---------------------------------------------------------------------------------------------- scorer
def test_reward_scorer_scores_in_order_and_leaves_out_what_does_not_fit(tiny_model_dir, tmp_path):
    spec = RewardModelSpec(str(tiny_model_dir), freeze_backbone=True)
    model = new_reward_model(spec, seed=0)
    tokenizer = load_tokenizer(tiny_model_dir)

    def enc(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False).input_ids)

    h, sep = enc("Joint multi-agent response\n"), enc("\n")
    p1, p2 = enc("### Agent 1 prompt\n"), enc("### Agent 2 prompt\n")
    r1, r2 = enc("\n### Agent 1 response\n"), enc("\n### Agent 2 response\n")
    fixed = len(h + sep + p1 + p2 + r1 + r2)
    save_reward_model(model, spec, tmp_path / "rm", max_length=fixed + 5)  # room for 5 prompt/response tokens
    scorer = RewardScorer(tmp_path / "rm", 2, batch_size=1)
    prompts = [[[40, 41, 44], [42]], [[50], [51]], [[60], [61]]]
    completions = [[[70], [71, 3]], [[80, 81, 82], [83, 84, 85]], [[90], [91]]]  # the second: 6 response tokens
    got = scorer.score(prompts, completions)
    first = h + p1 + [44] + sep + p2 + [42] + r1 + [70] + r2 + [71, 3]  # agent 1's first two prompt tokens cut
    last = h + p1 + [60] + sep + p2 + [61] + r1 + [90] + r2 + [91]  # one token shorter: padded in a batch
    assert [ids for _, ids in got] == [first, None, last]
    assert got[1][0] is None
    joints = [joint_input_ids(scorer.template, prompts[i], completions[i], fixed + 5) for i in (0, 2)]
    with torch.no_grad():
        alone = [float(model([joint])[0]) for joint in joints]
    assert [got[0][0], got[2][0]] == alone and alone[0] != alone[1]  # batch_size=1: each row alone, bitwise
    # (the default batch of 16 would score both in one right-padded forward: equal only to float32 rounding)
    with pytest.raises(ValueError):  # one completion list per prompt list
        scorer.score(prompts, completions[:2])


def test_fit_order_is_drawn_from_the_seed():
    """Five pairs of different margins, one AdamW step each: after the first, Adam's steps depend on the order
    of the gradients, so the fitted θ names the order. The same seed gives the same θ, bitwise; another seed
    (another order) another θ."""
    pairs = [([float(k + 2)], [0.0]) for k in range(5)]

    def fit(seed):
        model = Linear()
        fit_bradley_terry(model, pairs, epochs=1, batch_size=1, learning_rate=0.1, seed=seed, max_grad_norm=None)
        return model.theta.item()

    assert fit(0) == fit(0) and fit(0) != fit(1)


def test_heldout_split_edges():
    assert heldout_split(list(range(0)), 0.2, seed=0) == ([], [])
    assert len(heldout_split(list(range(2)), 0.99, seed=0)[1]) == 1  # never every pair held out
    assert len(heldout_split(list(range(10)), 1.0, seed=0)[1]) == 9
    assert len(heldout_split(list(range(10)), 0.05, seed=0)[1]) == 1  # round(0.5) = 0, at least one
    assert len(heldout_split(list(range(10)), 0.26, seed=0)[1]) == 3


def test_is_marlhf_names_the_two_marlhf_trainers():
    from pbrl.config import is_marlhf

    assert is_marlhf("marlhf") and is_marlhf("marlhf_iter")
    assert not is_marlhf("madpo") and not is_marlhf("madpo_iter")


def test_saved_record_and_load_errors(tiny_model_dir, tmp_path):
    import json

    from pbrl.learning.reward_model_build import load_reward_model
    from pbrl.models.lora import LoraSettings

    spec = RewardModelSpec(str(tiny_model_dir), lora=LoraSettings(r=2, target_modules=("q_proj",)))
    save_reward_model(new_reward_model(spec, seed=0), spec, tmp_path / "rm", max_length=64)
    assert json.loads((tmp_path / "rm" / "reward_model.json").read_text()) == {
        "template": "joint-v2",
        "source": str(tiny_model_dir),
        "trained": "lora",
        "lora": {"r": 2, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj"]},
        "pooling": "last_token",
        "num_agents": 1,
        "backbone_layers": None,
        "head_components": None,
        "length_squares": False,
        "length_products": False,
        "features": ["last_token"],
        "prompt_overlap": None,
        "joint_overlap": None,
        "max_length": 64,
    }
    old = tmp_path / "old"
    old.mkdir()
    (old / "reward_model.json").write_text(json.dumps({"template": "joint-v1", "source": str(tiny_model_dir)}))
    with pytest.raises(ValueError) as info:
        load_reward_model(old)
    assert str(info.value) == f"{old / 'reward_model.json'}: template 'joint-v1', expected 'joint-v2'"
    gone = tmp_path / "gone"
    gone.mkdir()
    (gone / "reward_model.json").write_text(
        json.dumps({"template": "joint-v2", "source": str(tmp_path / "no"), "trained": "head"})
    )
    with pytest.raises(ConfigError) as info:
        load_reward_model(gone)
    assert [p.field for p in info.value.problems] == ["reward_model_name"]


# ---------------------------------------------------------------------------------------------- padding, build
def test_pad_hand_values_both_sides_and_errors():
    from pbrl.models.forward import pad_rows as _pad

    ids, mask, positions, last = _pad([[11, 12, 13], [14]], 0, "left")
    assert ids.tolist() == [[11, 12, 13], [0, 0, 14]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert positions.tolist() == [[0, 1, 2], [0, 0, 0]] and last.tolist() == [2, 2]
    assert ids.dtype == mask.dtype == positions.dtype == torch.long
    ids, mask, positions, last = _pad([[11, 12, 13], [14]], 9, "right")
    assert ids.tolist() == [[11, 12, 13], [14, 9, 9]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert positions.tolist() == [[0, 1, 2], [0, 0, 0]] and last.tolist() == [2, 0]
    assert _pad([[7]], 0, "right")[0].tolist() == [[7]]  # one token is enough
    for rows in ([], [[1, 2], []]):
        with pytest.raises(ValueError) as info:
            _pad(rows, 0, "right")
        assert str(info.value) == "joint input ids: every row needs at least one token"
    with pytest.raises(ValueError) as info:
        _pad([[1]], 0, "middle")
    assert str(info.value) == "padding_side: got 'middle'; allowed: left, right"


def test_joint_input_needs_one_completion_per_agent_too():
    with pytest.raises(ValueError, match="got 2 prompts and 1 completions"):
        joint_input_ids(T, PROMPTS, [[30]], None)


def test_new_reward_model_builds_the_configured_adapter_in_float32_and_names_the_field(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from pbrl.models.lora import LoraSettings

    spec = RewardModelSpec(
        str(tiny_model_dir), lora=LoraSettings(r=2, alpha=4, dropout=0.1, target_modules=("q_proj",))
    )
    config = new_reward_model(spec, seed=0).backbone.peft_config["default"]
    assert (config.r, config.lora_alpha, config.lora_dropout) == (2, 4, 0.1)
    assert set(config.target_modules) == {"q_proj"}
    # A bfloat16 checkpoint still gives float32 weights (trained in float32, as documented).
    half = tmp_path / "half"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(torch.bfloat16).save_pretrained(half)
    load_tokenizer(tiny_model_dir).save_pretrained(half)
    assert {p.dtype for p in new_reward_model(RewardModelSpec(str(half)), seed=0).parameters()} == {torch.float32}
    with pytest.raises(ConfigError) as info:
        new_reward_model(RewardModelSpec(str(tmp_path / "missing")), seed=0)
    assert [p.field for p in info.value.problems] == ["reward_model_name"]


def test_backbone_weights_load_from_safetensors_only(tiny_model_dir, tmp_path):
    """A folder whose weights are only a pickled pytorch_model.bin is refused (use_safetensors=True)."""
    import shutil

    from safetensors.torch import load_file

    from pbrl.learning.reward_model_build import _load_backbone

    pickled = tmp_path / "pickled"
    shutil.copytree(tiny_model_dir, pickled)
    state = load_file(pickled / "model.safetensors")
    (pickled / "model.safetensors").unlink()
    torch.save(state, pickled / "pytorch_model.bin")
    for trained in ("full", "head"):  # its own copy, and the base shared with the LoRA policies
        with pytest.raises(OSError):
            _load_backbone(pickled, trained=trained, device="cpu")
