"""Shared fixtures. Real vLLM CPU servers are started once per session and always stopped."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TypeVar

import pytest

from replay.serving.local_server import LocalServer
from replay.serving.targets import DEFAULT_MODEL_ARGS, EMULATED_FP8, TargetSpec

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = ROOT.parent / "shared" / "data" / "traces"
ARTIFACTS = ROOT / "tests" / "artifacts"
T = TypeVar("T")


def cpu_can_serve_fp8_kv() -> bool:
    """vLLM CPU's FP8 KV kernels need AVX-512 or AMX (its own check, in cpu_attn.py)."""
    try:
        import torch

        return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())
    except Exception:
        return False


# "emulated" runs the FP8 tests against emulated FP8 on any CPU (to see that half here too).
FP8_MODE_ENV = "KVCANARY_TEST_FP8"


def fp8_emulated() -> bool:
    """The FP8 tests' FP8: served where vLLM CPU can serve an FP8 KV cache, elsewhere a BF16
    server with kvcal's E4M3 round trip at the cache write (kvcal/vllm_plugin.py)."""
    return os.environ.get(FP8_MODE_ENV) == "emulated" or not cpu_can_serve_fp8_kv()


def fp8_flags() -> list[str]:
    """What a replay command line needs for the FP8 tests' FP8 (see fp8_emulated)."""
    return ["--emulate-fp8", "--accept-emulated"] if fp8_emulated() else []


FP8_DTYPE = EMULATED_FP8 if fp8_emulated() else "fp8"


# The servers the session shares. Each takes about 3 GB (API server, engine core, worker with
# its 1 GiB KV cache): held all at once beside a module's own servers they overfill a 24 GB
# machine, which then evicts its page cache and crawls, or kills a server. So each one stops
# after the last test that uses it, and the modules run in an order that keeps few alive.
TWIN_SERVERS = ("twin_server", "twin_fp8_server", "twin_cal_fp8_server")
SHARED_SERVERS = ("bf16_server", "fp8_server", *TWIN_SERVERS)
_running: dict[str, LocalServer] = {}
_last_user: dict[str, str] = {}


def shared_servers_used(item: pytest.Item) -> set[str]:
    """The shared servers a test uses: its fixtures' closure, and those a module asks for at
    run time (``request.getfixturevalue``), which it names in ``uses_servers`` marks."""
    names = set(getattr(item, "fixturenames", ()))
    for mark in item.iter_markers("uses_servers"):
        names.update(mark.args)
    return names & set(SHARED_SERVERS)


def module_rank(items: list[pytest.Item]) -> tuple[int, int]:
    """Where a module runs: tests with no server first; then those that use the twin's shared
    servers, the one that uses the plain twin (``twin_server``) first and the one that uses
    the calibrated twin without it last, so that each twin server lives across few modules;
    then the other users of the shared servers; then the modules that only start servers of
    their own (the real model's among them), once every shared one has stopped."""
    used = set().union(*(shared_servers_used(i) for i in items))
    if used & set(TWIN_SERVERS):
        return 1, ("twin_cal_fp8_server" in used) - ("twin_server" in used)
    if used:
        return 2, 0
    return (3 if any(i.get_closest_marker("vllm") for i in items) else 0), 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules in ``module_rank`` order (each kept whole, in its own order); without vLLM (a
    core-only install), the tests that need its servers skip, saying why."""
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    ranked = sorted(modules.values(), key=module_rank)  # stable: ties keep file order
    items[:] = [item for module in ranked for item in module]
    if importlib.util.find_spec("vllm") is not None:
        return
    skip = pytest.mark.skip(reason="vLLM is not installed (scripts/setup installs it)")
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Each shared server's last user, among the tests that will run (after deselection)."""
    for item in session.items:
        for name in shared_servers_used(item):
            _last_user[name] = item.nodeid


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the shared servers whose last user this test was (their fixtures' own stop, at
    the session's end, then finds them stopped)."""
    for name, nodeid in _last_user.items():
        if nodeid == item.nodeid and name in _running:
            _running.pop(name).stop()


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from replay.testmodel.factory import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def twin_dir() -> Path:
    from replay.testmodel.factory import ensure_twin_model

    return ensure_twin_model()


@pytest.fixture(scope="session")
def twin_overlay(twin_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """kvcal's scales for the twin, from the sample trace (disjoint from the evaluated ones):
    calibrated once, shared by the FP8 story, the emulation check and the interop test."""
    from tests.support.twin_overlay import calibrate_twin

    return calibrate_twin(twin_dir, tmp_path_factory.mktemp("kvcal") / "twin-calibrated")


def _shared(
    request: pytest.FixtureRequest, name: str, dtype: str, model: Path, tmp: Path
) -> Iterator[LocalServer]:
    """A shared server (``SHARED_SERVERS``), stopped after its last user."""
    for server in _serve(name, dtype, model, tmp):
        _running[request.fixturename] = server
        yield server
        _running.pop(request.fixturename, None)


def _serve(name: str, dtype: str, model: Path, tmp: Path) -> Iterator[LocalServer]:
    spec = TargetSpec(
        name=name,
        model=str(model),
        kv_cache_dtype=dtype,
        args=DEFAULT_MODEL_ARGS,
        expect_cache_dtype=dtype,
    )
    server = LocalServer(spec, tmp / f"{name}.log")
    server.start()
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def bf16_server(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[LocalServer]:
    yield from _shared(request, "bf16", "auto", model_dir, tmp_path_factory.mktemp("servers"))


@pytest.fixture(scope="session")
def fp8_server(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[LocalServer]:
    """Served FP8, or emulated where this CPU cannot serve it (fp8_emulated)."""
    yield from _shared(request, "fp8", FP8_DTYPE, model_dir, tmp_path_factory.mktemp("servers"))


# The outlier twin's servers, shared like the original's: the FP8 story (test_testmodel_vllm),
# the emulation check (test_fp8_emulation_vllm) and any other test of the twin use these.
@pytest.fixture(scope="session")
def twin_server(
    twin_dir: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[LocalServer]:
    yield from _shared(request, "twin", "auto", twin_dir, tmp_path_factory.mktemp("servers"))


@pytest.fixture(scope="session")
def twin_fp8_server(
    twin_dir: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[LocalServer]:
    """The twin with an FP8 cache at scale 1.0 (emulated where fp8_emulated)."""
    tmp = tmp_path_factory.mktemp("servers")
    yield from _shared(request, "twin-fp8", FP8_DTYPE, twin_dir, tmp)


@pytest.fixture(scope="session")
def twin_cal_fp8_server(
    twin_overlay: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[LocalServer]:
    """The twin's kvcal overlay with an FP8 cache: its calibrated scales applied."""
    tmp = tmp_path_factory.mktemp("servers")
    yield from _shared(request, "twin-cal-fp8", FP8_DTYPE, twin_overlay, tmp)


def url_target(name: str, server: LocalServer, role: str | None = None) -> list[str]:
    """A targets-file table naming a running server by URL, expecting the cache dtype it was
    started with (so an emulated FP8 server is declared emulated)."""
    return [
        f"[targets.{name}]",
        f"url = {json.dumps(server.url)}",
        f"expect_cache_dtype = {json.dumps(server.spec.expect_cache_dtype)}",
        *([f"role = {json.dumps(role)}"] if role else []),
        "",
    ]


def url_targets(path: Path, servers: Mapping[str, LocalServer]) -> Path:
    """A targets file (for --targets-file) of running servers by the names the test gives."""
    path.write_text("\n".join(line for n, s in servers.items() for line in url_target(n, s)))
    return path


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    # Loopback traffic must never go through a proxy the environment may define.
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def within(seconds: float, fn: Callable[[], T]) -> T:
    """``fn()``, or a test failure when it has not returned after ``seconds``."""
    out: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"still running after {seconds} s"
    if errors:
        raise errors[0]
    return out[0]
