"""The exit codes of kvcanary's commands, defined once: ``replay`` (and ``replay canary``'s
verdicts) and the Locust scenario (``scenarios/locustfile.py``) mean the same by each number,
so a CI step can read them without knowing which driver ran.

``kvcal`` keeps its own small set (``kvcal/cli/common.py``): it is a separate tool.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    # A scan found something (``replay trace scan``, the re-scan of ``trace anonymize``).
    FINDINGS = 1
    # Bad input or usage: options, a trace line, a targets file.
    INPUT = 2
    # A target could not be used: did not start, serves something other than its spec
    # (e.g. the cache dtype), or could not be reached.
    TARGET_FAILED = 3
    # A target was used but did not answer: none of its requests, more than the allowed
    # share of them, or it was stopped by its error budget.
    TARGET_ERRORS = 4
    # The run directory could not be written mid-run (a full disk): every result written
    # before is kept, and ``--resume`` finishes the run once there is room.
    RUN_DIR = 5
    # ``replay canary``'s verdicts (``replay.analysis.verdict.VERDICTS``); "keep" is OK.
    VERDICT_CALIBRATE = 10
    VERDICT_PER_HEAD_OR_SKIP_LAYERS = 11
    VERDICT_REJECT = 12
    VERDICT_INSUFFICIENT_EVIDENCE = 13
    VERDICT_EMULATED_FP8 = 14  # no verdict: the FP8 cache was emulated inside a BF16 server
    INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as a shell reports it
    SIGTERM = 143  # stopped by SIGTERM (128 + 15), as a shell reports it
