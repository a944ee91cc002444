"""What actually ran: the engine's version, the model it serves, its cache config, and the
engine's own statement of what it runs in its log."""

from __future__ import annotations

import re
from typing import Any

import aiohttp
import orjson

from replay.core.credentials import redact
from replay.core.errors import EndpointError, TargetError
from replay.core.strict import integer
from replay.serving.endpoints import Answer, fetch_json, quote
from replay.serving.metrics import fetch_metrics, parse_metrics

_ENGINE_FIELDS = re.compile(r"\b(kv_cache_dtype|quantization|dtype|max_seq_len)=([^,\s]+)")


def engine_config_from_log(log_text: str) -> dict[str, str]:
    """The engine's own statement of what it runs (its 'Initializing ... engine' line)."""
    for line in log_text.splitlines():
        if "Initializing a V1 LLM engine" in line or "Initializing an LLM engine" in line:
            return {k: v.strip("'") for k, v in _ENGINE_FIELDS.findall(line)}
    return {}


def model_fields(ans: Answer) -> tuple[dict[str, Any], list[str]]:
    """model_id, model_root and max_model_len of the first model a /v1/models answer lists,
    and notes on fields of the wrong type (dropped, not trusted)."""
    v = ans.value
    data = v.get("data") if isinstance(v, dict) else None
    if not isinstance(data, list):
        raise ans.wrong('an object with a "data" list')
    if not data:
        raise ans.wrong("at least one model listed")
    first = data[0]
    if not isinstance(first, dict) or not isinstance(first.get("id"), str) or not first["id"]:
        raise ans.wrong('data[0] to be an object with a non-empty string "id"')
    out: dict[str, Any] = {"model_id": first["id"], "model_root": None, "max_model_len": None}
    notes = []
    root, mml = first.get("root"), first.get("max_model_len")
    if isinstance(root, str):
        out["model_root"] = root
    elif root is not None:
        notes.append(f"{ans.label}: data[0].root is not a string: {quote(orjson.dumps(root))}")
    if (n := integer(mml)) is not None and n > 0:
        out["max_model_len"] = n
    elif mml is not None:
        notes.append(
            f"{ans.label}: data[0].max_model_len is not a positive integer: "
            f"{quote(orjson.dumps(mml))}"
        )
    return out, notes


def engine_version(ans: Answer) -> str:
    v = ans.value
    if not isinstance(v, dict) or not isinstance(v.get("version"), str):
        raise ans.wrong('an object with a string "version"')
    return str(v["version"])


async def introspect(session: aiohttp.ClientSession, base_url: str) -> dict[str, Any]:
    """/v1/models, /version and the cache config labels. What an endpoint could not tell is
    a line in ``problems`` naming it; ``unreachable`` is set when the server could not be
    connected to at all (the rest is then not asked)."""
    out: dict[str, Any] = {
        "url": redact(base_url),  # written to the manifest: no credential
        "problems": [],
        "model_id": None,
        "model_root": None,
        "max_model_len": None,
        "engine_version": None,
        "cache_config": {},
    }
    problems: list[str] = out["problems"]
    try:
        models = await fetch_json(session, "GET", base_url, "/v1/models")
        fields, notes = model_fields(models)
        out.update(fields, models=models.value)
        problems.extend(notes)
    except EndpointError as exc:
        problems.append(str(exc))
        if exc.unreachable:
            out["unreachable"] = True
            return out
    try:
        version = await fetch_json(session, "GET", base_url, "/version")
        out["engine_version"] = engine_version(version)
        out["version"] = version.value
    except EndpointError as exc:
        problems.append(str(exc))
    try:
        out["cache_config"] = parse_metrics(await fetch_metrics(session, base_url)).cache_info
    except EndpointError as exc:
        problems.append(str(exc))
    except ValueError as exc:
        problems.append(f"GET /metrics: not Prometheus text: {exc}")
    return out


def served_model(info: dict[str, Any]) -> str:
    """The model an introspected target serves; a target without one cannot be used, and the
    TargetError says why in the endpoint's own terms."""
    model = info.get("model_id")
    if isinstance(model, str) and model:
        return model
    url = info.get("url")
    why = next(
        (p for p in info.get("problems", []) if p.startswith("GET /v1/models")),
        "GET /v1/models: no model listed",
    )
    if info.get("unreachable"):
        raise TargetError(f"target unreachable at {url}: {why}")
    raise TargetError(f"no model served by {url}: {why}")
