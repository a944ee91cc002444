"""kvcanary in Locust: replay an LLM trace against a vLLM (OpenAI-compatible) server, with
per-bucket TTFT/ITL/E2E statistics in Locust's web UI, concurrency-sweep shapes and
distributed workers.

    locust -f scenarios/locustfile.py --kvc-target http://127.0.0.1:8000      # web UI
    locust -f scenarios/locustfile.py --headless -u 8 -r 8 \\
        --kvc-target bf16=http://127.0.0.1:8000 --kvc-trace traces/sample.jsonl --kvc-buckets 256,1K
    locust -f scenarios/locustfile.py --headless --kvc-shape step --kvc-levels 1,4,16 ...
    locust -f scenarios/locustfile.py --master ...   +   locust -f scenarios/locustfile.py --worker

A thin adapter over the replay core: the core (``replay``) never imports Locust or gevent.
Locust users are the concurrency; each request is sent by the core's streaming client and
reported as Locust request events named per context bucket:

    ttft <b>            time to first token (ms)
    itl <b>             every inter-token gap (ms), at most --kvc-itl-events per request
    e2e <b>             whole request (ms); failures land here, with the error kind and reason
    output_tokens <b>   output tokens per request (in the response-time columns)
    check <b>           the trace's checker on the answer (--kvc-checkers on); a failed check
                        is a failure with the checker's reason

Every test writes a ``replay`` run directory (``--kvc-run-dir``), which ``replay report``
renders. How concepts map, why one asyncio loop per process, and how the trace is sharded
across workers: see ``kvc_runtime.py``; the shapes: ``kvc_shapes.py``.

Exit code (headless): 0, or ``--exit-code-on-error`` when a request failed (checker failures
alone do not count: they are the answers' quality, in the report), 2 for bad options, 3 when
the target cannot be used.
"""

from __future__ import annotations

from typing import Any

from kvc_runtime import KVC, add_arguments
from kvc_shapes import KvcShape, StepSweep, TraceTimes  # the first is the default shape
from locust import User, constant, events, task
from locust.exception import StopUser

__all__ = ["KvcShape", "LLMUser", "StepSweep", "TraceTimes"]


@events.init_command_line_parser.add_listener
def _arguments(parser: Any, **_: Any) -> None:
    add_arguments(parser)


@events.init.add_listener
def _install(environment: Any, runner: Any, **_: Any) -> None:
    KVC.install(environment, runner)


class LLMUser(User):
    """One concurrent client replaying the trace: takes the next request of this process's
    shard, sends it (streaming), reports it, and stops when the shard is exhausted."""

    wait_time = constant(0)  # a closed loop: the next request as soon as one completes

    @task
    def replay(self) -> None:
        if not KVC.user_step():
            raise StopUser()
