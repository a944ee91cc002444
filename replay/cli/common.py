"""What every ``replay`` command shares: the console, the exit codes, and the guard that turns
our errors into a one-line message and an exit code (a traceback is a bug, not a message).

Exit codes are ``replay.core.exit_codes.ExitCode``: 0 every target served the whole run; 2 bad
input or usage; 3 at least one target failed (did not start, or serves something other than its
spec); 4 a target ran but failed more requests than its error budget allows (a CI step must not
mistake that run for a good one); 130 interrupted. ``replay canary`` exits by its verdict.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

from rich.console import Console
from rich.markup import escape

from replay.core.errors import InputError, KvcanaryError
from replay.core.exit_codes import ExitCode
from replay.core.extras import MissingExtra

T = TypeVar("T")

console = Console(stderr=True)


def table_console() -> Console:
    """stdout for tables: as wide as the terminal, or wide enough not to wrap in a CI log."""
    out = Console()
    return out if out.is_terminal else Console(width=170)


def install_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C (asyncio cancels the run, ``finally`` blocks stop the
    servers we started)."""

    def handler(signum: int, frame: Any) -> None:
        signal.raise_signal(signal.SIGINT)

    signal.signal(signal.SIGTERM, handler)


def guard(fn: Callable[[], int]) -> NoReturn:
    """Run a command's work and exit with its code; our errors become an ``error:`` line on
    stderr (a traceback is a bug)."""
    try:
        code = fn()
    except InputError as exc:
        # A missing extra's hint is one line however narrow the terminal, so it can be copied.
        _print_error(exc, soft_wrap=isinstance(exc, MissingExtra))
        code = ExitCode.INPUT
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/yellow]: results so far are in the run directory")
        code = ExitCode.INTERRUPTED
    except KvcanaryError as exc:
        _print_error(exc)
        code = ExitCode.TARGET_FAILED
    sys.exit(code)


def _print_error(exc: Exception, soft_wrap: bool = False) -> None:
    """``error: <message>``; the message is text, not rich markup ('kvcanary[data]' is an
    extra, a path may hold brackets)."""
    console.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=soft_wrap)
