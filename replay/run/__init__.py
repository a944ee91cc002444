"""One replay: the run directory and its format, the runner and its phase loop, resume, the
error budget, trace exclusion, teacher-forced scoring, and the run read back as data.

The runner (``runner.Runner``) is given its collaborators and never subclassed: a clock, a
phase sender (``senders``: this process; ``worker_pool``: load processes), a connector
(``connect``: the target over HTTP) and an order (``runner.RunOrder``: one target after
another; ``interleave``: blocks; ``sequential_run``: rounds). ``replay/cli/compose.py`` picks
them; a test passes its own, and a run goes by without a socket (tests/support/nowire.py)."""
