"""How every kvcal command runs: its checks of optional dependencies, its errors, its exit code.

Progress and messages go to stderr (``console``); tables and JSON go to stdout, so that a
command's output can be piped.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

from rich.console import Console
from rich.markup import escape

from replay.core.errors import InputError
from replay.core.extras import as_missing_extra, require

console = Console(stderr=True)
EXIT_OK, EXIT_NOT_APPLIED, EXIT_INPUT = 0, 1, 2


def guard(
    command: str,
    fn: Callable[[], int],
    needs: Iterable[str] = (),
    purpose: str = "",
    otherwise: str = "",
) -> NoReturn:
    """Run ``kvcal command``'s work and exit with its code: 2 on bad input, and on an optional
    dependency (``needs``, checked first; or one found missing on the way) not installed."""
    name = f"kvcal {command}"
    try:
        require(name, needs, purpose, otherwise)
        code = fn()
    except InputError as exc:  # a MissingExtra among them
        code = _refused(exc)
    except ModuleNotFoundError as exc:
        extra = as_missing_extra(name, exc)
        if extra is None:
            raise
        code = _refused(extra)
    sys.exit(code)


def _refused(exc: InputError) -> int:
    # One line however narrow the terminal (it names a file and the fix: a grep finds it
    # whole), and "[model]" is an extra, not rich markup.
    console.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)
    return EXIT_INPUT


def with_options(options: Iterable[Callable[[Any], Any]]) -> Callable[[Any], Any]:
    """Apply click options in the order listed (the order ``--help`` shows them)."""
    listed = list(options)

    def apply(f: Any) -> Any:
        for option in reversed(listed):
            f = option(f)
        return f

    return apply
