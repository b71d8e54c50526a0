"""The env-step axis of the training metrics and the ``logging_steps`` gate (the reference's wandb x-axis).

The reference (CoMLRL ``MADPOTrainer.train`` / ``MAGRPOTrainer._should_log_train``;
docs/design/stages.md#update-policies) advances a counter ``env_step`` by ``environment_steps_per_pair ×
len(batch)`` after every update step when ``use_environment_step`` is on, and logs an update step's train
metrics only when the axis moved at least ``logging_steps`` since the last logged step (the first step is always
logged; ``logging_steps <= 1`` logs every step). The unit is a made-up count ("a pair = two joint samples"), not
generated samples.

Pure functions of plain values: the update stage passes its batch sizes and the counters it carried over from
the previous round (``env_step`` and the last logged step, kept with the checkpoint), and stores what these return.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

NEVER_LOGGED = -1  # the reference's initial ``_last_train_log_step``


def env_step_axis(
    batch_sizes: Sequence[int],
    *,
    start: int = 0,
    environment_steps_per_pair: int = 2,
    use_environment_step: bool = True,
) -> list[int]:
    """The env-step value after each update step.

    Args:
        batch_sizes: pairs in each update step, in order (every epoch's steps), each >= 1.
        start: the axis value before the first of these steps (carried over from earlier rounds), >= 0.
        environment_steps_per_pair: env steps one pair counts for (config option), >= 1.
        use_environment_step: when False the axis never moves (config option).

    Returns:
        One value per update step: ``start + environment_steps_per_pair × (pairs so far)``, or ``start``
        throughout when ``use_environment_step`` is False.

    Raises:
        ValueError: a batch size below 1, ``start`` below 0 or ``environment_steps_per_pair`` below 1 (named).
    """
    if start < 0:
        raise ValueError(f"start: got {start}; must be >= 0")
    if environment_steps_per_pair < 1:
        raise ValueError(f"environment_steps_per_pair: got {environment_steps_per_pair}; must be >= 1")
    axis, step = [], start
    for i, size in enumerate(batch_sizes):
        if size < 1:
            raise ValueError(f"batch_sizes: item {i} is {size}; every update step has >= 1 pair")
        if use_environment_step:
            step += environment_steps_per_pair * size
        axis.append(step)
    return axis


def logged_steps(env_steps: Sequence[int], *, logging_steps: int, last_logged: int = NEVER_LOGGED) -> list[int]:
    """Indices of the update steps whose train metrics are logged, by the reference's gate.

    Args:
        env_steps: the axis value after each update step (from :func:`env_step_axis`).
        logging_steps: the config option, >= 1; 1 logs every step.
        last_logged: the axis value of the last logged step before these (``NEVER_LOGGED`` = none yet).

    Returns:
        Step indices, ascending. A step is logged when nothing was logged yet, when ``logging_steps <= 1``,
        or when ``env_step - last_logged >= logging_steps``; each logged step becomes the new ``last_logged``.

    Raises:
        ValueError: ``logging_steps`` below 1.
    """
    if logging_steps < 1:
        raise ValueError(f"logging_steps: got {logging_steps}; must be >= 1")
    out = []
    for i, step in enumerate(env_steps):
        if logging_steps <= 1 or last_logged < 0 or step - last_logged >= logging_steps:
            out.append(i)
            last_logged = step
    return out


def train_log(
    step_metrics: Sequence[Mapping[str, float]],
    env_steps: Sequence[int],
    *,
    logging_steps: int,
    last_logged: int = NEVER_LOGGED,
) -> list[dict[str, float]]:
    """The logged train rows: ``{"env_step": s, **metrics}`` for each step that passes the gate.

    Args:
        step_metrics: one mapping of metric name -> value per update step (e.g. ``madpo/loss``).
        env_steps: the axis value after each update step; same length as ``step_metrics``.
        logging_steps, last_logged: as in :func:`logged_steps`.

    Raises:
        ValueError: the two sequences differ in length, or ``logging_steps`` below 1.
    """
    if len(step_metrics) != len(env_steps):
        raise ValueError(f"step_metrics has {len(step_metrics)} steps but env_steps {len(env_steps)}")
    return [
        {"env_step": float(env_steps[i]), **step_metrics[i]}
        for i in logged_steps(env_steps, logging_steps=logging_steps, last_logged=last_logged)
    ]
