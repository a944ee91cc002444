"""One rule for numbers and types in what kvcanary reads from outside: trace records (and the
rows importers turn into them) and servers' answers. A value is taken only as the type its field
has; nothing is coerced:

* a boolean is never a number (``true`` is not 1);
* a string is never a number (``"16"`` is not 16), nor a number a string;
* an integer takes an integral number (``16``, or ``16.0`` as a JSON writer may put it), never
  ``16.5``, NaN or infinity, nor one past 64 bits (no count or id is, and the run's files,
  written with orjson, could not hold it); a count is an integer >= 0;
* token ids are a list of counts.

In a trace, a value that breaks the rule is a bad line naming its field (``StrictInt``,
``StrictNumber`` for the record's fields); in a server's answer it is the server's protocol
error, recorded on the request and never stored as it came (``integer``, ``token_ids``).
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import BeforeValidator

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def integer(value: object) -> int | None:
    """``value`` as an integer under the rule; None when it is not one."""
    if type(value) is int:
        n = value
    elif type(value) is float and value.is_integer():
        n = int(value)
    else:
        return None
    return n if _INT64_MIN <= n <= _INT64_MAX else None


def number(value: object) -> float | None:
    """``value`` as a finite number under the rule; None when it is not one."""
    if type(value) in (int, float) and math.isfinite(value):  # type: ignore[arg-type]
        return float(value)  # type: ignore[arg-type]
    return None


def token_ids(value: object) -> list[int] | None:
    """A list of token ids (integers >= 0), or None when ``value`` is not one."""
    if not isinstance(value, list | tuple):
        return None
    out = []
    for v in value:
        n = integer(v)
        if n is None or n < 0:
            return None
        out.append(n)
    return out


def is_token_ids(value: object) -> bool:
    return token_ids(value) is not None


def shown(value: object) -> str:
    """A value as an error message quotes it (JSON spelling, at most 60 characters)."""
    if value is None or isinstance(value, bool):
        text = "null" if value is None else str(value).lower()
    else:
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _strict_int(value: Any) -> int:
    n = integer(value)
    if n is None:
        whole = type(value) is int or (type(value) is float and value.is_integer())
        past = " (past 64 bits)" if whole else ""
        raise ValueError(f"must be an integer, got {shown(value)}{past}")
    return n


def _strict_number(value: Any) -> float:
    x = number(value)
    if x is None:
        raise ValueError(f"must be a finite number, got {shown(value)}")
    return x


# The record's fields (pydantic would otherwise take true as 1 and "16" as 16).
StrictInt = Annotated[int, BeforeValidator(_strict_int)]
StrictNumber = Annotated[float, BeforeValidator(_strict_number)]
