"""The code checker's sandbox: an answer's code and its tests run in a separate process under
the strongest isolation this machine allows (``run``'s docstring has the modes), with limits on
time, memory and output (``limits``). ``command`` builds the isolating command line,
``supervise`` runs it, ``procs`` finds and kills what it left, ``output`` reads what it said.
``harness`` is the trusted test runner, joined into one script inside the sandbox."""

from replay.checkers.sandbox.limits import SandboxLimits, SandboxResult
from replay.checkers.sandbox.run import run_python

__all__ = ["SandboxLimits", "SandboxResult", "run_python"]
