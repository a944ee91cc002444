"""Importers: every trace format kvcanary reads, into trace v1 ``Request`` records.

Formats (``IMPORTERS``; ``--trace-format``): ``v1`` (kvcanary's own), the length-only
production traces ``mooncake``, ``azure``, ``bailian`` (Qwen-Bailian) and ``burstgpt``, the
request logs ``openai-log``, one module each; and column mappings ``csv:...``/``jsonl:...``
(``mapped``) for any other layout. ``sniff_format`` recognises a file's format from its first
record and never guesses between formats whose units differ. Each importer streams:
``importer(path, LengthPolicy)`` yields ``(line, Request | TraceError | Skip)`` and never holds
the file. ``load``, ``stream`` and ``scan`` read a trace of any format (``scan`` in bounded
memory for any length).
"""

from replay.traces.importers.lengths import LengthPolicy
from replay.traces.importers.registry import (
    FORMAT_HELP,
    IMPORTERS,
    get_importer,
    resolve_format,
    sniff_format,
)
from replay.traces.importers.scan import StreamedTrace, load, scan, skipped_note, stream

__all__ = [
    "FORMAT_HELP",
    "IMPORTERS",
    "LengthPolicy",
    "StreamedTrace",
    "get_importer",
    "load",
    "resolve_format",
    "scan",
    "skipped_note",
    "sniff_format",
    "stream",
]
