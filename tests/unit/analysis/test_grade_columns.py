"""Grades kept as columns (``GradeColumns``) give quality the same table as grade rows kept
whole (``frame_of``): the same values, types, index and order, for every mix a column can
hold (all None, some None, none)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from replay.analysis.grading.pairing import GRADE_COLUMNS, FlatGrade, GradeColumns, frame_of

yes_no = st.sampled_from([True, False, None])
flat_rows = st.tuples(
    st.sampled_from(["serve", "c16"]),
    st.sampled_from(["bf16", "fp8", "bf16-control"]),
    st.sampled_from([f"req-{i}" for i in range(6)]),
    st.sampled_from(["<8K", "8K-32K"]),
    st.booleans(),
    yes_no,
    st.sampled_from([None, "derived:facts", "derived:json"]),
    yes_no,
    yes_no,
    st.booleans(),
    st.booleans(),
    yes_no,
    yes_no,
    st.one_of(st.none(), st.integers(0, 500)),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(flat_rows, max_size=12))
def test_grade_columns_frame(rows: list[FlatGrade]) -> None:
    columns = GradeColumns()
    for row in rows:
        columns.append(row)
    assert len(columns) == len(rows)
    got, want = columns.frame(), frame_of(rows)
    assert list(got.columns) == list(GRADE_COLUMNS)
    assert got.dtypes.to_dict() == want.dtypes.to_dict()
    assert got.index.equals(want.index)
    assert got.equals(want)
    assert len(columns.frame()) == 0  # the columns were let go into the frame
