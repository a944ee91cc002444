"""The ``replay`` command line (``commands``); ``python -m replay.cli`` runs it too."""

from replay.cli.commands import main
from replay.cli.common import (
    EXIT_INPUT,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TARGET_ERRORS,
    EXIT_TARGET_FAILED,
)
from replay.cli.replay_run import target_errors

__all__ = [
    "EXIT_INPUT",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_TARGET_ERRORS",
    "EXIT_TARGET_FAILED",
    "main",
    "target_errors",
]
