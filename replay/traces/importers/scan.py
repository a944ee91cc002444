"""Reading a trace of any format: in memory (``load``), one request at a time (``stream``), or
checked in one pass and re-read for every pass a replay makes (``scan``, ``StreamedTrace``:
bounded memory for any length).

Every way applies the same rules (``replay.traces.trace.check``): a bad line fails or is skipped
and listed, a repeated id is a bad line, and a row the trace marks as not to be replayed (a
``Skip``, e.g. a failed request) is counted by category.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from replay.core.errors import TraceError
from replay.traces.importers.lengths import LengthPolicy
from replay.traces.importers.registry import get_importer, resolve_format
from replay.traces.trace import (
    CheckStats,
    OnBadLine,
    Request,
    Skip,
    TraceLoad,
    check,
    collect,
)


def skipped_note(skipped: dict[str, int]) -> str:
    """What a trace left out, for a person: ``not replayed: 3 failed request(s)``."""
    parts = [f"{n} {category} request(s)" for category, n in sorted(skipped.items())]
    return "not replayed: " + ", ".join(parts)


def load(
    path: Path,
    fmt: str = "auto",
    policy: LengthPolicy | None = None,
    on_bad_line: OnBadLine = "fail",
) -> TraceLoad:
    """Read a trace of any known format into validated v1 requests."""
    fmt = resolve_format(path, fmt)
    return collect(str(path), get_importer(fmt)(path, policy or LengthPolicy()), on_bad_line)


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
    bounded memory), counts (``skipped``: the rows the trace marks as not to be replayed, by
    category), and spools the bad lines to a temporary file. Each
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
    skipped: dict[str, int] = field(default_factory=dict)  # rows not replayed, by category
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
                if isinstance(item, Skip):
                    continue  # counted by the scan
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
    out.lines, out.skipped = stats.lines, stats.skipped
    return out
