from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from replay._sse import DONE, ProtocolError, SSEDecoder

STREAM = (
    b'data: {"choices":[{"delta":{"content":"he"}}]}\n\n'
    b": keep-alive comment\n\n"
    b'data: {"choices":[{"delta":{"content":"llo"}}]}\r\n\r\n'
    b"event: message\nid: 7\n"
    b'data: {"a":\ndata: 1}\n\n'
    b"data: [DONE]\n\n"
)
EXPECTED = [{"choices": [{"delta": {"content": "he"}}]},
            {"choices": [{"delta": {"content": "llo"}}]}, {"a": 1}, DONE]


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
