"""What the joint reward model's ``segments`` head may read beside the pooled hidden states: per agent, how much of
what is particular to its prompt its response mentions (``reward_prompt_overlap``;
docs/design/algorithms.md#joint-reward-model).

A mean of hidden states over a response says little about *which* words it contains: on ``humaneval_docs`` scored by
its content alone (``reward_terms: [coverage]``: which of the function's name and parameters the explanation names),
a linear head on the pooled states of the frozen SmolLM2 reached 0.66–0.82 on unseen items, and only with 8 or more
training items; this feature alone reached 0.82–0.85 from 2 items (docs/results/marlhf.md#content-alone-2026-12-06).

For agent k of a joint row with prompt tokens P (the token ids of its prompt, as a set) and response tokens R::

    overlap_k = Σ_{t ∈ P ∩ R} idf_k(t) / Σ_{t ∈ P} idf_k(t)        (0 when the denominator is 0)
    idf_k(t)  = log((1 + N_k) / (1 + df_k(t)))

with N_k the distinct prompts of agent k among the fit's training rows and df_k(t) how many of them contain t
(Spärck Jones 1972's inverse document frequency, smoothed as scikit-learn's ``TfidfTransformer``): a token of every
training prompt (the instructions) weighs 0, a token particular to one item (its identifiers) weighs most, and a
token of an unseen prompt weighs log(1 + N_k). The table (N_k and df_k) is fitted once per fit, on the training rows,
and saved with the model, so an unseen item is scored with the table of the items it was fitted on.

It reads token ids, not words: a tokenizer may spell a word after a space and after a bracket with different ids
(``benchmarks/reward_model.py`` measured the word-level variant lower, 0.79–0.81).

**The joint overlap** (``reward_joint_overlap``, :class:`JointWordOverlap`): one more input for the whole joint
response, on words. With W(text) the set of a text's words (maximal runs of 3 or more letters, case-folded: digits,
underscores and punctuation split them, so ``below_zero`` is ``below`` and ``zero``), P = the union of W over the
row's prompts and R = the union of W over its responses::

    joint_overlap = Σ_{w ∈ P ∩ R} idf(w) / Σ_{w ∈ P} idf(w)        (0 when the denominator is 0)

with idf over the distinct joint prompts (the union of a row's prompts) of the fit's training rows, as above. A
team's preference may count what the agents say *between them* (the ``humaneval_docs`` reward's ``docstring`` part:
the share of the specification's words that the summary and the explanation use together), which no agent's own
overlap shows; and words, not token ids, so that a word is found after a bracket as after a space. On the graded
content preference (``reward_terms: [coverage, docstring]``) a logistic regression on the per-agent overlaps ordered
0.72–0.74 of unseen items' pairs, with the joint overlap beside them 0.80–0.81, and MARLHF's reward model with it
held 0.75 or more in 6 rounds of 6 (3 of 6 without) (docs/results/marlhf.md#the-joint-overlap-2026-12-07).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pbrl.learning.joint_template import JointInput


def _segments(row: JointInput) -> list[tuple[set[int], set[int]]]:
    """Per agent, (prompt tokens, response tokens) of one joint row, as sets of ids."""
    ids = row.ids or []
    return [
        (set(ids[p0:p1]), set(ids[r0:r1]))
        for (p0, p1), (r0, r1) in zip(row.prompt_spans, row.response_spans, strict=True)
    ]


@dataclass(frozen=True)
class PromptOverlap:
    """The fitted table: per agent, ``documents`` N_k (distinct training prompts) and ``df`` (token id → the
    prompts that contain it)."""

    documents: tuple[int, ...]
    df: tuple[Mapping[int, int], ...]

    @classmethod
    def fit(cls, rows: Sequence[JointInput], num_agents: int) -> PromptOverlap:
        """The table of the training rows' distinct prompts, per agent.

        Raises:
            ValueError: a row lacks prompt or response spans for ``num_agents`` agents.
        """
        prompts: list[set[tuple[int, ...]]] = [set() for _ in range(num_agents)]
        for row in rows:
            if len(row.prompt_spans) != num_agents or len(row.response_spans) != num_agents:
                raise ValueError(f"reward_prompt_overlap: a joint row without the spans of {num_agents} agents")
            ids = row.ids or []
            for k, (start, end) in enumerate(row.prompt_spans):
                prompts[k].add(tuple(ids[start:end]))
        df = tuple(Counter(t for p in agent for t in set(p)) for agent in prompts)
        return cls(tuple(len(agent) for agent in prompts), tuple(dict(sorted(c.items())) for c in df))

    def idf(self, agent: int, token: int) -> float:
        """idf_k(t) of the module docstring."""
        n = self.documents[agent]
        return math.log((1 + n) / (1 + self.df[agent].get(token, 0)))

    def features(self, rows: Sequence[JointInput]) -> torch.Tensor:
        """overlap_k of every row and agent, (b, a) float32 in [0, 1]."""
        out = torch.zeros(len(rows), len(self.documents))
        for i, row in enumerate(rows):
            for k, (prompt, said) in enumerate(_segments(row)):
                total = sum(self.idf(k, t) for t in prompt)
                if total > 0:
                    out[i, k] = sum(self.idf(k, t) for t in prompt & said) / total
        return out

    def to_record(self) -> list[dict[str, Any]]:
        """JSON-ready: per agent ``{"documents": N, "df": {"<token id>": count}}``."""
        pairs = zip(self.documents, self.df, strict=True)
        return [{"documents": n, "df": {str(t): c for t, c in df.items()}} for n, df in pairs]

    @classmethod
    def from_record(cls, record: Sequence[Mapping[str, Any]]) -> PromptOverlap:
        """The table saved by :meth:`to_record`."""
        return cls(
            tuple(int(a["documents"]) for a in record),
            tuple({int(t): int(c) for t, c in a["df"].items()} for a in record),
        )


WORD = re.compile(r"[^\W\d_]{3,}")  # 3+ letters of any script: digits, underscores and punctuation split words
Decode = Callable[[list[int]], str]  # token ids -> text (the reward model's tokenizer)


def words(text: str) -> frozenset[str]:
    """W(text) of the module docstring: the distinct case-folded runs of 3 or more letters."""
    return frozenset(WORD.findall(text.casefold()))


def _span_words(row: JointInput, spans: Sequence[tuple[int, int]], decode: Decode) -> frozenset[str]:
    """The words of a row's ``spans`` together (its prompts' P or its responses' R)."""
    ids = row.ids or []
    return frozenset().union(*(words(decode(ids[s:e])) for s, e in spans))


def _prompt_words(rows: Sequence[JointInput], decode: Decode) -> list[frozenset[str]]:
    """P of every row, each distinct joint prompt decoded once (one item's joint responses share their prompts)."""
    seen: dict[tuple[tuple[int, ...], ...], frozenset[str]] = {}
    out = []
    for row in rows:
        key = tuple(tuple((row.ids or [])[s:e]) for s, e in row.prompt_spans)
        if key not in seen:
            seen[key] = _span_words(row, row.prompt_spans, decode)
        out.append(seen[key])
    return out


@dataclass(frozen=True)
class JointWordOverlap:
    """The fitted table of the joint overlap: ``documents`` N (distinct training joint prompts, as word sets) and
    ``df`` (word → the joint prompts that contain it)."""

    documents: int
    df: Mapping[str, int]

    @classmethod
    def fit(cls, rows: Sequence[JointInput], decode: Decode) -> JointWordOverlap:
        """The table of the training rows' distinct joint prompts (``decode``: the reward model's tokenizer)."""
        prompts = set(_prompt_words(rows, decode))
        return cls(len(prompts), dict(sorted(Counter(w for p in prompts for w in p).items())))

    def idf(self, word: str) -> float:
        """idf(w) of the module docstring."""
        return math.log((1 + self.documents) / (1 + self.df.get(word, 0)))

    def features(self, rows: Sequence[JointInput], decode: Decode) -> torch.Tensor:
        """joint_overlap of every row, (b, 1) float32 in [0, 1]."""
        out = torch.zeros(len(rows), 1)
        for i, (row, prompt) in enumerate(zip(rows, _prompt_words(rows, decode), strict=True)):
            said = _span_words(row, row.response_spans, decode)
            total = sum(self.idf(w) for w in prompt)
            if total > 0:
                out[i, 0] = sum(self.idf(w) for w in prompt & said) / total
        return out

    def to_record(self) -> dict[str, Any]:
        """JSON-ready: ``{"documents": N, "df": {word: count}}``."""
        return {"documents": self.documents, "df": dict(self.df)}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> JointWordOverlap:
        """The table saved by :meth:`to_record`."""
        return cls(int(record["documents"]), {str(w): int(c) for w, c in record["df"].items()})
