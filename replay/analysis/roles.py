"""Which target plays which part: the reference others are compared with, the candidate (FP8
at scale 1.0), the calibrated arm (FP8 with kvcal's scales) and the layers arm (FP8 with some
layers' cache kept in BF16: ``--skip-layers NAME=LAYERS`` gives a target this role).

Roles are explicit where the user gives them: ``--reference``, ``--candidate`` and
``--calibrated`` on the command line, or ``role = "..."`` in a ``[targets.NAME]`` table (the
command line wins). What is left is guessed from the names, as documented: the reference is
``bf16`` if there is one, else the first target; the calibrated arm is a target whose name has
a word ``cal``, ``calibrated`` or ``kvcal`` (``fp8-cal``, ``fp8_kvcal``), never a name that
merely contains the letters (``fp8-local`` is not calibrated); the candidate is the first
remaining target. The resolved roles go into the manifest, so the analysis, ``replay report``
and a resume read them instead of guessing again.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from replay.analysis.grading.quality import CONTROL_SUFFIX
from replay.analysis.schemas.manifest import Manifest
from replay.core.errors import ConfigError

ROLES = ("reference", "candidate", "calibrated", "layers")
_CAL_WORDS = frozenset({"cal", "calibrated", "kvcal"})


@dataclass(frozen=True)
class Roles:
    reference: str
    candidate: str | None = None
    calibrated: str | None = None
    layers: str | None = None

    def to_json(self) -> dict[str, str | None]:
        out = {
            "reference": self.reference,
            "candidate": self.candidate,
            "calibrated": self.calibrated,
        }
        return {**out, "layers": self.layers} if self.layers else out

    @classmethod
    def from_manifest(cls, manifest: Manifest, names: Sequence[str]) -> Roles:
        """The manifest's roles; runs written before roles were recorded get the guess."""
        saved = manifest.roles
        if saved is not None and saved.reference:
            return cls(saved.reference, saved.candidate, saved.calibrated, saved.layers)
        if not names:
            return cls(manifest.reference or "bf16")
        ref = manifest.reference
        return resolve(names, reference=ref if ref in names else None)


def looks_calibrated(name: str) -> bool:
    return bool(_CAL_WORDS & set(re.split(r"[-_.\s]+", name.lower())))


def resolve(
    names: Sequence[str],
    *,
    reference: str | None = None,
    candidate: str | None = None,
    calibrated: str | None = None,
    declared: Mapping[str, str] | None = None,
) -> Roles:
    """Roles for ``names`` (in the order the user gave them; controls are not targets here).
    ``declared`` maps a target to the role its targets-file table gives it."""
    names = [n for n in names if not n.endswith(CONTROL_SUFFIX)]
    given: dict[str, str | None] = {
        "reference": reference,
        "candidate": candidate,
        "calibrated": calibrated,
        "layers": None,  # declared only: a target served with some layers in BF16
    }
    for target, role in (declared or {}).items():
        if role not in ROLES:
            raise ConfigError(f"[targets.{target}]: role '{role}' is not one of {list(ROLES)}")
        if target in names and given[role] is None:
            given[role] = target
    for role, chosen in given.items():
        if chosen is not None and chosen not in names:
            raise ConfigError(f"--{role}: '{chosen}' is not one of the targets {names}")
    picked = [n for n in given.values() if n is not None]
    if len(picked) != len(set(picked)):
        raise ConfigError(f"one target cannot play two roles: {given}")
    ref = given["reference"] or ("bf16" if "bf16" in names else names[0])
    rest = [n for n in names if n != ref and n not in picked]
    cal = given["calibrated"] or next((n for n in rest if looks_calibrated(n)), None)
    cand = given["candidate"] or next((n for n in rest if n != cal), None)
    return Roles(ref, cand, cal, given["layers"])
