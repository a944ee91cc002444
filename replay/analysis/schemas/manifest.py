"""The run manifest's records (``manifest.json``), read as the summary's are (``Record``).

``replay/rundir/manifest.py`` writes the manifest (both drivers, one builder) and reads it back
as a ``Manifest`` (``read_manifest``); the analysis, the report, ``--resume`` and kvcal read
these fields, never the raw JSON. Reading is lenient as the summary's is: a key an older run
lacks reads as empty, a key a newer run adds is ignored, and a value of the wrong type is an
error naming its field (or, for the report, a problem listed and the field left empty).

The run spec (``replay/analysis/run_spec.py``) is read typed, and the settings the analysis
reads of a run come from it (or, for a run written before it, from that run's options and
flags) through ``Manifest``'s properties, never from the raw keys. What the spec (or the
roles) holds is written once, there: ``Manifest.from_json`` reads the trace's path and digest,
the buckets, the schedules and the reference from them, so those fields read the same for a
manifest written before (which repeated them at the top level) and after. What stays JSON
as written (``Mapping[str, Any]``): the options the run spec does not hold (think time,
``kvcal advise``'s figures), the CLI's own flags (which change with the CLI), what a server's
endpoints answered (``models``, ``version``, its engine config), a phase's windows, the
capacity phase's block and a driver's description.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Self

from replay.analysis.run_spec import RunSpec
from replay.analysis.thresholds import Thresholds
from replay.core.buckets import Buckets
from replay.core.errors import InputError, SummaryError
from replay.core.record_json import Record, absent_if_none, record
from replay.serving import kv_formats

MANIFEST_FILE = "manifest.json"


@record
class Tool(Record):
    name: str
    version: str


@record
class Platform(Record):
    python: str
    machine: str
    cpu_flags: Mapping[str, bool]


@record
class TraceFacts(Record):
    """Which trace ran: its digest ties a resume or a re-analysis to the same file. A manifest
    with a run spec writes only what reading the file found (``lines``, ``bad_lines``,
    ``skipped_rows``); the rest reads from ``run_spec.trace``."""

    path: str | None
    format: str | None
    sha256: str | None
    lines: int | None  # the non-blank lines read, bad and skipped rows included
    requests: int | None
    bad_lines: int | None  # bad lines left out (listed in bad_lines.jsonl)
    skipped_rows: Mapping[str, int]  # rows the trace marks as not to replay, by kind
    length_policy: Mapping[str, Any]


@record
class BucketFacts(Record):
    bounds: str
    labels: tuple[str, ...]


@record
class SpecFacts(Record):
    """A target's spec as given (``TargetSpec.describe()``): no secret, the key's variable
    name only."""

    name: str
    url: str | None
    api_key_env: str | None
    model: str | None
    kv_cache_dtype: str | None
    args: tuple[str, ...]
    env: Mapping[str, str]
    expect_cache_dtype: str | None
    role: str | None
    rounding: str | None

    @property
    def meant_format(self) -> str | None:
        """The KV format the spec asks for (what it expects served, else what it serves)."""
        return self.expect_cache_dtype or self.kv_cache_dtype

    @property
    def emulated(self) -> bool:
        return any(
            d is not None and kv_formats.emulated_format(d) is not None
            for d in (self.kv_cache_dtype, self.expect_cache_dtype)
        )


@record
class TargetEntry(Record):
    """One target: its spec, how it ended, what introspection and its server's log found,
    and its phases' windows on the run's clock."""

    spec: SpecFacts
    status: str
    reason: str | None
    url: str | None
    model_id: str | None
    model_root: str | None
    max_model_len: int | None
    engine_version: str | None
    cache_config: Mapping[str, Any]
    engine_config: Mapping[str, Any] | None
    scale_log_lines: tuple[str, ...]
    log: str | None
    server: Mapping[str, Any]  # a local server: pid, url, command line
    problems: tuple[str, ...]
    unreachable: bool | None = absent_if_none()
    models: Mapping[str, Any] | None = absent_if_none()  # /v1/models as it answered
    version: Mapping[str, Any] | None = absent_if_none()  # /version as it answered
    tokens_counted: int | None = absent_if_none()
    scrape_failures: int | None = absent_if_none()
    error_budget: Mapping[str, Any] | None = absent_if_none()
    sweep_stopped: Mapping[str, Any] | None = absent_if_none()
    # When its teacher-forced scores were asked for: ``spans``, ``[start, end, rows]`` on the
    # run's clock (an interleaved run's between its blocks, then the rest after the phases).
    teacher_forced: Mapping[str, Any] | None = absent_if_none()
    phases: Mapping[str, Mapping[str, Any]]


@record
class RolesFacts(Record):
    reference: str | None
    candidate: str | None
    calibrated: str | None
    layers: str | None


@record
class Manifest(Record):
    """What ran, on what machine, with which trace, buckets, schedules and options, and what
    happened to each target, in the same shape whichever driver made it."""

    tool: Tool
    driver: Mapping[str, Any] | None = absent_if_none()
    command: tuple[str, ...]
    started_at: float | None
    platform: Platform
    # What reading the trace found; its path, format, digest, requests and length policy
    # are read from the run spec (written here by a run before the spec held them).
    trace: TraceFacts
    # Read from the run spec's buckets (written here by a run before the spec held them).
    buckets: BucketFacts
    # Read from the run spec's load (written here by a run before the spec held them).
    schedules: tuple[str, ...]
    # What the run spec does not hold: sessions' think time, ``kvcal advise``'s figures (an
    # older run's options also held what its run spec now does).
    options: Mapping[str, Any]
    # Read from the roles (written here by a run before the roles held it).
    reference: str
    # The run as both drivers describe it; None for a run written before manifests held it
    # (what the analysis reads of it is below, with that run's own keys as the fallback).
    run_spec: RunSpec | None = absent_if_none()
    roles: RolesFacts | None = absent_if_none()
    cli_options: Mapping[str, Any] | None = absent_if_none()  # the CLI's flags, as given
    interrupted: bool
    resumed: Mapping[str, Any] | None = absent_if_none()
    capacity: Mapping[str, Any] | None = absent_if_none()
    results_not_stored: int | None = absent_if_none()
    targets: Mapping[str, TargetEntry]

    @classmethod
    def from_json(
        cls, data: object, *, where: str = "summary", problems: list[str] | None = None
    ) -> Self:
        """The manifest of ``data``, with what a manifest leaves to its run spec and roles
        (each written once) read from them: ``trace``'s path, format, digest, requests and
        length policy, ``buckets``, ``schedules`` and ``reference`` read as an older
        manifest, which wrote them here, reads."""
        # Named: ``@record`` makes a new (slotted) class, which super() without arguments
        # does not know before Python 3.14.
        read = super(Manifest, cls).from_json  # noqa: UP008
        return read(data, where=where, problems=problems)._completed(where, problems)

    def _completed(self, where: str, problems: list[str] | None) -> Self:
        """Each field a manifest with a run spec leaves out, filled from the spec (or the
        roles); a key an older manifest wrote is read as written."""
        spec = self.run_spec
        if spec is None:
            return self
        t, trace = spec.trace, self.trace
        if trace.path is None:
            policy = {
                "scale": t.length_scale,  # as LengthPolicy.as_dict() wrote it
                "max_input_tokens": t.max_input_tokens,
                "max_output_tokens": t.max_output_tokens,
            }
            trace = dataclasses.replace(
                trace,
                path=t.path,
                format=trace.format or t.format,
                sha256=trace.sha256 or t.sha256,
                requests=t.requests if trace.requests is None else trace.requests,
                length_policy=trace.length_policy or policy,
            )
        buckets = self.buckets
        if not buckets.bounds:
            bounds = spec.quality.buckets
            try:
                labels = tuple(Buckets.parse(bounds).labels)
            except InputError as exc:
                message = f"{where}: run_spec.quality.buckets: {exc}"
                if problems is None:
                    raise SummaryError(message) from None
                problems.append(message)
                labels = ()
            buckets = BucketFacts(bounds=bounds, labels=labels)
        roles = self.roles
        return dataclasses.replace(
            self,
            trace=trace,
            buckets=buckets,
            schedules=self.schedules or spec.load.schedules,
            reference=self.reference or (roles.reference if roles else None) or "",
        )

    # How the run was asked to run, as the analysis reads it: from the run spec, or from the
    # ``options`` and flags a run written before the run spec recorded.
    @property
    def seed(self) -> int:
        return self.run_spec.load.seed if self.run_spec else int(self.options.get("seed", 0))

    @property
    def target_order(self) -> tuple[str, ...]:
        """The targets in the order they were given (the ``targets`` entries are sorted)."""
        if self.run_spec:
            return self.run_spec.load.targets
        given = str((self.cli_options or {}).get("targets") or "")
        return tuple(p.split("=", 1)[0].strip() for p in given.split(",") if p.strip())

    @property
    def interleaved(self) -> bool:
        """Arms sent in blocks in a rotating order (``--interleave``)."""
        if self.run_spec:
            return self.run_spec.load.interleave
        return bool(self.options.get("interleave"))

    @property
    def quality_phase(self) -> str | None:
        """The one phase the quality side reads (``--quality-pass serial``), if any."""
        if self.run_spec:
            return self.run_spec.quality.quality_phase
        only = self.options.get("quality_phase")
        return only if isinstance(only, str) else None

    @property
    def slo(self) -> str | None:
        """The SLOs the run was started with (``--slo``, Locust's ``--kvc-slo``), as text."""
        if self.run_spec:
            return self.run_spec.quality.slo
        text = (self.cli_options or {}).get("slo") or self.options.get("slo")
        return str(text) if text else None

    def thresholds(self) -> Thresholds:
        """The verdict's thresholds the run was started with."""
        if self.run_spec:
            return self.run_spec.thresholds
        cli = self.cli_options or {}
        default = Thresholds()
        return Thresholds(
            tolerance=float(cli.get("tolerance", default.tolerance)),
            alpha=float(cli.get("alpha", default.alpha)),
            min_pairs=int(cli.get("min_pairs", default.min_pairs)),
            required_capacity_ratio=float(
                cli.get("required_capacity_ratio", default.required_capacity_ratio)
            ),
            max_error_rate=float(cli.get("max_error_rate", default.max_error_rate)),
            accept_emulated=bool(cli.get("accept_emulated", default.accept_emulated)),
            systems_threshold=float(cli.get("systems_threshold", default.systems_threshold)),
        )

    def target(self, name: str | None) -> TargetEntry | None:
        return self.targets.get(name) if name is not None else None

    def spec(self, name: str | None) -> SpecFacts | None:
        entry = self.target(name)
        return entry.spec if entry is not None else None

    def emulated(self, name: str | None) -> bool:
        spec = self.spec(name)
        return spec is not None and spec.emulated
