"""The machinery behind ``locustfile.py``: kvcanary's replay core driven from Locust.

How kvcanary's concepts map onto Locust's
-----------------------------------------
* A trace request is one task iteration of a Locust user. A user sends one request at a time,
  so Locust's user count is the concurrency (a closed loop, ``replay --concurrency N``); in
  the trace-timestamp shape each user sends its next request at the request's due time and
  the user count caps the requests in flight (``--trace-times --max-in-flight``).
* A phase is a load level: the shapes (``kvc.shapes``) name each level ``c<N>`` (or
  ``trace-x<scale>``), exactly as ``replay`` names its schedules, and results carry it.
* A result (``replay.core.records.Result``) is reported as Locust request events per context
  bucket: ``ttft <b>``, ``itl <b>``, ``e2e <b>``, ``output_tokens <b>`` and, with checkers
  on, ``check <b>`` (see ``replay.locust.events.locust_events``). Locust's own statistics,
  charts, CSV and distributed stats merging work on those unchanged.
* The run directory is ``replay``'s: results go to the master (Locust messages), which writes
  ``results.jsonl`` as they arrive and ``manifest.json``/``summary.json``/``grades.jsonl``
  when the test stops, so ``replay report RUN_DIR`` renders a Locust run.

The modules, by role
--------------------
    options    kvcanary's command-line options, read into one test's validated Config
    bridge     the one asyncio loop per process, run in a greenlet (why: see there)
    protocol   the messages between the master and its workers
    worker     the worker role: the master's messages to it and the users' steps
    shard      one shard of the trace, prepared and sent by Locust's users
    lease      a worker's list of requests and the claims the master granted it
    outbox     the results (and the last word) a shard ships to the master
    master     the master role: a test's start, phases, results and run directory
    fleet      the workers of a test as the master sees them: claims, loss, re-assignment
    run        one test as the master holds it: its state, plan and recorder
    shapes     the load shapes Locust offers (users, step sweep, trace timestamps)

A standalone Locust process plays both roles (Locust emulates the messages locally);
``locustfile.py`` wires Locust's events to a ``Master``, a ``Worker``, or both, by role.
"""
