"""The local vLLM servers we start for a target: command line, environment, health, stop.

A local server runs in its own process group on a free loopback port, logs into the run
directory, and is always stopped: on success, on errors, on Ctrl-C and SIGTERM (the CLI turns
SIGTERM into an exception) and, through PR_SET_PDEATHSIG, even when this tool is killed. A
server that dies while starting is a ``ServerStartError`` naming the root cause its log states.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from replay.core.errors import ConfigError, ServerStartError
from replay.serving.kv_layout import SLIDING_WINDOW, KvLayout
from replay.serving.prompt_scores import CACHED_SCORING_ARGS
from replay.serving.targets import TargetSpec

DEFAULT_KV_CACHE_GIB = "1"  # VLLM_CPU_KVCACHE_SPACE when the user sets none
# vLLM 0.32 on CPU saves its ahead-of-time compiled model and fails to load it at the next
# start ("Compiling model again due to a load failure ... 'function' object has no attribute
# 'finalize_loading'"), so every start compiled again: 10-70 s on two cores. Without AOT it
# loads inductor's cached graphs: a second start of the same model inits in about 8 s instead.
# A user's own setting wins.
COMPILE_ENV = {"VLLM_USE_AOT_COMPILE": "0"}
# vLLM CPU takes VLLM_CPU_KVCACHE_SPACE over this flag (platforms/cpu.py, "legacy setting"):
# a server given the flag is started without the variable, so the flag is what it gets.
KV_CACHE_BYTES_FLAG = "--kv-cache-memory-bytes"
# An emulated target's server (kvcal/vllm_plugin.py): these names are the plugin's contract
# (the line it logs when active is targets.EMULATION_MARKER).
EMULATION_ENV = "KVCANARY_KV_EMULATION"  # the format: fp8, fp8_e5m2, int8_per_token_head ...
EMULATION_ROUNDING_ENV = "KVCANARY_KV_EMULATION_ROUNDING"  # cpu or cuda; unset: the engine's
EMULATION_SKIP_ENV = "KVCANARY_KV_EMULATION_SKIP_LAYERS"
SKIP_LAYERS_FLAG = "--kv-cache-dtype-skip-layers"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    os.setsid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


# "(Worker pid=1) ERROR 11-30 12:14:12 [file.py:10] NotImplementedError: ..." or a bare
# traceback line; warnings that merely mention an error type do not count.
_LOG_PREFIX = re.compile(r"^(\(\w+ pid=\d+\)\s+)?(ERROR\s+\S+\s+\S+\s+\[[^\]]+\]\s+)?")
_ERROR_LINE = re.compile(r"^([A-Za-z_][A-Za-z_.]*(?:Error|Exception)): (.+)$")


def failure_reason(log_text: str) -> str:
    """The root cause a vLLM log states: the first 'XError: message' line of a traceback."""
    for line in log_text.splitlines():
        m = _ERROR_LINE.match(_LOG_PREFIX.sub("", line.strip(), count=1))
        if m and "Engine core initialization failed" not in m.group(2):
            return f"{m.group(1)}: {m.group(2).strip()}"
    tail = [ln for ln in log_text.splitlines() if ln.strip()][-3:]
    return " | ".join(tail)[-500:] or "the server exited without output"


def unquantized_cache_dtype(model_dir: Path) -> str:
    """The --kv-cache-dtype that stores K/V unquantized. 'auto', except for a checkpoint that
    declares a ``kv_cache_scheme`` (a kvcal overlay): vLLM serves FP8 for those under 'auto'
    (seen on vLLM CPU 0.32: twice the cache tokens), so the model's own dtype is named."""
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "auto"
    if not isinstance(config, dict) or not (config.get("quantization_config") or {}).get(
        "kv_cache_scheme"
    ):
        return "auto"
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return dtype if dtype in ("bfloat16", "float16") else "bfloat16"


class LocalServer:
    """A vLLM OpenAI server for one TargetSpec. Use as a context manager."""

    def __init__(
        self,
        spec: TargetSpec,
        log_path: Path,
        *,
        host: str = "127.0.0.1",
        startup_timeout_s: float = 900.0,
    ) -> None:
        if spec.model is None:
            raise ValueError("LocalServer needs a spec with a model")
        self.spec = spec
        self.log_path = log_path
        self.host = host
        self.port = free_port()
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        assert self.spec.model is not None
        args, _ = self._emulation()
        dtype = (
            unquantized_cache_dtype(Path(self.spec.model))
            if self.spec.emulated
            else self.spec.kv_cache_dtype
        )
        return [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.spec.model,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--kv-cache-dtype",
            dtype,
            "--seed",
            "0",
            # Teacher-forced scores that may read the prefix cache (serving/prompt_scores.py).
            *CACHED_SCORING_ARGS,
            *args,
        ]

    def _emulation(self) -> tuple[list[str], dict[str, str]]:
        """The server's arguments and the plugin's environment. An emulated target's
        --kv-cache-dtype-skip-layers goes to the plugin: a BF16 cache skips nothing."""
        args = list(self.spec.args)
        fmt = self.spec.emulated_format
        if fmt is None:
            return args, {}
        env = {EMULATION_ENV: fmt}
        if self.spec.rounding:
            env[EMULATION_ROUNDING_ENV] = self.spec.rounding
        if SKIP_LAYERS_FLAG in args:
            i = args.index(SKIP_LAYERS_FLAG)
            j = i + 1
            while j < len(args) and not args[j].startswith("-"):
                j += 1
            env[EMULATION_SKIP_ENV] = self._skip_indices(args[i + 1 : j])
            del args[i:j]
        return args, env

    def _skip_indices(self, words: list[str]) -> str:
        """The plugin takes layer indices (``0,3``): vLLM's ``sliding_window`` is resolved
        to the model's sliding-window layers, read off its config.json."""
        parts = [p for w in words for p in w.split(",") if p]
        if SLIDING_WINDOW not in parts:
            return ",".join(parts)
        layout = KvLayout.of_model(self.spec.model)
        if layout is None:
            raise ConfigError(
                f"target '{self.spec.name}': {SKIP_LAYERS_FLAG} {SLIDING_WINDOW} needs the "
                f"model's layer types, and {self.spec.model} has no readable config.json: "
                "name layer indices instead"
            )
        return ",".join(map(str, layout.skip_indices(parts)))

    def environment(self) -> dict[str, str]:
        """The server's environment: this process's, the defaults above where it sets none,
        the spec's own, and the emulation's."""
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", DEFAULT_KV_CACHE_GIB)
        for name, value in COMPILE_ENV.items():
            env.setdefault(name, value)
        env.update(self.spec.env)
        if KV_CACHE_BYTES_FLAG in self.spec.args:
            env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        env.update(self._emulation()[1])
        return env

    def start(self) -> None:
        env = self.environment()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"$ {' '.join(self.command())}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                preexec_fn=_die_with_parent,
            )

    def wait_healthy(self, progress: Any = None) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(
                    self.spec.name, failure_reason(self.log_text()), str(self.log_path)
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if progress is not None:
                progress()
            time.sleep(0.5)
        raise ServerStartError(
            self.spec.name, f"not healthy within {self.startup_timeout_s:g} s", str(self.log_path)
        )

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def stop(self, grace_s: float = 20.0) -> None:
        """Stop the whole process group: SIGTERM, then SIGKILL after ``grace_s``."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
                # The group may outlive its leader (engine workers); make sure it is gone.
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
            break

    def __enter__(self) -> LocalServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
