"""Qwen-Bailian usage traces: two hours of one Qwen serving instance on Aliyun Bailian.

Source: github.com/alibaba-edu/qwen-bailian-usagetraces-anon (README, "Data Specification of
the Traces"; Apache-2.0), used in Wang et al., "KVCache Cache in the Wild: Characterizing and
Optimizing KVCache Cache at a Large Cloud Provider", USENIX ATC '25. JSON lines::

    {"chat_id": 159, "parent_chat_id": 55, "timestamp": 61.114, "input_length": 521,
     "output_length": 132, "type": "text", "turn": 2, "hash_ids": [1089, 1090, ...]}

``chat_id`` is an integer id per request, ``parent_chat_id`` the request this one follows in
its conversation (-1 for a root), ``timestamp`` seconds since the trace began, ``type`` text,
search, image or file, ``turn`` the conversation turn (1-based), and ``hash_ids`` one salted
hash per 16-token block of the prompt (equal ids: a shared prefix).

Every record becomes a length-only request ``bailian-CHAT_ID`` whose ``session`` is the chat id
of its conversation's root, found by following ``parent_chat_id``; meta keeps ``chat_id``,
``parent_chat_id``, ``turn`` and ``type``. A parent must come before its child in the file (the
trace is in arrival order): a child whose parent is not an earlier valid record is a bad row,
never a session of its own, so a trace cut in the middle of a conversation says so. ``type``,
``turn`` and ``hash_ids`` may be absent (the published files have them all); any field outside
the eight above is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from replay.core.errors import TraceError
from replay.traces.importers.lengths import LengthPolicy, Lengths, length_record
from replay.traces.importers.trace_rows import (
    Records,
    as_trace_error,
    json_hash_ids,
    json_int,
    json_objects,
    json_seconds,
    refuse_unknown,
)
from replay.traces.trace import IdIndex, Request

FIELDS = (
    "chat_id",
    "parent_chat_id",
    "timestamp",
    "input_length",
    "output_length",
    "type",
    "turn",
    "hash_ids",
)
REQUIRED = ("chat_id", "parent_chat_id", "timestamp", "input_length", "output_length")
BLOCK_TOKENS = 16
ROOT = -1
MAX_CHAT_ID = 2**63 - 1  # what the on-disk index of roots holds


def import_bailian(path: Path, policy: LengthPolicy) -> Records:
    """Qwen-Bailian JSON lines (see the module docstring), sessions from the parent chain."""
    src = str(path)
    # chat id -> its conversation's root chat id, for every valid record so far; an IdIndex
    # keeps a long trace's map on disk past its first 65,536 chats.
    with IdIndex() as roots:
        for lineno, obj in json_objects(path, "a Qwen-Bailian line"):
            if isinstance(obj, TraceError):
                yield lineno, obj
                continue
            try:
                record, chat_id, root = _record(obj, lineno, policy, roots)
            except (ValueError, ValidationError) as exc:
                yield lineno, as_trace_error(src, lineno, exc)
                continue
            roots.first(str(chat_id), root)  # a repeated chat id is the checker's to report
            yield lineno, record


def _record(
    obj: dict[str, Any], lineno: int, policy: LengthPolicy, roots: IdIndex
) -> tuple[Request, int, int]:
    refuse_unknown(obj, FIELDS, "Qwen-Bailian")
    chat_id = json_int(obj, "chat_id", minimum=0)
    if chat_id > MAX_CHAT_ID:
        raise ValueError(f"chat_id: {chat_id} is past the largest id kept ({MAX_CHAT_ID})")
    parent = json_int(obj, "parent_chat_id", minimum=ROOT)
    if parent == chat_id:
        raise ValueError(f"parent_chat_id: chat {chat_id} cannot be its own parent")
    root = chat_id if parent == ROOT else roots.get(str(parent))
    if root is None:
        raise ValueError(
            f"parent_chat_id: chat {parent} is not an earlier valid record of this file (a "
            "request must follow its parent; was the trace cut, or its parent a bad line?)"
        )
    ts = json_seconds(obj, "timestamp")
    lengths = Lengths(
        json_int(obj, "input_length"),
        json_int(obj, "output_length"),
        json_hash_ids(obj),
        BLOCK_TOKENS,
    )
    meta: dict[str, Any] = {
        "source": "bailian",
        "line": lineno,
        "chat_id": chat_id,
        "parent_chat_id": parent,
    }
    if "turn" in obj:
        meta["turn"] = json_int(obj, "turn")
    if "type" in obj:
        kind = obj["type"]
        if not isinstance(kind, str) or not kind:
            raise ValueError(f"type: must be a request type such as 'text', got {kind!r}")
        meta["type"] = kind
    rid = f"bailian-{chat_id}"
    return length_record(rid, ts, lengths, policy, meta, session=str(root)), chat_id, root
