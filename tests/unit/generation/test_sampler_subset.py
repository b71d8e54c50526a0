"""The seeded sampler's top-k path (issue #33): the warp and the draw on each row's k kept tokens give the tokens of
transformers' warpers over the whole vocabulary."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pbrl.generation import sampling
from pbrl.generation.sampling import SamplingSettings, encode_prompt, generate
from pbrl.generation.seeded_sampler import (
    SeededSampler,
    build_warpers,
    counter_uniforms,
    draw_inverse_cdf,
    top_k_settings,
    warp_full,
    warp_top_k,
)

INF = float("inf")


def test_the_kept_tokens_and_scores_by_hand() -> None:
    # T = 0.7 gives probabilities 0.514, 0.123, 0.060, 0.030, 0.014, 0.007, 0.0004, 0.251 (tokens 0-7); top-k 6
    # keeps 0, 7, 1, 2, 3, 4 (drops -1 and -3); top-p 0.9 on them, ascending: 4 and 3 hold 0.015 and 0.030 of the
    # kept mass (cumulative 0.015, 0.044 <= 0.1) and go; token 2 brings it to 0.105, so 2, 1, 7, 0 stay.
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5]])
    ids, values, wide = warp_top_k(logits, 0.7, 6, 0.9)
    assert ids.tolist() == [list(range(8))] and not wide.any()  # min(4 k, v) = 8 slots, in vocabulary order
    expected = torch.tensor([[2.0, 1.0, 0.5, -INF, -INF, -INF, -INF, 1.5]]) / 0.7  # float32, as the warper divides
    assert torch.equal(values, expected)
    full = build_warpers(0.7, 0.9, 6)(torch.zeros(1, 1, dtype=torch.long), logits.clone())
    assert torch.isfinite(full).nonzero()[:, 1].tolist() == [0, 1, 2, 7]


def test_ties_of_the_kth_value_are_all_kept_and_ties_at_the_top_p_boundary_go_by_id() -> None:
    # transformers keeps every token at or above the k-th value: three tokens tie at 1.0 for k = 2.
    ids, values, _ = warp_top_k(torch.tensor([[3.0, 1.0, 1.0, 0.0, 1.0]]), 1.0, 2, 1.0)
    assert ids.tolist() == [[0, 1, 2, 3, 4]] and values.tolist() == [[3.0, 1.0, 1.0, -INF, 1.0]]
    # rows that keep different numbers of tokens: row 0 keeps 2 of its 5 slots, row 1 four
    ids, values, _ = warp_top_k(torch.tensor([[3.0, 1.0, 2.0, 0.0, 1.5], [3.0, 1.0, 1.0, 0.0, 1.0]]), 1.0, 2, 1.0)
    assert values.tolist() == [[3.0, -INF, 2.0, -INF, -INF], [3.0, 1.0, 1.0, -INF, 1.0]]
    # two tokens of probability 0.5 for top-p 0.5: the lower id comes first in ascending order (cumulative 0.5 <=
    # 0.5) and goes, in the middle of the vocabulary as at its ends
    for a, b in ((0, 1), (1, 3), (700, 2900)):
        logits = -20.0 - torch.arange(3000.0)[None] / 3000  # distinct below the pair
        logits[0, [a, b]] = 5.0
        ids, values, _ = warp_top_k(logits, 1.0, 50, 0.5)
        assert ids[torch.isfinite(values)].tolist() == [b]
    # more than 4 k kept through ties (a flat or all -inf row): the row is warped over the whole vocabulary
    assert warp_top_k(torch.zeros(2, 9), 1.0, 2, 1.0)[2].tolist() == [True, True]
    assert warp_top_k(torch.full((1, 6), -INF), 1.0, 1, 1.0)[2].tolist() == [True]
    assert warp_top_k(torch.zeros(1, 8), 1.0, 2, 1.0)[2].tolist() == [False]  # 8 = 4 k: still fits


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k", "expected"),
    [
        (0.8, 0.95, 50, (0.8, 50, 0.95)),
        (1.0, 0.9, 20, (1.0, 20, 0.9)),
        (0.5, 1.0, 5, (0.5, 5, 1.0)),
        (0.8, 0.95, None, None),  # no top-k cut: the whole vocabulary
    ],
)
def test_the_settings_are_read_from_the_warpers(temperature, top_p, top_k, expected) -> None:
    assert top_k_settings(build_warpers(temperature, top_p, top_k)) == expected


def _sampler(rows: int, top: tuple[float, float, int], subset: bool) -> SeededSampler:
    temperature, top_p, top_k = top
    seeds = torch.arange(rows, dtype=torch.int64) * 1_000_003 + 11
    warpers = build_warpers(temperature, top_p, top_k)
    return SeededSampler(seeds, 4, warpers, torch.tensor([0]), [f"row {r}" for r in range(rows)], temperature, subset)


@pytest.mark.parametrize("top", [(0.8, 0.95, 50), (1.0, 0.9, 20), (0.3, 0.5, 7), (1.7, 1.0, 100), (1.0, 1.0, 1)])
def test_the_subset_draws_the_tokens_of_the_whole_vocabulary(top) -> None:
    """Random logits of three shapes (flat, peaked, heavy-tailed; no ties), 256 rows, 12 steps: every token equal."""
    generator = torch.Generator().manual_seed(7)
    rows, vocab = 256, 3000
    flat = torch.randn(rows // 4, vocab, generator=generator) * 0.2
    peaked = torch.randn(rows // 4, vocab, generator=generator) * 4
    scale = torch.randn(rows // 2, vocab, generator=generator).exp()  # a normal of log-normal scale: heavy tails
    tailed = torch.randn(rows // 2, vocab, generator=generator) * scale
    logits = torch.cat([flat, peaked, tailed])
    fast, full = _sampler(rows, top, True), _sampler(rows, top, False)
    assert fast.top_k is not None and full.top_k is None
    for step in range(12):
        input_ids = torch.full((rows, 4 + step), 5, dtype=torch.long)
        a, b = fast(input_ids, logits.roll(step, dims=-1)), full(input_ids, logits.roll(step, dims=-1))
        assert torch.equal(a, b), step
        assert (torch.isfinite(a).sum(-1) == 1).all()  # one forced token per row


def test_the_subset_draw_follows_the_inverse_cdf_by_hand() -> None:
    # the kept tokens 0, 1, 2, 7 (above) in id order: a uniform just below each one's CDF value draws it
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5]]).expand(4, -1)
    warped = build_warpers(0.7, 0.9, 6)(torch.zeros(4, 1, dtype=torch.long), logits.clone())
    probs = torch.softmax(warped[0].double(), -1)
    cdf = probs[[0, 1, 2, 7]].cumsum(0)  # id order: 0, 1, 2, 7
    uniforms = torch.stack([cdf[0] - 1e-3, cdf[1] - 1e-3, cdf[2] - 1e-3, torch.tensor(0.999, dtype=torch.float64)])
    assert draw_inverse_cdf(warped, uniforms).tolist() == [0, 1, 2, 7]
    seeds = torch.arange(4, dtype=torch.int64)
    sampler = SeededSampler(seeds, 1, build_warpers(0.7, 0.9, 6), torch.tensor([99]), list("abcd"), 0.7)
    forced = sampler(torch.zeros(4, 1, dtype=torch.long), logits.clone())
    assert forced.argmax(-1).tolist() == draw_inverse_cdf(warped, counter_uniforms(seeds, 0)).tolist()


def _first_rows_tokens(batch: torch.Tensor, top: tuple[float, float, int], input_ids=None) -> list[int]:
    """Row 0's forced token for seeds 0..11, ``batch`` of (b, v) logits (row 0 first)."""
    names = [f"row {r}" for r in range(len(batch))]
    ids = torch.zeros(len(batch), 1, dtype=torch.long) if input_ids is None else input_ids
    out = []
    for seed in range(12):
        seeds = torch.tensor([seed] + [7] * (len(batch) - 1))
        sampler = SeededSampler(seeds, 1, build_warpers(*top), torch.tensor([99]), names, top[0])
        out.append(int(sampler(ids, batch).argmax(-1)[0]))
    return out


def test_a_rows_tokens_do_not_depend_on_its_neighbours() -> None:
    """Found by review: a neighbour that ties many tokens once sent the whole batch through transformers' unstable
    sort, and a neighbour's width changed the rounding of the row's cumulative probabilities at 1 - top_p."""
    vocab = 40
    row = -20.0 - torch.arange(float(vocab))[None] / vocab
    row[0, [1, 3]] = 5.0  # two equal best tokens; top_p 0.5 keeps one: by the id rule, 3
    top = (1.0, 0.5, 2)
    alone = _first_rows_tokens(row, top)
    assert set(alone) == {3}
    assert _first_rows_tokens(torch.cat([row, torch.zeros(1, vocab)]), top) == alone  # a flat live neighbour
    finished = torch.tensor([[0, 5], [0, 99]])  # the neighbour already generated stop id 99; its logits all -inf
    neighbour = torch.full((1, vocab), -INF)
    assert _first_rows_tokens(torch.cat([row, neighbour]), top, finished) == alone
    # top_p within one float32 rounding of a cumulative probability, and a neighbour whose 3rd value ties 8 tokens
    row = torch.tensor([[0.0, -8.0, -8.0, -8.0, 0.0, -8.0, -8.0, -8.0, 1.0]])  # top-3 keeps ids 0, 4, 8
    neighbour = torch.tensor([[5.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    top = (1.0, 1 - 0.21194155514240265, 3)
    assert _first_rows_tokens(torch.cat([row, neighbour]), top) == _first_rows_tokens(row, top)


def test_a_row_of_many_ties_is_warped_over_the_whole_vocabulary_by_the_same_rules() -> None:
    flat = torch.zeros(1, 300)
    # ten equal best tokens, k = 2: all ten kept (more than 4 k); top_p 0.55, ascending by id: cumulative 0.1 ... 0.4
    # <= 0.45 removes the four lowest ids, 0.5 does not, so the six highest stay
    flat[0, 10:20] = 1.0
    warped = warp_full(flat, 1.0, 2, 0.55)
    assert torch.isfinite(warped).nonzero()[:, 1].tolist() == [14, 15, 16, 17, 18, 19]
    tokens = _first_rows_tokens(flat, (1.0, 0.55, 2))
    assert set(tokens) <= set(range(14, 20)) and len(set(tokens)) > 1
    assert _first_rows_tokens(torch.cat([flat, torch.randn(1, 300)]), (1.0, 0.55, 2)) == tokens


def _stable_full_path(logits: torch.Tensor, uniforms: torch.Tensor, top: tuple[float, float, int]) -> torch.Tensor:
    """transformers' warpers over the whole vocabulary with a stable sort (ties by id), then the draw."""
    temperature, top_p, top_k = top
    scaled = logits / temperature
    scaled = scaled.masked_fill(scaled < scaled.topk(top_k, dim=-1).values[:, -1:], -INF)
    ascending, order = scaled.sort(dim=-1, stable=True)
    removed = ascending.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
    removed[..., -1:] = False
    warped = scaled.masked_fill(torch.zeros_like(removed).scatter(1, order, removed), -INF)
    return draw_inverse_cdf(warped, uniforms)


@pytest.mark.parametrize("top", [(0.8, 0.95, 50), (1.0, 0.5, 20), (0.3, 0.9, 7)])
def test_bfloat16_logits_full_of_ties_draw_the_stable_full_paths_tokens(top) -> None:
    """Logits rounded to bfloat16 (8 significant bits) tie at the k-th value and at the top-p boundary."""
    generator = torch.Generator().manual_seed(3)
    rows = 512
    logits = (torch.randn(rows, 3000, generator=generator) * 3).bfloat16().float()  # (b, v)
    sampler = _sampler(rows, top, True)
    uniforms = counter_uniforms(sampler.seeds, 0)
    expected = _stable_full_path(logits, uniforms, top)
    assert torch.equal(sampler(torch.full((rows, 4), 5), logits).argmax(-1), expected)
    kth = (logits / top[0]).topk(top[2], dim=-1).values[:, -1:]
    assert int(((logits / top[0] >= kth).sum(-1) > top[2]).sum()) > 10  # the k-th value did tie in many rows


def test_generate_gives_the_same_tokens_on_either_path(tiny_model_dir: Path, monkeypatch) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [encode_prompt(tokenizer, t) for t in ("the agent says", "a reward model of the policy", "q")]
    rows = [p for p in prompts for _ in range(8)]
    seeds = list(range(500, 500 + len(rows)))
    settings = SamplingSettings(max_new_tokens=24, temperature=0.8, top_p=0.95, top_k=50, batch_size=12)
    fast = generate(model, tokenizer, rows, seeds, settings)
    monkeypatch.setattr(sampling, "SeededSampler", functools.partial(SeededSampler, subset=False))
    full = generate(model, tokenizer, rows, seeds, settings)
    assert [g.completion_ids for g in fast] == [g.completion_ids for g in full]
    assert len({tuple(g.completion_ids) for g in fast}) == len(rows)
