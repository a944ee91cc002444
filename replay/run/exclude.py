"""Keep calibration requests out of evaluation.

Scales calibrated on a request and then judged on the same request measure reuse, not
generalization. ``--exclude-ids FILE`` drops the ids a calibration used (``kvcal sample``
writes them, one a line: ``replay.core.ids`` makes that file name every request exactly); a
target serving a calibrated checkpoint whose manifest lists sample ids that are still among the
evaluated requests stops the run before anything is sent.
This module reads kvcal's files by name and never imports kvcal.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from replay.core.errors import InputError
from replay.core.ids import read_ids as ids_in_file
from replay.serving.targets import TargetSpec
from replay.traces.trace import Request

CALIBRATION_MANIFEST = "kvcal_manifest.json"  # written by `kvcal calibrate` next to the scales


def read_ids(path: Path) -> set[str]:
    """One request id a line (``replay.core.ids``: blank lines and lines starting with '#' are
    skipped, a line that is no id is an error naming it)."""
    return ids_in_file(path, "--exclude-ids")


class Exclusion:
    """A ``keep`` predicate for the trace reader that counts what it leaves out."""

    def __init__(self, ids: set[str], source: Path) -> None:
        self.ids, self.source, self.dropped = ids, source, 0

    def __call__(self, req: Request) -> bool:
        if req.id in self.ids:
            self.dropped += 1
            return False
        return True


def exclusion(path: Path | str | None) -> Exclusion | None:
    """``--exclude-ids FILE`` as a predicate, or None when not given."""
    return None if path is None else Exclusion(read_ids(Path(path)), Path(path))


def calibration_ids(model_dir: Path) -> tuple[Path, set[str]] | None:
    """The sample ids a calibrated checkpoint was made from, if it says."""
    path = model_dir / CALIBRATION_MANIFEST
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        ids = data["sample_ids"]
        if not isinstance(ids, list):
            raise TypeError("sample_ids must be a list")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(
            f"{path}: field 'sample_ids': unreadable ({exc}); rewrite it with `kvcal calibrate`"
        ) from None
    return path, {str(i) for i in ids}


def refuse_overlap(
    requests: Iterable[Request], targets: Sequence[TargetSpec], trace_path: Path
) -> None:
    """Stop when a calibrated target was calibrated on requests this run evaluates. The
    requests are streamed; only calibration ids are held."""
    calibrated = [
        (spec, *found)
        for spec in targets
        if spec.model is not None and (found := calibration_ids(Path(spec.model))) is not None
    ]
    if not calibrated:
        return
    wanted = set().union(*(ids for _, _, ids in calibrated))
    evaluated = {r.id for r in requests if r.id in wanted}
    for spec, manifest, ids in calibrated:
        assert spec.model is not None
        overlap = sorted(ids & evaluated)
        if overlap:
            shown = ", ".join(overlap[:5]) + (", ..." if len(overlap) > 5 else "")
            raise InputError(
                f"target '{spec.name}': {len(overlap)} request(s) of {trace_path} were used to "
                f"calibrate its scales ({manifest} lists them: {shown}); evaluating on them "
                "measures reuse, not generalization. Exclude them with --exclude-ids "
                f"{Path(spec.model) / 'calibration_ids.txt'} (or the calibration_ids.txt "
                "`kvcal sample` wrote)"
            )
