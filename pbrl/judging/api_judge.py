"""``judge: api``: a model behind an API as a pairwise judge (docs/guides/judges.md), through pbrl's API client
(:func:`pbrl.generation.api_client.fetch_answers`: its formats, total deadline, one retry budget, size cap, no
redirects, and the redaction of the key in every text that leaves it).

Each comparison is one request: the prompt template (:mod:`pbrl.judging.prompt`) rendered with the comparison, as
the user message, asking for one answer of at most ``judge_api_max_tokens`` tokens at temperature 0 (openai,
anthropic and generic send a temperature; openai_responses has none to send). The answer is read strictly
(:func:`~pbrl.judging.verdicts.parse_verdict`): ``A``, ``B`` or ``tie``, else no verdict and the reason; never a
guess. Each answer records the tokens the API reports for it (``usage``:
:func:`~pbrl.generation.api_formats.usage_tokens`) and the seconds of its request. The generic format's body
carries ``task_item = {"item_id": ...}`` only (the task item may hold a reference solution, which the judge is not
shown unless the template shows it) and ``agent_index = 0``.

**Failures.** A request refused (4xx other than 408/429), redirected, answered malformed or beyond the size cap
raises the client's :class:`~pbrl.generation.api_errors.ApiComparatorError`, led by "API judge" and naming the
``judge_api_*`` options to change. A request whose retry budget is spent raises :class:`ApiJudgeUnavailableError`:
a :class:`~pbrl.errors.TransientError` (a passing failure: its answer is not stored, a later run asks again) that is
still an ``ApiComparatorError``, so that Prefect's stage retries (:func:`flows.retry.retry_transient`) never
multiply the client's one retry budget. Every other request of the call runs to its end first, and its answer
reaches ``on_answer``, so that a stage storing answers as they come loses none that was paid for.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from pbrl.config.credentials import safe_url
from pbrl.errors import TransientError
from pbrl.generation.api_client import fetch_answers
from pbrl.generation.api_errors import ApiRetriesSpentError
from pbrl.generation.api_formats import ApiAnswer, ApiRequest, ApiRole, ApiSettings
from pbrl.generation.sampling import SamplingSettings
from pbrl.judging.prompt import render, template_problems
from pbrl.judging.verdicts import RAW_CHARS, Answer, Comparison, cut, parse_verdict

# The options the API judge's errors and hints name (pbrl.config.judge_fields).
JUDGE_ROLE = ApiRole(
    name="API judge",
    prefix="judge_api",
    model_option="judge_model",
    max_tokens_option="judge_api_max_tokens",
    max_n_option=None,  # one answer per request
    sampling_options="judge_api_max_tokens (the judge asks at temperature 0)",
)
_DIGEST_CHARS = 16  # hex characters of a SHA-256 shown in a judge's name (64 bits)


class ApiJudgeUnavailableError(ApiRetriesSpentError, TransientError):
    """The API judge's retry budget for a request is spent (408, 429, 5xx, missed deadlines, connection errors), or
    the server asked to wait beyond ``retry_after_max``: a passing failure, so a :class:`~pbrl.errors.TransientError`
    (no answer is stored for it; the next run asks again). Its message is the client's (led by "API judge", counting
    the requests sent); as an :class:`~pbrl.generation.api_errors.ApiComparatorError` it is never resent by Prefect's
    stage retries (:mod:`flows.retry`: one retry budget per request)."""

    @classmethod
    def of(cls, error: ApiRetriesSpentError) -> ApiJudgeUnavailableError:
        """``error`` as this class: the same message and attributes."""
        judged = cls.__new__(cls)
        judged.args = error.args
        judged.__dict__.update(error.__dict__)
        return judged


def sha256_hex(text: str) -> str:
    """SHA-256 of ``text`` (UTF-8), as hex."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def read_answer(api_answer: ApiAnswer) -> Answer:
    """An API answer (already redacted by the client) as a judge's :class:`Answer`: its verdict read strictly, its
    text as ``raw`` (cut to :data:`RAW_CHARS`), its reported tokens and seconds. An answer cut at the token limit
    that does not parse says so in its reason."""
    verdict, reason = parse_verdict(api_answer.text)
    if reason is not None and api_answer.finish_reason == "length":
        reason += "; the answer was cut at judge_api_max_tokens (raise it if the model writes before it answers)"
    return Answer(
        verdict,
        raw=cut(api_answer.text, RAW_CHARS),
        tokens=api_answer.tokens,
        seconds=round(api_answer.seconds, 6),
        reason=reason,
    )


@dataclass(frozen=True)
class ApiJudge:
    """A model behind an API as a :class:`~pbrl.judging.verdicts.PairwiseJudge` (see the module docstring).

    Attributes:
        settings: the API client's settings (from the ``judge_api_*`` options); their ``role`` is set to
            :data:`JUDGE_ROLE`, so that every message names the judge's options.
        template: the prompt template (:data:`pbrl.judging.prompt.DEFAULT_TEMPLATE` or ``judge_prompt_template``'s
            text).
        max_tokens: ≥ 1, most tokens of one answer (``judge_api_max_tokens``).

    Raises:
        ValueError: the template has a problem (every one named), or ``max_tokens`` < 1.
    """

    settings: ApiSettings
    template: str
    max_tokens: int

    def __post_init__(self) -> None:
        problems = template_problems(self.template)
        if problems:
            raise ValueError("judge_prompt_template: " + "; ".join(problems))
        if self.max_tokens < 1:
            raise ValueError(f"judge_api_max_tokens: got {self.max_tokens}; must be >= 1")
        if self.settings.role != JUDGE_ROLE:  # a judge's messages name the judge's options, whoever built them
            object.__setattr__(self, "settings", replace(self.settings, role=JUDGE_ROLE))

    @property
    def name(self) -> str:
        """The judge's identity, the key of its stored answers: the format, the URL (credentials hidden), the model,
        SHA-256 of the template, ``max_tokens`` and SHA-256 of what else the request carries (extra body, extra
        headers, and the generic format's response field). Never the key, which is not in the settings."""
        s = self.settings
        options = {
            "extra_body": dict(s.extra_body),
            "headers": dict(s.headers),
            "response_field": s.response_field if s.api_format == "generic" else None,
        }
        digest = sha256_hex(json.dumps(options, sort_keys=True, default=str))
        return (
            f"api(format={s.api_format}, url={safe_url(s.url)}, model={s.model}, "
            f"template=sha256:{sha256_hex(self.template)[:_DIGEST_CHARS]}, max_tokens={self.max_tokens}, "
            f"options=sha256:{digest[:_DIGEST_CHARS]})"
        )

    def sampling(self) -> SamplingSettings:
        """What each request asks for: one answer of at most ``max_tokens`` tokens, at temperature 0, top-p 1."""
        return SamplingSettings(max_new_tokens=self.max_tokens, temperature=0.0, top_p=1.0, top_k=None, batch_size=1)

    def answer(
        self, comparisons: Sequence[Comparison], *, on_answer: Callable[[int, Answer], None] | None = None
    ) -> list[Answer]:
        """One answer per comparison, in order; at most ``settings.max_concurrency`` requests in flight.

        Args:
            comparisons: the questions, each sent as one request.
            on_answer: called with (index in ``comparisons``, answer) as each answer arrives, before any failure
                of another request is raised (a stage stores them there).

        Raises:
            ApiJudgeUnavailableError: a request's retry budget was spent (a TransientError).
            ApiComparatorError: a request was refused, redirected, answered malformed or beyond the size cap, or
                the key variable is not set.
            ConfigError: the settings hold a credential (nothing is sent).
        """
        if not comparisons:
            return []
        requests = [
            ApiRequest(f"item {c.item_id!r}", render(self.template, c), 0, {"item_id": c.item_id}, 1)
            for c in comparisons
        ]
        index = {id(r): i for i, r in enumerate(requests)}
        answers: list[Answer | None] = [None] * len(requests)

        def arrived(request: ApiRequest, got: list[ApiAnswer]) -> None:
            i = index[id(request)]
            answers[i] = read_answer(got[0])
            if on_answer is not None:
                on_answer(i, answers[i])

        try:
            fetch_answers(requests, self.settings, self.sampling(), on_answers=arrived)
        except ApiRetriesSpentError as exc:
            raise ApiJudgeUnavailableError.of(exc) from None
        return [a for a in answers if a is not None]
