"""The figures table of ``bench/README.md``, generated from the committed ``bench/results/*.json``.

    python bench/tables.py           # rewrite the block between the markers in bench/README.md
    python bench/tables.py --check   # exit 1 when the README's block is not what this generates

Every row is one figure of one results file, with the file's run date and machine, so a
figure in the README is always one some run recorded. The block sits between
``<!-- generated: bench/tables.py -->`` and ``<!-- end generated -->``; the rest of the
README is prose and is left as it is. A results file of a kind this script does not know
is listed with its date, so nothing committed is silently left out.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _blocks
import _kvcal_gpu_figures
import orjson
from _kvcal_figures import nat

BENCH = Path(__file__).resolve().parent
README = BENCH / "README.md"
RESULTS = BENCH / "results"
BEGIN = "<!-- generated: bench/tables.py -->"
END = "<!-- end generated -->"
Row = tuple[str, str, str]  # figure, value, target


def _f(x: Any, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def shared_cores_rows(doc: dict[str, Any]) -> Iterator[Row]:
    """The shared-cores case (``--busy``): the client's ITL against the server's."""
    busy = doc["config"]["busy_processes"]
    for streams, per in doc["summary"].items():
        s = per["kvcanary"]
        client, server = _f(s.get("client_itl_p50_ms"), 3), _f(s.get("server_itl_p50_ms"), 3)
        value = (
            f"p50 {client} (server's {server}), {_f(s.get('zero_gaps'), 0)} gaps of 0 ms, "
            f"{_f(s.get('chunks_sharing_a_read'), 0)} chunks shared a read (medians over runs)"
        )
        what = f"{streams} streams, kvcanary, {busy} busy processes, unpinned: ITL ms"
        yield what, value, "no 0.00 ms gaps"


def client_overhead_rows(doc: dict[str, Any]) -> Iterator[Row]:
    if doc.get("config", {}).get("busy_processes"):
        yield from shared_cores_rows(doc)
        return
    for streams, per in doc["summary"].items():
        for client, s in per.items():
            if not isinstance(s, dict):
                continue
            ours = client == "kvcanary"  # the targets are the kvcanary client's
            if s.get("did_not_run"):
                yield f"{streams} streams, {client}", str(s["did_not_run"]), ""
                continue
            if "cpu_us_per_token" in s and s["cpu_us_per_token"] is not None:
                ratio = s.get("cpu_vs_bare")
                value = f"{_f(s['cpu_us_per_token'], 1)} us/token ({_f(ratio)}x bare)"
                target = "<= 1.15x bare" if ours else ""
                yield f"{streams} streams, {client}: CPU per token", value, target
            if s.get("ttft_error_mean_ms") is not None:
                value = f"{_f(s['ttft_error_mean_ms'])} mean, {_f(s.get('ttft_error_p99_ms'))} p99"
                target = "p99 <= 2" if ours else ""
                yield f"{streams} streams, {client}: TTFT error ms", value, target
            if ours and s.get("itl_abs_error_p99_ms") is not None:
                mean, p99 = s.get("itl_abs_error_mean_ms"), s["itl_abs_error_p99_ms"]
                value = f"{_f(mean)} mean, {_f(p99)} p99"
                yield f"{streams} streams, {client}: |ITL error| ms", value, "p99 <= 1"


def memory_rows(doc: dict[str, Any]) -> Iterator[Row]:
    for command, s in doc["summary"].items():
        if not isinstance(s, dict) or "peak_rss_mib" not in s:
            continue
        sizes = ", ".join(f"{n}: {v}" for n, v in s["peak_rss_mib"].items())
        ratio = next((v for k, v in s.items() if k.startswith("ratio_")), None)
        yield f"{command}: peak RSS MiB by records", f"{sizes} (ratio {_f(ratio)})", "flat"


def kvcal_rows(doc: dict[str, Any]) -> Iterator[Row]:
    s = doc["summary"]
    value = (
        f"{_f(s['overhead_ratio_median'], 3)}x CPU ({_f(s['overhead_ratio_wall_median'], 3)}x wall)"
    )
    yield "observer / plain forward", value, f"<= {s['target_ratio']}x"


def open_loop_rows(doc: dict[str, Any]) -> Iterator[Row]:
    s, c = doc["summary"], doc["config"]
    lag = s["lag_ms"]
    what = f"lag ms at {c['rate_rps']:g} rps x {c['duration_s']:g} s, --workers {c['workers']}"
    if "output" in c:  # the runs before 2026-12-02 (second session) wrote to a file
        what += f", output to {c['output']}"
    value = f"p50 {_f(lag['p50'], 3)}, p99 {_f(lag['p99'], 3)}, max {_f(lag['max'], 3)}"
    yield what, value + f" ({'met' if s['met'] else 'missed'})", s["target"]


def workers_rows(doc: dict[str, Any]) -> Iterator[Row]:
    s, c = doc["summary"], doc["config"]
    for n, per in s["per_workers"].items():
        value = (
            f"{per['requests_per_s']:.0f} req/s, {per['tokens_per_s']:.0f} tok/s; "
            f"server CPU {per['server_cpu_share']:.2f}, replay CPU {per['replay_cpu_per_span']:.2f}"
        )
        yield f"--workers {n}, closed loop c{c['concurrency']}", value, ""
    verdict = "met" if s["met"] else "missed"
    yield f"ratio {s['ratio_of']}", f"{s['ratio']:.2f}x ({verdict})", s["target"]


def locust_workers_rows(doc: dict[str, Any]) -> Iterator[Row]:
    """Locust's master and workers across network namespaces (``bench/locust_workers.py``)."""
    s, c = doc["summary"], doc["config"]
    for n, per in s["per_workers"].items():
        who = "one process" if n == "0" else f"{n} worker(s)"
        value = (
            f"{_f(per['requests_per_s'], 0)} req/s, {_f(per['client_cpu_us_per_token'], 1)} us "
            f"CPU/token; TTFT error p50 {_f(per['ttft_error_p50_ms'], 3)}, p99 "
            f"{_f(per['ttft_error_p99_ms'])} ms ({per['disturbed_runs']} run(s) disturbed)"
        )
        yield f"Locust, {who}, {c['users_per_worker']} users each", value, ""
    met = s["met"]
    verdict = "undecided: disturbed" if met is None else ("met" if met else "missed")
    gap = _f(s["ttft_p99_gap_ms"], 3)
    yield "Locust workers: TTFT error p99 gap to one process, ms", f"{gap} ({verdict})", s["target"]


def real_canary_rows(doc: dict[str, Any]) -> Iterator[Row]:
    s, run = doc["summary"], doc["runs"][-1]
    extra = " ".join(doc["config"]["extra"])
    what = f"{s['requests']} answers, real model, canary bf16,fp8 + control {extra}".rstrip()
    cap = s["capacity_phase"]
    # Scoring between the blocks is inside the phases: the decode rate is over the rest.
    serving = f"serving {s['serving_s']:.0f} s: " if s.get("serving_s") is not None else ""
    value = (
        f"{s['wall_s'] / 60:.1f} min (exit {run['exit_code']}): servers up "
        f"{s['servers_up_s']:.0f} s, phases {s['phases_s']:.0f} s ({serving}{s['output_tokens']:,} "
        f"tokens at {s['decode_tokens_per_s']} tok/s), teacher-forced "
        f"{s['teacher_forced_s']:.0f} s ({s['teacher_forced_share_of_phases']:.0%} of serving), "
        f"capacity phase {cap['status']} "
        f"after {cap['requests_answered']} answers"
    )
    yield what, value + f" ({'met' if s['met'] else 'missed'})", "<= 12 min"


def real_model_rows(doc: dict[str, Any]) -> Iterator[Row]:
    """The real model's figures (``bench/real_model.py`` renders them in docs/models.md)."""
    for phase, per in doc["aa"]["phases"].items():
        rows = per["bf16-control"].values()
        same = sum(round((r["identical"] or 0) * (r["compared"] or 0)) for r in rows)
        total = sum(r["compared"] or 0 for r in rows)
        yield f"real model, A/A {phase}: answers identical", f"{same}/{total}", ""
    c = doc["canary"]
    yield "real model, canary bf16,fp8", f"{c['verdict']} (exit {c['exit_code']})", ""
    step = doc["advice"]["next_step"]
    yield "real model, kvcal advise", f"{step['action']}: {step['reasons'][0]}", ""


def advise_speed_rows(doc: dict[str, Any]) -> Iterator[Row]:
    """``kvcal advise`` on the real model against an older kvcal and whole passes
    (``bench/advise_speed.py``): the times, and whether the advice and its figures agree."""
    for r in doc["runs"]:
        n = sum(r["requests"].values())
        f = r["resumed"]
        value = f"{f['wall_s'] / 60:.1f} min, {f['action']}"
        b = r.get("before")
        if b is not None:
            same = [k for k in ("action", "skip_layers", "confirmed_set", "top_ranked")
                    if b[f"same_{k}"]]  # fmt: skip
            differ = [k for k in ("action", "skip_layers", "confirmed_set", "top_ranked")
                      if not b[f"same_{k}"]]  # fmt: skip
            value += (
                f"; at {doc['before_commit']} {b['wall_s'] / 60:.1f} min ({b['speedup']:.2f}x)"
                + (f", the same {', '.join(same).replace('_', ' ')}" if same else "")
                + "".join(f"; {k.replace('_', ' ')} {b[k]} there, {f[k]} here" for k in differ)
            )
        w = r.get("whole")
        if w is not None:
            same = "same figures" if r["same_figures"] else f"differ in {', '.join(r['differ'])}"
            value += f"; whole passes {w['wall_s'] / 60:.1f} min ({r['speedup']:.2f}x), {same}"
        rec = r.get("recorded")
        if rec is not None:
            action = "the same action" if rec["same_action"] else f"not {rec['action']}"
            kept = "the same" if rec["same_confirmed_set"] else f"{f['confirmed_set']} here"
            value += (
                f"; against the recorded advice ({rec['machine']}, {rec['wall_s'] / 60:.0f} min "
                f"by whole passes): {action}, confirmed set {rec['confirmed_set']} ({kept})"
            )
        others = max(f["others_cpu_s"], *(x.get("others_cpu_s", 0.0) for x in (w or {}, b or {})))
        if others > 0.25 * f["cpu_s"]:
            value += " (disturbed: other work used the CPU meanwhile)"
        target = f"<= {r['target_s'] / 60:.0f} min" if r.get("target_s") else ""
        what = f"kvcal advise, real model, {r['per_bucket']} a bucket ({n} requests)"
        yield what, value, target


def first_run_rows(doc: dict[str, Any]) -> Iterator[Row]:
    """The first command and its canary, run after run: the same verdict each time?"""
    for command, s in doc["summary"].items():
        runs = [r for r in doc["runs"] if r["command"] == command]
        verdicts = ", ".join(str(r["verdict"]).upper() for r in runs)
        same = "same" if s["same_verdict"] else "differ"
        yield f"`{command}` x{len(runs)}: verdicts", f"{verdicts} ({same})", "the same each run"


def advisor_rows(doc: dict[str, Any]) -> Iterator[Row]:
    """One model's advisor report (``bench/advisor.py`` renders it in docs/kvcal.md): the
    settings within the largest ΔNLL per token (``--max-dnll``) in every bucket."""
    sys.path.insert(0, str(BENCH.parent))
    from kvcal.emulate.advice import within_max_dnll

    report = doc["report"]
    max_dnll = report.get("tolerance")
    if max_dnll is None:
        yield f"advisor, {doc['name']}", f"{len(report['settings'])} settings", ""
        return
    fits = within_max_dnll(report, float(max_dnll))
    caps = {s["name"]: s["capacity_ratio"] for s in report["settings"]}
    kept = [f"{n} ({caps[n]:.2f}x)" for n, ok in fits.items() if ok]
    value = ", ".join(kept) if kept else "none"
    yield f"advisor, {doc['name']}: within ΔNLL {max_dnll:g} in every bucket", value, ""


def analysis_scale_rows(doc: dict[str, Any]) -> Iterator[Row]:
    """Analysis at scale (``bench/analysis_scale.py``): each command at each size, and its
    growth from the size before."""
    for command, s in doc["summary"].items():
        if not isinstance(s, dict) or not isinstance(s.get("wall_s"), dict):
            continue  # the targets, not a command
        for size, wall in s["wall_s"].items():
            rss = s["peak_rss_mib"][size]
            target = "<= 60 s, <= 1024 MiB" if size == "1000000" else ""
            yield f"{command}, {int(size):,} results", f"{wall:.1f} s, {rss:.0f} MiB peak", target


def evidence_simulation_rows(doc: dict[str, Any]) -> Iterator[Row]:
    """The evidence rule simulated (``bench/simulations.py``; docs/canary.md's table): KEEP at a
    drop of the tolerance at most alpha, and "need N" delivering its power."""
    c = doc["config"]
    size = [r["share"] for r in doc["rows"] if r["question"] == "size"]
    power = [r["share"] for r in doc["rows"] if r["question"] == "power"]
    yield (
        "evidence rule, drop = tolerance: KEEP share, largest",
        f"{max(size):.4f}",
        (f"<= {c['alpha']:g}"),
    )
    yield (
        "evidence rule, at need N: KEEP share, smallest",
        f"{min(power):.4f}",
        (f">= {c['power']:g}"),
    )


def systems_simulation_rows(doc: dict[str, Any]) -> Iterator[Row]:
    """The systems rule simulated (``bench/simulations.py``; docs/canary.md's table): how often
    pure noise claims a change, judged over blocks as the rule does."""
    alpha = doc["config"]["alpha"]
    noise = [
        r["either"]
        for r in doc["cells"]
        if r["case"].startswith("pure noise") and "per request" not in r["case"]
    ]
    yield (
        "systems rule, pure noise: share claiming a change, largest",
        f"{max(noise):.4f}",
        (f"<= {alpha:g}"),
    )
    cap = doc["capacity"][0]
    claimed = cap["fewer"] + cap["more"]
    yield (
        f"systems rule, capacity cell, {cap['case']}: claims",
        f"{claimed:.4f}",
        f"<= {alpha / 2:g}",
    )


def sequential_rows(doc: dict[str, Any]) -> Iterator[Row]:
    """The sequential canary simulated (``bench/sequential_sim.py``; docs/canary.md's table):
    its median pairs against the fixed design's N at the same power, where a target is set."""
    for r in doc["cases"]:
        if "target_median_over_fixed" in r and "median_over_equal_power" in r:
            what = f"sequential canary, {r['name']}: median pairs / fixed N at equal power"
            value = f"{r['median_over_equal_power']:.2f}x"
            yield what, value, f"<= {r['target_median_over_fixed']:g}x"


def kvcal_formats_rows(doc: dict[str, Any]) -> Iterator[Row]:
    """docs/kvcal.md's emulation and KV-format runs (``bench/kvcal_formats.py``; the doc's
    tables are ``bench/doc_figures.py``'s): one row per step recorded."""
    for step in ("emulate", "served", "canary", "formats"):
        entry = doc.get(step)
        if not entry:
            continue
        f, took = entry.get("figures"), f"{entry['wall_s'] / 60:.0f} min"
        if f is None:
            yield f"kvcal formats, {step}", f"figures not read ({took})", ""
        elif step == "emulate":
            cells = [
                f"{r['model']} {r['setting']} {nat(r['buckets']['all']['nll_delta_mean'])}"
                for r in f["rows"]
                if r["buckets"].get("all")
            ]
            yield "kvcal emulate, ΔNLL/token over all buckets", "; ".join(cells) + f" ({took})", ""
        elif step == "served":
            corr = min(r["positions"]["correlation"] for r in f["rows"])
            value = f"correlation >= {corr:.4f} over {len(f['rows'])} pairs ({took})"
            yield "FP8 emulated in vLLM vs served: per-position NLL", value, ">= 0.99"
        elif step == "canary":
            v = [f"{n}: {t['verdict']['verdict']}" for n, t in f["targets"].items() if t["verdict"]]
            yield "canary bf16,fp8,fp8_e5m2: verdicts", ", ".join(v) + f" ({took})", ""
        else:
            p = f["e5m2_positions"]
            value = f"correlation {p['correlation']:.4f} over {p['positions']} positions ({took})"
            yield "fp8_e5m2 emulated in vLLM vs served: per-position NLL", value, ">= 0.99"


def kvcal_long_rows(doc: dict[str, Any]) -> Iterator[Row]:
    """kvcal's teacher-forced scoring on long prompts (``bench/kvcal_long.py``; docs/kvcal.md's
    table): time and peak RSS by context length and setting."""
    longest = max(doc["config"]["lengths"])
    target = f"< {doc['summary']['target_peak_gib_at_longest']:g} GiB, linear"
    for r in doc["runs"]:
        what = f"kvcal teacher-forced, long model, {r['length']:,} tokens, {r['setting']}"
        value = f"{r['wall_s']:.1f} s, {r['peak_rss_mib']:.0f} MiB peak"
        yield what, value, target if r["length"] == longest else ""


def long_requests_rows(doc: dict[str, Any]) -> Iterator[Row]:
    """A long request at the client's cost (``bench/long_requests.py``): the replay's CPU per
    request over the shortest length's, its peak RSS, and the re-analysis's."""
    for r in doc["per_request"]:
        what = f"client per request, {r['length']:,}-token prompts"
        value = (
            f"replay {r['replay_cpu_s_per_request']:+.3f} s CPU, {r['replay_peak_rss_mib']:.0f} "
            f"MiB peak; reanalyse {r['reanalyse_cpu_s_per_request']:+.3f} s CPU, "
            f"{r['reanalyse_peak_rss_mib']:.0f} MiB peak"
        )
        yield what, value, ""


def long_model_rows(doc: dict[str, Any]) -> Iterator[Row]:
    """The long-context model's matrix (``bench/long_model.py`` renders it in docs/models.md)."""
    m = doc["matrix"]
    yield "long model, canary bf16,fp8,fp8-swa", f"{m['verdict']} (exit {m['exit_code']})", ""
    cap = m["capacity"]
    ref = cap["bf16"]["served_tokens"]
    for name in ("fp8", "fp8-swa"):
        a = cap.get(name)
        if a:
            err = a["served_tokens"] / a["predicted_tokens"] - 1
            yield (
                f"long model, {name}: served cache over BF16's (layer types' prediction)",
                f"{a['served_tokens'] / ref:.2f}x ({err:+.2%})",
                "within 5%",
            )
    seq = doc.get("sequential")
    if seq:
        wall = f"{seq['wall_s'] / 60:.0f} min" if seq.get("wall_s") else "?"
        yield "long model, sequential canary", f"{seq['verdict']} in {wall}", "<= 20 min"


KINDS: list[tuple[str, Callable[[dict[str, Any]], Iterator[Row]]]] = [
    ("sequential", sequential_rows),
    ("evidence_simulation", evidence_simulation_rows),
    ("systems_simulation", systems_simulation_rows),
    ("analysis_scale", analysis_scale_rows),
    ("advisor", advisor_rows),
    ("client_overhead", client_overhead_rows),
    ("memory", memory_rows),
    ("kvcal_observer", kvcal_rows),
    ("kvcal_long", kvcal_long_rows),
    ("kvcal_formats", kvcal_formats_rows),
    ("kvcal_gpu", _kvcal_gpu_figures.rows),
    ("open_loop", open_loop_rows),
    ("workers", workers_rows),
    ("locust_workers", locust_workers_rows),
    ("real_canary", real_canary_rows),
    ("real_model", real_model_rows),
    ("advise_speed", advise_speed_rows),
    ("long_model", long_model_rows),
    ("long_requests", long_requests_rows),
    ("first_run", first_run_rows),
]


def machine_of(doc: dict[str, Any]) -> tuple[str, str]:
    """(run date, machine) as the results file records them."""
    m = doc.get("machine") or {}
    date = str(m.get("date") or doc.get("date") or "?")
    cpu = m.get("cpu_model") or m.get("cpu") or "?"
    n = m.get("nproc")
    return date[:16].replace("T", " "), f"{cpu}, {n} CPUs" if n else str(cpu)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def generate(results: Path = RESULTS) -> str:
    """The markdown table for every ``*.json`` directly under ``results``."""
    lines = [
        "| results file | figure | value | target | run (UTC) | machine |",
        "|---|---|---|---|---|---|",
    ]
    for path in sorted(results.glob("*.json")):
        doc = orjson.loads(path.read_bytes())
        date, machine = machine_of(doc)
        kind = next((fn for prefix, fn in KINDS if path.stem.startswith(prefix)), None)
        rows = list(kind(doc)) if kind is not None else [("(not tabulated)", "-", "")]
        for what, value, target in rows:
            cells = (path.name, what, value, target, date, machine)
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def rewrite(readme: str, table: str) -> str:
    """``readme`` with its generated block replaced; ValueError without the markers."""
    return _blocks.rewrite(readme, BEGIN, END, table, README)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 if stale")
    a = ap.parse_args(argv)
    text = README.read_text(encoding="utf-8")
    new = rewrite(text, generate())
    if a.check:
        if new != text:
            sys.exit(f"{README}: the generated block is stale; run python bench/tables.py")
        return
    README.write_text(new, encoding="utf-8")


if __name__ == "__main__":
    main()
