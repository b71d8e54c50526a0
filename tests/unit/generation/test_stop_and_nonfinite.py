"""Several stop ids end a row (issue #16 item 7); non-finite logits stop sampling loudly (item 8)."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from pbrl.data.items import read_items
from pbrl.data.schema import CANDIDATES, EVAL
from pbrl.data.storage import RunPaths
from pbrl.data.tables import read_rows
from pbrl.errors import SamplingError
from pbrl.generation.sampling import SamplingSettings, encode_prompt, generate, stop_token_ids
from pbrl.generation.seeded_sampler import SeededSampler, build_warpers
from stages import STAGE_MODULES
from tests.helpers import new_run

EOS, OTHER_STOP = 3, 53  # the tiny tokenizer's <|im_end|>, and a second stop id as in multi-stop chat models
SETTINGS = SamplingSettings(max_new_tokens=48, temperature=0.9, top_p=0.95, top_k=50, batch_size=32)


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> LlamaForCausalLM:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _with_stop_ids(model: LlamaForCausalLM, stop_ids: int | list[int]) -> LlamaForCausalLM:
    other = copy.deepcopy(model)
    other.generation_config.eos_token_id = stop_ids
    return other


def _with_nan_weight(model: LlamaForCausalLM) -> LlamaForCausalLM:
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    return broken


def _model_dir(model: LlamaForCausalLM, tokenizer, path: Path) -> Path:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _tok(eos: int | None) -> SimpleNamespace:
    return SimpleNamespace(eos_token_id=eos)


def _lm(eos: object) -> SimpleNamespace:
    return SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=eos))


def test_stop_ids_are_the_tokenizer_eos_and_every_generation_config_id() -> None:
    assert stop_token_ids(_lm(3), _tok(3)) == [3]
    assert stop_token_ids(_lm([3, 53]), _tok(3)) == [3, 53]
    assert stop_token_ids(_lm([53, 7, 53]), _tok(3)) == [3, 53, 7]  # the tokenizer's first, no repeats
    assert stop_token_ids(_lm(None), _tok(3)) == [3]
    assert stop_token_ids(_lm([128001, 128009]), _tok(None)) == [128001, 128009]  # Llama 3 style, EOS unset
    with pytest.raises(ValueError, match=r"model.generation_config.eos_token_id: got -1"):
        stop_token_ids(_lm([3, -1]), _tok(3))
    with pytest.raises(ValueError, match="neither tokenizer.eos_token_id nor model.generation_config"):
        stop_token_ids(_lm(None), _tok(None))


def test_a_row_stops_at_any_stop_id_and_records_which(model, tokenizer) -> None:
    # The example: stop ids [3, 53]. Each row's token at step s depends only on its seed and the
    # tokens before it, so the rows sampled with EOS alone, cut by hand at their first 3 or 53, are the
    # rows the two-stop model must return.
    rows = [encode_prompt(tokenizer, "the agent says")] * 32
    eos_only = generate(_with_stop_ids(model, EOS), tokenizer, rows, list(range(32)), SETTINGS)
    two_stops = generate(_with_stop_ids(model, [EOS, OTHER_STOP]), tokenizer, rows, list(range(32)), SETTINGS)
    expected = []
    for g in eos_only:
        ids = g.completion_ids
        first = next((n for n, t in enumerate(ids) if t in (EOS, OTHER_STOP)), None)
        expected.append((ids, "length", None) if first is None else (ids[: first + 1], "eos", ids[first]))
    assert [(g.completion_ids, g.finish_reason, g.stop_token_id) for g in two_stops] == expected
    stopped_by = [g.stop_token_id for g in two_stops]
    assert OTHER_STOP in stopped_by and EOS in stopped_by and None in stopped_by  # these seeds give all three
    assert sum(s == OTHER_STOP for s in stopped_by) >= 5  # before the fix these ran on past 53


def test_the_stage_records_the_stop_id_of_every_row(model, tokenizer, tmp_path) -> None:
    model_dir = _model_dir(_with_stop_ids(model, [EOS, OTHER_STOP]), tokenizer, tmp_path / "two_stops")
    run_dir, job = new_run(model_dir, tmp_path / "runs", max_new_tokens=48)
    STAGE_MODULES["sample-candidates"].run(run_dir, 1, job)
    rows = read_rows(RunPaths(run_dir).candidates(1), CANDIDATES)
    for row in rows:
        ids, stop = row["completion_ids"], row["stop_token_id"]
        assert not {EOS, OTHER_STOP} & set(ids[:-1])  # nothing generated past a stop id
        if row["finish_reason"] == "eos":
            assert stop == ids[-1] and stop in (EOS, OTHER_STOP)
        else:
            assert row["finish_reason"] == "length" and stop is None and len(ids) == 48
    assert OTHER_STOP in {r["stop_token_id"] for r in rows}
    STAGE_MODULES["evaluate"].run(run_dir, 0, job)
    for row in read_rows(RunPaths(run_dir).eval(0), EVAL):
        for ids, reason, stop in zip(row["completion_ids"], row["finish_reasons"], row["stop_token_ids"], strict=True):
            assert (stop, reason) == ((ids[-1], "eos") if ids[-1] in (EOS, OTHER_STOP) else (None, "length"))


def test_a_nan_weight_stops_sampling_naming_the_rows(model, tokenizer) -> None:
    rows = [encode_prompt(tokenizer, t) for t in ("the agent says", "a")]
    names = ["agent 1, item 'q7', target candidate 0", "agent 1, item 'q8', target candidate 0"]
    with pytest.raises(SamplingError) as error:
        generate(_with_nan_weight(model), tokenizer, rows, [1, 2], SETTINGS, row_names=names)
    message = str(error.value)
    assert "generated token 0 in 2 of 2 rows" in message and "NaN" in message
    assert names[0] in message and names[1] in message


def _sampler(stop_ids: list[int], temperature: float, names: list[str]) -> SeededSampler:
    return SeededSampler(
        torch.arange(len(names)),
        prompt_width=2,
        warpers=build_warpers(temperature, 1.0, None),
        stop_ids=torch.tensor(stop_ids),
        row_names=names,
        temperature=temperature,
    )


def test_only_unfinished_rows_with_undrawable_scores_are_refused() -> None:
    nan, inf = float("nan"), float("inf")
    names = ["item a", "item b", "item c", "item d"]
    input_ids = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 3], [5, 6, 7]])  # row 2 generated stop id 3
    scores = torch.tensor([[0.1, -inf, 0.2], [0.1, nan, 0.2], [nan, nan, nan], [-inf, -inf, -inf]])
    with pytest.raises(SamplingError, match=r"token 1 in 2 of 4 rows \(item b; item d\): the model's logits"):
        _sampler([3], 1.0, names)(input_ids, scores)
    # −inf entries alone (masked vocabulary) are fine: only token 0 or 2 can be drawn.
    drawn = _sampler([3], 1.0, names[:1])(input_ids[:1], scores[:1])
    assert torch.isfinite(drawn).sum() == 1 and not torch.isfinite(drawn[0, 1])


def test_temperature_overflow_is_refused_where_it_used_to_emit_the_last_id(model, tokenizer) -> None:
    # 0.5 / 1e-39 = 5e38 > 3.4e38, the float32 maximum: the scaled logit is +inf and softmax gives NaN,
    # whose inverse-CDF draw was the last vocabulary id at every step.
    input_ids = torch.tensor([[5, 6]])
    scores = torch.tensor([[0.5, 0.1, -0.2]])
    with pytest.raises(SamplingError, match=r"item z\): logits / temperature 1e-39 overflow float32"):
        _sampler([3], 1e-39, ["item z"])(input_ids, scores)
    # 1e-30 (the lowest accepted temperature) keeps logits up to 3.4e8 finite: the argmax is drawn.
    drawn = _sampler([3], 1e-30, ["item z"])(input_ids, torch.tensor([[0.5, 1e4, -0.2]]))
    assert drawn[0].tolist() == [float("-inf"), 0.0, float("-inf")]
    with pytest.raises(ValueError, match=r"temperature: got 1e-39; must be in \[1e-30, 100.0\]"):
        generate(model, tokenizer, [[5, 6]], [0], SamplingSettings(4, 1e-39, 1.0, None, 1))
    for bad in (float("inf"), float("nan"), 101.0):
        with pytest.raises(ValueError, match="temperature: got"):
            generate(model, tokenizer, [[5, 6]], [0], SamplingSettings(4, bad, 1.0, None, 1))


def test_the_stages_name_agent_and_item_when_the_model_has_a_nan_weight(model, tokenizer, tmp_path) -> None:
    model_dir = _model_dir(_with_nan_weight(model), tokenizer, tmp_path / "nan")
    run_dir, job = new_run(model_dir, tmp_path / "runs")
    paths = RunPaths(run_dir)
    first_train, first_eval = read_items(paths, "train")[0]["item_id"], read_items(paths, "eval")[0]["item_id"]
    with pytest.raises(SamplingError, match=rf"\(agent 0, item '{first_train}', target candidate 0; "):
        STAGE_MODULES["sample-candidates"].run(run_dir, 1, job)
    with pytest.raises(SamplingError, match=rf"\(agent 0, eval item '{first_eval}'"):
        STAGE_MODULES["evaluate"].run(run_dir, 0, job)
    assert not paths.candidates(1).exists() and not paths.eval(0).exists()  # nothing half-written
