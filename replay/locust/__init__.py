"""What kvcanary's Locust adapter (``scenarios/locustfile.py``) needs from replay.

Nothing here imports Locust or gevent: these are plain functions and classes over replay's own
trace, client, buckets, run directory, summary and grading, so they are typed, unit-tested and
usable by any other load driver. The adapter adds only the Locust and gevent glue.

    config     Config: one test's options, checked (config_of), and the RunSpec they describe
    plans      LoadPlan (Constant, StepSweep, TraceTimes): users over time, as pure functions
               of time; shard_indices(), read_shard(): which trace requests one worker sends
    events     locust_events(), check_event(): one Result as Locust request events
    target     resolve_target(), prepare(), send_one(), MetricsTap: the target, through the
               streaming client (``replay.serving``)
    messages   RunPlan: what the master tells each worker (the run's RunSpec and its shard)
    ledger     Ledger: who holds which trace requests, and what a lost worker leaves
    recorder   RunRecorder: the run directory, as ``replay`` writes it (one manifest builder,
               one analysis)
"""
