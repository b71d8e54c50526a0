"""Forwards whose every row has the bits it would have alone: the arithmetic of a row never depends on its batch.

On a CPU, oneDNN computes a bfloat16 (or float16) matrix product with a kernel chosen by the product's shape and
the thread count, and kernels differ in the order they add their terms. So the same row gets other bits in a
product of 33 rows than alone, or with 1 thread than with 2 (measured on an Intel Xeon with AMX: rows of a 64-row
product differ from the row alone in 1 of 8,000 outputs; with the AVX-512 kernels of a CPU without AMX, the
SmolLM2 down-projection differs from 2 rows on). Every value is then rounded to bfloat16's 8 bits, so a last-bit
difference of the float32 sum becomes a jump of 2^-8, and a sampled token changes where float32 would have kept
it (1 row in 8 beside a longer prompt, 6 of 128 candidates of a Ray run against the local one). Padding does the
same through attention: a left-padded row's keys sit at other offsets, and a longer key axis is split and summed
in another order.

Inside :func:`row_invariant` a model computes each row as if alone:

* **Linear layers** run on blocks of 2 to :func:`row_block` rows: the largest block (up to
  :data:`ROW_BLOCK_MAX`) for which every row of the block equals, bit for bit, the row computed beside a zero row
  with one thread (a one-row product takes a matrix-vector kernel of its own, so a lone row is computed as such a
  pair). It is measured once per weight shape, dtype and thread count on this CPU, with the layer's own weight
  (:func:`probe_row_block`), because kernels and their thresholds differ between CPUs; the float32 LoRA adapters
  over a bfloat16 base are blocked the same way.
* **Attention** runs per group of rows with the same key offset (:func:`set_row_offsets`): each group attends
  to exactly its own keys, with no padding in the key axis, so a row's attention has the shapes it has alone.
  The model's attention implementation is switched to :data:`ATTENTION` for the block.

A **prompt's prefill** (:func:`prompt_rows`) is always computed as if alone, so its rows need no protection from a
batch, only from the thread count: its linear layers run on blocks of :data:`PROMPT_BLOCK` rows (the last one padded
with zero rows to a multiple of :data:`PROMPT_STEP`), each computed as one thread computes it. Where the current
thread count gives the bits of one thread for a block of that many rows (:func:`threads_agree`, measured once per
weight shape, dtype, row count and thread count), the block runs on every thread; elsewhere on one. Ten SmolLM2
prompts of 90-400 tokens prefilled in 1.30 s with row blocks of 32 and in 0.76 s so (2 threads, AMX; 0.74 s in one
product per layer, whose bits depend on the thread count from 256 rows on). Several prompts may share a forward,
packed one after the other in the sequence axis: each keeps its own blocks and attends to its own keys, and only
the layers' elementwise work (norms, activations, residuals) runs over the pack at once.

Sampling (:mod:`pbrl.generation.sampling`) prefills each distinct prompt as if alone (packed:
:mod:`pbrl.generation.prefill`) and decodes every row of a chunk at once under this block; float32 models keep their
batched path (MKL's strict reproducibility mode makes a float32 product independent of the thread count, and its
last-bit differences between batch shapes almost never move a token). See docs/design/architecture.md#what-is-bitwise.

No library offers this on CPUs: the batch-invariant kernels of vLLM and SGLang are CUDA kernels.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from pbrl.models.threads import gemm_independent_of_threads, one_thread, results_independent_of_threads

ROW_BLOCK_MAX = 32  # rows per block of a linear layer, at most: a decode step's batch in one block on AMX CPUs
# rows per block of a prompt's prefill, and the step its last block is padded to (so that a layer meets at most 7 row
# counts): on an Intel Xeon with AMX, oneDNN's bfloat16 products of SmolLM2's layers give the bits of one thread with
# two for every row count up to 255 (576 -> 576 differs from 288 rows on, 1536 -> 576 from 256)
PROMPT_BLOCK, PROMPT_STEP = 224, 32
ATTENTION = "pbrl_row_groups"  # the attention implementation registered below
LOW_PRECISION = (torch.bfloat16, torch.float16)
_PROBE_OUTPUTS = 1 << 19  # outputs compared per block size: a kernel's differences show in about 1 of 10^4
_PROBE_ROWS_MAX = 4096
_AGREE_OUTPUTS = 1 << 17  # outputs compared per row count: a kernel chosen by the thread count changes ~1 in 10^4

# (start, stop, key offset) runs of rows; None outside a row-invariant forward
_GROUPS: ContextVar[tuple[tuple[int, int, int], ...] | None] = ContextVar("pbrl_row_groups", default=None)
# inside prompt_rows(): the token count of each prompt packed in the sequence axis (() = one prompt); None outside
_PROMPT: ContextVar[tuple[int, ...] | None] = ContextVar("pbrl_prompt_rows", default=None)
_BLOCKS: dict[tuple[Any, ...], int] = {}
_AGREE: dict[tuple[Any, ...], bool] = {}
_LOCK = threading.RLock()  # one row-invariant block at a time: it patches modules shared by agents over one base


def applies(model: nn.Module) -> bool:
    """Whether ``model`` needs row-invariant forwards: it has bfloat16 or float16 weights on the CPU (frozen
    weights in ``torch_dtype: auto`` on a CPU with bfloat16 arithmetic, or an explicit ``torch_dtype``)."""
    return any(p.dtype in LOW_PRECISION and p.device.type == "cpu" for p in model.parameters())


def _probe_rows(out_features: int, block: int) -> int:
    rows = max(block, -(-_PROBE_OUTPUTS // out_features))
    return min(_PROBE_ROWS_MAX, -(-rows // block) * block)


def _paired(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` of one row (1, in) computed beside a zero row, as a block of 2: the reference arithmetic of a
    row (a product of one row is a matrix-vector kernel of its own, unlike every larger block)."""
    return nn.functional.linear(torch.cat([x, x.new_zeros(x.shape)]), weight, bias)[:1]


def probe_row_block(weight: torch.Tensor, bias: torch.Tensor | None, limit: int = ROW_BLOCK_MAX) -> int:
    """The largest m ≤ ``limit`` such that ``F.linear`` on any block of 2..m rows gives each row the bits of that
    row computed beside a zero row with one thread (:func:`_paired`), measured on random rows (seeded) with this
    weight and bias at the current thread count; 1 when no block of 2 or more does (every row is then computed
    beside a zero row).

    Each block size is checked on enough rows that about 5 * 10^5 outputs are compared: where two kernels add in
    another order, about 1 output in 10^4 shows it in bfloat16. Measured on an Intel Xeon with AMX (2 threads):
    32 for every bfloat16 layer of SmolLM2; for float32 LoRA adapters 15 (576 -> 8) and 32 (8 -> 576).
    """
    threads = torch.get_num_threads()
    generator = torch.Generator().manual_seed(0)
    rows = _probe_rows(weight.shape[0], limit)
    inputs = torch.randn(rows, weight.shape[1], generator=generator).to(weight.dtype)  # (n, in)
    with torch.inference_mode():
        torch.set_num_threads(1)
        try:
            reference = torch.cat([_paired(inputs[i : i + 1], weight, bias) for i in range(len(inputs))])
        finally:
            torch.set_num_threads(threads)
        for m in range(2, limit + 1):
            n = min(_probe_rows(weight.shape[0], m), len(inputs) // m * m)
            blocks = [nn.functional.linear(inputs[i : i + m], weight, bias) for i in range(0, n, m)]
            if not torch.equal(torch.cat(blocks), reference[:n]):
                return m - 1
    return limit


def row_block(weight: torch.Tensor, bias: torch.Tensor | None) -> int:
    """:func:`probe_row_block` for this weight's shape, dtype, layout and the current thread count, measured once
    per process (about 0.3 s for SmolLM2's 49,152 x 576 head)."""
    key = (tuple(weight.shape), tuple(weight.stride()), weight.dtype, bias is not None, torch.get_num_threads())
    block = _BLOCKS.get(key)
    if block is None:
        block = _BLOCKS[key] = probe_row_block(weight, bias)
    return block


def threads_agree(weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> bool:
    """Whether ``F.linear`` on ``rows`` rows with this weight and bias gives, at the current thread count, the bits
    it gives on one thread: compared on random rows (seeded) in as many products as it takes to compare about
    1.3 * 10^5 outputs (at most 256 products: a narrow LoRA adapter's float32 product), measured once per weight
    shape, dtype, layout, row count and thread count (true on one thread)."""
    threads = torch.get_num_threads()
    if threads == 1 or (weight.dtype == torch.float32 and gemm_independent_of_threads()):
        return True  # float32 LoRA adapters: MKL's strict mode
    key = (tuple(weight.shape), tuple(weight.stride()), weight.dtype, bias is not None, rows, threads)
    agree = _AGREE.get(key)
    if agree is None:
        generator = torch.Generator().manual_seed(0)
        products = min(256, -(-_AGREE_OUTPUTS // (rows * weight.shape[0])))
        inputs = torch.randn(products, rows, weight.shape[1], generator=generator).to(weight.dtype)  # (p, rows, in)
        with torch.inference_mode():
            ours = [nn.functional.linear(x, weight, bias) for x in inputs]
            with one_thread():
                theirs = [nn.functional.linear(x, weight, bias) for x in inputs]
            agree = all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
        _AGREE[key] = agree
    return agree


@contextmanager
def prompt_rows(lengths: Sequence[int] = ()) -> Iterator[None]:
    """Inside :func:`row_invariant`, the forwards in this block are prompts' prefills, each computed as if alone:
    linear layers run on blocks of :data:`PROMPT_BLOCK` rows with the bits of one thread (see the module docstring).
    ``lengths``: the token count of each prompt when several are packed one after the other in the sequence axis of
    a batch of one (their sum is the sequence's length); each then has its own row blocks and attends to its own
    keys only, causally, and its positions must start at 0. Empty: one prompt."""
    token = _PROMPT.set(tuple(int(n) for n in lengths))
    try:
        yield
    finally:
        _PROMPT.reset(token)


def _segments(rows: int) -> list[tuple[int, int]]:
    """(start, stop) of each packed prompt in a sequence of ``rows`` tokens (:func:`prompt_rows`)."""
    lengths = _PROMPT.get() or (rows,)
    if sum(lengths) != rows:
        raise RuntimeError(f"packed prompts of {sum(lengths)} tokens, but the sequence has {rows}")
    return [(stop - n, stop) for n, stop in zip(lengths, itertools.accumulate(lengths), strict=True)]


def _prompt_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` (..., in) -> (..., out) for prompts each computed as if alone (:func:`prompt_rows`): each
    prompt's rows on their own, in blocks of :data:`PROMPT_BLOCK`, the last one padded with zero rows to a multiple
    of :data:`PROMPT_STEP`, each block with the bits one thread gives it, on every thread where they agree. A row's
    bits depend on its block's row count and its place in it, both fixed by its prompt's length. A float32 layer (a
    LoRA adapter) under MKL's strict mode, whose bits do not depend on the thread count, runs as one product per
    prompt: a prompt alone has one shape."""
    weight, bias = module.weight, module.bias
    flat = x.reshape(-1, x.shape[-1])  # (r, in): a batch of one
    single = weight.dtype == torch.float32 and gemm_independent_of_threads()
    parts = []
    for first, stop in _segments(len(flat)):
        if single:
            parts.append(nn.functional.linear(flat[first:stop], weight, bias))
            continue
        for start in range(first, stop, PROMPT_BLOCK):
            block = flat[start : min(start + PROMPT_BLOCK, stop)]  # (m, in)
            rows = -(-len(block) // PROMPT_STEP) * PROMPT_STEP
            padding = block.new_zeros((rows - len(block), block.shape[1]))
            padded = torch.cat([block, padding]) if len(padding) else block  # (rows, in)
            with contextlib.nullcontext() if threads_agree(weight, bias, rows) else one_thread():
                parts.append(nn.functional.linear(padded, weight, bias)[: len(block)])
    return (torch.cat(parts) if len(parts) > 1 else parts[0]).reshape(*x.shape[:-1], -1)  # (..., out)


def linear_rows(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` with each row's bits independent of the other rows of ``x`` (..., in) -> (..., out): the rows
    in blocks of 2 to :func:`row_block` rows, a lone row beside a zero row; a prompt's prefill
    (:func:`prompt_rows`) in blocks of :data:`PROMPT_BLOCK` rows with the bits of one thread."""
    if _PROMPT.get() is not None:
        return _prompt_linear(module, x)
    weight, bias = module.weight, module.bias
    flat = x.reshape(-1, x.shape[-1])  # (r, in)
    block = max(row_block(weight, bias), 1)
    if 2 <= len(flat) <= block:
        return nn.functional.linear(x, weight, bias)
    if block == 1 and torch.get_num_threads() > 1:  # even a pair differs from the pair on one thread: compute it so
        with one_thread():
            return torch.cat([_paired(flat[i : i + 1], weight, bias) for i in range(len(flat))]).reshape(
                *x.shape[:-1], -1
            )
    parts = [flat[i : i + block] for i in range(0, len(flat), block)]
    out = torch.cat([nn.functional.linear(p, weight, bias) if len(p) > 1 else _paired(p, weight, bias) for p in parts])
    return out.reshape(*x.shape[:-1], -1)  # (..., out)


def _groups(offsets: Sequence[int]) -> tuple[tuple[int, int, int], ...]:
    """Runs of consecutive rows with the same key offset: (start, stop, offset)."""
    runs: list[tuple[int, int, int]] = []
    for row, offset in enumerate(offsets):
        if runs and runs[-1][2] == offset and runs[-1][1] == row:
            runs[-1] = (runs[-1][0], row + 1, offset)
        else:
            runs.append((row, row + 1, int(offset)))
    return tuple(runs)


def set_row_offsets(offsets: Sequence[int]) -> None:
    """Declare, for the forwards that follow inside :func:`row_invariant`, where each row's keys start in the key
    axis (its left padding): row r attends to keys ``offsets[r]:`` only. All zeros for unpadded rows."""
    _GROUPS.set(_groups(offsets))


def _grouped_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of query (b, h, q, d) over key/value (b, kv_h, k, d), one scaled-dot-product call per group of
    rows with the same key offset, on the group's own keys only. A query of several tokens (a prompt's prefill)
    must see every key (no cache before it) and is causal. Returns (b, q, h, d), as transformers expects.
    Outside :func:`row_invariant` it is transformers' ``sdpa``."""
    groups = _GROUPS.get()
    if groups is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    groups = groups or ((0, query.shape[0], 0),)  # none declared: every row unpadded
    if groups[-1][1] != query.shape[0]:
        raise RuntimeError(f"row offsets cover {groups[-1][1]} rows, but the batch has {query.shape[0]}")
    q_len, gqa = query.shape[2], key.shape[1] != query.shape[1]
    if q_len > 1 and key.shape[2] != q_len:
        raise RuntimeError("a row-invariant forward of several tokens must not follow a cache (a prefill or a scoring)")
    lengths = _PROMPT.get()
    if q_len > 1 and lengths and len(lengths) > 1:  # prompts packed in a batch of one: each on its own keys
        if query.shape[0] != 1:
            raise RuntimeError(f"packed prompts need a batch of one, not {query.shape[0]}")
        attended = torch.cat(
            [
                nn.functional.scaled_dot_product_attention(
                    query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True, scale=scaling, enable_gqa=gqa
                )  # (1, h, n, d)
                for a, b in _segments(q_len)
            ],
            2,
        )  # (1, h, q, d)
        return attended.transpose(1, 2).contiguous(), None
    outputs = []
    for start, stop, offset in groups:
        keys, values = key[start:stop, :, offset:], value[start:stop, :, offset:]  # (g, kv_h, k - offset, d)
        queries = query[start:stop, :, offset:] if q_len > 1 else query[start:stop]  # (g, h, q', d)
        attended = nn.functional.scaled_dot_product_attention(
            queries, keys, values, is_causal=q_len > 1, scale=scaling, enable_gqa=gqa
        )  # (g, h, q', d)
        if q_len > 1 and offset:  # the padding's own queries: zeros, read by nothing that counts
            attended = torch.cat([attended.new_zeros((*attended.shape[:2], offset, attended.shape[-1])), attended], 2)
        outputs.append(attended)
    attended = torch.cat(outputs) if len(outputs) > 1 else outputs[0]  # (b, h, q, d)
    return attended.transpose(1, 2).contiguous(), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The mask of :data:`ATTENTION`: none, each group's keys are exactly the keys its rows attend to."""
    return None


AttentionInterface.register(ATTENTION, _grouped_attention)
AttentionMaskInterface.register(ATTENTION, _no_mask)


def transformers_model(model: nn.Module) -> Any:
    """The transformers model under ``model`` (a peft model's base model; else ``model``)."""
    get_base = getattr(model, "get_base_model", None)  # a peft model: its transformers model
    return get_base() if callable(get_base) else model


@contextmanager
def row_invariant(model: nn.Module) -> Iterator[None]:
    """Inside the block, ``model``'s forwards compute each row as it is computed alone (see the module docstring):
    its linear layers in row blocks, its attention per group of rows declared by :func:`set_row_offsets` (every
    row unpadded until then). Only for models that :func:`applies` to; one block at a time per process.

    Raises:
        ValueError: the model's attention cannot be switched (it does not use transformers' attention interface).
    """
    base = transformers_model(model)
    with _LOCK, results_independent_of_threads():  # the load follower may change the thread count in here
        before = base.config._attn_implementation
        if not base._can_set_attn_implementation():
            raise ValueError(f"{type(base).__name__} does not use transformers' attention interface")
        linears = [m for m in model.modules() if type(m) is nn.Linear]
        token = _GROUPS.set(())
        base.set_attn_implementation(ATTENTION)
        # accelerate's offload hooks wrap a module's forward around ``_old_forward`` (they load offloaded weights
        # first): the row blocks replace the wrapped forward there, and the hook stays
        slots = [(m, "_old_forward" if hasattr(m, "_hf_hook") else "forward") for m in linears]
        saved = [m.__dict__.get(slot) for m, slot in slots]
        for module, slot in slots:
            setattr(module, slot, lambda x, module=module: linear_rows(module, x))
        try:
            yield
        finally:
            for (module, slot), old in zip(slots, saved, strict=True):
                if old is None:
                    delattr(module, slot)
                else:
                    setattr(module, slot, old)
            base.set_attn_implementation(before)
            _GROUPS.reset(token)
