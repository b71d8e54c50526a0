"""Fitting the joint reward model of MARLHF (docs/design/algorithms.md#joint-reward-model) and measuring it on pairs
(winner, loser) of joint rows.

**Fitting.** Bradley–Terry (Bradley and Terry 1952; Christiano et al. 2017; Ouyang et al. 2022 eq. 1):
L = −log σ(R(w) − R(l)), mean over a batch, AdamW. With a frozen backbone the features of every row are
computed once and only the head is stepped (the same losses, without a backbone forward per step).

**Measuring.** Loss, accuracy and margin of pairs (:func:`pair_metrics`, :func:`pair_correct`,
:func:`pair_margins`), each distinct row scored once; the held-out pairs are whole items (:func:`heldout_split`).
The model itself: :mod:`pbrl.learning.reward_model`.

Shape legend: b batch (pairs), f features.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pbrl.learning.joint_template import JointInput
from pbrl.learning.losses import bradley_terry_loss
from pbrl.learning.reward_model import JointRewardModel, JointRow, row_features, score_joint
from pbrl.models.threads import follow_load


@dataclass(frozen=True)
class PairMetrics:
    loss: float  # mean Bradley–Terry loss, nats
    accuracy: float  # share of pairs with R(w) > R(l)
    margin_mean: float  # mean R(w) − R(l)


Pair = tuple[JointRow, JointRow]  # (winner, loser)


@torch.no_grad()
def pair_metrics(model: JointRewardModel, pairs: Sequence[Pair], batch_size: int) -> PairMetrics:
    """Loss, accuracy and mean margin of ``pairs`` (winner, loser); NaN for no pairs."""
    if not pairs:
        return PairMetrics(math.nan, math.nan, math.nan)
    w, lo = (torch.tensor(x, dtype=torch.float64) for x in _pair_scores(model, pairs, batch_size))  # (b,) each
    margins = w - lo
    return PairMetrics(
        float(bradley_terry_loss(w, lo).mean()), float((margins > 0).double().mean()), float(margins.mean())
    )


@torch.no_grad()
def pair_correct(model: JointRewardModel, pairs: Sequence[Pair], batch_size: int) -> list[bool]:
    """Per pair (winner, loser): whether the model scores the winner strictly higher."""
    return [m > 0 for m in pair_margins(model, pairs, batch_size)]


@torch.no_grad()
def pair_margins(model: JointRewardModel, pairs: Sequence[Pair], batch_size: int) -> list[float]:
    """Per pair (winner, loser): the margin R(w) − R(l) (positive: ordered right), each distinct row scored once."""
    if not pairs:
        return []
    w, lo = _pair_scores(model, pairs, batch_size)
    return [a - b for a, b in zip(w, lo, strict=True)]


def _pair_scores(model: JointRewardModel, pairs: Sequence[Pair], batch_size: int) -> tuple[list[float], list[float]]:
    """The winners' and the losers' scores, each distinct row scored once: a joint response is in many pairs
    (every pair of an item's responses shares them), so scoring per pair would repeat most forwards."""
    rows, index = _distinct_rows(pairs)
    scores = score_joint(model, rows, batch_size)
    return [scores[w] for w, _ in index], [scores[lo] for _, lo in index]


def _distinct_rows(pairs: Sequence[Pair]) -> tuple[list[JointRow], list[tuple[int, int]]]:
    """The distinct rows of the pairs (by ids, first-seen order) and each pair as (winner, loser) row indexes."""
    index: dict[tuple[int, ...], int] = {}
    rows: list[JointRow] = []
    for pair in pairs:
        for row in pair:
            key = tuple(row.ids if isinstance(row, JointInput) else row)
            if key not in index:
                index[key] = len(rows)
                rows.append(row)
    keys = [tuple(tuple(r.ids if isinstance(r, JointInput) else r) for r in pair) for pair in pairs]
    return rows, [(index[w], index[lo]) for w, lo in keys]


def fit_bradley_terry(
    model: JointRewardModel,
    pairs: Sequence[Pair],
    *,
    epochs: int,
    batch_size: int,
    learning_rate: float,
    seed: int,
    max_grad_norm: float | None,
    on_step: Callable[[float], None] | None = None,
) -> dict[str, int]:
    """Fit ``model`` in place: ``epochs`` passes over ``pairs`` (winner, loser) in a seeded order,
    ``batch_size`` pairs per AdamW step (torch defaults besides ``lr``), winner and loser rows scored together,
    gradient norm clipped to ``max_grad_norm`` (None: not clipped). A step whose loss or gradient norm is not
    finite is skipped (parameters and optimizer state untouched) and counted. ``on_step(loss)`` is called after
    every step (the stage's progress).

    First the standardization of ``segments`` features is set from the distinct training rows
    (:meth:`JointRewardModel.standardize_on`). With a frozen backbone those rows' features are computed once
    (no gradients, eval mode, as every forward) and each step runs the head alone on them. Last, the range of each
    head input on those rows under the fitted model (:meth:`JointRewardModel.set_input_range`; a trained backbone's
    rows are run once more), to which the model clamps a row it scores later.

    Returns:
        ``{"steps": n, "skipped_steps": n}``.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=learning_rate)
    rng = np.random.default_rng(seed)
    rows, index = _distinct_rows(pairs)
    features = _training_features(model, rows)
    steps = skipped = 0
    for _ in range(epochs):
        order = rng.permutation(len(pairs))
        for begin in range(0, len(pairs), batch_size):
            chunk = [index[j] for j in order[begin : begin + batch_size]]
            follow_load()  # before a step: a safe point to change torch's threads (pbrl/models/threads.py)
            loss = _batch_loss(model, rows, features, chunk)
            steps += 1
            if on_step is not None:
                on_step(float(loss.detach()))
            skipped += not _adamw_step(optimizer, params, loss, max_grad_norm)
    if isinstance(model, JointRewardModel) and rows and model.pooling == "segments":  # the fitted model's inputs
        model.set_input_range(
            row_features(model, rows) if features.cached is None else features.cached, features.overlaps
        )
    return {"steps": steps, "skipped_steps": skipped}


@dataclass(frozen=True)
class _Features:
    """What a fit computes once from its distinct rows (n): ``cached`` (n, f) the features of a frozen backbone (None:
    the backbone moves, its features are recomputed at every step), ``overlaps`` (n, a) the prompt-overlap inputs."""

    cached: torch.Tensor | None
    overlaps: torch.Tensor | None


def _training_features(model: JointRewardModel, rows: list[JointRow]) -> _Features:
    """Standardize ``segments`` features on the training rows (:meth:`JointRewardModel.standardize_on`) and keep what
    the steps reuse. Any model other than a :class:`JointRewardModel` (tests' hand models: plain scorers of rows)
    has neither."""
    joint = isinstance(model, JointRewardModel)
    frozen = joint and model.backbone_frozen
    cached = row_features(model, rows) if rows and joint and (frozen or model.pooling == "segments") else None
    if cached is not None:
        model.standardize_on(cached, rows)
    overlaps = model.overlap_features(rows) if cached is not None and model.uses_overlap else None  # (n, a)
    return _Features(cached if frozen else None, overlaps)


def _batch_loss(
    model: JointRewardModel, rows: list[JointRow], features: _Features, chunk: list[tuple[int, int]]
) -> torch.Tensor:
    """The mean Bradley–Terry loss of the pairs ``chunk`` ((winner, loser) row indexes), winners and losers scored
    together: the head on the cached features, or a forward of the rows."""
    both = [w for w, _ in chunk] + [lo for _, lo in chunk]  # winners then losers: (2b,)
    if features.cached is not None:
        overlaps = None if features.overlaps is None else features.overlaps[both]
        scores = model.head_scores(features.cached[both], overlaps)
    else:
        scores = model([rows[j] for j in both])
    return bradley_terry_loss(scores[: len(chunk)], scores[len(chunk) :]).mean()


def _adamw_step(
    optimizer: torch.optim.Optimizer, params: list[torch.Tensor], loss: torch.Tensor, max_grad_norm: float | None
) -> bool:
    """One step on ``loss``, its gradient norm clipped to ``max_grad_norm`` (None: measured, not clipped); whether it
    stepped. A non-finite loss or gradient norm leaves the parameters and the optimizer state untouched."""
    optimizer.zero_grad(set_to_none=True)
    if not torch.isfinite(loss):
        return False
    loss.backward()
    norm = (
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        if max_grad_norm is not None
        else torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params if p.grad is not None]))
    )
    if not torch.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        return False
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return True


def heldout_split(groups: Sequence[str], share: float, seed: int) -> tuple[list[int], list[int]]:
    """Seeded split of the pairs into (train, held-out) indices by *group* (a pair's item): every pair of a
    held-out item is held out, so no held-out pair shares an item, hence a prompt or a response, with a training
    pair (holding out random pairs of the same items measured memory, not generalisation: issue #30).

    Of the G distinct groups (first-seen order), round(share·G) are held out, at least 1 when G ≥ 2, none when
    G < 2 (one item: every pair trains). With one pair per group this is a plain split of the pairs. Both lists
    in increasing order."""
    distinct = list(dict.fromkeys(groups))
    count = len(distinct)
    held = 0 if count < 2 else min(count - 1, max(1, round(share * count)))
    perm = np.random.default_rng(seed).permutation(count)
    held_groups = {distinct[int(i)] for i in perm[:held]}
    held_idx = [i for i, g in enumerate(groups) if g in held_groups]
    return [i for i, g in enumerate(groups) if g not in held_groups], held_idx
