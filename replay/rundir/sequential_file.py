"""``sequential.json``: a sequential canary's state, saved after every round, and what the
summary's ``sequential`` block is built from (by the run, and by
``replay report --reanalyse``).

The file holds the ``SequentialState`` (``analysis.sequential``: counts, decisions, the
interval path per round) and, under ``run``, the requests folded into it (``sent``, in order),
the round size, the trace's requests per bucket, why the run stopped and the seconds spent.
It is the truth a ``--resume`` starts from: results of requests it does not list were never
folded in, and are sent again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from replay.analysis.schemas import Sequential
from replay.analysis.sequential.state import SequentialState
from replay.analysis.sequential.summary_block import sequential_record
from replay.rundir.files import read_json, write_json

SEQUENTIAL = "sequential.json"


@dataclass
class SequentialRun:
    """The state and the run's bookkeeping around it."""

    state: SequentialState
    round_size: int
    pools: dict[str, int]  # the trace's requests per bucket
    sent: list[str] = field(default_factory=list)  # request ids folded into the state
    stopped: str = "running"  # decided | max_requests | max_time | trace | error_budget | ...
    elapsed_s: float = 0.0  # sending time over every process of the run

    def left(self, unsent: dict[str, int]) -> dict[str, int]:
        return {b: unsent.get(b, 0) for b in self.state.names}

    def record(self, unsent: dict[str, int]) -> Sequential:
        return sequential_record(
            self.state,
            stopped=self.stopped,
            round_size=self.round_size,
            requests_sent=len(self.sent),
            pools=self.pools,
            left=self.left(unsent),
        )

    def to_json(self, unsent: dict[str, int]) -> dict[str, Any]:
        return {
            **self.state.to_json(),
            "run": {
                "round_size": self.round_size,
                "pools": self.pools,
                "unsent": self.left(unsent),
                "stopped": self.stopped,
                "elapsed_s": self.elapsed_s,
                "sent": self.sent,
            },
        }

    def save(self, run_dir: Path, unsent: dict[str, int]) -> None:
        write_json(run_dir / SEQUENTIAL, self.to_json(unsent))

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SequentialRun:
        run = d["run"]
        return cls(
            state=SequentialState.from_json(d),
            round_size=int(run["round_size"]),
            pools={str(k): int(v) for k, v in run["pools"].items()},
            sent=[str(i) for i in run["sent"]],
            stopped=str(run["stopped"]),
            elapsed_s=float(run["elapsed_s"]),
        )


def load(run_dir: Path) -> tuple[SequentialRun, dict[str, int]] | None:
    """The saved run and its requests left per bucket; None when there is no file."""
    path = run_dir / SEQUENTIAL
    if not path.exists():
        return None
    d = read_json(path)
    return SequentialRun.from_json(d), {str(k): int(v) for k, v in d["run"]["unsent"].items()}


def load_record(run_dir: Path) -> Sequential | None:
    """The summary block of a run directory's sequential canary; None for other runs."""
    saved = load(run_dir)
    return None if saved is None else saved[0].record(saved[1])
