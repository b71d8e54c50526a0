"""Sequence log-probabilities of completions under a causal LM, batched with padding.

MADPO (docs/design/algorithms.md#madpo) needs log π(a | h) for every completion of every pair: the sum of the
log-probs of
*every* completion token, the last one and EOS included (★ the reference library drops the last token).
Scoring is batched and padded, yet gives the same numbers as scoring each sequence alone: the attention
mask and the position ids come from the sequence lengths, never from comparing ids with the pad id
(the pad id may equal the EOS id, as in SmolLM2).

Shape legend: b batch (sequences), t tokens, c completion positions kept (the longest completion), v vocab.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn
from transformers import DynamicCache

from pbrl.models import row_invariance
from pbrl.models.forward import distinct_prompts, eval_mode, pad_rows
from pbrl.models.row_invariance import set_row_offsets


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
    rows_alone: bool = False,
) -> torch.Tensor:
    """Sum of the log-probs of every completion token given the prompt and the earlier completion tokens.

    For row r with prompt h and completion a = (a_1 … a_C):  log π(a | h) = Σ_j log π(a_j | h, a_<j),
    every token counted, the last one and EOS included. The rows are scored in one padded forward pass;
    ``pad_token_id`` only fills the padding (the masks come from the lengths, so it may equal the EOS id).
    Position ids are ``cumsum(attention_mask) − 1`` (clamped at 0), so a padded row sees the same
    positions as when scored alone. Dropout is off for the call (every submodule is put in eval mode and
    restored afterwards) unless ``dropout`` is true, when the modules keep the modes the caller set (a
    training forward: :func:`pbrl.models.forward.training_forward` seeds the masks); gradients flow when called
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
        rows_alone: give every row the bits it has scored alone, whatever the batch and its padding, also for a
            bfloat16/float16 model on the CPU (:mod:`pbrl.models.row_invariance`; left padding). For scores
            compared across batchings (held-out margins, a judge's verdicts). Off, the rows share one batched
            forward, as training's forwards do: in bfloat16 its values differ from a row alone by about 1e-2 nats
            (in float32 by about 1e-6).

    Returns:
        (b,) float64 tensor on the model's device, in nats (≤ 0): per-token log-probs in float32, summed
        in float64. An empty completion scores exactly 0.0 (and carries no gradient).

    Raises:
        ValueError: naming the row, when the lists differ in length, a prompt is empty or an id lies
            outside the vocabulary; or when ``padding_side`` is not left/right.
    """
    token_logprobs, _ = completion_token_logprobs(
        model,
        prompt_ids,
        completion_ids,
        pad_token_id=pad_token_id,
        padding_side=padding_side,
        dropout=dropout,
        rows_alone=rows_alone,
    )
    if token_logprobs.shape[1] == 0:
        return torch.zeros(len(prompt_ids), dtype=torch.float64, device=token_logprobs.device)
    # Summed in float64: a float32 sum of a few hundred tokens would already round at the 1e-5 level.
    return token_logprobs.double().sum(-1)  # (b,)


def completion_token_logprobs(
    model: nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    *,
    pad_token_id: int,
    padding_side: Literal["left", "right"] = "left",
    dropout: bool = False,
    rows_alone: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token terms of :func:`sequence_logprobs` (same arguments, same padding, masks and errors).

    Returns:
        (b, c) float32 log-probs of every completion token (0 at padding) and the (b, c) bool mask of real
        completion tokens, on the model's device; c is the longest completion (0 when all are empty).
    """
    vocab_size = model.get_input_embeddings().num_embeddings
    _validate(prompt_ids, completion_ids, vocab_size, padding_side)
    device = next(model.parameters()).device
    batch = len(prompt_ids)
    completion_lens = torch.tensor([len(c) for c in completion_ids], dtype=torch.long)
    max_completion = int(completion_lens.max()) if batch else 0
    if max_completion == 0:
        return (torch.zeros((batch, 0), device=device), torch.zeros((batch, 0), dtype=torch.bool, device=device))

    alone = rows_alone and row_invariance.applies(model)
    # row-invariant attention reads each row's keys from its offset on: left padding
    padded = _padded(prompt_ids, completion_ids, pad_token_id, "left" if alone else padding_side)
    input_ids, attention_mask, position_ids, offsets, keep, targets = padded
    valid = torch.arange(max_completion)[None, :] < completion_lens[:, None]  # (b, c)

    rows = row_invariance.row_invariant(model) if alone else contextlib.nullcontext()
    with contextlib.nullcontext() if dropout else eval_mode(model), rows:
        if alone:
            set_row_offsets(offsets.tolist())
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
    return token_logprobs, valid


def _padded(
    prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]], pad_token_id: int, padding_side: str
) -> tuple[torch.Tensor, ...]:
    """The padded batch of prompt + completion rows: (b, t) input ids, attention mask and position ids, (b,) each
    row's first column, the (b, c) positions whose logits predict the completion tokens and the (b, c) targets."""
    prompt_lens = torch.tensor([len(p) for p in prompt_ids], dtype=torch.long)  # (b,)
    completion_lens = torch.tensor([len(c) for c in completion_ids], dtype=torch.long)  # (b,)
    lengths = prompt_lens + completion_lens
    width, batch = int(lengths.max()), len(prompt_ids)
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
    steps = torch.arange(int(completion_lens.max()), dtype=torch.long)  # (c,)
    first = offsets + prompt_lens - 1  # (b,)
    keep = (first[:, None] + steps[None, :]).clamp(max=width - 2)  # (b, c); clamp only hits masked slots
    return input_ids, attention_mask, position_ids, offsets, keep, input_ids.gather(1, keep + 1)


def shared_prompt_logprobs(
    model: nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    *,
    pad_token_id: int,
    dropout: bool = False,
    rows_alone: bool = False,
) -> torch.Tensor:
    """:func:`sequence_logprobs` computing each distinct prompt once: the same values, less compute
    (the sum of :func:`shared_prompt_token_logprobs`; ``rows_alone`` as there).

    Returns:
        (b,) float64 tensor on the model's device, in nats (≤ 0); an empty completion scores exactly 0.0.

    Raises:
        ValueError: as :func:`sequence_logprobs` (rows named).
    """
    token_logprobs, _ = shared_prompt_token_logprobs(
        model, prompt_ids, completion_ids, pad_token_id=pad_token_id, dropout=dropout, rows_alone=rows_alone
    )
    if token_logprobs.shape[1] == 0:
        return torch.zeros(len(prompt_ids), dtype=torch.float64, device=token_logprobs.device)
    return token_logprobs.double().sum(-1)  # (b,)


def uses_activation_checkpointing(model: nn.Module) -> bool:
    """Whether ``model`` (possibly peft-wrapped) recomputes activations in backward (``gradient_checkpointing``),
    where transformers turns the KV cache off, so :func:`shared_prompt_token_logprobs` cannot run."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # through a peft wrapper
    checkpointing = getattr(base, "is_activation_checkpointing", None)  # transformers >= 5.x name
    if checkpointing is None:  # transformers 4 (the 5.x name warns that it is deprecated)
        checkpointing = getattr(base, "is_gradient_checkpointing", False)
    return bool(checkpointing)


def token_logprobs(
    model: nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    *,
    pad_token_id: int,
    dropout: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of the completions, each distinct prompt computed once
    (:func:`shared_prompt_token_logprobs`), or padded whole rows (:func:`completion_token_logprobs`) when the model
    recomputes activations (:func:`uses_activation_checkpointing`). The two agree to float32 rounding.

    Returns:
        (b, c) float32 log-probs (0 at padding) and the (b, c) bool mask of real completion tokens.

    Raises:
        ValueError: as :func:`sequence_logprobs` (rows named).
    """
    score = completion_token_logprobs if uses_activation_checkpointing(model) else shared_prompt_token_logprobs
    return score(model, prompt_ids, completion_ids, pad_token_id=pad_token_id, dropout=dropout)


# Over 60 lines because of its docstring (the method and its equivalence to padded scoring); the code is ~25 lines.
def shared_prompt_token_logprobs(
    model: nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    *,
    pad_token_id: int,
    dropout: bool = False,
    rows_alone: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`completion_token_logprobs` computing each distinct prompt once: the same values, less compute.

    Two forward passes. (1) *Prefill*: the d distinct prompts, left-padded, with a KV cache
    (``transformers`` ``DynamicCache``); the logits of each prompt's last position predict its completions'
    first tokens. (2) *Continue*: every row's completion (but its last token, which predicts nothing),
    right-padded, attends to its prompt's cached keys and values, gathered from the d prefilled rows to the b
    rows (``index_select``, so the gradient of every completion flows back into the one prompt forward and is
    summed there). A prompt shared by k rows (the winner and loser of a pair, the pairs of one item) runs once
    instead of k times; with gradients enabled the prompt's activations are stored once too. Positions are
    the same as in :func:`sequence_logprobs` (prompt length + j for completion token j) and the masks come from
    the lengths, so the values agree with it to float32 rounding (≤ 1e-5 nats on the tiny model and
    SmolLM2: tests/unit/learning/test_shared_prompt.py), and so do the gradients.

    Use it when prompts repeat and are long compared with the completions (HumanEval: 150–300 prompt
    tokens, ≤ 64 completion tokens, 2 completions per pair). It needs the model's KV cache in the training
    forward, so it does not combine with activation checkpointing (transformers turns the cache off there):
    use :func:`sequence_logprobs` then.

    Args:
        model: a causal LM (``*ForCausalLM``, possibly peft-wrapped) taking ``past_key_values``,
            ``position_ids``, ``attention_mask`` and ``logits_to_keep``.
        prompt_ids: b token-id lists, each non-empty; equal lists share one prefill.
        completion_ids: b token-id lists; may be empty.
        pad_token_id: the id written into padding positions (never used to infer masks).
        dropout: keep the model's own train/eval modes (a training forward) instead of forcing eval mode.
            With dropout on, a shared prompt gets one dropout mask for all its rows.
        rows_alone: as in :func:`sequence_logprobs`. A bfloat16/float16 model on the CPU then scores the padded
            whole rows (:func:`completion_token_logprobs`): a continuation over a shared cache is another batch
            shape per prompt, which is what row-invariant scoring rules out.

    Returns:
        (b, c) float32 log-probs of every completion token (0 at padding) and the (b, c) bool mask of real
        completion tokens, on the model's device; c is the longest completion (0 when all are empty).

    Raises:
        ValueError: as :func:`sequence_logprobs` (rows named).
    """

    if rows_alone and row_invariance.applies(model):
        return completion_token_logprobs(
            model, prompt_ids, completion_ids, pad_token_id=pad_token_id, dropout=dropout, rows_alone=True
        )
    vocab_size = model.get_input_embeddings().num_embeddings
    _validate(prompt_ids, completion_ids, vocab_size, "left")
    device = next(model.parameters()).device
    batch = len(prompt_ids)
    completion_lens = torch.tensor([len(c) for c in completion_ids], dtype=torch.long)  # (b,)
    max_completion = int(completion_lens.max()) if batch else 0
    if max_completion == 0:
        return (torch.zeros((batch, 0), device=device), torch.zeros((batch, 0), dtype=torch.bool, device=device))

    distinct, prompt_of_row = distinct_prompts(prompt_ids)
    prompt_input, prompt_mask, prompt_positions, _ = pad_rows(distinct, pad_token_id, "left")  # (d, t) each
    rows = torch.tensor(prompt_of_row, dtype=torch.long)  # (b,)
    completion_input, targets, completion_mask, valid = _shifted_completions(
        completion_ids, completion_lens, max_completion, pad_token_id
    )
    with contextlib.nullcontext() if dropout else eval_mode(model):
        logits = _prefill_and_continue(
            model, (prompt_input, prompt_mask, prompt_positions), rows, completion_input, completion_mask, device
        )  # (b, c, v)
    logits = logits.float()
    targets, valid = targets.to(device), valid.to(device)
    token_logprobs = logits.gather(-1, targets[..., None]).squeeze(-1) - logits.logsumexp(-1)  # (b, c)
    return torch.where(valid, token_logprobs, torch.zeros_like(token_logprobs)), valid


def _shifted_completions(
    completion_ids: Sequence[Sequence[int]], completion_lens: torch.Tensor, max_completion: int, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The continue pass's inputs of b completions (c = ``max_completion`` >= 1, the longest; right-padded with
    ``pad_token_id``): (b, c-1) input ids (tokens 0 .. c-2: the last token predicts nothing), (b, c) targets,
    (b, c-1) long attention mask of the inputs and (b, c) bool mask of real completion tokens, all from the
    (b,) ``completion_lens``."""
    batch, steps = len(completion_ids), max_completion - 1
    # Completion token j of row r sits at column width + j; the input holds tokens 0 .. c-2 (right-padded).
    completion_input = torch.full((batch, max(steps, 0)), pad_token_id, dtype=torch.long)  # (b, c-1)
    targets = torch.full((batch, max_completion), pad_token_id, dtype=torch.long)  # (b, c)
    for r, completion in enumerate(completion_ids):
        if completion:
            targets[r, : len(completion)] = torch.tensor(completion, dtype=torch.long)
            completion_input[r, : len(completion) - 1] = targets[r, : len(completion) - 1]
    completion_mask = (torch.arange(steps)[None, :] < (completion_lens[:, None] - 1)).long()  # (b, c-1)
    valid = torch.arange(max_completion)[None, :] < completion_lens[:, None]  # (b, c)
    return completion_input, targets, completion_mask, valid


def _prefill_and_continue(
    model: nn.Module,
    prompts: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    rows: torch.Tensor,
    completion_input: torch.Tensor,
    completion_mask: torch.Tensor,
    device: torch.device,
) -> torch.Tensor:
    """The two forward passes of :func:`shared_prompt_token_logprobs`: the d left-padded ``prompts`` (ids, mask,
    positions, each (d, t)) with a fresh KV cache, then the b rows' completions over that cache gathered to them
    (``rows``: (b,) the prompt of each row). Returns the (b, c, v) logits in the model's dtype: the prompt's last
    position for completion token 0, then one per completion input token."""
    prompt_input, prompt_mask, prompt_positions = prompts
    steps = completion_input.shape[1]
    cache = DynamicCache(config=model.config)
    first = model(
        input_ids=prompt_input.to(device),
        attention_mask=prompt_mask.to(device),
        position_ids=prompt_positions.to(device),
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
    ).logits[:, -1]  # (d, v): predicts every row's completion token 0
    first = first.index_select(0, rows.to(device))[:, None]  # (b, 1, v)
    if steps == 0:
        return first
    cache.batch_select_indices(rows)  # (d, …) → (b, …), differentiable; CPU ids index any device
    attention_mask = torch.cat([prompt_mask[rows], completion_mask], dim=1)  # (b, t + c-1)
    prompt_lens = prompt_mask.sum(-1)[rows]  # (b,)
    positions = prompt_lens[:, None] + torch.arange(steps)[None, :]  # (b, c-1)
    rest = model(
        input_ids=completion_input.to(device),
        attention_mask=attention_mask.to(device),
        position_ids=positions.to(device),
        cache=cache,
        use_cache=True,
    ).logits  # (b, c-1, v)
    return torch.cat([first, rest], dim=1)  # (b, c, v)
