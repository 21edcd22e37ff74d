"""Argument checks shared by the public constructors (private)."""

from __future__ import annotations

from typing import Any


def check_int(value: Any, name: str, minimum: int = 1, why: str = "") -> int:
    """``value`` if it is an int (not a bool) >= ``minimum``, else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"Expect `{name}` to be an int >= {minimum}, got {value!r}{why}.")
    return value
