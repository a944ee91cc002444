"""Importers on the real public traces, unchanged; and synthesis of exact-length prompts."""

from __future__ import annotations

from pathlib import Path

import pytest

from replay.core.errors import TraceError
from replay.core.importers import LengthPolicy, load, sniff_format
from replay.core.synth import TokenPool, synthesize

from .conftest import SHARED_DATA

MOONCAKE = SHARED_DATA / "mooncake_conversation_trace.jsonl"
AZURE = SHARED_DATA / "azure_llm_2023_conv.csv"
needs_data = pytest.mark.skipif(not MOONCAKE.exists(), reason="shared trace data not present")


@needs_data
def test_mooncake_whole_file_imports() -> None:
    assert sniff_format(MOONCAKE) == "mooncake"
    loaded = load(MOONCAKE)
    assert len(loaded.requests) == 12031 and not loaded.bad
    first = loaded.requests[0]
    # {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0..13]}
    assert first.synth is not None
    assert (first.synth.input_tokens, first.max_tokens, first.t) == (6758, 500, 0.0)
    assert first.synth.hash_ids == tuple(range(14)) and first.synth.block_tokens == 512
    assert first.api == "completions" and first.params == {"ignore_eos": True}
    ts = [r.t or 0.0 for r in loaded.requests]
    assert ts == sorted(ts) and ts[-1] > 3000  # one hour of traffic, in seconds


@needs_data
def test_azure_whole_file_imports() -> None:
    assert sniff_format(AZURE) == "azure"
    loaded = load(AZURE)
    rows = sum(1 for line in AZURE.open() if line.strip()) - 1  # minus the header
    assert rows > 19000 and len(loaded.requests) == rows and not loaded.bad
    a, b = loaded.requests[:2]
    # 2023-11-16 18:15:46.6805900,374,44 then 18:15:50.9951690,396,109
    assert (a.input_tokens, a.max_tokens, a.t) == (374, 44, 0.0)
    assert b.t == pytest.approx(4.314579, abs=1e-6)
    assert a.synth is not None and a.synth.hash_ids == ()


@needs_data
def test_length_policy_scales_blocks_and_caps() -> None:
    policy = LengthPolicy(scale=0.25, max_input_tokens=1000, max_output_tokens=16)
    first = load(MOONCAKE, policy=policy).requests[0]
    assert first.synth is not None
    assert first.synth.block_tokens == 128
    assert first.synth.input_tokens == 1000  # 6758 * 0.25 = 1690, capped
    assert first.synth.hash_ids == tuple(range(8))  # ceil(1000 / 128) blocks
    assert first.max_tokens == 16
    assert first.meta["orig_input_tokens"] == 6758


def test_bad_rows_name_line_and_field(tmp_path: Path) -> None:
    mc = tmp_path / "m.jsonl"
    mc.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}\n'
        '{"timestamp": -5, "input_length": 10, "output_length": 5}\n'
        '{"timestamp": 1, "input_length": "ten", "output_length": 5}\n'
        '{"timestamp": 1, "input_length": 10, "output_length": 5, "hash_ids": "x"}\n'
    )
    loaded = load(mc, "mooncake", on_bad_line="skip")
    assert len(loaded.requests) == 1
    assert [(e.line, e.field) for e in loaded.bad] == [
        (2, "timestamp"),
        (3, "input_length"),
        (4, "hash_ids"),
    ]
    az = tmp_path / "a.csv"
    az.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,10,5\n"
        "yesterday,10,5\n2023-11-16 18:15:47,0,5\n"
    )
    loaded = load(az, "azure", on_bad_line="skip")
    assert [(e.line, e.field) for e in loaded.bad] == [(3, "TIMESTAMP"), (4, "ContextTokens")]
    wrong = tmp_path / "w.csv"
    wrong.write_text("time,in,out\n1,2,3\n")
    with pytest.raises(TraceError, match="missing column"):
        load(wrong, "azure")


BOM = b"\xef\xbb\xbf"
BOM_CASES = {
    "mooncake": b'{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}\n'
    b'{"timestamp": 5, "input_length": 20, "output_length": 5}\n',
    "azure": b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,10,5\n"
    b"2023-11-16 18:15:47,20,5\n",
    "v1": b'{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n'
    b'{"id": "b", "api": "completions", "prompt": "hi"}\n',
}


@pytest.mark.parametrize("fmt", list(BOM_CASES))
@pytest.mark.parametrize("given", ["auto", "named"])
def test_a_byte_order_mark_is_accepted(fmt: str, given: str, tmp_path: Path) -> None:
    """Files saved by Excel or Windows editors start with a UTF-8 BOM: the format is still
    recognised and the first record is still read."""
    path = tmp_path / ("t.csv" if fmt == "azure" else "t.jsonl")
    path.write_bytes(BOM + BOM_CASES[fmt])
    assert sniff_format(path) == fmt
    loaded = load(path, fmt if given == "named" else "auto")
    assert not loaded.bad and len(loaded.requests) == 2
    first = {"mooncake": "mooncake-1", "azure": "azure-2", "v1": "a"}[fmt]
    assert loaded.requests[0].id == first


POOL = TokenPool(range(100, 400))


def synth_req(rid: str, n: int, hash_ids: list[int], block: int = 16):  # type: ignore[no-untyped-def]
    from replay.core.trace import Request, Synth

    return Request(
        id=rid,
        api="completions",
        synth=Synth(input_tokens=n, hash_ids=tuple(hash_ids), block_tokens=block),
    )


def test_synth_exact_length_and_shared_prefixes() -> None:
    a = synthesize(synth_req("a", 40, [1, 2, 3]), POOL)
    b = synthesize(synth_req("b", 45, [1, 2, 9]), POOL)
    c = synthesize(synth_req("c", 40, [7, 2, 3]), POOL)
    assert (len(a), len(b), len(c)) == (40, 45, 40)
    assert a[:32] == b[:32] and a[32:] != b[32:40]  # two shared blocks, then different
    assert a[:16] != c[:16]
    assert synthesize(synth_req("a", 40, [1, 2, 3]), POOL) == a  # deterministic
    assert set(a) <= set(POOL.ids)


def test_synth_without_hash_ids_is_unique_per_request() -> None:
    a = synthesize(synth_req("x", 50, []), POOL)
    b = synthesize(synth_req("y", 50, []), POOL)
    assert len(a) == 50 and a[:16] != b[:16]
