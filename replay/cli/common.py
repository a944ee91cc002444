"""What every ``replay`` command shares: the console, the exit codes, and the guard that turns
our errors into a one-line message and an exit code (a traceback is a bug, not a message).

Exit codes are ``replay.core.exit_codes.ExitCode``: 0 every target served the whole run; 2 bad
input or usage; 3 at least one target failed (did not start, or serves something other than its
spec); 4 a target ran but failed more requests than its error budget allows (a CI step must not
mistake that run for a good one); 5 the run directory could not be written mid-run (a full
disk; ``--resume`` finishes the run); 130 interrupted by Ctrl-C, 143 by SIGTERM. ``replay
canary`` exits by its verdict.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from rich.console import Console
from rich.markup import escape

from replay.core.errors import InputError, KvcanaryError, MissingExtra, RunDirError
from replay.core.exit_codes import ExitCode
from replay.present.formatting import visible

T = TypeVar("T")

console = Console(stderr=True)


# Whether a SIGTERM came (``install_sigterm``): it unwinds as Ctrl-C does, and ``guard`` then
# exits 143 instead of 130. Signals are the process's, so this record is too.
_sigterm = threading.Event()


def install_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C (asyncio cancels the run, ``finally`` blocks stop the
    servers we started), and the command exits 143. During a run the run's own handler
    (``replay.run.signals``) takes it instead: the run drains and writes its summary."""

    def handler(signum: int, frame: Any) -> None:
        _sigterm.set()
        signal.raise_signal(signal.SIGINT)

    _sigterm.clear()
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
        code = ExitCode.SIGTERM if _sigterm.is_set() else ExitCode.INTERRUPTED
        _sigterm.clear()  # it stopped this command, and is told by this exit
    except RunDirError as exc:
        _print_error(exc)
        code = ExitCode.RUN_DIR
    except KvcanaryError as exc:
        _print_error(exc)
        code = ExitCode.TARGET_FAILED
    sys.exit(code)


@contextmanager
def writing(option: str, output: Path, *also: Path) -> Iterator[None]:
    """An output file the user named (``-o``): one that cannot be written (no such folder, a
    read-only one, a full disk) is an error line naming it (exit 2), never a traceback.
    ``also``: the files written on the way to it (a temporary one beside it)."""
    try:
        yield
    except OSError as exc:
        ours = {str(p) for p in (output, *also)}
        if exc.filename is not None and str(exc.filename) not in ours:
            raise  # another file's (the input's): not this guard's to word
        reason = f"{exc.strerror} (errno {exc.errno})" if exc.strerror else str(exc)
        raise InputError(f"{option} {output}: cannot write it: {reason}") from None


def shown(text: object) -> str:
    """Text for a console line: nothing in it acts on the terminal (``visible``: a server's
    or a trace's ESC, BEL or bidi override is shown escaped), and it is text, not rich markup
    ('kvcanary[data]' is an extra, a path may hold brackets)."""
    return escape(visible(str(text)))


def _print_error(exc: Exception, soft_wrap: bool = False) -> None:
    """``error: <message>``, the message ``shown``."""
    console.print(f"[red]error:[/red] {shown(exc)}", soft_wrap=soft_wrap)
