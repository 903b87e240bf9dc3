"""Reading user values (YAML, flags, questionnaire answers, environment, arguments): one set of coercions, each
raising the caller's error class with the key, the value and the fix."""

from __future__ import annotations

import difflib
from typing import Any

TRUE_WORDS = ("true", "yes", "y", "1", "on")
FALSE_WORDS = ("false", "no", "n", "0", "off")


def closest(name: str, candidates: list[str]) -> str:
    """"; did you mean 'x'?" for the closest candidate, else the list of valid keys."""
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(candidates)}"


def as_bool(key: str, value: Any, error: type[Exception]) -> bool:
    """A boolean from a bool or a true/false word."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in TRUE_WORDS:
        return True
    if text in FALSE_WORDS:
        return False
    raise error(f"{key} got {value!r}; expected true or false")


def as_int(key: str, value: Any, minimum: int, fix: str, error: type[Exception]) -> int:
    """An int >= `minimum` from an int or a string of digits; `fix` tells the user what to set instead."""
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise error(f"{key} is {value!r}; {fix}")
    return value
