"""``judge: local``: a local causal LM as a pairwise judge, by the probabilities of its two answer tokens
(docs/guides/judges.md).

The judge reads the prompt template (:mod:`pbrl.judging.prompt`) rendered with the comparison, as the user message
of the model's chat template (:func:`pbrl.generation.sampling.encode_prompt`), and answers with its next token:

    P(A) = p(A) / (p(A) + p(B)) = σ(log p(A) − log p(B)),

where p(A) and p(B) are the model's next-token probabilities of the single tokens it would write for "A" and "B" at
the start of its answer (:func:`answer_token_ids`). This is the judging of PairRM-style and "logit" LLM judges
(Zheng et al. 2023, "Judging LLM-as-a-judge", §3; TRL's ``PairRMJudge`` returns such probabilities): no sampling, so
no parse failure, and a probability instead of a word. The verdict is
:func:`~pbrl.judging.verdicts.verdict_of_probability` with ``judge_tie_margin``; ``raw`` records P(A) and the mass
p(A) + p(B) of the next token (a judge that puts little mass on either is not answering the question).

Comparisons are scored ``judge_batch_size`` at a time, each prompt prefilled once for both tokens
(:func:`pbrl.learning.logprobs.shared_prompt_logprobs`, the scoring path's shared-prompt forward), in eval mode
without gradients, with ``rows_alone=True``. So a comparison's answer does not depend on its batch: a bfloat16 (or
float16) model on the CPU gives it the bits it has when judged alone (:mod:`pbrl.models.row_invariance`; that path is
:func:`~pbrl.learning.logprobs.sequence_logprobs` with ``rows_alone=True``); a float32 model, or any model on a GPU,
keeps the batched forward, whose P(A) agrees with the comparison alone to rounding (about 1e-7 in float32 on the tiny
model), so a verdict can differ only where P(A) lies that close to a threshold.

A prompt longer than the model's context (``max_position_embeddings``) gets no verdict, with the reason.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from pbrl.errors import ConfigError, Problem
from pbrl.generation.sampling import encode_prompt
from pbrl.judging.api_judge import sha256_hex
from pbrl.judging.prompt import render, template_problems
from pbrl.judging.verdicts import Answer, Comparison, verdict_of_probability
from pbrl.learning.logprobs import shared_prompt_logprobs

ANSWER_WORDS = ("A", "B")
_DIGEST_CHARS = 16  # hex characters of the template's SHA-256 shown in the judge's name
_PROBE = Comparison("probe", ("Write a word.",), ("agent 1",), ("yes",), ("no",))  # checks the tokenizer up front


def answer_token_ids(tokenizer: Any, prompt: str) -> tuple[list[int], int, int]:
    """The judge's prompt ids and the single token ids of the answers "A" and "B" that follow them: each word is
    encoded as the text of the assistant's answer right after the prompt (in the chat template when the tokenizer has
    one), and must add exactly one token to the prompt's ids.

    Returns:
        (prompt ids as :func:`~pbrl.generation.sampling.encode_prompt` gives them, id of "A", id of "B").

    Raises:
        ValueError: a word is not one token after the prompt (the tokens it makes are named), or both are one.
    """
    prompt_ids = encode_prompt(tokenizer, prompt)
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        ids_after = [tokenizer(text + word, add_special_tokens=False).input_ids for word in ANSWER_WORDS]
    else:
        ids_after = [tokenizer(prompt + word).input_ids for word in ANSWER_WORDS]
    found = []
    for word, ids in zip(ANSWER_WORDS, ids_after, strict=True):
        ids = list(ids)
        follows = ids[: len(prompt_ids)] == prompt_ids
        if not follows or len(ids) != len(prompt_ids) + 1:
            # the tokens the word makes after the prompt; when it merges with the prompt's end, the last few
            written = tokenizer.convert_ids_to_tokens(ids[len(prompt_ids) :] if follows else ids[-3:])
            raise ValueError(
                f"the judge's tokenizer does not write the answer {word!r} as one token after the prompt (it writes "
                f"{written}); judge 'local' reads P(A) from the next token: use a judge_model whose tokenizer writes "
                "'A' and 'B' as single tokens at the start of an answer"
            )
        found.append(ids[-1])
    if found[0] == found[1]:
        raise ValueError(f"the judge's tokenizer writes 'A' and 'B' as the same token ({found[0]})")
    return prompt_ids, found[0], found[1]


def probability_of_a(logprob_a: float, logprob_b: float) -> float:
    """P(A) = p(A) / (p(A) + p(B)) from the log-probabilities (nats, finite), without overflow: σ(log p(A) − log
    p(B))."""
    d = logprob_a - logprob_b
    if d >= 0:
        return 1.0 / (1.0 + math.exp(-d))
    e = math.exp(d)
    return e / (1.0 + e)


class LocalJudge:
    """A local causal LM as a :class:`~pbrl.judging.verdicts.PairwiseJudge` (see the module docstring).

    Args:
        model: a causal LM (``*ForCausalLM``), e.g. from :func:`pbrl.models.loading.load_model`.
        tokenizer: its tokenizer (:func:`pbrl.models.loading.load_tokenizer`).
        source: the model's source as configured (``judge_model``: a folder or a packaged alias), for the name.
        template: the prompt template's text.
        batch_size: ≥ 1, comparisons per forward (``judge_batch_size``); the answers do not depend on it (see the
            module docstring: bitwise in bfloat16 on the CPU, to rounding otherwise).
        tie_margin: in [0, 0.5), ``judge_tie_margin``.

    Raises:
        ConfigError: naming ``judge_model``, the tokenizer does not write "A" and "B" as single tokens; naming
            ``judge_prompt_template``, ``judge_batch_size`` or ``judge_tie_margin``, a bad value.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        *,
        source: str,
        template: str,
        batch_size: int = 8,
        tie_margin: float = 0.0,
    ) -> None:
        problems = [Problem("judge_prompt_template", "(its text)", p) for p in template_problems(template)]
        if batch_size < 1:
            problems.append(Problem("judge_batch_size", batch_size, "must be >= 1"))
        if not 0 <= tie_margin < 0.5:
            problems.append(Problem("judge_tie_margin", tie_margin, "must be in [0, 0.5)"))
        if not problems:
            try:
                answer_token_ids(tokenizer, render(template, _PROBE))
            except ValueError as exc:
                problems.append(Problem("judge_model", source, str(exc)))
        if problems:
            raise ConfigError(problems)
        self.model, self.tokenizer, self.source, self.template = model, tokenizer, source, template
        self.batch_size, self.tie_margin = batch_size, tie_margin
        parameter = next(model.parameters())
        self.dtype, self.device = str(parameter.dtype).removeprefix("torch."), parameter.device.type
        self.context = getattr(getattr(model, "config", None), "max_position_embeddings", None)

    @property
    def name(self) -> str:
        """The judge's identity, the key of its stored answers: the model source, its dtype and device type,
        SHA-256 of the template and the tie margin (not the batch size: it changes no answer beyond rounding). A
        folder is named by its path: a judge model retrained in place needs a new folder (or a new run) for new
        answers."""
        digest = sha256_hex(self.template)[:_DIGEST_CHARS]
        return (
            f"local(model={self.source}, dtype={self.dtype}, device={self.device}, template=sha256:{digest}, "
            f"tie_margin={self.tie_margin})"
        )

    def answer(self, comparisons: Sequence[Comparison]) -> list[Answer]:
        """One answer per comparison, in order: P(A), its verdict and ``raw`` ``"P(A)=0.6123; p(A)+p(B)=0.4100"``;
        ``seconds`` is the wall time of its batch's forward, shared equally among the batch's comparisons; ``tokens``
        is 0 (nothing is paid). A comparison whose prompt does not fit the model's context, or whose log-probabilities
        are not finite, gets no verdict and the reason."""
        answers: list[Answer | None] = [None] * len(comparisons)
        rows: list[tuple[int, list[int], int, int]] = []  # (comparison, prompt ids, id of A, id of B)
        for i, comparison in enumerate(comparisons):
            try:
                prompt_ids, id_a, id_b = answer_token_ids(self.tokenizer, render(self.template, comparison))
            except ValueError as exc:
                answers[i] = Answer(None, reason=str(exc))
                continue
            if self.context is not None and len(prompt_ids) + 1 > self.context:
                answers[i] = Answer(None, reason=self._too_long(len(prompt_ids)))
                continue
            rows.append((i, prompt_ids, id_a, id_b))
        for start in range(0, len(rows), self.batch_size):
            batch = rows[start : start + self.batch_size]
            for i, answer in zip([r[0] for r in batch], self._judge(batch), strict=True):
                answers[i] = answer
        return [a for a in answers if a is not None]

    def _too_long(self, prompt_tokens: int) -> str:
        return (
            f"the judge's prompt has {prompt_tokens} tokens, beyond the judge model's context of {self.context} "
            "(max_position_embeddings): shorten the responses (max_new_tokens) or the template, or use a model with a "
            "longer context"
        )

    def _judge(self, batch: list[tuple[int, list[int], int, int]]) -> list[Answer]:
        """The answers of one batch: both answer tokens of every comparison scored in one forward (2 rows a
        comparison, one prefill per prompt)."""
        prompts = [ids for _, ids, _, _ in batch for _ in ANSWER_WORDS]  # (2b,): A then B of each comparison
        answer_ids = [[token] for _, _, id_a, id_b in batch for token in (id_a, id_b)]  # (2b,)
        started = time.monotonic()
        with torch.no_grad():
            logprobs = shared_prompt_logprobs(
                self.model, prompts, answer_ids, pad_token_id=self.tokenizer.pad_token_id, rows_alone=True
            )  # (2b,) float64 nats
        seconds = round((time.monotonic() - started) / len(batch), 6)
        pairs = logprobs.view(-1, 2).tolist()  # (b, 2): log p(A), log p(B)
        answers = []
        for logprob_a, logprob_b in pairs:
            raw = f"log p(A)={logprob_a}; log p(B)={logprob_b}"
            if not (math.isfinite(logprob_a) and math.isfinite(logprob_b)):
                reason = f"the judge model's log-probabilities are not finite ({raw})"
                answers.append(Answer(None, raw=raw, seconds=seconds, reason=reason))
                continue
            p = probability_of_a(logprob_a, logprob_b)
            mass = math.exp(logprob_a) + math.exp(logprob_b)
            verdict = verdict_of_probability(p, self.tie_margin)
            answers.append(Answer(verdict, probability=p, raw=f"P(A)={p:.4f}; p(A)+p(B)={mass:.4f}", seconds=seconds))
        return answers
