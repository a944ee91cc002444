"""Length-only records: what a production trace that gives only token counts becomes.

Each is a synthetic completions request (``synth``) sent with ``ignore_eos``, so the answer has
the trace's output length; its prompt is made at run time of deterministic token blocks, one
per hash id, so records that share hash ids share a prefix. ``LengthPolicy`` scales and caps
lengths so a real trace fits a small test model; it is recorded in the run manifest.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from replay.core.errors import InputError
from replay.traces.trace import Request, Synth


@dataclass(frozen=True)
class LengthPolicy:
    """``scale`` multiplies input, output and block lengths; caps apply after scaling."""

    scale: float = 1.0
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None

    def __post_init__(self) -> None:
        if not (self.scale > 0 and math.isfinite(self.scale)):
            raise InputError("--length-scale must be a positive number")
        for name in ("max_input_tokens", "max_output_tokens"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise InputError(f"--{name.replace('_', '-')} must be at least 1")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def apply(self, inp: int, out: int, block: int) -> tuple[int, int, int]:
        inp_s = max(1, round(inp * self.scale))
        out_s = max(1, round(out * self.scale))
        block_s = max(1, round(block * self.scale))
        if self.max_input_tokens is not None:
            inp_s = min(inp_s, self.max_input_tokens)
        if self.max_output_tokens is not None:
            out_s = min(out_s, self.max_output_tokens)
        return inp_s, out_s, block_s


@dataclass(frozen=True)
class Lengths:
    """One row's token counts as the trace gives them: ``hash_ids`` name its prompt's
    ``block``-token blocks in order (none: no prefix shared with any other row)."""

    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()
    block: int = 512


def length_record(
    rid: str,
    t: float,
    lengths: Lengths,
    policy: LengthPolicy,
    meta: dict[str, Any],
    session: str | None = None,
) -> Request:
    """The synthetic request for one row, after ``policy``; the original lengths go to meta."""
    inp, out = lengths.input_tokens, lengths.output_tokens
    inp_s, out_s, block_s = policy.apply(inp, out, lengths.block)
    n_blocks = math.ceil(inp_s / block_s)
    return Request(
        id=rid,
        t=t,
        session=session,
        api="completions",
        synth=Synth(input_tokens=inp_s, hash_ids=lengths.hash_ids[:n_blocks], block_tokens=block_s),
        max_tokens=out_s,
        params={"ignore_eos": True},
        task="perf",
        input_tokens=inp_s,
        meta={**meta, "orig_input_tokens": inp, "orig_output_tokens": out},
    )
