"""The master role (a master, or a standalone process): one test at a time.

At each test start the master reads and checks the options (the web UI may have changed
them), opens the run directory and sends every worker its ``RunPlan``; the shapes' tick
asks it for the users and names the phases; workers' results are written as they arrive;
when the test stops, the run directory is completed (manifest, summary, grades) in
``replay``'s format, every trace request accounted for. Exit codes are ``ExitCode``'s.
"""

from __future__ import annotations

import logging
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import gevent
from locust.env import Environment
from locust.runners import MasterRunner, Runner

from kvc.bridge import AsyncBridge
from kvc.fleet import Fleet
from kvc.options import parsed_options, read_config
from kvc.protocol import MSG_PHASE, MSG_PLAN, MSG_STOP, STOP_WAIT_S
from kvc.run import Test, recorder, run_plan
from kvc.tap import scrape, start_tap, stop_tap, worker_info
from replay.core.credentials import redact
from replay.core.errors import KvcanaryError
from replay.core.exit_codes import ExitCode
from replay.locust.config import load_plan
from replay.locust.recorder import cancelled_result
from replay.locust.target import resolve_target
from replay.rundir.files import read_results

log = logging.getLogger("kvcanary")


class Master:
    """kvcanary's master role in this Locust process: its tests and their run directories."""

    def __init__(self, env: Environment, bridge: AsyncBridge) -> None:
        self.env, self.bridge = env, bridge
        self.test: Test | None = None
        self.broken: str | None = None  # why the current test could not start
        self.tests_started = 0

    @property
    def runner(self) -> Runner:
        assert self.env.runner is not None
        return self.env.runner

    def on_init(self) -> None:
        """Locust has started: headless and --autostart runs check their options before
        anything starts, and the start form's Host field shows the target."""
        opts = parsed_options(self.env)
        if opts.headless or opts.autostart:
            self.validate()
        if not self.env.host:
            try:
                url = resolve_target(
                    str(opts.kvc_target), None, str(opts.kvc_targets_file) or None
                ).url
                self.env.host = redact(url or "")  # shown and written by Locust: no credential
            except KvcanaryError:
                pass  # the test's start says what is wrong with it

    def shape_mode(self) -> tuple[str, bool]:
        """The active shape's mode and whether it honours -u/-r/--run-time; no kvcanary shape
        (Locust's "Default" in the class picker) is Locust's own users."""
        shape = self.env.shape_class
        mode_of = getattr(shape, "kvc_mode", None)
        if shape is None or mode_of is None:
            return "users", False
        return str(mode_of(parsed_options(self.env))), bool(shape.use_common_options)

    def validate(self) -> None:
        try:
            cfg = read_config(self.env, *self.shape_mode())
        except KvcanaryError as exc:
            log.error("kvcanary: %s", exc)
            sys.exit(ExitCode.INPUT)
        opts = parsed_options(self.env)
        if cfg.loop and cfg.mode == "users" and not getattr(opts, "run_time", None):
            log.warning(
                "kvcanary: --kvc-loop on with the users shape and no --run-time: the "
                "test runs until it is stopped"
            )

    # a test starts -----------------------------------------------------------------------
    def begin(self) -> None:
        self.broken = None
        if self.test is not None and not self.test.closed:
            self.end()
        try:
            cfg = read_config(self.env, *self.shape_mode())
            # The trace is streamed: the recorder re-reads it for grading, each worker
            # keeps only its shard.
            run_dir = self._run_dir(cfg.run_dir)
        except KvcanaryError as exc:
            self.broken = str(exc)
            log.error("kvcanary: cannot start: %s", exc)
            self.env.process_exit_code = ExitCode.INPUT
            if self.env.shape_class is None:
                gevent.spawn(self.runner.stop)
            return
        self.tests_started += 1
        if str(parsed_options(self.env).kvc_target or "").strip():
            # The web UI's header shows what is measured, without its credentials (Locust
            # shows and writes its host); a host the user gave is the target itself, kept.
            self.env.host = redact(cfg.spec.url or "")
        clients = self._workers()
        epoch_wall, epoch = time.time(), time.perf_counter()
        base = run_plan(cfg, run_dir, epoch_wall, max(1, len(clients)))
        driver = {
            "role": type(self.runner).__name__,
            "workers": len(clients),
            "shards": base.shards,
            "shape": cfg.mode,
        }
        rec = recorder(cfg, parsed_options(self.env), run_dir, driver, base.run)
        test = self.test = Test(cfg, base, rec, base.shards, epoch)
        test.fleet = Fleet(self.env, test, clients, lambda: self._changed(test))
        test.fleet.publish()
        rec.save_manifest()
        log.info(
            "kvcanary: run directory %s: %d requests in %d shard(s), shape %s",
            run_dir,
            cfg.trace.count,
            base.shards,
            cfg.mode,
        )
        gevent.spawn(start_tap, self.bridge, test)
        test.fleet.start()
        runner = self.runner
        if isinstance(runner, MasterRunner):
            for k, client_id in enumerate(clients):
                runner.send_message(MSG_PLAN, base.with_shard(k).to_msg(), client_id=client_id)
        else:
            runner.send_message(MSG_PLAN, base.to_msg())

    def _workers(self) -> list[str]:
        runner = self.runner
        if not isinstance(runner, MasterRunner):
            return []
        nodes = runner.clients.ready + runner.clients.spawning + runner.clients.running
        return [n.id for n in sorted(nodes, key=lambda n: runner.get_worker_index(n.id))]

    def _run_dir(self, given: str) -> Path:
        if not given:
            stamp = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)
            return Path("reports") / f"locust-{stamp}"
        path = Path(given)
        if self.tests_started:
            path = path.with_name(f"{path.name}-{self.tests_started + 1}")
        if path.exists() and any(path.iterdir()):
            raise KvcanaryError(f"--kvc-run-dir: {path} exists and is not empty")
        return path

    # phases --------------------------------------------------------------------------------
    def tick(self) -> tuple[int, float] | None:
        """The kvcanary shapes' tick: the plan's users, and the phase label to the workers;
        None when the run is over (trace exhausted, sweep done, run time, or a failure)."""
        mode, common = self.shape_mode()
        test = self.test
        if self.broken is not None:
            return None
        if test is None or test.closed:  # a new test, before its test_start
            try:
                plan = load_plan(parsed_options(self.env), mode, common)
            except KvcanaryError as exc:
                log.error("kvcanary: %s", exc)
                return None
            first = plan.tick(0.0)
            return None if first is None else (first.users, first.spawn_rate)
        if test.failed is not None or test.finished.is_set():
            return None
        if test.go_at is None:  # workers preparing: start the first level's users
            first = test.cfg.plan.tick(0.0)
            return None if first is None else (first.users, first.spawn_rate)
        tk = test.cfg.plan.tick(test.now() - test.go_at)
        if tk is None:
            return None
        self._set_phase(test, tk.label)
        return tk.users, tk.spawn_rate

    def _set_phase(self, test: Test, label: str) -> None:
        if label == test.label:
            return
        scrape(self.bridge, test)  # the closing phase's last point, stamped before the boundary
        test.label = label
        test.recorder.open_phase(label, test.now())
        scrape(self.bridge, test)  # the new phase's first point, as the CLI scrapes at phase edges
        test.recorder.save_manifest()
        log.info("kvcanary: phase %s", label)
        self.runner.send_message(MSG_PHASE, {"label": label})

    # the workers' messages -----------------------------------------------------------------
    def _current(self, msg: Any) -> Test | None:
        """The test a worker's message belongs to (None: an earlier test's, or none)."""
        test = self.test
        if test is None or msg.data.get("run") != test.base.run_id:
            log.warning("kvcanary: %s from an earlier test ignored", msg.type)
            return None
        return test

    def on_ready(self, environment: Environment, msg: Any, **_: Any) -> None:
        test = self._current(msg)
        if test is None or test.closed:
            return
        shard = int(msg.data["shard"])
        test.ready[shard] = msg.data.get("failure")
        if msg.data.get("internal"):
            test.internal[shard] = (str(msg.node_id), str(msg.data["internal"]))
        worker_info(test, msg.data.get("info"))
        self._maybe_go(test)

    def _maybe_go(self, test: Test) -> None:
        """Every shard ready (or its worker lost while preparing: its requests went to the
        others): the first phase starts, unless a shard cannot run."""
        if test.go_at is not None or test.closed or test.failed is not None:
            return
        lost = {a.shard for a in test.fleet.ledger.accounts if a.lost} if test.fleet else set()
        if any(k not in test.ready and k not in lost for k in range(test.shards)):
            return
        if test.internal:
            first = min(test.internal)
            self._fail_internal(test, str(test.ready[first]), *test.internal[first])
            return
        failures = [f for f in test.ready.values() if f]
        if failures:
            self._fail(test, failures[0])
            return
        test.go_at = test.now()
        first_tick = test.cfg.plan.tick(0.0)
        if first_tick is not None and test.shards > 1 and first_tick.users < test.shards:
            log.warning(
                "kvcanary: %d user(s) for %d workers: a worker without users leaves "
                "its shard waiting; use at least one user per worker (a multiple of "
                "the worker count keeps the shards even)",
                first_tick.users,
                test.shards,
            )
        self._set_phase(test, test.cfg.plan.labels[0])

    def _fail(self, test: Test, reason: str, code: ExitCode = ExitCode.TARGET_FAILED) -> None:
        test.failed = reason
        test.recorder.fail(reason)
        self.env.process_exit_code = code
        log.error("kvcanary: target %s failed: %s", test.cfg.spec.name, reason)
        self.runner.send_message(
            MSG_STOP, {"kind": "unavailable", "reason": f"target unavailable: {reason}"}
        )

    def _fail_internal(self, test: Test, reason: str, node: str, tb: str) -> None:
        """A bug in kvcanary stopped a shard. The test stops and the run directory says why;
        the target is not blamed (no target exit code): Locust lists the traceback among its
        exceptions, in the web UI and in its exit code (``--exit-code-on-error``)."""
        test.failed = reason
        test.recorder.fail(reason)
        self.runner.log_exception(node, reason, tb)
        log.error("kvcanary: %s", reason)
        self.runner.send_message(MSG_STOP, {"kind": "cancelled", "reason": f"not sent: {reason}"})

    def on_claim(self, environment: Environment, msg: Any, **_: Any) -> None:
        test = self._current(msg)
        if test is not None and test.fleet is not None:
            test.fleet.on_claim(str(msg.node_id), msg.data)

    def on_results(self, environment: Environment, msg: Any, **_: Any) -> None:
        test = self._current(msg)
        if test is None or test.fleet is None:
            return
        rows = test.fleet.on_results(int(msg.data["shard"]), msg.data["rows"], msg.data.get("seqs"))
        test.recorder.add_results(rows)
        if test.closed and rows:
            test.late = True
            log.warning(
                "kvcanary: %d result(s) arrived after the summary; it is rewritten at exit",
                len(rows),
            )

    def on_done(self, environment: Environment, msg: Any, **_: Any) -> None:
        test = self._current(msg)
        if test is None or test.closed or test.fleet is None:
            return
        failure = msg.data.get("failure")
        if failure and test.failed is None and str(failure).startswith("error budget"):
            self._fail(test, str(failure), ExitCode.TARGET_ERRORS)
        test.fleet.on_done(int(msg.data["shard"]), int(msg.data.get("adoptions") or 0))

    def _changed(self, test: Test) -> None:
        """A worker was lost or reported done: the test may start, or be over."""
        self._maybe_go(test)
        self._check_finished(test)

    def _check_finished(self, test: Test) -> None:
        """Every shard done or lost: the test is over (the shapes' tick ends it)."""
        if test.fleet is None or not test.fleet.ledger.finished() or test.finished.is_set():
            return
        test.finished.set()
        log.info("kvcanary: every shard is done (%d results)", test.recorder.received)
        if self.env.shape_class is None and not test.stopping:
            gevent.spawn(self.runner.stop)  # no shape to end the test: end it here

    # the test stops ------------------------------------------------------------------------
    def sigterm(self) -> None:
        log.warning("kvcanary: SIGTERM: stopping the test and writing its run directory")
        if self.env.process_exit_code is None:
            self.env.process_exit_code = ExitCode.SIGTERM
        self.runner.stop()  # test_stopping, then test_stop: end() writes the summary
        self.runner.quit()

    def stopping(self) -> None:
        test = self.test
        if test is None or test.closed or test.stopping:
            return
        test.stopping = True
        if not test.finished.is_set():
            self.runner.send_message(
                MSG_STOP, {"kind": "cancelled", "reason": "not sent: the test stopped"}
            )

    def end(self) -> None:
        """The test stopped: wait for the workers' last results, then write the run dir."""
        self.broken = None
        test = self.test
        if test is None or test.closed or test.ending:
            return
        test.ending = True
        self.stopping()
        if not test.finished.wait(timeout=STOP_WAIT_S):
            ledger = test.fleet.ledger if test.fleet else None
            missing = [a.shard + 1 for a in ledger.live() if not a.done] if ledger else []
            log.warning(
                "kvcanary: no final report from shard(s) %s; their missing results "
                "are recorded as unavailable",
                missing,
            )
        test.closed = True
        try:
            self._write_run_dir(test)
        finally:
            test.ended.set()

    def _write_run_dir(self, test: Test) -> None:
        try:
            stop_tap(self.bridge, test)
        finally:  # a failure to stop the tap (a bug) still leaves a complete run directory
            test.recorder.close_phase(test.now())
            if test.fleet is not None:
                test.fleet.record_unresolved()
                test.fleet.publish()
            self._account_missing(test)
            summary = test.recorder.finish()
            self._log_summary(test, summary)

    def _account_missing(self, test: Test) -> None:
        """Trace requests no worker reported (a lost worker): results too, never silence."""
        if test.cfg.loop:
            return
        seen = {r.request_id for r in read_results(test.recorder.run_dir)}
        label = test.label or test.cfg.plan.labels[0]
        at = test.now()
        holder = test.fleet.ledger.holders() if test.fleet else {}
        rows = [
            cancelled_result(
                req,
                test.cfg.spec.name,
                label,
                "unknown",
                at,
                "unavailable",
                f"no result came back from worker shard {holder.get(i, i % test.shards) + 1}",
            ).to_json()
            for i, req in enumerate(test.cfg.trace.iter_requests())
            if req.id not in seen
        ]
        if rows:
            log.warning(
                "kvcanary: %d request(s) have no result; recorded as unavailable", len(rows)
            )
            test.recorder.add_results(rows)

    def _log_summary(self, test: Test, summary: dict[str, Any]) -> None:
        t = (summary.get("targets") or {}).get(test.cfg.spec.name) or {}
        for label, phase in (t.get("phases") or {}).items():
            a = phase["all"]
            log.info(
                "kvcanary: %s: %d requests, %d ok, %d errors %s",
                label,
                a["requests"],
                a["ok"],
                a["errors"],
                a["errors_by_kind"] or "",
            )
        log.info(
            "kvcanary: run directory %s (render it: replay report %s)",
            test.recorder.run_dir,
            test.recorder.run_dir,
        )

    def quitting(self) -> None:
        test = self.test
        if test is not None:
            if not test.closed and not test.ending:
                self.end()
            elif not test.ended.is_set():
                # An end() in another greenlet (the test stopped just before Locust quits) is
                # still writing the run directory: closing it now would lose the summary.
                test.ended.wait(timeout=STOP_WAIT_S + 60)
            elif test.late:
                test.recorder.finish()  # results that arrived after the summary count too
            test.recorder.close()
        self._set_exit_code()

    def _set_exit_code(self) -> None:
        """Locust's exit code counts every failure; kvcanary's counts serving failures (and
        leaves checker failures, which are the answers' quality, to the report)."""
        env = self.env
        if env.process_exit_code is not None or env.runner is None:
            return
        if env.runner.exceptions:
            return
        serving = [e for e in env.runner.stats.errors.values() if e.method != "CHECK"]
        if not serving and env.runner.stats.errors:
            env.process_exit_code = ExitCode.OK
