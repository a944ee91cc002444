"""``kvcal advise`` on the real model: its time and its advice, against an older kvcal.

    python bench/advise_speed.py --before 9f7052d      # that commit's kvcal at 2 a bucket first
    python bench/advise_speed.py --whole 2,6           # also by whole passes (35 min more)

The run docs/models.md records (SmolLM2, ``traces/real.jsonl``, buckets ``<1K``, ``1K-4K``,
``>=4K``, the calibrated overlay's held-out requests) is run at 2 and 6 requests a bucket as
kvcal now runs it. ``--before REV`` runs the same command first with the kvcal of commit REV
(a git worktree, the same Python) at the sizes ``--before-sizes`` names: the speed-up of a
change and whether its advice is the same (the action, the layers advised, the confirmed set,
the eight best-ranked layers), on one machine in one run. ``--whole`` runs it by whole passes
too (``--whole-passes``: every setting a whole pass over every request, as kvcal scored
before passes resumed at a layer), where every figure must agree. At 6 a bucket the advice
is also compared with the one docs/models.md records (``bench/results/real_model.json``,
scored by whole passes on another machine): the action and the confirmed set.

The overlay is calibrated first, as docs/models.md does (``kvcal sample --per-bucket 16``,
``kvcal calibrate``; ``--overlay`` gives one instead), and not timed. Each advise runs in its
own process; its wall time, its CPU time, and the CPU the rest of the machine used meanwhile
(a disturbed run says so) are kept, with the advice.

Writes ``bench/results/advise_speed.json``; ``python bench/tables.py`` puts its rows in
bench/README.md. About 30 minutes on 2 cores with ``--before`` at 2 a bucket.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

from _machine import describe, machine_busy_s  # noqa: E402

OUT = BENCH / "results" / "advise_speed.json"
KVCAL = [sys.executable, "-m", "kvcal.cli"]
TRACE = "traces/real.jsonl"
BUCKETS = "1K,4K"
COMPARED = ("settings", "ranking", "skip", "sliding_window", "next_step")
TARGET_S = {2: 600, 6: 900}  # issue 43: 2 a bucket in 10 minutes, 6 a bucket in 15


def _kvcal(*args: str) -> None:
    subprocess.run([*KVCAL, *args], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def calibrate(work: Path) -> Path:
    """The overlay docs/models.md calibrates: 16 samples a bucket, then kvcal calibrate."""
    _kvcal("sample", "real", "--trace", TRACE, "--buckets", BUCKETS, "--per-bucket", "16",
           "-o", str(work / "cal"))  # fmt: skip
    _kvcal("calibrate", "real", "--samples", str(work / "cal" / "samples.jsonl"),
           "-o", str(work / "overlay"))  # fmt: skip
    return work / "overlay"


def advise_args(per_bucket: int, overlay: str) -> list[str]:
    return ["advise", "real", "--trace", TRACE, "--buckets", BUCKETS,
            "--per-bucket", str(per_bucket), "--overlay", overlay]  # fmt: skip


def timed(args: list[str], out: Path, tree: Path = ROOT) -> dict[str, Any]:
    """One advise in its own process (kvcal as ``tree`` has it): wall, its CPU, the rest of
    the machine's CPU."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy0, t0 = machine_busy_s(), time.perf_counter()
    subprocess.run([*KVCAL, *args, "--json", str(out)], cwd=tree, check=True,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    others = max(0.0, machine_busy_s() - busy0 - cpu)
    doc = json.loads(out.read_text("utf-8"))
    return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "others_cpu_s": round(others, 1),
            "doc": doc}  # fmt: skip


def advice_of(doc: dict[str, Any]) -> dict[str, Any]:
    step = doc["next_step"]
    skip = doc.get("skip") or {}
    return {
        "action": step["action"],
        "skip_layers": step.get("skip_layers"),
        "confirmed_set": skip.get("skip_layers"),
        "confirmed_share": skip.get("recovered_share"),
        "top_ranked": [r["layer"] for r in doc.get("ranking", [])[:8]],
        "reasons": step["reasons"],
        "passes": doc.get("passes", "whole"),
    }


def recorded_advice(requests: dict[str, int]) -> dict[str, Any] | None:
    """The advice docs/models.md records, where it scored as many requests a bucket."""
    doc = json.loads((BENCH / "results" / "real_model.json").read_text("utf-8"))["advice"]
    if doc.get("requests") != requests:
        return None
    skip = doc.get("skip") or {}
    return {
        "action": doc["next_step"]["action"],
        "confirmed_set": skip.get("skip_layers"),
        "confirmed_share": skip.get("recovered_share"),
        "wall_s": doc.get("seconds"),
        "machine": json.loads((BENCH / "results" / "real_model.json").read_text("utf-8"))[
            "machine"
        ].get("cpu_model"),
    }


def checkout(rev: str, work: Path) -> tuple[Path, str]:
    """The project at ``rev`` in a worktree of its own (the "before" of a change), and the
    commit it is."""
    tree = work / "before"
    subprocess.run(["git", "worktree", "add", "--detach", str(tree), rev], cwd=ROOT, check=True,
                   capture_output=True)  # fmt: skip
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, check=True,
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    return tree, commit


def compare(
    per_bucket: int, overlay: str, work: Path, whole_too: bool, before: Path | None
) -> dict[str, Any]:
    args = advise_args(per_bucket, overlay)
    old = timed(args, work / f"before{per_bucket}.json", before) if before else None
    whole = (
        timed([*args, "--whole-passes"], work / f"whole{per_bucket}.json") if whole_too else None
    )
    resumed = timed(args, work / f"resumed{per_bucket}.json")
    drawn = resumed["doc"]["sampling"]["buckets"]
    requests = {label: b["drawn"] for label, b in drawn.items()}
    out: dict[str, Any] = {
        "per_bucket": per_bucket,
        "requests": requests,
        "command": "kvcal " + " ".join(args).replace(overlay, "OVERLAY"),
        "target_s": TARGET_S.get(per_bucket),
        "resumed": {k: v for k, v in resumed.items() if k != "doc"} | advice_of(resumed["doc"]),
    }
    if whole is not None:
        differ = [k for k in COMPARED if whole["doc"].get(k) != resumed["doc"].get(k)]
        out["whole"] = {k: v for k, v in whole.items() if k != "doc"} | advice_of(whole["doc"])
        out |= {
            "speedup": round(whole["wall_s"] / resumed["wall_s"], 2),
            "same_figures": not differ,
            "differ": differ,
        }
    if old is not None:
        mine, then = advice_of(resumed["doc"]), advice_of(old["doc"])
        out["before"] = (
            {k: v for k, v in old.items() if k != "doc"}
            | then
            | {
                "speedup": round(old["wall_s"] / resumed["wall_s"], 2),
                "same_action": then["action"] == mine["action"],
                "same_skip_layers": then["skip_layers"] == mine["skip_layers"],
                "same_confirmed_set": then["confirmed_set"] == mine["confirmed_set"],
                "same_top_ranked": then["top_ranked"] == mine["top_ranked"],
            }
        )
    recorded = recorded_advice(requests)
    if recorded is not None:
        mine = out["resumed"]
        out["recorded"] = recorded | {
            "same_action": recorded["action"] == mine["action"],
            "same_confirmed_set": recorded["confirmed_set"] == mine["confirmed_set"],
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--per-bucket", default="2,6", help="sizes to run, comma-separated")
    ap.add_argument("--whole", default="", help="sizes also run by whole passes")
    ap.add_argument("--before", metavar="REV", help="also run kvcal as commit REV has it ...")
    ap.add_argument("--before-sizes", default="2", help="... at these sizes, first")
    ap.add_argument("--overlay", help="a calibrated overlay to use (else calibrated here)")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="advise-speed-") as tmp:
        work = Path(tmp)
        overlay = a.overlay or str(calibrate(work))
        whole = {int(x) for x in a.whole.split(",") if x}
        tree, commit = checkout(a.before, work) if a.before else (None, None)
        before = {int(x) for x in a.before_sizes.split(",") if x} if tree else set()
        try:
            for n in (int(x) for x in a.per_bucket.split(",")):
                runs.append(compare(n, overlay, work, n in whole, tree if n in before else None))
                r = runs[-1]
                then, whole_s = r.get("before", {}), r.get("whole", {}).get("wall_s")
                print(f"{n} a bucket: {r['resumed']['wall_s']} s, before {then.get('wall_s')} s "
                      f"(same action {then.get('same_action')}), whole {whole_s} s, "
                      f"recorded {r.get('recorded')}", flush=True)  # fmt: skip
        finally:
            if tree is not None:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                               check=False)  # fmt: skip
    doc = {"machine": describe(("torch", "transformers")), "before_commit": commit, "runs": runs}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
