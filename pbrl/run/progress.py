"""A tiny hook so that a front end (the CLI's progress bar) hears when a stage finishes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_listeners: list[Callable[[dict[str, Any]], None]] = []


def subscribe(listener: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
    """Call ``listener(event)`` for every stage event; returns a function that unsubscribes."""
    _listeners.append(listener)
    return lambda: _listeners.remove(listener)


def publish(event: dict[str, Any]) -> None:
    for listener in list(_listeners):
        listener(event)
