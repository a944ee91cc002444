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
across workers: see the ``kvc`` package beside this file; the shapes: ``kvc/shapes.py``.
This file only wires Locust's events to kvcanary's roles: a ``Master`` on a master, a
``Worker`` on a worker, both on a standalone process.

Exit code (headless): 0, or ``--exit-code-on-error`` when a request failed (checker failures
alone do not count: they are the answers' quality, in the report), 2 for bad options, 3 when
the target cannot be used, 4 when its error budget stopped the test, 143 on SIGTERM
(``replay.core.exit_codes.ExitCode``). A bug in kvcanary is not blamed on the target: its
traceback is logged and listed among Locust's exceptions (exit ``--exit-code-on-error``).
"""

from __future__ import annotations

import signal
from typing import Any, ClassVar

import gevent
from kvc.bridge import AsyncBridge
from kvc.master import Master
from kvc.options import add_arguments
from kvc.protocol import (
    MSG_ADOPT,
    MSG_CLAIM,
    MSG_DONE,
    MSG_LEASE,
    MSG_PHASE,
    MSG_PLAN,
    MSG_READY,
    MSG_RESULTS,
    MSG_STOP,
)
from kvc.shapes import KvcShape, StepSweep, TraceTimes  # the first is the default shape
from kvc.worker import Worker
from locust import User, constant, events, task
from locust.env import Environment
from locust.exception import StopUser
from locust.runners import MasterRunner, Runner, WorkerRunner

__all__ = ["KvcShape", "LLMUser", "StepSweep", "TraceTimes"]


class LLMUser(User):
    """One concurrent client replaying the trace: takes the next request of this process's
    shard, sends it (streaming), reports it, and stops when the shard is exhausted."""

    wait_time = constant(0)  # a closed loop: the next request as soon as one completes
    worker: ClassVar[Worker | None] = None  # this process's worker role, once wired

    @task
    def replay(self) -> None:
        if self.worker is None or not self.worker.user_step():
            raise StopUser()


@events.init_command_line_parser.add_listener
def _arguments(parser: Any, **_: Any) -> None:
    add_arguments(parser)


@events.init.add_listener
def _install(environment: Environment, runner: Runner | None, **_: Any) -> None:
    if runner is None:
        return
    bridge = AsyncBridge()  # one asyncio loop per process, shared by both roles
    master = None if isinstance(runner, WorkerRunner) else _master(environment, runner, bridge)
    worker = None if isinstance(runner, MasterRunner) else _worker(environment, runner, bridge)

    def quitting(**_: Any) -> None:
        # The shard's client closes first, then the master completes the run directory; the
        # loop they both use stops last.
        if worker is not None:
            worker.close()
        if master is not None:
            master.quitting()
        bridge.close()

    environment.events.quitting.add_listener(quitting)


def _master(env: Environment, runner: Runner, bridge: AsyncBridge) -> Master:
    master = Master(env, bridge)
    runner.register_message(MSG_READY, master.on_ready)
    runner.register_message(MSG_CLAIM, master.on_claim)
    runner.register_message(MSG_RESULTS, master.on_results)
    runner.register_message(MSG_DONE, master.on_done)
    env.events.test_start.add_listener(lambda **_: master.begin())
    env.events.test_stopping.add_listener(lambda **_: master.stopping())
    env.events.test_stop.add_listener(lambda **_: master.end())
    # Locust installs its SIGTERM handler only after a headless run with a load shape
    # (kvcanary's default) has ended, so a container stop killed the master with no
    # summary. Until Locust's handler replaces this one, a SIGTERM stops the test the
    # normal way: users end at once and the run directory is completed.
    gevent.signal_handler(signal.SIGTERM, lambda: gevent.spawn(master.sigterm))
    for shape in {env.shape_class, *(env.available_shape_classes or {}).values()}:
        if isinstance(shape, KvcShape):
            shape.master = master
    master.on_init()
    return master


def _worker(env: Environment, runner: Runner, bridge: AsyncBridge) -> Worker:
    worker = LLMUser.worker = Worker(env, bridge)
    runner.register_message(MSG_PLAN, worker.on_plan)
    runner.register_message(MSG_PHASE, worker.on_phase)
    runner.register_message(MSG_STOP, worker.on_stop)
    runner.register_message(MSG_LEASE, worker.on_lease)
    runner.register_message(MSG_ADOPT, worker.on_adopt)
    env.events.test_stop.add_listener(
        lambda **_: worker.stop_shard("cancelled", "not sent: the test stopped")
    )
    return worker
