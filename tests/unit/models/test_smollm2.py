"""The packaged SmolLM2-135M-Instruct: converted once from its GGUF file, loaded offline, answers sensibly."""

from __future__ import annotations

import time

import pytest
import torch

from pbrl.models import loading as models
from pbrl.models import packaged

pytestmark = pytest.mark.slow

NAME = "smollm2-135m-instruct"


def test_smollm2_greedy_answer_names_paris() -> None:
    started = time.perf_counter()
    folder = packaged.prepare_packaged_model(NAME)  # under $PBRL_STORAGE or ./storage; reused once converted
    prepared = time.perf_counter()
    marker = packaged.read_marker(folder)
    assert marker is not None and marker["source_size"] == 98_362_432
    assert (NAME, True, folder) in packaged.list_packaged_models(folder.parent.parent)

    tok = models.load_tokenizer(NAME)
    model = models.load_model(NAME)
    loaded = time.perf_counter()
    assert (tok.eos_token, tok.pad_token_id, tok.padding_side) == ("<|im_end|>", 2, "left")
    assert model.config.num_hidden_layers == 30 and model.generation_config.pad_token_id == 2

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    enc = tok(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=24)
    answer = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    generated = time.perf_counter()
    print(
        f"\nprepare {prepared - started:.1f} s (conversion when first done: {marker['convert_seconds']} s), "
        f"load {loaded - prepared:.1f} s, generate {generated - loaded:.1f} s; answer: {answer!r}"
    )
    assert "Paris" in answer
