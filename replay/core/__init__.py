"""The core: validated inputs and the records of the hot path.

Errors, result records and their JSON form, the trace format and its importers, bucketing,
schedules (open and closed loop, injected clock), synthetic prompts, the checks for optional
dependencies (``extras``: what to install), and ``credentials``: the one redaction every writer
of a target URL or a server's words applies. It imports nothing above it in ``replay`` (only
``replay.checkers``, which validates a trace's checks) and never locust, gevent, torch,
transformers, vLLM or kvcal.
"""
