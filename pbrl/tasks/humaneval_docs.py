"""``humaneval_docs``: agent 1 summarises a HumanEval function in one sentence, agent 2 explains it in detail.

The reward is deterministic and bounded in [0, 3] (see :func:`docs_score`). The task itself (items, split)
is registered in :mod:`pbrl.tasks.humaneval`.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pbrl.errors import ConfigError, Problem
from pbrl.tasks.base import Task
from pbrl.tasks.humaneval import check_two_agent_batch, item_field, split_problems

SUMMARY_WORDS = (3, 60)
EXPLANATION_WORDS = (15, 400)
RATIO_ZERO_LOW, RATIO_FULL_LOW, RATIO_FULL_HIGH, RATIO_ZERO_HIGH = 1.0, 2.0, 6.0, 10.0
REWARD_TERMS = ("lengths", "ratio", "coverage")  # the default reward's parts, (a), (b) and (c) of docs_score
ALL_TERMS = (*REWARD_TERMS, "docstring")  # what reward_terms may name: (d) is a graded content part, off by default
# (d)'s words leave out the English function words (and the words every item's docstring and prompt use: "given",
# "return", "function", "list"). Hand-written: a stop list of 77 words, and no library we depend on ships one
# (scikit-learn's or NLTK's would be a dependency for this list alone).
STOP_WORDS = frozenset(
    """the and but then else its this that these those which what who whom whose when where why how all any both each
    few more most other some such nor not only own same than too very can will just should now does did has have had
    having into over under again further once here there their they them you your our his her are was were been being
    for with from given return returns function list""".split()
)


def summary_prompt(item: dict[str, Any]) -> str:
    """Agent 1's prompt: a one-sentence summary of the function in ``item["prompt"]``."""
    return (
        "Write a one-sentence summary of what the following Python function does. "
        "Answer with the sentence only.\n\n"
        f"```python\n{item_field(item, 'prompt')}```\n\nSummary:"
    )


def explanation_prompt(item: dict[str, Any]) -> str:
    """Agent 2's prompt: a detailed explanation of the function, naming its parameters."""
    return (
        f"Explain in detail what the Python function `{item_field(item, 'entry_point')}` below does: its "
        "parameters (by name), what it returns, and its edge cases. Answer with the explanation only.\n\n"
        f"```python\n{item_field(item, 'prompt')}```\n\nExplanation:"
    )


def key_identifiers(item: dict[str, Any]) -> list[str]:
    """The function name ``item["entry_point"]`` then its parameter names, parsed from ``item["prompt"]``.

    Raises:
        ValueError: the prompt does not parse or defines no top-level function of that name (names the
            item).
    """
    node = _entry_function(item)
    a = node.args
    params = [*a.posonlyargs, *a.args, *([a.vararg] if a.vararg else []), *a.kwonlyargs]
    params += [a.kwarg] if a.kwarg else []
    return list(dict.fromkeys([node.name, *(p.arg for p in params)]))


def docstring_words(item: dict[str, Any]) -> frozenset[str]:
    """The content words of the function's docstring prose: :func:`content_words` of its lines before the first
    doctest line (``>>>``), so the examples' values and calls do not count. Empty without a docstring.

    Raises:
        ValueError: as :func:`key_identifiers`.
    """
    prose = []
    for line in (ast.get_docstring(_entry_function(item)) or "").splitlines():
        if line.lstrip().startswith(">>>"):
            break
        prose.append(line)
    return content_words("\n".join(prose))


def content_words(text: str) -> frozenset[str]:
    """The distinct lower-cased runs of ASCII letters in ``text`` of 3 letters or more, less :data:`STOP_WORDS`
    (``has_close_elements`` gives ``close`` and ``elements``; ``Numbers,`` gives ``numbers``)."""
    return frozenset(w for w in re.findall(r"[a-z]+", text.lower()) if len(w) >= 3 and w not in STOP_WORDS)


def ratio_score(ratio: float) -> float:
    """Credit for ``len(explanation) / len(summary)`` in characters, in [0, 1].

    0 at or below 1.0, linear up to 1 at 2.0, 1 on [2.0, 6.0], linear down to 0 at 10.0, 0 beyond.
    """
    if ratio <= RATIO_ZERO_LOW or ratio >= RATIO_ZERO_HIGH:
        return 0.0
    if ratio < RATIO_FULL_LOW:
        return (ratio - RATIO_ZERO_LOW) / (RATIO_FULL_LOW - RATIO_ZERO_LOW)
    if ratio <= RATIO_FULL_HIGH:
        return 1.0
    return (RATIO_ZERO_HIGH - ratio) / (RATIO_ZERO_HIGH - RATIO_FULL_HIGH)


def coverage(text: str, identifiers: Sequence[str]) -> float:
    """Share of ``identifiers`` that appear in ``text`` as whole words (case-sensitive), in [0, 1].

    A whole word is not preceded or followed by a letter, digit or underscore, so ``numbers`` does not
    count inside ``numbers_list``. Single-letter parameters (``a``, ``n``) match ordinary words too.
    """
    if not identifiers:
        return 0.0
    found = sum(1 for name in identifiers if re.search(rf"(?<!\w){re.escape(name)}(?!\w)", text, re.ASCII))
    return found / len(identifiers)


def docs_score(summary: str, explanation: str, item: dict[str, Any], terms: Sequence[str] = REWARD_TERMS) -> float:
    """The ``humaneval_docs`` reward of one joint response, in [0, 3] (in [0, len(terms)] with ``terms``).

    With s = summary.strip(), e = explanation.strip(), words = whitespace-separated tokens:

        0                                    if s or e is empty; otherwise the sum of
        (a) 1 if 3 <= words(s) <= 60 and 15 <= words(e) <= 400, else 0
        (b) ratio_score(len(e) / len(s))     (characters; full credit for a ratio in [2, 6])
        (c) coverage(e, key_identifiers(item))   (function name and parameter names mentioned in e)
        (d) only when ``terms`` names it: the share of docstring_words(item) found in content_words(s + " " + e)

    Parts (b) and (c) count even when (a) is 0: a stepwise gate (the reference's writing reward stops at
    the first failed level) would turn most early outputs into ties and give no preference signal. Each
    part is at most 1, so an over-long explanation that lists every identifier still scores below a good
    one. ``terms`` (the task option ``reward_terms``) sums only those parts: ``("coverage",)`` is a preference
    about content alone (which names the explanation mentions), where (a) and (b) are about length. Part (d),
    ``docstring``, is a graded one: which of the specification's words (its docstring's prose) the two agents' texts
    use between them; with a dozen words per item it rarely ties or reaches 1 where (c), two to four names, saturates
    once the agents name them (docs/results/marlhf.md#a-graded-content-preference-2026-12-07).
    """
    parts = docs_terms(summary, explanation, item, terms)
    return 0.0 if parts is None else sum(parts[t] for t in terms)


def docs_terms(
    summary: str, explanation: str, item: dict[str, Any], terms: Sequence[str] = REWARD_TERMS
) -> dict[str, float] | None:
    """The parts ``terms`` of :func:`docs_score`, each in [0, 1] (by default the reward's three: ``lengths`` (a),
    ``ratio`` (b), ``coverage`` (c); :data:`ALL_TERMS` adds ``docstring`` (d)); None when the summary or the
    explanation is empty (the reward is then 0). What the report and the learning benchmark show per round, to show
    which part the agents learn."""
    s, e = summary.strip(), explanation.strip()
    if not s or not e:
        return None
    parts = {
        "lengths": lambda: float(_within(len(s.split()), SUMMARY_WORDS) and _within(len(e.split()), EXPLANATION_WORDS)),
        "ratio": lambda: ratio_score(len(e) / len(s)),
        "coverage": lambda: coverage(e, key_identifiers(item)),
        "docstring": lambda: _share(docstring_words(item), content_words(f"{s} {e}")),
    }
    return {t: parts[t]() for t in terms}


def _share(wanted: frozenset[str], found: frozenset[str]) -> float:
    return len(wanted & found) / len(wanted) if wanted else 0.0


def _entry_function(item: dict[str, Any]) -> ast.FunctionDef | ast.AsyncFunctionDef:
    """The top-level definition of ``item["entry_point"]`` in ``item["prompt"]``; ValueError naming the item."""
    entry_point = item_field(item, "entry_point")
    try:
        module = ast.parse(item_field(item, "prompt"))
    except SyntaxError as exc:
        raise ValueError(f"item {item.get('item_id')!r}: field 'prompt' does not parse: {exc}") from exc
    for node in module.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == entry_point:
            return node
    raise ValueError(f"item {item.get('item_id')!r}: field 'prompt' defines no function {entry_point!r}")


def docs_reward(
    summaries: Sequence[str],
    explanations: Sequence[str],
    *,
    prompts: Sequence[Sequence[str]] | None = None,
    batch_items: Sequence[dict[str, Any]] | None = None,
    terms: Sequence[str] = REWARD_TERMS,
) -> list[float]:
    """Batched :func:`docs_score`: ``summaries[j]`` (agent 1), ``explanations[j]`` (agent 2), ``batch_items[j]``,
    summing the parts ``terms``.

    Returns:
        n rewards in [0, 3].

    Raises:
        ValueError: ``batch_items`` missing, or the three lists differ in length.
    """
    items = check_two_agent_batch(summaries, explanations, batch_items)
    return [docs_score(s, e, item, terms) for s, e, item in zip(summaries, explanations, items, strict=True)]


@dataclass(frozen=True)
class PartialDocsReward:
    """:func:`docs_reward` summing only the parts ``terms``: a module-level object with a stable ``repr`` (the task's
    cache fingerprint reads it; a ``functools.partial`` shows a memory address) that pickles for Ray shards."""

    terms: tuple[str, ...]

    def __call__(
        self,
        summaries: Sequence[str],
        explanations: Sequence[str],
        *,
        prompts: Sequence[Sequence[str]] | None = None,
        batch_items: Sequence[dict[str, Any]] | None = None,
    ) -> list[float]:
        return docs_reward(summaries, explanations, prompts=prompts, batch_items=batch_items, terms=self.terms)


def _within(count: int, bounds: tuple[int, int]) -> bool:
    return bounds[0] <= count <= bounds[1]


def humaneval_docs_task(
    num_train_items: int | None = None, num_eval_items: int | None = None, reward_terms: Sequence[str] | None = None
) -> Task:
    """Agent 1 writes a one-sentence summary, agent 2 a detailed explanation; reward in [0, 3]
    (:func:`pbrl.tasks.humaneval_docs.docs_score`).

    ``reward_terms``: the parts of the reward summed, a non-empty subset of ``lengths``, ``ratio``, ``coverage`` and
    ``docstring`` (None = the first three); the reward then lies in [0, number of parts]. ``[coverage]`` and
    ``[coverage, docstring]`` are the content-only preferences of docs/results/marlhf.md.

    Raises:
        ConfigError: every bad option at once (``num_train_items``, ``num_eval_items``, ``reward_terms``: an
            unknown, repeated or missing part).
    """
    terms = REWARD_TERMS if reward_terms is None else tuple(reward_terms)
    problems = []
    unknown = [t for t in terms if t not in ALL_TERMS]
    if isinstance(reward_terms, str) or not terms or unknown or len(set(terms)) != len(terms):
        why = f"give a non-empty list of distinct parts among {', '.join(ALL_TERMS)}"
        problems.append(Problem("reward_terms", reward_terms, why + (f" (unknown: {unknown})" if unknown else "")))
    try:
        train, evaluation = split_problems(num_train_items, num_eval_items)
    except ConfigError as exc:
        raise ConfigError([*exc.problems, *problems]) from None
    if problems:
        raise ConfigError(problems)
    return Task(
        name="humaneval_docs",
        formatters=(summary_prompt, explanation_prompt),
        reward_func=docs_reward if terms == REWARD_TERMS else PartialDocsReward(terms),
        train_items=train,
        eval_items=evaluation,
        reward_range=(0.0, float(len(terms))),
        roles=("summary (one sentence)", "explanation (in detail)"),
    )
