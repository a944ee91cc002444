"""An aiohttp connector whose connections note when bytes last came off the socket.

A chunk's arrival is when the transport handed its bytes to aiohttp (``data_received``, in the
event loop's I/O phase), not when the task that reads the stream next runs: under load the loop
first takes in every ready socket, then runs every ready task, so a stamp taken by the reading
task also counts the work of every task that runs before it in that loop iteration.

It relies on one private detail of aiohttp, the connector's protocol factory (``_factory``);
where that changes, ``arrival_clock`` finds no stamping protocol and the client stamps at the
read, as before.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any, cast

import aiohttp
from aiohttp.client_proto import ResponseHandler


class StampingHandler(ResponseHandler):
    """aiohttp's response protocol, plus ``received_at``: the client clock's reading when
    the last non-empty read from the socket arrived."""

    def __init__(self, loop: asyncio.AbstractEventLoop, now: Callable[[], float]) -> None:
        super().__init__(loop)
        self._now = now
        self.received_at = 0.0

    def data_received(self, data: bytes) -> None:
        # aiohttp calls this with b"" to resume parsing what it already holds: no arrival.
        if data:
            self.received_at = self._now()
        super().data_received(data)


class StampingConnector(aiohttp.TCPConnector):
    """``aiohttp.TCPConnector`` whose connections are ``StampingHandler``s."""

    def __init__(self, now: Callable[[], float], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        factory = functools.partial(StampingHandler, loop=self._loop, now=now)
        self._factory = cast("functools.partial[ResponseHandler]", factory)


def arrival_clock(resp: aiohttp.ClientResponse) -> StampingHandler | None:
    """The stamping protocol a response streams over, if it has one."""
    conn = resp.connection
    proto = conn.protocol if conn is not None else None
    return proto if isinstance(proto, StampingHandler) else None
