"""docs/canary.md's simulated figures, rendered from the results files that recorded them
(``bench/doc_figures.py`` puts each between its markers)."""

from __future__ import annotations

from typing import Any

from _blocks import paragraph

Doc = dict[str, Any]


def _pct(x: float) -> str:
    return f"{x:.0%}"


def _seeds(rows: list[Doc], base: int) -> str:
    """'0-5': the rows' seeds as offsets from ``base``."""
    offsets = [r["seed"] - base for r in rows]
    lo, hi = min(offsets), max(offsets)
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def evidence(doc: Doc) -> str:
    """The evidence rule's size and power rows: a case's sizes on one line."""
    c, rows = doc["config"], doc["rows"]
    size = [r for r in rows if r["question"] == "size"]
    pw = [r for r in rows if r["question"] == "power"]
    lines = [
        paragraph(
            f"Measured over {c['canaries']:,} simulated canaries per case (BF16 pass rate "
            f"{c['reference_pass_rate']:g}; seed {c['seed']} plus {_seeds(size, c['seed'])} for "
            f"the size rows and {_seeds(pw, c['seed'])} for the power rows; tolerance "
            f'{c["tolerance"]:g} and alpha {c["alpha"]:g}; "exact" is the same share summed '
            "exactly; `python bench/simulations.py` records them in "
            "`bench/results/evidence_simulation.json`):"
        ),
        "",
        "| case | pairs | KEEP share | exact | must be |",
        "| --- | --- | --- | --- | --- |",
    ]
    names = list(dict.fromkeys(r["case"] for r in size))
    for name in names:
        same = [r for r in size if r["case"] == name]
        cells = [" / ".join(f"{r[k]:.4f}" for r in same) for k in ("share", "exact")]
        pairs = " / ".join(str(r["pairs"]) for r in same)
        lines.append(f"| {name} | {pairs} | {cells[0]} | {cells[1]} | <= {c['alpha']:g} |")
    for r in pw:
        seen, lost, gained = r["pilot"]
        pilot = (
            f"N for {seen} agreeing pairs"
            if lost == gained == 0
            else f"N for {seen} pairs, {lost} lost, {gained} gained"
        )
        lines.append(
            f"| {r['case']}: {pilot} | {r['pairs']} | {r['share']:.4f} | {r['exact']:.4f} | "
            f">= {c['power']:g} |"
        )
    return "\n".join(lines) + "\n"


def _sequential_intro(doc: Doc) -> str:
    c = doc["config"]
    d = next(r for r in doc["cases"] if r["key"] == "d")
    return (
        f"Measured over {c['canaries']:,} simulated canaries per case ({c['buckets']} buckets, "
        f"rounds of {c['round_pairs_per_bucket']} pairs per open bucket, a budget of "
        f"{c['budget_per_bucket']} pairs per bucket; BF16 pass rate "
        f"{c['reference_pass_rate']:g}; {100 * c['noise_each_way']:g} points of disagreement "
        f"each way plus the drop; tolerance {c['tolerance']:g} and alpha {c['alpha']:g}; seed "
        f"{doc['seed']} plus the row's index; (d) gives each bucket {d['budget_per_bucket']} "
        f"pairs, the run's {c['budget_per_bucket']} spread over {c['buckets']}, too few for most "
        "buckets to show the loss alone, and its second row switches the pool off, the buckets "
        'sharing all of alpha; the two "watched alone" rows let one question run to the budget '
        "with nothing else stopping it):"
    )


def _sequential_prose(doc: Doc, evidence_doc: Doc) -> str:
    """The paragraph under the table: every figure in it read from ``doc``, and the fixed
    design's chance per bucket from the evidence rule's simulation at the same rates and N."""
    cases = {r["key"]: r for r in doc["cases"]}
    a, c = cases["a"], cases["c"]
    fa, fc = a["fixed_n"], c["fixed_n"]
    per_bucket = next(
        r["exact"]
        for r in evidence_doc["rows"]
        if r["question"] == "power"
        and r["pairs"] == fa["per_bucket"]
        and (r["p10"], r["p01"]) == (a["rates"]["p10"], a["rates"]["p01"])
    )
    buckets = doc["config"]["buckets"]
    half = fa["per_bucket"] / 2
    return (
        "The fixed design's N is given twice, in pairs per bucket from exact power at the same "
        "alpha. First at the usual 80% chance of the right decision: the equivalence bound for "
        "(a) (in brackets: for all four buckets at once), the per-bucket McNemar test for (b)-(d) "
        "(in brackets: the stratified test). Then at the sequential canary's own chance of the "
        "right decision (the 95% lower confidence bound of its simulated share: "
        f"{fa['equal_power']['chance_of_the_right_decision']:.2f} with no drop, "
        f"{fc['equal_power']['chance_of_the_right_decision']:.4f} where every canary found the "
        'loss), the fixed design "at the same alpha and power": every bucket\'s equivalence '
        "bound for (a), the stratified test for (b)-(d), the smallest fixed N for a drop every "
        "bucket shares. At equal power the sequential canary needs "
        f"**{a['median_over_equal_power']:.2f}x** the fixed design's pairs with no drop and "
        f"**{c['median_over_equal_power']:.2f}x** with a drop of twice the tolerance (the "
        "target: at most half). Against a fixed design "
        "sized for only 80%, which leaves a fifth of its runs wrong or undecided, it is not "
        f"cheaper everywhere: {a['median_over_fixed']:.2f}x with no drop, and with a drop of "
        f"twice the tolerance {c['median_over_fixed']:.2f}x McNemar's N but "
        f"{c['median_pairs_per_bucket'] / fc['stratified']:.1f}x the stratified test's "
        f"{fc['stratified']}. Half of the 80% design is out of every design's reach with no "
        "drop: by Wald's bound on the average sample size of a sequential test, any test that "
        "shows equivalence with an 80% chance at these rates needs at least "
        f"{fa['sequential_floor_at_80']:.0f} pairs per bucket on average (half the fixed N is "
        f"{half:g}), an always-valid one about log(1/alpha) / KL_inf = "
        f"{fa['e_process_floor']:.0f}, and the fixed test planned for {half:g} pairs shows "
        f"equivalence in only {_pct(fa['power_at_half'])} of canaries. What the sequential "
        f"canary buys is the run: {_pct(a['shares']['equivalent'])} of the canaries end "
        f"KEEP-compatible within the budget, where the fixed design at {fa['per_bucket']} per "
        f"bucket shows all {buckets} buckets equivalent in {_pct(per_bucket**buckets)} "
        f"({per_bucket:.3f}^{buckets}) and needs {fa['for_the_run']} per bucket for 80%; and a "
        f"clear loss stops early, at {c['median_pairs_per_bucket']:g} pairs per bucket."
    )


def sequential(doc: Doc, evidence_doc: Doc) -> str:
    """The sequential canary's settings, its table (``sequential_sim.markdown``) and what the
    table says against the fixed design."""
    import sequential_sim

    return (
        paragraph(_sequential_intro(doc))
        + "\n\n"
        + sequential_sim.markdown(doc)
        + "\n\n"
        + paragraph(_sequential_prose(doc, evidence_doc))
        + "\n"
    )


def systems(doc: Doc) -> str:
    """The systems rule's latency cases and its capacity cell."""
    c = doc["config"]
    cap = doc["capacity"]
    lines = [
        paragraph(
            f"{c['canaries']:,} simulated canaries per case, seed {c['seed']} plus the row's "
            f"index (the capacity rows: plus {cap[0]['seed'] - c['seed']} and the row's index); "
            "`python bench/simulations.py` records them in "
            "`bench/results/systems_simulation.json`:"
        ),
        "",
        "| case | noise | blocks x requests per bucket | claims slower | claims faster |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in doc["cells"]:
        lines.append(
            f"| {r['case']} | {r['noise']} | {r['blocks']} x {r['requests']} | "
            f"{r['slower']:.4f} | {r['faster']:.4f} |"
        )
    lines += [
        "",
        "| capacity cell | blocks | claims fewer | claims more |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {r['case']} | {r['blocks']} | {r['fewer']:.4f} | {r['more']:.4f} |" for r in cap]
    return "\n".join(lines) + "\n"
