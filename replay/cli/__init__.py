"""The ``replay`` command line (``commands``); ``python -m replay.cli`` runs it too.

Its exit codes are ``replay.core.exit_codes.ExitCode``; the ``EXIT_*`` names are the same
values under the names tests and scripts have read them by.
"""

from replay.cli.commands import main
from replay.cli.replay_run import target_errors
from replay.core.exit_codes import ExitCode

EXIT_OK = ExitCode.OK
EXIT_INPUT = ExitCode.INPUT
EXIT_TARGET_FAILED = ExitCode.TARGET_FAILED
EXIT_TARGET_ERRORS = ExitCode.TARGET_ERRORS

__all__ = [
    "EXIT_INPUT",
    "EXIT_OK",
    "EXIT_TARGET_ERRORS",
    "EXIT_TARGET_FAILED",
    "ExitCode",
    "main",
    "target_errors",
]
