"""The `model` comparator (docs/design/algorithms.md#comparators): explicit models with their own tokenizers and chat
templates, and text
from another vocabulary encoded once, at entry, with each target agent's tokenizer
(docs/design/file-formats.md#conventions)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pbrl.data.schema import CANDIDATES, PAIRS
from pbrl.data.storage import RunPaths
from pbrl.data.tables import read_rows
from pbrl.errors import ConfigError
from pbrl.generation import comparators
from pbrl.models.loading import load_tokenizer
from stages import STAGE_MODULES
from tests.helpers import new_run, tiny_job

OTHER_WORDS = "cat dog runs jumps over under blue green fast slow tree house river stone sings".split()
LATER = ["score-with-oracle", "build-pairs", "store-round", "replay-select", "update-policies"]


def build_other_model(path: Path) -> Path:
    """A second tiny Llama whose tokenizer differs from the agents': byte-level BPE (vocab 290) trained on other
    words, EOS ``</s>``, pad ``<pad>``, an ``[INST]`` chat template."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    rng = random.Random(1)
    corpus = [" ".join(rng.choice(OTHER_WORDS) for _ in range(rng.randint(3, 9))) for _ in range(300)]
    tk = Tokenizer(models.BPE(unk_token=None))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    tk.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=290,
            special_tokens=["<pad>", "<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="</s>", bos_token="<s>")
    tok.chat_template = (
        "{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}{% if add_generation_prompt %} {% endif %}"
    )
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    torch.manual_seed(1)
    model = LlamaForCausalLM(cfg)
    model.generation_config.pad_token_id = tok.pad_token_id
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory) -> Path:
    return build_other_model(tmp_path_factory.mktemp("other"))


@pytest.fixture(scope="module")
def model_round(tiny_model_dir, other_model_dir, tmp_path_factory):
    """Round 1 sampled with the other-tokenizer comparator; encode_entry calls counted over the stage."""
    run_dir, job = new_run(
        tiny_model_dir,
        tmp_path_factory.mktemp("runs"),
        comparator_policy="model",
        comparator_model_name=str(other_model_dir),
        comparator_devices="cpu",
        preference_num_candidates=2,
        max_new_tokens=6,
    )
    before = sum(comparators.ENTRY_ENCODINGS.values())
    manifest = STAGE_MODULES["sample-candidates"].run(run_dir, 1, job)
    encodings = sum(comparators.ENTRY_ENCODINGS.values()) - before
    return run_dir, job, manifest, encodings


def test_other_tokenizer_text_is_stored_as_target_ids_that_decode_to_it(model_round, tiny_model_dir, other_model_dir):
    run_dir, job, manifest, encodings = model_round
    rows = read_rows(RunPaths(run_dir).candidates(1), CANDIDATES)
    comparator = [r for r in rows if r["side"] == "comparator"]
    assert len(comparator) == 2 * 4 * 2 and encodings == len(comparator)  # each row encoded exactly once
    assert manifest.counts["encoded_from_text"] == len(comparator)
    target_tok, other_tok = load_tokenizer(tiny_model_dir), load_tokenizer(other_model_dir)
    assert target_tok.get_vocab() != other_tok.get_vocab()
    for r in comparator:
        assert r["ids_source"] == "encoded_from_text"
        ids = r["completion_ids"]
        assert max(ids) < len(target_tok)  # the target's vocabulary (the comparator's ids would mean other tokens)
        assert target_tok.decode(ids, skip_special_tokens=True) == r["completion"]
        if r["finish_reason"] == "eos":  # the comparator ended its answer: the target's EOS (id 3) closes it
            assert ids[-1] == 3 and r["stop_token_id"] == 3
        else:
            assert r["finish_reason"] == "length" and r["stop_token_id"] is None and 3 not in ids
    assert {r["ids_source"] for r in rows if r["side"] == "target"} == {"generated"}
    # The comparator wrote words of its own corpus (its model is random, but its vocabulary is built from them).
    assert any(w in r["completion"] for r in comparator for w in ("cat", "dog", "tree", "river", "stone", "over"))


def test_later_stages_read_the_stored_ids_and_never_encode_text_again(model_round, monkeypatch):
    from transformers import PreTrainedTokenizerBase

    run_dir, job, _, _ = model_round
    paths = RunPaths(run_dir)
    candidates = {
        (r["item_id"], r["side"], r["candidate_index"], r["agent_index"]): r["completion_ids"]
        for r in read_rows(paths.candidates(1), CANDIDATES)
    }
    texts = {r["completion"] for r in read_rows(paths.candidates(1), CANDIDATES) if r["side"] == "comparator"}
    seen: list[str] = []
    real_call, real_encode = PreTrainedTokenizerBase.__call__, PreTrainedTokenizerBase.encode

    def spy_call(self, text=None, *args, **kwargs):
        seen.extend(text if isinstance(text, list) else [text])
        return real_call(self, text, *args, **kwargs)

    def spy_encode(self, text, *args, **kwargs):
        seen.append(text)
        return real_encode(self, text, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerBase, "__call__", spy_call)
    monkeypatch.setattr(PreTrainedTokenizerBase, "encode", spy_encode)
    before = dict(comparators.ENTRY_ENCODINGS)
    for name in LATER:
        STAGE_MODULES[name].run(run_dir, 1, job)
    assert dict(comparators.ENTRY_ENCODINGS) == before
    assert not texts & {t for t in seen if isinstance(t, str)}
    pairs = read_rows(paths.pairs(1), PAIRS)
    assert pairs
    for p in pairs:
        for side, index, ids in (
            ("winner", p["winner_index"], p["winner_ids"]),
            ("loser", p["loser_index"], p["loser_ids"]),
        ):
            stored = [candidates[(p["item_id"], p[f"{side}_side"], index, a)] for a in range(job.num_agents)]
            assert ids == stored


def test_the_agents_own_model_as_comparator_equals_current_in_round_one(tiny_model_dir, tmp_path):
    """Round 1's `current` comparator is the initial policy on the comparator seed stream: a `model` comparator
    naming the same model samples the very same rows (same tokenizer, so its ids are kept as generated)."""
    rows = {}
    for policy, extra in (("current", {}), ("model", {"comparator_model_name": str(tiny_model_dir)})):
        run_dir, job = new_run(
            tiny_model_dir,
            tmp_path / policy,
            comparator_policy=policy,
            generation_batch_size=1,
            preference_num_candidates=2,
            **extra,
        )
        STAGE_MODULES["sample-candidates"].run(run_dir, 1, job)
        rows[policy] = [r for r in read_rows(RunPaths(run_dir).candidates(1), CANDIDATES) if r["side"] == "comparator"]
    assert len(rows["model"]) == 2 * 4 * 2
    assert rows["model"] == rows["current"]
    assert {r["ids_source"] for r in rows["model"]} == {"generated"}


def test_preflight_names_a_missing_comparator_model_and_an_unset_key_variable(tiny_model_dir, tmp_path, monkeypatch):
    from pbrl.run.preflight import preflight

    job = tiny_job(tiny_model_dir, tmp_path, comparator_policy="model", comparator_model_name=str(tmp_path / "nope"))
    with pytest.raises(ConfigError) as info:
        preflight(job)
    assert [p.field for p in info.value.problems] == ["comparator_model_name"]

    monkeypatch.setenv("PBRL_UNSET_KEY_FOR_TEST", "")
    job = tiny_job(
        tiny_model_dir,
        tmp_path,
        comparator_policy="api",
        comparator_api_url="http://127.0.0.1:9/x",
        comparator_api_key_env="PBRL_UNSET_KEY_FOR_TEST",
    )
    with pytest.raises(ConfigError) as info:
        preflight(job)
    (problem,) = info.value.problems
    assert problem.field == "comparator_api_key_env" and "PBRL_UNSET_KEY_FOR_TEST" in str(info.value)


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_api")
@pytest.mark.parametrize("other_tokenizer", [False, True], ids=["as-shipped", "other-tokenizer"])
def test_tiny_model_config_trains_two_rounds(tmp_path, other_model_dir, other_tokenizer):
    """`pbrl train flows/configs/tiny-comparator-model.yaml`, as shipped and with a comparator whose tokenizer
    differs from the agents'."""
    from typer.testing import CliRunner

    from pbrl.cli.commands import app

    config = Path(__file__).resolve().parents[3] / "flows" / "configs" / "tiny-comparator-model.yaml"
    overrides = ["--set", f"output_dir={tmp_path}"]
    if other_tokenizer:
        overrides += ["--set", f"comparator_model_name={other_model_dir}"]
    result = CliRunner().invoke(app, ["train", str(config), *overrides])
    assert result.exit_code == 0, result.output
    paths = RunPaths(tmp_path / "tiny-comparator-model")
    for r in (1, 2):
        assert (paths.round_checkpoint(r) / "trainer_state.json").is_file()
        rows = read_rows(paths.candidates(r), CANDIDATES)
        sources = {row["ids_source"] for row in rows if row["side"] == "comparator"}
        assert sources == ({"encoded_from_text"} if other_tokenizer else {"generated"})
