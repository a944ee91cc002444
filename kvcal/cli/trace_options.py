"""The options of reading a trace that ``kvcal sample`` (so ``calibrate --trace``) and
``kvcal emulate`` share: the same option, the same meaning, in each command's ``--help``.

The options whose defaults or help differ by command (``--trace``, ``--per-bucket``,
``--seed``) stay with their commands.
"""

from __future__ import annotations

import click

from replay.core.buckets import DEFAULT_BOUNDS

TRACE_FORMAT_OPTION = click.option("--trace-format", default="auto", show_default=True)
BUCKETS_OPTION = click.option(
    "--buckets",
    "bucket_spec",
    default=DEFAULT_BOUNDS,
    show_default=True,
    help="Context-length bucket bounds, as in replay --buckets.",
)
ON_BAD_LINE_OPTION = click.option(
    "--on-bad-line", type=click.Choice(["fail", "skip"]), default="fail", show_default=True
)
