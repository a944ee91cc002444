"""kvcanary's replay engine: is the FP8 KV cache safe for this model and this traffic?

Architecture (imports point one way, downwards; lint-imports checks it, see pyproject.toml):

    cli                                   the ``replay`` command: typed options, the run's steps,
                                          ``trace`` commands; the only place click lives
    locust   present   tools   testmodel  Locust adapter support (plans, events, target,
                                          recorder), reports (views, charts, HTML, Markdown,
                                          tables), trace anonymizer and PII detectors, test model
                                          (siblings never import each other)
    run                                   one replay: config, runner (targets x phases), phase
                                          loop, sessions, resume state, the one manifest builder,
                                          the one analysis pipeline (analyze), sweeps, the run dir
    analysis                              schemas, summary (SLOs, sessions), grading, stats,
                                          systems, saturation, sequential evidence, verdict
    serving                               SSE, streaming client (its own HTTP/1.1), server API,
                                          prompt tokens, targets, local servers, scale log
    core     checkers                     errors, exit codes, records, trace + importers,
                                          sessions, SLOs, buckets, schedules, synth, extras,
                                          the event loop;
                                          the answer checkers

The core and the checkers never import locust, gevent, torch, transformers, vLLM or kvcal.
kvcal may import replay, never the reverse.

Public API: ``load_run(RUN_DIR)`` returns a run directory's results, grades, server metrics
and teacher-forced scores as pandas DataFrames (``replay.run.rundata``).
"""

__version__ = "0.1.0"

# After __version__: modules below import it.
from replay.run.rundata import RunData, load_run

__all__ = ["RunData", "__version__", "load_run"]
