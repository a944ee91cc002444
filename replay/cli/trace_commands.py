"""``replay trace``: validate, import, anonymize and scan trace files."""

from __future__ import annotations

import contextlib
from pathlib import Path

import click

from replay.cli.common import guard, writing
from replay.core.errors import InputError, TraceError
from replay.core.exit_codes import ExitCode
from replay.traces.importers import FORMAT_HELP, LengthPolicy, skipped_note, stream
from replay.traces.trace import CheckStats


@click.group()
def trace() -> None:
    """Validate and import traces."""


@trace.command("validate")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--format", "fmt", default="auto", show_default=True, help=FORMAT_HELP)
def trace_validate(path: Path, fmt: str) -> None:
    """Check every line of a trace; list each bad one with its field and reason."""

    def run() -> int:
        bad: list[int] = [0]  # streamed: each bad line is printed as it is found
        stats = CheckStats()

        def report(_k: int, err: TraceError) -> None:
            bad[0] += 1
            click.echo(str(err))

        valid = sum(1 for _ in stream(path, fmt, on_bad_line="skip", bad=report, stats=stats))
        note = f", {skipped_note(stats.skipped)}" if stats.skipped else ""
        click.echo(f"{path}: {valid} valid request(s), {bad[0]} bad line(s){note}")
        return ExitCode.INPUT if bad[0] else ExitCode.OK

    guard(run)


@trace.command("import")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--format", "fmt", default="auto", show_default=True, help=FORMAT_HELP)
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True)
@click.option("--length-scale", default=1.0, show_default=True)
@click.option("--max-input-tokens", type=int)
@click.option("--max-output-tokens", type=int)
@click.option("--on-bad-line", type=click.Choice(["fail", "skip"]), default="fail")
def trace_import(
    path: Path,
    fmt: str,
    output: Path,
    length_scale: float,
    max_input_tokens: int | None,
    max_output_tokens: int | None,
    on_bad_line: str,
) -> None:
    """Convert a production trace (any --format) into kvcanary's v1 format."""

    def run() -> int:
        policy = LengthPolicy(length_scale, max_input_tokens, max_output_tokens)
        stats, bad = CheckStats(), [0]
        # Streamed into a temporary file beside the output, renamed when the whole trace
        # checked: a bad line in "fail" mode leaves no half-written output behind.
        tmp = output.with_name(output.name + ".part")
        try:
            with writing("-o", output, tmp), tmp.open("w", encoding="utf-8") as fh:
                for req in stream(
                    path,
                    fmt,
                    policy,
                    on_bad_line,  # type: ignore[arg-type]
                    lambda _k, _e: bad.__setitem__(0, bad[0] + 1),
                    stats,
                ):
                    fh.write(req.model_dump_json(exclude_none=True) + "\n")
            with writing("-o", output, tmp):
                tmp.replace(output)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
        note = f"; {skipped_note(stats.skipped)}" if stats.skipped else ""
        click.echo(
            f"wrote {stats.requests} request(s) to {output}; {bad[0]} bad line(s) skipped{note}"
        )
        return ExitCode.OK

    guard(run)


def _secret(secret_env: str | None, secret_file: Path | None) -> bytes:
    """The pseudonym key: from an environment variable or a file, never a command argument
    (which would land in shell history and process lists)."""
    import os

    if (secret_env is None) == (secret_file is None):
        raise InputError("give exactly one of --secret-env VAR and --secret-file PATH")
    if secret_env is not None:
        value = os.environ.get(secret_env)
        if not value:
            raise InputError(f"--secret-env: environment variable {secret_env} is not set")
        return value.encode()
    assert secret_file is not None
    try:
        data = secret_file.read_bytes().strip()
    except OSError as exc:
        raise InputError(f"--secret-file: cannot read {secret_file}: {exc}") from None
    if not data:
        raise InputError(f"--secret-file: {secret_file} is empty")
    return data


@trace.command("anonymize")
@click.argument("path", type=click.Path(path_type=Path, dir_okay=False, exists=True))
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True)
@click.option("--secret-env", help="Environment variable holding the pseudonym key.")
@click.option(
    "--secret-file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="File holding the pseudonym key.",
)
def trace_anonymize(
    path: Path, output: Path, secret_env: str | None, secret_file: Path | None
) -> None:
    """Scrub PII and secrets (emails, also full-width, look-alike or internationalised ones;
    phones, also 00-prefixed; IPs; cards; IBANs; keys, JWTs, PEM blocks, AWS secret keys and
    other random tokens; credentials in URLs, query strings and password=/token: text; emails,
    cards and keys also split across a line, and fragments of them where a field was cut) from
    a v1 trace, in messages, tool arguments and checks alike, with consistent pseudonyms keyed
    by a secret; then re-scan the output. A key a JSON object repeats keeps its last value."""

    def run() -> int:
        from replay.tools.anonymize import anonymize_file, scan_file

        secret = _secret(secret_env, secret_file)
        with writing("-o", output, output.with_name(f".{output.name}.partial")):
            counts = anonymize_file(path, output, secret)
        found = {k: n for k, n in counts.items() if n}
        click.echo(f"wrote {output}: replaced {sum(found.values())} item(s) {found or ''}")
        lines, left = scan_file(output)
        if left:
            for lineno, f in left[:20]:
                click.echo(f"{output}:{lineno}: {f.kind} in {f.field}: {f.excerpt}")
            return ExitCode.FINDINGS
        click.echo(f"scan of {output}: {lines} line(s), nothing left")
        return ExitCode.OK

    guard(run)


@trace.command("scan")
@click.argument("path", type=click.Path(path_type=Path, dir_okay=False, exists=True))
def trace_scan(path: Path) -> None:
    """Report PII, secrets and repeated JSON keys left in a trace; exit 1 when anything is found.
    Every value of a line is read, those a repeated key hides too (a reader may take either)."""

    def run() -> int:
        from replay.tools.anonymize import scan_file

        lines, found = scan_file(path)
        for lineno, f in found:
            click.echo(f"{path}:{lineno}: {f.kind} in {f.field}: {f.excerpt}")
        click.echo(f"{path}: {lines} line(s) scanned, {len(found)} finding(s)")
        return ExitCode.FINDINGS if found else ExitCode.OK

    guard(run)
