"""Mooncake traces (kvcache-ai/Mooncake, FAST'25): JSON lines of ``timestamp`` (milliseconds),
``input_length``, ``output_length`` and ``hash_ids``, one id per 512-token block.

Any other field is refused: a Qwen-Bailian row has the same length fields but seconds and
16-token blocks, and read as Mooncake it would replay a thousand times too fast with the wrong
prefixes.
"""

from __future__ import annotations

from pathlib import Path

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

FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
REQUIRED = ("timestamp", "input_length", "output_length")
BLOCK_TOKENS = 512
BAILIAN_HINT = " (chat_id and parent_chat_id make a Qwen-Bailian trace: --trace-format bailian)"


def import_mooncake(path: Path, policy: LengthPolicy) -> Records:
    """Mooncake: ``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``
    (one id per 512-token block)."""
    src = str(path)
    for lineno, obj in json_objects(path, "a Mooncake line"):
        if isinstance(obj, TraceError):
            yield lineno, obj
            continue
        try:
            refuse_unknown(obj, FIELDS, "Mooncake", BAILIAN_HINT if "chat_id" in obj else "")
            ts = json_seconds(obj, "timestamp", "milliseconds")
            lengths = Lengths(
                json_int(obj, "input_length"),
                json_int(obj, "output_length"),
                json_hash_ids(obj),
                BLOCK_TOKENS,
            )
            meta = {"source": "mooncake", "line": lineno}
            yield lineno, length_record(f"mooncake-{lineno}", ts / 1000.0, lengths, policy, meta)
        except (ValueError, ValidationError) as exc:
            yield lineno, as_trace_error(src, lineno, exc)
