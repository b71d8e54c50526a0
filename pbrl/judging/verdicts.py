"""The judge interface: a question (:class:`Comparison`), an answer (:class:`Answer`), what a judge is
(:class:`PairwiseJudge`), and the rules that turn the answers of one pair into a preference.

A judge compares two **joint responses** to one task item: every agent's text, with the agents' roles named. It
sees them in an order, the first as ``A`` and the second as ``B``, and answers ``A``, ``B`` or ``tie``, optionally
with a probability that ``A`` is better. This is TRL's pairwise judge (``trl.BasePairwiseJudge.judge(prompts,
completions)``, which returns the index of the better completion) for joint responses: TRL's judges compare two
completions of one prompt; here each side is a team's answer, one text per agent.

Language-model judges prefer a position (Zheng et al. 2023, "Judging LLM-as-a-judge with MT-Bench and Chatbot
Arena", §3.3). So a pair (x, y) is asked in both orders (``judge_position_swap``): x as A, then y as A. The two
answers agree, or the pair follows ``judge_swap_disagreement`` (:func:`preference_of`). Without the swap the order is
drawn per pair from a seed and recorded.

Shape legend: a agents.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

Verdict = Literal["A", "B", "tie"]
VERDICTS: tuple[Verdict, ...] = ("A", "B", "tie")
Preferred = Literal["x", "y", "tie"]
DISAGREEMENT_POLICIES = ("tie", "drop")
# The answer word once the line's punctuation is stripped from both ends: "Answer: **A" -> A. Matched only on a line of
# at most _ANSWER_CHARS characters: a regular expression over a long untrusted answer may take quadratic time (the
# earlier one, with \W* on both sides of an optional prefix, took 7.5 s on 20,000 characters).
_ANSWER = re.compile(r"(?:answer\s*[:=])?[^\w]*(a|b|tie)", re.IGNORECASE)
_ANSWER_CHARS = 100
_SHOWN_CHARS = 200  # characters of an unparseable answer kept in its drop reason
RAW_CHARS = 4000  # characters of an answer's text kept as its raw (a one-word answer needs a few)
# The most tokens an answer may say it cost: pbrl.generation.api_formats.MAX_REPORTED_TOKENS, where an API's count is
# capped (not imported: that module imports torch, and the CLI reads verdicts without it)
MAX_TOKENS = 10**12
JUDGE_RAISED = "the judge raised"  # the start of the reason of an answer whose judge raised an exception
JUDGE_FAILED = "the judge failed"  # the start of the reason when the judge timed out or its process died


@dataclass(frozen=True)
class Comparison:
    """One question: which of two joint responses to one item is better, ``first`` shown as A, ``second`` as B.

    Attributes:
        item_id: the task item.
        prompts: (a,) each agent's prompt for the item (what it was asked; the task as each agent saw it).
        roles: (a,) each agent's role name (the task's, else "agent 1", "agent 2", ...).
        first: (a,) each agent's text of the joint response shown as A.
        second: (a,) each agent's text of the joint response shown as B.
        item: the task item itself, for judges that read its fields (a Python judge); not part of the key.
        rewards: the task reward of (first, second) when the task has one (the label simulator reads it); not part
            of the key.
    """

    item_id: str
    prompts: tuple[str, ...]
    roles: tuple[str, ...]
    first: tuple[str, ...]
    second: tuple[str, ...]
    item: Mapping[str, Any] = field(default_factory=dict, compare=False)
    rewards: tuple[float, float] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        sizes = {len(self.prompts), len(self.roles), len(self.first), len(self.second)}
        if len(sizes) != 1:
            raise ValueError(
                f"comparison of item {self.item_id!r}: prompts, roles, first and second must have one entry per agent "
                f"(got {len(self.prompts)}, {len(self.roles)}, {len(self.first)}, {len(self.second)})"
            )

    def swapped(self) -> Comparison:
        """The same question with the joint responses in the other order."""
        rewards = None if self.rewards is None else (self.rewards[1], self.rewards[0])
        return Comparison(
            self.item_id,
            self.prompts,
            self.roles,
            self.second,
            self.first,
            self.item,
            rewards,  # type: ignore[arg-type]
        )

    def key(self, judge: str) -> str:
        """The content key of this question put to ``judge`` (its :attr:`PairwiseJudge.name`): SHA-256 of the
        judge, the item id, the prompts, the roles and both texts in the order shown. Equal keys are one question,
        asked once per run (:mod:`pbrl.judging.store`)."""
        body = [judge, self.item_id, list(self.prompts), list(self.roles), list(self.first), list(self.second)]
        return hashlib.sha256(json.dumps(body, ensure_ascii=False).encode()).hexdigest()


@dataclass(frozen=True)
class Answer:
    """A judge's answer to one :class:`Comparison`, in the order shown.

    Attributes:
        verdict: ``A`` (the first is better), ``B``, ``tie``; None when the judge gave no usable answer.
        probability: P(A is better) in [0, 1], when the judge gives one (a local judge, a simulator); else None.
        raw: the answer as the judge gave it (the API's text, the callable's value), for provenance.
        tokens: tokens the answer cost (an API's reported usage; 0 where nothing is paid).
        seconds: wall seconds the answer took.
        reason: why ``verdict`` is None (an unparseable answer, a judge that raised); None otherwise.
    """

    verdict: Verdict | None
    probability: float | None = None
    raw: str = ""
    tokens: int = 0
    seconds: float = 0.0
    reason: str | None = None

    def __post_init__(self) -> None:
        if self.verdict is not None and self.verdict not in VERDICTS:
            raise ValueError(f"verdict: got {self.verdict!r}; allowed: A, B, tie, or None with a reason")
        if self.verdict is None and not self.reason:
            raise ValueError("an answer without a verdict must say why (reason)")
        if self.probability is not None and not (
            isinstance(self.probability, float) and math.isfinite(self.probability) and 0 <= self.probability <= 1
        ):
            raise ValueError(f"probability: got {self.probability!r}; must be a float in [0, 1]")
        if not (isinstance(self.tokens, int) and not isinstance(self.tokens, bool) and 0 <= self.tokens <= MAX_TOKENS):
            raise ValueError(f"tokens: got {self.tokens!r}; must be an integer in [0, {MAX_TOKENS}]")
        if not (isinstance(self.seconds, int | float) and math.isfinite(self.seconds) and self.seconds >= 0):
            raise ValueError(f"seconds: got {self.seconds!r}; must be a finite number >= 0")

    @property
    def judge_failed(self) -> bool:
        """No verdict because the judge raised, timed out or died: not an answer, so it is never stored and the
        question is asked again (a judge that was fixed, a server that came back)."""
        return self.verdict is None and (self.reason or "").startswith((JUDGE_RAISED, JUDGE_FAILED))


class PairwiseJudge(Protocol):
    """What a judge is: a name and a batched :meth:`answer`.

    ``name`` identifies the judge and everything that changes its answers (model, prompt template, settings): the
    answers pbrl keeps are keyed by it (:meth:`Comparison.key`), so a judge whose answers may differ must have
    another name. ``answer`` returns one :class:`Answer` per comparison, in order; it must not raise for a
    comparison it cannot judge (that answer has no verdict and a reason), only for a failure of the judge itself,
    such as an API that cannot be reached (:class:`pbrl.errors.TransientError` when retrying may help).
    """

    name: str

    def answer(self, comparisons: Sequence[Comparison]) -> list[Answer]: ...


def parse_verdict(text: str) -> tuple[Verdict | None, str | None]:
    """A judge's text answer read strictly: ``A``, ``B`` or ``tie`` (any case), alone on the answer, optionally after
    ``Answer:`` and inside punctuation or Markdown emphasis (``**A**``, ``"B".``). Anything else is not guessed at.

    Returns:
        (verdict, None), or (None, the reason naming the answer, cut to 200 characters).
    """
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    match = _answer_word(lines[0]) if len(lines) == 1 else None
    if match is None:
        shown = cut(str(text).strip(), _SHOWN_CHARS)
        return None, f"unparseable answer: {shown!r} (expected exactly A, B or tie)"
    word = match.group(1)
    return ("tie" if word.lower() == "tie" else word.upper()), None  # type: ignore[return-value]


def cut(text: str, limit: int) -> str:
    """``text`` as kept in an answer's ``raw`` or reason: its first ``limit`` characters, then "…" when longer."""
    return text if len(text) <= limit else text[:limit] + "…"


def _answer_word(line: str) -> re.Match[str] | None:
    """The answer word of one line, in linear time: its non-word characters stripped from both ends (a loop, not a
    regular expression), then :data:`_ANSWER` on at most :data:`_ANSWER_CHARS` characters."""
    begin, end = 0, len(line)
    while begin < end and not (line[begin].isalnum() or line[begin] == "_"):
        begin += 1
    while end > begin and not (line[end - 1].isalnum() or line[end - 1] == "_"):
        end -= 1
    if end - begin > _ANSWER_CHARS:
        return None
    return _ANSWER.fullmatch(line, begin, end)


def verdict_of_probability(probability: float, tie_margin: float) -> Verdict:
    """``A`` when P(A is better) exceeds 1/2 by more than ``tie_margin``, ``B`` when it falls short by more, else
    ``tie``."""
    if probability > 0.5 + tie_margin:
        return "A"
    if probability < 0.5 - tie_margin:
        return "B"
    return "tie"


def preferred(answer: Answer, shown_first: Literal["x", "y"]) -> Preferred | None:
    """The answer as a preference between the pair's joint responses x and y, given which one was shown first."""
    if answer.verdict is None:
        return None
    if answer.verdict == "tie":
        return "tie"
    other = "y" if shown_first == "x" else "x"
    return shown_first if answer.verdict == "A" else other  # type: ignore[return-value]


def preference_of(
    answers: Sequence[tuple[Answer, Literal["x", "y"]]], disagreement: str
) -> tuple[Preferred | None, str | None]:
    """The pair's preference from its answers (one per order it was shown in: (answer, which was shown first)).

    - One answer: its preference.
    - Both orders: the common preference when they agree; when they disagree (x once and y once, or a tie once),
      ``tie`` under ``disagreement: tie`` or no preference under ``drop``.
    - An answer without a verdict leaves the pair without a preference.

    Returns:
        (preference, None) or (None, why): ``"x"``, ``"y"`` or ``"tie"``.

    Raises:
        ValueError: ``disagreement`` is not ``tie`` or ``drop``, or no answer is given.
    """
    if disagreement not in DISAGREEMENT_POLICIES:
        raise ValueError(f"judge_swap_disagreement: got {disagreement!r}; allowed: {', '.join(DISAGREEMENT_POLICIES)}")
    if not answers:
        raise ValueError("a pair needs at least one answer")
    missing = [a.reason for a, _ in answers if a.verdict is None]
    if missing:
        return None, missing[0]
    views = {preferred(a, shown) for a, shown in answers}
    if len(views) == 1:
        return views.pop(), None
    if disagreement == "tie":
        return "tie", None
    return None, "the two orders disagree (judge_swap_disagreement: drop)"
