"""Where a run is written: a new run directory (checked before the trace is read), or the run
``--resume`` continues: its manifest's ``RunSpec``, as the options that build it again, and
only what may be given beside them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replay.cli.common import console, shown
from replay.cli.run_options import RunOptions
from replay.cli.run_spec import options_of
from replay.core.credentials import REDACTED, redact
from replay.core.errors import InputError
from replay.rundir.files import MANIFEST, check_run_location, file_digest, new_run_dir
from replay.rundir.manifest import read_manifest


def run_options_of(
    opts: Mapping[str, Any], given: Mapping[str, str]
) -> tuple[RunOptions, Resuming | None]:
    """This run's options: the command line's (their run directory checked before the trace is
    read), or with ``--resume`` the run's own, with what may be given beside it."""
    if opts.get("resume_dir") is None:
        o = RunOptions.from_click(opts)
        check_run_location(o.out_dir, o.run_id)
        return o, None
    o, resuming = resume_options(opts["resume_dir"])
    return reconcile_resume(o, resuming, given, opts), resuming


@dataclass(frozen=True)
class Resuming:
    """The run being continued, and the digest its trace must still have."""

    run_dir: Path
    trace_sha256: str


# Beside --resume, what may be given: where the run's trace is now, where the Markdown goes.
RESUME_MAY_GIVE = frozenset({"resume_dir", "trace_path", "markdown_path"})


def reconcile_resume(
    o: RunOptions, resuming: Resuming, given: Mapping[str, str], opts: Mapping[str, Any]
) -> RunOptions:
    """``--resume`` continues a run with the options it started with (its manifest). Beside it,
    ``--trace`` may say where that trace is now (the same file: its sha256 is checked) and
    ``--markdown`` where the summary goes; any other option would change the run half-way and
    is refused, as is another trace."""
    where = f"--resume {resuming.run_dir}"
    others = [flag for name, flag in given.items() if name not in RESUME_MAY_GIVE | {"targets"}]
    if others:
        raise InputError(
            f"{where}: a run continues with the options it started with (its manifest.json); "
            f"leave out {', '.join(others)}, or start a new run"
        )
    o = _targets_again(o, where, opts.get("targets") if "targets" in given else None)
    if "trace_path" in given and opts.get("trace_path") is not None:
        moved = Path(opts["trace_path"])
        if not moved.is_file():
            raise InputError(f"{where}: --trace {moved}: no such file")
        if file_digest(moved) != resuming.trace_sha256:
            raise InputError(
                f"{where}: --trace {moved} is not the trace this run replays ({o.trace_path}: "
                f"its sha256 differs); a run resumes on its own trace only: replay {moved} "
                "in a new run"
            )
        if moved.resolve() != o.trace_path.resolve():
            console.print(f"--resume: the run's trace, read from {shown(str(moved))} (same sha256)")
        o = o.replace(trace_path=moved)
    if "markdown_path" in given:
        o = o.replace(markdown_path=opts.get("markdown_path"))
    return o


def _targets_again(o: RunOptions, where: str, typed: str | None) -> RunOptions:
    """The run's ``--targets`` were saved redacted: the credentials a URL held (user-info,
    query values) are not on disk. ``--targets`` given again supplies them, and must be the
    run's own targets (it redacts to what was saved)."""
    if typed is None:
        if REDACTED in o.targets:
            raise InputError(
                f"{where}: the run's --targets held credentials, which are never saved "
                f"({o.targets}); give --targets again as first typed"
            )
        return o
    if redact(typed) != o.targets:
        raise InputError(
            f"{where}: --targets beside --resume only gives back the credentials of the "
            f"run's own targets ({o.targets}); leave it out, or start a new run"
        )
    return o.replace(targets=typed)


def resume_options(run_dir: Path) -> tuple[RunOptions, Resuming]:
    """The options the interrupted run was started with: its manifest's ``run_spec`` (a run
    written before the spec was complete: the options it saved then)."""
    where = f"--resume {run_dir}: {MANIFEST}"
    try:
        manifest = read_manifest(run_dir)
    except (OSError, ValueError):
        manifest = None
    spec = manifest.run_spec if manifest is not None else None
    if manifest is None or not manifest.trace.sha256:
        raise InputError(
            f"--resume {run_dir}: no readable manifest.json with the run's "
            "options; is this a kvcanary run directory?"
        )
    resuming = Resuming(run_dir, manifest.trace.sha256)
    if spec is not None and spec.targets is not None:
        return options_of(spec, spec.targets), resuming
    if manifest.cli_options is None:
        raise InputError(f"{where}: no run_spec (nor the options of an older version)")
    return RunOptions.from_saved(dict(manifest.cli_options), where), resuming


def run_directory(o: RunOptions, resuming: Resuming | None) -> Path:
    if resuming is None:
        return new_run_dir(o.out_dir, o.run_id)
    if file_digest(o.trace_path) != resuming.trace_sha256:
        raise InputError(
            f"--resume: {o.trace_path} changed since the run started (its "
            "sha256 differs); resuming would mix two traces"
        )
    return resuming.run_dir
