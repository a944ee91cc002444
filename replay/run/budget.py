"""When to stop sending to a target: its error budget, and backoff while it does not answer.

Both drivers (the CLI runner and the Locust workers) feed every finished request to one
``ErrorBudget`` per target. Failures of the target are results, so the budget never raises;
it says how long to wait before the next send and, once it is spent, why the target is
stopped. Without it a dead server turns a looping load test into a busy loop that writes
millions of ``connect`` errors (seen: 2.7 million in 23 minutes at 100% of a core).

* ``max_errors``: stop after this many failed requests (None: no absolute cap).
* ``max_error_rate``: stop once at least ``min_requests`` have finished and more than this
  share of them failed (None: no rate cap). The same number decides, at the end, whether
  ``replay`` exits with its "too many errors" code.
* A target that does not answer at all (refused connections, resets, 502/503/504) is backed
  off exponentially, ``backoff_base_s`` doubling up to ``backoff_cap_s``, and stopped after
  ``max_unreachable`` such failures in a row, with the last one as the reason.
Cancelled requests (an interrupt, a time limit) are not the target's failures and count for
nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from replay.analysis.run_spec import BudgetSpec

UNREACHABLE_KINDS = frozenset({"connect", "disconnect"})
UNREACHABLE_HTTP = frozenset({502, 503, 504})


@dataclass
class ErrorBudget:
    max_errors: int | None = None
    max_error_rate: float | None = None
    min_requests: int = 20
    max_unreachable: int = 10
    backoff_base_s: float = 0.05
    backoff_cap_s: float = 2.0
    finished: int = 0
    errors: int = 0
    unreachable_run: int = 0
    reason: str | None = None
    last_error: str = ""

    @classmethod
    def of(cls, spec: BudgetSpec) -> ErrorBudget:
        """A fresh budget of the run spec's limits."""
        return cls(max_errors=spec.max_errors, max_error_rate=spec.max_error_rate)

    def __post_init__(self) -> None:
        if self.max_errors is not None and self.max_errors < 1:
            raise ValueError("max_errors must be at least 1")
        if self.max_error_rate is not None and not 0 <= self.max_error_rate <= 1:
            raise ValueError("max_error_rate must be between 0 and 1")

    @property
    def spent(self) -> bool:
        return self.reason is not None

    def record(
        self,
        status: str,
        error_kind: str | None = None,
        http_status: int | None = None,
        error: str | None = None,
    ) -> None:
        """One finished request of this target."""
        if status == "cancelled" or error_kind == "cancelled":
            return
        self.finished += 1
        if status == "ok":
            self.unreachable_run = 0
        else:
            self.errors += 1
            self.last_error = f"{error_kind}: {(error or '')[:200]}"
            unreachable = error_kind in UNREACHABLE_KINDS or (
                error_kind == "http" and http_status in UNREACHABLE_HTTP
            )
            self.unreachable_run = self.unreachable_run + 1 if unreachable else 0
        if self.reason is None:
            self.reason = self._spent_because()

    def _spent_because(self) -> str | None:
        last = f" (last: {self.last_error})"
        if self.unreachable_run >= self.max_unreachable:
            return (
                f"the target stopped answering: {self.unreachable_run} requests in a row "
                f"failed{last}"
            )
        if self.max_errors is not None and self.errors >= self.max_errors:
            return f"{self.errors} failed requests reached --max-errors{last}"
        if (
            self.max_error_rate is not None
            and self.finished >= self.min_requests
            and self.errors / self.finished > self.max_error_rate
        ):
            return (
                f"{self.errors} of {self.finished} requests failed, more than "
                f"--max-error-rate {self.max_error_rate:g}{last}"
            )
        return None

    def delay(self) -> float:
        """Seconds to wait before the next send: 0 while the target answers."""
        if self.unreachable_run == 0:
            return 0.0
        return float(
            min(self.backoff_cap_s, self.backoff_base_s * 2.0 ** (self.unreachable_run - 1))
        )
