"""Context-length buckets: one average hides a decline past 32K tokens, so everything is
reported per bucket. Bounds are token counts on the target's own tokenizer."""

from __future__ import annotations

import bisect
import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass

from replay.core.errors import InputError

DEFAULT_BOUNDS = "8K,32K,64K"


def _fmt(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 and n >= 1024 else str(n)


def _parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", text)
    if not m:
        raise InputError(f"--buckets: '{text}' is not a token count (e.g. 512, 8K, 1M)")
    mult = {"": 1, "k": 1024, "m": 1024 * 1024}[m.group(2).lower()]
    return int(m.group(1)) * mult


@dataclass(frozen=True)
class Buckets:
    """Half-open ranges: ``<b0``, ``b0-b1``, ..., ``>=bn``."""

    bounds: tuple[int, ...]

    @classmethod
    def parse(cls, text: str = DEFAULT_BOUNDS) -> Buckets:
        bounds = tuple(_parse_size(p) for p in text.split(",") if p.strip())
        if not bounds:
            raise InputError("--buckets: give at least one bound, e.g. 8K,32K,64K")
        if any(b <= 0 for b in bounds) or list(bounds) != sorted(set(bounds)):
            raise InputError(f"--buckets: bounds must be positive and increasing: '{text}'")
        return cls(bounds)

    @property
    def labels(self) -> list[str]:
        b = self.bounds
        return (
            [f"<{_fmt(b[0])}"]
            + [f"{_fmt(lo)}-{_fmt(hi)}" for lo, hi in itertools.pairwise(b)]
            + [f">={_fmt(b[-1])}"]
        )

    def label(self, tokens: int) -> str:
        return self.labels[bisect.bisect_right(self.bounds, tokens)]

    def order(self, label: str) -> int:
        labels = self.labels
        return labels.index(label) if label in labels else len(labels)

    def spec(self) -> str:
        return ",".join(_fmt(b) for b in self.bounds)


def median(values: Sequence[int]) -> float | None:
    if not values:
        return None
    s = sorted(values)
    mid = len(s) // 2
    return float(s[mid]) if len(s) % 2 else (s[mid - 1] + s[mid]) / 2
