"""What the master tells each worker: the ``RunPlan`` of one test, as plain data."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from replay.analysis.run_spec import RunSpec
from replay.run.budget import ErrorBudget
from replay.serving.targets import (
    TargetSpec,
)


@dataclass(frozen=True)
class RunPlan:
    """Everything a worker needs for one test, sent by the master in a message (plain data), so
    a worker does not depend on its own command line: the web UI may have changed it. A
    worker's spec is the run's (``run``, as the manifest records it) plus its ``shard``, and
    what the run spec does not say of a Locust worker's part."""

    run: RunSpec
    target: dict[str, Any]  # the target's spec (the run spec names it only)
    mode: str
    time_scale: float
    itl_events: int
    epoch_wall: float
    limit: int = 0  # the trace positions read (0: all), as the master read them
    shard: int = 0

    @property
    def run_id(self) -> str:
        return Path(self.run.run_dir.path).name

    @property
    def shards(self) -> int:
        return self.run.load.workers

    @property
    def first_label(self) -> str:
        return self.run.load.schedules[0]

    def budget(self) -> ErrorBudget:
        """The shard's error budget (replay/run/budget.py)."""
        return ErrorBudget.of(self.run.budget)

    def with_shard(self, shard: int) -> RunPlan:
        return replace(self, shard=shard)

    def to_msg(self) -> dict[str, Any]:
        return {**asdict(self), "run": self.run.to_json()}

    @classmethod
    def from_msg(cls, data: Mapping[str, Any]) -> RunPlan:
        values = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**{**values, "run": RunSpec.from_json(data["run"], where="kvc_plan: run")})

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
