"""Paired samples, checked: request i on the reference (``a``) and on the candidate (``b``).

Every paired statistic reads its input through these, so a mismatched or non-finite sample
fails the same way, naming the function that was given it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt


def paired_arrays(
    a: Sequence[float], b: Sequence[float], what: str
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """Paired scores as two flat float arrays of one length, all finite."""
    xa, xb = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if xa.ndim != 1 or xb.ndim != 1 or xa.shape != xb.shape:
        raise ValueError(
            f"{what}: a and b must be flat and of the same length ({xa.shape} vs {xb.shape})"
        )
    if not (np.isfinite(xa).all() and np.isfinite(xb).all()):
        raise ValueError(f"{what}: values must be finite")
    return xa, xb


def discordant(a: Sequence[bool], b: Sequence[bool], what: str) -> tuple[int, int, int]:
    """(pairs, a passed & b failed, b passed & a failed)."""
    xa, xb = np.asarray(a, dtype=bool), np.asarray(b, dtype=bool)
    if xa.ndim != 1 or xb.ndim != 1 or xa.shape != xb.shape:
        raise ValueError(
            f"{what}: a and b must be flat and of the same length ({xa.shape} vs {xb.shape})"
        )
    return int(xa.size), int((xa & ~xb).sum()), int((xb & ~xa).sum())
