"""The joint reward model of MARLHF (docs/design/algorithms.md#joint-reward-model): one scalar score for a whole joint
response.

**Joint input**: :mod:`pbrl.learning.joint_template`.

**Model.** :class:`JointRewardModel`: a causal-LM backbone without its LM head (``AutoModel``) and a scalar
linear head on a pooled feature vector of the last layer's hidden states (``pooling``, :data:`POOLINGS`):

- ``last_token`` (the reference's): the hidden state at the **last non-padding token** of the joint text (h);
- ``segments``: per agent k, the mean hidden state over agent k's response tokens and log(1 + their count)
  (a·(h+1), :func:`pbrl.learning.segment_head.segment_features`), standardized with the mean and spread of the
  training rows' features (stored with the head), optionally projected on each agent's principal components, and
  each agent's standardized log length squared; with ``length_products`` the product of every two agents'
  standardized log lengths, and with ``prompt_overlap`` each agent's standardized share of what is particular to
  its prompt that its response mentions (:mod:`pbrl.learning.prompt_overlap`: the words a mean of hidden states
  does not show), and with ``joint_overlap`` the share of the prompts' words that the agents use between them
  (:class:`~pbrl.learning.prompt_overlap.JointWordOverlap`). The last token of a long joint text says little about
  which joint response is better; what decides the docs task's preference (each response's length and content)
  lives in the segments (measured in docs/results/marlhf.md).

Masks and position ids come from the row lengths, never from comparing ids with the pad id, so left and right
padding give the same score as the row alone and pad == EOS is safe. Forwards run in eval mode (dropout
off): fitting and scoring are deterministic. Rows with response spans run through the backbone cut at each
response's start (:func:`pbrl.models.forward.shared_prefix_hidden`): the joint responses of one item share the
header and every prompt, and cross joint responses share more, so each shared prefix runs once.

**Fitting** (Bradley–Terry) and the pair metrics: :mod:`pbrl.learning.reward_fit`. Built, saved (safetensors) and
loaded (safe loaders only): :mod:`pbrl.learning.reward_model_build`.

Shape legend: b batch (rows), t tokens, h hidden size, a agents, f features, o overlap inputs.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from pbrl.learning.joint_template import JointInput
from pbrl.learning.prompt_overlap import Decode, JointWordOverlap, PromptOverlap
from pbrl.learning.segment_head import length_products, length_squares, segment_features, segment_projection
from pbrl.models.forward import eval_mode, pad_rows, shared_prefix_hidden

_META = "reward_model.json"
_HEAD = "head.safetensors"


POOLINGS = ("last_token", "segments")
STANDARDIZE_EPS = 1e-6  # a feature's spread is clamped here; a feature with no more spread reads 0 (standardize)

JointRow = JointInput | Sequence[int]  # a joint input with its response spans, or its ids alone (last_token)


def standardize(values: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``(values - shift) / scale`` for values (..., f) and the training rows' shift and spread (f,), with a column
    whose spread is at most :data:`STANDARDIZE_EPS` 0 on every row: a feature constant on the training rows gives
    the head nothing to learn from, and dividing an unseen row's value by the clamped spread would make it ±10^6
    (a response length never seen in training once scored a rollout -5.6·10^7)."""
    return ((values - shift) / scale).masked_fill(scale <= STANDARDIZE_EPS, 0.0)


def _split_rows(rows: Sequence[JointRow]) -> tuple[list[list[int]], list[tuple[tuple[int, int], ...]] | None]:
    ids = [list(r.ids) if isinstance(r, JointInput) else list(r) for r in rows]
    spans = [r.response_spans for r in rows] if all(isinstance(r, JointInput) for r in rows) else None
    return ids, spans


def row_digest(row: JointRow) -> str:
    """A row's identity for remembered (and stored) features: sha256 of its ids and response spans (if any)."""
    key = (list(row.ids), row.response_spans) if isinstance(row, JointInput) else (list(row), None)
    return hashlib.sha256(repr(key).encode()).hexdigest()


@dataclass(frozen=True)
class HeadExtras:
    """What a ``segments`` head reads beside the (projected) pooled features, each off by default:
    ``length_squares``, ``length_products``, ``prompt_overlap`` and ``joint_overlap`` (:class:`JointRewardModel`)."""

    length_squares: bool = False
    length_products: bool = False
    prompt_overlap: bool = False
    joint_overlap: bool = False


class JointRewardModel(nn.Module):
    """Backbone (a causal LM's base model, or a peft model around it) + a scalar head (f → 1) on pooled features.

    ``feature_shift`` and ``feature_scale`` (buffers, (f,)) standardize the features before the head: 0 and 1 until
    :meth:`standardize_on` sets them (``segments``; ``last_token`` keeps the reference's raw hidden state). A head
    narrower than the ``num_features`` f reads them through ``feature_projection`` (buffer, (f, m)): each agent's
    principal components (``reward_head_components``, :func:`pbrl.learning.segment_head.segment_projection`).
    ``extras`` (:class:`HeadExtras`) says what else it reads. With ``length_squares`` (``segments``) the head also
    reads each agent's standardized log length squared (a more inputs after the others:
    :func:`pbrl.learning.segment_head.length_squares`), with ``length_products`` the product of every two agents'
    standardized log lengths (a(a−1)/2 more, after the squares: :func:`pbrl.learning.segment_head.length_products`),
    and with ``prompt_overlap`` each agent's prompt overlap (a more;
    :class:`~pbrl.learning.prompt_overlap.PromptOverlap`), and with ``joint_overlap`` the joint response's word
    overlap (1 more, last; :class:`~pbrl.learning.prompt_overlap.JointWordOverlap`, which reads text: ``decode``,
    the backbone's tokenizer): the overlap inputs, o of them, are fitted by :meth:`standardize_on` and standardized
    with ``overlap_shift`` and ``overlap_scale`` (buffers (o,)). ``input_low`` and ``input_high`` (buffers, (head
    inputs,), ``segments``) are the range each head input had on the training rows: an input outside it is clamped
    to it, so that a row unlike every training row (a length never seen) gets no input the head never read (±inf
    until :meth:`set_input_range`, set after a fit: nothing clamped).
    """

    def __init__(
        self,
        backbone: nn.Module,
        head: nn.Linear,
        pad_token_id: int,
        pooling: str = "last_token",
        num_features: int | None = None,
        extras: HeadExtras = HeadExtras(),
        decode: Decode | None = None,
    ):
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"reward_pooling: got {pooling!r}; allowed: {', '.join(POOLINGS)}")
        self.backbone, self.head, self.pad_token_id, self.pooling = backbone, head, int(pad_token_id), pooling
        f = num_features or head.in_features
        self.agents = f // (backbone.config.hidden_size + 1) if pooling == "segments" else 1
        segments = pooling == "segments"
        self.length_squares = extras.length_squares and segments
        self.agent_overlaps = extras.prompt_overlap and segments
        self.joint_overlap = extras.joint_overlap and segments
        if self.joint_overlap and decode is None:
            raise ValueError("reward_joint_overlap: the model needs its tokenizer's decode")
        self.decode = decode
        self.length_products = extras.length_products and segments
        o = self.agents * int(self.agent_overlaps) + int(self.joint_overlap)  # the overlap inputs
        extra = self.agents * int(self.length_squares) + o
        extra += self.agents * (self.agents - 1) // 2 if self.length_products else 0
        m = head.in_features - extra  # the head's inputs before the squares, the products and the overlaps
        self.register_buffer("feature_shift", torch.zeros(f))
        self.register_buffer("feature_scale", torch.ones(f))
        self.register_buffer("feature_projection", torch.zeros(f, m) if f != m else None)
        self.register_buffer("overlap_shift", torch.zeros(o) if o else None)
        self.register_buffer("overlap_scale", torch.ones(o) if o else None)
        self.register_buffer("input_low", torch.full((head.in_features,), -math.inf) if segments else None)
        self.register_buffer("input_high", torch.full((head.in_features,), math.inf) if segments else None)
        self.overlap: PromptOverlap | None = None  # fitted by standardize_on, or loaded
        self.word_overlap: JointWordOverlap | None = None  # likewise
        self._memo: dict[str, torch.Tensor] | None = None  # see remembered_features

    def features(self, rows: Sequence[JointRow], padding_side: str = "right") -> torch.Tensor:
        """Pooled, unstandardized features of b rows, (b, f) float32 on the head's device; gradients flow when
        enabled. Every submodule runs in eval mode (dropout off) and gets its mode back afterwards. Inside
        :meth:`remembered_features` a row seen before is not run through the backbone again.

        Raises:
            ValueError: ``segments`` pooling with rows that are ids alone (no response spans).
        """
        if self._memo is None:
            return self._compute_features(rows, padding_side)
        keys = [row_digest(r) for r in rows]
        new = list({k: r for k, r in zip(keys, rows, strict=True) if k not in self._memo}.items())
        if new:
            computed = self._compute_features([r for _, r in new], padding_side)
            self._memo.update({k: row for (k, _), row in zip(new, computed.detach(), strict=True)})
        return torch.stack([self._memo[k] for k in keys])

    @contextmanager
    def remembered_features(self, known: dict[str, torch.Tensor] | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """Within this block, with a frozen backbone, each distinct row (by :func:`row_digest`) is run through the
        backbone once and its pooled features are reused: a fit, then its metrics on the training and the held-out
        pairs, would otherwise repeat the same forwards (docs/results/marlhf.md). ``known`` (digest → (f,)
        features, e.g. stored by an earlier round: :mod:`pbrl.learning.feature_store`) are used as if computed.
        Yields the memory (digest → features), dropped on exit; empty and unused when the backbone trains."""
        if not self.backbone_frozen:
            yield {}
            return
        self._memo = dict(known or {})
        try:
            yield self._memo
        finally:
            self._memo = None

    def _compute_features(self, rows: Sequence[JointRow], padding_side: str = "right") -> torch.Tensor:
        """:meth:`features` through the backbone, always."""
        ids, spans = _split_rows(rows)
        if self.pooling == "segments" and spans is None:
            raise ValueError("reward_pooling 'segments' needs each row's response spans (JointInput rows)")
        input_ids, mask, positions, last = pad_rows(ids, self.pad_token_id, padding_side)
        device = self.head.weight.device
        with eval_mode(self):
            if spans is not None and padding_side == "right":  # cut at each response: shared prefixes run once
                cuts = [[start for start, _ in row] for row in spans]
                hidden = shared_prefix_hidden(self.backbone, ids, cuts, self.pad_token_id)  # (b, t, h)
            else:
                hidden = self.backbone(
                    input_ids=input_ids.to(device),
                    attention_mask=mask.to(device),
                    position_ids=positions.to(device),
                    use_cache=False,
                ).last_hidden_state  # (b, t, h)
            if self.pooling == "last_token":
                pooled = hidden[torch.arange(len(ids), device=device), last.to(device)]  # (b, h)
            else:
                offsets = (input_ids.shape[1] - torch.tensor([len(r) for r in ids])) if padding_side == "left" else None
                shifted = spans if offsets is None else [
                    tuple((s + int(o), e + int(o)) for s, e in row) for row, o in zip(spans, offsets, strict=True)
                ]  # fmt: skip
                pooled = segment_features(hidden, shifted)  # (b, a·(h+1))
        return pooled.to(self.head.weight.dtype)

    @property
    def uses_overlap(self) -> bool:
        """Whether the head reads overlap inputs (``prompt_overlap``, ``joint_overlap`` or both)."""
        return self.overlap_shift is not None

    def overlap_features(self, rows: Sequence[JointRow]) -> torch.Tensor:
        """Each row's overlap inputs, unstandardized, (b, o) on the head's device: its prompt overlap per agent
        (``prompt_overlap``), then its joint overlap (``joint_overlap``).

        Raises:
            ValueError: a table the model reads is not fitted yet (:meth:`standardize_on`).
        """
        parts = []
        if self.agent_overlaps:
            if self.overlap is None:
                raise ValueError("reward_prompt_overlap: the overlap table is not fitted (standardize_on first)")
            parts.append(self.overlap.features(rows))  # type: ignore[arg-type]
        if self.joint_overlap:
            if self.word_overlap is None:
                raise ValueError("reward_joint_overlap: the overlap table is not fitted (standardize_on first)")
            parts.append(self.word_overlap.features(rows, self.decode))  # type: ignore[arg-type]
        return torch.cat(parts, dim=-1).to(self.head.weight.device)  # (b, o)

    def head_inputs(self, features: torch.Tensor, overlaps: torch.Tensor | None = None) -> torch.Tensor:
        """The head's inputs (b, m) of pooled features (b, f), before the clamp: the standardized (and projected)
        features, with ``length_squares`` each agent's squared standardized length, with ``length_products`` the
        products of every two agents' standardized lengths, and with ``prompt_overlap`` or ``joint_overlap`` the
        rows' ``overlaps`` (b, o: :meth:`overlap_features`) standardized.

        Raises:
            ValueError: ``overlaps`` missing for a model that reads them.
        """
        z = standardize(features, self.feature_shift, self.feature_scale)  # (b, f)
        x = z if self.feature_projection is None else z @ self.feature_projection  # (b, m)
        if self.length_squares:
            x = torch.cat([x, length_squares(z, self.agents)], dim=-1)  # (b, m + a)
        if self.length_products:
            x = torch.cat([x, length_products(z, self.agents)], dim=-1)  # (b, … + a(a−1)/2)
        if self.uses_overlap:
            if overlaps is None:
                names = "reward_prompt_overlap" if self.agent_overlaps else "reward_joint_overlap"
                raise ValueError(f"{names}: head_scores needs the rows' overlaps")
            x = torch.cat([x, standardize(overlaps, self.overlap_shift, self.overlap_scale)], dim=-1)  # (b, … + o)
        return x

    def head_scores(self, features: torch.Tensor, overlaps: torch.Tensor | None = None) -> torch.Tensor:
        """Scores (b,) of pooled features (b, f): the head on :meth:`head_inputs`, each clamped to the range it had
        on the training rows (``input_low``, ``input_high``).

        Raises:
            ValueError: ``overlaps`` missing for a model that reads them.
        """
        x = self.head_inputs(features, overlaps)
        if self.input_low is not None:
            x = torch.minimum(torch.maximum(x, self.input_low), self.input_high)
        return self.head(x).squeeze(-1)

    def forward(self, rows: Sequence[JointRow], padding_side: str = "right") -> torch.Tensor:
        """Scores R of b joint inputs, shape (b,), float32, on the head's device; gradients flow when enabled."""
        overlaps = self.overlap_features(rows) if self.uses_overlap else None
        return self.head_scores(self.features(rows, padding_side), overlaps)

    @torch.no_grad()
    def standardize_on(self, features: torch.Tensor, rows: Sequence[JointRow] | None = None) -> None:
        """``segments``: set the standardization to the mean and population spread (clamped at
        :data:`STANDARDIZE_EPS`) of ``features`` (n, f), the training rows', and the projection to their principal
        components when the head reads them; with ``prompt_overlap`` or ``joint_overlap`` fit the overlap tables on
        ``rows`` (the same n training rows) and standardize their overlaps likewise; ``last_token``: nothing changes.

        Raises:
            ValueError: ``prompt_overlap`` or ``joint_overlap`` without ``rows``.
        """
        if self.uses_overlap and len(features):
            if rows is None:
                raise ValueError("reward_prompt_overlap: standardize_on needs the training rows")
            if self.agent_overlaps:
                self.overlap = PromptOverlap.fit(rows, self.agents)  # type: ignore[arg-type]
            if self.joint_overlap:
                self.word_overlap = JointWordOverlap.fit(rows, self.decode)  # type: ignore[arg-type]
            values = self.overlap_features(rows)  # (n, o)
            self.overlap_shift.copy_(values.mean(0))
            self.overlap_scale.copy_(values.std(0, unbiased=False).clamp(min=STANDARDIZE_EPS))
        if self.pooling == "segments" and len(features):
            self.feature_shift.copy_(features.mean(0))
            self.feature_scale.copy_(features.std(0, unbiased=False).clamp(min=STANDARDIZE_EPS))
            if self.feature_projection is not None:
                z = standardize(features, self.feature_shift, self.feature_scale)
                components = self.feature_projection.shape[1] // self.agents - 1
                self.feature_projection.copy_(segment_projection(z, self.agents, components))

    @torch.no_grad()
    def set_input_range(self, features: torch.Tensor, overlaps: torch.Tensor | None = None) -> None:
        """``segments``: set ``input_low`` and ``input_high`` to the range of each head input on the training rows,
        whose pooled ``features`` (n, f) and ``overlaps`` (n, o, with ``prompt_overlap`` or ``joint_overlap``) the
        fitted model gives (after the fit: a trained backbone's features move while it trains); ``last_token``:
        nothing changes."""
        if self.input_low is not None and len(features):
            inputs = self.head_inputs(features, overlaps)  # (n, m)
            self.input_low.copy_(inputs.min(0).values)
            self.input_high.copy_(inputs.max(0).values)

    @property
    def backbone_frozen(self) -> bool:
        return not any(p.requires_grad for p in self.backbone.parameters())


GROUP_BATCH_FACTOR = 4  # one item's rows may fill up to 4 batches' rows in one forward


def _prefix_batches(rows: Sequence[JointRow], batch_size: int) -> list[list[int]]:
    """Row indexes in forwards of about ``batch_size`` rows, sorted by their ids so that rows sharing a prefix (one
    item's joint responses, the same agent-1 candidate) land in one forward and share its computation. One item's
    rows (the same ids before agent 1's response) stay together up to ``GROUP_BATCH_FACTOR * batch_size`` rows: a
    cross round's 36 joint responses of an item run their prompts once, not once per 16 rows."""
    ids = [tuple(r.ids if isinstance(r, JointInput) else r) for r in rows]
    order = sorted(range(len(rows)), key=lambda i: ids[i])
    spans = all(isinstance(r, JointInput) and r.response_spans for r in rows)
    groups: list[tuple[tuple[int, ...] | None, list[int]]] = []  # (shared prefix or None, rows)
    for i in order:
        prefix = ids[i][: rows[i].response_spans[0][0]] if spans else None  # type: ignore[union-attr]
        room = bool(groups) and len(groups[-1][1]) < GROUP_BATCH_FACTOR * batch_size
        if room and prefix is not None and groups[-1][0] == prefix:
            groups[-1][1].append(i)
        else:
            groups.append((prefix, [i]))
    batches: list[list[int]] = []
    for _, group in groups:
        if batches and len(batches[-1]) + len(group) <= batch_size:
            batches[-1].extend(group)
        else:
            batches.append(group)
    return batches


@torch.no_grad()
def row_features(model: JointRewardModel, rows: Sequence[JointRow], batch_size: int = 16) -> torch.Tensor:
    """:meth:`JointRewardModel.features` of many rows without gradients, about ``batch_size`` rows per forward, (n, f)
    in the order of ``rows`` (batched by shared prefix: :func:`_prefix_batches`)."""
    batches = _prefix_batches(rows, batch_size)
    out = torch.cat([model.features([rows[i] for i in batch]) for batch in batches])  # (n, f), batch order
    return out[torch.tensor([i for batch in batches for i in batch]).argsort()]


@torch.no_grad()
def score_joint(model: JointRewardModel, rows: Sequence[JointRow], batch_size: int = 16) -> list[float]:
    """Scores of many joint inputs without gradients, about ``batch_size`` rows per forward (right padding, batched by
    shared prefix: :func:`_prefix_batches`), in the order of ``rows``."""
    out: list[float] = [0.0] * len(rows)
    for batch in _prefix_batches(rows, batch_size):
        for i, score in zip(batch, model([rows[i] for i in batch]).double().cpu(), strict=True):
            out[i] = float(score)
    return out
