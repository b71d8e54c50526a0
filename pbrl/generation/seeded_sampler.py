"""The seeded sampler: each row draws its tokens from its own counter-based random stream, so a row's tokens
depend on its seed alone, never on its batch neighbours or on global random state.

The uniform number for step s of a row is output s + 1 of SplitMix64 seeded with the row seed (Steele, Lea
and Flood 2014, "Fast splittable pseudorandom number generators"), computed vectorised in torch int64.
A ``LogitsProcessor`` warps the scores with transformers' own temperature / top-k / top-p warpers,
draws one token per row by inverse-CDF with that uniform, and leaves only the drawn token finite, so
``generate(do_sample=False)`` emits exactly the drawn tokens (:mod:`pbrl.generation.sampling`).

Shape legend: b batch (rows), v vocab.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from pbrl.errors import SamplingError

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
    pads them); their scores are not checked.

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
    ):
        self.seeds = seeds  # (b,) int64
        self.prompt_width = prompt_width
        self.warpers = warpers
        self.stop_ids = stop_ids  # (n_stop,) int64
        self.row_names = list(row_names)
        self.temperature = temperature

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        step = input_ids.shape[1] - self.prompt_width
        generated = input_ids[:, self.prompt_width :]  # (b, step)
        live = ~torch.isin(generated, self.stop_ids.to(generated.device)).any(-1)  # (b,)
        bad_logits = undrawable_rows(scores) & live  # (b,)
        warped = self.warpers(input_ids, scores)  # (b, v)
        bad_warped = undrawable_rows(warped) & live  # (b,)
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
        tokens = draw_inverse_cdf(warped, counter_uniforms(self.seeds.to(scores.device), step))  # (b,)
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter(1, tokens[:, None], 0.0)

    def _refuse(self, bad: torch.Tensor, step: int, why: str) -> None:
        if not bool(bad.any()):
            return
        rows = bad.nonzero().flatten().tolist()
        named = "; ".join(self.row_names[r] for r in rows[:_SHOWN_ROWS])
        more = f"; and {len(rows) - _SHOWN_ROWS} more" if len(rows) > _SHOWN_ROWS else ""
        raise SamplingError(
            f"cannot sample generated token {step} in {len(rows)} of {len(bad)} rows ({named}{more}): {why}"
        )
