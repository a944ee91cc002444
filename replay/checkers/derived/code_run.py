"""Running a ``code_plan`` in the sandbox: the reference's code on the label's calls (outcomes
reported on stdout after a marker, cached across targets), then the answer's code compared with
those outcomes inside its own sandbox, pass or fail coming back on the nonce channel."""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

from replay.checkers.base import Grade, checker_error
from replay.checkers.derived.rules import CODE, CODE_TEXT, _detail
from replay.checkers.sandbox.limits import SandboxLimits
from replay.checkers.sandbox.run import run_python

CALL_TIME_S = 0.5
CODE_LIMITS = SandboxLimits(wall_s=15.0, cpu_s=10, memory_mb=512)
_OUTCOME_CHARS = 1000  # longer canonical values are compared by their SHA-256
_CACHE_MAX = 1024


# The calls run as the sandbox's tests, in the trusted test process: ``from solution import *``
# gives proxies that call the solution in its own process with literal values (see
# sandbox/run.py). Each call is under an alarm, its value made canonical (so 3 and 3.0 agree as
# they do in Python, and dict order does not matter).
_RUNNER = r"""
import hashlib as _kvc_hashlib
import json as _kvc_json
import os as _kvc_os
import signal as _kvc_signal
import sys as _kvc_sys

import solution as _kvc_solution


class _KvcTimeout(BaseException):
    pass


def _kvc_alarm(signum, frame):
    raise _KvcTimeout()


def _kvc_canon(value, depth):
    if depth > 100:
        raise ValueError("nested too deeply")
    if value is None or isinstance(value, (bool, str, bytes, complex)):
        return repr(value)
    if isinstance(value, int):
        try:
            return str(value)
        except ValueError:
            return "int:" + format(value, "x")
    if isinstance(value, float):
        if value != value:
            return "nan"
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return format(value, ".12g")
    if isinstance(value, list):
        return "[" + ", ".join(_kvc_canon(v, depth + 1) for v in value) + "]"
    if isinstance(value, tuple):
        return "(" + ", ".join(_kvc_canon(v, depth + 1) for v in value) + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(sorted(_kvc_canon(k, depth + 1) + ": " + _kvc_canon(v, depth + 1)
                                      for k, v in value.items())) + "}"
    if isinstance(value, (set, frozenset)):
        return "set{" + ", ".join(sorted(_kvc_canon(v, depth + 1) for v in value)) + "}"
    text = repr(value)
    if " at 0x" in text:
        return "<" + type(value).__name__ + ">"
    return type(value).__name__ + ":" + text


def _kvc_outcome(name, src):
    fn = getattr(_kvc_solution, name, None)
    if fn is None and name in _KVC_ALIASES:
        fn = getattr(_kvc_solution, _KVC_ALIASES[name], None)
    if not callable(fn):
        return "has no function " + name
    code = compile(src, "<call>", "eval")
    _kvc_signal.signal(_kvc_signal.SIGALRM, _kvc_alarm)
    try:
        _kvc_signal.setitimer(_kvc_signal.ITIMER_REAL, _KVC_CALL_S)
        try:
            text = _kvc_canon(eval(code, {"__builtins__": __builtins__, name: fn}), 0)
        finally:
            _kvc_signal.setitimer(_kvc_signal.ITIMER_REAL, 0)
    except _KvcTimeout:
        return "times out"
    except BaseException as exc:
        return "raises " + type(exc).__name__
    if len(text) > _KVC_MAX_CHARS:
        text = "sha256:" + _kvc_hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    return "returns " + text


def _kvc_all():
    out = []
    for name, src in _KVC_CALLS:
        try:
            out.append(_kvc_outcome(name, src))
        except _KvcTimeout:  # the alarm landed between the call and its cancellation
            out.append("times out")
    return out
"""

# The reference's outcomes come back on stdout, after a marker: the last thing written there,
# so that the capture's tail keeps it whatever the code printed before.
_REPORT = r"""
_kvc_line = (_KVC_MARKER + _kvc_json.dumps(_kvc_all()) + "\n").encode()
for _kvc_stream in (_kvc_sys.stdout, _kvc_sys.stderr):
    try:
        _kvc_stream.flush()
    except Exception:
        pass
_kvc_os.write(1, _kvc_line)
try:
    _kvc_null = _kvc_os.open(_kvc_os.devnull, _kvc_os.O_WRONLY)
    _kvc_os.dup2(_kvc_null, 1)
    _kvc_os.dup2(_kvc_null, 2)
except OSError:
    pass
"""

# The answer's outcomes are compared inside its sandbox: pass or fail comes back through the
# sandbox's nonce channel, which nothing the code prints can forge.
_COMPARE = r"""
_kvc_got = _kvc_all()
_kvc_bad = [i for i, (w, g) in enumerate(zip(_KVC_EXPECTED, _kvc_got)) if w != g]
if _kvc_bad:
    _kvc_i = _kvc_bad[0]
    raise AssertionError("%d of %d call(s) differ; first %s: the reference's code %s, this "
                         "code %s" % (len(_kvc_bad), len(_KVC_CALLS), _KVC_CALLS[_kvc_i][1],
                                      _KVC_EXPECTED[_kvc_i][:100], _kvc_got[_kvc_i][:100]))
"""


def _header(calls: Sequence[tuple[str, str]], aliases: Mapping[str, str]) -> str:
    return (
        f"_KVC_CALLS = {[tuple(c) for c in calls]!r}\n_KVC_ALIASES = {dict(aliases)!r}\n"
        f"_KVC_CALL_S = {CALL_TIME_S!r}\n_KVC_MAX_CHARS = {_OUTCOME_CHARS!r}\n"
    )


def reference_outcomes(
    code: str, calls: Sequence[tuple[str, str]], limits: SandboxLimits = CODE_LIMITS
) -> list[str] | str:
    """The outcome of each call on the reference's code, or why there are none."""
    marker = f"kvc-outcomes-{secrets.token_hex(8)} "
    tests = _header(calls, {}) + f"_KVC_MARKER = {marker!r}\n" + _RUNNER + _REPORT
    res = run_python(code, tests, limits)
    if not res.passed:
        return f"did not run to its end: {res.reason}"
    for line in reversed(res.stdout.splitlines()):
        if line.startswith(marker):
            try:
                out = json.loads(line[len(marker) :])
            except ValueError:
                break
            if (
                isinstance(out, list)
                and len(out) == len(calls)
                and all(isinstance(x, str) for x in out)
            ):
                return out
            break
    return "reported no outcomes"


def run_code_plan(
    plan: Mapping[str, Any],
    limits: SandboxLimits = CODE_LIMITS,
    cache: MutableMapping[str, list[str] | str] | None = None,
) -> Grade:
    """Run a ``code_plan`` (see ``grade_label``): the reference's code once per plan (cached
    across the targets graded against it), then the answer's code against its outcomes."""
    calls = [(str(n), str(s)) for n, s in plan["calls"]]
    ref_code = str(plan["reference_code"])
    key = hashlib.sha256(json.dumps([ref_code, calls]).encode("utf-8", "surrogatepass")).hexdigest()
    expected = cache.get(key) if cache is not None else None
    if expected is None:
        expected = reference_outcomes(ref_code, calls, limits)
        if cache is not None:
            if len(cache) >= _CACHE_MAX:
                cache.clear()
            cache[key] = expected
    src = {k: int(v) for k, v in dict(plan.get("sources") or {}).items()}
    if isinstance(expected, str):
        same = bool(plan.get("code_text_equal"))
        return Grade(
            same,
            f"no behaviour to compare (the reference's code {expected}): the "
            f"normalized code {'is equal' if same else 'differs'}"[:300],
            1.0 if same else 0.0,
            _detail(CODE_TEXT),
        )
    tests = (
        _header(calls, plan.get("aliases") or {})
        + f"_KVC_EXPECTED = {expected!r}\n"
        + _RUNNER
        + _COMPARE
    )
    res = run_python(str(plan["candidate_code"]), tests, limits)
    detail = _detail(
        CODE,
        calls=[s for _, s in calls],
        reference_outcomes=[o[:100] for o in expected],
        sources=src,
        isolation=res.isolation,
        duration_s=round(res.duration_s, 3),
    )
    if res.passed:
        where = ", ".join(
            f"{n} {w}"
            for w, n in (
                ("from the prompt", src.get("prompt", 0)),
                ("from the reference's answer", src.get("reference", 0)),
                ("generated", src.get("generated", 0)),
            )
            if n
        )
        return Grade(
            True,
            f"the same outcome as the reference's code on all {len(calls)} call(s) ({where})",
            1.0,
            detail,
        )
    return Grade(False, res.reason, 0.0, detail)


def finish(
    grade: Grade,
    limits: SandboxLimits = CODE_LIMITS,
    cache: MutableMapping[str, list[str] | str] | None = None,
) -> Grade:
    """The final grade: a pending code comparison is run in the sandbox, others pass as is."""
    plan = grade.detail.get("code_plan")
    if not isinstance(plan, Mapping):
        return grade
    try:
        return run_code_plan(plan, limits, cache)
    except Exception as exc:  # the answer's grade, as for every checker
        bad = checker_error("exception", f"{type(exc).__name__}: {exc}")
        return Grade(False, bad.reason, 0.0, {**bad.detail, "rule": CODE})
