"""The KV-format advisor's tables in docs/kvcal.md, from the reports that measured them.

    python bench/advisor.py record NAME REPORT.json [--machine TEXT] -- kvcal emulate ...
    python bench/advisor.py            # rewrite docs/kvcal.md's blocks from the results file
    python bench/advisor.py --check    # exit 1 when a block is stale

``record`` keeps one ``kvcal emulate --json`` report (its settings, results and what the
advice reads; no path and no per-request rows) in ``bench/results/advisor_NAME.json``, with
the command that wrote it as a user types it (no output file of this machine) and the machine
it ran on: this one, or for a report made elsewhere ``--machine``'s words, with the report
file's time as the run's date.
docs/kvcal.md holds one block per NAME, between ``<!-- generated: bench/advisor.py NAME -->``
and ``<!-- end advisor NAME -->``: the command, then the table and the advice that
``kvcal emulate --markdown`` writes, rendered by kvcal's own functions from the recorded
report alone (the advice is computed again, so its wording is the code's of today, its
figures the run's).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path
from typing import Any

import _blocks
import orjson
from _machine import describe

BENCH = Path(__file__).resolve().parent
DOC = BENCH.parent / "docs" / "kvcal.md"
RESULTS = BENCH / "results"
KEPT = (
    "emulated",
    "caveat",
    "interval",
    "device",
    "dtype",
    "rounding",
    "formats",
    "tolerance",
    "min_loss",
    "layers",
    "kv_heads",
    "head_dim",
    "sampling",
    "notes",
    "reference",
    "settings",
    "results",
    "seconds",
)
OUTPUT_FLAGS = ("--json", "--markdown")  # files of the machine that ran it


def begin(name: str) -> str:
    return f"<!-- generated: bench/advisor.py {name} -->"


def end(name: str) -> str:
    return f"<!-- end advisor {name} -->"


def user_command(argv: list[str]) -> str:
    """The command as a user types it: no output file of this machine."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in OUTPUT_FLAGS:
            skip = True
        else:
            out.append(arg)
    return " ".join(out)


def wrapped(command: str, width: int = 96) -> str:
    """A shell command cut into continued lines (an option stays with its value)."""
    words = command.split(" ")
    parts = []  # an option with its value, or a lone word
    for word in words:
        if (
            parts
            and parts[-1].startswith("--")
            and " " not in parts[-1]
            and not word.startswith("--")
        ):
            parts[-1] += " " + word
        else:
            parts.append(word)
    lines, line = [], ""
    for part in parts:
        if line and len(line) + 1 + len(part) > width:
            lines.append(line)
            line = "  " + part
        else:
            line = f"{line} {part}" if line else part
    return " \\\n".join([*lines, line])


def render(entry: dict[str, Any]) -> str:
    """One block: the command, the Markdown table and the advice (kvcal's own renderers)."""
    sys.path.insert(0, str(BENCH.parent))
    from kvcal.cli.tables import emulation_markdown
    from kvcal.emulate.advice import advise

    report = dict(entry["report"])
    report["advice"] = advise(report)
    lines = [f"- {line}" for line in report["advice"]["lines"]]
    command = wrapped(entry["command"])
    m = entry["machine"]
    where = f"{m['date'][:10]}, {m['cpu_model']}" + (f", {m['nproc']} cores" if m["nproc"] else "")
    return (
        f"```bash\n{command}\n```\n\n"
        + emulation_markdown(report)
        + ("\n" + "\n".join(lines) + "\n" if lines else "")
        + f"\nThe run took {report['seconds']:.0f} s ({where}).\n"
    )


def rewrite(text: str, results: dict[str, Any]) -> str:
    for name, entry in results.items():
        text = _blocks.rewrite(text, begin(name), end(name), render(entry), DOC)
    return text


def load() -> dict[str, Any]:
    """Every recorded report, by model name."""
    return {
        p.stem.removeprefix("advisor_"): orjson.loads(p.read_bytes())
        for p in sorted(RESULTS.glob("advisor_*.json"))
    }


def record(name: str, report_path: Path, argv: list[str], machine: str | None) -> None:
    report = orjson.loads(report_path.read_bytes())
    here = describe(("torch", "transformers"))
    if machine is not None:
        ran = dt.datetime.fromtimestamp(report_path.stat().st_mtime, dt.UTC)
        here = {"date": ran.isoformat(timespec="seconds"), "cpu_model": machine, "nproc": None}
    entry = {
        "bench": "advisor",
        "name": name,
        "command": user_command(argv),
        "machine": here,
        "report": {k: report[k] for k in KEPT if k in report},
    }
    path = RESULTS / f"advisor_{name}.json"
    path.write_bytes(orjson.dumps(entry, option=orjson.OPT_INDENT_2) + b"\n")


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["record"]:
        if "--" not in args:
            sys.exit("record NAME REPORT.json -- kvcal emulate ... (the command that wrote it)")
        cut = args.index("--")
        rec = argparse.ArgumentParser(prog="advisor.py record")
        rec.add_argument("name")
        rec.add_argument("report", type=Path)
        rec.add_argument("--machine", help="where the report was made, if not on this machine")
        a = rec.parse_args(args[1:cut])
        record(a.name, a.report, args[cut + 1 :], a.machine)
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 if stale")
    a = ap.parse_args(args)
    text = DOC.read_text(encoding="utf-8")
    new = rewrite(text, load())
    if a.check:
        if new != text:
            sys.exit(f"{DOC}: an advisor block is stale; run python bench/advisor.py")
        return
    DOC.write_text(new, encoding="utf-8")


if __name__ == "__main__":
    main()
