"""kvcanary's replay engine: is the FP8 KV cache safe for this model and this traffic?

Architecture (imports point one way, downwards; lint-imports checks it, see pyproject.toml):

    cli                                   the ``replay`` command: typed options, the run's steps
                                          and its composition root, ``trace`` commands; the only
                                          place click lives
    locust   present   tools   testmodel  Locust adapter support (plans, events, target,
                                          recorder), reports (views, charts, HTML, Markdown,
                                          tables), trace anonymizer and PII detectors, test model
                                          (siblings never import each other)
    run                                   one replay: config, runner (targets x phases, given its
                                          sender, connector and order), phase
                                          loop, sessions, resume state, the one manifest builder,
                                          the one analysis pipeline (analyze), sweeps, the run dir
    analysis                              schemas, summary (SLOs, sessions), grading, stats,
                                          systems, saturation, sequential evidence, verdict
    serving                               SSE, streaming client (its own HTTP/1.1), server API,
                                          prompt tokens, targets, local servers, scale log
    traces                                the v1 trace format, multi-turn sessions, synthetic
                                          prompts, the importers of other formats
    checkers                              the answer checkers: task checks, derived grades
                                          (derived/), the code sandbox (sandbox/)
    core                                  errors (the one tree), exit codes, records, ids, the
                                          strictness rule, SLOs, buckets, schedules, extras,
                                          JSON records, the event loop

Core, checkers and traces never import locust, gevent, torch, transformers, vLLM or kvcal.
kvcal may import replay, never the reverse. No two siblings import each other in a cycle, and
a private module is imported only from its own package.

Public API: ``load_run(RUN_DIR)`` returns a run directory's results, grades, server metrics
and teacher-forced scores as pandas DataFrames (``replay.run.rundata``).
"""

__version__ = "0.1.0"

# After __version__: modules below import it.
from replay.run.rundata import RunData, load_run

__all__ = ["RunData", "__version__", "load_run"]
