"""The local vLLM servers a run starts: made by the composition root's factory
(``local_servers``), launched and waited for until healthy (or until the run is interrupted),
and stopped, with what their logs tell the manifest."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from replay.serving.local_server import LocalServer
from replay.serving.scale_log import scale_lines
from replay.serving.targets import TargetSpec

# A local target's server, logging to the given file (not started yet).
ServerFactory = Callable[[TargetSpec, Path], LocalServer]


def local_servers(startup_timeout_s: float) -> ServerFactory:
    """vLLM CPU servers that get ``startup_timeout_s`` to become healthy."""

    def make(spec: TargetSpec, log_path: Path) -> LocalServer:
        return LocalServer(spec, log_path, startup_timeout_s=startup_timeout_s)

    return make


async def launch(
    server: LocalServer,
    info: dict[str, Any],
    save_manifest: Callable[[], None],
    stopping: asyncio.Event,
) -> bool:
    """Start the server and wait until it is healthy; False when the run is interrupted
    meanwhile. The caller stops the server either way; ServerStartError when it died."""
    server.start()
    assert server.proc is not None
    info["server"] = {"pid": server.proc.pid, "url": server.url, "command": server.command()}
    save_manifest()
    return await _healthy_or_stopped(server, stopping)


async def stop(server: LocalServer, info: dict[str, Any]) -> None:
    await asyncio.get_running_loop().run_in_executor(None, server.stop)
    if "scale_log_lines" in info:
        # again at the end: some lines (the FP8 emulation's scales per layer) come only with
        # the first cache write
        info["scale_log_lines"] = scale_lines(server.log_text())


async def _healthy_or_stopped(server: LocalServer, stopping: asyncio.Event) -> bool:
    health: asyncio.Future[None] = asyncio.get_running_loop().run_in_executor(
        None, server.wait_healthy
    )
    stop_wait: asyncio.Future[Any] = asyncio.ensure_future(stopping.wait())
    await asyncio.wait([health, stop_wait], return_when=asyncio.FIRST_COMPLETED)
    stop_wait.cancel()
    if health.done():
        health.result()  # raises ServerStartError when the server died
        return True
    # The polling thread ends by itself once the server is stopped.
    health.add_done_callback(lambda f: f.exception())
    return False
