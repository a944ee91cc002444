"""Grades per request and quality per target x bucket, against the reference target.

Each answered request gets its checker's grade and its agreement with the reference's answer
to the same request in the same phase (exact, normalized, first divergent token). A request
that failed is not a quality result: it is counted as an error and left out of the pairs.
Quality per bucket pairs each target with the reference on the requests both answered; the
A/A control (the reference replayed a second time) gives the noise floor.

A request without a ``check`` is graded against the reference's answer instead (the
reference's answer is the label; rules in ``checkers._derived``): every other target's answer,
the A/A control's included, gets a ``derived`` grade naming its rule. A request with a check
gets none: explicit checks always win. Derived grades are reported beside the explicit ones
(``quality``'s ``derived`` blocks), each target paired with the control's derived agreement on
the same requests, which is their noise floor.

Grading is bounded (``checkers.Grader``): an answer that makes its checker raise, run too long
or read too much fails with a "checker error" reason; it never stops the run's analysis.

Quality reads the grades as a table (``grades_frame``, one row per answer): pandas groups it by
phase, target and bucket, and a target's requests are paired with the reference's (or the
control's) by request id, in the target's own order, which the seeded bootstrap depends on.
The result is a ``Quality`` record (``schemas``), summary.json's ``quality`` as JSON.

* ``rows`` - the grade rows: one per answer (``grade_rows``), and what grading keeps of a
  trace record (``GradingSpec``).
* ``pairing`` - the grades as a table, and the pairs of a target with its baseline.
* ``compare`` - one target against its baseline in one bucket: explicit, derived, combined
  and teacher-forced.
* ``quality`` - every phase, target and bucket, with noise floors and notes
  (``assess_quality``).
* ``trend`` - each target's trend across context length in a phase: its graded and
  teacher-forced differences per request against the request's prompt tokens.
"""
