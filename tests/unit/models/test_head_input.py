"""The LM head gets a contiguous input in bfloat16 on the CPU (pbrl.models.head_input): a last-position prefill no
longer copies the head once per row, and gives the same logits bit for bit."""

from __future__ import annotations

import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig, LlamaForCausalLM

from pbrl.models.head_input import _contiguous_input, contiguous_head_input, has_contiguous_head_input
from pbrl.models.loading import load_model
from pbrl.models.lora import LoraSettings
from pbrl.models.precision import BF16_CPU_FLAGS, cpu_flags
from tests.helpers import benchmark_script

VOCAB, HIDDEN, ROWS = 4096, 64, 16  # a head of 4096 x 64: 512 KiB in bfloat16, 8 MiB when copied for 16 rows


def _model(dtype: torch.dtype) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    # frozen, as every sampling and evaluation policy is: torch folds the rows into one product when the head's
    # weight requires grad, and takes the copying batched path only when it does not
    return LlamaForCausalLM(config).to(dtype).eval().requires_grad_(False)


def _prefill(model: LlamaForCausalLM) -> tuple[torch.Tensor, int]:
    """The last position's logits of 16 rows of 12 tokens (``logits_to_keep=1``, as every prefill asks), and the
    largest single allocation of that forward, in bytes."""
    ids = torch.randint(0, VOCAB, (ROWS, 12), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits  # (16, 1, vocab)
    return logits, max(event.cpu_memory_usage for event in prof.events())


def test_with_the_hook_a_bfloat16_prefill_allocates_less_than_the_head_and_gives_the_same_logits():
    model = _model(torch.bfloat16)
    strided, _ = _prefill(model)
    contiguous, peak = _prefill(contiguous_head_input(model))
    assert peak < VOCAB * HIDDEN * 2  # nothing the size of the head is allocated
    assert contiguous.shape == (ROWS, 1, VOCAB)
    if cpu_flags() & set(BF16_CPU_FLAGS):  # where torch_dtype: auto picks bfloat16: the same logits, bit for bit
        assert torch.equal(contiguous, strided)
    else:  # oneDNN without bfloat16 arithmetic accumulates the two products in another order: 1 ulp apart at most
        torch.testing.assert_close(contiguous, strided, rtol=2**-7, atol=1e-6)


def test_the_fault_the_hook_removes_copied_the_head_once_per_row():
    model = _model(torch.bfloat16)
    _, strided_peak = _prefill(model)
    if strided_peak < VOCAB * HIDDEN * 2:
        pytest.skip("this CPU's torch multiplies the strided rows without copying the head (pytorch/pytorch#151934)")
    assert strided_peak >= ROWS * VOCAB * HIDDEN * 2  # the head's 512 KiB copied for each of the 16 rows
    _, peak = _prefill(contiguous_head_input(model))
    assert peak < VOCAB * HIDDEN * 2


def test_float32_and_contiguous_inputs_pass_the_hook_untouched():
    seen = []
    model = _model(torch.float32)
    contiguous_head_input(contiguous_head_input(model))  # registered once
    head = model.get_output_embeddings()
    assert len(head._forward_pre_hooks) == 1
    head.register_forward_pre_hook(lambda module, args: seen.append(args[0]))  # runs after pbrl's hook
    hidden = torch.randn(ROWS, 5, HIDDEN)
    for x in (hidden[:, -1:, :], hidden):  # float32, strided: left strided (its products round otherwise)
        head(x)
        assert seen[-1] is x
    narrow = hidden.to(torch.bfloat16)
    head.to(torch.bfloat16)(narrow)  # contiguous bfloat16: nothing to do
    assert seen[-1] is narrow
    head(narrow[:, -1:, :])
    assert seen[-1].is_contiguous() and torch.equal(seen[-1], narrow[:, -1:, :])
    head.to(torch.float16)(hidden.to(torch.float16)[:, -1:, :])  # float16 too (torch's issue reports both)
    assert seen[-1].is_contiguous() and seen[-1].dtype == torch.float16
    on_meta = torch.empty(ROWS, 5, HIDDEN, dtype=torch.bfloat16, device="meta")[:, -1:, :]
    assert _contiguous_input(head, (on_meta,)) is None  # another device's product is its own business
    assert _contiguous_input(head, ()) is None  # called without positional input: nothing to do


def test_a_model_without_an_output_embedding_is_returned_as_it_is():
    model = _model(torch.bfloat16)
    backbone = model.model  # LlamaModel: no LM head
    assert backbone.get_output_embeddings() is None
    assert contiguous_head_input(backbone) is backbone and not has_contiguous_head_input(backbone)


@pytest.mark.parametrize("lora", [None, LoraSettings(r=2)], ids=["full", "lora"])
def test_every_loaded_policy_has_the_hook(tiny_model_dir, lora):
    models = [
        load_model(tiny_model_dir, dtype="bfloat16", lora=lora, seed=0 if lora else None),
        load_model(tiny_model_dir, dtype="bfloat16", lora=lora, seed=1 if lora else None),  # a LoRA tree of its own
    ]
    for model in models:
        head = model.get_output_embeddings()
        assert has_contiguous_head_input(model) and len(head._forward_pre_hooks) == 1


def test_the_benchmark_measures_both_products_of_every_dtype(tmp_path, monkeypatch, capsys):
    with benchmark_script("head_input") as bench:
        import benchkit

        monkeypatch.setattr(benchkit, "RESULTS_DIR", tmp_path)  # never over the committed results
        monkeypatch.setattr("sys.argv", ["head_input.py", "--vocab", "4096", "--hidden", "64", "--repeats", "1"])
        bench.main()
    result = json.loads((tmp_path / "head-input-head-4096x64.json").read_text())
    assert result["workload"] == {"rows": 16, "vocab": 4096, "hidden": 64, "weight": "frozen"}
    for name, head_mib in (("bfloat16", 0.5), ("float16", 0.5), ("float32", 1.0)):
        measured = result["dtypes"][name]
        assert measured["head_mib"] == head_mib
        assert measured["largest_allocation_mib"]["contiguous"] < head_mib  # rows x vocab logits, no head copy
        assert set(measured["seconds"]) == {"strided", "contiguous"}
    memory = result["dtypes"]["bfloat16"]["largest_allocation_mib"]
    assert result["checks"][0]["name"].startswith("bfloat16")
    assert result["checks"][0]["value"] == round(memory["strided"] / memory["contiguous"], 3)
    assert "[head_input] result:" in capsys.readouterr().out
