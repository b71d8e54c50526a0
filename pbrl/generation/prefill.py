"""How a sampling chunk's prompts get into the KV cache before ``generate`` decodes: every prompt column but the
last (``generate`` needs one uncached token to produce the first logits), at the columns of the chunk's left-padded
layout.

Float32 models prefill the chunk's distinct prompts in one padded forward and expand each prompt's keys and values
to the rows that continue it (a prompt's K candidates, both sides of a comparator with the same weights).
bfloat16 and float16 models on the CPU (:mod:`pbrl.models.row_invariance`) prefill each distinct prompt as if
alone, with no padding (several packed in one forward, each with its own row blocks, attention and positions), and
every row then attends to its own keys only: a row's cache, hence its tokens, has the bits it has when the row is
sampled alone.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from pbrl.models.forward import distinct_prompts
from pbrl.models.row_invariance import prompt_rows, set_row_offsets, transformers_model

PACK_TOKENS = 4096  # prompt tokens per packed prefill forward at most: bounds its activations (a longer prompt alone)


def prefill(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    device: torch.device,
    cache: Any,
    *,
    invariant: bool,
    share: bool,
) -> None:
    """Fill ``cache`` (empty) for the left-padded chunk ``input_ids``/``attention_mask`` (b, t): each distinct
    prompt alone and every row's key offset declared (``invariant``, inside
    :func:`pbrl.models.row_invariance.row_invariant`); else the distinct prompts batched (``share``); else nothing
    (``generate`` prefills the padded rows itself)."""
    if invariant:
        _prefill_each_prompt(model, input_ids, attention_mask, device, cache)
        set_row_offsets((attention_mask == 0).sum(-1).tolist())  # row r attends to its keys from column pad_r on
    elif share:
        _shared_prefill(model, input_ids, attention_mask, device, cache)


def _shared_prefill(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, device: torch.device, cache: Any
) -> tuple[Any, int] | None:
    """The KV cache of a left-padded chunk's prompts, each distinct prompt prefilled once, expanded to the rows.

    Covers every column but the last (``generate`` needs one uncached token to produce the first logits), with
    ``generate``'s own position ids (``cumsum(mask) − 1``, 0 on padding), in ``cache`` (empty). Returns (cache,
    distinct prompts), or None when no two rows of the chunk share a prompt or the prompts are one column wide
    (nothing to share).
    """
    distinct, which = distinct_prompts([tuple(r) for r in torch.cat([input_ids, attention_mask], dim=1).tolist()])
    if len(distinct) == len(which) or input_ids.shape[1] < 2:
        return None
    first_rows = [which.index(d) for d in range(len(distinct))]  # one row per distinct (padded) prompt
    ids, mask = input_ids[first_rows, :-1], attention_mask[first_rows, :-1]  # (d, t-1)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)  # (d, t-1)
    model(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        position_ids=positions.to(device),
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    cache.batch_select_indices(torch.tensor(which, dtype=torch.long))  # (d, …) → (b, …); CPU ids: any device
    return cache, len(distinct)


def _prefill_each_prompt(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, device: torch.device, cache: Any
) -> None:
    """Fill ``cache`` (empty) with a left-padded chunk's prompts, every column but the last, each distinct prompt
    prefilled as if alone (no padding, its own shapes) and its keys and values placed at its rows' offsets; the
    padding columns hold zeros that no row attends to (:func:`pbrl.models.row_invariance.set_row_offsets`). Inside
    :func:`pbrl.models.row_invariance.row_invariant`: a row's cache has the bits it has when the row is alone.

    The prompts go through the model packed one after the other in a batch of one, up to :data:`PACK_TOKENS`
    tokens a forward (:func:`pbrl.models.row_invariance.prompt_rows`: each prompt keeps its own row blocks, attention
    and positions), so that the layers' other operations run once per pack rather than once per prompt."""
    width = input_ids.shape[1] - 1
    if width < 1:
        return
    distinct, which = distinct_prompts([tuple(r) for r in torch.cat([input_ids, attention_mask], dim=1).tolist()])
    lengths = attention_mask.sum(-1).tolist()  # (b,) prompt lengths
    prompts = []  # (its rows, its length without the last token) per distinct prompt with a column to cache
    for d in range(len(distinct)):
        rows = [r for r, w in enumerate(which) if w == d]
        if int(lengths[rows[0]]) > 1:
            prompts.append((rows, int(lengths[rows[0]]) - 1))
    layers: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    decoder = transformers_model(model).get_decoder()  # the cache only: no LM head
    for pack in _packs(prompts):
        sizes = [length for _, length in pack]
        ids = torch.cat([input_ids[rows[0], -length - 1 : -1] for rows, length in pack])[None]  # (1, n)
        packed = DynamicCache(config=model.config)
        set_row_offsets([0])
        with prompt_rows(sizes), _rotary_per_prompt(decoder, sizes):
            decoder(
                input_ids=ids.to(device),
                position_ids=torch.cat([torch.arange(n) for n in sizes])[None].to(device),  # (1, n): each from 0
                cache=packed,
                use_cache=True,
            )
        if layers is None:  # (b, kv_h, width, d) zeros per layer
            layers = [
                (
                    layer.keys.new_zeros((len(which), *layer.keys.shape[1:2], width, layer.keys.shape[-1])),
                    layer.values.new_zeros((len(which), *layer.values.shape[1:2], width, layer.values.shape[-1])),
                )
                for layer in packed.layers
            ]
        start = 0
        for rows, length in pack:
            for (keys, values), layer in zip(layers, packed.layers, strict=True):
                keys[rows, :, width - length :] = layer.keys[0, :, start : start + length]
                values[rows, :, width - length :] = layer.values[0, :, start : start + length]
            start += length
    for index, (keys, values) in enumerate(layers or []):
        cache.update(keys, values, index)


def _packs(prompts: list[tuple[list[int], int]]) -> list[list[tuple[list[int], int]]]:
    """``prompts`` (rows, length) in order, grouped into packs of at most :data:`PACK_TOKENS` tokens (a longer
    prompt alone)."""
    packs: list[list[tuple[list[int], int]]] = []
    tokens = 0  # in the last pack
    for prompt in prompts:
        if packs and tokens + prompt[1] <= PACK_TOKENS:
            packs[-1].append(prompt)
            tokens += prompt[1]
        else:
            packs.append([prompt])
            tokens = prompt[1]
    return packs


@contextmanager
def _rotary_per_prompt(decoder: nn.Module, lengths: list[int]) -> Iterator[None]:
    """The decoder's rotary embedding computed for each packed prompt on its own, as when it is alone: an
    elementwise cosine's last bit may depend on where a thread's share of a longer tensor ends."""
    rotary = getattr(decoder, "rotary_emb", None)
    if rotary is None or len(lengths) < 2:
        yield
        return
    forward = rotary.forward
    stops = list(itertools.accumulate(lengths))

    def per_prompt(x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pieces = [forward(x, position_ids[:, stop - n : stop]) for n, stop in zip(lengths, stops, strict=True)]
        return torch.cat([cos for cos, _ in pieces], 1), torch.cat([sin for _, sin in pieces], 1)  # (1, n, d) each

    saved = rotary.__dict__.get("forward")  # an accelerate hook's wrapper, if any: put back as it was
    rotary.forward = per_prompt
    try:
        yield
    finally:
        if saved is None:
            del rotary.forward
        else:
            rotary.forward = saved
