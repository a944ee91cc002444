"""``kvcal advise``'s figures as the verdict reads them: what emulation measured when FP8 still
lost (which layers to keep in BF16, per-head scales, how much of the loss is the backend's
rounding) and what it advises.

``replay --advice FILE`` reads the JSON ``kvcal advise --json`` writes (:func:`read_advice`:
the fields the verdict uses, checked, kept in the manifest's options so that ``replay
report`` reads the same); :func:`advice_facts` turns them into :class:`Advice`. Emulated
figures predict; a served arm (``--skip-layers``) decides.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replay.core.errors import InputError

ACTIONS = ("none", "skip_layers", "per_head", "reject")


@dataclass(frozen=True)
class Advice:
    action: str  # one of ACTIONS
    reasons: tuple[str, ...]
    skip_layers: tuple[int, ...] = ()
    rounding_share: float | None = None  # of the loss, what the backend's rounding makes
    backend_rounding: str | None = None  # "cpu" (truncation) or "cuda" (nearest)
    per_head_supported: bool = False

    def flag(self) -> str:
        return "--kv-cache-dtype-skip-layers " + " ".join(map(str, self.skip_layers))


def read_advice(path: Path) -> dict[str, Any]:
    """The fields of a ``kvcal advise --json`` file the verdict uses, checked by name."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise InputError(f"--advice {path}: not a readable JSON file ({exc})") from None
    step = doc.get("next_step") if isinstance(doc, dict) else None
    if not isinstance(step, dict) or step.get("action") not in ACTIONS:
        raise InputError(
            f"--advice {path}: field 'next_step.action' must be one of {list(ACTIONS)}; "
            "write the file with `kvcal advise ... --json FILE`"
        )
    reasons = step.get("reasons") or []
    layers = step.get("skip_layers") or []
    share = step.get("rounding_share")
    if (
        not isinstance(reasons, list)
        or not all(isinstance(r, str) for r in reasons)
        or not isinstance(layers, list)
        or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in layers)
        or (share is not None and not isinstance(share, int | float))
    ):
        raise InputError(
            f"--advice {path}: 'next_step' has a reasons list of text, skip_layers of layer "
            "indices and a numeric rounding_share; this file's are not"
        )
    return {
        "file": str(path),
        "action": step["action"],
        "reasons": reasons,
        "skip_layers": layers,
        "rounding_share": share,
        "backend_rounding": doc.get("backend_rounding"),
        "per_head_supported": bool(doc.get("per_head_supported")),
    }


def advice_facts(options: Mapping[str, Any]) -> Advice | None:
    """The advice a run's manifest options carry (what :func:`read_advice` kept), if any."""
    a = options.get("advice")
    if not isinstance(a, Mapping) or a.get("action") not in ACTIONS:
        return None
    share = a.get("rounding_share")
    return Advice(
        action=str(a["action"]),
        reasons=tuple(str(r) for r in a.get("reasons") or ()),
        skip_layers=tuple(int(x) for x in a.get("skip_layers") or ()),
        rounding_share=float(share) if isinstance(share, int | float) else None,
        backend_rounding=a.get("backend_rounding"),
        per_head_supported=bool(a.get("per_head_supported")),
    )
