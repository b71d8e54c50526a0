"""Row-invariant forwards of bfloat16 models (pbrl/models/row_invariance.py): a row has the bits it has alone,
whatever its batch, its padding and the thread count; and the sampling built on them
(docs/design/architecture.md#what-is-bitwise).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from pbrl.generation.sampling import SamplingSettings, encode_prompt, generate
from pbrl.models import row_invariance
from pbrl.models.row_invariance import (
    PROMPT_BLOCK,
    PROMPT_STEP,
    linear_rows,
    probe_row_block,
    prompt_rows,
    row_invariant,
    set_row_offsets,
    threads_agree,
)

SMOLLM2 = Path(__file__).resolve().parents[3] / "storage" / "models" / "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def bf16_model(tiny_model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def threads():
    """Set torch's thread count inside a test; the count of before comes back after it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------- linear layers
def test_a_lone_row_is_computed_beside_a_zero_row_and_blocks_keep_every_row():
    layer = nn.Linear(3, 2)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0, 2.0, 3.0], [-1.0, 0.5, 0.0]]))
        layer.bias.copy_(torch.tensor([0.25, -1.0]))
    x = torch.tensor([[1.0, 1.0, 1.0], [2.0, 0.0, -2.0], [0.0, 4.0, 1.0]])
    # by hand: (1+2+3) + 0.25, (-1+0.5+0) - 1; (2-6) + 0.25, (-2+0-0) - 1; (0+8+3) + 0.25, (0+2+0) - 1
    expected = [[6.25, -1.5], [-3.75, -3.0], [11.25, 1.0]]
    assert linear_rows(layer, x[:1]).tolist() == expected[:1]
    assert linear_rows(layer, x).tolist() == expected
    row_invariance._BLOCKS[(tuple(layer.weight.shape), tuple(layer.weight.stride()), torch.float32, True,
                            torch.get_num_threads())] = 2  # fmt: skip
    assert linear_rows(layer, x).tolist() == expected  # a block of 2, then a lone row beside a zero row


def test_the_probe_finds_the_largest_block_whose_rows_equal_the_rows_alone(monkeypatch):
    """A kernel that adds in another order from 6 rows on (a last-bit change of every output) is found: blocks
    of at most 5 rows."""
    real = nn.functional.linear

    def kernel(x, weight, bias=None):
        out = real(x, weight, bias)
        return out * (1 + 2**-7) if x.shape[0] > 5 else out  # another rounding from 6 rows on

    monkeypatch.setattr(row_invariance.nn.functional, "linear", kernel)
    weight = torch.randn(16, 8).to(torch.bfloat16)
    assert probe_row_block(weight, None) == 5
    assert probe_row_block(weight, None, limit=4) == 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_row_of_a_layer_has_the_bits_it_has_alone(dtype, threads):
    generator = torch.Generator().manual_seed(0)
    layer = nn.Linear(96, 200).to(dtype)  # float32: a LoRA adapter over a bfloat16 base is blocked the same way
    x = torch.randn(70, 96, generator=generator).to(dtype)  # more rows than a block
    threads(1)
    alone = torch.cat([linear_rows(layer, x[i : i + 1]) for i in range(len(x))])
    threads(2)
    for rows in (2, 7, 33, 70):
        assert torch.equal(linear_rows(layer, x[:rows]), alone[:rows]), rows
    assert torch.equal(linear_rows(layer, x.view(7, 10, 96)), alone.view(7, 10, 200))  # (..., in) inputs


def test_a_prompt_runs_in_fixed_blocks_the_last_padded_with_the_bits_of_one_thread(threads):
    """A prefill's rows: blocks of PROMPT_BLOCK rows, the last padded with zero rows to a multiple of PROMPT_STEP,
    each as one thread computes it, at any thread count."""
    generator = torch.Generator().manual_seed(4)
    layer = nn.Linear(96, 200).to(torch.bfloat16)
    x = torch.randn(PROMPT_BLOCK + 40, 96, generator=generator).to(torch.bfloat16)  # a full block, then 40 rows
    threads(1)
    tail = torch.cat([x[PROMPT_BLOCK:], x.new_zeros((PROMPT_STEP * 2 - 40, 96))])  # 40 rows padded to 64
    expected = torch.cat([layer(x[:PROMPT_BLOCK]), layer(tail)[:40]]).detach()
    for count in (1, 2):
        threads(count)
        with torch.inference_mode(), prompt_rows():
            assert torch.equal(linear_rows(layer, x), expected), count
            assert torch.equal(linear_rows(layer, x[None]), expected[None])  # (..., in) inputs
    with torch.inference_mode():  # outside prompt_rows: the row blocks again
        assert torch.equal(linear_rows(layer, x[:3]), torch.cat([linear_rows(layer, x[i : i + 1]) for i in range(3)]))


def test_packed_prompts_each_get_the_blocks_they_get_alone_and_a_wrong_length_is_refused(threads):
    """Prompts packed in one sequence (``prompt_rows(lengths)``): each prompt's rows in blocks of its own, as when
    it is alone, for a bfloat16 layer and a float32 adapter, at any thread count."""
    generator = torch.Generator().manual_seed(5)
    lengths = [PROMPT_BLOCK + 40, 7, 33]
    for layer in (nn.Linear(96, 200).to(torch.bfloat16), nn.Linear(96, 8)):
        x = torch.randn(sum(lengths), 96, generator=generator).to(layer.weight.dtype)
        with torch.inference_mode():
            with prompt_rows():
                alone = [linear_rows(layer, part) for part in x.split(lengths)]
            for count in (1, 2):
                threads(count)
                with prompt_rows(lengths):
                    assert torch.equal(linear_rows(layer, x[None]), torch.cat(alone)[None]), (layer, count)
            with prompt_rows([10, 20]), pytest.raises(RuntimeError, match="packed prompts of 30 tokens"):
                linear_rows(layer, x)


def test_a_packed_prefill_gives_each_prompt_the_cache_it_has_alone(bf16_model, threads, monkeypatch):
    """The chunk's distinct prompts prefilled packed (positions from 0 each, attention on their own keys, rotary
    per prompt) give every row the keys and values of its prompt prefilled alone; packs hold at most PACK_TOKENS
    tokens."""
    from transformers import DynamicCache

    from pbrl.generation import prefill

    generator = torch.Generator().manual_seed(3)
    rows = [torch.randint(4, 300, (n,), generator=generator).tolist() for n in (9, 45, 3, 45, 20)]
    rows[3] = rows[1]  # two rows of one prompt
    ids, mask, _, _ = _padded(rows)

    def cache(tokens: int) -> list[torch.Tensor]:
        monkeypatch.setattr(prefill, "PACK_TOKENS", tokens)
        filled = DynamicCache(config=bf16_model.config)
        with torch.inference_mode(), row_invariant(bf16_model):
            prefill._prefill_each_prompt(bf16_model, ids, mask, torch.device("cpu"), filled)
        return [t for layer in filled.layers for t in (layer.keys, layer.values)]

    alone = cache(1)  # every prompt in a pack of its own
    for count in (2, 1):
        threads(count)
        assert all(torch.equal(a, b) for a, b in zip(cache(4096), alone, strict=True)), count
    assert alone[0].shape[0] == 5 and torch.equal(alone[0][1], alone[0][3])
    assert not alone[0][2, :, : ids.shape[1] - 3].any()  # a 3-token prompt caches 2 columns; its padding is zero


def test_rotary_angles_per_packed_prompt_and_a_hooked_forward_put_back(bf16_model):
    """Each packed prompt's angles are those it gets alone; a forward set on the rotary module itself (an
    accelerate hook's wrapper) is in place again after the pack."""
    from pbrl.generation.prefill import _rotary_per_prompt

    decoder = bf16_model.get_decoder()
    rotary, x = decoder.rotary_emb, torch.zeros(1, 1, dtype=torch.bfloat16)
    positions = torch.cat([torch.arange(5), torch.arange(3)])[None]  # two prompts of 5 and 3 tokens
    with _rotary_per_prompt(decoder, [5, 3]):
        cos, sin = rotary(x, positions)
    assert "forward" not in rotary.__dict__  # the class's forward again
    cos5, sin5 = rotary(x, torch.arange(5)[None])
    assert torch.equal(cos, torch.cat([cos5, cos5[:, :3]], 1)) and torch.equal(sin, torch.cat([sin5, sin5[:, :3]], 1))
    hooked = rotary.forward
    rotary.forward = hooked  # an instance attribute, as accelerate's hooks set it
    try:
        with _rotary_per_prompt(decoder, [5, 3]):
            assert rotary.forward is not hooked
        assert rotary.__dict__["forward"] is hooked
    finally:
        del rotary.forward


def test_prompts_are_packed_in_order_up_to_the_token_budget(monkeypatch):
    from pbrl.generation import prefill

    monkeypatch.setattr(prefill, "PACK_TOKENS", 10)
    prompts = [([0], 4), ([1], 5), ([2], 3), ([3, 4], 12), ([5], 2)]
    # 4 + 5 = 9 fits; + 3 = 12 does not; 12 alone (over the budget); then 2
    assert [[n for _, n in pack] for pack in prefill._packs(prompts)] == [[4, 5], [3], [12], [2]]


def test_a_float32_adapter_in_a_prompt_runs_as_one_product_on_any_thread_count(threads):
    """Under MKL's strict mode a float32 product's bits do not depend on the thread count, and a prompt alone has
    one shape: a LoRA adapter's layer in a prefill is one product, not blocks (and asking for the mode is cheap:
    it was found again at every layer, 0.15 ms each, a third of a prompt's prefill)."""
    from pbrl.models import threads as threads_module

    assert threads_module.gemm_independent_of_threads()  # `import pbrl` set the mode
    layer = nn.Linear(96, 8)
    x = torch.randn(PROMPT_BLOCK + 40, 96, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        expected = nn.functional.linear(x, layer.weight, layer.bias)
        for count in (1, 2):
            threads(count)
            with prompt_rows():
                assert torch.equal(linear_rows(layer, x), expected), count
    assert threads_module._mkl_cbwr_get.cache_info().hits > 0


def test_where_two_threads_change_a_prompt_block_it_runs_on_one(monkeypatch, threads):
    """A kernel that adds in another order on several threads for 64-row products (a last-bit change of every
    output): found for 64 rows, not for 32; a 40-row prompt (padded to 64) then gets the bits of one thread."""
    real = nn.functional.linear

    def kernel(x, weight, bias=None):
        out = real(x, weight, bias)
        return out * (1 + 2**-7) if x.shape[0] == 64 and torch.get_num_threads() > 1 else out

    monkeypatch.setattr(row_invariance.nn.functional, "linear", kernel)
    monkeypatch.setattr(row_invariance, "_AGREE", {})  # measured here, forgotten after
    weight = torch.randn(24, 16).to(torch.bfloat16)
    threads(2)
    assert not threads_agree(weight, None, 64) and threads_agree(weight, None, 32)
    layer = nn.Linear(16, 24, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(weight)
    x = torch.randn(40, 16).to(torch.bfloat16)
    with torch.inference_mode(), prompt_rows():
        ours = linear_rows(layer, x)
    padded = torch.cat([x, x.new_zeros((24, 16))])
    assert torch.equal(ours, real(padded, weight)[:40])  # one thread's bits, not the perturbed kernel's


# ---------------------------------------------------------------------------------------------- whole forwards
def _padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), [width - len(r) for r in rows]


def test_a_left_padded_row_has_the_logits_it_has_alone(bf16_model, threads):
    generator = torch.Generator().manual_seed(1)
    rows = [torch.randint(4, 300, (n,), generator=generator).tolist() for n in (9, 45, 3, 45, 20)]
    ids, mask, positions, offsets = _padded(rows)
    with torch.inference_mode(), row_invariant(bf16_model):
        set_row_offsets(offsets)
        batched = bf16_model(input_ids=ids, attention_mask=mask, position_ids=positions).logits  # (b, t, v)
        threads(1)
        for i, row in enumerate(rows):
            set_row_offsets([0])
            alone = bf16_model(input_ids=torch.tensor([row]), position_ids=torch.arange(len(row))[None]).logits
            assert torch.equal(batched[i, offsets[i] :], alone[0]), i


def test_outside_the_block_the_model_is_as_it_was(bf16_model):
    ids = torch.tensor([[5, 6, 7, 8]])
    before = bf16_model(input_ids=ids).logits
    implementation = bf16_model.config._attn_implementation
    with row_invariant(bf16_model):
        assert bf16_model.config._attn_implementation == row_invariance.ATTENTION
    assert bf16_model.config._attn_implementation == implementation
    assert not any("forward" in vars(m) for m in bf16_model.modules())  # no patched forward left behind
    assert torch.equal(bf16_model(input_ids=ids).logits, before)


def test_weights_offloaded_to_disk_are_loaded_by_their_hooks_inside_the_block(tiny_model_dir, tmp_path):
    """accelerate's offload hooks load a layer's weights before its forward: the row blocks ran around them and
    read meta weights (NaN logits, `agent_devices: auto` with a small memory budget); the hooks stay after the
    block."""
    from accelerate import disk_offload

    offloaded = disk_offload(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval(), tmp_path / "offload"
    )
    resident = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval()
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    with torch.inference_mode():
        with row_invariant(resident):
            expected = resident(input_ids=ids).logits
        with row_invariant(offloaded):
            got = offloaded(input_ids=ids).logits
        assert torch.equal(got, expected)
        hooked = [m for m in offloaded.modules() if hasattr(m, "_hf_hook") and type(m) is nn.Linear]
        assert hooked and all("forward" in vars(m) and "_old_forward" in vars(m) for m in hooked)
        assert torch.equal(offloaded(input_ids=ids).logits, resident(input_ids=ids).logits)


def test_only_low_precision_cpu_models_need_it(tiny_model_dir, bf16_model):
    assert row_invariance.applies(bf16_model)
    assert not row_invariance.applies(AutoModelForCausalLM.from_pretrained(tiny_model_dir))  # float32


# ---------------------------------------------------------------------------------------------- sampling
def _settings(batch_size: int, max_new_tokens: int = 12) -> SamplingSettings:
    return SamplingSettings(max_new_tokens=max_new_tokens, temperature=1.0, top_p=0.95, top_k=50, batch_size=batch_size)


def test_a_bfloat16_row_samples_the_same_tokens_alone_and_in_any_batch(bf16_model, tokenizer, threads):
    short = encode_prompt(tokenizer, "the agent says")
    long = encode_prompt(tokenizer, "a good policy helps the user and the model is not bad " * 10)
    assert len(long) >= 5 * len(short)
    seeds = [2**61 + 7 * i for i in range(6)]
    alone = [generate(bf16_model, tokenizer, [short], [s], _settings(1))[0] for s in seeds]
    beside = generate(bf16_model, tokenizer, [long, short] * 6, [x for s in seeds for x in (s + 1, s)], _settings(12))
    threads(1)
    chunked = generate(bf16_model, tokenizer, [short] * 6, seeds, _settings(4))
    assert [g.completion_ids for g in beside[1::2]] == [g.completion_ids for g in alone]
    assert [g.completion_ids for g in chunked] == [g.completion_ids for g in alone]
    assert len({tuple(g.completion_ids) for g in alone}) > 1  # the rows really sampled


def test_a_prompt_longer_than_a_prefill_block_samples_alike_alone_beside_others_and_on_one_thread(
    bf16_model, tokenizer, threads
):
    long = encode_prompt(tokenizer, "the model is not bad and a good policy helps the user " * 30)
    assert len(long) > PROMPT_BLOCK + PROMPT_STEP  # two prefill blocks, the last one padded
    short = encode_prompt(tokenizer, "the agent says")
    seeds = [11, 12, 13]
    alone = [generate(bf16_model, tokenizer, [long], [s], _settings(1))[0] for s in seeds]
    beside = generate(bf16_model, tokenizer, [short, long] * 3, [x for s in seeds for x in (s + 1, s)], _settings(6))
    threads(1)
    one_thread = generate(bf16_model, tokenizer, [long] * 3, seeds, _settings(3))
    assert [g.completion_ids for g in beside[1::2]] == [g.completion_ids for g in alone]
    assert [g.completion_ids for g in one_thread] == [g.completion_ids for g in alone]


@pytest.mark.slow
@pytest.mark.skipif(not (SMOLLM2 / "config.json").is_file(), reason="run `pbrl models prepare smollm2-135m-instruct`")
def test_smollm2_in_bfloat16_samples_a_prompt_alike_alone_and_beside_a_five_times_longer_one():
    """The real model, where bfloat16 kernels by batch shape changed 8 of 8 rows before (2026-12-06, AMX)."""
    model = AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=torch.bfloat16).eval()
    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    short = encode_prompt(tokenizer, "Write a haiku about the sea.")
    long = encode_prompt(
        tokenizer, "Explain how a transformer language model samples its next token, step by step. " * 15
    )
    assert len(long) >= 5 * len(short)
    seeds = list(range(4))
    settings = SamplingSettings(max_new_tokens=24, temperature=0.8, top_p=0.95, top_k=50, batch_size=8)
    alone = [generate(model, tokenizer, [short], [s], settings)[0] for s in seeds]
    beside = generate(model, tokenizer, [long] * 4 + [short] * 4, [100, 101, 102, 103, *seeds], settings)
    assert [g.completion_ids for g in beside[4:]] == [g.completion_ids for g in alone]


# ---------------------------------------------------------------------------------------------- scoring
def test_rows_alone_scoring_gives_every_row_the_bits_of_the_row_scored_alone(bf16_model, threads):
    from pbrl.learning.logprobs import sequence_logprobs, shared_prompt_logprobs

    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, 300, (n,), generator=generator).tolist() for n in (30, 7, 30, 52)]
    completions = [torch.randint(4, 300, (n,), generator=generator).tolist() for n in (5, 9, 1, 12)]
    prompts[2] = prompts[0]  # a shared prompt
    with torch.inference_mode():
        batched = sequence_logprobs(bf16_model, prompts, completions, pad_token_id=0, rows_alone=True)
        shared = shared_prompt_logprobs(bf16_model, prompts, completions, pad_token_id=0, rows_alone=True)
        threads(1)
        alone = [
            sequence_logprobs(bf16_model, [p], [c], pad_token_id=0, rows_alone=True)
            for p, c in zip(prompts, completions, strict=True)
        ]
    assert torch.equal(batched, torch.cat(alone)) and torch.equal(shared, batched)
