"""The LM head gets a contiguous input in bfloat16 on the CPU (pbrl.models.head_input): a last-position prefill no
longer copies the head once per row, and gives the same logits bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig, LlamaForCausalLM

from pbrl.models.head_input import contiguous_head_input
from pbrl.models.loading import load_model
from pbrl.models.lora import LoraSettings

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


def test_a_bfloat16_prefill_copied_the_head_once_per_row_and_no_longer_does():
    model = _model(torch.bfloat16)
    head_bytes = VOCAB * HIDDEN * 2
    strided, strided_peak = _prefill(model)
    assert strided_peak >= ROWS * head_bytes  # the fault (pytorch/pytorch#151934): the head copied for each row
    contiguous, peak = _prefill(contiguous_head_input(model))
    assert peak < head_bytes  # nothing the size of the head is allocated
    assert contiguous.shape == (ROWS, 1, VOCAB) and torch.equal(contiguous, strided)  # the same logits, bit for bit


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


@pytest.mark.parametrize("lora", [None, LoraSettings(r=2)], ids=["full", "lora"])
def test_every_loaded_policy_has_the_hook(tiny_model_dir, lora):
    models = [
        load_model(tiny_model_dir, dtype="bfloat16", lora=lora, seed=0 if lora else None),
        load_model(tiny_model_dir, dtype="bfloat16", lora=lora, seed=1 if lora else None),  # a LoRA tree of its own
    ]
    for model in models:
        head = model.get_output_embeddings()
        assert head._pbrl_contiguous_input and len(head._forward_pre_hooks) == 1
