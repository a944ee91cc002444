"""kvcanary's replay engine: is the FP8 KV cache safe for this model and this traffic?

Architecture (imports point one way, downwards; lint-imports checks it, see pyproject.toml):

    cli                                   the ``replay`` command; the only place click lives
    locust   present   tools   testmodel  Locust adapter support, reports (rich tables), trace
                                          anonymizer, test model (siblings never import each other)
    run                                   one replay: targets x schedules, writes the run dir
    analysis                              summary, grading, systems, stats, roles, verdict
    serving                               SSE, streaming client, server API, targets, scale log
    core     checkers                     errors, records, trace + importers, buckets,
                                          schedules, synth; the answer checkers

The core and the checkers never import locust, gevent, torch, transformers, vLLM or kvcal.
kvcal may import replay, never the reverse.

Public API: ``load_run(RUN_DIR)`` returns a run directory's results, grades, server metrics
and teacher-forced scores as pandas DataFrames (``replay.run.rundata``).
"""

__version__ = "0.1.0"

# After __version__: modules below import it.
from replay.run.rundata import RunData, load_run

__all__ = ["RunData", "__version__", "load_run"]
