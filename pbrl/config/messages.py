"""Translation of pydantic's validation errors into pbrl's :class:`~pbrl.errors.Problem` wording.

One problem per field, showing the raw value given and what would be accepted (read from the field's
annotation and constraints), never pydantic's own text: ``dpo_beta: got 0; must be > 0``,
``num_iterations: got True; must be an integer (true/false is not a number)``.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import ValidationError
from pydantic.fields import FieldInfo

from pbrl.config.credentials import api_shown_value
from pbrl.errors import ConfigError, Problem

_BOUNDS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")


def field_problems(err: ValidationError, fields: Mapping[str, FieldInfo], data: Mapping[str, Any]) -> list[Problem]:
    """One :class:`Problem` per field from pydantic's errors (plus the problems of a wrapped ConfigError).

    The value shown is the raw value given for the field; the message names the allowed values or range
    (read from the field's annotation and constraints), never pydantic's wording.
    """
    grouped: dict[str, list[dict[str, Any]]] = {}
    problems: list[Problem] = []
    for error in err.errors():
        wrapped = (error.get("ctx") or {}).get("error")
        if isinstance(wrapped, ConfigError):
            problems.extend(wrapped.problems)
        else:
            name = str(error["loc"][0]) if error["loc"] else "config"
            grouped.setdefault(name, []).append(error)
    for name, errors in grouped.items():
        info = fields.get(name)
        value = data.get(name)  # the raw value given (None when missing)
        problems.append(Problem(name, api_shown_value(name, value), _message(errors, info, value)))
    return problems


def _message(errors: list[dict[str, Any]], info: FieldInfo | None, value: Any) -> str:
    kinds = {e["type"] for e in errors}
    if info is None:
        return "; ".join(e["msg"] for e in errors)
    if "missing" in kinds:
        return "missing; this option is required"
    if "literal_error" in kinds:
        return "allowed: " + ", ".join(str(c) for c in _literal_choices(info.annotation))
    if kinds & set(_BOUNDS):
        return bounds_text(info)
    if "finite_number" in kinds:
        return "must be a finite number"
    if kinds & {"too_short", "string_too_short"}:
        error = next(e for e in errors if e["type"] in ("too_short", "string_too_short"))
        return f"item {error['loc'][1]} must not be empty" if len(error["loc"]) > 1 else "must not be empty"
    return "must be " + describe_type(info.annotation) + _strict_hint(info.annotation, value)


def _strict_hint(tp: Any, value: Any) -> str:
    """Why a value that lax parsing would have converted is refused (booleans, numbers for text)."""
    kinds = scalar_kinds(tp)
    if isinstance(value, bool) and kinds & {int, float}:
        return " (true/false is not a number)"
    if isinstance(value, int | float) and not isinstance(value, bool) and str in kinds:
        return f' (a number is not text: write it in quotes in YAML, "{value}")'
    return ""


def bounds_text(info: FieldInfo) -> str:
    """``'must be > 0'``, ``'must be in [0, 1)'``, ``'must be >= 1 or None'`` from a field's constraints."""
    low = high = None
    for m in info.metadata:
        if isinstance(m, annotated_types.Gt):
            low = f"> {m.gt}", "(", m.gt
        elif isinstance(m, annotated_types.Ge):
            low = f">= {m.ge}", "[", m.ge
        elif isinstance(m, annotated_types.Lt):
            high = f"< {m.lt}", ")", m.lt
        elif isinstance(m, annotated_types.Le):
            high = f"<= {m.le}", "]", m.le
    if low and high:
        text = f"must be in {low[1]}{low[2]}, {high[2]}{high[1]}"
    else:
        text = "must be " + (low or high or ("a valid value", "", ""))[0]
    return text + " or None" if _allows_none(info.annotation) else text


def _union_args(tp: Any) -> tuple[Any, ...]:
    origin = get_origin(tp)
    if origin is Annotated:
        return _union_args(get_args(tp)[0])
    if origin in (Union, types.UnionType):
        return get_args(tp)
    return (tp,)


def _strip(tp: Any) -> Any:
    return _strip(get_args(tp)[0]) if get_origin(tp) is Annotated else tp


def _allows_none(tp: Any) -> bool:
    return type(None) in _union_args(tp)


def _literal_choices(tp: Any) -> list[Any]:
    choices: list[Any] = []
    for arg in _union_args(tp):
        if get_origin(arg) is Literal:
            choices.extend(get_args(arg))
    return choices


def scalar_kinds(tp: Any) -> set[type]:
    """The scalar Python types an annotation takes: ``StrictInt | None`` -> ``{int, NoneType}``.

    A ``Literal`` counts as the types of its choices; lists and mappings are left out.
    """
    kinds: set[type] = set()
    for arg in map(_strip, _union_args(tp)):
        if get_origin(arg) is Literal:
            kinds.update(type(c) for c in get_args(arg))
        elif arg in (int, float, str, bool, type(None)):
            kinds.add(arg)
    return kinds


def describe_type(tp: Any) -> str:
    """Words for an annotation: ``str | list[str] | None`` -> ``'a string, a list of strings or None'``."""
    parts = [_describe_one(a) for a in _union_args(tp)]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " or " + parts[-1]


def _describe_one(tp: Any) -> str:
    tp = _strip(tp)
    origin = get_origin(tp)
    if origin is list:
        inner = _describe_one(get_args(tp)[0]) if get_args(tp) else "a value"
        return "a list of strings" if inner == "a string" else "a list"
    if origin is dict or tp is dict:
        values = get_args(tp)[1:] if get_args(tp) else ()
        return "a mapping of names to strings" if values and _strip(values[0]) is str else "a mapping"
    if origin is Literal:
        return "one of " + ", ".join(str(c) for c in get_args(tp))
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "None"}
    return names.get(tp, getattr(tp, "__name__", str(tp)))
