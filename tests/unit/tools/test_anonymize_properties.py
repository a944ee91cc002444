"""The anonymizer's properties: time stays linear on near-miss and finding-dense megabyte lines,
scrubbing never raises and is idempotent (text and records), Luhn-invalid card numbers are left
alone, and edited spans map back to the input as a walk of the edits would."""

from __future__ import annotations

import json
import time
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from replay.tools.anonymize import KINDS, _Edits
from tests.support import pii_corpus
from tests.unit.tools.planted import ANON, PLANTED

# -- bounded time -------------------------------------------------------------------------------

MB = 1_000_000
# Near misses: what each detector starts on, repeated, with nothing to find (or a little).
NEAR_MISS = [
    "-",
    "-----BEGIN-----\n",
    "A" * 64 + "\n",
    "MII\n",
    "eyJ",
    "sk-",
    "Bearer ",
    "key=",
    "password: ",
    '"token": "',
    "?token=a&",
    "a@",
    "a [at] b [dot] ",
    "ｊｏｈｎ＠",
    "1:",
    "1 1 1 1 1\n",
    "4111 1111\n",
    " ",
    "…",
]


def _seconds(text: str) -> float:
    start = time.perf_counter()
    ANON.scrub_text(text)
    return time.perf_counter() - start


def test_near_miss_megabyte_lines_take_linear_time() -> None:
    """A 1 MB line of near-miss characters costs a bounded multiple of a plain 1 MB line: no
    pattern backtracks catastrophically, nothing is quadratic (a regression reads as minutes)."""
    plain = min(
        _seconds(("the quick brown fox jumps over the lazy dog. " * 22300)[:MB]) for _ in range(2)
    )
    slow = {}
    for unit in NEAR_MISS:
        took = _seconds((unit * (MB // len(unit) + 1))[:MB])
        if took > 40 * plain:
            slow[unit] = round(took / plain, 1)
    assert slow == {}, f"plain 1 MB line: {plain:.3f}s; ratios {slow}"


def test_a_megabyte_of_findings_is_linear_too(tmp_path: Path) -> None:
    """Many replacements in one string (and a second pass over them) stay linear: spans map
    back through an index, not by walking every earlier replacement."""
    unit = "alice@corp.com/Zq8Xv3Lm9Tp2Rw7Ks4Nd6Hb1Gf5Jc0Ya "
    small, big = unit * 2000, unit * 8000
    ratio = _seconds(big) / max(_seconds(small), 1e-3)
    assert ratio < 12, ratio  # 4x the input: about 4x the time, never 16x


# -- properties ---------------------------------------------------------------------------------

GLUE = st.text(alphabet=st.sampled_from(list(" .,:;/@-_+=()[]{}\"'\n0123456789abcXYZ")), max_size=4)
FRAGMENT = st.one_of(
    st.sampled_from([text for _, text, _ in PLANTED] + [p.text for p in pii_corpus.PLANTED]),
    GLUE,
    st.text(max_size=8),
)


def _idempotent(text: str) -> None:
    out, found = ANON.scrub_text(text)
    assert ANON.scrub_text(out) == (out, [])
    for f in found:
        assert 0 <= f.start < f.end <= len(text) and f.kind in KINDS


@given(st.text())
def test_scrub_never_raises_and_is_idempotent(text: str) -> None:
    _idempotent(text)


@settings(max_examples=300)
@given(st.lists(FRAGMENT, max_size=8).map("".join))
def test_scrub_is_idempotent_on_glued_secrets(text: str) -> None:
    _idempotent(text)


@settings(max_examples=50)
@given(st.lists(FRAGMENT, max_size=6).map("".join))
def test_scrub_record_is_idempotent(text: str) -> None:
    rec = {
        "id": "x",
        "messages": [{"role": "user", "content": text}],
        "meta": {"args": json.dumps({"v": text})},
    }
    out, _ = ANON.scrub_record(rec)
    assert ANON.scrub_record(out) == (out, [])


def _luhn_ok(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch) * (2 if i % 2 else 1)
        total += d - 9 if d > 9 else d
    return total % 10 == 0


@given(
    st.integers(10**15, 10**16 - 1).filter(lambda n: not _luhn_ok(str(n))),
    st.sampled_from(["", " ", "-"]),
)
def test_luhn_invalid_card_numbers_are_left_alone(n: int, sep: str) -> None:
    digits = str(n)
    number = sep.join(digits[i : i + 4] for i in range(0, 16, 4))
    text = f"card {number} end"
    assert ANON.scrub_text(text) == (text, [])


@settings(max_examples=300)
@given(
    st.lists(st.tuples(st.integers(0, 40), st.integers(0, 6), st.integers(1, 12)), max_size=12),
    st.integers(0, 400),
    st.booleans(),
)
def test_edit_positions_map_back_like_a_walk(
    spec: list[tuple[int, int, int]], pos: int, is_end: bool
) -> None:
    """The indexed mapping agrees with walking the edits one by one."""
    edits, at = [], 0
    for gap, width, n in spec:
        edits.append((at + gap, at + gap + width, n))
        at += gap + width
    shift = 0
    want = None
    for s, e, n in edits:
        new_s = s + shift
        if pos < new_s or (is_end and pos == new_s):
            break
        if pos < new_s + n or (is_end and pos == new_s + n):
            want = e if is_end else s
            break
        shift += n - (e - s)
    assert _Edits(edits).back(pos, is_end) == (pos - shift if want is None else want)
