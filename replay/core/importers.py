"""Importers for real length-only production traces, into trace v1 records.

Registry: ``IMPORTERS[name](path, LengthPolicy)`` yields ``(line, Request | TraceError)``,
streamed. ``scan`` checks a whole trace in one streaming pass and returns a ``StreamedTrace``
that re-reads the file for every pass a replay makes (bounded memory for any length).
Each record is a synthetic completions request (``synth``) with ``ignore_eos`` so the
output has the trace's length. ``LengthPolicy`` scales and caps lengths so a real trace fits a
small test model; it is recorded in the run manifest.
"""

from __future__ import annotations

import csv
import math
import shutil
import tempfile
import weakref
from collections.abc import Callable, Generator, Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson
from pydantic import ValidationError

from replay.core.errors import InputError, TraceError
from replay.core.trace import (
    UTF8_BOM,
    CheckStats,
    OnBadLine,
    Request,
    Synth,
    TraceLoad,
    check,
    collect,
    iter_lines,
    parse_line_or_error,
)

Parsed = tuple[int, "Request | TraceError"]
# Generators, not just iterators: a reader that stops early closes them (and their file).
Records = Generator[Parsed, None, None]


@dataclass(frozen=True)
class LengthPolicy:
    """``scale`` multiplies input, output and block lengths; caps apply after scaling."""

    scale: float = 1.0
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None

    def __post_init__(self) -> None:
        if not (self.scale > 0 and math.isfinite(self.scale)):
            raise InputError("--length-scale must be a positive number")
        for name in ("max_input_tokens", "max_output_tokens"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise InputError(f"--{name.replace('_', '-')} must be at least 1")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def apply(self, inp: int, out: int, block: int) -> tuple[int, int, int]:
        inp_s = max(1, round(inp * self.scale))
        out_s = max(1, round(out * self.scale))
        block_s = max(1, round(block * self.scale))
        if self.max_input_tokens is not None:
            inp_s = min(inp_s, self.max_input_tokens)
        if self.max_output_tokens is not None:
            out_s = min(out_s, self.max_output_tokens)
        return inp_s, out_s, block_s


def _record(
    rid: str,
    t: float,
    inp: int,
    out: int,
    hash_ids: list[int],
    block: int,
    policy: LengthPolicy,
    meta: dict[str, Any],
) -> Request:
    inp_s, out_s, block_s = policy.apply(inp, out, block)
    n_blocks = math.ceil(inp_s / block_s)
    return Request(
        id=rid,
        t=t,
        api="completions",
        synth=Synth(input_tokens=inp_s, hash_ids=tuple(hash_ids[:n_blocks]), block_tokens=block_s),
        max_tokens=out_s,
        params={"ignore_eos": True},
        task="perf",
        input_tokens=inp_s,
        meta={**meta, "orig_input_tokens": inp, "orig_output_tokens": out},
    )


def _positive_int(obj: dict[str, Any], key: str) -> int:
    v = obj.get(key)
    if (
        isinstance(v, bool)
        or not isinstance(v, int | float)
        or not math.isfinite(v)
        or v < 1
        or int(v) != v
    ):
        raise ValueError(f"{key}: must be a positive integer, got {v!r}")
    return int(v)


def import_mooncake(path: Path, policy: LengthPolicy) -> Records:
    """Mooncake: ``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``
    (one id per 512-token block)."""
    src = str(path)
    for lineno, raw in iter_lines(path):
        try:
            obj = orjson.loads(raw)
            if not isinstance(obj, dict):
                raise ValueError("(line): a Mooncake line must be a JSON object")
            ts = obj.get("timestamp")
            if (
                isinstance(ts, bool)
                or not isinstance(ts, int | float)
                or not math.isfinite(ts)
                or ts < 0
            ):
                raise ValueError(f"timestamp: must be milliseconds >= 0, got {ts!r}")
            inp = _positive_int(obj, "input_length")
            out = _positive_int(obj, "output_length")
            hids = obj.get("hash_ids", [])
            if not isinstance(hids, list) or not all(
                isinstance(h, int) and not isinstance(h, bool) for h in hids
            ):
                raise ValueError("hash_ids: must be a list of integers")
            yield (
                lineno,
                _record(
                    f"mooncake-{lineno}",
                    ts / 1000.0,
                    inp,
                    out,
                    hids,
                    512,
                    policy,
                    {"source": "mooncake", "line": lineno},
                ),
            )
        except orjson.JSONDecodeError as exc:
            yield lineno, TraceError(src, lineno, "(line)", f"not valid JSON ({exc})")
        except (ValueError, ValidationError) as exc:
            yield lineno, _as_trace_error(src, lineno, exc)


def _parse_azure_time(text: str) -> float:
    """'2023-11-16 18:15:46.6805900' (7 fractional digits) -> POSIX seconds."""
    whole, _, frac = text.strip().partition(".")
    base = datetime.fromisoformat(whole).timestamp()
    return base + (float("0." + frac) if frac else 0.0)


def import_azure(path: Path, policy: LengthPolicy) -> Records:
    """Azure LLM inference traces 2023/2024 CSV: ``TIMESTAMP, ContextTokens, GeneratedTokens``."""
    src = str(path)
    first: float | None = None
    try:
        # Undecodable bytes become lone surrogates: the row's field then fails validation
        # with its line and field named, instead of breaking the whole stream. utf-8-sig:
        # a CSV saved by Excel starts with a byte order mark, which is not part of TIMESTAMP.
        fh = path.open(newline="", encoding="utf-8-sig", errors="surrogateescape")
    except OSError as exc:
        raise InputError(f"{src}: cannot read: {exc}") from None
    with fh:
        reader = csv.DictReader(fh)
        need = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
        try:
            header = set(reader.fieldnames or ())
        except UnicodeDecodeError as exc:
            raise TraceError(src, 1, "(header)", f"not UTF-8 text: {exc}") from None
        if not need <= header:
            raise TraceError(
                src,
                1,
                "(header)",
                f"missing column(s) {sorted(need - header)}; "
                "expected TIMESTAMP,ContextTokens,GeneratedTokens",
            )
        while True:
            at = reader.line_num
            try:
                row = next(reader)
            except StopIteration:
                break
            except csv.Error as exc:
                yield reader.line_num, TraceError(src, reader.line_num, "(line)", str(exc))
                if reader.line_num == at:
                    break  # the reader cannot move past this point
                continue
            lineno = reader.line_num
            try:
                try:
                    t = _parse_azure_time(row["TIMESTAMP"] or "")
                except (ValueError, TypeError):
                    raise ValueError(f"TIMESTAMP: not a date-time: {row['TIMESTAMP']!r}") from None
                first = t if first is None else first
                inp = _csv_int(row, "ContextTokens")
                out = _csv_int(row, "GeneratedTokens")
                yield (
                    lineno,
                    _record(
                        f"azure-{lineno}",
                        max(0.0, t - first),
                        inp,
                        out,
                        [],
                        512,
                        policy,
                        {"source": "azure", "line": lineno},
                    ),
                )
            except (ValueError, ValidationError) as exc:
                yield lineno, _as_trace_error(src, lineno, exc)


def _csv_int(row: dict[str, Any], key: str) -> int:
    raw = (row.get(key) or "").strip()
    try:
        v = int(raw)
    except ValueError:
        raise ValueError(f"{key}: must be a positive integer, got {raw!r}") from None
    if v < 1:
        raise ValueError(f"{key}: must be a positive integer, got {v}")
    return v


def _as_trace_error(src: str, lineno: int, exc: Exception) -> TraceError:
    if isinstance(exc, ValidationError):
        err = exc.errors()[0]
        return TraceError(src, lineno, ".".join(map(str, err["loc"])), err["msg"])
    field, sep, reason = str(exc).partition(": ")
    return TraceError(src, lineno, field if sep else "(line)", reason if sep else str(exc))


def import_v1(path: Path, policy: LengthPolicy) -> Records:
    """kvcanary's own format (lengths are the trace author's; the policy does not apply)."""
    for lineno, raw in iter_lines(path):
        yield lineno, parse_line_or_error(raw, str(path), lineno)


IMPORTERS: dict[str, Callable[[Path, LengthPolicy], Records]] = {
    "v1": import_v1,
    "mooncake": import_mooncake,
    "azure": import_azure,
}


def get_importer(name: str) -> Callable[[Path, LengthPolicy], Records]:
    try:
        return IMPORTERS[name]
    except KeyError:
        raise InputError(
            f"--trace-format: unknown format '{name}'. Available: {', '.join(IMPORTERS)}"
        ) from None


def sniff_format(path: Path) -> str:
    """Guess the format from the first line: CSV header, Mooncake keys, or v1."""
    try:
        with path.open("rb") as fh:
            head = fh.readline(65536).removeprefix(UTF8_BOM).strip()
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc}") from None
    if head.startswith(b"TIMESTAMP"):
        return "azure"
    if head.startswith(b"{") and b'"input_length"' in head and b'"id"' not in head:
        return "mooncake"
    return "v1"


def load(
    path: Path,
    fmt: str = "auto",
    policy: LengthPolicy | None = None,
    on_bad_line: OnBadLine = "fail",
) -> TraceLoad:
    """Read a trace of any known format into validated v1 requests."""
    fmt = resolve_format(path, fmt)
    return collect(str(path), get_importer(fmt)(path, policy or LengthPolicy()), on_bad_line)


def resolve_format(path: Path, fmt: str) -> str:
    if path.is_dir():
        raise InputError(f"{path}: is a directory; give the trace file in it")
    if not path.is_file():
        raise InputError(
            f"{path}: no such trace file"
            if not path.exists()
            else f"{path}: not a regular file; give a trace file"
        )
    return sniff_format(path) if fmt == "auto" else fmt


def stream(
    path: Path,
    fmt: str = "auto",
    policy: LengthPolicy | None = None,
    on_bad_line: OnBadLine = "fail",
    bad: Callable[[int, TraceError], None] | None = None,
    stats: CheckStats | None = None,
) -> Generator[Request, None, None]:
    """The valid requests of a trace of any known format, one at a time (bad lines raise, or
    go to ``bad``). Nothing is kept: what a trace import writes as it reads."""
    fmt = resolve_format(path, fmt)
    items = get_importer(fmt)(path, policy or LengthPolicy())
    try:
        yield from check(str(path), items, on_bad_line, bad or (lambda _k, _e: None), stats)
    finally:
        items.close()  # a caller that stops early must not leave the file open


@dataclass
class StreamedTrace:
    """A checked trace that is not held in memory (``TraceSource``).

    ``scan`` reads the file once: it validates every line, finds repeated ids (``IdIndex``:
    bounded memory), counts, and spools the bad lines to a temporary file. Each
    ``iter_requests`` reads the file again, skipping the bad records by their position, and
    stops after ``count`` requests (``--limit``). Only the counts and the facts the replay
    decides on up front are kept, not the requests. ``keep`` (optional) picks the requests a
    replay sends, e.g. to leave out held-out ids; every line is checked either way.
    """

    path: str
    fmt: str
    policy: LengthPolicy
    lines: int = 0
    total: int = 0  # valid requests in the file (that ``keep`` keeps)
    limit: int | None = None
    bad_count: int = 0
    first_bad: TraceError | None = None
    has_synth: bool = False  # among the first ``count`` requests, like the next two
    has_text: bool = False
    unlabeled: int = 0  # requests without a check: graded against the reference's answers
    t_min: float | None = None
    keep: Callable[[Request], bool] | None = field(default=None, repr=False)
    _spool: Path | None = field(default=None, repr=False)

    @property
    def count(self) -> int:
        """Requests a replay sends: the valid ones, up to the limit."""
        return self.total if self.limit is None else min(self.total, max(0, self.limit))

    def iter_bad(self) -> Iterator[TraceError]:
        for _k, err in self._bad_records():
            yield err

    def _bad_records(self) -> Generator[tuple[int, TraceError], None, None]:
        if self._spool is None or not self._spool.exists():
            return
        with self._spool.open("rb") as fh:
            for raw in fh:
                d = orjson.loads(raw)
                yield d["k"], TraceError(d["path"], d["line"], d["field"], d["reason"])

    def iter_requests(self) -> Iterator[Request]:
        want = self.count
        if want == 0:
            return
        bad = self._bad_records()
        next_bad = next(bad, None)
        items = get_importer(self.fmt)(Path(self.path), self.policy)
        n = 0
        try:
            for k, (lineno, item) in enumerate(items):
                if next_bad is not None and next_bad[0] == k:
                    next_bad = next(bad, None)
                    continue  # a bad line or a repeated id, listed by the scan
                if isinstance(item, TraceError):
                    raise TraceError(
                        self.path,
                        lineno,
                        item.field,
                        f"the trace changed while it was being replayed: {item.reason}",
                    )
                if self.keep is not None and not self.keep(item):
                    continue
                yield item
                n += 1
                if n >= want:
                    return
        finally:
            items.close()
            bad.close()


def scan(
    path: Path,
    fmt: str = "auto",
    policy: LengthPolicy | None = None,
    on_bad_line: OnBadLine = "fail",
    limit: int | None = None,
    keep: Callable[[Request], bool] | None = None,
) -> StreamedTrace:
    """Check a whole trace in one streaming pass (see ``StreamedTrace``)."""
    fmt = resolve_format(path, fmt)
    policy = policy or LengthPolicy()
    out = StreamedTrace(str(path), fmt, policy, limit=limit, keep=keep)
    spool_dir = Path(tempfile.mkdtemp(prefix="kvcanary-trace-"))
    weakref.finalize(out, shutil.rmtree, spool_dir, True)
    out._spool = spool_dir / "bad.jsonl"
    stats = CheckStats()
    with out._spool.open("wb") as spool:

        def bad(k: int, err: TraceError) -> None:
            if out.first_bad is None:
                out.first_bad = err
            out.bad_count += 1
            spool.write(orjson.dumps({"k": k, **err.as_dict()}) + b"\n")

        for req in stream(path, fmt, policy, on_bad_line, bad, stats):
            if keep is not None and not keep(req):
                continue
            out.total += 1
            if limit is not None and out.total > limit:
                continue  # checked (the whole trace must be valid), not replayed
            out.has_synth = out.has_synth or req.synth is not None
            out.has_text = out.has_text or bool(req.messages) or isinstance(req.prompt, str)
            out.unlabeled += req.check is None
            if req.t is not None:
                out.t_min = req.t if out.t_min is None else min(out.t_min, req.t)
    out.lines = stats.lines
    return out
