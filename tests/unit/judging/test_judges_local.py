"""The local judge (pbrl.judging.local_judge, issue #51) on the tiny model: its answer tokens, its probabilities
against a hand computation with one unpadded forward, its answers independent of the batch (bitwise in bfloat16),
prompts beyond the model's context, tokenizers it must refuse, and its factory."""

from __future__ import annotations

import hashlib
import math
import struct

import pytest
import torch
from tokenizers import Tokenizer, models, trainers
from transformers import PreTrainedTokenizerFast

from pbrl.errors import ConfigError
from pbrl.generation.sampling import encode_prompt
from pbrl.judging.factory import local_judge_from_options
from pbrl.judging.local_judge import LocalJudge, answer_token_ids, probability_of_a
from pbrl.judging.prompt import render
from pbrl.judging.verdicts import Comparison
from pbrl.models.loading import load_model, load_tokenizer

# Short enough for the tiny model's 512 positions (the default template alone is about 575 of its tokens).
TEMPLATE = "Task:\n{task}\nA:\n{response_a}\nB:\n{response_b}\nWhich is better, A or B?"
ROLES = ("writer", "checker")
PROMPTS = ("Say a word about reward.", "Check the word.")


def comparisons() -> list[Comparison]:
    """Five comparisons of different lengths (so a batch pads them), one of them the swap of another."""
    texts = [("the reward is good", "agent says yes"), ("bad model", "no"), ("policy helps the user", "is good"),
             ("a", "the answer of the question is not bad and helps"), ("reward", "model")]  # fmt: skip
    pairs = [Comparison(f"q{i}", PROMPTS, ROLES, texts[i], texts[(i + 1) % 5]) for i in range(4)]
    return [*pairs, pairs[0].swapped()]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)  # float32, frozen, eval mode


def by_hand(model, tokenizer, comparison: Comparison) -> tuple[float, float, float]:
    """(log p(A), log p(B), P(A)) from one unpadded forward of the prompt alone: the last position's log-softmax."""
    ids = encode_prompt(tokenizer, render(TEMPLATE, comparison))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].double()  # (v,)
    logprobs = logits.log_softmax(-1)
    a, b = (float(logprobs[tokenizer.convert_tokens_to_ids(w)]) for w in ("A", "B"))
    return a, b, math.exp(a) / (math.exp(a) + math.exp(b))


def test_the_answer_tokens_are_the_single_tokens_of_a_and_b_after_the_assistant_turn(tokenizer):
    prompt = render(TEMPLATE, comparisons()[0])
    ids, id_a, id_b = answer_token_ids(tokenizer, prompt)
    assert ids == encode_prompt(tokenizer, prompt)
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")  # ChatML: the answer starts here
    assert (id_a, id_b) == (tokenizer.convert_tokens_to_ids("A"), tokenizer.convert_tokens_to_ids("B")) == (36, 37)


def test_probability_of_a_is_the_normalised_pair_without_overflow():
    assert probability_of_a(math.log(0.3), math.log(0.1)) == pytest.approx(0.75, abs=1e-15)
    assert probability_of_a(math.log(0.1), math.log(0.3)) == pytest.approx(0.25, abs=1e-15)
    assert probability_of_a(-1.0, -1.0) == 0.5
    assert probability_of_a(0.0, -1000.0) == 1.0 and probability_of_a(-1000.0, 0.0) == 0.0


def test_the_local_judges_answers_equal_a_hand_computation(model, tokenizer):
    cs = comparisons()
    hand = [by_hand(model, tokenizer, c) for c in cs]
    distances = sorted(abs(p - 0.5) for _, _, p in hand)
    margin = (distances[1] + distances[2]) / 2  # two answers within the margin (ties), three beyond it
    assert distances[2] - distances[1] > 1e-4  # the margin is not at a rounding's distance from an answer
    judge = LocalJudge(model, tokenizer, source="tiny", template=TEMPLATE, batch_size=2, tie_margin=margin)
    answers = judge.answer(cs)
    expected = ["A" if p > 0.5 + margin else "B" if p < 0.5 - margin else "tie" for _, _, p in hand]
    assert [a.verdict for a in answers] == expected and expected.count("tie") == 2
    for answer, (log_a, log_b, p) in zip(answers, hand, strict=True):
        assert answer.probability == pytest.approx(p, abs=1e-6) and answer.reason is None and answer.tokens == 0
        shown_p, shown_mass = (float(part.split("=")[1]) for part in answer.raw.split("; "))
        assert answer.raw.startswith("P(A)=") and shown_p == pytest.approx(p, abs=6e-5)
        assert shown_mass == pytest.approx(math.exp(log_a) + math.exp(log_b), abs=6e-5)


def bits(x: float) -> bytes:
    return struct.pack("<d", x)


def test_a_comparisons_answer_never_depends_on_its_batch_bitwise_in_bfloat16(tiny_model_dir, tokenizer):
    model = load_model(tiny_model_dir, dtype="bfloat16")
    cs = comparisons()
    in_five = LocalJudge(model, tokenizer, source="tiny", template=TEMPLATE, batch_size=5).answer(cs)
    in_twos = LocalJudge(model, tokenizer, source="tiny", template=TEMPLATE, batch_size=2).answer(cs)
    alone = LocalJudge(model, tokenizer, source="tiny", template=TEMPLATE, batch_size=1)
    each = [alone.answer([c])[0] for c in cs]
    assert [bits(a.probability) for a in in_five] == [bits(a.probability) for a in each]
    assert [bits(a.probability) for a in in_twos] == [bits(a.probability) for a in each]
    assert [a.verdict for a in in_five] == [a.verdict for a in each]
    assert len({a.probability for a in each}) == 5  # five different questions, five different answers


def test_in_float32_a_batch_agrees_with_each_comparison_alone_to_rounding(model, tokenizer):
    """float32 keeps the batched forward (pbrl.models.row_invariance): equal to about 1e-7, the verdicts equal."""
    judge = LocalJudge(model, tokenizer, source="tiny", template=TEMPLATE, batch_size=5)
    batched = judge.answer(comparisons())
    each = [judge.answer([c])[0] for c in comparisons()]
    assert [a.probability for a in batched] == pytest.approx([a.probability for a in each], abs=1e-6)
    assert [a.verdict for a in batched] == [a.verdict for a in each]


def test_a_prompt_beyond_the_models_context_gets_no_verdict_and_the_others_are_judged(model, tokenizer):
    long = Comparison("long", PROMPTS, ROLES, ("the reward " * 800, "yes"), ("no", "no"))
    judge = LocalJudge(model, tokenizer, source="tiny", template=TEMPLATE, batch_size=8)
    short, too_long, again = judge.answer([comparisons()[0], long, comparisons()[0]])
    assert too_long.verdict is None and too_long.probability is None
    assert "beyond the judge model's context of 2048 (max_position_embeddings)" in too_long.reason
    assert short.verdict is not None and short.probability == again.probability


def test_judging_leaves_the_model_as_it_was_and_computes_no_gradient(tiny_model_dir, tokenizer):
    trained = load_model(tiny_model_dir, trainable=True)  # train mode, every weight trainable
    LocalJudge(trained, tokenizer, source="tiny", template=TEMPLATE).answer(comparisons()[:2])
    assert trained.training and all(p.requires_grad and p.grad is None for p in trained.parameters())


def merging_tokenizer() -> PreTrainedTokenizerFast:
    """A real BPE tokenizer without pre-tokenization (as some SentencePiece models), trained so that "? A" and
    "? B" are single tokens: after a prompt ending in "? ", the answer merges with the prompt's end."""
    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<pad>", "<unk>", "</s>"], show_progress=False)
    tk.train_from_iterator(["Which? A", "Which? B", "Which? tie", "abcdefghijklmnopqrstuvwxyz:\n"] * 50, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def test_a_tokenizer_that_does_not_write_a_and_b_as_one_token_is_refused_naming_judge_model(model):
    merging = merging_tokenizer()
    template = "a:\n{response_a}\nb:\n{response_b}\nWhich? "
    with pytest.raises(ValueError, match="does not write the answer 'A' as one token after the prompt"):
        answer_token_ids(merging, render(template, comparisons()[0]))
    with pytest.raises(ConfigError) as info:
        LocalJudge(model, merging, source="merging-model", template=template)
    assert [p.field for p in info.value.problems] == ["judge_model"]
    assert "'A' and 'B' as single tokens" in str(info.value)


def test_bad_values_are_refused_all_at_once_naming_their_options(model, tokenizer):
    with pytest.raises(ConfigError) as info:
        LocalJudge(model, tokenizer, source="tiny", template="{response_a}", batch_size=0, tie_margin=0.5)
    assert [p.field for p in info.value.problems] == ["judge_prompt_template", "judge_batch_size", "judge_tie_margin"]


def test_the_factory_loads_the_judge_model_frozen_and_names_it(tiny_model_dir, tmp_path):
    template = tmp_path / "judge.txt"
    template.write_text(TEMPLATE)
    judge = local_judge_from_options(model=str(tiny_model_dir), prompt_template=template, batch_size=3,
                                     tie_margin=0.05, dtype="float32")  # fmt: skip
    assert not judge.model.training and not any(p.requires_grad for p in judge.model.parameters())
    digest = hashlib.sha256(TEMPLATE.encode()).hexdigest()[:16]
    expected = f"local(model={tiny_model_dir}, dtype=float32, device=cpu, template=sha256:{digest}, tie_margin=0.05)"
    assert judge.name == expected
    assert (judge.batch_size, judge.tie_margin, judge.template) == (3, 0.05, TEMPLATE)
    with pytest.raises(ConfigError) as info:
        local_judge_from_options(model=str(tmp_path / "no-such-model"))
    assert [p.field for p in info.value.problems] == ["judge_model"]
