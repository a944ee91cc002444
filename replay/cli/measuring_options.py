"""The options that say how a run measures the systems side: interleaved arms
(replay/run/interleave.py), the systems rule's threshold (analysis/systems_cells.py) and the
capacity phase (replay/run/capacity_phase.py); ``run_options`` lists them among the run options and
``measuring`` resolves them."""

from __future__ import annotations

import click

MEASURING_OPTIONS = [
    click.option(
        "--interleave/--no-interleave",
        default=None,
        help="Serve every target at once and send each phase in blocks, arm after arm in a "
        "rotating order, so that a machine whose load drifts cannot favour one [default: on "
        "when targets are compared, except with --parallel-targets, --workers or "
        "--session-history reference].",
    ),
    click.option(
        "--block-size",
        default=0,
        show_default=True,
        type=click.IntRange(min=0),
        help="Interleaved: units (requests or sessions) per block; 0 = 2 x the concurrency "
        "of a closed loop, 32 in an open loop.",
    ),
    click.option(
        "--systems-threshold",
        default=0.05,
        show_default=True,
        type=click.FloatRange(0.0, 1.0, min_open=True),
        help="Smallest change in a latency or a rate that counts as faster, slower, more or "
        "fewer (0.05: x1.05 or /1.05), beyond the A/A floor as well.",
    ),
    click.option(
        "--capacity-phase/--no-capacity-phase",
        default=None,
        help="Restart the reference and the candidate with the same, smaller KV cache and "
        "load them until the reference's cache is full: does the candidate's larger cache "
        "serve more requests/s there? [default: on in `canary` when the workload's own load "
        "never fills the reference's cache and the quality side has not decided the verdict "
        "alone; local servers only].",
    ),
    click.option(
        "--capacity-concurrency",
        default=12,
        show_default=True,
        type=click.IntRange(min=2),
        help="Capacity phase: requests in flight (the reference's cache holds half of them "
        "at the workload's median length).",
    ),
    click.option(
        "--capacity-cache-mib",
        default=0,
        show_default=True,
        type=click.IntRange(min=0),
        help="Capacity phase: KV-cache memory of each server in MiB (0: sized from the "
        "workload's median request).",
    ),
    click.option(
        "--capacity-time-limit",
        default=600.0,
        show_default=True,
        type=click.FloatRange(min=0.0, min_open=True),
        metavar="SECONDS",
        help="Capacity phase: the most its blocks may take (checked between blocks; server "
        "start-up not counted). It stops sooner once its rule decides; stopped by this "
        "bound undecided, its cell is not weighed and the verdict says so.",
    ),
]
