"""Batched sampling whose every row is reproducible from its own seed, however the rows are batched.

HF ``generate`` draws sampled tokens from one global generator shared by the whole batch, so a row's
tokens depend on its batch neighbours and on global random state. Here each row carries a seed; the
uniform number for step s of a row is output s + 1 of SplitMix64 seeded with the row seed (Steele, Lea
and Flood 2014, "Fast splittable pseudorandom number generators"), computed vectorised in torch int64.
The sampler (:mod:`pbrl.generation.seeded_sampler`) forces the drawn token, so ``generate(do_sample=False)``
(left padding, KV cache) emits exactly the drawn tokens. No global RNG is read.

What a row's tokens may depend on besides its prompt, seed and settings is the arithmetic of its logits. A
bfloat16 or float16 model on the CPU computes every row as it computes the row alone (each prompt prefilled
alone, each row attending to its own keys, linear layers in row blocks whose bits do not depend on the other rows
or the thread count: :mod:`pbrl.models.row_invariance`), so its tokens are bitwise those of the row sampled
alone. A float32 model batches the padded rows; its logits then differ between batch layouts in the last float32
bits, which changes a token only when the row's uniform falls within that rounding of a CDF boundary.

A row stops at any of its stop ids (the tokenizer's EOS and every ``generation_config.eos_token_id``), as HF
``generate`` does, and the sampler refuses non-finite logits (HF's ``multinomial`` raises on them; an
inverse-CDF draw would silently return the last vocabulary id).

Shape legend: b batch (rows), t tokens, v vocab.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import Any, Literal

import torch
from torch import nn
from transformers import (
    DynamicCache,
    GenerationConfig,
    LogitsProcessorList,
)

from pbrl.generation.kv_cache import preallocated_cache
from pbrl.generation.prefill import prefill
from pbrl.generation.seeded_sampler import (
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    SEED_LIMIT,
    SeededSampler,
    build_warpers,
    greedy_generation_config,
)
from pbrl.models import row_invariance
from pbrl.models.forward import distinct_prompts, eval_mode


@dataclass(frozen=True)
class SamplingSettings:
    """How every row is sampled; plain values a stage builds from its job (docs/design/stages.md#sample-candidates,
    docs/design/stages.md#evaluate).

    Attributes:
        max_new_tokens: most tokens generated per row, ≥ 1.
        temperature: in [MIN_TEMPERATURE, MAX_TEMPERATURE] (float32 logits / temperature stay finite).
        top_p: nucleus mass in (0, 1]; 1 keeps every token.
        top_k: ≥ 1, or None for no top-k cut.
        batch_size: rows per ``model.generate`` call, ≥ 1.
    """

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int | None
    batch_size: int


@dataclass(frozen=True)
class Batching:
    """How :func:`generate` lays its rows out; a row's tokens do not depend on it (up to float32 rounding, see there).

    Attributes:
        share_prompts: chunk the rows of one prompt together and prefill each distinct prompt of a chunk once, its
            KV cache expanded to every row that continues it.
        preallocate: keep each layer's keys and values in one buffer for the prompt and every new token
            (:mod:`pbrl.generation.kv_cache`) instead of transformers' cache, which copies itself at every token.
    """

    share_prompts: bool = True
    preallocate: bool = True


@dataclass(frozen=True)
class Generation:
    """One sampled completion.

    ``completion_ids`` are exactly the generated tokens: the stop id included when one was generated,
    nothing after it. ``text`` is their decoding with special tokens skipped (for people; the ids are the
    truth). ``stop_token_id`` is the id that ended the row ("eos"), None when it ran to the length limit.
    """

    completion_ids: list[int]
    text: str
    finish_reason: Literal["eos", "length"]
    seed: int
    stop_token_id: int | None


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of a user prompt, with the chat template applied once when the tokenizer has one.

    With a template: the single user message rendered with ``add_generation_prompt=True`` as text, then
    tokenized with ``add_special_tokens=False`` (the template already holds the special tokens). Without
    one: ``tokenizer(prompt).input_ids``.

    Raises:
        ValueError: the prompt is empty or only whitespace, or it encodes to no tokens.
    """
    if not prompt.strip():
        raise ValueError(f"prompt: got {prompt!r}; an empty prompt cannot be sampled from")
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer(text, add_special_tokens=False).input_ids
    else:
        ids = tokenizer(prompt).input_ids
    if not ids:
        raise ValueError(f"prompt: {prompt!r} encodes to no tokens")
    return list(ids)


def stop_token_ids(model: nn.Module, tokenizer: Any) -> list[int]:
    """The ids that end a row: the tokenizer's EOS, then ``model.generation_config.eos_token_id`` (an int or
    a list: Llama 3, Qwen2.5 and Gemma instruct models stop at several), without repeats. ``generate``
    stops at its generation_config's ids; the tokenizer's EOS is added so a completion can always end.

    Raises:
        ValueError: neither source has a stop id, or one is not an int >= 0 (the source is named).
    """
    model_config = getattr(model, "generation_config", None)
    configured = getattr(model_config, "eos_token_id", None)
    sources = [("tokenizer.eos_token_id", tokenizer.eos_token_id)]
    sources += [
        ("model.generation_config.eos_token_id", i)
        for i in (configured if isinstance(configured, (list, tuple)) else [configured])
    ]
    ids: list[int] = []
    for source, value in sources:
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, Integral) or value < 0:
            raise ValueError(f"{source}: got {value!r}; stop ids must be ints >= 0")
        if int(value) not in ids:
            ids.append(int(value))
    if not ids:
        raise ValueError(
            "neither tokenizer.eos_token_id nor model.generation_config.eos_token_id is set; "
            "completions could never finish with 'eos'"
        )
    return ids


def _validate(
    prompt_ids: Sequence[list[int]],
    seeds: Sequence[int],
    settings: SamplingSettings,
    row_names: Sequence[str] | None,
) -> None:
    max_new_tokens, temperature, top_p = settings.max_new_tokens, settings.temperature, settings.top_p
    top_k, batch_size = settings.top_k, settings.batch_size
    problems = []
    if len(prompt_ids) != len(seeds):
        problems.append(f"prompt_ids has {len(prompt_ids)} rows but seeds has {len(seeds)}")
    if row_names is not None and len(row_names) != len(prompt_ids):
        problems.append(f"prompt_ids has {len(prompt_ids)} rows but row_names has {len(row_names)}")
    problems += [f"prompt_ids[{r}] is empty" for r, p in enumerate(prompt_ids) if len(p) == 0]
    problems += [
        f"seeds[{r}]: got {s!r}; must be an int in [0, 2**63)"
        for r, s in enumerate(seeds)
        if isinstance(s, bool) or not isinstance(s, Integral) or not 0 <= s < SEED_LIMIT
    ]
    if max_new_tokens < 1:
        problems.append(f"max_new_tokens: got {max_new_tokens!r}; must be >= 1")
    if not (
        isinstance(temperature, (int, float))
        and math.isfinite(temperature)
        and MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE
    ):
        problems.append(
            f"temperature: got {temperature!r}; must be in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}] "
            "(below, float32 logits / temperature overflow; for greedy decoding use top_k=1)"
        )
    if not 0 < top_p <= 1:
        problems.append(f"top_p: got {top_p!r}; must be in (0, 1]")
    if top_k is not None and top_k < 1:
        problems.append(f"top_k: got {top_k!r}; must be >= 1 or None")
    if batch_size < 1:
        problems.append(f"batch_size: got {batch_size!r}; must be >= 1")
    if problems:
        raise ValueError("; ".join(problems))


def _left_pad(rows: Sequence[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, t) input ids and attention mask, rows right-aligned; the mask comes from the lengths."""
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        attention_mask[i, width - len(row) :] = 1
    return input_ids, attention_mask


def _cut(
    new_tokens: list[int], stop_ids: list[int], max_new_tokens: int
) -> tuple[list[int], Literal["eos", "length"], int | None]:
    """The completion, its finish reason and stop id: up to and including the first stop id, else all
    max_new_tokens tokens (stop id None)."""
    for position, token in enumerate(new_tokens):
        if token in stop_ids:
            return new_tokens[: position + 1], "eos", token
    if len(new_tokens) != max_new_tokens:
        raise RuntimeError(
            f"generation stopped after {len(new_tokens)} of {max_new_tokens} tokens without a stop id {stop_ids}"
        )
    return new_tokens, "length", None


def prompt_grouped_order(prompt_ids: Sequence[Sequence[int]]) -> list[int]:
    """Row indices with the rows of one prompt adjacent (prompts in first-seen order, rows in order within one),
    so that a prompt's rows share a generate chunk and its prefill."""
    _, which = distinct_prompts(prompt_ids)
    return sorted(range(len(prompt_ids)), key=lambda r: which[r])


@dataclass(frozen=True)
class _Plan:
    """What every chunk of one :func:`generate` call shares (built once from its arguments and the model)."""

    settings: SamplingSettings
    batching: Batching
    config: GenerationConfig
    warpers: LogitsProcessorList
    stop_ids: list[int]
    pad_id: int
    device: torch.device
    invariant: bool  # bfloat16/float16 on the CPU: each row computed as if alone (pbrl.models.row_invariance)


# Over 60 lines because of its docstring (the reproducibility contract); the code is ~20 lines.
def generate(
    model: nn.Module,
    tokenizer: Any,
    prompt_ids: Sequence[list[int]],
    seeds: Sequence[int],
    settings: SamplingSettings,
    *,
    row_names: Sequence[str] | None = None,
    on_rows: Callable[[int], None] | None = None,
    batching: Batching = Batching(),
) -> list[Generation]:
    """Sample one completion per (prompt_ids[r], seeds[r]) row; repeat a prompt for K candidates.

    Rows go through ``model.generate`` in chunks of ``settings.batch_size``, left-padded, with the KV
    cache, in eval mode under ``torch.inference_mode`` (every submodule's mode is restored afterwards).
    With ``batching.share_prompts`` (the default) the rows of one prompt are chunked together and each distinct
    prompt of a chunk is prefilled once, its KV cache expanded to every row that continues it (the K candidates of a
    prompt, both sides of a comparator with the same weights); each row still draws from its own seed stream,
    and the tokens equal those of ``share_prompts=False`` up to the float32 rounding of a different batch shape
    (see below; tests/unit/learning/test_shared_prompt.py). A
    row's tokens depend only on its prompt, its seed and the sampling settings, never on the batch it lands
    in or on global random state (see the module docstring). A bfloat16/float16 model on the CPU samples every
    row bitwise as it samples the row alone, whatever the chunking, padding, ``share_prompts`` or thread count
    (rows of one prompt length are chunked together there: fewer attention groups); in float32 different batch
    layouts can differ only where the last float32 bits of the logits move a CDF boundary across the row's
    uniform number.
    A row stops at the first of :func:`stop_token_ids` (the tokenizer's EOS and every id of the model's
    ``generation_config.eos_token_id``, the union HF ``generate`` would stop at); the tokenizer's pad id
    (the first stop id when it has none) fills padding.

    Args:
        model: a causal LM with ``generate``.
        tokenizer: the model's tokenizer (for the EOS / pad ids and decoding).
        prompt_ids: b non-empty token-id lists (see :func:`encode_prompt`).
        seeds: b ints in [0, 2**63), one per row (e.g. from ``pbrl.data.seeds.derive_seed``).
        settings: see :class:`SamplingSettings`.
        row_names: b labels naming each row in errors (e.g. "agent 0, item 'q1', target candidate 2");
            None names them "row r".
        on_rows: called with the number of rows after each generate chunk (a stage's progress).
        batching: see :class:`Batching` (prompts shared, the preallocated KV cache: the same tokens either way).

    Returns:
        b :class:`Generation` in row order: ``finish_reason`` "eos" when a stop id was generated (kept as
        the last id, and as ``stop_token_id``), else "length" with exactly ``max_new_tokens`` ids.

    Raises:
        ValueError: bad arguments (all listed at once), no stop id, or a model generation_config field
            that would alter sampling and has no neutral value.
        SamplingError: an unfinished row's logits are NaN / +inf, or overflow once divided by the
            temperature (the rows are named; nothing is returned).
    """
    _validate(prompt_ids, seeds, settings, row_names)
    names = list(row_names) if row_names is not None else [f"row {r}" for r in range(len(prompt_ids))]
    plan = _plan(model, tokenizer, settings, batching)
    order = _row_order(prompt_ids, invariant=plan.invariant, share_prompts=batching.share_prompts)
    results: dict[int, Generation] = {}
    rows_alone = row_invariance.row_invariant(model) if plan.invariant else contextlib.nullcontext()
    with eval_mode(model), torch.inference_mode(), rows_alone:
        for start in range(0, len(order), settings.batch_size):
            chunk = order[start : start + settings.batch_size]
            row_seeds = [int(seeds[r]) for r in chunk]
            rows = [prompt_ids[r] for r in chunk]
            generated = _sample_chunk(model, tokenizer, rows, row_seeds, [names[r] for r in chunk], plan)
            results.update(zip(chunk, generated, strict=True))
            if on_rows is not None:
                on_rows(len(chunk))
    return [results[r] for r in range(len(prompt_ids))]


def _plan(model: nn.Module, tokenizer: Any, settings: SamplingSettings, batching: Batching) -> _Plan:
    """The stop and pad ids, the greedy generation config, the warpers, the device and whether rows are computed as
    if alone, for one :func:`generate` call.

    Raises:
        ValueError: no stop id, or a model generation_config field that would alter sampling (see
            :func:`stop_token_ids` and :func:`~pbrl.generation.seeded_sampler.greedy_generation_config`).
    """
    stop_ids = stop_token_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    return _Plan(
        settings=settings,
        batching=batching,
        config=greedy_generation_config(model, settings.max_new_tokens, pad_id, stop_ids),
        warpers=build_warpers(settings.temperature, settings.top_p, settings.top_k),
        stop_ids=stop_ids,
        pad_id=pad_id,
        device=next(model.parameters()).device,
        invariant=row_invariance.applies(model),
    )


def _row_order(prompt_ids: Sequence[list[int]], *, invariant: bool, share_prompts: bool) -> list[int]:
    """The order rows are chunked in: rows computed as if alone (``invariant``) by prompt length, then prompt (fewer
    attention groups; the bits do not depend on it); else a prompt's rows adjacent (``share_prompts``) or as given."""
    if invariant:
        _, which = distinct_prompts(prompt_ids)
        return sorted(range(len(prompt_ids)), key=lambda r: (len(prompt_ids[r]), which[r]))
    return prompt_grouped_order(prompt_ids) if share_prompts else list(range(len(prompt_ids)))


def _sample_chunk(
    model: nn.Module,
    tokenizer: Any,
    rows: list[list[int]],
    seeds: list[int],
    names: list[str],
    plan: _Plan,
) -> list[Generation]:
    """One ``model.generate`` call over the b rows of a chunk (left-padded, prefilled, each row drawn from its seed by
    the :class:`SeededSampler`); their :class:`Generation` in the chunk's order.

    Raises:
        SamplingError: an unfinished row's logits are not finite (the sampler names the rows).
    """
    settings = plan.settings
    input_ids, attention_mask = _left_pad(rows, plan.pad_id)  # (b, t)
    sampler = SeededSampler(
        torch.tensor(seeds, dtype=torch.int64),
        input_ids.shape[1],
        plan.warpers,
        torch.tensor(plan.stop_ids, dtype=torch.int64),
        names,
        settings.temperature,
    )
    capacity = input_ids.shape[1] + settings.max_new_tokens
    cache = preallocated_cache(model, capacity) if plan.batching.preallocate else DynamicCache(config=model.config)
    share = plan.batching.share_prompts
    prefill(model, input_ids, attention_mask, plan.device, cache, invariant=plan.invariant, share=share)
    sequences = model.generate(
        input_ids=input_ids.to(plan.device),
        attention_mask=attention_mask.to(plan.device),
        generation_config=plan.config,
        logits_processor=LogitsProcessorList([sampler]),
        cache=cache,  # holds every prompt column but the last (prefill), or none: generate fills it
    )  # (b, t + new)
    generated = []
    for row, seed in zip(sequences[:, input_ids.shape[1] :].tolist(), seeds, strict=True):
        completion, reason, stop_id = _cut(row, plan.stop_ids, settings.max_new_tokens)
        text = tokenizer.decode(completion, skip_special_tokens=True)
        generated.append(Generation(completion, text, reason, seed, stop_id))
    return generated
