"""The bench's fast fake OpenAI server (``bench/_fast_sse_server.py``) as a test's target, in a
process of its own: on loopback, or inside the target namespace of a ``netns.Hosts``, where
only the workers reach it. Each answer is ``max_tokens`` one-token chunks, the first
``ttft_ms`` after the request arrived and then one every ``itl_ms``, every send stamped on
the machine's monotonic clock (``stamps``: by the request body's ``user``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from tests.support.netns import Hosts

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "bench" / "_fast_sse_server.py"
PORT = 8000  # inside a namespace of its own: nothing else can hold it
READY_S = 30.0


@dataclass
class FastTarget:
    url: str
    hosts: Hosts | None
    proc: subprocess.Popen[bytes]

    def get(self, path: str) -> Any:
        """GET ``path`` where the workers are (no proxy: the address is ours)."""

        def fetch() -> Any:
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
            with opener.open(self.url + path, timeout=10) as resp:
                return orjson.loads(resp.read())

        return fetch() if self.hosts is None else self.hosts.inside(self.hosts.workers[0], fetch)

    def stamps(self, prefix: str) -> tuple[dict[str, Any], float]:
        """Pop the stamps of the finished streams whose id starts with ``prefix``, and the
        server's CPU seconds so far."""
        got = self.get(f"/bench/stamps?prefix={prefix}")
        return got["streams"], float(got["cpu_s"])


@contextmanager
def fast_target(
    log: Path,
    ttft_ms: float = 2.0,
    itl_ms: float = 1.0,
    hosts: Hosts | None = None,
    extra: tuple[str, ...] = (),
) -> Iterator[FastTarget]:
    """The server, started and always stopped; ``hosts``: inside its target namespace."""
    host = hosts.target_addr if hosts is not None else "127.0.0.1"

    def bind() -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((host, PORT if hosts is not None else 0))
        sock.listen(1024)
        return sock

    sock = hosts.inside("target", bind) if hosts is not None else bind()
    url = f"http://{host}:{sock.getsockname()[1]}"
    cmd = [sys.executable, str(SERVER), "--fd", str(sock.fileno())]
    cmd += ["--ttft-ms", str(ttft_ms), "--itl-ms", str(itl_ms), *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("wb") as out:
        try:
            proc = subprocess.Popen(
                hosts.cmd("target", cmd) if hosts is not None else cmd,
                pass_fds=(sock.fileno(),),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        finally:
            sock.close()
        target = FastTarget(url, hosts, proc)
        try:
            _wait_ready(target, log)
            yield target
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def _wait_ready(target: FastTarget, log: Path) -> None:
    deadline = time.monotonic() + READY_S
    while True:
        if target.proc.poll() is not None:
            raise RuntimeError(f"fast server exited: {log.read_text(errors='replace')[-2000:]}")
        try:
            target.get("/v1/models")
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
