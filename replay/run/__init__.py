"""The engine of one replay: the runner and its phase loop, the orders it runs in
(interleaved, sequential), load processes (``--workers``), local servers, the capacity phase,
sweeps, the error budget, trace exclusion and teacher-forced scoring. What it writes is
``replay.rundir``'s format; the analysis at the end is ``replay.pipeline``'s.

The runner (``runner.Runner``) is given its collaborators and never subclassed: a clock, a
phase sender (``senders``: this process; ``worker_pool``: load processes), a connector
(``connect``: the target over HTTP) and an order (``runner.RunOrder``: one target after
another; ``interleave``: blocks; ``sequential_run``: rounds). ``replay/cli/compose.py`` picks
them; a test passes its own, and a run goes by without a socket (tests/support/nowire.py)."""
