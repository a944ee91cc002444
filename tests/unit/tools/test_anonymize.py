"""Anonymization of the planted corpus: fully scrubbed, pseudonyms consistent (so checks on
scrubbed records still pass), a re-scan clean; how records (JSON strings, keys, regex
patterns, numbers) and files (bad lines, the anonymized mark, line numbers) are handled."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from replay.checkers import Answer, parse_check
from replay.core.errors import TraceError
from replay.core.records import ToolCall
from replay.tools.anonymize import (
    KINDS,
    PLACEHOLDER,
    Anonymizer,
    anonymize_file,
    is_scanned,
    scan_file,
    scan_record,
    scan_text,
)
from replay.traces.trace import parse_line
from tests.unit.tools.planted import (
    CARD_INT,
    CARDS,
    EMAILS,
    IBANS,
    IPV4,
    JWTS,
    KEYS,
    PHONES,
    PLANTED,
    ROOT,
    SECRET,
    URLS,
    corpus,
    ph,
    records,
    write_jsonl,
)


@pytest.fixture()
def scrubbed(tmp_path: Path) -> tuple[Path, Path, dict[str, int]]:
    src = write_jsonl(tmp_path / "raw.jsonl", corpus())
    dst = tmp_path / "clean.jsonl"
    return src, dst, anonymize_file(src, dst, SECRET)


# -- the planted corpus -------------------------------------------------------------------------


def test_every_planted_kind_has_three_examples() -> None:
    for kind in KINDS:
        assert sum(k == kind for k, _, _ in PLANTED) >= 3, kind


@pytest.mark.parametrize(("kind", "text", "secret"), PLANTED, ids=[p[1][:24] for p in PLANTED])
def test_each_planted_item_is_detected_with_its_span(kind: str, text: str, secret: str) -> None:
    sentence = f"note: {text} (end)"
    found = scan_text(sentence)
    assert [f.kind for f in found] == [kind]
    assert sentence[found[0].start : found[0].end] == secret
    assert secret not in found[0].excerpt


def test_planted_corpus_is_fully_scrubbed(scrubbed: tuple[Path, Path, dict[str, int]]) -> None:
    src, dst, counts = scrubbed
    data = dst.read_bytes()
    for _kind, _text, secret in PLANTED:
        for form in {secret, json.dumps(secret)[1:-1], re.sub(r"\D", "", secret)}:
            if len(form) >= 6:
                assert form.encode() not in data, form
    assert str(CARD_INT).encode() in data  # only inside the token-id prompt
    assert records(dst)["tokens-1"]["prompt"] == [5, CARD_INT, 7]
    assert records(dst)["meta-1"]["meta"]["card_number"] == ph(str(CARD_INT))
    assert scan_file(dst) == (len(corpus()), [])
    assert all(counts[k] >= 3 for k in KINDS), counts
    lines, found = scan_file(src)
    assert lines == len(corpus()) and {f.kind for _, f in found} == set(KINDS)


def test_scrubbed_trace_is_valid_and_marked(scrubbed: tuple[Path, Path, dict[str, int]]) -> None:
    src, dst, _ = scrubbed
    for i, line in enumerate(dst.read_text().splitlines(), start=1):
        req = parse_line(line, str(dst), i)
        assert req.meta["anonymized"] == {"by": "kvcanary", "version": 1}
    assert is_scanned(dst) and not is_scanned(src)


def test_same_value_same_placeholder_everywhere(
    scrubbed: tuple[Path, Path, dict[str, int]],
) -> None:
    out = records(scrubbed[1])
    rec = out["support-1"]
    p_email, p_card = ph(EMAILS[0]), ph(CARDS[0])
    for text in (rec["messages"][0]["content"], rec["messages"][1]["content"]):
        assert p_email in text
    args = json.loads(rec["messages"][2]["tool_calls"][0]["function"]["arguments"])
    assert args["to"] == p_email and args["card"] == p_card and ph(JWTS[0]) in args["note"]
    assert rec["check"]["calls"][0]["arguments"] == {"to": p_email, "card": p_card}
    assert out["contains-1"]["check"]["values"] == [ph(EMAILS[1]), ph(IBANS[1])]
    assert ph(EMAILS[1]) in out["completion-1"]["prompt"]  # across records too
    assert rec["tools"][0]["function"]["description"].startswith(
        f"Send mail via {Anonymizer(SECRET).scrub_text(URLS[0][0])[0]};"
    )
    assert ph(URLS[0][0]) == Anonymizer(SECRET).placeholder("url_credentials", URLS[0][1])
    assert rec["meta"]["user"] == ph(EMAILS[2]) and rec["meta"]["client_ip"] == ph(IPV4[1])
    assert rec["messages"][3]["tool_call_id"] == rec["messages"][2]["tool_calls"][0]["id"]
    # Different values never share a placeholder; one value in two formats does.
    distinct = {ph(text) for _, text, _ in PLANTED}
    assert len(distinct) == len(PLANTED)
    assert ph("+1 415 555 0132") == ph("+14155550132") == ph(PHONES[0])
    assert ph("4111-1111-1111-1111") == ph(CARDS[0]) and ph("Alice.Smith@Corp-Mail.com") == ph(
        EMAILS[0]
    )


def _grade(check: dict[str, Any], text: str, calls: tuple[ToolCall, ...] = ()) -> bool:
    return parse_check(check).grade(Answer(text=text, tool_calls=calls)).passed


def _copy(message: str, value: str) -> str:
    """The placeholder for ``value``, copied out of the scrubbed message as a model would."""
    want = ph(value)
    found = [m.group(0) for m in PLACEHOLDER.finditer(message) if m.group(0) == want]
    assert found, (value, message)
    return found[0]


def test_checks_still_pass_on_scrubbed_records(scrubbed: tuple[Path, Path, dict[str, int]]) -> None:
    out = records(scrubbed[1])
    user = {rid: r["messages"][-1]["content"] for rid, r in out.items() if r.get("messages")}
    user["support-1"] = out["support-1"]["messages"][1]["content"]
    call = ToolCall(
        index=0,
        name="send_email",
        arguments=json.dumps(
            {"to": _copy(user["support-1"], EMAILS[0]), "card": _copy(user["support-1"], CARDS[0])}
        ),
    )
    assert _grade(out["support-1"]["check"], "", (call,))
    email, iban = _copy(user["contains-1"], EMAILS[1]), _copy(user["contains-1"], IBANS[1])
    assert _grade(out["contains-1"]["check"], f"Address {email}, IBAN {iban}.")
    phone = _copy(user["retrieval-1"], PHONES[2])
    assert _grade(out["retrieval-1"]["check"], f"[P0] says the billing phone is {phone}.")
    assert _grade(out["exact-1"]["check"], _copy(user["exact-1"], CARDS[1]))
    assert _grade(out["regex-1"]["check"], f"That is {_copy(user['regex-1'], EMAILS[2])}.")
    token = _copy(user["json-1"], KEYS[2])
    assert _grade(out["json-1"]["check"], json.dumps({"token": token}))
    assert not _grade(out["contains-1"]["check"], f"Address {EMAILS[1]}, IBAN {IBANS[1]}.")
    assert ph(CARDS[2]) in out["code-1"]["check"]["tests"]
    compile(out["code-1"]["check"]["tests"], "<tests>", "exec")


def test_checks_pass_on_the_raw_records_too() -> None:
    """The same answers in raw form pass the raw checks: scrubbing kept what the check means."""
    raw = {r["id"]: r for r in corpus()}
    assert _grade(raw["contains-1"]["check"], f"Address {EMAILS[1]}, IBAN {IBANS[1]}.")
    assert _grade(raw["regex-1"]["check"], f"That is {EMAILS[2]}.")
    assert _grade(raw["retrieval-1"]["check"], f"[P0] says {PHONES[2]}.")


def test_finding_fields_name_the_json_path() -> None:
    found = scan_record(corpus()[0])
    fields = {f.field for f in found}
    assert "messages.2.tool_calls.0.function.arguments#to" in fields
    assert "messages.3.content#server" in fields
    assert "tools.0.function.parameters.properties.to.description" in fields
    assert "check.calls.0.arguments.card" in fields and "meta.session_token" in fields
    text = corpus()[0]["messages"][1]["content"]
    for f in found:
        if f.field == "messages.1.content":
            assert scan_text(text[f.start : f.end])[0].kind == f.kind


def test_secret_keys_pseudonyms() -> None:
    a, b = Anonymizer(b"one"), Anonymizer(b"two")
    text = f"mail {EMAILS[0]} card {CARDS[0]}"
    assert a.scrub_text(text)[0] == Anonymizer(b"one").scrub_text(text)[0]
    assert a.scrub_text(text)[0] != b.scrub_text(text)[0]
    with pytest.raises(ValueError, match="secret"):
        Anonymizer(b"")


# -- record handling ----------------------------------------------------------------------------


def test_json_arguments_with_escapes_are_parsed() -> None:
    rec = {
        "id": "x",
        "messages": [
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "function": {
                            "name": "f",
                            "arguments": '{"to": "alice\\u0040corp.com", "n": 3}',
                        }
                    }
                ],
            }
        ],
    }
    out, found = Anonymizer(SECRET).scrub_record(rec)
    args = out["messages"][0]["tool_calls"][0]["function"]["arguments"]
    assert json.loads(args) == {"to": ph("alice@corp.com"), "n": 3}
    assert [f.field for f in found] == ["messages.0.tool_calls.0.function.arguments#to"]


def test_unchanged_json_strings_keep_their_bytes() -> None:
    args = '{ "city":"Paris",\n "days": 2 }'
    rec = {"id": "x", "messages": [{"role": "user", "content": args}]}
    assert Anonymizer(SECRET).scrub_record(rec) == (rec, [])


def test_keys_are_kept_unless_a_key_is_itself_detected() -> None:
    rec = {"id": "x", "meta": {"owners": {EMAILS[0]: "admin", "team": "infra"}}}
    out, found = Anonymizer(SECRET).scrub_record(rec)
    assert out["meta"]["owners"] == {ph(EMAILS[0]): "admin", "team": "infra"}
    assert found[0].field == f"meta.owners.{ph(EMAILS[0])}(key)"


def test_regex_pattern_escapes_are_seen_through() -> None:
    pattern = r"^Mail (alice\.smith@corp\.com)\.$"
    rec: dict[str, Any] = {"id": "x", "check": {"type": "regex", "pattern": pattern}}
    out, found = Anonymizer(SECRET).scrub_record(rec)
    scrubbed = out["check"]["pattern"]
    assert scrubbed == rf"^Mail ({ph('alice.smith@corp.com')})\.$"
    assert re.search(scrubbed, f"Mail {ph('alice.smith@corp.com')}.")
    assert rec["check"]["pattern"][found[0].start : found[0].end] == r"alice\.smith@corp\.com"
    assert found[0].field == "check.pattern"


def test_number_checks_and_top_level_numbers_are_untouched() -> None:
    rec = {"id": "x", "t": 1.5, "max_tokens": 16, "check": {"type": "number", "value": CARD_INT}}
    assert Anonymizer(SECRET).scrub_record(rec) == (rec, [])


def test_spans_are_in_the_input_when_a_second_pass_is_needed() -> None:
    # The e-mail wins the overlap with the high-entropy run; the run's tail is found next.
    text = f"see {EMAILS[0]}/Zq8Xv3Lm9Tp2Rw7Ks4Nd6Hb1Gf5Jc0Ya ok"
    out, found = Anonymizer(SECRET).scrub_text(text)
    assert [(f.kind, text[f.start : f.end]) for f in found] == [
        ("email", EMAILS[0]),
        ("high_entropy", "Zq8Xv3Lm9Tp2Rw7Ks4Nd6Hb1Gf5Jc0Ya"),
    ]
    assert scan_text(out) == []


# -- files --------------------------------------------------------------------------------------


def test_anonymize_file_rejects_a_bad_line_and_writes_nothing(tmp_path: Path) -> None:
    src = tmp_path / "raw.jsonl"
    src.write_text('{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n\n{oops\n')
    dst = tmp_path / "out.jsonl"
    with pytest.raises(TraceError, match=r"raw.jsonl:3"):
        anonymize_file(src, dst, SECRET)
    assert not dst.exists() and list(tmp_path.iterdir()) == [src]


def test_is_scanned(tmp_path: Path) -> None:
    marked = {
        "id": "a",
        "messages": [{"role": "user", "content": "hi"}],
        "meta": {"anonymized": {"by": "kvcanary", "version": 1}},
    }
    good = write_jsonl(tmp_path / "good.jsonl", [marked, marked | {"id": "b"}])
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [marked, {"id": "b", "messages": []}])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert is_scanned(good)
    assert not is_scanned(mixed) and not is_scanned(empty)
    assert is_scanned(ROOT / "traces" / "sample.jsonl")  # shipped through anonymize


def test_scan_file_reports_line_numbers_and_scans_non_json_lines(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(f'{{"id": "a", "meta": {{"ip": "{IPV4[0]}"}}}}\n\nnot json {EMAILS[0]}\n')
    lines, found = scan_file(path)
    assert lines == 2
    assert [(n, f.kind, f.field) for n, f in found] == [
        (1, "ipv4", "meta.ip"),
        (3, "email", "(line)"),
    ]
