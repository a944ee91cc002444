"""Models a command may name instead of giving a folder: ``--model real`` and the like.

``embedded`` is the trained test model committed with the package, ``twin`` its outlier twin
(keys past FP8's range), ``real`` SmolLM2-135M-Instruct built from its PyPI package
(``replay.testmodel.real``), ``long`` Gemma 3 270M, 32K tokens with sliding-window layers,
from its PyPI packages (``replay.testmodel.long``; Gemma Terms of Use). Each is built into
the cache on first use; a name that needs a package not installed stops with
:class:`~replay.core.extras.MissingExtra` and the install line.
A folder that exists always wins over a name, so a model folder called ``real`` still works.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from replay.core.errors import InputError


def _embedded(command: str) -> Path:
    from replay.testmodel.factory import ensure_default_model

    return ensure_default_model(command)


def _twin(command: str) -> Path:
    from replay.testmodel.factory import ensure_twin_model

    return ensure_twin_model(command)


def _real(command: str) -> Path:
    from replay.testmodel.real import ensure_real_model

    return ensure_real_model(command)


def _long(command: str) -> Path:
    from replay.testmodel.long import ensure_long_model

    return ensure_long_model(command)


NAMED: dict[str, Callable[[str], Path]] = {
    "embedded": _embedded,
    "twin": _twin,
    "real": _real,
    "long": _long,
}


def resolve_model(value: str | Path, command: str) -> Path:
    """The folder ``value`` names: itself when it is a folder, else the named model, built on
    first use; anything else is bad input."""
    path = Path(value)
    if path.is_dir():
        return path
    if str(value) in NAMED:
        return NAMED[str(value)](command)
    raise InputError(
        f"{value}: no such model folder (or name a built-in model: {', '.join(NAMED)})"
    )
