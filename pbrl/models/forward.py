"""How a model's forward passes run: eval mode (dropout off) for sampling and scoring, training forwards with
seeded dropout masks, and the distinct prompts of a batch (each prefilled once)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn
from transformers import DynamicCache

from pbrl.models.precision import Precision, autocast
from pbrl.models.threads import follow_load


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Put every submodule of ``model`` in eval mode (dropout off) and restore each one's mode afterwards.

    Restores the modes module by module, so a model whose parts were in different modes (e.g. a frozen
    backbone kept in eval under a training head) comes back exactly as it was. Gradient mode is untouched.
    Entering is a safe point to change torch's threads (:func:`pbrl.models.threads.follow_load`).
    """
    follow_load()
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, was_training in modes:
            module.training = was_training


def has_dropout(model: torch.nn.Module) -> bool:
    """True when ``model`` holds a dropout module with p > 0 (e.g. peft's ``lora_dropout``)."""
    kinds = (
        torch.nn.Dropout,
        torch.nn.Dropout1d,
        torch.nn.Dropout2d,
        torch.nn.Dropout3d,
        torch.nn.AlphaDropout,
        torch.nn.FeatureAlphaDropout,
    )
    return any(isinstance(m, kinds) and m.p > 0 for m in model.modules())


def _cuda_indices(model: torch.nn.Module) -> list[int]:
    """The CUDA devices holding ``model``'s resident parameters (several when accelerate split it)."""
    indices = set()
    for param in model.parameters():
        if param.device.type == "cuda":
            indices.add(param.device.index if param.device.index is not None else torch.cuda.current_device())
    return sorted(indices)


@contextmanager
def training_forward(model: torch.nn.Module, seed: int, precision: Precision | None = None) -> Iterator[None]:
    """Inside the block, every forward of ``model`` runs in train mode, so its dropout takes effect, with
    masks drawn from torch's RNG seeded with ``seed``: the same seed gives the same masks (a resumed run
    is bitwise identical), and the global RNG state is restored on exit (``torch.random.fork_rng``).
    With ``precision`` (``mixed_precision`` bf16/fp16), the forwards also run under its autocast
    (:func:`pbrl.models.precision.autocast`); the float32 master weights are not cast.

    Score with ``sequence_logprobs(..., dropout=True)`` inside the block (it otherwise forces eval mode).
    Every submodule's mode is restored on exit. Backward draws no random numbers (the masks are saved by
    the forward). A model split over several GPUs by ``agent_devices: auto`` gets ``seed`` on each of them.
    Entering is a safe point to change torch's threads (:func:`pbrl.models.threads.follow_load`).
    """
    follow_load()
    modes = [(module, module.training) for module in model.modules()]
    cuda = _cuda_indices(model)
    model.train()
    try:
        with torch.random.fork_rng(devices=cuda), autocast(precision):
            torch.random.default_generator.manual_seed(seed)
            for index in cuda:
                with torch.cuda.device(index):
                    torch.cuda.manual_seed(seed)
            yield
    finally:
        for module, was_training in modes:
            module.training = was_training


def distinct_prompts(prompt_ids: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[int]]:
    """The distinct prompts in first-seen order and, per row, the index of its prompt among them."""
    index: dict[tuple[int, ...], int] = {}
    distinct: list[list[int]] = []
    rows = []
    for prompt in prompt_ids:
        key = tuple(int(i) for i in prompt)
        if key not in index:
            index[key] = len(distinct)
            distinct.append(list(key))
        rows.append(index[key])
    return distinct, rows


def pad_rows(
    rows: Sequence[Sequence[int]], pad_token_id: int, padding_side: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token rows as one padded batch: (b, t) ids, mask and position ids, and (b,) the index of each row's last
    token. Masks and positions come from the row lengths, never from comparing ids with the pad id (pad may equal
    EOS). Raises ValueError for an unknown ``padding_side`` or an empty row."""
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side: got {padding_side!r}; allowed: left, right")
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    if len(rows) == 0 or int(lengths.min()) == 0:
        raise ValueError("joint input ids: every row needs at least one token")
    width = int(lengths.max())
    offsets = width - lengths if padding_side == "left" else torch.zeros_like(lengths)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)  # (b, t)
    mask = torch.zeros((len(rows), width), dtype=torch.long)  # (b, t)
    for r, row in enumerate(rows):
        start = int(offsets[r])
        input_ids[r, start : start + len(row)] = torch.tensor(list(row), dtype=torch.long)
        mask[r, start : start + len(row)] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (b, t)
    return input_ids, mask, positions, offsets + lengths - 1


def shared_prefix_hidden(
    backbone: nn.Module, rows: Sequence[Sequence[int]], cuts: Sequence[Sequence[int]], pad_token_id: int
) -> torch.Tensor:
    """Last-layer hidden states of b token rows, each prefix that rows share run once.

    Each row is cut into L + 1 chunks at ``cuts[r]`` (the same L for every row). Chunk l of the rows runs once
    per distinct *prefix through chunk l*, attending to the cached keys and values of its prefix (gathered to
    it with ``DynamicCache.batch_select_indices``). The joint inputs of one item share the header and every
    prompt; cross joint responses with the same agent-1 candidate also share everything up to agent 2's
    response (:mod:`pbrl.learning.joint_template`): cutting at each response's start, a chunk is computed once
    per distinct candidate prefix instead of once per row (the shared-prompt idea of
    :func:`pbrl.learning.logprobs.shared_prompt_logprobs`, one level deeper). Positions count the real tokens
    before each one and masks come from the lengths, so the values agree with one plain forward per row to
    float32 rounding (tests/unit/learning/test_reward_model.py).

    Args:
        backbone: a transformer body (``AutoModel``, possibly peft-wrapped) taking ``cache``, ``use_cache``,
            ``position_ids`` and ``attention_mask``, returning ``last_hidden_state``.
        rows: b token-id lists.
        cuts: per row, L non-decreasing cut positions in [1, len(row)]; a chunk may be empty, but not the first.
        pad_token_id: the id written into padding positions (never used to infer masks).

    Returns:
        (b, t, h) hidden states laid out as :func:`pad_rows` with right padding lays the rows out (t = the
        longest row); padding positions hold zeros.

    Raises:
        ValueError: rows with different numbers of cuts, a cut outside [1, len(row)] or a decreasing one.
    """
    bounds, levels = _chunk_bounds(rows, cuts)
    device = next(backbone.parameters()).device
    out: torch.Tensor | None = None
    cache = DynamicCache(config=backbone.config)
    mask: torch.Tensor | None = None  # (d, tokens so far): the mask of the previous level's distinct prefixes
    parent_of_row: list[int] = []
    for level in range(levels + 1):
        keys = [tuple(int(i) for i in r[: bd[level + 1]]) for r, bd in zip(rows, bounds, strict=True)]
        distinct, of_row = distinct_prompts(keys)
        first_row = [of_row.index(d) for d in range(len(distinct))]
        starts = [bounds[first_row[d]][level] for d in range(len(distinct))]
        chunks = [distinct[d][starts[d] :] for d in range(len(distinct))]
        if level:
            parents = torch.tensor([parent_of_row[first_row[d]] for d in range(len(distinct))], dtype=torch.long)
            cache.batch_select_indices(parents)
            mask = mask[parents] if mask is not None else None
        if max(len(c) for c in chunks):
            hidden, mask = _chunk_forward(backbone, chunks, starts, mask, pad_token_id, cache, device)  # (d, w, h)
            if out is None:
                out = hidden.new_zeros((len(rows), max(len(r) for r in rows), hidden.shape[-1]))  # (b, t, h)
            for r, bd in enumerate(bounds):
                out[r, bd[level] : bd[level + 1]] = hidden[of_row[r], : bd[level + 1] - bd[level]]
        parent_of_row = of_row
    del cache
    assert out is not None  # the first chunk of every row is non-empty (checked above)
    return out


def _chunk_bounds(rows: Sequence[Sequence[int]], cuts: Sequence[Sequence[int]]) -> tuple[list[list[int]], int]:
    """Per row, its chunk boundaries ``[0, *cuts[r], len(row)]``, and L, the number of cuts of every row.

    Raises:
        ValueError: no rows, rows with different numbers of cuts, a cut outside [1, len(row)] or a decreasing one.
    """
    if not rows:
        raise ValueError("shared_prefix_hidden: no rows")
    levels = {len(c) for c in cuts}
    bounds = [[0, *(int(x) for x in c), len(r)] for r, c in zip(rows, cuts, strict=True)]
    bad = [r for r, bd in enumerate(bounds) if bd[1] < 1 or any(a > b for a, b in zip(bd, bd[1:], strict=False))]
    if len(levels) != 1 or bad:
        raise ValueError(
            f"shared_prefix_hidden: cuts must be as many per row, within [1, len], non-decreasing; rows {bad}"
        )
    return bounds, levels.pop()


def _chunk_forward(
    backbone: nn.Module,
    chunks: list[list[int]],
    starts: list[int],
    mask: torch.Tensor | None,
    pad_token_id: int,
    cache: DynamicCache,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One level of :func:`shared_prefix_hidden`: the d ``chunks`` (right-padded to the longest, w >= 1), chunk d
    starting at position ``starts[d]``, over ``cache`` (the d prefixes before them, whose (d, tokens so far) mask is
    ``mask``; None at the first level). Returns the (d, w, h) hidden states and the mask through these chunks."""
    width = max(len(c) for c in chunks)
    ids = torch.full((len(chunks), width), pad_token_id, dtype=torch.long)  # (d, w)
    chunk_mask = torch.zeros((len(chunks), width), dtype=torch.long)  # (d, w)
    for d, chunk in enumerate(chunks):
        ids[d, : len(chunk)] = torch.tensor(chunk, dtype=torch.long)
        chunk_mask[d, : len(chunk)] = 1
    first = torch.tensor(starts, dtype=torch.long)  # (d,)
    mask = chunk_mask if mask is None else torch.cat([mask, chunk_mask], dim=1)
    hidden = backbone(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        position_ids=(first[:, None] + torch.arange(width)[None, :]).to(device),
        cache=cache,
        use_cache=True,
    ).last_hidden_state  # (d, w, h)
    return hidden, mask


def keep_first_layers(body: nn.Module, count: int | None, *, field: str = "reward_backbone_layers") -> nn.Module:
    """Cut a transformer body (``AutoModel``: embeddings, a stack of decoder layers, a final norm) to its first
    ``count`` decoder layers, in place; None keeps them all. The final norm then applies to layer ``count``'s
    output, so the last hidden state is ``norm(hidden_states[count])`` of the whole body (a probe of an
    intermediate layer, as in Tenney et al. 2019, "BERT rediscovers the classical NLP pipeline", read off at
    ``count / num_hidden_layers`` of the cost). The body's config says ``count`` layers afterwards, so a saved
    copy reloads cut. Only for a module tree of the caller's own (e.g. :func:`pbrl.models.loading.shared_backbone`'s):
    the layers kept are the same modules, the others are dropped from this tree only.

    Raises:
        ValueError: ``count`` is not in [1, the body's layers] or the body has no stack of
            ``num_hidden_layers`` layers named ``layers`` or ``h`` (names ``field``).
    """
    if count is None:
        return body
    total = body.config.num_hidden_layers
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= total:
        raise ValueError(f"{field}: got {count!r}; the backbone has {total} layers (1 to {total}, or null for all)")
    stacks = [n for n in ("layers", "h") if isinstance(getattr(body, n, None), nn.ModuleList)]  # Llama / GPT-2
    if not stacks or len(getattr(body, stacks[0])) != total:
        raise ValueError(f"{field}: {type(body).__name__} has no stack of {total} layers named 'layers' or 'h'")
    setattr(body, stacks[0], nn.ModuleList(list(getattr(body, stacks[0]))[:count]))
    body.config.num_hidden_layers = count
    if isinstance(getattr(body.config, "layer_types", None), list):
        body.config.layer_types = body.config.layer_types[:count]
    return body
