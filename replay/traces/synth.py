"""Prompts for length-only traces, made of the target's own token ids.

Each hash id names one block of content, the same block wherever it appears, so requests that
share hash ids share a prefix (and hit the server's prefix cache as they did in production).
Requests without hash ids get blocks of their own. Ids are sent to ``/v1/completions`` as they
are, so the prompt has exactly the declared length: no re-tokenization drift.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

from replay.traces.trace import Request, Synth

# Plain words whose tokens make up the pool; special tokens never appear in synthetic text.
POOL_TEXT = (
    "the of and to in is that for on with as by at from this be are was it an or which "
    "river stone cloud ember forest harbor lantern meadow orbit pepper quartz saddle timber "
    "velvet willow anchor bridge cobalt falcon garnet hollow island jasper kernel ledger "
    "marble nectar oyster prism ridge summit tundra vector walnut zenith 0 1 2 3 4 5 6 7 8 9 "
    "report value number order price total count list name city date time search result"
)


class TokenPool:
    """Token ids that ordinary text produces on the target's tokenizer."""

    def __init__(self, ids: Sequence[int]) -> None:
        uniq = sorted(set(int(i) for i in ids))
        if len(uniq) < 8:
            raise ValueError(f"token pool too small ({len(uniq)} ids) to synthesize prompts")
        self.ids = uniq

    def block(self, key: str, n: int) -> list[int]:
        """``n`` ids, a pure function of ``key`` (stable across runs and machines)."""
        seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
        rng = random.Random(seed)
        return [self.ids[rng.randrange(len(self.ids))] for _ in range(n)]


def synthesize(req: Request, pool: TokenPool) -> list[int]:
    """The exact-length prompt for a synthetic request."""
    s: Synth | None = req.synth
    if s is None:
        raise ValueError(f"request {req.id} is not synthetic")
    out: list[int] = []
    i = 0
    while len(out) < s.input_tokens:
        need = min(s.block_tokens, s.input_tokens - len(out))
        if i < len(s.hash_ids):
            # Full-size block keyed by hash id; a shorter last block is its prefix, as a
            # partial last block shares a prefix with the full one.
            block = pool.block(f"h{s.hash_ids[i]}:{s.block_tokens}", s.block_tokens)[:need]
        else:
            block = pool.block(f"r{req.id}:{i}:{s.block_tokens}", need)
        out.extend(block)
        i += 1
    return out
