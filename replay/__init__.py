"""kvcanary's replay engine: is the FP8 KV cache safe for this model and this traffic?

Architecture (imports point one way, downwards):

    cli, reports                       user-facing; the only place rich and click live
    _runner                            one replay: targets x schedules, writes the run dir
    _client _schedule _introspect      HTTP streaming, timing, server metrics
    _targets _synth _importers         servers we start or reach; prompts; trace formats
    _trace _records _buckets _errors   validated inputs, hot-path records, bucketing

The core never imports locust, gevent or kvcal. kvcal may import the trace and bucketing code.

Public API: ``load_run(RUN_DIR)`` returns a run directory's results, grades, server metrics
and teacher-forced scores as pandas DataFrames (``_rundata``).
"""

__version__ = "0.1.0"

# After __version__: modules below import it.
from ._rundata import RunData, load_run

__all__ = ["RunData", "__version__", "load_run"]
