"""Ctrl-C and SIGTERM during a run: they call the driver's handler on the running loop (which
stops sending and drains) with the signal (the CLI exits 130 after Ctrl-C, 143 after SIGTERM),
and the CLI's own handlers are back afterwards."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def interrupts(handler: Callable[[int], None]) -> Iterator[None]:
    """SIGINT and SIGTERM call ``handler(signal)`` on the running loop while the run lasts;
    then the handlers that were there before (the CLI's) are back, not the defaults asyncio
    leaves."""
    loop = asyncio.get_running_loop()
    sigs = (signal.SIGINT, signal.SIGTERM)
    before = {sig: signal.getsignal(sig) for sig in sigs}
    for sig in sigs:
        loop.add_signal_handler(sig, handler, sig)
    try:
        yield
    finally:
        for sig in sigs:
            loop.remove_signal_handler(sig)
            if before[sig] is not None:
                signal.signal(sig, before[sig])
