from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replay.serving.sse import DONE, ProtocolError, SSEDecoder

STREAM = (
    b'data: {"choices":[{"delta":{"content":"he"}}]}\n\n'
    b": keep-alive comment\n\n"
    b'data: {"choices":[{"delta":{"content":"llo"}}]}\r\n\r\n'
    b"event: message\nid: 7\n"
    b'data: {"a":\ndata: 1}\n\n'
    b"data: [DONE]\n\n"
)
EXPECTED = [
    {"choices": [{"delta": {"content": "he"}}]},
    {"choices": [{"delta": {"content": "llo"}}]},
    {"a": 1},
    DONE,
]


def decode(chunks: list[bytes]) -> list[object]:
    d = SSEDecoder()
    out: list[object] = []
    for c in chunks:
        out.extend(d.feed(c))
    out.extend(d.close())
    return out


def test_whole_stream() -> None:
    assert decode([STREAM]) == EXPECTED


@pytest.mark.parametrize("cut", range(1, len(STREAM)))
def test_split_anywhere_gives_the_same_events(cut: int) -> None:
    assert decode([STREAM[:cut], STREAM[cut:]]) == EXPECTED


@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12))
def test_split_into_many_pieces(cuts: list[int]) -> None:
    bounds = sorted(set(cuts) | {0, len(STREAM)})
    chunks = [STREAM[a:b] for a, b in itertools.pairwise(bounds)]
    assert decode(chunks) == EXPECTED


@pytest.mark.parametrize("end", [b"\n", b"\r\n", b"\r"], ids=["LF", "CRLF", "CR"])
@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=10), mixed=st.booleans())
def test_every_line_end_the_spec_allows_gives_the_same_events(
    end: bytes, cuts: list[int], mixed: bool
) -> None:
    """A server that ends its lines with CRLF, LF or a bare CR (the SSE spec allows all
    three, mixed too), cut into reads anywhere (a CRLF split between two reads included)."""
    lines = STREAM.replace(b"\r\n", b"\n").split(b"\n")
    ends = [b"\n", b"\r\n", b"\r"] if mixed else [end]
    stream = b"".join(line + ends[i % len(ends)] for i, line in enumerate(lines[:-1]))
    bounds = sorted({c for c in cuts if c < len(stream)} | {0, len(stream)})
    assert decode([stream[a:b] for a, b in itertools.pairwise(bounds)]) == EXPECTED


def test_a_crlf_split_between_reads_is_one_line_end() -> None:
    """Not a blank line: the event's second data line is not cut off from its first."""
    assert decode([b'data: {"a":\r', b"\ndata: 1}\r", b"\n\r\n"]) == [{"a": 1}]
    assert decode([b'data: {"a": 1}\r', b"\r"]) == [{"a": 1}]


def test_one_event_per_read_gives_the_same_events() -> None:
    """How servers usually stream: each read is one whole event (the decoder's fast path)."""
    events = [e + b"\n\n" for e in STREAM.split(b"\n\n") if e]
    assert b"".join(events) == STREAM
    assert decode(events) == EXPECTED
    assert decode([b'data: {"x": 1}\n\n', b'data: {"x": 2}\n', b"\n"]) == [{"x": 1}, {"x": 2}]


def test_bad_json_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="bad JSON"):
        decode([b"data: {not json}\n\n"])


def test_last_event_without_blank_line_counts() -> None:
    assert decode([b'data: {"x": 1}']) == [{"x": 1}]


@given(st.binary(max_size=300))
def test_arbitrary_bytes_never_crash_otherwise(data: bytes) -> None:
    try:
        decode([data])
    except ProtocolError:
        pass


def outcome(chunks: list[bytes], limit: int) -> tuple[list[object], str | None]:
    """The events and the error, if any, that a decoder with this limit gives."""
    d = SSEDecoder(max_event_bytes=limit)
    out: list[object] = []
    try:
        for c in chunks:
            out.extend(d.feed(c))
        out.extend(d.close())
    except ProtocolError as err:
        return out, str(err)
    return out, None


LINES = st.lists(
    st.one_of(
        st.integers(0, 40).map(lambda n: b'data: {"k": "' + b"x" * n + b'"}'),
        st.integers(0, 40).map(lambda n: b"data: " + b"y" * n),
        st.integers(0, 60).map(lambda n: b": " + b"c" * n),
        st.sampled_from([b"", b"", b"data: [DONE]", b"data:", b"event: x", b"\r"]),
    ),
    max_size=12,
)


@settings(max_examples=500, deadline=None)
@given(
    LINES,
    st.booleans(),
    st.integers(8, 48),
    st.lists(st.integers(min_value=0, max_value=700), max_size=12),
)
def test_the_cap_gives_the_same_outcome_however_the_stream_is_cut(
    lines: list[bytes], crlf: bool, limit: int, cuts: list[int]
) -> None:
    """A line or event over the limit is an error at the same place in the stream, whether
    it came in one read or was held across many (the held size is counted, not re-measured)."""
    stream = (b"\r\n" if crlf else b"\n").join(lines) + b"\n\n"
    bounds = sorted({c for c in cuts if c < len(stream)} | {0, len(stream)})
    chunks = [stream[a:b] for a, b in itertools.pairwise(bounds)]
    whole = outcome([stream], limit)
    assert outcome(chunks, limit) == whole
    assert outcome([bytes([b]) for b in stream], limit) == whole
    if whole[1] is None:  # under the cap it decodes as without one
        assert whole == outcome([stream], 1 << 20)


def test_the_cap_is_on_the_event_not_the_read() -> None:
    event = b'data: {"k": "' + b"x" * 20 + b'"}\n\n'
    line = len(event) - 2  # the limit is on a line's bytes before its newline
    assert outcome([event], line) == ([{"k": "x" * 20}], None)
    events, err = outcome([event], line - 1)
    assert events == [] and err is not None and err.startswith(f"SSE event over {line - 1} bytes")
    # Data fields joined: three 10-byte fields are 32 bytes with their newlines.
    multi = b"data: " + b"a" * 10 + b"\ndata: " + b"b" * 10 + b"\ndata: " + b"c" * 10 + b"\n\n"
    assert outcome([multi], 31)[1] == outcome([multi[:20], multi[20:45], multi[45:]], 31)[1]
    assert (outcome([multi], 31)[1] or "").startswith("SSE event over 31 bytes")
    assert (outcome([multi], 32)[1] or "").startswith("bad JSON")  # within the cap: parsed


def test_an_event_of_endless_empty_data_lines_is_bounded() -> None:
    from replay.serving.sse import MAX_DATA_LINES

    events, err = outcome([b"data:\n" * (MAX_DATA_LINES + 1)], 1 << 30)
    assert events == [] and err == f"SSE event of over {MAX_DATA_LINES} data lines"
