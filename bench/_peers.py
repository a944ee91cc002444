"""Peer load generators (GuideLLM, AIPerf) for ``client_overhead.py``: each installed from PyPI,
at a pinned version, into a virtual environment of its own outside the project's
(``$KVCANARY_CACHE/bench-peers/<name>-<version>``, default ``~/.cache/kvcanary``), reused
when present. A peer that depends on torch gets the CPU build (``torch==2.13.0`` through a
constraints file), never a CUDA one. An install that fails (no network, no such version)
is reported as ``not installed: why``, not raised: the bench runs without that peer.

    python bench/_peers.py install        # install (or find) every peer; prints where

``measure`` runs each against ``client_overhead.py``'s server with its workload (S streams,
``waves x S`` requests of ``--tokens`` tokens, a 64-token prompt), in a process of its own
pinned like the other clients: CPU per token is that process's CPU (its children's included;
start-up, imports and prompt generation too, which the in-process clients do not count) over
the tokens the server sent it; TTFT error is its TTFT minus the server's, per request. The
peers send no request id the server can read (GuideLLM: neither the ``user`` field nor
``x-request-id``), so the server names their streams ``anon-N`` and puts that name in each
answer's ``id`` (``cmpl-anon-N``), which GuideLLM records per request as ``response_id``:
that is the match. AIPerf sends an ``X-Request-ID`` header, which names the server's stream
and is in AIPerf's per-request records (``profile_export.jsonl``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import venv
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import orjson

PEERS = {"guidellm": "0.8.1", "aiperf": "0.13.0"}
CPU_TORCH = "torch==2.13.0"  # the local CPU wheel; a peer must never pull a CUDA torch
INSTALL_TIMEOUT_S = 1800.0
RUN_TIMEOUT_S = 600.0  # generous: their start-up (torch, transformers) is slow on a busy machine


@dataclass(frozen=True)
class Peer:
    """A peer's venv: ``python`` and its console scripts under ``bin``, or why it has none."""

    name: str
    version: str
    home: Path
    missing: str | None = None  # "not installed: ..." when it could not be installed

    @property
    def bin(self) -> Path:
        return self.home / "bin"

    @property
    def ready_marker(self) -> Path:
        return self.home / ".kvcanary-installed"


class RunTimed(Protocol):
    def __call__(
        self, cmd: list[str], pin: bool, server: Any, timeout_s: float = ...
    ) -> dict[str, Any]: ...


def cache_root() -> Path:
    base = os.environ.get("KVCANARY_CACHE") or str(Path.home() / ".cache" / "kvcanary")
    return Path(base) / "bench-peers"


def ensure(name: str, version: str | None = None) -> Peer:
    """The peer's venv, installed on first use; ``missing`` says why when it cannot be."""
    version = version or PEERS[name]
    peer = Peer(name, version, cache_root() / f"{name}-{version}")
    if peer.ready_marker.exists():
        return peer
    try:
        _install(peer)
    except (OSError, subprocess.SubprocessError) as exc:
        why = str(exc).strip().splitlines()[-1:] or [type(exc).__name__]
        return Peer(name, version, peer.home, f"not installed: {why[0][:300]}")
    return peer


def _install(peer: Peer) -> None:
    peer.home.parent.mkdir(parents=True, exist_ok=True)
    venv.create(peer.home, with_pip=True, clear=True)
    constraints = peer.home / "constraints.txt"
    constraints.write_text(CPU_TORCH + "\n")
    cmd = [str(peer.bin / "python"), "-m", "pip", "install", "--quiet", "-c", str(constraints)]
    done = subprocess.run(
        [*cmd, f"{peer.name}=={peer.version}"],
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()
        raise subprocess.SubprocessError(
            f"pip install {peer.name}=={peer.version} exited {done.returncode}: "
            + (tail[-1] if tail else "no output")
        )
    peer.ready_marker.write_text(f"{peer.name}=={peer.version}\n")


def guidellm_scenario(url: str, streams: int, requests: int, tokens: int, tok: Path) -> Any:
    """A GuideLLM 0.8 scenario: ``streams`` concurrent, ``requests`` in all, synthetic prompts
    of 64 tokens (the test model's tokenizer), ``tokens`` out, JSON output."""
    return {
        "metadata": {"name": "kvcanary-client-overhead", "description": "client overhead"},
        "spec": {
            "backend": {"kind": "openai_http", "target": url, "request_format": "/v1/completions"},
            "profile": {"kind": "concurrent", "streams": streams},
            "tokenizer": {"kind": "huggingface_auto", "model": str(tok)},
            "data": [{"kind": "synthetic_text", "prompt_tokens": 64, "output_tokens": tokens}],
            "constraints": [{"kind": "max_requests", "count": requests}],
            "outputs": [{"kind": "json", "path": "OUT"}],
        },
    }


def guidellm_requests(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per successful request: the server's stream name (from ``response_id``) and its TTFT."""
    out = []
    for bench in report["benchmarks"]:
        for r in bench["requests"]["successful"]:
            rid = r.get("response_id") or ""
            if rid.startswith("cmpl-") and r.get("time_to_first_token_ms") is not None:
                out.append({"id": rid[5:], "ttft_s": r["time_to_first_token_ms"] / 1e3})
    return out


def run_guidellm(
    peer: Peer, server: Any, opts: Any, streams: int, tok: Path, run_timed: RunTimed
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="guidellm-") as tmp:
        result = Path(tmp) / "out.json"
        scenario = guidellm_scenario(server.url, streams, opts.waves * streams, opts.tokens, tok)
        scenario["spec"]["outputs"][0]["path"] = str(result)
        (Path(tmp) / "scenario.json").write_bytes(orjson.dumps(scenario))
        cmd = [str(peer.bin / "guidellm"), "run", "-c", str(Path(tmp) / "scenario.json")]
        run = run_timed([*cmd, "--disable-console-interactive"], opts.pin, server, RUN_TIMEOUT_S)
        stamps, _ = server.stamps("anon-")
        if run["returncode"] != 0 or not result.exists():
            return {"did_not_run": f"exit {run['returncode']}", **run}
        reqs = guidellm_requests(orjson.loads(result.read_bytes()))
    del run["output_tail"]
    return {**run, **ttft_against_stamps(reqs, stamps)}


def ttft_against_stamps(reqs: list[dict[str, Any]], stamps: dict[str, Any]) -> dict[str, Any]:
    """TTFT error per matched request (client TTFT - server TTFT) and tokens the server sent."""
    errors = [
        r["ttft_s"] - (stamps[r["id"]]["sends"][0] - stamps[r["id"]]["recv"])
        for r in reqs
        if r["id"] in stamps and stamps[r["id"]]["sends"]
    ]
    ms = np.asarray(errors) * 1e3
    return {
        "requests_reported": len(reqs),
        "requests_matched": len(errors),
        "server_streams": len(stamps),
        "tokens": sum(len(s["sends"]) for s in stamps.values()),
        "ttft_error_mean_ms": float(ms.mean()) if ms.size else None,
        "ttft_error_p99_ms": float(np.percentile(ms, 99)) if ms.size else None,
    }


def aiperf_cmd(
    peer: Peer, url: str, streams: int, requests: int, tokens: int, tok: Path
) -> list[str]:
    return [
        str(peer.bin / "aiperf"),
        "profile",
        *("--model", "bench", "--url", url, "--endpoint-type", "completions", "--streaming"),
        *("--concurrency", str(streams), "--request-count", str(requests)),
        *("--synthetic-input-tokens-mean", "64", "--output-tokens-mean", str(tokens)),
        *("--extra-inputs", "ignore_eos:true", "--ui-type", "none", "--export-level", "records"),
        # a trailing slash: without it AIPerf 0.13 takes the folder for a Hub repo id
        *("--tokenizer", f"{tok}/"),
    ]


def aiperf_requests(records: Path) -> list[dict[str, Any]]:
    """Per profiled request: its ``X-Request-ID`` (the server's stream name) and TTFT."""
    out = []
    for line in records.read_bytes().splitlines():
        rec = orjson.loads(line)
        ttft = (rec.get("metrics") or {}).get("time_to_first_token")
        rid = (rec.get("metadata") or {}).get("x_request_id")
        if rid and ttft:
            out.append({"id": rid, "ttft_s": ttft["value"] / 1e3})
    return out


def run_aiperf(
    peer: Peer, server: Any, opts: Any, streams: int, tok: Path, run_timed: RunTimed
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="aiperf-") as tmp:
        cmd = aiperf_cmd(peer, server.url, streams, opts.waves * streams, opts.tokens, tok)
        run = run_timed([*cmd, "--artifact-dir", tmp], opts.pin, server, RUN_TIMEOUT_S)
        stamps, _ = server.stamps("")  # its ids are UUIDs; every earlier stamp was popped
        records = Path(tmp) / "profile_export.jsonl"
        if run["returncode"] != 0 or not records.exists():
            return {"did_not_run": f"exit {run['returncode']}", **run}
        reqs = aiperf_requests(records)
    del run["output_tail"]
    return {**run, **ttft_against_stamps(reqs, stamps)}


RUNNERS = {"guidellm": run_guidellm, "aiperf": run_aiperf}


def measure(
    server: Any, opts: Any, streams: int, tok: Path, run_timed: RunTimed
) -> dict[str, dict[str, Any]]:
    """Every peer at ``streams``: its figures, or ``did_not_run`` saying why. ``run_timed`` is
    ``client_overhead.py``'s: it runs a peer's command and measures its CPU and the server's."""
    out: dict[str, dict[str, Any]] = {}
    for name in PEERS:
        peer = ensure(name)
        runner = RUNNERS.get(name)
        if peer.missing is not None:
            out[name] = {"did_not_run": peer.missing}
        elif runner is None:
            out[name] = {"did_not_run": f"installed ({peer.home}); no runner for it yet"}
        else:
            res = runner(peer, server, opts, streams, tok, run_timed)
            tokens = res.get("tokens")
            if tokens:
                res["cpu_us_per_token"] = res["process_cpu_s"] / tokens * 1e6
            out[name] = {"version": peer.version, **res}
    return out


def main() -> None:
    if sys.argv[1:] != ["install"]:
        raise SystemExit(__doc__)
    for name in PEERS:
        peer = ensure(name)
        print(f"{name} {peer.version}: {peer.missing or peer.home}")


if __name__ == "__main__":
    main()
