"""The stop rule's simulations, recorded: the evidence rule's and the systems rule's.

    python bench/simulations.py    # both; prints the tables docs/canary.md shows

Each simulation lives beside its tests (``tests/unit/analysis/test_evidence_simulation.py``,
``tests/unit/analysis/test_systems_simulation.py``), seeded, so a rerun gives the same figures. This
script keeps every row, the settings and the machine in ``bench/results/evidence_simulation.json``
and ``bench/results/systems_simulation.json``; docs/canary.md's tables are rendered from those files
by ``bench/doc_figures.py``, and the tests check that the rows they simulate are the recorded ones.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import _canary_figures
import orjson
from _machine import describe

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
sys.path.insert(0, str(BENCH.parent))

from tests import test_evidence_simulation as evidence  # noqa: E402
from tests import test_systems_simulation as systems  # noqa: E402


def _write(name: str, body: dict[str, Any], started: float) -> dict[str, Any]:
    doc = {
        "bench": name,
        "command": "python bench/simulations.py",
        "machine": describe(("numpy",)),
        **body,
        "seconds": round(time.perf_counter() - started, 1),
    }
    path = RESULTS / f"{name}.json"
    path.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n")
    print(f"{path.relative_to(BENCH.parent)}: {doc['seconds']} s")
    return doc


def main() -> None:
    t0 = time.perf_counter()
    body = {"config": evidence.config(), "rows": evidence.rows()}
    print(_canary_figures.evidence(_write("evidence_simulation", body, t0)))
    t0 = time.perf_counter()
    capacity = [systems.capacity_row(j) for j in range(len(systems.BLOCK_CASES))]
    body = {"config": systems.config(), "cells": systems.cell_rows(), "capacity": capacity}
    print(_canary_figures.systems(_write("systems_simulation", body, t0)))


if __name__ == "__main__":
    main()
