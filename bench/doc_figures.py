"""The docs' measured and simulated figures, rendered from the files that recorded them.

    python bench/doc_figures.py           # rewrite every block below from its sources
    python bench/doc_figures.py --check   # exit 1 when a block is stale

A house rule: a figure in the docs that a run measured or a simulation produced is rendered
by code from a recorded results file, never typed. Each block sits in its doc between
``<!-- generated: bench/doc_figures.py NAME -->`` and ``<!-- end doc_figures NAME -->`` and is
rendered from its sources alone; ``tests/house/test_doc_figures.py`` fails when a doc and its
sources disagree; ``bench/kvcal_long.py``'s block (docs/kvcal.md) is checked here under its own
markers. Other generators keep their own blocks: ``bench/tables.py`` (bench/README.md),
``bench/advisor.py`` (docs/kvcal.md), ``bench/real_model.py`` (docs/models.md),
``bench/first_run.py`` (README.md) and ``docs/cli_reference.py`` (docs/cli.md).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _blocks
import _canary_figures
import _kvcal_figures
import _model_figures
import kvcal_long
import orjson

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
DOCS = ROOT / "docs"
RESULTS = BENCH / "results"
KV = RESULTS / "kvcal_formats.json"
MODEL = ROOT / "replay" / "testmodel" / "models" / "kvcanary-tiny-llama" / "kvcanary_model.json"


@dataclass(frozen=True)
class Block:
    """One generated block: its doc, its name there, the files it is rendered from (in the
    order ``render`` takes them) and the renderer."""

    doc: Path
    name: str
    sources: tuple[Path, ...]
    render: Callable[..., str]

    @property
    def begin(self) -> str:
        return f"<!-- generated: bench/doc_figures.py {self.name} -->"

    @property
    def end(self) -> str:
        return f"<!-- end doc_figures {self.name} -->"


@dataclass(frozen=True)
class OwnBlock(Block):
    """A block under its own bench script's markers (``<!-- generated: bench/NAME.py -->`` ...
    ``<!-- end NAME -->``): the script writes it after a run, this check keeps it current."""

    @property
    def begin(self) -> str:
        return f"<!-- generated: bench/{self.name}.py -->"

    @property
    def end(self) -> str:
        return f"<!-- end {self.name} -->"


BLOCKS = (
    Block(
        DOCS / "canary.md",
        "evidence",
        (RESULTS / "evidence_simulation.json",),
        _canary_figures.evidence,
    ),
    Block(
        DOCS / "canary.md",
        "sequential",
        (RESULTS / "sequential.json", RESULTS / "evidence_simulation.json"),
        _canary_figures.sequential,
    ),
    Block(
        DOCS / "canary.md",
        "systems",
        (RESULTS / "systems_simulation.json",),
        _canary_figures.systems,
    ),
    Block(DOCS / "models.md", "testmodel", (MODEL,), _model_figures.served),
    Block(DOCS / "models.md", "training", (MODEL,), _model_figures.training),
    Block(DOCS / "kvcal.md", "kvcal-emulate", (KV,), _kvcal_figures.emulate),
    Block(DOCS / "kvcal.md", "kvcal-served", (KV,), _kvcal_figures.served),
    Block(DOCS / "kvcal.md", "kv-formats-canary", (KV,), _kvcal_figures.canary),
    Block(DOCS / "kvcal.md", "kv-formats-emulated", (KV,), _kvcal_figures.formats),
    OwnBlock(DOCS / "kvcal.md", "kvcal_long", (kvcal_long.OUT,), kvcal_long.render),
)


def _load(path: Path) -> Any:
    return orjson.loads(path.read_bytes())


def render(block: Block) -> str:
    return block.render(*(_load(p) for p in block.sources))


def rewrite(text: str, blocks: tuple[Block, ...], where: Path) -> str:
    """``text`` (the doc at ``where``) with each of ``blocks`` rendered anew; ValueError naming
    the doc and the marker when one is missing."""
    for block in blocks:
        text = _blocks.rewrite(text, block.begin, block.end, render(block), where)
    return text


def docs() -> dict[Path, tuple[Block, ...]]:
    """The blocks of each doc."""
    out: dict[Path, tuple[Block, ...]] = {}
    for block in BLOCKS:
        out[block.doc] = (*out.get(block.doc, ()), block)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 if stale")
    a = ap.parse_args(argv)
    stale = []
    for doc, blocks in docs().items():
        text = doc.read_text(encoding="utf-8")
        new = rewrite(text, blocks, doc)
        if new != text:
            stale.append(str(doc.relative_to(ROOT)))
            if not a.check:
                doc.write_text(new, encoding="utf-8")
    if a.check and stale:
        sys.exit(f"stale generated blocks in {', '.join(stale)}; run python bench/doc_figures.py")


if __name__ == "__main__":
    main()
