"""kvcanary's replay engine: is the FP8 KV cache safe for this model and this traffic?

Architecture (imports point one way, downwards; lint-imports checks it, see pyproject.toml):

    cli                                   the ``replay`` command: typed options, the run's steps
                                          and its composition root, ``trace`` commands; the only
                                          place click lives
    locust   present   tools   testmodel  Locust adapter support (plans, events, target,
                                          recorder), reports (views, charts, HTML, Markdown,
                                          tables), trace anonymizer and PII detectors, test model
                                          (siblings never import each other)
    run                                   the engine: config, runner (targets x phases, given
                                          its sender, connector and order), phase loop,
                                          sessions, servers, the capacity phase, sweeps
    pipeline                              the one analysis of a run directory (analyse,
                                          reanalyse), read as its manifest's run spec says
    rundir                                the run directory's format: files, the one manifest
                                          builder, shard files, resume state, the run as data
    analysis                              schemas, summary (SLOs, sessions), grading, stats,
                                          systems, saturation, sequential evidence, verdict
    serving                               SSE, streaming client (its own HTTP/1.1), server API,
                                          prompt tokens, targets, local servers, scale log
    traces                                the v1 trace format, multi-turn sessions, synthetic
                                          prompts, the importers of other formats
    checkers                              the answer checkers: task checks, derived grades
                                          (derived/), the code sandbox (sandbox/)
    core                                  errors (the one tree), exit codes, records, ids, the
                                          strictness rule, SLOs, buckets, schedules, shards,
                                          extras, credentials, JSON records, the event loop,
                                          the version (from pyproject.toml, via package metadata)

Core, checkers and traces never import locust, gevent, torch, transformers, vLLM or kvcal.
kvcal may import replay, never the reverse. No two siblings import each other in a cycle, and
a private module is imported only from its own package.

Public API: ``load_run(RUN_DIR)`` returns a run directory's results, grades, server metrics
and teacher-forced scores as pandas DataFrames (``replay.rundir.rundata``).
"""

from typing import TYPE_CHECKING, Any

from replay.core.version import __version__

if TYPE_CHECKING:
    from replay.rundir.rundata import RunData, load_run

__all__ = ["RunData", "__version__", "load_run"]


def __getattr__(name: str) -> Any:
    """``RunData`` and ``load_run``, imported when first asked for: importing any module of
    ``replay`` (``replay.core.errors``, say) runs this file, and the run as data brings pandas
    and the analysis with it."""
    if name in ("RunData", "load_run"):
        from replay.rundir import rundata

        return getattr(rundata, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
