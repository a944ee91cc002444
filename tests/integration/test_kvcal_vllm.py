"""kvcal against real vLLM CPU servers: the overlay checkpoint loads and links the original
weights; prompts render as the server renders them; `kvcal verify` reports what an FP8 server
does with the scales: applied where FP8 can be served, vLLM's refusal where it cannot, and
per-head scales as unsupported on the CPU backend."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from click.testing import CliRunner

pytest.importorskip("torch", reason="kvcal needs torch (installed with vLLM)")
if importlib.util.find_spec("vllm") is None:  # found, not imported: the servers import it
    pytest.skip("vLLM is not installed: these tests start vLLM servers", allow_module_level=True)

from kvcal._backend import per_head_backend_support
from kvcal._calibrate import Recipe, calibrate
from kvcal._sample import PromptRenderer, Sample, draw, read_samples
from kvcal._verify import split_for_scoring
from kvcal.cli import main as kvcal_main
from replay.core.buckets import Buckets
from replay.run.teacher import TFScore, score_tokens
from replay.serving.introspect import introspect
from replay.serving.local_server import LocalServer
from replay.serving.targets import DEFAULT_MODEL_ARGS, TargetSpec
from replay.traces.trace import Request
from tests.conftest import cpu_can_serve_fp8_kv, fp8_emulated
from tests.unit.kvcal.test_kvcal import _requests, build_test_model

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_test_model(tmp_path_factory)


def _renderer(model_dir: Path) -> PromptRenderer:
    from transformers import AutoTokenizer

    return PromptRenderer(AutoTokenizer.from_pretrained(str(model_dir)))


def _calibrate(model_dir: Path, out: Path, strategy: str) -> Path:
    split = draw(_requests(), _renderer(model_dir), Buckets.parse("128,512"), 1, seed=0)
    calibrate(model_dir, split.calibration, out, Recipe(strategy=strategy), 0, {})
    return out


@pytest.fixture(scope="module")
def calibrated(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _calibrate(model_dir, tmp_path_factory.mktemp("kvcal") / "tensor", "tensor")


async def _scores(url: str, samples: list[Sample]) -> tuple[dict[str, Any], list[TFScore]]:
    async with aiohttp.ClientSession() as session:
        info = await introspect(session, url)
        out = []
        for s in samples:
            prompt, rest = split_for_scoring(s.input_ids)
            out.append(await score_tokens(session, url, info["model_id"], prompt, rest))
        return info, out


@pytest.fixture(scope="module")
def original_server(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalServer]:
    spec = TargetSpec(
        name="original", model=str(model_dir), kv_cache_dtype="auto", args=DEFAULT_MODEL_ARGS
    )
    with LocalServer(spec, tmp_path_factory.mktemp("servers") / "original.log") as server:
        server.wait_healthy()
        yield server


def test_overlay_loads_in_vllm_and_answers_like_the_original(
    calibrated: Path, original_server: LocalServer, tmp_path: Path
) -> None:
    """The overlay's config, scale shard and linked weights load; with a BF16 cache the
    scales are unused, so every score equals the original model's, token for token."""
    # With kv_cache_dtype 'auto' vLLM would turn the checkpoint's kv_cache_scheme into an FP8
    # cache (refused on CPUs without AVX-512/AMX); an explicit bfloat16 keeps BF16.
    spec = TargetSpec(
        name="overlay", model=str(calibrated), kv_cache_dtype="bfloat16", args=DEFAULT_MODEL_ARGS
    )
    samples = read_samples(calibrated / "samples.jsonl")
    with LocalServer(spec, tmp_path / "overlay.log") as server:
        server.wait_healthy()
        info, got = asyncio.run(_scores(server.url, samples))
        log = server.log_text()
    _, want = asyncio.run(_scores(original_server.url, samples))
    assert "quantization=compressed-tensors" in log  # the overlay's config was read
    assert info["cache_config"]["cache_dtype"] == "bfloat16"
    assert all(s.error is None and s.n > 0 for s in got)
    assert [s.nll for s in got] == [s.nll for s in want]
    assert [s.top1 for s in got] == [s.top1 for s in want]


def test_prompts_render_as_the_server_renders_them(
    model_dir: Path, original_server: LocalServer
) -> None:
    renderer = _renderer(model_dir)

    async def server_ids(session: aiohttp.ClientSession, req: Request) -> list[int]:
        body: dict[str, Any] = {"model": str(model_dir)}
        if req.api == "chat":
            body.update(messages=list(req.messages or ()), add_generation_prompt=True)
            if req.tools:
                body["tools"] = list(req.tools)
        else:
            body["prompt"] = req.prompt
        async with session.post(original_server.url + "/tokenize", json=body) as r:
            assert r.status == 200, await r.text()
            return list((await r.json())["tokens"])

    async def check() -> int:
        checked = 0
        async with aiohttp.ClientSession() as session:
            for req in _requests():
                if req.synth is not None or isinstance(req.prompt, tuple):
                    continue
                assert renderer.render(req)[0] == await server_ids(session, req), req.id
                checked += 1
        return checked

    assert asyncio.run(check()) >= 20


def _verify(overlay: Path, log_dir: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    res = CliRunner().invoke(
        kvcal_main, ["verify", str(overlay), "--sequences", "2", "--log-dir", str(log_dir), *extra]
    )
    return res.exit_code, json.loads((log_dir / "verify.json").read_text())


def test_verify_reports_vllms_refusal_of_fp8(calibrated: Path, tmp_path: Path) -> None:
    if cpu_can_serve_fp8_kv():
        pytest.skip("this CPU can serve an FP8 KV cache: see test_verify_scales_applied")
    code, result = _verify(calibrated, tmp_path)
    assert code == 3 and result["status"] == "unsupported"
    cal = result["servers"][0]
    assert not cal["started"]
    assert "FP8 KV cache on CPU requires x86 with AVX-512 or AMX" in cal["refused"]
    assert "AVX-512 or AMX" in result["reasons"][-1]


@pytest.mark.fp8
def test_verify_scales_applied(calibrated: Path, tmp_path: Path) -> None:
    """On served FP8, or on emulated FP8 (kvcal's plugin) where this CPU cannot serve it."""
    emulated = fp8_emulated()
    code, result = _verify(calibrated, tmp_path, *(["--emulate-fp8"] if emulated else []))
    assert code == 0 and result["status"] == "applied", result["reasons"]
    cal, base = result["servers"]
    if emulated:
        assert cal["cache_dtype"] in ("auto", "bfloat16")
        assert cal["emulated"] and cal["emulation_active"]
        # the plugin rounds each layer's K at the checkpoint's scale, and the original's at 1.0
        assert any("k_scale" in ln and "(checkpoint)" in ln for ln in cal["log_lines"])
        assert any("k_scale 1 v_scale 1 (default)" in ln for ln in base["log_lines"])
    else:
        assert cal["cache_dtype"].startswith("fp8")
    assert cal["scales"] == "checkpoint" and cal["runs_at_scale_one"] is False
    assert cal["quantization"] == "compressed-tensors" and not cal["scale_one_warning"]
    # The original runs at scale 1.0, and vLLM CPU 0.32 says so only through its engine line
    # (quantization=None); it logs no "Using KV cache scaling factor 1.0" for such a model.
    assert base["scales"] == "default-1.0-no-quantization-config", base
    assert base["runs_at_scale_one"] is True and base["quantization"] is None
    assert result["teacher_forced"]["differing_positions"] > 0


def test_per_head_checkpoint_is_reported_unsupported(model_dir: Path, tmp_path: Path) -> None:
    supported, why = per_head_backend_support()
    if supported:
        pytest.skip(f"per-head scales are supported here: {why}")
    overlay = _calibrate(model_dir, tmp_path / "per-head", "attn_head")
    code, result = _verify(overlay, tmp_path / "verify")
    assert code == 3 and result["status"] == "unsupported"
    assert result["reasons"][0].startswith("per-head (attn_head) scales:")
    assert "does not support per-head scales" in result["reasons"][0]
