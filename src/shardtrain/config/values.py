"""Reading user values (YAML, flags, questionnaire answers, environment, arguments): one set of coercions, each
raising the caller's error class with the key, the value and the fix."""

from __future__ import annotations

import difflib
import re
from typing import Any

TRUE_WORDS = ("true", "yes", "y", "1", "on")
FALSE_WORDS = ("false", "no", "n", "0", "off")


BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
              "gib": 2**30, "tib": 2**40}


def as_bytes(key: str, value: Any, error: type[Exception]) -> int:
    """'80GiB', '80 GB', '81920MiB' or a number of bytes -> bytes (> 0)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        number, unit = float(value), ""
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if not match or match.group(2).lower() not in BYTE_UNITS:
            raise error(f"{key} = {value!r} is not a memory size; write e.g. 80GiB, 80GB or 81920MiB")
        number, unit = float(match.group(1)), match.group(2).lower()
    if number <= 0:
        raise error(f"{key} = {value!r} must be > 0; write e.g. 80GiB")
    return int(number * BYTE_UNITS[unit])


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
