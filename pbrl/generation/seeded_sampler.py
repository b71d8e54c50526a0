"""The seeded sampler: each row draws its tokens from its own counter-based random stream, so a row's tokens
depend on its seed alone, never on its batch neighbours or on global random state.

The uniform number for step s of a row is output s + 1 of SplitMix64 seeded with the row seed (Steele, Lea
and Flood 2014, "Fast splittable pseudorandom number generators"), computed vectorised in torch int64.
A ``LogitsProcessor`` warps the scores with transformers' own temperature / top-k / top-p warpers,
draws one token per row by inverse-CDF with that uniform, and leaves only the drawn token finite, so
``generate(do_sample=False)`` emits exactly the drawn tokens (:mod:`pbrl.generation.sampling`).

With a top-k cut (the usual case: every config of this project sets ``top_k``) the warp and the draw run on each
row's kept tokens (:func:`warp_top_k`) instead of the whole vocabulary: transformers' top-p warper sorts every
row's full vocabulary and both it and the draw take a softmax and a cumulative sum over it, 44 ms a step for 24
rows of SmolLM2's 49,152 ids on 2 CPU cores against 4.5 ms on the kept ones (docs/results/benchmarks.md). The
warpers' rules are followed to the letter, ties of the k-th value included (a row that keeps more than 4k tokens
through ties is warped over the whole vocabulary by the same rules, :func:`warp_full`). Tokens of equal score at
the top-p boundary are ordered by id, where transformers' sort leaves them to its algorithm. A row's result
depends on that row alone, never on its batch. Otherwise the tokens equal transformers' full path up to the order
in which float sums add their terms, which matters only when a uniform number falls within rounding of a CDF
boundary, or a cumulative probability within rounding of 1 − top_p (tested equal on random, bfloat16 and model
logits).

Shape legend: b batch (rows), v vocab, w kept tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from pbrl.errors import SamplingError
from pbrl.models.threads import follow_load

SEED_LIMIT = 2**63
# Temperatures where float32 logits / temperature stay finite. Lower: |logit| <= 1e4 covers real LMs (Gemma
# soft-caps at 30, fp16 overflows at 65504), and 1e4 / 3.4e38 (float32 max) = 3e-35; 1e-30 leaves 10^4 of
# headroom and is a normal float32 (>= 1.2e-38). Upper: at 100 a logit spread of 60 nats shrinks to 0.6,
# i.e. next to uniform; an infinite temperature would turn masked (-inf) logits into NaN.
MIN_TEMPERATURE = 1e-30
MAX_TEMPERATURE = 100.0
_SHOWN_ROWS = 5  # rows named in a sampling error; the rest are counted


def _signed(constant: int) -> int:
    """A 64-bit unsigned constant as the int64 with the same bits."""
    return constant - 2**64 if constant >= 2**63 else constant


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` is arithmetic: mask the sign copies)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(seeds: torch.Tensor, step: int) -> torch.Tensor:
    """Output ``step + 1`` of SplitMix64 seeded with each seed, as int64 bit patterns.

    int64 multiplication and addition wrap modulo 2**64, which is exactly the unsigned arithmetic
    SplitMix64 needs. Seed 0, step 0 gives 0xE220A8397B1DCDAF (Vigna's reference ``splitmix64.c``).

    Args:
        seeds: (b,) int64 seeds.
        step: the counter, ≥ 0 (the index of the generated token).

    Returns:
        (b,) int64 tensor holding the 64-bit outputs' bits.
    """
    z = seeds.to(torch.int64) + (step + 1) * torch.tensor(_GOLDEN, dtype=torch.int64, device=seeds.device)
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def counter_uniforms(seeds: torch.Tensor, step: int) -> torch.Tensor:
    """One uniform number in [0, 1) per seed for this step: the top 53 bits of :func:`splitmix64`.

    Returns:
        (b,) float64 tensor, a pure function of (seed, step).
    """
    return _shift_right(splitmix64(seeds, step), 11).to(torch.float64) * 2.0**-53


def draw_inverse_cdf(scores: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draw one token per row from softmax(scores) by inverse-CDF: the first token whose CDF exceeds u.

    The CDF runs over the vocabulary in id order, in float64. Tokens with score −inf have probability 0
    and are never drawn (the draw is clamped to the last token with positive probability, which only
    matters when rounding makes u · total reach the total).

    Args:
        scores: (b, v) warped scores (−inf = excluded); each row needs a finite entry.
        uniforms: (b,) numbers in [0, 1).

    Returns:
        (b,) int64 token ids.
    """
    probs = torch.softmax(scores.to(torch.float64), dim=-1)  # (b, v)
    cdf = probs.cumsum(dim=-1)  # (b, v)
    target = uniforms.to(cdf)[:, None] * cdf[:, -1:]  # (b, 1)
    drawn = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # (b,)
    vocab = scores.shape[-1]
    last_positive = vocab - 1 - (probs > 0).flip(-1).to(torch.int64).argmax(dim=-1)  # (b,)
    return torch.minimum(drawn, last_positive)


def build_warpers(temperature: float, top_p: float, top_k: int | None) -> LogitsProcessorList:
    """transformers' own warpers in ``generate``'s order: temperature, top-k, top-p (neutral ones left out)."""
    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(float(temperature)))
    if top_k is not None:
        warpers.append(TopKLogitsWarper(int(top_k)))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(float(top_p)))
    return warpers


def top_k_settings(warpers: LogitsProcessorList) -> tuple[float, int, float] | None:
    """(temperature, top_k, top_p) when ``warpers`` are what :func:`build_warpers` makes with a top-k cut (the
    temperature and top-p warpers optional, transformers' defaults: −inf filter, one token kept at least), else None
    (the full-vocabulary path applies)."""
    found = {type(w): w for w in warpers}
    order = [TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper]
    top_k, top_p = found.get(TopKLogitsWarper), found.get(TopPLogitsWarper)
    if (
        top_k is None
        or [type(w) for w in warpers] != [kind for kind in order if kind in found]
        or any(w.filter_value != float("-inf") for w in (top_k, top_p) if w is not None)
        or (top_p is not None and top_p.min_tokens_to_keep != 1)
    ):
        return None
    temperature = found.get(TemperatureLogitsWarper)
    return (
        float(temperature.temperature) if temperature else 1.0,
        int(top_k.top_k),
        float(top_p.top_p) if top_p else 1.0,
    )


# The tokens each row carries through the warp (k times this, at most the vocabulary): room for ties of the k-th
# value (bfloat16 logits, 8 significant bits, tie often). A row that keeps more (a flat or all −inf row) is warped
# over the whole vocabulary. The width does not depend on the batch, so neither does a row's rounding.
_WIDTH_PER_K = 4


def _top_p_by_id(values: torch.Tensor, top_p: float) -> torch.Tensor:
    """``TopPLogitsWarper``'s rule on (b, n) scores in vocabulary order, ties ordered by id (a stable sort): ascending,
    the tokens whose cumulative probability is at most 1 − top_p removed (−inf), the most probable kept."""
    ascending, order = values.sort(dim=-1, stable=True)  # (b, n)
    removed = ascending.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
    removed[..., -1:] = False
    return values.masked_fill(torch.zeros_like(removed).scatter(1, order, removed), float("-inf"))


def warp_full(scores: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """:func:`warp_top_k`'s rules over the whole vocabulary: (b, v) warped scores, −inf where removed (the path of
    rows that keep more than ``4 · top_k`` tokens)."""
    scaled = scores / temperature if temperature != 1.0 else scores  # (b, v)
    kth = scaled.topk(min(top_k, scores.shape[-1]), dim=-1).values[:, -1:]  # (b, 1)
    warped = scaled.masked_fill(scaled < kth, float("-inf"))
    return _top_p_by_id(warped, top_p) if top_p < 1.0 else warped


def warp_top_k(
    scores: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' temperature, top-k and top-p warpers (in ``generate``'s order) computed on each row's best tokens
    only: the kept token ids and their warped scores, −inf where removed.

    The rules are transformers' (``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``): scores
    divided by the temperature; every token whose scaled score is below the k-th largest removed (ties of the k-th
    value all kept); of those left, in ascending order, the tokens whose cumulative probability is at most
    1 − top_p removed, the most probable always kept. One rule is ours: tokens of equal score are ordered by id
    (the lower id first, so removed first). transformers' full sort leaves their order to its algorithm, which on
    CPU is not stable (here already for 17 equal values): with ties at the top-p boundary (frequent in bfloat16
    logits) its tokens depended on the sort, ours depend on the scores alone.

    Args:
        scores: (b, v) float logits.
        temperature: > 0; top_k: ≥ 1; top_p: in (0, 1].

    Returns:
        (b, w) int64 ids ascending, (b, w) warped scores, and (b,) bool ``wide``: the rows that keep more than w
        tokens (ties of their k-th value), whose scores here are incomplete: warp them with :func:`warp_full`.
        w = min(4 · top_k, v), whatever the batch.
    """
    scaled = scores / temperature if temperature != 1.0 else scores  # (b, v), as TemperatureLogitsWarper divides
    k = min(top_k, scores.shape[-1])
    width = min(_WIDTH_PER_K * k, scores.shape[-1])
    values, ids = scaled.topk(min(width + 1, scores.shape[-1]), dim=-1)  # (b, w + 1) descending
    kth = values[:, k - 1 : k]  # (b, 1)
    # a row keeps more than w tokens iff its (w + 1)-th best still ties its k-th (a NaN k-th value: a finished row)
    wide = values[:, -1] >= kth[:, 0] if values.shape[-1] > width else torch.zeros_like(kth[:, 0], dtype=torch.bool)
    values, ids = values[:, :width], ids[:, :width]
    values = values.masked_fill(~(values >= kth), float("-inf"))  # below the row's k-th value (or NaN)
    by_id = ids.argsort(dim=-1)  # (b, w): vocabulary order
    ids, values = ids.gather(1, by_id), values.gather(1, by_id)
    return ids, (_top_p_by_id(values, top_p) if top_p < 1.0 else values), wide


def undrawable_rows(scores: torch.Tensor) -> torch.Tensor:
    """Rows whose softmax is undefined: a NaN or +inf score, or no finite score at all (−inf alone is fine).

    Args:
        scores: (b, v) logits or warped scores.

    Returns:
        (b,) bool.
    """
    # One pass: a row's max is NaN when it holds a NaN (max propagates NaN), +inf with a +inf, −inf when all are −inf.
    return ~torch.isfinite(scores.amax(dim=-1))


class SeededSampler(LogitsProcessor):
    """Samples each row from its own counter-based stream and forces the drawn token.

    Returns scores that are −inf everywhere but the drawn token (0.0), so greedy decoding emits it.
    The step is the number of tokens generated so far: ``input_ids.shape[1] − prompt_width``, the same
    for a row whatever its padding. Rows that already generated a stop id are finished (``generate``
    pads them); their scores are not checked. With ``subset`` (the default) and a top-k cut among ``warpers``,
    the warp and the draw run on each row's kept tokens (:func:`warp_top_k`, :func:`warp_full` for rows of many ties);
    ``subset=False`` always applies transformers' warpers to the whole vocabulary (the path for warpers without a
    top-k cut, kept for comparisons).

    Raises:
        SamplingError: an unfinished row's logits, or its logits after the warpers, have a NaN or +inf or
            no finite entry; the message names the rows (``row_names``) and the generated-token index.
    """

    def __init__(
        self,
        seeds: torch.Tensor,
        prompt_width: int,
        warpers: LogitsProcessorList,
        stop_ids: torch.Tensor,
        row_names: Sequence[str],
        temperature: float,
        subset: bool = True,
    ):
        self.seeds = seeds  # (b,) int64
        self.prompt_width = prompt_width
        self.warpers = warpers
        self.stop_ids = stop_ids  # (n_stop,) int64
        self.row_names = list(row_names)
        self.temperature = temperature
        self.top_k = top_k_settings(warpers) if subset else None  # None: warp the full vocabulary

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        follow_load()  # between two tokens: a safe point to change torch's threads (pbrl/models/threads.py)
        step = input_ids.shape[1] - self.prompt_width
        generated = input_ids[:, self.prompt_width :]  # (b, step)
        live = ~torch.isin(generated, self.stop_ids.to(generated.device)).any(-1)  # (b,)
        bad_logits = undrawable_rows(scores) & live  # (b,)
        ids, full, wide = None, None, None
        if self.top_k is not None:
            ids, warped, wide = warp_top_k(scores, *self.top_k)  # (b, w) each, (b,)
            if bool(wide.any()):  # rows of more ties than w: the whole vocabulary, same rules
                full = warp_full(scores[wide], *self.top_k)  # (n_wide, v)
        else:
            warped = self.warpers(input_ids, scores)  # (b, v)
        bad_warped = undrawable_rows(warped) & live  # (b,)
        if full is not None:
            bad_warped[wide] = undrawable_rows(full) & live[wide]
        if bool((bad_logits | bad_warped).any()):  # one device sync per step
            self._refuse(
                bad_logits,
                step,
                "the model's logits are NaN or +inf (a NaN/inf weight or an "
                "overflowing activation: check the checkpoint and torch_dtype)",
            )
            self._refuse(
                bad_warped,
                step,
                f"logits / temperature {self.temperature!r} overflow float32; use a "
                f"temperature in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]",
            )
        uniforms = counter_uniforms(self.seeds.to(scores.device), step)  # (b,)
        if ids is None:
            tokens = draw_inverse_cdf(warped, uniforms)  # (b,)
        else:  # the kept tokens in id order: the CDF runs over them as over the vocabulary
            tokens = ids.gather(1, draw_inverse_cdf(warped, uniforms)[:, None]).squeeze(1)  # (b,)
            if full is not None:
                tokens[wide] = draw_inverse_cdf(full, uniforms[wide])
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter_(1, tokens[:, None], 0.0)

    def _refuse(self, bad: torch.Tensor, step: int, why: str) -> None:
        if not bool(bad.any()):
            return
        rows = bad.nonzero().flatten().tolist()
        named = "; ".join(self.row_names[r] for r in rows[:_SHOWN_ROWS])
        more = f"; and {len(rows) - _SHOWN_ROWS} more" if len(rows) > _SHOWN_ROWS else ""
        raise SamplingError(
            f"cannot sample generated token {step} in {len(rows)} of {len(bad)} rows ({named}{more}): {why}"
        )


# GenerationConfig fields that would add a logits processor or change decoding and have no explicit
# neutral value (None means "unset", which generate() fills from model.generation_config).
_UNNEUTRALISABLE = (
    "bad_words_ids",
    "sequence_bias",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
    "watermarking_config",
    "stop_strings",
    "max_time",
    "prompt_lookup_num_tokens",
    "assistant_early_exit",
)


def greedy_generation_config(
    model: nn.Module, max_new_tokens: int, pad_id: int, stop_ids: list[int]
) -> GenerationConfig:
    """Greedy decoding with every processor-adding field set to its neutral value: with a :class:`SeededSampler` as
    its only logits processor, ``generate`` emits exactly the drawn tokens.

    ``generate`` fills unset (None) fields from ``model.generation_config``; explicit values keep the
    model's own settings (temperature, repetition penalty, …) out. Fields with no neutral value must be
    unset on the model.
    """
    model_config = getattr(model, "generation_config", None)
    if model_config is not None:
        found = {f: getattr(model_config, f, None) for f in _UNNEUTRALISABLE}
        found = {f: v for f, v in found.items() if v is not None}
        if found:
            raise ValueError(
                f"model.generation_config sets {found}; pbrl samples with its own processor and cannot "
                "neutralise these fields: set them to None on the model's generation_config"
            )
    return GenerationConfig(
        do_sample=False,
        num_beams=1,
        num_return_sequences=1,
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,  # takes precedence over any min_length (becomes the prompt length)
        temperature=1.0,
        top_p=1.0,
        top_k=50,
        repetition_penalty=1.0,
        encoder_repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        encoder_no_repeat_ngram_size=0,
        remove_invalid_values=False,
        renormalize_logits=False,
        guidance_scale=1.0,
        use_cache=True,
        output_scores=False,
        return_dict_in_generate=False,
        pad_token_id=pad_id,
        eos_token_id=stop_ids,
    )
