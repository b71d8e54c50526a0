"""Sequence log-probabilities of completions under a causal LM, batched with padding.

MADPO (SPEC §5.5) needs log π(a | h) for every completion of every pair: the sum of the log-probs of
*every* completion token, the last one and EOS included (★ the reference library drops the last token).
Scoring is batched and padded, yet gives the same numbers as scoring each sequence alone: the attention
mask and the position ids come from the sequence lengths, never from comparing ids with the pad id
(the pad id may equal the EOS id, as in SmolLM2).

Shape legend: b batch (sequences), t tokens, c completion positions kept (the longest completion), v vocab.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Literal

import torch
from torch import nn


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Put every submodule of ``model`` in eval mode (dropout off) and restore each one's mode afterwards.

    Restores the modes module by module, so a model whose parts were in different modes (e.g. a frozen
    backbone kept in eval under a training head) comes back exactly as it was. Gradient mode is untouched.
    """
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, was_training in modes:
            module.training = was_training


def _validate(
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    vocab_size: int,
    padding_side: str,
) -> None:
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side: got {padding_side!r}; allowed: left, right")
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(
            f"prompt_ids has {len(prompt_ids)} rows but completion_ids has {len(completion_ids)}; "
            "pass one completion per prompt"
        )
    for row, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
        if len(prompt) == 0:
            raise ValueError(f"prompt_ids[{row}] is empty; every completion needs at least one prompt token")
        for name, ids in (("prompt_ids", prompt), ("completion_ids", completion)):
            bad = [int(i) for i in ids if not 0 <= int(i) < vocab_size]
            if bad:
                raise ValueError(f"{name}[{row}] holds token ids outside [0, {vocab_size}): {bad[:5]}")


def sequence_logprobs(
    model: nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    *,
    pad_token_id: int,
    padding_side: Literal["left", "right"] = "left",
    dropout: bool = False,
) -> torch.Tensor:
    """Sum of the log-probs of every completion token given the prompt and the earlier completion tokens.

    For row r with prompt h and completion a = (a_1 … a_C):  log π(a | h) = Σ_j log π(a_j | h, a_<j),
    every token counted, the last one and EOS included. The rows are scored in one padded forward pass;
    ``pad_token_id`` only fills the padding (the masks come from the lengths, so it may equal the EOS id).
    Position ids are ``cumsum(attention_mask) − 1`` (clamped at 0), so a padded row sees the same
    positions as when scored alone. Dropout is off for the call (every submodule is put in eval mode and
    restored afterwards) unless ``dropout`` is true, when the modules keep the modes the caller set (a
    training forward: :func:`pbrl.madpo.training_forward` seeds the masks); gradients flow when called
    with grad enabled, so training can use it. Logits are
    computed only at the positions that predict completion tokens (the model's ``logits_to_keep``, as a
    (b, c) tensor of positions, supported by transformers ≥ 5 causal LMs), never over the prompt.

    Args:
        model: a causal LM (``transformers`` ``*ForCausalLM``) taking ``input_ids``, ``attention_mask``,
            ``position_ids`` and ``logits_to_keep``.
        prompt_ids: b token-id lists, each non-empty.
        completion_ids: b token-id lists; may be empty.
        pad_token_id: the id written into padding positions (any valid id; never used to infer masks).
        padding_side: ``"left"`` (all rows end at the last column) or ``"right"``; the values agree.
        dropout: keep the model's own train/eval modes instead of forcing eval mode.

    Returns:
        (b,) float64 tensor on the model's device, in nats (≤ 0): per-token log-probs in float32, summed
        in float64. An empty completion scores exactly 0.0 (and carries no gradient).

    Raises:
        ValueError: naming the row, when the lists differ in length, a prompt is empty or an id lies
            outside the vocabulary; or when ``padding_side`` is not left/right.
    """
    vocab_size = model.get_input_embeddings().num_embeddings
    _validate(prompt_ids, completion_ids, vocab_size, padding_side)
    device = next(model.parameters()).device
    batch = len(prompt_ids)
    prompt_lens = torch.tensor([len(p) for p in prompt_ids], dtype=torch.long)
    completion_lens = torch.tensor([len(c) for c in completion_ids], dtype=torch.long)
    max_completion = int(completion_lens.max()) if batch else 0
    if max_completion == 0:
        return torch.zeros(batch, dtype=torch.float64, device=device)

    lengths = prompt_lens + completion_lens
    width = int(lengths.max())
    # First column of each row's tokens: left padding right-aligns the rows.
    offsets = width - lengths if padding_side == "left" else torch.zeros(batch, dtype=torch.long)
    input_ids = torch.full((batch, width), pad_token_id, dtype=torch.long)  # (b, t)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)  # (b, t)
    for row, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
        start, stop = int(offsets[row]), int(offsets[row] + lengths[row])
        input_ids[row, start:stop] = torch.tensor([*prompt, *completion], dtype=torch.long)
        attention_mask[row, start:stop] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (b, t)

    # Position p predicts the token at p + 1: row r's completion tokens sit at columns
    # offset + P .. offset + P + C − 1, so the predicting positions start at offset + P − 1.
    steps = torch.arange(max_completion, dtype=torch.long)  # (c,)
    first = offsets + prompt_lens - 1  # (b,)
    keep = (first[:, None] + steps[None, :]).clamp(max=width - 2)  # (b, c); clamp only hits masked slots
    targets = input_ids.gather(1, keep + 1)  # (b, c)
    valid = steps[None, :] < completion_lens[:, None]  # (b, c)

    with contextlib.nullcontext() if dropout else eval_mode(model):
        logits = model(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            position_ids=position_ids.to(device),
            logits_to_keep=keep.to(device),
            use_cache=False,
        ).logits  # (b, c, v)
    logits = logits.float()
    targets, valid = targets.to(device), valid.to(device)
    # log_softmax at the target only: gather − logsumexp, without a second (b, c, v) tensor.
    token_logprobs = logits.gather(-1, targets[..., None]).squeeze(-1) - logits.logsumexp(-1)  # (b, c)
    token_logprobs = torch.where(valid, token_logprobs, torch.zeros_like(token_logprobs))
    # Summed in float64: a float32 sum of a few hundred tokens would already round at the 1e-5 level.
    return token_logprobs.double().sum(-1)  # (b,)
