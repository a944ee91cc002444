"""Grading under bounds: an answer nobody has read can fail its own grade, never the run.

    with Grader() as grader:
        grade = grader.grade(spec, Answer(text, tool_calls))

What bounds one grade:

size
    An answer whose text and tool-call arguments together hold more than ``MAX_ANSWER_CHARS``
    characters is failed without being read ("checker error: answer too long to grade ...").
    Checkers are about linear in what they read, so the cap bounds their memory, and most of
    their time; no real answer comes near it (it is some 250,000 tokens).
time
    Every checker but ``code`` runs in a worker process. An answer it has not graded within
    ``time_s`` is failed ("checker error: timed out ...") and the worker is killed; the next
    answer gets a fresh one. Only a process boundary makes the limit hold for any checker: a
    thread cannot be stopped, and the JSON parser or jsonschema's own loops (``uniqueItems``
    compares every pair) run without ever looking at signals. (Regular expressions, a
    ``regex`` check's or a schema's ``pattern``, have their own, shorter bound.) ``code`` checks
    run in this process because the sandbox already is a separate process tree with its own
    wall timeout, killed whole when it expires.
errors
    Whatever a checker raises while grading (RecursionError on a deeply nested answer, a
    jsonschema error, a bug of ours) becomes that answer's failed grade, the exception named in
    the reason. A grade that says "checker error" is therefore a finding to read, not noise.
memory
    The worker's address space is limited (``WORKER_MEMORY_MB``); a MemoryError is an error
    like the others.

repeats
    The worker grades a request once: identical requests (the same check or derived spec and
    answer, as the arms of a run often give) share its grade. A Grader keeps the last ``kept``
    grades (``GRADES_KEPT`` unless told) by their request's digest, but not a timed-out or dead
    worker's (they describe that moment, not the answer); identical replies share one Grade.

The worker is ``grading_worker`` (its own module: it is the other end of the pipe). Each
checker-error grade has ``detail["checker_error"]``: "size", "timeout", "exception" or
"worker" (the worker died or could not start). A Grader is for one thread at a time.

Derived grades (``grade_derived``, rules in ``derived.checker``) are bounded the same way: both
answers are size-capped, the worker parses them under the time limit, and code they hold runs in
the sandbox in this process, like ``code`` checks.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from replay.checkers.base import (
    MAX_ANSWER_CHARS,
    Answer,
    Checker,
    Grade,
    answer_size,
    checker_error,
    parse_check,
)

GRADE_TIME_S = 5.0
WORKER_MEMORY_MB = 2048
_WORKER_START_S = 60.0  # a cold interpreter importing jsonschema on a loaded machine
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]
_WORKER_MAIN = "from replay.checkers.grading_worker import serve; serve()"
READY = b"ready\n"  # the worker's first line
PIPELINE_DEPTH = 64  # requests written to the worker ahead of its replies
# Grades a Grader remembers by their request: a run asks the same (check, answer) of every
# arm and, tiled or repeated, of many requests; the worker's grade is a function of the request.
GRADES_KEPT = 65_536
# A grade that says the worker timed out or died describes that moment, not the answer.
_NOT_KEPT = frozenset({"timeout", "worker"})


@dataclass(frozen=True)
class Job:
    """One answer to grade: by its check (``spec``), or, given ``reference``, against the
    reference's answer to the same request (a derived grade; ``prompt`` is the request's)."""

    answer: Answer
    spec: Mapping[str, Any] | None = None
    reference: Answer | None = None
    prompt: str = ""


def grade_safely(
    check: Checker | Mapping[str, Any], answer: Answer, max_chars: int = MAX_ANSWER_CHARS
) -> Grade:
    """Grade in this process: size-capped, and whatever the checker raises is the answer's
    failed grade. No time limit (see ``Grader`` for one)."""
    size = answer_size(answer)
    if size > max_chars:
        return checker_error(
            "size", f"answer too long to grade: {size:,} characters (the limit is {max_chars:,})"
        )
    try:
        checker = parse_check(check) if isinstance(check, Mapping) else check
        return checker.grade(answer)
    except Exception as exc:  # the answer's grade, by this module's contract (see above)
        return checker_error("exception", f"{type(exc).__name__}: {exc}")


class Grader:
    """Grades answers under the bounds above; the worker starts on first use."""

    def __init__(
        self,
        time_s: float = GRADE_TIME_S,
        max_chars: int = MAX_ANSWER_CHARS,
        kept: int = GRADES_KEPT,
    ) -> None:
        self.time_s, self.max_chars, self.kept = time_s, max_chars, kept
        self._proc: subprocess.Popen[bytes] | None = None
        self._broken: str | None = None  # why no worker can start (not retried)
        self._local: dict[str, Checker | Mapping[str, Any]] = {}
        # The reference's code outcomes, shared by every target graded against it.
        self._code_outcomes: dict[str, list[str] | str] = {}
        # The worker's grades by request digest (oldest out), and each distinct reply's.
        self._kept: OrderedDict[bytes, Grade] = OrderedDict()
        self._replies: dict[bytes, Grade] = {}
        # One request at a time on the worker's pipes: Locust's users grade from several
        # greenlets at once (under gevent this lock is cooperative), and interleaved
        # requests and replies were read as each other's.
        self._lock = threading.Lock()

    def __enter__(self) -> Grader:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def grade(self, spec: Mapping[str, Any], answer: Answer) -> Grade:
        return self.grade_many([Job(answer, spec=spec)])[0]

    def grade_derived(self, reference: Answer, answer: Answer, prompt: str = "") -> Grade:
        """``answer`` graded against the reference's answer to the same request
        (``derived.checker``); the grade's ``detail["rule"]`` names the rule (absent when none
        could be chosen)."""
        return self.grade_many([Job(answer, reference=reference, prompt=prompt)])[0]

    def grade_many(self, jobs: Sequence[Job]) -> list[Grade]:
        """Each job's grade, in order, as ``grade`` and ``grade_derived`` give them one at a
        time. The worker's share is pipelined (requests written ahead of the replies, at most
        ``PIPELINE_DEPTH`` unanswered): one exchange per answer cost more than most checks.
        A request asked or graded before (see "repeats" above) is not asked again."""
        from replay.checkers.derived.code_run import finish

        out: list[Grade | None] = [None] * len(jobs)
        remote: list[tuple[int, bytes]] = []  # (job, its request's digest)
        asked: dict[bytes, bytes] = {}  # digest -> request, each asked of the worker once
        for i, job in enumerate(jobs):
            here = self._here_or_spec(job)
            if isinstance(here, Grade):
                out[i] = here
                continue
            request = _request(here, job.answer)
            digest = hashlib.blake2b(request, digest_size=16).digest()
            kept = self._kept.get(digest)
            if kept is not None:
                self._kept.move_to_end(digest)
                out[i] = kept
            else:
                remote.append((i, digest))
                asked.setdefault(digest, request)
        if remote:
            with self._lock:
                grades = dict(zip(asked, self._exchange_many(list(asked.values())), strict=True))
            for digest, grade in grades.items():
                self._keep(digest, grade)
            for i, digest in remote:
                out[i] = grades[digest]
        done = [g for g in out if g is not None]
        assert len(done) == len(jobs)
        # A derived grade that compares code runs it here, in the sandbox.
        return [
            finish(g, cache=self._code_outcomes) if job.reference is not None else g
            for job, g in zip(jobs, done, strict=True)
        ]

    def _keep(self, digest: bytes, grade: Grade) -> None:
        if grade.detail.get("checker_error") in _NOT_KEPT:
            return
        self._kept[digest] = grade
        if len(self._kept) > self.kept:
            self._kept.popitem(last=False)

    def _here_or_spec(self, job: Job) -> Grade | Mapping[str, Any]:
        """The job's grade where it is given in this process (too long to read; a ``code``
        check, which the sandbox bounds), else the spec the worker grades it by."""
        if job.reference is not None:
            from replay.checkers.derived.checker import derived_spec

            for who, a in (("the reference's answer", job.reference), ("the answer", job.answer)):
                size = answer_size(a)
                if size > self.max_chars:
                    return checker_error(
                        "size",
                        f"{who} is too long to grade: {size:,} characters "
                        f"(the limit is {self.max_chars:,})",
                    )
            return derived_spec(job.reference, job.prompt)
        spec = job.spec or {}
        if answer_size(job.answer) > self.max_chars:
            return grade_safely(spec, job.answer, self.max_chars)
        if spec.get("type") == "code":
            return self._grade_here(spec, job.answer)
        return spec

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            assert proc.stdin is not None
            proc.stdin.close()  # the worker's read ends: it exits by itself
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()

    # -- in this process (code: the sandbox bounds it) ----------------------------------------

    def _grade_here(self, spec: Mapping[str, Any], answer: Answer) -> Grade:
        key = spec_key(spec)
        check = self._local.get(key)
        if check is None:
            try:
                check = parse_check(spec)
            except Exception:
                check = spec  # grade_safely turns the parse error into the grade
            self._local[key] = check
        return grade_safely(check, answer, self.max_chars)

    # -- in the worker --------------------------------------------------------------------------

    def _exchange_many(self, requests: Sequence[bytes]) -> list[Grade]:
        """The worker's grades of ``requests``, in order: a worker that times out or dies on
        one fails that answer, and a fresh worker grades the rest."""
        grades: list[Grade] = []
        while len(grades) < len(requests):
            try:
                proc = self._worker()
            except _WorkerError as exc:
                left = len(requests) - len(grades)
                return grades + [checker_error("worker", str(exc)) for _ in range(left)]
            grades += self._pipeline(proc, requests[len(grades) :])
        return grades

    def _pipeline(self, proc: subprocess.Popen[bytes], requests: Sequence[bytes]) -> list[Grade]:
        """Grades of a prefix of ``requests`` (at least one): all of them, or up to the one
        the worker timed out or died on, failed with the reason, the worker then killed. The
        worker grades in order, so an answer's clock starts once the worker has both its
        request and the previous reply: each answer gets ``time_s`` of its own."""
        assert proc.stdin is not None and proc.stdout is not None
        wfd, rfd = proc.stdin.fileno(), proc.stdout.fileno()
        out: list[Grade] = []
        outgoing, inbox = bytearray(), bytearray()
        ends: deque[tuple[int, int]] = deque()  # (request, stream offset where it ends)
        written_at: dict[int, float] = {}
        queued = queued_bytes = sent = 0
        last_reply = last_progress = time.monotonic()
        while len(out) < len(requests):
            while queued < len(requests) and queued - len(out) < PIPELINE_DEPTH:
                outgoing += requests[queued]
                queued_bytes += len(requests[queued])
                ends.append((queued, queued_bytes))
                queued += 1
            head = len(out)
            started = max(last_reply, written_at[head]) if head in written_at else last_progress
            left = started + self.time_s - time.monotonic()
            if left <= 0:
                self._kill()
                return [*out, checker_error("timeout", f"timed out after {self.time_s:g} s")]
            readable, writable, _ = select.select([rfd], [wfd] if outgoing else [], [], left)
            if writable:
                try:
                    n = os.write(wfd, outgoing[:65536])
                except BlockingIOError:
                    n = 0
                except (BrokenPipeError, ConnectionResetError):
                    return [*out, self._lost(proc, _death(proc))]
                del outgoing[:n]
                sent += n
                last_progress = time.monotonic()
                while ends and ends[0][1] <= sent:
                    written_at[ends.popleft()[0]] = last_progress
            if readable:
                chunk = os.read(rfd, 65536)
                if not chunk:
                    return [*out, self._lost(proc, _death(proc))]
                inbox += chunk
                last_progress = time.monotonic()
                while (nl := inbox.find(b"\n")) >= 0 and len(out) < len(requests):
                    line = bytes(inbox[:nl])
                    del inbox[: nl + 1]
                    try:
                        grade = self._reply(line)
                    except (ValueError, KeyError, TypeError) as exc:
                        why = f"unreadable reply from the grading process: {exc}"
                        return [*out, self._lost(proc, why)]
                    written_at.pop(len(out), None)
                    out.append(grade)
                    last_reply = time.monotonic()
        return out

    def _reply(self, line: bytes) -> Grade:
        """The grade a reply line says; a line said before gives the same ``Grade``."""
        grade = self._replies.get(line)
        if grade is None:
            row = json.loads(line)
            grade = Grade(
                bool(row["passed"]), str(row["reason"]), row["score"], dict(row["detail"])
            )
            if len(self._replies) >= self.kept:
                self._replies.clear()
            self._replies[line] = grade
        return grade

    def _lost(self, proc: subprocess.Popen[bytes], why: str) -> Grade:
        """The answer a worker failed on: its grade says why, and the worker goes."""
        self._kill()
        return checker_error("worker", why)

    def _worker(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        if self._broken is not None:
            raise _WorkerError(self._broken)
        self._kill()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(_PACKAGE_ROOT), env.get("PYTHONPATH", "")) if p
        )
        try:
            # Its own session: a Ctrl-C meant for the run does not kill the grader mid-answer.
            proc = subprocess.Popen(
                [sys.executable, "-B", "-c", _WORKER_MAIN],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        except OSError as exc:
            self._broken = f"cannot start the grading process: {exc}"
            raise _WorkerError(self._broken) from None
        self._proc = proc
        try:
            ready = _receive(proc, time.monotonic() + _WORKER_START_S)
        except (TimeoutError, _WorkerError) as exc:
            self._kill()
            self._broken = f"the grading process did not start: {exc or 'timed out'}"
            raise _WorkerError(self._broken) from None
        if ready + b"\n" != READY:
            self._kill()
            self._broken = f"the grading process did not start: it said {ready[:100]!r}"
            raise _WorkerError(self._broken)
        assert proc.stdin is not None
        os.set_blocking(proc.stdin.fileno(), False)  # writes obey the deadline too
        return proc

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


class _WorkerError(Exception):
    """The grading process died, could not start or answered nonsense."""


def spec_key(spec: Mapping[str, Any]) -> str:
    """A check's identity: its JSON, keys sorted."""
    return json.dumps(spec, sort_keys=True, default=str)


def _request(spec: Mapping[str, Any], answer: Answer) -> bytes:
    """One request line. ASCII JSON: lone surrogates a decoder let through survive the trip,
    and no newline can appear inside the request."""
    calls = [[c.index, c.id, c.name, c.arguments] for c in answer.tool_calls]
    return json.dumps({"check": spec, "text": answer.text, "calls": calls}).encode() + b"\n"


def _receive(proc: subprocess.Popen[bytes], deadline: float) -> bytes:
    """One line from the worker (without its newline), or TimeoutError at ``deadline``."""
    assert proc.stdout is not None
    fd, buf = proc.stdout.fileno(), bytearray()
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        readable, _, _ = select.select([fd], [], [], left)
        if not readable:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            raise _WorkerError(_death(proc))
        buf += chunk
    return bytes(buf[:-1])


def _death(proc: subprocess.Popen[bytes]) -> str:
    try:
        status = proc.wait(timeout=2)
    except subprocess.TimeoutExpired:
        return "the grading process stopped answering"
    how = f"signal {-status}" if status < 0 else f"status {status}"
    return f"the grading process died ({how}; memory limit {WORKER_MEMORY_MB} MB)"
