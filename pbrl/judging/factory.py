"""The model judges built from plain option values: the run's setup code unpacks the job's ``judge_*`` options into
:func:`api_judge_from_options` (``judge: api``) or :func:`local_judge_from_options` (``judge: local``)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

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
    settings: ApiSettings, *, max_tokens: int = 16, prompt_template: str | Path | None = None
) -> ApiJudge:
    """``judge: api`` from the client's settings (the ``judge_api_*`` options, ``judge_model`` as ``model``; the key
    variable's NAME only, the key is read when asking), ``judge_api_max_tokens`` and ``judge_prompt_template`` (a
    file path, or None for the built-in template). The settings speak as the judge (:data:`JUDGE_ROLE`) whoever
    built them. Nothing is sent here.

    Raises:
        ConfigError: the template file cannot be read or has problems.
        ValueError: ``max_tokens`` < 1 (naming ``judge_api_max_tokens``).
    """
    return ApiJudge(replace(settings, role=JUDGE_ROLE), read_template(prompt_template), max_tokens)


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
