"""The HTML report in a real browser: headless Chromium (Debian's ``chromium`` package), offline.

Chromium renders the report of a run directory built from scratch (see ``make_run_dir``) from
a file:// URL with networking features off. The rendered DOM must show the verdict and every
section, explicit and derived grades side by side with "need N" only where a bucket is still
open, the teacher-forced warning, and the script payloads planted in a trace prompt, a model
answer and a checker reason must be text: no element made from them, and the page title
untouched. The screenshot is kept
as tests/artifacts/report.png.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from replay.present.report import write_reports
from tests.conftest import ROOT
from tests.unit.present.test_report import PAYLOAD, SECTION_IDS, make_run_dir

ARTIFACTS = ROOT / "tests" / "artifacts"
CHROMIUM = shutil.which("chromium")
TIMEOUT_S = 60

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="needs Debian's chromium package (apt-get install chromium)"
)


def chromium(profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-extensions",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    root = tmp_path_factory.mktemp("browser")
    html_path, _ = write_reports(make_run_dir(root, unlabeled=10))
    url = html_path.resolve().as_uri()
    dom = chromium(root / "profile-dom", "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "report.png"
    shot.unlink(missing_ok=True)
    snap = chromium(
        root / "profile-shot",
        f"--screenshot={shot}",
        "--window-size=1400,3000",
        "--hide-scrollbars",
        url,
    )
    assert snap.returncode == 0, snap.stderr[-2000:]
    return dom.stdout, shot


def test_verdict_and_sections_render(rendered: tuple[str, Path]) -> None:
    dom, _ = rendered
    assert "<title>kvcanary run1: CALIBRATE</title>" in dom
    assert re.search(r'<section id="verdict"[^>]*>\s*<div class="word">CALIBRATE</div>', dom)
    for sid in SECTION_IDS:
        assert f'<section id="{sid}"' in dom, sid
    assert dom.count("<svg") == 5
    assert "not measured in this run" not in dom


def test_planted_payloads_are_text(rendered: tuple[str, Path]) -> None:
    dom, _ = rendered
    assert "<script" not in dom.lower()  # no element was made from a payload
    assert "<img" not in dom.lower()
    assert "pwned" not in dom.split("</title>")[0]  # nothing ran
    requests = dom[dom.index('<section id="requests"') :]
    escaped = PAYLOAD.replace("<", "&lt;").replace(">", "&gt;")
    assert requests.count(escaped) == 5  # r0's prompt, fp8's answer, three checker reasons
    assert '<pre class="text prompt">' in requests
    assert re.search(r'<pre class="text answer">Sure: ' + re.escape(escaped), requests)


def test_screenshot_saved(rendered: tuple[str, Path]) -> None:
    _, shot = rendered
    assert shot.is_file()
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert shot.stat().st_size > 20_000  # a rendered page, not a blank one


def test_quality_shows_derived_grades_need_n_where_open_and_the_warning(
    rendered: tuple[str, Path],
) -> None:
    dom, _ = rendered
    quality = dom[dom.index('<section id="quality"') : dom.index('<section id="systems"')]
    assert "Derived from the reference" in quality
    assert "(4/10)" in quality and "40 (30 + 10)" in quality  # fp8's derived grades in 256-1K
    # "need N" in the open cells only (fp8 in <256, the control in both buckets), never
    # beside fp8's established loss in 256-1K.
    assert len(re.findall(r">at least \d+ needed</td>", quality)) == 3
    assert re.search(r"<td>fp8</td><td>256-1K</td>(?:(?!</tr>).)*>loss shown</td>", quality)
    verdict = dom[dom.index('<section id="verdict"') : dom.index('<section id="serving"')]
    assert "teacher-forced ΔNLL +0.800/token" in verdict and "early warning" in verdict
