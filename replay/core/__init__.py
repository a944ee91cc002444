"""The core: validated inputs and the records of the hot path, below every other package.

Errors (the one tree), exit codes, result records (``records``) and the JSON records they and
the analysis's schemas are built on (``record_json``), request ids and id files, the strictness
rule for values read from outside, bucketing, SLOs, schedules (open and closed loop, injected
clock) and how a phase's sends split across load processes (``shards``), the event loop and
bounded iteration, the checks for optional dependencies (``extras``: what to install),
``credentials`` (the one redaction every writer of a target URL or a server's words applies)
and the version (``version``, from the installed package's metadata). It imports nothing else
in ``replay`` and never locust, gevent, torch, transformers, vLLM or kvcal.
"""
