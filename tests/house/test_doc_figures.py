"""The docs' measured and simulated figures are what bench/doc_figures.py renders from the files
that recorded them, so a figure there is one a run or a simulation wrote down."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import doc_figures


@pytest.mark.parametrize("doc", sorted(doc_figures.docs()), ids=lambda p: p.name)
def test_every_block_is_what_its_sources_render(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    assert doc_figures.rewrite(text, doc_figures.docs()[doc], doc) == text, (
        "run: python bench/doc_figures.py"
    )


def test_every_block_has_its_markers_once_and_its_sources_committed() -> None:
    for block in doc_figures.BLOCKS:
        text = block.doc.read_text(encoding="utf-8")
        assert text.count(block.begin) == 1 and text.count(block.end) == 1, block.name
        assert text.index(block.begin) < text.index(block.end), block.name
        for source in block.sources:
            assert source.is_file(), source


def test_a_doc_without_a_blocks_markers_is_refused() -> None:
    block = doc_figures.BLOCKS[0]
    with pytest.raises(ValueError, match=r"no '<!-- generated: bench/doc_figures\.py"):
        doc_figures.rewrite("# canary\n", (block,), block.doc)


def test_a_stale_figure_fails_the_check(tmp_path: Path) -> None:
    """A block whose figure differs from its source's is rewritten: the check sees it."""
    block = next(b for b in doc_figures.BLOCKS if b.name == "training")
    rendered = doc_figures.render(block)
    stale = f"x\n{block.begin}\n{rendered.replace(' steps in ', ' steps in 1', 1)}{block.end}\n"
    assert doc_figures.rewrite(stale, (block,), tmp_path) != stale
