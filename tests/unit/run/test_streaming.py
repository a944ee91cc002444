"""Bounded memory: a trace is checked in one pass and re-read for every replay pass, never
held whole. The tests count live ``Request`` objects (structural, not timed: they cannot be
flaky) and check that the streamed path gives exactly what the in-memory one gives."""

from __future__ import annotations

import asyncio
import gc
import json
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replay.analysis.run_spec import QualitySpec
from replay.cli import main
from replay.core.errors import TraceError
from replay.core.schedule import ClosedLoop, OpenLoop, PoissonOffsets, TraceOffsets, trace_offsets
from replay.run.runner import Runner
from replay.rundir.files import new_run_dir, read_jsonl, read_results
from replay.serving.targets import TargetSpec
from replay.traces.importers import load, scan
from replay.traces.trace import IdIndex, Request
from tests.support.fault_server import fault_server
from tests.support.run_config import run_config


def live_requests() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is Request)


def write_trace(path: Path, n: int, bad_every: int = 0) -> Path:
    with path.open("w", encoding="utf-8") as fh:
        for i in range(n):
            if bad_every and i % bad_every == bad_every - 1:
                fh.write('{"id": "broken", "messages": []}\n')
                continue
            fh.write(
                json.dumps(
                    {
                        "id": f"r{i}",
                        "t": i * 0.01,
                        "max_tokens": 4,
                        "messages": [{"role": "user", "content": f"q {i}"}],
                    }
                )
                + "\n"
            )
    return path


def test_scan_holds_no_request_and_reads_lazily(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", 3000, bad_every=7)
    base = live_requests()
    loaded = load(path, on_bad_line="skip")
    assert live_requests() - base == loaded.count == 3000 - 3000 // 7  # the counter counts
    del loaded
    trace = scan(path, on_bad_line="skip")
    assert live_requests() - base == 0
    assert (trace.lines, trace.count, trace.bad_count) == (3000, 3000 - 3000 // 7, 3000 // 7)
    it = trace.iter_requests()
    first = next(it)
    assert first.id == "r0" and live_requests() - base <= 2  # one request read, not the file
    it.close()
    assert [r.id for r in trace.iter_requests()][:3] == ["r0", "r1", "r2"]


def test_limit_counts_and_stops_the_reread_but_checks_the_whole_file(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", 50)
    with path.open("a") as fh:
        fh.write('{"id": "r3", "messages": [{"role": "user", "content": "again"}]}\n')
    with pytest.raises(TraceError, match="duplicate id 'r3' \\(first on line 4\\)"):
        scan(path, limit=5)  # past the limit, still an error: the trace is checked whole
    trace = scan(path, on_bad_line="skip", limit=5)
    assert trace.count == 5 and trace.total == 50
    assert [r.id for r in trace.iter_requests()] == [f"r{i}" for i in range(5)]
    assert [e.line for e in trace.iter_bad()] == [51]
    assert trace.t_min == 0.0 and trace.has_text and not trace.has_synth


def test_keep_filters_what_is_replayed(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", 20)
    trace = scan(path, keep=lambda r: int(r.id[1:]) % 2 == 0, limit=3)
    assert [r.id for r in trace.iter_requests()] == ["r0", "r2", "r4"]
    assert trace.total == 10 and trace.lines == 20


LINE = st.one_of(
    st.builds(
        lambda i, t: json.dumps(
            {"id": f"x{i}", "t": t, "messages": [{"role": "user", "content": "hi"}]}
        ),
        st.integers(0, 8),
        st.floats(min_value=-1, max_value=5, allow_nan=False),
    ),
    st.sampled_from(
        [
            "{oops",
            "[]",
            "",
            "   ",
            '{"id": "", "messages": []}',
            '{"id": 7, "api": "completions", "prompt": [1, 2]}',
        ]
    ),
    st.binary(max_size=30).map(lambda b: b.decode("latin-1").replace("\n", " ")),
)


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(LINE, max_size=25), st.one_of(st.none(), st.integers(0, 10)))
def test_streamed_equals_in_memory(
    tmp_path_factory,
    lines: list[str],  # type: ignore[no-untyped-def]
    limit: int | None,
) -> None:
    path = tmp_path_factory.mktemp("s") / "t.jsonl"
    path.write_bytes("\n".join(lines).encode("utf-8", "surrogateescape") + b"\n")
    for mode in ("fail", "skip"):
        try:
            ref = load(path, "v1", on_bad_line=mode)  # type: ignore[arg-type]
        except TraceError as err:
            with pytest.raises(TraceError) as info:
                scan(path, "v1", on_bad_line=mode, limit=limit)  # type: ignore[arg-type]
            assert str(info.value) == str(err)
            continue
        got = scan(path, "v1", on_bad_line=mode, limit=limit)  # type: ignore[arg-type]
        want = ref.requests if limit is None else ref.requests[:limit]
        assert list(got.iter_requests()) == want
        assert list(got.iter_requests()) == want  # again: every pass is the same
        assert [str(e) for e in got.iter_bad()] == [str(e) for e in ref.bad]
        assert (got.lines, got.bad_count, got.count) == (ref.lines, len(ref.bad), len(want))


def test_id_index_spills_to_disk_and_still_finds_every_repeat() -> None:
    with IdIndex(spill_after=50) as idx:
        firsts = [idx.first(f"id{i % 300}", i + 1) for i in range(900)]
        assert idx.in_memory == 0  # spilled: nothing held in Python objects
    assert firsts[:300] == [None] * 300
    assert firsts[300:] == [(i % 300) + 1 for i in range(300, 900)]


def test_lazy_offsets_equal_the_lists() -> None:
    assert list(PoissonOffsets(500, 3.0, 7)) == list(PoissonOffsets(500, 3.0, 7))
    times = [5.0, None, 6.0, 9.0]
    lazy = TraceOffsets(lambda: iter(times), base=5.0, time_scale=0.5)
    assert list(lazy) == list(lazy) == trace_offsets(times, 0.5)
    with pytest.raises(ValueError):
        PoissonOffsets(3, 0.0)


class CountingProgress:
    """Samples how many requests are alive while the replay runs."""

    def __init__(self) -> None:
        self.seen = 0
        self.peak = 0

    def status(self, message: str) -> None:
        pass

    def phase(self, target: str, label: str, total: int) -> None:
        pass

    def advance(self, target: str, label: str, ok: bool) -> None:
        self.seen += 1
        if self.seen % 25 == 1:
            self.peak = max(self.peak, live_requests())


@pytest.mark.parametrize("open_loop", [False, True])
def test_replay_holds_only_requests_in_flight(tmp_path: Path, open_loop: bool) -> None:
    path = write_trace(tmp_path / "t.jsonl", 2000)
    trace = scan(path, limit=150)
    sched = (
        OpenLoop(PoissonOffsets(trace.count, 2000.0), max_in_flight=4)
        if open_loop
        else ClosedLoop(4)
    )
    progress = CountingProgress()
    with fault_server("split") as server:
        cfg = run_config(
            trace=trace,
            trace_path=path,
            trace_format="v1",
            targets=[TargetSpec(name="bf16", url=server.url)],
            schedules=[sched],
            quality=QualitySpec(buckets="256,1K", teacher_forced=False),
            run_dir=new_run_dir(tmp_path),
            load={"timeout_s": 10.0},
        )
        base = live_requests()
        asyncio.run(Runner(cfg, progress).run())
    assert progress.seen == 150
    # 4 in flight, one pulled and waiting for a slot, one being counted: never the trace.
    assert progress.peak - base <= 8
    results = list(read_results(cfg.run_dir))
    assert Counter(r.request_id for r in results) == Counter(f"r{i}" for i in range(150))
    assert all(r.status == "ok" for r in results)


def test_phase_time_limit_records_every_unsent_request_once(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", 300)
    trace = scan(path)
    with fault_server("split") as server:
        cfg = run_config(
            trace=trace,
            trace_path=path,
            trace_format="v1",
            targets=[TargetSpec(name="bf16", url=server.url)],
            schedules=[ClosedLoop(2)],
            quality=QualitySpec(buckets="256,1K", teacher_forced=False),
            run_dir=new_run_dir(tmp_path),
            load={"timeout_s": 10.0, "phase_timeout_s": 0.4},
        )
        asyncio.run(Runner(cfg).run())
    results = list(read_results(cfg.run_dir))
    assert Counter(r.request_id for r in results) == Counter(f"r{i}" for i in range(300))
    unsent = [r for r in results if (r.error or "").startswith("not sent: phase time limit")]
    assert 0 < len(unsent) < 300 and all(r.status == "cancelled" for r in unsent)
    # Unsent ones are written in trace order, after everything that was sent or cut short.
    ids = [int(r.request_id[1:]) for r in unsent]
    assert ids == sorted(ids) and ids[-1] == 299


def test_trace_import_streams_and_leaves_nothing_on_failure(tmp_path: Path) -> None:
    src = tmp_path / "mc.jsonl"
    rows = [
        {"timestamp": i * 10, "input_length": 600, "output_length": 5, "hash_ids": [i, i]}
        for i in range(40)
    ]
    src.write_text(
        "\n".join(json.dumps(r) for r in rows[:20])
        + "\n{bad\n"
        + "\n".join(json.dumps(r) for r in rows[20:])
        + "\n"
    )
    out = tmp_path / "v1.jsonl"
    failed = CliRunner().invoke(main, ["trace", "import", str(src), "-o", str(out)])
    assert failed.exit_code == 2 and f"{src}:21" in failed.output
    assert not out.exists() and not list(tmp_path.glob("*.part"))
    ok = CliRunner().invoke(
        main, ["trace", "import", str(src), "-o", str(out), "--on-bad-line", "skip"]
    )
    assert ok.exit_code == 0, ok.output
    assert "wrote 40 request(s)" in ok.output and "1 bad line(s) skipped" in ok.output
    assert [r["id"] for r in read_jsonl(out)] == [
        f"mooncake-{i}" for i in [*range(1, 21), *range(22, 42)]
    ]
    checked = CliRunner().invoke(main, ["trace", "validate", str(src)])
    assert checked.exit_code == 2
    assert checked.output.splitlines()[0].startswith(f"{src}:21: field '(line)'")
    assert checked.output.splitlines()[-1] == f"{src}: 40 valid request(s), 1 bad line(s)"
