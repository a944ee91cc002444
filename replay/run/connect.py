"""Connecting to a target: the runner's seam between a target's URL and the arm its phases are
sent on.

``HttpConnector`` asks the target what it serves (introspection, the dtype check), counts the
trace's prompts on its tokenizer and scrapes its /metrics while the connection lasts; what it
yields (``Connected``) is the ``TargetSession`` every phase of the target shares, and how to
score answers teacher-forced on it. A test may pass a connector of its own, which opens no
socket: with a sender of its own too (replay/run/senders.py), a whole run then goes by without
the wire.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Protocol

import aiohttp

from replay.core.errors import RunDirError
from replay.core.schedule import Clock
from replay.run.phase import TargetSession
from replay.run.progress import Progress
from replay.run.run_config import RunConfig, TargetRun
from replay.run.teacher import Scoring
from replay.rundir.files import JsonlWriter
from replay.serving.client import Client
from replay.serving.endpoints import api_session
from replay.serving.introspect import engine_config_from_log, introspect, served_model
from replay.serving.local_server import LocalServer
from replay.serving.metrics import MetricsSnapshot, Scraper
from replay.serving.prompt_scores import serves_cached_scores
from replay.serving.prompt_tokens import UNKNOWN, prompt_token_counts, token_pool
from replay.serving.scale_log import scale_lines
from replay.serving.targets import check_served_dtype

__all__ = ["Connected", "Connector", "HttpConnector"]


@dataclass(frozen=True)
class Connected:
    """A target ready for its phases: the arm they share, and its teacher-forced scoring
    (``scoring(writer)``: where the scores go)."""

    arm: TargetSession
    scoring: Callable[[JsonlWriter], Awaitable[Scoring]]


class Connector(Protocol):
    """Opens one target (its ``info`` noted in ``run``) for as long as its phases last; a
    target that cannot be used raises TargetError (the runner records it as failed)."""

    def open(
        self, run: TargetRun, url: str, server: LocalServer | None
    ) -> AbstractAsyncContextManager[Connected]: ...


class HttpConnector:
    """The target over HTTP: introspected, checked, its prompts counted, /metrics scraped
    (into ``metrics/<target>.jsonl``)."""

    def __init__(
        self,
        cfg: RunConfig,
        clock: Clock,
        progress: Progress,
        save_manifest: Callable[[], None],
        cannot_write: Callable[[RunDirError], None],
    ) -> None:
        self.cfg, self.clock, self.progress = cfg, clock, progress
        self.save_manifest, self.cannot_write = save_manifest, cannot_write

    @asynccontextmanager
    async def open(
        self, run: TargetRun, url: str, server: LocalServer | None
    ) -> AsyncIterator[Connected]:
        spec = run.spec
        # The target's key goes with every call made on this session (introspection,
        # /metrics, /tokenize, teacher-forced scoring), and only to the target's URL.
        async with api_session(spec.auth_headers()) as session:
            info = await introspect(session, url)
            run.info.update(info)
            if server is not None:
                log = server.log_text()
                run.info["engine_config"] = engine_config_from_log(log)
                run.info["scale_log_lines"] = scale_lines(log)
                run.info["log"] = str(server.log_path.relative_to(self.cfg.run_dir))
            model = served_model(info)
            check_served_dtype(
                spec,
                info["cache_config"].get("cache_dtype"),
                server.log_text() if server is not None else None,
                run.info["problems"],
            )
            self.save_manifest()
            client = Client(
                url,
                model,
                headers=spec.auth_headers(),
                timeout_s=self.cfg.load.timeout_s,
                seed=self.cfg.load.seed,
                clock=self.clock.now,
                token_logprobs=self.cfg.quality.teacher_forced,
            )
            try:
                async with self._measured(run, session, client, url) as arm:

                    async def scoring(writer: JsonlWriter) -> Scoring:
                        return Scoring(
                            session,
                            url,
                            client.model,
                            writer,
                            self.progress,
                            self.cfg.load.timeout_s,
                            salt=None,
                            # A local server is started to serve them; an external one is asked.
                            cached=run.spec.is_local or await serves_cached_scores(session, url),
                        )

                    yield Connected(arm, scoring)
            finally:
                await client.close()

    @asynccontextmanager
    async def _measured(
        self, run: TargetRun, session: aiohttp.ClientSession, client: Client, url: str
    ) -> AsyncIterator[TargetSession]:
        """One target's prompt lengths on its tokenizer, and its /metrics scraped while the
        block lasts."""
        trace = self.cfg.trace
        self.progress.status(f"[{run.spec.name}] counting prompt tokens on the target tokenizer")
        pool = await token_pool(session, url, client.model) if trace.has_synth else None
        counts = await prompt_token_counts(
            session,
            url,
            client.model,
            trace.iter_requests(),
            trace.count,
            problems=run.info["problems"],
        )
        run.info["tokens_counted"] = sum(c != UNKNOWN for c in counts)
        series = JsonlWriter(
            self.cfg.run_dir / "metrics" / f"{run.spec.name}.jsonl", self.cannot_write
        )

        def sink(snap: MetricsSnapshot) -> None:
            series.write(snap.to_json())

        scraper = Scraper(session, url, self.clock.now, sink)
        scraper.start()
        try:
            mml = run.info.get("max_model_len")
            yield TargetSession(run.spec.name, client, counts, pool, run.budget, scraper, mml)
        finally:
            await scraper.stop()
            series.close()
            run.info["scrape_failures"] = scraper.failures
            if scraper.first_failure is not None:
                run.info["problems"].append(
                    f"{scraper.failures} /metrics scrape(s) failed; first: {scraper.first_failure}"
                )
