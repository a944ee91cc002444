"""What the master and its workers say to each other (Locust's custom messages).

At test start the master (or a standalone process, which plays both roles through Locust's
local message emulation) checks the trace and sends each worker a ``RunPlan`` with its shard
(``i % shards == shard``: every trace request is sent by exactly one worker, none skipped).
Workers prepare their shard (bucket counts on the target's tokenizer, the synthetic-prompt
pool), report ready, and send nothing until the master says go (the first phase), so all
phases start together and phase windows are the master's.

A worker sends a request only once the master has granted its claim (``kvc_claim``, answered
by ``kvc_lease``; claims run a little ahead of the users, so they rarely wait): the master's
ledger (``replay.locust.ledger``) then knows at every moment what each worker may have sent.
A worker sends its results back in batches, each with its claim's ``seq``, and ``kvc_done``
after its last one; the test ends when every shard is done or lost (or the shape's last level
ends, or ``--run-time``). When Locust marks a worker missing (no heartbeat) or no longer lists
it, the master keeps what it reported, records what it had claimed as lost and re-assigns
what it never claimed to the live workers (``kvc_adopt``). When a test stops early, in-flight
requests are cancelled and unsent ones recorded as cancelled, so every trace request still
appears exactly once in ``results.jsonl``.

    master -> workers   kvc_plan (a RunPlan), kvc_phase (the first one is "go"), kvc_stop,
                        kvc_lease (claims granted, or refused to a worker given up on),
                        kvc_adopt (a lost worker's unsent requests)
    workers -> master   kvc_ready (or why the shard cannot run), kvc_claim,
                        kvc_results (batches), kvc_done (after the shard's last result)
"""

from __future__ import annotations

from locust.env import Environment
from locust.runners import Runner

MSG_PLAN, MSG_PHASE, MSG_STOP = "kvc_plan", "kvc_phase", "kvc_stop"
MSG_READY, MSG_RESULTS, MSG_DONE = "kvc_ready", "kvc_results", "kvc_done"
MSG_CLAIM, MSG_LEASE, MSG_ADOPT = "kvc_claim", "kvc_lease", "kvc_adopt"
RESULTS_BATCH = 64  # result rows per kvc_results message
STOP_WAIT_S = 15.0  # how long a stopping test waits for in-flight results and workers


def runner_of(env: Environment) -> Runner:
    """The process's Locust runner: started before any kvcanary hook runs."""
    if env.runner is None:
        raise RuntimeError("Locust has not started a runner in this environment")
    return env.runner
