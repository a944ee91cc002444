"""What a worker's shard ships to the master: its results, in batches, each with its claim's
``seq`` (the master's ledger resolves the claim with it), and the word that it is done."""

from __future__ import annotations

from typing import Any

from locust.env import Environment

from kvc.protocol import MSG_DONE, MSG_RESULTS, RESULTS_BATCH, runner_of
from replay.locust.messages import RunPlan

Row = tuple[dict[str, Any], int | None]  # a Result's JSON and its claim's seq (None: unclaimed)


class Outbox:
    """Results waiting to go to the master, and the shard's last word."""

    def __init__(self, env: Environment, plan: RunPlan) -> None:
        self.env, self.plan = env, plan
        self.pending: list[Row] = []

    def add(self, row: dict[str, Any], seq: int | None) -> None:
        self.pending.append((row, seq))

    def flush(self) -> None:
        while self.pending:
            batch, self.pending = self.pending[:RESULTS_BATCH], self.pending[RESULTS_BATCH:]
            runner_of(self.env).send_message(
                MSG_RESULTS,
                {
                    "run": self.plan.run_id,
                    "shard": self.plan.shard,
                    "rows": [row for row, _ in batch],
                    "seqs": [seq for _, seq in batch],
                },
            )

    def done(self, stopped: bool, failure: str | None, adoptions: int) -> None:
        """Every result is out; ``adoptions``: the re-assignments it includes."""
        self.flush()
        runner_of(self.env).send_message(
            MSG_DONE,
            {
                "run": self.plan.run_id,
                "shard": self.plan.shard,
                "stopped": stopped,
                "failure": failure,
                "adoptions": adoptions,
            },
        )
