"""torch, transformers, safetensors and vLLM are optional: the paths that need none of them
import none of them, and a command that needs one it cannot import stops with one line naming
what to install (exit 2), not a traceback.

Each check runs in a fresh interpreter where the optional modules cannot be imported (a
``sys.meta_path`` finder that refuses them, or ``sys.modules[name] = None``), so it holds
whether or not they are installed here."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "replay" / "testmodel" / "models" / "kvcanary-tiny-llama"
TRACE = ROOT / "traces" / "sample.jsonl"
OPTIONAL = ("torch", "transformers", "safetensors", "tokenizers", "vllm")

# Refuses every optional module and records each attempt; runs each CLI call in turn, then
# prints the exit codes and the attempts as the last line of stdout.
LIGHT_PATHS = textwrap.dedent(
    """
    import json, sys

    OPTIONAL = set(sys.argv[1].split(","))
    tried = []

    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in OPTIONAL:
                tried.append(name)
                raise ModuleNotFoundError(f"No module named {name!r} (refused)", name=name)
            return None

    sys.meta_path.insert(0, Refuse())
    from kvcal.cli import main as kvcal
    from replay.cli import main as replay

    codes = []
    for line in sys.argv[2:]:
        prog, *args = json.loads(line)
        try:
            (kvcal if prog == "kvcal" else replay)(args)
        except SystemExit as exc:
            codes.append(exc.code or 0)
    print(json.dumps({"codes": codes, "tried": tried}))
    """
)


def _python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "80"}
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_help_and_trace_validation_import_no_optional_module() -> None:
    calls = [
        ["kvcal", "--help"],
        *(["kvcal", cmd, "--help"] for cmd in ("sample", "calibrate", "verify", "inspect")),
        ["kvcal", "emulate", "--help"],
        ["replay", "--help"],
        ["replay", "trace", "validate", str(TRACE)],
    ]
    proc = _python(LIGHT_PATHS, ",".join(OPTIONAL), *map(json.dumps, calls))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result == {"codes": [0] * len(calls), "tried": []}, proc.stderr


def _kvcal_without(blocked: str, *args: str) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys\n"
        f"for name in {blocked.split(',')!r}:\n"
        "    sys.modules[name] = None\n"
        "from kvcal.cli import main\n"
        "main(sys.argv[1:])\n"
    )
    return _python(code, *args)


def _one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    return lines[0]


SETUP = "(scripts/setup installs vLLM and torch built for this machine)"
MODEL_EXTRAS = ("torch", "transformers", "safetensors", "tokenizers")


def isolates(blocked: str) -> None:
    """The message names exactly the ``blocked`` modules only where the command's other
    needs are installed: in a core-only venv (``pip install .``) it would name them too."""
    if blocked == "vllm":
        return
    gone = set(blocked.split(","))
    missing = [m for m in MODEL_EXTRAS if m not in gone and importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed: the message would name them too")


@pytest.mark.parametrize(
    ("blocked", "args", "message"),
    [
        (
            "torch",
            ["calibrate", str(MODEL), "--trace", str(TRACE), "-o", "{tmp}/overlay"],
            f"kvcal calibrate needs torch: pip install torch {SETUP}",
        ),
        (
            "torch,transformers",
            ["emulate", str(MODEL), "--trace", str(TRACE)],
            f"kvcal emulate needs torch and transformers: pip install torch 'kvcanary[model]' "
            f"{SETUP}",
        ),
        (
            "transformers",
            ["sample", str(MODEL), "--trace", str(TRACE), "-o", "{tmp}/samples"],
            "kvcal sample needs transformers: pip install 'kvcanary[model]'",
        ),
        (
            "safetensors",
            ["inspect", str(MODEL)],
            "kvcal inspect needs safetensors to read *.safetensors: pip install 'kvcanary[model]'",
        ),
        (
            "vllm",
            ["verify", "{tmp}"],
            f"kvcal verify needs vllm to start its FP8 servers: pip install vllm {SETUP}, "
            "or give --url and --baseline-url",
        ),
    ],
)
def test_kvcal_names_the_missing_extra(
    blocked: str, args: list[str], message: str, tmp_path: Path
) -> None:
    isolates(blocked)
    proc = _kvcal_without(blocked, *(a.format(tmp=tmp_path) for a in args))
    assert _one_line_error(proc) == f"error: {message}"
    assert not (tmp_path / "overlay").exists() and not (tmp_path / "samples").exists()


def test_trainer_names_the_missing_extra(tmp_path: Path) -> None:
    isolates("torch")
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "from replay.testmodel.train import main\n"
        "main(sys.argv[1:])\n"
    )
    proc = _python(code, "--out", str(tmp_path / "model"))
    assert _one_line_error(proc) == (
        f"python -m replay.testmodel.train needs torch: pip install torch {SETUP}"
    )
    assert not (tmp_path / "model").exists()


def test_sample_needs_no_torch(tmp_path: Path) -> None:
    """Drawing samples renders prompts with the tokenizer alone."""
    pytest.importorskip("transformers", reason="kvcal sample needs the model extra")
    out = tmp_path / "samples"
    proc = _kvcal_without(
        "torch",
        *("sample", str(MODEL), "--trace", str(TRACE), "--buckets", "256,1K"),
        *("--per-bucket", "2", "-o", str(out)),
    )
    assert proc.returncode == 0, proc.stderr
    assert (out / "samples.jsonl").read_text().strip()


def _replay_without(blocked: str, *args: str, cache: Path, no_embedded: bool = False) -> str:
    """``replay ARGS`` with ``blocked`` unimportable and an empty model cache; with
    ``no_embedded``, as in a tree without the committed checkpoint."""
    code = (
        "import sys\n"
        f"for name in {blocked.split(',')!r}:\n"
        "    sys.modules[name] = None\n"
        "from replay.testmodel import factory\n"
        f"if {no_embedded!r}:\n"
        f"    factory.EMBEDDED_DIR = factory.Path({str(cache / 'no-embedded')!r})\n"
        "from replay.cli import main\n"
        "main(sys.argv[1:], prog_name='replay')\n"
    )
    env = {**os.environ, "KVCANARY_CACHE": str(cache)}
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT), "COLUMNS": "80"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    return _one_line_error(proc)


def test_replay_model_names_the_missing_extra(tmp_path: Path) -> None:
    """Deriving the twin and building the random model need torch; the message says so
    before anything is written."""
    isolates("torch,transformers")
    cache = tmp_path / "cache"
    assert _replay_without("torch", "model", "--twin", cache=cache) == (
        f"error: replay model --twin needs torch to derive the outlier twin: pip install torch "
        f"{SETUP}"
    )
    assert _replay_without("transformers", "model", "--twin", cache=cache) == (
        "error: replay model --twin needs transformers to derive the outlier twin: "
        "pip install 'kvcanary[model]'"
    )
    out = tmp_path / "random"
    assert _replay_without("torch,safetensors", "model", "--random", str(out), cache=cache) == (
        "error: replay model --random needs torch and safetensors to build the test model: "
        f"pip install torch 'kvcanary[model]' {SETUP}"
    )
    assert not out.exists() and not cache.exists()


def test_replay_model_without_a_committed_checkpoint_names_the_missing_extra(
    tmp_path: Path,
) -> None:
    isolates("torch")
    assert _replay_without("torch", "model", cache=tmp_path, no_embedded=True) == (
        f"error: replay model needs torch to build the test model: pip install torch {SETUP}"
    )


def test_the_run_names_the_extra_its_embedded_model_needs(tmp_path: Path) -> None:
    """The default run builds the random model when no checkpoint is committed."""
    isolates("tokenizers")
    args = ("--trace", str(TRACE), "--targets", "bf16", "--out", str(tmp_path / "runs"))
    assert _replay_without("tokenizers", *args, cache=tmp_path, no_embedded=True) == (
        "error: replay needs tokenizers to build the test model: pip install 'kvcanary[model]'"
    )


def test_replay_model_prints_the_committed_checkpoint_without_torch(tmp_path: Path) -> None:
    """The committed checkpoint is served as it is: printing its folder needs no extra."""
    if not (MODEL / "kvcanary_model.json").exists():
        pytest.skip("no committed checkpoint in this tree")
    proc = subprocess.run(
        [sys.executable, "-c", LIGHT_PATHS, ",".join(OPTIONAL), json.dumps(["replay", "model"])],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "KVCANARY_CACHE": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    *printed, last = proc.stdout.splitlines()
    assert printed == [str(MODEL)]
    assert json.loads(last) == {"codes": [0], "tried": []}


def test_replay_errors_print_brackets_as_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An error message is text, not rich markup: the extra in ``'kvcanary[data]'`` and a
    folder named ``run[1]`` reach the terminal as written."""
    from click.testing import CliRunner

    from replay.cli import main
    from replay.cli.common import guard
    from replay.core.errors import InputError

    def fails() -> int:
        raise InputError("replay export needs pyarrow: pip install 'kvcanary[data]'")

    with pytest.raises(SystemExit) as exit_:
        guard(fails)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err == "error: replay export needs pyarrow: pip install 'kvcanary[data]'\n"

    run_dir = tmp_path / "run[1]"
    run_dir.mkdir()
    out = CliRunner().invoke(main, ["report", str(run_dir)])
    assert out.exit_code == 2
    # However rich wraps it, the folder's name is all there.
    assert f"{run_dir}:nosummary.json" in "".join(out.output.split())
