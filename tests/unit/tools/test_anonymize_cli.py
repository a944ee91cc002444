"""`replay trace anonymize` / `scan` from the command line, and the replay's warning; the hostile
corpus (tests/support/pii_corpus.py) through both commands."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT
from tests.support import pii_corpus

TEXT = "write to bob@corp.com from 10.1.2.3, key sk-abcdefghijklmnopqrstuvwx123456"
PII = {
    "id": "a",
    "messages": [{"role": "user", "content": TEXT}],
    "check": {"type": "contains", "values": ["bob@corp.com"]},
}


def replay(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "replay.cli", *args],
        cwd=ROOT,
        text=True,
        capture_output=True,
        timeout=120,
        env=env,
    )


def test_anonymize_then_scan(tmp_path: Path) -> None:
    import os

    src, dst = tmp_path / "raw.jsonl", tmp_path / "clean.jsonl"
    src.write_text(json.dumps(PII) + "\n")
    scan = replay("trace", "scan", str(src))
    assert scan.returncode == 1 and "email in messages.0.content" in scan.stdout
    assert "bob@corp.com" not in scan.stdout  # findings are masked
    env = {**os.environ, "KVC_TEST_SECRET": "k1"}
    out = replay(
        "trace", "anonymize", str(src), "-o", str(dst), "--secret-env", "KVC_TEST_SECRET", env=env
    )
    assert out.returncode == 0, out.stderr
    text = dst.read_text()
    for secret in ("bob@corp.com", "10.1.2.3", "sk-abcdefghijklmnopqrstuvwx123456"):
        assert secret not in text
    record = json.loads(text)
    placeholder = record["check"]["values"][0]
    assert placeholder in record["messages"][0]["content"]  # the check still holds
    assert replay("trace", "scan", str(dst)).returncode == 0
    missing = replay("trace", "anonymize", str(src), "-o", str(dst), "--secret-env", "NOPE_X")
    assert missing.returncode == 2 and "NOPE_X" in missing.stderr


def test_shipped_sample_is_scanned_and_clean() -> None:
    from replay.tools.anonymize import is_scanned, scan_file

    sample = ROOT / "traces" / "sample.jsonl"
    assert is_scanned(sample)
    assert scan_file(sample)[1] == []


def test_hostile_corpus_through_scan_and_anonymize(tmp_path: Path) -> None:
    """``scan`` reports every planted item on its line, as its kind; ``anonymize`` leaves a file
    that ``scan`` calls clean and that holds none of the planted values."""
    import os

    src, dst = tmp_path / "hostile.jsonl", tmp_path / "clean.jsonl"
    src.write_text(pii_corpus.jsonl(), encoding="utf-8")
    scan = replay("trace", "scan", str(src))
    assert scan.returncode == 1
    reported = scan.stdout.splitlines()
    for lineno, item in enumerate(pii_corpus.PLANTED, start=1):
        want = f"{src}:{lineno}: {item.kind} in {pii_corpus.field(item)}: "
        assert any(line.startswith(want) for line in reported), (item.name, want)
        assert item.secret not in scan.stdout  # findings are masked
    env = {**os.environ, "KVC_TEST_SECRET": "k2"}
    out = replay(
        "trace", "anonymize", str(src), "-o", str(dst), "--secret-env", "KVC_TEST_SECRET", env=env
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "nothing left" in out.stdout
    rescan = replay("trace", "scan", str(dst))
    assert rescan.returncode == 0 and rescan.stdout.strip().endswith("0 finding(s)")
    text = dst.read_text(encoding="utf-8")
    for line, item in zip(text.splitlines(), pii_corpus.PLANTED, strict=True):
        record = json.loads(line)
        inner = json.dumps(record, ensure_ascii=False)
        assert item.secret not in line and item.secret not in inner, item.name
