"""The grades as a table, and the pairs quality is computed from.

``grades_frame`` flattens grade rows (``rows.grade_rows``) into one row per answer, indexed by
request id. A target's requests are paired with the reference's (or the A/A control's) by
request id, in the target's own order, which the seeded bootstrap depends on.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

GRADE_COLUMNS = (
    "phase",
    "target",
    "request_id",
    "bucket",
    "answered",
    "passed",
    "rule",
    "d_passed",
    "d_exact",
    "d_error",
    "agreed",
    "exact",
    "normalized",
    "divergence",
)
KEY = ["phase", "target", "request_id"]


def grades_frame(rows: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    """One row per graded answer (``grade_rows``), flattened: ``passed`` is the check's
    outcome (None: no check graded it), ``rule``/``d_passed`` the derived grade's (None: none,
    or ungraded), ``agreed`` whether it was compared with the reference's answer. A request
    answered twice in one phase (a looping Locust test) keeps its last grade, in the place of
    its first."""
    return frame_of([flat_grade(row) for row in rows])


FlatGrade = tuple[Any, ...]  # a grade row as ``GRADE_COLUMNS``


def flat_grade(row: Mapping[str, Any]) -> FlatGrade:
    """A grade row as the table's columns: what quality reads of it."""
    g, d, ag = row["grade"], row.get("derived"), row["agreement"]
    return (
        row["phase"],
        row["target"],
        row["request_id"],
        row["bucket"],
        bool(row["answered"]),
        None if g is None else bool(g["passed"]),
        sys.intern(str(d["rule"])) if d else None,  # a few names, each read anew
        None if not d or d["passed"] is None else bool(d["passed"]),
        None if not d or d.get("exact") is None else bool(d["exact"]),
        bool(d and (d.get("detail") or {}).get("checker_error")),
        ag is not None,
        ag and ag["exact"],
        ag and ag["normalized"],
        ag and ag["first_divergence"],
    )


class GradeColumns:
    """Flattened grade rows (``flat_grade``) as columns, a million at a time: text as the
    rows' own strings, each yes/no/None as a byte, the divergence as an integer (-1: None).
    About 50 bytes a row, where a row's tuple took 170."""

    def __init__(self) -> None:
        self.text: dict[str, list[str | None]] = {c: [] for c in _TEXT_COLUMNS}
        self.yes_no = {c: bytearray() for c in _YES_NO_COLUMNS}
        self.divergence = array("q")

    def __len__(self) -> int:
        return len(self.divergence)

    def append(self, flat: FlatGrade) -> None:
        text, yes_no = self.text, self.yes_no
        for name in _TEXT_COLUMNS:
            text[name].append(flat[_AT[name]])
        for name in _YES_NO_COLUMNS:
            yes_no[name].append(_YES_NO_CODE[flat[_AT[name]]])
        divergence = flat[_AT["divergence"]]
        self.divergence.append(-1 if divergence is None else divergence)

    def frame(self) -> pd.DataFrame:
        """``frame_of`` the rows, each column let go as it becomes the frame's."""
        import numpy as np

        if not len(self):  # typed as no rows are (every column text)
            return frame_of([])
        values = np.array(_YES_NO_VALUES, dtype=object)
        columns: dict[str, list[Any]] = {}
        for name in GRADE_COLUMNS:
            if name in self.text:
                columns[name], self.text[name] = self.text[name], []
            elif name == "divergence":
                columns[name] = [None if d < 0 else d for d in self.divergence]
                self.divergence = array("q")
            else:
                codes = np.frombuffer(self.yes_no[name], dtype=np.uint8)
                columns[name] = values[codes].tolist()
                self.yes_no[name] = bytearray()
        return _keyed(_columns_frame(columns))


_TEXT_COLUMNS = ("phase", "target", "request_id", "bucket", "rule")
_YES_NO_COLUMNS = tuple(c for c in GRADE_COLUMNS if c not in (*_TEXT_COLUMNS, "divergence"))
_AT = {name: k for k, name in enumerate(GRADE_COLUMNS)}
# A yes/no/None column's codes: ``_YES_NO_VALUES[code]`` is the value.
_YES_NO_VALUES = (False, True, None)
_YES_NO_CODE = {False: 0, True: 1, None: 2}


def _columns_frame(columns: Mapping[str, list[Any]]) -> pd.DataFrame:
    """A frame of columns given as lists, typed as ``frame_of`` types rows: pandas infers a
    column's type from a list as it does from records (``test_grade_columns_frame``)."""
    import pandas as pd

    with pd.option_context("mode.string_storage", "python"):
        return pd.DataFrame(columns, columns=list(GRADE_COLUMNS))


def frame_of(flat: Sequence[FlatGrade]) -> pd.DataFrame:
    """``grades_frame`` of rows already flattened (``flat_grade``)."""
    import pandas as pd

    # Text columns hold the rows' own Python strings (each shared by the rows that have it):
    # arrow storage would copy them, a million rows at a time, into a pool that keeps its
    # memory.
    with pd.option_context("mode.string_storage", "python"):
        frame = pd.DataFrame.from_records(flat, columns=GRADE_COLUMNS)
    return _keyed(frame)


def _keyed(frame: pd.DataFrame) -> pd.DataFrame:
    """The frame indexed by request id, a request answered twice in a phase kept once."""
    if not frame.duplicated(KEY).any():  # as a rule: the copies below would change nothing
        return frame.set_index("request_id", drop=False)
    first = frame.groupby(KEY, sort=False).ngroup()
    return (
        frame.assign(first=first)
        .drop_duplicates(KEY, keep="last")
        .sort_values("first")
        .drop(columns="first")
        .set_index("request_id", drop=False)
    )


def outcomes(values: pd.Series) -> list[bool]:
    """A column's graded outcomes as plain booleans."""
    return [bool(v) for v in values]


def paired_outcomes(
    rows: pd.DataFrame,
    base: pd.DataFrame | None,
    column: str,
) -> tuple[list[bool], list[bool]]:
    """``column``'s outcomes of the requests graded in both, in ``rows``' order: (base,
    rows)."""
    if base is None or rows.empty:
        return [], []
    theirs, mine = graded_in_both(rows, base, column)
    return outcomes(theirs), outcomes(mine)


def graded_in_both(
    rows: pd.DataFrame, base: pd.DataFrame, column: str
) -> tuple[pd.Series, pd.Series]:
    """``column`` of the requests graded in both, in ``rows``' order, by request id: (base,
    rows)."""
    theirs = base[column].reindex(rows.index)
    both = rows[column].notna() & theirs.notna()
    return theirs[both], rows.loc[both, column]


def combined_pairs(
    rows: pd.DataFrame,
    ref: pd.DataFrame | None,
    control: pd.DataFrame | None,
    demoted: frozenset[str] = frozenset(),
) -> tuple[list[bool], list[bool], int]:
    """Every graded pair of one target and bucket, explicit and derived pooled, and how many
    are derived. A request is one pair at most: with a check, its grade against the
    reference's (explicit checks win); without one, its derived grade (agreement with the
    reference's answer) against the A/A control's derived grade of the same request, the
    reference agreeing with itself. Without a control the baseline is a pass: every
    disagreement with the reference counts against the candidate, the conservative reading
    (no noise floor). Derived grades of a ``demoted`` rule (``rule_floors``) are left out."""
    a, b = paired_outcomes(rows, ref, "passed")
    derived = _derived(rows, demoted)
    if control is None:
        base, mine = [True] * len(derived), outcomes(derived["d_passed"])
    else:
        base, mine = paired_outcomes(derived, control, "d_passed")
    return a + base, b + mine, len(base)


def _derived(rows: pd.DataFrame, demoted: frozenset[str]) -> pd.DataFrame:
    """The requests graded by a derived grade in the pairs: no check, a derived outcome, a
    rule not demoted."""
    return rows[rows["passed"].isna() & rows["d_passed"].notna() & ~rows["rule"].isin(demoted)]


def combined_differences(
    rows: pd.DataFrame,
    ref: pd.DataFrame | None,
    control: pd.DataFrame | None,
    demoted: frozenset[str] = frozenset(),
) -> pd.Series:
    """``combined_pairs`` as each pair's difference (target minus baseline: -1, 0 or +1) by
    request id: what a per-request statistic (the trend across context length) reads."""
    import pandas as pd

    parts = []
    if ref is not None and not rows.empty:
        theirs, mine = graded_in_both(rows, ref, "passed")
        parts.append(mine.astype(float) - theirs.astype(float))
    derived = _derived(rows, demoted)
    if control is None:
        parts.append(derived["d_passed"].astype(float) - 1.0)
    elif not derived.empty:
        theirs, mine = graded_in_both(derived, control, "d_passed")
        parts.append(mine.astype(float) - theirs.astype(float))
    parts = [p for p in parts if not p.empty]
    return pd.concat(parts) if parts else pd.Series([], dtype=float)
