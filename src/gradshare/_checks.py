"""Argument checks shared by the public constructors, and the one default timeout (private).

Imported by every layer of the package; imports nothing of gradshare.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any


def check_int(value: Any, name: str, minimum: int = 1, why: str = "") -> int:
    """``value`` if it is an int (not a bool) >= ``minimum``, else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"Expect `{name}` to be an int >= {minimum}, got {value!r}{why}.")
    return value


DEFAULT_TIMEOUT = 300.0
"""Seconds a party, rank or collective waits for the others when no timeout is given: the one
default of every gradshare component (long enough for a slow step, short enough that a lost
peer is noticed within minutes, not torch.distributed's 30)."""


def to_seconds(timeout: float | timedelta | None, name: str = "timeout") -> float:
    """``timeout`` as seconds (None → :data:`DEFAULT_TIMEOUT`); must be finite and > 0."""
    if timeout is None:
        return DEFAULT_TIMEOUT
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(f"Expect `{name}` as seconds > 0 or a timedelta, got {timeout!r}.")
    if seconds == float("inf"):
        raise ValueError(f"Expect a finite `{name}`: an infinite wait can hang, got {timeout!r}.")
    return float(seconds)
