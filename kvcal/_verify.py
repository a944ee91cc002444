"""Did the serving engine apply the calibrated scales? Asked of the engine itself.

Three kinds of evidence, each recorded: the served ``cache_dtype`` (``/metrics``), the
server log (the engine line's ``quantization=compressed-tensors`` means the checkpoint's
scales went through a quantization method; ``quantization=None``, or vLLM's "Using KV cache
scaling factor 1.0" warning, means the server runs at scale 1.0: see
``replay.serving.scale_log``), and teacher-forced scores of the same token sequences
under the calibrated FP8 server and a scale-1.0 FP8 server of the original model: scales
that were applied change the dequantized K/V and so the scores. A server that refuses to
start (no FP8 KV kernels on this CPU, per-head scales on a backend without them) is a result,
``unsupported``, with vLLM's own reason, never a crash.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from replay.core.errors import ServerStartError
from replay.run.teacher import TFScore, score_tokens
from replay.serving.endpoints import api_session
from replay.serving.introspect import introspect
from replay.serving.local_server import LocalServer
from replay.serving.scale_log import EMULATED_FP8, UNKNOWN, scale_evidence, scale_lines
from replay.serving.targets import (
    DEFAULT_MODEL_ARGS,
    EMULATION_MARKER,
    TargetSpec,
    cache_dtype_matches,
)

from ._sample import Sample

APPLIED, NOT_APPLIED, UNSUPPORTED = "applied", "not_applied", "unsupported"
EXIT_CODES = {APPLIED: 0, NOT_APPLIED: 1, UNSUPPORTED: 3}


@dataclass
class ServerCheck:
    """One FP8 server: how it came up and what it says it runs."""

    role: str  # "calibrated" or "scale-1.0"
    model: str
    # FP8 emulated in a BF16 server (kvcal/vllm_plugin.py) rather than served
    emulated: bool = False
    url: str | None = None
    started: bool = False
    refused: str | None = None
    cache_dtype: str | None = None
    quantization: str | None = None
    scale_one_warning: bool = False
    # What the log says the server runs with (replay.serving.scale_log): "checkpoint", one of the
    # two "default-1.0-..." sources, or "unknown" (a server reached by URL has no log here).
    scales: str = UNKNOWN
    runs_at_scale_one: bool | None = None
    emulation_active: bool = False
    log_lines: list[str] = field(default_factory=list)
    log: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Verification:
    status: str
    reasons: list[str]
    servers: list[ServerCheck]
    teacher_forced: dict[str, Any] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.status]

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "exit_code": self.exit_code,
            "reasons": self.reasons,
            "servers": [s.to_json() for s in self.servers],
            "teacher_forced": self.teacher_forced,
        }


def _from_log(check: ServerCheck, log_text: str) -> None:
    check.log_lines = scale_lines(log_text)
    check.emulation_active = EMULATION_MARKER in log_text
    ev = scale_evidence(log_text)
    check.scale_one_warning = ev.warning
    check.scales, check.runs_at_scale_one = ev.source, ev.runs_at_scale_one
    check.quantization = ev.quantization


def split_for_scoring(ids: Sequence[int]) -> tuple[list[int], list[int]]:
    """First half as the prompt, second half scored: every scored position reads K/V of
    earlier tokens back from the (FP8) cache."""
    half = max(1, len(ids) // 2)
    return list(ids[:half]), list(ids[half:])


async def _scores(url: str, samples: Sequence[Sample], salt: str) -> list[TFScore]:
    async with api_session() as session:
        info = await introspect(session, url)
        model = info.get("model_id") or ""
        out = []
        for s in samples:
            prompt, rest = split_for_scoring(s.input_ids)
            out.append(await score_tokens(session, url, model, prompt, rest, salt=salt))
        return out


async def _cache_dtype(url: str) -> str | None:
    async with api_session() as session:
        info = await introspect(session, url)
    return (info.get("cache_config") or {}).get("cache_dtype")


def compare_scores(cal: Sequence[TFScore], base: Sequence[TFScore]) -> dict[str, Any]:
    """How far the calibrated server's scores are from the scale-1.0 server's."""
    deltas: list[float] = []
    differing = errors = 0
    for a, b in zip(cal, base, strict=True):
        if a.error or b.error or a.n != b.n:
            errors += 1
            continue
        for x, y in zip(a.nll, b.nll, strict=True):
            deltas.append(abs(x - y))
            differing += abs(x - y) > 1e-6
    return {
        "sequences": len(cal),
        "errors": errors,
        "positions": len(deltas),
        "differing_positions": differing,
        "mean_abs_nll_delta": statistics.fmean(deltas) if deltas else None,
        "max_abs_nll_delta": max(deltas) if deltas else None,
        "mean_nll_calibrated": _mean_nll(cal),
        "mean_nll_scale_1": _mean_nll(base),
    }


def _mean_nll(scores: Sequence[TFScore]) -> float | None:
    values = [x for s in scores if not s.error for x in s.nll]
    return statistics.fmean(values) if values else None


class _Server:
    """A server we start (and stop), or one the user points at."""

    def __init__(self, check: ServerCheck, url: str | None, log_dir: Path) -> None:
        self.check, self.local = check, None
        if url is None:
            dtype = EMULATED_FP8 if check.emulated else "fp8"
            spec = TargetSpec(
                name=check.role,
                model=check.model,
                kv_cache_dtype=dtype,
                args=DEFAULT_MODEL_ARGS,
                expect_cache_dtype=dtype,
            )
            self.local = LocalServer(spec, log_dir / f"{check.role}.log")
            check.log = str(self.local.log_path)
        else:
            check.url = url

    def __enter__(self) -> ServerCheck:
        if self.local is not None:
            self.local.start()
            try:
                self.local.wait_healthy()
            except ServerStartError as exc:
                self.check.refused = exc.reason
            finally:
                _from_log(self.check, self.local.log_text())
            if self.check.refused is None:
                self.check.url = self.local.url
        self.check.started = self.check.refused is None
        if self.check.started and self.check.url:
            self.check.cache_dtype = asyncio.run(_cache_dtype(self.check.url))
        return self.check

    def __exit__(self, *exc: object) -> None:
        if self.local is not None:
            self.local.stop()
            _from_log(self.check, self.local.log_text())


def verify(
    overlay: Path,
    original: str,
    samples: Sequence[Sample],
    log_dir: Path,
    *,
    strategy: str,
    per_head: tuple[bool, str],
    url: str | None = None,
    baseline_url: str | None = None,
    emulate: bool = False,
    status: Callable[[str], None] = lambda _: None,
) -> Verification:
    """Start (or reach) FP8 servers on the overlay and on the original, one at a time (fair
    on small machines), and decide whether the calibrated scales were applied. ``emulate``:
    FP8 emulated in BF16 servers by kvcal's plugin, where the CPU cannot serve FP8."""
    cal = ServerCheck("calibrated", str(overlay.resolve()), emulated=emulate)
    base = ServerCheck("scale-1.0", original, emulated=emulate)
    reasons: list[str] = []
    if strategy == "attn_head" and not per_head[0]:
        reasons.append(f"per-head (attn_head) scales: {per_head[1]}")
    status("starting the FP8 server on the calibrated checkpoint")
    with _Server(cal, url, log_dir) as c:
        if c.refused:
            return Verification(
                UNSUPPORTED,
                [
                    *reasons,
                    f"the FP8 server on the calibrated checkpoint did not start: {c.refused}",
                ],
                [cal, base],
            )
        status("teacher-forced scoring on the calibrated server")
        assert c.url is not None
        cal_scores = asyncio.run(_scores(c.url, samples, "kvcal-verify-cal"))
    status("starting the scale-1.0 FP8 server on the original model")
    with _Server(base, baseline_url, log_dir) as b:
        if b.refused:
            reasons.append(
                f"the scale-1.0 FP8 server did not start ({b.refused}): no "
                "teacher-forced comparison"
            )
            base_scores: list[TFScore] = []
        else:
            status("teacher-forced scoring on the scale-1.0 server")
            assert b.url is not None
            base_scores = asyncio.run(_scores(b.url, samples, "kvcal-verify-base"))
    tf = compare_scores(cal_scores, base_scores) if base_scores else {}
    return Verification(*_decide(cal, tf, reasons), [cal, base], tf)


def _decide(cal: ServerCheck, tf: dict[str, Any], reasons: list[str]) -> tuple[str, list[str]]:
    if reasons and reasons[0].startswith("per-head"):
        # The server came up (a backend that ignores or lacks per-head support must not be
        # mistaken for one that applied it).
        return UNSUPPORTED, reasons
    meant = EMULATED_FP8 if cal.emulated else "fp8"
    if cal.cache_dtype is not None and not cache_dtype_matches(meant, cal.cache_dtype):
        return NOT_APPLIED, [*reasons, f"served cache_dtype is '{cal.cache_dtype}', not FP8"]
    if cal.emulated and not cal.emulation_active:
        return NOT_APPLIED, [
            *reasons,
            f"the server never logged '{EMULATION_MARKER}': the "
            "emulation plugin did not run (is kvcanary installed there?)",
        ]
    if cal.scale_one_warning or cal.runs_at_scale_one:
        why = (
            "the server log says 'Using KV cache scaling factor 1.0'"
            if cal.scale_one_warning
            else "the engine runs with quantization=None (vLLM's default k/v scales of 1.0)"
        )
        return NOT_APPLIED, [*reasons, f"{why}: the checkpoint's scales were not loaded"]
    if tf and tf["positions"] and tf["differing_positions"] == 0:
        return NOT_APPLIED, [
            *reasons,
            f"teacher-forced scores are identical to scale 1.0 at all {tf['positions']} positions",
        ]
    if not tf or not tf["positions"]:
        return APPLIED if cal.quantization == "compressed-tensors" else NOT_APPLIED, [
            *reasons,
            "no scale-1.0 comparison; judged by the log alone (quantization="
            f"{cal.quantization}, scales from {cal.scales})",
        ]
    return APPLIED, [
        *reasons,
        f"teacher-forced scores differ from scale 1.0 at "
        f"{tf['differing_positions']} of {tf['positions']} positions (mean |dNLL| "
        f"{tf['mean_abs_nll_delta']:.4g}); log: quantization={cal.quantization}",
    ]
