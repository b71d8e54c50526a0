"""Notices of the pbrl configuration: warnings about valid options, and options derived from others.

A reference (CoMLRL) config carries over key for key. Options that pbrl accepts for that reason but that change
nothing here warn once (:class:`ConfigNotice`, naming why), and options whose value follows from others in the
reference are filled in before validation (:func:`derive_values`), as the reference's ``__post_init__`` does.
:mod:`pbrl.config.models` runs both; ``pbrl validate`` prints the warnings.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

Values = Mapping[str, Any]
# A notice reads the validated values and the names of the options that were given explicitly, and returns
# warnings (a valid configuration whose option does nothing, or is replaced, as in the reference).
Notice = Callable[[Values, frozenset[str]], list[str]]
# The reference's ``_apply_magrpo_family_args``: MARLHF's advantage_mode follows rl_algorithm.
ADVANTAGE_MODES = {"magrpo": "mean", "mareinforce": "raw", "maremax": "max", "marloo": "rloo"}


class ConfigNotice(UserWarning):
    """A warning about a valid configuration: an option accepted for reference configs that changes nothing in
    pbrl, or one replaced as the reference replaces it. Emitted once per entry (``pbrl validate`` / ``train``)."""


def madpo_kl_notice(v: Values, given: frozenset[str] = frozenset()) -> list[str]:
    """The warning for MADPO configs with ``reference_kl_enabled=True`` (valid, but it adds nothing)."""
    if not v["reference_kl_enabled"]:
        return []
    return [
        (
            "reference_kl_enabled=True has no effect on MADPO: MADPO is reference-free in pbrl (no reference "
            "model is loaded), so reference_kl_coef and reference_devices add nothing"
        )
    ]


# Options of the reference that pbrl accepts (with the reference's bounds) but that change nothing, and why.
_SINGLE_TURN = "pbrl trains single-turn joint responses (num_turns=1), and the option only acts over several turns"
NO_EFFECT_COMMON = {
    "discount": _SINGLE_TURN,
    "early_termination_threshold": _SINGLE_TURN,
    "external_prompt_passthrough": _SINGLE_TURN,
}
NO_EFFECT_MADPO = {
    **NO_EFFECT_COMMON,
    "advantage_normalization": "it shapes the advantages of MARLHF's RL backends; MADPO learns from pairs",
    "advantage_mode": "it picks the baseline of MARLHF's RL backends; MADPO learns from pairs",
}
NO_EFFECT_MARLHF = {
    **NO_EFFECT_COMMON,
    "dpo_beta": "MARLHF fits a reward model and runs RL; only MADPO's loss uses it",
}


def _no_effect_notice(table: Mapping[str, str]) -> Notice:
    def notice(v: Values, given: frozenset[str] = frozenset()) -> list[str]:
        return [
            f"{name}={v[name]!r} has no effect in pbrl ({why}); accepted for reference configs"
            for name, why in table.items()
            if name in given
        ]

    return notice


madpo_no_effect_notice = _no_effect_notice(NO_EFFECT_MADPO)
marlhf_no_effect_notice = _no_effect_notice(NO_EFFECT_MARLHF)


def eval_interval_notice(v: Values, given: frozenset[str] = frozenset()) -> list[str]:
    """A warning when ``eval_interval`` (rounds in pbrl, update steps in the reference) skips every trained round."""
    rounds = v.get("num_iterations", 1)  # the base trainers have one round
    interval = v["eval_interval"]
    if interval <= rounds:
        return []
    return [
        f"eval_interval={interval} counts rounds in pbrl (the reference counts update steps) and exceeds the "
        f"{rounds} round(s) of this run: only the round-0 baseline will be evaluated; set eval_interval: 1 to "
        "evaluate after every round"
    ]


def derive_values(data: Mapping[str, Any], fields: Iterable[str]) -> tuple[dict[str, Any], list[str]]:
    """Options whose value follows from others in the reference, filled in before validation.

    * ``train_batch_size`` None (or absent) -> ``rollout_buffer_size`` (MADPOConfig.__post_init__);
    * MARLHF: ``advantage_mode`` <- ``rl_algorithm`` for the group-baseline backends (the reference's
      ``_apply_magrpo_family_args``); a different given value is replaced, with a notice;
    * iterative: ``comparator_generation_mode`` <- ``'centralized'`` with ``collaboration_mode='centralized'``
      (the reference's ``__post_init__``); a different given value is replaced, with a notice.

    A source option of the wrong type is left for validation to report; its dependant then takes its own
    default. Returns (the values, the notices).
    """
    out, notes, fields = dict(data), [], set(fields)
    if "train_batch_size" in fields and out.get("train_batch_size") is None:
        buffer = out.get("rollout_buffer_size", 2)
        valid = type(buffer) is int and buffer >= 1
        out["train_batch_size"] = buffer if valid else 2
    if "rl_algorithm" in fields and "advantage_mode" in fields:
        algorithm = out.get("rl_algorithm", "magrpo")
        mode = ADVANTAGE_MODES.get(algorithm) if isinstance(algorithm, str) else None
        if mode is not None:
            given = out.get("advantage_mode")
            if given is not None and given != mode:
                notes.append(
                    f"advantage_mode={given!r} is replaced by {mode!r}: with rl_algorithm={algorithm!r} "
                    "the advantage mode follows the algorithm, as in the reference"
                )
            out["advantage_mode"] = mode
    if "comparator_generation_mode" in fields and out.get("collaboration_mode") == "centralized":
        # Centralized collaboration: the comparator is one actor writing every role too (the reference's
        # MADPOIterConfig.__post_init__ sets it the same way).
        given = out.get("comparator_generation_mode")
        if given is not None and given != "centralized":
            notes.append(
                f"comparator_generation_mode={given!r} is replaced by 'centralized': with "
                "collaboration_mode='centralized' one actor writes every role, on the comparator side "
                "too, as in the reference"
            )
        out["comparator_generation_mode"] = "centralized"
    return out, notes
