"""The model judges built from plain option values: the run's setup code unpacks the job's ``judge_*`` options into
:func:`api_judge_from_options` (``judge: api``) or :func:`local_judge_from_options` (``judge: local``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pbrl.errors import ConfigError, Problem
from pbrl.generation.api_formats import ApiSettings
from pbrl.judging.api_judge import JUDGE_ROLE, ApiJudge
from pbrl.judging.local_judge import LocalJudge
from pbrl.judging.prompt import DEFAULT_TEMPLATE, template_problems
from pbrl.models.loading import load_model, load_tokenizer, resolve_model_source
from pbrl.models.precision import resolve_precision


def read_template(path: str | Path | None) -> str:
    """The judge's prompt template: the text of the file ``path`` (``judge_prompt_template``, resolved by the
    caller), or :data:`~pbrl.judging.prompt.DEFAULT_TEMPLATE` when None.

    Raises:
        ConfigError: naming ``judge_prompt_template``, the file cannot be read as UTF-8 text, or the template has
            problems (every one listed: :func:`~pbrl.judging.prompt.template_problems`).
    """
    if path is None:
        return DEFAULT_TEMPLATE
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = f"cannot be read ({type(exc).__name__}: {exc}); give the path of a UTF-8 text file"
        raise ConfigError([Problem("judge_prompt_template", str(path), why)]) from None
    problems = template_problems(text)
    if problems:
        raise ConfigError([Problem("judge_prompt_template", str(path), p) for p in problems])
    return text


def api_judge_from_options(
    *,
    api_format: str,
    url: str,
    model: str | None,
    key_env: str | None,
    key_header: str = "Authorization",
    key_prefix: str = "Bearer",
    headers: Mapping[str, str] | None = None,
    extra_body: Mapping[str, Any] | None = None,
    response_field: str = "completions",
    max_tokens: int = 16,
    timeout: float = 120.0,
    max_concurrency: int = 4,
    prompt_template: str | Path | None = None,
) -> ApiJudge:
    """``judge: api`` from the values of ``judge_api_format``, ``judge_api_url``, ``judge_model``,
    ``judge_api_key_env`` (the variable's NAME; the key is read only when asking), ``judge_api_key_header``,
    ``judge_api_key_prefix``, ``judge_api_headers``, ``judge_api_extra_body``, ``judge_api_response_field``,
    ``judge_api_max_tokens``, ``judge_api_timeout`` (seconds, per request in all), ``judge_api_max_concurrency`` and
    ``judge_prompt_template`` (a file path, or None for the built-in template). Nothing is sent here.

    Raises:
        ConfigError: the template file cannot be read or has problems.
        ValueError: an unknown format (naming ``judge_api_format``) or ``max_tokens`` < 1.
    """
    settings = ApiSettings(
        api_format=api_format,
        url=url,
        model=model,
        key_env=key_env,
        key_header=key_header,
        key_prefix=key_prefix,
        headers=dict(headers or {}),
        extra_body=dict(extra_body or {}),
        response_field=response_field,
        timeout=timeout,
        max_concurrency=max_concurrency,
        role=JUDGE_ROLE,
    )
    return ApiJudge(settings, read_template(prompt_template), max_tokens)


def local_judge_from_options(
    *,
    model: str,
    prompt_template: str | Path | None = None,
    batch_size: int = 8,
    tie_margin: float = 0.0,
    dtype: str = "auto",
    device: str = "cpu",
) -> LocalJudge:
    """``judge: local`` from the values of ``judge_model`` (a model folder, a hub id already on disk or a packaged
    alias such as ``tiny-random`` or ``smollm2-135m-instruct``), ``judge_prompt_template``, ``judge_batch_size`` and
    ``judge_tie_margin``; the model is loaded frozen, in eval mode, on ``device`` with frozen-weight dtype ``dtype``
    (``auto``: bfloat16 where the device computes it natively, else float32, as the run's ``torch_dtype``).

    Raises:
        ConfigError: naming ``judge_model``, the model is not found offline or its tokenizer does not write "A" and
            "B" as single tokens; naming ``judge_prompt_template``, ``judge_batch_size`` or ``judge_tie_margin``, a
            bad value.
    """
    source = resolve_model_source(model, field="judge_model")
    template = read_template(prompt_template)
    concrete = resolve_precision(dtype, "no", device).torch_dtype
    judge_model = load_model(source, device=device, dtype=concrete)
    return LocalJudge(
        judge_model,
        load_tokenizer(source),
        source=model,
        template=template,
        batch_size=batch_size,
        tie_margin=tie_margin,
    )
