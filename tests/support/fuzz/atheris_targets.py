"""Coverage-guided fuzzing (atheris, libFuzzer) of every parser that takes outside input.

    python tests/support/fuzz/atheris_targets.py TARGET [CORPUS_DIR] [libFuzzer flags, e.g.
        -max_total_time=30]

TARGET is one of ``TARGETS``. An empty CORPUS_DIR is first filled with ``SEEDS`` (valid
inputs of that format): from nothing, libFuzzer rarely gets past the JSON or CSV parser,
which is C code it cannot see into. Each harness feeds the fuzzer's bytes to one parser and lets
only that parser's documented error through (a ``TraceError`` naming the file and line, a
``ProtocolError``, a ``SpecError``, a ``ConfigError``); any other exception is a crash that
libFuzzer reports with the input that caused it. ``tests/hostile/test_atheris.py`` runs each target
for a few seconds in CI; longer runs find more.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import atheris
import orjson

# Only kvcanary's own modules are instrumented: instrumenting everything (numpy, pydantic,
# aiohttp) takes minutes at start-up, and their coverage is not what is being explored.
with atheris.instrument_imports(include=["replay"]):
    from replay.checkers import SpecError, parse_check
    from replay.core.errors import ConfigError, TraceError
    from replay.core.records import Result
    from replay.serving.accumulator import StreamAccumulator
    from replay.serving.sse import DONE, ProtocolError, SSEDecoder
    from replay.serving.targets import load_targets_config
    from replay.traces.importers import load
    from replay.traces.trace import parse_line

# Files the file-reading targets write each input to (the CI test points it at its tmp_path).
SCRATCH = Path(os.environ.get("KVCANARY_FUZZ_SCRATCH") or tempfile.mkdtemp(prefix="kvcanary-fuzz-"))


def _named(err: TraceError, path: str) -> None:
    if err.path != path or err.line < 0 or not err.field or not err.reason:
        raise AssertionError(f"an error that does not name its place: {err!r}")


def trace_line(data: bytes) -> None:
    try:
        parse_line(data, "fuzz.jsonl", 7)
    except TraceError as err:
        _named(err, "fuzz.jsonl")
        if err.line != 7:
            raise AssertionError(f"wrong line in {err}") from None


def _file(data: bytes, name: str) -> Path:
    path = SCRATCH / name
    path.write_bytes(data)
    return path


def _trace_file(fmt: str) -> Callable[[bytes], None]:
    def target(data: bytes) -> None:
        path = _file(data, f"t.{fmt}")
        try:
            loaded = load(path, fmt, on_bad_line="skip")
        except TraceError as err:  # file-level only: empty, or no CSV header
            _named(err, str(path))
            return
        for err in loaded.bad:
            _named(err, str(path))

    return target


def sse(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    decoder = SSEDecoder()
    acc = StreamAccumulator(
        Result(request_id="r", target="t", phase="p", bucket="b", scheduled=0.0, sent=0.0),
        lambda: 1.0,
    )
    try:
        while fdp.remaining_bytes():
            for ev in decoder.feed(fdp.ConsumeBytes(fdp.ConsumeIntInRange(1, 64))):
                if ev is DONE:
                    return
                acc.add(ev)
        for ev in decoder.close():
            if ev is not DONE:
                acc.add(ev)
        acc.finish()
    except ProtocolError:
        return
    orjson.dumps(acc.r.to_json())  # whatever was accepted can be written as a result


def checker(data: bytes) -> None:
    try:
        spec = orjson.loads(data)
    except orjson.JSONDecodeError:
        return
    try:
        parse_check(spec)
    except SpecError as err:
        if not err.field or not err.reason:
            raise AssertionError(f"a spec error that does not name its field: {err!r}") from None


def targets_toml(data: bytes) -> None:
    path = _file(data, "targets.toml")
    try:
        load_targets_config(path)
    except ConfigError as err:
        if not str(err).startswith(f"{path}:"):
            raise AssertionError(f"a config error that does not name the file: {err}") from None


TARGETS: dict[str, Callable[[bytes], None]] = {
    "trace_line": trace_line,
    "v1_file": _trace_file("v1"),
    "mooncake": _trace_file("mooncake"),
    "azure": _trace_file("azure"),
    "bailian": _trace_file("bailian"),
    "burstgpt": _trace_file("burstgpt"),
    "openai-log": _trace_file("openai-log"),
    "sse": sse,
    "checker": checker,
    "targets_toml": targets_toml,
}

ROOT = Path(__file__).resolve().parents[3]
_SAMPLE = (ROOT / "traces" / "sample.jsonl").read_bytes().splitlines()[:6]
_CHUNK = (
    b'data: {"choices":[{"index":0,"delta":{"content":"he","tool_calls":[{"index":0,'
    b'"id":"c1","function":{"name":"f","arguments":"{}"}}]},"token_ids":[5,6],'
    b'"finish_reason":null}],"usage":{"prompt_tokens":3,"completion_tokens":2},'
    b'"prompt_token_ids":[1,2,3]}\n\n'
)
SEEDS: dict[str, list[bytes]] = {
    "trace_line": [
        *_SAMPLE,
        b'{"id":"s","api":"completions","synth":{"input_tokens":9,'
        b'"hash_ids":[1,2]},"max_tokens":4,"t":0.5}',
        b'{"id":7,"api":"completions","prompt":[1,2,3]}',
    ],
    "v1_file": [b"\n".join(_SAMPLE[:3] + _SAMPLE[:1]) + b"\n"],
    "mooncake": [
        b'{"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [1, 2]}\n'
        b'{"timestamp": 27, "input_length": 10, "output_length": 1}\n'
    ],
    "azure": [
        b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
        b"2023-11-16 18:15:50,396,109\n"
    ],
    "bailian": [
        b'{"chat_id": 1, "parent_chat_id": -1, "timestamp": 0.5, "input_length": 40, '
        b'"output_length": 4, "type": "text", "turn": 1, "hash_ids": [1, 2, 3]}\n'
        b'{"chat_id": 2, "parent_chat_id": 1, "timestamp": 2.0, "input_length": 60, '
        b'"output_length": 3, "type": "text", "turn": 2, "hash_ids": [1, 2, 3, 4]}\n'
    ],
    "burstgpt": [
        b"Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        b"0,ChatGPT,30,5,35,Conversation log\n4,GPT-4,55,0,55,API log\n"
    ],
    "openai-log": [
        b'{"timestamp": 0, "request": {"messages": [{"role": "user", "content": "hi"}], '
        b'"max_tokens": 8, "tools": [{"type": "function", "function": {"name": "f", '
        b'"parameters": {"type": "object"}}}]}, "response": {"choices": [{"message": '
        b'{"role": "assistant", "content": "ok"}}]}}\n'
    ],
    "sse": [
        _CHUNK + b'data: {"choices":[{"index":0,"text":"x"}]}\n\ndata: [DONE]\n\n',
        b'data: {"error":{"message":"boom"}}\n\n',
    ],
    "checker": [
        orjson.dumps(orjson.loads(line)["check"]) for line in _SAMPLE if b'"check"' in line
    ],
    "targets_toml": [(ROOT / "scenarios" / "targets.example.toml").read_bytes()],
}


def _seed(argv: list[str], target: str) -> None:
    """Fill the corpus folder (the first argument that is not a flag) if it is empty."""
    corpus = next((Path(a) for a in argv[1:] if not a.startswith("-")), None)
    if corpus is not None and corpus.is_dir() and not any(corpus.iterdir()):
        for i, seed in enumerate(SEEDS[target]):
            (corpus / f"seed-{i}").write_bytes(seed)


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(TARGETS)}}} [libFuzzer flags]")
    name = sys.argv.pop(1)
    _seed(sys.argv, name)
    atheris.Setup(sys.argv, TARGETS[name])
    atheris.Fuzz()


if __name__ == "__main__":
    main()
