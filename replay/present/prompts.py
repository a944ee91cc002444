"""Prompts for the per-request drill-down, from the run's trace file: found beside the run
or where the manifest says, checked against the digest the run recorded, and shortened to a
head and a tail."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import orjson

from replay.present.reading import Run, obj
from replay.rundir.files import file_digest

PROMPT_HEAD = PROMPT_TAIL = 300


def trace_file(run: Run) -> tuple[Path | None, str]:
    """The run's trace file, if it can be found, and a note (for a changed or missing one)."""
    raw = run.manifest.trace.path
    if not raw:
        return None, "the manifest names no trace file"
    p = Path(raw)
    roots = [Path.cwd(), run.dir.resolve().parent.parent, run.dir.resolve().parent]
    found = [q for q in ([p] if p.is_absolute() else [r / p for r in roots]) if q.is_file()]
    if not found:
        return None, f"trace file {raw} not found"
    digest = run.manifest.trace.sha256
    for q in found:
        if not digest or file_digest(q) == digest:
            return q, ""
    return found[0], f"{found[0]} has changed since the run (sha256 differs): prompts may not match"


def prompt_text(rec: Mapping[str, Any]) -> str:
    """A trace record's prompt as readable text (chat messages, text, token ids or synth)."""
    messages = rec.get("messages")
    if isinstance(messages, list):
        return "\n".join(
            f"[{obj(m).get('role', '?')}] {_content(obj(m).get('content'))}" for m in messages
        )
    prompt = rec.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        head = " ".join(str(t) for t in prompt[:24])
        return f"({len(prompt)} token ids) {head}{' …' if len(prompt) > 24 else ''}"
    synth = obj(rec.get("synth"))
    if synth:
        return (
            f"(synthetic prompt: {synth.get('input_tokens')} tokens, hash ids "
            f"{synth.get('hash_ids', [])})"
        )
    return "(no prompt in the trace record)"


def _content(content: object) -> str:
    if isinstance(content, list):  # OpenAI content parts
        return " ".join(str(obj(p).get("text", f"({obj(p).get('type', 'part')})")) for p in content)
    return "" if content is None else str(content)


def excerpt(s: str, head: int = PROMPT_HEAD, tail: int = PROMPT_TAIL) -> str:
    if len(s) <= head + tail + 40:
        return s
    return f"{s[:head]}\n… [{len(s) - head - tail:,} characters omitted] …\n{s[-tail:]}"


def load_prompts(run: Run, ids: Iterable[str]) -> tuple[dict[str, str], str]:
    """Prompt excerpts of the given request ids, and a note when the trace is unavailable."""
    path, note = trace_file(run)
    if path is None:
        return {}, note
    wanted, out = set(ids), {}
    with path.open("rb") as fh:
        for raw in fh:
            try:
                rec = orjson.loads(raw)
            except orjson.JSONDecodeError:
                continue
            rid = str(obj(rec).get("id"))
            if rid in wanted and rid not in out:
                out[rid] = excerpt(prompt_text(obj(rec)))
    return out, note
