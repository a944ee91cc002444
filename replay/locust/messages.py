"""What the master tells each worker: the ``RunPlan`` of one test, as plain data."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from replay.run.budget import ErrorBudget
from replay.serving.targets import (
    TargetSpec,
)


@dataclass(frozen=True)
class RunPlan:
    """Everything a worker needs for one test, sent by the master in a message (plain data), so
    a worker does not depend on its own command line: the web UI may have changed it."""

    run_id: str
    trace_path: str
    trace_sha256: str
    limit: int
    buckets: str
    target: dict[str, Any]
    mode: str
    first_label: str
    time_scale: float
    loop: bool
    checkers: bool
    seed: int
    timeout_s: float
    itl_events: int
    epoch_wall: float
    shard: int = 0
    shards: int = 1
    # The shard's error budget (replay/run/budget.py); 0 max_errors: no absolute cap.
    max_errors: int = 0
    max_error_rate: float = 0.05

    def budget(self) -> ErrorBudget:
        return ErrorBudget(max_errors=self.max_errors or None, max_error_rate=self.max_error_rate)

    def to_msg(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_msg(cls, data: Mapping[str, Any]) -> RunPlan:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    def target_spec(self) -> TargetSpec:
        t = self.target
        return TargetSpec(
            name=t["name"],
            url=t["url"],
            api_key_env=t.get("api_key_env"),
            expect_cache_dtype=t.get("expect_cache_dtype"),
        )

    def salt(self, target: str, label: str, pass_no: int) -> str:
        """A prefix-cache salt per phase (and per pass over the trace), as the runner's."""
        base = f"{self.run_id}.{target}.{label}"
        return base if pass_no == 0 else f"{base}.p{pass_no}"


def target_message(spec: TargetSpec) -> dict[str, Any]:
    return {
        "name": spec.name,
        "url": spec.url,
        "api_key_env": spec.api_key_env,
        "expect_cache_dtype": spec.expect_cache_dtype,
    }
